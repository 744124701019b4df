"""Corpus files a new user brings that could be read two ways (issue 42): a stale side beside its compressed copy, a
header row naming languages, old Mac line ends, a prefix that is also a folder, /dev/null, flat JSON paraphrases.
Each is built for real in tmp_path; a refusal is checked through train.py's main (exit status, one line, nothing
created), a file that must work through load_parallel_corpus (every pair as written)."""

import bz2
import contextlib
import csv
import gzip
import json
import logging
import lzma
from pathlib import Path

import pytest
from datasets import Dataset
from helpers import CORPUS_PAIRS, fails_with, saved_files, tiny_run_flags

from hf_scratch_transformer.data.corpus_files import MAX_LINE_BYTES
from hf_scratch_transformer.data.language_names import header_languages
from hf_scratch_transformer.data.loading import CorpusError, DataArguments, load_parallel_corpus

COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}


def refused(tmp_path, capsys, **files) -> str:
    """train.py's one-line refusal (exit 2) of the corpus `files`, the other splits a good JSON Lines file; nothing
    is created."""
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"translation": {"en": en, "es": es}}) + "\n" for en, es in CORPUS_PAIRS))
    output_dir = tmp_path / "out"
    flags = {"train_file": str(good), "validation_file": str(good), "test_file": str(good), **files}
    message = fails_with(tiny_run_flags(output_dir, **flags), capsys)
    assert message.startswith("error: ") and saved_files(output_dir) == []
    return message


def loaded(path, caplog=None, **args) -> list[tuple[str, str]]:
    """The training pairs of the corpus at `path` (every split reads it, so that nothing is carved away)."""
    with caplog.at_level(logging.INFO, logger="hf_scratch_transformer") if caplog else contextlib.nullcontext():
        corpus = load_parallel_corpus(DataArguments(train_file=str(path), validation_file=str(path),
                                                    test_file=str(path), **args))
    return [(pair["en"], pair["es"]) for pair in corpus["train"]["translation"]]


def write_sides(prefix: Path, pairs=CORPUS_PAIRS, end="\n", suffixes=("", "")) -> Path:
    """PREFIX.en + PREFIX.es, each line ending in `end`, each side compressed as its suffix says ("" for plain)."""
    for index, (lang, suffix) in enumerate(zip(("en", "es"), suffixes)):
        data = "".join(pair[index] + end for pair in pairs).encode()
        Path(f"{prefix}.{lang}{suffix}").write_bytes(COMPRESS[suffix](data) if suffix else data)
    return prefix


# ------------------------------------------------------------------------------------ two versions of one side


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz"])
@pytest.mark.parametrize("stale_side", ["en", "es"])
def test_a_side_beside_its_compressed_copy_is_refused_naming_both(tmp_path, capsys, suffix, stale_side):
    prefix = write_sides(tmp_path / "train", suffixes=(suffix, suffix))
    Path(f"{prefix}.{stale_side}").write_text("stale\n" * len(CORPUS_PAIRS))  # as many lines: nothing else differs
    message = refused(tmp_path, capsys, train_file=str(prefix))
    assert f"{prefix}.{stale_side} and {prefix}.{stale_side}{suffix}" in message
    assert "remove or rename all but one" in message


def test_one_compressed_side_and_one_plain_side_still_pair(tmp_path):
    assert loaded(write_sides(tmp_path / "train", suffixes=(".gz", ""))) == CORPUS_PAIRS


# -------------------------------------------------------------------------------------------------- header rows


@pytest.mark.parametrize("row, named", [("en\tes", ("en", "es")), ("English\tSpanish", ("en", "es")),
                                        ("eng\tspa", ("en", "es")), ("EN\tEspañol", ("en", "es")),
                                        ("en-US\tes-MX", ("en", "es")), ("es\ten", ("es", "en")),
                                        ("en\tfr", ("en", "fr")), ("German\tFrench", ("de", "fr")),
                                        ("en\tceb", ("en", "ceb")), ("Yes\tSí", None), ("No\tNo", None),
                                        ("the\tel", None), ("one\ttwo", None), ("English\tInglés", None),
                                        ("Hello.\tHola.", None)])
