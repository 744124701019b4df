"""Checkpoints of a training run: where the run is (`RunState`), writing and finding complete checkpoints, resuming
(same architecture, settings and number of processes), averaging the last K, and the lock of the output directory.

A checkpoint is `output_dir/checkpoint-<step>`: Accelerate's `save_state` (model, optimiser, RNG states of every
process), config.json, the tokenizer, `run_state.json`, and last `checkpoint_complete.json`, which names every file
and its size. It is written as `checkpoint-<step>.tmp` and renamed only when complete.
"""

import json
import logging
import os
import platform
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from safetensors.torch import load_file

from .distributed import save_state_on_main
from .errors import TrainingFault, UsageError

logger = logging.getLogger("hf_scratch_transformer")
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
# This package's own run state (JSON), named so that it is not taken for transformers' `trainer_state.json`
# (`TrainerState`), which it is not. Checkpoints written before the rename hold the same JSON under the old name.
TRAINER_STATE = "run_state.json"
LEGACY_TRAINER_STATE = "trainer_state.json"
CHECKPOINT_COMPLETE = "checkpoint_complete.json"  # written last: names every file of the checkpoint and its size
ABANDONED_PREFIX = "abandoned-after-"  # newer checkpoints set aside by --overwrite_newer_checkpoints
LOCK_FILE = ".train.lock"


@dataclass
class RunState:
    """Where the run is; saved as JSON in every checkpoint."""

    global_step: int = 0
    epoch: int = 0
    batches_done_in_epoch: int = 0
    train_tokens: int = 0
    train_seconds: float = 0.0
    history: list = field(default_factory=list)
    scheduler: dict = field(default_factory=dict)
    world_size: int = 1  # processes that trained: batches_done_in_epoch counts the batches of each of them
    settings: dict = field(default_factory=dict)  # RESUME_SETTINGS as the run started: a resume must not change them


# What a resumed run must keep: the schedule (restored from the checkpoint) and the batch order and position.
RESUME_SETTINGS = {"args": ("learning_rate", "warmup_steps", "lr_scheduler_type", "seed", "per_device_train_batch_size",
                            "gradient_accumulation_steps"),
                   "data_args": ("dataset_name", "dataset_config_name", "train_file", "max_train_samples", "streaming",
                                 "source_lang", "target_lang", "max_source_length", "max_target_length",
                                 "max_length_ratio", "max_tokens")}
ARCHITECTURE_FIELDS = ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
                       "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "normalize_before",
                       "max_position_embeddings", "share_encoder_decoder_embeddings", "tie_word_embeddings")


def resume_settings(args, data_args) -> dict:
    """The values of RESUME_SETTINGS in this run's RunArguments and DataArguments."""
    sources = {"args": args, "data_args": data_args}
    return {name: getattr(sources[group], name) for group, names in RESUME_SETTINGS.items() for name in names}


