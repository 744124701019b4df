"""Rebuild the shipped English–Spanish Bible corpus in ``hf_scratch_transformer/corpus/``.

Sources (public domain): the Debian packages ``sword-text-web`` (World English Bible, SWORD module
``engWEB2015eb``) and ``sword-text-sparv`` (Reina-Valera 1909, module ``spaRV1909eb``), read with ``pysword``
(a dependency of this script only: ``pip install pysword``); ``sword-text-kjv`` (King James Version, 1769 text,
module ``engKJV2006eb``) gives each pair a paraphrase of its English side, in the record's ``paraphrases`` field.

Without ``--sword_dir`` the script downloads and unpacks the two packages itself into a temporary directory, i.e.::

    apt-get update && apt-get download sword-text-web sword-text-sparv sword-text-kjv
    for deb in sword-text-*.deb; do dpkg -x "$deb" root; done      # modules under root/usr/share/sword

Rules (the data card in ``corpus/README.md`` restates them): per verse, delete ``<note …>…</note>`` with its
content (replaced by a space), drop all other tags keeping their text, unescape HTML entities, delete the
paragraph sign ``¶``, collapse whitespace, strip, keep the pair only if both sides are non-empty. Books present in
both modules, in module order (Old then New Testament); verses 1 … min(chapter lengths). Chapters are numbered
0, 1, 2, … over those books: ``c % 40 == 0`` → test, ``c % 40 == 20`` → validation, every other chapter → train.
The paraphrase of a pair is the same reference in the King James module, cleaned by the same rules (a list of one,
or empty if that verse is empty there). Output gzip is written with mtime=0 so that a rebuild is byte-identical.
"""

import argparse
import glob
import gzip
import html
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

ENGLISH_MODULE = "engWEB2015eb"
SPANISH_MODULE = "spaRV1909eb"
PARAPHRASE_MODULES = {"en": "engKJV2006eb"}  # language -> module of another translation into it
DEBIAN_PACKAGES = ("sword-text-web", "sword-text-sparv", "sword-text-kjv")
DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parent.parent / "hf_scratch_transformer" / "corpus"
FILE_PREFIX = "bible_en_es"

NOTE_RE = re.compile(r"<note\b[^>]*>.*?</note>", re.DOTALL)
TAG_RE = re.compile(r"<[^>]+>")
WHITESPACE_RE = re.compile(r"\s+")


def clean_verse(markup: str) -> str:
    """Apply the cleaning rules to one verse of OSIS markup."""
    text = NOTE_RE.sub(" ", markup)
    text = TAG_RE.sub("", text)
    text = html.unescape(text).replace("\u00b6", " ")
    return WHITESPACE_RE.sub(" ", text).strip()


def split_for_chapter(chapter_index: int) -> str:
    """The split rule: every 40th chapter is test, the one 20 chapters later validation, the rest train."""
    if chapter_index % 40 == 0:
        return "test"
    if chapter_index % 40 == 20:
        return "validation"
    return "train"


def download_sword_modules(workdir: str) -> str:
    """``apt-get download`` the Debian packages into ``workdir``, unpack them, return the SWORD root."""
    subprocess.run(["apt-get", "download", *DEBIAN_PACKAGES], cwd=workdir, check=True)
    root = os.path.join(workdir, "root")
    for deb in sorted(glob.glob(os.path.join(workdir, "*.deb"))):
        subprocess.run(["dpkg", "-x", deb, root], check=True)
    return os.path.join(root, "usr", "share", "sword")


def build_records(sword_dir: str) -> dict[str, list[dict]]:
    """Read the modules and return the aligned records per split."""
    from pysword.modules import SwordModules

    modules = SwordModules(sword_dir)
    modules.parse_modules()
    english = modules.get_bible_from_module(ENGLISH_MODULE)
    spanish = modules.get_bible_from_module(SPANISH_MODULE)
    paraphrase_bibles = {lang: modules.get_bible_from_module(name) for lang, name in PARAPHRASE_MODULES.items()}
    spanish_books = {
        book.osis_name: book for books in spanish.get_structure().get_books().values() for book in books
    }
    english_books = [book for testament in ("ot", "nt") for book in english.get_structure().get_books()[testament]]
    shared_books = [book for book in english_books if book.osis_name in spanish_books]

    splits: dict[str, list[dict]] = {"train": [], "validation": [], "test": []}
    chapter_index = 0
    for en_book in shared_books:
        es_book = spanish_books[en_book.osis_name]
        for chapter in range(1, min(en_book.num_chapters, es_book.num_chapters) + 1):
            split = splits[split_for_chapter(chapter_index)]
            chapter_index += 1
            n_verses = min(en_book.chapter_lengths[chapter - 1], es_book.chapter_lengths[chapter - 1])
            for verse in range(1, n_verses + 1):
                ref = dict(books=[en_book.osis_name], chapters=[chapter], verses=[verse], clean=False)
                en_text = clean_verse(english.get(**ref))
                es_text = clean_verse(spanish.get(**ref))
                if en_text and es_text:
                    paraphrases = {lang: [text] if (text := clean_verse(bible.get(**ref))) else []
                                   for lang, bible in paraphrase_bibles.items()}
                    split.append(
                        {
                            "translation": {"en": en_text, "es": es_text},
                            "paraphrases": paraphrases,
                            "book": en_book.name,
                            "chapter": chapter,
                            "verse": verse,
                        }
                    )
    return splits


def write_jsonl_gz(records: list[dict], path: Path) -> None:
    """Write records as gzip-compressed JSON lines, reproducibly (mtime=0, no file name in the header)."""
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        for record in records:
            gz.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sword_dir", help="SWORD root holding mods.d/ and modules/ (default: download via apt)")
    parser.add_argument("--output_dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as workdir:
        sword_dir = args.sword_dir or download_sword_modules(workdir)
        splits = build_records(sword_dir)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for split, records in splits.items():
        path = args.output_dir / f"{FILE_PREFIX}.{split}.jsonl.gz"
        write_jsonl_gz(records, path)
        chapters = len({(r["book"], r["chapter"]) for r in records})
        print(f"{split}: {len(records)} pairs from {chapters} chapters -> {path}")


if __name__ == "__main__":
    main()
