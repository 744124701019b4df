"""When a run ends: the run-length rule, early stopping and the best model, the time budget, resuming with the
patience counter. Validation BLEU is scripted (the real validation runs, then its BLEU is replaced) so that the
scores, and therefore the decisions, are known in advance."""

import json

import pytest
import torch
from helpers import run_quick
from safetensors.torch import load_file

from torch.optim.lr_scheduler import LambdaLR
from transformers import get_scheduler

from hf_scratch_transformer.training.arguments import RunArguments
from hf_scratch_transformer.training.recipe import DEFAULT_MAX_EPOCHS, STREAMED_MOST_STEPS, run_length
from hf_scratch_transformer.training.evaluation import Evaluator
from hf_scratch_transformer.training.stopping import StoppingRules, TimeFittedSchedule

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models on shared cores


# ---------------------------------------------------------------------------------------------- the run-length rule


@pytest.mark.parametrize("steps_per_epoch, total, eval_steps", [
    (1108, 3600, 2000),  # the shipped corpus: the step budget binds (3.2 epochs)
    (110, 3600, 220),  # 3,000 pairs: 33 epochs at most, validation every two epochs, early stopping does the rest
    (20, 2000, 200),  # a tiny corpus: 100 epochs, validation at least 200 steps apart
    (None, 3600, 2000),  # streamed: the epoch's length is unknown
])
def test_without_steps_or_epochs_the_rule_decides_and_stops_early(steps_per_epoch, total, eval_steps):
    length = run_length(RunArguments(), steps_per_epoch)
    assert (length.total_steps, length.eval_steps, length.source) == (total, eval_steps, "rule")
    assert length.patience == 3 and length.load_best and length.metric == "bleu" and length.greater_is_better
    assert "run-length rule" in length.describe() and f"{total:,} steps" in length.describe()


def test_given_steps_or_epochs_win_and_early_stopping_is_then_off_unless_asked():
    by_steps = run_length(RunArguments(max_steps=300), 1108)
    assert (by_steps.total_steps, by_steps.patience, by_steps.load_best, by_steps.source) == (300, 0, False,
                                                                                             "max_steps")
    by_epochs = run_length(RunArguments(num_train_epochs=2.5), 1108)
    assert (by_epochs.total_steps, by_epochs.source) == (2770, "epochs")
    asked = run_length(RunArguments(max_steps=300, early_stopping_patience=2, metric_for_best_model="eval_loss",
                                    eval_steps=50), 1108)
    assert (asked.patience, asked.load_best, asked.eval_steps, asked.metric, asked.greater_is_better) == (
        2, True, 50, "loss", False)
    kept_last = run_length(RunArguments(early_stopping_patience=2, load_best_model_at_end=False), 1108)
    assert kept_last.patience == 2 and not kept_last.load_best


def test_the_budget_counts_the_time_of_earlier_runs():
    class State:
        wall_seconds = 50.0
    now = [1000.0]
    rules = StoppingRules(run_length(RunArguments(), 100), 1.0, State(), clock=lambda: now[0])
    assert not rules.budget_spent()
    now[0] += 9.0
    assert not rules.budget_spent() and rules.wall_seconds() == 59.0
    now[0] += 1.0
    assert rules.budget_spent()


# ------------------------------------------------------------------------------------ a time budget under the rule


