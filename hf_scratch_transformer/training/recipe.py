"""train.py's default recipe and its rules, resolved once per run from the flags and the machine: `Recipe`.

Where a flag leaves a choice open, the recipe makes it:

- the **run length** (`run_length`, `RunLength`) when neither --max_steps nor --num_train_epochs is given: a step
  budget (counted in 1,024-token steps), or with --max_train_minutes the steps those minutes hold on this machine;
- the **batch** when --max_tokens is not given: 1,024 or 2,048 tokens by the training pairs' mean length, once the
  corpus is known (`batch_tokens_for`, LONG_PAIR_TOKENS: `Recipe.for_corpus`);
- the **precision** when neither --bf16 nor --fp16 is given: bf16 mixed precision where the CPU has bf16 matrix units,
  for a new model at least BF16_CPU_MIN_WIDTH wide, with BF16_CPU_STEP_BUDGET steps (BF16_TCMALLOC_CPU_STEP_BUDGET on
  tcmalloc, where steps are faster);
- a **new model's** normalisation and dropout (NEW_MODEL_SETTINGS: pre-norm; dropout by the epochs the run
  plans over its corpus, DROPOUT_BY_EPOCHS, once the corpus is known: `Recipe.for_run`);
- the **training-time noise** (DEFAULT_AUGMENTATION: the defaults of the augmentation flags);
- **protected spans** (--mask_protected_spans, on by default): the spans both sides of a training pair share are
  masked by sentinel tokens (data/preprocessing.py), which a new tokenizer gets.

`resolve_recipe` reads the flags and never changes them: the resolved precision is the recipe's, and resuming
(checkpointing.resume_settings), train_results.json and the model card read it there. The recipe is printed once at
the start of a run (`Recipe.describe`), recorded in train_results.json ("recipe") and stated in the model card.

Why the config class and the recipe differ, openly: `ScratchTransformerConfig`'s defaults stay the paper's (post-norm,
dropout 0.1). The config describes the model of "Attention Is All You Need" and is what anyone building or loading
one without train.py gets; the recipe is what was measured to train best in train.py's budget on this package's
corpora. So the recipe changes exactly NEW_MODEL_SETTINGS on a new model and says which and why (one line in the
log, train_results.json and the card). Each default value has one home: the config's in the config class, the
recipe's here; a flag whose default is the recipe's either reads it from here (the augmentation rates) or is None,
meaning "the recipe decides" (--bf16, --normalize_before, --dropout).
"""

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..configuration_scratch_transformer import PRESETS, ScratchTransformerConfig
from ..cpu_threads import cpu_bf16_units
from ..memory_allocator import loaded_allocator
from .augmentation import Augmentation
from .stopping import BEST_MODEL_METRICS, best_model_metric

# ------------------------------------------------------------------------------------------------ the run length

# The run-length rule (docs/training.md), when neither --max_steps nor --num_train_epochs is given: at most
# DEFAULT_STEP_BUDGET optimiser steps (the default run's 30 minutes on 2 CPU cores: the small preset at 1,024-token
# batches) and DEFAULT_MAX_EPOCHS epochs, with early stopping after DEFAULT_PATIENCE validations without a better
# model; validation every two epochs, within [MIN_AUTO_EVAL_STEPS, MAX_AUTO_EVAL_STEPS] steps.
DEFAULT_STEP_BUDGET = 3600
DEFAULT_MAX_EPOCHS = 100
DEFAULT_PATIENCE = 3
MIN_AUTO_EVAL_STEPS, MAX_AUTO_EVAL_STEPS = 200, 2000
# With --max_train_minutes (and neither --max_steps nor --num_train_epochs) the rule's run length is the minutes
# instead of the step budget: as many steps as they hold at the machine's measured speed, the learning-rate schedule
# fitted to them as the run goes (stopping.TimeFittedSchedule), at most DEFAULT_MAX_EPOCHS epochs, or this many steps
# over a streamed corpus, whose epochs are unknown.
STREAMED_MOST_STEPS = 10**9
# The batch size the step budgets were sized for: the default --max_tokens. Under --max_train_minutes the steps are
# known only as the run goes, so a new model's dropout is chosen for the tokens of the rule's budget instead, the
# budget's steps × STEP_BUDGET_BATCH_TOKENS / --max_tokens: a CPU trains as many tokens per second with larger batches
# or more (2,048 tokens: 1.02-1.30x 1,024's in train.py's loop, benchmarks/results/batch_tokens_throughput.md), and
# planning the budget's steps at 2,048 tokens planned 10.9 epochs, dropout 0.1, for a run that trained 4.8.
STEP_BUDGET_BATCH_TOKENS = 1024


