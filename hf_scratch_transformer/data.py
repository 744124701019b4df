"""Parallel corpora: loading, tokenisation, filtering and batching.

Every source (the shipped English–Spanish Bible, a Hub dataset, local json/jsonl/csv/tsv files) is turned into a
``DatasetDict`` with ``train``/``validation``/``test`` splits whose examples carry a ``translation`` dict keyed by
language code, the convention of Hub translation datasets. Argument names follow transformers' ``run_translation.py``.
"""

import gzip
import json
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict, load_dataset
from torch.utils.data import Sampler
from transformers import DataCollatorForSeq2Seq

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
SPLITS = ("train", "validation", "test")
SHIPPED_CORPUS_FILES = {split: CORPUS_DIR / f"bible_en_es.{split}.jsonl.gz" for split in SPLITS}
KEY_SAMPLE = 1000  # records looked at for the language keys when the schema does not list them
SPLIT_ALIASES = {"valid": "validation", "dev": "validation", "eval": "validation"}
FILE_BUILDERS = {
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t"}),
}


@dataclass
class DataArguments:
    """Which corpus to load and how to tokenise, filter and batch it."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Hub dataset with a `translation` column (e.g. wmt16). Default: the shipped corpus."},
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset configuration (e.g. ro-en)."})
    train_file: str | None = field(default=None, metadata={"help": "Local training file: .json, .jsonl, .csv or .tsv."})
    validation_file: str | None = field(default=None, metadata={"help": "Local validation file (same formats)."})
    test_file: str | None = field(default=None, metadata={"help": "Local test file (same formats)."})
    source_lang: str = field(default="en", metadata={"help": "Source language key of the `translation` dicts."})
    target_lang: str = field(default="es", metadata={"help": "Target language key of the `translation` dicts."})
    max_source_length: int = field(default=256, metadata={"help": "Maximum source length in tokens, </s> included."})
    max_target_length: int = field(default=256, metadata={"help": "Maximum target length in tokens, </s> included."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training pairs."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep only the first N validation pairs."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Keep only the first N test pairs."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percentage of train carved out for each missing validation/test split."}
    )
    streaming: bool = field(default=False, metadata={"help": "Stream the corpus instead of loading it in memory."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenisation."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute cached tokenised datasets."})
    max_length_ratio: float = field(
        default=3.0,
        metadata={"help": "Drop training pairs whose source/target token-length ratio exceeds this (or 1/this)."},
    )
    tokenizer_vocab_size: int = field(default=4000, metadata={"help": "Vocabulary size of the joint BPE tokenizer."})
    tokenizer_max_sentences: int | None = field(
        default=500_000, metadata={"help": "Train the tokenizer on at most this many sampled sentences."}
    )
    max_tokens: int | None = field(
        default=1024,
        metadata={
            "help": "Token budget per batch (batch size x longest padded side); 0: fixed-size sentence batches of "
            "--per_device_train_batch_size."
        },
    )


# ----------------------------------------------------------------------------------------------------------- errors


class CorpusError(ValueError):
    """A corpus that cannot be used as given; the message names the file (and line) and what to fix."""


class CorpusFileNotFoundError(CorpusError, FileNotFoundError):
    """A corpus file that does not exist."""


class CorpusKeyError(CorpusError, KeyError):
    """A language key or column absent from the corpus."""

    def __str__(self) -> str:  # KeyError would show the message in quotes
        return str(self.args[0]) if self.args else ""


# ---------------------------------------------------------------------------------------------------------- loading


def load_parallel_corpus(args: DataArguments, seed: int = 42) -> DatasetDict | IterableDatasetDict:
    """Load the corpus chosen by ``args`` as train/validation/test splits of ``translation`` pairs.

    Missing validation or test splits are carved deterministically out of train (``validation_split_percentage``
    each). With ``args.streaming`` the splits are ``IterableDataset``s.
    """
    if args.dataset_name:
        corpus = _load_hub_dataset(args)
    elif args.train_file or args.validation_file or args.test_file:
        corpus = _load_local_files(args)
    else:
        files = {split: str(path) for split, path in SHIPPED_CORPUS_FILES.items()}
        corpus = load_dataset("json", data_files=files, streaming=args.streaming)
    corpus = {SPLIT_ALIASES.get(name, name): split for name, split in corpus.items()}
    if "train" not in corpus:
        raise CorpusError(f"The corpus has no train split (splits found: {sorted(corpus)}).")
    corpus = _carve_missing_splits(corpus, args.validation_split_percentage, seed)
    for name in SPLITS:
        _check_language_keys(corpus[name], name, args.source_lang, args.target_lang)
    corpus = _limit_samples(corpus, args)
    return IterableDatasetDict(corpus) if args.streaming else DatasetDict(corpus)


def _load_hub_dataset(args: DataArguments):
    """``load_dataset`` from the Hub, with a clear message when the Hub cannot be reached."""
    try:
        return load_dataset(args.dataset_name, args.dataset_config_name, streaming=args.streaming)
    except ConnectionError as error:
        raise ConnectionError(
            f"Could not download the dataset {args.dataset_name!r} (config {args.dataset_config_name!r}) from the "
            f"Hugging Face Hub: {error}. Without network access, pass local files with --train_file "
            "(and --validation_file / --test_file), or omit --dataset_name to use the shipped corpus."
        ) from error


def _load_local_files(args: DataArguments) -> dict:
    """Load each given file (json, jsonl, csv or tsv, chosen by extension) as one split."""
    if not args.train_file:
        raise CorpusError("--validation_file / --test_file need a --train_file as well.")
    given = {"train": args.train_file, "validation": args.validation_file, "test": args.test_file}
    return {split: _load_file(path, split, args) for split, path in given.items() if path}


def _load_file(path: str, split: str, args: DataArguments):
    """Load one local file as a split with a ``translation`` column."""
    if os.path.isdir(path):
        raise CorpusError(f"The {split} file {path!r} is a directory: give the path of a file inside it.")
    if not os.path.isfile(path):
        raise CorpusFileNotFoundError(f"The {split} file {path!r} does not exist.")
    suffix = Path(path.removesuffix(".gz")).suffix.lower()
    if suffix not in FILE_BUILDERS:
        raise CorpusError(
            f"Cannot read {path!r}: the extension must be one of {sorted(FILE_BUILDERS)} (or that + .gz)."
        )
    if os.path.getsize(path) == 0:
        raise CorpusError(f"The {split} file {path!r} is empty.")
    _check_utf8(path, split)
    builder, options = FILE_BUILDERS[suffix]
    if builder == "json":
        _check_record_shapes(path, split, args.source_lang, args.target_lang)
    try:
        dataset = load_dataset(builder, data_files={split: path}, split=split, streaming=args.streaming, **options)
        empty = _is_empty(dataset)
    except Exception as error:  # noqa: BLE001  (pyarrow, pandas and datasets each raise their own kind)
        where = _json_error_location(path) if builder == "json" else None
        cause = error.__cause__ or error
        if where:
            raise CorpusError(f"The {split} file {path!r} is not valid {suffix[1:]}: {where}") from error
        reason = f"{type(cause).__name__}: {' '.join(str(cause).split())[:300]}"
        raise CorpusError(f"The {split} file {path!r} holds no examples or is not valid {suffix[1:]}: {reason}") from error
    if empty:
        raise CorpusError(f"The {split} file {path!r} holds no examples.")
    columns = dataset.column_names or list(next(iter(dataset)).keys())
    if "translation" in columns:
        return dataset
    missing = [lang for lang in (args.source_lang, args.target_lang) if lang not in columns]
    if missing:
        raise CorpusKeyError(
            f"The {split} file {path!r} has neither a `translation` column nor columns for the languages {missing}; "
            f"its columns are {columns}."
        )
    to_pairs = partial(_columns_to_translation, languages=(args.source_lang, args.target_lang))
    return dataset.map(to_pairs, batched=True, remove_columns=columns)


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _check_utf8(path: str, split: str) -> None:
    """Refuse a file that is not UTF-8 (the json reader would silently replace the bad bytes), naming the line."""
    try:
        with _open_binary(path) as handle:
            for number, line in enumerate(handle, start=1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise CorpusError(
                        f"The {split} file {path!r} is not UTF-8: line {number}, byte {error.start + 1} of the line "
                        f"({line[error.start:error.start + 1]!r}). Convert it, e.g. `iconv -f latin1 -t utf-8`."
                    ) from None
    except (OSError, EOFError) as error:  # unreadable, or a corrupt .gz
        raise CorpusError(f"Cannot read the {split} file {path!r}: {error}") from error


def _json_error_location(path: str) -> str | None:
    """Where a JSON Lines (or JSON) file first fails to parse: "line N: reason", or None if it parses."""
    with _open_binary(path) as handle:
        text = handle.read().decode("utf-8", errors="replace")
    lines = text.splitlines()
    first = next((line for line in lines if line.strip()), "")
    try:
        json_lines = isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        json_lines = not first.lstrip().startswith(("[", "{"))
    if json_lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                return f"line {number}, column {error.colno}: {error.msg}"
            if not isinstance(record, dict):
                return f"line {number}: a JSON object per line is expected, got {type(record).__name__}"
        return None
    try:
        json.loads(text)
    except json.JSONDecodeError as error:
        return f"line {error.lineno}, column {error.colno}: {error.msg}"
    return None


def _json_records(path: str):
    """(where, record) of a JSON Lines file ("line N", read line by line: a corpus larger than memory is fine; a line
    that does not parse comes as an `_Unparsable`), or of a JSON file holding a list ("record N"); nothing for a JSON
    document of another layout (the json reader decides)."""
    with _open_binary(path) as handle:
        first = next((line for line in handle if line.strip()), b"").decode("utf-8", errors="replace")
    if first.lstrip().startswith("["):
        with _open_binary(path) as handle:
            try:
                records = json.loads(handle.read().decode("utf-8", errors="replace"))
            except json.JSONDecodeError:
                return
        for number, record in enumerate(records, start=1):
            yield f"record {number}", record
        return
    if first.lstrip().startswith("{") and not _parses_as_object(first):
        return  # one JSON document spread over lines: the json reader decides
    with _open_binary(path) as handle:
        for number, raw in enumerate(handle, start=1):
            line = raw.decode("utf-8", errors="replace")
            if line.strip():
                try:
                    yield f"line {number}", json.loads(line)
                except json.JSONDecodeError as error:
                    yield f"line {number}", _Unparsable(f"column {error.colno}: {error.msg}")


class _Unparsable:
    def __init__(self, reason: str):
        self.reason = reason


def _parses_as_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _check_record_shapes(path: str, split: str, source_lang: str, target_lang: str) -> None:
    """Every record must be an object with a `translation` object (or per-language fields) whose sentences are
    strings (null or absent: skipped later as an empty pair). The first wrong one is named with its line."""
    expected = (f'expected {{"translation": {{"{source_lang}": "...", "{target_lang}": "..."}}}} '
                f'or {{"{source_lang}": "...", "{target_lang}": "..."}}')
    kind = Path(path.removesuffix(".gz")).suffix[1:].lower()
    for where, record in _json_records(path):
        if isinstance(record, _Unparsable):  # named here, before the json reader logs its own error
            raise CorpusError(f"The {split} file {path!r} is not valid {kind}: {where}, {record.reason}")
        if not isinstance(record, dict):
            if where.startswith("line"):
                raise CorpusError(f"The {split} file {path!r} is not valid {kind}: {where}: a JSON object per line "
                                  f"is expected, got {type(record).__name__}")
            raise CorpusError(f"The {split} file {path!r}, {where}: {expected}, got {type(record).__name__}.")
        if "translation" in record:
            pair, field_name = record["translation"], "translation"
            if pair is not None and not isinstance(pair, dict):
                raise CorpusError(f"The {split} file {path!r}, {where}: `translation` must be an object, got "
                                  f"{type(pair).__name__} ({json.dumps(pair, ensure_ascii=False)[:60]}); {expected}.")
            pair = pair or {}
        elif source_lang in record or target_lang in record:
            pair, field_name = record, None
        else:
            continue  # no such column at all: the column check names the columns present
        for lang in (source_lang, target_lang):
            value = pair.get(lang)
            if value is not None and not isinstance(value, str):
                name = f"translation.{lang}" if field_name else lang
                raise CorpusError(f"The {split} file {path!r}, {where}: `{name}` must be a string (or null), got "
                                  f"{type(value).__name__} ({json.dumps(value, ensure_ascii=False)[:60]}).")


def _columns_to_translation(batch: dict, languages: tuple[str, str]) -> dict:
    """Turn per-language columns (csv/tsv) into a ``translation`` column of dicts."""
    return {"translation": [dict(zip(languages, texts)) for texts in zip(*(batch[lang] for lang in languages))]}


def _is_empty(dataset) -> bool:
    if isinstance(dataset, IterableDataset):
        return next(iter(dataset), None) is None
    return len(dataset) == 0


def _carve_missing_splits(corpus: dict, percentage: int, seed: int) -> dict:
    """Carve missing validation/test splits out of train: a seeded random sample, or every k-th pair when streaming."""
    missing = [name for name in ("validation", "test") if name not in corpus]
    if not missing:
        return corpus
    train = corpus["train"]
    if isinstance(train, IterableDataset):
        period = max(2, round(100 / percentage))
        for offset, name in enumerate(missing):
            corpus[name] = train.filter(partial(_index_in_slot, period=period, slot=offset), with_indices=True)
        carved = len(missing)
        corpus["train"] = train.filter(partial(_index_past_slots, period=period, slots=carved), with_indices=True)
        return corpus
    for name in missing:
        if len(corpus["train"]) < 2:
            raise CorpusError(
                f"The train split has only {len(corpus['train'])} pairs: too few to carve a {name} split of "
                f"{percentage}% out of it. Give --validation_file and --test_file, or a larger corpus."
            )
        parts = corpus["train"].train_test_split(test_size=percentage / 100, seed=seed, shuffle=True)
        corpus["train"], corpus[name] = parts["train"], parts["test"]
    return corpus


def _index_in_slot(example: dict, index: int, period: int, slot: int) -> bool:
    return index % period == slot


def _index_past_slots(example: dict, index: int, period: int, slots: int) -> bool:
    return index % period >= slots


def _check_language_keys(split, split_name: str, source_lang: str, target_lang: str) -> None:
    """Stop with the available keys when a language is absent from the ``translation`` dicts.

    The keys are those of the split's schema, or of its first ``KEY_SAMPLE`` records when the records are free-form
    JSON: a record that lacks a language, or holds null, counts as an empty pair and is skipped by the preprocessing.
    """
    first = next(iter(split), None)
    if first is None:
        raise CorpusError(f"The {split_name} split is empty.")
    if "translation" not in first:
        raise CorpusKeyError(f"The {split_name} split has no `translation` column; its columns are {sorted(first)}.")
    feature = (getattr(split, "features", None) or {}).get("translation")
    if isinstance(feature, dict):
        keys = sorted(feature)
    elif getattr(feature, "languages", None):
        keys = sorted(feature.languages)
    else:  # free-form JSON records: the keys seen in the first records
        sample = split.take(KEY_SAMPLE) if isinstance(split, IterableDataset) else split.select(
            range(min(KEY_SAMPLE, len(split))))
        keys = sorted({key for example in sample for key in (example["translation"] or {})})
    missing = [lang for lang in (source_lang, target_lang) if lang not in keys]
    if missing:
        raise CorpusKeyError(
            f"Language key(s) {missing} not found in the {split_name} split; "
            f"the `translation` keys present are {keys}. "
            "Set --source_lang / --target_lang accordingly."
        )


def _limit_samples(corpus: dict, args: DataArguments) -> dict:
    limits = {"train": args.max_train_samples, "validation": args.max_eval_samples, "test": args.max_predict_samples}
    for name, limit in limits.items():
        if limit is None:
            continue
        split = corpus[name]
        if isinstance(split, IterableDataset):
            corpus[name] = split.take(limit)
        else:
            corpus[name] = split.select(range(min(limit, len(split))))
    return corpus


# ----------------------------------------------------------------------------------------------------- preprocessing


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


def _tokenize_batch(batch: dict, tokenizer, args: DataArguments, length_slack: int) -> dict:
    """Tokenise sources and targets, truncated ``length_slack`` tokens beyond the maxima (so over-long shows)."""
    sources = [pair[args.source_lang] for pair in batch["translation"]]
    targets = [pair[args.target_lang] for pair in batch["translation"]]
    model_inputs = tokenizer(sources, truncation=True, max_length=args.max_source_length + length_slack)
    labels = tokenizer(text_target=targets, truncation=True, max_length=args.max_target_length + length_slack)
    model_inputs["labels"] = labels["input_ids"]
    return model_inputs


def _fits_lengths(batch: dict, max_source_length: int, max_target_length: int) -> list[bool]:
    return [
        len(src) <= max_source_length and len(tgt) <= max_target_length
        for src, tgt in zip(batch["input_ids"], batch["labels"])
    ]


def _plausible_ratio(batch: dict, max_ratio: float) -> list[bool]:
    """Length ratio of source and target in tokens, ``</s>`` not counted."""
    keep = []
    for src, tgt in zip(batch["input_ids"], batch["labels"]):
        src_len, tgt_len = max(len(src) - 1, 1), max(len(tgt) - 1, 1)
        keep.append(max(src_len / tgt_len, tgt_len / src_len) <= max_ratio)
    return keep


def preprocess_corpus(raw: DatasetDict | IterableDatasetDict, tokenizer, args: DataArguments):
    """Tokenise every split into ``input_ids``/``attention_mask``/``labels`` and filter the training pairs.

    Train drops, in this order, pairs with an empty side, pairs longer than ``max_source_length`` /
    ``max_target_length`` tokens, and pairs whose token-length ratio exceeds ``max_length_ratio``. Validation and
    test keep every non-empty pair, truncated to the maxima (use :func:`evaluation_pairs` for the aligned
    references). Returns the tokenised splits and a report ``{split: {"input", "empty", "too_long", "bad_ratio",
    "kept"}}``; counts are ``None`` for streamed splits, whose length is unknown.
    """
    processed, report = {}, {}
    for name, split in raw.items():
        is_train = name == "train"
        columns = split.column_names or list(next(iter(split)).keys())
        map_options = {} if isinstance(split, IterableDataset) else {
            "num_proc": args.preprocessing_num_workers,
            "load_from_cache_file": not args.overwrite_cache,
        }
        counts = [_count(split)]
        split = split.filter(
            partial(is_nonempty_pair, source_lang=args.source_lang, target_lang=args.target_lang), **map_options
        )
        counts.append(_count(split))
        tokenize = partial(_tokenize_batch, tokenizer=tokenizer, args=args, length_slack=1 if is_train else 0)
        split = split.map(tokenize, batched=True, remove_columns=columns, **map_options)
        if is_train:
            fits = partial(
                _fits_lengths, max_source_length=args.max_source_length, max_target_length=args.max_target_length
            )
            split = split.filter(fits, batched=True, **map_options)
            counts.append(_count(split))
            plausible = partial(_plausible_ratio, max_ratio=args.max_length_ratio)
            split = split.filter(plausible, batched=True, **map_options)
            counts.append(_count(split))
        else:
            counts += [counts[-1], counts[-1]]
        processed[name] = split
        report[name] = _filter_report(counts)
    result = IterableDatasetDict(processed) if args.streaming else DatasetDict(processed)
    return result, report


def _count(split) -> int | None:
    return None if isinstance(split, IterableDataset) else len(split)


def _filter_report(counts: list[int | None]) -> dict:
    """Turn the sizes before/after each filter into numbers dropped per filter."""
    initial, non_empty, short_enough, kept = counts
    if initial is None:
        return {"input": None, "empty": None, "too_long": None, "bad_ratio": None, "kept": None}
    return {
        "input": initial,
        "empty": initial - non_empty,
        "too_long": non_empty - short_enough,
        "bad_ratio": short_enough - kept,
        "kept": kept,
    }


def sequence_lengths(dataset: Dataset) -> tuple[list[int], list[int]]:
    """Token lengths of the sources (``input_ids``) and targets (``labels``) of a tokenised split."""
    lengths = dataset.map(
        lambda batch: {"src_len": [len(x) for x in batch["input_ids"]], "tgt_len": [len(x) for x in batch["labels"]]},
        batched=True,
        remove_columns=dataset.column_names,
        keep_in_memory=True,
    )
    return list(lengths["src_len"]), list(lengths["tgt_len"])


def make_collator(tokenizer) -> DataCollatorForSeq2Seq:
    """Pads ``input_ids`` with the pad id and ``labels`` with -100; the model derives decoder inputs from labels."""
    return DataCollatorForSeq2Seq(tokenizer, model=None, label_pad_token_id=-100, pad_to_multiple_of=None)


# -------------------------------------------------------------------------------------------------------- batching


def shard_batches(batches: list[list[int]], num_replicas: int, rank: int, drop_last: bool) -> list[list[int]]:
    """The batches of one process: every ``num_replicas``-th batch starting at ``rank``.

    To give every process the same number of batches (so DDP never waits on a process that ran out), the batch count
    is first made a multiple of ``num_replicas``: with ``drop_last`` the surplus batches are dropped; otherwise the
    largest batches are split in two, so every example is still seen exactly once. Only when there are fewer
    examples than processes are batches repeated from the start.
    """
    if num_replicas == 1:
        return batches
    batches = [list(batch) for batch in batches]
    surplus = len(batches) % num_replicas
    if surplus and drop_last:
        batches = batches[: len(batches) - surplus]
    elif surplus:
        for repeat in range(num_replicas - surplus):
            largest = max(range(len(batches)), key=lambda i: len(batches[i]))
            batch = batches[largest]
            if len(batch) < 2:
                batches.append(batches[repeat % len(batches)])
            else:
                batches[largest : largest + 1] = [batch[: len(batch) // 2], batch[len(batch) // 2 :]]
    return batches[rank::num_replicas]


class ShardedBatchSampler(Sampler[list[int]]):
    """Batches of one epoch (``all_batches``, seeded by ``seed + epoch``), of which each process keeps its share
    (:func:`shard_batches`). Subclasses decide how the batches are formed."""

    def __init__(self, shuffle: bool, seed: int, num_replicas: int, rank: int, drop_last: bool):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas}).")
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def sampler(self) -> Sampler:
        """Lets Accelerate's ``DataLoaderShard.set_epoch`` find :meth:`set_epoch` through its batch-sampler wrapper."""
        return self

    def all_batches(self) -> list[list[int]]:
        """This epoch's batches over all processes, in iteration order before sharding (defined by subclasses)."""
        raise TypeError(f"{type(self).__name__} must define all_batches()")

    def __iter__(self) -> Iterator[list[int]]:
        return iter(shard_batches(self.all_batches(), self.num_replicas, self.rank, self.drop_last))

    def __len__(self) -> int:
        return len(shard_batches(self.all_batches(), self.num_replicas, self.rank, self.drop_last))


