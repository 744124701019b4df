"""Resuming a run from a checkpoint: where the run is (`RunState`), the checks that the resumed run continues the
same one (architecture, settings, number of processes, length, training data), loading, and averaging the last K
checkpoints. Writing and finding checkpoints is the run directory's (run_directory.py).
"""

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from datasets import Dataset
from safetensors.torch import load_file

from ..data.corpus_files import CorpusError, resolve_corpus_files
from ..errors import UsageError
from .augmentation import AUGMENTATION_FLAGS
from .run_directory import RUN_STATE_FILE, list_checkpoints

logger = logging.getLogger("hf_scratch_transformer")
FINGERPRINT_SAMPLE = 64  # pairs hashed to recognise the training data (evenly spread; the first ones if streamed)


@dataclass
class RunState:
    """Where the run is; saved as JSON in every checkpoint."""

    global_step: int = 0
    epoch: int = 0
    batches_done_in_epoch: int = 0
    train_tokens: int = 0
    train_seconds: float = 0.0
    train_flops: float | None = None  # model FLOPs trained (flops.py): 0 at a run's start, None read from a
    # checkpoint written before they were counted (its earlier steps' FLOPs are unknown)
    train_positions: int | None = None  # source + target positions trained, padding included, as collated (after the
    # training-time changes to the sources): 0 at a run's start, None read from a checkpoint written before they were
    # counted
    history: list = field(default_factory=list)
    scheduler: dict = field(default_factory=dict)
    world_size: int = 1  # processes that trained: batches_done_in_epoch counts the batches of each of them
    settings: dict = field(default_factory=dict)  # RESUME_SETTINGS as the run started: a resume must not change them
    data_fingerprint: dict = field(default_factory=dict)  # data_fingerprint() of the training data it trained on
    # the end of the run (stopping.StoppingRules): the best validation so far, the patience counter, the time spent
    best_metric: float | None = None
    best_step: int | None = None
    best_checkpoint: str | None = None  # the checkpoint holding the best validated weights (kept by rotation)
    validations_without_improvement: int = 0
    wall_seconds: float = 0.0
    stop_reason: str | None = None

    def count_trained(self, seconds: float, tokens: int, flops: float, positions: int) -> None:
        """Add a log window's training seconds, tokens, model FLOPs and positions."""
        self.train_seconds += seconds
        self.train_tokens += tokens
        if self.train_flops is not None:
            self.train_flops += flops
        if self.train_positions is not None:
            self.train_positions += positions

    def padding_fraction(self) -> float | None:
        """The share of the trained batches' positions that held padding (None when the positions are unknown)."""
        if not self.train_positions:
            return None
        return round(1 - self.train_tokens / self.train_positions, 4)


# What a resumed run must keep: the schedule (restored from the checkpoint) and the batch order and position, the
# augmentation's draws (augmentation.Augmentation), the recipe's precision, which sets the run-length rule's steps on
# a CPU (Recipe.step_budget, which the memory allocator also sets, so under the run-length rule it is kept itself),
# and the masking of protected spans (the training pairs themselves).
RESUME_SETTINGS = {"args": ("learning_rate", "warmup_steps", "lr_scheduler_type", "seed", "per_device_train_batch_size",
                            "gradient_accumulation_steps", "metric_for_best_model"),
                   "augmentation": AUGMENTATION_FLAGS,
                   "recipe": ("bf16", "fp16"),
                   "data_args": ("dataset_name", "dataset_config_name", "train_file", "max_train_samples", "streaming",
                                 "source_lang", "target_lang", "max_source_length", "max_target_length",
                                 "max_length_ratio", "max_tokens", "mask_protected_spans")}
# Settings that name a local file: one file given as `data/train.jsonl` or `/home/me/data/train.jsonl`, or through a
# link, is the same setting (what the file holds is checked by the data fingerprint)
PATH_SETTINGS = ("train_file",)
STEP_BUDGET_SETTING = "step_budget"  # the run-length rule's steps, kept in the settings of a run that uses the rule
# How the token buckets of an in-memory split are packed (data.batching.TrainingBatches): by the lengths after each
# epoch's training noise when the augmentation changes anything, else (and for a streamed split or fixed-size batches,
# which are not packed by length) as before the setting existed: checkpoints saved then lack it and read as that.
PACKING_SETTING = "batch_packing"
PACKED_AFTER_NOISE, PACKED_AS_TOKENISED = "by the lengths after the training noise", "by the tokenised lengths"
SETTINGS_OF_OLDER_RUNS = {PACKING_SETTING: PACKED_AS_TOKENISED}
ARCHITECTURE_FIELDS = ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
                       "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "normalize_before",
                       "max_position_embeddings", "share_encoder_decoder_embeddings", "tie_word_embeddings")


