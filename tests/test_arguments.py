"""arguments.py: flags, config files and the checks made before any work (one line naming what to fix)."""

import json
import logging

import pytest
from helpers import MODEL_CARD_TEMPLATE, REPO, fails_with, run_tiny, tiny_run_flags

import torch

from hf_scratch_transformer import cpu_threads
from hf_scratch_transformer.training.arguments import (
    BF16_CPU_STEP_BUDGET,
    DEFAULT_STEP_BUDGET,
    RunArguments,
    choose_precision,
    parse_arguments,
    run_length,
    step_budget,
)
from hf_scratch_transformer.errors import UsageError
from hf_scratch_transformer.training.run import run_training


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"preset": "huge"}, "invalid model size: Unknown preset 'huge': choose one of tiny, small, base, big"),
        ({"d_model": 30, "attention_heads": 4}, "invalid model size"),
        ({"target_lang": "en"}, "--source_lang and --target_lang are both 'en'"),
        ({"max_tokens": 50}, "--max_tokens 50 is smaller than the longest allowed sentence (96 tokens)"),
        ({"no_such_flag": 1}, "--no_such_flag"),
        ({"max_steps": "many"}, "--max_steps"),
    ],
    ids=["unknown_preset", "width_not_divisible_by_heads", "same_languages", "max_tokens_too_small", "unknown_flag",
         "bad_value"],
)
def test_contradictory_or_unknown_flags_fail_before_any_work(overrides, expected, tmp_path, capsys):
    output_dir = tmp_path / "out"
    message = fails_with(tiny_run_flags(output_dir, **overrides), capsys)
    assert message.startswith("error: ") and expected in message
    assert not output_dir.exists()


def test_non_empty_output_dir_is_refused_unless_overwrite_or_resume(tmp_path, capsys):
    (tmp_path / "model.safetensors").write_bytes(b"precious")
    message = fails_with(tiny_run_flags(tmp_path), capsys)
    assert "exists and is not empty" in message and "--overwrite_output_dir" in message
    assert "--resume_from_checkpoint latest" in message
    assert (tmp_path / "model.safetensors").read_bytes() == b"precious"
    # with --resume_from_checkpoint the directory is accepted: the complaint is now about the checkpoint
    message = fails_with(tiny_run_flags(tmp_path, resume_from_checkpoint="latest"), capsys)
    assert "--resume_from_checkpoint latest: no complete checkpoint in" in message


def test_config_file_instead_of_flags(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"preset": "tiny", "max_train_samples": 400, "max_steps": 1}))
    (tmp_path / "run.yaml").write_text("preset: base\nmax_tokens: 4096\nnormalize_before: true\n")
    model_args, data_args, args = parse_arguments([str(tmp_path / "run.json")])
    assert model_args.preset == "tiny" and data_args.max_train_samples == 400 and args.max_steps == 1
    model_args, data_args, args = parse_arguments([str(tmp_path / "run.yaml")])
    assert model_args.preset == "base" and model_args.normalize_before and data_args.max_tokens == 4096


def test_a_new_model_is_pre_norm_unless_post_norm_is_asked_for(tmp_path):
    model_args, _, args = parse_arguments(tiny_run_flags(tmp_path))
    assert model_args.build_config(vocab_size=100).normalize_before is True and args.learning_rate == 2e-3
    # the default is not a size flag: a post-norm model given to --model_name_or_path is not contradicted
    assert "normalize_before" not in model_args.size_overrides()
    model_args, _, _ = parse_arguments(tiny_run_flags(tmp_path, normalize_before=False))
    assert model_args.build_config(vocab_size=100).normalize_before is False
    assert model_args.size_overrides()["normalize_before"] is False


def test_a_new_model_has_no_dropout_unless_asked_for(tmp_path):
    model_args, _, _ = parse_arguments(tiny_run_flags(tmp_path))
    config = model_args.build_config(vocab_size=100)
    assert (config.dropout, config.attention_dropout, config.activation_dropout) == (0.0, 0.0, 0.0)
    assert model_args.dropout_overrides() == {}  # a model given to --model_name_or_path keeps its own rates
    model_args, _, _ = parse_arguments(tiny_run_flags(tmp_path, dropout=0.1, attention_dropout=0.05))
    config = model_args.build_config(vocab_size=100)
    assert (config.dropout, config.attention_dropout, config.activation_dropout) == (0.1, 0.05, 0.0)


