"""Hostile corpora and environments of the data path: plain-text pairs that do not line up, files that are not what
their name says (compressed, UTF-16, archives, pipes, symlink loops), broken quoting, nesting too deep to parse, giant
words, save_to_disk directories without what is needed, and a `datasets` cache that cannot be written; and files that
could be read two ways (issue 42): a stale side beside its compressed copy, header rows naming languages, old Mac line
ends, a prefix that is also a folder, /dev/null, flat JSON records with paraphrases.

A refusal must end in one line naming the file (or the cache) and the fix: exit 2 for the user's corpus, 1 for the
environment. An input that must work is checked for the documented result, at the level of `data`/`tokenization`
(seconds, no training run). Environment cases use real environments: a FIFO with a writer thread, real symlinks, a
read-only or full tmpfs mounted for the case (root), or a directory made read-only by its mode (other users).
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import json
import lzma
import os
import shutil
import subprocess
import threading
from pathlib import Path

import hostile_inputs
from hostile_inputs import PAIRS, Case, Failure, Workspace, one_line, run_train, tiny_flags

Skipped = getattr(hostile_inputs, "Skipped", Failure)  # "cannot run here" where hostile_inputs defines it
GOOD_JSONL = "".join(json.dumps({"translation": {"en": en, "es": es}}, ensure_ascii=False) + "\n" for en, es in PAIRS)


def _refused(name: str, make, *parts: str, code: int = 2) -> Case:
    """train.py given the corpus `make(ws, folder)` returns (a path, or a dict of flags) stops with one line."""
    def check(ws: Workspace) -> str:
        good = ws.corpus()
        made = make(ws, ws.fresh(name))
        flags = made if isinstance(made, dict) else {"train_file": str(made)}
        files = {"validation_file": str(good), "test_file": str(good), **flags}
        output_dir = ws.fresh("out")
        return one_line(*run_train(tiny_flags(output_dir, **files)), code, *[part.format(**files) for part in parts])
    return Case(name, "corpus", check)


def _loads(name: str, make, expected_pairs) -> Case:
    """The corpus `make(ws, folder)` returns loads, every pair exactly as expected."""
    def check(ws: Workspace) -> str:
        from hf_scratch_transformer.data.loading import DataArguments, load_parallel_corpus

        path = str(make(ws, ws.fresh(name)))
        good = str(ws.corpus())
        corpus = load_parallel_corpus(DataArguments(train_file=path, validation_file=good, test_file=good))
        pairs = [(pair["en"], pair["es"]) for pair in corpus["train"]["translation"]]
        if pairs != list(expected_pairs):
            raise Failure(f"loaded {pairs[:3]}..., expected {list(expected_pairs)[:3]}...")
        return f"{len(pairs)} pairs loaded as written"
    return Case(name, "corpus", check)


def _plain_pairs(folder: Path, sources: list[str], targets: list[str], encoding="utf-8", end="\n") -> Path:
    (folder / "train.en").write_bytes("".join(text + end for text in sources).encode(encoding))
    (folder / "train.es").write_bytes("".join(text + end for text in targets).encode(encoding))
    return folder / "train"


EN, ES = [en for en, _ in PAIRS], [es for _, es in PAIRS]


# ------------------------------------------------------------------------------------------- files and their names


def _counts_differ(ws, folder):
    return _plain_pairs(folder, EN, ES[:-1])


def _target_side_missing(ws, folder):
    (folder / "train.en").write_text("Hello.\n")
    return folder / "train"


def _one_side_given(ws, folder):
    _plain_pairs(folder, EN, ES)
    return folder / "train.en"


def _symlink_loop(ws, folder):
    (folder / "a.jsonl").symlink_to(folder / "b.jsonl")
    (folder / "b.jsonl").symlink_to(folder / "a.jsonl")
    return folder / "a.jsonl"


def _dangling_symlink(ws, folder):
    (folder / "train.jsonl").symlink_to(folder / "moved-away.jsonl")
    return folder / "train.jsonl"


def _unknown_extension(ws, folder):
    (folder / "train.txt").write_text("Hello.\tHola.\n")
    return folder / "train.txt"


def _empty_pair_files(ws, folder):
    return _plain_pairs(folder, [], [])


def _header_only_tsv(ws, folder):
    (folder / "train.tsv").write_text("en\tes\n")
    return folder / "train.tsv"


def _over_long_line(ws, folder):
    from hf_scratch_transformer.data.corpus_files import MAX_LINE_BYTES

    with open(folder / "train.en", "wb") as handle:
        handle.write(b"Hello.\n" + b"a " * (MAX_LINE_BYTES // 2 + 1) + b"\n")
    (folder / "train.es").write_text("Hola.\nHola.\n")
    return folder / "train"


# --------------------------------------------------------------------------------------- what is inside the file


def _nested_json(ws, folder):
    deep = "[" * 200_000 + "]" * 200_000
    path = folder / "train.jsonl"
    path.write_text(GOOD_JSONL.splitlines()[0] + '\n{"translation": {"en": ' + deep + ', "es": "x"}}\n')
    return path


def _tsv_three_columns(ws, folder):
    (folder / "train.tsv").write_text("Hello.\tHola.\nBye.\tAdiós.\textra\n")
    return folder / "train.tsv"


def _csv_quote_inside_field(ws, folder):
    (folder / "train.csv").write_text('en,es\n"Hello," he said.,"Hallo", sagte er.\n')
    return folder / "train.csv"


def _csv_unclosed_quote(ws, folder):
    (folder / "train.csv").write_text('en,es\nYes,Sí\n"It is fine,Está bien\nNo,No\n')  # the quote opens a field
    return folder / "train.csv"


def _utf16(ws, folder):
    (folder / "train.jsonl").write_bytes(GOOD_JSONL.encode("utf-16"))
    return folder / "train.jsonl"


def _zstd_named_jsonl(ws, folder):
    (folder / "train.jsonl").write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(64))  # a zstd frame's magic number
    return folder / "train.jsonl"


def _zip_named_jsonl(ws, folder):
    import zipfile

    with zipfile.ZipFile(folder / "train.jsonl", "w") as archive:
        archive.writestr("train.jsonl", GOOD_JSONL)
    return folder / "train.jsonl"


def _truncated_gzip(ws, folder):
    data = gzip.compress(GOOD_JSONL.encode() * 50)
    (folder / "train.jsonl.gz").write_bytes(data[: len(data) // 2])
    return folder / "train.jsonl.gz"


def _latin1_pairs(ws, folder):
    pairs = _plain_pairs(folder, EN, ES)
    (folder / "train.en").write_bytes("".join(f"{en}\n" for en in EN[:2] + ["café"] + EN[3:]).encode("latin-1"))
    return pairs


# ------------------------------------------------------------------------------------ read two ways (issue 42)


def _stale_side_beside_gzip(ws, folder):
    """A stale train.en left beside train.en.gz and train.es.gz: it must not be paired with train.es.gz."""
    (folder / "train.en").write_text("stale\n" * len(EN))
    (folder / "train.en.gz").write_bytes(gzip.compress("".join(f"{en}\n" for en in EN).encode()))
    (folder / "train.es.gz").write_bytes(gzip.compress("".join(f"{es}\n" for es in ES).encode()))
    return folder / "train"


def _tsv(first_line: str | None, pairs=PAIRS, swap=False):
    def make(ws, folder):
        rows = "".join(f"{es}\t{en}\n" if swap else f"{en}\t{es}\n" for en, es in pairs)
        (folder / "train.tsv").write_text((f"{first_line}\n" if first_line else "") + rows, encoding="utf-8")
        return folder / "train.tsv"
    return make


def _csv_named_columns(ws, folder):
    import csv

    with open(folder / "train.csv", "w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([("Spanish", "English")] + [(es, en) for en, es in PAIRS])
    return folder / "train.csv"


def _old_mac_pairs(ws, folder):
    return _plain_pairs(folder, EN, ES, end="\r")


def _old_mac_tsv(ws, folder):
    (folder / "train.tsv").write_bytes("".join(f"{en}\t{es}\r" for en, es in PAIRS).encode())
    return folder / "train.tsv"


def _prefix_is_a_folder(ws, folder):
    (folder / "train").mkdir()
    return _plain_pairs(folder, EN, ES)


def _file_in_the_way_of_a_prefix(ws, folder):
    prefix = _plain_pairs(folder, EN, ES)
    prefix.write_text("a stray file without a corpus extension\n")
    return prefix


def _newline_after_old_mac_line_ends(ws, folder):
    """More than 16 MiB of lines ended by \\r (old Mac), then a \\n: which of the two ends lines cannot be told."""
    from hf_scratch_transformer.data.corpus_files import MAX_LINE_BYTES

    lines = MAX_LINE_BYTES // 1000 + 1000
    (folder / "train.en").write_bytes((b"word " * 199 + b"word\r") * lines + b"Jesus wept.\nY\r")
    (folder / "train.es").write_bytes(b"palabra\n" * (lines + 2))
    return folder / "train"


def _dev_null_validation(ws, folder):
    return {"train_file": str(ws.corpus()), "validation_file": os.devnull}


def _flat_paraphrases(ws: Workspace) -> str:
    """Flat JSON Lines records with a `paraphrases` object: the paraphrases reach training's lookup."""
    from hf_scratch_transformer.data.loading import DataArguments, load_parallel_corpus
    from hf_scratch_transformer.training.augmentation import source_paraphrases
    from hf_scratch_transformer.data.tokenization import train_tokenizer_on_corpus

    records = [{"en": en, "es": es, "paraphrases": {"en": [f"{en} (again)"]}} for en, es in PAIRS]
    path = ws.corpus(records)
    corpus = load_parallel_corpus(DataArguments(train_file=str(path), validation_file=str(path), test_file=str(path)))
    tokenizer = train_tokenizer_on_corpus(corpus["train"], "en", "es", vocab_size=300)
    found = source_paraphrases(corpus["train"], tokenizer, "en")
    if sorted(set(sum(found.values(), []))) != sorted({f"{en} (again)" for en in EN}):
        raise Failure(f"the paraphrases found for training are {found}, not the {len(set(EN))} written")
    return f"{len(found)} training sources with their paraphrases"


