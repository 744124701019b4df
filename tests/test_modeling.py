import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForSeq2SeqLM
from helpers import assert_the_masks_hide_what_they_must, attention_mask_probe

from hf_scratch_transformer import (
    ScratchTransformerConfig,
    ScratchTransformerForConditionalGeneration,
    ScratchTransformerModel,
)
from hf_scratch_transformer import modeling_scratch_transformer as modeling
from hf_scratch_transformer.modeling_scratch_transformer import SinusoidalPositionalEncoding, shift_tokens_right

SOURCE = torch.tensor([[5, 6, 7, 8, 9, 2], [10, 11, 12, 2, 0, 0]])
SOURCE_MASK = (SOURCE != 0).long()
LABELS = torch.tensor([[13, 14, 15, 2], [16, 2, -100, -100]])


def make_model(config, **overrides):
    for key, value in overrides.items():
        setattr(config, key, value)
    return ScratchTransformerForConditionalGeneration(config).eval()


def matmul_parameters(config):
    """Parameters of one preset, counted from the paper's architecture (shared embedding = output projection)."""
    d, fe, fd = config.d_model, config.encoder_ffn_dim, config.decoder_ffn_dim
    attention = 4 * d * d + 4 * d
    norm = 2 * d
    encoder_layer = attention + (2 * d * fe + fe + d) + 2 * norm
    decoder_layer = 2 * attention + (2 * d * fd + fd + d) + 3 * norm
    return config.vocab_size * d + config.encoder_layers * encoder_layer + config.decoder_layers * decoder_layer


@pytest.mark.parametrize("preset", ["tiny", "small", "base", "big"])
def test_each_preset_builds_with_the_expected_size(preset):
    config = ScratchTransformerConfig.from_preset(preset, vocab_size=1000)
    with torch.device("meta"):
        model = ScratchTransformerForConditionalGeneration(config)
    assert model.num_parameters() == matmul_parameters(config)


def test_output_shapes_and_loss(tiny_config):
    model = make_model(tiny_config)
    output = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, labels=LABELS)
    assert output.logits.shape == (2, 4, tiny_config.vocab_size)
    assert output.encoder_last_hidden_state.shape == (2, 6, tiny_config.d_model)
    expected = F.cross_entropy(output.logits.reshape(-1, tiny_config.vocab_size), LABELS.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(output.loss, expected)
    assert math.isclose(output.loss.item(), math.log(tiny_config.vocab_size), rel_tol=0.3)  # untrained: ~uniform


def test_label_smoothing(tiny_config):
    model = make_model(tiny_config)
    output = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, labels=LABELS, label_smoothing=0.1)
    scored = LABELS != -100
    expected = F.cross_entropy(output.logits[scored], LABELS[scored], label_smoothing=0.1)
    torch.testing.assert_close(output.loss, expected)
    assert output.loss != model(input_ids=SOURCE, attention_mask=SOURCE_MASK, labels=LABELS).loss


def test_training_mode_returns_logits_and_the_loss_is_their_cross_entropy(tiny_config):
    """The standard output contract holds in training mode too: logits (B, T, V), loss = CE(logits, labels)."""
    model = make_model(tiny_config).train()
    output = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, labels=LABELS, label_smoothing=0.1)
    assert output.logits.shape == (2, 4, tiny_config.vocab_size)
    expected = F.cross_entropy(output.logits.flatten(0, 1), LABELS.flatten(), ignore_index=-100, label_smoothing=0.1)
    torch.testing.assert_close(output.loss, expected)


def test_logits_mask_gives_the_logits_of_those_positions_only(tiny_config):
    """logits_mask (B, T): the output projection runs on the True positions only, (N, V) in row-major order, equal
    to those positions of the full logits, and the loss is theirs."""
    model = make_model(tiny_config)
    scored = LABELS != -100
    assert not scored.all()
    seen = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].shape[:-1]))
    full = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, labels=LABELS, label_smoothing=0.1)
    kept = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, labels=LABELS, label_smoothing=0.1,
                 logits_mask=scored)
    assert seen == [LABELS.shape, (int(scored.sum()),)]
    torch.testing.assert_close(kept.logits, full.logits[scored])
    torch.testing.assert_close(kept.loss, full.loss)


