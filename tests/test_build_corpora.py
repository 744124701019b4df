"""The corpora built from gettext catalogs (`benchmarks/build_corpora.py`, rules in `benchmarks/gettext_pairs.py`):
the cleaning rules on synthetic catalogs written with polib, the split's guarantees, and a whole build from a .deb
made here with dpkg-deb: same bytes twice, and `--check` finds a text leaked across splits."""

import json
import shutil
import subprocess

import polib
import pytest
from build_corpora import CorpusSpec, Source, build_corpus, check_corpus, main, write_corpus
from gettext_pairs import (
    FREECIV_CONTEXT,
    WESNOTH_CONTEXT,
    Harvest,
    capped,
    chosen_pairs,
    harvest_catalog,
    near_duplicate_key,
    placeholder_signature,
    placeholders,
    split_records,
)

SPANISH_PLURALS = "nplurals=2; plural=(n != 1);"
RUSSIAN_PLURALS = ("nplurals=3; plural=(n%10==1 && n%100!=11 ? 0 : n%10>=2 && n%10<=4 && (n%100<10 || n%100>=20) "
                   "? 1 : 2);")


def catalog(entries: list[dict], plural_forms: str = SPANISH_PLURALS) -> polib.POFile:
    po = polib.POFile()
    po.metadata = {"Content-Type": "text/plain; charset=UTF-8", "Plural-Forms": plural_forms}
    for entry in entries:
        po.append(polib.POEntry(**entry))
    return po


def as_mo(po: polib.POFile, tmp_path) -> polib.MOFile:
    """The catalog compiled to a .mo file and read back from its bytes, as the build reads a package's catalogs."""
    path = tmp_path / "catalog.mo"
    po.save_as_mofile(str(path))
    return polib.mofile(path.read_bytes())


def harvested(*catalogs, context_prefix=None) -> tuple[dict, dict]:
    harvest = Harvest()
    for number, parsed in enumerate(catalogs):
        harvest_catalog(parsed, f"pkg/catalog{number}", harvest, context_prefix)
    pairs = {record["source"]: record["target"] for record in chosen_pairs(harvest)}
    return pairs, {reason: count for reason, count in harvest.dropped.items() if count}


def test_placeholders_of_every_style_are_found_and_an_escaped_or_spaced_percent_is_none():
    text = "%s of %2$d, %(name)s, %1, {0} {name} {count:>3}, $unit.name| costs 100%% or 50% done, %-5.2lf"
    assert placeholders(text) == ["%s", "%2$d", "%(name)s", "%1", "{0}", "{name}", "{count:>3}", "$unit.name|",
                                  "%-5.2lf"]
    assert placeholder_signature("%2$s de %1$s") == placeholder_signature("%s of %s")  # reordered by position
    assert placeholder_signature("%i files") == placeholder_signature("%d archivos")
    assert placeholder_signature("%1 of %2") != placeholder_signature("%1 de %1")


def test_a_mo_catalog_yields_the_documented_pairs_and_counts_every_dropped_entry(tmp_path):
    po = catalog([
        {"msgid": "Open file", "msgstr": "Abrir archivo"},
        {"msgid": "%d file", "msgid_plural": "%d files", "msgstr_plural": {0: "%d archivo", 1: "%d archivos"}},
        {"msgid": "  _Open\n", "msgstr": "  _Abrir\n"},  # stripped; the accelerator kept
        {"msgid": "Usage: x\nOptions:", "msgstr": "Uso: x\nOpciones:"},  # an inner newline kept
        {"msgid": "translator-credits", "msgstr": "Juan"},
        {"msgid": "Your names", "msgstr": "Juan", "msgctxt": "NAME OF TRANSLATORS"},
        {"msgid": "Save", "msgstr": ""},
        {"msgid": "%s: %s", "msgstr": "%s : %s"},  # letters only inside placeholders
        {"msgid": "Bluetooth", "msgstr": "Bluetooth"},
        {"msgid": "Copied %s to %s", "msgstr": "Copiado %s"},
    ])
    pairs, dropped = harvested(as_mo(po, tmp_path))
    assert pairs == {"Open file": "Abrir archivo", "%d file": "%d archivo", "%d files": "%d archivos",
                     "_Open": "_Abrir", "Usage: x\nOptions:": "Uso: x\nOpciones:"}
    assert dropped == {"credits": 2, "no_words": 1, "identical": 1, "placeholder_mismatch": 1}
    assert "Save" not in pairs  # polib leaves an empty translation out of the .mo: it is never seen


