"""training.py: end-to-end runs of train.py on a slice of the shipped corpus, and main()'s one-line errors."""

import json
import logging
import re

import pytest
from helpers import MODEL_CARD_TEMPLATE, run_tiny, tiny_run_flags
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

from hf_scratch_transformer.training.run import main


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("run")
    results = run_tiny(output_dir, max_steps=40, learning_rate=3e-3, logging_steps=5, eval_steps=20, save_steps=20)
    return output_dir, results


def test_the_output_directory_is_in_hub_format(long_run):
    output_dir, results = long_run
    names = {path.name for path in output_dir.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "README.md", "all_results.json", "training_curves.png", "modeling_scratch_transformer.py",
            "configuration_scratch_transformer.py", "pipeline_translation.py", "train_results.json",
            "eval_results.json", "predict_results.json", "generated_predictions.txt"} <= names
    assert not any(name.startswith((".staging", ".tokenizer")) or name.endswith(".tmp") for name in names)
    assert sorted(name for name in names if name.startswith("checkpoint-")) == ["checkpoint-20", "checkpoint-40"]
    assert json.loads((output_dir / "all_results.json").read_text()) == results
    assert results["train_steps"] == 40 and results["train_tokens"] > 0
    # the longest sentence translated whole (translate_texts): the training sources' 90th-percentile length
    generation = json.loads((output_dir / "generation_config.json").read_text())
    assert 5 < generation["max_sentence_tokens"] < 96  # --max_source_length 96 in tiny_run_flags


def test_the_test_sources_are_saved_beside_their_translations(long_run):
    """test_sources.txt (the demo's examples): line N is the source of generated_predictions.txt's line N."""
    output_dir, _ = long_run
    sources = (output_dir / "test_sources.txt").read_text(encoding="utf-8").splitlines()
    predictions = (output_dir / "generated_predictions.txt").read_text(encoding="utf-8").splitlines()
    assert len(sources) == len(predictions) > 0
    from hf_scratch_transformer.data.loading import DataArguments, load_parallel_corpus
    from hf_scratch_transformer.data.preprocessing import evaluation_pairs

    expected, _ = evaluation_pairs(load_parallel_corpus(DataArguments())["test"], DataArguments())
    assert sources == expected[: len(sources)]


def test_the_model_learns(long_run):
    output_dir, _ = long_run
    history = json.loads((output_dir / "training_history.json").read_text())
    train_losses = [row["train_loss"] for row in history if "train_loss" in row]
    eval_losses = [row["eval_loss"] for row in history if "eval_loss" in row]
    assert train_losses[-1] < train_losses[0] - 1.0
    assert eval_losses[-1] < eval_losses[0]


def test_the_output_loads_with_auto_classes_and_the_pipeline(long_run):
    output_dir, _ = long_run
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(output_dir).eval()
    assert model.config.use_cache and model.generation_config.num_beams == 2
    batch = tokenizer(["In the beginning God created the heavens."], return_tensors="pt")
    generated = model.generate(**batch, max_new_tokens=8)
    assert generated.shape[0] == 1 and generated[0, 0] == model.config.decoder_start_token_id
    translation = pipeline("translation", model=str(output_dir), trust_remote_code=True)("Jesus wept.", max_new_tokens=8)
    assert set(translation[0]) == {"translation_text"}


def test_the_model_card_holds_the_measured_figures(long_run):
    output_dir, results = long_run
    card = (output_dir / "README.md").read_text()
    assert card.startswith("---\n") and "pipeline_tag: translation" in card
    assert f"| greedy | {results['predict_bleu_greedy']} | {results['predict_chrf_greedy']} |" in card
    assert f"| beam 2 | {results['predict_bleu']} | {results['predict_chrf']} |" in card
    assert "{{" not in card and "40 optimiser steps" in card
    assert "Final weights: the weights after the last step." in card
    assert "`linear` decay" in card and "dropout 0.0 (attention 0.0, after the feed-forward activation 0.0)" in card
    assert ("training-time noise: 50% of the source sentences with a paraphrase in the corpus replaced by it, plain "
            "quotes in 50% of the source sentences with typographic ones, 5% of the source sentences lower-cased "
            "(redrawn every epoch).") in " ".join(card.split())
    assert re.search(r"Hardware: .+ \((AMX|AVX-512 BF16, no AMX|no bf16 units)\), \d+ logical cores, 1 process\(es\); "
                     r"fp32; wall time", card)


def test_debug_shows_the_traceback(tmp_path, capsys, caplog):
    with caplog.at_level(logging.ERROR, logger="hf_scratch_transformer"):
        assert main(tiny_run_flags(tmp_path / "out", preset="huge", debug=True), MODEL_CARD_TEMPLATE) == 2
    assert any(record.exc_info and "UsageError" in record.exc_info[0].__name__ for record in caplog.records)