def count_rows(model) -> dict[str, list[int]]:
    """The rows each layer's feed-forward and the cross-attention's key projection see, by module name."""
    rows = {}
    for name in ("model.encoder.layers.0.feed_forward.fc1", "model.decoder.layers.0.feed_forward.fc1",
                 "model.decoder.layers.0.cross_attn.k_proj"):
        module = model.get_submodule(name)
        module.register_forward_hook(
            lambda module, inputs, output, name=name: rows.setdefault(name, []).append(inputs[0].shape[:-1].numel()))
    return rows


def test_a_right_padded_training_batch_skips_its_padding_with_the_same_loss_and_gradients(tiny_config):
    """With logits_mask on a prefix of each row, no layer computes a padded position of source or target
    (RealPositions), and the loss and every gradient are those of the padded computation."""
    model = make_model(tiny_config, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0).train()
    scored = LABELS != -100
    rows = count_rows(model)

    def loss_and_gradients(**mask):
        model.zero_grad()
        loss = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, labels=LABELS, label_smoothing=0.1, **mask).loss
        loss.backward()
        return loss, {name: parameter.grad.clone() for name, parameter in model.named_parameters()}

    padded_loss, padded_gradients = loss_and_gradients()
    skipped_loss, skipped_gradients = loss_and_gradients(logits_mask=scored)
    real_source, real_target = int(SOURCE_MASK.sum()), int(scored.sum())
    assert real_source < SOURCE.numel() and real_target < LABELS.numel()
    assert rows == {"model.encoder.layers.0.feed_forward.fc1": [SOURCE.numel(), real_source],
                    "model.decoder.layers.0.feed_forward.fc1": [LABELS.numel(), real_target],
                    "model.decoder.layers.0.cross_attn.k_proj": [SOURCE.numel(), real_source]}
    torch.testing.assert_close(skipped_loss, padded_loss)
    assert padded_gradients.keys() == skipped_gradients.keys()
    for name, gradient in padded_gradients.items():
        torch.testing.assert_close(skipped_gradients[name], gradient, atol=1e-6, rtol=1e-5, msg=name)


def test_a_logits_mask_with_gaps_keeps_every_position_the_decoder_reads(tiny_config):
    """A position left out of logits_mask before one kept is still read by the causal attention: there the decoder
    runs on the padded layout, and the kept logits are those of the full computation."""
    model = make_model(tiny_config)
    gaps = torch.tensor([[True, False, True, False], [True, True, False, True]])
    rows = count_rows(model)
    full = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, labels=LABELS).logits
    kept = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, labels=LABELS, logits_mask=gaps).logits
    torch.testing.assert_close(kept, full[gaps])
    assert rows["model.decoder.layers.0.feed_forward.fc1"] == [LABELS.numel()] * 2
    with pytest.raises(ValueError, match="prefix"):
        model.model(input_ids=SOURCE, attention_mask=SOURCE_MASK, decoder_input_ids=LABELS.clamp(min=0),
                    use_cache=False, decoder_real_positions=gaps)


def test_decoder_input_is_labels_shifted_right(tiny_config):
    shifted = shift_tokens_right(LABELS, pad_token_id=0, decoder_start_token_id=1)
    assert shifted.tolist() == [[1, 13, 14, 15], [1, 16, 2, 0]]
    model = make_model(tiny_config)
    with_labels = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, labels=LABELS).logits
    explicit = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, decoder_input_ids=shifted).logits
    torch.testing.assert_close(with_labels, explicit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["eager", "flex_attention"])
