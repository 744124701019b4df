"""Greedy search without generate()'s per-step machinery: the tokens of `generate(num_beams=1)`, in less time.

For a model of this size `generate()` spends most of a decoding step outside the model's arithmetic: building the
causal and encoder masks again, growing the cache by concatenation, the output dataclasses and decorators of every
forward, the logits processors and stopping criteria. This loop keeps the arithmetic and drops the rest: the
encoder runs once, each decoder layer's cross-attention keys and values are projected once, the self-attention
keys and values of each new token are written into buffers allocated for the whole output, and each step computes
each layer's sublayers with `F.linear` / `F.layer_norm` on the layer's own parameters (pre- and post-norm alike) and
`scaled_dot_product_attention`, as the model's default "sdpa" attention does.

`ScratchTransformerForConditionalGeneration.generate()` comes here when `plain_greedy` finds a call that asks for
nothing else (greedy, no sampling, no logits processors but the minimum length, no streamer, no extra outputs);
every other call is transformers' own `generate()`. tests/test_greedy_decoding.py holds the two to the same tokens.
The translation backend calls `greedy_search` directly, with a bound on new tokens per source and the step scores.

Shapes: B batch, S source length, N new tokens, D d_model, H heads, Dh head width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

# Settings that change nothing in greedy search or that `greedy_search` implements itself; any other setting of a
# generation config must be unset or at transformers' neutral default for a call to take this path.
HANDLED_SETTINGS = {
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "pad_token_id", "bos_token_id", "eos_token_id",
    "decoder_start_token_id", "transformers_version", "_from_model_config",
    "early_stopping", "length_penalty", "num_beams", "do_sample", "use_cache", "num_return_sequences",
    "output_scores", "return_dict_in_generate",
    # sampling-only settings: generate() builds no logits warper from them when do_sample is False
    "temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff",
    # assistant-only settings: read only when an assistant model is given (which no plain call has)
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "assistant_lookbehind", "target_lookbehind",
}
# The one value a handled setting may have on this path (the others are read by greedy_search or ignored).
REQUIRED_VALUES = {"num_beams": 1, "do_sample": False, "use_cache": True, "num_return_sequences": 1,
                   "output_scores": False, "return_dict_in_generate": False}
# Neutral values of settings that generate()'s logits processors test against.
NEUTRAL_VALUES = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                  "encoder_no_repeat_ngram_size": 0, "remove_invalid_values": False, "renormalize_logits": False,
                  "diversity_penalty": 0.0, "num_beam_groups": 1,
                  "output_attentions": False, "output_hidden_states": False, "output_logits": False}


@dataclass
class GreedyCall:
    """A `generate()` call `greedy_search` answers: its inputs and the length settings resolved as generate() does."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_new_tokens: int
    min_new_tokens: int
    eos_token_ids: list[int]
    pad_token_id: int
    decoder_start_token_id: int


def plain_greedy(model, inputs, generation_config, kwargs: dict) -> GreedyCall | None:
    """The call as a GreedyCall when it asks only for plain greedy search (what `greedy_search` does), else None.

    Settings are merged the way generate() merges them (the call's > `generation_config` > the model's > transformers'
    defaults); any unknown keyword, extra output, processor or stopping rule means None, so generate() handles it.
    """
    if model.training or model.config._attn_implementation != "sdpa":
        return None
    extra = {key: value for key, value in kwargs.items() if value is not None}
    tensors = {key: extra.pop(key) for key in ("input_ids", "attention_mask") if key in extra}
    try:
        config, model_kwargs = model._prepare_generation_config(generation_config, **extra)
    except (AttributeError, TypeError, ValueError):  # a transformers without this helper, or a call it rejects
        return None
    if model_kwargs or not settings_are_plain(config):
        return None
    input_ids = tensors.get("input_ids", inputs)
    if (inputs is not None and "input_ids" in tensors) or not isinstance(input_ids, torch.Tensor):
        return None
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int, torch.long) or 0 in input_ids.shape:
        return None  # generate() says what is wrong with it
    eos = config.eos_token_id
    eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad, start = config.pad_token_id, config.decoder_start_token_id
    if start is None:
        start = config.bos_token_id
    if pad is None or start is None or not isinstance(start, int):
        return None  # generate() warns and substitutes: let it
    # generate(): max_new_tokens wins over max_length; both count the decoder's start token in max_length
    max_new_tokens = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - 1
    min_new_tokens = max(config.min_new_tokens or 0, (config.min_length or 0) - 1)
    if max_new_tokens < 1 or max_new_tokens > model.config.max_position_embeddings:
        return None  # generate() says what is wrong
    attention_mask = tensors.get("attention_mask")
    if attention_mask is None:  # generate() infers no mask for an encoder-decoder model: every position counts
        attention_mask = torch.ones_like(input_ids, dtype=torch.long)
    return GreedyCall(input_ids, attention_mask, max_new_tokens, min_new_tokens, eos_token_ids, pad, start)


