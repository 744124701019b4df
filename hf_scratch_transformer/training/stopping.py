"""When a training run ends, and which of its models is the best: the last step, early stopping after validations
without improvement (transformers' `early_stopping_patience` / `metric_for_best_model`), a training-time budget
(fairseq's `--stop-time-hours`). What it tracks lives in the run state, so a resumed run keeps its patience counter,
its best score and the time already spent."""

import time
from collections.abc import Callable

METRIC_NAMES = {"bleu": "BLEU", "chrf": "chrF", "loss": "loss"}
BEST_MODEL_METRICS = {"bleu": True, "chrf": True, "loss": False}  # metric -> greater is better


def best_model_metric(args) -> str:
    """--metric_for_best_model without transformers' optional `eval_` prefix."""
    return args.metric_for_best_model.removeprefix("eval_")


class StoppingRules:
    """The end of a run: `length` is the run's recipe.RunLength (recipe.py imports this module, so it is not
    imported here); `state` (a RunState) holds what is tracked; `clock` is time.time (tests pass their own)."""

    def __init__(self, length, max_train_minutes: float, state, clock: Callable[[], float] = time.time):
        self.length, self.budget_seconds, self.state, self.clock = length, max_train_minutes * 60, state, clock
        self.started, self.wall_before = clock(), state.wall_seconds

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
        return self.budget_seconds > 0 and self.wall_seconds() >= self.budget_seconds

    def reason_at_the_last_step(self) -> str:
        return {"max_steps": "max_steps", "epochs": "epochs", "rule": "step_budget"}[self.length.source]

    def detail(self) -> str:
        """Why the run ended, in words, from `state.stop_reason`."""
        state, length, reason = self.state, self.length, self.state.stop_reason
        if reason == "early_stopping":
            return (f"early stopping at step {state.global_step:,}: {length.patience} validations without a better "
                    f"validation {METRIC_NAMES[length.metric]} than {state.best_metric} (step {state.best_step:,})")
        if reason == "time_budget":
            return (f"the --max_train_minutes budget ({self.budget_seconds / 60:g} min) was spent at step "
                    f"{state.global_step:,}")
        return {"max_steps": f"reached --max_steps ({state.global_step:,} steps)",
                "epochs": f"completed --num_train_epochs ({state.global_step:,} steps)",
                "step_budget": f"reached the run-length rule's {length.total_steps:,} steps"}[reason]
