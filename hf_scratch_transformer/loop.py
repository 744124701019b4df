"""The training loop: Accelerate, Adam with the warm-up schedule, label-smoothed loss, batches per epoch (or per
round of a streamed corpus), periodic logging, validation and checkpoints, a non-finite loss check without per-step
synchronisation, and SIGINT/SIGTERM handling (a checkpoint, then `RunInterrupted`)."""

import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from .checkpointing import RunState, list_checkpoints, load_checkpoint, resume_settings, save_checkpoint
from .data import make_batch_sampler, padding_fraction, sequence_lengths
from .distributed import check_shared_output_dir, quiet_other_processes, start_process_group, watch_processes
from .errors import RunInterrupted, TrainingFault, UsageError
from .evaluation import log_row
from .export import push_during_training, staging_folder

logger = logging.getLogger("hf_scratch_transformer")
STREAM_SHUFFLE_BUFFER = 10_000  # examples in the shuffle buffer of a --streaming training split
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


# ------------------------------------------------------------------------------------------------------ launching


def launched_world_size() -> int:
    """How many processes the launcher started; refuses launches that would not give them (or FSDP on CPU).

    accelerate 1.15 starts several processes through torchrun (`--multi_gpu`, or `distributed_type: MULTI_GPU`),
    which also works without GPUs (gloo). `--cpu --num_processes N` and `distributed_type: MULTI_CPU` go to its
    "simple" launcher instead, which starts ONE process and expects mpirun to start the others.
    """
    world_size = next((int(os.environ[name]) for name in WORLD_SIZE_VARIABLES if os.environ.get(name)), 1)
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        raise UsageError(
            "FSDP is not supported by train.py: validation, test decoding and saving run on the main process and "
            "need the whole model, which FSDP shards; use DDP instead (configs/accelerate/multi_gpu.yaml on GPUs, "
            "configs/accelerate/cpu_2proc.yaml on CPUs)")
    cpu_launch = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    if world_size == 1 and cpu_launch and os.environ.get("MASTER_PORT") and "LOCAL_RANK" not in os.environ:
        raise UsageError(
            "`accelerate launch --cpu --num_processes N` (and distributed_type: MULTI_CPU) starts only one process "
            "in accelerate 1.15 unless mpirun starts the others: use `accelerate launch --multi_gpu --num_processes "
            "N --num_machines 1 train.py ...` (gloo on CPUs) or --config_file configs/accelerate/cpu_2proc.yaml")
    return world_size


def trackers(args) -> list[str]:
    """The Accelerate trackers of --report_to ("none": no tracker)."""
    return [name.strip() for name in args.report_to.split(",") if name.strip() not in ("", "none")]


