"""bf16 and int8 inference on a CPU, against fp32: test BLEU and speed of a trained model, through the package's own
translation path (translate_texts with the PyTorch backend), in six precisions: fp32; `bf16` (every generate()
call under torch.autocast("cpu", bfloat16), as train.py's bf16 evaluation runs it: fp32 weights cast at each matrix
product); `bf16_weights` (the model's weights stored in bf16, `model.to(torch.bfloat16)`, as
`from_pretrained(..., dtype=torch.bfloat16)` loads it: no casts; the decoding loops take the logits in fp32); `int8`
(fp32 weights, the decoding loops' matrix products in int8, the encoder in bf16 on a CPU with bf16 units, as
`load_model_and_tokenizer(..., dtype="int8")` loads it: `decoding.quantize_for_decoding`); `int8_fp32_encoder` (the
same with the encoder in fp32 everywhere); `bf16_products` (fp32 weights, the decoding loops' matrix products in bf16
where a product has rows enough (`decoding.bf16_min_rows`) and in fp32 below, the encoder as in `int8`, as
`load_model_and_tokenizer(..., dtype="bfloat16_products")` loads it: `decoding.bf16_products_for_decoding`).

    python benchmarks/inference_precision.py --model outputs/scratch-small-en-es
    python benchmarks/inference_precision.py --model DIR --test_file benchmarks/work/corpora/games_en_ru/test.jsonl \
        --precisions fp32 int8 --output benchmarks/results/inference_precision_int8_games_en_ru.json

Quality: the shipped test split (755 verses), or `--test_file` (JSON lines of {"translation": {source_lang: ...,
target_lang: ...}}, as build_corpora.py writes them), greedy and beam 4 at batch 32, sacreBLEU 13a. Speed: the same
work timed in alternating order (fp32, bf16, ..., then reversed, ...), greedy and beam 4 at batch 32 over the test
split, greedy at batch 1 over its first `--batch1_sentences` sentences; paired ratios (adjacent in time) cancel most
of a shared machine's load. Writes results/inference_precision.json and .md. Adopt a precision only if its BLEU is
within 0.2 of fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from pathlib import Path

import json

import common
import real_text
import sacrebleu
import torch

from hf_scratch_transformer.cpu_threads import cpu_bf16_units
from hf_scratch_transformer.decoding import bf16_products_for_decoding, quantize_for_decoding
from hf_scratch_transformer.translation.translate import decoding_encoder_dtype, load_model_and_tokenizer
from hf_scratch_transformer.translation_core import DecodingOptions, TextOptions, TorchBackend, translate_texts


class PrecisionBackend(TorchBackend):
    """The PyTorch backend with every generate() call under `context()`."""

    def __init__(self, model, context):
        super().__init__(model)
        self.context = context

    def generate(self, *args, **kwargs):
        with self.context():
            return super().generate(*args, **kwargs)


def decoding_copy(model, copies, encoder_dtype: torch.dtype):
    """A copy of `model` whose decoding loops multiply as `copies` (quantize_for_decoding or
    bf16_products_for_decoding) makes them, its encoder in `encoder_dtype`."""
    copied = copy.deepcopy(model)
    copies(copied, encoder_dtype)
    return copied


PRECISIONS = {"fp32": lambda model: PrecisionBackend(model, contextlib.nullcontext),
              "bf16": lambda model: PrecisionBackend(model, common.precision_context("bf16")),
              "bf16_weights": lambda model: PrecisionBackend(copy.deepcopy(model).to(torch.bfloat16),
                                                             contextlib.nullcontext),
              "int8": lambda model: PrecisionBackend(
                  decoding_copy(model, quantize_for_decoding, decoding_encoder_dtype()), contextlib.nullcontext),
              "int8_fp32_encoder": lambda model: PrecisionBackend(
                  decoding_copy(model, quantize_for_decoding, torch.float32), contextlib.nullcontext),
              "bf16_products": lambda model: PrecisionBackend(
                  decoding_copy(model, bf16_products_for_decoding, decoding_encoder_dtype()), contextlib.nullcontext)}


def test_pairs(test_file: Path | None, source_lang: str) -> tuple[list[str], list[str]]:
    """(sources, references) of the shipped test split, or of a JSON-lines test file."""
    if test_file is None:
        records = real_text.test_records("en", "es")
        return [r["source"] for r in records], [r["target"] for r in records]
    pairs = [json.loads(line)["translation"] for line in test_file.read_text(encoding="utf-8").splitlines() if line]
    target_lang = next(lang for lang in pairs[0] if lang != source_lang)
    return [pair[source_lang] for pair in pairs], [pair[target_lang] for pair in pairs]


def run(backend, tokenizer, sources, num_beams: int, batch_size: int) -> list[str]:
    options = DecodingOptions(num_beams=num_beams, batch_size=batch_size)
    return [t.text for t in translate_texts(backend, tokenizer, sources, options, TextOptions())]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model directory written by train.py")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each precision per workload")
    parser.add_argument("--batch1_sentences", type=int, default=100)
    parser.add_argument("--test_file", type=Path, help="a JSON-lines test split (default: the shipped one)")
    parser.add_argument("--source_lang", default="en")
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS),
                        help="fp32 and the precisions compared with it")
    parser.add_argument("--output", type=Path, default=common.RESULTS / "inference_precision.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(args.model)
    sources, references = test_pairs(args.test_file, args.source_lang)
    backends = {name: PRECISIONS[name](model) for name in ["fp32"] + [p for p in args.precisions if p != "fp32"]}
    compared = [name for name in backends if name != "fp32"]  # the precisions compared with fp32
    results = {"model": str(args.model), "test_file": str(args.test_file or "the shipped test split"),
               "sentences": len(sources), "bf16_units": cpu_bf16_units(), "bleu": {}, "seconds": {}}
    for beams in (1, 4):
        for name, backend in backends.items():
            hypotheses = run(backend, tokenizer, sources, beams, 32)
            results["bleu"][f"{name}_beam{beams}"] = round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2)
    workloads = {"greedy_b32": (sources, 1, 32), "beam4_b32": (sources, 4, 32),
                 "greedy_b1": (sources[: args.batch1_sentences], 1, 1)}
    for workload, (texts, beams, batch) in workloads.items():
        seconds = {name: [] for name in backends}
        for repeat in range(args.repeats):
            for name in common.alternate(list(backends), repeat):
                started = time.perf_counter()
                run(backends[name], tokenizer, texts, beams, batch)
                seconds[name].append(time.perf_counter() - started)
        results["seconds"][workload] = dict(seconds)
        for name in compared:
            ratios = common.paired_ratios(seconds, "fp32", name)
            results["seconds"][workload][f"{name}_speedup_paired"] = [round(r, 3) for r in ratios]
            results["seconds"][workload][f"{name}_speedup_median"] = round(common.median(ratios), 3)
    for name in compared:
        for beams, label in ((1, "greedy"), (4, "beam4")):
            change = results["bleu"][f"{name}_beam{beams}"] - results["bleu"][f"fp32_beam{beams}"]
            results[f"{name}_bleu_change_{label}"] = round(change, 2)
    machine = common.machine_info(args.threads)
    lines = [f"# bf16 and int8 against fp32 inference\n\n{common.machine_line(machine)} Load average "
             f"{machine['loadavg']}; bf16 units: {results['bf16_units']}. Model: `{args.model}`; test: "
             f"{results['test_file']} ({len(sources)} sentences). `bf16`: autocast over fp32 weights; `bf16_weights`: "
             f"the weights stored in bf16; `int8`: the decoding loops' products in int8, the encoder in "
             f"{str(decoding_encoder_dtype()).removeprefix('torch.')} (`int8_fp32_encoder`: in float32); "
             f"`bf16_products`: the decoding loops' products in bf16 where they have rows enough, the encoder as in "
             f"`int8`. Speed-up: the "
             f"median of the fp32 time over the variant's time, paired with the fp32 run next to it.\n\n| | fp32 | "
             + " | ".join(compared) + " |\n|---|---:|" + "---:|" * len(compared)]
    for beams, label in ((1, "greedy"), (4, "beam 4")):
        fp32 = results["bleu"][f"fp32_beam{beams}"]
        cells = [f"{results['bleu'][f'{name}_beam{beams}']} ({results['bleu'][f'{name}_beam{beams}'] - fp32:+.2f})"
                 for name in compared]
        lines.append(f"| test BLEU, {label} | {fp32} | " + " | ".join(cells) + " |")
    for workload, figures in results["seconds"].items():
        cells = [f"{min(figures[name]):.1f} s, {figures[f'{name}_speedup_median']}x" for name in compared]
        lines.append(f"| {workload}: fastest seconds, speed-up | {min(figures['fp32']):.1f} s | "
                     + " | ".join(cells) + " |")
    markdown = "\n".join(lines) + "\n"
    common.write_results({"machine": machine, "results": results}, args.output, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
