"""recipe.py: the default recipe, resolved once from the flags and the machine (which it never changes): the
precision by CPU, the run-length rule's budget, a new model's settings (and what the recipe says about them), the
augmentation's defaults; printed at the start, recorded in train_results.json and stated in the model card."""

import json
import logging
from dataclasses import fields

import pytest
import torch
from helpers import REPO, fails_with, run_tiny, tiny_run_flags, write_jsonl

from hf_scratch_transformer import ScratchTransformerConfig, cpu_threads, memory_allocator
from hf_scratch_transformer.data.loading import DataArguments
from hf_scratch_transformer.training.arguments import RunArguments, parse_arguments
from hf_scratch_transformer.training.augmentation import Augmentation
from hf_scratch_transformer.training.recipe import (
    BF16_CPU_STEP_BUDGET,
    BF16_TCMALLOC_CPU_STEP_BUDGET,
    DEFAULT_AUGMENTATION,
    DEFAULT_STEP_BUDGET,
    LONG_PAIR_TOKENS,
    dropout_for,
    resolve_recipe,
    run_length,
)

AVX512_BF16, NO_BF16_UNITS = {"avx512f", "avx512_bf16"}, {"avx512f"}
AMX = {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def cpu_flags(monkeypatch):
    """Fakes the CPU's feature flags (/proc/cpuinfo) as the precision rule sees them."""
    def fake(flags):
        monkeypatch.setattr(cpu_threads, "cpu_model_and_flags", lambda: ("a test CPU", set(flags)))
    return fake


TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.16"
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


@pytest.fixture(autouse=True)
def process_malloc(monkeypatch, tmp_path_factory):
    """The libraries mapped into this process as the recipe reads them (/proc/self/maps): glibc's malloc alone,
    unless a test maps another (a path) or none."""
    maps = tmp_path_factory.mktemp("proc") / "maps"

    def fake(library: str | None):
        lines = ["7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6"]
        if library:
            lines.append(f"7f0000002000-7f0000003000 r-xp 00000000 08:01 2 {library}")
        maps.write_text("\n".join(lines) + "\n")
    fake(None)
    monkeypatch.setattr("hf_scratch_transformer.training.recipe.loaded_allocator",
                        lambda: memory_allocator.loaded_allocator(maps))
    return fake


def recipe_of(argv: list[str], device: torch.device = CPU):
    """(recipe, model_args, args) of train.py's flags `argv` on `device`."""
    model_args, data_args, args = parse_arguments(argv)
    return resolve_recipe(model_args, data_args, args, device), model_args, args


# ------------------------------------------------------------------------------------------------ the precision


@pytest.mark.parametrize("flags, device, given, precision, budget", [
    (AVX512_BF16, CPU, [], "bf16", BF16_CPU_STEP_BUDGET),  # measured to pay: bf16, more steps
    (AMX, CPU, [], "bf16", BF16_CPU_STEP_BUDGET),  # measured to pay there too
    (NO_BF16_UNITS, CPU, [], "fp32", DEFAULT_STEP_BUDGET),
    (AVX512_BF16, GPU, [], "fp32", DEFAULT_STEP_BUDGET),  # a GPU's precision comes from its flags
    (AVX512_BF16, CPU, ["--bf16", "false"], "fp32", DEFAULT_STEP_BUDGET),
    (AVX512_BF16, CPU, ["--fp16"], "fp16", DEFAULT_STEP_BUDGET),
    (AVX512_BF16, CPU, ["--bf16"], "bf16", BF16_CPU_STEP_BUDGET),
    (NO_BF16_UNITS, CPU, ["--bf16", "true"], "bf16", DEFAULT_STEP_BUDGET),  # asked for, but no faster: no more steps
    (AVX512_BF16, CPU, ["--do_eval", "--do_predict"], "fp32", DEFAULT_STEP_BUDGET),  # no training: nothing to gain
], ids=["avx512_bf16", "amx", "no_units", "gpu", "bf16_false", "fp16", "bf16_given", "bf16_without_units",
        "evaluation_only"])
def test_bf16_is_the_default_only_where_it_was_measured_to_pay(cpu_flags, flags, device, given, precision, budget):
    cpu_flags(flags)
    recipe, _, args = recipe_of(given, device)  # the small preset, where it was measured
    assert recipe.precision == precision and recipe.step_budget == budget
    assert args.bf16 is (None if "--bf16" not in given else given[-1] != "false")  # the flags stay as given
    chosen = "bf16 mixed precision: this CPU has" in recipe.describe()
    assert chosen == (precision == "bf16" and not given)  # the rule's reason said when it chose bf16
    warned = "emulated on this CPU, which has no bf16 matrix units" in recipe.describe()
    assert warned == (precision == "bf16" and device == CPU and "avx512_bf16" not in flags)  # bf16 asked for there
    length = recipe.run_length(args, steps_per_epoch=1108)
    assert length.total_steps == budget and f"at most {budget:,} steps" in length.describe()
    assert run_length(RunArguments(max_steps=8), 1108, budget).total_steps == 8  # --max_steps wins


@pytest.mark.parametrize("given, precision", [(["--preset", "tiny"], "fp32"), ([], "bf16"),
                                              (["--preset", "base"], "bf16"), (["--d_model", "128"], "fp32"),
                                              (["--model_name_or_path", "some/model"], "fp32")],
                         ids=["tiny", "small", "base", "narrow_small", "loaded_model"])
def test_the_default_bf16_needs_a_new_model_wide_enough(cpu_flags, given, precision):
    """The tiny preset trained slower in bf16 (casts outweigh its small products); a loaded model keeps fp32."""
    cpu_flags(AVX512_BF16)
    recipe, _, args = recipe_of(given)
    assert recipe.precision == precision and args.bf16 is None


@pytest.mark.parametrize("flags, malloc, budget", [
    (AMX, TCMALLOC, BF16_TCMALLOC_CPU_STEP_BUDGET),  # faster steps on tcmalloc: more of them in the same minutes
    (AVX512_BF16, TCMALLOC, BF16_TCMALLOC_CPU_STEP_BUDGET),
    (AMX, JEMALLOC, BF16_CPU_STEP_BUDGET),  # measured no faster than glibc's
    (AMX, None, BF16_CPU_STEP_BUDGET),
    (NO_BF16_UNITS, TCMALLOC, DEFAULT_STEP_BUDGET),  # measured in bf16 only: fp32 keeps its budget
], ids=["amx_tcmalloc", "avx512_bf16_tcmalloc", "jemalloc", "glibc", "fp32_tcmalloc"])
def test_the_step_budget_follows_the_malloc_the_process_runs_on(cpu_flags, process_malloc, flags, malloc, budget):
    cpu_flags(flags)
    process_malloc(malloc)
    recipe, _, args = recipe_of([])
    assert recipe.step_budget == budget
    assert recipe.run_length(args, steps_per_epoch=1108).total_steps == budget
    assert f"at most the tokens of {budget:,} steps of 1,024 tokens" in recipe.describe()
    assert run_length(RunArguments(max_steps=8), 1108, recipe.step_budget).total_steps == 8  # --max_steps wins


def test_a_run_of_the_rule_is_not_resumed_on_another_malloc(cpu_flags, process_malloc, tmp_path, capsys):
    """Under the run-length rule the budget sets the learning-rate schedule: a run started on glibc's malloc (5,040
    bf16 steps) is not continued on tcmalloc (5,400), where it would follow another schedule; with --max_steps the
    malloc does not matter."""
    cpu_flags(AMX)
    rule_run = dict(bf16=None, d_model=256, max_steps=None, max_tokens=128, max_train_minutes=0.002, eval_steps=0,
                    save_steps=0, max_eval_samples=2, max_predict_samples=2, num_beams=1, eval_max_new_tokens=2)
    results = run_tiny(tmp_path, **rule_run)
    assert results["recipe"]["step_budget"] == BF16_CPU_STEP_BUDGET
    process_malloc(TCMALLOC)
    message = fails_with(tiny_run_flags(tmp_path, **rule_run, resume_from_checkpoint="latest"), capsys)
    assert "was trained with other settings (the run-length rule's steps" in message
    assert f"{BF16_CPU_STEP_BUDGET!r} -> {BF16_TCMALLOC_CPU_STEP_BUDGET!r}" in message
    step = results["train_steps"]
    resumed = run_tiny(tmp_path, **{**rule_run, "max_steps": step + 1, "max_train_minutes": 0},
                       resume_from_checkpoint="latest")
    assert resumed["train_steps"] == step + 1


@pytest.mark.parametrize("flags, steps, precision, units", [
    (AVX512_BF16, BF16_CPU_STEP_BUDGET, "bf16 mixed precision", "AVX-512 BF16"),
    (AMX, BF16_CPU_STEP_BUDGET, "bf16 mixed precision", "AMX"),
    (NO_BF16_UNITS, DEFAULT_STEP_BUDGET, "fp32", None)], ids=["avx512_bf16", "amx", "no_units"])
def test_a_run_without_precision_flags_follows_the_cpu(cpu_flags, flags, steps, precision, units, tmp_path, caplog):
    """A real run with neither --bf16 nor --max_steps: its precision and its run-length rule's budget (stopped at
    once by --max_train_minutes, which takes the budget's place and says so; many short batches so that 100 epochs
    are more than the budget)."""
    cpu_flags(flags)
    with caplog.at_level(logging.INFO, logger="hf_scratch_transformer"):
        results = run_tiny(tmp_path, bf16=None, d_model=256, max_steps=None, max_tokens=128, max_train_minutes=0.002,
                           eval_steps=0, save_steps=0, max_eval_samples=2, max_predict_samples=2, num_beams=1,
                           eval_max_new_tokens=2)  # the small preset's width: the tiny preset stays fp32
    logged = " ".join(record.getMessage() for record in caplog.records)
    assert f"in place of the run-length rule's {steps:,} steps" in logged and f"at most the tokens of {steps:,} steps of 1,024 tokens" in logged
    assert ("bf16 mixed precision: this CPU has" in logged) == (units is not None)
    assert units is None or f"this CPU has {units}, where bf16 trains" in logged
    assert f"; {precision}; wall time" in (tmp_path / "README.md").read_text()
    assert results["train_precision"] == precision.split()[0]  # all_results.json records it too
    assert results["recipe"]["precision"] == precision.split()[0] and results["recipe"]["step_budget"] == steps


def test_a_mixed_precision_run_validates_and_tests_its_weights_as_saved(tmp_path):
    """bf16 trains under autocast; validation (mid-run too) and the test scores decode in fp32, as the saved model
    translates for its users, and training goes on in bf16 after a validation. Layer outputs by training mode."""
    dtypes = {True: set(), False: set()}

    def record(module, inputs, output):
        if isinstance(module, torch.nn.Linear):
            dtypes[module.training].add(output.dtype)

    hook = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        results = run_tiny(tmp_path, bf16=True, max_steps=8, eval_steps=4, save_steps=0)
    finally:
        hook.remove()
    assert results["train_precision"] == "bf16" and results["train_steps"] == 8
    assert dtypes[True] == {torch.bfloat16}  # every training step, before and after the step-4 validation
    assert dtypes[False] == {torch.float32}  # validation and test


def test_one_process_trains_in_one_precision_then_another(tmp_path):
    """Accelerate keeps one precision per process; train.py's main called again in the same process (a notebook)
    with another precision gets it (Accelerate stays in fp32, bf16 autocast is the loop's)."""
    quick = dict(max_steps=2, save_steps=0, eval_steps=0, do_train=True)
    precisions = [run_tiny(tmp_path / name, bf16=bf16, **quick)["train_precision"]
                  for name, bf16 in (("first", False), ("second", True), ("third", False))]
    assert precisions == ["fp32", "bf16", "fp32"]


# ------------------------------------------------------------------------------------------------ a new model


def test_a_new_model_is_pre_norm_without_dropout_unless_asked_and_the_recipe_says_so(tmp_path):
    recipe, model_args, args = recipe_of(tiny_run_flags(tmp_path))
    config = recipe.new_model_config(model_args, vocab_size=100)
    assert config.normalize_before is True and args.learning_rate == 2e-3
    assert (config.dropout, config.attention_dropout, config.activation_dropout) == (0.0, 0.0, 0.0)
    paper = ScratchTransformerConfig.from_preset("tiny", vocab_size=100)
    assert (paper.normalize_before, paper.dropout) == (False, 0.1)  # the config class keeps the paper's
    line = next(line for line in recipe.lines() if line.startswith("new model: "))
    assert line.startswith("new model: pre-norm, where the config class keeps the paper's post-norm (") and \
        "18.76" in line and "dropout by the epochs the run plans over its corpus: 0 up to 10 epochs, 0.1 beyond" in line
    # not size flags: a post-norm model with dropout given to --model_name_or_path is not contradicted
    assert "normalize_before" not in model_args.size_overrides() and model_args.dropout_overrides() == {}
    recipe, model_args, _ = recipe_of(tiny_run_flags(tmp_path, normalize_before=False, dropout=0.1,
                                                     attention_dropout=0.05))
    config = recipe.new_model_config(model_args, vocab_size=100)
    assert (config.normalize_before, config.dropout, config.attention_dropout) == (False, 0.1, 0.05)
    assert recipe.new_model_settings == {} and "changes nothing" in recipe.describe()
    recipe, _, _ = recipe_of(tiny_run_flags(tmp_path, model_name_or_path="some/model"))
    assert recipe.new_model_settings == {} and "keeps its own settings" in recipe.describe()


@pytest.mark.parametrize("steps, epochs, dropout", [(39, 3.9, 0.0), (100, 10, 0.0), (101, 10.1, 0.1), (460, 46, 0.1),
                                                   (2000, 200, 0.1)])
def test_a_new_model_gets_the_dropout_of_the_epochs_its_run_plans(tmp_path, steps, epochs, dropout):
    recipe, model_args, args = recipe_of(tiny_run_flags(tmp_path, max_steps=steps))
    resolved = recipe.for_run(recipe.run_length(args, steps_per_epoch=10))
    assert resolved.planned_epochs == pytest.approx(epochs)
    assert resolved.new_model_config(model_args, vocab_size=100).dropout == dropout == dropout_for(epochs)[0]
    line = next(line for line in resolved.lines() if line.startswith("new model: "))
    chosen = "no dropout" if dropout == 0 else f"dropout {dropout:g}"
    assert f"; {chosen}, since this run plans {epochs:.3g} epochs (" in line
    assert resolved.as_dict()["new_model_settings"]["dropout"] == dropout


@pytest.mark.parametrize("max_tokens", [512, 1024, 2048, 4096])
def test_under_minutes_the_dropout_is_chosen_for_the_tokens_of_the_rules_budget(tmp_path, max_tokens):
    """--max_train_minutes: the steps are known only as the run goes, and a CPU trains as many tokens per second
    with larger batches or more, so the minutes plan the rule's budget of 1,024-token steps at any --max_tokens: a corpus
    of a sixth of that budget plans 6 epochs (no dropout) with 512- or 2,048-token batches as with 1,024, where the
    budget's steps at 2,048 tokens would be 12 epochs (dropout 0.1). --max_steps keeps its steps."""
    recipe, model_args, args = recipe_of(tiny_run_flags(tmp_path, max_steps=None, max_train_minutes=20,
                                                         max_tokens=max_tokens))
    steps_per_epoch = recipe.step_budget * 1024 // 6 // max_tokens  # the same corpus in batches of max_tokens
    length = recipe.run_length(args, steps_per_epoch)
    resolved = recipe.for_run(length)
    assert resolved.planned_epochs == pytest.approx(6, rel=0.01)
    assert resolved.new_model_config(model_args, vocab_size=100).dropout == 0.0
    if max_tokens != 1024:
        budget = f"{recipe.step_budget:,} steps of 1,024 tokens: {length.planned_steps:,} of this run's {max_tokens:,}"
        assert budget in length.describe()
    recipe, model_args, args = recipe_of(tiny_run_flags(tmp_path, max_steps=recipe.step_budget, max_tokens=max_tokens))
    stepped = recipe.for_run(recipe.run_length(args, steps_per_epoch))
    assert stepped.planned_epochs == pytest.approx(6 * max_tokens / 1024, rel=0.01)
    assert stepped.new_model_settings["dropout"] == dropout_for(6 * max_tokens / 1024)[0]


def test_under_minutes_sentence_batches_plan_the_rules_steps(tmp_path):
    recipe, _, args = recipe_of(tiny_run_flags(tmp_path, max_steps=None, max_train_minutes=20, max_tokens=0))
    length = recipe.run_length(args, steps_per_epoch=100)
    assert length.planned_steps == recipe.step_budget and "dropout is chosen for the rule's steps" in length.describe()


@pytest.mark.parametrize("flags", [{"dropout": 0.0}, {"dropout": 0.2}, {"model_name_or_path": "some/model"}])
def test_the_users_dropout_or_a_loaded_models_wins_over_the_dropout_rule(tmp_path, flags):
    recipe, model_args, args = recipe_of(tiny_run_flags(tmp_path, max_steps=2000, **flags))
    resolved = recipe.for_run(recipe.run_length(args, steps_per_epoch=10))
    assert "dropout" not in resolved.new_model_settings
    if "dropout" in flags:
        assert resolved.new_model_config(model_args, vocab_size=100).dropout == flags["dropout"]


def test_a_streamed_corpus_or_a_resumed_run_keeps_the_dropout_it_has(tmp_path):
    recipe, _, args = recipe_of(tiny_run_flags(tmp_path))
    streamed = recipe.for_run(recipe.run_length(args, steps_per_epoch=None))
    assert streamed.new_model_settings["dropout"] == 0.0 and "a streamed corpus" in streamed.dropout_line()
    recipe, _, args = recipe_of(tiny_run_flags(tmp_path, max_steps=2000))  # 200 epochs: 0.1 for a new run
    resumed = recipe.for_run(recipe.run_length(args, steps_per_epoch=10), resumed_dropout=0.0)
    assert resumed.new_model_settings["dropout"] == 0.0
    assert "as the checkpoint this run resumes was trained" in resumed.dropout_line()


def test_a_training_run_prints_records_and_states_its_recipe(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hf_scratch_transformer"):
        results = run_tiny(tmp_path / "out", max_train_samples=40, max_steps=60, save_steps=0, eval_steps=0,
                           do_predict=False, source_typo_rate=0.01)
    messages = [record.getMessage() for record in caplog.records]
    printed = [message for message in messages if message.startswith("the recipe (")]
    assert len(printed) == 1  # once, at the start
    # 60 steps over 40 pairs are many epochs: the recipe gives the new model dropout and says why
    [chosen] = [message for message in messages if message.startswith("the recipe for this corpus: ")]
    assert chosen.startswith("the recipe for this corpus: dropout 0.1, since this run plans 20 epochs (")
    recorded = json.loads((tmp_path / "out" / "train_results.json").read_text())["recipe"]
    assert recorded == results["recipe"]
    assert recorded["precision"] == "fp32" and recorded["new_model_settings"] == {"normalize_before": True,
                                                                                  "dropout": 0.1}
    assert recorded["planned_epochs"] == 20
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dropout"] == 0.1
    assert recorded["augmentation"] == {**DEFAULT_AUGMENTATION.settings(), "source_typo_rate": 0.01}
    # printed before the corpus is known: the dropout rule; recorded after: the dropout it chose
    assert all(f"  {line}" in printed[0] for line in recorded["description"] if not line.startswith("new model: "))
    assert "dropout by the epochs the run plans over its corpus" in printed[0]
    [new_model] = [line for line in recorded["description"] if line.startswith("new model: ")]
    assert new_model.endswith(chosen.removeprefix("the recipe for this corpus: "))
    card = " ".join((tmp_path / "out" / "README.md").read_text().split())
    assert "The recipe (train.py's defaults, as resolved for this run): precision: fp32 (--bf16 false); " in card
    assert "typos in 1% of the source words" in card and "where the config class keeps the paper's" in card


def test_the_augmentation_flags_default_to_the_recipes_rates():
    args = RunArguments()
    assert Augmentation.from_flags(args) == DEFAULT_AUGMENTATION
    assert DEFAULT_AUGMENTATION.source_paraphrase_rate == 0.5 and DEFAULT_AUGMENTATION.bpe_dropout == 0.0


def test_the_recipe_says_whether_protected_spans_are_masked(tmp_path):
    """On by default (the new tokenizer gets the sentinels), off with --mask_protected_spans false, and for a model
    given to --model_name_or_path only if its tokenizer has them; recorded in train_results.json's recipe."""
    lines = {}
    for name, flags in {"default": {}, "off": {"mask_protected_spans": False},
                        "loaded": {"model_name_or_path": "some/model"}}.items():
        recipe, _, _ = recipe_of(tiny_run_flags(tmp_path, **flags))
        [lines[name]] = [line for line in recipe.lines() if line.startswith("protected spans: ")]
        assert recipe.as_dict()["mask_protected_spans"] is (name != "off")
    assert "masked by the same sentinel token (｟0｠ ... ｟31｠, in the new tokenizer, 32 tokens more" in lines["default"]
    assert lines["off"].startswith("protected spans: left as text (--mask_protected_spans false)")
    assert "in the tokenizer of --model_name_or_path, if it has them (else left as text)" in lines["loaded"]


def test_readme_and_the_training_guide_name_the_default_vocabulary():
    """README's recipe and docs/training.md's tokenizer paragraph state train.py's default BPE size: a changed
    default fails here until both say it."""
    size = DataArguments.tokenizer_vocab_size
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    guide = " ".join((REPO / "docs" / "training.md").read_text(encoding="utf-8").split())
    assert f"joint BPE of {size:,};" in readme
    assert f"(`--tokenizer_vocab_size`, default {size};" in guide


def test_readme_and_the_training_guide_state_the_step_budgets():
    """The run-length rule's budgets as README (its recipe and "How long it trains") and docs/training.md's run-length
    paragraph state them: a changed budget fails here until both say it."""
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    guide = " ".join((REPO / "docs" / "training.md").read_text(encoding="utf-8").split())
    default, bf16, tcmalloc = (f"{budget:,}" for budget in (DEFAULT_STEP_BUDGET, BF16_CPU_STEP_BUDGET,
                                                             BF16_TCMALLOC_CPU_STEP_BUDGET))
    assert f"the tokens of {bf16} steps of 1,024 tokens, of {tcmalloc} where train.py runs on tcmalloc" in readme
    assert f"at most the tokens of {default} optimiser steps of 1,024 tokens" in readme
    assert f"({bf16} where it trains in bf16 on a CPU with AVX-512 BF16 or AMX" in readme
    assert f"{tcmalloc} there on tcmalloc" in readme
    assert f"at most the tokens of **{default} steps**" in guide
    assert f"**{bf16}** in bf16 on a CPU with AVX-512 BF16 or AMX, `BF16_CPU_STEP_BUDGET`" in guide
    assert f"**{tcmalloc}** there when the process runs on tcmalloc, `BF16_TCMALLOC_CPU_STEP_BUDGET`" in guide


# ------------------------------------------------------------------------------------------------ the batch


@pytest.mark.parametrize("mean, batch", [(13.5, 1024), (19.8, 1024), (LONG_PAIR_TOKENS, 1024),
                                         (LONG_PAIR_TOKENS + 0.1, 2048), (23.0, 2048), (25.7, 2048), (34.0, 2048),
                                         (None, 1024)],
                         ids=["software", "greek_games", "at_the_bound", "above_it", "russian_games_bpe16k", "russian_games",
                              "bible", "streamed"])
def test_without_max_tokens_the_batch_follows_the_pairs_length_and_the_budget_its_tokens(tmp_path, mean, batch):
    """Short pairs: 1,024-token batches; long ones: 2,048, with the run-length rule's steps halved so that the run
    trains the tokens of its budget (the same minutes, or fewer: larger batches train more tokens a second)."""
    recipe, _, args = recipe_of(tiny_run_flags(tmp_path, max_tokens=None, max_steps=None))
    assert recipe.batch_by_rule and "chosen once the corpus is known" in recipe.batch_line()
    chosen = recipe.for_corpus(mean, longest_allowed=96)
    assert chosen.batch_tokens == batch
    length = chosen.run_length(args, steps_per_epoch=10**6)
    assert length.total_steps == recipe.step_budget * 1024 // batch
    line = chosen.batch_line()
    assert line.startswith(f"{batch:,} tokens a batch, since ") and "--max_tokens to choose" in line
    assert (f"average {mean:.1f} tokens" in line) if mean is not None else "a streamed corpus" in line
    assert chosen.as_dict()["batch_tokens"] == batch


@pytest.mark.parametrize("max_tokens, batch, steps_factor", [(4096, 4096, 0.25), (1024, 1024, 1), (0, None, 1)])
def test_a_given_max_tokens_wins_and_the_rule_trains_the_tokens_of_its_budget(tmp_path, max_tokens, batch,
                                                                               steps_factor):
    recipe, _, args = recipe_of(tiny_run_flags(tmp_path, max_tokens=max_tokens, max_steps=None))
    chosen = recipe.for_corpus(34.0, longest_allowed=96)
    assert chosen.batch_tokens == batch and not chosen.batch_by_rule
    assert chosen.run_length(args, steps_per_epoch=10**6).total_steps == recipe.step_budget * steps_factor


def test_the_batch_rule_never_gives_less_than_the_longest_pair_allowed(tmp_path):
    recipe, _, _ = recipe_of(tiny_run_flags(tmp_path, max_tokens=None, max_source_length=1500,
                                            max_target_length=1500, max_position_embeddings=1600))
    assert recipe.for_corpus(10.0, longest_allowed=1500).batch_tokens == 1500


def test_a_run_without_max_tokens_batches_long_pairs_by_2048_tokens_and_says_why(tmp_path, caplog):
    """The rule's batch is the one the run trains with: an epoch of the same pairs has the steps of
    --max_tokens 2048, not 1,024's, and the log, train_results.json and the model card say so."""
    long_pairs = [{"translation": {"en": " ".join(f"word{i} number{j}" for j in range(12)),
                                   "es": " ".join(f"palabra{i} numero{j}" for j in range(12))}} for i in range(300)]
    corpus = write_jsonl(tmp_path / "long.jsonl", long_pairs)
    common = dict(train_file=str(corpus), validation_file=str(corpus), max_train_samples=None, max_steps=4,
                  save_steps=0, eval_steps=0, do_eval=False, do_predict=False)

    def planned_epochs(name, **flags):
        with caplog.at_level(logging.INFO, logger="hf_scratch_transformer"):
            results = run_tiny(tmp_path / name, **common, **flags)
        return results["recipe"]["planned_epochs"], results["recipe"]

    caplog.clear()
    by_rule, recipe = planned_epochs("rule", max_tokens=None)
    assert recipe["batch_tokens"] == 2048 and recipe["mean_pair_tokens"] > LONG_PAIR_TOKENS
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("the recipe for this corpus: 2,048")]
    assert "tokens on their longer side" in line
    assert by_rule == planned_epochs("given_2048", max_tokens=2048)[0]
    assert by_rule > 1.5 * planned_epochs("given_1024", max_tokens=1024)[0]  # 1,024: twice the steps an epoch
    card = " ".join((tmp_path / "rule" / "README.md").read_text().split())
    assert "at most 2048 tokens per batch" in card and "batch: 2,048 tokens a batch, since" in card


def test_readme_the_training_guide_and_the_flags_help_state_the_batch_rule():
    """The batch rule's sizes and bound, as README's recipe, docs/training.md's batches paragraph and --max_tokens's
    help state them: a changed rule fails here until all three say it."""
    from hf_scratch_transformer.training.recipe import DEFAULT_BATCH_TOKENS, LONG_PAIRS_BATCH_TOKENS

    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    guide = " ".join((REPO / "docs" / "training.md").read_text(encoding="utf-8").split())
    small, large, bound = f"{DEFAULT_BATCH_TOKENS:,}", f"{LONG_PAIRS_BATCH_TOKENS:,}", LONG_PAIR_TOKENS
    assert f"token batches of {small}, or {large} where the pairs average more than {bound} tokens" in readme
    assert f"**{small}**, or **{large}** where the training pairs average more than {bound} tokens" in guide
    [help_text] = [f.metadata["help"] for f in fields(DataArguments) if f.name == "max_tokens"]
    assert f"{DEFAULT_BATCH_TOKENS}, or {LONG_PAIRS_BATCH_TOKENS} where the training pairs average more than {bound}" \
        in help_text
