"""`hf-scratch-demo`: a web page to try a trained model, and a Gradio Space in one command.

    hf-scratch-demo --model runs/en-es                         # http://127.0.0.1:7860 (the first free port from 7860)
    hf-scratch-demo --model runs/en-es --host 0.0.0.0 --port 8080
    hf-scratch-demo --write_space space/ --model owner/en-es    # a folder to push as a Gradio Space

The page translates typed or pasted text (a sentence or a few paragraphs) with greedy or beam search through the
package's translation core, shows the translation with its confidence, lists the n best hypotheses with their scores,
protects placeholders, markup and URLs (a toggle), honours a glossary typed or pasted as TSV lines, and draws the
cross-attention of the hypothesis chosen as an interactive heatmap (source tokens across, generated tokens down;
one layer, one head or the mean of the heads; the weight of a cell shows on hover). It starts offline: no
analytics, no share link, system fonts, and it listens on 127.0.0.1 unless `--host` says otherwise.

The logic is plain functions, testable without a browser: `translate_text`, `first_sentence`, `attention_view`,
`heatmap_matrix`, `heatmap_spec`, `text_report`, `example_sentences`, `write_space`. `build_demo` only lays them out
with Gradio, which is an optional dependency: `pip install "hf-scratch-transformer[demo]"` (in a clone: `pip install
-e ".[demo]"`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from ..data.tokenization import language_pair
from ..errors import EnvironmentFault, UsageError, run_command
from ..glossary import parse_glossary
from ..protected_spans import tokenizer_has_sentinels
from .translate import TEST_SOURCES_FILE, load_model_and_tokenizer, pick_device
from ..translation_core import DecodingOptions, TextOptions, TextTranslation, TorchBackend, translate_texts

PROGRAM = "hf-scratch-demo"
DEFAULT_HOST = "127.0.0.1"
MODEL_ENV_VAR = "HF_SCRATCH_DEMO_MODEL"  # the model a Space's app.py loads (a hub id or a local directory)
MAX_EXAMPLES = 6
MAX_BEAMS = 8
INSTALL_HINT = "pip install 'hf-scratch-transformer[demo]' (in a clone: pip install -e '.[demo]')"
SYSTEM_FONTS = ("ui-sans-serif", "system-ui", "Segoe UI", "Roboto", "Helvetica", "Arial", "sans-serif")
SYSTEM_MONO_FONTS = ("ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "Liberation Mono", "monospace")

# Used when the run saved no test sources and its corpus is not the shipped one; keyed by source language.
BUILTIN_EXAMPLES = {
    "en": ["In the beginning God created the heavens and the earth.", "God said, “Let there be light.”",
           "Jesus wept.", "The light shines in the darkness.", "Love your neighbor as yourself."],
    "es": ["En el principio creó Dios los cielos y la tierra.", "Y dijo Dios: Sea la luz: y fué la luz.",
           "Y lloró Jesús.", "La luz en las tinieblas resplandece.", "Amarás a tu prójimo como a ti mismo."],
    "fr": ["Au commencement, Dieu créa les cieux et la terre.", "Dieu dit: Que la lumière soit! Et la lumière fut.",
           "Jésus pleura.", "La lumière luit dans les ténèbres."],
    "de": ["Am Anfang schuf Gott Himmel und Erde.", "Und Gott sprach: Es werde Licht! und es ward Licht.",
           "Jesus weinte.", "Das Licht scheint in der Finsternis."],
}


# --------------------------------------------------------------------------------------------------------------
# Translation and attention, through the translation core (the CLI's and the pipeline's)
# --------------------------------------------------------------------------------------------------------------
def translate_text(model, tokenizer, text: str, num_beams: int = 1, num_hypotheses: int = 1,
                   protect: bool | None = None, glossary: str = "") -> TextTranslation:
    """`text` translated as hf-scratch-translate translates a line: its `num_hypotheses` best translations
    (`.hypotheses`, best first, with scores and confidence), the best (`.text`, `.confidence`), what became of its
    protected spans and glossary terms (`.spans`, `.glossary`). Greedy search when `num_beams` is 1, else beam
    search. `protect`: None for the model's default (on for a model trained with sentinels); `glossary`: TSV lines
    `source term<TAB>target term` (GlossaryError, one line naming the line, when one is malformed)."""
    if not text.strip():
        raise ValueError("the text to translate is empty")
    options = DecodingOptions(num_beams=num_beams, num_return_sequences=num_hypotheses, with_scores=True)
    terms = parse_glossary(glossary, "the glossary") if glossary.strip() else None
    reading = TextOptions(protect=protect, glossary=terms if terms else None)
    [translation] = translate_texts(TorchBackend(model), tokenizer, [text], options, reading)
    return translation


def first_sentence(translation: TextTranslation, rank: int = 0) -> tuple[str, list[int]]:
    """(what the model read, the token ids it wrote) of the first sentence of `translation` that the model
    translated, in its `rank`-th hypothesis: what the heatmap shows (one sentence: attention is per sentence)."""
    for segment in translation.segments:
        hypothesis = segment.hypotheses[min(rank, len(segment.hypotheses) - 1)]
        if hypothesis.token_ids:
            return segment.model_text, hypothesis.token_ids
    raise ValueError("nothing of this text went to the model (only white space or protected spans)")


def text_report(translation: TextTranslation) -> str:
    """One line for the page: the confidence, how many sentences, and what became of spans and glossary terms."""
    parts = [f"confidence {translation.confidence:.3f} (mean log-probability per token: 0 is certain; each token "
             f"{math.exp(translation.confidence):.0%} likely on average)" if translation.confidence is not None
             else "confidence: none (nothing was translated)"]
    translated = [segment for segment in translation.segments if segment.hypotheses[0].token_ids]
    if len(translated) > 1:
        parts.append(f"{len(translated)} sentences, translated one by one (the heatmap shows the first)")
    if translation.spans:
        parts.append(f"{len(translation.spans)} protected span(s), each put back once")
    if translation.glossary:
        missed = [entry["source"] for entry in translation.glossary if not entry["honoured"]]
        parts.append(f"glossary: {len(translation.glossary) - len(missed)} of {len(translation.glossary)} term "
                     f"occurrence(s) honoured" + (f", not: {', '.join(missed)}" if missed else ""))
    return "; ".join(parts)


@dataclass
class AttentionView:
    """Cross-attention of one hypothesis: `weights` (layers, heads, T target tokens, S source tokens) and a
    readable label per token."""

    weights: np.ndarray
    source_labels: list[str]
    target_labels: list[str]


def attention_view(model, tokenizer, text: str, token_ids: list[int]) -> AttentionView:
    """What the decoder attended to in `text` while generating `token_ids` (one teacher-forced pass)."""
    from ..plotting import token_labels
    from ..translation_core import cross_attention_matrices

    weights = cross_attention_matrices(model, tokenizer, text, token_ids).numpy()
    source_ids = tokenizer(text, truncation=True)["input_ids"][: weights.shape[-1]]
    return AttentionView(weights, token_labels(tokenizer, source_ids), token_labels(tokenizer, token_ids))


# --------------------------------------------------------------------------------------------------------------
# Heatmap data
# --------------------------------------------------------------------------------------------------------------
def heatmap_matrix(weights: np.ndarray, layer: int | None = None, head: int | None = None) -> np.ndarray:
    """(T, S) attention of one layer (the last when None) and one head (the mean of the heads when None), from
    `weights` of shape (layers, heads, T, S). Each row sums to 1 (one generated token's attention)."""
    layers, heads = weights.shape[:2]
    layer = layers - 1 if layer is None else layer
    if not -layers <= layer < layers or (head is not None and not -heads <= head < heads):
        raise ValueError(f"layer {layer} / head {head} out of range for {layers} layers and {heads} heads")
    per_head = weights[layer]  # (heads, T, S)
    return per_head.mean(axis=0) if head is None else per_head[head]


def heatmap_title(weights: np.ndarray, layer: int | None, head: int | None) -> str:
    layers, heads = weights.shape[:2]
    layer = layers - 1 if layer is None else layer % layers
    which = f"mean of {heads} heads" if head is None else f"head {head % heads + 1} of {heads}"
    return f"Cross-attention, layer {layer + 1} of {layers}, {which}"


def heatmap_spec(matrix: np.ndarray, source_labels: list[str], target_labels: list[str], title: str) -> dict:
    """A Vega-Lite heatmap of `matrix` (T, S): source tokens across, generated tokens down, the weight of a cell
    in its tooltip. Tokens are placed by position (a token may occur twice) and labelled with their text."""
    target_length, source_length = matrix.shape
    if (len(target_labels), len(source_labels)) != matrix.shape:
        raise ValueError(f"{len(target_labels)} x {len(source_labels)} labels for a {matrix.shape} matrix")
    cell = max(14, min(34, 720 // max(source_length, 1)))  # pixels per token
    values = [{"s": s, "t": t, "source": source_labels[s], "target": target_labels[t],
               "weight": round(float(matrix[t, s]), 4)} for t in range(target_length) for s in range(source_length)]

    def axis(title: str, labels: list[str], angle: int) -> dict:
        return {"title": title, "labelAngle": angle, "labelExpr": f"{json.dumps(labels)}[datum.value]"}

    return {
        "title": title,
        "width": cell * source_length,
        "height": cell * target_length,
        "data": {"values": values},
        "mark": {"type": "rect", "tooltip": True},
        # vega-embed's options: draw in SVG (cells and labels in the page), no menu of links to online editors
        "usermeta": {"embedOptions": {"renderer": "svg", "actions": False}},
        "encoding": {
            "x": {"field": "s", "type": "ordinal",
                  "axis": axis("source tokens (▁ starts a word)", source_labels, -50)},
            "y": {"field": "t", "type": "ordinal", "axis": axis("generated tokens", target_labels, 0)},
            "color": {"field": "weight", "type": "quantitative", "title": "attention",
                      "scale": {"scheme": "viridis", "domain": [0, max(float(matrix.max()), 1e-6)]}},
            "tooltip": [{"field": "target", "title": "generated token"}, {"field": "source", "title": "source token"},
                        {"field": "weight", "title": "attention", "format": ".3f"}],
        },
    }


# --------------------------------------------------------------------------------------------------------------
# The model, its languages and example sentences
# --------------------------------------------------------------------------------------------------------------
@dataclass
class DemoModel:
    model: object
    tokenizer: object
    name: str
    source_lang: str | None
    target_lang: str | None
    examples: list[str]
    examples_origin: str


def model_card_facts(name: str) -> tuple[list[str], list[str]]:
    """(languages, dataset ids) from the model card (README.md) of a directory or hub model: train.py writes
    `language: [source, target]`. Empty lists when there is no readable card."""
    from huggingface_hub import ModelCard

    path = Path(name).expanduser()
    try:
        card = ModelCard.load(path / "README.md" if path.is_dir() else name)
    except Exception:  # noqa: BLE001  (no card, unreadable YAML, hub unreachable: the demo runs without it)
        return [], []
    return _as_list(card.data.language), _as_list(card.data.datasets)


def _as_list(value) -> list[str]:
    """A card field that may be one string, a list or missing, as a list."""
    return [value] if isinstance(value, str) else list(value or [])


def pick_examples(lines: list[str]) -> list[str]:
    """Up to MAX_EXAMPLES distinct sentences of a readable length (15 to 120 characters), in order."""
    picked = []
    for line in (line.strip() for line in lines):
        if 15 <= len(line) <= 120 and line not in picked:
            picked.append(line)
        if len(picked) == MAX_EXAMPLES:
            break
    return picked


def example_sentences(name: str, source_lang: str | None, datasets: list[str]) -> tuple[list[str], str]:
    """(example sentences, where they come from): the test sources the run saved (TEST_SOURCES_FILE), else the
    test split of the shipped corpus when the model was trained on it, else a built-in list in the source language."""
    from ..data.loading import SHIPPED_CORPUS_FILES, SHIPPED_DATASET_ID

    saved = Path(name).expanduser() / TEST_SOURCES_FILE
    if saved.is_file():
        examples = pick_examples(saved.read_text(encoding="utf-8", errors="replace").splitlines())
        if examples:
            return examples, f"the run's test split ({TEST_SOURCES_FILE})"
    if SHIPPED_DATASET_ID in datasets and source_lang in ("en", "es"):
        if SHIPPED_CORPUS_FILES["test"].is_file():
            with gzip.open(SHIPPED_CORPUS_FILES["test"], "rt", encoding="utf-8") as lines:
                sources = [json.loads(line)["translation"][source_lang] for _, line in zip(range(200), lines)]
            return pick_examples(sources), "the test split of the shipped corpus, which the model was tested on"
    if source_lang in BUILTIN_EXAMPLES:
        return list(BUILTIN_EXAMPLES[source_lang]), f"the demo's built-in {source_lang!r} sentences"
    return [], "none: the model card names no source language the demo has sentences for"


def load_demo_model(name: str, device: torch.device | str | None = None, dtype: str = "auto") -> DemoModel:
    """The model and tokenizer (`ModelLoadError` with the CLI's one-line messages) in `dtype` (the CLI's --dtype),
    its languages and examples."""
    model, tokenizer = load_model_and_tokenizer(name, device, dtype=dtype)
    languages, datasets = model_card_facts(name)
    # the pair saved with the tokenizer (train.py writes it), else the model card's first two languages
    saved_pair = language_pair(tokenizer)
    source_lang, target_lang = saved_pair if all(saved_pair) else (languages + [None, None])[:2]
    examples, origin = example_sentences(name, source_lang, datasets)
    return DemoModel(model, tokenizer, name, source_lang, target_lang, examples, origin)


# --------------------------------------------------------------------------------------------------------------
# The page (Gradio): layout and callbacks only
# --------------------------------------------------------------------------------------------------------------
def import_gradio():
    """gradio, with its analytics off; UsageError saying how to install it when it is missing."""
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # read by gradio at import and at launch
    try:
        import gradio
    except ImportError as error:
        raise UsageError(f"the demo needs gradio, which cannot be imported ({error}): {INSTALL_HINT}") from None
    return gradio


def head_choices(heads: int) -> list[tuple[str, str]]:
    return [(f"mean of the {heads} heads", "mean")] + [(f"head {h + 1}", str(h)) for h in range(heads)]


def parse_head(choice: str | None) -> int | None:
    return None if choice in (None, "", "mean") else int(choice)


class DemoActions:
    """What the page's events do, as plain methods over a `DemoModel` (the Gradio callbacks call them)."""

    def __init__(self, demo_model: DemoModel):
        self.demo_model = demo_model

    def translate(self, text: str, decoding: str, beams: int, count: int, protect: bool = True,
                  glossary: str = "") -> TextTranslation:
        num_beams = 1 if decoding == "greedy" else max(2, min(int(beams), MAX_BEAMS))
        return translate_text(self.demo_model.model, self.demo_model.tokenizer, text, num_beams,
                              min(max(int(count), 1), num_beams), bool(protect), glossary or "")

    def attention(self, translation: TextTranslation, rank: int = 0) -> AttentionView:
        """The attention of the first sentence of hypothesis `rank`, over what the model read."""
        model_text, token_ids = first_sentence(translation, rank)
        return attention_view(self.demo_model.model, self.demo_model.tokenizer, model_text, token_ids)

    @staticmethod
    def heatmap(view: AttentionView, layer: int | str | None, head: str | None) -> dict:
        layer_index = None if layer in (None, "") else int(layer)
        head_index = parse_head(head)
        matrix = heatmap_matrix(view.weights, layer_index, head_index)
        return heatmap_spec(matrix, view.source_labels, view.target_labels,
                            heatmap_title(view.weights, layer_index, head_index))

    @staticmethod
    def table(translation: TextTranslation) -> list[list]:
        return [[rank + 1, h.text, round(h.score, 4), round(h.confidence, 4), len(h.token_ids)]
                for rank, h in enumerate(translation.hypotheses)]


def offline_theme(gradio):
    """Gradio's default theme with system fonts: nothing for the page to fetch from a font server."""
    return gradio.themes.Default(font=list(SYSTEM_FONTS), font_mono=list(SYSTEM_MONO_FONTS))


def launch_options(host: str | None = None, port: int | None = None) -> dict:
    """`Blocks.launch` keywords: no share link, no server-side rendering (a Node.js process), system fonts.
    host/port None: Gradio's defaults (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT, else 127.0.0.1 and the first free
    port from 7860), which is what a Space wants."""
    return {"server_name": host, "server_port": port, "share": False, "ssr_mode": False, "show_error": True,
            "theme": offline_theme(import_gradio())}


def _plot(spec: dict):
    """A gr.Plot value: Gradio's front end draws a Vega-Lite spec given as an "altair" plot (no altair needed)."""
    from gradio.components.plot import PlotData

    return PlotData(type="altair", plot=json.dumps(spec))


def _page_intro(demo_model: DemoModel) -> str:
    direction = f" ({demo_model.source_lang} → {demo_model.target_lang})" if demo_model.source_lang else ""
    return (f"## hf-scratch-transformer: `{demo_model.name}`{direction}\n"
            "Type or paste a sentence (or paragraphs) and press **Translate**. The confidence is the mean "
            "log-probability per token of the translation; the n-best table lists the hypotheses with their score "
            "(beam search's ranking). Placeholders, markup and URLs are protected when the box is ticked; a glossary "
            "(one `source term<TAB>target term` per line) pins terms. Choose a hypothesis to see what the decoder "
            "attended to while writing its first sentence; hover over a cell of the heatmap for its weight.")


def default_beams(model) -> int:
    """The page's beam size at start: the model's generation_config's when it uses beam search, else 4."""
    num_beams = getattr(model.generation_config, "num_beams", None) or 1
    return min(num_beams, MAX_BEAMS) if num_beams > 1 else 4


def build_demo(demo_model: DemoModel):
    """The page as a `gradio.Blocks` (not launched)."""
    gr = import_gradio()
    layers, heads = demo_model.model.config.decoder_layers, demo_model.model.config.decoder_attention_heads
    beams = default_beams(demo_model.model)
    language = f" ({demo_model.source_lang})" if demo_model.source_lang else ""
    ui = {}
    with gr.Blocks(title=f"hf-scratch-transformer: {demo_model.name}", analytics_enabled=False) as blocks:
        gr.Markdown(_page_intro(demo_model))
        with gr.Row():
            with gr.Column(scale=2):
                ui["source"] = gr.Textbox(label=f"Source text{language}", lines=4, elem_id="source")
                with gr.Row():
                    ui["decoding"] = gr.Radio(["greedy", "beam search"], value="beam search", label="Decoding")
                    ui["beams"] = gr.Slider(2, MAX_BEAMS, value=beams, step=1, label="Beams")
                    ui["count"] = gr.Slider(1, MAX_BEAMS, value=min(3, beams), step=1, label="Hypotheses (n-best)")
                with gr.Row():
                    ui["protect"] = gr.Checkbox(value=tokenizer_has_sentinels(demo_model.tokenizer),
                                                label="Protect placeholders, markup, URLs, e-mail addresses",
                                                elem_id="protect")
                    ui["glossary"] = gr.Textbox(label="Glossary: source term<TAB>target term per line", lines=2,
                                                elem_id="glossary")
                ui["button"] = gr.Button("Translate", variant="primary", elem_id="translate")
                if demo_model.examples:
                    gr.Examples([[text] for text in demo_model.examples], inputs=[ui["source"]],
                                label=f"Examples, from {demo_model.examples_origin}")
            with gr.Column(scale=3):
                ui["translation"] = gr.Textbox(label="Translation (best hypothesis)", interactive=False,
                                               elem_id="translation")
                ui["report"] = gr.Textbox(label="Confidence, spans and glossary", interactive=False,
                                          elem_id="confidence")
                ui["table"] = gr.Dataframe(headers=["#", "translation", "score", "confidence", "tokens"],
                                           label="n-best list", interactive=False, wrap=True, elem_id="nbest",
                                           column_widths=["6%", "54%", "14%", "14%", "12%"])
        with gr.Row():
            ui["chosen"] = gr.Dropdown(choices=[("1", 0)], value=0, label="Attention of hypothesis #",
                                       elem_id="hypothesis")
            ui["layer"] = gr.Dropdown([(f"layer {i + 1}", i) for i in range(layers)], value=layers - 1, label="Layer",
                                      elem_id="layer")
            ui["head"] = gr.Dropdown(head_choices(heads), value="mean", label="Head", elem_id="head")
        ui["heatmap"] = gr.Plot(label="Cross-attention (generated tokens × source tokens)", elem_id="heatmap")
        _wire_events(gr, DemoActions(demo_model), ui)
    return blocks


def _wire_events(gr, actions: DemoActions, ui: dict) -> None:
    """Translate → translation, confidence, n-best table, heatmap of hypothesis 1; a hypothesis, layer or head
    chosen → heatmap. The model's events share one queue (`concurrency_id`): the attention pass switches its
    attention kernel."""
    translated, view_state = gr.State(None), gr.State(None)  # the last TextTranslation, the heatmap's weights

    def on_translate(text, decoding, beams, count, protect, glossary, layer, head):
        if not text or not text.strip():
            raise gr.Error("Type or paste a sentence to translate first.")
        try:
            translation = actions.translate(text, decoding, beams, count, protect, glossary)
        except UsageError as error:  # a malformed glossary line, named
            raise gr.Error(str(error)) from None
        try:
            view = actions.attention(translation)
        except ValueError:  # only protected spans went to the model: the translation, no heatmap
            view = None
        choices = [(str(rank + 1), rank) for rank in range(len(translation.hypotheses))]
        return (translation.text, text_report(translation), actions.table(translation),
                gr.Dropdown(choices=choices, value=0), translation, view,
                None if view is None else _plot(actions.heatmap(view, layer, head)))

    def on_choose(last, chosen, layer, head):
        if not last or chosen is None or not 0 <= int(chosen) < len(last.hypotheses):
            return None, None
        try:
            view = actions.attention(last, int(chosen))
        except ValueError:
            return None, None
        return view, _plot(actions.heatmap(view, layer, head))

    def on_view(view, layer, head):
        return None if view is None else _plot(actions.heatmap(view, layer, head))

    inputs = [ui["source"], ui["decoding"], ui["beams"], ui["count"], ui["protect"], ui["glossary"], ui["layer"],
              ui["head"]]
    outputs = [ui["translation"], ui["report"], ui["table"], ui["chosen"], translated, view_state, ui["heatmap"]]
    ui["button"].click(on_translate, inputs, outputs, api_name="translate", concurrency_id="model")
    ui["source"].submit(on_translate, inputs, outputs, api_name=False, concurrency_id="model")
    ui["chosen"].input(on_choose, [translated, ui["chosen"], ui["layer"], ui["head"]], [view_state, ui["heatmap"]],
                       api_name="show_hypothesis", concurrency_id="model")
    for control in (ui["layer"], ui["head"]):
        control.input(on_view, [view_state, ui["layer"], ui["head"]], [ui["heatmap"]], api_name=False)


# --------------------------------------------------------------------------------------------------------------
# A Gradio Space in one command
# --------------------------------------------------------------------------------------------------------------
SPACE_APP = '''"""Gradio Space: the hf-scratch-transformer demo of {model_id}.

The model is loaded by hub id; the environment variable {env_var} (a hub id or a local
directory) loads another one. hf_scratch_transformer/ beside this file is a copy of the package
(version {version}) that wrote this Space.
"""

import os

from hf_scratch_transformer.translation.demo import MODEL_ENV_VAR, build_demo, launch_options, load_demo_model

MODEL = os.environ.get(MODEL_ENV_VAR, {model_id!r})
demo = build_demo(load_demo_model(MODEL))

if __name__ == "__main__":
    demo.launch(**launch_options())
'''


def check_hub_id(name: str) -> None:
    """A Space loads its model from the hub: `name` must be an `owner/name` id, not a local directory."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(name).expanduser().exists():
        raise UsageError(f"--model {name} is a local path, but a Space loads its model from the hub: push the model "
                         f"(train.py --push_to_hub --hub_model_id owner/name) and give --model owner/name")
    try:
        validate_repo_id(name)
    except HFValidationError as error:
        raise UsageError(f"--model {name!r} is not a hub model id such as owner/name ({error})") from None
    if name.count("/") != 1:
        raise UsageError(f"--model {name!r} is not a hub model id of the form owner/name")


def space_files(model_id: str) -> dict[str, str]:
    """{file name: text} of the Space: app.py, requirements.txt (the package's dependencies, as installed) and a
    README.md whose front matter (`sdk: gradio`, the Gradio version installed here, `app_file`) Spaces read."""
    from huggingface_hub import SpaceCardData

    from .. import __version__

    requirements = [line for line in metadata.requires("hf-scratch-transformer") or [] if "extra ==" not in line]
    card = SpaceCardData(title=f"{model_id.split('/')[-1]} translation demo", emoji="🔤", colorFrom="indigo",
                         colorTo="blue", sdk="gradio", sdk_version=metadata.version("gradio"), app_file="app.py",
                         python_version=f"{sys.version_info.major}.{sys.version_info.minor}", models=[model_id],
                         license="apache-2.0", pinned=False, short_description="Translate, n-best, cross-attention")
    readme = (f"---\n{card.to_yaml()}\n---\n\n# {model_id}: translation demo\n\nTranslate with greedy or beam search, "
              f"see the n-best list with scores and the cross-attention of each hypothesis. Written by "
              f"`hf-scratch-demo --write_space` (hf-scratch-transformer {__version__}); the model is "
              f"[{model_id}](https://huggingface.co/{model_id}). `hf_scratch_transformer/` is a copy of that "
              f"package.\n")
    app = SPACE_APP.format(model_id=model_id, env_var=MODEL_ENV_VAR, version=__version__)
    return {"app.py": app, "requirements.txt": "\n".join(requirements) + "\n", "README.md": readme}


SPACE_ENTRIES = ("app.py", "requirements.txt", "README.md", "hf_scratch_transformer")  # what write_space writes


def check_space_target(directory: str | os.PathLike, model_id: str) -> Path:
    """The folder a Space is written into, if `model_id` is a hub id and the folder holds none of SPACE_ENTRIES
    (UsageError otherwise: nothing already there is replaced)."""
    check_hub_id(model_id)
    target = Path(directory).expanduser()
    taken = [name for name in SPACE_ENTRIES if (target / name).exists() or (target / name).is_symlink()]
    if taken:
        raise UsageError(f"{target} already holds {', '.join(taken)}: write the Space into a new or empty folder")
    return target


def write_space(directory: str | os.PathLike, model_id: str) -> Path:
    """Write a Gradio Space for `model_id` into `directory` (created if needed): app.py, requirements.txt,
    README.md and a copy of this package (its code, without the shipped corpus's train and validation splits).
    The entries are staged beside `directory` and moved in once all are written: a failure leaves it as it was."""
    from ..data.loading import SHIPPED_CORPUS_FILES

    target = check_space_target(directory, model_id)
    files = space_files(model_id)
    package = Path(__file__).resolve().parents[1]  # the whole hf_scratch_transformer package
    skipped = ["__pycache__", "*.pyc", *(SHIPPED_CORPUS_FILES[split].name for split in ("train", "validation"))]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))
        try:
            for name, text in files.items():
                (staging / name).write_text(text, encoding="utf-8")
            shutil.copytree(package, staging / "hf_scratch_transformer", ignore=shutil.ignore_patterns(*skipped))
            target.mkdir(exist_ok=True)
            for name in SPACE_ENTRIES:
                os.replace(staging / name, target / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as error:
        reason = ("a file stands where a folder is needed" if isinstance(error, (FileExistsError, NotADirectoryError))
                  else error.strerror or str(error))
        where = f" ({error.filename})" if error.filename else ""
        raise EnvironmentFault(f"cannot write the Space into {target}: {reason}{where}") from None
    return target


# --------------------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description="A web page to try a model: translation (greedy or beam search) with its confidence, the n-best "
        "list with scores, protected placeholders and markup, a glossary, and the cross-attention of each hypothesis "
        "as an interactive heatmap. Starts offline, on 127.0.0.1.",
        epilog="examples:\n  hf-scratch-demo --model runs/en-es\n  hf-scratch-demo --model runs/en-es --port 8080\n"
        "  hf-scratch-demo --write_space space/ --model owner/en-es",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", "-m", required=True, metavar="DIR",
                        help="directory written by save_pretrained (or a hub id, where the hub is reachable); with "
                        "--write_space: the hub id (owner/name) the Space loads")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to listen on (default: {DEFAULT_HOST}, this machine only; 0.0.0.0: every "
                        "network interface)")
    parser.add_argument("--port", type=int, metavar="N",
                        help="port to listen on (default: the first free one from 7860)")
    parser.add_argument("--device", metavar="DEVICE", help="cpu, cuda, mps... (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "bfloat16_products", "int8"),
                        default="auto",
                        help="the weights' dtype while translating, as hf-scratch-translate's --dtype (default auto)")
    parser.add_argument("--write_space", metavar="DIR",
                        help="instead of starting the page, write a Gradio Space (app.py, requirements.txt, README.md) "
                        "into DIR, loading --model from the hub")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    return parser


def check_port(host: str, port: int | None) -> None:
    """Refuse, before the model is loaded, a port out of range or a --host that names no address (UsageError), and
    an address this process cannot listen on (EnvironmentFault: a port in use, an address that is not this
    machine's). Without --port the address alone is tried (port 0): the web server would otherwise retry it on
    every port from 7860, one error line each, and never exit."""
    if port is not None and not 1 <= port <= 65535:
        raise UsageError(f"--port must be between 1 and 65535, got {port}")
    try:
        family = socket.getaddrinfo(host, port or 0, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as error:
        raise UsageError(f"--host {host} is not an address ({error.strerror}): give an address of this machine, "
                         f"127.0.0.1 (this machine only) or 0.0.0.0 (every network interface)") from None
    where = f"{host}:{port}" if port is not None else host
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the web server does
            probe.bind((host, port or 0))
    except OSError as error:
        raise EnvironmentFault(f"cannot listen on {where} ({error.strerror or error}): the port is in use "
                               f"or the address is not this machine's; choose another --port or --host") from None


def _run(args: argparse.Namespace) -> int:
    """Values first (port, device, Space folder), then gradio, then the model: a mistake fails in a second."""
    if args.write_space:
        check_space_target(args.write_space, args.model)
        import_gradio()
        target = write_space(args.write_space, args.model)
        print(f"Space written to {target}; try it here with `cd {target} && python app.py`, and push it with "
              f"`hf upload --repo-type space OWNER/SPACE_NAME {target}`", file=sys.stderr)
        return 0
    check_port(args.host, args.port)
    try:
        device = pick_device(args.device)
    except ValueError as error:
        raise UsageError(str(error)) from None
    import_gradio()
    blocks = build_demo(load_demo_model(args.model, device, args.dtype))
    try:
        blocks.launch(**launch_options(args.host, args.port))
    except OSError as error:
        raise EnvironmentFault(f"cannot start the web server on {args.host}:{args.port}: {error}") from None
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command with `argv` (default: sys.argv[1:]); returns the exit status (errors.exit_code: 2 for what the
    user can fix, 1 for what the machine refused)."""
    args = build_parser().parse_args(argv)
    return run_command(PROGRAM, lambda: _run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