def budget_steps(budget: int, batch_tokens: int | None) -> int:
    """The steps of batches of `batch_tokens` tokens (None: of sentences) that train the tokens of `budget` steps of
    STEP_BUDGET_BATCH_TOKENS: the run-length rule's budget is counted in tokens."""
    if not batch_tokens:
        return budget
    return max(1, round(budget * STEP_BUDGET_BATCH_TOKENS / batch_tokens))


# ------------------------------------------------------------------------------------------------ the batch

# Without --max_tokens, a batch holds DEFAULT_BATCH_TOKENS tokens, or LONG_PAIRS_BATCH_TOKENS where the training pairs
# average more than LONG_PAIR_TOKENS tokens on their longer side, with the run-length rule's steps fitted to the same
# tokens (budget_steps). Tokens a pair as a run counts them (the log's figure). At equal tokens, 2,048-token batches
# were ahead where pairs are long: Russian game text (25.7 tokens a pair at BPE 8,000) +1.2 to +1.6 validation BLEU in
# three runs (CPU and GPU), the same text at BPE 16,000 (23.0) +1.4 (one seed), the shipped corpus (34.0) +0.1 and +1.0
# in two seeds; about level on Greek game text (+0.3 at BPE 4,000; 19.8 tokens at 8,000), and behind on software
# messages (13.5): -2.1 and -1.4 in two seeds (docs/training.md, "The batch by the pairs' length";
# benchmarks/results/recipe_sweep.md). A batch of short pairs holds many of them already; one of long pairs holds few,
# so its gradient is noisier. The bound lies between what was measured (19.8 and 23.0), not at a measured edge;
# 4,096-token batches were level with 2,048 on the Russian text (GPU, two seeds) and were not measured on a CPU.
DEFAULT_BATCH_TOKENS = STEP_BUDGET_BATCH_TOKENS
LONG_PAIRS_BATCH_TOKENS = 2048
LONG_PAIR_TOKENS = 21
BATCH_WHY = {
    DEFAULT_BATCH_TOKENS: "on software messages (13.5 tokens a pair) 2,048-token batches were 1.4 and 2.1 validation "
                          "BLEU behind 1,024 at equal tokens",
    LONG_PAIRS_BATCH_TOKENS: "on Russian game text (25.7 tokens a pair) and the shipped corpus (34.0) 2,048-token "
                             "batches were up to 1.6 validation BLEU ahead of 1,024 at equal tokens",
}


def batch_tokens_for(mean_pair_tokens: float | None) -> int:
    """The batch rule's --max_tokens for training pairs of `mean_pair_tokens` tokens on their longer side on average
    (None: a streamed corpus, whose lengths are unknown)."""
    if mean_pair_tokens is not None and mean_pair_tokens > LONG_PAIR_TOKENS:
        return LONG_PAIRS_BATCH_TOKENS
    return DEFAULT_BATCH_TOKENS


def batch_rule() -> str:
    """The batch rule in words."""
    return (f"{DEFAULT_BATCH_TOKENS:,} tokens a batch, {LONG_PAIRS_BATCH_TOKENS:,} where the training pairs average "
            f"more than {LONG_PAIR_TOKENS} tokens on their longer side")

# ------------------------------------------------------------------------------------------------ the precision

