"""run_directory.py: the lock, the checks on the output directory, and environment faults at every write, on a REAL
small file system (a tmpfs the test mounts; skipped with the reason where mounting is not allowed)."""

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import MODEL_CARD_TEMPLATE, REPO, digests, fails_with, quick_flags, run_quick, tiny_run_flags
from hostile_inputs import PAGE, Skipped, SmallDisk, disk_usage
from safetensors.torch import save_file

from hf_scratch_transformer.errors import TrainingFault
from hf_scratch_transformer.training.run_directory import (
    LOCK_FILE,
    checkpoint_bytes,
    guarded_write,
    human_size,
    list_checkpoints,
)
from hf_scratch_transformer.training.run import main
from hf_scratch_transformer.translation.translate import load_model_and_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models on shared cores
ROOMY = 64 << 20  # what a disk is grown to once space has been "freed"


@pytest.fixture
def small_disk(tmp_path):
    """A factory of mounted tmpfs file systems (unmounted after the test); skips the test where it cannot mount."""
    disks = []

    def mount(size: int) -> SmallDisk:
        disk = SmallDisk(tmp_path / f"disk{len(disks)}", size)
        try:
            disk.__enter__()
        except Skipped as reason:
            pytest.skip(str(reason))
        disks.append(disk)
        return disk

    yield mount
    for disk in disks:
        disk.__exit__(None, None, None)


# ------------------------------------------------------------------------------------ every library's write error


def _big_tensor():
    return {"weights": torch.zeros(64 * 1024)}  # 256 KB


WRITERS = {
    "torch.save": lambda path, tokenizer: torch.save(_big_tensor(), path / "state.bin"),
    "safetensors": lambda path, tokenizer: save_file(_big_tensor(), path / "model.safetensors"),
    "tokenizers": lambda path, tokenizer: tokenizer.save_pretrained(path / "tokenizer"),
    "open().write": lambda path, tokenizer: (path / "results.json").write_text("x" * 300_000),
}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_full_disk_is_named_whatever_library_writes(writer, small_disk, tiny_tokenizer):
    """torch raises RuntimeError, safetensors SafetensorError, tokenizers a bare Exception, Python OSError: each
    becomes the same one line naming the path, the cause, the space needed and free, and the remedy."""
    disk = small_disk(16 * 1024)
    if writer == "tokenizers":
        (disk.path / "ballast").write_bytes(b"x" * (16 * 1024 - 100))  # the tokenizer files are small
    with pytest.raises(TrainingFault) as caught:
        with guarded_write("the thing", disk.path, needed=300_000, kept="nothing else changed", then="try again"):
            WRITERS[writer](disk.path, tiny_tokenizer)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"could not write the thing in {disk.path}: No space left on device (about 300.0 KB "
                              f"needed, ")
    assert message.endswith("free there); nothing else changed: free space, then try again")


@pytest.mark.parametrize("writer", ["torch.save", "safetensors", "open().write"])
def test_a_read_only_disk_is_named(writer, small_disk, tiny_tokenizer):
    disk = small_disk(1 << 20)
    disk.read_only()
    with pytest.raises(TrainingFault, match=f"could not write the thing in {disk.path}: Read-only file system; "
                                            f".*: make it writable or choose another --output_dir, then"):
        with guarded_write("the thing", disk.path):
            WRITERS[writer](disk.path, tiny_tokenizer)


def test_a_name_too_long_is_named_with_the_limit(tmp_path):
    too_long = tmp_path / ("n" * 300)
    with pytest.raises(TrainingFault, match=r"File name too long \(a name in the path has 300 characters, the file "
                                            r"system allows 255\).*: choose a shorter --output_dir"):
        with guarded_write("the lock", too_long):
            too_long.mkdir()


