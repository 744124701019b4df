"""evaluation.py: validation during a run (the divergence warning)."""

import itertools

import pytest
from helpers import run_quick

from hf_scratch_transformer.training import evaluation
from hf_scratch_transformer.training.evaluation import divergence_warning

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models on shared cores


def test_finite_divergence_is_reported_at_validation(tmp_path, monkeypatch, caplog):
    losses = itertools.chain([3.0], itertools.repeat(10.2))  # step 2, then step 4 and the final evaluation
    monkeypatch.setattr(evaluation, "evaluation_loss", lambda *args, **kwargs: next(losses))
    results = run_quick(tmp_path, max_steps=4, eval_steps=2, save_steps=0, warmup_steps=1)
    assert "training is diverging: validation loss 10.2 at step 4" in results["divergence_warning"]
    assert "--learning_rate" in results["divergence_warning"]
    assert any("training is diverging" in record.getMessage() for record in caplog.records)
    assert divergence_warning({"step": 10, "eval_loss": 3.1, "eval_bleu": 5.0}, [3.0], 400, 4) is None