# A run that gives neither --bf16 nor --fp16 trains in bf16 mixed precision on a CPU with bf16 matrix units, where
# that was measured to pay: AVX-512 BF16 (an AMD EPYC: 1.20x the training tokens/s in whole runs, validation BLEU
# within a seed's noise of fp32 at the same steps) and AMX (an Intel Xeon: 1.15x per step at 2 threads idle, 1.24x at
# 1 thread, 1.25x at 1 thread with the other core busy); in fp32 elsewhere, where bf16 is emulated. bf16 on such a
# CPU gives the run-length rule more steps in about the same time: 4,320 steps reached validation BLEU 22.42 / 21.84
# (seeds 42 / 7) where fp32's 3,600 had 21.31 / 21.38 on the EPYC, and 22.75 where fp32's 3,600 had 20.48 on the Xeon
# (benchmarks/results/recipe_ablation.md, stage 4). 5,040 since train.py's loss (training/loss.py) made its steps
# 1.17x faster on glibc's malloc: about the minutes 4,320 took before, and on the shipped corpus validation BLEU
# 25.02 / 25.19 where 4,320 reached 23.72 / 24.16 (test BLEU 28.43 / 28.60 greedy, 30.99 / 31.01 beam 4, against
# 26.79 / 27.33 and 29.10 / 29.68; seeds 42 / 7, an AMD EPYC: docs/training.md, "The step budget with the faster loss").
BF16_CPU_STEP_BUDGET = 5040
# ... for a new model at least this wide: the `tiny` preset (width 64) trained 0.76x as fast in bf16 on the EPYC and
# 0.62x on the Xeon (casts outweigh its small matrix products); `small` (256) 1.27x / 1.15x and `base` (512) 1.75x /
# 1.48x at 2 threads (benchmarks/results/cpu_precision*.md). A model given to --model_name_or_path keeps fp32 unless
# --bf16.
BF16_CPU_MIN_WIDTH = 256
# The bf16 budget where the process runs on tcmalloc (memory_allocator.py; train.py preloads it where the machine has
# it): 5,400, 1.25x the 4,320 glibc's malloc then had, as tcmalloc's steps were 1.20-1.28x faster than glibc's
# malloc's (benchmarks/results/memory_allocator.md), so the same minutes buy more steps. On the Xeon, 5,400 steps on
# tcmalloc took 22.6 / 24.3 min (seeds 42 / 7), where 4,320 on glibc's malloc took 24.7 / 27.5, and reached
# validation BLEU 24.25 / 24.41 where those had 23.61 / 23.44 (test BLEU beam 4: 30.52 / 30.50 against 29.08 /
# 29.67); a fresh clone took 25.2 min at a slower moment of the same VM (docs/training.md, "The step budget on
# tcmalloc"). With train.py's loss (training/loss.py) tcmalloc's steps are 1.07-1.12x glibc's (an AMD EPYC), about
# 5,400 over glibc's 5,040 (1.07x): the budget was kept.
BF16_TCMALLOC_CPU_STEP_BUDGET = 5400

# ------------------------------------------------------------------------------------------------ a new model

# The config fields the recipe sets on a new model (unless their flag is given), and why. Pre-norm: with the default
# learning rate of 2e-3 it reached validation BLEU 18.76 at step 4,000 where post-norm at 1e-3 had 14.55, and
# post-norm at 2e-3 fell far behind (benchmarks/results/recipe_ablation.md, stage 3). Dropout: chosen by
# DROPOUT_BY_EPOCHS once the corpus is known (Recipe.for_run); until then (and for a streamed corpus, whose epochs are
# unknown) none. A model fine-tuned with --model_name_or_path keeps its own.
NEW_MODEL_SETTINGS = {"normalize_before": True, "dropout": 0.0}
NEW_MODEL_WHY = {  # what, the paper's, the flag for the paper's, why
    "normalize_before": ("pre-norm", "post-norm", "--normalize_before false",
                         "pre-norm at the default learning rate reached validation BLEU 18.76 where post-norm had "
                         "14.55 at 1e-3 and fell far behind at 2e-3"),
}

