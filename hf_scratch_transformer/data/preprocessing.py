"""Tokenising and filtering a run's splits, and the raw sources and references evaluation scores against.

One tokenising pass reads each split; the filters then work on arrays of lengths (`datasets` caches the
result), so a corpus of a million pairs is prepared in seconds once cached.

Before a pair is tokenised, the protected spans both of its sides share (placeholders, markup, URLs, e-mail
addresses: protected_spans.DEFAULT_KINDS) are masked by the same sentinel token (`mask_shared_spans`), when
--mask_protected_spans is on (the default) and the tokenizer has the sentinel tokens: the model learns to carry
`｟0｠` where the source has it, which is what it reads when translation protects spans. This is done for every
split's token ids (the validation loss measures the task the model is trained on); the raw sources and references
that BLEU and chrF read are left as they are (evaluation translates them through the core, which protects the spans
itself).
"""

import json
import math
import logging
from dataclasses import dataclass
from functools import partial

import numpy as np
import pyarrow.compute as pc
from datasets import Dataset, DatasetDict, Features, IterableDataset, IterableDatasetDict, List, Value
from datasets.fingerprint import Hasher
from transformers import DataCollatorForSeq2Seq

from ..protected_spans import DEFAULT_PATTERNS, MAX_SENTINELS, SpanProtector, sentinel, tokenizer_has_sentinels
from .loading import DataArguments, cache_faults
from .tokenization import tokenizer_can_train_on

logger = logging.getLogger("hf_scratch_transformer")
# No side of a training pair is tokenised if it has more characters than this many per allowed token (a BPE token
# of natural text averages 3-5): such a pair would be dropped as over-long anyway, after costly tokenisation.
MAX_CHARS_PER_TOKEN = 16

# What the one tokenising pass marks on each pair, and why a pair is dropped (the filter report's keys).
PAIR_FINE, PAIR_EMPTY, PAIR_TOO_LONG = 0, 1, 2
KEEP, EMPTY, TOO_LONG, BAD_RATIO = 0, 1, 2, 3
TOKENIZED_FEATURES = Features({"input_ids": List(Value("int32")), "attention_mask": List(Value("int8")),
                               "labels": List(Value("int32")), "problem": Value("int8"), "masked": Value("int8")})


def is_nonempty_pair(example: dict, source_lang: str, target_lang: str) -> bool:
    """True when both sides of the pair hold some non-whitespace text."""
    pair = example.get("translation") or {}
    return all(isinstance(pair.get(lang), str) and pair[lang].strip() for lang in (source_lang, target_lang))


def evaluation_pairs(raw_split, args: DataArguments) -> tuple[list[str], list[str]]:
    """Sources and references of an evaluation split, aligned row for row with its preprocessed version."""
    keep = partial(is_nonempty_pair, source_lang=args.source_lang, target_lang=args.target_lang)
    pairs = [example["translation"] for example in raw_split if keep(example)]
    return [pair[args.source_lang] for pair in pairs], [pair[args.target_lang] for pair in pairs]


@dataclass
class TrainingData:
    """A run's tokenised, filtered splits (`datasets`, with what the filters dropped per split in `filter_report`)
    and the raw sources and references of the validation and test splits, as BLEU/chrF read them."""

    datasets: dict
    filter_report: dict
    eval_sources: list[str]
    eval_references: list[str]
    test_sources: list[str]
    test_references: list[str]


def _pair_problems(translations: list, args: DataArguments, is_train: bool) -> list[int]:
    """PAIR_EMPTY for a pair with an empty side; for training, PAIR_TOO_LONG for a side of more than
    MAX_CHARS_PER_TOKEN characters per allowed token or with a giant word (see `tokenizer_can_train_on`): such a pair
    is not tokenised at all (tokenizer training and tokenisation would spend super-linear or useless time on it)."""
    languages = (args.source_lang, args.target_lang)
    limits = (MAX_CHARS_PER_TOKEN * args.max_source_length, MAX_CHARS_PER_TOKEN * args.max_target_length)
    problems = []
    for pair in translations:
        if not is_nonempty_pair({"translation": pair}, *languages):
            problems.append(PAIR_EMPTY)
        elif is_train and not all(len(pair[lang]) <= limit and tokenizer_can_train_on(pair[lang])
                                  for lang, limit in zip(languages, limits)):
            problems.append(PAIR_TOO_LONG)
        else:
            problems.append(PAIR_FINE)
    return problems