@pytest.mark.parametrize("flags, steps, warned", [({}, 300, True), ({}, 100, False), ({"dropout": 0.0}, 300, False),
                                                  ({"model_name_or_path": "some/model"}, 300, False)])
def test_a_long_run_without_dropout_is_warned_about_at_the_start(tmp_path, flags, steps, warned):
    model_args, _, args = parse_arguments(tiny_run_flags(tmp_path, max_steps=steps, **flags))
    warning = model_args.dropout_warning(run_length(args, steps_per_epoch=10))
    assert (warning is not None) == warned
    if warned:
        assert "30 epochs" in warning and "--dropout 0.1" in warning


def test_a_training_run_logs_the_no_dropout_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_scratch_transformer"):
        run_tiny(tmp_path / "out", max_train_samples=40, max_steps=60, save_steps=0, eval_steps=0, do_predict=False)
    assert any("trains without dropout by default" in record.getMessage() for record in caplog.records)


def test_an_unknown_schedule_is_refused(tmp_path):
    with pytest.raises(UsageError, match="--lr_scheduler_type must be one of"):
        run_tiny(tmp_path, lr_scheduler_type="exponential")


TRAINING_CONFIGS = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "configs").glob("*.json"))


@pytest.mark.parametrize("config", TRAINING_CONFIGS, ids=lambda path: path.name)
def test_every_shipped_training_config_parses(config):
    model_args, data_args, args = parse_arguments([str(config)])
    assert args.output_dir.startswith("outputs/")


def test_the_gpu_recipe_runs_its_code_paths_on_a_cpu(tmp_path):
    """configs/gpu-en-es.yaml's options (bf16, averaging, dropouts, loader workers), shrunk to a tiny run."""
    flags = tiny_run_flags(tmp_path, max_steps=4, save_steps=2, eval_steps=0, num_beams=1, do_train=True,
                           save_total_limit=None, dropout=None, tokenizer_vocab_size=600, bf16=None)
    results = run_training(*parse_arguments([str(REPO / "configs" / "gpu-en-es.yaml"), *flags]), MODEL_CARD_TEMPLATE)
    assert results["averaged_checkpoints"] == ["checkpoint-2", "checkpoint-4"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["dropout"], config["attention_dropout"], config["activation_dropout"]) == (0.3, 0.1, 0.1)
    assert results["train_steps"] == 4 and results["train_loss"] > 0
    assert "; bf16 mixed precision; wall time" in (tmp_path / "README.md").read_text()


# ------------------------------------------------------------------------------------------------ the precision

