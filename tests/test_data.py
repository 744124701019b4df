import csv
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict, IterableDataset
from helpers import CORPUS_PAIRS, fails_with, pair_records, saved_files, tiny_run_flags, write_jsonl
from transformers import DataCollatorForSeq2Seq

from hf_scratch_transformer.training.arguments import check_values, parse_arguments
from hf_scratch_transformer.data import loading
from hf_scratch_transformer.data.loading import CORPUS_DIR, CorpusError, DataArguments, load_parallel_corpus
from hf_scratch_transformer.protected_spans import SpanProtector
from hf_scratch_transformer.data.preprocessing import (
    evaluation_pairs,
    make_collator,
    mask_shared_spans,
    preprocess_corpus,
    sequence_lengths,
)
from hf_scratch_transformer.training.run_directory import check_output_dir
from hf_scratch_transformer.data.tokenization import train_tokenizer_on_corpus

DATA_CARD = CORPUS_DIR / "README.md"
PAIRS = [
    {"en": "In the beginning God created the heavens.", "es": "En el principio creó Dios los cielos."},
    {"en": "Jesus wept.", "es": "Y lloró Jesús."},
    {"en": "God saw the light.", "es": "Y vio Dios la luz."},
    {"en": "There was evening.", "es": "Y fue la tarde."},
]


def card_counts():
    """{split: (pairs, chapters)} as stated in the data card's table."""
    rows = re.findall(r"^\| (train|validation|test) \| `[^`]+` \| (\d+) \| (\d+) \|$", DATA_CARD.read_text(), re.M)
    return {split: (int(pairs), int(chapters)) for split, pairs, chapters in rows}


# ------------------------------------------------------------------------------------------------- shipped corpus


def test_shipped_corpus_has_the_data_card_counts(shipped_corpus):
    counts = card_counts()
    assert set(counts) == {"train", "validation", "test"}
    for split, (pairs, chapters) in counts.items():
        assert shipped_corpus[split].num_rows == pairs
        assert len(set(zip(shipped_corpus[split]["book"], shipped_corpus[split]["chapter"]))) == chapters


def test_no_chapter_is_in_two_splits(shipped_corpus):
    chapters = {split: set(zip(ds["book"], ds["chapter"])) for split, ds in shipped_corpus.items()}
    assert not chapters["train"] & chapters["validation"]
    assert not chapters["train"] & chapters["test"]
    assert not chapters["validation"] & chapters["test"]


@pytest.mark.parametrize(
    "split, book, chapter, verse, en, es, king_james",
    [
        ("test", "Genesis", 1, 1, "In the beginning, God created the heavens and the earth.",
         "EN el principio crió Dios los cielos y la tierra.", "In the beginning God created the heaven and the earth."),
        ("train", "John", 3, 16, "For God so loved the world, that he gave his only born Son",
         "Porque de tal manera amó Dios al mundo, que ha dado á su Hijo unigénito",
         "For God so loved the world, that he gave his only begotten Son"),
        ("train", "John", 11, 35, "Jesus wept.", "Y lloró Jesús.", "Jesus wept."),
        ("validation", "Genesis", 21, 1, "Yahweh visited Sarah as he had said",
         "Y VISITÓ Jehová á Sara, como había dicho", "And the LORD visited Sarah as he had said"),
    ],
)
def test_pairs_are_aligned(shipped_corpus, split, book, chapter, verse, en, es, king_james):
    matches = shipped_corpus[split].filter(
        lambda ex: (ex["book"], ex["chapter"], ex["verse"]) == (book, chapter, verse)
    )
    assert matches.num_rows == 1
    pair = matches[0]["translation"]
    assert pair["en"].startswith(en) and pair["es"].startswith(es)
    assert list(matches[0]["paraphrases"]) == ["en"] and len(matches[0]["paraphrases"]["en"]) == 1
    assert matches[0]["paraphrases"]["en"][0].startswith(king_james)


def test_markup_is_cleaned(shipped_corpus):
    texts = [t for pair in shipped_corpus["validation"]["translation"] for t in pair.values()]
    texts += [t for paraphrases in shipped_corpus["validation"]["paraphrases"] for t in paraphrases["en"]]
    assert not any(re.search(r"[<>¶]|&\w+;|\s{2}|^\s|\s$", text) for text in texts)


def test_shipped_corpus_streams():
    streamed = load_parallel_corpus(DataArguments(streaming=True))
    assert isinstance(streamed["train"], IterableDataset)
    first = next(iter(streamed["test"]))
    assert first["translation"]["en"].startswith("In the beginning")


# ---------------------------------------------------------------------------------------------------- local files