def mask_shared_spans(source: str, target: str, protector: SpanProtector) -> tuple[str, str, int]:
    """(source, target, number of spans masked): each span `protector` finds in the source whose exact text is also
    a span of the target (the k-th occurrence of a text paired with the k-th in the target) replaced on both sides by
    the same sentinel, numbered in source order (at most MAX_SENTINELS); spans on one side only stay text.

        >>> mask_shared_spans("Delete %d files in %s?", "¿Borrar %d archivos en %s?", SpanProtector())
        ('Delete ｟0｠ files in ｟1｠?', '¿Borrar ｟0｠ archivos en ｟1｠?', 2)
    """
    source_spans = protector.find(source)
    if not source_spans:
        return source, target, 0
    unused: dict[str, list] = {}
    for span in protector.find(target):
        unused.setdefault(span.text, []).append(span)
    shared = [(span, unused[span.text].pop(0)) for span in source_spans if unused.get(span.text)][:MAX_SENTINELS]
    if not shared:
        return source, target, 0
    masked_source = _replace(source, [(s.start, s.end, sentinel(i)) for i, (s, _) in enumerate(shared)])
    masked_target = _replace(target, sorted((t.start, t.end, sentinel(i)) for i, (_, t) in enumerate(shared)))
    return masked_source, masked_target, len(shared)


def _replace(text: str, pieces: list[tuple[int, int, str]]) -> str:
    """`text` with each sorted, non-overlapping [start, end) range replaced by its piece."""
    out, position = [], 0
    for start, end, piece in pieces:
        out += [text[position:start], piece]
        position = end
    return "".join(out) + text[position:]


def _tokenize_batch(translations: list, tokenizer, args: DataArguments, is_train: bool, mask: bool = False) -> dict:
    """Token ids of the usable pairs (empty lists for the others, marked in ``problem``), truncated one token beyond
    the maxima for training (so that over-long shows) and at the maxima otherwise; with `mask`, the spans both sides
    share masked first (their number in ``masked``)."""
    problems = _pair_problems(translations, args, is_train)
    usable = [index for index, problem in enumerate(problems) if problem == PAIR_FINE]
    columns = {name: [[] for _ in translations] for name in ("input_ids", "attention_mask", "labels")}
    masked = [0] * len(translations)
    if not usable:  # the tokenizer refuses an empty list
        return {**columns, "problem": problems, "masked": masked}
    pairs = [(translations[i][args.source_lang], translations[i][args.target_lang]) for i in usable]
    if mask:
        protector = SpanProtector()
        triples = [mask_shared_spans(source, target, protector) for source, target in pairs]
        pairs = [(source, target) for source, target, _ in triples]
        for index, (_, _, count) in zip(usable, triples):
            masked[index] = count
    slack = 1 if is_train else 0
    sources = tokenizer([source for source, _ in pairs], truncation=True, max_length=args.max_source_length + slack)
    targets = tokenizer(text_target=[target for _, target in pairs], truncation=True,
                        max_length=args.max_target_length + slack)
    for row, index in enumerate(usable):
        columns["input_ids"][index] = sources["input_ids"][row]
        columns["attention_mask"][index] = sources["attention_mask"][row]
        columns["labels"][index] = targets["input_ids"][row]
    return {**columns, "problem": problems, "masked": masked}


def _drop_reasons(problems: np.ndarray, source_lengths: np.ndarray, target_lengths: np.ndarray,
                  args: DataArguments, is_train: bool) -> np.ndarray:
    """Why each tokenised pair is dropped (KEEP if it is not), in the order the filters apply: EMPTY; for training
    TOO_LONG (before tokenising, or over max_source_length / max_target_length tokens) then BAD_RATIO (token-length
    ratio of source and target, </s> not counted, above max_length_ratio)."""
    reasons = np.where(problems == PAIR_EMPTY, EMPTY, np.where(problems == PAIR_TOO_LONG, TOO_LONG, KEEP))
    if is_train:
        over = (source_lengths > args.max_source_length) | (target_lengths > args.max_target_length)
        reasons[(reasons == KEEP) & over] = TOO_LONG
        sources, targets = np.maximum(source_lengths - 1, 1), np.maximum(target_lengths - 1, 1)
        reasons[(reasons == KEEP) & (np.maximum(sources / targets, targets / sources) > args.max_length_ratio)] = \
            BAD_RATIO
    return reasons


