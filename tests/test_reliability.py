"""Several processes, streaming, locks and resumes under real conditions (issue 12).

The 2-process tests start `accelerate launch` with 2 CPU processes (gloo) and count the ranks from the batches each
one records (HF_SCRATCH_BATCH_TRACE): they fail if only one process trains or if two ranks see the same batch.
"""

import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest_train import MODEL_CARD_TEMPLATE, REPO, tiny_run_flags
from safetensors.torch import load_file

from hf_scratch_transformer import evaluation
from hf_scratch_transformer.arguments import parse_arguments
from hf_scratch_transformer.checkpointing import CHECKPOINT_COMPLETE, LOCK_FILE, list_checkpoints
from hf_scratch_transformer.evaluation import divergence_warning
from hf_scratch_transformer.loop import BATCH_TRACE_VARIABLE, Trainer
from hf_scratch_transformer.training import main, run_training


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on shared cores
    yield
    torch.set_num_threads(threads)


# Smaller than tiny_run_flags' defaults: these tests check the mechanics, not what the model learns.
QUICK = dict(max_train_samples=80, max_eval_samples=4, max_predict_samples=2, num_beams=1, eval_max_new_tokens=4,
             max_tokens=512)


def quick_flags(output_dir, **overrides) -> list[str]:
    return tiny_run_flags(output_dir, **{**QUICK, **overrides})


def run(output_dir, **overrides) -> dict:
    return run_training(*parse_arguments(quick_flags(output_dir, **overrides)), MODEL_CARD_TEMPLATE)


