"""Training with Accelerate and the paper's recipe; `train.py` is a thin command line over `main()`.

The run: corpus -> joint BPE tokenizer -> tokenised, filtered splits -> model -> Adam + warm-up/inverse-sqrt
schedule + label smoothing -> periodic validation (loss, BLEU, chrF) and checkpoints -> test BLEU/chrF with greedy
and beam search -> a Hub-format output directory with a model card -> optionally the hub.
"""

import json
import logging
import math
import os
import platform
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import Dataset, IterableDataset
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, GenerationConfig, HfArgumentParser, get_scheduler

from .configuration_scratch_transformer import PRESETS, ScratchTransformerConfig
from .data import (
    CorpusError,
    DataArguments,
    evaluation_pairs,
    load_parallel_corpus,
    make_batch_sampler,
    make_collator,
    padding_fraction,
    preprocess_corpus,
    sequence_lengths,
)
from .evaluation import evaluate_translations, evaluation_loss
from .modeling_scratch_transformer import ScratchTransformerForConditionalGeneration
from .tokenization import train_tokenizer_on_corpus

logger = logging.getLogger("hf_scratch_transformer")
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
# This package's own run state (JSON), named so that it is not taken for transformers' `trainer_state.json`
# (`TrainerState`), which it is not. Checkpoints written before the rename hold the same JSON under the old name.
TRAINER_STATE = "run_state.json"
LEGACY_TRAINER_STATE = "trainer_state.json"
CHECKPOINT_COMPLETE = "checkpoint_complete.json"  # written last: names every file of the checkpoint and its size
STREAM_SHUFFLE_BUFFER = 10_000  # examples in the shuffle buffer of a --streaming training split
BATCH_TRACE_VARIABLE = "HF_SCRATCH_BATCH_TRACE"  # a directory: each process appends the batches it trained on


class UsageError(Exception):
    """A mistake in the command line, the corpus or the files given: the message says what to fix."""


class TrainingFault(Exception):
    """The run itself failed (non-finite loss, hub unreachable...): the message says what is kept on disk."""


class RunInterrupted(Exception):
    """SIGINT or SIGTERM arrived; a checkpoint was saved. `exit_code` is 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


@dataclass
class ModelArguments:
    """Model size: a preset, then per-field overrides; or an existing model to fine-tune or continue training."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Start from this saved model directory or hub id, with its tokenizer (vocabulary kept), "
                          "instead of a new model; size flags must then agree with it."},
    )
    preset: str | None = field(
        default=None, metadata={"help": f"Model size preset: {', '.join(PRESETS)} (default: small)."}
    )
    d_model: int | None = field(default=None, metadata={"help": "Override the preset's width."})
    encoder_layers: int | None = field(default=None, metadata={"help": "Override the number of encoder layers."})
    decoder_layers: int | None = field(default=None, metadata={"help": "Override the number of decoder layers."})
    attention_heads: int | None = field(default=None, metadata={"help": "Override the heads of every attention."})
    ffn_dim: int | None = field(default=None, metadata={"help": "Override the feed-forward width of every layer."})
    dropout: float | None = field(
        default=None, metadata={"help": "Residual and embedding dropout (P_drop); default 0.1, or the model's own."})
    attention_dropout: float | None = field(
        default=None, metadata={"help": "Dropout on attention weights; default 0.0, or the model's own."})
    activation_dropout: float | None = field(
        default=None, metadata={"help": "Dropout after the feed-forward ReLU; default 0.0, or the model's own."})
    normalize_before: bool = field(default=False, metadata={"help": "Pre-norm instead of the paper's post-norm."})
    max_position_embeddings: int | None = field(
        default=None, metadata={"help": "Longest sequence the model accepts (default: 1024)."})

    def dropout_overrides(self) -> dict:
        """The dropout rates given on the command line (a fine-tuned model keeps its own otherwise)."""
        rates = {"dropout": self.dropout, "attention_dropout": self.attention_dropout,
                 "activation_dropout": self.activation_dropout}
        return {name: value for name, value in rates.items() if value is not None}

    def size_overrides(self) -> dict:
        """Config fields set by size flags on the command line (a preset given explicitly included)."""
        sizes = dict(PRESETS[self.preset]) if self.preset in PRESETS else {}
        given = {
            "d_model": self.d_model, "encoder_layers": self.encoder_layers, "decoder_layers": self.decoder_layers,
            "encoder_attention_heads": self.attention_heads, "decoder_attention_heads": self.attention_heads,
            "encoder_ffn_dim": self.ffn_dim, "decoder_ffn_dim": self.ffn_dim,
            "normalize_before": self.normalize_before or None,  # False is also the default: only True is a request
            "max_position_embeddings": self.max_position_embeddings,
        }
        sizes.update({key: value for key, value in given.items() if value is not None})
        return sizes

    def build_config(self, vocab_size: int) -> ScratchTransformerConfig:
        preset = self.preset or "small"
        if preset not in PRESETS:
            raise UsageError(f"unknown --preset {preset!r}: choose one of {', '.join(PRESETS)}")
        overrides = {
            "d_model": self.d_model, "encoder_layers": self.encoder_layers, "decoder_layers": self.decoder_layers,
            "encoder_attention_heads": self.attention_heads, "decoder_attention_heads": self.attention_heads,
            "encoder_ffn_dim": self.ffn_dim, "decoder_ffn_dim": self.ffn_dim,
        }
        try:
            return ScratchTransformerConfig.from_preset(
                preset, vocab_size=vocab_size, normalize_before=self.normalize_before,
                max_position_embeddings=self.max_position_embeddings or 1024, **self.dropout_overrides(),
                **{key: value for key, value in overrides.items() if value is not None},
            )
        except ValueError as error:
            raise UsageError(f"invalid model size: {error}") from error