def test_with_minutes_and_no_steps_the_minutes_are_the_run_length():
    fitted = run_length(RunArguments(max_train_minutes=20), 1108, budget=5400)
    assert (fitted.source, fitted.total_steps, fitted.patience, fitted.load_best) == (
        "minutes", DEFAULT_MAX_EPOCHS * 1108, 3, True)  # the step budget is gone; 100 epochs stay a bound
    assert "the 20 minutes of --max_train_minutes" in fitted.describe() and "5,400 steps" in fitted.describe()
    assert fitted.epochs == pytest.approx(5400 / 1108)  # the dropout rule plans as for the step budget
    assert run_length(RunArguments(max_train_minutes=20), None).total_steps == STREAMED_MOST_STEPS
    assert run_length(RunArguments(max_train_minutes=20, max_steps=300), 1108).source == "max_steps"  # stops only
    assert run_length(RunArguments(max_train_minutes=20, num_train_epochs=2), 1108).source == "epochs"


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_the_fitted_schedule_is_transformers_schedule_over_the_steps_the_minutes_hold(kind):
    """At a steady 4 steps/s, 10 minutes hold 2,400 steps: the multipliers are get_scheduler's for 2,400 steps."""
    fitted = TimeFittedSchedule(kind, warmup_steps=100, budget_seconds=600, most_steps=10**6)
    assert fitted.estimate(step=200, wall_seconds=50.0) == 2400
    reference = get_scheduler(kind, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                              num_warmup_steps=100, num_training_steps=2400)
    for step in (0, 50, 100, 101, 1000, 2000, 2399, 2400):
        assert fitted.multiplier(step) == pytest.approx(reference.lr_lambdas[0](step), abs=1e-12)
    assert fitted.finished(2400) and not fitted.finished(2399)
    assert fitted.estimate(step=1200, wall_seconds=400.0) == 1200 + 600  # slower since: fewer steps, an earlier end
    assert fitted.estimate(step=1900, wall_seconds=700.0) == 1900  # over the budget: the schedule ends here
    assert TimeFittedSchedule(kind, 100, 600, most_steps=1000).estimate(200, 50.0) == 1000  # 100 epochs bind


def lr_by_step(results_dir) -> dict[int, float]:
    rows = json.loads((results_dir / "training_history.json").read_text())
    return {row["step"]: row["learning_rate"] for row in rows if "learning_rate" in row}


def test_a_run_of_the_rule_with_minutes_fits_its_schedule_to_them(tmp_path, monkeypatch):
    """A clock of 2 s a step: 1 minute holds 30 steps, and the run is the --max_steps 30 run (the same learning rate at
    every logged step, 0 at the last), ended where its schedule ends (step 30, though the budget is checked at log
    lines, every 4 steps: 28 and 32); the old rule (the step budget, cut by the minutes) would have stopped at step
    32 at nearly the full learning rate."""
    monkeypatch.setattr(StoppingRules, "wall_seconds", lambda self: self.state.global_step * 2.0)
    flags = dict(eval_steps=0, save_steps=0, logging_steps=4)
    fitted = run_quick(tmp_path / "fitted", max_steps=None, max_train_minutes=1, **flags)
    assert fitted["train_steps"] == 30 and fitted["stop_reason"] == "time_budget"
    assert "the run's length, was spent at step 30" in fitted["stop_detail"]
    by_steps = run_quick(tmp_path / "steps", max_steps=30, **flags)
    assert lr_by_step(tmp_path / "fitted") == pytest.approx(lr_by_step(tmp_path / "steps"), abs=1e-12)
    assert lr_by_step(tmp_path / "fitted")[30] == 0.0


def test_a_resumed_run_fits_its_schedule_to_the_minutes_left(tmp_path, monkeypatch):
    """Resumed with a longer budget, the run goes on where it was, with the time it spent counted: 1 minute at 2 s a
    step ends at step 30, on the schedule a fresh 1-minute run has from the resumed step on."""
    monkeypatch.setattr(StoppingRules, "wall_seconds", lambda self: self.state.global_step * 2.0)
    flags = dict(max_steps=None, eval_steps=0, save_steps=0)
    first = run_quick(tmp_path / "run", max_train_minutes=0.2, **flags)
    assert first["train_steps"] == 6 and first["stop_reason"] == "time_budget"
    resumed = run_quick(tmp_path / "run", max_train_minutes=1, resume_from_checkpoint="latest", **flags)
    assert resumed["train_steps"] == 30 and resumed["stop_reason"] == "time_budget"
    fresh = TimeFittedSchedule("linear", 4, 60, 10**6)
    fresh.estimate(8, 16.0)
    logged = lr_by_step(tmp_path / "run")
    assert logged[8] == pytest.approx(2e-3 * fresh.multiplier(8)) and logged[30] == 0.0
    assert isinstance(LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                               fresh.multiplier).state_dict(), dict)  # the schedule's state is saved as LambdaLR's


# ----------------------------------------------------------------------------------------------------- in a run