# A new model's dropout by the epochs its run plans over the training split (Recipe.for_run): the first row whose
# bound the run stays within, (most epochs, dropout, why). A few epochs over a large corpus are under-training, where
# dropout only slows learning; many epochs over a small corpus over-fit, where dropout pays, but within the step
# budget a heavy dropout does not catch up (docs/training.md, "Dropout by the epochs a run plans";
# benchmarks/results/recipe_sweep.md). The bound of 10 epochs lies between what was measured (3.9 and 7.2 epochs:
# none; 46: 0.1), not at a measured edge.
DROPOUT_BY_EPOCHS = (
    (10.0, 0.0, "in the shipped corpus's 3.9 epochs no dropout reached validation BLEU 21.31 / 21.38 (seeds 42 / 7) "
                "where 0.1 had 18.34 / 18.68"),
    (math.inf, 0.1, "on 3,961 pairs of game text en->el (46 epochs) 0.1 reached validation BLEU 12.48 where none had "
                    "11.76 and 0.3 only 8.34 (it learns too slowly for the step budget)"),
)


def dropout_for(epochs: float | None) -> tuple[float, str]:
    """(dropout, why) of DROPOUT_BY_EPOCHS for a run planning `epochs` (None: a streamed corpus, a large one)."""
    for bound, dropout, why in DROPOUT_BY_EPOCHS:
        if epochs is None or epochs <= bound:
            return dropout, why
    raise AssertionError("DROPOUT_BY_EPOCHS ends with an unbounded row")


def dropout_rule() -> str:
    """DROPOUT_BY_EPOCHS in words."""
    bounds = [f"{dropout:g} up to {bound:g} epochs" if bound != math.inf else f"{dropout:g} beyond"
              for bound, dropout, _ in DROPOUT_BY_EPOCHS]
    return "dropout by the epochs the run plans over its corpus: " + ", ".join(bounds)


# ------------------------------------------------------------------------------------------------ the noise

# The augmentation flags' defaults. Paraphrases and plain quotes at 0.5 kept validation BLEU where it was on the
# shipped corpus and lifted the style-shifted validation source by 1.4 to 2.0 BLEU, and the test verses written in the
# King James Version by 5 to 7. Lower-casing 0.05 alone cost nothing on the plain source in two seeds on each precision
# branch and lost 0.3 to 1.4 BLEU less on a style-shifted one; 0.1 with typos at 0.02 lost less there too but cost
# about a BLEU point on the plain source. Typos at 0.01 cost a third less on misspelt input but 0.68 validation BLEU on
# clean input: not the default. BPE-dropout (0.05, 0.1) is off. (benchmarks/results/recipe_ablation.md,
# docs/training.md)
DEFAULT_AUGMENTATION = Augmentation(source_lowercase_rate=0.05, source_paraphrase_rate=0.5,
                                    source_plain_quotes_rate=0.5)


# ------------------------------------------------------------------------------------------------ the run length


