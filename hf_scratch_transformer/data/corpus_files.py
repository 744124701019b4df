"""Local corpus files read as ``{"translation": {source: ..., target: ...}}`` records, checked while they are read.

Layouts: plain-text pairs (``PREFIX.<source>`` + ``PREFIX.<target>``, one sentence per line, fairseq/OPUS/Moses
style), TSV (``source<TAB>target``, quotes are plain characters), CSV (a header naming the language columns, proper
CSV quoting) and JSON Lines / JSON (``{"translation": {...}}`` or one field per language). Any of them may be gzip,
bzip2 or xz compressed: the compression is recognised from the content, not the name. Lines end at ``\\n`` only
(``\\r\\n`` too; never at U+2028, form feed or the other characters ``str.splitlines`` splits on, which would
misalign the two sides), or at ``\\r`` in a file with old Mac line ends (a ``\\r`` and no ``\\n`` in its first line's
worth of bytes); a UTF-8 BOM and surrounding whitespace are removed from every sentence. A first TSV or CSV row
naming languages is a header (:mod:`language_names`).

Every problem is a :class:`CorpusError` naming the file, the line and what to fix. A file is read once per use:
:meth:`CorpusFiles.records` is the one reader, which `datasets` drives (``Dataset.from_generator``).
"""

import bz2
import csv
import errno
import gzip
import hashlib
import json
import logging
import lzma
import os
import reprlib
import stat
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain, zip_longest
from pathlib import Path

from ..errors import UsageError
from .language_names import header_languages, named_language, same_language

LAYOUTS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "tsv"}  # by file name; plain pairs by prefix
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz")
COMPRESSIONS = {b"\x1f\x8b": gzip.GzipFile, b"BZh": bz2.BZ2File, b"\xfd7zXZ\x00": lzma.LZMAFile}
UNREADABLE_CONTENT = {
    b"\x28\xb5\x2f\xfd": "zstd-compressed: decompress it first (`zstd -d`) or compress it with gzip",
    b"PK\x03\x04": "a zip archive: extract the corpus file from it",
    b"7z\xbc\xaf\x27\x1c": "a 7z archive: extract the corpus file from it",
    b"\xff\xfe": "UTF-16: convert it to UTF-8, e.g. `iconv -f utf-16 -t utf-8`",
    b"\xfe\xff": "UTF-16: convert it to UTF-8, e.g. `iconv -f utf-16 -t utf-8`",
}
BOM = b"\xef\xbb\xbf"
MAX_LINE_BYTES = 16 * 2**20  # a longer line is no sentence (and would be held in memory whole)
CHUNK_BYTES = 2**20  # read at a time, then split into lines
SAVED_DATASET_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes (DatasetDict, Dataset)
KEY_SAMPLE = 1000  # JSON records looked at for the language keys
# a change of the reading rules (this module, the header rules): a new cache
READER_CODE = hashlib.sha256(b"".join(Path(__file__).with_name(name).read_bytes()
                                      for name in ("corpus_files.py", "language_names.py"))).hexdigest()
_PREVIEW = reprlib.Repr()  # a short repr that never recurses deeply (a nested JSON value)
_PREVIEW.maxlevel, _PREVIEW.maxstring, _PREVIEW.maxother = 2, 60, 60
_preview = _PREVIEW.repr
logger = logging.getLogger("hf_scratch_transformer")


# ----------------------------------------------------------------------------------------------------------- errors


class CorpusError(UsageError, ValueError):
    """A corpus that cannot be used as given; the message names the file (and line) and what to fix."""


class CorpusFileNotFoundError(CorpusError, FileNotFoundError):
    """A corpus file that does not exist."""


class CorpusKeyError(CorpusError, KeyError):
    """A language key or column absent from the corpus."""

    def __str__(self) -> str:  # KeyError would show the message in quotes
        return str(self.args[0]) if self.args else ""


# ------------------------------------------------------------------------------------------------ the files of a split