def script_bleu(monkeypatch, scores: dict[int, float]):
    """Validation runs as usual, then reports scores[step] (0.0 for steps not listed) as its BLEU."""
    real = Evaluator.validate

    def validate(self, state):
        row = real(self, state)
        if row:
            row["eval_bleu"] = scores.get(row["step"], 0.0)
            state.history[-1]["eval_bleu"] = row["eval_bleu"]
        return row

    monkeypatch.setattr(Evaluator, "validate", validate)


STOPPING = dict(eval_steps=4, save_steps=0, save_total_limit=1, early_stopping_patience=2, logging_steps=4)


def test_early_stopping_ends_the_run_and_saves_the_best_validated_model(tmp_path, monkeypatch):
    script_bleu(monkeypatch, {4: 5.0, 8: 7.0, 12: 6.0, 16: 6.5, 20: 9.0})
    output_dir = tmp_path / "run"
    results = run_quick(output_dir, max_steps=40, **STOPPING)
    assert results["stop_reason"] == "early_stopping" and results["train_steps"] == 16  # 12 and 16 were worse
    assert (results["best_step"], results["best_metric"], results["best_model_checkpoint"]) == (8, 7.0,
                                                                                                "checkpoint-8")
    assert "early stopping at step 16" in results["stop_detail"]
    # the best checkpoint survives rotation (save_total_limit 1), and the saved model holds its weights
    best, saved = load_file(output_dir / "checkpoint-8" / "model.safetensors"), load_file(
        output_dir / "model.safetensors")
    last = load_file(output_dir / "checkpoint-16" / "model.safetensors")
    assert all(torch.equal(best[name], saved[name]) for name in best)
    assert not all(torch.equal(last[name], saved[name]) for name in last)
    assert results["eval_bleu"] == 7.0  # the final validation is the best model's, not made again
    card = (output_dir / "README.md").read_text()
    assert "early stopping at step 16" in card and "checkpoint-8" in card


def test_the_time_budget_ends_the_run_cleanly(tmp_path, monkeypatch):
    monkeypatch.setattr(StoppingRules, "wall_seconds", lambda self: self.state.global_step * 10.0)
    output_dir = tmp_path / "run"
    results = run_quick(output_dir, max_steps=40, max_train_minutes=1, eval_steps=0, logging_steps=2,
                        save_steps=0)
    assert results["stop_reason"] == "time_budget" and results["train_steps"] == 6  # 60 s at the log of step 6
    assert "--max_train_minutes" in results["stop_detail"]
    assert {"predict_bleu", "eval_bleu"} <= set(results)  # evaluated, tested and saved as at a last step
    assert (output_dir / "model.safetensors").is_file() and (output_dir / "checkpoint-6").is_dir()
    assert "--max_train_minutes" in (output_dir / "README.md").read_text()


def test_a_resumed_run_keeps_its_patience_counter_and_best_score(tmp_path, monkeypatch):
    script_bleu(monkeypatch, {4: 5.0, 8: 7.0, 12: 6.0, 16: 6.5, 20: 6.0, 24: 9.0})
    flags = {**STOPPING, "early_stopping_patience": 3, "save_steps": 4}
    output_dir = tmp_path / "run"
    first = run_quick(output_dir, max_steps=12, **flags)
    assert first["stop_reason"] == "max_steps"
    state = json.loads((output_dir / "checkpoint-12" / "run_state.json").read_text())
    assert (state["best_metric"], state["best_step"], state["validations_without_improvement"]) == (7.0, 8, 1)
    resumed = run_quick(output_dir, max_steps=40, resume_from_checkpoint="latest", **flags)
    # 12, 16 and 20 without a better score than step 8's: a fresh counter would have gone on to step 24's 9.0
    assert resumed["stop_reason"] == "early_stopping" and resumed["train_steps"] == 20
    assert resumed["best_step"] == 8


def test_the_reason_a_run_ended_is_in_the_results_and_the_card(tmp_path):
    output_dir = tmp_path / "run"
    results = run_quick(output_dir, max_steps=4, eval_steps=0)
    assert results["stop_reason"] == "max_steps" and results["stop_detail"] == "reached --max_steps (4 steps)"
    assert json.loads((output_dir / "all_results.json").read_text())["stop_reason"] == "max_steps"
    assert "reached --max_steps (4 steps)" in (output_dir / "README.md").read_text()