@dataclass
class RunLength:
    """How long a run trains, how often it validates and when it stops early, once the epoch's length is known."""

    total_steps: int
    eval_steps: int
    patience: int  # validations without a better model before stopping; 0: never
    load_best: bool
    steps_per_epoch: int | None  # optimiser steps; None when streamed
    source: str  # "max_steps", "epochs", "rule" or "minutes" (the rule with --max_train_minutes)
    metric: str
    greater_is_better: bool
    step_budget: int = DEFAULT_STEP_BUDGET  # the run-length rule's most steps (Recipe.step_budget)
    minutes: float = 0  # --max_train_minutes; under source "minutes", total_steps is only the most steps
    batch_tokens: int | None = None  # --max_tokens (None: batches of a fixed number of sentences)

    @property
    def minutes_steps(self) -> int:
        """What a time budget ("minutes") plans, as its steps are known only as the run goes: the tokens of the
        run-length rule's step budget (what the minutes are meant to replace), in steps of this run's batches."""
        return budget_steps(self.step_budget, self.batch_tokens)

    @property
    def planned_steps(self) -> int:
        """The steps the run plans: its total, or under a time budget minutes_steps within the total."""
        return min(self.minutes_steps, self.total_steps) if self.source == "minutes" else self.total_steps

    @property
    def epochs(self) -> float | None:
        """Planned epochs over the training split (planned_steps'; what the dropout rule reads); None when
        streamed."""
        return self.planned_steps / self.steps_per_epoch if self.steps_per_epoch else None

    def describe(self) -> str:
        """One log line: steps, why that many, validation and stopping."""
        validation = f"validation every {self.eval_steps:,} steps" if self.eval_steps else "validation at the end"
        stopping = (f"early stopping after {self.patience} validations without a better validation {self.metric}"
                    if self.patience else "no early stopping")
        kept = "the best validated model is saved" if self.load_best else "the last step's model is saved"
        if self.source == "minutes":
            most = (f" (at most {self.total_steps:,} steps, {DEFAULT_MAX_EPOCHS} epochs of "
                    f"{self.steps_per_epoch:,} steps)" if self.steps_per_epoch else "")
            return (f"training for the {self.minutes:g} minutes of --max_train_minutes{most}, in place of the "
                    f"run-length rule's {self.step_budget:,} steps: as many steps as the minutes hold at this "
                    f"machine's speed, the learning-rate schedule fitted to them as the run goes (a new model's "
                    f"dropout is chosen for {self._minutes_plan()}); {validation}; {stopping}; {kept}")
        epochs = f" ({self.epochs:.3g} epochs of {self.steps_per_epoch:,} steps)" if self.steps_per_epoch else ""
        why = {"max_steps": "--max_steps", "epochs": "--num_train_epochs",
               "rule": f"the run-length rule: at most {self._budget_in_words()} and {DEFAULT_MAX_EPOCHS} epochs, "
                       f"since neither --max_steps nor --num_train_epochs was given"}[self.source]
        return f"training for {self.total_steps:,} steps{epochs} ({why}); {validation}; {stopping}; {kept}"


    def _minutes_plan(self) -> str:
        if self.minutes_steps == self.step_budget:
            return "the rule's steps"
        return (f"the rule's {self.step_budget:,} steps of {STEP_BUDGET_BATCH_TOKENS:,} tokens: "
                f"{self.minutes_steps:,} of this run's {self.batch_tokens:,}")

    def _budget_in_words(self) -> str:
        if self.minutes_steps == self.step_budget:
            return f"{self.step_budget:,} steps"
        return f"{self.minutes_steps:,} steps ({self._minutes_plan()})"


def run_length(args, steps_per_epoch: int | None, budget: int = DEFAULT_STEP_BUDGET,
               batch_tokens: int | None = None) -> RunLength:
    """The run length of `args` (a RunArguments) for an epoch of `steps_per_epoch` optimiser steps (None: a streamed
    corpus), with at most `budget` steps under the run-length rule (Recipe.step_budget), for batches of at most
    `batch_tokens` tokens (--max_tokens; None: of a fixed number of sentences)."""
    if args.max_steps > 0:
        total, source = args.max_steps, "max_steps"
    elif args.num_train_epochs is not None and steps_per_epoch:
        total, source = math.ceil(args.num_train_epochs * steps_per_epoch), "epochs"
    elif args.max_train_minutes > 0:  # the rule's length is the minutes: total_steps is only a bound
        total, source = (DEFAULT_MAX_EPOCHS * steps_per_epoch if steps_per_epoch else STREAMED_MOST_STEPS), "minutes"
    else:
        total, source = budget_steps(budget, batch_tokens), "rule"
        if steps_per_epoch:
            total = min(total, DEFAULT_MAX_EPOCHS * steps_per_epoch)
    eval_steps = args.eval_steps
    if eval_steps is None:
        eval_steps = (min(MAX_AUTO_EVAL_STEPS, max(MIN_AUTO_EVAL_STEPS, 2 * steps_per_epoch)) if steps_per_epoch
                      else MAX_AUTO_EVAL_STEPS)
    patience = args.early_stopping_patience
    if patience is None:
        patience = DEFAULT_PATIENCE if source in ("rule", "minutes") and eval_steps else 0
    load_best = args.load_best_model_at_end if args.load_best_model_at_end is not None else patience > 0
    metric = best_model_metric(args)
    return RunLength(total, eval_steps, patience, load_best, steps_per_epoch, source, metric,
                     BEST_MODEL_METRICS[metric], budget, args.max_train_minutes, batch_tokens)


# ------------------------------------------------------------------------------------------------ the recipe