def preprocess_corpus(raw: DatasetDict | IterableDatasetDict, tokenizer, args: DataArguments):
    """Tokenise every split into ``input_ids``/``attention_mask``/``labels`` and filter the training pairs.

    Train drops, in this order, pairs with an empty side, over-long pairs (first, before tokenising, a side of more
    than ``MAX_CHARS_PER_TOKEN`` characters per allowed token or with a giant word, see
    :func:`tokenization.tokenizer_can_train_on`; then a side longer than ``max_source_length`` /
    ``max_target_length`` tokens), and pairs whose token-length ratio exceeds ``max_length_ratio``. Validation and
    test keep every non-empty pair, truncated to the maxima (use :func:`evaluation_pairs` for the aligned
    references). One tokenising pass reads each split; the filters then work on arrays of lengths. With
    ``--mask_protected_spans`` and a tokenizer that has the sentinel tokens, the spans both sides of a pair share are
    masked first (:func:`mask_shared_spans`; one log line says whether). Returns the tokenised splits and a report
    ``{split: {"input", "empty", "too_long", "bad_ratio", "kept", "masked"}}`` ("masked": kept pairs with a span
    masked); counts are ``None`` for streamed splits, whose length is unknown.
    """
    mask = protected_span_masking(tokenizer, args)
    processed, report = {}, {}
    with cache_faults():
        for name, split in raw.items():
            preprocess = _preprocess_stream if isinstance(split, IterableDataset) else _preprocess_split
            processed[name], report[name] = preprocess(split, name == "train", tokenizer, args, mask)
    result = IterableDatasetDict(processed) if args.streaming else DatasetDict(processed)
    return result, report


def protected_span_masking(tokenizer, args: DataArguments) -> bool:
    """Whether this run masks the spans both sides of a pair share: --mask_protected_spans and a tokenizer with the
    sentinel tokens (a new one gets them with the flag; a model given to --model_name_or_path may lack them). Says
    so in one log line."""
    if not args.mask_protected_spans:
        logger.info("protected spans: not masked (--mask_protected_spans false)")
        return False
    if not tokenizer_has_sentinels(tokenizer):
        logger.info("protected spans: not masked, the tokenizer has no sentinel tokens (a model trained with "
                    "--mask_protected_spans false)")
        return False
    logger.info("protected spans: the placeholders, markup, URLs and e-mail addresses both sides of a pair share "
                "are masked by sentinel tokens (--mask_protected_spans false: left as text)")
    return True


def _preprocess_split(split: Dataset, is_train: bool, tokenizer, args: DataArguments,
                      mask: bool = False) -> tuple[Dataset, dict]:
    """(tokenised split, filter report) of an in-memory split: one map (cached by `datasets`), then the filters on
    arrays of lengths and a selection of the kept rows."""
    tokenize = partial(_tokenize_batch, tokenizer=tokenizer, args=args, is_train=is_train, mask=mask)
    tokenized = split.map(tokenize, batched=True, input_columns=["translation"], remove_columns=split.column_names,
                          features=TOKENIZED_FEATURES, num_proc=args.preprocessing_num_workers,
                          load_from_cache_file=not args.overwrite_cache,
                          new_fingerprint=_tokenized_fingerprint(split, tokenizer, args, is_train, mask))
    reasons = _drop_reasons(column_array(tokenized, "problem"), list_lengths(tokenized, "input_ids"),
                            list_lengths(tokenized, "labels"), args, is_train)
    counts = np.bincount(reasons, minlength=4)
    report = {"input": len(split), "empty": int(counts[EMPTY]), "too_long": int(counts[TOO_LONG]),
              "bad_ratio": int(counts[BAD_RATIO]), "kept": int(counts[KEEP]),
              "masked": int(((reasons == KEEP) & (column_array(tokenized, "masked") > 0)).sum())}
    kept = tokenized if report["kept"] == len(split) else tokenized.select(np.flatnonzero(reasons == KEEP))
    return kept.remove_columns(["problem", "masked"]), report


def _preprocess_stream(split: IterableDataset, is_train: bool, tokenizer, args: DataArguments, mask: bool = False):
    """(tokenised stream, unknown counts): the same tokenising and filters, applied while the stream is read."""
    columns = split.column_names or list(next(iter(split)).keys())
    tokenize = partial(_tokenize_batch, tokenizer=tokenizer, args=args, is_train=is_train, mask=mask)
    tokenized = split.map(tokenize, batched=True, input_columns=["translation"], remove_columns=columns,
                          features=TOKENIZED_FEATURES)
    kept = tokenized.filter(partial(_kept_in_batch, args=args, is_train=is_train), batched=True,
                            input_columns=["problem", "input_ids", "labels"])
    report = dict.fromkeys(("input", "empty", "too_long", "bad_ratio", "kept", "masked"))
    return kept.remove_columns(["problem", "masked"]), report


