"""Greedy and beam search without generate()'s per-step machinery: the tokens of `generate()`, in less time.

For a model of this size `generate()` spends most of a decoding step outside the model's arithmetic: building the
causal and encoder masks again, growing and reordering the cache, the output dataclasses and decorators of every
forward, the logits processors and stopping criteria. These loops keep the arithmetic and drop the rest: the encoder
runs once, each decoder layer's cross-attention keys and values are projected once (once per source, not per beam),
the self-attention keys and values of each new token are written into buffers allocated for the whole output, and
each step computes each layer's sublayers with `F.linear` / `F.layer_norm` on the layer's own parameters (pre- and
post-norm alike) and `scaled_dot_product_attention`, as the model's default "sdpa" attention does; an fp32 model on a
CPU multiplies by copies of its large products prepacked for oneDNN (`PackedLinear`, `decoding_weights`): the same
products, by oneDNN's kernels. The encoder computes nothing at the sources' padding. A model given
int8 copies of its decoder's weights (`quantize_for_decoding`) computes the steps' matrix products in int8 (and may
run its encoder in bf16); one given bf16 copies (`bf16_products_for_decoding`) computes them, and the cross-attention
keys and values, in bf16 where a product has rows enough for its size to pay, in fp32 where it has few. From a few
sources on a CPU, cross-attention is two batched products instead of the fused kernel
(`BMM_CROSS_ATTENTION_MIN_SOURCES`).

`ScratchTransformerForConditionalGeneration.generate()` comes here when `plain_decoding` finds a call that asks for
nothing else (greedy or beam search, no sampling, no logits processors but the minimum length, no streamer, no extra
outputs); every other call is transformers' own `generate()`. `beam_search` follows transformers' vectorised beam
search step for step (its candidates, length penalty, `early_stopping` rules and padding), so the two give the same
tokens; tests/test_decoding.py holds them to it. The translation backend calls `greedy_search` and `beam_search`
directly, with a bound on new tokens per source and the scores.

Shapes: B batch, K beams, S source length, N new tokens, D d_model, H heads, Dh head width, V vocabulary.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from functools import cache, partial
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

# Settings that change nothing in greedy or beam search or that the loops implement themselves; any other setting of
# a generation config must be unset or at transformers' neutral default for a call to take this path.
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
# The one value a handled setting may have on this path (the others are read by the loops or ignored).
REQUIRED_VALUES = {"do_sample": False, "use_cache": True, "output_scores": False, "return_dict_in_generate": False}
# Neutral values of settings that generate()'s logits processors test against.
NEUTRAL_VALUES = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                  "encoder_no_repeat_ngram_size": 0, "remove_invalid_values": False, "renormalize_logits": False,
                  "diversity_penalty": 0.0, "num_beam_groups": 1,
                  "output_attentions": False, "output_hidden_states": False, "output_logits": False}


@dataclass
class DecodingCall:
    """A `generate()` call the loops answer: its inputs and settings resolved as generate() resolves them."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_new_tokens: int
    min_new_tokens: int
    eos_token_ids: list[int]
    pad_token_id: int
    decoder_start_token_id: int
    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False