def test_attention_implementations_agree_with_sdpa(tiny_config, implementation):
    model = make_model(tiny_config)
    decoder_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    inputs = dict(input_ids=SOURCE, attention_mask=SOURCE_MASK, labels=LABELS)
    with torch.no_grad():  # flex_attention has no backward on CPU
        sdpa, sdpa_masked = model(**inputs).logits, model(**inputs, decoder_attention_mask=decoder_mask).logits
        model.set_attn_implementation(implementation)
        assert {m.config._attn_implementation for m in model.modules() if hasattr(m, "config")} == {implementation}
        other, other_masked = model(**inputs).logits, model(**inputs, decoder_attention_mask=decoder_mask).logits
    torch.testing.assert_close(other, sdpa, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(other_masked, sdpa_masked, atol=1e-5, rtol=1e-5)


def test_attention_implementation_is_chosen_when_loading(tiny_config, tmp_path):
    make_model(tiny_config).save_pretrained(tmp_path)
    assert AutoModelForSeq2SeqLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"
    eager = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert eager.model.decoder.config._attn_implementation == "eager"
    calls = []
    original = modeling.eager_attention_forward
    try:  # eager really runs the written-out attention of the model file
        modeling.eager_attention_forward = lambda *a, **k: calls.append(1) or original(*a, **k)
        eager(input_ids=SOURCE, labels=LABELS)
    finally:
        modeling.eager_attention_forward = original
    assert len(calls) == tiny_config.encoder_layers + 2 * tiny_config.decoder_layers


def test_padding_changes_no_real_output(tiny_config):
    model = make_model(tiny_config)
    reference = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, labels=LABELS)
    changed_source = SOURCE.clone()
    changed_source[1, 4:] = 42  # garbage in the padded positions, still masked out
    changed = model(input_ids=changed_source, attention_mask=SOURCE_MASK, labels=LABELS)
    real = SOURCE_MASK.bool()
    torch.testing.assert_close(changed.encoder_last_hidden_state[real], reference.encoder_last_hidden_state[real])
    torch.testing.assert_close(changed.logits, reference.logits)
    # and the padded sentence alone gives the same logits as inside the batch
    alone = model(input_ids=SOURCE[1:, :4], labels=LABELS[1:, :2]).logits
    torch.testing.assert_close(alone, reference.logits[1:, :2], atol=1e-5, rtol=1e-5)


