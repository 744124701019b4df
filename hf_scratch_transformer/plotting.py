"""Figures: what the decoder attends to in the source (cross-attention heatmaps), and training curves.

Figures are drawn with matplotlib's object-oriented API on its Agg canvas (no pyplot, no global backend switched), so
it works on servers without a display and leaves a program's own matplotlib settings alone. The attention weights
come from `translation_core.cross_attention_matrices` (also importable from here). A figure is written to a
temporary file beside `path` and renamed into place: a failed write (full disk) leaves no half-written PNG.

    >>> matrices = cross_attention_matrices(model, tokenizer, "Jesus wept.", target_ids)      # doctest: +SKIP
    >>> matrices.shape                                  # (layers, heads, target tokens, source tokens)
    >>> plot_attention(matrices, source_labels, target_labels, "attention.png")                # doctest: +SKIP
"""

from __future__ import annotations

import codecs
import math
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .translation_core import cross_attention_matrices, without_start_token

WORD_START = "▁"  # prefixed to tokens that begin a word (the SentencePiece convention)
DPI = 100


# --------------------------------------------------------------------------------------------------------------
# Readable labels for subword tokens
# --------------------------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    characters = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return {chr(character): byte for byte, character in zip(printable, characters)}


def token_labels(tokenizer, ids) -> list[str]:
    """Readable tick labels for token ids: one label per id, word starts marked with "▁".

    Byte-level BPE tokens ("Ġcre", "Ã³") are turned back into bytes and decoded as UTF-8 incrementally, so an
    accented letter split over two tokens is shown on the token that completes it ("…" marks a token made only
    of the first bytes of a character). Special tokens keep their names (`</s>`). Other tokenizers (SentencePiece
    "▁" or WordPiece "##") are shown via `convert_tokens_to_string`.
    """
    ids = torch.as_tensor(ids).flatten().tolist()
    tokens = tokenizer.convert_ids_to_tokens(ids)
    special = set(getattr(tokenizer, "all_special_ids", []))
    byte_decoder = _byte_decoder()
    backend_decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if backend_decoder is not None:
        byte_level = "ByteLevel" in repr(backend_decoder)
    else:  # a slow tokenizer: guess from the alphabet
        byte_level = all(t is None or i in special or all(c in byte_decoder for c in t) for i, t in zip(ids, tokens))
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    labels, next_is_word_start = [], True
    for token_id, token in zip(ids, tokens):
        if token is None or token_id in special:
            labels.append(token if token is not None else f"<{token_id}>")
            decoder.reset()
            next_is_word_start = True
            continue
        if byte_level:
            text = decoder.decode(bytes(byte_decoder.get(c, 0x3F) for c in token))
        else:
            text = tokenizer.convert_tokens_to_string([token])
            if token.startswith(("▁", "Ġ")) and not text[:1].isspace():
                text = " " + text
            if token.startswith("##"):
                text = token[2:]
        word_start = next_is_word_start or text[:1].isspace()
        next_is_word_start = False
        if not text:  # only the first bytes of a character: it is shown on the token that completes it
            labels.append("…")
            next_is_word_start = word_start
            continue
        if not text.strip():  # a token of white space alone: the next token starts a word
            labels.append("␣" if text == " " else repr(text)[1:-1])
            next_is_word_start = True
            continue
        text = text.strip().replace("\n", "\\n").replace("\t", "\\t")
        labels.append(WORD_START + text if word_start else text)
    return labels


# --------------------------------------------------------------------------------------------------------------
# Attention heatmaps
# --------------------------------------------------------------------------------------------------------------
CELL = 0.32  # inches per token in the main heatmap
PANEL = 1.6  # inches per side of one small layer/head panel (longest side)


