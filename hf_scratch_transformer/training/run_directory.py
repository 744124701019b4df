"""The run directory (`--output_dir`): its layout, its lock, the checks made on it before any work, checkpoints, the
hidden staging folders, and what happens when a write into it fails. Every name of a file or folder a run creates
in it is defined here and nowhere else.

    output_dir/
      .train.lock                     the lock of the running run (filelock's SoftFileLock: pid and host inside)
      .tokenizer/                     the tokenizer trained during setup, until the final model is saved
      .staging-*/                     a save in progress (the final model, result files, a hub snapshot)
      checkpoint-<step>/              a complete checkpoint: Accelerate's save_state, config.json, the tokenizer,
                                      run_state.json, and last checkpoint_complete.json (every file and its size)
      checkpoint-<step>.tmp/          a checkpoint being written; renamed when complete, removed if the write fails
      abandoned-after-<step>-<time>/  newer checkpoints set aside by --overwrite_newer_checkpoints
      runs/                           the trackers' logs (TensorBoard)
      model.safetensors, config.json, tokenizer files, *_results.json, generated_predictions.txt, README.md, ...
                                      the Hub-format model (model_directory.py writes it)

Every write goes through `guarded_write` (or `write_fault`): a full disk, a read-only file system, a name too long
end in one TrainingFault line naming the path, the space needed where it is known, what is kept and what to do;
the half-written folder is removed first. torch and safetensors do not raise OSError for these (torch: RuntimeError
"[enforce fail at inline_container.cc:...]", safetensors: SafetensorError "... (os error 28)", tokenizers: a plain
Exception), so the cause is read from the error chain and, for torch, from the file system itself.

Accelerate's own checkpoint management (`ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=N)`)
is not used: it names checkpoints by save count (`checkpoints/checkpoint_<i>`), deletes the oldest before the new
one is written (a failed save then leaves fewer complete checkpoints) and marks nothing as complete.
"""

import errno
import json
import logging
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
from filelock import SoftFileLock, Timeout

from .distributed import save_state_on_main
from ..errors import TrainingFault, UsageError

logger = logging.getLogger("hf_scratch_transformer")

LOCK_FILE = ".train.lock"
TOKENIZER_STAGING = ".tokenizer"
STAGING_PREFIX = ".staging-"
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
PARTIAL_SUFFIX = ".tmp"  # checkpoint-<step>.tmp: being written
RUN_STATE_FILE = "run_state.json"  # the run state of a checkpoint (checkpointing.RunState as JSON)
CHECKPOINT_COMPLETE = "checkpoint_complete.json"  # written last: names every file of the checkpoint and its size
ABANDONED_PREFIX = "abandoned-after-"  # newer checkpoints set aside by --overwrite_newer_checkpoints
TRACKER_LOGS = "runs"
ALL_RESULTS_FILE = "all_results.json"
PREDICTIONS_FILE = "generated_predictions.txt"
HUB_IGNORE = ["checkpoint-*", "checkpoint-*/**", f"{STAGING_PREFIX}*", f"{TOKENIZER_STAGING}/**",
              f"{TRACKER_LOGS}/**", LOCK_FILE, f"{ABANDONED_PREFIX}*/**"]  # what a run keeps that is not the model


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint at optimiser step `step` (matched by CHECKPOINT_PATTERN)."""
    return f"checkpoint-{step}"


def results_file(phase: str) -> str:
    """run_translation.py's name of a phase's figures: train_results.json, eval_results.json, predict_results.json."""
    return f"{phase}_results.json"


def is_hidden_staging(path: Path) -> bool:
    """A hidden folder of a run (`.tokenizer`, `.staging-*`): nothing in it is lost when it is removed."""
    return path.name.startswith((TOKENIZER_STAGING, STAGING_PREFIX))


def tokenizer_staging(output_dir: Path) -> Path:
    """Where the tokenizer trained during setup waits (for every process to load it) until the model is saved."""
    return output_dir / TOKENIZER_STAGING


# ---------------------------------------------------------------------------------------- write faults, one line

# errno -> what to do about it (the path and the rest of the message are added by write_fault)
REMEDIES = {errno.ENOSPC: "free space", errno.EDQUOT: "free space or raise the disk quota",
            errno.EROFS: "make it writable or choose another --output_dir",
            errno.EACCES: "fix its permissions or choose another --output_dir",
            errno.EPERM: "fix its permissions or choose another --output_dir",
            errno.ENAMETOOLONG: "choose a shorter --output_dir", errno.EIO: "check the disk"}
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL_BYTES = 1 << 20  # torch names no cause: less than this free where it wrote means the disk filled up


def _error_chain(error: BaseException):
    """`error` and the errors it was raised from (`raise ... from`; not those it was merely raised while handling,
    which may be unrelated)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__


