"""Launching and several processes, on one machine or on several: how many processes were launched (refusing
launches that would not give them), Accelerate started for them (`start_accelerator`), the process-group timeout
(--ddp_timeout), agreement between processes (`agree`, `any_process`), processes other than the main one kept quiet,
checkpoints written by the main process alone, and a watch that names the process that was lost when a collective
operation (all-reduce, barrier) fails.

Rank 0 (the global main process) is the only writer of the output directory and the only one to print results;
the other processes read what it wrote (the staged tokenizer, the checkpoints to resume), so on several machines the
output directory must be on a filesystem that every machine sees.
"""

import contextlib
import json
import logging
import os
import socket
import tempfile
import threading
import time
import uuid
import warnings
from datetime import timedelta
from pathlib import Path

import datasets
import torch
import transformers
from accelerate import Accelerator, PartialState
from accelerate.checkpointing import save_accelerator_state
from accelerate.state import AcceleratorState, is_initialized
from accelerate.utils import RNG_STATE_NAME, broadcast_object_list, gather_object

from ..errors import TrainingFault, UsageError

logger = logging.getLogger("hf_scratch_transformer")
RANK_VARIABLES = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
HEARTBEAT_SECONDS = 1.0  # how often each process says it is alive
SILENT_SECONDS = 5.0  # a process whose heartbeat has not moved for this long is counted as lost
STORE_SECONDS = 10.0  # the longest wait for one answer of the launcher's key-value store
# gloo reports a lost peer ("Connection reset by peer", "Timed out waiting ... for recv") as a plain RuntimeError
# whose text starts with the gloo source file; NCCL and the stores raise torch.distributed.DistError.
GLOO_ERROR_MARKER = "gloo/transport/"


def launched_rank() -> int:
    """This process's global rank as the launcher set it (0 without a launcher), readable before Accelerate starts."""
    return next((int(os.environ[name]) for name in RANK_VARIABLES if os.environ.get(name)), 0)


def launched_world_size() -> int:
    """How many processes the launcher started (1 without a launcher); `check_launch` has refused launches that
    would not give them."""
    return next((int(os.environ[name]) for name in WORLD_SIZE_VARIABLES if os.environ.get(name)), 1)


LAUNCHER_PRECISIONS = ("bf16", "fp16")  # `accelerate launch --mixed_precision` values train.py applies ("no": none)


def launcher_precision() -> str | None:
    """The mixed precision `accelerate launch --mixed_precision` (or a config file's `mixed_precision`) asked for:
    "bf16", "fp16", or None for "no", which is also what accelerate launch passes when given nothing."""
    value = os.environ.get("ACCELERATE_MIXED_PRECISION", "").strip().lower()
    return value if value in LAUNCHER_PRECISIONS else None


def check_launch(args) -> None:
    """Before any work: refuse a launch that would not start the processes it names, a process count left in the
    environment without a launcher, FSDP, and a launcher's precision that contradicts --bf16 / --fp16.

    accelerate 1.15 starts several processes through torchrun (`--multi_gpu`, or `distributed_type: MULTI_GPU`),
    which also works without GPUs (gloo). Without --multi_gpu on a machine without GPUs, `--num_processes N` (and
    `--cpu --num_processes N`, `distributed_type: MULTI_CPU`) goes to its "simple" launcher instead, which starts ONE
    process (it sets MASTER_ADDR/MASTER_PORT, never LOCAL_RANK) and expects mpirun to start the others."""
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        raise UsageError(
            "FSDP is not supported by train.py: validation, test decoding and saving run on the main process and "
            "need the whole model, which FSDP shards; use DDP instead (configs/accelerate/multi_gpu.yaml on GPUs, "
            "configs/accelerate/cpu_2proc.yaml on CPUs)")
    world_size = launched_world_size()
    simple_launcher = "ACCELERATE_USE_CPU" in os.environ and "LOCAL_RANK" not in os.environ
    if world_size == 1 and simple_launcher and os.environ.get("MASTER_PORT"):
        raise UsageError(
            "`accelerate launch --num_processes N` without --multi_gpu on a machine without GPUs (and `--cpu "
            "--num_processes N`, distributed_type: MULTI_CPU) starts only one process in accelerate 1.15 unless "
            "mpirun starts the others: use `accelerate launch --multi_gpu --num_processes N --num_machines 1 "
            "train.py ...` (gloo on CPUs) or --config_file configs/accelerate/cpu_2proc.yaml")
    if world_size > 1:
        _check_launched_by_a_launcher(world_size)
    _check_launcher_precision(args)


