"""train.py's flags and the checks made on them before any work.

Names follow transformers' `run_translation.py` and `Seq2SeqTrainingArguments` where they overlap; model size flags
are the config's own field names (`--d_model`, `--encoder_attention_heads`, `--decoder_ffn_dim`, ...), with
`--attention_heads` and `--ffn_dim` as shortcuts that set both sides. Every size flag left out is the preset's, or
the `--model_name_or_path` model's: the defaults live in the config (`ScratchTransformerConfig`, `PRESETS`).
Flags can also come from one JSON / YAML file anywhere among them: `train.py run.yaml --max_steps 5` (flags on the
command line win over the file's).

Parsing decides nothing: where a flag leaves a choice to the default recipe (the run length, the precision, a new
model's normalisation and dropout, the augmentation's rates), recipe.py makes it, from the parsed flags, which it
does not change.
"""

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from transformers import HfArgumentParser

from ..configuration_scratch_transformer import DEFAULT_PRESET, PRESETS, ScratchTransformerConfig
from ..data.loading import DataArguments
from .augmentation import AUGMENTATION_FLAGS
from .recipe import (
    BF16_CPU_STEP_BUDGET,
    BF16_TCMALLOC_CPU_STEP_BUDGET,
    DEFAULT_AUGMENTATION,
    DEFAULT_MAX_EPOCHS,
    DEFAULT_PATIENCE,
    DEFAULT_STEP_BUDGET,
    MAX_AUTO_EVAL_STEPS,
    MIN_AUTO_EVAL_STEPS,
)
from .stopping import BEST_MODEL_METRICS, best_model_metric
from ..errors import UsageError, check_range
from ..translation_core import DEFAULT_MAX_LEN_A, DEFAULT_MAX_LEN_B, DecodingOptions, InvalidOption

CONFIG_SUFFIXES = (".json", ".yaml", ".yml")
LR_SCHEDULERS = ("inverse_sqrt", "linear", "cosine", "constant_with_warmup")  # transformers.get_scheduler names
# Config fields a size flag sets (the architecture); the dropout rates may change when fine-tuning.
SIZE_FIELDS = ("d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
               "encoder_ffn_dim", "decoder_ffn_dim", "normalize_before", "max_position_embeddings")
DROPOUT_FIELDS = ("dropout", "attention_dropout", "activation_dropout")
SHORTCUTS = {"attention_heads": ("encoder_attention_heads", "decoder_attention_heads"),
             "ffn_dim": ("encoder_ffn_dim", "decoder_ffn_dim")}


def _config_field(help_text: str):
    """A flag named as a ScratchTransformerConfig field; None (not given) leaves the preset's or model's value."""
    return field(default=None, metadata={"help": help_text})


def _augmentation_flag(name: str, help_text: str):
    """A rate of the training-time augmentation (augmentation.Augmentation); its default is the recipe's."""
    default = getattr(DEFAULT_AUGMENTATION, name)
    return field(default=default, metadata={"help": f"{help_text} Default: {default:g}, the recipe's "
                                                    f"(docs/training.md); 0: off."})


