"""hf-scratch-demo: the translation, n-best and heatmap functions on a trained model; the page served on 127.0.0.1
and called through gradio_client; the Space that --write_space writes, imported and built against a local model."""

import copy
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard, SpaceCard

from hf_scratch_transformer.decoding import bf16_products_for_decoding, quantize_for_decoding
from hf_scratch_transformer.translation import demo
from hf_scratch_transformer.data.loading import SHIPPED_CORPUS_FILES, SHIPPED_DATASET_ID
from hf_scratch_transformer.errors import EnvironmentFault, UsageError
from hf_scratch_transformer.translation.translate import TEST_SOURCES_FILE
from hf_scratch_transformer.translation.translate import decoding_encoder_dtype, translate

pytestmark = pytest.mark.usefixtures("one_torch_thread")

needs_gradio = pytest.mark.skipif(
    find_spec("gradio") is None or find_spec("gradio_client") is None,
    reason="gradio and gradio_client are not installed (pip install -e '.[dev]' installs them)",
)
REPO = Path(__file__).resolve().parents[1]
SENTENCE = "In the beginning God created the heavens and the earth."


@pytest.fixture(scope="module")
def model_and_tokenizer(trained_model):
    model, tokenizer, _ = trained_model
    return model.eval(), tokenizer


# ------------------------------------------------------------------------------------------ translation, n-best


