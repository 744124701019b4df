"""The one translation core: the command line, `translate()`, the translation pipeline, evaluation during training
and both backends (PyTorch `generate()`, CTranslate2) all translate through `translate_batches`.

    >>> backend = TorchBackend(model)                                                           # doctest: +SKIP
    >>> options = DecodingOptions(num_beams=4, num_return_sequences=2)                          # doctest: +SKIP
    >>> [[best, second], []] = translate_batches(backend, tokenizer, ["Jesus wept.", ""], options)  # doctest: +SKIP
    >>> best.text, best.score, best.token_ids                                                   # doctest: +SKIP
    ('Jesús lloró.', -0.31, [...])
    >>> attention = cross_attention_matrices(model, tokenizer, "Jesus wept.", best.token_ids)  # (L, H, T, S)
    >>> hard_alignment(model, tokenizer, "Jesus wept.", best.token_ids)                        # doctest: +SKIP
    [(0, 1), (1, 0)]                               # (source word, target word): "Jesus"-"lloró", "wept."-"Jesús"

What the core does, the same way for every path: the texts are checked (strings only), tokenized, cut to the model's
limit (with one warning), sorted by length and cut into batches (little padding), translated by the backend and put
back in input order. An empty (or whitespace-only) text is never given to the model: it gets no hypothesis (an
empty line). Each translation is bounded to `max_len_a * source tokens + max_len_b` new tokens (fairseq's bound;
defaults `DEFAULT_MAX_LEN_A` and `DEFAULT_MAX_LEN_B`), and never more than the generation_config allows
(`max_new_tokens`, else `max_length` - 1, else `FALLBACK_MAX_NEW_TOKENS`) nor than the decoder has positions for.
The bound is each sentence's own, so a sentence translates the same alone or in any batch.

A backend only generates: `backend.generate(source_ids, bounds, num_beams, num_return_sequences, with_scores)`
returns, per source, its hypotheses as (token ids, score) pairs, best first (ids without the decoder start token,
ending with `</s>` unless cut by the bound). It also carries `generation_config`, `max_positions`, `vocab_size` and
`per_row_bounds` (False when it can only bound a whole batch: the core then puts only sentences with the same bound
in a batch).

A hypothesis's score is the sum of its tokens' log-probabilities (`</s>` included) divided by
`length ** length_penalty`, the number beam search ranks hypotheses by (transformers' and fairseq's definition).

This file imports only torch, transformers and its sibling errors.py: both are copied into saved model directories
beside pipeline_translation.py, which uses them under `trust_remote_code=True`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import re
import time
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from .errors import UsageError
from .decoding import plain_decoding, search
from .documents import Unit, model_text, source_language, split_document, split_long
from .glossary import Glossary
from .glossary import report as glossary_report
from .protected_spans import (
    DEFAULT_KINDS,
    ProtectError,
    ProtectedText,
    SpanProtector,
    hide,
    restore,
    sentinel,
    tokenizer_has_sentinels,
)

logger = logging.getLogger("hf_scratch_transformer")

DEFAULT_MAX_LEN_A = 1.5  # fairseq's max_len_a: new tokens per source token ...
DEFAULT_MAX_LEN_B = 10.0  # ... plus max_len_b
DEFAULT_BATCH_SIZE = 32  # sentences per generate() call
FALLBACK_MAX_NEW_TOKENS = 256  # when the generation_config sets no length limit at all
FALLBACK_MAX_SOURCE_TOKENS = 512  # when neither the model nor the tokenizer states a limit


# --------------------------------------------------------------------------------------------------------------
# Options, checked once
# --------------------------------------------------------------------------------------------------------------
class InvalidOption(UsageError, ValueError):
    """A decoding option out of range (a ValueError too). `name` is the option's name, so a command line can name its
    own flag."""

    def __init__(self, name: str, value, requirement: str):
        self.name, self.value, self.requirement = name, value, requirement
        super().__init__(f"{name} must be {requirement}, got {value!r}")


def _check_whole(name: str, value, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidOption(name, value, "a whole number >= 1")


def _check_length_factor(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise InvalidOption(name, value, "a finite number >= 0")


@dataclass(frozen=True)
class DecodingOptions:
    """How to translate. None means the model's generation_config decides (`num_beams`, `max_new_tokens`).

    num_return_sequences: hypotheses per text (n-best), at most num_beams. with_scores: give each hypothesis its
    score (always done for n-best). max_len_a / max_len_b: the length bound (0 and 0: none). truncation: cut
    over-long texts to the model's limit with a warning (False: refuse them).
    """

    num_beams: int | None = None
    num_return_sequences: int = 1
    max_new_tokens: int | None = None
    max_len_a: float = DEFAULT_MAX_LEN_A
    max_len_b: float = DEFAULT_MAX_LEN_B
    batch_size: int = DEFAULT_BATCH_SIZE
    truncation: bool = True
    with_scores: bool = False

    def __post_init__(self):
        _check_whole("num_beams", self.num_beams, optional=True)
        _check_whole("num_return_sequences", self.num_return_sequences)
        _check_whole("max_new_tokens", self.max_new_tokens, optional=True)
        _check_whole("batch_size", self.batch_size)
        _check_length_factor("max_len_a", self.max_len_a)
        _check_length_factor("max_len_b", self.max_len_b)

    def beams(self, generation_config) -> int:
        """The beam size of this call: the option, else the generation_config's, else 1; n-best fits in it."""
        beams = self.num_beams if self.num_beams is not None else (getattr(generation_config, "num_beams", 1) or 1)
        if self.num_return_sequences > beams:
            raise InvalidOption("num_return_sequences", self.num_return_sequences, f"at most the beam size ({beams})")
        return beams


