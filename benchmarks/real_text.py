"""The measures of real text (issue 41) on a trained model: documents, software strings, a glossary, and what
sentence splitting costs. Each writes results/real_text_<measure>.json and .md, naming the machine and its load.

    python benchmarks/real_text.py documents --model outputs/scratch-small-en-es
    python benchmarks/real_text.py glossary --model outputs/scratch-small-en-es     # benchmarks/bible_glossary.tsv
    python benchmarks/real_text.py splitting --model outputs/scratch-small-en-es    # timing: run on an idle machine
    python benchmarks/real_text.py software --model outputs/ui-en-es --compare_model outputs/ui-en-es-plain \
        --test_file data/software_en_es/test.jsonl

documents: every chapter of the shipped test split as one paragraph (its verses joined by spaces), translated as a
document, against the same verses one per line (each verse one unit, as before documents were split, and each
verse split into its sentences, today's default). Pass: output words >= 0.9 x the reference's, and document BLEU
(the chapters as segments) within 1.0 of the line-by-line translation joined per chapter.
software: a test split of UI/CLI strings with placeholders (`--test_file` JSON lines with a `translation` field, as
`benchmarks/build_corpora.py software_en_es` writes them, or `--source` / `--target` one string per line); per
line with spans (printf, format, tags, URLs, e-mails), whether the translation holds the same multiset of them; BLEU
with the model's default protection (on for a model trained with masked spans), with protection on and off; how
the spans came back (placed by the model, aligned, ...). Masking on against off: train the same recipe twice,

    python train.py --train_file data/software_en_es/train.jsonl \
        --validation_file data/software_en_es/validation.jsonl --test_file data/software_en_es/test.jsonl \
        --output_dir outputs/ui-en-es
    python train.py ... --mask_protected_spans false --output_dir outputs/ui-en-es-plain

and give the second as `--compare_model`: both are measured the same way. Pass: 100 % of lines keep their multiset
with the model's default, and its BLEU is no lower than the compared model's (trained without masking) default.
glossary: the test split with and without the glossary: occurrences honoured (the target term in the translation)
and the BLEU change. Pass: >= 99 % honoured.
splitting: the CLI's work on the test split (one verse per line) with and without sentence splitting, alternated
ABAB; pass: splitting adds <= 5 %.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections import Counter
from itertools import groupby
from pathlib import Path

import common
import sacrebleu
import torch

from hf_scratch_transformer.glossary import read_glossary
from hf_scratch_transformer.protected_spans import SpanProtector, tokenizer_has_sentinels
from hf_scratch_transformer.translation.translate import load_model_and_tokenizer
from hf_scratch_transformer.translation_core import DecodingOptions, TextOptions, TorchBackend, translate_texts

TEST_SPLIT = common.ROOT / "hf_scratch_transformer" / "corpus" / "bible_en_es.test.jsonl.gz"
GLOSSARY = Path(__file__).resolve().parent / "bible_glossary.tsv"


def test_records(source_lang: str, target_lang: str) -> list[dict]:
    with gzip.open(TEST_SPLIT, "rt", encoding="utf-8") as lines:
        records = [json.loads(line) for line in lines]
    return [{"chapter": (r["book"], r["chapter"]), "source": r["translation"][source_lang],
             "target": r["translation"][target_lang]} for r in records]


def translate(backend, tokenizer, texts, args, **text_options):
    options = DecodingOptions(num_beams=args.num_beams, batch_size=args.batch_size)
    return translate_texts(backend, tokenizer, texts, options, TextOptions(**text_options), progress=True)


def bleu(hypotheses: list[str], references: list[str]) -> float:
    return round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2)


def documents(backend, tokenizer, args) -> dict:
    records = test_records(args.source_lang, args.target_lang)
    chapters = [list(verses) for _, verses in groupby(records, key=lambda r: r["chapter"])]
    sources = [" ".join(r["source"] for r in verses) for verses in chapters]
    references = [" ".join(r["target"] for r in verses) for verses in chapters]
    whole = [t.text for t in translate(backend, tokenizer, sources, args)]
    results = {"chapters": len(chapters), "verses": len(records), "document_bleu": bleu(whole, references),
               "output_words": sum(len(t.split()) for t in whole),
               "reference_words": sum(len(t.split()) for t in references)}
    for name, segment in (("lines_unsplit", False), ("lines_split", True)):
        lines = [t.text for t in translate(backend, tokenizer, [r["source"] for r in records], args, segment=segment)]
        joined, position = [], 0
        for verses in chapters:
            joined.append(" ".join(lines[position : position + len(verses)]))
            position += len(verses)
        results[f"{name}_bleu"] = bleu(joined, references)
    results["words_ratio"] = round(results["output_words"] / results["reference_words"], 3)
    results["passed"] = (results["words_ratio"] >= 0.9
                         and results["document_bleu"] >= results["lines_unsplit_bleu"] - 1.0)
    return results


def software_pairs(args) -> tuple[list[str], list[str]]:
    """(sources, references) of the software test split: --test_file (JSON lines) or --source / --target."""
    if args.test_file:
        with open(args.test_file, encoding="utf-8") as lines:
            pairs = [json.loads(line)["translation"] for line in lines if line.strip()]
        return [pair[args.source_lang] for pair in pairs], [pair[args.target_lang] for pair in pairs]
    sources = Path(args.source).read_text(encoding="utf-8").splitlines()
    references = Path(args.target).read_text(encoding="utf-8").splitlines()
    if len(sources) != len(references):
        raise SystemExit(f"{args.source} has {len(sources)} lines but {args.target} {len(references)}")
    return sources, references


def software_runs(backend, tokenizer, sources: list[str], references: list[str], args) -> dict:
    """One model on the software strings, protection at its default, on and off: BLEU, the lines that keep their
    spans, and how the spans came back."""
    protector = SpanProtector()
    expected = [Counter(span.text for span in protector.find(source)) for source in sources]
    with_spans = sum(bool(spans) for spans in expected)
    results = {"sentinel_tokens": tokenizer_has_sentinels(tokenizer)}
    default = "on" if results["sentinel_tokens"] else "off"  # what protect=None resolves to for this model
    for name, protect in (("default", None), ("on", True), ("off", False)):
        if name == default:  # the same run as the default's
            results[name] = results["default"]
            continue
        found = translate(backend, tokenizer, sources, args, protect=protect)
        kept = sum(all(t.text.count(span) == count for span, count in spans.items())
                   for t, spans in zip(found, expected) if spans)
        results[name] = {"bleu": bleu([t.text for t in found], references), "lines_keeping_spans": kept,
                         "kept_percent": round(100 * kept / max(with_spans, 1), 2),
                         "how": dict(Counter(entry["how"] for t in found for entry in t.spans))}
    return results


def software(backend, tokenizer, args) -> dict:
    sources, references = software_pairs(args)
    protector = SpanProtector()
    results = {"lines": len(sources), "lines_with_spans": sum(bool(protector.find(source)) for source in sources),
               "model_results": software_runs(backend, tokenizer, sources, references, args)}
    passed = results["model_results"]["default"]["kept_percent"] == 100.0
    if args.compare_model:
        model, compared_tokenizer = load_model_and_tokenizer(args.compare_model)
        results["compare_model"] = str(args.compare_model)
        results["compared_results"] = software_runs(TorchBackend(model), compared_tokenizer, sources, references,
                                                    args)
        passed = passed and (results["model_results"]["default"]["bleu"]
                             >= results["compared_results"]["default"]["bleu"])
    results["passed"] = passed
    return results


def glossary(backend, tokenizer, args) -> dict:
    terms = read_glossary(args.glossary)
    records = test_records(args.source_lang, args.target_lang)
    sources, references = [r["source"] for r in records], [r["target"] for r in records]
    plain = [t.text for t in translate(backend, tokenizer, sources, args)]
    pinned = translate(backend, tokenizer, sources, args, glossary=terms)
    report = [entry for translation in pinned for entry in translation.glossary]
    honoured = sum(entry["honoured"] for entry in report)
    hows = Counter(entry["how"] for entry in report)
    plain_honoured = sum(entry["target"] in text for translation, text in zip(pinned, plain)
                         for entry in translation.glossary)
    results = {"terms": len(terms), "occurrences": len(report), "honoured": honoured,
               "honoured_percent": round(100 * honoured / max(len(report), 1), 2),
               "without_glossary_percent": round(100 * plain_honoured / max(len(report), 1), 2),
               "how": dict(hows), "bleu_without": bleu(plain, references),
               "bleu_with": bleu([t.text for t in pinned], references)}
    results["bleu_change"] = round(results["bleu_with"] - results["bleu_without"], 2)
    results["passed"] = results["honoured_percent"] >= 99.0
    return results


def splitting(backend, tokenizer, args) -> dict:
    sources = [r["source"] for r in test_records(args.source_lang, args.target_lang)]
    times = {True: [], False: []}
    for repeat in range(args.repeats):
        for segment in ((True, False) if repeat % 2 == 0 else (False, True)):  # ABAB: drift hits both
            started = time.perf_counter()
            translate(backend, tokenizer, sources, args, segment=segment)
            times[segment].append(time.perf_counter() - started)
    split, unsplit = min(times[True]), min(times[False])
    return {"lines": len(sources), "seconds_split": times[True], "seconds_unsplit": times[False],
            "added_percent": round(100 * (split - unsplit) / unsplit, 2),
            "passed": split <= 1.05 * unsplit}


MEASURES = {"documents": documents, "software": software, "glossary": glossary, "splitting": splitting}


def markdown(measure: str, results: dict, machine: dict) -> str:
    rows = "\n".join(f"| {key} | {value} |" for key, value in results.items())
    return (f"# Real text: {measure}\n\n{common.machine_line(machine)} Load average {machine['loadavg']}.\n\n"
            f"| figure | value |\n|---|---|\n{rows}\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("measure", choices=sorted(MEASURES))
    parser.add_argument("--model", required=True, help="a model directory written by train.py")
    parser.add_argument("--test_file", help="software: the test split, JSON lines with a `translation` field")
    parser.add_argument("--source", help="software: the test sources, one per line (instead of --test_file)")
    parser.add_argument("--target", help="software: the test references, one per line")
    parser.add_argument("--compare_model", help="software: a model trained without masking, measured the same way")
    parser.add_argument("--glossary", default=GLOSSARY, help=f"glossary: the TSV file (default {GLOSSARY.name})")
    parser.add_argument("--source_lang", default="en")
    parser.add_argument("--target_lang", default="es")
    parser.add_argument("--num_beams", type=int, help="default: the model's generation_config")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=2, help="splitting: timed runs of each")
    parser.add_argument("--output", type=Path, help="results JSON (default results/real_text_<measure>.json)")
    args = parser.parse_args(argv)
    if args.measure == "software" and not (args.test_file or (args.source and args.target)):
        parser.error("software needs --test_file, or --source and --target")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(args.model)
    machine = common.machine_info(args.threads)
    results = {"model": str(args.model), **MEASURES[args.measure](TorchBackend(model), tokenizer, args)}
    output = args.output or common.RESULTS / f"real_text_{args.measure}.json"
    common.write_results({"machine": machine, "results": results}, output, markdown(args.measure, results, machine))
    print(markdown(args.measure, results, machine))


if __name__ == "__main__":
    main()