@dataclass
class ModelArguments:
    """Model size: a preset, then config fields; or an existing model to fine-tune or continue training."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Start from this saved model directory or hub id, with its tokenizer (vocabulary kept), "
                          "instead of a new model; size flags must then agree with it."},
    )
    preset: str | None = field(
        default=None, metadata={"help": f"Model size preset: {', '.join(PRESETS)} (default: {DEFAULT_PRESET})."}
    )
    d_model: int | None = _config_field("Width of the residual stream (the preset's if not given).")
    encoder_layers: int | None = _config_field("Encoder layers.")
    decoder_layers: int | None = _config_field("Decoder layers.")
    encoder_attention_heads: int | None = _config_field("Heads of the encoder's attention.")
    decoder_attention_heads: int | None = _config_field("Heads of the decoder's self- and cross-attention.")
    attention_heads: int | None = _config_field(
        "Shortcut: --encoder_attention_heads and --decoder_attention_heads (each wins over it where given).")
    encoder_ffn_dim: int | None = _config_field("Feed-forward width of the encoder layers.")
    decoder_ffn_dim: int | None = _config_field("Feed-forward width of the decoder layers.")
    ffn_dim: int | None = _config_field(
        "Shortcut: --encoder_ffn_dim and --decoder_ffn_dim (each wins over it where given).")
    dropout: float | None = _config_field(
        "Residual and embedding dropout (P_drop); a new model's default is the recipe's (0), a loaded model keeps its "
        "own.")
    attention_dropout: float | None = _config_field("Dropout on attention weights; the config's, or the model's.")
    activation_dropout: float | None = _config_field(
        "Dropout after the feed-forward ReLU; the config's, or the model's.")
    normalize_before: bool | None = field(  # `--normalize_before` alone means true
        default=None, metadata={"help": "Pre-norm (true; a new model's default in the recipe) or the paper's post-norm (false).",
                                "nargs": "?", "const": True})
    max_position_embeddings: int | None = _config_field("Longest sequence the model accepts (the config's: 1024).")

    def __post_init__(self):
        for name in DROPOUT_FIELDS:
            check_range(name, getattr(self, name), 0, 1, high_ok=False)
        check_range("max_position_embeddings", self.max_position_embeddings, 2)

    def preset_name(self) -> str:
        return self.preset or DEFAULT_PRESET

    def dropout_overrides(self) -> dict:
        """The dropout rates given on the command line (a fine-tuned model keeps its own otherwise)."""
        return {name: getattr(self, name) for name in DROPOUT_FIELDS if getattr(self, name) is not None}

    def given_sizes(self) -> dict:
        """The size fields given on the command line, shortcuts resolved (a side given explicitly wins)."""
        sizes = {}
        for shortcut, sides in SHORTCUTS.items():
            if getattr(self, shortcut) is not None:
                sizes.update(dict.fromkeys(sides, getattr(self, shortcut)))
        sizes.update({name: getattr(self, name) for name in SIZE_FIELDS if getattr(self, name) is not None})
        return sizes

    def size_overrides(self) -> dict:
        """Config fields set by size flags on the command line (a preset given explicitly included): what a
        --model_name_or_path model must already have."""
        return {**(PRESETS[self.preset] if self.preset is not None else {}), **self.given_sizes()}

    def build_config(self, vocab_size: int, **defaults) -> ScratchTransformerConfig:
        """The preset's config (the config checks the name), then `defaults` (a new model's: the recipe's
        Recipe.new_model_config), then every field given; one line if invalid."""
        try:
            settings = {**defaults, **self.given_sizes(), **self.dropout_overrides()}
            return ScratchTransformerConfig.from_preset(self.preset_name(), vocab_size=vocab_size, **settings)
        except ValueError as error:
            raise UsageError(f"invalid model size: {error}") from error


@dataclass
class RunArguments:
    """How to train, evaluate and save; flag names follow transformers' Seq2SeqTrainingArguments where they overlap
    (the class is named apart from it: it is not a transformers TrainingArguments and behaves differently)."""

    output_dir: str = field(default="outputs/scratch-small-en-es", metadata={"help": "Where the model goes."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Reuse a non-empty output_dir."})
    num_train_epochs: float | None = field(
        default=None, metadata={"help": "Epochs over the training split (default: the run-length rule, see "
                                        "--max_steps)."})
    max_steps: int = field(
        default=-1, metadata={"help": f"If > 0: optimiser steps to run (overrides epochs). With neither: up to "
                                      f"{DEFAULT_STEP_BUDGET:,} steps ({BF16_CPU_STEP_BUDGET:,} in bf16 on a CPU "
                                      f"with AVX-512 BF16 or AMX, {BF16_TCMALLOC_CPU_STEP_BUDGET:,} there on "
                                      f"tcmalloc) and {DEFAULT_MAX_EPOCHS} epochs, with early stopping "
                                      f"(docs/training.md)."})
    max_train_minutes: float = field(
        default=0, metadata={"help": "Training time budget in minutes (summed over resumed runs; validations and "
                                     "checkpoints count): at the budget the run stops as at its last step "
                                     "(checkpoint, evaluation, test, save); 0: none. Without --max_steps and "
                                     "--num_train_epochs it is the run's length: as many steps as the minutes hold "
                                     "at this machine's speed, the linear or cosine schedule fitted to them."})
    early_stopping_patience: int | None = field(
        default=None, metadata={"help": f"Stop after N validations without a better --metric_for_best_model (0: "
                                        f"never; default: {DEFAULT_PATIENCE} when the run length comes from the "
                                        f"rule, else 0)."})
    metric_for_best_model: str = field(
        default="bleu", metadata={"help": "Validation metric that decides the best model and early stopping: bleu, "
                                          "chrf (higher is better) or loss (lower is better)."})
    load_best_model_at_end: bool | None = field(  # `--load_best_model_at_end` alone means true
        default=None, metadata={"help": "Save the best validated checkpoint's weights instead of the last step's "
                                        "(default: yes with early stopping).", "nargs": "?", "const": True})
    learning_rate: float = field(default=2e-3, metadata={"help": "Peak learning rate, reached after warm-up."})
    warmup_steps: int = field(default=400, metadata={"help": "Linear warm-up steps, then --lr_scheduler_type's decay."})
    # Linear decay to 0 at the run's last step: in the 3,600-step budget it reached validation BLEU 18.34 / 18.68
    # (seeds 42 / 7) where inverse-sqrt had 18.76 only at step 4,000 (benchmarks/results/recipe_ablation.md, stage 4).
    lr_scheduler_type: str = field(
        default="linear",
        metadata={"help": "Decay after warm-up: linear (default) or cosine, both to 0 at the last step; inverse_sqrt "
                          "(the paper's); constant_with_warmup."})
    adam_beta1: float = field(default=0.9, metadata={"help": "Adam β1 (paper: 0.9)."})
    adam_beta2: float = field(default=0.98, metadata={"help": "Adam β2 (paper: 0.98)."})
    adam_epsilon: float = field(default=1e-9, metadata={"help": "Adam ε (paper: 1e-9)."})
    weight_decay: float = field(default=0.0, metadata={"help": "Decoupled weight decay (AdamW) if > 0."})
    label_smoothing_factor: float = field(default=0.1, metadata={"help": "Label smoothing ε_ls (paper: 0.1)."})
    bpe_dropout: float = _augmentation_flag(
        "bpe_dropout", "BPE-dropout rate of the training batches (subword regularisation, resampled every epoch, "
                       "seeded); evaluation and the saved tokenizer never use it.")
    source_lowercase_rate: float = _augmentation_flag(
        "source_lowercase_rate", "Share of training source sentences lower-cased (drawn anew every epoch, seeded), so "
                                 "that the model translates lower-case input too.")
    source_paraphrase_rate: float = _augmentation_flag(
        "source_paraphrase_rate", "Share of training pairs whose source sentence is replaced by one of its "
                                  "paraphrases, where the corpus gives them (a `paraphrases` field; the shipped "
                                  "corpus: the King James Version of the English verses), drawn anew every epoch, "
                                  "seeded.")
    source_plain_quotes_rate: float = _augmentation_flag(
        "source_plain_quotes_rate", "Share of training source sentences with typographic quotes or apostrophes "
                                    "(‘ ’ “ ”) that get plain ones (' \"), as keyboards type them (drawn anew every "
                                    "epoch, seeded).")
    source_typo_rate: float = _augmentation_flag(
        "source_typo_rate", "Share of training source words (four letters or more) given one typo: two inner letters "
                            "swapped, one dropped or one doubled (drawn anew every epoch, seeded).")
    source_contraction_rate: float = _augmentation_flag(
        "source_contraction_rate", "Share of training source sentences (English) with contractions where they can "
                                   "have them: do not -> don't, it is -> it's, ... (drawn anew every epoch, seeded).")
    source_spaced_punctuation_rate: float = _augmentation_flag(
        "source_spaced_punctuation_rate", "Share of training source sentences with a space before each , . ; : ! ? "
                                          "that ends a word (drawn anew every epoch, seeded).")
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0: off)."})
    per_device_train_batch_size: int = field(default=64, metadata={"help": "Sentences per batch without --max_tokens."})
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "Sentences per evaluation batch."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Batches per optimiser step."})
    seed: int = field(default=42, metadata={"help": "Seed of initialisation, dropout and batch order."})
    logging_steps: int = field(default=50, metadata={"help": "Log loss, learning rate and tokens/s every N steps."})
    eval_steps: int | None = field(
        default=None, metadata={"help": "Validate every N steps (0: only at the end; default: every two epochs, "
                                        f"between {MIN_AUTO_EVAL_STEPS} and {MAX_AUTO_EVAL_STEPS} steps)."})
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
    ignore_data_changes: bool = field(
        default=False,
        metadata={"help": "Resume although the training data changed since the checkpoint was saved (its tokenizer "
                  "and position in the data are kept)."},
    )
    average_checkpoints: int = field(
        default=1, metadata={"help": "Final weights = average of the last K checkpoints (fairseq-style); 1: off."}
    )
    num_beams: int = field(default=4, metadata={"help": "Beam size of the test evaluation and the saved model."})
    eval_max_new_tokens: int = field(default=256, metadata={"help": "Longest translation during evaluation."})
    max_len_a: float = field(
        default=DEFAULT_MAX_LEN_A, metadata={"help": "Evaluation translations get at most max_len_a * source tokens + max_len_b new "
                                       "tokens (fairseq), within --eval_max_new_tokens; 0 and 0: no bound."})
    max_len_b: float = field(default=DEFAULT_MAX_LEN_B, metadata={"help": "See --max_len_a."})
    do_train: bool = field(default=False, metadata={"help": "Train (with no --do_* flag: train, eval and predict)."})
    do_eval: bool = field(default=False, metadata={"help": "Validation loss, BLEU and chrF at the end."})
    do_predict: bool = field(
        default=False, metadata={"help": "Translate the test split: generated_predictions.txt, test BLEU and chrF."})
    report_to: str = field(default="tensorboard", metadata={"help": "Accelerate tracker(s), comma-separated, or none."})
    bf16: bool | None = field(  # `--bf16` alone means true
        default=None, metadata={"help": "bf16 mixed precision (default: the recipe's, bf16 when training a new "
                                        "model on a CPU with AVX-512 BF16 or AMX, where it was measured to pay, "
                                        "unless --fp16; else off).", "nargs": "?", "const": True})
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
        default=0, metadata={"help": "Torch threads per process on CPU: 0 measures and adapts them to the load (up to the CPUs available to each local process); N pins N, and the run then repeats bit for bit."}
    )
    ddp_timeout: int = field(
        default=1800,
        metadata={"help": "Several processes: seconds a process waits for the others at a collective operation before "
                  "the run stops (a lost machine is noticed at once when its connection closes)."})
    debug: bool = field(default=False, metadata={"help": "Show full tracebacks of errors."})
    verbose: bool = field(
        default=False, metadata={"help": "Show the datasets progress bars and library logs that are hidden by default."})

    def __post_init__(self):
        """Every value checked on its own, before any work; a run with no --do_* flag does all three."""
        self.output_dir = str(Path(self.output_dir).expanduser())  # a YAML config's `~/runs/x` too
        if self.resume_from_checkpoint and self.resume_from_checkpoint != "latest":
            self.resume_from_checkpoint = str(Path(self.resume_from_checkpoint).expanduser())
        for rule in RUN_RANGES:
            check_range(rule[0], getattr(self, rule[0]), *rule[1:3], **rule[3] if len(rule) > 3 else {})
        if self.max_steps <= 0 and self.num_train_epochs is not None and not self.num_train_epochs > 0:
            raise UsageError(f"--num_train_epochs must be > 0 when --max_steps is not set, got "
                             f"{self.num_train_epochs}: give a positive number of epochs, or --max_steps N")
        try:  # the translation core owns the rules of the evaluation's decoding options
            DecodingOptions(num_beams=self.num_beams, max_len_a=self.max_len_a, max_len_b=self.max_len_b,
                            batch_size=self.per_device_eval_batch_size, max_new_tokens=self.eval_max_new_tokens)
        except InvalidOption as error:
            flag = {"batch_size": "per_device_eval_batch_size", "max_new_tokens": "eval_max_new_tokens"}.get(
                error.name, error.name)
            raise UsageError(f"--{flag} must be {error.requirement}, got {error.value!r}") from None
        _check_choices(self)
        if not (self.do_train or self.do_eval or self.do_predict):  # run_translation.py needs them; here: all three
            self.do_train = self.do_eval = self.do_predict = True



# ---------------------------------------------------------------------------------------------------- parsing


def flags_to_argv(flags: dict) -> list[str]:
    """train.py's flags for a mapping of flag names to values, as a config file's keys become flags: `--key value`,
    booleans as true/false; None leaves the flag out; dashes in a key are underscores (the flags' spelling)."""
    argv = []
    for key, value in flags.items():
        if value is not None:
            argv += [f"--{str(key).replace('-', '_')}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def parse_arguments(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, RunArguments]:
    """Command-line flags, and optionally one .json / .yaml file holding flags: `train.py run.yaml --max_steps 5`.

    The file's keys become flags placed before the command line's, wherever the file is named, so flags given on the
    command line override the file, and every value goes through the same conversion and checks as a flag (YAML's
    `1e-3`, read as a string, is a float; the string "no" is a false boolean; a wrong type is named).
    """
    parser = HfArgumentParser((ModelArguments, DataArguments, RunArguments))

    def one_line_error(message: str):  # argparse would print the (long) usage, then exit
        raise UsageError(f"{message} (see --help)")

    parser.error = one_line_error
    argv = list(sys.argv[1:] if argv is None else argv)
    files = [i for i, item in enumerate(argv) if item.lower().endswith(CONFIG_SUFFIXES) and not item.startswith("-")
             and not (i and argv[i - 1].startswith("-") and "=" not in argv[i - 1])]
    if len(files) > 1:
        raise UsageError(f"give one config file, not {len(files)} ({', '.join(argv[i] for i in files)})")
    if files:
        path = Path(argv[files[0]])
        file_flags = _config_file_flags(path, {action.dest for action in parser._actions})
        try:
            parser.parse_args_into_dataclasses(args=file_flags)
        except (UsageError, ValueError) as error:
            raise UsageError(f"config file {path}: {' '.join(str(error).split())}") from error
        argv = file_flags + argv[: files[0]] + argv[files[0] + 1:]
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
    kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
    try:
        values = json.loads(text) if kind == "JSON" else yaml.safe_load(text)
    except Exception as error:  # noqa: BLE001  (json and yaml raise their own kinds; deep nesting a RecursionError)
        reason = " ".join(str(error).split())[:300]
        raise UsageError(f"config file {path} is not valid {kind}: {reason}") from error
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise UsageError(f"config file {path} must hold a mapping of flag names to values (like "
                         f"`max_steps: 100`), not a {type(values).__name__}")
    for key, value in values.items():
        if str(key).replace("-", "_") not in known:
            raise UsageError(f"config file {path}: unknown key {key!r} (see --help for the flag names)")
        if isinstance(value, (dict, list)):
            raise UsageError(f"config file {path}: {key} must be a single value, not a {type(value).__name__} "
                             f"({json.dumps(value)[:80]})")
    return flags_to_argv(values)


# ------------------------------------------------------------------------------------------------------ checks

# RunArguments' numeric flags: (flag, lowest, highest[, {"low_ok": ..., "high_ok": ...}]); see errors.check_range.
RUN_RANGES = [
    ("learning_rate", 0, math.inf, {"low_ok": False}), ("warmup_steps", 0, math.inf),
    ("adam_beta1", 0, 1, {"high_ok": False}), ("adam_beta2", 0, 1, {"high_ok": False}),
    ("adam_epsilon", 0, math.inf, {"low_ok": False}), ("weight_decay", 0, math.inf),
    ("label_smoothing_factor", 0, 1, {"high_ok": False}),
    *((name, 0, 1, {"high_ok": False}) for name in AUGMENTATION_FLAGS),
    ("max_grad_norm", 0, math.inf), ("eval_steps", 0, math.inf), ("early_stopping_patience", 0, math.inf),
    ("max_train_minutes", 0, math.inf), ("save_steps", 0, math.inf), ("save_total_limit", 1, math.inf),
    ("cpu_threads", 0, math.inf), ("ddp_timeout", 1, math.inf), ("dataloader_num_workers", 0, math.inf),
    ("gradient_accumulation_steps", 1, math.inf), ("per_device_train_batch_size", 1, math.inf),
    ("logging_steps", 1, math.inf), ("average_checkpoints", 1, math.inf), ("seed", 0, 2**32 - 1),
]
HUB_STRATEGIES = ("end", "every_save", "checkpoint")


def _check_choices(args: RunArguments) -> None:
    """RunArguments' flags that name a choice, and the flags that only make sense together."""
    if args.hub_strategy not in HUB_STRATEGIES:
        raise UsageError(f"--hub_strategy must be one of {', '.join(HUB_STRATEGIES)}, not {args.hub_strategy!r}")
    if args.bf16 and args.fp16:
        raise UsageError("--bf16 and --fp16 are exclusive: pick one")
    if args.lr_scheduler_type not in LR_SCHEDULERS:
        raise UsageError(f"--lr_scheduler_type must be one of {', '.join(LR_SCHEDULERS)}, not {args.lr_scheduler_type!r}")
    _check_trackers(args.report_to)
    if best_model_metric(args) not in BEST_MODEL_METRICS:
        raise UsageError(f"--metric_for_best_model must be one of {', '.join(BEST_MODEL_METRICS)}, not "
                         f"{args.metric_for_best_model!r}")
    if args.early_stopping_patience and args.eval_steps == 0:
        raise UsageError("--early_stopping_patience needs validation during training: give --eval_steps N > 0")
    if args.load_best_model_at_end and args.average_checkpoints > 1:
        raise UsageError("--load_best_model_at_end and --average_checkpoints both choose the final weights: pick one")


def _check_trackers(report_to: str) -> None:
    """--report_to names Accelerate trackers whose package is installed (or none)."""
    import accelerate.utils

    known = sorted(tracker.value for tracker in accelerate.utils.LoggerType)
    for name in (part.strip() for part in report_to.split(",")):
        if name in ("", "none"):
            continue
        if name not in known:
            raise UsageError(f"--report_to {name!r} is not an Accelerate tracker: use none or one of {', '.join(known)}")
        available = getattr(accelerate.utils, f"is_{name}_available", lambda: True)
        if name != "all" and not available():
            raise UsageError(f"--report_to {name}: the {name} package is not installed: pip install {name}, or "
                             f"--report_to none")


def check_values(model_args: ModelArguments, data_args: DataArguments, args: RunArguments) -> None:
    """What no single dataclass can check: the model sizes together (the config validates them), the phases and the
    model to evaluate, streaming with epochs, and lengths against the model's positions. Touches no file."""
    config = model_args.build_config(vocab_size=data_args.tokenizer_vocab_size)  # contradicting sizes fail here
    if args.resume_from_checkpoint and not args.do_train:
        raise UsageError("--resume_from_checkpoint continues training: add --do_train (or no --do_* flag)")
    if not args.do_train and not model_args.model_name_or_path:
        raise UsageError("--do_eval/--do_predict without --do_train evaluate an existing model: give it with "
                         "--model_name_or_path DIR")
    if data_args.streaming and args.max_steps <= 0 and args.num_train_epochs is not None:
        raise UsageError("--streaming reads a corpus of unknown length, so epochs cannot be counted: give --max_steps N "
                         "instead of --num_train_epochs")
    longest = max(data_args.max_source_length, data_args.max_target_length)
    # A --model_name_or_path model's own limit is checked when it is loaded (check_model_flags).
    limit = model_args.max_position_embeddings or (None if model_args.model_name_or_path
                                                   else config.max_position_embeddings)
    if limit is not None and longest + 1 > limit:
        raise UsageError(f"--max_source_length/--max_target_length ({longest}) must be below "
                         f"--max_position_embeddings ({limit})")


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