@dataclass(frozen=True)
class CorpusFiles:
    """The local file(s) of one split: ``paths`` is one file, or the source and target files of plain-text pairs."""

    split: str
    layout: str  # "pairs", "tsv", "csv" or "json"
    paths: tuple[str, ...]
    languages: tuple[str, str]  # (source, target)
    announce: bool = True  # log how the files are read (a header, old Mac line ends); off for repeated readings

    def describe(self) -> str:
        names = " and ".join(self.paths)
        return f"{names} ({'plain-text pairs' if self.layout == 'pairs' else self.layout.upper()})"

    def rereadable(self) -> bool:
        """False for a pipe (``<(...)``, /dev/stdin): it can be read only once."""
        return all(stat.S_ISREG(os.stat(path).st_mode) for path in self.paths)

    def fingerprint(self) -> str:
        """Names the `datasets` cache of these files: changes with their size or modification time (a pipe gets a
        new one every time, as its content cannot be known before it is read)."""
        if not self.rereadable():
            return uuid.uuid4().hex
        facts = [READER_CODE, self.layout, *self.languages]
        for path in self.paths:
            status = os.stat(path)
            facts += [os.path.realpath(path), str(status.st_size), str(status.st_mtime_ns)]
        return "corpus-" + hashlib.sha256("\0".join(facts).encode()).hexdigest()[:24]

    def records(self) -> Iterator[dict]:
        """``{"translation": {source: str | None, target: str | None}}`` per pair, stripped; JSON records also
        ``{"paraphrases": {source: [str, ...], target: [...]}}`` (empty lists where a record has none); raises
        CorpusError."""
        if self.layout == "pairs":
            pairs = _plain_pairs(self, _lines(self, self.paths[0]), _lines(self, self.paths[1]))
        else:
            layout, lines = self.layout, _lines(self, self.paths[0])
            if layout == "pipe":
                layout, lines = _sniffed_layout(self, lines)
            pairs = {"tsv": _tsv_pairs, "csv": _csv_pairs, "json": _json_pairs}[layout](self, lines)
        count = 0
        for count, pair in enumerate(pairs, start=1):
            record = {"translation": {lang: _clean(pair.get(lang)) for lang in self.languages}}
            if self.has_paraphrases():
                record["paraphrases"] = {lang: [_clean(text) for text in pair.paraphrases.get(lang, [])]
                                         for lang in self.languages}
            yield record
        if not count:
            raise CorpusError(f"The {self.split} file {self.paths[0]!r} holds no examples.")

    def has_paraphrases(self) -> bool:
        """Whether the records carry a `paraphrases` field: JSON ones (other wordings of a side), see docs/data.md."""
        return self.layout == "json"

    def error(self, where: str, problem: str, path: str | None = None) -> CorpusError:
        return CorpusError(f"The {self.split} file {path or self.paths[0]!r}, {where}: {problem}")


def _clean(text):
    return text.strip() if isinstance(text, str) else text


def resolve_corpus_files(path: str, split: str, languages: tuple[str, str]) -> CorpusFiles | None:
    """The files ``path`` names for ``split``, or None when it is a directory (a ``save_to_disk`` dataset, for the
    caller to load). A path that is not a file is a prefix of plain-text pairs when ``PATH.<source>`` and
    ``PATH.<target>`` (or ``.gz``/``.bz2``/``.xz``) exist."""
    status = _stat(path, split)
    if status is None:
        prefix = _plain_pair_paths(path, split, languages)
        if prefix is None:
            raise CorpusFileNotFoundError(
                f"The {split} file {path!r} does not exist, and neither do the plain-text pair files "
                f"{path}.{languages[0]} and {path}.{languages[1]} it could be the prefix of.")
        return CorpusFiles(split, "pairs", prefix, languages)
    if stat.S_ISDIR(status.st_mode):
        _check_folder_is_no_prefix(path, split, languages)
        return None
    if not (stat.S_ISREG(status.st_mode) or stat.S_ISFIFO(status.st_mode) or stat.S_ISCHR(status.st_mode)):
        raise CorpusError(f"The {split} file {path!r} is not a regular file (a socket or device): give a file.")
    if stat.S_ISREG(status.st_mode) and status.st_size == 0:
        raise CorpusError(f"The {split} file {path!r} is empty.")
    return CorpusFiles(split, _layout_of(path, split, languages, status), (path,), languages)


