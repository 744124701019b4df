"""The GPU training-throughput benchmark's code path, in its CPU smoke mode (the GPU figures need a GPU)."""

import json

import pytest



@pytest.mark.filterwarnings("ignore")
def test_quick_mode_measures_both_models_on_train_py_batches(tmp_path):
    from training_throughput import main

    results = main(["--quick", "--output", str(tmp_path / "throughput.json")])
    assert json.loads((tmp_path / "throughput.json").read_text())["models"].keys() == {"scratch", "marian"}
    assert results["batches"] == 3 and results["non_pad_tokens_per_pass"] > 1000
    assert results["padding_fraction"] < 0.2  # token-bucketed, as train.py's batches
    for row in results["models"].values():
        assert row["tokens_per_second"] > 0 and 0 < row["mfu"] < 1  # model FLOPs can never beat the matmul peak
        assert len(row["seconds_per_pass"]) == 2
    assert "| scratch |" in (tmp_path / "throughput.md").read_text()