def length_bound(source_length: int, max_len_a: float, max_len_b: float) -> int | None:
    """fairseq's bound on a translation's length in generated tokens (`</s>` included): `a * source tokens + b`
    (the source's `</s>` counted), rounded up; None when both are 0 (no bound)."""
    if max_len_a == 0 and max_len_b == 0:
        return None
    return max(1, math.ceil(max_len_a * source_length + max_len_b))


def new_tokens_cap(generation_config, max_positions: int | None, max_new_tokens: int | None = None) -> int:
    """The longest translation allowed whatever the source, in new tokens: `max_new_tokens`, else the
    generation_config's (max_new_tokens, else max_length - 1 for the decoder start token, else the fallback), and
    never more than the decoder has positions for."""
    if max_new_tokens is not None:
        cap = max_new_tokens
    elif getattr(generation_config, "max_new_tokens", None) is not None:
        cap = generation_config.max_new_tokens
    elif getattr(generation_config, "max_length", None) is not None:
        cap = max(1, generation_config.max_length - 1)
    else:
        cap = FALLBACK_MAX_NEW_TOKENS
    return min(cap, max_positions - 1) if isinstance(max_positions, int) and max_positions > 1 else cap


def source_limit(max_positions: int | None, tokenizer) -> int:
    """The most source tokens the model takes: its positions, or the tokenizer's model_max_length if lower."""
    limits = [max_positions, getattr(tokenizer, "model_max_length", None)]
    limits = [limit for limit in limits if isinstance(limit, int) and 0 < limit < 1_000_000]
    return min(limits) if limits else FALLBACK_MAX_SOURCE_TOKENS


def check_texts(texts) -> None:
    """`texts` is a list (or tuple) of strings; the first item that is not is named."""
    if isinstance(texts, (str, bytes)) or not isinstance(texts, (list, tuple)):
        raise TypeError(f"texts must be a list of strings, got {type(texts).__name__}: for one text, pass [text]")
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{index}] is {text!r} ({type(text).__name__}), not a string: translate only strings "
                            f"(an empty string gives an empty translation)")


def check_tokenizer_fits(tokenizer, vocab_size: int | None, exact: bool = False) -> None:
    """The tokenizer's ids are all rows of the model's embeddings; with `exact`, it has as many tokens as the model
    has embeddings (train.py saves them equal). Raises ValueError naming both sizes."""
    size = len(tokenizer)
    if vocab_size is None or (size <= vocab_size and not (exact and size != vocab_size)):
        return
    if size > vocab_size:
        raise ValueError(
            f"the tokenizer has {size} tokens but the model only {vocab_size} embeddings: ids from {vocab_size} on are "
            f"outside the model's vocabulary (0..{vocab_size - 1}); the tokenizer belongs to another model, use the "
            f"tokenizer saved with these weights"
        )
    raise ValueError(
        f"the tokenizer has {size} tokens but the model {vocab_size} embeddings (train.py saves them equal): the "
        f"tokenizer files belong to another model; use the tokenizer saved with these weights"
    )


# --------------------------------------------------------------------------------------------------------------
# The batch loop
# --------------------------------------------------------------------------------------------------------------
@dataclass
class Hypothesis:
    """One translation of a text: its text, its score (None unless asked for), its token ids (without the decoder
    start token; ending with `</s>` unless cut by the length bound) and its confidence (with the score): the mean
    log-probability of its tokens, `</s>` included (see `confidence`)."""

    text: str
    score: float | None
    token_ids: list[int]
    confidence: float | None = None


def translate_batches(backend, tokenizer, texts: list[str], options: DecodingOptions | None = None, *,
                      progress: bool = False, description: str = "translating",
                      on_batch: Callable[[int, float], None] | None = None) -> list[list[Hypothesis]]:
    """Translate `texts` with `backend`: per text, its hypotheses best first (`options.num_return_sequences` of
    them; none for an empty text), in input order.

    `progress` shows a tqdm bar named `description`. `on_batch(tokens_generated, seconds)` is called after each
    batch with the number of tokens the backend generated for it (all hypotheses) and the seconds it took.
    """
    options = options or DecodingOptions()
    check_texts(texts)
    check_tokenizer_fits(tokenizer, backend.vocab_size)
    beams = options.beams(backend.generation_config)
    with_scores = options.with_scores or options.num_return_sequences > 1
    results: list[list[Hypothesis]] = [[] for _ in texts]
    todo = [index for index, text in enumerate(texts) if text.strip()]
    if not todo:
        return results
    sources = _encode(tokenizer, texts, todo, source_limit(backend.max_positions, tokenizer), options.truncation)
    cap = new_tokens_cap(backend.generation_config, backend.max_positions, options.max_new_tokens)
    bounds = {index: min(length_bound(len(sources[index]), options.max_len_a, options.max_len_b) or cap, cap)
              for index in todo}
    order = sorted(todo, key=lambda index: -len(sources[index]))  # longest first: an out-of-memory batch shows at once
    with tqdm(total=len(order), unit="sent", desc=description, dynamic_ncols=True, disable=not progress) as bar:
        for batch in _batches(order, bounds, options.batch_size, backend.per_row_bounds):
            started = time.perf_counter()
            generated = backend.generate([sources[i] for i in batch], [bounds[i] for i in batch], beams,
                                         options.num_return_sequences, with_scores)
            seconds = time.perf_counter() - started
            for index, hypotheses in zip(batch, generated):
                results[index] = [Hypothesis(decode_ids(tokenizer, ids), score, ids) for ids, score in hypotheses]
            if on_batch is not None:
                on_batch(sum(len(ids) for hypotheses in generated for ids, _ in hypotheses), seconds)
            bar.update(len(batch))
    return results


