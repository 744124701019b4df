"""Parallel corpora: loading, tokenisation, filtering and batching.

Every source (the shipped English–Spanish Bible, a Hub dataset, a ``save_to_disk`` directory, local plain-text pairs,
tsv, csv, json or jsonl files, see :mod:`corpus_files`) is turned into a ``DatasetDict`` with ``train``/``validation``/
``test`` splits whose examples carry a ``translation`` dict keyed by language code, the convention of Hub
translation datasets. Argument names follow transformers' ``run_translation.py``.
"""

import errno
import json
import logging
import os
import random
import tempfile
from contextlib import contextmanager
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
from datasets import (
    Dataset,
    DatasetDict,
    Features,
    IterableDataset,
    IterableDatasetDict,
    List,
    Value,
    load_dataset,
    load_from_disk,
)
from datasets.exceptions import DatasetGenerationError
from datasets.fingerprint import Hasher
from torch.utils.data import Sampler
from transformers import DataCollatorForSeq2Seq

from .corpus_files import CorpusError, CorpusFiles, resolve_corpus_files
from .corpus_files import CorpusFileNotFoundError, CorpusKeyError  # noqa: F401  (part of this module's interface)
from .errors import TrainingFault, UsageError, check_range
from .tokenization import tokenizer_can_train_on


logger = logging.getLogger("hf_scratch_transformer")
CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
SPLITS = ("train", "validation", "test")
SHIPPED_CORPUS_FILES = {split: CORPUS_DIR / f"bible_en_es.{split}.jsonl.gz" for split in SPLITS}
SHIPPED_DATASET_ID = "bible-en-es-web-rv1909"  # the shipped corpus's name in model cards (`datasets:`)
KEY_SAMPLE = 1000  # records looked at for the language keys when the schema does not list them
SPLIT_ALIASES = {"valid": "validation", "dev": "validation", "eval": "validation"}
SAVED_DATASET_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes (DatasetDict, Dataset)
# No side of a training pair is tokenised if it has more characters than this many per allowed token (a BPE token
# of natural text averages 3-5): such a pair would be dropped as over-long anyway, after costly tokenisation.
MAX_CHARS_PER_TOKEN = 16
CACHE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}  # the cache's, not the corpus's