class TokenBucketBatchSampler(ShardedBatchSampler):
    """fairseq-style batches of similar-length pairs under a token budget.

    The cost of a batch is ``len(batch) * max(longest source, longest target)`` (the padded size of the larger side,
    ``</s>`` included) and never exceeds ``max_tokens``. Pairs are sorted by length with a seeded random tie-break,
    packed greedily, and the batch order is shuffled with ``seed + epoch`` (call :meth:`set_epoch`). With several
    processes every process builds the same batches and keeps its share (see :func:`shard_batches`): ``__len__`` is
    equal on all ranks and, unless ``drop_last``, the union over ranks is the whole epoch without overlap.

    Under Accelerate, either build it with ``num_replicas=accelerator.num_processes, rank=accelerator.process_index``
    and do not pass that DataLoader through ``accelerator.prepare`` (no example repeated), or build it with
    ``num_replicas=1`` and let ``prepare`` shard it (Accelerate then evens out the ranks by repeating a few
    batches). The batch count can differ by a few between epochs, since the length ties are broken anew.
    """

    def __init__(
        self,
        src_lengths: Sequence[int],
        tgt_lengths: Sequence[int],
        max_tokens: int,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
    ):
        super().__init__(shuffle, seed, num_replicas, rank, drop_last)
        if len(src_lengths) != len(tgt_lengths):
            raise ValueError(f"{len(src_lengths)} source lengths but {len(tgt_lengths)} target lengths.")
        self.lengths = [max(s, t) for s, t in zip(src_lengths, tgt_lengths)]
        self.src_lengths, self.tgt_lengths = list(src_lengths), list(tgt_lengths)
        longest = max(self.lengths, default=0)
        if max_tokens < longest:
            raise ValueError(
                f"max_tokens={max_tokens} is smaller than the longest example ({longest} tokens); raise --max_tokens "
                "or lower --max_source_length / --max_target_length."
            )
        self.max_tokens = max_tokens
        self._cache: tuple[int, list[list[int]]] | None = None

    def all_batches(self) -> list[list[int]]:
        """This epoch's batches over all processes, in iteration order before sharding."""
        if self._cache and self._cache[0] == self.epoch:
            return self._cache[1]
        rng = random.Random(self.seed + self.epoch)
        order = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(order)
        order.sort(key=lambda i: (self.lengths[i], self.src_lengths[i]))
        batches, batch, longest = [], [], 0
        for index in order:
            candidate_longest = max(longest, self.lengths[index])
            if batch and (len(batch) + 1) * candidate_longest > self.max_tokens:
                batches.append(batch)
                batch, candidate_longest = [], self.lengths[index]
            batch.append(index)
            longest = candidate_longest
        if batch:
            batches.append(batch)
        if self.shuffle:
            rng.shuffle(batches)
        self._cache = (self.epoch, batches)
        return batches