@dataclass(frozen=True)
class Recipe:
    """The recipe of one run, resolved from its flags and machine (`resolve_recipe`); read it, never the flags, for
    the precision, the run-length rule's budget, a new model's settings and the augmentation."""

    precision: str  # "bf16", "fp16" or "fp32" (mixed precision but for fp32)
    precision_note: str  # which precision, and why
    step_budget: int  # the run-length rule's most steps
    new_model_settings: dict = field(default_factory=dict)  # config fields set on a new model ({} for a loaded one)
    augmentation: Augmentation = field(default_factory=Augmentation)
    loaded_model: bool = False  # --model_name_or_path: a new model's settings do not apply
    mask_protected_spans: bool = True  # --mask_protected_spans: shared spans masked by sentinel tokens
    planned_epochs: float | None = None  # set by for_run once the corpus is known (None: not yet, or streamed)
    resolved_for_run: bool = False
    batch_tokens: int | None = None  # --max_tokens or the batch rule's (None: batches of a fixed number of sentences)
    batch_by_rule: bool = False  # no --max_tokens: the batch rule chooses batch_tokens once the corpus is known
    mean_pair_tokens: float | None = None  # what the batch rule read (None: streamed, or not yet read)
    batch_chosen: bool = False  # for_corpus has applied the batch rule

    def run_length(self, args, steps_per_epoch: int | None) -> RunLength:
        return run_length(args, steps_per_epoch, self.step_budget, self.batch_tokens)

    def new_model_config(self, model_args, vocab_size: int) -> ScratchTransformerConfig:
        """A new model's config: the preset's, the recipe's new-model settings, then every size and dropout flag."""
        return model_args.build_config(vocab_size, **self.new_model_settings)

    def for_corpus(self, mean_pair_tokens: float | None, longest_allowed: int) -> "Recipe":
        """The recipe once the training pairs are tokenised: without --max_tokens, the batch rule's batch for pairs
        of `mean_pair_tokens` tokens on their longer side on average (None: streamed), at least `longest_allowed`
        (the longest pair --max_source_length / --max_target_length let through)."""
        if not self.batch_by_rule:
            return self
        return replace(self, batch_tokens=max(batch_tokens_for(mean_pair_tokens), longest_allowed),
                       mean_pair_tokens=mean_pair_tokens, batch_chosen=True)

    def batch_line(self) -> str:
        """The batch in words: --max_tokens, or the rule before the corpus is known, then what it chose and why."""
        if not self.batch_by_rule:
            given = (f"{self.batch_tokens:,} tokens (--max_tokens)" if self.batch_tokens
                     else "a fixed number of sentences (--max_tokens 0)")
            return f"{given}; the run-length rule's steps train the tokens of its budget's steps of 1,024 tokens"
        if not self.batch_chosen:
            return f"{batch_rule()}, chosen once the corpus is known (--max_tokens to choose)"
        pairs = (f"the training pairs average {self.mean_pair_tokens:.1f} tokens on their longer side"
                 if self.mean_pair_tokens is not None else "a streamed corpus (its lengths are unknown)")
        why = BATCH_WHY[batch_tokens_for(self.mean_pair_tokens)]
        return (f"{self.batch_tokens:,} tokens a batch, since {pairs} ({batch_rule()}; {why}: docs/training.md); "
                f"--max_tokens to choose")

    def for_run(self, length: RunLength, resumed_dropout: float | None = None) -> "Recipe":
        """The recipe once the corpus is known: a new model without --dropout gets DROPOUT_BY_EPOCHS's dropout for
        the epochs `length` plans, or, resuming, the dropout its checkpoint was trained with (`resumed_dropout`)."""
        settings = dict(self.new_model_settings)
        if "dropout" in settings:
            settings["dropout"] = resumed_dropout if resumed_dropout is not None else dropout_for(length.epochs)[0]
        return replace(self, new_model_settings=settings, planned_epochs=length.epochs, resolved_for_run=True)

    def lines(self) -> list[str]:
        """The recipe in words, one line per rule."""
        return [f"precision: {self.precision_note}",
                f"run length: without --max_steps or --num_train_epochs, at most the tokens of {self.step_budget:,} "
                f"steps of {STEP_BUDGET_BATCH_TOKENS:,} tokens and {DEFAULT_MAX_EPOCHS} epochs (with "
                f"--max_train_minutes: the steps those minutes hold at this machine's speed, the learning-rate "
                f"schedule fitted to them), with early stopping after {DEFAULT_PATIENCE} validations without a better "
                f"model",
                f"batch: {self.batch_line()}",
                f"new model: {self._new_model_line()}",
                f"training-time noise: {self.augmentation.describe()}",
                f"protected spans: {self._protected_spans_line()}"]

    def describe(self) -> str:
        """What the log prints once at the start of a run."""
        return "the recipe (train.py's defaults, resolved for this run):\n" + "\n".join(
            f"  {line}" for line in self.lines())

    def as_dict(self) -> dict:
        """train_results.json's "recipe" entry."""
        return {"precision": self.precision, "step_budget": self.step_budget, "batch_tokens": self.batch_tokens,
                "mean_pair_tokens": self.mean_pair_tokens,
                "new_model_settings": dict(self.new_model_settings), "augmentation": self.augmentation.settings(),
                "mask_protected_spans": self.mask_protected_spans, "planned_epochs": self.planned_epochs,
                "description": self.lines()}

    def _protected_spans_line(self) -> str:
        if not self.mask_protected_spans:
            return ("left as text (--mask_protected_spans false): the tokenizer gets no sentinel tokens, and "
                    "translation protects spans only when asked (--protect on)")
        where = ("the tokenizer of --model_name_or_path, if it has them (else left as text)" if self.loaded_model
                 else "the new tokenizer, 32 tokens more than --tokenizer_vocab_size")
        return (f"the placeholders, markup, URLs and e-mail addresses both sides of a training pair share are masked "
                f"by the same sentinel token (｟0｠ ... ｟31｠, in {where}), so the model learns to place them and "
                f"translation protects them by default; --mask_protected_spans false leaves them as text")

    def _new_model_line(self) -> str:
        if self.loaded_model:
            return "none: the model given to --model_name_or_path keeps its own settings"
        if not self.new_model_settings:
            return "as its flags give it (the recipe changes nothing of the config class's defaults)"
        parts = []
        if "normalize_before" in self.new_model_settings:
            what, paper, flag, why = NEW_MODEL_WHY["normalize_before"]
            parts.append(f"{what}, where the config class keeps the paper's {paper} ({why}: "
                         f"benchmarks/results/recipe_ablation.md; {flag} for the paper's)")
        if "dropout" in self.new_model_settings:
            parts.append(self.dropout_line())
        return "; ".join(parts)

    def dropout_line(self) -> str:
        """A new model's dropout in words: the rule before the corpus is known, then what it chose and why."""
        if not self.resolved_for_run:
            return f"{dropout_rule()}, chosen once the corpus is known (--dropout to choose)"
        dropout, why = dropout_for(self.planned_epochs)
        if self.new_model_settings["dropout"] != dropout:
            return f"dropout {self.new_model_settings['dropout']:g}, as the checkpoint this run resumes was trained"
        plans = (f"this run plans {self.planned_epochs:.3g} epochs" if self.planned_epochs is not None
                 else "a streamed corpus (its epochs are unknown, taken as few)")
        chosen = "no dropout" if dropout == 0 else f"dropout {dropout:g}"
        return (f"{chosen}, since {plans} ({dropout_rule()}; {why}: docs/training.md), where the config class keeps "
                f"the paper's 0.1; --dropout to choose")


