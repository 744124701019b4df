"""Attention matrices, readable token labels, the heatmap figure and the training curves."""

import math

import pytest
import torch
from helpers import PAIRS_EN_ES, png_size

from hf_scratch_transformer import plotting
from hf_scratch_transformer.plotting import (
    attention_figure_size,
    cross_attention_matrices,
    plot_attention,
    plot_training_curves,
    token_labels,
)
from hf_scratch_transformer.translation.translate import translate


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_cross_attention_matrices_match_generate(trained_model):
    """The teacher-forced pass gives exactly the weights greedy generate() saw at each step."""
    model, tokenizer, _ = trained_model
    text = PAIRS_EN_ES[3][0]
    batch = tokenizer(text, return_tensors="pt")
    model.set_attn_implementation("eager")  # generate() returns attention weights from the eager kernel only
    try:
        output = model.generate(**batch, output_attentions=True, return_dict_in_generate=True, num_beams=1)
    finally:
        model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"
    [[best]] = translate(model, tokenizer, [text], num_beams=1, num_return_sequences=1)
    target_ids = best.token_ids
    matrices = cross_attention_matrices(model, tokenizer, text, target_ids)
    layers, heads = model.config.decoder_layers, model.config.decoder_attention_heads
    source_length = batch.input_ids.shape[1]
    assert matrices.shape == (layers, heads, len(target_ids), source_length)
    torch.testing.assert_close(matrices.sum(-1), torch.ones(layers, heads, len(target_ids)))
    from_generate = torch.cat([torch.stack(step)[:, 0] for step in output.cross_attentions], dim=-2)  # (L, H, T, S)
    torch.testing.assert_close(matrices, from_generate[:, :, : len(target_ids)], atol=1e-5, rtol=1e-4)
    # the leading decoder start token is optional
    torch.testing.assert_close(cross_attention_matrices(model, tokenizer, text, [1, *target_ids]), matrices)


def test_token_labels_are_readable(trained_model):
    _, tokenizer, _ = trained_model
    text = "¿Dónde estás tú? Año"
    ids = tokenizer(text)["input_ids"]
    labels = token_labels(tokenizer, ids)
    assert len(labels) == len(ids) and labels[-1] == "</s>"
    assert not any("Ġ" in label or "Ã" in label for label in labels)
    words = [label for label in labels[:-1] if label.startswith(plotting.WORD_START)]
    assert len(words) == len(text.split())
    joined = "".join(label.replace(plotting.WORD_START, " ") for label in labels[:-1] if label not in ("…", "␣"))
    assert joined.strip() == text


def test_plot_attention_png_size(tmp_path):
    torch.manual_seed(0)
    attention = torch.rand(2, 4, 5, 7).softmax(-1)
    source = ["▁In", "▁the", "▁beg", "inning", "▁God", ".", "</s>"]
    target = ["▁En", "▁el", "▁princ", "ipio", "</s>"]
    path = plot_attention(attention, source, target, tmp_path / "sub" / "attention.png", title="In the beginning God.")
    width, height = attention_figure_size(5, 7, 2, 4)
    assert png_size(path) == (round(width * plotting.DPI), round(height * plotting.DPI))
    # a long sentence grows the figure, labels keep their size
    long_width, long_height = attention_figure_size(40, 50, 6, 8)
    assert long_width > width and long_height > height
    with pytest.raises(ValueError, match="labels"):
        plot_attention(attention, source[:-1], target, tmp_path / "bad.png")


def test_plot_training_curves(tmp_path):
    history = []
    for step in range(0, 1001, 20):
        history.append({"step": step, "train_loss": 6 * math.exp(-step / 300) + 1, "learning_rate": 1e-3})
        if step and step % 200 == 0:
            history.append({"step": step, "eval_loss": 6 * math.exp(-step / 300) + 1.3, "eval_bleu": step / 50})
    history += [{"step": 1001, "train_loss": None}, {"epoch": 1.0}, {"step": 1002, "eval_loss": float("nan")}]
    path = plot_training_curves(history, tmp_path / "training_curves.png")
    assert png_size(path) == (1100, 420)
    # no evaluation rows at all, or nothing at all: still a figure
    assert png_size(plot_training_curves(history[:3], tmp_path / "train_only.png")) == (1100, 420)
    assert png_size(plot_training_curves([], tmp_path / "empty.png")) == (1100, 420)