def write_pairs(path: Path, pairs=PAIRS) -> str:
    if path.suffix == ".json":
        path.write_text(json.dumps([{"translation": pair} for pair in pairs]))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({"translation": pair}) + "\n" for pair in pairs))
    else:
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["en", "es"], delimiter="\t" if path.suffix == ".tsv" else ",")
            writer.writeheader()
            writer.writerows(pairs)
    return str(path)


@pytest.mark.parametrize("extension", [".json", ".jsonl", ".csv", ".tsv"])
def test_local_files_load_in_every_format(tmp_path, extension):
    args = DataArguments(
        train_file=write_pairs(tmp_path / f"train{extension}", PAIRS * 10),
        validation_file=write_pairs(tmp_path / f"valid{extension}"),
        test_file=write_pairs(tmp_path / f"test{extension}"),
    )
    corpus = load_parallel_corpus(args)
    assert {split: ds.num_rows for split, ds in corpus.items()} == {"train": 40, "validation": 4, "test": 4}
    assert corpus["validation"][1]["translation"] == PAIRS[1]


def test_missing_splits_are_carved_deterministically_from_train(tmp_path):
    pairs = [{"en": f"sentence {i}", "es": f"frase {i}"} for i in range(200)]
    args = DataArguments(train_file=write_pairs(tmp_path / "train.jsonl", pairs), validation_split_percentage=10)
    corpus = load_parallel_corpus(args, seed=1)
    assert {split: ds.num_rows for split, ds in corpus.items()} == {"train": 162, "validation": 20, "test": 18}
    all_pairs = [p["en"] for ds in corpus.values() for p in ds["translation"]]
    assert sorted(all_pairs) == sorted(p["en"] for p in pairs)
    assert load_parallel_corpus(args, seed=1)["validation"]["translation"] == corpus["validation"]["translation"]


def test_streamed_local_file_is_carved_without_overlap(tmp_path):
    pairs = [{"en": f"sentence {i}", "es": f"frase {i}"} for i in range(100)]
    args = DataArguments(train_file=write_pairs(tmp_path / "train.jsonl", pairs), streaming=True)
    corpus = load_parallel_corpus(args)
    seen = {split: [ex["translation"]["en"] for ex in ds] for split, ds in corpus.items()}
    assert (len(seen["validation"]), len(seen["test"]), len(seen["train"])) == (5, 5, 90)
    assert sorted(sum(seen.values(), [])) == sorted(p["en"] for p in pairs)


def test_sample_limits_apply(shipped_corpus):
    corpus = load_parallel_corpus(DataArguments(max_train_samples=7, max_eval_samples=5, max_predict_samples=3))
    assert {split: ds.num_rows for split, ds in corpus.items()} == {"train": 7, "validation": 5, "test": 3}


def test_wrong_language_key_lists_the_keys_present(tmp_path):
    args = DataArguments(train_file=write_pairs(tmp_path / "train.jsonl", PAIRS * 10), target_lang="fr")
    with pytest.raises(KeyError, match=r"\['fr'\].*\['en', 'es'\]"):
        load_parallel_corpus(args)


def test_wrong_language_column_in_csv_lists_the_columns(tmp_path):
    args = DataArguments(train_file=write_pairs(tmp_path / "train.csv", PAIRS * 10), source_lang="de")
    with pytest.raises(KeyError, match=r"\['de'\].*\['en', 'es'\]"):
        load_parallel_corpus(args)