def resume_settings(args, data_args, recipe) -> dict:
    """The values of RESUME_SETTINGS in this run's RunArguments, augmentation (the recipe's), precision (the recipe's:
    `bf16` and `fp16` as booleans, as the flags once held them) and DataArguments."""
    precision = {"bf16": recipe.precision == "bf16", "fp16": recipe.precision == "fp16"}
    sources = {"args": vars(args), "augmentation": recipe.augmentation.settings(), "recipe": precision,
               "data_args": vars(data_args)}
    settings = {name: sources[group][name] for group, names in RESUME_SETTINGS.items() for name in names}
    settings.update({name: _same_path(settings[name]) for name in PATH_SETTINGS})
    if args.max_steps <= 0 and args.num_train_epochs is None:  # the run-length rule: its budget sets the schedule
        settings[STEP_BUDGET_SETTING] = recipe.step_budget
    packed_by_length = bool(recipe.batch_tokens) and not data_args.streaming
    noised = packed_by_length and any(recipe.augmentation.settings().values())
    settings[PACKING_SETTING] = PACKED_AFTER_NOISE if noised else PACKED_AS_TOKENISED
    return settings


def read_run_state(checkpoint: Path) -> RunState:
    """The run state saved in a checkpoint; one line if it cannot be read."""
    try:
        return RunState(**json.loads((checkpoint / RUN_STATE_FILE).read_text()))
    except (OSError, ValueError, TypeError) as error:
        reason = " ".join(str(error).split())[:300]
        raise UsageError(f"checkpoint {checkpoint} has no readable {RUN_STATE_FILE} ({type(error).__name__}: "
                         f"{reason}): resume from another checkpoint-N or start a new --output_dir") from error


# ------------------------------------------------------------------------------------------------ resume checks


def check_resume(checkpoint: Path, args, data_args, recipe, world_size: int) -> None:
    """Before any work: the resumed run must be the same run (number of processes, RESUME_SETTINGS) and not end
    before the checkpoint's step (--max_steps)."""
    saved = read_run_state(checkpoint)
    check_world_size(checkpoint, saved.world_size, world_size)
    check_same_settings(checkpoint, saved.settings, resume_settings(args, data_args, recipe))
    if args.max_steps > 0:
        check_run_length(checkpoint, saved.global_step, args.max_steps)


def check_run_length(checkpoint: Path, step: int, total_steps: int) -> None:
    """A checkpoint past the run's last step would be saved as this run's model, trained longer than asked."""
    if step > total_steps:
        raise UsageError(
            f"checkpoint {checkpoint} is at step {step}, past the {total_steps} steps this run is set to "
            f"(--max_steps, or --num_train_epochs): the resumed run would save that longer-trained model as its "
            f"result; raise --max_steps to train on from step {step}, or resume from a checkpoint-N with N <= "
            f"{total_steps}")


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


def saved_dropout(checkpoint: Path | None) -> float | None:
    """The dropout the model of `checkpoint` was trained with (None: no checkpoint); check_same_architecture has
    refused an unreadable config.json by the time it matters."""
    if checkpoint is None:
        return None
    try:
        return json.loads((checkpoint / "config.json").read_text()).get("dropout")
    except (OSError, ValueError):
        return None


def check_same_settings(checkpoint: Path, saved: dict, current: dict) -> None:
    """The learning-rate schedule comes back from the checkpoint and the position in the data only means the
    same thing over the same batches: changed values would silently not apply, so they are refused."""
    def comparable(name: str, value):
        return _same_path(value) if name in PATH_SETTINGS else value

    saved = SETTINGS_OF_OLDER_RUNS | saved
    changed = [f"{_setting_name(name)} {saved[name]!r} -> {current[name]!r}" for name in current
               if name in saved and comparable(name, saved[name]) != comparable(name, current[name])]
    if changed:
        raise UsageError(
            f"checkpoint {checkpoint} was trained with other settings ({'; '.join(changed)}): a resumed run keeps "
            f"its schedule and batch order, so resume with the values it was started with, or start a new "
            f"--output_dir to train with the new ones")


