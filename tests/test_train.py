"""End-to-end runs of train.py on a slice of the shipped corpus."""

import json

import pytest
import torch
from conftest_train import MODEL_CARD_TEMPLATE, tiny_run_flags
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

from hf_scratch_transformer.arguments import parse_arguments
from hf_scratch_transformer.errors import UsageError
from hf_scratch_transformer.loop import Trainer
from hf_scratch_transformer.training import main, run_training


def run(output_dir, **overrides) -> dict:
    return run_training(*parse_arguments(tiny_run_flags(output_dir, **overrides)), MODEL_CARD_TEMPLATE)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("run")
    results = run(output_dir, max_steps=40, learning_rate=3e-3, logging_steps=5, eval_steps=20, save_steps=20)
    return output_dir, results


def test_the_output_directory_is_in_hub_format(finished_run):
    output_dir, results = finished_run
    names = {path.name for path in output_dir.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "README.md", "all_results.json", "training_curves.png", "modeling_scratch_transformer.py",
            "configuration_scratch_transformer.py", "pipeline_translation.py", "train_results.json",
            "eval_results.json", "predict_results.json", "generated_predictions.txt"} <= names
    assert not any(name.startswith((".staging", ".tokenizer")) or name.endswith(".tmp") for name in names)
    assert sorted(name for name in names if name.startswith("checkpoint-")) == ["checkpoint-20", "checkpoint-40"]
    assert json.loads((output_dir / "all_results.json").read_text()) == results
    assert results["train_steps"] == 40 and results["train_tokens"] > 0


def test_the_model_learns(finished_run):
    output_dir, _ = finished_run
    history = json.loads((output_dir / "training_history.json").read_text())
    train_losses = [row["train_loss"] for row in history if "train_loss" in row]
    eval_losses = [row["eval_loss"] for row in history if "eval_loss" in row]
    assert train_losses[-1] < train_losses[0] - 1.0
    assert eval_losses[-1] < eval_losses[0]


def test_the_output_loads_with_auto_classes_and_the_pipeline(finished_run):
    output_dir, _ = finished_run
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(output_dir).eval()
    assert model.config.use_cache and model.generation_config.num_beams == 2
    batch = tokenizer(["In the beginning God created the heavens."], return_tensors="pt")
    generated = model.generate(**batch, max_new_tokens=8)
    assert generated.shape[0] == 1 and generated[0, 0] == model.config.decoder_start_token_id
    translation = pipeline("translation", model=str(output_dir), trust_remote_code=True)("Jesus wept.", max_new_tokens=8)
    assert set(translation[0]) == {"translation_text"}


def test_the_model_card_holds_the_measured_figures(finished_run):
    output_dir, results = finished_run
    card = (output_dir / "README.md").read_text()
    assert card.startswith("---\n") and "pipeline_tag: translation" in card
    assert f"| greedy | {results['predict_bleu_greedy']} | {results['predict_chrf_greedy']} |" in card
    assert f"| beam 2 | {results['predict_bleu']} | {results['predict_chrf']} |" in card
    assert "{{" not in card and "40 optimiser steps" in card


def test_stop_and_resume_ends_with_the_same_weights(tmp_path):
    flags = dict(max_steps=12, save_steps=4, eval_steps=0, max_train_samples=40, max_tokens=256)
    run(tmp_path / "straight", **flags)
    run(tmp_path / "resumed", **{**flags, "max_steps": 6})  # stops after step 6, checkpoint-6 written
    run(tmp_path / "resumed", **flags, resume_from_checkpoint="latest")
    straight = load_file(tmp_path / "straight" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    state = json.loads((tmp_path / "resumed" / "checkpoint-12" / "run_state.json").read_text())
    assert state["global_step"] == 12 and state["epoch"] >= 1  # the run crossed an epoch boundary


def test_checkpoint_averaging(tmp_path):
    results = run(tmp_path, max_steps=8, save_steps=2, save_total_limit=3, average_checkpoints=3, eval_steps=0)
    assert results["averaged_checkpoints"] == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    final = load_file(tmp_path / "model.safetensors")
    parts = [load_file(tmp_path / name / "model.safetensors") for name in results["averaged_checkpoints"]]
    torch.testing.assert_close(final["model.shared.weight"], sum(p["model.shared.weight"] for p in parts) / 3)


def test_push_to_hub_offline_fails_cleanly_and_keeps_the_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(tiny_run_flags(tmp_path, max_steps=2, eval_steps=0, push_to_hub=True, hub_model_id="me/tiny"),
                MODEL_CARD_TEMPLATE)
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1
    assert message.startswith("training stopped: could not push to the hub repository 'me/tiny'")
    assert f"saved and complete in {tmp_path}" in message
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert model.num_parameters() > 0 and (tmp_path / "README.md").is_file()


def test_config_file_instead_of_flags(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"preset": "tiny", "max_train_samples": 400, "max_steps": 1}))
    (tmp_path / "run.yaml").write_text("preset: base\nmax_tokens: 4096\nnormalize_before: true\n")
    model_args, data_args, args = parse_arguments([str(tmp_path / "run.json")])
    assert model_args.preset == "tiny" and data_args.max_train_samples == 400 and args.max_steps == 1
    model_args, data_args, args = parse_arguments([str(tmp_path / "run.yaml")])
    assert model_args.preset == "base" and model_args.normalize_before and data_args.max_tokens == 4096


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_decaying_schedule_reaches_zero_at_the_last_step(tmp_path, schedule):
    run(tmp_path, lr_scheduler_type=schedule, max_steps=6, warmup_steps=2, logging_steps=1, save_steps=0,
        eval_steps=0, do_train=True)
    rates = [row["learning_rate"] for row in json.loads((tmp_path / "training_history.json").read_text())
             if "learning_rate" in row]
    assert len(rates) == 6 and rates[1] == pytest.approx(1e-3) and rates[-1] == 0.0
    assert all(later < earlier for earlier, later in zip(rates[1:], rates[2:]))
    assert f"`{schedule}` decay" in (tmp_path / "README.md").read_text()


def test_an_unknown_schedule_is_refused(tmp_path):
    with pytest.raises(UsageError, match="--lr_scheduler_type must be one of"):
        run(tmp_path, lr_scheduler_type="exponential")


def test_the_optimiser_is_fused(tmp_path, monkeypatch):
    seen = {}
    real_train = Trainer.train

    def record(self):
        seen["fused"] = self.optimizer.optimizer.defaults["fused"]
        return real_train(self)

    monkeypatch.setattr(Trainer, "train", record)
    run(tmp_path, max_steps=2, save_steps=0, eval_steps=0, do_train=True)
    assert seen["fused"] is True