@dataclass
class DataArguments:
    """Which corpus to load and how to tokenise, filter and batch it."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Hub dataset with a `translation` column (e.g. wmt16), or a directory written by "
                          "save_to_disk. Default: the shipped corpus."},
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset configuration (e.g. ro-en)."})
    train_file: str | None = field(
        default=None,
        metadata={"help": "Local training corpus: PREFIX of plain-text pairs (PREFIX.<source_lang> + "
                          "PREFIX.<target_lang>), a .tsv/.csv/.json/.jsonl file (each optionally .gz/.bz2/.xz), or a "
                          "save_to_disk directory."},
    )
    validation_file: str | None = field(default=None, metadata={"help": "Local validation corpus (same forms)."})
    test_file: str | None = field(default=None, metadata={"help": "Local test corpus (same forms)."})
    source_lang: str = field(default="en", metadata={"help": "Source language code (file suffix, column or key)."})
    target_lang: str = field(default="es", metadata={"help": "Target language code (file suffix, column or key)."})
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

    def __post_init__(self):
        """Every value checked before any work; local paths with `~` expanded (a YAML config's too)."""
        for name in ("train_file", "validation_file", "test_file"):
            if getattr(self, name):
                setattr(self, name, os.path.expanduser(getattr(self, name)))
        for name, low in (("max_source_length", 2), ("max_target_length", 2), ("max_length_ratio", 1),
                          ("tokenizer_vocab_size", 260), ("max_train_samples", 1), ("max_eval_samples", 1),
                          ("max_predict_samples", 1), ("preprocessing_num_workers", 1),
                          ("tokenizer_max_sentences", 1), ("max_tokens", 0)):
            check_range(name, getattr(self, name), low)
        check_range("validation_split_percentage", self.validation_split_percentage, 0, 100, low_ok=False,
                    high_ok=False)
        if self.source_lang == self.target_lang:
            raise UsageError(f"--source_lang and --target_lang are both {self.source_lang!r}: give two languages")
        longest = max(self.max_source_length, self.max_target_length)
        if self.max_tokens and self.max_tokens < longest:
            raise UsageError(f"--max_tokens {self.max_tokens} is smaller than the longest allowed sentence ({longest} "
                             f"tokens): raise --max_tokens or lower --max_source_length/--max_target_length")


class DatasetsCacheError(TrainingFault):
    """The `datasets` cache cannot be written (read-only, a file, full): an environment fault, not the corpus's."""


# ---------------------------------------------------------------------------------------------------------- loading


def load_parallel_corpus(args: DataArguments, seed: int = 42) -> DatasetDict | IterableDatasetDict:
    """Load the corpus chosen by ``args`` as train/validation/test splits of ``translation`` pairs.

    Missing validation or test splits are carved deterministically out of train (``validation_split_percentage``
    each), and announced in the log. With ``args.streaming`` the splits are ``IterableDataset``s.
    """
    check_datasets_cache()
    if args.dataset_name:
        corpus = _load_named_dataset(args)
    elif args.train_file or args.validation_file or args.test_file:
        corpus = _load_local_files(args)
    else:
        files = {split: str(path) for split, path in SHIPPED_CORPUS_FILES.items()}
        with cache_faults():
            corpus = load_dataset("json", data_files=files, streaming=args.streaming)
    corpus = {SPLIT_ALIASES.get(name, name): split for name, split in corpus.items()}
    if "train" not in corpus:
        raise CorpusError(f"The corpus has no train split (splits found: {sorted(corpus)}).")
    corpus = _carve_missing_splits(corpus, args.validation_split_percentage, seed)
    for name in SPLITS:
        _check_language_keys(corpus[name], name, args.source_lang, args.target_lang)
    corpus = _limit_samples(corpus, args)
    return IterableDatasetDict(corpus) if args.streaming else DatasetDict(corpus)


def check_datasets_cache() -> Path:
    """The `datasets` cache directory, created if needed; refused (an environment fault) unless it can be written."""
    cache = Path(datasets.config.HF_DATASETS_CACHE)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=cache):
            pass
    except OSError as error:
        raise DatasetsCacheError(_cache_message(cache, error)) from None
    return cache


def _cache_message(cache: Path, error: OSError) -> str:
    if isinstance(error, (FileExistsError, NotADirectoryError)):
        reason = "it, or a folder above it, is a file"
    else:
        reason = error.strerror or str(error)
    return (f"the datasets cache {cache} is not usable ({reason}): set HF_DATASETS_CACHE (or HF_HOME, which holds "
            "it) to a writable directory with free space, e.g. HF_DATASETS_CACHE=/tmp/hf-datasets")


@contextmanager
def cache_faults():
    """Turns the failure of `datasets` to write its cache (disk full, read-only, no permission) into a
    DatasetsCacheError naming the cache; a CorpusError raised while the corpus was read comes out as itself."""
    try:
        yield
    except CorpusError:
        raise
    except (DatasetGenerationError, OSError) as error:
        cause = error.__cause__ if isinstance(error, DatasetGenerationError) else error
        if isinstance(cause, CorpusError):
            raise cause from None
        # pyarrow's writer raises an OSError without errno, its message naming the cause
        if isinstance(cause, OSError) and (cause.errno in CACHE_ERRNOS or "No space left" in str(cause)):
            raise DatasetsCacheError(_cache_message(Path(datasets.config.HF_DATASETS_CACHE), cause)) from error
        raise