def test_a_po_catalog_skips_fuzzy_and_counts_empty_translations_and_three_plural_forms_give_the_singular_only():
    po = catalog([
        {"msgid": "Quit", "msgstr": "Выйти", "flags": ["fuzzy"]},
        {"msgid": "Save", "msgstr": ""},
        {"msgid": "%d file", "msgid_plural": "%d files",
         "msgstr_plural": {0: "%d файл", 1: "%d файла", 2: "%d файлов"}},
    ], RUSSIAN_PLURALS)
    pairs, dropped = harvested(polib.pofile(str(po)))
    assert pairs == {"%d file": "%d файл"}
    assert dropped == {"untranslated": 1}


def test_a_context_written_into_the_msgid_leaves_both_sides():
    wesnoth = catalog([
        {"msgid": "female^Elvish Fighter", "msgstr": "Эльфийка-воин"},
        {"msgid": "teamname^Statues", "msgstr": "teamname^Статуи"},  # the translator copied the context
        {"msgid": "editor^The overlay '^Uf' is deprecated.", "msgstr": "Покрытие '^Uf' устарело."},
    ], RUSSIAN_PLURALS)
    assert harvested(wesnoth, context_prefix=WESNOTH_CONTEXT)[0] == {
        "Elvish Fighter": "Эльфийка-воин", "Statues": "Статуи",
        "The overlay '^Uf' is deprecated.": "Покрытие '^Uf' устарело."}  # only the first caret is the context's
    freeciv = catalog([{"msgid": "?plural:Hungarians", "msgstr": "?plural:Ουγγαροί"}])
    assert harvested(freeciv, context_prefix=FREECIV_CONTEXT)[0] == {"Hungarians": "Ουγγαροί"}
    assert harvested(freeciv)[0] == {"?plural:Hungarians": "?plural:Ουγγαροί"}  # only where the program says so


def test_one_translation_per_text_the_one_most_catalogs_give():
    first, second, third = (catalog([{"msgid": "Open", "msgstr": text}]) for text in ("Abrir", "Abre", "Abrir"))
    harvest = Harvest()
    for number, parsed in enumerate((first, second, third)):
        harvest_catalog(parsed, f"pkg/catalog{number}", harvest)
    assert chosen_pairs(harvest) == [{"source": "Open", "target": "Abrir", "origins": ["pkg/catalog0", "pkg/catalog2"]}]
    assert harvest.dropped["alternative_translation"] == 1


def synthetic_records(count: int) -> list[dict]:
    """`count` texts, each in three near-duplicate variants (case, placeholder names, accelerator, punctuation)."""
    records = []
    for number in range(count):
        for variant in (f"Open %s report {number}", f"open %d report {number}…", f"_Open %(name)s Report {number}:"):
            records.append({"source": variant, "target": f"es {variant}", "origins": ["pkg/catalog"]})
    return records


def test_near_duplicates_land_in_one_split_and_no_key_is_in_two():
    assert len({near_duplicate_key(r["source"]) for r in synthetic_records(1)}) == 1
    records = synthetic_records(2000)
    splits = split_records(records, validation_permille=30, test_permille=40)
    keys = {split: {near_duplicate_key(r["source"]) for r in rows} for split, rows in splits.items()}
    assert not (keys["train"] & keys["test"] or keys["train"] & keys["validation"] or keys["test"] & keys["validation"])
    assert sum(len(rows) for rows in splits.values()) == len(records)
    assert all(len(rows) % 3 == 0 for rows in splits.values())  # whole groups of three
    assert 0.02 < len(splits["test"]) / len(records) < 0.06 and 0.015 < len(splits["validation"]) / len(records) < 0.05
    assert split_records(list(reversed(records)), 30, 40) == splits  # the input order does not matter


def test_the_cap_keeps_whole_groups_and_stays_under_it():
    sample = capped(synthetic_records(500), 1000)
    assert 990 <= len(sample) <= 1000 and len(sample) % 3 == 0
    assert capped(synthetic_records(500), None) == synthetic_records(500)


# ---------------------------------------------------------------------------------------- a build from a .deb
@pytest.fixture
def fake_package(tmp_path):
    """A download directory holding `fakeui_1.0_all.deb`, with a Spanish catalog of 60 messages and a
    machine-readable copyright file."""
    if shutil.which("dpkg-deb") is None:
        pytest.skip("needs Debian's dpkg-deb")
    root = tmp_path / "root"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text("Package: fakeui\nVersion: 1.0\nArchitecture: all\nMaintainer: x <x@x>\n"
                                             "Description: test\n")
    locale = root / "usr/share/locale/es/LC_MESSAGES"
    locale.mkdir(parents=True)
    entries = [{"msgid": f"Cannot open file number {n}: %s", "msgstr": f"No se puede abrir el fichero {n}: %s"}
               for n in range(60)]
    catalog(entries).save_as_mofile(str(locale / "fakeui.mo"))
    (root / "usr/share/doc/fakeui").mkdir(parents=True)
    (root / "usr/share/doc/fakeui/copyright").write_text("Format: https://x\n\nFiles: *\nLicense: GPL-3+\n")
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(downloads / "fakeui_1.0_all.deb")],
                   check=True, capture_output=True)
    return downloads