def _encode(tokenizer, texts: list[str], todo: list[int], limit: int, truncation: bool) -> dict[int, list[int]]:
    """Source token ids of each text to translate (index -> ids); over-long texts cut to `limit` tokens (`</s>`
    kept) with one warning, or refused without `truncation`."""
    sources = dict(zip(todo, tokenizer([texts[i] for i in todo], verbose=False)["input_ids"]))
    too_long = [i for i in todo if len(sources[i]) > limit]
    if too_long and not truncation:
        first = too_long[0]
        raise ValueError(f"text {first + 1} has {len(sources[first])} tokens, more than the model's limit of {limit} "
                         f"(max_position_embeddings): split it into sentences, or translate with truncation")
    if too_long:
        logger.warning(
            f"{len(too_long)} input text(s) longer than the model's limit of {limit} tokens were truncated to it "
            f"(first: text {too_long[0] + 1}, {len(sources[too_long[0]])} tokens); split long texts into sentences"
        )
        cut = tokenizer([texts[i] for i in too_long], truncation=True, max_length=limit, verbose=False)["input_ids"]
        sources.update(zip(too_long, cut))
    return sources


def _batches(order: list[int], bounds: dict[int, int], batch_size: int, per_row_bounds: bool):
    """`order` cut into batches of `batch_size`; for a backend that bounds only whole batches, also where the
    bound changes (sorted by length, neighbours mostly share it)."""
    batch: list[int] = []
    for index in order:
        if batch and (len(batch) == batch_size or (not per_row_bounds and bounds[index] != bounds[batch[0]])):
            yield batch
            batch = []
        batch.append(index)
    if batch:
        yield batch


# --------------------------------------------------------------------------------------------------------------
# Token ids and text
# --------------------------------------------------------------------------------------------------------------
def decoder_start_token(model) -> int:
    """The token decoding starts from: the generation config's, else the model config's."""
    start = getattr(model.generation_config, "decoder_start_token_id", None)
    return start if start is not None else model.config.decoder_start_token_id


def without_start_token(ids, model) -> list[int]:
    """`ids` (a list or a tensor) as a list, without a leading decoder start token."""
    ids = ids.flatten().tolist() if hasattr(ids, "flatten") else list(ids)
    return ids[1:] if ids and ids[0] == decoder_start_token(model) else ids


def strip_generated(ids: list[int], generation_config, start_token: int | None) -> list[int]:
    """Generated ids without the decoder start token, cut after the first end-of-sequence token, no padding."""
    eos = generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) - {None}
    pad = generation_config.pad_token_id
    ids = ids[1:] if ids and ids[0] == start_token else ids
    out = []
    for token_id in ids:
        if token_id in eos:
            out.append(token_id)
            break
        if token_id == pad:
            break
        out.append(token_id)
    return out


def decode_ids(tokenizer, ids: list[int] | None) -> str:
    """One line of text: special tokens dropped, line breaks (\\n, \\r) in the output turned into spaces, no white
    space at either end (a byte-level model may begin with a word's mid-sentence form, " Dios", and decoding keeps
    its space)."""
    if not ids:
        return ""
    # A translation cut by the length bound may end inside a multi-byte character: drop the replacement mark.
    text = tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    return text.replace("\r\n", " ").replace("\r", " ").replace("\n", " ").strip()


# --------------------------------------------------------------------------------------------------------------
# The PyTorch backend: generate()
# --------------------------------------------------------------------------------------------------------------
class SourceLengthBound(StoppingCriteria):
    """Stops each source's hypotheses at that source's own bound on new tokens (generate()'s max_new_tokens is one
    number per call). Rows come in source order, (sources × candidate beams) of them in beam search; the decoder
    input starts with the one decoder start token."""

    def __init__(self, bounds: list[int]):
        self.bounds = torch.tensor(bounds)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        rows_per_source = input_ids.shape[0] // len(self.bounds)
        bounds = self.bounds.to(input_ids.device).repeat_interleave(rows_per_source)
        return bounds <= input_ids.shape[1] - 1


def greedy_resets(generation_config, num_beams: int) -> dict:
    """For a greedy call on a model saved for beam search: beam-only options back to their defaults, which
    transformers would otherwise report as invalid flags (`early_stopping=True` is what train.py saves)."""
    if num_beams > 1 or getattr(generation_config, "early_stopping", False) is False:
        return {}
    return {"early_stopping": False}