def _load_named_dataset(args: DataArguments) -> dict:
    """--dataset_name: a directory written by save_to_disk, or a Hub dataset (clear message when unreachable)."""
    name = args.dataset_name
    if os.path.isdir(name) and _is_saved_dataset(name):
        saved = _load_saved(name, f"--dataset_name {name!r}")
        splits = saved if isinstance(saved, DatasetDict) else {"train": saved}
    else:
        try:
            with cache_faults():
                splits = load_dataset(name, args.dataset_config_name, streaming=args.streaming)
        except ConnectionError as error:
            raise ConnectionError(
                f"Could not download the dataset {name!r} (config {args.dataset_config_name!r}) from the "
                f"Hugging Face Hub: {error}. Without network access, pass local files with --train_file "
                "(and --validation_file / --test_file), or omit --dataset_name to use the shipped corpus."
            ) from error
        except (FileNotFoundError, ValueError) as error:  # no such dataset, no data files in it, a wrong config
            local = " (a local directory needs data files or a dataset written by save_to_disk)" \
                if os.path.isdir(name) else ""
            raise CorpusError(f"--dataset_name {name!r} cannot be loaded{local}: {type(error).__name__}: "
                              f"{' '.join(str(error).split())[:300]}") from error
    return {split: _as_translation(dataset, f"the {split} split of {name!r}", args, streamed=args.streaming)
            for split, dataset in splits.items()}


def _load_local_files(args: DataArguments) -> dict:
    """Load each given path (a file, a plain-text pair prefix or a save_to_disk directory) as one split."""
    if not args.train_file:
        raise CorpusError("--validation_file / --test_file need a --train_file as well.")
    given = {"train": args.train_file, "validation": args.validation_file, "test": args.test_file}
    return {split: _load_path(path, split, args) for split, path in given.items() if path}


def _load_path(path: str, split: str, args: DataArguments):
    """One split from ``path``: its files read through `datasets` (cached), or a save_to_disk directory."""
    files = resolve_corpus_files(path, split, (args.source_lang, args.target_lang))
    if files is None:
        saved = _load_saved(path, f"The {split} file {path!r}")
        if isinstance(saved, DatasetDict):
            saved = _split_of(saved, split, path)
        return _as_translation(saved, f"The {split} dataset {path!r}", args, streamed=args.streaming)
    logger.info("%s split: reading %s", split, files.describe())
    return _dataset_from_files(files, args.streaming)


def _dataset_from_files(files: CorpusFiles, streaming: bool) -> Dataset | IterableDataset:
    """The pairs of ``files`` as a Dataset (written once to the `datasets` cache, reused while the files keep their
    size and modification time), or as an IterableDataset after one checking pass over the files."""
    features = Features({"translation": {lang: Value("string") for lang in files.languages}})
    if files.has_paraphrases():
        features["paraphrases"] = {lang: List(Value("string")) for lang in files.languages}
    if streaming:
        if not files.rereadable():
            raise CorpusError(f"The {files.split} file {files.paths[0]!r} is a pipe, which can be read only once, "
                              "but --streaming reads the corpus several times: save it to a file, or drop --streaming.")
        for _ in files.records():  # one pass that checks every record before any work
            pass
        return IterableDataset.from_generator(_records_of, features=features, gen_kwargs={"files": files})
    with cache_faults():
        return Dataset.from_generator(_records_of, features=features, gen_kwargs={"files": files},
                                      fingerprint=files.fingerprint())


def _records_of(files: CorpusFiles) -> Iterator[dict]:
    yield from files.records()


def _is_saved_dataset(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, marker)) for marker in SAVED_DATASET_MARKERS)


def _load_saved(path: str, what: str) -> Dataset | DatasetDict:
    """A directory written by ``save_to_disk``, memory-mapped in place (nothing is copied)."""
    if not _is_saved_dataset(path):
        raise CorpusError(
            f"{what} is a directory without a dataset saved by `datasets` in it (no "
            f"{' or '.join(SAVED_DATASET_MARKERS)}): give a corpus file, the PREFIX of plain-text pair files, or a "
            "directory written by save_to_disk.")
    try:
        return load_from_disk(path)
    except (OSError, ValueError, KeyError) as error:
        raise CorpusError(f"{what} holds a saved dataset that cannot be loaded: {type(error).__name__}: "
                          f"{' '.join(str(error).split())[:300]}") from error


def _split_of(saved: DatasetDict, split: str, path: str) -> Dataset:
    names = {SPLIT_ALIASES.get(name, name): name for name in saved}
    if split not in names:
        raise CorpusError(f"The saved dataset {path!r} has no {split} split (its splits: {sorted(saved)}): give "
                          f"--dataset_name {path} to use all its splits, or a dataset with a {split} split.")
    return saved[names[split]]


