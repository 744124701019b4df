"""Several processes, on one machine or on several: the process-group timeout (--ddp_timeout), processes other than
the main one kept quiet, checkpoints written by the main process alone, and a watch that names the process that was
lost when a collective operation (all-reduce, barrier) fails.

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
from accelerate import PartialState
from accelerate.checkpointing import save_accelerator_state
from accelerate.utils import RNG_STATE_NAME, broadcast_object_list, gather_object

from ..errors import TrainingFault, UsageError

logger = logging.getLogger("hf_scratch_transformer")
RANK_VARIABLES = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
HEARTBEAT_SECONDS = 1.0  # how often each process says it is alive
SILENT_SECONDS = 5.0  # a process whose heartbeat has not moved for this long is counted as lost
STORE_SECONDS = 10.0  # the longest wait for one answer of the launcher's key-value store
# gloo reports a lost peer ("Connection reset by peer", "Timed out waiting ... for recv") as a plain RuntimeError
# whose text starts with the gloo source file; NCCL and the stores raise torch.distributed.DistError.
GLOO_ERROR_MARKER = "gloo/transport/"


def launched_rank() -> int:
    """This process's global rank as the launcher set it (0 without a launcher), readable before Accelerate starts."""
    return next((int(os.environ[name]) for name in RANK_VARIABLES if os.environ.get(name)), 0)


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