# --------------------------------------------------------------------------------------------- finding checkpoints


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint, or None: the completion marker, written last, must be there and
    every file it lists must exist with the size it records."""
    try:
        listed = json.loads((path / CHECKPOINT_COMPLETE).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        if _is_legacy_checkpoint(path):
            return None
        return f"no {CHECKPOINT_COMPLETE}, which is written last, once every file is in place"
    for name, size in listed.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            return f"{name} is missing or has another size than when it was written"
    return None


def _is_legacy_checkpoint(path: Path) -> bool:
    """A checkpoint written before completion markers existed (one process; its run state, written last, has no
    `world_size`): complete as far as can be told, so that runs started with the previous version can resume."""
    try:
        state = json.loads(run_state_file(path).read_text())
    except (AttributeError, OSError, ValueError):  # AttributeError: no run state at all
        return False
    return isinstance(state, dict) and "global_step" in state and "world_size" not in state


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints (`checkpoint-<step>`, never the `.tmp` being written), oldest first."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), path) for path in output_dir.iterdir()
             if path.is_dir() and (m := CHECKPOINT_PATTERN.match(path.name)) and checkpoint_problem(path) is None]
    return [path for _, path in sorted(found)]


def run_state_file(checkpoint: Path) -> Path | None:
    """The run-state JSON of a checkpoint: `run_state.json`, or `trainer_state.json` in checkpoints written before
    it was renamed; None if there is neither."""
    for name in (TRAINER_STATE, LEGACY_TRAINER_STATE):
        if (checkpoint / name).is_file():
            return checkpoint / name
    return None


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


def set_newer_checkpoints_aside(checkpoint: Path, output_dir: Path, allowed: bool, is_main: bool) -> None:
    """Resuming from checkpoint-N while checkpoint-M (M > N) exist: the resumed run would overwrite them and
    rotation would delete its own new checkpoints, so it is refused unless `allowed` (--overwrite_newer_checkpoints),
    which moves them into abandoned-after-N-<time>/ (where `latest` no longer sees them). The main process moves."""
    match = CHECKPOINT_PATTERN.match(checkpoint.name)
    step = int(match.group(1)) if match else json.loads(run_state_file(checkpoint).read_text())["global_step"]
    newer = [path for path in output_dir.glob("checkpoint-*")
             if (m := CHECKPOINT_PATTERN.match(path.name)) and int(m.group(1)) > step and path.is_dir()]
    newer.sort(key=lambda path: int(CHECKPOINT_PATTERN.match(path.name).group(1)))
    if not newer:
        return
    names = ", ".join(path.name + ("" if checkpoint_problem(path) is None else " (incomplete)") for path in newer)
    if not allowed:
        raise UsageError(
            f"resuming from {checkpoint} (step {step}) while {output_dir} holds newer checkpoints "
            f"({names}): resume from the newest with --resume_from_checkpoint latest, or add "
            f"--overwrite_newer_checkpoints to move them aside into {output_dir}/{ABANDONED_PREFIX}{step}-<time>/")
    aside = output_dir / f"{ABANDONED_PREFIX}{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    if is_main:
        aside.mkdir()
        for path in newer:
            os.replace(path, aside / path.name)
        logger.warning(f"moved the newer checkpoints {names} aside into {aside}")


def remove_checkpoints(output_dir: Path) -> None:
    """--overwrite_output_dir: the checkpoints of the run that was there go (the main process removes them)."""
    for old in output_dir.glob("checkpoint-*"):
        shutil.rmtree(old)


# ------------------------------------------------------------------------------------------------ resume checks


def check_same_architecture(checkpoint: Path, config) -> None:
    """The model this run builds must have the sizes the checkpoint's weights were trained with."""
    try:
        saved = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"checkpoint {checkpoint} has no readable config.json ({error}): it is incomplete; resume "
                         f"from another checkpoint-N or start a new --output_dir") from error
    different = [f"{name} {saved.get(name)} -> {getattr(config, name)}" for name in ARCHITECTURE_FIELDS
                 if saved.get(name) != getattr(config, name)]
    if different:
        raise UsageError(
            f"checkpoint {checkpoint} was made with another model config ({'; '.join(different)}): "
            f"resume with the same --preset and size flags, or start a new --output_dir"
        )


def check_same_settings(checkpoint: Path, saved: dict, current: dict) -> None:
    """The learning-rate schedule comes back from the checkpoint and the position in the data only means the
    same thing over the same batches: changed values would silently not apply, so they are refused."""
    changed = [f"--{name} {saved[name]!r} -> {current[name]!r}" for name in current
               if name in saved and saved[name] != current[name]]
    if changed:
        raise UsageError(
            f"checkpoint {checkpoint} was trained with other settings ({'; '.join(changed)}): a resumed run keeps "
            f"its schedule and batch order, so resume with the values it was started with, or start a new "
            f"--output_dir to train with the new ones")


def check_world_size(checkpoint: Path, saved: int, current: int) -> None:
    """The position in the epoch counts batches of each of `saved` processes, and every process has its own
    random state: another number of processes cannot continue the same batch order, so it is refused."""
    if saved != current:
        how = (f"`accelerate launch --multi_gpu --num_processes {saved} --num_machines 1 train.py ...`"
               if saved > 1 else "one process (`python train.py ...`)")
        raise UsageError(
            f"checkpoint {checkpoint} was written by {saved} process(es) and this run has {current}: the position "
            f"in the data and the per-process random states only carry over to the same number; resume with "
            f"{how} or start a new --output_dir")


