"""Several processes under real launches: two processes of one machine (configs/accelerate/cpu_2proc.yaml), two
"machines" on one host (two `accelerate launch --config_file configs/accelerate/multi_node.yaml --machine_rank 0|1`
commands, one CPU process each, gloo), and what a lost machine does to the other.

Every process runs tests/batch_trace.py (train.py with a wrapper that records the batches each rank trained on), so
the tests count the ranks and machines that trained and check that no two ranks saw the same example. Machine 1 runs
in its own mount namespace where the shared output directory is read-only: any write it tried there would fail its
run, so a run that passes shows that machine 1 wrote nothing.

The lost-machine tests (SIGKILL, SIGSTOP of machine 1 mid-training) are slow: `scripts/run_distributed_tests.sh`.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from batch_trace import read_trace
from helpers import REPO, quick_flags
from safetensors.torch import load_file

from hf_scratch_transformer.training.run_directory import CHECKPOINT_COMPLETE, LOCK_FILE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIGS = REPO / "configs" / "accelerate"
TRACED_TRAIN = REPO / "tests" / "batch_trace.py"
# The run both launches share: 4 steps, checkpoints at 2 and 4, no validation before the end; one torch thread per
# process (by default a process takes the cores of its machine divided by the processes on it: 1 for two processes
# on one machine, 2 for a "machine" of one process here, and other thread counts sum in another order).
RUN = dict(max_steps=4, eval_steps=0, save_steps=2, cpu_threads=1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def launch_command(config: str, trace_dir, flags: list[str], *overrides: str) -> list[str]:
    """`accelerate launch --config_file configs/accelerate/CONFIG OVERRIDES tests/batch_trace.py TRACE_DIR FLAGS`."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config), *overrides,
            str(TRACED_TRAIN), str(trace_dir), *flags]


def machine_command(machine: int, port: int, trace_dir, flags: list[str]) -> list[str]:
    """One of two machines of configs/accelerate/multi_node.yaml, on this host: one process each."""
    return launch_command("multi_node.yaml", trace_dir, flags, "--num_processes", "2", "--machine_rank", str(machine),
                          "--main_process_ip", "127.0.0.1", "--main_process_port", str(port))


# Mounts in machine 1's own mount namespace (the rest of the host stays as it is): the output directory read-only
# (the files stay shared: what machine 0 writes shows up at once, but every write fails with EROFS), or an empty
# filesystem of its own at the same path (machine 1 on another disk).
READ_ONLY = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1"'
SEPARATE = 'mount -t tmpfs tmpfs "$1"'


def own_mount(mount: str, path, command: list[str]) -> list[str]:
    """`command` in a mount namespace of its own where `mount` (READ_ONLY, SEPARATE) was done on `path`."""
    namespace = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        namespace[1:1] = ["--user", "--map-root-user"]
    return [*namespace, "sh", "-c", f'{mount} && shift && exec "$@"', "sh", str(path), *command]


def own_mounts_work(tmp_path) -> bool:
    """Whether this system lets a test give a process its own mounts (unshare as root, or user namespaces)."""
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        result = subprocess.run(own_mount(READ_ONLY, probe, ["sh", "-c", f"! touch {probe}/file"]),
                                capture_output=True, timeout=30)
    except FileNotFoundError:  # no unshare
        return False
    return result.returncode == 0 and not (probe / "file").exists()


NO_OWN_MOUNTS = ("this system gives a test no mount namespace (unshare as root, or unprivileged user namespaces) "
                 "to change what machine 1 sees of the output directory")