def _torch_write_failure(error: BaseException) -> bool:
    """torch's zip writer reports a failed write without its cause: "[enforce fail at inline_container.cc:...]"."""
    return isinstance(error, RuntimeError) and "inline_container" in str(error)


def _errno_of(error: BaseException, directory: Path) -> int | None:
    """The errno behind a failed write, read from the error chain (OSError.errno, Rust's "(os error N)", the
    system's own wording); for torch's writer, which names no cause, the file system is looked at; None if the
    error is not a failed write."""
    for link in _error_chain(error):
        if isinstance(link, OSError) and link.errno:
            return link.errno
        text = str(link)
        if found := re.search(r"os error (\d+)", text):
            return int(found.group(1))
        for code in REMEDIES:
            if os.strerror(code) in text:
                return code
    if _torch_write_failure(error):
        if _free_bytes(directory) < NEARLY_FULL_BYTES:
            return errno.ENOSPC
        return errno.EACCES if not os.access(_existing(directory), os.W_OK) else errno.EIO
    return None


def _existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists."""
    path = Path(os.path.abspath(path))
    while not os.path.exists(path) and path != path.parent:  # os.path: False (no OSError) for a name too long
        path = path.parent
    return path


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(_existing(path)).free


def human_size(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def _cause(code: int, directory: Path, needed: int | None) -> str:
    """The system's wording of the cause, with the space needed and free where that is the cause."""
    cause = os.strerror(code)
    if code in SPACE_ERRNOS:
        free = human_size(_free_bytes(directory))
        cause += f" (about {human_size(needed)} needed, {free} free there)" if needed else f" ({free} free there)"
    elif code == errno.ENAMETOOLONG:
        limit = os.pathconf(_existing(directory), "PC_NAME_MAX")
        longest = max(Path(os.path.abspath(directory)).parts, key=len)
        cause += f" (a name in the path has {len(longest)} characters, the file system allows {limit})"
    return cause


def write_fault(error: BaseException, what: str, directory: Path, *, needed: int | None = None,
                partial: Path | None = None, kept: str | None = None, then: str | None = None,
                run_dir: Path | None = None) -> TrainingFault | None:
    """The one-line fault for a failed write of `what` into `directory` (None if `error` is not a failed write:
    the caller re-raises it). `partial` (a half-written file or folder) is removed first. `kept` says what is safe
    and `then` how to go on; by default both are read from the checkpoints in `run_dir` (default: `directory`)."""
    if isinstance(error, (TrainingFault, UsageError)):  # already one line
        return error
    code = _errno_of(error, directory)  # before removing `partial`: torch's failure is read from the free space
    if partial is not None:
        remove_quietly(partial)
    if code is None:
        return None
    if kept is None or then is None:
        kept, then = what_is_kept(run_dir or directory)
    remedy = REMEDIES.get(code, "check the disk")
    return TrainingFault(f"could not write {what} in {directory}: {_cause(code, directory, needed)}; {kept}: "
                         f"{remedy}, then {then}")


@contextmanager
def guarded_write(what: str, directory: Path, **fault):
    """Writes of `what` into `directory`: a failure of the environment becomes one TrainingFault line (see
    write_fault for `fault`: needed, partial, kept, then); any other error passes through."""
    try:
        yield
    except (TrainingFault, UsageError):
        raise
    except Exception as error:  # noqa: BLE001  (torch, safetensors and tokenizers raise their own kinds)
        fault_line = write_fault(error, what, directory, **fault)
        if fault_line is None:
            raise
        raise fault_line from error