def test_only_cells_that_are_exactly_language_codes_or_names_make_a_header(row, named):
    assert header_languages(row.split("\t"), ("en", "es")) == named


@pytest.mark.parametrize("header", ["en\tes", "English\tSpanish", "eng\tspa", "EN\tEspañol"])
def test_a_tsv_header_naming_the_run_s_languages_is_skipped_and_logged(tmp_path, caplog, header):
    path = tmp_path / "train.tsv"
    path.write_text(header + "\n" + "".join(f"{en}\t{es}\n" for en, es in CORPUS_PAIRS))
    assert loaded(path, caplog) == CORPUS_PAIRS
    assert any("is a header naming the languages: skipped" in record.getMessage() and repr(header.replace(
        "\t", "<TAB>")) in record.getMessage() for record in caplog.records)


def test_a_tsv_header_in_the_other_order_gives_the_columns_and_says_so(tmp_path, caplog):
    path = tmp_path / "train.tsv"
    path.write_text("Spanish\tEnglish\n" + "".join(f"{es}\t{en}\n" for en, es in CORPUS_PAIRS))
    assert loaded(path, caplog) == CORPUS_PAIRS
    assert any("column 1 is read as es, as it says" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("header, flags", [("en\tfr", "--source_lang en --target_lang fr"),
                                           ("English\tFrench", "--source_lang en --target_lang fr"),
                                           ("de\tes", "--source_lang de --target_lang es")])
def test_a_tsv_header_naming_another_language_is_refused_naming_both(tmp_path, capsys, header, flags):
    path = tmp_path / "train.tsv"
    path.write_text(header + "\n" + "".join(f"{en}\t{es}\n" for en, es in CORPUS_PAIRS))
    message = refused(tmp_path, capsys, train_file=str(path))
    shown = header.replace("\t", "<TAB>")
    assert f"train.tsv', line 1: '{shown}' reads as a header" in message
    assert flags in message and "add the header line en<TAB>es above it" in message


def test_the_header_line_the_refusal_advises_makes_a_look_alike_first_pair_data(tmp_path):
    path = tmp_path / "train.tsv"
    rows = "".join(f"{en}\t{es}\n" for en, es in [("Is", "Es")] + CORPUS_PAIRS)
    path.write_text(rows)
    with pytest.raises(CorpusError, match="'Is<TAB>Es' reads as a header naming the languages is and es"):
        loaded(path)
    path.write_text("en\tes\n" + rows)
    assert loaded(path) == [("Is", "Es")] + CORPUS_PAIRS


@pytest.mark.parametrize("first", [("Yes", "Sí"), ("No", "No"), ("the", "el"), ("English", "Inglés")])
def test_a_first_pair_of_short_words_is_data_not_a_header(tmp_path, first):
    path = tmp_path / "train.tsv"
    path.write_text("".join(f"{en}\t{es}\n" for en, es in [first] + CORPUS_PAIRS))
    assert loaded(path) == [first] + CORPUS_PAIRS


def test_csv_columns_named_by_language_names_are_found(tmp_path):
    path = tmp_path / "train.csv"
    with open(path, "w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([("id", "Spanish", "English")] + [(i, es, en) for i, (en, es) in
                                                                      enumerate(CORPUS_PAIRS)])
    assert loaded(path) == CORPUS_PAIRS