def _same_path(value: str | None) -> str | None:
    """A path setting as the file it names (absolute, links resolved; a relative path from the working directory,
    as train.py reads it); a plain-text PREFIX resolves as a path too."""
    return os.path.realpath(value) if value else value


def _setting_name(name: str) -> str:
    if name == PACKING_SETTING:
        return "the packing of the training batches (this version packs them by the lengths the noise gives)"
    if name == STEP_BUDGET_SETTING:
        return ("the run-length rule's steps (its budget depends on the precision and on the memory allocator, "
                "tcmalloc or not: docs/training.md)")
    return f"--{name}"


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


# ------------------------------------------------------------------------------------------- the training data


def data_fingerprint(train_split, data_args) -> dict:
    """What recognises the training data without reading all of it: where it comes from, the size of a local file
    (or folder), the number of pairs and a hash of FINGERPRINT_SAMPLE pairs spread over it (the first ones when
    streamed)."""
    fingerprint = {"source": data_args.train_file or data_args.dataset_name or "the shipped corpus"}
    if data_args.train_file:
        fingerprint["bytes"] = _local_bytes(data_args)
    if isinstance(train_split, Dataset):
        count = len(train_split)
        step = max(1, count // FINGERPRINT_SAMPLE)
        sample = train_split[list(range(0, count, step))[:FINGERPRINT_SAMPLE]]
        fingerprint["pairs"] = count
    else:  # streamed: only the first pairs are read
        sample = list(islice(train_split, FINGERPRINT_SAMPLE))
    text = json.dumps(sample, sort_keys=True, ensure_ascii=False, default=str)
    fingerprint["sample_sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return fingerprint


def _local_bytes(data_args) -> int | None:
    """The size of the training data's local file(s): one file, both files of plain-text pairs, or a folder's."""
    try:
        files = resolve_corpus_files(data_args.train_file, "train", (data_args.source_lang, data_args.target_lang))
    except (CorpusError, OSError):
        return None
    paths = files.paths if files is not None else [p for p in Path(data_args.train_file).rglob("*") if p.is_file()]
    return sum(Path(path).stat().st_size for path in paths if Path(path).is_file())


def check_same_data(checkpoint: Path, fingerprint: dict, allowed: bool) -> None:
    """A resumed run continues the checkpoint's tokenizer and position in the data: on other training data that
    would go unnoticed, so it is refused unless `allowed` (--ignore_data_changes)."""
    saved = read_run_state(checkpoint).data_fingerprint
    if {**saved, "source": _same_path(saved.get("source"))} == {**fingerprint, "source": _same_path(fingerprint["source"])}:
        return  # the same data, its file named as before or by another path (relative, absolute, through a link)
    changes = [f"{key} {saved.get(key)} -> {fingerprint.get(key)}" for key in ("bytes", "pairs")
               if saved.get(key) != fingerprint.get(key)]
    if saved.get("sample_sha256") != fingerprint.get("sample_sha256"):
        changes.append(f"other text in the {FINGERPRINT_SAMPLE} pairs sampled")
    change = f"{fingerprint['source']}: {'; '.join(changes)}"
    if allowed:
        logger.warning(f"--ignore_data_changes: the training data changed since {checkpoint} was saved ({change}); "
                       f"continuing with its tokenizer and position on the new data")
        return
    raise UsageError(
        f"the training data changed since {checkpoint} was saved ({change}): the resumed run would go on with its "
        f"tokenizer and position in the data on other pairs; resume with the data it was trained on, start a new "
        f"--output_dir, or add --ignore_data_changes to continue on the new data")


# ------------------------------------------------------------------------------------------------ loading


def load_checkpoint(accelerator, scheduler, checkpoint: Path, total_steps: int) -> RunState:
    """Weights from safetensors; optimiser and RNG states through Accelerate's `torch.load(weights_only=True)`;
    the run state it was saved with (check_resume has compared it with this run). Refused with one line if it
    cannot be read or is past `total_steps`, the run's last step."""
    state = read_run_state(checkpoint)
    check_run_length(checkpoint, state.global_step, total_steps)
    try:
        accelerator.load_state(str(checkpoint))
        scheduler.load_state_dict(state.scheduler)
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
