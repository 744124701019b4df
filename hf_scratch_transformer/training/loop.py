"""The training loop: the optimiser (Adam with the warm-up schedule), the label-smoothed loss (loss.py), the run's
batches epoch by epoch, and after each optimiser step what is due then (a log line, a validation, a checkpoint, a
stop).

A step reads top to bottom in `TrainingLoop`: forward, backward, clipping, optimiser step (`_train_batch`), then the
schedule and what is due (`_after_step`). The pieces it leans on are small and named: `StepSchedule` (what is due at
step N), `LogWindow` (the figures and training time since the last log line), `NonFiniteLoss` (a non-finite loss
noticed without per-step synchronisation), `StopSignals` (SIGINT/SIGTERM: a checkpoint, then `RunInterrupted`);
agreement between processes is distributed.py's, the CPU thread count the tuner's (cpu_threads.py). Code outside the
package hooks into a run through `TrainingCallback` (like transformers' TrainerCallback).
"""

import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from torch.optim.lr_scheduler import LambdaLR, LRScheduler
from tqdm.auto import tqdm
from transformers import get_scheduler

from .checkpointing import RunState, load_checkpoint, resume_settings
from ..cpu_threads import thread_tuner
from ..data.batching import TrainingBatches
from .distributed import agree, any_process, main_process_value
from ..errors import RunInterrupted, TrainingFault, UsageError
from .evaluation import log_row
from .flops import end_peak_seconds, run_matmul_peak, tokens_and_flops, training_throughput
from .loss import teacher_forced_loss
from .model_directory import push_during_training
from .recipe import Recipe
from .run_directory import checkpoint_name, list_checkpoints, save_checkpoint
from .stopping import FITTED_SCHEDULES, METRIC_NAMES, StoppingRules, TimeFittedSchedule

logger = logging.getLogger("hf_scratch_transformer")


def make_optimizer(model, args, device: torch.device) -> torch.optim.Optimizer:
    """Adam (AdamW with --weight_decay) with the paper's betas and epsilon by default."""
    optimizer_class = torch.optim.AdamW if args.weight_decay > 0 else torch.optim.Adam
    # fused: one kernel for every parameter's update (on CPU too), instead of a loop of small ones.
    return optimizer_class(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                           betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                           fused=device.type in ("cpu", "cuda"))


def make_schedule(args, optimizer, length) -> tuple[LRScheduler, TimeFittedSchedule | None]:
    """(learning-rate scheduler, its time fit or None): transformers' schedule over the run's total steps, or under
    the run-length rule with --max_train_minutes, a linear or cosine one fitted to the steps the minutes hold
    (stopping.TimeFittedSchedule). Stepped by hand once per optimiser step: Accelerate's wrapper would step it once
    per process."""
    if length.source == "minutes" and args.lr_scheduler_type in FITTED_SCHEDULES:
        fitted = TimeFittedSchedule(args.lr_scheduler_type, args.warmup_steps, args.max_train_minutes * 60,
                                    length.total_steps)
        return LambdaLR(optimizer, fitted.multiplier), fitted
    return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                         num_training_steps=length.total_steps), None


def mixed_precision_autocast(precision: str, device: torch.device):
    """A factory of the context of a training forward: bf16 autocast for the recipe's bf16 (Accelerate stays in fp32,
    see distributed.start_accelerator), nothing otherwise (fp16's autocast is Accelerate's, on the model)."""
    if precision == "bf16":
        return partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


# ---------------------------------------------------------------------------------------------------- callbacks


class TrainingCallback:
    """A hook into a `TrainingLoop`, like transformers' TrainerCallback: subclass it and override what you need.
    Every method gets the loop (its `state`, `model`, `optimizer`, `accelerator`, `batches`, `evaluator`, ...) and is
    called on every process. Give callbacks to `TrainingLoop(callbacks=...)`, or, for the runs of `run_training` and
    train.py's `main`, open `training_callbacks(...)` around them."""

    def on_train_begin(self, loop: "TrainingLoop") -> None:
        """Before the first batch (of the resumed run, when it resumes)."""

    def on_batch_end(self, loop: "TrainingLoop", indices: list[int], batch: dict, loss: torch.Tensor) -> None:
        """After one batch's forward and backward (and the optimiser step ending an accumulation): `indices` are its
        examples (positions in the stream when streamed), `batch` its tensors ((batch, length) each, on the device),
        `loss` its loss (detached). It belongs to step `loop.state.global_step + 1`."""

    def on_step_end(self, loop: "TrainingLoop") -> None:
        """After optimiser step `loop.state.global_step` and what was due at it (log line, validation, checkpoint),
        before a stop on a signal."""

    def on_evaluate(self, loop: "TrainingLoop", row: dict) -> None:
        """After a validation during training: its figures (empty on the processes other than the main one)."""

    def on_save(self, loop: "TrainingLoop", checkpoint: Path) -> None:
        """After a checkpoint was saved (and pushed, with --hub_strategy every_save / checkpoint)."""