@dataclass
class TrainingArguments:
    """How to train; names follow transformers' Seq2SeqTrainingArguments where they overlap."""

    output_dir: str = field(default="outputs/scratch-small-en-es", metadata={"help": "Where the model goes."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Reuse a non-empty output_dir."})
    num_train_epochs: float = field(default=3.0, metadata={"help": "Epochs over the training split."})
    max_steps: int = field(default=-1, metadata={"help": "If > 0: optimiser steps to run (overrides epochs)."})
    learning_rate: float = field(default=1e-3, metadata={"help": "Peak learning rate, reached after warm-up."})
    warmup_steps: int = field(default=400, metadata={"help": "Linear warm-up steps, then --lr_scheduler_type's decay."})
    lr_scheduler_type: str = field(
        default="inverse_sqrt",
        metadata={"help": "Decay after warm-up: inverse_sqrt (the paper's), linear or cosine (to 0 at the last step), "
                          "constant_with_warmup."})
    adam_beta1: float = field(default=0.9, metadata={"help": "Adam β1 (paper: 0.9)."})
    adam_beta2: float = field(default=0.98, metadata={"help": "Adam β2 (paper: 0.98)."})
    adam_epsilon: float = field(default=1e-9, metadata={"help": "Adam ε (paper: 1e-9)."})
    weight_decay: float = field(default=0.0, metadata={"help": "Decoupled weight decay (AdamW) if > 0."})
    label_smoothing_factor: float = field(default=0.1, metadata={"help": "Label smoothing ε_ls (paper: 0.1)."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0: off)."})
    per_device_train_batch_size: int = field(default=64, metadata={"help": "Sentences per batch without --max_tokens."})
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "Sentences per evaluation batch."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Batches per optimiser step."})
    seed: int = field(default=42, metadata={"help": "Seed of initialisation, dropout and batch order."})
    logging_steps: int = field(default=50, metadata={"help": "Log loss, learning rate and tokens/s every N steps."})
    eval_steps: int = field(default=500, metadata={"help": "Validate every N steps (0: only at the end)."})
    save_steps: int = field(default=500, metadata={"help": "Checkpoint every N steps (0: only at the end)."})
    save_total_limit: int = field(default=2, metadata={"help": "Keep only the last N checkpoints."})
    resume_from_checkpoint: str | None = field(
        default=None, metadata={"help": "Checkpoint directory, or 'latest' for the newest one in output_dir."}
    )
    overwrite_newer_checkpoints: bool = field(
        default=False,
        metadata={"help": "Resuming from an older checkpoint-N: move the newer checkpoints aside into "
                  "output_dir/abandoned-after-N-<time>/ instead of refusing."},
    )
    average_checkpoints: int = field(
        default=1, metadata={"help": "Final weights = average of the last K checkpoints (fairseq-style); 1: off."}
    )
    num_beams: int = field(default=4, metadata={"help": "Beam size of the test evaluation and the saved model."})
    eval_max_new_tokens: int = field(default=256, metadata={"help": "Longest translation during evaluation."})
    max_len_a: float = field(
        default=1.5, metadata={"help": "Evaluation translations get at most max_len_a * source tokens + max_len_b new "
                                       "tokens (fairseq), within --eval_max_new_tokens; 0 and 0: no bound."})
    max_len_b: float = field(default=10, metadata={"help": "See --max_len_a."})
    do_train: bool = field(default=False, metadata={"help": "Train (with no --do_* flag: train, eval and predict)."})
    do_eval: bool = field(default=False, metadata={"help": "Validation loss, BLEU and chrF at the end."})
    do_predict: bool = field(
        default=False, metadata={"help": "Translate the test split: generated_predictions.txt, test BLEU and chrF."})
    report_to: str = field(default="tensorboard", metadata={"help": "Accelerate tracker(s), comma-separated, or none."})
    bf16: bool = field(default=False, metadata={"help": "bf16 mixed precision (GPU, or recent CPUs)."})
    fp16: bool = field(default=False, metadata={"help": "fp16 mixed precision (GPU)."})
    torch_compile: bool = field(default=False, metadata={"help": "Compile the model with torch.compile."})
    dataloader_num_workers: int = field(default=0, metadata={"help": "Worker processes for batch collation."})
    push_to_hub: bool = field(default=False, metadata={"help": "Upload the output directory to the model hub."})
    hub_model_id: str | None = field(default=None, metadata={"help": "Hub repository (default: output_dir's name)."})
    hub_strategy: str = field(
        default="end", metadata={"help": "end | every_save (model at each save) | checkpoint (also last-checkpoint/)."}
    )
    hub_token: str | None = field(default=None, metadata={"help": "Hub token (default: HF_TOKEN or stored login)."})
    hub_private_repo: bool = field(default=False, metadata={"help": "Create the hub repository as private."})
    cpu_threads: int = field(
        default=0, metadata={"help": "Torch threads per process on CPU (0: the CPUs available / local processes)."}
    )
    debug: bool = field(default=False, metadata={"help": "Show full tracebacks of errors."})
    verbose: bool = field(
        default=False, metadata={"help": "Show the datasets progress bars and library logs that are hidden by default."})


# ------------------------------------------------------------------------------------------------ argument checks


CONFIG_SUFFIXES = (".json", ".yaml", ".yml")
LR_SCHEDULERS = ("inverse_sqrt", "linear", "cosine", "constant_with_warmup")  # transformers.get_scheduler names


def parse_arguments(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, TrainingArguments]:
    """Command-line flags, optionally after a .json / .yaml file holding flags: `train.py run.yaml --max_steps 5`.

    The file's keys become flags placed before the command line's, so flags given on the command line override the
    file, and every value goes through the same conversion as a flag (YAML's `1e-3`, read as a string, is a float;
    the string "no" is a false boolean; a wrong type is named).
    """
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))

    def one_line_error(message: str):  # argparse would print the (long) usage, then exit
        raise UsageError(f"{message} (see --help)")

    parser.error = one_line_error
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].endswith(CONFIG_SUFFIXES) and not argv[0].startswith("-"):
        path = Path(argv[0])
        file_flags = _config_file_flags(path, {action.dest for action in parser._actions})
        try:
            parser.parse_args_into_dataclasses(args=file_flags)
        except (UsageError, ValueError) as error:
            raise UsageError(f"config file {path}: {' '.join(str(error).split())}") from error
        argv = file_flags + argv[1:]
    try:
        return parser.parse_args_into_dataclasses(args=argv)
    except ValueError as error:  # flags no dataclass knows
        raise UsageError(f"{' '.join(str(error).split())} (see --help)") from error


def _config_file_flags(path: Path, known: set[str]) -> list[str]:
    """The flags a JSON / YAML config file stands for; its problems named in one line."""
    if path.is_dir():
        raise UsageError(f"config file {path} is a directory: give a .json or .yaml file")
    if not path.is_file():
        raise UsageError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"config file {path} cannot be read as UTF-8 text ({error})") from error
    try:
        if path.suffix == ".json":
            values = json.loads(text)
        else:
            import yaml

            values = yaml.safe_load(text)
    except Exception as error:  # noqa: BLE001  (json and yaml raise their own kinds)
        reason = " ".join(str(error).split())[:300]
        raise UsageError(f"config file {path} is not valid {path.suffix[1:].upper()}: {reason}") from error
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise UsageError(f"config file {path} must hold a mapping of flag names to values (like "
                         f"`max_steps: 100`), not a {type(values).__name__}")
    flags = []
    for key, value in values.items():
        if key not in known:
            raise UsageError(f"config file {path}: unknown key {key!r} (see --help for the flag names)")
        if value is None:
            continue
        if isinstance(value, (dict, list)):
            raise UsageError(f"config file {path}: {key} must be a single value, not a {type(value).__name__} "
                             f"({json.dumps(value)[:80]})")
        flags += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags


def check_arguments(model_args: ModelArguments, data_args: DataArguments, args: TrainingArguments) -> None:
    """Refuse contradictory or impossible settings, and an output directory holding another run, before any work."""
    check_values(model_args, data_args, args)
    check_output_dir(args)


