"""Which sentence segmenter splits documents for translation: accuracy on hand-made tricky cases in English, Spanish
and German (abbreviations, decimal numbers, ellipses, quotes, verse references, placeholders), and speed on the
shipped test split (every chapter of it as one paragraph).

    python benchmarks/sentence_segmenters.py                 # all candidates that are installed
    python benchmarks/sentence_segmenters.py --output results/sentence_segmenters.md

Candidates (pip install sentencex pysbd sentence-splitter syntok nupunkt): sentencex (Wikimedia, Rust, ~300
languages), pysbd (rule-based, Golden Rules), sentence-splitter (the Moses / Europarl splitter of Koehn and
Schroeder), syntok (segtok v2; English, German, Spanish, Dutch rules, no language switch), nupunkt (Punkt trained
on English legal text; English only, so it gets the English model for every language). A case counts when the
segmenter's sentences, white space trimmed, are exactly the expected ones; boundary precision and recall count the
cut positions. Speed is the median of 3 runs, one thread, on a machine others may be using (the load is printed).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import time
from itertools import groupby
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_SPLIT = ROOT / "hf_scratch_transformer" / "corpus" / "bible_en_es.test.jsonl.gz"

CASES = {
    "en": [
        ["Mr. Smith went to Washington.", "He arrived at 3 p.m. on Monday."],
        ["The price rose 3.5 percent.", "Analysts were surprised."],
        ["I thought so...", "But I was wrong."],
        ['He said, "Stop."', "Then he left."],
        ["God said, “Let there be light.”", "There was light."],
        ["Read Gen. 1:1 and Matt. 5:3 today.", "They are short."],
        ["J. R. R. Tolkien wrote it.", "It is long."],
        ["Bring fruit, e.g. apples or pears.", "Nothing else."],
        ["Where are you?", "I am here!", "Good."],
        ["Dr. Brown lives on Baker St. near the park.", "Visit him."],
        ["Verse 4.2 follows chapter 3.", "Read on."],
        ["Write to info@example.com or see www.example.com for details.", "Thanks."],
        ["The U.S. economy grew.", "Prices fell."],
        ["It was late (about 11 p.m.).", "We slept."],
        ["Deleted %d files.", "Press {key} to continue."],
        ["In the beginning, God created the heavens and the earth."],
    ],
    "es": [
        ["El Sr. García llegó ayer.", "Trajo regalos."],
        ["Viajó a EE. UU. en mayo.", "Volvió en junio."],
        ["La inflación subió un 3.5 por ciento.", "Nadie lo esperaba."],
        ["¿Dónde estás?", "¡Aquí!", "Bien."],
        ["Lee Gén. 1:1 y Mt. 5:3 hoy.", "Son breves."],
        ["Dijo: «No temáis».", "Y se fueron."],
        ["Véase la pág. 12 del informe.", "Allí está todo."],
        ["Esperé un rato...", "Nadie vino."],
        ["Ud. tiene razón.", "Lo siento."],
        ["Costó 2.500 euros.", "Era caro."],
        ["Escribe a info@ejemplo.es o visita www.ejemplo.es para más información.", "Gracias."],
        ["Borrados %d archivos.", "Pulse {tecla} para continuar."],
        ["Nació en el s. XIX, aprox. en 1850.", "Murió joven."],
        ["Y dijo Dios: Sea la luz: y fué la luz."],
    ],
    "de": [
        ["Am 3. Oktober ist Feiertag.", "Dann ist frei."],
        ["Das ist z. B. ein Test.", "Er läuft."],
        ["Herr Dr. Müller kommt um 10 Uhr.", "Er ist pünktlich."],
        ["Es kostet 3,5 Mio. Euro.", "Das ist viel."],
        ["Siehe S. 12 bzw. Kap. 3 im Buch.", "Dort steht es."],
        ["Wo bist du?", "Hier!", "Gut."],
        ["Er sagte: „Komm her.“", "Sie kam."],
        ["Lies 1. Mose 1,1 heute.", "Es ist kurz."],
        ["Ich wartete...", "Niemand kam."],
        ["Die Firma XY GmbH & Co. KG wächst.", "Gut so."],
        ["Er wohnt in der Hauptstr. 5 in Berlin.", "Besuch ihn."],
        ["%d Dateien gelöscht.", "Drücke {key}, um fortzufahren."],
    ],
}


def candidates() -> dict:
    """{name: function(language, text) -> sentences} for every candidate that imports."""
    found = {}
    try:
        import sentencex

        found["sentencex"] = lambda language, text: list(sentencex.segment(language, text))
    except ImportError:
        pass
    try:
        import pysbd

        segmenters = {}

        def pysbd_split(language, text):
            if language not in segmenters:
                segmenters[language] = pysbd.Segmenter(language=language, clean=False)
            return segmenters[language].segment(text)

        found["pysbd"] = pysbd_split
    except ImportError:
        pass
    try:
        from sentence_splitter import SentenceSplitter

        splitters = {}

        def moses_split(language, text):
            if language not in splitters:
                splitters[language] = SentenceSplitter(language=language)
            return splitters[language].split(text)

        found["sentence-splitter"] = moses_split
    except ImportError:
        pass
    try:
        import syntok.segmenter

        def syntok_split(language, text):
            return ["".join(token.spacing + token.value for token in sentence)
                    for paragraph in syntok.segmenter.analyze(text) for sentence in paragraph]

        found["syntok"] = syntok_split
    except ImportError:
        pass
    try:
        import nupunkt

        found["nupunkt"] = lambda language, text: nupunkt.sent_tokenize(text)
    except ImportError:
        pass
    return found


def cut_positions(sentences: list[str]) -> set[int]:
    """Where sentences end, counted in non-space characters (so white space handling does not matter)."""
    positions, count = set(), 0
    for sentence in sentences[:-1]:
        count += len("".join(sentence.split()))
        positions.add(count)
    return positions


def accuracy(split, language: str) -> dict:
    exact, true_cuts, found_cuts, right_cuts, failures = 0, 0, 0, 0, []
    for expected in CASES[language]:
        got = [sentence.strip() for sentence in split(language, " ".join(expected)) if sentence.strip()]
        exact += got == expected
        if got != expected:
            failures.append(" | ".join(got))
        want, have = cut_positions(expected), cut_positions(got)
        true_cuts, found_cuts, right_cuts = true_cuts + len(want), found_cuts + len(have), right_cuts + len(want & have)
    return {"cases": len(CASES[language]), "exact": exact, "precision": right_cuts / max(found_cuts, 1),
            "recall": right_cuts / max(true_cuts, 1), "failures": failures}


def chapter_paragraphs(language: str) -> list[str]:
    """The test split as documents: the verses of each chapter joined into one paragraph."""
    with gzip.open(TEST_SPLIT, "rt", encoding="utf-8") as lines:
        records = [json.loads(line) for line in lines]
    return [" ".join(r["translation"][language] for r in verses)
            for _, verses in groupby(records, key=lambda r: (r["book"], r["chapter"]))]


def speed(split, language: str, repeats: int = 3) -> dict:
    paragraphs = chapter_paragraphs(language)
    characters = sum(map(len, paragraphs))
    split(language, paragraphs[0])  # warm-up (rule compilation)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        sentences = sum(len(split(language, paragraph)) for paragraph in paragraphs)
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    return {"paragraphs": len(paragraphs), "characters": characters, "sentences": sentences, "seconds": seconds,
            "kchars_per_second": characters / seconds / 1000}


def report(results: dict) -> str:
    lines = [f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start", "",
             "| segmenter | en exact | es exact | de exact | boundary precision | boundary recall | "
             "en test split, k chars/s |", "|---|---|---|---|---|---|---|"]
    for name, result in results.items():
        cells = [f"{result[lang]['exact']}/{result[lang]['cases']}" for lang in CASES]
        precision = statistics.mean(result[lang]["precision"] for lang in CASES)
        recall = statistics.mean(result[lang]["recall"] for lang in CASES)
        lines.append(f"| {name} | {' | '.join(cells)} | {precision:.2f} | {recall:.2f} | "
                     f"{result['speed']['kchars_per_second']:.0f} |")
    lines.append("")
    for name, result in results.items():
        for language in CASES:
            for failure in result[language]["failures"]:
                lines.append(f"- {name} ({language}) split: {failure}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help="also write the Markdown table to this file")
    args = parser.parse_args(argv)
    results = {}
    for name, split in candidates().items():
        results[name] = {language: accuracy(split, language) for language in CASES}
        results[name]["speed"] = speed(split, "en")
    text = report(results)
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