def bf16_pays_on(device: torch.device) -> bool:
    """Whether bf16 mixed precision was measured to make a training step cheaper at equal BLEU on `device`: a CPU
    with bf16 matrix units, AVX-512 BF16 or AMX (see BF16_CPU_STEP_BUDGET)."""
    return device.type == "cpu" and cpu_bf16_units() is not None


def runs_on_tcmalloc() -> bool:
    """Whether this process's malloc is tcmalloc (read from the libraries mapped into it)."""
    return "tcmalloc" in Path(loaded_allocator() or "").name


def step_budget(precision: str, device: torch.device) -> int:
    """The run-length rule's most steps for a run in `precision` on `device`: more where bf16 pays, and more again
    on tcmalloc, so that the default run takes about the same minutes (BF16_CPU_STEP_BUDGET)."""
    if precision == "bf16" and bf16_pays_on(device):
        return BF16_TCMALLOC_CPU_STEP_BUDGET if runs_on_tcmalloc() else BF16_CPU_STEP_BUDGET
    return DEFAULT_STEP_BUDGET


def resolve_recipe(model_args, data_args, args, device: torch.device,
                   launcher_precision: str | None = None) -> Recipe:
    """The recipe of a run with these flags (ModelArguments, DataArguments, RunArguments) on `device`; the flags are
    not changed. `launcher_precision` is what `accelerate launch --mixed_precision` asked for ("bf16", "fp16" or
    None: distributed.launcher_precision), which stands for --bf16 / --fp16 when neither is given."""
    loaded = model_args.model_name_or_path is not None
    width = None if loaded else model_args.d_model or PRESETS[model_args.preset_name()]["d_model"]
    precision, note = _precision(args, device, width, launcher_precision)
    budget = step_budget(precision, device)
    settings = {} if loaded else {name: value for name, value in NEW_MODEL_SETTINGS.items()
                                  if getattr(model_args, name) is None}
    by_rule = data_args.max_tokens is None
    return Recipe(precision, note, budget, settings, Augmentation.from_flags(args), loaded,
                  data_args.mask_protected_spans, batch_by_rule=by_rule,
                  batch_tokens=DEFAULT_BATCH_TOKENS if by_rule else data_args.max_tokens or None)


