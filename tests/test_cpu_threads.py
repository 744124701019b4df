"""cpu_threads.py: the thread count follows the measured throughput (step times are injected, not real load); at a
pinned count, fp32 training repeats bit for bit."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, quick_flags, run_quick
from safetensors.torch import load_file

from hf_scratch_transformer.cpu_threads import ThreadTuner

IDLE = {1: 1000.0, 2: 1750.0}  # tokens/s of the small preset on 2 quiet cores (1 and 2 threads)
BUSY = {1: 950.0, 2: 180.0}  # one core taken by another process: 2 threads wait at every barrier


class SimulatedMachine:
    """Drives a tuner with steps of 300 tokens whose duration follows the load of the moment."""

    def __init__(self, max_threads=2, **options):
        self.applied = []
        self.tuner = ThreadTuner(max_threads, "training", set_threads=self.applied.append, **options)
        self.tuner.activate()
        self.clock = 0.0
        self.timeline = []  # (time, thread count in use, seconds of the step)

    def run(self, seconds: float, throughput: dict) -> None:
        end = self.clock + seconds
        while self.clock < end:
            threads = self.applied[-1]
            step = 300 / throughput[threads]
            self.tuner.record(300, step)
            self.timeline.append((self.clock, threads, step))
            self.clock += step

    def efficiency(self, start: float, end: float, throughput: dict) -> float:
        """Work done between start and end, against the best fixed thread count for that load."""
        spent = sum(step for time, _, step in self.timeline if start <= time < end)
        steps = sum(1 for time, _, _ in self.timeline if start <= time < end)
        return steps * 300 / max(throughput.values()) / spent


def test_on_a_quiet_machine_it_keeps_every_core():
    machine = SimulatedMachine()
    machine.run(600, IDLE)
    assert machine.tuner.current == 2 and not machine.tuner.changes
    assert 1 in machine.applied  # it did measure the alternative
    assert machine.efficiency(0, 600, IDLE) >= 0.97


def test_when_a_core_gets_busy_it_drops_to_one_thread_within_seconds_and_comes_back_when_it_is_free():
    machine = SimulatedMachine()
    machine.run(120, IDLE)
    assert machine.tuner.current == 2
    machine.run(600, BUSY)
    switched = next(time for time, threads, _ in machine.timeline if time >= 120 and threads == 1)
    assert switched - 120 < 10  # a slow window triggers a check at once, not at the next periodic one
    assert machine.tuner.current == 1
    assert machine.efficiency(130, 720, BUSY) >= 0.95  # the periodic checks of 2 threads cost little
    machine.run(600, IDLE)
    back = next(time for time, threads, _ in machine.timeline if time >= 720 and threads == 2
                and machine.tuner.current == 2)
    assert back - 720 <= 240 + 10  # within the longest interval between checks
    assert machine.tuner.current == 2
    assert [(change["from"], change["to"]) for change in machine.tuner.changes] == [(2, 1), (1, 2)]


def test_slow_first_steps_do_not_make_the_starting_count_look_slow():
    """The first steps allocate and warm caches (here 5 times slower for 3 seconds): they are not counted."""
    machine = SimulatedMachine()
    machine.run(3, {1: IDLE[1], 2: IDLE[2] / 5})
    machine.run(120, IDLE)
    assert machine.tuner.current == 2 and not machine.tuner.changes
    assert machine.efficiency(0, 123, IDLE) >= 0.9


def test_work_that_speeds_up_over_time_favours_no_count():
    """Batches sorted by length get faster per token as they go: the current count is measured before and after
    the other (ABA), so the later, faster windows of the other count do not win on their own."""
    close = {1: 1000.0, 2: 1050.0}  # 2 threads slightly faster at every moment
    machine = SimulatedMachine(warmup_windows=0)
    for second in range(60):
        machine.run(1, {threads: speed * (1 + second / 10) for threads, speed in close.items()})
    assert machine.tuner.current == 2 and not machine.tuner.changes


def sleeping_work(machine, milliseconds: dict):
    """Stand-in work that takes `milliseconds[threads]` at the thread count last applied."""
    import time

    return lambda: time.sleep(milliseconds[machine.applied[-1]] / 1000)


def test_start_up_calibration_on_a_busy_machine_starts_with_one_thread():
    machine = SimulatedMachine()
    machine.tuner.calibrate(sleeping_work(machine, {1: 2, 2: 10}))
    assert machine.tuner.current == 1 and machine.applied[-1] == 1
    assert [(c["from"], c["to"], c["reason"]) for c in machine.tuner.changes] == [(2, 1, "start-up calibration")]
    machine.run(25, BUSY)
    assert machine.efficiency(0, 25, BUSY) >= 0.97  # no window at 2 threads before the first periodic check


def test_start_up_calibration_on_a_quiet_machine_defers_the_first_check():
    """Two threads clearly faster in the calibration: no window at one thread until the first periodic check."""
    machine = SimulatedMachine()
    machine.tuner.calibrate(sleeping_work(machine, {1: 8, 2: 4}))
    assert machine.tuner.current == 2 and not machine.tuner.changes
    applied_before = len(machine.applied)
    machine.run(25, IDLE)
    assert 1 not in machine.applied[applied_before:]
    machine.run(60, IDLE)
    assert 1 in machine.applied[applied_before:]  # the periodic check still measures the alternative


def test_an_undecided_calibration_leaves_the_check_to_the_real_work():
    machine = SimulatedMachine()
    machine.tuner.calibrate(sleeping_work(machine, {1: 5, 2: 5}))
    applied_before = len(machine.applied)
    machine.run(10, IDLE)
    assert 1 in machine.applied[applied_before:]


def test_more_cores_move_to_the_neighbouring_counts():
    speeds = {threads: 1000.0 * threads for threads in range(1, 9)}
    speeds[8] = 300.0  # one of 8 cores busy: 7 threads is best
    machine = SimulatedMachine(max_threads=8)
    machine.run(300, speeds)
    assert machine.tuner.current == 7


def test_a_fixed_count_is_kept_and_nothing_is_measured():
    machine = SimulatedMachine(fixed=1)
    machine.run(300, BUSY)
    assert machine.applied == [1] and machine.tuner.current == 1 and not machine.tuner.adaptive
    assert "pinned by --cpu_threads: results repeat bit for bit" in machine.tuner.describe()


def test_every_change_is_logged(caplog):
    machine = SimulatedMachine()
    with caplog.at_level(logging.INFO, logger="hf_scratch_transformer"):
        machine.run(60, IDLE)
        machine.run(60, BUSY)
    [line] = [record.getMessage() for record in caplog.records if "CPU threads for training" in record.getMessage()]
    assert "2 -> 1" in line and "fell from" in line
    assert "results do not repeat bit for bit; --cpu_threads N pins N" in machine.tuner.describe()


# ---------------------------------------------------------------------------------------------- in a training run


@pytest.fixture
def two_threads_look_busy(monkeypatch):
    """Every step is its own window, and a step run with 2 threads is recorded as 5 times slower than it was (as
    with a busy core); the real work is unchanged."""
    real_init, real_record = ThreadTuner.__init__, ThreadTuner.record

    def init(self, *args, **kwargs):
        real_init(self, *args, **{**kwargs, "window_seconds": 0.0, "min_window_steps": 1, "recheck_seconds": 0.0})

    def record(self, work, seconds):
        real_record(self, work, seconds * (5 if self.applied == 2 else 1))

    monkeypatch.setattr(ThreadTuner, "__init__", init)
    monkeypatch.setattr(ThreadTuner, "record", record)
    monkeypatch.setattr("hf_scratch_transformer.cpu_threads.available_cores", lambda: 2)  # whatever the machine has


def test_a_run_adapts_its_threads_and_records_each_change(tmp_path, two_threads_look_busy):
    results = run_quick(tmp_path / "adaptive", max_steps=12, eval_steps=0, save_steps=0, logging_steps=2,
                        cpu_threads=0)
    assert results["train_cpu_threads"] == 1
    assert [(change["from"], change["to"]) for change in results["train_cpu_thread_changes"]] == [(2, 1)]
    history = json.loads((tmp_path / "adaptive" / "training_history.json").read_text())
    assert [row["cpu_threads"] for row in history if "cpu_threads" in row][-1] == 1


def test_fp32_training_at_a_pinned_thread_count_is_bit_identical_run_to_run(tmp_path):
    """train.py twice, each in its own process, with --cpu_threads 2 at the small preset's width (where a matrix
    product is split between the threads): the same weights to the last bit. That is the guarantee; the adaptive
    thread policy gives it up for speed (docs/training.md, CPU threads). train.py sets MKL's reproducibility mode
    itself, so the variable is taken out of the environment here. The weights compared are trained ones: the loss
    falls over the 4 steps."""
    env = {key: value for key, value in os.environ.items() if key != "MKL_CBWR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    weights, losses = [], []
    for run in ("first", "second"):
        flags = quick_flags(tmp_path / run, preset="small", tokenizer_vocab_size=1000, max_train_samples=400,
                            max_steps=4, logging_steps=1, warmup_steps=2, eval_steps=0, save_steps=0, cpu_threads=2,
                            bf16=False, do_train=True)
        result = subprocess.run([sys.executable, str(REPO / "train.py"), *flags], capture_output=True, text=True,
                                cwd=REPO, env=env, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "2 CPU thread(s) for training (pinned by --cpu_threads" in result.stderr
        weights.append(load_file(tmp_path / run / "model.safetensors"))
        history = json.loads((tmp_path / run / "training_history.json").read_text())
        losses.append([row["train_loss"] for row in history if "train_loss" in row])
    first, second = weights
    assert len(first) > 20 and first.keys() == second.keys()
    assert [name for name in first if not torch.equal(first[name], second[name])] == []
    assert len(losses[0]) == 4 and losses[0][-1] < losses[0][0] and losses[0] == losses[1]


def test_translation_adapts_its_threads_in_the_cli_and_in_validation(tmp_path, trained_model_dir, caplog,
                                                                     two_threads_look_busy, capsys):
    from hf_scratch_transformer.translation import cli

    with caplog.at_level(logging.INFO, logger="hf_scratch_transformer"):
        code = cli.main(["--model", str(trained_model_dir), "--batch_size", "1", "Jesus wept.", "God is love.",
                         "The Lord is my shepherd.", "Jesus wept.", "God is love.", "The Lord is my shepherd."])
    assert code == 0 and len(capsys.readouterr().out.splitlines()) == 6
    assert any("CPU threads for translation: 2 -> 1" in record.getMessage() for record in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_scratch_transformer"):
        run_quick(tmp_path / "run", max_steps=2, eval_steps=1, per_device_eval_batch_size=1, cpu_threads=0)
    assert any("CPU threads for translation: 2 -> 1" in record.getMessage() for record in caplog.records)


def test_the_cli_refuses_a_negative_thread_count_before_loading(capsys):
    from hf_scratch_transformer.translation import cli

    assert cli.main(["--model", "does-not-matter", "--cpu_threads", "-1", "hi"]) == 2
    assert "--cpu_threads must be a whole number >= 0" in capsys.readouterr().err


def test_each_backend_has_its_own_thread_flag_and_the_other_is_refused_before_loading(capsys):
    """--cpu_threads is torch's (as in train.py), --ct2_intra_threads CTranslate2's: one flag, one meaning."""
    from hf_scratch_transformer.translation import cli

    for argv, words in (
        (["--ct2_intra_threads", "2"], "--ct2_intra_threads sets CTranslate2's threads (--backend ct2); the pytorch "
                                       "backend's are --cpu_threads N"),
        (["--backend", "ct2", "--cpu_threads", "2"], "--cpu_threads sets torch's threads (the pytorch backend); "
                                                     "CTranslate2's are --ct2_intra_threads N"),
        (["--backend", "ct2", "--ct2_intra_threads", "-1"], "--ct2_intra_threads must be a whole number >= 0"),
    ):
        assert cli.main(["--model", "does-not-matter", *argv, "hi"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err


# ------------------------------------------------------------------- the limit: pins, affinity, cgroup CPU quota


def _proc_tree(tmp_path, memberships: str, mounts: str, quotas: dict) -> "Path":
    """A /proc/self of `memberships` (its `cgroup` file) and `mounts` (`mountinfo`, {root} standing for a cgroup
    file system made under tmp_path), with the quota files `quotas` ({path under the mount: {file: text}})."""
    from pathlib import Path

    root = tmp_path / "sys" / "fs" / "cgroup"
    for folder, files in quotas.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (root / folder / name).write_text(text)
    proc = Path(tmp_path / "proc" / "self")
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(memberships)
    (proc / "mountinfo").write_text(mounts.format(root=root))
    return proc


V2_MOUNT = "23 1 0:26 / /proc rw - proc proc rw\n41 31 0:38 / {root} rw,relatime - cgroup2 cgroup2 rw\n"
V1_MOUNT = "32 31 0:29 / {root} rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"


def test_a_cgroup_v2_quota_of_one_and_a_half_cpus_limits_the_threads_to_one(tmp_path):
    from hf_scratch_transformer.cpu_threads import cgroup_cpu_quota, thread_limit

    proc = _proc_tree(tmp_path, "0::/user.slice/job\n", V2_MOUNT,
                      {"": {"cpu.max": "max 100000\n"}, "user.slice": {"cpu.max": "max 100000\n"},
                       "user.slice/job": {"cpu.max": "150000 100000\n"}})
    assert cgroup_cpu_quota(proc)[0] == 1.5
    limit = thread_limit({}, proc)
    assert limit.threads == 1 and "cgroup's CPU quota of 1.5 CPU(s)" in limit.reason
    assert "cpu.max: 150000 100000" in limit.reason


def test_the_tightest_quota_of_the_cgroup_and_its_ancestors_counts_and_nothing_above_the_mount(tmp_path):
    from hf_scratch_transformer.cpu_threads import cgroup_cpu_quota

    proc = _proc_tree(tmp_path, "0::/outer/inner\n", V2_MOUNT,
                      {"outer": {"cpu.max": "100000 100000\n"}, "outer/inner": {"cpu.max": "max 100000\n"}})
    (tmp_path / "sys" / "fs" / "cpu.max").write_text("1000 100000\n")  # above the mount point: not read
    assert cgroup_cpu_quota(proc)[0] == 1.0


def test_a_cgroup_v1_cfs_quota_limits_the_threads(tmp_path):
    from hf_scratch_transformer.cpu_threads import thread_limit

    proc = _proc_tree(tmp_path, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n", V1_MOUNT,
                      {"docker/abc": {"cpu.cfs_quota_us": "100000\n", "cpu.cfs_period_us": "100000\n"},
                       "docker": {"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"}})
    limit = thread_limit({}, proc)
    assert limit.threads == 1 and "cpu.cfs_quota_us 100000" in limit.reason


def test_no_quota_and_no_cgroup_file_system_leave_the_cores(tmp_path):
    from hf_scratch_transformer.cpu_threads import available_cores, cgroup_cpu_quota, thread_limit

    unlimited = _proc_tree(tmp_path, "0::/job\n", V2_MOUNT, {"job": {"cpu.max": "max 100000\n"}})
    assert cgroup_cpu_quota(unlimited) is None and cgroup_cpu_quota(tmp_path / "no-proc") is None
    assert thread_limit({}, unlimited).threads == available_cores()


@pytest.mark.parametrize("variable", ["OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_a_users_thread_pin_is_the_limit_and_named(variable, tmp_path):
    from hf_scratch_transformer.cpu_threads import thread_limit

    limit = thread_limit({variable: "1"}, tmp_path / "no-proc")
    assert (limit.threads, limit.reason, limit.notes) == (1, f"{variable}=1", ())


def test_a_launchers_omp_default_and_a_value_that_is_no_count_are_noted_not_taken(tmp_path):
    from hf_scratch_transformer.cpu_threads import available_cores, thread_limit

    launched = thread_limit({"OMP_NUM_THREADS": "1", "ACCELERATE_MIXED_PRECISION": "no"}, tmp_path / "no-proc")
    assert launched.threads == available_cores() and "what accelerate launch sets" in launched.notes[0]
    odd = thread_limit({"OMP_NUM_THREADS": "four"}, tmp_path / "no-proc")
    assert odd.threads == available_cores() and "'four' is no whole number" in odd.notes[0]
    assert thread_limit({"OMP_NUM_THREADS": "2", "TORCHELASTIC_RUN_ID": "x"}, tmp_path / "no-proc").threads == \
        min(2, available_cores())


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to take one away")
def test_an_affinity_mask_set_like_taskset_is_the_limit_in_a_real_process():
    script = ("from hf_scratch_transformer.cpu_threads import thread_limit; import os; "
              "limit = thread_limit({k: v for k, v in os.environ.items() if not k.endswith('_NUM_THREADS')}); "
              "print(limit.threads, limit.reason, sep='|')")
    core = min(os.sched_getaffinity(0))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO,
                          preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    threads, reason = done.stdout.strip().split("|")
    assert threads == "1" and "affinity mask" in reason


def test_cpu_threads_above_the_limit_is_lowered_to_it_with_a_warning(caplog, monkeypatch):
    from hf_scratch_transformer.cpu_threads import thread_limit, thread_tuner

    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(variable, raising=False)
    limit = thread_limit()
    with caplog.at_level(logging.WARNING, logger="hf_scratch_transformer"):
        tuner = thread_tuner(torch.device("cpu"), "training", fixed=999)
    assert tuner.current == limit.threads
    assert f"--cpu_threads 999 is more than this process may use ({limit.reason})" in caplog.text


@pytest.mark.parametrize("name", ["training", "translation"])
def test_omp_num_threads_bounds_the_tuner_of_training_and_translation_and_its_line_says_so(name, monkeypatch):
    from hf_scratch_transformer.cpu_threads import thread_tuner

    for variable in ("ACCELERATE_MIXED_PRECISION", "TORCHELASTIC_RUN_ID", "MKL_NUM_THREADS"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    try:
        tuner = thread_tuner(torch.device("cpu"), name)
        tuner.activate()
        assert tuner.max_threads == 1 and torch.get_num_threads() == 1
        assert "the most it may use, OMP_NUM_THREADS=1" in tuner.describe()
    finally:
        torch.set_num_threads(threads)