def start(command: list[str], log_dir, name: str) -> subprocess.Popen:
    """A launch; its output goes to log_dir/NAME.out and .err (files: a pipe nobody reads could fill up and block
    it)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{name}.out", "w") as stdout, open(log_dir / f"{name}.err", "w") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, env=launch_env(), cwd=REPO)
    process.logs = log_dir / name
    return process


def finish(process: subprocess.Popen, timeout: float = 600) -> subprocess.CompletedProcess:
    """Wait for a launch (killed after `timeout` seconds): its exit status and output."""
    try:
        process.wait(timeout)
    finally:
        if process.poll() is None:
            signal_machine(process, signal.SIGKILL)
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, process.logs.with_suffix(".out").read_text(),
                                       process.logs.with_suffix(".err").read_text())


def run_two_machines(output_dir, trace_dir, flags: list[str], machine_1_mount: str | None = None):
    """Both machines to the end, machine 1 with `machine_1_mount` done on the output directory if given:
    (machine 0's CompletedProcess, machine 1's)."""
    output_dir.mkdir(parents=True, exist_ok=True)  # a mount point must exist
    port, logs = free_port(), trace_dir.with_name(f"{trace_dir.name}-logs")
    machine_1 = machine_command(1, port, trace_dir, flags)
    if machine_1_mount:
        machine_1 = own_mount(machine_1_mount, output_dir, machine_1)
    machines = [start(machine_command(0, port, trace_dir, flags), logs, "machine-0"),
                start(machine_1, logs, "machine-1")]
    return tuple(finish(process) for process in machines)


def assert_disjoint_batches(trace: dict, steps: list[int]) -> None:
    assert sorted(trace) == [0, 1], "two processes must each have trained"
    for rank, rows in trace.items():
        assert {row["world_size"] for row in rows} == {2}
        assert [row["step"] for row in rows] == steps, rank
    seen = [(row["epoch"], index) for rows in trace.values() for row in rows for index in row["indices"]]
    assert len(seen) == len(set(seen)), "an example was trained on by both ranks in the same epoch"


def assert_same_weights(expected_dir, got_dir) -> None:
    expected, got = load_file(expected_dir / "model.safetensors"), load_file(got_dir / "model.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name)


# ------------------------------------------------------------------------------------- two processes, one machine


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory):
    """configs/accelerate/cpu_2proc.yaml, 2 processes, RUN: (output directory, trace, CompletedProcess)."""
    root = tmp_path_factory.mktemp("one-machine")
    result = launch_one_machine(root / "out", root / "trace", **RUN)
    return root / "out", read_trace(root / "trace"), result


def test_two_cpu_processes_train_on_disjoint_batches(one_machine):
    output_dir, trace, result = one_machine
    assert_disjoint_batches(trace, steps=[1, 2, 3, 4])
    results = json.loads((output_dir / "all_results.json").read_text())
    assert results["train_steps"] == 4
    assert json.loads(result.stdout)["train_steps"] == 4, "the results are printed once, by rank 0"
    assert "2 process(es)" in (output_dir / "README.md").read_text()
    # each rank's random state is in the checkpoint, and the completion marker lists it
    marker = json.loads((output_dir / "checkpoint-4" / CHECKPOINT_COMPLETE).read_text())
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors", "run_state.json"} <= set(
        marker["files"])
    assert json.loads((output_dir / "checkpoint-4" / "run_state.json").read_text())["world_size"] == 2
    assert not (output_dir / LOCK_FILE).exists()


STREAM = dict(streaming=True, max_steps=4, save_steps=2, eval_steps=0, max_train_samples=200)


def launch_one_machine(output_dir, trace_dir, **flags) -> subprocess.CompletedProcess:
    """configs/accelerate/cpu_2proc.yaml with quick flags, to the end."""
    command = launch_command("cpu_2proc.yaml", trace_dir, quick_flags(output_dir, **flags), "--main_process_port",
                             str(free_port()))
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=launch_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def one_machine_stream(tmp_path_factory):
    """A --streaming run of 4 steps by 2 processes: (output directory, per-rank trace)."""
    root = tmp_path_factory.mktemp("stream2")
    launch_one_machine(root / "straight", root / "trace-straight", **STREAM)
    return root / "straight", read_trace(root / "trace-straight")


def test_two_cpu_processes_stream_disjoint_batches(one_machine_stream):
    output_dir, trace = one_machine_stream
    assert_disjoint_batches(trace, steps=[1, 2, 3, 4])
    assert json.loads((output_dir / "all_results.json").read_text())["train_steps"] == 4
    assert json.loads((output_dir / "checkpoint-4" / "run_state.json").read_text())["world_size"] == 2


@pytest.mark.slow  # three 2-process launches; the 1-process resume (test_loop.py) runs in every suite
def test_two_cpu_processes_resume_the_stream_position(one_machine_stream, tmp_path):
    straight, trace = one_machine_stream
    resumed = tmp_path / "resumed"
    # the same run stopped after step 2, then resumed from checkpoint-2 by two processes
    launch_one_machine(resumed, tmp_path / "trace-first", **{**STREAM, "max_steps": 2})
    launch_one_machine(resumed, tmp_path / "trace-second", **STREAM, resume_from_checkpoint="latest")
    second = read_trace(tmp_path / "trace-second")
    for rank in (0, 1):
        assert [row["step"] for row in second[rank]] == [3, 4]
        assert [row["indices"] for row in second[rank]] == [row["indices"] for row in trace[rank][2:]]
    expected, got = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


# --------------------------------------------------------------------------------------- two machines on one host


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory):
    """multi_node.yaml on this host, machine 1 with a read-only view of the output directory where the system allows
    it: (output directory, trace, machine 0's CompletedProcess, machine 1's, whether machine 1's view was
    read-only)."""
    root = tmp_path_factory.mktemp("two-machines")
    read_only = own_mounts_work(root)
    machine_0, machine_1 = run_two_machines(root / "out", root / "trace", quick_flags(root / "out", **RUN),
                                            machine_1_mount=READ_ONLY if read_only else None)
    assert machine_0.returncode == 0, machine_0.stderr[-3000:]
    assert machine_1.returncode == 0, machine_1.stderr[-3000:]
    return root / "out", read_trace(root / "trace"), machine_0, machine_1, read_only


def test_two_machines_on_one_host_train_one_model_on_disjoint_batches(two_machines):
    output_dir, trace, machine_0, _, _ = two_machines
    assert_disjoint_batches(trace, steps=[1, 2, 3, 4])
    assert {(rank, rows[0]["machine"]) for rank, rows in trace.items()} == {(0, 0), (1, 1)}
    assert trace[0][0]["pid"] != trace[1][0]["pid"]
    assert json.loads((output_dir / "checkpoint-4" / "run_state.json").read_text())["world_size"] == 2
    assert json.loads((output_dir / "all_results.json").read_text())["train_steps"] == 4


def test_only_machine_0_prints_the_results(two_machines):
    _, _, machine_0, machine_1, _ = two_machines
    assert json.loads(machine_0.stdout)["train_steps"] == 4
    assert machine_1.stdout == ""
    assert machine_1.stderr == "", "machine 1 prints errors only, and there were none"


def test_machine_1_writes_nothing_in_the_output_directory(two_machines):
    output_dir, _, _, _, read_only = two_machines
    if not read_only:
        pytest.skip(NO_OWN_MOUNTS)
    # machine 1 finished although every write into the output directory would have failed for it; machine 0 wrote
    # the whole run, the random states of both ranks included
    marker = json.loads((output_dir / "checkpoint-2" / CHECKPOINT_COMPLETE).read_text())
    assert {"random_states_0.pkl", "random_states_1.pkl", "optimizer.bin", "model.safetensors"} <= set(
        marker["files"])
    assert (output_dir / "model.safetensors").is_file() and (output_dir / "README.md").is_file()


def test_two_machines_train_the_model_of_two_processes_on_one_machine(two_machines, one_machine):
    machines_dir, machines_trace, *_ = two_machines
    one_dir, one_trace, _ = one_machine
    for rank in (0, 1):
        assert [row["indices"] for row in machines_trace[rank]] == [row["indices"] for row in one_trace[rank]]
    assert_same_weights(one_dir, machines_dir)


def test_an_output_directory_that_machine_1_does_not_share_is_refused_on_both_machines(tmp_path):
    if not own_mounts_work(tmp_path):
        pytest.skip(NO_OWN_MOUNTS)
    output_dir = tmp_path / "out"
    machines = run_two_machines(output_dir, tmp_path / "trace", quick_flags(output_dir, **RUN),
                                machine_1_mount=SEPARATE)
    expected = (f"error: --output_dir {output_dir} is not shared by every machine: rank 1 (machine 1) cannot read "
                f"what rank 0 writes there (machine 0 alone writes it; the others read the tokenizer and the "
                f"checkpoints from it): put it on a filesystem that every machine mounts at the same path")
    for machine in machines:
        assert machine.returncode == 1, machine.stderr[-3000:]  # torchrun's status for a failed worker
        assert [line for line in machine.stderr.splitlines() if line.startswith("error:")] == [expected]
        assert "Traceback" not in machine.stderr.split(expected)[0], "the worker printed a traceback"
        assert machine.stderr.strip().splitlines()[-2] == f"  traceback : {expected}", "torchrun's report names it"
        assert machine.stdout == ""
    assert list(output_dir.iterdir()) == [], "no training started: nothing was written"
    assert not list(tmp_path.glob("trace/rank-*.jsonl"))


# ------------------------------------------------------------------------------------------------ a lost machine


def wait_for(path, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert process.poll() is None, \
            f"machine 0 ended before {path.name} appeared: {finish(process).stderr[-3000:]}"
        assert time.time() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.05)


def machine_processes(launcher: subprocess.Popen) -> list[int]:
    """The launcher and every process under it: torchrun starts each worker in a session of its own, so signalling
    the launcher's process group would leave the worker running."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [launcher.pid]
    while queue:
        pid = queue.pop()
        found.append(pid)
        queue += parents.get(pid, [])
    return found


