"""The training loop: Accelerate, Adam with the warm-up schedule, label-smoothed loss, batches per epoch (or per
round of a streamed corpus), periodic logging, validation and checkpoints, a non-finite loss check without per-step
synchronisation, and SIGINT/SIGTERM handling (a checkpoint, then `RunInterrupted`)."""

import logging
import math
import os
import random
import signal
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from .arguments import choose_precision, precision, run_length, step_budget
from .checkpointing import RunState, load_checkpoint, resume_settings
from ..cpu_threads import thread_tuner
from ..data.batching import make_batch_sampler, padding_fraction
from ..data.preprocessing import sequence_lengths
from .distributed import check_shared_output_dir, quiet_other_processes, start_process_group, watch_processes
from ..errors import RunInterrupted, TrainingFault, UsageError
from .evaluation import log_row
from .model_directory import push_during_training
from .run_directory import checkpoint_name, list_checkpoints, save_checkpoint, staging_folder
from .stopping import METRIC_NAMES, StoppingRules
from ..data.tokenization import BPEDropout, SourceNoise

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


def start_accelerator(args, output_dir: Path, new_model_width: int | None = None) -> Accelerator:
    """Accelerate for the launched processes (refused if it does not join them all; collectives wait at most
    --ddp_timeout seconds, and a heartbeat lets a failed one name the lost process); on a CPU, every core used; the
    precision settled (arguments.choose_precision: the width of a new model, None for a loaded one)."""
    world_size = launched_world_size()
    # torchrun-style launch on a machine without GPUs: one CPU process per rank over gloo (MULTI_CPU).
    cpu = world_size > 1 and not torch.cuda.is_available()
    if world_size > 1:
        start_process_group(cpu, args.ddp_timeout)
    processes = PartialState(cpu=cpu)  # the device, before Accelerator's precision is fixed
    if (chosen := choose_precision(args, processes.device, new_model_width)) and processes.is_main_process:
        logger.info(chosen)
    mixed_precision = {"fp32": "no"}.get(precision(args), precision(args))
    # Accelerate keeps one precision per process and refuses another: a process that runs train.py's main again (a
    # notebook, the tests) in another precision starts Accelerate's state afresh, keeping the launched processes.
    if AcceleratorState._shared_state.get("_mixed_precision", mixed_precision) != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=mixed_precision,
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
    check_shared_output_dir(accelerator, output_dir, partial(staging_folder, what="the shared-directory check"))
    watch_processes(accelerator)
    return accelerator




# -------------------------------------------------------------------------------------------------------- batches


class TrainingNoiseCollator:
    """Collates training pairs with the run's training-time noise: each side is decoded back to its text, the source
    is given `SourceNoise` (paraphrases, plain quotes, lower-casing, typos), and the texts are encoded again with BPE-dropout
    (`BPEDropout`) when its rate is above 0; without it, only the sources the noise changed are encoded again. Every
    draw is seeded by the run's seed, the epoch and the text, so that every epoch sees new noise and a rerun or a
    resumed run sees the same. Sequences stay within the maximum lengths (`</s>` kept). Only the training batches use
    it."""

    def __init__(self, collator, tokenizer, seed: int, max_source_length: int, max_target_length: int,
                 bpe_dropout: float = 0.0, source_noise: SourceNoise | None = None):
        self.collator, self.tokenizer, self.seed = collator, tokenizer, seed
        self.dropout = BPEDropout(tokenizer, bpe_dropout) if bpe_dropout > 0 else None
        self.source_noise = source_noise if source_noise is not None else SourceNoise()
        self.max_lengths = {"input_ids": max_source_length, "labels": max_target_length}
        self.epoch = 0

    def __call__(self, features: list[dict]) -> dict:
        encoded = [{} for _ in features]
        for key, max_length in self.max_lengths.items():
            noised = key == "input_ids" and self.source_noise
            if self.dropout is None and not noised:  # nothing to redraw on this side: keep its ids
                for example, feature in zip(encoded, features):
                    example[key] = feature[key]
                continue
            texts = self.tokenizer.batch_decode([feature[key] for feature in features], skip_special_tokens=True)
            if noised:
                plain = texts
                texts = [self.source_noise.apply(text, random.Random(f"{self.seed}:{self.epoch}:noise:{text}"))
                         for text in plain]
            if self.dropout is None:  # only the sentences the noise changed need encoding again
                all_ids = [feature[key] for feature in features]
                changed = [i for i, (text, before) in enumerate(zip(texts, plain)) if text != before]
                if changed:
                    for i, ids in zip(changed, self.tokenizer([texts[i] for i in changed])["input_ids"]):
                        all_ids[i] = ids
            else:
                all_ids = [self.dropout.encode(text, random.Random(f"{self.seed}:{self.epoch}:{key}:{text}"))
                           for text in texts]
            for example, ids in zip(encoded, all_ids):
                example[key] = ids if len(ids) <= max_length else ids[: max_length - 1] + ids[-1:]
        for example in encoded:
            example["attention_mask"] = [1] * len(example["input_ids"])
        return self.collator(encoded)


