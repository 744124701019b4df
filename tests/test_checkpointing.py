"""checkpointing.py: complete checkpoints, resuming (bit for bit, or refused with one line), averaging, the lock."""

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, digests, fails_with, quick_flags, run_quick, run_tiny, saved_files, tiny_run_flags
from safetensors.torch import load_file

from hf_scratch_transformer.checkpointing import CHECKPOINT_COMPLETE, LOCK_FILE, list_checkpoints

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models on shared cores


# ------------------------------------------------------------------------------------------------------------ resuming


def test_stop_and_resume_ends_with_the_same_weights(tmp_path):
    flags = dict(max_steps=12, save_steps=4, eval_steps=0, max_train_samples=40, max_tokens=256)
    run_tiny(tmp_path / "straight", **flags)
    run_tiny(tmp_path / "resumed", **{**flags, "max_steps": 6})  # stops after step 6, checkpoint-6 written
    run_tiny(tmp_path / "resumed", **flags, resume_from_checkpoint="latest")
    straight = load_file(tmp_path / "straight" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    state = json.loads((tmp_path / "resumed" / "checkpoint-12" / "run_state.json").read_text())
    assert state["global_step"] == 12 and state["epoch"] >= 1  # the run crossed an epoch boundary


def test_resume_with_another_model_config_is_refused(finished_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = digests(run_dir / "checkpoint-4")
    message = fails_with(tiny_run_flags(run_dir, max_steps=6, save_steps=2, eval_steps=0, d_model=96, ffn_dim=128,
                                        resume_from_checkpoint="latest"), capsys)
    assert "checkpoint-4 was made with another model config (" in message
    assert "d_model 64 -> 96" in message and "encoder_ffn_dim 256 -> 128" in message
    assert "resume with the same --preset and size flags" in message
    assert digests(run_dir / "checkpoint-4") == before and saved_files(run_dir) == saved_files(finished_run)


def test_resume_from_a_half_copied_checkpoint_is_refused(finished_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    weights = run_dir / "checkpoint-4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    # the truncated checkpoint no longer counts as complete (its completion marker records the sizes) ...
    message = fails_with(tiny_run_flags(run_dir, max_steps=6, resume_from_checkpoint=str(run_dir / "checkpoint-4")),
                         capsys)
    assert f"--resume_from_checkpoint {run_dir / 'checkpoint-4'}: not a complete checkpoint" in message
    assert "model.safetensors is missing or has another size" in message
    # ... so `latest` is checkpoint-2, and resuming from it would overwrite checkpoint-4: refused, both named
    message = fails_with(tiny_run_flags(run_dir, max_steps=6, resume_from_checkpoint="latest"), capsys)
    assert f"resuming from {run_dir / 'checkpoint-2'} (step 2)" in message
    assert "checkpoint-4 (incomplete)" in message and "--overwrite_newer_checkpoints" in message


def test_resume_from_a_corrupted_checkpoint_is_refused(finished_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    weights = run_dir / "checkpoint-4" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"\xff" * 8  # same size, broken header
    weights.write_bytes(bytes(data))
    message = fails_with(tiny_run_flags(run_dir, max_steps=6, resume_from_checkpoint="latest"), capsys)
    assert f"checkpoint {run_dir / 'checkpoint-4'} cannot be loaded" in message
    assert "incomplete or corrupted; resume from an earlier checkpoint-N" in message


def test_resuming_an_older_checkpoint_moves_the_newer_ones_aside_when_asked(tmp_path, capsys):
    run_quick(tmp_path, max_steps=4, save_steps=2, eval_steps=0)
    newer = load_file(tmp_path / "checkpoint-4" / "model.safetensors")
    run_quick(tmp_path, max_steps=4, save_steps=2, eval_steps=0, resume_from_checkpoint=str(tmp_path / "checkpoint-2"),
        overwrite_newer_checkpoints=True, learning_rate=0.001)
    [aside] = tmp_path.glob("abandoned-after-2-*")
    assert sorted(path.name for path in aside.iterdir()) == ["checkpoint-4"]
    assert all(torch.equal(newer[name], value) for name, value in
               load_file(aside / "checkpoint-4" / "model.safetensors").items())  # kept as it was
    assert [path.name for path in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]  # rotation kept
    state = json.loads((tmp_path / "checkpoint-4" / "run_state.json").read_text())
    assert state["global_step"] == 4


def test_a_checkpoint_counts_only_with_its_completion_marker_and_files(tmp_path):
    run_quick(tmp_path, max_steps=4, save_steps=2, eval_steps=0)
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


# ----------------------------------------------------------------------------------------------------------- averaging


def test_checkpoint_averaging(tmp_path):
    results = run_tiny(tmp_path, max_steps=8, save_steps=2, save_total_limit=3, average_checkpoints=3, eval_steps=0)
    assert results["averaged_checkpoints"] == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    final = load_file(tmp_path / "model.safetensors")
    parts = [load_file(tmp_path / name / "model.safetensors") for name in results["averaged_checkpoints"]]
    torch.testing.assert_close(final["model.shared.weight"], sum(p["model.shared.weight"] for p in parts) / 3)
    card = (tmp_path / "README.md").read_text()  # the model card states what the final weights are
    assert "Final weights: the average of the last 3 checkpoints (checkpoint-4, checkpoint-6, checkpoint-8)" in card


# ------------------------------------------------------------------------------------------------------------ the lock


def test_a_stale_lock_is_taken_over_and_the_lock_is_released_after_the_run(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that existed and is gone
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "hostname": platform.node()}))
    run_quick(tmp_path, max_steps=2, save_steps=0, eval_steps=0)
    assert not (tmp_path / LOCK_FILE).exists()
    assert (tmp_path / "model.safetensors").is_file()


def test_a_second_concurrent_run_is_refused_and_the_first_one_goes_on(tmp_path):
    """Two real runs into one directory: while the first holds the lock, the second exits 2 and writes nothing; the
    first is then stopped with SIGINT and saves a checkpoint that exists."""
    trace_dir = tmp_path.parent / f"{tmp_path.name}-trace"
    trace_dir.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # train.py that records each batch it trained on (tests/batch_trace.py)
    first = subprocess.Popen([sys.executable, str(REPO / "tests" / "batch_trace.py"), str(trace_dir),
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