def _check_launched_by_a_launcher(world_size: int) -> None:
    """A process count > 1 comes with what a launcher sets beside it: this process's rank and the address of
    rank 0 (MASTER_ADDR). Without them it is a variable left in the environment, and joining would fail or wait."""
    variable = next(name for name in WORLD_SIZE_VARIABLES if os.environ.get(name))
    missing = [name for name in ("MASTER_ADDR",) if not os.environ.get(name)]
    if not any(os.environ.get(name) for name in RANK_VARIABLES):
        missing.insert(0, RANK_VARIABLES[WORLD_SIZE_VARIABLES.index(variable)])
    if missing:
        raise UsageError(
            f"{variable}={world_size} is set in the environment, but no launcher started this process "
            f"({' and '.join(missing)} not set): unset {variable} to train in one process, or start {world_size} "
            f"with `accelerate launch --multi_gpu --num_processes {world_size} --num_machines 1 train.py ...`")


def _check_launcher_precision(args) -> None:
    """`accelerate launch --mixed_precision X` applies when train.py is given no --bf16 / --fp16 (recipe.py); a flag
    that says otherwise, or a precision train.py does not train in, is refused."""
    value = os.environ.get("ACCELERATE_MIXED_PRECISION", "").strip().lower()
    if value in ("", "no"):
        return
    if value not in LAUNCHER_PRECISIONS:
        raise UsageError(f"accelerate launch --mixed_precision {value} (ACCELERATE_MIXED_PRECISION) is not a precision "
                         f"train.py trains in: launch with --mixed_precision bf16, fp16 or no")
    flag = "--bf16" if args.bf16 else "--fp16" if args.fp16 else "--bf16 false" if args.bf16 is False else None
    if flag is not None and flag != f"--{value}":
        raise UsageError(f"accelerate launch --mixed_precision {value} and train.py's {flag} contradict each other: "
                         f"give the precision once (train.py's --bf16 / --fp16, or the launcher's --mixed_precision)")


def join_processes(timeout_seconds: int) -> PartialState:
    """The launched processes joined (one alone: nothing to join), before Accelerate's precision is fixed: its
    `device` is where this process trains (the recipe's precision depends on it). On a machine without GPUs a
    torchrun-style launch gives one CPU process per rank over gloo (MULTI_CPU)."""
    world_size = launched_world_size()
    cpu = world_size > 1 and not torch.cuda.is_available()
    if world_size > 1:
        start_process_group(cpu, timeout_seconds)
    return PartialState(cpu=cpu)


def trackers(args) -> list[str]:
    """The Accelerate trackers of --report_to ("none": no tracker)."""
    return [name.strip() for name in args.report_to.split(",") if name.strip() not in ("", "none")]