def check_values(model_args: ModelArguments, data_args: DataArguments, args: TrainingArguments) -> None:
    """Refuse contradictory or impossible settings before any work is done (touches no file)."""
    _check_ranges(model_args, data_args, args)
    if model_args.preset is not None and model_args.preset not in PRESETS:
        raise UsageError(f"unknown --preset {model_args.preset!r}: choose one of {', '.join(PRESETS)}")
    model_args.build_config(vocab_size=data_args.tokenizer_vocab_size)  # sizes that contradict fail before any work
    if not (args.do_train or args.do_eval or args.do_predict):  # run_translation.py needs them; here: all three
        args.do_train = args.do_eval = args.do_predict = True
    if args.resume_from_checkpoint and not args.do_train:
        raise UsageError("--resume_from_checkpoint continues training: add --do_train (or no --do_* flag)")
    if not args.do_train and not model_args.model_name_or_path:
        raise UsageError("--do_eval/--do_predict without --do_train evaluate an existing model: give it with "
                         "--model_name_or_path DIR")
    if args.max_len_a < 0 or args.max_len_b < 0:
        raise UsageError(f"--max_len_a and --max_len_b must be >= 0, got {args.max_len_a} and {args.max_len_b}")
    if data_args.source_lang == data_args.target_lang:
        raise UsageError(f"--source_lang and --target_lang are both {data_args.source_lang!r}: give two languages")
    if args.hub_strategy not in ("end", "every_save", "checkpoint"):
        raise UsageError(f"--hub_strategy must be end, every_save or checkpoint, not {args.hub_strategy!r}")
    if args.bf16 and args.fp16:
        raise UsageError("--bf16 and --fp16 are exclusive: pick one")
    if args.lr_scheduler_type not in LR_SCHEDULERS:
        raise UsageError(f"--lr_scheduler_type must be one of {', '.join(LR_SCHEDULERS)}, not {args.lr_scheduler_type!r}")
    for name in ("gradient_accumulation_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
                 "num_beams", "logging_steps", "average_checkpoints"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if data_args.streaming and args.max_steps <= 0:
        raise UsageError("--streaming reads a corpus of unknown length, so epochs cannot be counted: give --max_steps N")
    longest = max(data_args.max_source_length, data_args.max_target_length)
    if data_args.max_tokens and data_args.max_tokens < longest:
        raise UsageError(
            f"--max_tokens {data_args.max_tokens} is smaller than the longest allowed sentence ({longest} tokens): "
            f"raise --max_tokens or lower --max_source_length/--max_target_length"
        )
    limit = model_args.max_position_embeddings or (None if model_args.model_name_or_path else 1024)
    if limit is not None and longest + 1 > limit:
        raise UsageError(
            f"--max_source_length/--max_target_length ({longest}) must be below --max_position_embeddings "
            f"({limit})"
        )
    output_dir = Path(args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output_dir {output_dir} is a file, not a directory")


def check_output_dir(args: TrainingArguments) -> None:
    """A non-empty output directory is only reused on request."""
    output_dir = Path(args.output_dir)
    # Staging folders left by a run that stopped during setup hold nothing to lose; the lock is this run's.
    kept = [path for path in output_dir.iterdir()
            if not path.name.startswith((".tokenizer", ".staging-")) and path.name != LOCK_FILE] \
        if output_dir.is_dir() else []
    if kept and args.do_train and not args.overwrite_output_dir and not args.resume_from_checkpoint:
        raise UsageError(
            f"output directory {output_dir} exists and is not empty: pass --overwrite_output_dir to replace it, "
            f"--resume_from_checkpoint latest to continue its run, or another --output_dir"
        )


# (flag, value, lowest, highest, lowest allowed?, highest allowed?): each value must be a finite number in range.
def _numeric_rules(model_args: ModelArguments, data_args: DataArguments, args: TrainingArguments) -> list:
    inf = math.inf
    rules = [
        ("learning_rate", args.learning_rate, 0, inf, False, True),
        ("warmup_steps", args.warmup_steps, 0, inf, True, True),
        ("adam_beta1", args.adam_beta1, 0, 1, True, False),
        ("adam_beta2", args.adam_beta2, 0, 1, True, False),
        ("adam_epsilon", args.adam_epsilon, 0, inf, False, True),
        ("weight_decay", args.weight_decay, 0, inf, True, True),
        ("label_smoothing_factor", args.label_smoothing_factor, 0, 1, True, False),
        ("max_grad_norm", args.max_grad_norm, 0, inf, True, True),
        ("eval_steps", args.eval_steps, 0, inf, True, True),
        ("save_steps", args.save_steps, 0, inf, True, True),
        ("save_total_limit", args.save_total_limit, 1, inf, True, True),
        ("cpu_threads", args.cpu_threads, 0, inf, True, True),
        ("dataloader_num_workers", args.dataloader_num_workers, 0, inf, True, True),
        ("eval_max_new_tokens", args.eval_max_new_tokens, 1, inf, True, True),
        ("dropout", model_args.dropout, 0, 1, True, False),
        ("attention_dropout", model_args.attention_dropout, 0, 1, True, False),
        ("activation_dropout", model_args.activation_dropout, 0, 1, True, False),
        ("max_position_embeddings", model_args.max_position_embeddings, 2, inf, True, True),
        ("max_source_length", data_args.max_source_length, 2, inf, True, True),
        ("max_target_length", data_args.max_target_length, 2, inf, True, True),
        ("validation_split_percentage", data_args.validation_split_percentage, 0, 100, False, False),
        ("max_length_ratio", data_args.max_length_ratio, 1, inf, True, True),
        ("tokenizer_vocab_size", data_args.tokenizer_vocab_size, 260, inf, True, True),
    ]
    optional = [("max_train_samples", data_args.max_train_samples, 1), ("max_eval_samples", data_args.max_eval_samples, 1),
                ("max_predict_samples", data_args.max_predict_samples, 1),
                ("preprocessing_num_workers", data_args.preprocessing_num_workers, 1),
                ("tokenizer_max_sentences", data_args.tokenizer_max_sentences, 1),
                ("max_tokens", data_args.max_tokens, 0)]
    rules += [(name, value, low, inf, True, True) for name, value, low in optional if value is not None]
    if args.max_steps <= 0:  # the epochs decide the length of the run
        rules.append(("num_train_epochs", args.num_train_epochs, 0, inf, False, True))
    return rules


def _check_ranges(model_args: ModelArguments, data_args: DataArguments, args: TrainingArguments) -> None:
    for name, value, low, high, low_ok, high_ok in _numeric_rules(model_args, data_args, args):
        if value is None:  # not given: the preset's (or the --model_name_or_path model's) value, checked by its config
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--{name} must be a finite number, got {value}")
        if value < low or (value == low and not low_ok) or value > high or (value == high and not high_ok):
            upper = "∞)" if high == math.inf else f"{high}{']' if high_ok else ')'}"
            interval = f"{'[' if low_ok else '('}{low}, {upper}"
            hint = " (or give --max_steps N)" if name == "num_train_epochs" else ""
            raise UsageError(f"--{name} must be in {interval}, got {value}: give a value in that range{hint}")


# ------------------------------------------------------------------------------------------------------ the lock

LOCK_FILE = ".train.lock"


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
                try:
                    with open(self.path, "x", encoding="utf-8") as handle:
                        handle.write(json.dumps(self.owner))
                    self.held = True
                    return
                except FileExistsError:
                    holder = self._holder()
                    if holder is not None and not self._is_stale(holder):
                        raise UsageError(
                            f"output directory {directory} is in use by another run (pid {holder.get('pid')} on "
                            f"{holder.get('hostname')}, lock {self.path}): wait for it to end or choose another "
                            f"--output_dir; delete the lock only if that run is gone") from None
                    logger.warning(f"removing the stale lock {self.path} of a run that is gone ({holder})")
                    self.path.unlink(missing_ok=True)
        except OSError as error:
            raise UsageError(f"output directory {directory} is not writable ({type(error).__name__}: "
                             f"{error.strerror or error}): fix its permissions or free space, or choose another "
                             f"--output_dir") from error
        raise UsageError(f"could not take the lock {self.path}: another run keeps recreating it; choose another "
                         f"--output_dir")

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


# ------------------------------------------------------------------------------------------------------- launching

WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_world_size() -> int:
    """How many processes the launcher started; refuses launches that would not give them (or FSDP on CPU).

    accelerate 1.15 starts several processes through torchrun (`--multi_gpu`, or `distributed_type: MULTI_GPU`),
    which also works without GPUs (gloo). `--cpu --num_processes N` and `distributed_type: MULTI_CPU` go to its
    "simple" launcher instead, which starts ONE process and expects mpirun to start the others.
    """
    world_size = next((int(os.environ[name]) for name in WORLD_SIZE_VARIABLES if os.environ.get(name)), 1)
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        raise UsageError(
            "FSDP is not supported by train.py: validation, test decoding and saving run on the main process and "
            "need the whole model, which FSDP shards; use DDP instead (configs/accelerate/multi_gpu.yaml on GPUs, "
            "configs/accelerate/cpu_2proc.yaml on CPUs)")
    cpu_launch = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    if world_size == 1 and cpu_launch and os.environ.get("MASTER_PORT") and "LOCAL_RANK" not in os.environ:
        raise UsageError(
            "`accelerate launch --cpu --num_processes N` (and distributed_type: MULTI_CPU) starts only one process "
            "in accelerate 1.15 unless mpirun starts the others: use `accelerate launch --multi_gpu --num_processes "
            "N --num_machines 1 train.py ...` (gloo on CPUs) or --config_file configs/accelerate/cpu_2proc.yaml")
    return world_size


# ------------------------------------------------------------------------------------------------------ checkpoints


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


ARCHITECTURE_FIELDS = ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
                       "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "normalize_before",
                       "max_position_embeddings", "share_encoder_decoder_embeddings", "tie_word_embeddings")


def check_model_flags(model_args: ModelArguments, data_args: DataArguments, config, name: str) -> None:
    """Size flags given with --model_name_or_path must describe that model: the vocabulary and sizes are its own."""
    different = [f"{key} {value} (the model has {getattr(config, key, None)})"
                 for key, value in model_args.size_overrides().items() if getattr(config, key, None) != value]
    if different:
        raise UsageError(f"size flags contradict the model {name}: {'; '.join(different)}; drop them to start from "
                         f"the model as it is")
    longest = max(data_args.max_source_length, data_args.max_target_length)
    if longest + 1 > config.max_position_embeddings:
        raise UsageError(f"--max_source_length/--max_target_length ({longest}) must be below the model's "
                         f"max_position_embeddings ({config.max_position_embeddings})")


def check_same_architecture(checkpoint: Path, config: ScratchTransformerConfig) -> None:
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


# ------------------------------------------------------------------------------------------------------- the run


class Run:
    """One training run: holds what the steps share (accelerator, model, data) and writes the output directory."""

    def __init__(self, model_args: ModelArguments, data_args: DataArguments, args: TrainingArguments,
                 model_card_template: str | Path | None = None):
        self.model_args, self.data_args, self.args = model_args, data_args, args
        self.output_dir = Path(args.output_dir)
        self.model_card_template = model_card_template
        self.stop_signal: int | None = None
        self.last_checkpoint: Path | None = None
        self.state = RunState()
        self.started = time.time()
        self.lock = OutputDirLock(self.output_dir)

    # -- setup ---------------------------------------------------------------------------------------------------

    def setup(self) -> None:
        args, data_args = self.args, self.data_args
        check_values(self.model_args, data_args, args)
        _quiet_libraries(args.verbose)
        if int(os.environ.get("RANK", "0")) == 0:  # the main process, before Accelerate starts
            self.lock.acquire()
        check_output_dir(args)
        trackers = [name.strip() for name in args.report_to.split(",") if name.strip() not in ("", "none")]
        world_size = launched_world_size()
        self.accelerator = Accelerator(
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            mixed_precision="bf16" if args.bf16 else "fp16" if args.fp16 else "no",
            log_with=trackers or None,
            project_dir=str(self.output_dir),
            # torchrun-style launch on a machine without GPUs: one CPU process per rank over gloo (MULTI_CPU).
            cpu=world_size > 1 and not torch.cuda.is_available(),
        )
        if self.accelerator.num_processes != world_size:
            raise UsageError(
                f"{world_size} processes were launched but Accelerate joined {self.accelerator.num_processes} of "
                f"them: they would race in one --output_dir; launch with `accelerate launch --multi_gpu "
                f"--num_processes {world_size} --num_machines 1` (see README, Several processes)")
        self.is_main = self.accelerator.is_main_process
        if self.accelerator.device.type == "cpu":
            # `accelerate launch` without --cpu sets OMP_NUM_THREADS=1, which would leave all but one core idle.
            local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", self.accelerator.num_processes))
            torch.set_num_threads(args.cpu_threads or max(1, len(os.sched_getaffinity(0)) // local_processes))
        self.checkpoint = None
        if args.resume_from_checkpoint:
            self.checkpoint = resolve_checkpoint(args.resume_from_checkpoint, self.output_dir)
            self._set_newer_checkpoints_aside()
        elif args.overwrite_output_dir and self.is_main:
            for old in self.output_dir.glob("checkpoint-*"):
                shutil.rmtree(old)
        set_seed(args.seed)
        # A model to start from is loaded first: a wrong path or contradicting size flags fail before the corpus.
        self.pretrained = self._load_pretrained() if self.model_args.model_name_or_path else None

        corpus_args = data_args
        if not args.do_train and not data_args.train_file and (data_args.test_file or data_args.validation_file):
            # Evaluating an existing model needs no training file: the loader wants one, so it gets a given file,
            # whose "train" split is dropped below.
            corpus_args = replace(data_args, train_file=data_args.test_file or data_args.validation_file)
        try:
            raw = load_parallel_corpus(corpus_args, seed=args.seed)
        except (CorpusError, ConnectionError) as error:
            raise UsageError(str(error)) from error
        if not args.do_train:  # evaluation only: the training split is not needed
            raw = type(raw)({name: split for name, split in raw.items() if name != "train"})
        self.tokenizer = self._tokenizer(raw)
        started = time.time()
        with self.accelerator.main_process_first():
            self.datasets, self.filter_report = preprocess_corpus(raw, self.tokenizer, data_args)
        logger.info("tokenised and filtered in %.1f s: %s", time.time() - started, "; ".join(
            f"{split} {report['kept']} of {report['input']} pairs kept" for split, report in self.filter_report.items()))
        if data_args.streaming:
            # Validation and test are read once and kept in memory (bounded by --max_eval/predict_samples);
            # only the training split streams.
            self.datasets = {name: split if name == "train" else Dataset.from_list(list(split))
                             for name, split in self.datasets.items()}
        if args.do_train and not _has_examples(self.datasets["train"]):
            raise UsageError(f"every training pair was filtered out ({self.filter_report['train']}): check the "
                             f"language keys and --max_source_length/--max_target_length/--max_length_ratio")
        for split, report in self.filter_report.items():
            if report["empty"]:
                logger.warning(f"{split}: {report['empty']} of {report['input']} pairs skipped, a side missing, null "
                               f"or empty")
        self.eval_sources, self.eval_references = evaluation_pairs(raw["validation"], data_args)
        self.test_sources, self.test_references = evaluation_pairs(raw["test"], data_args)
        if (args.do_train or args.do_eval) and not self.eval_sources:
            raise UsageError("the validation split has no usable pairs: give --validation_file with pairs in it")

        if self.pretrained is not None:
            self.model = self.pretrained[0]
            config = self.model.config
        else:
            config = self.model_args.build_config(vocab_size=len(self.tokenizer))
            self.model = ScratchTransformerForConditionalGeneration(config)
        if self.checkpoint is not None:
            check_same_architecture(self.checkpoint, config)
        self.model.generation_config = self._generation_config()
        _DECLARED_TIES.tied = set(getattr(self.model, "all_tied_weights_keys", None) or {})
        self.collator = make_collator(self.tokenizer)
        if not args.do_train:
            self.model.to(self.accelerator.device).eval()
            return
        optimizer_class = torch.optim.AdamW if args.weight_decay > 0 else torch.optim.Adam
        # fused: one kernel for every parameter's update (on CPU too), instead of a loop of small ones.
        optimizer = optimizer_class(self.model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                                    betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                    fused=self.accelerator.device.type in ("cpu", "cuda"))
        self.train_model = torch.compile(self.model) if args.torch_compile else self.model
        self.train_model, self.optimizer = self.accelerator.prepare(self.train_model, optimizer)
        if data_args.streaming:  # length unknown: check_arguments asked for --max_steps
            self.sampler, self.batches_per_epoch, self.total_steps = None, 0, args.max_steps
        else:
            self.sampler = make_batch_sampler(
                self.datasets["train"], data_args, args.per_device_train_batch_size, shuffle=True, seed=args.seed,
                num_replicas=self.accelerator.num_processes, rank=self.accelerator.process_index,
            )
            self.batches_per_epoch = len(self.sampler)
            steps_per_epoch = math.ceil(self.batches_per_epoch / args.gradient_accumulation_steps)
            self.total_steps = (args.max_steps if args.max_steps > 0
                                else math.ceil(args.num_train_epochs * steps_per_epoch))
        # Stepped by hand once per optimiser step: Accelerate's wrapper would step it once per process.
        self.scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                                       num_training_steps=self.total_steps)
        trace = os.environ.get(BATCH_TRACE_VARIABLE)
        self.trace = (open(Path(trace) / f"rank-{self.accelerator.process_index}.jsonl", "a", encoding="utf-8")
                      if trace else None)
        if self.checkpoint is not None:
            self._load_checkpoint(self.checkpoint)
        if trackers:
            self.accelerator.init_trackers("runs", config=self._hyperparameters())

    def _load_pretrained(self):
        """(model, tokenizer) of --model_name_or_path, refused with one line if unusable or contradicted by flags."""
        from .translate import ModelLoadError, load_model_and_tokenizer

        name = self.model_args.model_name_or_path
        try:
            model, tokenizer = load_model_and_tokenizer(name, config_overrides=self.model_args.dropout_overrides())
        except ModelLoadError as error:
            raise UsageError(f"--model_name_or_path: {error}") from error
        if getattr(model.config, "model_type", None) != ScratchTransformerConfig.model_type:
            raise UsageError(f"--model_name_or_path {name} is a {model.config.model_type!r} model: train.py trains "
                             f"and fine-tunes only {ScratchTransformerConfig.model_type!r} models")
        check_model_flags(self.model_args, self.data_args, model.config, name)
        logger.info(f"starting from {name}: {model.num_parameters() / 1e6:.1f} M parameters, its tokenizer "
                    f"({len(tokenizer)} tokens; --tokenizer_vocab_size is not used)")
        return model, tokenizer

    def _set_newer_checkpoints_aside(self) -> None:
        """Resuming from checkpoint-N while checkpoint-M (M > N) exist: the resumed run would overwrite them and
        rotation would delete its own new checkpoints, so it is refused unless --overwrite_newer_checkpoints,
        which moves them into abandoned-after-N-<time>/ (where `latest` no longer sees them)."""
        match = CHECKPOINT_PATTERN.match(self.checkpoint.name)
        step = int(match.group(1)) if match else json.loads(run_state_file(self.checkpoint).read_text())["global_step"]
        newer = [path for path in self.output_dir.glob("checkpoint-*")
                 if (m := CHECKPOINT_PATTERN.match(path.name)) and int(m.group(1)) > step and path.is_dir()]
        newer.sort(key=lambda path: int(CHECKPOINT_PATTERN.match(path.name).group(1)))
        if not newer:
            return
        names = ", ".join(path.name + ("" if checkpoint_problem(path) is None else " (incomplete)") for path in newer)
        if not self.args.overwrite_newer_checkpoints:
            raise UsageError(
                f"resuming from {self.checkpoint} (step {step}) while {self.output_dir} holds newer checkpoints "
                f"({names}): resume from the newest with --resume_from_checkpoint latest, or add "
                f"--overwrite_newer_checkpoints to move them aside into {self.output_dir}/abandoned-after-{step}-<time>/")
        aside = self.output_dir / f"abandoned-after-{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        if self.is_main:
            aside.mkdir()
            for path in newer:
                os.replace(path, aside / path.name)
            logger.warning(f"moved the newer checkpoints {names} aside into {aside}")
        self.accelerator.wait_for_everyone()

    def _tokenizer(self, raw):
        """Trained on the training split (main process), the one of --model_name_or_path, or the one a resumed
        checkpoint was trained with."""
        if self.checkpoint is not None:
            return AutoTokenizer.from_pretrained(self.checkpoint)
        if self.pretrained is not None:
            return self.pretrained[1]
        staging = self.output_dir / ".tokenizer"
        if self.is_main:
            tokenizer = train_tokenizer_on_corpus(
                raw["train"], self.data_args.source_lang, self.data_args.target_lang,
                vocab_size=self.data_args.tokenizer_vocab_size, max_sentences=self.data_args.tokenizer_max_sentences,
                seed=self.args.seed,
            )
            tokenizer.model_max_length = max(self.data_args.max_source_length, self.data_args.max_target_length)
            tokenizer.save_pretrained(staging)
        self.accelerator.wait_for_everyone()
        return AutoTokenizer.from_pretrained(staging)

    def _generation_config(self) -> GenerationConfig:
        return GenerationConfig(
            decoder_start_token_id=self.model.config.decoder_start_token_id, bos_token_id=self.model.config.bos_token_id,
            eos_token_id=self.model.config.eos_token_id, pad_token_id=self.model.config.pad_token_id,
            # max_new_tokens rather than max_length: a call with its own max_new_tokens then gives no warning.
            num_beams=self.args.num_beams, max_new_tokens=self.data_args.max_target_length,
            early_stopping=self.args.num_beams > 1,
        )

    def _hyperparameters(self) -> dict:
        flat = {**asdict(self.model_args), **asdict(self.data_args), **asdict(self.args)}
        return {key: value for key, value in flat.items() if isinstance(value, (int, float, str, bool))}

    # -- training ------------------------------------------------------------------------------------------------

    def train(self) -> None:
        accelerator = self.accelerator
        device = accelerator.device
        previous_handlers = self._install_signal_handlers()
        try:
            self._train_loop(accelerator, device)
        finally:
            if getattr(self, "_progress", None) is not None:  # on a fault too: the message is then the last line
                self._progress.close()
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
            if self.trace is not None:
                self.trace.close()
                self.trace = None

    def _train_loop(self, accelerator: Accelerator, device: torch.device) -> None:
        args, state = self.args, self.state
        progress = self._progress = _progress_bar(self.total_steps, state.global_step, disable=not self.is_main)
        window_loss, window_batches, window_tokens, window_start = 0.0, 0, 0, time.time()
        # A non-finite loss is recorded on the device and looked at only before logging, validating or saving:
        # a per-step `.item()` would make the host wait for the GPU at every step.
        self._first_bad = torch.full((2,), -1.0, device=device)  # (step, loss value) of the first non-finite loss
        self.train_model.train()
        while state.global_step < self.total_steps:
            trained_in_pass = 0
            for indices, batch in self._epoch_batches(state.epoch, state.batches_done_in_epoch):
                trained_in_pass += 1
                # Counted on the host before the copy to the device: no synchronisation.
                tokens = int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
                batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
                with accelerator.accumulate(self.train_model):
                    loss = self._loss(batch)
                    self._record_non_finite(loss.detach(), state.global_step + 1)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and args.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(self.train_model.parameters(), args.max_grad_norm)
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                state.batches_done_in_epoch += 1
                if self.trace is not None:
                    self.trace.write(json.dumps({"rank": accelerator.process_index, "world_size": accelerator.num_processes,
                                                 "epoch": state.epoch, "step": state.global_step + 1,
                                                 "indices": indices, "tokens": tokens}) + "\n")
                    self.trace.flush()
                window_loss, window_batches, window_tokens = window_loss + loss.detach(), window_batches + 1, window_tokens + tokens
                if not accelerator.sync_gradients:
                    continue
                self.scheduler.step()
                state.global_step += 1
                progress.update(1)
                checkpoint_due = args.save_steps and state.global_step % args.save_steps == 0
                validation_due = (args.eval_steps and state.global_step % args.eval_steps == 0
                                  and state.global_step < self.total_steps)
                log_due = state.global_step % args.logging_steps == 0 or state.global_step == self.total_steps
                if log_due or checkpoint_due or validation_due or self.stop_signal is not None:
                    self._raise_if_non_finite()
                if log_due:
                    seconds = time.time() - window_start
                    total_tokens = int(accelerator.reduce(torch.tensor(window_tokens, device=device), "sum"))
                    state.train_tokens += total_tokens
                    state.train_seconds += seconds
                    row = {"step": state.global_step, "epoch": self._epoch_fraction(),
                           "train_loss": round(float(window_loss) / window_batches, 4),
                           "learning_rate": self.scheduler.get_last_lr()[0],
                           "tokens_per_second": round(total_tokens / max(seconds, 1e-9), 1)}
                    self._log(row)
                    progress.set_postfix(loss=row["train_loss"], tok_s=row["tokens_per_second"])
                    window_loss, window_batches, window_tokens, window_start = 0.0, 0, 0, time.time()
                # The window's clock stops while validating or saving: tokens/s counts training time only.
                if validation_due:
                    paused = time.time()
                    self.validate()
                    window_start += time.time() - paused
                if checkpoint_due:
                    paused = time.time()
                    self.save_checkpoint()
                    window_start += time.time() - paused
                if self.stop_signal is not None:
                    self._stop_on_signal()
                if state.global_step >= self.total_steps:
                    break
            else:
                if trained_in_pass == 0 and state.batches_done_in_epoch == 0:
                    raise UsageError(f"the training split gives no batch for each of the {accelerator.num_processes} "
                                     f"process(es): give more training pairs or use fewer processes")
                state.epoch += 1
                state.batches_done_in_epoch = 0
        progress.close()
        self._raise_if_non_finite()
        if self.last_checkpoint is None or self.last_checkpoint.name != f"checkpoint-{state.global_step}":
            self.save_checkpoint()

    def _epoch_fraction(self) -> float:
        """Epochs done; with --streaming the length of an epoch is unknown, so only whole epochs count."""
        fraction = self.state.batches_done_in_epoch / self.batches_per_epoch if self.batches_per_epoch else 0.0
        return round(self.state.epoch + fraction, 3)

    def _epoch_batches(self, epoch: int, done: int):
        """(example indices, collated batch) of this process for the rest of epoch `epoch`, after the `done`
        batches it already trained on; indices are positions in the (shuffled) stream with --streaming."""
        if self.data_args.streaming:
            yield from self._stream_batches(epoch, done)
            return
        self.sampler.set_epoch(epoch)
        batches = list(self.sampler)[done:]
        # A private generator: creating the loader must not draw from the global RNG (exact resumption).
        loader = DataLoader(self.datasets["train"], batch_sampler=batches, collate_fn=self.collator,
                            num_workers=self.args.dataloader_num_workers, generator=torch.Generator())
        yield from zip(batches, loader)

    def _stream_batches(self, epoch: int, done: int):
        """Batches read from the streamed training split: every process reads the same seeded, shuffled stream and
        forms the same batches (a token budget or a sentence count, in stream order); batch k goes to process
        k % world_size. Only whole rounds (one batch per process) are trained, so every process takes the same
        number of steps. Resuming re-reads the stream and skips the rounds already trained (`done` of them)."""
        dataset = self.datasets["train"].shuffle(seed=self.args.seed, buffer_size=STREAM_SHUFFLE_BUFFER)
        dataset.set_epoch(epoch)
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        budget = self.data_args.max_tokens
        round_, batch, positions, longest = [], [], [], 0
        rounds = 0

        def close_batch():
            nonlocal batch, positions, longest, rounds
            round_.append((positions, batch))
            batch, positions, longest = [], [], 0
            if len(round_) == world:
                rounds += 1
                mine = round_[rank]
                round_.clear()
                if rounds > done:
                    return mine
            return None

        for position, example in enumerate(dataset):
            features = {key: example[key] for key in ("input_ids", "attention_mask", "labels")}
            length = max(len(features["input_ids"]), len(features["labels"]))
            full = ((len(batch) + 1) * max(longest, length) > budget) if budget else \
                len(batch) >= self.args.per_device_train_batch_size
            if batch and full:
                mine = close_batch()
                if mine is not None:
                    yield mine[0], self.collator(mine[1])
            batch.append(features)
            positions.append(position)
            longest = max(longest, length)
        if batch:
            mine = close_batch()
            if mine is not None:
                yield mine[0], self.collator(mine[1])

    def _loss(self, batch: dict) -> torch.Tensor:
        """Label-smoothed cross-entropy over the non-padding target tokens, teacher-forced."""
        # With labels the model derives the decoder input; skip_logits projects only the scored positions.
        return self.train_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                labels=batch["labels"], label_smoothing=self.args.label_smoothing_factor,
                                skip_logits=True).loss

    def _record_non_finite(self, loss: torch.Tensor, step: int) -> None:
        """Remember (on the device, without synchronising) the step and value of the first non-finite loss."""
        first = (~torch.isfinite(loss)) & (self._first_bad[0] < 0)
        self._first_bad.copy_(torch.where(first, torch.stack([torch.full_like(loss, step), loss]).float(),
                                          self._first_bad))

    def _raise_if_non_finite(self) -> None:
        """Stop before anything is logged or saved from weights a non-finite loss has touched."""
        step, value = self._first_bad.tolist()
        if step >= 0:
            raise TrainingFault(self._non_finite_message(value, int(step)))

    def _non_finite_message(self, value: float, step: int) -> str:
        kept = list_checkpoints(self.output_dir)
        if kept:
            return (f"loss became {value} at step {step}; stopped without saving this state, "
                    f"the last good checkpoint is {kept[-1]}. Lower --learning_rate, raise --warmup_steps or check "
                    f"the data, then resume with --resume_from_checkpoint latest")
        return (f"loss became {value} at step {step}; stopped, no checkpoint had been written "
                f"yet. Lower --learning_rate, raise --warmup_steps or check the data, then start again with "
                f"--overwrite_output_dir")

    def _install_signal_handlers(self) -> dict:
        """SIGINT/SIGTERM only set a flag: the loop saves a checkpoint after the current step and stops."""
        def request_stop(signum, frame):
            self.stop_signal = signum
        return {signum: signal.signal(signum, request_stop) for signum in (signal.SIGINT, signal.SIGTERM)}

    def _stop_on_signal(self) -> None:
        self.save_checkpoint()
        raise RunInterrupted(
            f"{signal.Signals(self.stop_signal).name} received: checkpoint saved at step {self.state.global_step} in "
            f"{self.last_checkpoint}; continue with --resume_from_checkpoint latest",
            self.stop_signal,
        )

    def _log(self, row: dict) -> None:
        self.state.history.append(row)
        self.accelerator.log({key: value for key, value in row.items() if key != "step"}, step=row["step"])
        if self.is_main:
            logger.info(json.dumps(row))

    # -- evaluation ----------------------------------------------------------------------------------------------

    def _eval_batches(self, split: str):
        dataset = self.datasets[split]
        sampler = make_batch_sampler(dataset, self.data_args, self.args.per_device_eval_batch_size, shuffle=False)
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=self.collator)

    def _decoding_options(self) -> dict:
        """How validation and test translate: bounded to a * source length + b, a progress bar on the main process."""
        return dict(batch_size=self.args.per_device_eval_batch_size, max_new_tokens=self.args.eval_max_new_tokens,
                    max_len_a=self.args.max_len_a, max_len_b=self.args.max_len_b, progress=self.is_main)

    def validate(self) -> dict:
        """Validation loss and greedy BLEU/chrF, on the main process; logged and added to the history."""
        row = {}
        if self.is_main:
            model = self.accelerator.unwrap_model(self.model).eval()  # no dropout while validating
            loss = evaluation_loss(model, self._eval_batches("validation"), self.accelerator.device)
            scores, _ = evaluate_translations(model, self.tokenizer, self.eval_sources, self.eval_references,
                                              num_beams=1, description=f"validation, step {self.state.global_step}",
                                              **self._decoding_options())
            model.train(self.args.do_train)
            row = {"step": self.state.global_step, "eval_loss": round(loss, 4), "eval_bleu": scores["bleu"],
                   "eval_chrf": scores["chrf"], "eval_gen_len": scores["gen_len"]}
            earlier = [r["eval_loss"] for r in self.state.history if "eval_loss" in r]
            self._log(row)
            warning = divergence_warning(row, earlier, len(self.tokenizer), self.args.warmup_steps)
            if warning:
                self.divergence = warning
                logger.warning(warning)
        self.accelerator.wait_for_everyone()
        return row

    def test(self) -> dict:
        """Test loss, and BLEU/chrF/gen_len with beam search (`predict_*`, run_translation.py's names) and, for
        comparison, greedy decoding (`predict_*_greedy`), on the main process."""
        results = {}
        if self.is_main and self.test_sources:
            model = self.accelerator.unwrap_model(self.model).eval()
            results["predict_loss"] = round(evaluation_loss(model, self._eval_batches("test"), self.accelerator.device), 4)
            for beams in sorted({1, self.args.num_beams}):
                started = time.time()
                name = "greedy" if beams == 1 else f"beam {beams}"
                scores, predictions = evaluate_translations(
                    model, self.tokenizer, self.test_sources, self.test_references, num_beams=beams,
                    description=f"test, {name}", **self._decoding_options(),
                )
                suffix = "_greedy" if beams != self.args.num_beams else ""
                results.update({f"predict_bleu{suffix}": scores["bleu"], f"predict_chrf{suffix}": scores["chrf"],
                                f"predict_gen_len{suffix}": scores["gen_len"],
                                f"predict_runtime{suffix}": round(time.time() - started, 2)})
                if beams == self.args.num_beams:
                    self.test_predictions = predictions
            results["predict_samples"] = len(self.test_sources)
            results["predict_samples_per_second"] = round(len(self.test_sources) / max(results["predict_runtime"], 1e-9), 3)
            logger.info(json.dumps(results))
        self.accelerator.wait_for_everyone()
        return results

    # -- saving --------------------------------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """`accelerator.save_state` into `checkpoint-<step>.tmp`, renamed when complete; old ones rotated out."""
        step = self.state.global_step
        final = self.output_dir / f"checkpoint-{step}"
        staging = self.output_dir / f"checkpoint-{step}.tmp"
        try:
            if self.is_main and staging.exists():
                shutil.rmtree(staging)
            self.accelerator.wait_for_everyone()
            self.accelerator.save_state(str(staging), safe_serialization=True)
            self.accelerator.wait_for_everyone()  # every process's random states are written before the marker
            if self.is_main:
                self.state.scheduler = self.scheduler.state_dict()
                self.state.world_size = self.accelerator.num_processes
                self.state.settings = self.state.settings or self._settings()
                self.accelerator.unwrap_model(self.model).config.to_json_file(staging / "config.json")
                self.tokenizer.save_pretrained(staging)
                (staging / TRAINER_STATE).write_text(json.dumps(asdict(self.state), indent=1))
                files = {str(path.relative_to(staging)): path.stat().st_size
                         for path in sorted(staging.rglob("*")) if path.is_file()}
                (staging / CHECKPOINT_COMPLETE).write_text(json.dumps({"step": step, "files": files}, indent=1))
                if final.exists():
                    shutil.rmtree(final)
                os.replace(staging, final)
                for old in list_checkpoints(self.output_dir)[: -self.args.save_total_limit]:
                    shutil.rmtree(old)
        except OSError as error:  # disk full, permissions: the staging folder never counts as a checkpoint
            if self.is_main:
                shutil.rmtree(staging, ignore_errors=True)
            kept = list_checkpoints(self.output_dir)
            where = (f"the last complete checkpoint, {kept[-1]}, is unchanged; free space or fix permissions, then "
                     f"resume with --resume_from_checkpoint latest" if kept else
                     "no complete checkpoint was written before; free space or fix permissions, then start again "
                     "with --overwrite_output_dir")
            raise TrainingFault(f"could not write checkpoint-{step} in {self.output_dir} ({type(error).__name__}: "
                                f"{error}); {where}") from error
        self.accelerator.wait_for_everyone()
        self.last_checkpoint = final
        if self.args.push_to_hub and self.args.hub_strategy in ("every_save", "checkpoint") and self.is_main:
            self._push_during_training(final)
        return final

    def _load_checkpoint(self, checkpoint: Path) -> None:
        """Weights from safetensors; optimiser and RNG states through Accelerate's `torch.load(weights_only=True)`."""
        try:
            saved = json.loads(run_state_file(checkpoint).read_text())
            self._check_world_size(checkpoint, saved.get("world_size", 1))
            self._check_same_settings(checkpoint, saved.get("settings") or {})
            self.accelerator.load_state(str(checkpoint))
            self.state = RunState(**saved)
            self.scheduler.load_state_dict(self.state.scheduler)
        except UsageError:
            raise
        except Exception as error:  # noqa: BLE001  (safetensors, torch and json each raise their own)
            reason = " ".join(str(error).split())[:300]
            raise UsageError(
                f"checkpoint {checkpoint} cannot be loaded ({type(error).__name__}: {reason}): it is incomplete or "
                f"corrupted; resume from an earlier checkpoint-N or start a new --output_dir"
            ) from error
        self.last_checkpoint = checkpoint
        logger.info(f"resumed from {checkpoint} at step {self.state.global_step}")

    def _settings(self) -> dict:
        sources = {"args": self.args, "data_args": self.data_args}
        return {name: getattr(sources[group], name) for group, names in RESUME_SETTINGS.items() for name in names}

    def _check_same_settings(self, checkpoint: Path, saved: dict) -> None:
        """The learning-rate schedule comes back from the checkpoint and the position in the data only means the
        same thing over the same batches: changed values would silently not apply, so they are refused."""
        current = self._settings()
        changed = [f"--{name} {saved[name]!r} -> {current[name]!r}" for name in current
                   if name in saved and saved[name] != current[name]]
        if changed:
            raise UsageError(
                f"checkpoint {checkpoint} was trained with other settings ({'; '.join(changed)}): a resumed run keeps "
                f"its schedule and batch order, so resume with the values it was started with, or start a new "
                f"--output_dir to train with the new ones")

    def _check_world_size(self, checkpoint: Path, saved: int) -> None:
        """The position in the epoch counts batches of each of `saved` processes, and every process has its own
        random state: another number of processes cannot continue the same batch order, so it is refused."""
        current = self.accelerator.num_processes
        if saved != current:
            how = (f"`accelerate launch --multi_gpu --num_processes {saved} --num_machines 1 train.py ...`"
                   if saved > 1 else "one process (`python train.py ...`)")
            raise UsageError(
                f"checkpoint {checkpoint} was written by {saved} process(es) and this run has {current}: the position "
                f"in the data and the per-process random states only carry over to the same number; resume with "
                f"{how} or start a new --output_dir")

    def average_last_checkpoints(self) -> None:
        """Replace the weights by the mean of the last K checkpoints' weights (fairseq's average_checkpoints)."""
        from safetensors.torch import load_file

        checkpoints = list_checkpoints(self.output_dir)[-self.args.average_checkpoints :]
        if len(checkpoints) < 2:
            logger.warning(f"--average_checkpoints {self.args.average_checkpoints}: only {len(checkpoints)} "
                           f"checkpoint(s) kept (raise --save_total_limit); not averaging")
            return
        model = self.accelerator.unwrap_model(self.model)
        total = None
        for checkpoint in checkpoints:
            weights = load_file(checkpoint / "model.safetensors")
            total = weights if total is None else {name: total[name] + weights[name] for name in total}
        model.load_state_dict({name: value / len(checkpoints) for name, value in total.items()}, strict=False)
        self.averaged_checkpoints = [path.name for path in checkpoints]

    def _result_files(self, results: dict, phases: dict) -> dict:
        """run_translation.py's result files: {train,eval,predict}_results.json, all_results.json (`results`) and
        generated_predictions.txt (one line per test source, in order)."""
        files = {f"{phase}_results.json": json.dumps(values, indent=2) for phase, values in phases.items() if values}
        files["all_results.json"] = json.dumps(results, indent=2)
        if getattr(self, "test_predictions", None) is not None:
            files["generated_predictions.txt"] = "".join(line + "\n" for line in self.test_predictions)
        return files

    def save_results(self, results: dict, phases: dict) -> None:
        """Without training: write the result files into output_dir (all_results.json merged into an existing one,
        as transformers' Trainer.save_metrics does)."""
        if not self.is_main:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        previous = self.output_dir / "all_results.json"
        try:
            merged = {**json.loads(previous.read_text()), **results} if previous.is_file() else results
        except ValueError:
            merged = results
        try:
            for name, text in self._result_files(merged, phases).items():
                (self.output_dir / name).write_text(text, encoding="utf-8")
        except OSError as error:
            raise TrainingFault(f"could not write the results into {self.output_dir} ({type(error).__name__}: "
                                f"{error})") from error

    def save_model(self, results: dict, phases: dict | None = None) -> None:
        """Write the Hub-format directory: staged in a temporary folder, then moved in file by file, so a failed
        save leaves the previous model as it was."""
        if not self.is_main:
            return
        model = self.accelerator.unwrap_model(self.model)
        model.config.use_cache = True
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.output_dir))
        moving = False
        try:
            model.save_pretrained(staging)
            self.tokenizer.save_pretrained(staging)
            for name, text in self._result_files(results, phases or {}).items():
                (staging / name).write_text(text, encoding="utf-8")
            (staging / "training_history.json").write_text(json.dumps(self.state.history, indent=1))
            self._write_training_curves(staging / "training_curves.png")
            if self.model_card_template is not None:
                (staging / "README.md").write_text(self._model_card(results))
            moving = True
            for path in staging.iterdir():
                os.replace(path, self.output_dir / path.name)
        except OSError as error:
            before = ("were partly replaced" if moving else "are unchanged")
            kept = f"the last checkpoint is {self.last_checkpoint}" if self.last_checkpoint else "no checkpoint"
            raise TrainingFault(
                f"could not save the final model in {self.output_dir} ({type(error).__name__}: {error}); the model "
                f"files there before this save {before} and {kept}: free space or fix permissions, then run "
                f"again with --resume_from_checkpoint latest"
            ) from error
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(self.output_dir / ".tokenizer", ignore_errors=True)

    def _write_training_curves(self, path: Path) -> None:
        from .plotting import plot_training_curves

        plot_training_curves(self.state.history, path)

    def _model_card(self, results: dict) -> str:
        from .model_card import render_model_card

        config = self.model.config
        data_args, args = self.data_args, self.args
        shipped = data_args.dataset_name is None and data_args.train_file is None
        dataset_name = data_args.dataset_name or ("bible-en-es-web-rv1909" if shipped else "local files")
        description = ("the verse-aligned English–Spanish Bible shipped with hf-scratch-transformer (World English "
                       "Bible ↔ Reina-Valera 1909, public domain)" if shipped else f"`{dataset_name}`")
        decodings = {"_greedy": "greedy", "": "greedy" if args.num_beams == 1 else f"beam {args.num_beams}"}
        rows = {label: {"bleu": results[f"predict_bleu{suffix}"], "chrf": results[f"predict_chrf{suffix}"]}
                for suffix, label in decodings.items() if f"predict_bleu{suffix}" in results}
        samples = [
            {"source": _table_cell(s), "reference": _table_cell(r), "prediction": _table_cell(p)}
            for s, r, p in list(zip(self.test_sources, self.test_references, getattr(self, "test_predictions", [])))[:5]
        ]
        report = self.filter_report["train"]
        device = self.accelerator.device
        hardware = (torch.cuda.get_device_name(device) if device.type == "cuda" else
                    f"{_cpu_name()}, {os.cpu_count()} logical cores") + f", {self.accelerator.num_processes} process(es)"
        return render_model_card(
            self.model_card_template, model_name=self.output_dir.name, source_lang=data_args.source_lang,
            target_lang=data_args.target_lang, dataset_name=dataset_name, results=rows,
            dataset_description=description, test_pairs=len(self.test_sources),
            train_pairs="streamed" if data_args.streaming else len(self.datasets["train"]),
            validation_pairs=len(self.eval_sources),
            filter_summary=("streamed: empty, over-long and implausible-length-ratio pairs dropped as read"
                            if report["input"] is None else
                            f"{report['empty']} empty, {report['too_long']} over-long and {report['bad_ratio']} "
                            f"implausible-length-ratio pairs dropped of {report['input']}"),
            architecture=(f"{config.encoder_layers}+{config.decoder_layers} layers, d_model {config.d_model}, "
                          f"{config.encoder_attention_heads} heads, FFN {config.encoder_ffn_dim}, "
                          f"{'pre' if config.normalize_before else 'post'}-norm "
                          + (f"(started from `{self.model_args.model_name_or_path}`)" if self.model_args.model_name_or_path
                             else f"(preset `{self.model_args.preset or 'small'}`)")),
            parameters=f"{self.model.num_parameters() / 1e6:.1f}M", vocab_size=config.vocab_size,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_epsilon=args.adam_epsilon,
            learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, lr_scheduler=args.lr_scheduler_type,
            label_smoothing=args.label_smoothing_factor, dropout=config.dropout, max_grad_norm=args.max_grad_norm,
            batching=(f"token-bucketed, at most {data_args.max_tokens} tokens per batch and process"
                      if data_args.max_tokens else f"{args.per_device_train_batch_size} sentences per batch and process")
            + f", gradient accumulation {args.gradient_accumulation_steps}",
            steps=self.state.global_step, epochs=round(results.get("epoch", self.state.epoch), 2),
            train_tokens=f"{self.state.train_tokens:,}", hardware=hardware,
            train_time=f"{results['train_runtime'] / 60:.1f} minutes",
            software=(f"hf-scratch-transformer, PyTorch {torch.__version__}, transformers {transformers.__version__}, "
                      f"Python {platform.python_version()}"),
            sample_translations=samples, decoding_for_samples=f"beam {args.num_beams}",
            repo_or_dir=args.hub_model_id or str(self.output_dir),
            example_source=self.test_sources[0] if self.test_sources else "Hello.",
            domain_note="the Bible in early-20th-century Spanish and modern English" if shipped else "the corpus above",
            max_source_length=data_args.max_source_length,
        )

    # -- hub -----------------------------------------------------------------------------------------------------

    def _hub_repo(self) -> str:
        return self.args.hub_model_id or self.output_dir.resolve().name

    def push_to_hub(self, folder: Path, path_in_repo: str | None = None, message: str = "Upload model") -> str:
        from huggingface_hub import HfApi

        repo_id = self._hub_repo()
        try:
            api = HfApi(token=self.args.hub_token)
            api.create_repo(repo_id, private=self.args.hub_private_repo, exist_ok=True)
            commit = api.upload_folder(
                repo_id=repo_id, folder_path=str(folder), path_in_repo=path_in_repo, commit_message=message,
                ignore_patterns=["checkpoint-*", "checkpoint-*/**", ".staging-*", ".tokenizer/**", "runs/**",
                                 LOCK_FILE, "abandoned-after-*/**"],
            )
        except Exception as error:  # any failure of the network or the hub ends in the same advice
            raise TrainingFault(
                f"could not push to the hub repository {repo_id!r}: {type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}. The model is saved and complete in "
                f"{self.output_dir}; upload it later with `hf upload {repo_id} {self.output_dir}`"
            ) from error
        return str(getattr(commit, "commit_url", commit))

    def _push_during_training(self, checkpoint: Path) -> None:
        """hub_strategy every_save / checkpoint: failures are logged, training goes on."""
        try:
            if self.args.hub_strategy == "checkpoint":
                self.push_to_hub(checkpoint, "last-checkpoint", f"Checkpoint at step {self.state.global_step}")
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.output_dir))
            try:
                self.accelerator.unwrap_model(self.model).save_pretrained(staging)
                self.tokenizer.save_pretrained(staging)
                self.push_to_hub(staging, None, f"Model at step {self.state.global_step}")
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        except TrainingFault as error:
            logger.warning(f"push during training failed, training goes on: {error}")


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