def _as_translation(dataset, where: str, args: DataArguments, streamed: bool):
    """The dataset with a `translation` column (made from one column per language if need be), streamed on
    request."""
    if streamed and isinstance(dataset, Dataset):
        dataset = dataset.to_iterable_dataset()
    columns = dataset.column_names or list(next(iter(dataset), {}).keys())
    if "translation" in columns:
        return dataset
    missing = [lang for lang in (args.source_lang, args.target_lang) if lang not in columns]
    if missing:
        raise CorpusKeyError(f"{where} has neither a `translation` column nor columns for the languages {missing}; "
                             f"its columns are {columns}.")
    to_pairs = partial(_columns_to_translation, languages=(args.source_lang, args.target_lang))
    return dataset.map(to_pairs, batched=True, remove_columns=columns)


def _columns_to_translation(batch: dict, languages: tuple[str, str]) -> dict:
    """Turn per-language columns into a ``translation`` column of dicts."""
    return {"translation": [dict(zip(languages, texts)) for texts in zip(*(batch[lang] for lang in languages))]}


def _carve_missing_splits(corpus: dict, percentage: int, seed: int) -> dict:
    """Carve missing validation/test splits out of train: a seeded random sample, or every k-th pair when streaming.
    Each carved split is announced in the log with its size."""
    missing = [name for name in ("validation", "test") if name not in corpus]
    if not missing:
        return corpus
    train = corpus["train"]
    if isinstance(train, IterableDataset):
        period = max(2, round(100 / percentage))
        for offset, name in enumerate(missing):
            corpus[name] = train.filter(partial(_index_in_slot, period=period, slot=offset), with_indices=True)
            logger.info("%s split: 1 pair in %d of the streamed training data (pair %d, %d, ...), none given",
                        name, period, offset + 1, offset + 1 + period)
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
        logger.info("%s split: %d pairs carved out of the training data (%d%%, seed %d), none given; %d pairs left "
                    "for training", name, len(corpus[name]), percentage, seed, len(corpus["train"]))
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

# What the one tokenising pass marks on each pair, and why a pair is dropped (the filter report's keys).
PAIR_FINE, PAIR_EMPTY, PAIR_TOO_LONG = 0, 1, 2
KEEP, EMPTY, TOO_LONG, BAD_RATIO = 0, 1, 2, 3
TOKENIZED_FEATURES = Features({"input_ids": List(Value("int32")), "attention_mask": List(Value("int8")),
                               "labels": List(Value("int32")), "problem": Value("int8")})


def is_nonempty_pair(example: dict, source_lang: str, target_lang: str) -> bool:
    """True when both sides of the pair hold some non-whitespace text."""
    pair = example.get("translation") or {}
    return all(isinstance(pair.get(lang), str) and pair[lang].strip() for lang in (source_lang, target_lang))


def evaluation_pairs(raw_split, args: DataArguments) -> tuple[list[str], list[str]]:
    """Sources and references of an evaluation split, aligned row for row with its preprocessed version."""
    keep = partial(is_nonempty_pair, source_lang=args.source_lang, target_lang=args.target_lang)
    pairs = [example["translation"] for example in raw_split if keep(example)]
    return [pair[args.source_lang] for pair in pairs], [pair[args.target_lang] for pair in pairs]


def source_paraphrases(raw_train, tokenizer, source_lang: str) -> dict[str, list[str]]:
    """{source sentence: its paraphrases} from the training split's optional ``paraphrases`` field (a dict
    language -> list of other wordings of that side, as in the shipped corpus). The keys are the sentences as the
    training collator decodes them from their token ids, so that it finds them. Empty for a streamed split or a
    corpus without the field."""
    if isinstance(raw_train, IterableDataset) or "paraphrases" not in (raw_train.column_names or []):
        return {}
    sources, alternatives = [], []
    for example in raw_train.select_columns(["translation", "paraphrases"]):
        found = [text for text in (example["paraphrases"] or {}).get(source_lang) or [] if text and text.strip()]
        source = (example["translation"] or {}).get(source_lang)
        if found and isinstance(source, str) and source.strip():
            sources.append(source)
            alternatives.append(found)
    decoded = tokenizer.batch_decode(tokenizer(sources)["input_ids"], skip_special_tokens=True) if sources else []
    paraphrases: dict[str, list[str]] = {}
    for key, found in zip(decoded, alternatives):
        paraphrases.setdefault(key, []).extend(text for text in found if text not in paraphrases.get(key, []))
    return paraphrases


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
    source_paraphrases: dict[str, list[str]] = field(default_factory=dict)


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