class TorchBackend:
    """`generate()` of a transformers encoder-decoder model with its generation_config, on the device of its
    weights; `generate_kwargs` are passed to every generate() call (e.g. length_penalty=1.2)."""

    per_row_bounds = True

    def __init__(self, model, **generate_kwargs):
        self.model = model
        self.generation_config = model.generation_config
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.vocab_size = getattr(model.config, "vocab_size", None)
        self.generate_kwargs = generate_kwargs

    @property
    def length_penalty(self) -> float:
        """The exponent scores are normalised with: the generate() keyword's, else the generation_config's, else 1."""
        penalty = self.generate_kwargs.get("length_penalty", getattr(self.generation_config, "length_penalty", None))
        return 1.0 if penalty is None else penalty

    def _padded(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, attention mask), each (B, longest), right-padded, on the model's device."""
        config = self.generation_config
        pad = config.pad_token_id if config.pad_token_id is not None else self.model.config.pad_token_id
        device = next(self.model.parameters()).device
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(row) for row in sequences], batch_first=True,
                                              padding_value=pad if pad is not None else 0).to(device)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(row), dtype=torch.long) for row in sequences],
                                               batch_first=True).to(device)
        return ids, mask

    @torch.no_grad()
    def generate(self, source_ids: list[list[int]], bounds: list[int], num_beams: int, num_return_sequences: int,
                 with_scores: bool) -> list[list[tuple[list[int], float | None]]]:
        """Per source, `num_return_sequences` (token ids, score) pairs, best first; score None without scores."""
        config = self.generation_config
        input_ids, attention_mask = self._padded(source_ids)
        settings = {**greedy_resets(config, num_beams), **self.generate_kwargs, "num_beams": num_beams,
                    "num_return_sequences": num_return_sequences,
                    "max_new_tokens": max(bounds), "max_length": None}  # the saved max_length would compete (and warn)
        call = self._plain_call(input_ids, attention_mask, settings)
        if call is not None:
            return self._search(call, bounds, with_scores)
        output = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask,
            stopping_criteria=StoppingCriteriaList([SourceLengthBound(bounds)]),
            **settings, return_dict_in_generate=True, output_scores=with_scores,
        )
        start = decoder_start_token(self.model)
        # cut to the source's own bound: beam search may fill a row past its end while other rows go on
        row_bounds = [bound for bound in bounds for _ in range(num_return_sequences)]
        sequences = [strip_generated(ids, config, start)[:bound]
                     for ids, bound in zip(output.sequences.tolist(), row_bounds)]
        scores = self._scores(output, sequences, num_beams) if with_scores else [None] * len(sequences)
        pairs = list(zip(sequences, scores))
        return [pairs[i : i + num_return_sequences] for i in range(0, len(pairs), num_return_sequences)]

    def _plain_call(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, settings: dict):
        """For this package's model, a call for plain greedy or beam search (decoding.DecodingCall), else None."""
        if getattr(self.model.config, "model_type", None) != "scratch_transformer":
            return None
        return plain_decoding(self.model, None, None, {"input_ids": input_ids, "attention_mask": attention_mask,
                                                       **settings})

    def _search(self, call, bounds: list[int], with_scores: bool) -> list[list[tuple[list[int], float | None]]]:
        """decoding.py's greedy or beam search with each source's own bound: the hypotheses generate() gives, in
        less time."""
        greedy = call.num_beams == 1
        sequences, scores = search(self.model, call, torch.tensor(bounds, device=call.input_ids.device),
                                   with_log_probs=with_scores)
        returned = call.num_return_sequences
        hypotheses = []
        for row, ids in enumerate(sequences.tolist()):
            ids = strip_generated(ids, self.generation_config, call.decoder_start_token_id)[: bounds[row // returned]]
            if not with_scores:
                score = None
            elif greedy:
                score = float(scores[row, : len(ids)].sum()) / max(len(ids), 1) ** self.length_penalty
            else:
                score = float(scores[row])
            hypotheses.append((ids, score))
        return [hypotheses[i : i + returned] for i in range(0, len(hypotheses), returned)]

    def _scores(self, output, sequences: list[list[int]], num_beams: int) -> list[float]:
        """Beam search's own scores; for greedy search the same quantity from the step log-probabilities."""
        if num_beams > 1:
            return output.sequences_scores.tolist()
        log_probs = self.model.compute_transition_scores(output.sequences, output.scores, normalize_logits=True)
        return [float(row[: len(ids)].sum()) / max(len(ids), 1) ** self.length_penalty
                for row, ids in zip(log_probs, sequences)]

    @torch.no_grad()
    def cross_attention(self, source_ids: list[list[int]], target_ids: list[list[int]]) -> list[torch.Tensor]:
        """Per (source, translation) pair, the last decoder layer's cross-attention averaged over its heads, (T, S):
        row t is what the step that produced target token t attended to (one teacher-forced pass per batch)."""
        input_ids, attention_mask = self._padded(source_ids)
        start = decoder_start_token(self.model)
        decoder_input_ids, _ = self._padded([[start] + list(target[:-1]) for target in target_ids])
        with eager_attention(self.model):
            output = self.model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                                output_attentions=True, use_cache=False, return_dict=True)
        weights = output.cross_attentions[-1].float().mean(dim=1).cpu()  # (B, H, T, S) -> (B, T, S)
        return [weights[row, : len(target), : len(source)] for row, (source, target)
                in enumerate(zip(source_ids, target_ids))]


@contextlib.contextmanager
def eager_attention(model):
    """The model in eval mode with the eager attention kernel (the fused ones return no weights), restored after."""
    was_training, attention_kernel = model.training, model.config._attn_implementation
    model.eval()
    model.set_attn_implementation("eager")
    try:
        yield model
    finally:
        model.train(was_training)
        model.set_attn_implementation(attention_kernel)


# --------------------------------------------------------------------------------------------------------------
# Texts: documents, protected spans, glossaries, confidence
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TextOptions:
    """How texts are read before decoding and put together after it (translate_texts).

    segment: split each text into sentences (documents.py; False: each text is one unit, still split when longer
    than the model's limit). source_lang: the segmenter's language (None: the tokenizer's saved source language,
    else English rules). protect: None (the default) protects the default kinds of span when the model's tokenizer
    has the sentinel tokens (a model trained with masked spans) and not otherwise; True / False: on / off.
    protect_kinds: which kinds (protected_spans.DEFAULT_KINDS); protect_patterns: the user's regular expressions,
    protected whenever given. glossary: a glossary.Glossary, honoured whenever given. max_sentence_tokens: with
    `segment`, a sentence longer than this many tokens is translated in pieces cut at clauses (None: the length the
    model was trained on, `max_sentence_tokens` in its generation_config.json, which train.py sets to the 90th
    percentile of its training sources; a model without it: only the model's limit).
    """

    segment: bool = True
    source_lang: str | None = None
    max_sentence_tokens: int | None = None
    protect: bool | None = None
    protect_kinds: tuple = DEFAULT_KINDS
    protect_patterns: tuple = ()
    glossary: Glossary | None = None

    def __post_init__(self):
        for name in ("protect_kinds", "protect_patterns"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes, re.Pattern)):  # not its characters, one by one
                raise ProtectError(f"{name} must be a list, got the {type(value).__name__} {value!r}: pass [{value!r}]")
        object.__setattr__(self, "protect_kinds", tuple(self.protect_kinds))
        object.__setattr__(self, "protect_patterns", tuple(self.protect_patterns))
        if self.glossary is not None and not isinstance(self.glossary, Glossary):
            object.__setattr__(self, "glossary", Glossary.from_pairs(self.glossary))
        SpanProtector(self.protect_kinds, self.protect_patterns)  # unknown kinds and bad patterns refused now

    def protector(self, sentinels: bool) -> SpanProtector | None:
        """What finds the spans, for a model with (or without) sentinel tokens; None when nothing is protected."""
        kinds = self.protect_kinds if (sentinels if self.protect is None else self.protect) else ()
        if not kinds and not self.protect_patterns and not self.glossary:
            return None
        return SpanProtector(kinds, self.protect_patterns)