_DECLARED_TIES = _DeclaredTiesFilter()


def _quiet_libraries(verbose: bool) -> None:
    """One log line per phase instead of a `datasets` progress bar per map/filter, no transformers bar per save, no
    warning about the declared weight ties at every checkpoint; --verbose shows them again."""
    import datasets

    if verbose:
        datasets.enable_progress_bars()
        transformers.utils.logging.enable_progress_bar()
        logging.getLogger("accelerate.utils.other").removeFilter(_DECLARED_TIES)
    else:
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()  # "Writing model shards" at every save
        logging.getLogger("accelerate.utils.other").addFilter(_DECLARED_TIES)


def divergence_warning(row: dict, earlier_losses: list[float], vocab_size: int, warmup_steps: int) -> str | None:
    """A finite divergence seen at validation: after warm-up, a loss half a nat above that of guessing every token
    uniformly (ln V), or 50% and 1 nat above the best validation loss so far. None when the run looks healthy."""
    loss, uniform = row["eval_loss"], math.log(vocab_size)
    best = min(earlier_losses, default=math.inf)
    if loss > uniform + 0.5 and row["step"] > warmup_steps:
        why = f"above {uniform:.2f}, the loss of guessing uniformly among {vocab_size} tokens"
    elif loss > 1.5 * best and loss > best + 1:
        why = f"up from {best} at best"
    else:
        return None
    return (f"training is diverging: validation loss {loss} at step {row['step']} is {why} (BLEU {row['eval_bleu']}); "
            f"lower --learning_rate, raise --warmup_steps or use --normalize_before (pre-norm), then start again "
            f"or resume from a checkpoint written before the loss rose")