def _stat(path: str, split: str) -> os.stat_result | None:
    """os.stat of ``path``, None if nothing is there; a symlink loop, a dangling link and the like are named."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise CorpusFileNotFoundError(f"The {split} file {path!r} is a symbolic link to "
                                          f"{os.readlink(path)!r}, which does not exist.") from None
        return None
    except OSError as error:
        reason = ("a symbolic link that loops (it points, directly or not, back to itself)"
                  if error.errno == errno.ELOOP else f"not usable: {error.strerror}")
        raise CorpusError(f"The {split} file {path!r} is {reason}: give the path of a real file.") from None


def _pair_files(prefix: str, split: str, languages: tuple[str, str]) -> list[list[str]]:
    """Per language, the files ``PREFIX.<lang>`` and ``PREFIX.<lang>.gz``/``.bz2``/``.xz`` that exist."""
    return [[name for name in [f"{prefix}.{lang}"] + [f"{prefix}.{lang}{suffix}" for suffix in COMPRESSED_SUFFIXES]
             if _stat(name, split) is not None] for lang in languages]


def _plain_pair_paths(prefix: str, split: str, languages: tuple[str, str]) -> tuple[str, str] | None:
    """(source file, target file) of a plain-text pair prefix, None when neither side exists. A side with two
    versions (``train.en`` and ``train.en.gz``: one of them stale?) is refused, never paired with the other side."""
    present = _pair_files(prefix, split, languages)
    for lang, names in zip(languages, present):
        if len(names) > 1:
            raise CorpusError(
                f"The {split} corpus {prefix!r} has {len(names)} versions of its {lang} side: {' and '.join(names)}. "
                f"Which one goes with the other side cannot be told (one may be stale): remove or rename all but one.")
    found = [names[0] if names else None for names in present]
    if found == [None, None]:
        return None
    if None in found:
        have, lang = (found[0], languages[1]) if found[1] is None else (found[1], languages[0])
        raise CorpusFileNotFoundError(
            f"The {split} corpus {prefix!r} has {have} but no {prefix}.{lang} (nor {prefix}.{lang}.gz): plain-text "
            f"pairs need one file per language, --source_lang {languages[0]} and --target_lang {languages[1]}.")
    return found[0], found[1]


def is_saved_dataset(path: str) -> bool:
    """Whether the folder ``path`` holds what ``save_to_disk`` writes."""
    return any(os.path.isfile(os.path.join(path, marker)) for marker in SAVED_DATASET_MARKERS)


def _check_folder_is_no_prefix(path: str, split: str, languages: tuple[str, str]) -> None:
    """A folder given as a corpus is read as a saved dataset, unless it is also the prefix of plain-text pairs: then
    it could mean either, and is refused naming both."""
    pairs = _pair_files(path, split, languages)
    if not all(pairs):
        return
    if is_saved_dataset(path):
        folder, other = "a folder holding a dataset saved by `datasets`", "to use the saved dataset, rename the pairs"
    else:
        folder, other = "a folder (no dataset saved by `datasets` in it)", "a folder is read only as a saved dataset"
    pair_files = " and ".join(name for names in pairs for name in names)
    raise CorpusError(f"The {split} file {path!r} is {folder}, and also the prefix of the plain-text pairs "
                      f"{pair_files}: to train on those pairs, move or rename the folder; {other}.")


def _layout_of(path: str, split: str, languages: tuple[str, str], status: os.stat_result) -> str:
    """The layout a file's name gives (a pipe has no telling name: its first line decides)."""
    name = Path(path).name.lower()
    for suffix in COMPRESSED_SUFFIXES:
        name = name.removesuffix(suffix)
    layout = LAYOUTS.get(Path(name).suffix)
    if layout is not None:
        return layout
    if not stat.S_ISREG(status.st_mode):
        return "pipe"
    side, pairs = Path(name).suffix.lstrip("."), _pair_files(path, split, languages)
    hint = (f" It looks like one side of plain-text pairs: give their prefix, --{split}_file "
            f"{path[: -len(side) - 1] if path.lower().endswith(side) else path}." if side in languages else "")
    if all(pairs):  # a file in the way of a prefix
        hint = (f" It is also the prefix of the plain-text pairs {' and '.join(sum(pairs, []))}: to train on them, "
                f"move or rename {path!r}.")
    raise CorpusError(
        f"Cannot read {path!r} as the {split} corpus: its extension must be one of {sorted(LAYOUTS)} (or that + "
        f".gz/.bz2/.xz), or give the prefix PREFIX of plain-text pairs PREFIX.{languages[0]} + "
        f"PREFIX.{languages[1]}.{hint}")