def test_errors_that_are_not_failed_writes_pass_through(tmp_path):
    with pytest.raises(ValueError, match="a bug"):
        with guarded_write("the thing", tmp_path):
            raise ValueError("a bug")
    with pytest.raises(TrainingFault) as caught:  # any OSError is a failed write: named in the system's words
        with guarded_write("the thing", tmp_path, kept="k", then="t"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
    assert str(caught.value) == (f"could not write the thing in {tmp_path}: Input/output error; k: check the disk, "
                                 f"then t")


# ------------------------------------------------------------------------------------- full disks in real runs


def test_full_disk_at_the_tokenizer_leaves_nothing_and_the_same_command_then_works(small_disk, capsys):
    disk = small_disk(3 * PAGE)  # the lock fits, the tokenizer's files do not
    run_dir = disk.path / "run"
    flags = quick_flags(run_dir, max_steps=2, save_steps=0, eval_steps=0)
    message = fails_with(flags, capsys, code=1)
    assert message.startswith(f"training stopped: could not write the tokenizer in {run_dir / '.tokenizer'}: No "
                              f"space left on device (")
    assert message.endswith("nothing was saved yet: free space, then run the same command again")
    assert list(run_dir.iterdir()) == []  # no half-written .tokenizer, no lock
    disk.resize(ROOMY)
    assert main(flags, MODEL_CARD_TEMPLATE) == 0
    load_model_and_tokenizer(run_dir)


def test_full_disk_at_a_checkpoint_keeps_the_last_one_and_a_resume_after_freeing_space_finishes(
        finished_run, small_disk, capsys):
    """finished_run is the same run on a roomy disk: its files give the sizes. The disk holds the lock, the tokenizer,
    checkpoint-2 and half of checkpoint-4."""
    checkpoint = disk_usage(finished_run / "checkpoint-2")
    tokenizer = disk_usage(finished_run / "tokenizer.json", finished_run / "tokenizer_config.json")
    disk = small_disk(PAGE + tokenizer + checkpoint + checkpoint // 2)
    run_dir = disk.path / "run"
    flags = dict(max_steps=4, save_steps=2, eval_steps=0, max_predict_samples=4)
    message = fails_with(tiny_run_flags(run_dir, **flags), capsys, code=1)
    needed = human_size(checkpoint_bytes(finished_run / "checkpoint-2"))  # the size of the last checkpoint
    assert message.startswith(f"training stopped: could not write checkpoint-4 in {run_dir}: No space left on "
                              f"device (about {needed} needed, ")
    assert message.endswith(f"free there); the last complete checkpoint, {run_dir / 'checkpoint-2'}, is unchanged: "
                            f"free space, then resume with --resume_from_checkpoint latest")
    assert sorted(path.name for path in run_dir.iterdir()) == ["checkpoint-2"]  # no .tmp, no staging, no lock
    assert list_checkpoints(run_dir) == [run_dir / "checkpoint-2"]
    disk.resize(ROOMY)
    assert main(tiny_run_flags(run_dir, **flags, resume_from_checkpoint="latest"), MODEL_CARD_TEMPLATE) == 0
    results = json.loads((run_dir / "all_results.json").read_text())
    assert results["train_steps"] == 4 and [path.name for path in list_checkpoints(run_dir)] == [
        "checkpoint-2", "checkpoint-4"]
    load_model_and_tokenizer(run_dir)


def test_full_disk_at_the_final_save_keeps_the_previous_model_and_a_resume_after_freeing_space_finishes(
        finished_run, small_disk, capsys):
    """A new run over a finished one (--overwrite_output_dir) whose final save does not fit: every file of the
    previous model is kept byte for byte, the new checkpoint too, and no staging folder is left."""
    model_files = [path for path in finished_run.iterdir() if path.is_file()]
    checkpoint = disk_usage(finished_run / "checkpoint-2")
    tokenizer = disk_usage(finished_run / "tokenizer.json", finished_run / "tokenizer_config.json")
    weights = disk_usage(finished_run / "model.safetensors")
    disk = small_disk(disk_usage(*model_files) + PAGE + tokenizer + checkpoint + weights // 2)
    run_dir = disk.path / "run"
    run_dir.mkdir()
    for path in model_files:
        shutil.copy2(path, run_dir / path.name)
    before = digests(run_dir)
    flags = dict(max_steps=2, save_steps=0, eval_steps=0, max_predict_samples=4)
    message = fails_with(tiny_run_flags(run_dir, **flags, overwrite_output_dir=True), capsys, code=1)
    assert message.startswith(f"training stopped: could not write the final model in {run_dir}: No space left on "
                              f"device (about 1.1 MB needed, ")
    assert message.endswith(f"the model files there before this save are unchanged and the last checkpoint is "
                            f"{run_dir / 'checkpoint-2'}: free space, then run again with --resume_from_checkpoint "
                            f"latest")
    assert digests(run_dir) == before  # every file of the previous model, byte for byte
    assert not [path for path in run_dir.iterdir() if path.name.startswith((".staging-", ".train.lock"))]
    assert list_checkpoints(run_dir) == [run_dir / "checkpoint-2"]
    disk.resize(ROOMY)
    assert main(tiny_run_flags(run_dir, **flags, resume_from_checkpoint="latest"), MODEL_CARD_TEMPLATE) == 0
    assert digests(run_dir)["model.safetensors"] != before["model.safetensors"]  # the new model is in place
    load_model_and_tokenizer(run_dir)


@pytest.mark.slow  # a 2-process launch (about 2 minutes on 2 busy cores): python -m pytest -m slow tests/test_run_directory.py
def test_a_full_disk_under_two_processes_stops_both_with_one_line_each(finished_run, small_disk):
    """The disk fills while two processes write checkpoint-4 (the main one writes the weights and the optimiser, each
    one its random states; either may be the one that fails): the failure is exchanged before the completion marker,
    so no checkpoint-4 is completed without a part, the run ends with the line naming the cause, and checkpoint-2
    stays the last complete checkpoint."""
    checkpoint = disk_usage(finished_run / "checkpoint-2")
    tokenizer = disk_usage(finished_run / "tokenizer.json", finished_run / "tokenizer_config.json")
    disk = small_disk(PAGE + tokenizer + checkpoint * 3 // 2)
    run_dir = disk.path / "run"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "configs" / "accelerate" / "cpu_2proc.yaml"), "--main_process_port", str(port),
               str(REPO / "train.py"), *tiny_run_flags(run_dir, max_steps=4, save_steps=2, eval_steps=0)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode != 0
    # Each rank ends in its line (after a progress bar, when processes share the terminal); the launcher may stop
    # the other rank with SIGTERM before it prints: the one naming the cause is always there.
    lines = [line[line.index("training stopped: "):] for line in result.stderr.splitlines()
             if "training stopped: " in line]
    assert any(f"could not write checkpoint-4 in {run_dir}: No space left on device (about" in line for line in lines)
    assert all(f"the last complete checkpoint, {run_dir / 'checkpoint-2'}, is unchanged" in line for line in lines)
    assert sorted(path.name for path in run_dir.iterdir()) == ["checkpoint-2"]


def test_a_read_only_output_dir_is_named_before_any_work(small_disk, capsys):
    disk = small_disk(1 << 20)
    disk.read_only()
    message = fails_with(quick_flags(disk.path / "run"), capsys, code=1)
    assert message == (f"training stopped: could not write the lock in {disk.path / 'run'}: Read-only file system; "
                       f"nothing was written: make it writable or choose another --output_dir, then run the same "
                       f"command again")


# ------------------------------------------------------------------------------------------ output directory checks


def test_overwrite_together_with_resume_is_refused(finished_run, capsys):
    before = digests(finished_run / "checkpoint-4")
    message = fails_with(tiny_run_flags(finished_run, overwrite_output_dir=True, resume_from_checkpoint="latest"),
                         capsys)
    assert message == (f"error: --overwrite_output_dir starts {finished_run} over (its checkpoints are removed) and "
                       f"--resume_from_checkpoint latest continues one of them: give only one")
    assert digests(finished_run / "checkpoint-4") == before


def test_predicting_into_a_model_directory_does_not_replace_its_results(finished_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir, ignore=shutil.ignore_patterns("checkpoint-*"))
    before = digests(run_dir)
    flags = tiny_run_flags(run_dir, model_name_or_path=run_dir, do_predict=True, max_predict_samples=2)
    message = fails_with(flags, capsys)
    assert message == (f"error: output directory {run_dir} already holds predict_results.json, "
                       f"generated_predictions.txt, which this evaluation would replace: give another --output_dir, "
                       f"or add --overwrite_output_dir to replace them")
    assert digests(run_dir) == before
    assert main(flags + ["--overwrite_output_dir"], MODEL_CARD_TEMPLATE) == 0  # asked for: replaced
    assert len((run_dir / "generated_predictions.txt").read_text().splitlines()) == 2


# ------------------------------------------------------------------------------------------------------ the lock


def test_a_stale_lock_is_taken_over_and_the_lock_is_released_after_the_run(tmp_path):
    """The lock of a run killed without releasing it (a real one: taken by a process that then dies)."""
    code = ("import os, sys; from hf_scratch_transformer.training.run_directory import OutputDirLock; "
            "lock = OutputDirLock(sys.argv[1]); lock.acquire(); os._exit(0)")  # dies holding it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env)
    assert (tmp_path / LOCK_FILE).is_file()
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


# ------------------------------------------------------------------------------------- issue 42: another run, umask


def test_a_checkpoint_of_another_run_is_not_continued_into_a_finished_run(finished_run, tmp_path, capsys):
    """--resume_from_checkpoint A/checkpoint-4 --output_dir B, B a finished run: refused, B unchanged; with
    --overwrite_output_dir the same command is allowed (checked up to the refusal, not trained here)."""
    other = tmp_path / "B"
    shutil.copytree(finished_run, other)
    before = digests(other)
    line = fails_with(tiny_run_flags(other, max_steps=6, resume_from_checkpoint=str(finished_run / "checkpoint-4")),
                      capsys)
    assert "continues a run of another directory" in line and "a finished run (model.safetensors" in line
    assert "--overwrite_output_dir" in line and digests(other) == before


def test_files_get_the_mode_the_umask_gives_although_safetensors_writes_0600(tmp_path):
    from hf_scratch_transformer.training.run_directory import follow_umask

    previous = os.umask(0o022)
    try:
        save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
        (tmp_path / "config.json").write_text("{}")
        assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o600  # what the library writes
        follow_umask(tmp_path)
    finally:
        os.umask(previous)
    assert {path.name: path.stat().st_mode & 0o777 for path in tmp_path.iterdir()} == \
        {"model.safetensors": 0o644, "config.json": 0o644}


def test_a_finished_run_and_its_checkpoints_are_readable_by_others_under_umask_022(finished_run):
    """finished_run was trained under the test process's umask (022 here): every file has the same mode."""
    umask = os.umask(0)
    os.umask(umask)
    modes = {str(path.relative_to(finished_run)): path.stat().st_mode & 0o777 for path in finished_run.rglob("*")
             if path.is_file() and not path.name.startswith(".")}
    assert set(modes.values()) == {0o666 & ~umask}, modes