class SentenceBatchSampler(ShardedBatchSampler):
    """Fixed-size batches of ``batch_size`` pairs in a seeded random order (reshuffled by :meth:`set_epoch`),
    sharded across processes like :class:`TokenBucketBatchSampler`."""

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
    ):
        super().__init__(shuffle, seed, num_replicas, rank, drop_last)
        self.num_examples, self.batch_size = num_examples, batch_size

    def all_batches(self) -> list[list[int]]:
        order = list(range(self.num_examples))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return [order[start : start + self.batch_size] for start in range(0, self.num_examples, self.batch_size)]


def make_batch_sampler(
    dataset: Dataset,
    args: DataArguments,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    num_replicas: int = 1,
    rank: int = 0,
    drop_last: bool = False,
) -> Sampler[list[int]]:
    """Token-bucketed batches when ``args.max_tokens`` is set, else fixed batches of ``batch_size`` pairs."""
    if args.max_tokens:
        src_lengths, tgt_lengths = sequence_lengths(dataset)
        return TokenBucketBatchSampler(
            src_lengths, tgt_lengths, args.max_tokens, shuffle, seed, num_replicas, rank, drop_last
        )
    return SentenceBatchSampler(len(dataset), batch_size, shuffle, seed, num_replicas, rank, drop_last)


def padding_fraction(batches: Sequence[Sequence[int]], src_lengths: Sequence[int], tgt_lengths: Sequence[int]) -> float:
    """Share of padding among all source and target positions once each batch is padded to its longest sequence."""
    padded = real = 0
    for batch in batches:
        for lengths in (src_lengths, tgt_lengths):
            batch_lengths = [lengths[i] for i in batch]
            padded += len(batch_lengths) * max(batch_lengths)
            real += sum(batch_lengths)
    return 1 - real / padded if padded else 0.0