def test_greedy_gives_one_hypothesis_the_same_as_hf_scratch_translate(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    translation = demo.translate_text(model, tokenizer, SENTENCE, num_beams=1, num_hypotheses=1)
    [hypothesis] = translation.hypotheses
    assert hypothesis.text == translation.text == translate(model, tokenizer, [SENTENCE], num_beams=1)[0]
    assert hypothesis.text == "En el principio creó Dios los cielos y la tierra."  # a training pair, learnt
    assert hypothesis.score < 0 and translation.confidence == hypothesis.confidence < 0


def test_beam_search_lists_n_hypotheses_best_first_with_beam_search_s_own_scores(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    hypotheses = demo.translate_text(model, tokenizer, SENTENCE, num_beams=4, num_hypotheses=3).hypotheses
    assert len(hypotheses) == 3 and len({tuple(h.token_ids) for h in hypotheses}) == 3
    scores = [h.score for h in hypotheses]
    assert scores == sorted(scores, reverse=True)
    [expected] = translate(model, tokenizer, [SENTENCE], num_beams=4, num_return_sequences=3)  # the CLI's --nbest
    assert [(h.token_ids, h.score, h.confidence) for h in hypotheses] == \
        [(h.token_ids, h.score, h.confidence) for h in expected]
    assert hypotheses[0].text == translate(model, tokenizer, [SENTENCE], num_beams=4)[0]  # what the CLI prints


def test_nbest_refuses_more_hypotheses_than_beams_and_empty_text(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match="num_return_sequences"):
        demo.translate_text(model, tokenizer, SENTENCE, num_beams=2, num_hypotheses=3)
    with pytest.raises(ValueError, match="empty"):
        demo.translate_text(model, tokenizer, "  ", num_beams=1)


def test_the_glossary_field_and_the_protect_toggle_go_through_the_core(model_and_tokenizer):
    """The page's glossary (TSV typed into a field) and toggle give what translate() gives with the same options,
    and the report line says what became of terms and spans; a malformed line is refused naming it."""
    model, tokenizer = model_and_tokenizer
    text = "Jesus wept. See <b>%d</b> at http://God.org now."
    shown = demo.translate_text(model, tokenizer, text, protect=True, glossary="Jesus\tCristo\n\nGod\tDios\n")
    [expected] = translate(model, tokenizer, [text], protect=True, glossary={"Jesus": "Cristo", "God": "Dios"},
                           details=True)
    assert shown.text == expected.text and "Cristo" in shown.text
    assert all(shown.text.count(span) == 1 for span in ("<b>", "%d", "</b>", "http://God.org"))
    report = demo.text_report(shown)
    assert "glossary: 1 of 2 term occurrence(s) honoured, not: God" in report  # "God" inside the URL
    assert "4 protected span(s), each put back once" in report
    assert "2 sentences" in report and f"confidence {shown.confidence:.3f}" in report
    unprotected = demo.translate_text(model, tokenizer, text, protect=False)
    assert unprotected.spans == [] and unprotected.segments[1].model_text == "See <b>%d</b> at http://God.org now."
    with pytest.raises(UsageError, match="the glossary line 2: the target term is empty"):
        demo.translate_text(model, tokenizer, text, glossary="Jesus\tCristo\nGod\t \n")


def test_the_heatmap_shows_the_first_sentence_over_what_the_model_read(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    translation = demo.translate_text(model, tokenizer, "<br/> Jesus wept. God is love.", num_beams=2,
                                      num_hypotheses=2, protect=True)
    model_text, token_ids = demo.first_sentence(translation, rank=1)
    assert model_text == "Jesus wept." and token_ids == translation.segments[0].hypotheses[1].token_ids
    view = demo.DemoActions(demo.DemoModel(model, tokenizer, "m", "en", "es", [], "")).attention(translation, 1)
    assert view.weights.shape[2:] == (len(token_ids), len(tokenizer(model_text)["input_ids"]))
    spans_only = demo.translate_text(model, tokenizer, "<br/>", protect=True)
    assert spans_only.text == "<br/>"
    with pytest.raises(ValueError, match="nothing of this text went to the model"):
        demo.first_sentence(spans_only)


# ---------------------------------------------------------------------------------------------- heatmap data


@pytest.fixture(scope="module")
def view(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    [hypothesis] = demo.translate_text(model, tokenizer, SENTENCE).hypotheses
    return demo.attention_view(model, tokenizer, SENTENCE, hypothesis.token_ids), hypothesis


def test_attention_view_has_a_row_per_generated_token_and_a_column_per_source_token(view, model_and_tokenizer):
    attention, hypothesis = view
    model, tokenizer = model_and_tokenizer
    source_tokens = len(tokenizer(SENTENCE)["input_ids"])
    assert attention.weights.shape == (model.config.decoder_layers, model.config.decoder_attention_heads,
                                       len(hypothesis.token_ids), source_tokens)
    assert len(attention.source_labels) == source_tokens and attention.source_labels[-1] == "</s>"
    assert len(attention.target_labels) == len(hypothesis.token_ids) and attention.target_labels[-1] == "</s>"


def test_heatmap_is_target_by_source_rows_sum_to_one_and_averages_the_heads_of_the_last_layer(view):
    weights = view[0].weights
    layers, heads, target_length, source_length = weights.shape
    default = demo.heatmap_matrix(weights)
    assert default.shape == (target_length, source_length)
    np.testing.assert_allclose(default.sum(axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(default, weights[-1].mean(axis=0))
    assert not np.allclose(weights[-1, 0], weights[-1, 1])  # the heads differ, so the mean is not any one of them
    for layer in range(layers):
        for head in range(heads):
            chosen = demo.heatmap_matrix(weights, layer=layer, head=head)
            np.testing.assert_array_equal(chosen, weights[layer, head])
            np.testing.assert_allclose(chosen.sum(axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(demo.heatmap_matrix(weights, layer=0), weights[0].mean(axis=0))
    with pytest.raises(ValueError, match="out of range"):
        demo.heatmap_matrix(weights, layer=layers)
    with pytest.raises(ValueError, match="out of range"):
        demo.heatmap_matrix(weights, head=heads)


def test_heatmap_spec_holds_every_cell_with_its_tokens_and_weight(view):
    attention = view[0]
    matrix = demo.heatmap_matrix(attention.weights, layer=0, head=1)
    spec = demo.heatmap_spec(matrix, attention.source_labels, attention.target_labels, "title")
    cells = spec["data"]["values"]
    assert len(cells) == matrix.size
    for cell in cells:
        assert cell["weight"] == pytest.approx(matrix[cell["t"], cell["s"]], abs=1e-4)
        assert cell["source"] == attention.source_labels[cell["s"]]
        assert cell["target"] == attention.target_labels[cell["t"]]
    assert json.dumps(attention.source_labels) in spec["encoding"]["x"]["axis"]["labelExpr"]
    assert {"field": "weight", "title": "attention", "format": ".3f"} in spec["encoding"]["tooltip"]
    assert demo.heatmap_title(attention.weights, 0, 1) == "Cross-attention, layer 1 of 2, head 2 of 4"
    assert demo.heatmap_title(attention.weights, None, None) == "Cross-attention, layer 2 of 2, mean of 4 heads"
    with pytest.raises(ValueError, match="labels"):
        demo.heatmap_spec(matrix, attention.source_labels[:-1], attention.target_labels, "title")


# ------------------------------------------------------------------------------------------ example sentences


def _card(directory: Path, languages, datasets) -> None:
    card = ModelCard(f"---\nlanguage: {json.dumps(languages)}\ndatasets: {json.dumps(datasets)}\n---\n# a model\n")
    card.save(directory / "README.md")


def test_examples_come_from_saved_test_sources_then_the_shipped_test_split_then_a_built_in_list(tmp_path):
    _card(tmp_path, ["en", "es"], [SHIPPED_DATASET_ID])
    assert demo.model_card_facts(str(tmp_path)) == (["en", "es"], [SHIPPED_DATASET_ID])
    examples, origin = demo.example_sentences(str(tmp_path), "en", [SHIPPED_DATASET_ID])
    assert "shipped corpus" in origin and examples[0] == "In the beginning, God created the heavens and the earth."
    assert SHIPPED_CORPUS_FILES["test"].is_file() and len(examples) == demo.MAX_EXAMPLES
    spanish, _ = demo.example_sentences(str(tmp_path), "es", [SHIPPED_DATASET_ID])
    assert spanish[0] == "EN el principio crió Dios los cielos y la tierra."
    (tmp_path / TEST_SOURCES_FILE).write_text("Too short.\nA saved test sentence of the run.\n\n"
                                                      "A saved test sentence of the run.\nAnd another one here.\n")
    assert demo.example_sentences(str(tmp_path), "en", [SHIPPED_DATASET_ID]) == (
        ["A saved test sentence of the run.", "And another one here."], "the run's test split (test_sources.txt)")
    other = tmp_path / "other"
    other.mkdir()
    assert demo.example_sentences(str(other), "de", ["wmt16"])[0] == demo.BUILTIN_EXAMPLES["de"]
    assert demo.example_sentences(str(other), "xx", [])[0] == []
    assert demo.model_card_facts(str(other)) == ([], [])  # no card: no languages, no failure


def test_load_demo_model_reads_languages_and_examples_from_the_card(trained_model_dir, tmp_path):
    import shutil

    directory = tmp_path / "model"
    shutil.copytree(trained_model_dir, directory)
    _card(directory, ["en", "es"], ["wmt16"])
    loaded = demo.load_demo_model(str(directory))
    assert (loaded.source_lang, loaded.target_lang) == ("en", "es")
    assert loaded.examples == demo.BUILTIN_EXAMPLES["en"] and "built-in 'en'" in loaded.examples_origin


# ------------------------------------------------------------------------------------------- the command's checks


def test_check_port_refuses_a_port_in_use_and_one_out_of_range():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(EnvironmentFault, match=f"127.0.0.1:{port}"):
            demo.check_port("127.0.0.1", port)
    demo.check_port("127.0.0.1", port)  # free again
    with pytest.raises(UsageError, match="--port must be between 1 and 65535, got 70000"):
        demo.check_port("127.0.0.1", 70000)


def test_a_space_needs_a_hub_id():
    demo.check_hub_id("owner/name")
    for name in ("owner/name/extra", "not a valid id!", "name"):
        with pytest.raises(UsageError, match="hub model id"):
            demo.check_hub_id(name)
    with pytest.raises(UsageError, match="local path"):
        demo.check_hub_id(str(REPO))


# --------------------------------------------------------------------------------- the page, through gradio_client


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Runs `python -m hf_scratch_transformer.translation.demo ARGS` with an audit hook that logs every connection and name lookup
# the process makes (sys.addaudithook: events "socket.connect" and "socket.getaddrinfo").
AUDITED_DEMO = textwrap.dedent("""
    import json, runpy, sys
    log = open(sys.argv.pop(1), "a", encoding="utf-8")
    def hook(event, args):
        if event == "socket.connect":
            log.write(json.dumps({"connect": repr(args[1])}) + "\\n"); log.flush()
        elif event == "socket.getaddrinfo":
            log.write(json.dumps({"lookup": repr(args[0])}) + "\\n"); log.flush()
    sys.addaudithook(hook)
    sys.argv[0] = "hf-scratch-demo"
    runpy.run_module("hf_scratch_transformer.translation.demo", run_name="__main__")
""")


def _wait_for_page(url: str, process: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the demo exited with {process.returncode}: {process.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"no page at {url} after {timeout} s")


def _is_loopback(text: str) -> bool:
    return any(local in text for local in ("'127.", "'localhost'", "'::1'")) or text in ("None", "b'localhost'")


@needs_gradio
def test_the_page_translates_over_http_on_127_0_0_1_and_connects_nowhere_else(trained_model_dir, model_and_tokenizer,
                                                                                tmp_path):
    from gradio_client import Client

    port, audit_log = _free_port(), tmp_path / "connections.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-c", AUDITED_DEMO, str(audit_log), "--model", str(trained_model_dir),
                                "--port", str(port), "--dtype", "float32"], env=env,  # as the fixture's model stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        _wait_for_page(f"http://127.0.0.1:{port}/", process)
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        translation, report, table, _, plot = client.predict(SENTENCE, "beam search", 4, 3, True, "God\tDios", 1,
                                                             "mean", api_name="/translate")
        second = client.predict(1, 0, "2", api_name="/show_hypothesis")
    finally:
        process.terminate()
        process.wait(timeout=30)
    model, tokenizer = model_and_tokenizer
    shown = demo.translate_text(model, tokenizer, SENTENCE, num_beams=4, num_hypotheses=3, protect=True,
                                glossary="God\tDios")
    expected = shown.hypotheses
    assert translation == expected[0].text == "En el principio creó Dios los cielos y la tierra."
    assert report == demo.text_report(shown) and "glossary: 1 of 1 term occurrence(s) honoured" in report
    assert [row[1] for row in table["data"]] == [h.text for h in expected]
    assert [row[2] for row in table["data"]] == pytest.approx([h.score for h in expected], abs=1e-3)
    assert [row[3] for row in table["data"]] == pytest.approx([h.confidence for h in expected], abs=1e-3)
    spec = json.loads(plot["plot"])
    assert spec["title"] == "Cross-attention, layer 2 of 2, mean of 4 heads"
    assert len(spec["data"]["values"]) == len(expected[0].token_ids) * len(tokenizer(SENTENCE)["input_ids"])
    second_spec = json.loads(second["plot"])
    assert second_spec["title"] == "Cross-attention, layer 1 of 2, head 3 of 4"
    assert len(second_spec["data"]["values"]) == len(expected[1].token_ids) * len(tokenizer(SENTENCE)["input_ids"])
    events = [json.loads(line) for line in audit_log.read_text().splitlines()]
    assert any("connect" in event for event in events)  # the hook saw the server's own check of its page
    outside = [event for event in events if not _is_loopback(next(iter(event.values())))]
    assert not outside, f"the demo reached beyond this machine: {outside[:5]}"


@needs_gradio
def test_the_page_is_built_offline(trained_model_dir):
    import gradio

    blocks = demo.build_demo(demo.load_demo_model(str(trained_model_dir)))
    assert isinstance(blocks, gradio.Blocks) and blocks.analytics_enabled is False
    assert os.environ["GRADIO_ANALYTICS_ENABLED"] == "False"
    options = demo.launch_options("127.0.0.1", 7860)
    assert options["share"] is False and options["ssr_mode"] is False
    theme = options["theme"]
    assert "ui-sans-serif" in theme._get_theme_css() and "@font-face" not in theme._get_theme_css()
    assert not [sheet for sheet in theme._stylesheets if "://" in str(sheet)]  # no font fetched from elsewhere
    # the check can fail: a theme with a Google font links Google's stylesheet
    google = gradio.themes.Default(font=gradio.themes.GoogleFont("Inter"))
    assert [sheet for sheet in google._stylesheets if "fonts.googleapis.com" in str(sheet)]


# ------------------------------------------------------------------------------------------------- the Space


@needs_gradio
def test_write_space_writes_an_app_that_builds_its_blocks_against_a_local_model(trained_model_dir, tmp_path):
    space = demo.write_space(tmp_path / "space", "someone/en-es-model")
    card = SpaceCard.load(space / "README.md")
    assert (card.data.sdk, card.data.app_file, card.data.models) == ("gradio", "app.py", ["someone/en-es-model"])
    assert card.data.sdk_version == __import__("gradio").__version__
    requirements = (space / "requirements.txt").read_text().splitlines()
    assert any(line.startswith("torch") for line in requirements) and not any("extra" in r for r in requirements)
    assert "'someone/en-es-model'" in (space / "app.py").read_text()
    assert not list(space.parent.glob(".space.staging-*"))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env[demo.MODEL_ENV_VAR] = str(trained_model_dir)
    probe = ("import app, gradio, hf_scratch_transformer; "
             "print(type(app.demo).__name__, isinstance(app.demo, gradio.Blocks), hf_scratch_transformer.__file__)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=space, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    kind, is_blocks, package_file = result.stdout.split()
    assert (kind, is_blocks) == ("Blocks", "True")
    assert Path(package_file).resolve().is_relative_to(space.resolve())  # the Space's copy of the package


@needs_gradio
def test_write_space_keeps_what_is_there(tmp_path):
    space = tmp_path / "space"
    space.mkdir()
    (space / "app.py").write_text("my own app\n")
    with pytest.raises(UsageError, match="already holds app.py"):
        demo.write_space(space, "someone/model")
    assert (space / "app.py").read_text() == "my own app\n" and sorted(os.listdir(space)) == ["app.py"]


def test_a_host_that_does_not_resolve_is_refused_without_a_port_before_anything_is_loaded():
    """Without --port the web server would retry the address on every port from 7860 and never exit."""
    with pytest.raises(UsageError, match=r"--host a-name-that-does-not-resolve\.invalid is not an address"):
        demo.check_port("a-name-that-does-not-resolve.invalid", None)
    with pytest.raises(EnvironmentFault, match="cannot listen on 192.0.2.1 "):  # TEST-NET-1: not this machine's
        demo.check_port("192.0.2.1", None)


@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat16_products", "int8"])
def test_the_demo_loads_the_weights_in_the_dtype_asked_and_translates_as_the_api_there(trained_model, dtype):
    """`--dtype bfloat16`, `bfloat16_products` or `int8` (load_demo_model's dtype): the weights in bf16, or in fp32
    with the decoding loops' bf16 or int8 copies; the same translation and scores as the Python API gives with such a
    copy of the model."""
    model, tokenizer, directory = trained_model
    loaded = demo.load_demo_model(str(directory), dtype=dtype)
    weights = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    assert {parameter.dtype for parameter in loaded.model.parameters()} == {weights}
    assert hasattr(loaded.model, "decoding_weights") == (dtype != "bfloat16")
    copied = copy.deepcopy(model)
    if dtype == "int8":
        quantize_for_decoding(copied, decoding_encoder_dtype())
    elif dtype == "bfloat16_products":
        bf16_products_for_decoding(copied, decoding_encoder_dtype())
    shown = demo.translate_text(loaded.model, loaded.tokenizer, SENTENCE, num_beams=4, num_hypotheses=2)
    expected = demo.translate_text(copied.to(weights), tokenizer, SENTENCE, num_beams=4, num_hypotheses=2)
    assert [(h.text, h.score) for h in shown.hypotheses] == [(h.text, h.score) for h in expected.hypotheses]
    assert shown.hypotheses[0].text