SPEC = CorpusSpec("fake_en_es", "es", "A test corpus.", (Source("fakeui", "1.0"),), validation_permille=200,
                  test_permille=200)


def test_a_build_writes_the_same_bytes_twice_and_passes_its_check(fake_package, tmp_path):
    for output in ("first", "second"):
        write_corpus(tmp_path / output, *build_corpus(SPEC, fake_package))
    names = ("train.jsonl", "validation.jsonl", "test.jsonl", "manifest.json", "README.md")
    assert all((tmp_path / "first" / n).read_bytes() == (tmp_path / "second" / n).read_bytes() for n in names)
    manifest = json.loads((tmp_path / "first" / "manifest.json").read_text())
    assert sum(split["pairs"] for split in manifest["splits"].values()) == 60
    assert min(split["pairs"] for split in manifest["splits"].values()) > 0
    assert manifest["sources"][0]["licences"] == ["GPL-3+"]
    assert manifest["splits"]["test"]["with_placeholder"] == manifest["splits"]["test"]["pairs"]
    first_line = json.loads((tmp_path / "first" / "test.jsonl").read_text().splitlines()[0])
    assert set(first_line["translation"]) == {"en", "es"} and first_line["origins"] == ["fakeui/fakeui"]
    assert check_corpus(tmp_path / "first") == []


def test_the_check_finds_a_test_text_leaked_into_train(fake_package, tmp_path):
    directory = tmp_path / "corpus"
    splits, manifest = build_corpus(SPEC, fake_package)
    leaked = dict(splits["test"][0], source=splits["test"][0]["source"].replace("Cannot", "cannot"))  # other case
    splits["train"].append(leaked)
    manifest["splits"]["train"]["pairs"] += 1
    write_corpus(directory, splits, manifest)
    problems = check_corpus(directory)
    assert len(problems) == 1 and "in both train and test" in problems[0], problems
    (directory / "validation.jsonl").write_text("not json\n")
    assert any("changed after the build" in problem for problem in check_corpus(directory))


def test_the_command_line_check_fails_on_a_missing_corpus_and_refuses_an_unknown_name(tmp_path, capsys):
    assert main(["games_en_ru", "--check", "--output_dir", str(tmp_path)]) == 1
    assert "manifest.json is missing: build the corpus first" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["bible_en_xx"])
    assert exit_info.value.code == 2


def test_the_recipe_sweep_reads_corpora_where_they_are_built():
    """`recipe_sweep.py games_en_ru ...` looks a corpus name up where build_corpora.py writes it by default (it looked
    in work/corpora at the repository's root, where nothing is built)."""
    import build_corpora
    import recipe_sweep

    assert recipe_sweep.CORPORA == build_corpora.DEFAULT_OUTPUT_DIR


def test_the_recipe_sweep_gives_train_py_the_variants_flags_and_train_flags(tmp_path):
    """`--train_flags` reach train.py after the variant's (a GPU run gets `--bf16 true`, the CPU recipe's precision)
    and are recorded in the row: here a tiny model, which the run's config.json shows."""
    import argparse

    import recipe_sweep

    corpus = tmp_path / "tiny_en_es"
    corpus.mkdir()
    pairs = [{"translation": {"en": f"open the file number {i}", "es": f"abre el archivo número {i}"}}
             for i in range(60)]
    for split in ("train", "validation", "test"):
        (corpus / f"{split}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (corpus / "manifest.json").write_text(json.dumps({"languages": {"source": "en", "target": "es"}}))
    args = argparse.Namespace(
        seed=42, cpu_threads=1, step_budget=4, note="test", output_root=tmp_path / "runs", record_only=False,
        commit="test", train_flags="--preset tiny --tokenizer_vocab_size 300 --max_eval_samples 4 "
                                   "--max_predict_samples 2 --num_beams 1 --eval_max_new_tokens 4 --bf16 false")
    row = recipe_sweep.run(corpus, "steps1", args)
    assert row["flags"].startswith("--max_steps 4 --max_tokens 1024 ") and row["flags"].endswith(args.train_flags)
    assert row["train_steps"] == 4 and row["corpus"] == "tiny_en_es"
    # the batch it trained on and its tokens, read from the run (a variant compares at equal tokens only if they match)
    train = json.loads((tmp_path / "runs" / "tiny_en_es-steps1" / "train_results.json").read_text())
    assert row["batch_tokens"] == 1024 and row["train_tokens"] == train["train_tokens"] > 0
    config = json.loads((tmp_path / "runs" / "tiny_en_es-steps1" / "config.json").read_text())
    assert config["d_model"] == 64  # the tiny preset of --train_flags, not train.py's default small