def read_trace(directory) -> dict[int, list[dict]]:
    ranks = {}
    for path in sorted(directory.glob("rank-*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        ranks[rows[0]["rank"]] = rows
    return ranks


def launch_two(output_dir, trace_dir, **overrides) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file configs/accelerate/cpu_2proc.yaml train.py ...`, as the README says."""
    trace_dir.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "configs" / "accelerate" / "cpu_2proc.yaml"), "--main_process_port", str(_free_port()),
               str(REPO / "train.py"), *quick_flags(output_dir, **overrides)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", BATCH_TRACE_VARIABLE: str(trace_dir), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def assert_two_ranks_on_disjoint_batches(trace: dict, steps: int) -> None:
    assert sorted(trace) == [0, 1], "two processes must each have trained"
    for rank, rows in trace.items():
        assert {row["world_size"] for row in rows} == {2}
        assert [row["step"] for row in rows] == list(range(1, steps + 1)), rank
    seen = [(row["epoch"], index) for rows in trace.values() for row in rows for index in row["indices"]]
    assert len(seen) == len(set(seen)), "an example was trained on by both ranks in the same epoch"


# ------------------------------------------------------------------------------------------------ several processes


def test_two_cpu_processes_train_on_disjoint_batches(tmp_path):
    output_dir, trace_dir = tmp_path / "out", tmp_path / "trace"
    launch_two(output_dir, trace_dir, max_steps=4, eval_steps=0, save_steps=2)
    assert_two_ranks_on_disjoint_batches(read_trace(trace_dir), steps=4)
    results = json.loads((output_dir / "all_results.json").read_text())
    assert results["train_steps"] == 4
    assert "2 process(es)" in (output_dir / "README.md").read_text()
    # each rank's random state is in the checkpoint, and the completion marker lists it
    marker = json.loads((output_dir / "checkpoint-4" / CHECKPOINT_COMPLETE).read_text())
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors", "run_state.json"} <= set(
        marker["files"])
    assert json.loads((output_dir / "checkpoint-4" / "run_state.json").read_text())["world_size"] == 2
    assert not (output_dir / LOCK_FILE).exists()


STREAM_FLAGS = dict(streaming=True, max_steps=4, save_steps=2, eval_steps=0, max_train_samples=200)


@pytest.fixture(scope="module")
def two_process_stream(tmp_path_factory):
    """A --streaming run of 4 steps by 2 processes: (output directory, per-rank trace)."""
    root = tmp_path_factory.mktemp("stream2")
    launch_two(root / "straight", root / "trace-straight", **STREAM_FLAGS)
    return root / "straight", read_trace(root / "trace-straight")


def test_two_cpu_processes_stream_disjoint_batches(two_process_stream):
    output_dir, trace = two_process_stream
    assert_two_ranks_on_disjoint_batches(trace, steps=4)
    assert json.loads((output_dir / "all_results.json").read_text())["train_steps"] == 4
    assert json.loads((output_dir / "checkpoint-4" / "run_state.json").read_text())["world_size"] == 2


@pytest.mark.slow  # three 2-process launches; the 1-process resume below runs in every suite
def test_two_cpu_processes_resume_the_stream_position(two_process_stream, tmp_path):
    flags = STREAM_FLAGS
    straight, trace = two_process_stream
    resumed = tmp_path / "resumed"
    # the same run stopped after step 2, then resumed from checkpoint-2 by two processes
    launch_two(resumed, tmp_path / "trace-first", **{**flags, "max_steps": 2})
    launch_two(resumed, tmp_path / "trace-second", **flags, resume_from_checkpoint="latest")
    second = read_trace(tmp_path / "trace-second")
    for rank in (0, 1):
        assert [row["step"] for row in second[rank]] == [3, 4]
        assert [row["indices"] for row in second[rank]] == [row["indices"] for row in trace[rank][2:]]
    expected, got = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


# ------------------------------------------------------------------------------------------------------- streaming


def test_streaming_trains_checkpoints_and_resumes_exactly_in_one_process(tmp_path, monkeypatch):
    flags = dict(streaming=True, max_steps=6, save_steps=3, eval_steps=0, max_train_samples=24, max_tokens=0,
                 per_device_train_batch_size=8)  # 3 batches an epoch: the run crosses into a second one
    monkeypatch.setenv(BATCH_TRACE_VARIABLE, str(tmp_path))
    results = run(tmp_path / "straight", **flags)
    assert results["train_steps"] == 6 and results["train_samples"] is None
    straight_trace = [json.loads(line) for line in (tmp_path / "rank-0.jsonl").read_text().splitlines()]
    (tmp_path / "rank-0.jsonl").unlink()
    run(tmp_path / "resumed", **{**flags, "max_steps": 3})
    run(tmp_path / "resumed", **flags, resume_from_checkpoint="latest")
    resumed_trace = [json.loads(line) for line in (tmp_path / "rank-0.jsonl").read_text().splitlines()]
    assert [(row["epoch"], row["indices"]) for row in resumed_trace] == \
        [(row["epoch"], row["indices"]) for row in straight_trace]
    assert any(row["epoch"] == 1 for row in straight_trace), "the stream must wrap into a second epoch"
    expected = load_file(tmp_path / "straight" / "model.safetensors")
    got = load_file(tmp_path / "resumed" / "model.safetensors")
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


# -------------------------------------------------------------------------------------------- locks and checkpoints


def test_a_stale_lock_is_taken_over_and_the_lock_is_released_after_the_run(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that existed and is gone
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "hostname": platform.node()}))
    run(tmp_path, max_steps=2, save_steps=0, eval_steps=0)
    assert not (tmp_path / LOCK_FILE).exists()
    assert (tmp_path / "model.safetensors").is_file()


def test_a_second_concurrent_run_is_refused_and_the_first_one_goes_on(tmp_path):
    """Two real runs into one directory: while the first holds the lock, the second exits 2 and writes nothing; the
    first is then stopped with SIGINT and saves a checkpoint that exists."""
    trace_dir = tmp_path.parent / f"{tmp_path.name}-trace"
    trace_dir.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", BATCH_TRACE_VARIABLE: str(trace_dir),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    first = subprocess.Popen([sys.executable, str(REPO / "train.py"),
                              *quick_flags(tmp_path, max_steps=100_000, save_steps=0, eval_steps=0)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        deadline = time.time() + 120
        while not (tmp_path / LOCK_FILE).exists() and time.time() < deadline:
            time.sleep(0.1)
        before = sorted(path.name for path in tmp_path.iterdir())
        second = subprocess.run([sys.executable, str(REPO / "train.py"), *quick_flags(tmp_path, max_steps=2)],
                                capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        assert second.returncode == 2, second.stderr[-2000:]
        message = second.stderr.strip().splitlines()[-1]
        assert message.startswith(f"error: output directory {tmp_path} is in use by another run (pid {first.pid} on ")
        assert first.poll() is None, "the first run must still be training"
        after = sorted(path.name for path in tmp_path.iterdir() if not path.name.startswith("checkpoint-"))
        assert set(after) <= set(before) | {".tokenizer"}
        trace = trace_dir / "rank-0.jsonl"
        while not (trace.exists() and trace.stat().st_size) and first.poll() is None and time.time() < deadline:
            time.sleep(0.1)  # the first run is in its training loop once it has recorded a batch
        first.send_signal(2)  # SIGINT
        _, first_err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, first_err[-2000:]
    stop = first_err.strip().splitlines()[-1]
    assert stop.startswith("interrupted: SIGINT received: checkpoint saved at step")
    saved = stop.split(" in ")[-1].split(";")[0]
    assert list_checkpoints(tmp_path)[-1] == Path(saved)
    assert not (tmp_path / LOCK_FILE).exists()


def test_resuming_an_older_checkpoint_moves_the_newer_ones_aside_when_asked(tmp_path, capsys):
    run(tmp_path, max_steps=4, save_steps=2, eval_steps=0)
    newer = load_file(tmp_path / "checkpoint-4" / "model.safetensors")
    run(tmp_path, max_steps=4, save_steps=2, eval_steps=0, resume_from_checkpoint=str(tmp_path / "checkpoint-2"),
        overwrite_newer_checkpoints=True, learning_rate=0.001)
    [aside] = tmp_path.glob("abandoned-after-2-*")
    assert sorted(path.name for path in aside.iterdir()) == ["checkpoint-4"]
    assert all(torch.equal(newer[name], value) for name, value in
               load_file(aside / "checkpoint-4" / "model.safetensors").items())  # kept as it was
    assert [path.name for path in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]  # rotation kept
    state = json.loads((tmp_path / "checkpoint-4" / "run_state.json").read_text())
    assert state["global_step"] == 4


def test_a_checkpoint_counts_only_with_its_completion_marker_and_files(tmp_path):
    run(tmp_path, max_steps=4, save_steps=2, eval_steps=0)
    assert [path.name for path in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]
    (tmp_path / "checkpoint-4" / "optimizer.bin").unlink()  # a file listed by the marker is gone
    assert [path.name for path in list_checkpoints(tmp_path)] == ["checkpoint-2"]
    (tmp_path / "checkpoint-2" / CHECKPOINT_COMPLETE).unlink()  # no marker: not complete
    assert list_checkpoints(tmp_path) == []
    # ... unless written by the version before markers (its run state has no world_size): still resumable
    state_file = tmp_path / "checkpoint-2" / "run_state.json"
    state = json.loads(state_file.read_text())
    del state["world_size"], state["settings"]
    state_file.write_text(json.dumps(state))
    assert [path.name for path in list_checkpoints(tmp_path)] == ["checkpoint-2"]


# ---------------------------------------------------------------------------------------------- measured figures


def test_tokens_per_second_counts_training_time_only(tmp_path, monkeypatch):
    """A step trains at least 0.2 s; saving and validation, which fall between log lines, take 0.5 s more each.
    The rate must count all the training time (at least 6 x 0.2 s: the old clock lost the part of a window before a
    save) and none of the saving and validation time (measured here)."""
    real_loss, real_save, real_validate, real_train = Trainer._loss, Trainer.save_checkpoint, Trainer.validate, Trainer.train
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

    monkeypatch.setattr(Trainer, "_loss", slow_loss)
    monkeypatch.setattr(Trainer, "save_checkpoint", slow(real_save))
    monkeypatch.setattr(Trainer, "validate", slow(real_validate))
    monkeypatch.setattr(Trainer, "train", timed_train)
    results = run(tmp_path, max_steps=6, logging_steps=3, save_steps=1, eval_steps=1, max_tokens=256,
                  max_train_samples=60)
    seconds = results["train_tokens"] / results["train_tokens_per_second"]
    assert seconds >= 6 * 0.2 * 0.99, seconds
    assert seconds <= spent["train"] - spent["paused"] + 0.1, (seconds, spent)


def test_finite_divergence_is_reported_at_validation(tmp_path, monkeypatch, caplog):
    losses = itertools.chain([3.0], itertools.repeat(10.2))  # step 2, then step 4 and the final evaluation
    monkeypatch.setattr(evaluation, "evaluation_loss", lambda *args, **kwargs: next(losses))
    results = run(tmp_path, max_steps=4, eval_steps=2, save_steps=0, warmup_steps=1)
    assert "training is diverging: validation loss 10.2 at step 4" in results["divergence_warning"]
    assert "--learning_rate" in results["divergence_warning"]
    assert any("training is diverging" in record.getMessage() for record in caplog.records)
    assert divergence_warning({"step": 10, "eval_loss": 3.1, "eval_bleu": 5.0}, [3.0], 400, 4) is None


def test_nan_advice_names_a_checkpoint_only_when_there_is_one(tmp_path, capsys, monkeypatch):
    real_loss = Trainer._loss
    monkeypatch.setattr(Trainer, "_loss", lambda self, batch: real_loss(self, batch) * float("nan"))
    assert main(quick_flags(tmp_path, max_steps=4, save_steps=0), MODEL_CARD_TEMPLATE) == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no checkpoint had been written yet" in message and "--overwrite_output_dir" in message
    assert "--resume_from_checkpoint" not in message
    # the advice works: the same command with --overwrite_output_dir starts again
    monkeypatch.setattr(Trainer, "_loss", real_loss)
    assert main(quick_flags(tmp_path, max_steps=2, save_steps=0, eval_steps=0, overwrite_output_dir=True),
                MODEL_CARD_TEMPLATE) == 0