# ------------------------------------------------------------------------------------------------------------ lines


def _lines(files: CorpusFiles, path: str) -> Iterator[tuple[int, str]]:
    """(line number, text ending in "\\n" or "\\r\\n") of a file, decompressed, UTF-8 checked: split at b"\\n" only,
    or at b"\\r" in a file with old Mac line ends (see `_first_bytes`)."""
    try:
        with open(path, "rb") as raw:
            stream = _decompressed(raw, files, path)
            head = _first_bytes(stream)
            first_line = head[:MAX_LINE_BYTES + 1]  # holds a line end, or is too long to be a line
            old_mac = b"\r" in first_line and b"\n" not in first_line
            if old_mac and files.announce:
                logger.info("%s split: %s has old Mac line ends (\\r): read line by line at them", files.split, path)
            for number, line in enumerate(_split_lines(head, stream, b"\r" if old_mac else b"\n"), start=1):
                if len(line) > MAX_LINE_BYTES:
                    raise files.error(f"line {number}", f"longer than {MAX_LINE_BYTES // 2**20} MiB: is this a "
                                      "text corpus with one sentence (pair) per line?", path)
                if old_mac and b"\n" in line[:-1]:
                    raise files.error(f"line {number}", "a \\n line end after old Mac line ends (\\r) before it: "
                                      "where the lines end cannot be told; give the file one kind of line end.", path)
                yield number, _decoded(line.removeprefix(BOM) if number == 1 else line, number, files, path)
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as error:  # unreadable, or corrupt compressed data
        if isinstance(error, CorpusError):
            raise
        raise CorpusError(f"Cannot read the {files.split} file {path!r}: {error}") from error


def _first_bytes(stream) -> bytes:
    """The first bytes of a stream, read until they hold a b"\\n" (the end of the first line), pass MAX_LINE_BYTES
    (no line is longer) or end the stream. A b"\\r" and no b"\\n" in them: old Mac line ends (a file of one line
    with a lone b"\\r" inside could be read either way, but is no corpus)."""
    head = b""
    while b"\n" not in head and len(head) <= MAX_LINE_BYTES:
        chunk = stream.read(CHUNK_BYTES)
        if not chunk:
            break
        head += chunk
    return head


def _split_lines(head: bytes, stream, separator: bytes) -> Iterator[bytes]:
    """The lines of ``head`` + the rest of ``stream``, split at ``separator``, each ending in b"\\n" (the last one
    too); a line past MAX_LINE_BYTES is given as it is (for the caller to refuse) and ends the reading."""
    pending = head
    while True:
        *lines, pending = pending.split(separator)
        yield from (line + b"\n" for line in lines)
        if len(pending) > MAX_LINE_BYTES:
            yield pending
            return
        chunk = stream.read(CHUNK_BYTES)
        if not chunk:
            break
        pending += chunk
    if pending:
        yield pending + b"\n"


def _decompressed(raw, files: CorpusFiles, path: str):
    """The stream itself, or its decompression when its first bytes are a gzip, bzip2 or xz signature."""
    head = raw.peek(8)[:8]
    for magic, opener in COMPRESSIONS.items():
        if head.startswith(magic):
            return opener(fileobj=raw) if opener is gzip.GzipFile else opener(raw)
    for magic, what in UNREADABLE_CONTENT.items():
        if head.startswith(magic):
            raise CorpusError(f"The {files.split} file {path!r} is {what}.")
    return raw


