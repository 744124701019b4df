"""When a training run ends, and which of its models is the best: the last step, early stopping after validations
without improvement (transformers' `early_stopping_patience` / `metric_for_best_model`), a training-time budget
(fairseq's `--stop-time-hours`), and under the run-length rule a time budget the learning-rate schedule is fitted to
(`TimeFittedSchedule`). What it tracks lives in the run state, so a resumed run keeps its patience counter, its best
score and the time already spent."""

import math
import time
from collections.abc import Callable

METRIC_NAMES = {"bleu": "BLEU", "chrf": "chrF", "loss": "loss"}
BEST_MODEL_METRICS = {"bleu": True, "chrf": True, "loss": False}  # metric -> greater is better


def best_model_metric(args) -> str:
    """--metric_for_best_model without transformers' optional `eval_` prefix."""
    return args.metric_for_best_model.removeprefix("eval_")


class StoppingRules:
    """The end of a run: `length` is the run's recipe.RunLength (recipe.py imports this module, so it is not
    imported here); `state` (a RunState) holds what is tracked; `fitted`, the run's TimeFittedSchedule if it has one
    (its end spends the budget); `clock` is time.time (tests pass their own)."""

    def __init__(self, length, max_train_minutes: float, state, fitted: "TimeFittedSchedule | None" = None,
                 clock: Callable[[], float] = time.time):
        self.length, self.budget_seconds, self.state, self.clock = length, max_train_minutes * 60, state, clock
        self.started, self.wall_before, self.fitted = clock(), state.wall_seconds, fitted

    def wall_seconds(self) -> float:
        """Training time of the run so far, earlier runs resumed from included."""
        return self.wall_before + self.clock() - self.started

    def record_validation(self, row: dict) -> bool:
        """Account a validation row ({"step", "eval_bleu", ...}); True if it is the best so far."""
        state, value = self.state, row[f"eval_{self.length.metric}"]
        best = state.best_metric
        better = best is None or (value > best if self.length.greater_is_better else value < best)
        if better:
            state.best_metric, state.best_step, state.validations_without_improvement = value, row["step"], 0
        else:
            state.validations_without_improvement += 1
        return better

    def patience_spent(self) -> bool:
        return bool(self.length.patience) and self.state.validations_without_improvement >= self.length.patience

    def budget_spent(self) -> bool:
        """The minutes are spent, by the clock or by the end of the schedule fitted to them."""
        if self.fitted is not None and self.fitted.finished(self.state.global_step):
            return True
        return self.budget_seconds > 0 and self.wall_seconds() >= self.budget_seconds

    def reason_at_the_last_step(self) -> str:
        return {"max_steps": "max_steps", "epochs": "epochs", "rule": "step_budget",
                "minutes": "step_budget"}[self.length.source]

    def detail(self) -> str:
        """Why the run ended, in words, from `state.stop_reason`."""
        state, length, reason = self.state, self.length, self.state.stop_reason
        if reason == "early_stopping":
            return (f"early stopping at step {state.global_step:,}: {length.patience} validations without a better "
                    f"validation {METRIC_NAMES[length.metric]} than {state.best_metric} (step {state.best_step:,})")
        if reason == "time_budget" and length.source == "minutes":
            return (f"the --max_train_minutes budget ({self.budget_seconds / 60:g} min), the run's length, was spent "
                    f"at step {state.global_step:,} (the learning-rate schedule fitted to it)")
        if reason == "time_budget":
            return (f"the --max_train_minutes budget ({self.budget_seconds / 60:g} min) was spent at step "
                    f"{state.global_step:,}")
        return {"max_steps": f"reached --max_steps ({state.global_step:,} steps)",
                "epochs": f"completed --num_train_epochs ({state.global_step:,} steps)",
                "step_budget": f"reached the run-length rule's {length.total_steps:,} steps"}[reason]


# The schedules whose shape depends on the run's total steps, which TimeFittedSchedule fits to a time budget (the
# others, inverse_sqrt and constant_with_warmup, do not know the total: a run with them stops at the budget).
FITTED_SCHEDULES = ("linear", "cosine")


class TimeFittedSchedule:
    """The learning-rate multiplier of a run whose length is a time budget (the run-length rule with
    --max_train_minutes): transformers' `linear` or `cosine` schedule (warm-up, then decay to 0 at the last step)
    over the steps the budget is expected to hold, so that the decay ends when the minutes do, on any machine.

    The expected total is re-estimated at each log line (`estimate`): the steps done plus the seconds left at the
    run's mean steps per second so far (validations and checkpoints included, as they spend the budget too), at most
    `most_steps`. Between estimates the schedule is transformers' own for that total; a new estimate moves the total
    a little, not the learning rate much. Give every process the same wall time (the main process's), so that all
    of them follow one schedule. Use `multiplier` as a LambdaLR's lambda."""

    def __init__(self, kind: str, warmup_steps: int, budget_seconds: float, most_steps: int):
        if kind not in FITTED_SCHEDULES:
            raise ValueError(f"a time-fitted schedule is one of {FITTED_SCHEDULES}, not {kind!r}")
        self.kind, self.warmup_steps, self.budget_seconds = kind, warmup_steps, budget_seconds
        self.most_steps = self.total_steps = most_steps  # until the first estimate

    def estimate(self, step: int, wall_seconds: float) -> int:
        """The expected total steps after `step` steps in `wall_seconds` of the budget (this run's and the runs it
        resumed); the same step count until a step has been timed."""
        if step > 0 and wall_seconds > 0:
            left = max(self.budget_seconds - wall_seconds, 0.0) * step / wall_seconds
            self.total_steps = min(self.most_steps, step + math.floor(left))
        return self.total_steps

    def finished(self, step: int) -> bool:
        """Whether the schedule has reached its end (the learning rate is 0 from here)."""
        return step >= self.total_steps

    def multiplier(self, step: int) -> float:
        """The learning rate's factor at `step` (transformers' get_scheduler formulas, num_cycles 0.5 for cosine)."""
        if step < self.warmup_steps:
            return step / max(1, self.warmup_steps)
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        if self.kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))