def start_accelerator(args, output_dir: Path, precision: str, probe_folder) -> Accelerator:
    """Accelerate for the launched processes (refused if it does not join them all; collectives wait at most
    --ddp_timeout seconds, and a heartbeat lets a failed one name the lost process); on a CPU, every core used.

    `precision` is the recipe's. Accelerate keeps one mixed precision per process (a process-wide state that only
    private methods reset), so Accelerate runs in fp32 for fp32 and bf16 alike, and the training loop applies bf16
    autocast itself (the `torch.autocast` Accelerate would put on the model's forward): runs of both precisions can
    follow each other in one process (a notebook, the tests). fp16 needs Accelerate's gradient scaler and stays
    Accelerate's; a process that trained in fp16 is refused another precision with one line. `probe_folder()` makes
    the folder the shared-directory check writes into (run_directory.staging_folder)."""
    world_size = launched_world_size()
    join_processes(args.ddp_timeout)  # done already when the recipe read the device: PartialState is one per process
    cpu = world_size > 1 and not torch.cuda.is_available()
    mixed_precision = "fp16" if precision == "fp16" else "no"
    if is_initialized() and AcceleratorState().mixed_precision != mixed_precision:
        raise UsageError(f"this Python process already trained in {AcceleratorState().mixed_precision}, and "
                         f"Accelerate keeps one mixed precision per process: run train.py in a new process for a run "
                         f"in {precision}")
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              mixed_precision=mixed_precision, log_with=trackers(args) or None,
                              project_dir=str(output_dir), cpu=cpu)
    if accelerator.num_processes != world_size:
        raise UsageError(
            f"{world_size} processes were launched but Accelerate joined {accelerator.num_processes} of "
            f"them: they would race in one --output_dir; launch with `accelerate launch --multi_gpu "
            f"--num_processes {world_size} --num_machines 1` (see README, Several processes)")
    quiet_other_processes(accelerator)
    check_shared_output_dir(accelerator, output_dir, probe_folder)
    watch_processes(accelerator)
    return accelerator


def agree(accelerator, flag: bool) -> bool:
    """The main process's `flag`, on every process (the others' flags are ignored): what it decides (the best model,
    early stopping, the time budget) all of them do at the same step."""
    return main_process_value(accelerator, float(flag)) > 0


def main_process_value(accelerator, value: float) -> float:
    """The main process's `value`, on every process (the others' values are ignored): the time a schedule is fitted
    to, and `agree`'s flag."""
    if accelerator.num_processes == 1:
        return value
    mine = torch.tensor(value if accelerator.is_main_process else 0.0, dtype=torch.float64, device=accelerator.device)
    return float(accelerator.reduce(mine, "sum").item())


def any_process(accelerator, flag: bool) -> bool:
    """Whether `flag` holds on any process (a signal that reached one of them), on every process."""
    if accelerator.num_processes == 1:
        return flag
    value = torch.tensor(float(flag), device=accelerator.device)
    return bool(accelerator.reduce(value, "sum").item() > 0)


def start_process_group(cpu: bool, timeout_seconds: int) -> None:
    """Join the launched processes with `timeout_seconds` as the limit of every collective operation (what
    transformers' --ddp_timeout sets). Passed to Accelerate's PartialState, which the Accelerator then reuses:
    Accelerate's InitProcessGroupKwargs drops a timeout equal to its own default (600 s), so that value would give
    torch's default (30 minutes on gloo) instead."""
    PartialState(cpu=cpu, timeout=timedelta(seconds=timeout_seconds))