def _decoded(line: bytes, number: int, files: CorpusFiles, path: str) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as error:
        bad = line[error.start:error.start + 1]
        raise CorpusError(
            f"The {files.split} file {path!r} is not UTF-8: line {number}, byte {error.start + 1} of the line "
            f"({bad!r}). Convert it, e.g. `iconv -f latin1 -t utf-8`.") from None


def _without_line_end(line: str) -> str:
    return line[:-2] if line.endswith("\r\n") else line[:-1] if line.endswith("\n") else line


# ------------------------------------------------------------------------------------------------------ the layouts


def _sniffed_layout(files: CorpusFiles, lines: Iterator[tuple[int, str]]):
    """(layout, the same lines) of a pipe, which has no telling name: JSON when its first non-blank line starts with
    `{` or `[`, TSV when that line holds a tab."""
    head = []
    for item in lines:
        head.append(item)
        if item[1].strip():
            break
    first = head[-1][1].strip() if head else ""
    if not first:
        instead = "give a corpus file" if files.split == "train" else (
            f"give a corpus file, or leave --{files.split}_file out (the split is then carved out of the train split)")
        raise CorpusError(f"The {files.split} file {files.paths[0]!r} gave no text (an empty pipe or device, such as "
                          f"/dev/null): {instead}.")
    layout = "json" if first.startswith(("{", "[")) else "tsv" if "\t" in first else None
    if layout is None:
        raise CorpusError(
            f"The {files.split} file {files.paths[0]!r} is a pipe or device, whose format cannot be told from its "
            "name, and its first line is neither JSON nor tab-separated: give a file named .jsonl, .json, .csv or .tsv, "
            "or a PREFIX of plain-text pair files.")
    return layout, chain(head, lines)


def _plain_pairs(files: CorpusFiles, sources, targets) -> Iterator[dict]:
    """Line N of the source file with line N of the target file; different line counts are an error."""
    (source, target), (source_lang, target_lang) = files.paths, files.languages
    pairs = 0
    for source_line, target_line in zip_longest(sources, targets):
        if source_line is None or target_line is None:
            rest = 1 + sum(1 for _ in (targets if source_line is None else sources))
            counts = (pairs, pairs + rest) if source_line is None else (pairs + rest, pairs)
            raise CorpusError(
                f"The {files.split} files have different line counts: {source} has {counts[0]} lines but {target} "
                f"has {counts[1]}. Plain-text pairs need line N of one file to translate line N of the other.")
        pairs += 1
        yield {source_lang: _without_line_end(source_line[1]), target_lang: _without_line_end(target_line[1])}


def _tsv_pairs(files: CorpusFiles, lines) -> Iterator[dict]:
    """Two tab-separated columns, source then target, or in the order a header gives: a first line naming two
    languages (`header_languages`) is skipped when they are the run's, refused when one is not. Quotes are characters
    like any other."""
    columns = list(files.languages)
    for number, line in lines:
        fields = _without_line_end(line).split("\t")
        named = header_languages(fields, files.languages) if number == 1 and len(fields) == 2 else None
        if named is not None:
            columns = _tsv_header(named, fields, files)
            continue
        if len(fields) == 1 and not fields[0].strip():
            yield {}  # a blank line: an empty pair (skipped and counted)
            continue
        if len(fields) != 2:
            raise files.error(f"line {number}", f"{len(fields)} tab-separated fields, but a TSV corpus has two per "
                              f"line: {files.languages[0]}<TAB>{files.languages[1]}.")
        yield dict(zip(columns, fields))


def _tsv_header(named: tuple[str, ...], fields: list[str], files: CorpusFiles) -> list[str]:
    """The languages of the two columns a header line names; refused (two readings: a header, or a pair) when they
    are not the run's two."""
    (source, target), shown = files.languages, "<TAB>".join(field.strip() for field in fields)
    if sorted(named) != sorted(files.languages):
        raise files.error("line 1", f"{shown!r} reads as a header naming the languages {named[0]} and {named[1]}, but "
                          f"this run translates {source} to {target}: if the columns hold {named[0]} and {named[1]}, "
                          f"give --source_lang {named[0]} --target_lang {named[1]}; if line 1 is a pair to train on, "
                          f"add the header line {source}<TAB>{target} above it.")
    if files.announce:
        order = "" if list(named) == [source, target] else f"; column 1 is read as {named[0]}, as it says"
        logger.info("%s split: line 1 of %s, %r, is a header naming the languages: skipped%s", files.split,
                    files.paths[0], shown, order)
    return list(named)