_RUN_CALLBACKS: ContextVar[tuple[TrainingCallback, ...]] = ContextVar("training_callbacks", default=())


@contextlib.contextmanager
def training_callbacks(*callbacks: TrainingCallback) -> Iterator[None]:
    """Inside this block, the training loops of `run_training` (train.py's `main` too) call `callbacks`, after those
    of enclosing blocks: `with training_callbacks(Trace()): main(argv)`."""
    token = _RUN_CALLBACKS.set(_RUN_CALLBACKS.get() + callbacks)
    try:
        yield
    finally:
        _RUN_CALLBACKS.reset(token)


def active_callbacks() -> tuple[TrainingCallback, ...]:
    """The callbacks of the enclosing `training_callbacks` blocks."""
    return _RUN_CALLBACKS.get()


# ------------------------------------------------------------------------------------------ the loop's pieces


@dataclass(frozen=True)
class Due:
    """What is due after an optimiser step; true when anything is."""

    log: bool = False
    validation: bool = False
    checkpoint: bool = False

    def __bool__(self) -> bool:
        return self.log or self.validation or self.checkpoint


@dataclass(frozen=True)
class StepSchedule:
    """What is due after optimiser step N: a log line every `logging_steps` and at the last step, a validation every
    `eval_steps` (0: none during training) and at the last step only when `validate_last` (its weights compete for
    the best model; otherwise --do_eval validates them after training), a checkpoint every `save_steps` (0: none)."""

    logging_steps: int
    eval_steps: int
    save_steps: int
    total_steps: int
    validate_last: bool
    fitted: TimeFittedSchedule | None = None  # a time-fitted schedule's end is the last step too

    def at(self, step: int) -> Due:
        last = step == self.total_steps or self.fitted is not None and self.fitted.finished(step)
        return Due(log=step % self.logging_steps == 0 or last,
                   validation=bool(self.eval_steps) and (last and self.validate_last
                                                         or not last and step % self.eval_steps == 0),
                   checkpoint=bool(self.save_steps) and step % self.save_steps == 0)


class LogWindow:
    """What was trained since the last log line: the summed loss (a tensor, on the device), batches, tokens, model
    FLOPs, positions (padding included), and the training time since `start`, whose clock stops while validating or
    saving (`paused`)."""

    def __init__(self):
        self.loss: float | torch.Tensor = 0.0
        self.batches = self.tokens = self.positions = 0
        self.flops = 0.0
        self.start = time.time()

    def add(self, loss: torch.Tensor, tokens: int, flops: float, positions: int) -> None:
        self.loss, self.batches, self.tokens = self.loss + loss, self.batches + 1, self.tokens + tokens
        self.flops += flops
        self.positions += positions

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        paused = time.time()
        yield
        self.start += time.time() - paused

    def totals(self, accelerator: Accelerator) -> tuple[float, int, float, int, float]:
        """(training seconds, tokens, model FLOPs and positions of all processes, mean loss of this process's
        batches)."""
        work = torch.tensor([self.tokens, round(self.flops), self.positions], device=accelerator.device)  # int64: exact
        tokens, flops, positions = accelerator.reduce(work, "sum").tolist()
        return time.time() - self.start, tokens, float(flops), positions, float(self.loss) / self.batches


