"""arguments.py: flags, config files and the checks made before any work (one line naming what to fix)."""

import json

import pytest
from helpers import MODEL_CARD_TEMPLATE, REPO, fails_with, run_tiny, tiny_run_flags

from hf_scratch_transformer.training.arguments import parse_arguments
from hf_scratch_transformer.training.recipe import dropout_for
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


def test_an_unknown_schedule_is_refused(tmp_path):
    with pytest.raises(UsageError, match="--lr_scheduler_type must be one of"):
        run_tiny(tmp_path, lr_scheduler_type="exponential")


TRAINING_CONFIGS = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "configs").glob("*.json"))


@pytest.mark.parametrize("config", TRAINING_CONFIGS, ids=lambda path: path.name)
def test_every_shipped_training_config_parses(config):
    model_args, data_args, args = parse_arguments([str(config)])
    assert args.output_dir.startswith("outputs/")


def test_the_gpu_recipe_is_the_cpu_recipe_trained_longer():
    """configs/gpu-en-es.yaml leaves the model's settings to the recipe: 16 epochs, so its dropout rule gives 0.1."""
    model_args, data_args, args = parse_arguments([str(REPO / "configs" / "gpu-en-es.yaml")])
    assert (args.num_train_epochs, data_args.max_tokens, data_args.tokenizer_vocab_size) == (16, 4096, 16000)
    assert model_args.dropout is None and model_args.normalize_before is None  # the recipe decides
    assert dropout_for(args.num_train_epochs)[0] == 0.1
    assert (args.average_checkpoints, args.save_total_limit, args.bf16) == (5, 5, True)


def test_the_moonshot_config_is_the_documented_command():
    """configs/moonshot-en-es.yaml is README's moonshot command, flag for flag (its runs were made with the flags),
    and leaves the model's settings to the recipe."""
    command = ["--max_train_minutes", "23.5", "--max_tokens", "2048", "--source_contraction_rate", "0.5",
               "--source_spaced_punctuation_rate", "0.1", "--source_typo_rate", "0.01",
               "--output_dir", "outputs/scratch-small-en-es-moonshot"]
    from_config = parse_arguments([str(REPO / "configs" / "moonshot-en-es.yaml")])
    assert [vars(group) for group in from_config] == [vars(group) for group in parse_arguments(command)]
    model_args, data_args, args = from_config
    assert (args.max_train_minutes, data_args.max_tokens, args.source_typo_rate) == (23.5, 2048, 0.01)
    assert model_args.dropout is None and model_args.preset is None  # the default preset, small
    readme = (REPO / "README.md").read_text()
    assert "python train.py configs/moonshot-en-es.yaml" in readme


def test_the_gpu_recipe_runs_its_code_paths_on_a_cpu(tmp_path):
    """configs/gpu-en-es.yaml's options (bf16, averaging, loader workers), shrunk to a tiny run."""
    flags = tiny_run_flags(tmp_path, max_steps=4, save_steps=2, eval_steps=0, num_beams=1, do_train=True,
                           save_total_limit=None, dropout=None, tokenizer_vocab_size=600, bf16=None)
    results = run_training(*parse_arguments([str(REPO / "configs" / "gpu-en-es.yaml"), *flags]), MODEL_CARD_TEMPLATE)
    assert results["averaged_checkpoints"] == ["checkpoint-2", "checkpoint-4"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dropout"] == dropout_for(results["recipe"]["planned_epochs"])[0]
    assert config["normalize_before"] is True
    assert results["train_steps"] == 4 and results["train_loss"] > 0
    assert "; bf16 mixed precision; wall time" in (tmp_path / "README.md").read_text()
