"""loop.py: the training loop under real conditions: streaming, signals, non-finite losses, the schedule, the
optimiser, the figures it measures. Runs of several processes are in test_distributed.py.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from batch_trace import traced_train_batch
from helpers import MODEL_CARD_TEMPLATE, REPO, fails_with, quick_flags, run_quick, run_tiny, tiny_run_flags
from safetensors.torch import load_file

from hf_scratch_transformer import ScratchTransformerForConditionalGeneration
from hf_scratch_transformer.training.loop import TrainingLoop
from hf_scratch_transformer.training.run import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models on shared cores


# ----------------------------------------------------------------------------------------------------------- streaming


def test_streaming_trains_checkpoints_and_resumes_exactly_in_one_process(tmp_path, monkeypatch):
    flags = dict(streaming=True, max_steps=6, save_steps=3, eval_steps=0, max_train_samples=24, max_tokens=0,
                 per_device_train_batch_size=8)  # 3 batches an epoch: the run crosses into a second one
    monkeypatch.setattr(TrainingLoop, "_train_batch", traced_train_batch(tmp_path))
    results = run_quick(tmp_path / "straight", **flags)
    assert results["train_steps"] == 6 and results["train_samples"] is None
    straight_trace = [json.loads(line) for line in (tmp_path / "rank-0.jsonl").read_text().splitlines()]
    (tmp_path / "rank-0.jsonl").unlink()
    run_quick(tmp_path / "resumed", **{**flags, "max_steps": 3})
    run_quick(tmp_path / "resumed", **flags, resume_from_checkpoint="latest")
    resumed_trace = [json.loads(line) for line in (tmp_path / "rank-0.jsonl").read_text().splitlines()]
    assert [(row["epoch"], row["indices"]) for row in resumed_trace] == \
        [(row["epoch"], row["indices"]) for row in straight_trace]
    assert any(row["epoch"] == 1 for row in straight_trace), "the stream must wrap into a second epoch"
    expected = load_file(tmp_path / "straight" / "model.safetensors")
    got = load_file(tmp_path / "resumed" / "model.safetensors")
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


# --------------------------------------------------------------------------------------- signals and non-finite losses


def test_sigterm_mid_training_saves_a_checkpoint_and_resume_latest_continues(tmp_path, capsys, monkeypatch):
    flags = tiny_run_flags(tmp_path, max_steps=10_000, logging_steps=1, save_steps=0, eval_steps=0,
                           max_train_samples=100, max_predict_samples=4)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, str(REPO / "train.py"), *flags], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    lines, stepped = [], threading.Event()

    def read_stderr():
        for line in process.stderr:
            lines.append(line)
            if '"step": 2,' in line:
                stepped.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert stepped.wait(240), "".join(lines)[-3000:]
        process.send_signal(signal.SIGTERM)
        process.wait(120)
    finally:
        process.kill()
    reader.join(10)
    assert process.returncode == 128 + signal.SIGTERM, "".join(lines)[-3000:]
    last = lines[-1].strip()
    assert last.startswith("interrupted: SIGTERM received: checkpoint saved at step ")
    assert last.endswith("continue with --resume_from_checkpoint latest")
    step = int(last.split("at step ")[1].split()[0])
    assert step >= 2 and (tmp_path / f"checkpoint-{step}" / "model.safetensors").is_file()
    assert not list(tmp_path.glob("*.tmp"))

    # resume in-process; optimiser and RNG states must load with weights_only=True
    loads, real_load = [], torch.load

    def spy(*args, **kwargs):
        loads.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    flags = tiny_run_flags(tmp_path, max_steps=step + 2, logging_steps=1, save_steps=0, eval_steps=0,
                           max_train_samples=100, max_predict_samples=4, resume_from_checkpoint="latest")
    assert main(flags, MODEL_CARD_TEMPLATE) == 0
    results = json.loads((tmp_path / "all_results.json").read_text())
    assert results["train_steps"] == step + 2
    assert loads and all(weights_only is True for weights_only in loads), loads


def test_sigint_mid_training_saves_a_checkpoint_with_exit_130(tmp_path, capsys, monkeypatch):
    real_loss = TrainingLoop._loss

    def loss_then_ctrl_c(self, batch):
        if self.state.global_step == 2:  # during step 3
            os.kill(os.getpid(), signal.SIGINT)
        return real_loss(self, batch)

    monkeypatch.setattr(TrainingLoop, "_loss", loss_then_ctrl_c)
    handler_before = signal.getsignal(signal.SIGINT)  # SIG_IGN under nohup or a background job
    message = fails_with(tiny_run_flags(tmp_path, max_steps=50, save_steps=0, eval_steps=0), capsys, code=130)
    assert message == (f"interrupted: SIGINT received: checkpoint saved at step 3 in {tmp_path / 'checkpoint-3'}; "
                       "continue with --resume_from_checkpoint latest")
    assert json.loads((tmp_path / "checkpoint-3" / "run_state.json").read_text())["global_step"] == 3
    assert signal.getsignal(signal.SIGINT) == handler_before  # handlers are given back


def test_non_finite_loss_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    real_loss = TrainingLoop._loss

    def nan_at_step_5(self, batch):
        loss = real_loss(self, batch)
        return loss * float("nan") if self.state.global_step == 4 else loss

    monkeypatch.setattr(TrainingLoop, "_loss", nan_at_step_5)
    message = fails_with(tiny_run_flags(tmp_path, max_steps=8, save_steps=2, eval_steps=0), capsys, code=1)
    assert message.startswith("training stopped: loss became nan at step 5;")
    assert f"the last good checkpoint is {tmp_path / 'checkpoint-4'}" in message
    assert "--resume_from_checkpoint latest" in message
    assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert not (tmp_path / "model.safetensors").exists()
    weights = load_file(tmp_path / "checkpoint-4" / "model.safetensors")
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
    model = ScratchTransformerForConditionalGeneration.from_pretrained(tmp_path / "checkpoint-4")
    assert model.num_parameters() > 0


def test_nan_advice_names_a_checkpoint_only_when_there_is_one(tmp_path, capsys, monkeypatch):
    real_loss = TrainingLoop._loss
    monkeypatch.setattr(TrainingLoop, "_loss", lambda self, batch: real_loss(self, batch) * float("nan"))
    assert main(quick_flags(tmp_path, max_steps=4, save_steps=0), MODEL_CARD_TEMPLATE) == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no checkpoint had been written yet" in message and "--overwrite_output_dir" in message
    assert "--resume_from_checkpoint" not in message
    # the advice works: the same command with --overwrite_output_dir starts again
    monkeypatch.setattr(TrainingLoop, "_loss", real_loss)
    assert main(quick_flags(tmp_path, max_steps=2, save_steps=0, eval_steps=0, overwrite_output_dir=True),
                MODEL_CARD_TEMPLATE) == 0


# ------------------------------------------------------------------------------- schedule, optimiser, measured figures


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_decaying_schedule_reaches_zero_at_the_last_step(tmp_path, schedule):
    run_tiny(tmp_path, lr_scheduler_type=schedule, learning_rate=1e-3, max_steps=6, warmup_steps=2, logging_steps=1,
             save_steps=0, eval_steps=0, do_train=True)
    rates = [row["learning_rate"] for row in json.loads((tmp_path / "training_history.json").read_text())
             if "learning_rate" in row]
    assert len(rates) == 6 and rates[1] == pytest.approx(1e-3) and rates[-1] == 0.0
    assert all(later < earlier for earlier, later in zip(rates[1:], rates[2:]))
    assert f"`{schedule}` decay" in (tmp_path / "README.md").read_text()


def test_the_optimiser_is_fused(tmp_path, monkeypatch):
    seen = {}
    real_train = TrainingLoop.train

    def record(self):
        seen["fused"] = self.optimizer.optimizer.defaults["fused"]
        return real_train(self)

    monkeypatch.setattr(TrainingLoop, "train", record)
    run_tiny(tmp_path, max_steps=2, save_steps=0, eval_steps=0, do_train=True)
    assert seen["fused"] is True


def test_tokens_per_second_counts_training_time_only(tmp_path, monkeypatch):
    """A step trains at least 0.2 s; saving and validation, which fall between log lines, take 0.5 s more each.
    The rate must count all the training time (at least 6 x 0.2 s: the old clock lost the part of a window before a
    save) and none of the saving and validation time (measured here)."""
    real_loss, real_save, real_validate, real_train = TrainingLoop._loss, TrainingLoop.save_checkpoint, TrainingLoop.validate, TrainingLoop.train
    spent = {"paused": 0.0, "train": 0.0, "inside": False}

    def slow_loss(self, batch):
        time.sleep(0.2)
        return real_loss(self, batch)

    def slow(real):
        def wrapper(self, *args, **kwargs):
            start = time.time()
            time.sleep(0.5)
            try:
                return real(self, *args, **kwargs)
            finally:
                if spent["inside"]:  # the final validation comes after train()
                    spent["paused"] += time.time() - start
        return wrapper

    def timed_train(self):
        start, spent["inside"] = time.time(), True
        try:
            real_train(self)
        finally:
            spent["train"], spent["inside"] = time.time() - start, False

    monkeypatch.setattr(TrainingLoop, "_loss", slow_loss)
    monkeypatch.setattr(TrainingLoop, "save_checkpoint", slow(real_save))
    monkeypatch.setattr(TrainingLoop, "validate", slow(real_validate))
    monkeypatch.setattr(TrainingLoop, "train", timed_train)
    results = run_quick(tmp_path, max_steps=6, logging_steps=3, save_steps=1, eval_steps=1, max_tokens=256,
                  max_train_samples=60)
    seconds = results["train_tokens"] / results["train_tokens_per_second"]
    assert seconds >= 6 * 0.2 * 0.99, seconds
    assert seconds <= spent["train"] - spent["paused"] + 0.1, (seconds, spent)