class NonFiniteLoss:
    """The step and value of the first non-finite loss, recorded on the device without synchronising (a per-step
    `.item()` would make the host wait for the GPU at every step) and looked at only before anything is logged,
    validated or saved from weights it has touched."""

    def __init__(self, device: torch.device):
        self.first = torch.full((2,), -1.0, device=device)  # (step, loss)

    def record(self, loss: torch.Tensor, step: int) -> None:
        first = (~torch.isfinite(loss)) & (self.first[0] < 0)
        self.first.copy_(torch.where(first, torch.stack([torch.full_like(loss, step), loss]).float(), self.first))

    def raise_if_seen(self, output_dir: Path) -> None:
        step, value = self.first.tolist()
        if step < 0:
            return
        kept = list_checkpoints(output_dir)
        if kept:
            raise TrainingFault(
                f"loss became {value} at step {int(step)}; stopped without saving this state, the last good checkpoint "
                f"is {kept[-1]}. Lower --learning_rate, raise --warmup_steps or check the data, then resume with "
                f"--resume_from_checkpoint latest")
        raise TrainingFault(
            f"loss became {value} at step {int(step)}; stopped, no checkpoint had been written yet. Lower "
            f"--learning_rate, raise --warmup_steps or check the data, then start again with --overwrite_output_dir")