def test_a_validation_reused_at_the_end_keeps_its_own_runtime(long_run):
    """The run validated at its last step (eval_steps 20, max_steps 40), so the end does not validate again:
    eval_results.json reports that validation's time, not the zero seconds of reusing it."""
    output_dir, results = long_run
    evaluation = json.loads((output_dir / "eval_results.json").read_text())
    assert evaluation["eval_runtime"] > 0
    assert evaluation["eval_samples_per_second"] == pytest.approx(
        evaluation["eval_samples"] / evaluation["eval_runtime"], rel=0.05)


# ------------------------------------------------------------------------------------------- protected spans
UI_STRINGS = [(f"{verb} %d {thing} in <b>{{folder}}</b>.", f"{verbo} %d {cosa} en <b>{{folder}}</b>.")
              for verb, verbo in (("Delete", "Borrar"), ("Copy", "Copiar"), ("Move", "Mover"), ("Open", "Abrir"))
              for thing, cosa in (("files", "archivos"), ("folders", "carpetas"), ("images", "imágenes"))]
UI_STRINGS += [("See https://example.org/help for %s.", "Véase la ayuda para %s."), ("Cancel", "Cancelar")]


def test_a_run_masks_shared_spans_and_its_model_and_evaluation_protect_them(tmp_path):
    """train.py on software strings: the new tokenizer has the sentinel tokens, the spans both sides share are
    masked (counted in train_results.json, stated in the recipe and the model card), and evaluation translates the
    raw test sources through the core with protection on: each prediction holds the source's spans exactly once,
    although 4 steps teach a model nothing. --mask_protected_spans false: no sentinels, nothing masked."""
    from helpers import run_quick, write_jsonl
    from transformers import AutoTokenizer

    from hf_scratch_transformer.protected_spans import SpanProtector, tokenizer_has_sentinels

    corpus = write_jsonl(tmp_path / "ui.jsonl", [{"translation": {"en": en, "es": es}} for en, es in UI_STRINGS * 4])
    files = dict(train_file=str(corpus), validation_file=str(corpus), test_file=str(corpus), max_predict_samples=8,
                 max_steps=4, save_steps=0)
    results = run_quick(tmp_path / "masked", **files)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "masked")
    assert tokenizer_has_sentinels(tokenizer)
    report = json.loads((tmp_path / "masked" / "train_results.json").read_text())
    assert report["filtered"]["train"]["masked"] == 13 * 4 and report["recipe"]["mask_protected_spans"] is True
    card = " ".join((tmp_path / "masked" / "README.md").read_text().split())
    assert "protected spans: the placeholders, markup, URLs and e-mail addresses both sides of a training pair share" \
           " are masked" in card and f"in {13 * 4} of the pairs kept, the protected spans" in card
    predictions = (tmp_path / "masked" / "generated_predictions.txt").read_text(encoding="utf-8").splitlines()
    assert len(predictions) == 8 and results["predict_samples"] == 8
    for (source, _), prediction in zip(UI_STRINGS * 4, predictions):
        assert all(prediction.count(span.text) == 1 for span in SpanProtector().find(source)), prediction
    run_quick(tmp_path / "plain", mask_protected_spans=False, **files)
    assert not tokenizer_has_sentinels(AutoTokenizer.from_pretrained(tmp_path / "plain"))
    report = json.loads((tmp_path / "plain" / "train_results.json").read_text())
    assert report["filtered"]["train"]["masked"] == 0 and report["recipe"]["mask_protected_spans"] is False


def test_a_run_s_scores_are_those_of_the_model_it_saved(tmp_path, monkeypatch):
    """Validation during training and the test decoding at its end decode with the weights as trained so far, also
    through the fp32 loops' prepacked copies (made at the first validation, forced here for the tiny model's products
    as a CPU with AVX-512 makes them), which train.py's fused Adam then updates in place without bumping a version:
    the saved model, evaluated on its own, scores and translates the same."""
    from hf_scratch_transformer import decoding

    monkeypatch.setattr(decoding, "packed_min_elements", lambda: 0)
    trained = run_tiny(tmp_path / "run", max_steps=16, eval_steps=8, save_steps=8, learning_rate=3e-3, cpu_threads=1)
    evaluated = run_tiny(tmp_path / "evaluated", model_name_or_path=str(tmp_path / "run"), preset=None,
                         max_position_embeddings=None, tokenizer_vocab_size=None, do_eval=True, do_predict=True,
                         cpu_threads=1)
    assert "train_steps" not in evaluated
    for name in ("eval_loss", "eval_bleu", "predict_bleu", "predict_bleu_greedy"):
        assert trained[name] == evaluated[name], name
    predictions = [(tmp_path / run / "generated_predictions.txt").read_text(encoding="utf-8")
                   for run in ("run", "evaluated")]
    assert predictions[0] == predictions[1] and len(set(predictions[0].splitlines())) > 1