@dataclass
class SegmentTranslation:
    """One unit of a text (a sentence, or a piece of an over-long one): `source` as in the text, `model_text`
    what the model read (spans hidden), `hypotheses` best first (spans restored), `spans` how each protected span
    of the best came back ({"kind", "text", "how"}), `glossary` the glossary report of the best
    (glossary.report)."""

    source: str
    model_text: str
    hypotheses: list[Hypothesis]
    spans: list[dict]
    glossary: list[dict]


@dataclass
class TextTranslation:
    """One input text translated: `text` (its best translation, in the text's own white space and paragraphs),
    `confidence` (the mean log-probability per token over all its units; None without scores or units),
    `hypotheses` (n-best of the whole text: the k-th joins every unit's k-th), `segments` (the units)."""

    source: str
    text: str
    confidence: float | None
    hypotheses: list[Hypothesis]
    segments: list[SegmentTranslation]

    @property
    def spans(self) -> list[dict]:
        return [entry for segment in self.segments for entry in segment.spans]

    @property
    def glossary(self) -> list[dict]:
        return [entry for segment in self.segments for entry in segment.glossary]


def confidence(score: float | None, length: int, length_penalty: float) -> float | None:
    """The mean log-probability per token of a hypothesis of `length` tokens whose score is
    `sum of log-probabilities / length ** length_penalty`: `score * length ** (length_penalty - 1)`."""
    if score is None or length < 1:
        return None
    return score * length ** (length_penalty - 1)


@dataclass
class _Unit:
    """A unit to translate: which text it belongs to, its source, its protected form, terms it could not keep."""

    text_index: int
    source: str
    protected: ProtectedText
    lost_terms: list


def translate_texts(backend, tokenizer, texts: list[str], options: DecodingOptions | None = None,
                    text_options: TextOptions | None = None, *, progress: bool = False,
                    description: str = "translating",
                    on_batch: Callable[[int, float], None] | None = None) -> list[TextTranslation]:
    """Translate `texts` (documents of any length) with `backend`: every text cut into units (sentences, pieces
    of over-long ones), their spans hidden, all units translated as one sorted batch (`translate_batches`), the
    spans restored, and each text put back together in its own white space. One TextTranslation per text, in
    input order. Every path of the package (command line, translate(), pipeline, demo) goes through here."""
    options = options or DecodingOptions()
    text_options = text_options or TextOptions()
    check_texts(texts)
    sentinels = tokenizer_has_sentinels(tokenizer)
    protector = text_options.protector(sentinels)
    limit = source_limit(backend.max_positions, tokenizer) - 1  # room for </s>
    layouts, units = _plan(texts, tokenizer, text_options, protector, sentinels, limit,
                           _sentence_limit(backend, text_options, limit))
    found = translate_batches(backend, tokenizer, [unit.protected.model_text for unit in units], options,
                              progress=progress, description=description, on_batch=on_batch)
    links = _alignment_links(backend, tokenizer, units, found, options.batch_size)
    penalty = _length_penalty(backend)
    segments = [_segment(unit, hypotheses, links.get(number, {}), penalty)
                for number, (unit, hypotheses) in enumerate(zip(units, found))]
    per_text: list[list[SegmentTranslation]] = [[] for _ in texts]
    for unit, segment in zip(units, segments):
        per_text[unit.text_index].append(segment)
    return [_assemble(text, layout, parts, penalty) for text, layout, parts in zip(texts, layouts, per_text)]


