"""Parallel corpora: which corpus to load (`DataArguments`) and loading it as train/validation/test splits.

Every source (the shipped English–Spanish Bible, a Hub dataset, a ``save_to_disk`` directory, local plain-text pairs,
tsv, csv, json or jsonl files, see :mod:`corpus_files`) is turned into a ``DatasetDict`` with ``train``/``validation``/
``test`` splits whose examples carry a ``translation`` dict keyed by language code, the convention of Hub
translation datasets. Argument names follow transformers' ``run_translation.py``.
"""

import errno
import logging
import os
import tempfile
from contextlib import contextmanager
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import datasets
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

from .corpus_files import SAVED_DATASET_MARKERS, CorpusError, CorpusFiles, is_saved_dataset, resolve_corpus_files
from .corpus_files import CorpusFileNotFoundError, CorpusKeyError  # noqa: F401  (part of this module's interface)
from ..errors import TrainingFault, UsageError, check_range


logger = logging.getLogger("hf_scratch_transformer")
CORPUS_DIR = Path(__file__).resolve().parents[1] / "corpus"  # shipped inside the package
SPLITS = ("train", "validation", "test")
SHIPPED_CORPUS_FILES = {split: CORPUS_DIR / f"bible_en_es.{split}.jsonl.gz" for split in SPLITS}
SHIPPED_DATASET_ID = "bible-en-es-web-rv1909"  # the shipped corpus's name in model cards (`datasets:`)
KEY_SAMPLE = 1000  # records looked at for the language keys when the schema does not list them
SPLIT_ALIASES = {"valid": "validation", "dev": "validation", "eval": "validation"}
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
    tokenizer_vocab_size: int = field(default=8000, metadata={"help": "Vocabulary size of the joint BPE tokenizer."})
    mask_protected_spans: bool = field(
        default=True,
        metadata={"help": "Mask the placeholders, markup, URLs and e-mail addresses both sides of a training pair "
                          "share by sentinel tokens (｟0｠...｟31｠, added to a new tokenizer), so that the model "
                          "learns to place them and translation protects them by default. false: spans stay text, "
                          "and the tokenizer gets no sentinels."},
    )
    tokenizer_max_sentences: int | None = field(
        default=500_000, metadata={"help": "Train the tokenizer on at most this many sampled sentences."}
    )
    max_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Token budget per batch (batch size x longest padded side); 0: fixed-size sentence batches of "
            "--per_device_train_batch_size. Default: the recipe's, 1024, or 2048 where the training pairs average "
            "more than 21 tokens on their longer side."
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
    if os.path.isdir(name) and is_saved_dataset(name):
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
        for _ in files.records():  # one pass that checks every record before any work (and logs how it reads them)
            pass
        return IterableDataset.from_generator(_records_of, features=features,
                                              gen_kwargs={"files": replace(files, announce=False)})
    with cache_faults():
        return Dataset.from_generator(_records_of, features=features, gen_kwargs={"files": files},
                                      fingerprint=files.fingerprint())


def _records_of(files: CorpusFiles) -> Iterator[dict]:
    yield from files.records()


def _load_saved(path: str, what: str) -> Dataset | DatasetDict:
    """A directory written by ``save_to_disk``, memory-mapped in place (nothing is copied)."""
    if not is_saved_dataset(path):
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
    """The dataset with a `translation` column (made from one column per language if need be, a `paraphrases`
    column kept), streamed on request."""
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
    return dataset.map(to_pairs, batched=True, remove_columns=[name for name in columns if name != "paraphrases"])


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