def _has_examples(split) -> bool:
    return next(iter(split), None) is not None if isinstance(split, IterableDataset) else len(split) > 0


def _table_cell(text: str, limit: int = 300) -> str:
    """Text safe inside a Markdown table cell."""
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _progress_bar(total: int, done: int, disable: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc="training", unit="step", disable=disable, dynamic_ncols=True)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run_training(model_args: ModelArguments, data_args: DataArguments, args: TrainingArguments,
                 model_card_template: str | Path | None = None) -> dict:
    """Train (--do_train), evaluate (--do_eval), predict (--do_predict), save (and push); with no --do_* flag all
    three. Returns the figures written to all_results.json (run_translation.py's key names)."""
    run = Run(model_args, data_args, args, model_card_template)
    try:
        return _run_training(run)
    finally:
        run.lock.release()


def _run_training(run: "Run") -> dict:
    model_args, data_args, args = run.model_args, run.data_args, run.args
    run.setup()
    phases = {}
    if args.do_train:
        started = time.time()
        run.train()
        if args.average_checkpoints > 1:
            run.average_last_checkpoints()
        runtime = time.time() - started
        steps = run.state.global_step
        losses = [(row["step"], row["train_loss"]) for row in run.state.history if "train_loss" in row]
        weighted = sum((step - previous) * loss for (previous, _), (step, loss) in zip([(0, 0)] + losses, losses))
        phases["train"] = {
            "train_runtime": round(runtime, 2),
            "train_samples": None if data_args.streaming else len(run.datasets["train"]),
            "train_steps_per_second": round(steps / max(runtime, 1e-9), 3),
            "train_loss": round(weighted / losses[-1][0], 4) if losses else None,
            "epoch": run._epoch_fraction(),
            "train_steps": steps,
            "train_tokens": run.state.train_tokens,
            "train_tokens_per_second": round(run.state.train_tokens / max(run.state.train_seconds, 1e-9), 1),
            "train_padding_fraction": None if data_args.streaming else round(
                padding_fraction(list(run.sampler), *sequence_lengths(run.datasets["train"])), 4),
            "filtered": run.filter_report,
        }
        if getattr(run, "averaged_checkpoints", None):
            phases["train"]["averaged_checkpoints"] = run.averaged_checkpoints
    if args.do_eval:
        started = time.time()
        validation = run.validate()
        if validation:
            runtime = time.time() - started
            phases["eval"] = {**{key: value for key, value in validation.items() if key != "step"},
                              "eval_samples": len(run.eval_sources), "eval_runtime": round(runtime, 2),
                              "eval_samples_per_second": round(len(run.eval_sources) / max(runtime, 1e-9), 3)}
            if args.do_train:
                phases["eval"]["epoch"] = phases["train"]["epoch"]
    if args.do_predict:
        phases["predict"] = run.test()
    results = {key: value for phase in phases.values() for key, value in phase.items()}
    if getattr(run, "divergence", None):
        results["divergence_warning"] = run.divergence
    results["total_runtime"] = round(time.time() - run.started, 1)
    if args.do_train:
        run.save_model(results, phases)
        run.accelerator.end_training()
    else:
        run.save_results(results, phases)
    if args.do_train and args.push_to_hub and run.is_main:
        results["hub_commit"] = run.push_to_hub(run.output_dir, None, "Training finished")
    return results