def _sentence_limit(backend, text_options: TextOptions, limit: int) -> int:
    """The longest sentence translated whole: a model trained on sentences of up to ~N tokens stops early on a
    longer one (a sentence of a document can be ten verses long), so with `segment` longer sentences go in pieces."""
    trained = text_options.max_sentence_tokens or getattr(backend.generation_config, "max_sentence_tokens", None)
    return min(limit, int(trained)) if text_options.segment and trained else limit


def _plan(texts, tokenizer, text_options: TextOptions, protector, sentinels: bool, limit: int, split_at: int):
    """(layout per text, units): texts cut into sentences, sentences longer than `split_at` tokens into pieces
    (a warning for those over the model's `limit`), spans hidden."""
    language = text_options.source_lang or source_language(tokenizer)
    layouts = [split_document(text, language, text_options.segment, _span_ranges(text, protector, text_options))
               for text in texts]
    sentences = [model_text(unit.text) for layout in layouts for unit in layout.units]
    lengths = iter([len(ids) for ids in tokenizer(sentences, add_special_tokens=False, verbose=False)["input_ids"]]
                   if sentences else [])
    units, too_long = [], []
    for index, layout in enumerate(layouts):
        pieces = []
        for unit in layout.units:
            sentence = model_text(unit.text)
            length = next(lengths)
            keep_whole = [(s.start, s.end) for s in protector.find(sentence)] if protector and length > split_at else []
            split = [Unit(sentence)] if length <= split_at else split_long(sentence, tokenizer, split_at, keep_whole)
            if length > limit:
                too_long.append((index, len(split)))
            split[-1].separator += unit.separator
            pieces += split
        layout.units = pieces
        units += [_protect(index, piece.text, protector, text_options.glossary, sentinels) for piece in pieces]
    if too_long:
        logger.warning(f"{len(too_long)} sentence(s) longer than the model's limit of {limit} tokens were split into "
                       f"{sum(count for _, count in too_long)} pieces at clauses or between words, and translated "
                       f"piece by piece (first: text {too_long[0][0] + 1})")
    return layouts, units


def _span_ranges(text: str, protector, text_options: TextOptions) -> list[tuple[int, int]]:
    """Where the protected spans and glossary terms of a whole text are: no sentence ends inside one."""
    if protector is None or not text_options.segment:
        return []
    terms = text_options.glossary.find(text) if text_options.glossary else []
    return [(span.start, span.end) for span in protector.find(text, terms)]


def _protect(index: int, text: str, protector, glossary, sentinels: bool) -> _Unit:
    if protector is None:
        return _Unit(index, text, ProtectedText(text, text, [], sentinels), [])
    terms = glossary.find(text) if glossary else []
    spans = protector.find(text, terms)
    kept = {id(span) for span in spans}
    return _Unit(index, text, hide(text, spans, sentinels), [term for term in terms if id(term) not in kept])


def _needs_alignment(unit: _Unit, hypothesis: Hypothesis) -> bool:
    """Stripped spans and terms (always kept as text) are placed by the alignment; sentinels only when the model
    dropped one."""
    protected = unit.protected
    if not protected.spans:
        return False
    if not protected.sentinels:
        return True
    return len(protected.sentinel_numbers) < len(protected.spans) or any(
        sentinel(number) not in hypothesis.text for number in protected.sentinel_numbers.values())


def _alignment_links(backend, tokenizer, units: list[_Unit], found, batch_size: int) -> dict:
    """{unit number: {hypothesis rank: links}} for the hypotheses whose spans are placed by the alignment; empty
    when the backend gives no attention (spans then go to their relative positions)."""
    wanted = [(number, rank) for number, hypotheses in enumerate(found) for rank, hypothesis in enumerate(hypotheses)
              if hypothesis.token_ids and _needs_alignment(units[number], hypothesis)]
    if not wanted or not hasattr(backend, "cross_attention"):
        return {}
    encoded = {number: tokenizer(units[number].protected.model_text, return_offsets_mapping=True, verbose=False)
               for number in {number for number, _ in wanted}}
    special = set(getattr(tokenizer, "all_special_ids", []))
    links: dict = {}
    for begin in range(0, len(wanted), batch_size):
        batch = wanted[begin : begin + batch_size]
        weights = backend.cross_attention([encoded[number]["input_ids"] for number, _ in batch],
                                          [found[number][rank].token_ids for number, rank in batch])
        for (number, rank), attention in zip(batch, weights):
            links.setdefault(number, {})[rank] = _links(tokenizer, units[number].protected.model_text,
                                                        encoded[number], found[number][rank].token_ids,
                                                        attention, special)
    return links


def _links(tokenizer, text: str, encoded, target_ids: list[int], attention: torch.Tensor, special: set) -> list:
    """(source token's characters in `text`, white space left out; translation word) for each target token:
    the source token its attention weighs most (fairseq's hard alignment)."""
    sources = []
    for position, (token, (start, end)) in enumerate(zip(encoded["input_ids"], encoded["offset_mapping"])):
        while start < end and text[start].isspace():
            start += 1
        if token not in special and end > start:
            sources.append((position, start, end))
    target_positions = [t for t, token in enumerate(target_ids) if token not in special]
    words = word_indices(tokenizer, [target_ids[t] for t in target_positions])
    if not sources:
        return []
    columns = torch.tensor([position for position, _, _ in sources])
    links = []
    for t, word in zip(target_positions, words):
        if word is not None and t < attention.shape[0]:
            best = sources[int(attention[t, columns].argmax())]
            links.append((best[1], best[2], word))
    return links