def signal_machine(launcher: subprocess.Popen, how: int) -> None:
    for pid in machine_processes(launcher):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, how)


def lose_machine_1(tmp_path, how: int, **flags):
    """Both machines on a long run; once checkpoint-2 is complete, every process of machine 1 (launcher and worker)
    gets `how` (SIGKILL or SIGSTOP). Returns (machine 0's CompletedProcess, seconds from the signal to machine 0's
    exit)."""
    port, output_dir = free_port(), tmp_path / "out"
    argv = quick_flags(output_dir, **{**RUN, "max_steps": 200, **flags})
    machine_0 = start(machine_command(0, port, tmp_path / "trace", argv), tmp_path / "logs", "machine-0")
    machine_1 = start(machine_command(1, port, tmp_path / "trace", argv), tmp_path / "logs", "machine-1")
    try:
        wait_for(output_dir / "checkpoint-2", machine_0)
        signal_machine(machine_1, how)
        signalled = time.time()
        stopped = finish(machine_0, timeout=300)
        return stopped, time.time() - signalled
    finally:
        signal_machine(machine_1, signal.SIGKILL)
        machine_1.wait()


def lost_machine_message(stopped: subprocess.CompletedProcess) -> str:
    """Machine 0's one-line message: printed once by its process, without a traceback, and repeated by torchrun as
    the last entry of its closing report (accelerate's launcher then re-raises torchrun's error: the last lines of
    a failed multi-process launch are never the worker's)."""
    lines = stopped.stderr.strip().splitlines()
    ours = [line for line in lines if line.startswith("training stopped:")]
    assert len(ours) == 1, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr.split(ours[0])[0], "the worker printed a traceback"
    assert lines[-2] == f"  traceback : {ours[0]}"
    return ours[0]