def test_csv_with_two_columns_naming_one_language_is_refused_naming_them(tmp_path):
    path = tmp_path / "train.csv"
    with open(path, "w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([("English", "eng", "Spanish")] + [(en, "x", es) for en, es in CORPUS_PAIRS])
    with pytest.raises(CorpusError, match=r"2 columns for the language en: \['English', 'eng'\]"):
        loaded(path)


# ------------------------------------------------------------------------------------------- old Mac line ends


@pytest.mark.parametrize("ends", [("\r", "\r"), ("\r", "\n"), ("\n", "\r")])
def test_plain_pairs_with_old_mac_line_ends_are_read_line_by_line(tmp_path, caplog, ends):
    for index, (lang, end) in enumerate(zip(("en", "es"), ends)):
        (tmp_path / f"train.{lang}").write_bytes("".join(pair[index] + end for pair in CORPUS_PAIRS).encode())
    assert loaded(tmp_path / "train", caplog) == CORPUS_PAIRS
    assert any("has old Mac line ends" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("name", ["train.tsv", "train.jsonl", "train.csv", "train.tsv.gz"])
def test_tsv_json_and_csv_files_with_old_mac_line_ends_are_read(tmp_path, name):
    if ".tsv" in name:
        text = "".join(f"{en}\t{es}\r" for en, es in CORPUS_PAIRS)
    elif ".jsonl" in name:
        text = "".join(json.dumps({"en": en, "es": es}) + "\r" for en, es in CORPUS_PAIRS)
    else:
        text = "en,es\r" + "".join(f'"{en}","{es}"\r' for en, es in CORPUS_PAIRS)
    data = text.encode()
    (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    assert loaded(tmp_path / name) == CORPUS_PAIRS


def test_a_lone_carriage_return_inside_a_newline_file_stays_in_its_sentence(tmp_path):
    pairs = [("one\rtwo", "uno dos")] + CORPUS_PAIRS
    assert loaded(write_sides(tmp_path / "train", pairs)) == pairs


@pytest.mark.parametrize("last", [b"Jesus wept.\nY llor\xc3\xb3.\r", b"Jesus wept.\r\n"])
def test_old_mac_line_ends_then_a_newline_are_refused_naming_the_line(tmp_path, capsys, last):
    """The line ends are told from the first 16 MiB (where a \\n would make every \\r part of a sentence); a \\n
    after them is refused, not read as a line end of another kind."""
    lines = MAX_LINE_BYTES // 1000 + 2000  # 1,000-byte lines: 2 MB more than 16 MiB of them
    (tmp_path / "train.en").write_bytes((b"word " * 199 + b"word\r") * lines + last)
    (tmp_path / "train.es").write_bytes((b"palabra\n") * (lines + 3))
    message = refused(tmp_path, capsys, train_file=str(tmp_path / "train"))
    line = lines + (1 if b"\nY" in last else 2)  # the \n after the last \r begins a line of its own
    assert f"train.en', line {line}: a \\n line end after old Mac line ends (\\r)" in message


def test_a_line_past_the_limit_is_refused_in_a_file_with_old_mac_line_ends(tmp_path):
    (tmp_path / "train.en").write_bytes(b"Hello.\r" + b"a " * (MAX_LINE_BYTES // 2 + 1) + b"\r")
    (tmp_path / "train.es").write_text("Hola.\nHola.\n")
    with pytest.raises(CorpusError, match="train.en', line 2: longer than 16 MiB"):
        loaded(tmp_path / "train")


# ------------------------------------------------------------------------------- a prefix that is also a folder


@pytest.mark.parametrize("saved", [False, True])
def test_a_folder_that_is_also_a_pair_prefix_is_refused_naming_the_pair_files(tmp_path, capsys, saved):
    prefix = write_sides(tmp_path / "train", suffixes=("", ".gz"))
    if saved:
        Dataset.from_dict({"translation": [{"en": "Hi.", "es": "Hola."}] * 4}).save_to_disk(prefix)
    else:
        prefix.mkdir()
    message = refused(tmp_path, capsys, train_file=str(prefix))
    assert f"'{prefix}' is a folder" in message and f"{prefix}.en and {prefix}.es.gz" in message
    assert "move or rename the folder" in message
    assert ("to use the saved dataset, rename the pairs" in message) == saved


def test_a_file_without_a_layout_in_the_way_of_a_pair_prefix_names_the_pair_files(tmp_path, capsys):
    prefix = write_sides(tmp_path / "train")
    prefix.write_text("a stray file\n")
    message = refused(tmp_path, capsys, train_file=str(prefix))
    assert f"also the prefix of the plain-text pairs {prefix}.en and {prefix}.es" in message
    assert f"move or rename '{prefix}'" in message


def test_a_saved_dataset_folder_without_pair_files_beside_it_still_loads(tmp_path):
    Dataset.from_dict({"translation": [{"en": en, "es": es} for en, es in CORPUS_PAIRS]}).save_to_disk(
        tmp_path / "train")
    (tmp_path / "train.en").write_text("one side alone is no pair prefix\n")
    assert loaded(tmp_path / "train") == CORPUS_PAIRS


# ------------------------------------------------------------------------------------------------------ /dev/null


@pytest.mark.parametrize("flag", ["train_file", "validation_file", "test_file"])
def test_dev_null_as_a_split_is_named_as_empty(tmp_path, capsys, flag):
    message = refused(tmp_path, capsys, **{flag: "/dev/null"})
    assert "'/dev/null' gave no text (an empty pipe or device" in message
    assert (f"leave --{flag} out" in message) == (flag != "train_file")


# ------------------------------------------------------------------------------------------- flat JSON paraphrases


def test_flat_json_lines_paraphrases_reach_the_training_data(tmp_path):
    from hf_scratch_transformer.training.augmentation import source_paraphrases
    from hf_scratch_transformer.data.tokenization import train_tokenizer_on_corpus

    records = [{"en": en, "es": es, "paraphrases": {"en": [f"{en} (again)"]}} for en, es in CORPUS_PAIRS[:6]]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
    corpus = load_parallel_corpus(DataArguments(train_file=str(path), validation_file=str(path), test_file=str(path)))
    assert corpus["train"]["paraphrases"] == [{"en": [f"{en} (again)"], "es": []} for en, _ in CORPUS_PAIRS[:6]]
    tokenizer = train_tokenizer_on_corpus(corpus["train"], "en", "es", vocab_size=300)
    found = source_paraphrases(corpus["train"], tokenizer, "en")
    assert sorted(sum(found.values(), [])) == sorted(f"{en} (again)" for en, _ in CORPUS_PAIRS[:6])


def test_a_streamed_corpus_says_how_it_reads_a_file_once(tmp_path, caplog):
    path = tmp_path / "train.tsv"
    path.write_text("es\ten\n" + "".join(f"{es}\t{en}\n" for en, es in CORPUS_PAIRS))
    with caplog.at_level(logging.INFO, logger="hf_scratch_transformer"):
        corpus = load_parallel_corpus(DataArguments(train_file=str(path), streaming=True))
        pairs = [(pair["translation"]["en"], pair["translation"]["es"]) for split in corpus.values() for pair in split]
    assert sorted(pairs) == sorted(CORPUS_PAIRS)
    assert sum("is a header naming the languages" in record.getMessage() for record in caplog.records) == 1


def test_a_saved_dataset_of_language_columns_keeps_its_paraphrases(tmp_path):
    rows = {"en": [en for en, _ in CORPUS_PAIRS], "es": [es for _, es in CORPUS_PAIRS],
            "paraphrases": [{"en": [f"{en} (again)"]} for en, _ in CORPUS_PAIRS], "id": list(range(len(CORPUS_PAIRS)))}
    Dataset.from_dict(rows).save_to_disk(tmp_path / "saved")
    corpus = load_parallel_corpus(DataArguments(train_file=str(tmp_path / "saved"),
                                                validation_file=str(tmp_path / "saved"),
                                                test_file=str(tmp_path / "saved")))
    assert sorted(corpus["train"].column_names) == ["paraphrases", "translation"]
    assert corpus["train"]["paraphrases"] == rows["paraphrases"]