# ------------------------------------------------------------------------------------------------ save and load


def save_checkpoint(accelerator, model, tokenizer, state: RunState, scheduler, output_dir: Path,
                    keep: int) -> Path:
    """`accelerator.save_state` into `checkpoint-<step>.tmp`, renamed when complete; all but the last `keep`
    complete checkpoints removed. A failed write leaves the earlier checkpoints as they were (TrainingFault)."""
    step = state.global_step
    final = output_dir / f"checkpoint-{step}"
    staging = output_dir / f"checkpoint-{step}.tmp"
    try:
        if accelerator.is_main_process and staging.exists():
            shutil.rmtree(staging)
        accelerator.wait_for_everyone()
        save_state_on_main(accelerator, staging)
        if accelerator.is_main_process:
            state.scheduler = scheduler.state_dict()
            state.world_size = accelerator.num_processes
            accelerator.unwrap_model(model).config.to_json_file(staging / "config.json")
            tokenizer.save_pretrained(staging)
            _complete(staging, final, state)
            for old in list_checkpoints(output_dir)[:-keep]:
                shutil.rmtree(old)
    except OSError as error:  # disk full, permissions: the staging folder never counts as a checkpoint
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
        raise TrainingFault(f"could not write checkpoint-{step} in {output_dir} ({type(error).__name__}: "
                            f"{error}); {_what_is_kept(output_dir)}") from error
    accelerator.wait_for_everyone()
    return final