def remove_quietly(path: Path) -> None:
    """Remove a file or folder left half-written (nothing in it is kept)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def what_is_kept(output_dir: Path) -> tuple[str, str]:
    """(what is safe in output_dir, how to go on) after a failed run, for its last line."""
    kept = list_checkpoints(output_dir)
    if kept:
        return (f"the last complete checkpoint, {kept[-1]}, is unchanged",
                "resume with --resume_from_checkpoint latest")
    return "no checkpoint had been written yet", "start again with --overwrite_output_dir"


# -------------------------------------------------------------------------------------------------------- the lock


class OutputDirLock:
    """`<output_dir>/.train.lock`, taken by the main process so that a second run into the same directory is refused
    with one line naming the holder. It is filelock's SoftFileLock: the file holds the holder's pid, host and process
    start time; a lock left by a process that is gone (same host) is taken over; it is removed on release. Taking it
    is the run's first write into the directory."""

    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / LOCK_FILE
        self._lock = SoftFileLock(self.path, timeout=0)  # one attempt: a held lock is refused at once

    @property
    def held(self) -> bool:
        return self._lock.is_locked

    def acquire(self) -> None:
        directory = self.path.parent
        with guarded_write("the lock", directory, kept="nothing was written", then="run the same command again"):
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except (NotADirectoryError, FileExistsError) as error:
                raise UsageError(f"output directory {directory} is not writable ({type(error).__name__}: a part of "
                                 f"the path is a file): choose another --output_dir") from error
            try:
                self._lock.acquire()
            except Timeout:
                raise UsageError(self._refusal()) from None

    def _refusal(self) -> str:
        holder = self._holder()
        who = f"pid {holder[0]} on {holder[1]}" if holder else "a run whose lock file cannot be read"
        return (f"output directory {self.path.parent} is in use by another run ({who}, lock {self.path}): wait for it "
                f"to end or choose another --output_dir; delete the lock only if that run is gone")

    def _holder(self) -> tuple[int, str] | None:
        """(pid, host) from the lock file (SoftFileLock writes "<pid>\\n<host>\\n..."), or None if unreadable."""
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
            return int(lines[0]), lines[1]
        except (OSError, ValueError, IndexError, UnicodeDecodeError):
            return None

    def release(self) -> None:
        """Release the lock; the tokenizer staged by this run (useless once it ends: a resumed run takes the
        checkpoint's) is removed with it."""
        if self.held:
            shutil.rmtree(tokenizer_staging(self.path.parent), ignore_errors=True)
            self._lock.release()


# -------------------------------------------------------------------------------------- checks before any work


def claim_output_dir(args, lock: OutputDirLock | None) -> None:
    """The output directory of a run, before any work: flags about it checked, the lock taken (by the main
    process, which passes it), then what the directory holds checked (check_output_dir)."""
    check_output_flags(args)
    if lock is not None:
        lock.acquire()
    check_output_dir(args)


def check_output_flags(args) -> None:
    """What the flags alone say about the output directory (touches nothing)."""
    output_dir = Path(args.output_dir)
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):  # os.path: no OSError for a name too long
        raise UsageError(f"--output_dir {output_dir} is a file, not a directory")
    if args.overwrite_output_dir and args.resume_from_checkpoint and not resumes_another_run(args):
        raise UsageError(f"--overwrite_output_dir starts {output_dir} over (its checkpoints are removed) and "
                         f"--resume_from_checkpoint {args.resume_from_checkpoint} continues one of them: give only one")


def resumes_another_run(args) -> bool:
    """--resume_from_checkpoint names a checkpoint outside --output_dir (the run goes on in another directory)."""
    if not args.resume_from_checkpoint or args.resume_from_checkpoint == "latest":
        return False
    checkpoint, output_dir = Path(args.resume_from_checkpoint).resolve(), Path(args.output_dir).resolve()
    return output_dir not in checkpoint.parents


def check_output_dir(args) -> None:
    """A non-empty output directory is only trained into on request; an evaluation (no --do_train) does not replace
    the result files already there (a model directory's README quotes them) unless --overwrite_output_dir."""
    output_dir = Path(args.output_dir)
    if not os.path.isdir(output_dir) or args.overwrite_output_dir:
        return
    if args.do_train:
        # Staging folders left by a run that stopped during setup hold nothing to lose; the lock is this run's.
        kept = [path for path in output_dir.iterdir() if not is_hidden_staging(path) and path.name != LOCK_FILE]
        if kept and resumes_another_run(args):
            # its model would be replaced and its checkpoints rotated away by the run continued into it
            raise UsageError(
                f"--resume_from_checkpoint {args.resume_from_checkpoint} continues a run of another directory into "
                f"{output_dir}, which holds {_what_it_holds(kept)}: give an empty or new --output_dir, "
                f"--resume_from_checkpoint latest to continue the run of {output_dir} itself, or add "
                f"--overwrite_output_dir to replace it")
        if kept and not args.resume_from_checkpoint:
            raise UsageError(
                f"output directory {output_dir} exists and is not empty: pass --overwrite_output_dir to replace it, "
                f"--resume_from_checkpoint latest to continue its run, or another --output_dir")
        return
    written = [results_file("eval")] if args.do_eval else []
    if args.do_predict:
        written += [results_file("predict"), PREDICTIONS_FILE]
    replaced = [name for name in written if (output_dir / name).exists()]
    if replaced:
        raise UsageError(f"output directory {output_dir} already holds {', '.join(replaced)}, which this evaluation "
                         f"would replace: give another --output_dir, or add --overwrite_output_dir to replace them")