@pytest.mark.slow  # 3 launches of two machines, about 2 minutes
def test_a_killed_machine_stops_the_other_at_once_and_both_resume_from_the_last_checkpoint(tmp_path, two_machines):
    stopped, seconds = lose_machine_1(tmp_path, signal.SIGKILL)
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert seconds < 60, f"machine 0 took {seconds:.0f} s to stop"
    message = lost_machine_message(stopped)
    assert message.startswith("training stopped: lost rank 1 (machine 1 of 2, host ")
    assert message.endswith(f"it ended or stopped (its connection closed); the last complete checkpoint is "
                            f"{tmp_path / 'out' / 'checkpoint-2'}: restart every machine with "
                            f"--resume_from_checkpoint latest")
    # the checkpoint is intact: both machines resume from it and finish with the model of the run never interrupted
    machine_0, machine_1 = run_two_machines(tmp_path / "out", tmp_path / "resumed",
                                            quick_flags(tmp_path / "out", **RUN, resume_from_checkpoint="latest"))
    assert machine_0.returncode == 0 and machine_1.returncode == 0, machine_0.stderr[-3000:] + machine_1.stderr[-3000:]
    assert_disjoint_batches(read_trace(tmp_path / "resumed"), steps=[3, 4])
    assert_same_weights(two_machines[0], tmp_path / "out")