def _segment(unit: _Unit, hypotheses: list[Hypothesis], links: dict, penalty: float) -> SegmentTranslation:
    """A unit's hypotheses with their spans restored, confidence added, and its span and glossary reports."""
    if not hypotheses:  # nothing for the model (white space, or spans only): the spans alone come back
        hypotheses = [Hypothesis("", None, [])]
    restored_hypotheses, spans, terms = [], [], []
    for rank, hypothesis in enumerate(hypotheses):
        restored = restore(unit.protected, hypothesis.text, links.get(rank))
        restored_hypotheses.append(Hypothesis(restored.text, hypothesis.score, hypothesis.token_ids,
                                              confidence(hypothesis.score, len(hypothesis.token_ids), penalty)))
        if rank == 0:
            protected = unit.protected
            spans = [{"kind": span.kind, "text": span.text, "how": how}
                     for span, how in zip(protected.spans, restored.outcomes) if span.kind != "term"]
            spans += [{"kind": span.kind, "text": span.text, "how": "not protected: more spans than sentinels"}
                      for span in protected.unprotected]
            term_spans = [(span, how) for span, how in zip(protected.spans, restored.outcomes) if span.kind == "term"]
            terms = glossary_report([span for span, _ in term_spans], [how for _, how in term_spans], restored.text,
                                    unit.lost_terms + [s for s in protected.unprotected if s.kind == "term"])
    return SegmentTranslation(unit.source, unit.protected.model_text, restored_hypotheses, spans, terms)


def _assemble(text: str, layout, segments: list[SegmentTranslation], penalty: float) -> TextTranslation:
    """A text's translation from its units': joined in the text's white space; n-best and confidence combined."""
    if not segments:
        return TextTranslation(text, layout.join([]), None, [], [])
    count = max(len(segment.hypotheses) for segment in segments)
    hypotheses = []
    for rank in range(count):
        chosen = [segment.hypotheses[min(rank, len(segment.hypotheses) - 1)] for segment in segments]
        hypotheses.append(_joined(layout.join([h.text for h in chosen]), chosen, penalty))
    if all(not segment.model_text.strip() for segment in segments):  # spans only: nothing was translated
        hypotheses = [Hypothesis(hypotheses[0].text, None, [])] if count else []
    return TextTranslation(text, hypotheses[0].text if hypotheses else layout.join([]),
                           hypotheses[0].confidence if hypotheses else None, hypotheses, segments)


def _joined(text: str, parts: list[Hypothesis], penalty: float) -> Hypothesis:
    """One hypothesis of a whole text from one of each unit's: token ids one after the other, the score and
    confidence of all its tokens together (units the model did not translate left out)."""
    scored = [part for part in parts if part.token_ids]
    ids = [token for part in scored for token in part.token_ids]
    if not scored or any(part.score is None for part in scored):
        return Hypothesis(text, None, ids)
    log_prob = sum(part.score * len(part.token_ids) ** penalty for part in scored)
    return Hypothesis(text, log_prob / len(ids) ** penalty, ids, log_prob / len(ids))


def _length_penalty(backend) -> float:
    """The exponent of the backend's score normalisation: its own, else its generation_config's, else 1."""
    penalty = getattr(backend, "length_penalty", None)
    if penalty is None:
        penalty = getattr(backend.generation_config, "length_penalty", None)
    return 1.0 if penalty is None else penalty


# --------------------------------------------------------------------------------------------------------------
# Cross-attention and alignments
# --------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def cross_attention_matrices(model, tokenizer, source_text: str, target_ids) -> torch.Tensor:
    """Cross-attention weights (layers, heads, T, S) of `model` translating `source_text` into `target_ids`.

    `target_ids` are the generated tokens (a list or 1-D tensor, with or without the leading decoder start
    token, usually ending with `</s>`). One teacher-forced forward pass recomputes what the decoder saw when it
    produced each of them, which is exact for greedy and beam search alike: row t is the attention of the step
    that predicted target token t, over the S source tokens (including the `</s>` the tokenizer appends; the source
    cut to the model's limit as for translating). Each row sums to 1.
    """
    target = without_start_token(torch.as_tensor(target_ids, dtype=torch.long), model)
    if not target:
        raise ValueError("target_ids is empty: there is no generated token to show attention for.")
    device = next(model.parameters()).device
    limit = source_limit(getattr(model.config, "max_position_embeddings", None), tokenizer)
    encoded = tokenizer(source_text, return_tensors="pt", truncation=True, max_length=limit)
    decoder_input_ids = torch.tensor([[decoder_start_token(model)] + target[:-1]], device=device)  # (1, T)
    with eager_attention(model):
        output = model(input_ids=encoded["input_ids"].to(device), attention_mask=encoded["attention_mask"].to(device),
                       decoder_input_ids=decoder_input_ids, output_attentions=True, use_cache=False, return_dict=True)
    # per layer (1, H, T, S) -> (layers, H, T, S)
    return torch.cat([layer.float().cpu() for layer in output.cross_attentions], dim=0)