def _what_it_holds(paths: list[Path]) -> str:
    """"a finished run (model.safetensors, 2 checkpoints)", "3 checkpoints", "4 files": what a refusal protects."""
    checkpoints = [path for path in paths if CHECKPOINT_PATTERN.match(path.name)]
    if any(path.name == "model.safetensors" for path in paths):
        return f"a finished run (model.safetensors{f', {len(checkpoints)} checkpoint(s)' if checkpoints else ''})"
    if checkpoints:
        return f"the checkpoints of another run ({', '.join(sorted(path.name for path in checkpoints))})"
    return f"{len(paths)} file(s) of its own ({', '.join(sorted(path.name for path in paths)[:3])}...)"


# ---------------------------------------------------------------------------------------- hidden staging folders


def stage_tokenizer(tokenizer, output_dir: Path) -> Path:
    """Save the tokenizer trained during setup into output_dir/.tokenizer (for the other processes to load); a
    failed write leaves nothing behind."""
    staging = tokenizer_staging(output_dir)
    with guarded_write("the tokenizer", staging, partial=staging, kept="nothing was saved yet",
                       then="run the same command again"):
        tokenizer.save_pretrained(staging)
    return staging


@contextmanager
def staging_folder(output_dir: Path, what: str, **fault):
    """A fresh hidden folder in output_dir (same file system: its files can be moved in atomically), removed
    after; a failed write in it ends in one line about `what` (see write_fault for `fault`)."""
    with guarded_write(what, output_dir, **fault):
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=output_dir))
        try:
            with guarded_write(what, output_dir, partial=staging, **fault):
                yield staging
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def follow_umask(folder: Path) -> None:
    """Give every file under `folder` the permissions a new file gets under the process's umask (0644 under umask
    022), as open() gives them: safetensors 0.8 writes its files through a temporary file of mode 0600, so the weights
    would be the one file of a model directory that a server account or a container user cannot read. The mode is
    read from a file created here (reading the umask itself means changing it)."""
    probe = folder / f".umask-probe-{os.getpid()}"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        mode = probe.stat().st_mode & 0o777
    finally:
        probe.unlink()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 != mode:
            path.chmod(mode)