def test_empty_file_is_rejected(tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_parallel_corpus(DataArguments(train_file=str(tmp_path / "train.jsonl")))


def test_header_only_csv_is_rejected(tmp_path):
    (tmp_path / "train.csv").write_text("en,es\n")
    with pytest.raises(ValueError, match="no examples"):
        load_parallel_corpus(DataArguments(train_file=str(tmp_path / "train.csv")))


def test_missing_file_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_parallel_corpus(DataArguments(train_file=str(tmp_path / "nope.jsonl")))


def test_unknown_extension_is_rejected(tmp_path):
    (tmp_path / "train.txt").write_text("hello\n")
    with pytest.raises(ValueError, match="extension"):
        load_parallel_corpus(DataArguments(train_file=str(tmp_path / "train.txt")))


def test_unreachable_hub_names_the_dataset_and_suggests_files(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wmt16' on the Hub")

    monkeypatch.setattr(loading, "load_dataset", offline)
    with pytest.raises(ConnectionError, match=r"'wmt16'.*--train_file"):
        load_parallel_corpus(DataArguments(dataset_name="wmt16", dataset_config_name="ro-en"))


def test_hub_style_dataset_with_dev_split_is_accepted(monkeypatch):
    rows = {"translation": [{"ro": "Bună", "en": "Hello"}] * 4}
    hub = DatasetDict({split: Dataset.from_dict(rows) for split in ("train", "dev", "test")})
    monkeypatch.setattr(loading, "load_dataset", lambda *args, **kwargs: hub)
    corpus = load_parallel_corpus(DataArguments(dataset_name="wmt16", source_lang="ro", target_lang="en"))
    assert sorted(corpus) == ["test", "train", "validation"]


# ------------------------------------------------------------------- users' corpora: plain text, TSV, CSV, saved sets

QUOTED = [("\"Hello,\" he said.", "\"Hallo\", sagte er."), ("It's \"fine", "Es ist \"gut"), ("Tab-free, 'single'", "x")]


def write_plain_pairs(prefix: Path, pairs, source="en", target="es", line_end="\n", compress=()) -> str:
    """PREFIX.source + PREFIX.target, one sentence per line; the languages in `compress` are gzip-compressed."""
    import gzip

    for index, lang in enumerate((source, target)):
        text = "".join(pair[index] + line_end for pair in pairs).encode("utf-8")
        path = Path(f"{prefix}.{lang}")
        if lang in compress:
            Path(f"{path}.gz").write_bytes(gzip.compress(text))
        else:
            path.write_bytes(text)
    return str(prefix)


def loaded_pairs(dataset) -> list[tuple[str, str]]:
    return [(pair["en"], pair["es"]) for pair in dataset["translation"]]


@pytest.mark.parametrize("compress", [(), ("en",), ("en", "es")])
def test_plain_text_pairs_load_from_a_prefix(tmp_path, compress):
    pairs = [(f"sentence {i}", f"frase {i}") for i in range(30)]
    args = DataArguments(train_file=write_plain_pairs(tmp_path / "train", pairs, compress=compress),
                         validation_file=write_plain_pairs(tmp_path / "dev", pairs[:3]),
                         test_file=write_plain_pairs(tmp_path / "test", pairs[3:5]))
    corpus = load_parallel_corpus(args)
    assert loaded_pairs(corpus["train"]) == pairs
    assert loaded_pairs(corpus["validation"]) == pairs[:3] and loaded_pairs(corpus["test"]) == pairs[3:5]


def test_plain_text_pairs_stream(tmp_path):
    pairs = [(f"sentence {i}", f"frase {i}") for i in range(40)]
    corpus = load_parallel_corpus(DataArguments(train_file=write_plain_pairs(tmp_path / "train", pairs),
                                                streaming=True))
    assert isinstance(corpus["train"], IterableDataset)
    seen = {split: [(ex["translation"]["en"], ex["translation"]["es"]) for ex in ds] for split, ds in corpus.items()}
    assert (len(seen["validation"]), len(seen["test"]), len(seen["train"])) == (2, 2, 36)
    assert sorted(sum(seen.values(), [])) == sorted(pairs)


def test_plain_text_pairs_with_different_line_counts_name_both_files_and_counts(tmp_path):
    prefix = write_plain_pairs(tmp_path / "train", [("a", "b")] * 5)
    Path(f"{prefix}.es").write_text("b\n" * 4)
    for streaming in (False, True):
        with pytest.raises(CorpusError) as error:
            load_parallel_corpus(DataArguments(train_file=prefix, streaming=streaming))
        message = str(error.value)
        assert f"{prefix}.en has 5 lines but {prefix}.es has 4" in message, message


def test_crlf_bom_and_surrounding_whitespace_are_removed(tmp_path):
    prefix = tmp_path / "train"
    (tmp_path / "train.en").write_bytes("\ufeffHello.  \r\n\tJesus wept. \r\n".encode())
    (tmp_path / "train.es").write_bytes("\ufeffHola.\r\nY lloró Jesús.\r\n".encode())
    corpus = load_parallel_corpus(DataArguments(train_file=str(prefix), validation_file=str(prefix),
                                                test_file=str(prefix)))
    assert loaded_pairs(corpus["train"]) == [("Hello.", "Hola."), ("Jesus wept.", "Y lloró Jesús.")]


def test_only_newline_ends_a_line(tmp_path):
    """U+2028, U+0085, form feed and a lone CR stay inside their sentence: splitting there would misalign the two
    sides."""
    inside = ["one\u2028two", "three\x85four", "five\x0csix", "seven\rcarriage"]
    pairs = [(text, f"es {i}") for i, text in enumerate(inside)]
    prefix = write_plain_pairs(tmp_path / "train", pairs)
    corpus = load_parallel_corpus(DataArguments(train_file=prefix, validation_file=prefix, test_file=prefix))
    assert loaded_pairs(corpus["train"]) == pairs


def test_tsv_keeps_quotes_as_characters(tmp_path):
    (tmp_path / "train.tsv").write_text("".join(f"{en}\t{es}\n" for en, es in QUOTED * 3))
    corpus = load_parallel_corpus(DataArguments(train_file=str(tmp_path / "train.tsv"),
                                                validation_file=str(tmp_path / "train.tsv"),
                                                test_file=str(tmp_path / "train.tsv")))
    assert loaded_pairs(corpus["validation"]) == QUOTED * 3  # the unbalanced quote did not merge two columns


def test_tsv_header_naming_the_languages_is_skipped_and_gives_the_column_order(tmp_path):
    (tmp_path / "es_en.tsv").write_text("es\ten\nHola.\tHello.\nAdiós.\tBye.\n")
    corpus = load_parallel_corpus(DataArguments(train_file=str(tmp_path / "es_en.tsv"),
                                                validation_file=str(tmp_path / "es_en.tsv"),
                                                test_file=str(tmp_path / "es_en.tsv")))
    assert loaded_pairs(corpus["train"]) == [("Hello.", "Hola."), ("Bye.", "Adiós.")]


def test_tsv_line_without_two_columns_is_named(tmp_path):
    (tmp_path / "train.tsv").write_text("a\tb\nc\td\te\n")
    with pytest.raises(CorpusError, match=r"train.tsv', line 2: 3 tab-separated fields"):
        load_parallel_corpus(DataArguments(train_file=str(tmp_path / "train.tsv")))


def test_csv_quoting_round_trips_quotes_and_commas(tmp_path):
    with open(tmp_path / "train.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["es", "en"])  # columns named, in any order
        writer.writerows([(es, en) for en, es in QUOTED * 3])
    path = str(tmp_path / "train.csv")
    corpus = load_parallel_corpus(DataArguments(train_file=path, validation_file=path, test_file=path))
    assert loaded_pairs(corpus["test"]) == QUOTED * 3


@pytest.mark.parametrize("bad_line", ['"Hallo", sagte er.,"Hello," he said.', 'Bye,"unclosed'])
def test_csv_with_broken_quoting_is_refused_not_mangled(tmp_path, bad_line):
    (tmp_path / "train.csv").write_text(f"de,en\nJa,Yes\n{bad_line}\nNein,No\n")
    with pytest.raises(CorpusError, match=r"train.csv', line 3: not valid CSV.*\.tsv"):
        load_parallel_corpus(DataArguments(train_file=str(tmp_path / "train.csv"), source_lang="de", target_lang="en"))


@pytest.mark.parametrize("compression", ["gzip", "xz", "bz2"])
def test_compression_is_recognised_from_the_content_not_the_name(tmp_path, compression):
    import bz2
    import gzip
    import lzma

    compress = {"gzip": gzip.compress, "xz": lzma.compress, "bz2": bz2.compress}[compression]
    text = "".join(json.dumps({"translation": pair}) + "\n" for pair in PAIRS * 10)
    (tmp_path / "train.jsonl").write_bytes(compress(text.encode()))  # named .jsonl, compressed inside
    corpus = load_parallel_corpus(DataArguments(train_file=str(tmp_path / "train.jsonl")))
    assert sum(len(split) for split in corpus.values()) == 40


def test_a_json_object_of_columns_is_read_and_unequal_columns_are_refused(tmp_path):
    columns = {"en": [f"sentence {i}" for i in range(40)], "es": [f"frase {i}" for i in range(40)],
               "id": list(range(40))}
    (tmp_path / "columns.json").write_text(json.dumps(columns))
    path = str(tmp_path / "columns.json")
    corpus = load_parallel_corpus(DataArguments(train_file=path, validation_file=path, test_file=path))
    assert loaded_pairs(corpus["test"]) == list(zip(columns["en"], columns["es"]))
    (tmp_path / "short.json").write_text(json.dumps({"en": ["a", "b"], "es": ["c"]}))
    with pytest.raises(CorpusError, match=r"columns of different lengths \{'en': 2, 'es': 1\}"):
        load_parallel_corpus(DataArguments(train_file=str(tmp_path / "short.json")))


def test_saved_datasets_are_accepted_wherever_a_corpus_is(tmp_path):
    rows = {"en": [f"sentence {i}" for i in range(40)], "es": [f"frase {i}" for i in range(40)]}
    DatasetDict({"train": Dataset.from_dict(rows), "dev": Dataset.from_dict(rows).select(range(4))}).save_to_disk(
        tmp_path / "dict")
    Dataset.from_dict({"translation": [{"en": "Hi.", "es": "Hola."}] * 3}).save_to_disk(tmp_path / "single")
    named = load_parallel_corpus(DataArguments(dataset_name=str(tmp_path / "dict")))
    assert len(named["validation"]) == 4 and named["train"][0]["translation"]["es"].startswith("frase")
    files = load_parallel_corpus(DataArguments(train_file=str(tmp_path / "dict"), test_file=str(tmp_path / "single"),
                                               validation_file=str(tmp_path / "dict")))
    assert (len(files["train"]), len(files["validation"]), len(files["test"])) == (40, 4, 3)
    streamed = load_parallel_corpus(DataArguments(dataset_name=str(tmp_path / "dict"), streaming=True))
    assert next(iter(streamed["validation"]))["translation"] == {"en": "sentence 0", "es": "frase 0"}


def test_a_json_corpus_is_read_once_and_then_served_from_the_cache_until_it_changes(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", pair_records())
    with files_opened(path) as opened:
        first = load_parallel_corpus(DataArguments(train_file=str(path), validation_file=str(path),
                                                   test_file=str(path)))
    assert len(opened) == 1  # one reading, not one per check (and the three splits share its cache)
    with files_opened(path) as opened:
        load_parallel_corpus(DataArguments(train_file=str(path)))
    assert opened == []  # the same file again: datasets' cache
    write_jsonl(path, pair_records()[:10])
    with files_opened(path) as opened:
        changed = load_parallel_corpus(DataArguments(train_file=str(path), validation_file=str(path),
                                                     test_file=str(path)))
    assert len(first["train"]) == len(CORPUS_PAIRS) and len(changed["train"]) == 10 and len(opened) == 1


class files_opened:  # noqa: N801
    """The opens of `path` (through Python's audit events) while the block runs."""

    watched: dict = {}
    hooked = False  # an audit hook cannot be removed: one for the session

    def __init__(self, path):
        self.path = str(path)

    def __enter__(self):
        import sys

        if not files_opened.hooked:
            sys.addaudithook(files_opened._hook)
            files_opened.hooked = True
        files_opened.watched[self.path] = []
        return files_opened.watched[self.path]

    def __exit__(self, *exc):
        files_opened.watched.pop(self.path)

    @staticmethod
    def _hook(event, args):
        if event == "open" and files_opened.watched and str(args[0]) in files_opened.watched:
            files_opened.watched[str(args[0])].append(args[1])


def test_carved_splits_are_announced_with_their_size(tmp_path, caplog):
    pairs = [{"en": f"sentence {i}", "es": f"frase {i}"} for i in range(200)]
    args = DataArguments(train_file=write_pairs(tmp_path / "train.jsonl", pairs), validation_split_percentage=10)
    with caplog.at_level("INFO", logger="hf_scratch_transformer"):
        load_parallel_corpus(args, seed=1)
    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("validation split: 20 pairs carved out of the training data (10%") for m in messages)
    assert any(m.startswith("test split: 18 pairs carved out of the training data") for m in messages)


def test_spanish_to_english_trains_on_english_labels(shipped_corpus, tmp_path):
    """The direction comes from the flags: with es→en the labels are the English side, and the tokenizer says so."""
    from transformers import AutoTokenizer

    from hf_scratch_transformer.data.tokenization import language_pair

    raw = DatasetDict({name: shipped_corpus[name].select(range(40)) for name in ("train", "validation", "test")})
    args = DataArguments(source_lang="es", target_lang="en")
    tokenizer = train_tokenizer_on_corpus(raw["train"], "es", "en", vocab_size=400)
    processed, _ = preprocess_corpus(raw, tokenizer, args)
    labels = tokenizer.batch_decode(processed["train"]["labels"][:3], skip_special_tokens=True)
    sources = tokenizer.batch_decode(processed["train"]["input_ids"][:3], skip_special_tokens=True)
    kept = [pair for pair in raw["train"]["translation"]][:3]
    assert labels == [pair["en"] for pair in kept] and sources == [pair["es"] for pair in kept]
    assert evaluation_pairs(raw["test"], args)[1][0].startswith("In the beginning")
    tokenizer.save_pretrained(tmp_path)
    assert language_pair(AutoTokenizer.from_pretrained(tmp_path)) == ("es", "en")


def test_giant_words_and_over_long_sides_are_dropped_before_tokenising_and_counted(tmp_path, corpus_tokenizer):
    from hf_scratch_transformer.data.tokenization import MAX_WORD_CHARS, _both_sides

    giant = "x" * (MAX_WORD_CHARS + 1)
    train = [{"en": "A good sentence.", "es": "Una buena frase."},
             {"en": f"see {giant}", "es": "mira"},  # one giant whitespace-free run
             {"en": "word " * 400, "es": "palabra"}]  # 2,000 characters: more than 16 per allowed token
    raw = DatasetDict({"train": Dataset.from_dict({"translation": train})})
    assert giant not in " ".join(_both_sides(raw["train"], "en", "es"))  # the tokenizer never trains on it
    _, report = preprocess_corpus(raw, corpus_tokenizer, DataArguments(max_source_length=100, max_target_length=100))
    assert report["train"] == {"input": 3, "empty": 0, "too_long": 2, "bad_ratio": 0, "kept": 1,
                               "masked": 0}


# -------------------------------------------------------------------------------------------------- preprocessing


def test_preprocessing_filters_train_and_reports_each_filter(corpus_tokenizer):
    train = [
        {"en": "A good sentence.", "es": "Una buena frase."},
        {"en": "", "es": "Vacía."},
        {"en": "Empty target.", "es": "   "},
        {"en": "word " * 40, "es": "palabra " * 40},
        {"en": "Yes.", "es": "Sí, así es, dijo el hombre a su hermano."},
        {"en": "Another good one.", "es": "Otra buena."},
    ]
    raw = DatasetDict({
        "train": Dataset.from_dict({"translation": train}),
        "validation": Dataset.from_dict({"translation": train}),
        "test": Dataset.from_dict({"translation": train[:1]}),
    })
    args = DataArguments(max_source_length=20, max_target_length=20, max_length_ratio=3.0)
    processed, report = preprocess_corpus(raw, corpus_tokenizer, args)
    assert report["train"] == {"input": 6, "empty": 2, "too_long": 1, "bad_ratio": 1, "kept": 2, "masked": 0}
    assert report["validation"] == {"input": 6, "empty": 2, "too_long": 0, "bad_ratio": 0, "kept": 4,
                                    "masked": 0}
    assert processed["train"].column_names == ["input_ids", "attention_mask", "labels"]
    decoded = corpus_tokenizer.batch_decode(list(processed["train"]["labels"]), skip_special_tokens=True)
    assert decoded == ["Una buena frase.", "Otra buena."]
    assert all(len(ids) <= 20 for ids in processed["validation"]["input_ids"])
    assert all(ids[-1] == corpus_tokenizer.eos_token_id for ids in processed["validation"]["labels"])
    sources, references = evaluation_pairs(raw["validation"], args)
    assert len(references) == processed["validation"].num_rows and references[1] == "palabra " * 40


# ------------------------------------------------------------------------------------ protected spans, masked
SOFTWARE_PAIRS = [
    ("Delete %d files in %s?", "¿Borrar %d archivos en %s?"),
    ("Open <b>%1$s</b> and %2$s", "Abrir %2$s y <b>%1$s</b>"),
    ("See https://example.org/help for {name}.", "Véase la ayuda para {name}."),  # the URL on one side only
    ("Plain text, no spans.", "Texto sin nada."),
]


@pytest.mark.parametrize("source, target, expected", [
    ("Delete %d files in %s?", "¿Borrar %d archivos en %s?", ("Delete ｟0｠ files in ｟1｠?",
                                                              "¿Borrar ｟0｠ archivos en ｟1｠?", 2)),
    ("Open <b>%1$s</b> and %2$s", "Abrir %2$s y <b>%1$s</b>",
     ("Open ｟0｠｟1｠｟2｠ and ｟3｠", "Abrir ｟3｠ y ｟0｠｟1｠｟2｠", 4)),
    ("See https://x.org for {name}.", "Véase {name}.", ("See https://x.org for ｟0｠.", "Véase ｟0｠.", 1)),
    ("%s of %s", "%s", ("｟0｠ of %s", "｟0｠", 1)),  # the k-th occurrence pairs with the k-th
    ("100%% of %d", "100 %% de %d", ("100｟0｠ of ｟1｠", "100 ｟0｠ de ｟1｠", 2)),
    ("a {x} b", "a {y} b", ("a {x} b", "a {y} b", 0)),  # different text: not shared
    ("no spans here", "ninguno", ("no spans here", "ninguno", 0)),
])
def test_only_the_spans_both_sides_share_are_masked_numbered_in_source_order(source, target, expected):
    assert mask_shared_spans(source, target, SpanProtector()) == expected


def test_at_most_as_many_spans_are_masked_as_there_are_sentinels():
    source = " ".join(f"{{f{i}}}" for i in range(40))
    masked_source, masked_target, count = mask_shared_spans(source, source, SpanProtector())
    assert count == 32 and masked_source == masked_target and "｟31｠ {f32}" in masked_source


def test_training_pairs_are_masked_before_tokenising_and_the_cache_knows_it(tmp_path):
    """With a tokenizer that has the sentinels, every split's token ids are those of the masked pairs (the
    validation loss measures the task trained); the raw sources and references evaluation translates stay as they
    are. --mask_protected_spans false afterwards is not served the masked cache."""
    path = write_jsonl(tmp_path / "software.jsonl", [{"translation": {"en": en, "es": es}}
                                                     for en, es in SOFTWARE_PAIRS * 3])
    args = DataArguments(train_file=str(path), validation_file=str(path), test_file=str(path))
    raw = load_parallel_corpus(args)
    tokenizer = train_tokenizer_on_corpus(raw["train"], "en", "es", vocab_size=300, sentinels=True)
    masked, report = preprocess_corpus(raw, tokenizer, args)
    plain, plain_report = preprocess_corpus(raw, tokenizer, replace(args, mask_protected_spans=False))
    expected = [mask_shared_spans(en, es, SpanProtector()) for en, es in SOFTWARE_PAIRS * 3]
    for split in ("train", "validation"):
        assert tokenizer.batch_decode(list(masked[split]["input_ids"]), skip_special_tokens=True) == \
            [source for source, _, _ in expected]
        assert tokenizer.batch_decode(list(masked[split]["labels"]), skip_special_tokens=True) == \
            [target for _, target, _ in expected]
        assert tokenizer.batch_decode(list(plain[split]["input_ids"]), skip_special_tokens=True) == \
            [en for en, _ in SOFTWARE_PAIRS * 3]
        assert report[split]["masked"] == 9 and plain_report[split]["masked"] == 0
        assert masked[split].column_names == ["input_ids", "attention_mask", "labels"]
    assert evaluation_pairs(raw["validation"], args)[0][0] == "Delete %d files in %s?"
    plain_tokenizer = train_tokenizer_on_corpus(raw["train"], "en", "es", vocab_size=300)
    assert preprocess_corpus(raw, plain_tokenizer, args)[1]["train"]["masked"] == 0  # no sentinels: no masking


def test_a_second_run_reuses_the_tokenised_cache_whatever_folder_the_tokenizer_comes_from(tmp_path):
    """`datasets` would hash the tokenizer object, whose loading folder (the run's output directory) differs between
    runs: the cache key is its content, so the second run finds the first run's files."""
    from transformers import AutoTokenizer

    path = write_jsonl(tmp_path / "pairs.jsonl", pair_records())
    args = DataArguments(train_file=str(path), validation_file=str(path), test_file=str(path))
    raw = load_parallel_corpus(args)
    tokenizer = train_tokenizer_on_corpus(raw["train"], "en", "es", vocab_size=300)
    files = {}
    for run in ("first", "second"):
        tokenizer.save_pretrained(tmp_path / run / ".tokenizer")
        processed, _ = preprocess_corpus(raw, AutoTokenizer.from_pretrained(tmp_path / run / ".tokenizer"), args)
        files[run] = {name: [entry["filename"] for entry in split.cache_files] for name, split in processed.items()}
    assert files["first"] == files["second"] and files["first"]["train"]


def test_sequence_lengths_follow_the_rows_of_a_filtered_and_selected_split():
    rows = {"input_ids": [[1] * (i % 7 + 1) for i in range(50)], "labels": [[2] * (i % 5 + 1) for i in range(50)]}
    dataset = Dataset.from_dict(rows).filter(lambda ids: len(ids) != 3, input_columns=["input_ids"]).select(
        [9, 0, 4, 30])
    sources, targets = sequence_lengths(dataset)
    assert sources.tolist() == [len(ids) for ids in dataset["input_ids"]]
    assert targets.tolist() == [len(ids) for ids in dataset["labels"]]


def test_shipped_glossary_verse_is_dropped_as_over_long(shipped_corpus, corpus_tokenizer):
    train = shipped_corpus["train"].filter(lambda ex: ex["book"] == "Revelation of John" and ex["chapter"] == 22)
    raw = DatasetDict({"train": train})
    _, report = preprocess_corpus(raw, corpus_tokenizer, DataArguments())
    assert report["train"]["too_long"] == 1


def test_collator_pads_labels_with_minus_100(corpus_tokenizer):
    features = [corpus_tokenizer("Jesus wept.", text_target="Y lloró Jesús."),
                corpus_tokenizer("In the beginning God created.", text_target="En el principio creó Dios.")]
    batch = make_collator(corpus_tokenizer)([dict(f) for f in features])
    assert isinstance(make_collator(corpus_tokenizer), DataCollatorForSeq2Seq)
    assert batch["labels"].shape[0] == 2 and (batch["labels"] == -100).any()
    assert (batch["input_ids"][batch["attention_mask"] == 0] == corpus_tokenizer.pad_token_id).all()
    assert "decoder_input_ids" not in batch


# ---------------------------------------------------------------------------------------------------- broken corpora


def _corpus_case(case, tmp_path):
    """(flags, expected message parts) of one broken corpus."""
    train = write_jsonl(tmp_path / "train.jsonl", pair_records())
    flags = {"train_file": str(train), "max_train_samples": None, "max_eval_samples": None, "max_predict_samples": None}
    if case == "missing_file":
        flags["train_file"] = str(tmp_path / "nope.jsonl")
        return flags, ["train file", "nope.jsonl", "does not exist"]
    if case == "empty_file":
        (tmp_path / "empty.jsonl").write_text("")
        flags["train_file"] = str(tmp_path / "empty.jsonl")
        return flags, ["empty.jsonl", "is empty"]
    if case == "not_utf8":
        (tmp_path / "latin1.jsonl").write_bytes(
            train.read_bytes() + '{"translation": {"en": "café", "es": "café"}}\n'.encode("latin-1"))
        flags["train_file"] = str(tmp_path / "latin1.jsonl")
        return flags, ["latin1.jsonl", "not UTF-8", f"line {len(CORPUS_PAIRS) + 1}", "iconv"]
    if case == "malformed_json":
        lines = train.read_text().splitlines()
        lines[2] = lines[2][:-5]
        (tmp_path / "broken.jsonl").write_text("\n".join(lines) + "\n")
        flags["train_file"] = str(tmp_path / "broken.jsonl")
        return flags, ["broken.jsonl", "not valid jsonl", "line 3"]
    if case == "language_missing":
        flags["target_lang"] = "fr"
        return flags, ["['fr'] not found", "keys present are ['en', 'es']", "--target_lang"]
    if case == "every_pair_filtered":
        flags.update(max_source_length=4, max_target_length=4)
        return flags, ["every training pair was filtered out", "'too_long': 20", "--max_source_length"]
    if case == "validation_without_pairs":
        empty_pairs = [{"translation": {"en": "", "es": " "}}, {"translation": {"en": None, "es": "Hola."}}]
        flags["validation_file"] = str(write_jsonl(tmp_path / "valid.jsonl", empty_pairs))
        flags["test_file"] = str(train)
        return flags, ["validation split has no usable pairs", "--validation_file"]
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing_file", "empty_file", "not_utf8", "malformed_json", "language_missing",
                                  "every_pair_filtered", "validation_without_pairs"])
def test_broken_corpus_stops_with_one_line_naming_the_problem(case, tmp_path, capsys):
    output_dir = tmp_path / "out"
    flags, expected = _corpus_case(case, tmp_path)
    message = fails_with(tiny_run_flags(output_dir, **flags), capsys)
    assert message.startswith("error: ")
    for part in expected:
        assert part in message, (part, message)
    assert saved_files(output_dir) == []  # no model, no checkpoint: nothing half-written
    # ... and the same command, corrected, is not refused because of what the failed run left behind.
    model_args, data_args, args = parse_arguments(tiny_run_flags(output_dir))
    check_values(model_args, data_args, args)
    check_output_dir(args)


def test_null_missing_and_empty_sentences_are_skipped_and_counted(tmp_path):
    records = pair_records() + [
        {"translation": {"en": "Hello.", "es": None}},  # null
        {"translation": {"en": "Hello."}},  # the target language missing from one record
        {"translation": {"en": "", "es": "Hola."}},  # empty
        {"translation": {"en": "   ", "es": "Hola."}},  # whitespace only
    ]
    path = write_jsonl(tmp_path / "train.jsonl", [records[-1]] + records[:-1])  # a broken record comes first
    args = DataArguments(train_file=str(path), validation_file=str(path), test_file=str(path))
    corpus = load_parallel_corpus(args)
    tokenizer = train_tokenizer_on_corpus(corpus["train"], "en", "es", vocab_size=300)  # nulls do not break it
    _, report = preprocess_corpus(corpus, tokenizer, args)
    assert report["train"] == {"input": len(CORPUS_PAIRS) + 4, "empty": 4, "too_long": 0, "bad_ratio": 0,
                               "kept": len(CORPUS_PAIRS), "masked": 0}
    assert report["validation"]["empty"] == 4 and report["validation"]["kept"] == len(CORPUS_PAIRS)


def test_corpus_errors_are_one_exception_family(tmp_path):
    """Library callers can catch CorpusError; the historical types (FileNotFoundError, KeyError) still match."""
    with pytest.raises(CorpusError) as missing:
        load_parallel_corpus(DataArguments(train_file=str(tmp_path / "nope.jsonl")))
    assert isinstance(missing.value, FileNotFoundError)
    write_jsonl(tmp_path / "t.jsonl", pair_records())
    with pytest.raises(CorpusError) as language:
        load_parallel_corpus(DataArguments(train_file=str(tmp_path / "t.jsonl"), source_lang="de"))
    assert isinstance(language.value, KeyError) and str(language.value).startswith("Language key(s) ['de']")
    with pytest.raises(CorpusError, match="only 1 pairs: too few to carve"):
        load_parallel_corpus(DataArguments(train_file=str(write_jsonl(tmp_path / "one.jsonl", pair_records()[:1]))))