def settings_are_plain(config) -> bool:
    """Whether a merged GenerationConfig asks for nothing beyond plain greedy search. Custom entries (keys that
    GenerationConfig does not define, such as train.py's `max_sentence_tokens` for translate_texts) are not read by
    generate() and do not count."""
    known = GenerationConfig().to_dict()
    for key, value in config.to_dict().items():
        if key not in known:
            continue
        if key in HANDLED_SETTINGS:
            if key in REQUIRED_VALUES and value != REQUIRED_VALUES[key]:
                return False
        elif value is not None and NEUTRAL_VALUES.get(key, object()) != value:
            return False
    return True


@torch.no_grad()
def greedy_search(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int | torch.Tensor,
    eos_token_ids: list[int], pad_token_id: int, decoder_start_token_id: int, min_new_tokens: int = 0,
    with_log_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """input_ids, attention_mask (B, S) -> sequences (B, 1 + N) starting with the decoder start token, and with
    `with_log_probs` the log-probability of each emitted token (B, N) (generate()'s `compute_transition_scores`
    with normalized logits).

    `max_new_tokens` is one bound or one per row (B,); a row ends at an end token or its bound and is then padded
    with `pad_token_id`; the loop ends when every row has. The end tokens are barred for the first
    `min_new_tokens` steps. N is the steps taken (the largest bound when some row reaches it).
    """
    decoder, batch_size = model.model.decoder, input_ids.shape[0]
    device = input_ids.device
    bounds = torch.as_tensor(max_new_tokens, device=device).expand(batch_size)
    steps = int(bounds.max())
    encoder_output = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    # the encoder mask for every query (B, 1, 1, S), True where a source token may be attended; None without padding
    source_mask = None if bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :]
    layers = [LayerState(layer, encoder_output, steps) for layer in decoder.layers]
    end_tokens = torch.tensor(eos_token_ids, device=device, dtype=torch.long)

    tokens = torch.full((batch_size,), decoder_start_token_id, dtype=torch.long, device=device)
    sequences, log_probs = [tokens], []
    unfinished = torch.ones(batch_size, dtype=torch.bool, device=device)
    for step in range(steps):
        hidden = decoder.embed(decoder.embed_tokens(tokens)[:, None], offset=step)  # (B, 1, D)
        for state in layers:
            hidden = state.step(hidden, step, source_mask)
        logits = model.lm_head(decoder.final_norm(hidden)[:, 0]).float()  # (B, V)
        if step < min_new_tokens and len(end_tokens):
            logits[:, end_tokens] = float("-inf")
        tokens = logits.max(dim=-1).indices  # argmax's first maximum, faster on CPU (bench_speed's kernels)
        tokens = torch.where(unfinished, tokens, pad_token_id)
        if with_log_probs:
            log_probs.append(logits.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0])
        sequences.append(tokens)
        unfinished &= ~torch.isin(tokens, end_tokens) & (bounds > step + 1)
        if not unfinished.any():
            break
    return torch.stack(sequences, dim=1), (torch.stack(log_probs, dim=1) if with_log_probs else None)