# ------------------------------------------------------------------------------------------ save_to_disk directories


def _empty_directory_as_dataset_name(ws, folder):
    return {"dataset_name": str(folder), "train_file": None, "validation_file": None, "test_file": None}


def _saved_without_language_columns(ws, folder):
    from datasets import Dataset

    Dataset.from_dict({"text": ["Hello.", "Bye."], "label": [0, 1]}).save_to_disk(folder / "saved")
    return folder / "saved"


def _saved_dict_without_validation(ws, folder):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_dict({"translation": [{"en": "a", "es": "b"}] * 4})}).save_to_disk(
        folder / "saved")
    return {"train_file": str(ws.corpus()), "validation_file": str(folder / "saved")}


# ------------------------------------------------------------------------------------------------------------ pipes


@contextlib.contextmanager
def _fifo(path: Path, content: bytes):
    """A named pipe at `path` that a thread fills with `content` once a reader opens it (like `<(...)`)."""
    os.mkfifo(path)

    def write():
        try:
            with open(path, "wb") as pipe:
                pipe.write(content)
        except BrokenPipeError:  # the reader stopped early
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        yield path
    finally:
        if writer.is_alive():  # nobody opened it: let the writer's open() return
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(timeout=10)


def _pipe_case(name: str, content: bytes, streaming: bool, *parts: str) -> Case:
    def check(ws: Workspace) -> str:
        good = ws.corpus()
        with _fifo(ws.fresh(name) / "63", content) as pipe:
            flags = {"train_file": str(pipe), "validation_file": str(good), "test_file": str(good)}
            if streaming:
                flags.update(streaming=True, max_steps=4)
            return one_line(*run_train(tiny_flags(ws.fresh("out"), **flags)), 2, str(pipe), *parts)
    return Case(name, "corpus", check)