def _tokenize_batch(translations: list, tokenizer, args: DataArguments, is_train: bool) -> dict:
    """Token ids of the usable pairs (empty lists for the others, marked in ``problem``), truncated one token beyond
    the maxima for training (so that over-long shows) and at the maxima otherwise."""
    problems = _pair_problems(translations, args, is_train)
    usable = [index for index, problem in enumerate(problems) if problem == PAIR_FINE]
    columns = {name: [[] for _ in translations] for name in ("input_ids", "attention_mask", "labels")}
    if not usable:  # the tokenizer refuses an empty list
        return {**columns, "problem": problems}
    slack = 1 if is_train else 0
    sources = tokenizer([translations[i][args.source_lang] for i in usable], truncation=True,
                        max_length=args.max_source_length + slack)
    targets = tokenizer(text_target=[translations[i][args.target_lang] for i in usable], truncation=True,
                        max_length=args.max_target_length + slack)
    for row, index in enumerate(usable):
        columns["input_ids"][index] = sources["input_ids"][row]
        columns["attention_mask"][index] = sources["attention_mask"][row]
        columns["labels"][index] = targets["input_ids"][row]
    return {**columns, "problem": problems}


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
    references). One tokenising pass reads each split; the filters then work on arrays of lengths. Returns the
    tokenised splits and a report ``{split: {"input", "empty", "too_long", "bad_ratio", "kept"}}``; counts are
    ``None`` for streamed splits, whose length is unknown.
    """
    processed, report = {}, {}
    with cache_faults():
        for name, split in raw.items():
            preprocess = _preprocess_stream if isinstance(split, IterableDataset) else _preprocess_split
            processed[name], report[name] = preprocess(split, name == "train", tokenizer, args)
    result = IterableDatasetDict(processed) if args.streaming else DatasetDict(processed)
    return result, report


def _preprocess_split(split: Dataset, is_train: bool, tokenizer, args: DataArguments) -> tuple[Dataset, dict]:
    """(tokenised split, filter report) of an in-memory split: one map (cached by `datasets`), then the filters on
    arrays of lengths and a selection of the kept rows."""
    tokenize = partial(_tokenize_batch, tokenizer=tokenizer, args=args, is_train=is_train)
    tokenized = split.map(tokenize, batched=True, input_columns=["translation"], remove_columns=split.column_names,
                          features=TOKENIZED_FEATURES, num_proc=args.preprocessing_num_workers,
                          load_from_cache_file=not args.overwrite_cache,
                          new_fingerprint=_tokenized_fingerprint(split, tokenizer, args, is_train))
    reasons = _drop_reasons(column_array(tokenized, "problem"), list_lengths(tokenized, "input_ids"),
                            list_lengths(tokenized, "labels"), args, is_train)
    counts = np.bincount(reasons, minlength=4)
    report = {"input": len(split), "empty": int(counts[EMPTY]), "too_long": int(counts[TOO_LONG]),
              "bad_ratio": int(counts[BAD_RATIO]), "kept": int(counts[KEEP])}
    kept = tokenized if report["kept"] == len(split) else tokenized.select(np.flatnonzero(reasons == KEEP))
    return kept.remove_columns("problem"), report


def _preprocess_stream(split: IterableDataset, is_train: bool, tokenizer, args: DataArguments):
    """(tokenised stream, unknown counts): the same tokenising and filters, applied while the stream is read."""
    columns = split.column_names or list(next(iter(split)).keys())
    tokenize = partial(_tokenize_batch, tokenizer=tokenizer, args=args, is_train=is_train)
    tokenized = split.map(tokenize, batched=True, input_columns=["translation"], remove_columns=columns,
                          features=TOKENIZED_FEATURES)
    kept = tokenized.filter(partial(_kept_in_batch, args=args, is_train=is_train), batched=True,
                            input_columns=["problem", "input_ids", "labels"])
    report = dict.fromkeys(("input", "empty", "too_long", "bad_ratio", "kept"))
    return kept.remove_columns("problem"), report


def _kept_in_batch(problems: list, inputs: list, labels: list, args: DataArguments, is_train: bool) -> list[bool]:
    lengths = [np.array([len(ids) for ids in column], dtype=np.int64) for column in (inputs, labels)]
    return list(_drop_reasons(np.array(problems, dtype=np.int64), *lengths, args, is_train) == KEEP)


def _tokenized_fingerprint(split: Dataset, tokenizer, args: DataArguments, is_train: bool) -> str:
    """The `datasets` cache key of a tokenised split: what decides the token ids (the tokenizer's content, not the
    folder it was loaded from, which `datasets` would hash too and which differs between runs), the lengths, the
    languages and the code of the tokenising functions."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    for call_state in ("truncation", "padding"):  # set by the last call (the lengths are in `settings`)
        backend.pop(call_state, None)
    content = [backend, tokenizer.special_tokens_map, tokenizer.split_special_tokens]
    settings = [args.source_lang, args.target_lang, args.max_source_length, args.max_target_length, is_train,
                MAX_CHARS_PER_TOKEN]
    code = [Hasher.hash(function) for function in (_tokenize_batch, _pair_problems, tokenizer_can_train_on)]
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

    def __init__(self, shuffle: bool = True, seed: int = 0, num_replicas: int = 1, rank: int = 0,
                 drop_last: bool = False):
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
        # numpy arrays: 4 bytes a pair, where Python lists of ints took ~40
        self.src_lengths = np.asarray(src_lengths, dtype=np.int32)
        self.tgt_lengths = np.asarray(tgt_lengths, dtype=np.int32)
        self.lengths = np.maximum(self.src_lengths, self.tgt_lengths)
        longest = int(self.lengths.max()) if len(self.lengths) else 0
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
        order = np.array(order, dtype=np.int64)
        # a stable sort by (length, source length): the shuffle breaks the ties
        key = self.lengths[order].astype(np.int64) * (int(self.src_lengths.max(initial=0)) + 1) + \
            self.src_lengths[order]
        order = order[np.argsort(key, kind="stable")]
        batches = _pack_sorted(order.tolist(), self.lengths[order].tolist(), self.max_tokens)
        if self.shuffle:
            rng.shuffle(batches)
        self._cache = (self.epoch, batches)
        return batches