def report_to_launcher(message: str) -> None:
    """Give torchrun the one-line message of a failed process: it shows it as the `traceback` of its closing
    "Root Cause" block (instead of a link to its documentation), after the worker's own output. The error file is
    torch elastic's (TORCHELASTIC_ERROR_FILE, set for each worker); a plain-string "message" is shown as it is."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):  # the message is on stderr already
            Path(error_file).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))


def quiet_other_processes(accelerator) -> None:
    """Only the main process logs progress and warnings; the others print errors only."""
    if accelerator.is_main_process:
        return
    logger.setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    datasets.logging.set_verbosity_error()
    warnings.simplefilter("ignore")


def check_shared_output_dir(accelerator, output_dir: Path, probe_folder) -> None:
    """Refuse (on every process, exit 2) an output directory that some process does not share with rank 0: rank 0
    writes a random token into a fresh hidden folder there (`probe_folder(output_dir)`, run_directory.staging_folder, a
    context manager entered on rank 0 only) and every process reads it back before it is removed."""
    if accelerator.num_processes == 1:
        return
    with probe_folder(output_dir) if accelerator.is_main_process else contextlib.nullcontext() as folder:
        token = [None]
        if folder is not None:
            token = [f"{folder.name}/{uuid.uuid4().hex}"]
            (folder / "token").write_text(token[0])
        broadcast_object_list(token)  # after rank 0 wrote the file
        try:
            sees = (output_dir / token[0].split("/")[0] / "token").read_text() == token[0]
        except OSError:
            sees = False
        where = {"rank": accelerator.process_index, "machine": int(os.environ.get("GROUP_RANK", 0)), "sees": sees}
        blind = [f"rank {w['rank']} (machine {w['machine']})" for w in gather_object([where]) if not w["sees"]]
    if blind:
        raise UsageError(
            f"--output_dir {output_dir} is not shared by every machine: {', '.join(blind)} cannot read what rank 0 "
            f"writes there (machine 0 alone writes it; the others read the tokenizer and the checkpoints from it): "
            f"put it on a filesystem that every machine mounts at the same path")


# ------------------------------------------------------------------------------------------------- checkpoints


def save_state_on_main(accelerator, directory: Path) -> None:
    """`accelerator.save_state(directory)` with a single writer: the main process writes the model, the optimiser,
    the schedule and its random states, and also the random states of every other process, gathered over the process
    group (Accelerate's own file per process, `random_states_<rank>.pkl`, which `load_state` reads back on each
    process). The other processes write nothing in the output directory: no two machines write one shared folder,
    and none depends on seeing another's files before the completion marker is written."""
    states, failed = None, None
    if not accelerator.is_main_process:
        try:
            with tempfile.TemporaryDirectory() as scratch:  # Accelerate's format, outside the output directory
                saved = save_accelerator_state(scratch, [], [], [], [], accelerator.process_index, accelerator.step)
                states = (Path(saved) / f"{RNG_STATE_NAME}_{accelerator.process_index}.pkl").read_bytes()
        except (OSError, RuntimeError) as error:  # raised after the gather, which the others are waiting in
            failed = error
    gathered = gather_object([(accelerator.process_index, states)]) if accelerator.num_processes > 1 else []
    if failed is not None:
        raise failed
    missing = [index for index, data in gathered if data is None and index != accelerator.process_index]
    if accelerator.is_main_process and missing:  # no checkpoint without every part
        raise OSError(f"process(es) {missing} could not save their random states (see their own messages)")
    if accelerator.is_main_process:
        accelerator.save_state(str(directory), safe_serialization=True)
        for index, data in gathered:
            if data is not None:
                (directory / f"{RNG_STATE_NAME}_{index}.pkl").write_bytes(data)


# ---------------------------------------------------------------------------------------------- lost processes