class TrainBatches:
    """The training batches of this process: token-bucketed or sentence batches of the in-memory split (a sampler
    sharded over the processes), or batches formed while reading a streamed split."""

    def __init__(self, dataset, collator, data_args, args, accelerator: Accelerator, tokenizer=None,
                 source_paraphrases: dict[str, list[str]] | None = None):
        source_noise = SourceNoise(args.source_lowercase_rate, args.source_typo_rate, args.source_paraphrase_rate,
                                   source_paraphrases, args.source_plain_quotes_rate)
        if args.bpe_dropout > 0 or source_noise:
            collator = TrainingNoiseCollator(collator, tokenizer, args.seed, data_args.max_source_length,
                                             data_args.max_target_length, args.bpe_dropout, source_noise)
        self.dataset, self.collator, self.data_args, self.args = dataset, collator, data_args, args
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        self.sampler = None if data_args.streaming else make_batch_sampler(
            dataset, data_args, args.per_device_train_batch_size, shuffle=True, seed=args.seed,
            num_replicas=self.world, rank=self.rank,
        )
        self.per_epoch = 0 if self.sampler is None else len(self.sampler)  # unknown when streamed

    def steps_per_epoch(self) -> int | None:
        """Optimiser steps in an epoch (None when streamed: unknown)."""
        if self.sampler is None:
            return None
        return math.ceil(self.per_epoch / self.args.gradient_accumulation_steps)

    def padding_fraction(self) -> float | None:
        """Padding in the batches of one epoch (None when streamed)."""
        if self.sampler is None:
            return None
        return round(padding_fraction(list(self.sampler), *sequence_lengths(self.dataset)), 4)

    def epoch(self, epoch: int, done: int):
        """(example indices, collated batch) of this process for the rest of epoch `epoch`, after the `done`
        batches it already trained on; indices are positions in the (shuffled) stream with --streaming."""
        if isinstance(self.collator, TrainingNoiseCollator):
            self.collator.epoch = epoch
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
    last_tokens: int = 0  # of the last batch
    start: float = field(default_factory=time.time)