def plain_decoding(model, inputs, generation_config, kwargs: dict) -> DecodingCall | None:
    """The call as a DecodingCall when it asks only for plain greedy or beam search (what `search` does), else None.

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
    beams, returned = config.num_beams, config.num_return_sequences
    if not isinstance(beams, int) or beams < 1 or not isinstance(returned, int) or not 1 <= returned <= beams:
        return None  # generate() says what is wrong
    if beams == 1 and returned != 1:
        return None  # (transformers refuses it)
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
    length_penalty = 1.0 if config.length_penalty is None else config.length_penalty
    return DecodingCall(input_ids, attention_mask, max_new_tokens, min_new_tokens, eos_token_ids, pad, start,
                        beams, returned, length_penalty, config.early_stopping)


def settings_are_plain(config) -> bool:
    """Whether a merged GenerationConfig asks for nothing beyond plain greedy or beam search. Custom entries (keys
    that GenerationConfig does not define, such as train.py's `max_sentence_tokens` for translate_texts) are not read
    by generate() and do not count."""
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


def search(model, call: DecodingCall, max_new_tokens: torch.Tensor | None = None,
           with_log_probs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`greedy_search` or `beam_search` for `call`: (sequences, scores). Scores: beam search's sequence scores; in
    greedy search each token's log-probability with `with_log_probs`, else None. `max_new_tokens` (B,) replaces the
    call's one bound by a bound per source."""
    common = dict(input_ids=call.input_ids, attention_mask=call.attention_mask,
                  max_new_tokens=call.max_new_tokens if max_new_tokens is None else max_new_tokens,
                  eos_token_ids=call.eos_token_ids, pad_token_id=call.pad_token_id,
                  decoder_start_token_id=call.decoder_start_token_id, min_new_tokens=call.min_new_tokens)
    if call.num_beams == 1:
        return greedy_search(model, **common, with_log_probs=with_log_probs)
    return beam_search(model, **common, num_beams=call.num_beams, length_penalty=call.length_penalty,
                       early_stopping=call.early_stopping, num_return_sequences=call.num_return_sequences)


def encode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
           copies: DecodingWeights | None) -> torch.Tensor:
    """The encoder's output (B, S, D): from the model's encoder, or from the decoding copies' encoder in another dtype
    (`DecodingWeights`), back in fp32. It computes nothing at the padding (`skip_padding`; the output is the padded
    run's at every real position, zero at the padding, which the cross-attention's mask hides)."""
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, skip_padding=True)
    if copies is None or copies.encoder is None:
        return model.get_encoder()(**inputs).last_hidden_state
    return copies.encoder(**inputs).last_hidden_state.float()


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
    with `pad_token_id` (its log-probabilities there mean nothing); the loop ends when every row has, and ended rows
    leave the batch on the way. The end tokens are barred for the first `min_new_tokens` steps. N is the steps
    taken (the largest bound when some row reaches it).
    """
    decoder, batch_size = model.model.decoder, input_ids.shape[0]
    device = input_ids.device
    bounds = torch.as_tensor(max_new_tokens, device=device).expand(batch_size)
    steps = int(bounds.max())
    copies = decoding_weights(model)
    encoder_output = encode(model, input_ids, attention_mask, copies)
    # the encoder mask for every query (B, 1, 1, S), True where a source token may be attended; None without padding
    source_mask = None if bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :]
    layers = [LayerState(layer, encoder_output, steps, products=copies and copies.decoder_layers[index])
              for index, layer in enumerate(decoder.layers)]
    output_projection = copies.output_projection if copies else model.lm_head
    end_tokens = torch.tensor(eos_token_ids, device=device, dtype=torch.long)

    sequences = torch.full((batch_size, 1 + steps), pad_token_id, dtype=torch.long, device=device)
    sequences[:, 0] = decoder_start_token_id
    log_probs = torch.zeros(batch_size, steps, device=device) if with_log_probs else None
    tokens = sequences[:, 0]
    rows = torch.arange(batch_size, device=device)  # the rows still decoded (the others have ended)
    unfinished = torch.ones(batch_size, dtype=torch.bool, device=device)
    for step in range(steps):
        hidden = decoder.embed(decoder.embed_tokens(tokens)[:, None], offset=step)  # (B, 1, D)
        for state in layers:
            hidden = state.step(hidden, step, source_mask)
        logits = output_projection(decoder.final_norm(hidden)[:, 0]).float()  # (B, V)
        if step < min_new_tokens and len(end_tokens):
            logits[:, end_tokens] = float("-inf")
        tokens = first_argmax(logits)
        tokens = torch.where(unfinished, tokens, pad_token_id)
        sequences[rows, step + 1] = tokens
        if with_log_probs:
            log_probs[rows, step] = logits.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]
        unfinished &= ~torch.isin(tokens, end_tokens) & (bounds > step + 1)
        ended = len(rows) - int(unfinished.sum())
        if ended == len(rows):
            break
        if ended >= max(1, len(rows) // 4):  # ended rows leave the batch, a quarter at a time (each leaving copies)
            going = unfinished.nonzero()[:, 0]
            rows, tokens, bounds, unfinished = rows[going], tokens[going], bounds[going], unfinished[going]
            source_mask = None if source_mask is None else source_mask[going]
            for state in layers:
                state.keep_sources(going)
                state.reorder(going, filled=step + 1)
    taken = step + 1 if steps else 0
    return sequences[:, : 1 + taken], (log_probs[:, :taken] if with_log_probs else None)


# Rows from which `first_argmax` finds the maximum by blocks. Over an 8,000-token row torch's max with indices is a
# scalar loop on a CPU (torch 2.13, AVX2 AMD EPYC: 310 µs for 32 rows, where the vectorised amax takes 33); by blocks
# it took 104 against 189 µs at 16 rows, 110 against 306 at 32, level at 8 and slower below (twice as slow at 2).
ARGMAX_BY_BLOCKS_MIN_ROWS = 16
ARGMAX_BLOCK = 64


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """(R, V) -> (R,): the index of each row's first maximum, NaN counting as the maximum (torch.argmax's answer).
    From ARGMAX_BY_BLOCKS_MIN_ROWS rows on it is found in two passes: the block of ARGMAX_BLOCK entries that holds it
    (the first block whose maximum is the row's), then its place in that block."""
    rows, size = logits.shape
    if rows < ARGMAX_BY_BLOCKS_MIN_ROWS:
        return logits.max(dim=-1).indices  # faster than argmax on a CPU (bench_speed's kernels)
    if size % ARGMAX_BLOCK:
        logits = F.pad(logits, (0, -size % ARGMAX_BLOCK), value=float("-inf"))
    blocks = logits.view(rows, -1, ARGMAX_BLOCK)  # (R, V / block, block)
    block = blocks.amax(dim=-1).argmax(dim=-1)  # (R,)
    return block * ARGMAX_BLOCK + blocks[torch.arange(rows, device=logits.device), block].argmax(dim=-1)


# transformers' beam search marks what may no longer be chosen by adding this (not -inf, which would make ties of
# finished and impossible hypotheses arbitrary); the loop adds it where transformers does, for the same choices.
NEVER = -1.0e9


@torch.no_grad()
def beam_search(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int | torch.Tensor,
    eos_token_ids: list[int], pad_token_id: int, decoder_start_token_id: int, num_beams: int,
    min_new_tokens: int = 0, length_penalty: float = 1.0, early_stopping: bool | str = False,
    num_return_sequences: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask (B, S) -> the best `num_return_sequences` hypotheses of each source, (B·R, 1 + N)
    starting with the decoder start token, best first, and their scores (B·R,): the sum of the tokens'
    log-probabilities over (new tokens) ** length_penalty, generate()'s `sequences_scores`.

    Each step follows transformers' `_beam_search` (`Beams.advance`); a source whose hypotheses can no longer change
    leaves the batch (`Beams.leave`). Sequences are padded as generate() pads them.
    """
    decoder, batch_size = model.model.decoder, input_ids.shape[0]
    bounds = torch.as_tensor(max_new_tokens, device=input_ids.device).expand(batch_size)
    steps = int(bounds.max())
    copies = decoding_weights(model)
    encoder_output = encode(model, input_ids, attention_mask, copies)
    source_mask = None if bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :]
    layers = [LayerState(layer, encoder_output, steps, num_beams, products=copies and copies.decoder_layers[index])
              for index, layer in enumerate(decoder.layers)]
    output_projection = copies.output_projection if copies else model.lm_head
    beams = Beams(batch_size, num_beams, steps, bounds, eos_token_ids, pad_token_id, decoder_start_token_id,
                  length_penalty, early_stopping)
    for step in range(steps):
        tokens = beams.running[:, :, step].reshape(-1)
        hidden = decoder.embed(decoder.embed_tokens(tokens)[:, None], offset=step)
        for state in layers:
            hidden = state.step(hidden, step, source_mask)
        log_probs = output_projection(decoder.final_norm(hidden)[:, 0]).float().log_softmax(dim=-1)  # (B·K, V)
        if step < min_new_tokens and len(eos_token_ids):
            log_probs[:, beams.end_tokens] = float("-inf")
        parent_rows, done, all_ended = beams.advance(log_probs, length=step + 1)
        if done.all() or all_ended:
            break
        if done.any():
            going = (~done).nonzero()[:, 0]
            parent_rows = beams.leave(done, going, parent_rows)
            source_mask = None if source_mask is None else source_mask[going]
            for state in layers:
                state.keep_sources(going)
        for state in layers:  # the parents' keys and values, of the sources that go on
            state.reorder(parent_rows.view(-1), filled=step + 1)
    return beams.best(num_return_sequences)


class Beams:
    """The hypotheses of beam search for the B sources still searched, as transformers' `_beam_search` keeps them:
    K running beams (B, K, 1 + N) with their scores, K finished hypotheses with their length-penalised scores and
    lengths, and whether a source's finished ones can still improve. Sources that leave are kept in `results`."""

    def __init__(self, batch_size: int, beams: int, steps: int, bounds: torch.Tensor, eos_token_ids: list[int],
                 pad_token_id: int, decoder_start_token_id: int, length_penalty: float, early_stopping: bool | str):
        device = bounds.device
        self.beams, self.steps, self.bounds = beams, steps, bounds
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.end_tokens = torch.tensor(eos_token_ids, device=device, dtype=torch.long)
        self.candidates_kept = max(2, 1 + len(eos_token_ids)) * beams
        self.among_best = torch.arange(self.candidates_kept, device=device) < beams  # candidates that may finish
        fill = (pad_token_id or eos_token_ids[0]) if eos_token_ids else -1  # generate()'s padding of beam outputs
        self.running = torch.full((batch_size, beams, 1 + steps), fill, dtype=torch.long, device=device)
        self.running[:, :, 0] = decoder_start_token_id
        self.running_scores = torch.zeros(batch_size, beams, device=device)
        self.running_scores[:, 1:] = NEVER  # the first step extends the first beam only
        self.finished = self.running.clone()
        self.finished_scores = torch.full((batch_size, beams), NEVER, device=device)
        self.finished_lengths = torch.zeros(batch_size, beams, dtype=torch.long, device=device)  # new tokens
        self.is_finished = torch.zeros(batch_size, beams, dtype=torch.bool, device=device)
        self.improvable = torch.ones(batch_size, 1, dtype=torch.bool, device=device)
        self.row_offsets = torch.arange(batch_size, device=device)[:, None] * beams  # (B, 1): a source's first row
        self.sources = torch.arange(batch_size, device=device)  # the source of each row still searched
        self.results = (self.finished.clone(), self.finished_scores.clone(), self.finished_lengths.clone())

    def advance(self, log_probs: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One step from the beams' next-token log-probabilities (B·K, V), `length` new tokens once added: the row
        each new beam continues (B, K), which sources are done (B,), and whether every candidate ended."""
        active, vocab_size = self.running.shape[0], log_probs.shape[-1]
        totals = (log_probs.view(active, self.beams, vocab_size) + self.running_scores[:, :, None]).view(active, -1)
        scores, picked = torch.topk(totals, self.candidates_kept)  # (B, 2K)
        parents, tokens = picked // vocab_size, picked % vocab_size
        candidates = torch.take_along_dim(self.running, parents[:, :, None], dim=1)  # (B, 2K, 1 + N)
        candidates[:, :, length] = tokens
        ends = torch.isin(tokens, self.end_tokens) | (self.bounds[:, None] <= length)

        going_on = scores + ends.to(torch.float32) * NEVER
        kept = torch.topk(going_on, self.beams).indices  # (B, K)
        self.running = torch.take_along_dim(candidates, kept[:, :, None], dim=1)
        self.running_scores = torch.take_along_dim(going_on, kept, dim=1)
        parent_rows = torch.take_along_dim(parents, kept, dim=1) + self.row_offsets
        self.add_finished(candidates, scores, ends & self.among_best, length)

        best_length = self.steps if self.early_stopping == "never" and self.length_penalty > 0.0 else length
        best_possible = self.running_scores[:, :1] / (best_length**self.length_penalty)
        worst_finished = torch.where(self.is_finished, self.finished_scores.min(dim=1, keepdim=True).values, NEVER)
        self.improvable &= (best_possible > worst_finished).any(dim=-1, keepdim=True)
        done = ~self.improvable[:, 0] | (self.is_finished.all(dim=-1) & (self.early_stopping is True))
        return parent_rows, done, bool(ends.all())

    def add_finished(self, candidates: torch.Tensor, scores: torch.Tensor, just_finished: torch.Tensor, length: int):
        """The candidates that ended among the K best join the finished hypotheses if better than the worst there,
        unless the source is full (early_stopping True) or can no longer improve."""
        final_scores = scores / (length**self.length_penalty)
        full = self.is_finished.all(dim=-1, keepdim=True) & (self.early_stopping is True)
        final_scores += full.to(torch.float32) * NEVER
        final_scores += (~self.improvable).to(torch.float32) * NEVER
        final_scores += (~just_finished) * NEVER
        best = torch.topk(torch.cat((self.finished_scores, final_scores), dim=1), self.beams).indices
        lengths = torch.full_like(scores, length, dtype=torch.long)
        self.finished = torch.take_along_dim(torch.cat((self.finished, candidates), dim=1), best[:, :, None], dim=1)
        self.finished_scores, self.finished_lengths, self.is_finished = (
            torch.take_along_dim(torch.cat(pair, dim=1), best, dim=1)
            for pair in ((self.finished_scores, final_scores), (self.finished_lengths, lengths),
                         (self.is_finished, just_finished)))

    def leave(self, done: torch.Tensor, going: torch.Tensor, parent_rows: torch.Tensor) -> torch.Tensor:
        """The done sources' hypotheses go to `results`; the others (`going`) stay. Returns their parent rows."""
        for result, tensor in zip(self.results, (self.finished, self.finished_scores, self.finished_lengths)):
            result[self.sources[done]] = tensor[done]
        for name in ("sources", "bounds", "improvable", "running", "running_scores", "finished", "finished_scores",
                     "finished_lengths", "is_finished"):
            setattr(self, name, getattr(self, name)[going])
        self.row_offsets = self.row_offsets[: len(going)]
        return parent_rows[going]

    def best(self, returned: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `returned` best finished hypotheses of every source (B·R, 1 + N) and their scores (B·R,)."""
        for result, tensor in zip(self.results, (self.finished, self.finished_scores, self.finished_lengths)):
            result[self.sources] = tensor
        finished, scores, lengths = self.results
        output_length = 1 + int(lengths[:, :returned].max())
        return (finished[:, :returned, :output_length].reshape(-1, output_length),
                scores[:, :returned].reshape(-1))


def step_products(layer) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """The (weight, bias) of each matrix product of a decoder layer's step, by name: the new position's query, key
    and value in one product (3D outputs, one call instead of three), its self-attention output, the cross-attention's
    query and output, the feed-forward's two."""
    self_attention, cross_attention, feed_forward = layer.self_attn, layer.cross_attn, layer.feed_forward
    projections = (self_attention.q_proj, self_attention.k_proj, self_attention.v_proj)
    products = {"self_query_key_value": (torch.cat([linear.weight for linear in projections]),
                                         torch.cat([linear.bias for linear in projections]))}
    for name, linear in (("self_output", self_attention.out_proj), ("cross_query", cross_attention.q_proj),
                         ("cross_output", cross_attention.out_proj), ("fc1", feed_forward.fc1),
                         ("fc2", feed_forward.fc2)):
        products[name] = (linear.weight, linear.bias)
    return products


class Int8Linear:
    """x·Wᵀ + b with W in int8 and x rounded to int8 at each call: (..., in) -> (..., out) in fp32.

    W is stored with one scale per output row (its largest magnitude over 127), x gets one scale per row at each
    call, and `torch._int_mm` sums the int8 products in int32, which the two scales turn back into fp32. On a CPU
    with AVX-512 VNNI this is several times faster than an fp32 product at the rows of a decoding step (the weights
    are a quarter of the bytes, and the units multiply four int8 pairs where they multiply one fp32 pair).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        weight = weight.detach().float()
        self.weight_scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127  # (out,)
        # (in, out): the transposed view of the (out, in) rows, the layout `_int_mm` reads fastest at one row
        self.weight = torch.round(weight / self.weight_scale[:, None]).to(torch.int8).t()
        self.bias = torch.zeros_like(self.weight_scale) if bias is None else bias.detach().float()

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs.reshape(-1, inputs.shape[-1])  # (R, in)
        row_scale = rows.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-12).div_(127)  # (R, 1)
        products = torch._int_mm(rows.div(row_scale).round_().to(torch.int8), self.weight)  # (R, out) int32
        return torch.addcmul(self.bias, products, row_scale * self.weight_scale).view(*inputs.shape[:-1], -1)


# When `Bf16Linear` multiplies in bf16 rather than fp32: from the row count (B·K new tokens; B·S source positions for
# the cross-attention keys and values) at which rows × weight elements reach BF16_MIN_MULTIPLY_ADDS, and from 2 rows
# at the least. Alone on a Xeon with AMX a bf16 product cost some 30 µs whatever its size (casts and oneDNN's
# set-up), an fp32 one little while its rows were few and its weight in the cores' caches: the small preset's
# 256×256 products paid in bf16 from 48-64 rows, the feed-forward's from 12-16, an 8,000-token output projection
# from 1 (benchmarks/results/bf16_product_rows_amx.md). Within a whole step that projection at one row ran 0.98x as
# fast in bf16 (a one-off alternated comparison, greedy at batch 1), hence the 2. Against bf16 from 16 rows on for
# every product, this rule decoded greedy 1.15x as fast at batch 8 and beam 4 1.05x at batch 1, 0.95-1.02x in the
# other cases measured, within the run's noise (decoding_precision_amx.md).
BF16_MIN_MULTIPLY_ADDS = 3 * 2**20


def bf16_min_rows(weight: torch.Tensor) -> int:
    """The rows from which `Bf16Linear` multiplies by `weight` (out, in) in bf16: BF16_MIN_MULTIPLY_ADDS over its
    elements, rounded up, and at least 2."""
    return max(2, -(-BF16_MIN_MULTIPLY_ADDS // weight.numel()))


class Bf16Linear:
    """x·Wᵀ + b: in bf16 from `min_rows` rows on (`bf16_min_rows(W)` unless given), in fp32 below; (..., in) ->
    (..., out) in fp32.

    Holds W in fp32 and a bf16 copy, the copy in oneDNN's blocked layout where torch's oneDNN offers it
    (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing does), so that no call reorders it: on a
    Xeon with AMX that decoded greedy at batch 32 1.08x and beam 4 1.03-1.19x (two runs) as fast as a plain bf16
    copy. The bf16 product sums in fp32 and rounds its output to bf16, which returns in fp32 (leaving it bf16 for
    the step's next operation to take was level at batch 32 and 1-3 % slower at 1 and 8 in one-off alternated
    comparisons).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int | None = None):
        self.min_rows = bf16_min_rows(weight) if min_rows is None else min_rows
        self.weight = weight.detach().float()
        self.bias = None if bias is None else bias.detach().float()
        self.bf16_bias = None if bias is None else self.bias.bfloat16()
        self.packed_weight = prepacked_bf16_weight(self.weight)  # None: torch's oneDNN cannot, F.linear then
        self.bf16_weight = self.weight.bfloat16() if self.packed_weight is None else None

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs.reshape(-1, inputs.shape[-1])  # (R, in)
        if rows.shape[0] < self.min_rows:
            return F.linear(inputs, self.weight, self.bias)
        if self.packed_weight is None:
            products = F.linear(rows.bfloat16(), self.bf16_weight, self.bf16_bias)
        else:
            products = torch.ops.mkldnn._linear_pointwise(rows.bfloat16(), self.packed_weight, self.bf16_bias,
                                                          "none", [], "")
        return products.float().view(*inputs.shape[:-1], -1)


def prepacked_bf16_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 copy of `weight` (out, in) in the layout oneDNN's bf16 product reads, or None where torch's oneDNN does
    not offer it (a build without it, or a CPU without bf16 support), or it fails to run on a product of 32 rows."""
    if not (weight.is_cpu and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None
    return prepacked_weight(weight.bfloat16())


def prepacked_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` (out, in) in the blocked layout oneDNN's product reads (`torch.ops.mkldnn._reorder_linear_weight`, what
    inductor's CPU freezing does), or None where torch's oneDNN does not offer it or it fails to run on 32 rows."""
    try:
        if not (weight.is_cpu and torch.backends.mkldnn.is_available()):
            return None
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        probe = torch.zeros(32, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):  # an op missing from this build, or refusing
        return None
    return packed


def packed_min_elements() -> int:
    """The weights (elements) from which the fp32 loops multiply by a prepacked copy (`PackedLinear`) rather than by the
    parameter (`F.linear`): every weight on a CPU whose kernels torch runs with AVX-512, 2**17 elsewhere.

    Cycling through a small-preset step's products as a step does (each weight out of the cores' caches by its next
    turn), a prepacked product was 1.1-2.2x as fast as F.linear for the 768x256 / 1024x256 / 256x1024 products and
    2-3.7x for the 8,000x256 output projection at 1-32 rows on an AMD EPYC with AVX2 only, but 0.75-1.0x for the
    256x256 ones there (benchmarks/results/fp32_prepacked_products.md); on one with AVX-512 the 256x256 ones were
    1.1-1.4x as fast prepacked at 2-128 rows and level at 1 (fp32_prepacked_products_amd.md)."""
    return 0 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 2**17


class PackedLinear:
    """x·Wᵀ + b in fp32, W held in oneDNN's blocked layout (`prepacked_weight`) so that no call reorders it, and the
    activation "relu" applied in the same call when given: (..., in) -> (..., out)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, activation: str = "none"):
        self.packed_weight = prepacked_weight(weight.detach().float())
        if self.packed_weight is None:
            raise ValueError("this build of torch cannot prepack fp32 weights for oneDNN")
        self.bias = None if bias is None else bias.detach().float()
        self.activation = activation

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs.reshape(-1, inputs.shape[-1])  # (R, in)
        products = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, self.activation, [], "")
        return products.view(*inputs.shape[:-1], -1)


@cache
def fp32_prepacking_available() -> bool:
    """Whether this torch can prepack fp32 weights for oneDNN and multiply by them (`prepacked_weight`)."""
    return prepacked_weight(torch.ones(8, 8)) is not None


def packed_fp32_copies(model) -> DecodingWeights:
    """`DecodingWeights` that multiply in fp32 as the model does, by prepacked copies (`PackedLinear`) of the weights
    of `packed_min_elements()` or more, by the parameters themselves (`F.linear`) below; a ReLU feed-forward's first
    product applies its ReLU in the same call ("fc1_applies_activation")."""
    min_elements = packed_min_elements()

    def product(weight, bias, activation="none"):
        if weight.numel() < min_elements:
            return partial(F.linear, weight=weight, bias=bias)
        return PackedLinear(weight, bias, activation)

    layers = []
    for layer in model.model.decoder.layers:
        weights = step_products(layer)
        products = {name: product(*weights[name]) for name in weights}
        if layer.feed_forward.activation is F.relu and isinstance(products["fc1"], PackedLinear):
            products["fc1"] = product(*weights["fc1"], activation="relu")
            products["fc1_applies_activation"] = True
        layers.append(products)
    return DecodingWeights(layers, product(model.lm_head.weight, model.lm_head.bias))


# model -> (its weights' storage and versions, their sums, their prepacked copies): outside the model, whose copies
# and pickles must not carry oneDNN's opaque tensors (they have no storage to copy), and gone with it
PACKED_FP32_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoding_weights(model) -> DecodingWeights | None:
    """What the loops multiply a decoding step by: the copies the model was given (`model.decoding_weights`: int8,
    bf16 products), else for an fp32 model on a CPU whose torch can prepack weights, outside autocast, the prepacked
    fp32 copies (`packed_fp32_copies`), made at the first call and again whenever a copied weight has changed since
    (training, loading others: `weights_state`), else None (the model's own parameters)."""
    given = getattr(model, "decoding_weights", None)
    if given is not None:
        return given
    if (model.dtype != torch.float32 or model.device.type != "cpu" or torch.is_autocast_enabled("cpu")
            or not fp32_prepacking_available()):
        return None  # under autocast its products are autocast's, in bf16
    storage, sums = weights_state([*model.lm_head.parameters(), *model.model.decoder.layers.parameters()])
    cached = PACKED_FP32_COPIES.get(model)
    if cached is None or cached[0] != storage or not torch.equal(cached[1], sums):
        cached = PACKED_FP32_COPIES[model] = (storage, sums, packed_fp32_copies(model))
    return cached[2]


def weights_state(parameters: list[torch.Tensor]) -> tuple[tuple, torch.Tensor]:
    """What tells whether weights have changed since their copies were made: each one's storage and in-place version,
    and the sum of its values (P,). The sums are needed: torch's fused AdamW (train.py's optimizer) and writes through
    `parameter.data` update the values in place without bumping the version (a pass over the weights: about 0.3 ms for
    the small preset's decoder, against 2-3 ms a decoding step at batch 1)."""
    with torch.no_grad():
        sums = torch.stack([parameter.sum() for parameter in parameters])
    return tuple((parameter.data_ptr(), parameter._version) for parameter in parameters), sums


@dataclass
class DecodingWeights:
    """Copies of what a decoding step multiplies by, for the loops: each decoder layer's six products
    (`step_products`; bf16 copies also its cross-attention keys and values, "cross_key_value") and the output
    projection, as functions (`Int8Linear`, `Bf16Linear`, `PackedLinear`; "fc1_applies_activation": True where fc1
    applies the feed-forward's activation itself); and the encoder the loops run once per source: the
    model's own (None), or a copy in another dtype. The model's forward and transformers' own `generate()` path never
    use them."""

    decoder_layers: list[dict[str, Callable[[torch.Tensor], torch.Tensor] | bool]]
    output_projection: Callable[[torch.Tensor], torch.Tensor]
    encoder: torch.nn.Module | None = None  # None: the model's own


def decoding_copies(model, product: type, encoder_dtype: torch.dtype, what: str,
                    cross_keys_and_values: bool = False) -> DecodingWeights:
    """`DecodingWeights` of `product` copies (`Int8Linear` or `Bf16Linear`) of an fp32 model on a CPU, its encoder
    copied to `encoder_dtype` unless that is fp32; with `cross_keys_and_values` each layer's entry also holds a copy
    of its cross-attention's key and value projections, as one product ("cross_key_value", keys then values);
    `what` names the precision in a refusal."""
    if model.dtype != torch.float32 or model.device.type != "cpu":
        raise ValueError(f"{what} decoding copies fp32 weights on a CPU, not {model.dtype} on {model.device}")
    if encoder_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the encoder of {what} decoding runs in torch.float32 or torch.bfloat16, not {encoder_dtype}")
    encoder = None if encoder_dtype == torch.float32 else copy.deepcopy(model.get_encoder()).to(encoder_dtype)
    layers = []
    for layer in model.model.decoder.layers:
        products = {name: product(*weights) for name, weights in step_products(layer).items()}
        if cross_keys_and_values:
            key, value = layer.cross_attn.k_proj, layer.cross_attn.v_proj
            products["cross_key_value"] = product(torch.cat([key.weight, value.weight]),
                                                  torch.cat([key.bias, value.bias]))
        layers.append(products)
    return DecodingWeights(layers, product(model.lm_head.weight, model.lm_head.bias), encoder)


def quantize_for_decoding(model, encoder_dtype: torch.dtype = torch.float32) -> None:
    """Make the loops (greedy and beam search: `generate()`'s plain calls and the translation backend) compute a
    decoding step's matrix products in int8 (`Int8Linear`), for inference on a CPU, and run the encoder in
    `encoder_dtype` (bf16 halves its time on a CPU with bf16 units and kept test BLEU; its output returns to fp32).
    The encoder and the cross-attention keys and values stay out of int8: there they cost test BLEU on every corpus
    tried (0.07-0.22, benchmarks/README.md), the step's products did not. The copies are made once, now: a model whose
    weights then change (training, loading others) must be quantized again. The model's forward and transformers'
    own `generate()` path still use its fp32 weights."""
    model.decoding_weights = decoding_copies(model, Int8Linear, encoder_dtype, "int8")


def bf16_products_for_decoding(model, encoder_dtype: torch.dtype = torch.bfloat16) -> None:
    """Make the loops compute a decoding step's matrix products, and each layer's cross-attention keys and values,
    in bf16 where the product has rows enough for that to pay (`bf16_min_rows`) and in fp32 where it has fewer
    (`Bf16Linear`), for inference on a CPU with bf16 units, and run the encoder in `encoder_dtype`. Copies made once,
    now, as `quantize_for_decoding`'s."""
    model.decoding_weights = decoding_copies(model, Bf16Linear, encoder_dtype, "bf16-products",
                                             cross_keys_and_values=True)


# sources in a batch from which cross-attention is two batched products, not scaled_dot_product_attention: at 32
# sources on a CPU the fused kernel, reading keys and values no longer in cache, made decoding 1.02-1.05x slower (AMD
# EPYC, small preset, fp32 and int8, greedy and beam 4); level at 8, and at 1 the products' extra calls cost more
# (benchmarks/results/cross_attention_bmm.md)
BMM_CROSS_ATTENTION_MIN_SOURCES = 8
# positions the self-attention buffers hold at first (LayerState.grow doubles them)
INITIAL_POSITIONS = 64
# sources in a batch from which bf16 weights on a CPU attend in fp32 (AMD EPYC, small preset, against bf16: greedy
# 1.29-1.33x as fast at batch 32, 1.05-1.11x at 8, level within the noise at 1 and 2; beam 4 1.03-1.14x at 32; with
# cross-attention by bmm from 8 sources 1.00-1.10x, level at 1 and 2: decoding_attention_bf16_bmm_cross.md)
FP32_ATTENTION_MIN_SOURCES = 8


class LayerState:
    """One decoder layer during greedy or beam search: its weights, its cross-attention keys/values (B, H, S, Dh;
    the keys (B, H, Dh, S) when `cross_attends_by_bmm`) projected once, and its self-attention keys/values
    (B·K, H, N, Dh), filled one position per step (K beams; 1 in greedy search).

    The step computes what the layer's forward computes in eval mode (post- or pre-norm, its activation) with
    `F.linear` / `F.layer_norm` on the layer's own parameters: calling the modules costs more than their arithmetic
    at one token per row (bench_speed: ~1.3x more tokens/s at batch 1 than calling them). `products` (one layer's
    entry of `DecodingWeights.decoder_layers`) replaces the step's six by functions of the same names, and with a
    "cross_key_value" entry the projection of the cross-attention keys and values (keys first).
    """

    def __init__(self, layer, encoder_output: torch.Tensor, steps: int, beams: int = 1,
                 products: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None):
        self_attention = layer.self_attn
        self.pre_norm = layer.normalize_before
        self.heads, self.head_dim = self_attention.num_heads, self_attention.head_dim
        self.scaling = self_attention.scaling
        self.beams = beams
        # each a function (B·K, 1, in) -> (B·K, 1, out): F.linear on the layer's weights, or their copies
        # (`DecodingWeights`)
        products = products or {name: partial(F.linear, weight=weight, bias=bias)
                                for name, (weight, bias) in step_products(layer).items()}
        self.self_query_key_value, self.self_output = products["self_query_key_value"], products["self_output"]
        self.cross_query, self.cross_output = products["cross_query"], products["cross_output"]
        self.fc1, self.fc2 = products["fc1"], products["fc2"]
        self.activation = layer.feed_forward.activation
        self.fc1_applies_activation = products.get("fc1_applies_activation", False)
        self.self_norm, self.cross_norm, self.final_norm = (
            (norm.normalized_shape, norm.weight, norm.bias, norm.eps)
            for norm in (layer.self_attn_layer_norm, layer.cross_attn_layer_norm, layer.final_layer_norm))
        # A CPU's scaled_dot_product_attention over one query per row runs several times slower in bf16 than in fp32
        # (torch 2.13): with bf16 weights and enough sources for that to outweigh two more casts a sublayer, the keys
        # and values are kept in fp32, each cast once when written (benchmarks/results/decoding_attention_bf16.md).
        self.attends_in_fp32 = (encoder_output.dtype == torch.bfloat16 and encoder_output.is_cpu
                                and encoder_output.shape[0] >= FP32_ATTENTION_MIN_SOURCES)
        cross_attention = layer.cross_attn
        if "cross_key_value" in products:  # the copies' product of keys and values at once (B·S rows)
            keys, values = products["cross_key_value"](encoder_output).chunk(2, dim=-1)
        else:
            keys = F.linear(encoder_output, cross_attention.k_proj.weight, cross_attention.k_proj.bias)
            values = F.linear(encoder_output, cross_attention.v_proj.weight, cross_attention.v_proj.bias)
        self.cross_keys = self.attention_input(self.split_heads(keys))
        self.cross_values = self.attention_input(self.split_heads(values))
        self.cross_attends_by_bmm = (encoder_output.is_cpu
                                     and encoder_output.shape[0] >= BMM_CROSS_ATTENTION_MIN_SOURCES)
        if self.cross_attends_by_bmm:  # keys (B, H, Dh, S) and values (B, H, S, Dh), each contiguous for bmm
            self.cross_keys = self.cross_keys.transpose(2, 3).contiguous()
            self.cross_values = self.cross_values.contiguous()
        rows = encoder_output.shape[0] * beams
        # room for the first steps, doubled when full (`self_attention`): a bound of 256 new tokens costs memory only
        # when a sentence comes near it
        self.self_keys = self.cross_keys.new_empty(rows, self.heads, min(steps, INITIAL_POSITIONS), self.head_dim)
        self.self_values = torch.empty_like(self.self_keys)
        self.spare = None  # beam search: the buffers reordered keys and values are written to (`reorder`)

    def split_heads(self, projected: torch.Tensor) -> torch.Tensor:
        """(B, L, D) -> (B, H, L, Dh)."""
        return projected.view(projected.shape[0], -1, self.heads, self.head_dim).transpose(1, 2)

    def attention_input(self, tensor: torch.Tensor) -> torch.Tensor:
        """A query, key or value as attention takes it: in fp32 if `attends_in_fp32`, else as it is."""
        return tensor.float() if self.attends_in_fp32 else tensor

    def attention_output(self, output: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Attention's output (B·K, 1, D) back in the dtype of the layer's hidden states if attended in fp32."""
        return output.to(hidden.dtype) if self.attends_in_fp32 else output

    def step(self, hidden: torch.Tensor, step: int, source_mask: torch.Tensor | None) -> torch.Tensor:
        """hidden (B, 1, D) at position `step` -> (B, 1, D), as the layer's forward with a cache computes it."""
        hidden = self.add_and_norm(hidden, self.self_norm, lambda x: self.self_attention(x, step))
        hidden = self.add_and_norm(hidden, self.cross_norm, lambda x: self.cross_attention(x, source_mask))
        return self.add_and_norm(hidden, self.final_norm, self.feed_forward)

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """FFN(x) = activation(x·W1 + b1)·W2 + b2 (§3.3), the activation in fc1's call where it applies it."""
        if self.fc1_applies_activation:
            return self.fc2(self.fc1(hidden))
        return self.fc2(self.activation(self.fc1(hidden)))

    def add_and_norm(self, hidden: torch.Tensor, norm: tuple, sublayer) -> torch.Tensor:
        """LayerNorm(x + Sublayer(x)), or x + Sublayer(LayerNorm(x)) in pre-norm (the layer's AddAndNorm)."""
        if self.pre_norm:
            return hidden + sublayer(F.layer_norm(hidden, *norm))
        return F.layer_norm(hidden + sublayer(hidden), *norm)

    def self_attention(self, hidden: torch.Tensor, step: int) -> torch.Tensor:
        """The new position's keys and values join the buffers; its query attends to positions 0 .. step."""
        query, key, value = self.self_query_key_value(hidden).chunk(3, dim=-1)
        if step == self.self_keys.shape[2]:
            self.grow()
        self.self_keys[:, :, step] = self.split_heads(key)[:, :, 0]
        self.self_values[:, :, step] = self.split_heads(value)[:, :, 0]
        output = F.scaled_dot_product_attention(self.attention_input(self.split_heads(query)),
                                                self.self_keys[:, :, : step + 1], self.self_values[:, :, : step + 1],
                                                scale=self.scaling)
        return self.self_output(self.attention_output(output.transpose(1, 2).reshape(hidden.shape), hidden))

    def grow(self):
        """Twice the positions in the self-attention buffers, the filled ones copied."""
        filled = self.self_keys.shape[2]
        grown = [buffer.new_empty(buffer.shape[0], self.heads, 2 * filled, self.head_dim)
                 for buffer in (self.self_keys, self.self_values)]
        grown[0][:, :, :filled], grown[1][:, :, :filled] = self.self_keys, self.self_values
        self.self_keys, self.self_values = grown
        self.spare = None

    def cross_attention(self, hidden: torch.Tensor, source_mask: torch.Tensor | None) -> torch.Tensor:
        """hidden (B·K, 1, D) -> (B·K, 1, D): a source's K beams are K queries over its keys and values, which are
        therefore projected and stored once per source, not once per beam."""
        query = self.attention_input(
            self.cross_query(hidden).view(-1, self.beams, self.heads, self.head_dim).transpose(1, 2))
        if self.cross_attends_by_bmm:
            output = self.cross_attention_by_bmm(query, source_mask)
        else:
            output = F.scaled_dot_product_attention(query, self.cross_keys, self.cross_values, attn_mask=source_mask,
                                                    scale=self.scaling)  # (B, H, K, Dh)
        return self.cross_output(self.attention_output(output.transpose(1, 2).reshape(hidden.shape), hidden))

    def cross_attention_by_bmm(self, query: torch.Tensor, source_mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(q·kᵀ·scale) v for queries (B, H, K, Dh) over `cross_keys` (B, H, Dh, S): what
        scaled_dot_product_attention computes, as two batched matrix products."""
        sources, heads, beams, head_dim = query.shape
        keys, values = self.cross_keys, self.cross_values
        scores = torch.bmm(query.reshape(sources * heads, beams, head_dim), keys.view(sources * heads, head_dim, -1))
        scores = scores.view(sources, heads, beams, -1).mul_(self.scaling)
        if source_mask is not None:
            scores.masked_fill_(source_mask.logical_not(), float("-inf"))
        output = torch.bmm(scores.softmax(dim=-1).view(sources * heads, beams, -1),
                           values.view(sources * heads, -1, head_dim))
        return output.view(sources, heads, beams, head_dim)

    def keep_sources(self, sources: torch.Tensor):
        """Beam search: only these sources (indices into the present batch) go on; `reorder` then keeps their beams'
        self-attention keys and values."""
        self.cross_keys, self.cross_values = self.cross_keys[sources], self.cross_values[sources]

    def reorder(self, rows: torch.Tensor, filled: int):
        """Row i of the self-attention keys and values becomes row rows[i] (in beam search its beam's parent), for
        the `filled` positions written so far; rows may be fewer than before (rows or sources that left). Gathered into
        a second pair of buffers, which then become the first: one copy of the filled positions (indexing in place
        copies twice, and took about twice as long)."""
        if self.spare is None:
            self.spare = (torch.empty_like(self.self_keys), torch.empty_like(self.self_values))
        spare_keys, spare_values = (buffer[: len(rows)] for buffer in self.spare)
        torch.index_select(self.self_keys[:, :, :filled], 0, rows, out=spare_keys[:, :, :filled])
        torch.index_select(self.self_values[:, :, :filled], 0, rows, out=spare_values[:, :, :filled])
        self.spare = (self.self_keys, self.self_values)
        self.self_keys, self.self_values = spare_keys, spare_values