# ------------------------------------------------------------------------------------------ finding checkpoints


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint, or None: the completion marker, written last, must be there and
    every file it lists must exist with the size it records."""
    try:
        listed = json.loads((path / CHECKPOINT_COMPLETE).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no {CHECKPOINT_COMPLETE}, which is written last, once every file is in place"
    for name, size in listed.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            return f"{name} is missing or has another size than when it was written"
    return None


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints (`checkpoint-<step>`, never the `.tmp` being written), oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), path) for path in output_dir.iterdir()
             if path.is_dir() and (m := CHECKPOINT_PATTERN.match(path.name)) and checkpoint_problem(path) is None]
    return [path for _, path in sorted(found)]


def checkpoint_bytes(checkpoint: Path) -> int:
    """The size of a complete checkpoint, from its completion marker."""
    return sum(json.loads((checkpoint / CHECKPOINT_COMPLETE).read_text())["files"].values())


def resolve_checkpoint(value: str, output_dir: Path) -> Path:
    """The checkpoint --resume_from_checkpoint names (a path, or `latest` in output_dir), refused if incomplete."""
    if value == "latest":
        checkpoints = list_checkpoints(output_dir)
        if not checkpoints:
            raise UsageError(f"--resume_from_checkpoint latest: no complete checkpoint in {output_dir}")
        return checkpoints[-1]
    path = Path(value)
    problem = checkpoint_problem(path) if path.is_dir() else "not a directory"
    if problem:
        raise UsageError(f"--resume_from_checkpoint {path}: not a complete checkpoint ({problem}); resume from "
                         f"another checkpoint-N or with 'latest'")
    return path


def checkpoint_step(checkpoint: Path) -> int:
    """The optimiser step a complete checkpoint was saved at."""
    return json.loads((checkpoint / CHECKPOINT_COMPLETE).read_text())["step"]


def set_newer_checkpoints_aside(checkpoint: Path, output_dir: Path, allowed: bool, is_main: bool) -> None:
    """Resuming from checkpoint-N while checkpoint-M (M > N) exist: the resumed run would overwrite them and
    rotation would delete its own new checkpoints, so it is refused unless `allowed` (--overwrite_newer_checkpoints),
    which moves them into abandoned-after-N-<time>/ (where `latest` no longer sees them). The main process moves."""
    step = checkpoint_step(checkpoint)
    newer = sorted((int(m.group(1)), path) for path in output_dir.glob("checkpoint-*")
                   if (m := CHECKPOINT_PATTERN.match(path.name)) and int(m.group(1)) > step and path.is_dir())
    if not newer:
        return
    names = ", ".join(path.name + ("" if checkpoint_problem(path) is None else " (incomplete)") for _, path in newer)
    if not allowed:
        raise UsageError(
            f"resuming from {checkpoint} (step {step}) while {output_dir} holds newer checkpoints "
            f"({names}): resume from the newest with --resume_from_checkpoint latest, or add "
            f"--overwrite_newer_checkpoints to move them aside into {output_dir}/{ABANDONED_PREFIX}{step}-<time>/")
    if is_main:
        aside = output_dir / f"{ABANDONED_PREFIX}{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir()
        for _, path in newer:
            os.replace(path, aside / path.name)
        logger.warning(f"moved the newer checkpoints {names} aside into {aside}")


def remove_checkpoints(output_dir: Path) -> None:
    """--overwrite_output_dir: the checkpoints of the run that was there go (the main process removes them)."""
    for old in output_dir.glob("checkpoint-*"):
        remove_quietly(old)


# -------------------------------------------------------------------------------------------- writing checkpoints


def save_checkpoint(accelerator, model, tokenizer, state, scheduler, output_dir: Path, keep: int) -> Path:
    """`accelerator.save_state` into `checkpoint-<step>.tmp`, then (main process) config.json, the tokenizer, the run
    state and the completion marker, then the rename to `checkpoint-<step>`; all but the last `keep` complete
    checkpoints are removed, except the best one (`state.best_checkpoint`). A failed write on any process ends in
    one TrainingFault line on every process, with the `.tmp` folder removed and the earlier checkpoints as they
    were."""
    step = state.global_step
    final, partial = output_dir / checkpoint_name(step), output_dir / f"{checkpoint_name(step)}{PARTIAL_SUFFIX}"
    earlier = list_checkpoints(output_dir) if accelerator.is_main_process else []
    needed = checkpoint_bytes(earlier[-1]) if earlier else 3 * model.get_memory_footprint(return_buffers=False)
    fault = dict(what=checkpoint_name(step), directory=output_dir, needed=needed)
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)
    accelerator.wait_for_everyone()
    _on_every_process(accelerator, lambda: save_state_on_main(accelerator, partial), partial,
                      fault)

    def complete():
        state.scheduler = scheduler.state_dict()
        state.world_size = accelerator.num_processes
        accelerator.unwrap_model(model).config.to_json_file(partial / "config.json")
        tokenizer.save_pretrained(partial)
        _complete(partial, final, state)

    _on_every_process(accelerator, complete if accelerator.is_main_process else lambda: None, partial, fault)
    if accelerator.is_main_process:
        for old in list_checkpoints(output_dir)[:-keep]:
            if old.name != state.best_checkpoint:
                remove_quietly(old)
    return final


def _on_every_process(accelerator, action, partial: Path, fault: dict) -> None:
    """Run `action` here, then let every process know whether it failed anywhere (the exchange is also the barrier
    after it). A failure raises on every process: where it happened with its cause, elsewhere as "another process
    failed"; the main process removes `partial`."""
    error = None
    try:
        action()
    except Exception as raised:  # noqa: BLE001  (classified by write_fault below)
        error = raised
    failures = int(accelerator.reduce(torch.tensor(int(error is not None), device=accelerator.device), "sum"))
    if not failures:
        return
    if error is not None:
        fault_line = write_fault(error, partial=partial if accelerator.is_main_process else None, **fault)
        if fault_line is None or fault_line is error:
            raise error
        raise fault_line from error
    if accelerator.is_main_process:
        remove_quietly(partial)
    kept, then = what_is_kept(fault["directory"])
    raise TrainingFault(f"could not write {fault['what']} in {fault['directory']}: another process failed to write "
                        f"its part (its own message names the cause); {kept}: fix that, then {then}")


def _complete(partial: Path, final: Path, state) -> None:
    """The run state, then the completion marker (last), then the rename to `final`; every file with the umask's
    permissions."""
    (partial / RUN_STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
    follow_umask(partial)
    files = {str(path.relative_to(partial)): path.stat().st_size
             for path in sorted(partial.rglob("*")) if path.is_file()}
    (partial / CHECKPOINT_COMPLETE).write_text(json.dumps({"step": state.global_step, "files": files}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