def _csv_pairs(files: CorpusFiles, lines) -> Iterator[dict]:
    """CSV with a header naming the columns (the two languages among them) and standard quoting, checked strictly:
    a quote that does not open and close a whole field is an error, not silently dropped."""
    rows = csv.reader((line for _, line in lines), strict=True)
    header, number = None, 0
    try:
        for row in rows:
            start, number = number + 1, rows.line_num
            if header is None:
                header, columns = row, _csv_columns(row, files)
                continue
            if row and len(row) != len(header):
                raise files.error(f"line {start}", f"{len(row)} fields, but the header has {len(header)}.")
            yield {lang: row[column] for lang, column in zip(files.languages, columns)} if row else {}
    except csv.Error as error:
        raise files.error(
            f"line {number + 1}", f"not valid CSV ({error}): a field holding commas, quotes or line breaks must be "
            'quoted whole, with each quote inside it doubled ("He said ""yes"""), as spreadsheets and Python\'s csv '
            "module write it; or save the corpus as .tsv, where quotes are plain characters.") from None
    if header is None:
        raise CorpusError(f"The {files.split} file {files.paths[0]!r} holds no examples.")


def _csv_columns(row: list[str], files: CorpusFiles) -> list[int]:
    """The column of each language: the one its code names exactly, else the one naming the same language
    (``English`` or ``eng`` for en); refused when no column, or several, do."""
    header, columns, missing = [name.strip() for name in row], [], []
    for lang in files.languages:
        same = [index for index, name in enumerate(header) if name == lang] or [
            index for index, name in enumerate(header)
            if (found := named_language(name)) is not None and same_language(lang, found[0])]
        if len(same) > 1:
            raise CorpusKeyError(f"The {files.split} file {files.paths[0]!r} has {len(same)} columns for the language "
                                 f"{lang}: {[header[index] for index in same]}. Rename all but one in the header line.")
        missing += [] if same else [lang]
        columns += same
    if missing:
        raise CorpusKeyError(f"The {files.split} file {files.paths[0]!r} has no column for the language(s) "
                             f"{missing}: its header names the columns {header}. A CSV corpus needs a header line "
                             "naming the language columns; set --source_lang / --target_lang to them.")
    return columns


def _json_pairs(files: CorpusFiles, lines) -> Iterator[dict]:
    """The fields of JSON Lines records (or of a JSON list of records / an object of columns), each record checked:
    an object, with a `translation` object or one field per language, holding strings or null. The language keys
    must appear among the first KEY_SAMPLE records."""
    keys_seen, count = set(), 0
    for count, (where, record) in enumerate(_json_records(files, lines), start=1):
        pair = _record_pair(record, where, files)
        if count <= KEY_SAMPLE:
            keys_seen.update(pair)
            if count == KEY_SAMPLE:
                _check_keys(keys_seen, files, count)
        yield pair
    if count < KEY_SAMPLE:
        _check_keys(keys_seen, files, count)


def _check_keys(keys_seen: set, files: CorpusFiles, records: int) -> None:
    if not records:
        raise CorpusError(f"The {files.split} file {files.paths[0]!r} holds no examples.")
    missing = [lang for lang in files.languages if lang not in keys_seen]
    if missing:
        raise CorpusKeyError(
            f"Language key(s) {missing} not found in the {files.split} file {files.paths[0]!r}: the keys present "
            f"are {sorted(keys_seen)}. Set --source_lang / --target_lang accordingly.")


