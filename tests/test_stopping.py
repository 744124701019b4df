"""When a run ends: the run-length rule, early stopping and the best model, the time budget, resuming with the
patience counter. Validation BLEU is scripted (the real validation runs, then its BLEU is replaced) so that the
scores, and therefore the decisions, are known in advance."""

import json

import pytest
import torch
from helpers import run_quick
from safetensors.torch import load_file

from hf_scratch_transformer.training.arguments import RunArguments
from hf_scratch_transformer.training.recipe import run_length
from hf_scratch_transformer.training.evaluation import Evaluator
from hf_scratch_transformer.training.stopping import StoppingRules

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