def _pipe_loads(ws: Workspace) -> str:
    from hf_scratch_transformer.data.loading import DataArguments, load_parallel_corpus

    good = str(ws.corpus())
    tsv = "".join(f"{en}\t{es}\n" for en, es in PAIRS).encode()
    with _fifo(ws.fresh("pipe") / "63", tsv) as pipe:
        corpus = load_parallel_corpus(DataArguments(train_file=str(pipe), validation_file=good, test_file=good))
    pairs = [(pair["en"], pair["es"]) for pair in corpus["train"]["translation"]]
    if pairs != PAIRS:
        raise Failure(f"the pipe gave {len(pairs)} pairs, not the {len(PAIRS)} written to it")
    return f"{len(pairs)} pairs read from the pipe, once"


# ---------------------------------------------------------------------------------------------- the datasets cache


@contextlib.contextmanager
def _datasets_cache_at(path: Path):
    """`datasets` computes its cache directory from HF_DATASETS_CACHE / HF_HOME when it is imported: point it at
    `path` for the block, as those variables would in a new process."""
    import datasets

    before = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = Path(path)
    try:
        yield
    finally:
        datasets.config.HF_DATASETS_CACHE = before


@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
    """A real tmpfs mounted at `path` with `options` (root only), unmounted after the block."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        raise Skipped("a read-only or full file system is a tmpfs mounted for the case, which needs root")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        raise Skipped(f"mounting a tmpfs was refused ({done.stderr.strip()})")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _cache_case(name: str, cache_in, *parts: str) -> Case:
    """train.py with the datasets cache at `cache_in(folder)` (a context manager giving the path) stops with one line
    naming the cache, exit 1; the corpus is fine."""
    def check(ws: Workspace) -> str:
        good = ws.corpus()
        pairs = _plain_pairs(ws.fresh("pairs"), EN * 50, ES * 50)  # not cached yet: datasets must write it
        with cache_in(ws.fresh(name)) as cache, _datasets_cache_at(cache):
            flags = {"train_file": str(pairs), "validation_file": str(good), "test_file": str(good)}
            return one_line(*run_train(tiny_flags(ws.fresh("out"), **flags)), 1, "datasets cache", str(cache),
                            "HF_DATASETS_CACHE", *parts)
    return Case(name, "corpus", check)


@contextlib.contextmanager
def _a_file(folder: Path):
    (folder / "cache").write_text("not a directory")
    yield folder / "cache"


@contextlib.contextmanager
def _read_only_home(folder: Path):
    """HF_HOME on a read-only file system: the datasets cache would be HF_HOME/datasets."""
    if os.geteuid() != 0:  # a directory's mode binds every user but root
        folder.chmod(0o555)
        try:
            yield folder / "datasets"
        finally:
            folder.chmod(0o755)
        return
    with _tmpfs(folder / "home", "ro,size=1m") as home:
        yield home / "datasets"


@contextlib.contextmanager
def _full_disk(folder: Path):
    with _tmpfs(folder / "cache", "size=48k") as cache:
        yield cache


# ------------------------------------------------------------------------------------------- inputs that must work


def _compressed_named_jsonl(compress):
    def make(ws, folder):
        (folder / "train.jsonl").write_bytes(compress(GOOD_JSONL.encode()))
        return folder / "train.jsonl"
    return make


def _tsv_with_quotes(ws, folder):
    (folder / "train.tsv").write_text("".join(f"{en}\t{es}\n" for en, es in QUOTED))
    return folder / "train.tsv"


def _crlf_bom_padding(ws, folder):
    (folder / "train.en").write_bytes(("\ufeff" + "".join(f"  {en} \r\n" for en in EN)).encode())
    (folder / "train.es").write_bytes(("\ufeff" + "".join(f"{es}\t\r\n" for es in ES)).encode())
    return folder / "train"


def _separators_inside_lines(ws, folder):
    return _plain_pairs(folder, [f"{en}\u2028{en}\x85\x0c" for en in EN], ES)


QUOTED = [('"Hello," he said.', '"Hallo", sagte er.'), ('It is "fine', 'Está "bien'), ("'Yes'", "«Sí»")] * 3


def _giant_word(ws: Workspace) -> str:
    """A 1 MB line without spaces: dropped before tokenizer training (which would take minutes) and counted."""
    from hf_scratch_transformer.data.loading import DataArguments, load_parallel_corpus
    from hf_scratch_transformer.data.preprocessing import preprocess_corpus
    from hf_scratch_transformer.data.tokenization import train_tokenizer_on_corpus

    pairs = _plain_pairs(ws.fresh("giant"), EN + ["x" * 2**20], ES + ["y"])
    good = str(ws.corpus())
    args = DataArguments(train_file=str(pairs), validation_file=good, test_file=good, tokenizer_vocab_size=400)
    corpus = load_parallel_corpus(args)
    tokenizer = train_tokenizer_on_corpus(corpus["train"], "en", "es", vocab_size=400)
    _, report = preprocess_corpus(corpus, tokenizer, args)
    if report["train"]["too_long"] != 1 or report["train"]["kept"] != len(PAIRS):
        raise Failure(f"filter report {report['train']}: the giant line is not counted as over-long")
    return f"dropped before tokenizing and counted: {report['train']}"


CASES = [
    _refused("plain_pairs_line_counts_differ", _counts_differ, "different line counts", "train.en has 24 lines",
             "train.es has 23"),
    _refused("plain_pairs_target_side_missing", _target_side_missing, "{train_file}.en", "no {train_file}.es"),
    _refused("one_side_of_plain_pairs_given", _one_side_given, "one side of plain-text pairs", "give their prefix"),
    _refused("symlink_loop", _symlink_loop, "{train_file}", "symbolic link that loops"),
    _refused("dangling_symlink", _dangling_symlink, "{train_file}", "symbolic link to", "does not exist"),
    _refused("unknown_extension", _unknown_extension, "{train_file}", "extension must be one of", "PREFIX"),
    _refused("empty_plain_pair_files", _empty_pair_files, "holds no examples"),
    _refused("header_only_tsv", _header_only_tsv, "{train_file}", "holds no examples"),
    _refused("line_over_16_mib", _over_long_line, "line 2", "longer than 16 MiB"),
    _refused("deeply_nested_json", _nested_json, "{train_file}", "line 2", "too deeply"),
    _refused("tsv_three_columns", _tsv_three_columns, "{train_file}", "line 2", "3 tab-separated fields"),
    _refused("csv_quote_inside_a_field", _csv_quote_inside_field, "{train_file}", "line 2", "not valid CSV", ".tsv"),
    _refused("csv_unclosed_quote", _csv_unclosed_quote, "{train_file}", "line 3", "not valid CSV"),
    _refused("utf16_corpus", _utf16, "{train_file}", "UTF-16", "iconv"),
    _refused("zstd_named_jsonl", _zstd_named_jsonl, "{train_file}", "zstd"),
    _refused("zip_named_jsonl", _zip_named_jsonl, "{train_file}", "zip archive", "extract"),
    _refused("truncated_gzip", _truncated_gzip, "Cannot read", "{train_file}"),
    _refused("latin1_plain_pairs", _latin1_pairs, "train.en", "not UTF-8", "line 3", "iconv"),
    _refused("empty_directory_as_dataset_name", _empty_directory_as_dataset_name, "{dataset_name}",
             "cannot be loaded", "save_to_disk"),
    _refused("saved_dataset_without_language_columns", _saved_without_language_columns, "{train_file}",
             "neither a `translation` column nor columns for the languages", "'text'"),
    _refused("saved_dict_without_validation_split", _saved_dict_without_validation, "{validation_file}",
             "no validation split", "--dataset_name"),
    _pipe_case("pipe_with_streaming", GOOD_JSONL.encode(), True, "pipe", "read only once", "--streaming"),
    _pipe_case("pipe_of_unknown_format", "\n".join(EN).encode(), False, "pipe", "neither JSON nor tab-separated"),
    _cache_case("datasets_cache_is_a_file", _a_file, "is a file"),
    _cache_case("datasets_cache_read_only", _read_only_home, "HF_HOME"),
    _cache_case("datasets_cache_disk_full", _full_disk, "No space left"),
    Case("pipe_is_read_once", "corpus", _pipe_loads),
    _loads("gzip_named_jsonl", _compressed_named_jsonl(gzip.compress), PAIRS),
    _loads("xz_named_jsonl", _compressed_named_jsonl(lzma.compress), PAIRS),
    _loads("bzip2_named_jsonl", _compressed_named_jsonl(bz2.compress), PAIRS),
    _loads("tsv_quotes_are_characters", _tsv_with_quotes, QUOTED),
    _loads("crlf_bom_and_padding", _crlf_bom_padding, PAIRS),
    _loads("line_separators_inside_lines", _separators_inside_lines,
           [(f"{en}\u2028{en}", es) for en, es in PAIRS]),
    Case("one_mb_word_is_filtered", "corpus", _giant_word),
    _refused("stale_plain_side_beside_gzip", _stale_side_beside_gzip, "{train_file}.en and {train_file}.en.gz",
             "remove or rename all but one"),
    _refused("tsv_header_of_another_language", _tsv("en\tfr"), "{train_file}", "line 1", "'en<TAB>fr'",
             "--source_lang en --target_lang fr", "add the header line en<TAB>es"),
    _loads("tsv_header_of_language_names_skipped", _tsv("English\tSpanish"), PAIRS),
    _loads("tsv_header_in_the_other_order", _tsv("Spanish\tEnglish", swap=True), PAIRS),
    _loads("tsv_first_pair_of_short_words_is_data", _tsv(None, [("Yes", "Sí"), ("No", "No")] + PAIRS),
           [("Yes", "Sí"), ("No", "No")] + PAIRS),
    _loads("csv_columns_named_in_english", _csv_named_columns, PAIRS),
    _loads("old_mac_line_ends_plain_pairs", _old_mac_pairs, PAIRS),
    _loads("old_mac_line_ends_tsv", _old_mac_tsv, PAIRS),
    _refused("prefix_is_also_a_folder", _prefix_is_a_folder, "{train_file}' is a folder",
             "{train_file}.en and {train_file}.es", "move or rename the folder"),
    _refused("file_in_the_way_of_a_pair_prefix", _file_in_the_way_of_a_prefix, "{train_file}",
             "also the prefix of the plain-text pairs {train_file}.en and {train_file}.es", "move or rename"),
    _refused("newline_after_old_mac_line_ends", _newline_after_old_mac_line_ends, "train.en', line 17778",
             "a \\n line end after old Mac line ends (\\r)"),
    _refused("dev_null_as_validation_file", _dev_null_validation, "'/dev/null' gave no text",
             "leave --validation_file out"),
    Case("flat_jsonl_paraphrases_are_read", "corpus", _flat_paraphrases),
]