def test_decoder_padding_mask_changes_no_real_output(tiny_config):
    """A right-padded decoder mask, or none at all, gives the same logits at real target positions."""
    model = make_model(tiny_config)
    decoder_input_ids = torch.tensor([[1, 20, 21, 22], [1, 23, 0, 0]])
    right = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, decoder_input_ids=decoder_input_ids,
                  decoder_attention_mask=(decoder_input_ids != 0).long()).logits
    unmasked = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, decoder_input_ids=decoder_input_ids).logits
    torch.testing.assert_close(right[0], unmasked[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(right[1, :2], unmasked[1, :2], atol=1e-5, rtol=1e-5)


def test_future_target_tokens_change_no_earlier_logit(tiny_config):
    model = make_model(tiny_config)
    decoder_input_ids = torch.tensor([[1, 20, 21, 22, 23]])
    reference = model(input_ids=SOURCE[:1], decoder_input_ids=decoder_input_ids).logits
    for position in range(1, 5):
        changed_ids = decoder_input_ids.clone()
        changed_ids[0, position] = 50
        changed = model(input_ids=SOURCE[:1], decoder_input_ids=changed_ids).logits
        torch.testing.assert_close(changed[:, :position], reference[:, :position])
        assert not torch.allclose(changed[:, position:], reference[:, position:])


def test_attention_weights_are_returned(tiny_config):
    model = make_model(tiny_config)
    model.set_attn_implementation("eager")  # the fused kernels return no weights
    output = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, labels=LABELS, output_attentions=True)
    heads, layers = tiny_config.encoder_attention_heads, tiny_config.encoder_layers
    assert len(output.encoder_attentions) == layers and len(output.cross_attentions) == tiny_config.decoder_layers
    assert output.encoder_attentions[0].shape == (2, heads, 6, 6)
    assert output.decoder_attentions[0].shape == (2, heads, 4, 4)
    assert output.cross_attentions[0].shape == (2, heads, 4, 6)
    for weights in output.encoder_attentions + output.decoder_attentions + output.cross_attentions:
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    assert output.cross_attentions[-1][1, :, :, 4:].abs().max() == 0  # source padding gets no weight
    assert output.decoder_attentions[0][0].triu(1).abs().max() == 0  # nothing attends to the future


def test_hidden_states_are_returned(tiny_config):
    output = make_model(tiny_config)(input_ids=SOURCE, labels=LABELS, output_hidden_states=True)
    assert len(output.encoder_hidden_states) == tiny_config.encoder_layers + 1
    assert len(output.decoder_hidden_states) == tiny_config.decoder_layers + 1


def test_config_output_flags_are_honoured(tiny_config, tmp_path):
    make_model(tiny_config).save_pretrained(tmp_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(
        tmp_path, output_hidden_states=True, output_attentions=True, attn_implementation="eager"
    ).eval()
    output = model(input_ids=SOURCE, labels=LABELS)
    assert len(output.encoder_hidden_states) == tiny_config.encoder_layers + 1
    assert len(output.decoder_hidden_states) == tiny_config.decoder_layers + 1
    assert len(output.cross_attentions) == tiny_config.decoder_layers
    assert model(input_ids=SOURCE, labels=LABELS, output_hidden_states=False).encoder_hidden_states is None


def test_sinusoidal_encoding_follows_the_paper():
    table = SinusoidalPositionalEncoding(50, 16).pe
    position, i = 7, 3
    angle = position / 10000 ** (2 * i / 16)
    assert table[position, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
    assert table[position, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert SinusoidalPositionalEncoding(4, 7).pe.shape == (4, 7)  # odd widths work too


def test_too_long_input_raises_a_clear_error(tiny_config):
    model = make_model(tiny_config)
    too_long = torch.full((1, tiny_config.max_position_embeddings + 1), 5)
    with pytest.raises(ValueError, match="max_position_embeddings \\(64\\)"):
        model(input_ids=too_long, decoder_input_ids=torch.tensor([[1]]))


def test_post_norm_and_pre_norm(tiny_config):
    post = make_model(ScratchTransformerConfig(**tiny_config.to_diff_dict()))
    pre = make_model(tiny_config, normalize_before=True)
    assert post.model.encoder.layer_norm is None and post.model.decoder.layer_norm is None
    assert pre.model.encoder.layer_norm is not None and pre.model.decoder.layer_norm is not None
    pre.load_state_dict(post.state_dict(), strict=False)
    assert not torch.allclose(pre(input_ids=SOURCE, labels=LABELS).logits, post(input_ids=SOURCE, labels=LABELS).logits)
    # post-norm: every layer output is normalised
    hidden = post(input_ids=SOURCE, labels=LABELS, output_hidden_states=True).encoder_hidden_states[1]
    torch.testing.assert_close(hidden.mean(-1), torch.zeros(hidden.shape[:-1]), atol=1e-5, rtol=0)


def test_weight_matrices_are_xavier_uniform():
    config = ScratchTransformerConfig.from_preset("small", vocab_size=500)
    model = ScratchTransformerForConditionalGeneration(config)
    d = config.d_model
    bound = math.sqrt(6 / (d + d))
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        weight = getattr(model.model.encoder.layers[0].self_attn, name).weight
        assert weight.abs().max() <= bound and weight.abs().max() > 0.95 * bound
    fc1 = model.model.decoder.layers[0].feed_forward.fc1.weight
    assert fc1.abs().max() <= math.sqrt(6 / (d + config.decoder_ffn_dim))
    assert model.model.encoder.layers[0].self_attn.q_proj.bias.abs().max() == 0
    assert model.model.shared.weight[config.pad_token_id].abs().max() == 0


def test_embeddings_are_shared_and_tied(tiny_config):
    model = make_model(tiny_config)
    shared = model.model.shared.weight
    assert model.model.encoder.embed_tokens.weight is shared and model.model.decoder.embed_tokens.weight is shared
    assert model.lm_head.weight is shared
    assert model.get_input_embeddings().weight is shared and model.get_output_embeddings() is model.lm_head


def test_a_checkpoint_without_the_shared_embedding_reports_it_missing(tiny_config, tmp_path):
    """Tied as Marian ties (parameter level): a missing `shared.weight` is reported and initialised, not left on
    the meta device."""
    make_model(tiny_config).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    assert "model.shared.weight" in weights and "model.encoder.embed_tokens.weight" not in weights
    del weights["model.shared.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, info = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, output_loading_info=True)
    assert "model.shared.weight" in info["missing_keys"]
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    assert loaded.model.decoder.embed_tokens.weight is loaded.model.shared.weight is loaded.lm_head.weight
    assert loaded.generate(SOURCE, max_new_tokens=3).shape == (2, 4)


def test_untied_and_unshared_embeddings(tiny_config, tmp_path):
    model = make_model(tiny_config, share_encoder_decoder_embeddings=False, tie_word_embeddings=False)
    assert model.model.encoder.embed_tokens is not model.model.decoder.embed_tokens
    assert model.lm_head.weight is not model.model.decoder.embed_tokens.weight
    model.save_pretrained(tmp_path)
    loaded, info = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    torch.testing.assert_close(loaded.eval()(input_ids=SOURCE, labels=LABELS).logits, model(input_ids=SOURCE, labels=LABELS).logits)


def test_resize_token_embeddings_keeps_ties(tiny_config, tmp_path):
    model = make_model(tiny_config)
    old_rows = model.model.shared.weight[:99].clone()
    model.resize_token_embeddings(101, pad_to_multiple_of=8)
    assert model.config.vocab_size == 104 and model.lm_head.weight.shape == (104, tiny_config.d_model)
    assert model.lm_head.weight is model.model.shared.weight is model.model.encoder.embed_tokens.weight
    torch.testing.assert_close(model.model.shared.weight[:99], old_rows)
    model.save_pretrained(tmp_path)
    loaded, info = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, output_loading_info=True)
    assert loaded.config.vocab_size == 104 and not info["missing_keys"] and not info["unexpected_keys"]


def test_save_and_reload_through_auto_classes(tiny_config, tmp_path):
    model = make_model(tiny_config)
    model.save_pretrained(tmp_path)
    names = {path.name for path in tmp_path.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "modeling_scratch_transformer.py",
            "configuration_scratch_transformer.py"} <= names
    assert "pipeline_translation.py" not in names  # the pipeline saves its own code (test_generation.py)
    loaded, info = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(loaded, ScratchTransformerForConditionalGeneration)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    loaded.eval()
    assert torch.equal(loaded(input_ids=SOURCE, labels=LABELS).logits, model(input_ids=SOURCE, labels=LABELS).logits)
    assert loaded.lm_head.weight is loaded.model.shared.weight
    torch.testing.assert_close(loaded.model.decoder.embed_positions.pe, model.model.decoder.embed_positions.pe)
    base = AutoModel.from_pretrained(tmp_path)
    assert isinstance(base, ScratchTransformerModel)
    torch.testing.assert_close(base.shared.weight, model.model.shared.weight)


def test_gradient_checkpointing_gives_identical_gradients(tiny_config):
    model = make_model(tiny_config).train()
    loss = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, labels=LABELS).loss
    loss.backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model.activation_checkpointing_enable()
    checkpointed = model(input_ids=SOURCE, attention_mask=SOURCE_MASK, labels=LABELS).loss
    checkpointed.backward()
    torch.testing.assert_close(checkpointed, loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name], msg=name)


def test_tiny_model_overfits_pairs_and_generate_reproduces_them(pairs, tiny_tokenizer):
    config = ScratchTransformerConfig.from_preset("tiny", vocab_size=len(tiny_tokenizer), dropout=0.0)
    model = ScratchTransformerForConditionalGeneration(config)
    sources, targets = zip(*pairs)
    batch = tiny_tokenizer(list(sources), text_target=list(targets), padding=True, return_tensors="pt")
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] == tiny_tokenizer.pad_token_id, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(200):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 < losses[0]
    model.eval()
    generated = model.generate(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=40,
        decoder_start_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    assert tiny_tokenizer.batch_decode(generated, skip_special_tokens=True) == list(targets)


class _AttentionDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the dtype of the query of every CPU scaled-dot-product-attention kernel that runs, and the dtypes of
    the operands of every batched product (in a forward, only attention's)."""

    def __init__(self):
        super().__init__()
        self.seen, self.batched_products = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__ and "backward" not in func.__name__:
            self.seen.append(args[0].dtype)
        if func is torch.ops.aten.bmm.default:
            self.batched_products.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def test_bf16_training_on_a_cpu_writes_attention_out_in_bf16_and_inference_keeps_sdpa(tiny_config, monkeypatch):
    """torch's CPU attention kernel is 5-6x slower backwards in bf16 (and slow in fp32 at a training batch's
    lengths): under bf16 autocast a training forward attends with the formula written out, its scores in fp32 and the
    weights-by-values product in bf16, and its loss stays that of the fp32 model; inference keeps the kernel, in
    bf16."""
    model = ScratchTransformerForConditionalGeneration(tiny_config)
    source, labels = torch.randint(4, 99, (3, 7)), torch.randint(4, 99, (3, 5))
    written_out, formula = [], modeling.cpu_bf16_training_attention

    def counted(module, query, key, value, *args, **kwargs):
        written_out.append((query.dtype, key.dtype, value.dtype))
        return formula(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(modeling, "cpu_bf16_training_attention", counted)
    with _AttentionDtypes() as training, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=source, labels=labels).loss
    loss.backward()
    with _AttentionDtypes() as inference, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=source, labels=labels)
    layers = tiny_config.encoder_layers + 2 * tiny_config.decoder_layers
    assert training.seen == [] and written_out == [(torch.bfloat16,) * 3] * layers
    # Each attention: the scores in fp32, the weights by the values in bf16.
    fp32, bf16 = (torch.float32,) * 2, (torch.bfloat16,) * 2
    assert training.batched_products == [fp32, bf16] * layers and inference.batched_products == []
    assert inference.seen == [torch.bfloat16] * layers and len(written_out) == layers
    assert model.model.encoder.layers[0].self_attn.q_proj.weight.grad is not None
    with torch.no_grad():
        reference = model(input_ids=source, labels=labels).loss
    assert abs(loss.item() - reference.item()) < 0.05  # bf16 rounding only


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_bf16_training_on_a_cpu_keeps_the_masks_of_the_attention_implementation(tiny_config, implementation):
    """The written-out attention of bf16 training computes what the fp32 model computes: with a padded source and a
    decoder input without padding (sdpa gets no causal mask then), a padded position and a later target token change
    nothing, and the loss is the fp32 model's to bf16 rounding."""
    model = ScratchTransformerForConditionalGeneration(tiny_config)
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        reference = attention_mask_probe(model)["loss"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probe = attention_mask_probe(model)
    assert probe["logits"].requires_grad  # the training path, not inference's
    assert_the_masks_hide_what_they_must(probe)
    loss = probe["loss"]
    assert abs(loss.item() - reference.item()) < 0.05 and loss.item() != reference.item()
