"""How many CPU threads torch uses: measured while the work runs, not assumed from the core count.

On a machine whose cores are also busy with other work (a browser, another job, a CI neighbour), torch's default
of one thread per core can be many times slower than fewer threads: at every operator's barrier the threads wait for
one that the operating system has descheduled, and the small operators of a small model hit those barriers
thousands of times per step. `ThreadTuner` measures throughput (work per second: tokens trained, tokens translated)
over short windows, tries the neighbouring thread counts now and then, keeps the fastest, and tries again at once
when throughput falls.

That speed has a price: torch's CPU kernels (LayerNorm's gradient, bf16 matrix products on AMX) split their sums by
thread count, so a run whose count changes with the load does not repeat bit for bit. A pinned count (`fixed`,
--cpu_threads N) measures nothing and repeats: fp32 training is bit-identical run to run at the same count.

    tuner = ThreadTuner(max_threads=2, name="training")
    tuner.activate()
    for batch in batches:
        started = time.perf_counter(); train_step(batch)
        tuner.record(work=tokens_in(batch), seconds=time.perf_counter() - started)
"""

import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("hf_scratch_transformer")


def cpu_model_and_flags() -> tuple[str, set[str]]:
    """The first CPU's model name and feature flags from /proc/cpuinfo (platform.processor() and none elsewhere)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "flags"):
                    fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields.get("model name") or platform.processor() or "unknown CPU", set(fields.get("flags", "").split())


def cpu_bf16_units() -> str | None:
    """The CPU's bf16 matrix units, which decide whether `--bf16` pays there: "AMX" (Intel Sapphire Rapids and later),
    "AVX-512 BF16" (AMD Zen 4 and later, Intel Cooper Lake) or None (bf16 would be emulated)."""
    flags = cpu_model_and_flags()[1]
    return "AMX" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else None


def cpu_int8_units() -> str | None:
    """The CPU's int8 dot-product units, which decide whether int8 decoding (`torch._int_mm`) pays there: "AMX",
    "AVX-512 VNNI", "AVX-VNNI" or None (then int8 products run several times slower than fp32 ones)."""
    flags = cpu_model_and_flags()[1]
    return ("AMX" if "amx_int8" in flags else "AVX-512 VNNI" if "avx512_vnni" in flags
            else "AVX-VNNI" if "avx_vnni" in flags else None)


def thread_tuner(device, name: str, fixed: int = 0) -> "ThreadTuner | None":
    """The thread policy of one kind of work on `device` (None off the CPU): adapted to the load up to
    `thread_limit()`, or `fixed` (--cpu_threads N) when it is not 0, lowered to that limit with a warning when it is
    above it (more threads than cores only wait for each other)."""
    if getattr(device, "type", device) != "cpu":
        return None
    limit = thread_limit()
    if fixed and fixed > limit.threads:
        logger.warning(f"--cpu_threads {fixed} is more than this process may use ({limit.reason}): {limit.threads} "
                       f"thread(s) used")
        fixed = limit.threads
    tuner = ThreadTuner(limit.threads, name, fixed=fixed or None, limit=limit)
    tuner.calibrate()
    return tuner


# ------------------------------------------------------------------------------------------- how many threads at most

LAUNCHER_VARIABLES = {"ACCELERATE_MIXED_PRECISION": "accelerate launch", "TORCHELASTIC_RUN_ID": "torchrun"}
PIN_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class ThreadLimit:
    """The most threads a process should use, why (`reason`, for the log) and what was not taken as a limit
    (`notes`: a launcher's default, a value that is no count)."""

    threads: int
    reason: str
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """"1 (OMP_NUM_THREADS=1)": the limit as train_results.json records it."""
        return f"{self.threads} ({'; '.join((self.reason, *self.notes))})"


def thread_limit(environ=None, proc: Path = Path("/proc/self")) -> ThreadLimit:
    """The smallest of: the cores this process may run on (`available_cores`: its affinity mask, as `taskset` or a
    container's cpuset sets it) and the CPU quota of its cgroup (`cgroup_cpu_quota`), shared by the processes a
    launcher started on this machine (LOCAL_WORLD_SIZE); and the user's OMP_NUM_THREADS / MKL_NUM_THREADS.
    `accelerate launch` and torchrun set OMP_NUM_THREADS=1 for every process they start when the user gave no
    value: under them 1 is taken for the launcher's and is no limit (a note says so); another value is the user's."""
    environ = os.environ if environ is None else environ
    cores, total = available_cores(), os.cpu_count() or 1
    limits = [(cores, f"{cores} core(s) in this process's affinity mask (taskset, cpuset)" if cores < total
               else f"the machine's {cores} core(s)")]
    quota = cgroup_cpu_quota(proc)
    if quota is not None:
        limits.append((max(1, math.floor(quota[0])), f"its cgroup's CPU quota of {quota[0]:g} CPU(s) ({quota[1]})"))
    local_processes = _whole_number(environ.get("LOCAL_WORLD_SIZE")) or 1
    if local_processes > 1:
        cpus, why = min(limits)
        limits.append((max(1, cpus // local_processes), f"{why}, shared by the {local_processes} processes launched "
                                                         f"on this machine (LOCAL_WORLD_SIZE)"))
    notes = []
    launcher = next((name for variable, name in LAUNCHER_VARIABLES.items() if variable in environ), None)
    for variable in PIN_VARIABLES:
        value = environ.get(variable)
        if value is None or not value.strip():
            continue
        count = _whole_number(value)
        if count is None:
            notes.append(f"{variable}={value!r} is no whole number >= 1 and was not taken as a limit")
        elif count == 1 and launcher and variable == "OMP_NUM_THREADS":
            notes.append(f"OMP_NUM_THREADS=1 is what {launcher} sets for each process when given no value, so it was "
                         f"not taken as a limit (--cpu_threads 1 pins one thread)")
        else:
            limits.append((count, f"{variable}={count}"))
    threads, reason = min(limits, key=lambda limit: limit[0])
    return ThreadLimit(threads, reason, tuple(notes))


def _whole_number(value: str | None) -> int | None:
    try:
        number = int(str(value).strip())
    except ValueError:
        return None
    return number if number >= 1 else None


def cgroup_cpu_quota(proc: Path = Path("/proc/self")) -> tuple[float, str] | None:
    """(CPUs, where it was read) of the tightest CPU quota on this process's cgroup or its ancestors: cgroup v2's
    cpu.max (`150000 100000`: 1.5 CPUs), cgroup v1's cpu.cfs_quota_us / cpu.cfs_period_us; None when there is none
    (or no cgroup file system). `proc` is /proc/self (tests give a made-up one)."""
    try:
        memberships = (proc / "cgroup").read_text().splitlines()
        mounts = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    found = []
    for directory, top, version in _cpu_cgroup_directories(memberships, mounts):
        while True:
            quota = _read_quota(directory, version)
            if quota is not None:
                found.append(quota)
            if directory == top or top not in directory.parents:
                break
            directory = directory.parent
    return min(found) if found else None


def _cpu_cgroup_directories(memberships: list[str], mounts: list[str]):
    """(this process's cgroup directory, the mount point above which nothing is read, 1 or 2) per mounted cgroup
    hierarchy with the cpu controller, from /proc/self/cgroup (`id:controllers:path`) and /proc/self/mountinfo."""
    paths = {}  # cgroup version -> this process's cgroup path in that hierarchy
    for line in memberships:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            paths[2] = path
        elif "cpu" in controllers.split(","):
            paths[1] = path
    for line in mounts:
        fields, _, described = line.partition(" - ")
        fields, described = fields.split(), described.split()
        if len(fields) < 5 or len(described) < 3:
            continue
        fstype, options = described[0], described[-1].split(",")
        version = 2 if fstype == "cgroup2" else 1 if fstype == "cgroup" and "cpu" in options else None
        if version not in paths:
            continue
        root, mount_point = fields[3], Path(fields[4])  # the mount shows the hierarchy from `root` down
        relative = os.path.relpath(paths[version], root) if paths[version].startswith(root) else "."
        yield Path(os.path.normpath(mount_point / relative)), mount_point, version


def _read_quota(directory: Path, version: int) -> tuple[float, str] | None:
    """(CPUs, file and contents) of one cgroup's quota, or None when it sets none."""
    try:
        if version == 2:
            text = (directory / "cpu.max").read_text().split()
            if text[0] == "max":
                return None
            quota, period, where = int(text[0]), int(text[1]), f"{directory / 'cpu.max'}: {' '.join(text)}"
        else:
            quota = int((directory / "cpu.cfs_quota_us").read_text())
            period = int((directory / "cpu.cfs_period_us").read_text())
            where = f"{directory}/cpu.cfs_quota_us {quota} / cpu.cfs_period_us {period}"
    except (OSError, ValueError, IndexError):
        return None
    return (quota / period, where) if quota > 0 and period > 0 else None


def stand_in_work(rows: int = 512, width: int = 256, hidden: int = 1024) -> Callable[[], None]:
    """A few milliseconds of what a Transformer step is made of (matmuls of a layer's shapes, ReLU, LayerNorm)."""
    generator = torch.Generator().manual_seed(0)
    inputs, weight = torch.randn(rows, width, generator=generator), torch.randn(width, hidden, generator=generator)

    def work() -> None:
        hidden_states = inputs
        for _ in range(4):
            hidden_states = torch.nn.functional.layer_norm((hidden_states @ weight).relu_() @ weight.T, (width,))
    return work


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask: what `taskset` or a container allows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass
class _Window:
    work: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def throughput(self) -> float:
        return self.work / self.seconds if self.seconds > 0 else 0.0


class ThreadTuner:
    """Chooses torch's intra-op thread count from measured throughput (see the module docstring).

    Args:
        max_threads: the most threads to use (`thread_limit()`: the cores available to this process, its pins).
        name: what is measured, for the log ("training", "translation").
        fixed: a thread count to keep (e.g. --cpu_threads N); nothing is measured then.
        window_seconds / min_window_steps: a measurement window lasts at least this long and this many steps.
        recheck_seconds / max_recheck_seconds: measured time between two checks of the other thread counts; the
            interval doubles (up to the maximum) each time a check keeps the current count.
        drop_ratio: a window slower than this fraction of the usual throughput triggers a check at once.
        margin: another thread count must be this much faster to be chosen.
        warmup_windows: windows measured and ignored at the start (first steps allocate memory and warm caches:
            counting them would make the starting count look slow).
        set_threads: applies a thread count (torch.set_num_threads; tests pass their own).
        limit: where `max_threads` comes from, for the log (`thread_limit()`).
    """

    def __init__(self, max_threads: int, name: str, fixed: int | None = None, *, window_seconds: float = 2.0,
                 min_window_steps: int = 3, recheck_seconds: float = 30.0, max_recheck_seconds: float = 240.0,
                 drop_ratio: float = 0.6, margin: float = 1.05, warmup_windows: int = 1,
                 set_threads: Callable[[int], None] = torch.set_num_threads, limit: ThreadLimit | None = None):
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}")
        self.max_threads, self.name, self.fixed = max_threads, name, fixed
        self.limit = limit or ThreadLimit(max_threads, f"at most {max_threads} asked for")
        self.window_seconds, self.min_window_steps = window_seconds, min_window_steps
        self.recheck_seconds, self.max_recheck_seconds = recheck_seconds, max_recheck_seconds
        self.drop_ratio, self.margin, self.set_threads = drop_ratio, margin, set_threads
        self._warmup_windows = warmup_windows
        self.current = fixed if fixed else max_threads
        self.applied: int | None = None  # the count in use now (another one while it is being measured)
        self.changes: list[dict] = []  # every change: {"from", "to", "throughputs", "reason"}
        self._window = _Window()
        self._usual: float | None = None  # throughput of recent windows at the current count (moving average)
        self._interval = 0.0  # the first check comes after the first window
        self._since_check = 0.0
        self._probe: list[int] = []  # thread counts still to measure in the check under way
        self._measured: dict[int, float] = {}  # throughput per thread count in the check under way
        self._reason = ""

    def calibrate(self, work: Callable[[], None] | None = None, rounds: int = 4, decisive: float = 1.25) -> None:
        """Before the real work (about half a second): time `work` (default: `stand_in_work`) at the current count
        and its neighbours, alternating (ABAB), and start with the fastest. A count faster than every other by
        `decisive` is trusted until the first periodic check; otherwise the real work is measured at once."""
        if not self.adaptive:
            return
        work = work or stand_in_work()
        counts = [self.current, *self._candidates()]
        times: dict[int, list[float]] = {count: [] for count in counts}
        for _ in range(rounds):
            for count in counts:
                self.set_threads(count)
                work()  # the first call at a count wakes its threads
                started = time.perf_counter()
                work()
                times[count].append(time.perf_counter() - started)
        speed = {count: 1.0 / statistics.median(values) for count, values in times.items()}
        best = max(speed, key=speed.get)
        others = [value for count, value in speed.items() if count != best]
        if best != self.current and speed[best] > self.margin * speed[self.current]:
            rates = {str(count): round(value, 1) for count, value in sorted(speed.items())}
            self.changes.append({"from": self.current, "to": best, "reason": "start-up calibration",
                                 "throughputs": rates})
            logger.info(f"CPU threads for {self.name}: {self.current} -> {best} (start-up calibration: "
                        + ", ".join(f"{count}: {1000 / value:.1f} ms" for count, value in sorted(speed.items())) + ")")
            self.current = best
        if all(speed[self.current] >= decisive * value for value in others):
            self._interval = self.recheck_seconds
        self._apply(self.current)

    @property
    def adaptive(self) -> bool:
        return not self.fixed and self.max_threads > 1

    def activate(self) -> None:
        """Apply the current thread count (call when the work this tuner measures starts or resumes)."""
        self._apply(self.current)

    def _apply(self, count: int) -> None:
        self.applied = count
        self.set_threads(count)

    def describe(self) -> str:
        """The log line of the policy: the count, the limit and why (a user's pin, a quota...), what was not taken as
        a limit, and what it means for reproducibility."""
        notes = "".join(f"; {note}" for note in self.limit.notes)
        if not self.adaptive:
            why = "pinned by --cpu_threads" if self.fixed else f"the most it may use, {self.limit.reason}"
            return (f"{self.current} CPU thread(s) for {self.name} ({why}: results repeat bit for bit at this "
                    f"count{notes})")
        return (f"{self.current} CPU thread(s) for {self.name} to start with, then adapted to the load (1 to "
                f"{self.max_threads}: {self.limit.reason}{notes}): faster on busy cores, but the sums depend on the "
                f"thread count, so results do not repeat bit for bit; --cpu_threads N pins N and makes them repeat")

    def record(self, work: float, seconds: float) -> None:
        """Account one step (`work` units done in `seconds`); may change the thread count."""
        if not self.adaptive or seconds <= 0:
            return
        window = self._window
        window.work, window.seconds, window.steps = window.work + work, window.seconds + seconds, window.steps + 1
        if self._probe and self._clearly_slower(window):
            self._end_window()  # a candidate already much slower than the current count: no need to go on
        elif window.seconds >= self.window_seconds and window.steps >= self.min_window_steps:
            self._end_window()

    def _clearly_slower(self, window: _Window) -> bool:
        current = self._measured.get(self.current)
        return current is not None and window.throughput() < 0.5 * current

    def _end_window(self) -> None:
        throughput, seconds = self._window.throughput(), self._window.seconds
        self._window = _Window()
        if self._warmup_windows > 0:
            self._warmup_windows -= 1
            return
        if self._probe:
            count = self._probe.pop(0)
            # the current count is measured before and after the others (ABA): a trend in the work (batches
            # sorted by length, a load that comes and goes) then favours no count
            self._measured[count] = (throughput if count not in self._measured
                                     else (self._measured[count] + throughput) / 2)
            if self._probe:
                self._apply(self._probe[0])
            else:
                self._decide()
            return
        self._since_check += seconds
        if self._usual is not None and throughput < self.drop_ratio * self._usual:
            self._start_check(throughput, f"{self.name} throughput fell from {self._usual:,.0f} to {throughput:,.0f}")
        elif self._since_check >= self._interval:
            self._start_check(throughput, "periodic check" if self.changes or self._usual else "first check")
        else:
            self._usual = throughput if self._usual is None else 0.8 * self._usual + 0.2 * throughput

    def _candidates(self) -> list[int]:
        near = {self.current - 1, self.current + 1, self.current // 2}
        return sorted(count for count in near if 1 <= count <= self.max_threads and count != self.current)

    def _start_check(self, current_throughput: float, reason: str) -> None:
        self._measured = {self.current: current_throughput}
        self._probe, self._reason = [*self._candidates(), self.current], reason
        self._apply(self._probe[0])

    def _decide(self) -> None:
        """After measuring every candidate: keep the fastest (the current count unless another is clearly faster)."""
        previous, measured = self.current, self._measured
        best = max(measured, key=measured.get)
        if best != previous and measured[best] > self.margin * measured[previous]:
            self.current = best
            rates = {str(count): round(value, 1) for count, value in sorted(measured.items())}  # JSON keys
            self.changes.append({"from": previous, "to": best, "reason": self._reason, "throughputs": rates})
            logger.info(f"CPU threads for {self.name}: {previous} -> {best} ({self._reason}; measured "
                        + ", ".join(f"{count}: {value:,.0f}/s" for count, value in sorted(measured.items())) + ")")
            self._interval = self.recheck_seconds
        else:
            self._interval = min(max(2 * self._interval, self.recheck_seconds), self.max_recheck_seconds)
        self._usual = measured[self.current]
        self._since_check, self._measured = 0.0, {}
        self._apply(self.current)