def argmax_alignment(attention: torch.Tensor, source_ids: list[int], target_ids: list[int], special_ids: set[int],
                     layer: int = -1) -> list[tuple[int, int]]:
    """fairseq's hard alignment on tokens: for each target token, the source token that `layer`'s head-averaged
    cross-attention (`attention`: (layers, heads, T, S)) weighs most. Special tokens (`</s>`, padding) are left
    out on both sides, and indices count only the other tokens: (source index, target index) pairs."""
    weights = attention[layer].mean(dim=0)  # (T, S)
    source_kept = [s for s, token in enumerate(source_ids[: weights.shape[1]]) if token not in special_ids]
    target_kept = [t for t, token in enumerate(target_ids[: weights.shape[0]]) if token not in special_ids]
    if not source_kept or not target_kept:
        return []
    best = weights[target_kept][:, source_kept].argmax(dim=-1).tolist()
    return [(source, target) for target, source in enumerate(best)]


def word_indices(tokenizer, ids: list[int]) -> list[int | None]:
    """For each of `ids` (special tokens left out), the index of the whitespace-separated word of the decoded text
    it belongs to; None for a token of white space alone. Found by decoding growing prefixes, so it works for any
    tokenizer whose decoding of a prefix is a prefix of the text (byte-level BPE, SentencePiece, WordPiece)."""
    indices = []
    for end in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:end], skip_special_tokens=False)
        words = len(prefix.split())
        indices.append(None if not prefix or prefix[-1].isspace() or words == 0 else words - 1)
    return indices


def hard_alignment(model, tokenizer, source_text: str, target_ids, layer: int = -1,
                   unit: str = "words") -> list[tuple[int, int]]:
    """Hard alignment of `source_text` and its translation `target_ids`: sorted (source, target) pairs, fairseq's
    definition (`argmax_alignment`) on `layer` (an index into the decoder layers, -1 the last).

    unit "words": indices of whitespace-separated words (of `source_text` and of the translation as printed), a
    pair for every word pair some token pair links; "tokens": indices of the non-special tokens."""
    if unit not in ("words", "tokens"):
        raise ValueError(f"unit must be 'words' or 'tokens', got {unit!r}")
    layers = model.config.decoder_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not -layers <= layer < layers:
        raise ValueError(f"layer {layer!r} is not a decoder layer: the model has {layers} (0..{layers - 1}, or -1)")
    target = without_start_token(target_ids, model)
    attention = cross_attention_matrices(model, tokenizer, source_text, target)
    limit = source_limit(getattr(model.config, "max_position_embeddings", None), tokenizer)
    source = tokenizer(source_text, truncation=True, max_length=limit)["input_ids"]
    special = set(getattr(tokenizer, "all_special_ids", [])) | {model.config.pad_token_id} - {None}
    pairs = argmax_alignment(attention, source, target, special, layer)
    if unit == "tokens":
        return sorted(pairs)
    source_words = word_indices(tokenizer, [token for token in source if token not in special])
    target_words = word_indices(tokenizer, [token for token in target if token not in special])
    return sorted({(source_words[s], target_words[t]) for s, t in pairs
                   if source_words[s] is not None and target_words[t] is not None})


def text_alignment(model, tokenizer, translation: TextTranslation, rank: int = 0, layer: int = -1,
                   unit: str = "words") -> list[tuple[int, int]]:
    """`hard_alignment` of a whole text and its `rank`-th hypothesis: each unit's pairs, offset by the words (or
    tokens) of the units before it. Indices count what the model read and wrote (protected spans, hidden from it,
    are not counted)."""
    special = set(getattr(tokenizer, "all_special_ids", [])) | {model.config.pad_token_id} - {None}
    pairs, source_offset, target_offset = [], 0, 0
    for segment in translation.segments:
        hypothesis = segment.hypotheses[min(rank, len(segment.hypotheses) - 1)]
        if hypothesis.token_ids:
            pairs += [(s + source_offset, t + target_offset) for s, t in
                      hard_alignment(model, tokenizer, segment.model_text, hypothesis.token_ids, layer, unit)]
        if unit == "words":
            source_offset += len(segment.model_text.split())
            target_offset += len(decode_ids(tokenizer, hypothesis.token_ids).split())
        else:
            source_offset += sum(token not in special for token in tokenizer(segment.model_text)["input_ids"])
            target_offset += sum(token not in special for token in hypothesis.token_ids)
    return sorted(pairs)


def format_alignment(pairs: list[tuple[int, int]]) -> str:
    """Pairs as fairseq and fast_align print them: `0-0 1-2 2-1` (source-target)."""
    return " ".join(f"{source}-{target}" for source, target in pairs)


__all__ = [
    "DEFAULT_BATCH_SIZE",
    "SegmentTranslation",
    "TextOptions",
    "TextTranslation",
    "confidence",
    "eager_attention",
    "translate_texts",
    "DEFAULT_MAX_LEN_A",
    "DEFAULT_MAX_LEN_B",
    "FALLBACK_MAX_NEW_TOKENS",
    "DecodingOptions",
    "Hypothesis",
    "InvalidOption",
    "TorchBackend",
    "argmax_alignment",
    "check_texts",
    "check_tokenizer_fits",
    "cross_attention_matrices",
    "decode_ids",
    "format_alignment",
    "hard_alignment",
    "length_bound",
    "new_tokens_cap",
    "source_limit",
    "text_alignment",
    "translate_batches",
    "word_indices",
]