AVX512_BF16, NO_BF16_UNITS = {"avx512f", "avx512_bf16"}, {"avx512f"}
AMX = {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def cpu_flags(monkeypatch):
    """Fakes the CPU's feature flags (/proc/cpuinfo) as the precision rule sees them."""
    def fake(flags):
        monkeypatch.setattr(cpu_threads, "cpu_model_and_flags", lambda: ("a test CPU", set(flags)))
    return fake


@pytest.mark.parametrize("flags, device, given, bf16, budget", [
    (AVX512_BF16, CPU, [], True, BF16_CPU_STEP_BUDGET),  # measured to pay: bf16, 1.2x the steps
    (AMX, CPU, [], True, BF16_CPU_STEP_BUDGET),  # measured to pay there too
    (NO_BF16_UNITS, CPU, [], False, DEFAULT_STEP_BUDGET),
    (AVX512_BF16, GPU, [], False, DEFAULT_STEP_BUDGET),  # a GPU's precision comes from its config
    (AVX512_BF16, CPU, ["--bf16", "false"], False, DEFAULT_STEP_BUDGET),
    (AVX512_BF16, CPU, ["--fp16"], False, DEFAULT_STEP_BUDGET),
    (AVX512_BF16, CPU, ["--bf16"], True, BF16_CPU_STEP_BUDGET),
    (NO_BF16_UNITS, CPU, ["--bf16", "true"], True, DEFAULT_STEP_BUDGET),  # asked for, but no faster: no more steps
    (AVX512_BF16, CPU, ["--do_eval", "--do_predict"], False, DEFAULT_STEP_BUDGET),  # no training: nothing to gain
], ids=["avx512_bf16", "amx", "no_units", "gpu", "bf16_false", "fp16", "bf16_given", "bf16_without_units",
        "evaluation_only"])
def test_bf16_is_the_default_only_where_it_was_measured_to_pay(cpu_flags, flags, device, given, bf16, budget):
    cpu_flags(flags)
    _, _, args = parse_arguments(given)
    line = choose_precision(args, device, new_model_width=256)  # the small preset, where it was measured
    assert args.bf16 is bf16 and step_budget(args, device) == budget
    assert (line is not None) == (bf16 and not given)  # said when chosen, not when asked for
    length = run_length(args, steps_per_epoch=1108, budget=step_budget(args, device))
    assert length.total_steps == budget and f"at most {budget:,} steps" in length.describe()
    assert run_length(RunArguments(max_steps=8, bf16=bf16), 1108, budget).total_steps == 8  # --max_steps wins


def test_on_amx_the_bf16_line_says_a_run_with_adaptive_threads_is_not_bit_reproducible(cpu_flags):
    """oneDNN's AMX kernels split their sums by thread count: adaptive threads change the weights, pinned ones do not."""
    cpu_flags(AMX)
    lines = {}
    for given in ([], ["--cpu_threads", "2"]):
        _, _, args = parse_arguments(given)
        lines[len(given)] = choose_precision(args, CPU, new_model_width=256)
    assert "not reproducible bit for bit: --cpu_threads N (or --bf16 false) is" in lines[0]
    assert lines[2].startswith("bf16 mixed precision: this CPU has AMX") and "reproducible" not in lines[2]


@pytest.mark.parametrize("width, bf16", [(64, False), (256, True), (512, True), (None, False)],
                         ids=["tiny", "small", "base", "loaded_model"])
def test_the_default_bf16_needs_a_new_model_wide_enough(cpu_flags, width, bf16):
    """The tiny preset trained slower in bf16 (casts outweigh its small products); a loaded model keeps fp32."""
    cpu_flags(AVX512_BF16)
    _, _, args = parse_arguments([])
    choose_precision(args, CPU, new_model_width=width)
    assert args.bf16 is bf16


@pytest.mark.parametrize("flags, steps, precision, units", [
    (AVX512_BF16, BF16_CPU_STEP_BUDGET, "bf16 mixed precision", "AVX-512 BF16"),
    (AMX, BF16_CPU_STEP_BUDGET, "bf16 mixed precision", "AMX"),
    (NO_BF16_UNITS, DEFAULT_STEP_BUDGET, "fp32", None)], ids=["avx512_bf16", "amx", "no_units"])
def test_a_run_without_precision_flags_follows_the_cpu(cpu_flags, flags, steps, precision, units, tmp_path, caplog):
    """A real run with neither --bf16 nor --max_steps: its precision and its run-length rule's budget (stopped at
    once by --max_train_minutes; many short batches so that 100 epochs are more than the budget)."""
    cpu_flags(flags)
    with caplog.at_level(logging.INFO, logger="hf_scratch_transformer"):
        results = run_tiny(tmp_path, bf16=None, d_model=256, max_steps=None, max_tokens=128, max_train_minutes=0.002,
                           eval_steps=0, save_steps=0, max_eval_samples=2, max_predict_samples=2, num_beams=1,
                           eval_max_new_tokens=2)  # the small preset's width: the tiny preset stays fp32
    logged = " ".join(record.getMessage() for record in caplog.records)
    assert f"training for {steps:,} steps" in logged and f"at most {steps:,} steps" in logged
    assert ("bf16 mixed precision: this CPU has" in logged) == (units is not None)
    assert units is None or f"this CPU has {units}, where bf16 trains" in logged
    assert ("on AMX the weights depend on the thread count" in logged) == (units == "AMX")  # and the run adapts them
    assert f"; {precision}; wall time" in (tmp_path / "README.md").read_text()
    assert results["train_precision"] == precision.split()[0]  # all_results.json records it too


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
    """Accelerate keeps one precision per process and refuses another; train.py's main called again in the same
    process (a notebook) with another precision gets it."""
    quick = dict(max_steps=2, save_steps=0, eval_steps=0, do_train=True)
    precisions = [run_tiny(tmp_path / name, bf16=bf16, **quick)["train_precision"]
                  for name, bf16 in (("first", False), ("second", True), ("third", False))]
    assert precisions == ["fp32", "bf16", "fp32"]