@pytest.mark.slow  # waits for --ddp_timeout
def test_a_stopped_machine_is_given_up_after_ddp_timeout(tmp_path):
    stopped, seconds = lose_machine_1(tmp_path, signal.SIGSTOP, ddp_timeout=20)
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert 20 <= seconds < 20 + 60, f"machine 0 stopped {seconds:.0f} s after machine 1"
    message = lost_machine_message(stopped)
    assert message.startswith("training stopped: lost rank 1 (machine 1 of 2, host ")
    assert message.endswith(f"it ended or stopped (no answer within --ddp_timeout 20 s); the last complete "
                            f"checkpoint is {tmp_path / 'out' / 'checkpoint-2'}: restart every machine with "
                            f"--resume_from_checkpoint latest")


@pytest.mark.slow  # two launches that stop after a few seconds of validation
def test_a_ddp_timeout_shorter_than_validation_stops_both_machines_with_its_advice(tmp_path):
    """Only rank 0 validates; the other process waits for it at a barrier, which --ddp_timeout 1 cuts short while
    every process is still running."""
    # a validation of 788 sentences of up to 64 tokens takes seconds on one thread (3.4 s for 400 on a busy core)
    flags = quick_flags(tmp_path / "out", **{**RUN, "max_steps": 20, "eval_steps": 2, "max_eval_samples": 788,
                                             "eval_max_new_tokens": 64, "max_len_a": 0, "max_len_b": 0,
                                             "ddp_timeout": 1})
    machines = run_two_machines(tmp_path / "out", tmp_path / "trace", flags)
    messages = [lost_machine_message(machine) for machine in machines]
    assert all(machine.returncode == 1 for machine in machines)
    assert ("training stopped: no answer from the other processes within --ddp_timeout 1 s, though all of them are "
            "still running: raise --ddp_timeout above the longest step the main process does alone (tokenizer "
            "training, preprocessing, validation, saving)") in messages, messages


# ----------------------------------------------------------------- launches that would not do what they say (issue 42)
def _refused_launch(tmp_path, command_head: list[str], env: dict, *parts, **flags) -> str:
    """A real `train.py` process under `command_head` (a launcher, or plain python) with `env`: train.py's one
    `error:` line names every part, the output directory is not created; exit status 2 without a launcher (accelerate
    launch reports a failed child with its own traceback and status 1 after that line: docs/distributed.md)."""
    output_dir = tmp_path / "never"
    result = subprocess.run([*command_head, str(REPO / "train.py"), *quick_flags(output_dir, **flags)],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env={**launch_env(), "HF_HOME": str(tmp_path / "hf-home"), **env})
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and all(part in lines[0] for part in parts), result.stderr[-3000:]
    launched = command_head[0] != sys.executable or len(command_head) > 1
    assert result.returncode == (1 if launched else 2), result.stderr[-3000:]
    if not launched:
        assert "Traceback" not in result.stderr and result.stderr.strip().splitlines()[-1] == lines[0]
    last = lines[0]
    assert not output_dir.exists()
    return last


ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="accelerate picks multi-GPU on a machine with GPUs")
def test_accelerate_launch_num_processes_2_without_gpus_is_refused_not_one_process_trained(tmp_path):
    _refused_launch(tmp_path, [*ACCELERATE_LAUNCH, "--num_processes", "2", "--num_machines", "1",
                               "--mixed_precision", "no", "--dynamo_backend", "no"], {},
                    "--num_processes N", "starts only one process", "--multi_gpu")


def test_accelerate_launch_mixed_precision_is_not_ignored_when_train_py_says_otherwise(tmp_path):
    _refused_launch(tmp_path, [*ACCELERATE_LAUNCH, "--num_processes", "1", "--num_machines", "1",
                               "--mixed_precision", "bf16", "--dynamo_backend", "no"], {},
                    "--mixed_precision bf16", "--bf16 false", "contradict", bf16=False)


def test_world_size_left_in_the_environment_without_a_launcher_is_one_line(tmp_path):
    _refused_launch(tmp_path, [sys.executable], {"WORLD_SIZE": "2"}, "WORLD_SIZE=2", "no launcher",
                    "unset WORLD_SIZE")