class TrainingLoop:
    """Trains one model: optimiser, schedule, batches, the loop, checkpoints (and hub pushes during training),
    periodic validation through `evaluator`. `state` is where the run is (restored by `resume`)."""

    def __init__(self, accelerator: Accelerator, model, tokenizer, train_dataset, collator, evaluator,
                 data_args, args, output_dir: Path, source_paraphrases: dict[str, list[str]] | None = None):
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
        self.batches = TrainBatches(train_dataset, collator, data_args, args, accelerator, tokenizer,
                                    source_paraphrases)
        self.threads = thread_tuner(accelerator.device, "training", args.cpu_threads)
        self.length = run_length(args, self.batches.steps_per_epoch(), step_budget(args, accelerator.device))
        self.total_steps = self.length.total_steps
        self.stopping = StoppingRules(self.length, args.max_train_minutes, self.state)
        self.final_validation: dict | None = None  # the validation of the weights the run ends with, if made
        self._expected_time_logged = False
        # Stepped by hand once per optimiser step: Accelerate's wrapper would step it once per process.
        self.scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                                       num_training_steps=self.total_steps)
        # A non-finite loss is recorded on the device and looked at only before logging, validating or saving:
        # a per-step `.item()` would make the host wait for the GPU at every step.
        self._first_bad = torch.full((2,), -1.0, device=accelerator.device)  # (step, loss) of the first non-finite
        self._window = _Window()

    def resume(self, checkpoint: Path) -> None:
        """Model, optimiser, schedule, RNG states and position in the data from `checkpoint`."""
        self.state = load_checkpoint(self.accelerator, self.scheduler, checkpoint, self.total_steps)
        self.state.stop_reason = None
        self.stopping = StoppingRules(self.length, self.args.max_train_minutes, self.state)
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
        if self.threads is not None:
            logger.info(self.threads.describe())
            self.threads.activate()
        if self.is_main:
            logger.info(self.length.describe())
        self._check_stop(patience=True, budget=True)  # a resumed run may have nothing left to do
        while state.global_step < self.total_steps and state.stop_reason is None:
            if self._train_pass():
                state.epoch += 1
                state.batches_done_in_epoch = 0
        self.progress.close()
        self._raise_if_non_finite()
        state.stop_reason = state.stop_reason or self.stopping.reason_at_the_last_step()
        self._finish()

    def _finish(self) -> None:
        """The end of training: the last weights validated when the best model is kept (they are a candidate),
        a checkpoint of them, then the best checkpoint's weights loaded if they are not the last ones."""
        state = self.state
        validated = [row for row in state.history if "eval_loss" in row and row["step"] == state.global_step]
        if self.length.load_best and not validated:
            self._validate_and_track()
        if self.last_checkpoint is None or self.last_checkpoint.name != checkpoint_name(state.global_step):
            self.save_checkpoint()
        logger.info(f"training ended: {self.stopping.detail()}")
        best = state.best_checkpoint
        if self.length.load_best and best and state.best_step != state.global_step:
            weights = load_file(self.output_dir / best / "model.safetensors")
            self.accelerator.unwrap_model(self.model).load_state_dict(weights, strict=False)
            logger.info(f"the saved model is the best validated one: {best} (validation "
                        f"{METRIC_NAMES[self.length.metric]} {state.best_metric})")
        step = state.best_step if self.length.load_best and best else state.global_step
        self.final_validation = next((row for row in state.history if "eval_loss" in row and row["step"] == step),
                                     None)

    def _train_pass(self) -> bool:
        """Train on the rest of the current epoch: True when it is done, False when the last step came first."""
        trained = 0
        for indices, batch in self.batches.epoch(self.state.epoch, self.state.batches_done_in_epoch):
            trained += 1
            started = time.perf_counter()
            stepped = self._train_batch(indices, batch)  # True when an optimiser step was taken
            if self.threads is not None:
                self.threads.record(self._window.last_tokens, time.perf_counter() - started)
            if stepped:
                self._after_step()
                if self.state.global_step >= self.total_steps or self.state.stop_reason is not None:
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
        window.last_tokens = tokens
        return accelerator.sync_gradients

    def _after_step(self) -> None:
        """After an optimiser step: the schedule, then what is due (log line, validation, checkpoint, stop)."""
        args, state = self.args, self.state
        self.scheduler.step()
        state.global_step += 1
        self.progress.update(1)
        eval_steps = self.length.eval_steps
        checkpoint_due = args.save_steps and state.global_step % args.save_steps == 0
        last = state.global_step == self.total_steps
        # The last step's weights are validated here only when they compete for the best model (the final
        # validation of --do_eval is made after training otherwise), before its checkpoint records the result.
        validation_due = bool(eval_steps) and (last and self.length.load_best
                                               or not last and state.global_step % eval_steps == 0)
        log_due = state.global_step % args.logging_steps == 0 or state.global_step == self.total_steps
        stop = self._signalled()
        if log_due or checkpoint_due or validation_due or stop:
            self._raise_if_non_finite()
        if log_due:
            self._log_window()
            self._check_stop(budget=True)
        # The window's clock stops while validating or saving: tokens/s counts training time only.
        if validation_due:
            best = self._paused(self._validate_and_track)
            checkpoint_due = checkpoint_due or (best and self.length.load_best)
            self._check_stop(patience=True)
        if checkpoint_due:
            self._paused(self.save_checkpoint)
        if stop:
            self._stop_on_signal()

    def _paused(self, action):
        paused = time.time()
        result = action()
        self._window.start += time.time() - paused
        if self.threads is not None:
            self.threads.activate()  # validation decodes with its own thread count
        return result

    def _validate_and_track(self) -> bool:
        """Validate; True on every process when it is the best model so far (the main process decides)."""
        row = self.validate()
        best = bool(row) and self.stopping.record_validation(row)
        if best and self.length.load_best:
            self.state.best_checkpoint = checkpoint_name(self.state.global_step)  # saved next, kept by rotation
        return self._agree(best)

    def _check_stop(self, patience: bool = False, budget: bool = False) -> None:
        """Early stopping and the time budget, decided by the main process for all of them."""
        if self._agree(patience and self.stopping.patience_spent()):
            self.state.stop_reason = "early_stopping"
        elif self._agree(budget and self.stopping.budget_spent()):
            self.state.stop_reason = "time_budget"

    def _signalled(self) -> bool:
        """Whether SIGINT/SIGTERM reached any process: they stop at the same step (a process that stopped alone would
        leave the others waiting in the next gradient exchange until --ddp_timeout)."""
        if self.accelerator.num_processes == 1:
            return self.stop_signal is not None
        value = torch.tensor(float(self.stop_signal is not None), device=self.accelerator.device)
        if self.accelerator.reduce(value, "sum").item() > 0:
            self.stop_signal = self.stop_signal or signal.SIGTERM
            return True
        return False

    def _agree(self, flag: bool) -> bool:
        """The main process's `flag`, on every process (the others' flags are ignored)."""
        if self.accelerator.num_processes == 1:
            return flag
        value = torch.tensor(float(flag and self.is_main), device=self.accelerator.device)
        return bool(self.accelerator.reduce(value, "sum").item() > 0)

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
        if self.threads is not None:
            row["cpu_threads"] = self.threads.current
        log_row(self.accelerator, state, row)
        self.progress.set_postfix(loss=row["train_loss"], tok_s=row["tokens_per_second"])
        if not self._expected_time_logged and self.is_main:
            self._expected_time_logged = True
            rate = window.batches / max(seconds, 1e-9) / self.args.gradient_accumulation_steps
            left = (self.total_steps - state.global_step) / max(rate, 1e-9) / 60
            logger.info(f"expected training time: about {left:.0f} more minutes for the "
                        f"{self.total_steps - state.global_step:,} steps left at {rate:.2f} steps/s so far "
                        f"(validation and early stopping not counted)")
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
        self.state.wall_seconds = round(self.stopping.wall_seconds(), 1)
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
            "train_precision": precision(self.args),
            **({"train_cpu_threads": self.threads.current, "train_cpu_thread_changes": self.threads.changes}
               if self.threads is not None else {}),
            "stop_reason": state.stop_reason,
            "stop_detail": self.stopping.detail() if state.stop_reason else None,
            **({"best_step": state.best_step, "best_metric": state.best_metric,
                "metric_for_best_model": f"eval_{self.length.metric}", "best_model_checkpoint": state.best_checkpoint}
               if self.length.load_best else {}),
        }