def main(argv: list[str] | None = None, model_card_template: str | Path | None = None) -> int:
    """Command-line entry: 0 on success, 2 for a usage error, 1 for a training fault, 130/143 on SIGINT/SIGTERM."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    transformers.logging.set_verbosity_warning()
    previous_sigterm = _raise_on_sigterm()
    try:
        model_args, data_args, args = parse_arguments(argv)
        results = run_training(model_args, data_args, args, model_card_template)
    except SystemExit:  # --help (argparse errors are UsageErrors, see parse_arguments)
        raise
    except UsageError as error:
        return _fail(f"error: {error}", 2, debug)
    except TrainingFault as error:
        return _fail(f"training stopped: {error}", 1, debug)
    except RunInterrupted as error:
        return _fail(f"interrupted: {error}", error.exit_code, debug)
    except KeyboardInterrupt:  # outside the training loop, whose handler saves a checkpoint first
        return _fail("interrupted outside the training loop: nothing was saved since the last checkpoint, if any",
                     130, debug)
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
    print(json.dumps({key: value for key, value in results.items() if key != "filtered"}, indent=1))
    return 0


def _raise_on_sigterm():
    """Outside the training loop (whose handler saves a checkpoint first) SIGTERM ends the run like Ctrl-C, with a
    message and exit code 143 rather than a silent kill. Returns the previous handler (None off the main thread)."""
    def interrupt(signum, frame):
        raise RunInterrupted("SIGTERM received outside the training loop: nothing was saved since the last "
                             "checkpoint, if any", signum)
    try:
        return signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        return None


def _fail(message: str, code: int, debug: bool) -> int:
    if debug:
        logger.exception(message)
    print(message, file=sys.stderr)
    return code