def _record_pair(record, where: str, files: CorpusFiles) -> dict:
    """The `translation` object of one record, or the record itself when it has one field per language."""
    expected = (f'expected {{"translation": {{"{files.languages[0]}": "...", "{files.languages[1]}": "..."}}}} '
                f'or {{"{files.languages[0]}": "...", "{files.languages[1]}": "..."}}')
    if not isinstance(record, dict):
        if where.startswith("line"):
            raise files.error(where, f"a JSON object per line is expected, got {type(record).__name__}.")
        raise files.error(where, f"{expected}, got {type(record).__name__}.")
    pair, nested = (record.get("translation"), True) if "translation" in record else (record, False)
    if pair is not None and not isinstance(pair, dict):
        raise files.error(where, f"`translation` must be an object, got {type(pair).__name__} ({_preview(pair)}); "
                                 f"{expected}.")
    pair = _Pair(pair or {})
    for lang in files.languages:
        value = pair.get(lang)
        if value is not None and not isinstance(value, str):
            name = f"translation.{lang}" if nested else lang
            raise files.error(where, f"`{name}` must be a string (or null), got {type(value).__name__} "
                                     f"({_preview(value)}).")
    paraphrases = record.get("paraphrases")
    if paraphrases is not None and not (isinstance(paraphrases, dict) and all(
            isinstance(texts, list) and all(isinstance(text, str) for text in texts)
            for lang, texts in paraphrases.items() if lang in files.languages)):
        raise files.error(where, f"`paraphrases` must be an object of lists of strings per language, e.g. "
                                 f'{{"{files.languages[0]}": ["another wording"]}}, got {_preview(paraphrases)}.')
    pair.paraphrases = {lang: texts for lang, texts in (paraphrases or {}).items() if lang in files.languages}
    return pair


class _Pair(dict):
    """One record's `translation` object, with the record's `paraphrases` beside it."""

    paraphrases: dict[str, list[str]] = {}


def _json_records(files: CorpusFiles, lines) -> Iterator[tuple[str, object]]:
    """(where, record): JSON Lines line by line ("line N"); a document (a list of records, "record N", or an object
    of equal-length columns) read whole."""
    head = []
    for number, line in lines:
        head.append(line)
        if line.strip():
            break
    first = head[-1].strip() if head else ""
    if first.startswith("{") and _parses_as_object(first):
        yield f"line {len(head)}", json.loads(first)
        for number, line in lines:
            if line.strip():
                yield f"line {number}", _parsed(line, f"line {number}", files)
        return
    document = _parsed("".join(head) + "".join(line for _, line in lines), "", files)
    yield from _document_records(document, files)


def _document_records(document, files: CorpusFiles) -> Iterator[tuple[str, object]]:
    if isinstance(document, list):
        for number, record in enumerate(document, start=1):
            yield f"record {number}", record
    elif isinstance(document, dict) and document and all(isinstance(column, list) for column in document.values()):
        sizes = {name: len(column) for name, column in document.items()}  # an object of columns (pandas' layout)
        if len(set(sizes.values())) > 1:
            raise CorpusError(f"The {files.split} file {files.paths[0]!r} holds columns of different lengths "
                              f"{sizes}: each column needs one value per pair.")
        for number, values in enumerate(zip(*document.values()), start=1):
            yield f"record {number}", dict(zip(document, values))
    else:
        yield "record 1", document


def _parses_as_object(line: str) -> bool:
    """True when the line is a record of JSON Lines: an object, not an object of columns (a JSON document)."""
    try:
        parsed = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return False
    return isinstance(parsed, dict) and not (parsed and all(isinstance(value, list) for value in parsed.values()))


def _parsed(text: str, where: str, files: CorpusFiles):
    kind = "jsonl" if where else "json"
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        place = where or f"line {error.lineno}"
        raise CorpusError(f"The {files.split} file {files.paths[0]!r} is not valid {kind}: {place}, column "
                          f"{error.colno}: {error.msg}") from None
    except RecursionError:
        raise CorpusError(f"The {files.split} file {files.paths[0]!r} is not usable: {where or 'the document'} "
                          "nests objects or lists too deeply to be read (a record of the corpus holds a "
                          "`translation` object of strings).") from None