def _pack_sorted(order: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy batches of the pairs `order` (sorted by non-decreasing `lengths`, aligned with it): a batch closes when
    one more pair would make batch size x its longest pair exceed `max_tokens`."""
    batches, batch = [], []
    for index, length in zip(order, lengths):
        if batch and (len(batch) + 1) * length > max_tokens:
            batches.append(batch)
            batch = []
        batch.append(index)
    if batch:
        batches.append(batch)
    return batches


class SentenceBatchSampler(ShardedBatchSampler):
    """Fixed-size batches of ``batch_size`` pairs in a seeded random order (reshuffled by :meth:`set_epoch`),
    sharded across processes like :class:`TokenBucketBatchSampler`."""

    def __init__(self, num_examples: int, batch_size: int, **sharding):
        """sharding: shuffle, seed, num_replicas, rank, drop_last, as for TokenBucketBatchSampler."""
        super().__init__(**sharding)
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
    return SentenceBatchSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed, num_replicas=num_replicas,
                                rank=rank, drop_last=drop_last)


def padding_fraction(batches: Sequence[Sequence[int]], src_lengths: Sequence[int], tgt_lengths: Sequence[int]) -> float:
    """Share of padding among all source and target positions once each batch is padded to its longest sequence."""
    batches = [batch for batch in batches if len(batch)]
    if not batches:
        return 0.0
    rows = np.fromiter(chain.from_iterable(batches), dtype=np.int64)
    sizes = np.fromiter(map(len, batches), dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    padded = real = 0
    for lengths in (src_lengths, tgt_lengths):
        values = np.asarray(lengths, dtype=np.int64)[rows]
        padded += int((np.maximum.reduceat(values, starts) * sizes).sum())
        real += int(values.sum())
    return 1 - real / padded if padded else 0.0
