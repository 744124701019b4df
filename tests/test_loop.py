"""loop.py: the training loop under real conditions: streaming, signals, non-finite losses, the schedule, the
optimiser, the figures it measures, and its pieces (what is due at step N). Tests reach into a run through the loop's
public callback hook (`TrainingCallback`, `training_callbacks`). Runs of several processes are in test_distributed.py.
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
from batch_trace import BatchTrace
from helpers import MODEL_CARD_TEMPLATE, REPO, fails_with, quick_flags, run_quick, run_tiny, tiny_run_flags
from safetensors.torch import load_file

from hf_scratch_transformer import ScratchTransformerForConditionalGeneration
from hf_scratch_transformer.data.batching import padding_fraction
from hf_scratch_transformer.data.preprocessing import sequence_lengths
from hf_scratch_transformer.training.loop import StepSchedule, TrainingCallback, training_callbacks
from hf_scratch_transformer.training.run import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models on shared cores


# ----------------------------------------------------------------------------------------------------------- streaming


def test_streaming_trains_checkpoints_and_resumes_exactly_in_one_process(tmp_path, monkeypatch):
    flags = dict(streaming=True, max_steps=6, save_steps=3, eval_steps=0, max_train_samples=24, max_tokens=0,
                 per_device_train_batch_size=8, cpu_threads=1)  # 3 batches an epoch: the run crosses into a second one;
    # the thread count pinned: bit for bit only at a pinned count
    with training_callbacks(BatchTrace(tmp_path)):
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


class SignalAt(TrainingCallback):
    """Sends this process `signum` (a real signal, through the kernel) at the end of step `step`."""

    def __init__(self, step: int, signum: int = signal.SIGINT):
        self.step, self.signum = step, signum

    def on_step_end(self, loop) -> None:
        if loop.state.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class NanWeightsAt(TrainingCallback):
    """Sets the shared embedding to NaN at the end of step `step` (0: before the first step): the next loss is NaN."""

    def __init__(self, step: int):
        self.step = step

    def on_train_begin(self, loop) -> None:
        if self.step == 0:
            self.poison(loop)

    def on_step_end(self, loop) -> None:
        if loop.state.global_step == self.step:
            self.poison(loop)

    @staticmethod
    def poison(loop) -> None:
        with torch.no_grad():
            loop.model.get_input_embeddings().weight.fill_(float("nan"))


def test_sigint_mid_training_saves_a_checkpoint_with_exit_130(tmp_path, capsys):
    handler_before = signal.getsignal(signal.SIGINT)  # SIG_IGN under nohup or a background job
    with training_callbacks(SignalAt(2)):  # after step 2: step 3 is being trained when it is seen
        message = fails_with(tiny_run_flags(tmp_path, max_steps=50, save_steps=0, eval_steps=0), capsys, code=130)
    assert message == (f"interrupted: SIGINT received: checkpoint saved at step 3 in {tmp_path / 'checkpoint-3'}; "
                       "continue with --resume_from_checkpoint latest")
    assert json.loads((tmp_path / "checkpoint-3" / "run_state.json").read_text())["global_step"] == 3
    assert signal.getsignal(signal.SIGINT) == handler_before  # handlers are given back


def test_non_finite_loss_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    with training_callbacks(NanWeightsAt(4)):  # after checkpoint-4 is saved: the loss of step 5 is NaN
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


def test_nan_advice_names_a_checkpoint_only_when_there_is_one(tmp_path, capsys):
    with training_callbacks(NanWeightsAt(0)):
        assert main(quick_flags(tmp_path, max_steps=4, save_steps=0), MODEL_CARD_TEMPLATE) == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("training stopped: loss became nan at step 1;")
    assert "no checkpoint had been written yet" in message and "--overwrite_output_dir" in message
    assert "--resume_from_checkpoint" not in message
    # the advice works: the same command with --overwrite_output_dir starts again
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


def test_the_optimiser_is_fused(tmp_path):
    class Optimiser(TrainingCallback):
        def on_train_begin(self, loop):
            seen["fused"] = loop.optimizer.optimizer.defaults["fused"]

    seen = {}
    with training_callbacks(Optimiser()):
        run_tiny(tmp_path, max_steps=2, save_steps=0, eval_steps=0, do_train=True)
    assert seen["fused"] is True


class SlowTraining(TrainingCallback):
    """Each batch trains 0.2 s longer; each checkpoint and validation during training takes 0.5 s more (`paused`
    counts those)."""

    def __init__(self):
        self.paused = 0.0

    def on_batch_end(self, loop, indices, batch, loss):
        time.sleep(0.2)

    def on_save(self, loop, checkpoint):
        self.paused += 0.5
        time.sleep(0.5)

    def on_evaluate(self, loop, row):
        self.paused += 0.5
        time.sleep(0.5)


def test_tokens_per_second_counts_training_time_only(tmp_path):
    """The rate must count all the training time (at least 6 x 0.2 s: the old clock lost the part of a window before
    a save) and none of the time of saving and validating (at least 0.5 s each, out of the training phase's
    runtime)."""
    slow = SlowTraining()
    with training_callbacks(slow):
        results = run_quick(tmp_path, max_steps=6, logging_steps=3, save_steps=1, eval_steps=1, max_tokens=256,
                            max_train_samples=60)
    seconds = results["train_tokens"] / results["train_tokens_per_second"]
    assert slow.paused >= 11 * 0.5  # 6 checkpoints and 5 validations during training (the last step: after it)
    assert seconds >= 6 * 0.2 * 0.99, seconds
    assert seconds <= results["train_runtime"] - slow.paused + 0.1, (seconds, results["train_runtime"], slow.paused)


class CollatedPadding(TrainingCallback):
    """The padding of the batches as the loop trained them, and that of the same batches by the lengths before the
    training-time changes to the sources."""

    def __init__(self):
        self.tokens = self.positions = 0
        self.sampler_figure = None

    def on_train_begin(self, loop):
        self.sampler_figure = padding_fraction(list(loop.batches.sampler), *sequence_lengths(loop.batches.dataset))

    def on_batch_end(self, loop, indices, batch, loss):
        self.tokens += int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
        self.positions += batch["input_ids"].numel() + batch["labels"].numel()


def test_the_padding_fraction_is_that_of_the_batches_trained_after_the_source_changes(tmp_path):
    """Paraphrases in place of most sources change their lengths: the run's train_padding_fraction must be the
    padding of the collated batches it trained on, not a figure from the lengths before the changes (which read
    3.6 % where a default run's batches, then packed by those lengths, held 15.7 %)."""
    collated = CollatedPadding()
    with training_callbacks(collated):
        results = run_quick(tmp_path, max_steps=6, logging_steps=2, save_steps=0, eval_steps=0, do_train=True,
                            source_paraphrase_rate=0.9)
    measured = 1 - collated.tokens / collated.positions
    assert results["train_padding_fraction"] == pytest.approx(measured, abs=1e-4)
    assert abs(measured - collated.sampler_figure) > 0.02, (measured, collated.sampler_figure)  # told apart


# ---------------------------------------------------------------------------------------------- what is due at step N


def test_what_is_due_at_each_step():
    schedule = StepSchedule(logging_steps=3, eval_steps=4, save_steps=5, total_steps=10, validate_last=False)
    due = {step: schedule.at(step) for step in range(1, 11)}
    assert [step for step, d in due.items() if d.log] == [3, 6, 9, 10]  # and the last step
    assert [step for step, d in due.items() if d.validation] == [4, 8]  # the last one only for the best model
    assert [step for step, d in due.items() if d.checkpoint] == [5, 10]
    assert not due[1] and due[3] and due[4] and due[5]
    best_model = StepSchedule(3, 4, 0, 10, validate_last=True)
    assert [step for step in range(1, 11) if best_model.at(step).validation] == [4, 8, 10]
    assert not any(best_model.at(step).checkpoint for step in range(1, 11))  # --save_steps 0
    assert not any(StepSchedule(3, 0, 5, 10, True).at(step).validation for step in range(1, 11))  # --eval_steps 0