class PeerWatch:
    """Each process of a multi-process run adds 1 to its own counter in the launcher's key-value store (torchrun's
    TCPStore, on machine 0) every HEARTBEAT_SECONDS, from a background thread. When a collective operation fails,
    `lost()` names the processes whose counter stopped: ended, killed, stopped or cut off."""

    def __init__(self, rank: int, world_size: int, address: str, port: int):
        self.rank, self.world_size, self.address = rank, world_size, f"{address}:{port}"
        run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
        self.prefix = f"hf_scratch_transformer/{run}/"
        self.store = self._connect(address, port)  # for `lost()`; the heartbeat thread has its own connection
        me = {"machine": int(os.environ.get("GROUP_RANK", 0)), "machines": int(os.environ.get("GROUP_WORLD_SIZE", 1)),
              "host": socket.gethostname(), "pid": os.getpid()}
        self.store.set(f"{self.prefix}process-{rank}", json.dumps(me))
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(self._connect(address, port),), daemon=True,
                                        name="hf_scratch_transformer heartbeat")
        self._thread.start()

    @staticmethod
    def _connect(address: str, port: int):
        return torch.distributed.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=STORE_SECONDS))

    def _beat(self, store) -> None:
        try:
            while not self._stopped.wait(HEARTBEAT_SECONDS):
                store.add(f"{self.prefix}beat-{self.rank}", 1)
        except (RuntimeError, torch.distributed.DistError):  # the store is gone: `lost()` will say so
            return

    def stop(self) -> None:
        self._stopped.set()

    def lost(self) -> list[int] | None:
        """The other ranks whose heartbeat did not move for SILENT_SECONDS; None if the store does not answer (the
        machine that holds it, machine 0, is gone)."""
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        try:
            before = {rank: self.store.add(f"{self.prefix}beat-{rank}", 0) for rank in others}
            time.sleep(SILENT_SECONDS)
            return [rank for rank in others if self.store.add(f"{self.prefix}beat-{rank}", 0) == before[rank]]
        except (RuntimeError, torch.distributed.DistError):
            return None

    def describe(self, rank: int) -> str:
        """"rank 1 (machine 1 of 2, host h, pid p)" as that process registered itself."""
        try:
            me = json.loads(self.store.get(f"{self.prefix}process-{rank}"))
        except (RuntimeError, torch.distributed.DistError):
            return f"rank {rank}"
        return f"rank {rank} (machine {me['machine']} of {me['machines']}, host {me['host']}, pid {me['pid']})"


_watch: PeerWatch | None = None  # one per process, like the process group it watches


def watch_processes(accelerator) -> None:
    """Start this process's heartbeat (multi-process runs launched with a rendezvous address only)."""
    global _watch
    stop_watching()
    if accelerator.num_processes > 1 and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        _watch = PeerWatch(accelerator.process_index, accelerator.num_processes, os.environ["MASTER_ADDR"],
                           int(os.environ["MASTER_PORT"]))


def stop_watching() -> None:
    global _watch
    if _watch is not None:
        _watch.stop()
        _watch = None


def is_lost_process_error(error: BaseException) -> bool:
    """A collective operation failed because another process ended, stopped or was cut off (or timed out)."""
    return isinstance(error, torch.distributed.DistError) or GLOO_ERROR_MARKER in str(error)


def lost_process_fault(error: BaseException, last_checkpoint: Path | None, timeout_seconds: int) -> TrainingFault:
    """The one-line fault of a failed collective operation: which process was lost, the last complete checkpoint
    (untouched: a checkpoint only counts once its completion marker is written and it is renamed) and how to go
    on."""
    timed_out = "timed out" in str(error).lower()
    lost = _watch.lost() if _watch is not None else []
    if lost is None:
        cause = f"lost machine 0: the rendezvous store at {_watch.address} (on machine 0) no longer answers"
    elif lost:
        how = f"no answer within --ddp_timeout {timeout_seconds} s" if timed_out else "its connection closed"
        cause = f"lost {', '.join(_watch.describe(rank) for rank in lost)}: it ended or stopped ({how})"
    elif _watch is not None and timed_out:
        return TrainingFault(
            f"no answer from the other processes within --ddp_timeout {timeout_seconds} s, though all of them are "
            f"still running: raise --ddp_timeout above the longest step the main process does alone (tokenizer "
            f"training, preprocessing, validation, saving)")
    else:
        cause = f"lost contact with another process ({str(error).splitlines()[0][:200]})"
    if last_checkpoint is None:
        return TrainingFault(f"{cause}; no checkpoint had been completed yet: start every machine again with "
                             f"--overwrite_output_dir")
    return TrainingFault(f"{cause}; the last complete checkpoint is {last_checkpoint}: restart every machine with "
                         f"--resume_from_checkpoint latest")