def _kept_in_batch(problems: list, inputs: list, labels: list, args: DataArguments, is_train: bool) -> list[bool]:
    lengths = [np.array([len(ids) for ids in column], dtype=np.int64) for column in (inputs, labels)]
    return list(_drop_reasons(np.array(problems, dtype=np.int64), *lengths, args, is_train) == KEEP)


def _tokenized_fingerprint(split: Dataset, tokenizer, args: DataArguments, is_train: bool, mask: bool = False) -> str:
    """The `datasets` cache key of a tokenised split: what decides the token ids (the tokenizer's content, not the
    folder it was loaded from, which `datasets` would hash too and which differs between runs), the lengths, the
    languages, whether shared spans are masked, and the code of the tokenising and masking functions."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    for call_state in ("truncation", "padding"):  # set by the last call (the lengths are in `settings`)
        backend.pop(call_state, None)
    content = [backend, tokenizer.special_tokens_map, tokenizer.split_special_tokens]
    settings = [args.source_lang, args.target_lang, args.max_source_length, args.max_target_length, is_train,
                MAX_CHARS_PER_TOKEN, mask]
    code = [Hasher.hash(function) for function in (_tokenize_batch, _pair_problems, tokenizer_can_train_on,
                                                   mask_shared_spans, _replace)]
    if mask:  # what finds the spans (a change of a pattern changes the masking)
        code.append(Hasher.hash([DEFAULT_PATTERNS, MAX_SENTINELS, Hasher.hash(SpanProtector.find)]))
    return Hasher.hash([split._fingerprint, code, content, settings])


def list_lengths(dataset: Dataset, column: str) -> np.ndarray:
    """The length of ``column``'s list in every row, read from the dataset's Arrow table without turning any list
    into Python objects (O(rows), not O(tokens))."""
    return _through_indices(dataset, pc.list_value_length(dataset.data.column(column)))


def column_array(dataset: Dataset, column: str) -> np.ndarray:
    """A scalar column of every row as a numpy array, read from the Arrow table."""
    return _through_indices(dataset, dataset.data.column(column))


def _through_indices(dataset: Dataset, values) -> np.ndarray:
    """``values`` (one per row of the dataset's table) for the dataset's rows: a filtered or selected dataset keeps
    its rows as an indices mapping over the table (`datasets`' `_indices`, which has no public accessor; reading
    rows through it one batch at a time costs ~100x more for the lengths of 1M pairs)."""
    indices = getattr(dataset, "_indices", None)
    if indices is not None:
        values = values.take(indices.column(0))
    return values.to_numpy()


def sequence_lengths(dataset: Dataset) -> tuple[np.ndarray, np.ndarray]:
    """Token lengths of the sources (``input_ids``) and targets (``labels``) of a tokenised split."""
    return list_lengths(dataset, "input_ids"), list_lengths(dataset, "labels")


def mean_pair_tokens(dataset) -> float | None:
    """Mean tokens of a tokenised split's pairs on their longer side, what a token-bucketed batch is paid by (None for
    a streamed split, whose lengths are unknown before it is read, or an empty one)."""
    if not isinstance(dataset, Dataset) or len(dataset) == 0:
        return None
    return float(np.maximum(*sequence_lengths(dataset)).mean())


def make_collator(tokenizer) -> DataCollatorForSeq2Seq:
    """Pads ``input_ids`` with the pad id and ``labels`` with -100; the model derives decoder inputs from labels."""
    return DataCollatorForSeq2Seq(tokenizer, model=None, label_pad_token_id=-100, pad_to_multiple_of=None)




SENTENCE_LENGTH_SAMPLE = 20_000  # training pairs whose source lengths give `sentence_tokens`


def sentence_tokens(train, percentile: float = 90.0) -> int | None:
    """The source length (tokens, </s> not counted) that `percentile` % of the tokenised training split's sources
    (its first SENTENCE_LENGTH_SAMPLE) do not exceed: the longest sentence the model saw often enough to translate
    whole (90: on the shipped corpus's test chapters as documents, 56 tokens gave document BLEU 30.43 where the
    99th percentile's 76 gave 29.83, and line by line 27.56 against 26.98 unsplit). None for a streamed or empty
    split."""
    if train is None or not hasattr(train, "__len__") or len(train) == 0 or "input_ids" not in train.column_names:
        return None
    sample = train.select(range(min(len(train), SENTENCE_LENGTH_SAMPLE)))["input_ids"]
    lengths = sorted(len(ids) - 1 for ids in sample)
    return max(1, lengths[min(len(lengths) - 1, math.ceil(percentile / 100 * len(lengths)) - 1)])