def start_accelerator(args, output_dir: Path) -> Accelerator:
    """Accelerate for the launched processes (refused if it does not join them all; collectives wait at most
    --ddp_timeout seconds, and a heartbeat lets a failed one name the lost process); on a CPU, every core used."""
    world_size = launched_world_size()
    # torchrun-style launch on a machine without GPUs: one CPU process per rank over gloo (MULTI_CPU).
    cpu = world_size > 1 and not torch.cuda.is_available()
    if world_size > 1:
        start_process_group(cpu, args.ddp_timeout)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision="bf16" if args.bf16 else "fp16" if args.fp16 else "no",
        log_with=trackers(args) or None,
        project_dir=str(output_dir),
        cpu=cpu,
    )
    if accelerator.num_processes != world_size:
        raise UsageError(
            f"{world_size} processes were launched but Accelerate joined {accelerator.num_processes} of "
            f"them: they would race in one --output_dir; launch with `accelerate launch --multi_gpu "
            f"--num_processes {world_size} --num_machines 1` (see README, Several processes)")
    quiet_other_processes(accelerator)
    check_shared_output_dir(accelerator, output_dir, staging_folder)
    watch_processes(accelerator)
    if accelerator.device.type == "cpu":
        # `accelerate launch` without --cpu sets OMP_NUM_THREADS=1, which would leave all but one core idle.
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
        torch.set_num_threads(args.cpu_threads or max(1, len(os.sched_getaffinity(0)) // local_processes))
    return accelerator


# -------------------------------------------------------------------------------------------------------- batches


class TrainBatches:
    """The training batches of this process: token-bucketed or sentence batches of the in-memory split (a sampler
    sharded over the processes), or batches formed while reading a streamed split."""

    def __init__(self, dataset, collator, data_args, args, accelerator: Accelerator):
        self.dataset, self.collator, self.data_args, self.args = dataset, collator, data_args, args
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        self.sampler = None if data_args.streaming else make_batch_sampler(
            dataset, data_args, args.per_device_train_batch_size, shuffle=True, seed=args.seed,
            num_replicas=self.world, rank=self.rank,
        )
        self.per_epoch = 0 if self.sampler is None else len(self.sampler)  # unknown when streamed

    def total_steps(self) -> int:
        """Optimiser steps of the run: --max_steps, or --num_train_epochs of batches (not when streamed)."""
        if self.sampler is None or self.args.max_steps > 0:
            return self.args.max_steps
        steps_per_epoch = math.ceil(self.per_epoch / self.args.gradient_accumulation_steps)
        return math.ceil(self.args.num_train_epochs * steps_per_epoch)

    def padding_fraction(self) -> float | None:
        """Padding in the batches of one epoch (None when streamed)."""
        if self.sampler is None:
            return None
        return round(padding_fraction(list(self.sampler), *sequence_lengths(self.dataset)), 4)

    def epoch(self, epoch: int, done: int):
        """(example indices, collated batch) of this process for the rest of epoch `epoch`, after the `done`
        batches it already trained on; indices are positions in the (shuffled) stream with --streaming."""
        if self.sampler is None:
            yield from self._stream(epoch, done)
            return
        self.sampler.set_epoch(epoch)
        batches = list(self.sampler)[done:]
        # A private generator: creating the loader must not draw from the global RNG (exact resumption).
        loader = DataLoader(self.dataset, batch_sampler=batches, collate_fn=self.collator,
                            num_workers=self.args.dataloader_num_workers, generator=torch.Generator())
        yield from zip(batches, loader)

    def _stream(self, epoch: int, done: int):
        """Batches read from the streamed training split: every process reads the same seeded, shuffled stream and
        forms the same batches (a token budget or a sentence count, in stream order); batch k goes to process
        k % world_size. Only whole rounds (one batch per process) are trained, so every process takes the same
        number of steps. Resuming re-reads the stream and skips the rounds already trained (`done` of them)."""
        dataset = self.dataset.shuffle(seed=self.args.seed, buffer_size=STREAM_SHUFFLE_BUFFER)
        dataset.set_epoch(epoch)
        rounds = 0
        for round_ in self._stream_rounds(dataset):
            rounds += 1
            if rounds > done:
                positions, batch = round_[self.rank]
                yield positions, self.collator(batch)

    def _stream_rounds(self, dataset):
        """Rounds of `world` batches ([(positions, features)] each), in stream order; a last partial round is
        dropped."""
        budget, round_, batch, positions, longest = self.data_args.max_tokens, [], [], [], 0
        for position, example in enumerate(dataset):
            features = {key: example[key] for key in ("input_ids", "attention_mask", "labels")}
            length = max(len(features["input_ids"]), len(features["labels"]))
            full = ((len(batch) + 1) * max(longest, length) > budget) if budget else \
                len(batch) >= self.args.per_device_train_batch_size
            if batch and full:
                round_.append((positions, batch))
                batch, positions, longest = [], [], 0
                if len(round_) == self.world:
                    yield round_
                    round_ = []
            batch.append(features)
            positions.append(position)
            longest = max(longest, length)
        if batch:
            round_.append((positions, batch))
            if len(round_) == self.world:
                yield round_


# ----------------------------------------------------------------------------------------------------- the loop


def make_optimizer(model, args, device: torch.device) -> torch.optim.Optimizer:
    """Adam (AdamW with --weight_decay) with the paper's betas and epsilon by default."""
    optimizer_class = torch.optim.AdamW if args.weight_decay > 0 else torch.optim.Adam
    # fused: one kernel for every parameter's update (on CPU too), instead of a loop of small ones.
    return optimizer_class(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                           betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                           fused=device.type in ("cpu", "cuda"))


@dataclass
class _Window:
    """What was trained since the last log line; `start` moves on by the time spent validating or saving."""

    loss: float | torch.Tensor = 0.0
    batches: int = 0
    tokens: int = 0
    start: float = field(default_factory=time.time)


class TrainingLoop:
    """Trains one model: optimiser, schedule, batches, the loop, checkpoints (and hub pushes during training),
    periodic validation through `evaluator`. `state` is where the run is (restored by `resume`)."""

    def __init__(self, accelerator: Accelerator, model, tokenizer, train_dataset, collator, evaluator,
                 data_args, args, output_dir: Path):
        self.accelerator, self.model, self.tokenizer, self.evaluator = accelerator, model, tokenizer, evaluator
        self.data_args, self.args, self.output_dir = data_args, args, output_dir
        self.is_main = accelerator.is_main_process
        self.state = RunState()
        self.settings = resume_settings(args, data_args)
        self.last_checkpoint: Path | None = None
        self.stop_signal: int | None = None
        self.progress = None
        optimizer = make_optimizer(model, args, accelerator.device)
        self.train_model = torch.compile(model) if args.torch_compile else model
        self.train_model, self.optimizer = accelerator.prepare(self.train_model, optimizer)
        self.batches = TrainBatches(train_dataset, collator, data_args, args, accelerator)
        self.total_steps = self.batches.total_steps()
        # Stepped by hand once per optimiser step: Accelerate's wrapper would step it once per process.
        self.scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                                       num_training_steps=self.total_steps)
        # A non-finite loss is recorded on the device and looked at only before logging, validating or saving:
        # a per-step `.item()` would make the host wait for the GPU at every step.
        self._first_bad = torch.full((2,), -1.0, device=accelerator.device)  # (step, loss) of the first non-finite
        self._window = _Window()

    def resume(self, checkpoint: Path) -> None:
        """Model, optimiser, schedule, RNG states and position in the data from `checkpoint`."""
        self.state = load_checkpoint(self.accelerator, self.scheduler, checkpoint, self.settings)
        self.last_checkpoint = checkpoint

    def train(self) -> None:
        """Train until the last step (a checkpoint is saved there); SIGINT/SIGTERM save one and stop."""
        previous_handlers = self._install_signal_handlers()
        try:
            self._train_loop()
        finally:
            if self.progress is not None:  # on a fault too: the message is then the last line
                self.progress.close()
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)

    def _train_loop(self) -> None:
        state = self.state
        self.progress = tqdm(total=self.total_steps, initial=state.global_step, desc="training", unit="step",
                             disable=not self.is_main, dynamic_ncols=True)
        self._window = _Window()
        self.train_model.train()
        while state.global_step < self.total_steps:
            if self._train_pass():
                state.epoch += 1
                state.batches_done_in_epoch = 0
        self.progress.close()
        self._raise_if_non_finite()
        if self.last_checkpoint is None or self.last_checkpoint.name != f"checkpoint-{state.global_step}":
            self.save_checkpoint()

    def _train_pass(self) -> bool:
        """Train on the rest of the current epoch: True when it is done, False when the last step came first."""
        trained = 0
        for indices, batch in self.batches.epoch(self.state.epoch, self.state.batches_done_in_epoch):
            trained += 1
            if self._train_batch(indices, batch):  # an optimiser step was taken
                self._after_step()
                if self.state.global_step >= self.total_steps:
                    return False
        if trained == 0 and self.state.batches_done_in_epoch == 0:
            raise UsageError(f"the training split gives no batch for each of the {self.accelerator.num_processes} "
                             f"process(es): give more training pairs or use fewer processes")
        return True

    def _train_batch(self, indices: list[int], batch: dict) -> bool:
        """Forward and backward on one batch (and the optimiser step at the end of an accumulation); True if the
        gradients were synchronised, i.e. an optimiser step was taken."""
        accelerator, state = self.accelerator, self.state
        # Counted on the host before the copy to the device: no synchronisation.
        tokens = int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
        batch = {key: value.to(accelerator.device, non_blocking=True) for key, value in batch.items()}
        with accelerator.accumulate(self.train_model):
            loss = self._loss(batch)
            self._record_non_finite(loss.detach(), state.global_step + 1)
            accelerator.backward(loss)
            if accelerator.sync_gradients and self.args.max_grad_norm > 0:
                accelerator.clip_grad_norm_(self.train_model.parameters(), self.args.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        state.batches_done_in_epoch += 1
        window = self._window
        window.loss, window.batches, window.tokens = window.loss + loss.detach(), window.batches + 1, \
            window.tokens + tokens
        return accelerator.sync_gradients

    def _after_step(self) -> None:
        """After an optimiser step: the schedule, then what is due (log line, validation, checkpoint, stop)."""
        args, state = self.args, self.state
        self.scheduler.step()
        state.global_step += 1
        self.progress.update(1)
        checkpoint_due = args.save_steps and state.global_step % args.save_steps == 0
        validation_due = (args.eval_steps and state.global_step % args.eval_steps == 0
                          and state.global_step < self.total_steps)
        log_due = state.global_step % args.logging_steps == 0 or state.global_step == self.total_steps
        if log_due or checkpoint_due or validation_due or self.stop_signal is not None:
            self._raise_if_non_finite()
        if log_due:
            self._log_window()
        # The window's clock stops while validating or saving: tokens/s counts training time only.
        if validation_due:
            self._paused(self.validate)
        if checkpoint_due:
            self._paused(self.save_checkpoint)
        if self.stop_signal is not None:
            self._stop_on_signal()

    def _paused(self, action) -> None:
        paused = time.time()
        action()
        self._window.start += time.time() - paused

    def _log_window(self) -> None:
        """Loss, learning rate and tokens/s (all processes' tokens) of the steps since the last log line."""
        state, window = self.state, self._window
        seconds = time.time() - window.start
        total_tokens = int(self.accelerator.reduce(torch.tensor(window.tokens, device=self.accelerator.device), "sum"))
        state.train_tokens += total_tokens
        state.train_seconds += seconds
        row = {"step": state.global_step, "epoch": self.epoch_fraction(),
               "train_loss": round(float(window.loss) / window.batches, 4),
               "learning_rate": self.scheduler.get_last_lr()[0],
               "tokens_per_second": round(total_tokens / max(seconds, 1e-9), 1)}
        log_row(self.accelerator, state, row)
        self.progress.set_postfix(loss=row["train_loss"], tok_s=row["tokens_per_second"])
        self._window = _Window()

    def epoch_fraction(self) -> float:
        """Epochs done; with --streaming the length of an epoch is unknown, so only whole epochs count."""
        per_epoch = self.batches.per_epoch
        fraction = self.state.batches_done_in_epoch / per_epoch if per_epoch else 0.0
        return round(self.state.epoch + fraction, 3)

    def _loss(self, batch: dict) -> torch.Tensor:
        """Label-smoothed cross-entropy over the non-padding target tokens, teacher-forced."""
        # With labels the model derives the decoder input.
        return self.train_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                labels=batch["labels"], label_smoothing=self.args.label_smoothing_factor).loss

    def _record_non_finite(self, loss: torch.Tensor, step: int) -> None:
        """Remember (on the device, without synchronising) the step and value of the first non-finite loss."""
        first = (~torch.isfinite(loss)) & (self._first_bad[0] < 0)
        self._first_bad.copy_(torch.where(first, torch.stack([torch.full_like(loss, step), loss]).float(),
                                          self._first_bad))

    def _raise_if_non_finite(self) -> None:
        """Stop before anything is logged or saved from weights a non-finite loss has touched."""
        step, value = self._first_bad.tolist()
        if step >= 0:
            raise TrainingFault(self._non_finite_message(value, int(step)))

    def _non_finite_message(self, value: float, step: int) -> str:
        kept = list_checkpoints(self.output_dir)
        if kept:
            return (f"loss became {value} at step {step}; stopped without saving this state, "
                    f"the last good checkpoint is {kept[-1]}. Lower --learning_rate, raise --warmup_steps or check "
                    f"the data, then resume with --resume_from_checkpoint latest")
        return (f"loss became {value} at step {step}; stopped, no checkpoint had been written "
                f"yet. Lower --learning_rate, raise --warmup_steps or check the data, then start again with "
                f"--overwrite_output_dir")

    def _install_signal_handlers(self) -> dict:
        """SIGINT/SIGTERM only set a flag: the loop saves a checkpoint after the current step and stops."""
        def request_stop(signum, frame):
            self.stop_signal = signum
        return {signum: signal.signal(signum, request_stop) for signum in (signal.SIGINT, signal.SIGTERM)}

    def _stop_on_signal(self) -> None:
        self.save_checkpoint()
        raise RunInterrupted(
            f"{signal.Signals(self.stop_signal).name} received: checkpoint saved at step {self.state.global_step} in "
            f"{self.last_checkpoint}; continue with --resume_from_checkpoint latest",
            self.stop_signal,
        )

    def validate(self) -> dict:
        """Validation at the current step (see Evaluator.validate)."""
        return self.evaluator.validate(self.state)

    def save_checkpoint(self) -> Path:
        """A checkpoint of the current step (see checkpointing.save_checkpoint); pushed with --hub_strategy
        every_save / checkpoint."""
        self.state.settings = self.state.settings or self.settings
        final = save_checkpoint(self.accelerator, self.model, self.tokenizer, self.state, self.scheduler,
                                self.output_dir, self.args.save_total_limit)
        self.last_checkpoint = final
        if self.args.push_to_hub and self.args.hub_strategy in ("every_save", "checkpoint") and self.is_main:
            push_during_training(self.args, self.output_dir, self.accelerator.unwrap_model(self.model),
                                 self.tokenizer, final, self.state.global_step)
        return final

    def train_results(self, runtime: float) -> dict:
        """train_results.json's figures (run_translation.py's names, and this package's token counts)."""
        state, steps = self.state, self.state.global_step
        losses = [(row["step"], row["train_loss"]) for row in state.history if "train_loss" in row]
        weighted = sum((step - previous) * loss for (previous, _), (step, loss) in zip([(0, 0)] + losses, losses))
        return {
            "train_runtime": round(runtime, 2),
            "train_samples": None if self.data_args.streaming else len(self.batches.dataset),
            "train_steps_per_second": round(steps / max(runtime, 1e-9), 3),
            "train_loss": round(weighted / losses[-1][0], 4) if losses else None,
            "epoch": self.epoch_fraction(),
            "train_steps": steps,
            "train_tokens": state.train_tokens,
            "train_tokens_per_second": round(state.train_tokens / max(state.train_seconds, 1e-9), 1),
            "train_padding_fraction": self.batches.padding_fraction(),
        }