def attention_figure_size(target_length: int, source_length: int, layers: int, heads: int) -> tuple[float, float]:
    """(width, height) in inches of the figure `plot_attention` draws; the PNG is this times DPI pixels."""
    main_width = 2.6 + CELL * source_length + 1.0  # target labels, cells, colour bar
    main_height = 1.8 + CELL * target_length + 1.6  # title, cells, rotated source labels
    panel_width = PANEL * min(1.0, max(0.35, source_length / max(target_length, 1)))
    panel_height = PANEL * min(1.0, max(0.35, target_length / max(source_length, 1)))
    grid_width = 1.0 + heads * (panel_width + 0.25)
    grid_height = 0.8 + layers * (panel_height + 0.35)
    return round(max(main_width, grid_width, 6.0), 2), round(main_height + grid_height, 2)


def new_figure(**options) -> Figure:
    """A figure on its own Agg canvas (`Figure` options: figsize, layout...): nothing global is created or switched,
    and it is freed with its last reference."""
    figure = Figure(dpi=DPI, **options)
    FigureCanvasAgg(figure)
    return figure


def save_figure(fig: Figure, path) -> Path:
    """Write `fig` as the PNG `path` (parent folders created) through a temporary file renamed into place; on an
    error (disk full, read-only folder) no partial file is left and the OSError propagates."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        fig.savefig(partial, dpi=DPI, format="png")
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def _heatmap(ax, matrix: np.ndarray, cmap: str = "viridis"):
    return ax.imshow(matrix, cmap=cmap, vmin=0.0, vmax=max(float(matrix.max()), 1e-6), aspect="auto",
                     interpolation="nearest")


def plot_attention(
    attention,
    source_labels: list[str],
    target_labels: list[str],
    path,
    title: str | None = None,
    layer: int = -1,
) -> Path:
    """Draw cross-attention as heatmaps into the PNG `path` and return it.

    attention: (layers, heads, T, S) weights (tensor or array), e.g. from `cross_attention_matrices`.
    Top: the average over heads of `layer` (the last by default), generated tokens down the side, source
    tokens along the bottom. Below: one small panel per layer (rows) and head (columns), same axes, no labels.
    """
    weights = np.asarray(torch.as_tensor(attention, dtype=torch.float32).detach().cpu())
    if weights.ndim == 2:
        weights = weights[None, None]
    if weights.ndim != 4:
        raise ValueError(f"attention must have shape (layers, heads, T, S), got {weights.shape}")
    layers, heads, target_length, source_length = weights.shape
    if len(source_labels) != source_length or len(target_labels) != target_length:
        raise ValueError(
            f"{len(target_labels)} target and {len(source_labels)} source labels for an attention matrix of "
            f"{target_length} x {source_length}"
        )
    width, height = attention_figure_size(target_length, source_length, layers, heads)
    main_height = 1.8 + CELL * target_length + 1.6
    fig = new_figure(figsize=(width, height), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[main_height, height - main_height])
    _draw_layer_mean(top, weights, layer % layers, source_labels, target_labels, title)
    _draw_every_head(bottom, weights)
    return save_figure(fig, path)


def _draw_layer_mean(figure, weights: np.ndarray, layer_index: int, source_labels: list[str],
                     target_labels: list[str], title: str | None) -> None:
    """The mean over heads of one layer, with every token labelled."""
    layers, heads, target_length, source_length = weights.shape
    ax = figure.subplots()
    image = _heatmap(ax, weights[layer_index].mean(axis=0))  # (T, S)
    label_size = 10 if max(source_length, target_length) <= 40 else 8
    ax.set_xticks(range(source_length), source_labels, rotation=60, ha="right", rotation_mode="anchor",
                  fontsize=label_size)
    ax.set_yticks(range(target_length), target_labels, fontsize=label_size)
    ax.set_xlabel(f"source tokens ({WORD_START} marks a word start)")
    ax.set_ylabel("generated tokens")
    ax.tick_params(length=2)
    figure.colorbar(image, ax=ax, fraction=0.04 if source_length > 12 else 0.08, pad=0.02, label="attention weight")
    heading = f"Cross-attention, layer {layer_index + 1} of {layers}, mean of {heads} heads"
    ax.set_title(f"{title}\n{heading}" if title else heading, fontsize=11)


def _draw_every_head(figure, weights: np.ndarray) -> None:
    """One small panel per layer (rows) and head (columns), same axes, no labels."""
    layers, heads = weights.shape[:2]
    axes = np.atleast_2d(figure.subplots(layers, heads, squeeze=False))
    for layer_number in range(layers):
        for head in range(heads):
            panel = axes[layer_number, head]
            _heatmap(panel, weights[layer_number, head])
            panel.set_xticks([])
            panel.set_yticks([])
            if layer_number == 0:
                panel.set_title(f"head {head + 1}", fontsize=9)
            if head == 0:
                panel.set_ylabel(f"layer {layer_number + 1}", fontsize=9)
    figure.suptitle("Every layer (rows) and head (columns): generated tokens ↓, source tokens →", fontsize=10)


def plot_translation_attention(model, tokenizer, source_text: str, target_ids, path, title: str | None = None) -> Path:
    """`cross_attention_matrices` + readable labels + `plot_attention`, in one call."""
    attention = cross_attention_matrices(model, tokenizer, source_text, target_ids)
    source_ids = tokenizer(source_text, truncation=True)["input_ids"][: attention.shape[-1]]
    target = without_start_token(torch.as_tensor(target_ids), model)
    return plot_attention(attention, token_labels(tokenizer, source_ids), token_labels(tokenizer, target), path,
                          title=title)


# --------------------------------------------------------------------------------------------------------------
# Training curves
# --------------------------------------------------------------------------------------------------------------
def _series(history: list[dict], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for row in history:
        value, step = row.get(key), row.get("step")
        if value is None or step is None:
            continue
        try:
            value, step = float(value), float(step)
        except (TypeError, ValueError):
            continue
        if math.isfinite(value) and math.isfinite(step):
            steps.append(step)
            values.append(value)
    return steps, values


def plot_training_curves(history: list[dict], path) -> Path:
    """Train / validation loss and validation BLEU against steps, saved as the PNG `path` (returned).

    history rows: {"step": int, "train_loss": float} or {"step": int, "eval_loss": float, "eval_bleu": float};
    other keys are ignored, and rows lacking a key (or holding None / NaN) are skipped for that curve.
    """
    fig = new_figure(figsize=(11, 4.2), layout="constrained")
    loss_ax, bleu_ax = fig.subplots(1, 2)
    for key, label, style in (("train_loss", "train loss", "-"), ("eval_loss", "validation loss", "o-")):
        steps, values = _series(history, key)
        if steps:
            loss_ax.plot(steps, values, style, label=label, markersize=4, linewidth=1.5)
    loss_ax.set_title("Loss (cross-entropy per token)")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss")
    if loss_ax.lines:
        loss_ax.legend()
    else:
        loss_ax.text(0.5, 0.5, "no loss logged", ha="center", va="center", transform=loss_ax.transAxes)
    loss_ax.grid(alpha=0.3)

    steps, values = _series(history, "eval_bleu")
    if steps:
        bleu_ax.plot(steps, values, "o-", color="tab:green", markersize=4, linewidth=1.5, label="validation BLEU")
        best = int(np.argmax(values))
        bleu_ax.annotate(f"best {values[best]:.2f}", (steps[best], values[best]), textcoords="offset points",
                         xytext=(0, 8), ha="center", fontsize=9)
        bleu_ax.set_ylim(bottom=0, top=max(values) * 1.15 + 1)
        bleu_ax.legend(loc="lower right")
    else:
        bleu_ax.text(0.5, 0.5, "no validation BLEU logged", ha="center", va="center", transform=bleu_ax.transAxes)
    bleu_ax.set_title("Validation BLEU")
    bleu_ax.set_xlabel("step")
    bleu_ax.set_ylabel("BLEU")
    bleu_ax.grid(alpha=0.3)

    return save_figure(fig, path)


__all__ = [
    "attention_figure_size",
    "cross_attention_matrices",
    "plot_attention",
    "plot_training_curves",
    "plot_translation_attention",
    "token_labels",
]