def _complete(staging: Path, final: Path, state: RunState) -> None:
    """The run state, then the completion marker (last), then the rename to `final`."""
    (staging / TRAINER_STATE).write_text(json.dumps(asdict(state), indent=1))
    files = {str(path.relative_to(staging)): path.stat().st_size
             for path in sorted(staging.rglob("*")) if path.is_file()}
    (staging / CHECKPOINT_COMPLETE).write_text(json.dumps({"step": state.global_step, "files": files}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)


def _what_is_kept(output_dir: Path) -> str:
    kept = list_checkpoints(output_dir)
    if kept:
        return (f"the last complete checkpoint, {kept[-1]}, is unchanged; free space or fix permissions, then "
                f"resume with --resume_from_checkpoint latest")
    return ("no complete checkpoint was written before; free space or fix permissions, then start again with "
            "--overwrite_output_dir")


def load_checkpoint(accelerator, scheduler, checkpoint: Path, settings: dict) -> RunState:
    """Weights from safetensors; optimiser and RNG states through Accelerate's `torch.load(weights_only=True)`;
    the run state it was saved with. Refused with one line if it was written by another number of processes or
    with other RESUME_SETTINGS, or cannot be read."""
    try:
        saved = json.loads(run_state_file(checkpoint).read_text())
        check_world_size(checkpoint, saved.get("world_size", 1), accelerator.num_processes)
        check_same_settings(checkpoint, saved.get("settings") or {}, settings)
        accelerator.load_state(str(checkpoint))
        state = RunState(**saved)
        scheduler.load_state_dict(state.scheduler)
    except UsageError:
        raise
    except Exception as error:  # noqa: BLE001  (safetensors, torch and json each raise their own)
        reason = " ".join(str(error).split())[:300]
        raise UsageError(
            f"checkpoint {checkpoint} cannot be loaded ({type(error).__name__}: {reason}): it is incomplete or "
            f"corrupted; resume from an earlier checkpoint-N or start a new --output_dir"
        ) from error
    logger.info(f"resumed from {checkpoint} at step {state.global_step}")
    return state


def average_checkpoints(model, output_dir: Path, count: int) -> list[str]:
    """Replace `model`'s weights by the mean of the last `count` checkpoints' weights (fairseq's
    average_checkpoints); the names of the checkpoints averaged, or [] when fewer than 2 are kept."""
    checkpoints = list_checkpoints(output_dir)[-count:]
    if len(checkpoints) < 2:
        logger.warning(f"--average_checkpoints {count}: only {len(checkpoints)} checkpoint(s) kept (raise "
                       f"--save_total_limit); not averaging")
        return []
    total = None
    for checkpoint in checkpoints:
        weights = load_file(checkpoint / "model.safetensors")
        total = weights if total is None else {name: total[name] + weights[name] for name in total}
    model.load_state_dict({name: value / len(checkpoints) for name, value in total.items()}, strict=False)
    return [path.name for path in checkpoints]


# -------------------------------------------------------------------------------------------------------- the lock


class OutputDirLock:
    """`<output_dir>/.train.lock`, created exclusively by the main process and holding its pid and hostname, so that
    a second run into the same directory is refused. A lock whose process is gone (same host, dead pid) is stale
    and taken over. Creating it is also the check that the directory is writable."""

    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / LOCK_FILE
        self.owner = {"pid": os.getpid(), "hostname": platform.node()}
        self.held = False

    def acquire(self) -> None:
        directory = self.path.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for _ in range(2):
                if self._try_create():
                    return
        except OSError as error:
            raise UsageError(f"output directory {directory} is not writable ({type(error).__name__}: "
                             f"{error.strerror or error}): fix its permissions or free space, or choose another "
                             f"--output_dir") from error
        raise UsageError(f"could not take the lock {self.path}: another run keeps recreating it; choose another "
                         f"--output_dir")

    def _try_create(self) -> bool:
        """True once the lock is created; False after removing a stale one; UsageError if a live run holds it."""
        try:
            with open(self.path, "x", encoding="utf-8") as handle:
                handle.write(json.dumps(self.owner))
            self.held = True
            return True
        except FileExistsError:
            holder = self._holder()
            if holder is not None and not self._is_stale(holder):
                raise UsageError(
                    f"output directory {self.path.parent} is in use by another run (pid {holder.get('pid')} on "
                    f"{holder.get('hostname')}, lock {self.path}): wait for it to end or choose another "
                    f"--output_dir; delete the lock only if that run is gone") from None
            logger.warning(f"removing the stale lock {self.path} of a run that is gone ({holder})")
            self.path.unlink(missing_ok=True)
            return False

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text(encoding="utf-8"))
            return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None
        except (OSError, ValueError):
            return None  # unreadable or half-written: treated as stale

    def _is_stale(self, holder: dict) -> bool:
        if holder.get("hostname") != platform.node():
            return False  # another machine's process cannot be checked from here
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # alive, another user's
        return False

    def release(self) -> None:
        if self.held and self._holder() == self.owner:
            self.path.unlink(missing_ok=True)
        self.held = False


# ------------------------------------------------------------------------------------ the warning at every save


class _DeclaredTiesFilter(logging.Filter):
    """Accelerate's `save_state` warns "Removed shared tensor {...} while saving. This should be OK, but check..."
    at every checkpoint for the tied embeddings. Those ties are declared (`_tied_weights_keys`) and restored when the
    checkpoint is loaded (resumption is tested bit for bit), so the warning is dropped when it names only declared
    tie targets; any other name keeps it."""

    def __init__(self):
        super().__init__()
        self.tied: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Removed shared tensor" not in message:
            return True
        names = set(re.findall(r"'([^']+)'", message.split(" while saving")[0]))
        return not names or not names <= self.tied


DECLARED_TIES = _DeclaredTiesFilter()
SAVE_STATE_LOGGER = "accelerate.utils.other"  # where save_state's warning comes from


def declare_tied_weights(model) -> None:
    """The model's declared ties: the save_state warning that names only them is dropped (see quiet_save_warnings)."""
    DECLARED_TIES.tied = set(getattr(model, "all_tied_weights_keys", None) or {})


def quiet_save_warnings(quiet: bool) -> None:
    """Drop (or, with --verbose, show again) the warning about the declared weight ties at every checkpoint."""
    if quiet:
        logging.getLogger(SAVE_STATE_LOGGER).addFilter(DECLARED_TIES)
    else:
        logging.getLogger(SAVE_STATE_LOGGER).removeFilter(DECLARED_TIES)