def _emulated(precision: str, device: torch.device) -> str:
    """The warning a bf16 run asked for on a CPU without bf16 matrix units gets in its precision note ("" else)."""
    if precision != "bf16" or device.type != "cpu" or bf16_pays_on(device):
        return ""
    return (", emulated on this CPU, which has no bf16 matrix units (AVX-512 BF16 or AMX): there a bf16 matrix "
            "product ran some 100x slower than an fp32 one (0.9 against 80-110 GFLOP/s, an AMD EPYC with AVX2 "
            "only), so this run trains far slower than in fp32 (--bf16 false)")


def _precision(args, device: torch.device, new_model_width: int | None,
               launcher: str | None = None) -> tuple[str, str]:
    """(precision, why): --bf16 / --fp16 when given, else the launcher's --mixed_precision (`launcher`; a
    contradiction was refused by distributed.check_launch); else bf16 for training a new model at least
    BF16_CPU_MIN_WIDTH wide where bf16_pays_on(device), fp32 otherwise (evaluation decodes in fp32 anyway)."""
    if args.bf16 or args.fp16:
        name = "bf16" if args.bf16 else "fp16"
        return name, f"{name} mixed precision (--{name})" + _emulated(name, device)
    if args.bf16 is False:
        return "fp32", "fp32 (--bf16 false)"
    if launcher is not None:
        return launcher, (f"{launcher} mixed precision (accelerate launch --mixed_precision {launcher})"
                          + _emulated(launcher, device))
    units = cpu_bf16_units() if device.type == "cpu" else None
    if not args.do_train:
        return "fp32", "fp32 (nothing to train)"
    if new_model_width is None:
        return "fp32", "fp32: a model given to --model_name_or_path keeps fp32 unless --bf16"
    if device.type != "cpu":
        return "fp32", "fp32 on this device unless --bf16 or --fp16 (the recipe measured bf16 on CPUs)"
    if units is None:
        return "fp32", "fp32: this CPU has no bf16 matrix units (AVX-512 BF16 or AMX), where bf16 would be emulated"
    if new_model_width < BF16_CPU_MIN_WIDTH:
        return "fp32", (f"fp32: a model {new_model_width} wide trains slower in bf16 (casts outweigh its small "
                        f"products; bf16 from {BF16_CPU_MIN_WIDTH} wide); --bf16 for it anyway")
    note = (f"bf16 mixed precision: this CPU has {units}, where bf16 trains 1.15-1.2x faster at the same BLEU (so the "
            f"run-length rule allows the tokens of {BF16_CPU_STEP_BUDGET:,} steps of {STEP_BUDGET_BATCH_TOKENS:,} "
            f"tokens, of {BF16_TCMALLOC_CPU_STEP_BUDGET:,} on tcmalloc, where steps are faster still); --bf16 false "
            f"trains in fp32")
    return "bf16", note