class StopSignals:
    """While `installed`, SIGINT and SIGTERM only set `received`: the loop saves a checkpoint after the current step
    and stops. The previous handlers are given back after."""

    def __init__(self):
        self.received: int | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        def request_stop(signum, frame):
            self.received = signum
        previous = {signum: signal.signal(signum, request_stop) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    @staticmethod
    def interruption(signum: int, step: int, checkpoint: Path) -> RunInterrupted:
        """What the loop raises once the checkpoint after a signal is saved."""
        return RunInterrupted(f"{signal.Signals(signum).name} received: checkpoint saved at step {step} in "
                              f"{checkpoint}; continue with --resume_from_checkpoint latest", signum)


def expected_time(steps_per_second: float, steps_left: int, fitted: TimeFittedSchedule | None = None,
                  minutes: float = 0) -> str:
    """The log line of the expected training time, after the first log window (with a time-fitted schedule: the
    steps expected in the minutes)."""
    if fitted is not None:
        return (f"expected: about {fitted.total_steps:,} steps in the {minutes:g} minutes of --max_train_minutes at "
                f"{steps_per_second:.2f} steps/s so far (re-estimated at each log line; validations and checkpoints "
                f"count against the minutes)")
    return (f"expected training time: about {steps_left / max(steps_per_second, 1e-9) / 60:.0f} more minutes for "
            f"the {steps_left:,} steps left at {steps_per_second:.2f} steps/s so far (validation and early stopping "
            f"not counted)")


def mean_train_loss(history: list[dict]) -> float | None:
    """The training loss of the whole run: the logged windows' losses weighted by their steps."""
    losses = [(row["step"], row["train_loss"]) for row in history if "train_loss" in row]
    weighted = sum((step - previous) * loss for (previous, _), (step, loss) in zip([(0, 0)] + losses, losses))
    return round(weighted / losses[-1][0], 4) if losses else None


# ----------------------------------------------------------------------------------------------------- the loop


class TrainingLoop:
    """Trains one model on `batches` (data.batching.TrainingBatches): optimiser, schedule, the loop, periodic
    validation through `evaluator`, checkpoints (and hub pushes during training), the end of the run. `recipe`
    gives the precision and the run-length rule; `state` is where the run is (restored by `resume`)."""

    def __init__(self, accelerator: Accelerator, model, tokenizer, batches: TrainingBatches, evaluator, args,
                 data_args, recipe: Recipe, output_dir: Path, callbacks: tuple[TrainingCallback, ...] = ()):
        self.accelerator, self.model, self.tokenizer, self.evaluator = accelerator, model, tokenizer, evaluator
        self.batches, self.args, self.recipe, self.output_dir = batches, args, recipe, output_dir
        self.callbacks, self.is_main = list(callbacks), accelerator.is_main_process
        self.state = RunState(train_flops=0.0, train_positions=0)
        self.settings = resume_settings(args, data_args, recipe)
        self.last_checkpoint: Path | None = None
        self.final_validation: dict | None = None  # the validation of the weights the run ends with, if made
        optimizer = make_optimizer(model, args, accelerator.device)
        self.train_model = torch.compile(model) if args.torch_compile else model
        self.train_model, self.optimizer = accelerator.prepare(self.train_model, optimizer)
        self.autocast = mixed_precision_autocast(recipe.precision, accelerator.device)
        self.threads = thread_tuner(accelerator.device, "training", args.cpu_threads)
        self.length = recipe.run_length(args, batches.steps_per_epoch(args.gradient_accumulation_steps))
        self.total_steps = self.length.total_steps
        self.scheduler, self.fitted = make_schedule(args, optimizer, self.length)
        self.stopping = StoppingRules(self.length, args.max_train_minutes, self.state, self.fitted)
        self.schedule = StepSchedule(args.logging_steps, self.length.eval_steps, args.save_steps, self.total_steps,
                                     self.length.load_best, self.fitted)
        self.non_finite, self.signals, self.window = NonFiniteLoss(accelerator.device), StopSignals(), LogWindow()
        self.progress, self._expected_time_logged, self.matmul_peaks = None, False, []

    def resume(self, checkpoint: Path) -> None:
        """Model, optimiser, schedule, RNG states and position in the data from `checkpoint`."""
        self.state = load_checkpoint(self.accelerator, self.scheduler, checkpoint, self.total_steps)
        self.state.stop_reason = None
        self.stopping = StoppingRules(self.length, self.args.max_train_minutes, self.state, self.fitted)
        self.last_checkpoint = checkpoint

    def train(self) -> None:
        """Train until the last step (a checkpoint is saved there); SIGINT/SIGTERM save one and stop."""
        with self.signals.installed():
            try:
                self._train_loop()
            finally:
                if self.progress is not None:  # on a fault too: the message is then the last line
                    self.progress.close()

    def _train_loop(self) -> None:
        state = self.state
        self.progress = tqdm(total=self.total_steps, initial=state.global_step, desc="training", unit="step",
                             disable=not self.is_main, dynamic_ncols=True)
        self._fit_schedule()  # a resumed run's minutes left
        self.matmul_peaks = [run_matmul_peak(self.accelerator, self.recipe.precision, self.threads)]  # before the clock
        self.window = LogWindow()
        self.train_model.train()
        if self.threads is not None:
            logger.info(self.threads.describe())
            self.threads.activate()
        if self.is_main:
            logger.info(self.length.describe())
        for callback in self.callbacks:
            callback.on_train_begin(self)
        self._check_stop(patience=True, budget=True)  # a resumed run may have nothing left to do
        while state.global_step < self.total_steps and state.stop_reason is None:
            if self._train_pass():
                state.epoch += 1
                state.batches_done_in_epoch = 0
        self.progress.close()
        self.non_finite.raise_if_seen(self.output_dir)
        state.stop_reason = state.stop_reason or self.stopping.reason_at_the_last_step()
        self._finish()

    def _train_pass(self) -> bool:
        """Train on the rest of the current epoch: True when it is done, False when the last step came first."""
        trained = 0
        for indices, batch in self.batches.epoch(self.state.epoch, self.state.batches_done_in_epoch):
            trained += 1
            if not self._train_batch(indices, batch):  # within an accumulation: no optimiser step yet
                continue
            self._after_step()
            if self.state.global_step >= self.total_steps or self.state.stop_reason is not None:
                return False
        if trained == 0 and self.state.batches_done_in_epoch == 0:
            raise UsageError(f"the training split gives no batch for each of the {self.accelerator.num_processes} "
                             f"process(es): give more training pairs or use fewer processes")
        return True

    def _train_batch(self, indices: list[int], batch: dict) -> bool:
        """Forward, backward, clipping and (at the end of an accumulation) the optimiser step on one batch; True if
        an optimiser step was taken."""
        accelerator, started = self.accelerator, time.perf_counter()
        # Counted on the host before the copy to the device: no synchronisation.
        tokens, flops = tokens_and_flops(self.model.config, batch)
        positions = batch["input_ids"].numel() + batch["labels"].numel()
        batch = {key: value.to(accelerator.device, non_blocking=True) for key, value in batch.items()}
        with accelerator.accumulate(self.train_model):
            loss = self._loss(batch)
            self.non_finite.record(loss.detach(), self.state.global_step + 1)
            accelerator.backward(loss)
            if accelerator.sync_gradients and self.args.max_grad_norm > 0:
                accelerator.clip_grad_norm_(self.train_model.parameters(), self.args.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.state.batches_done_in_epoch += 1
        self.window.add(loss.detach(), tokens, flops, positions)
        if self.threads is not None:
            self.threads.record(tokens, time.perf_counter() - started)
        for callback in self.callbacks:
            callback.on_batch_end(self, indices, batch, loss.detach())
        return accelerator.sync_gradients

    def _loss(self, batch: dict) -> torch.Tensor:
        """Label-smoothed cross-entropy over the non-padding target tokens, teacher-forced (the decoder input comes
        from the labels); fp32 whatever the precision of the forward (loss.py)."""
        with self.autocast():
            return teacher_forced_loss(self.train_model, batch, self.args.label_smoothing_factor)

    def _after_step(self) -> None:
        """After an optimiser step: the schedule, then what is due (log line, validation, checkpoint, stop)."""
        state = self.state
        self.scheduler.step()
        state.global_step += 1
        self.progress.update(1)
        due = self.schedule.at(state.global_step)
        # A signal that reached any process stops all of them at this step (one that stopped alone would leave the
        # others waiting in the next gradient exchange until --ddp_timeout).
        stop = any_process(self.accelerator, self.signals.received is not None)
        if due or stop:
            self.non_finite.raise_if_seen(self.output_dir)
        if due.log:
            self._log_window()
            self._check_stop(budget=True)
        checkpoint = due.checkpoint
        if due.validation:
            best = self._paused(self._validate_and_track)
            checkpoint = checkpoint or (best and self.length.load_best)
            self._check_stop(patience=True)
        if checkpoint:
            self._paused(self.save_checkpoint)
        for callback in self.callbacks:
            callback.on_step_end(self)
        if stop:
            self.save_checkpoint()
            raise self.signals.interruption(self.signals.received or signal.SIGTERM, self.state.global_step,
                                            self.last_checkpoint)

    def _fit_schedule(self) -> None:
        """A time-fitted schedule's new estimate of the steps the minutes hold, on the main process's clock."""
        if self.fitted is not None and not self.fitted.finished(self.state.global_step):
            wall = main_process_value(self.accelerator, self.stopping.wall_seconds())
            self.progress.total = self.fitted.estimate(self.state.global_step, wall)

    def _paused(self, action):
        """`action()` with the log window's clock stopped: tokens/s counts training time only."""
        with self.window.paused():
            result = action()
        if self.threads is not None:
            self.threads.activate()  # validation decodes with its own thread count
        return result

    def _validate_and_track(self) -> bool:
        """Validate; True on every process when it is the best model so far (the main process decides)."""
        row = self.validate()
        best = bool(row) and self.stopping.record_validation(row)
        if best and self.length.load_best:
            self.state.best_checkpoint = checkpoint_name(self.state.global_step)  # saved next, kept by rotation
        return agree(self.accelerator, best)

    def _check_stop(self, patience: bool = False, budget: bool = False) -> None:
        """Early stopping and the time budget, decided by the main process for all of them."""
        if agree(self.accelerator, patience and self.stopping.patience_spent()):
            self.state.stop_reason = "early_stopping"
        elif agree(self.accelerator, budget and self.stopping.budget_spent()):
            self.state.stop_reason = "time_budget"

    def _log_window(self) -> None:
        """Loss, learning rate and tokens/s (all processes' tokens) of the steps since the last log line."""
        state, batches = self.state, self.batches
        self._fit_schedule()
        seconds, tokens, flops, positions, loss = self.window.totals(self.accelerator)
        state.count_trained(seconds, tokens, flops, positions)
        row = {"step": state.global_step, "epoch": batches.epoch_fraction(state.epoch, state.batches_done_in_epoch),
               "train_loss": round(loss, 4), "learning_rate": self.scheduler.get_last_lr()[0],
               "tokens_per_second": round(tokens / max(seconds, 1e-9), 1)}
        if self.threads is not None:
            row["cpu_threads"] = self.threads.current
        log_row(self.accelerator, state, row)
        self.progress.set_postfix(loss=row["train_loss"], tok_s=row["tokens_per_second"])
        if not self._expected_time_logged and self.is_main:
            self._expected_time_logged = True
            rate = self.window.batches / max(seconds, 1e-9) / self.args.gradient_accumulation_steps
            logger.info(expected_time(rate, self.total_steps - state.global_step, self.fitted, self.length.minutes))
        self.window = LogWindow()

    def _finish(self) -> None:
        """The end of training: the last weights validated when the best model is kept (they are a candidate),
        a checkpoint of them, then the best checkpoint's weights loaded if they are not the last ones."""
        state, load_best = self.state, self.length.load_best
        self._measure_peak_again()
        validated = [row for row in state.history if "eval_loss" in row and row["step"] == state.global_step]
        if load_best and not validated:
            self._validate_and_track()
        if self.last_checkpoint is None or self.last_checkpoint.name != checkpoint_name(state.global_step):
            self.save_checkpoint()
        logger.info(f"training ended: {self.stopping.detail()}")
        best = state.best_checkpoint
        if load_best and best and state.best_step != state.global_step:
            weights = load_file(self.output_dir / best / "model.safetensors")
            self.accelerator.unwrap_model(self.model).load_state_dict(weights, strict=False)
            logger.info(f"the saved model is the best validated one: {best} (validation "
                        f"{METRIC_NAMES[self.length.metric]} {state.best_metric})")
        step = state.best_step if load_best and best else state.global_step
        self.final_validation = next((row for row in state.history if "eval_loss" in row and row["step"] == step),
                                     None)

    def _measure_peak_again(self) -> None:
        """The matmul peak once more, now that the run knows how long it trained (flops.end_peak_seconds); the same
        decision in every process, from their mean training time."""
        trained = self.accelerator.reduce(torch.tensor(self.state.train_seconds, device=self.accelerator.device),
                                          "mean")
        seconds = end_peak_seconds(float(trained))
        if seconds:
            self.matmul_peaks.append(run_matmul_peak(self.accelerator, self.recipe.precision, self.threads, seconds))

    def validate(self) -> dict:
        """Validation at the current step (see Evaluator.validate)."""
        row = self.evaluator.validate(self.state)
        for callback in self.callbacks:
            callback.on_evaluate(self, row)
        return row

    def save_checkpoint(self) -> Path:
        """A checkpoint of the current step (see run_directory.save_checkpoint); pushed with --hub_strategy
        every_save / checkpoint."""
        self.state.settings = self.state.settings or self.settings
        self.state.wall_seconds = round(self.stopping.wall_seconds(), 1)
        final = save_checkpoint(self.accelerator, self.model, self.tokenizer, self.state, self.scheduler,
                                self.output_dir, self.args.save_total_limit)
        self.last_checkpoint = final
        if self.args.push_to_hub and self.args.hub_strategy in ("every_save", "checkpoint") and self.is_main:
            push_during_training(self.args, self.output_dir, self.accelerator.unwrap_model(self.model),
                                 self.tokenizer, final, self.state.global_step)
        for callback in self.callbacks:
            callback.on_save(self, final)
        return final


def train_results(loop: TrainingLoop, runtime: float) -> dict:
    """train_results.json's figures of `loop`'s run (run_translation.py's names, this package's token counts, the
    recipe)."""
    state, steps = loop.state, loop.state.global_step
    return {
        "train_runtime": round(runtime, 2),
        "train_samples": None if loop.batches.sampler is None else len(loop.batches.dataset),
        "train_steps_per_second": round(steps / max(runtime, 1e-9), 3),
        "train_loss": mean_train_loss(state.history),
        "epoch": loop.batches.epoch_fraction(state.epoch, state.batches_done_in_epoch),
        "train_steps": steps,
        **training_throughput(state, loop.matmul_peaks),
        "train_padding_fraction": state.padding_fraction(),
        "train_precision": loop.recipe.precision,
        **({"train_cpu_threads": loop.threads.current, "train_cpu_thread_changes": loop.threads.changes,
            "train_cpu_thread_limit": loop.threads.limit.describe()} if loop.threads is not None else {}),
        "stop_reason": state.stop_reason,
        "stop_detail": loop.stopping.detail() if state.stop_reason else None,
        **({"best_step": state.best_step, "best_metric": state.best_metric,
            "metric_for_best_model": f"eval_{loop.length.metric}", "best_model_checkpoint": state.best_checkpoint}
           if loop.length.load_best else {}),
        "recipe": loop.recipe.as_dict(),
    }