class LayerState:
    """One decoder layer during greedy search: its weights, its cross-attention keys/values (B, H, S, Dh) projected
    once, and its self-attention keys/values (B, H, N, Dh), filled one position per step.

    The step computes what the layer's forward computes in eval mode (post- or pre-norm, its activation) with
    `F.linear` / `F.layer_norm` on the layer's own parameters: calling the modules costs more than their arithmetic
    at one token per row (bench_speed: ~1.3x more tokens/s at batch 1 than calling them).
    """

    def __init__(self, layer, encoder_output: torch.Tensor, steps: int):
        self_attention, cross_attention = layer.self_attn, layer.cross_attn
        self.pre_norm = layer.normalize_before
        self.heads, self.head_dim = self_attention.num_heads, self_attention.head_dim
        self.scaling = self_attention.scaling
        self.self_query, self.self_key, self.self_value, self.self_output, self.cross_query, self.cross_output = (
            (linear.weight, linear.bias) for linear in (self_attention.q_proj, self_attention.k_proj,
                                                        self_attention.v_proj, self_attention.out_proj,
                                                        cross_attention.q_proj, cross_attention.out_proj))
        feed_forward = layer.feed_forward
        self.fc1 = (feed_forward.fc1.weight, feed_forward.fc1.bias)
        self.fc2 = (feed_forward.fc2.weight, feed_forward.fc2.bias)
        self.activation = feed_forward.activation
        self.self_norm, self.cross_norm, self.final_norm = (
            (norm.normalized_shape, norm.weight, norm.bias, norm.eps)
            for norm in (layer.self_attn_layer_norm, layer.cross_attn_layer_norm, layer.final_layer_norm))
        self.cross_keys = self.split_heads(F.linear(encoder_output, cross_attention.k_proj.weight,
                                                    cross_attention.k_proj.bias))
        self.cross_values = self.split_heads(F.linear(encoder_output, cross_attention.v_proj.weight,
                                                      cross_attention.v_proj.bias))
        batch_size = encoder_output.shape[0]
        self.self_keys = self.cross_keys.new_empty(batch_size, self.heads, steps, self.head_dim)
        self.self_values = torch.empty_like(self.self_keys)

    def split_heads(self, projected: torch.Tensor) -> torch.Tensor:
        """(B, L, D) -> (B, H, L, Dh)."""
        return projected.view(projected.shape[0], -1, self.heads, self.head_dim).transpose(1, 2)

    def step(self, hidden: torch.Tensor, step: int, source_mask: torch.Tensor | None) -> torch.Tensor:
        """hidden (B, 1, D) at position `step` -> (B, 1, D), as the layer's forward with a cache computes it."""
        hidden = self.add_and_norm(hidden, self.self_norm, lambda x: self.self_attention(x, step))
        hidden = self.add_and_norm(hidden, self.cross_norm, lambda x: self.attend(
            x, self.cross_query, self.cross_output, self.cross_keys, self.cross_values, source_mask))
        return self.add_and_norm(hidden, self.final_norm,
                                 lambda x: F.linear(self.activation(F.linear(x, *self.fc1)), *self.fc2))

    def add_and_norm(self, hidden: torch.Tensor, norm: tuple, sublayer) -> torch.Tensor:
        """LayerNorm(x + Sublayer(x)), or x + Sublayer(LayerNorm(x)) in pre-norm (the layer's AddAndNorm)."""
        if self.pre_norm:
            return hidden + sublayer(F.layer_norm(hidden, *norm))
        return F.layer_norm(hidden + sublayer(hidden), *norm)

    def self_attention(self, hidden: torch.Tensor, step: int) -> torch.Tensor:
        """The new position's keys and values join the buffers; its query attends to positions 0 .. step."""
        self.self_keys[:, :, step] = self.split_heads(F.linear(hidden, *self.self_key))[:, :, 0]
        self.self_values[:, :, step] = self.split_heads(F.linear(hidden, *self.self_value))[:, :, 0]
        return self.attend(hidden, self.self_query, self.self_output, self.self_keys[:, :, : step + 1],
                           self.self_values[:, :, : step + 1])

    def attend(self, hidden: torch.Tensor, query_projection: tuple, output_projection: tuple, keys: torch.Tensor,
               values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """One query position (B, 1, D) over keys and values (B, H, K, Dh) -> (B, 1, D)."""
        query = self.split_heads(F.linear(hidden, *query_projection))  # (B, H, 1, Dh)
        output = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.scaling)
        return F.linear(output.transpose(1, 2).reshape(hidden.shape), *output_projection)
