"""bf16 inference on a CPU with bf16 units, against fp32: test BLEU and speed of a trained model, through the package's
own translation path (translate_texts with the PyTorch backend), every generate() call in fp32 or under
torch.autocast("cpu", bfloat16) as train.py's bf16 evaluation runs it.

    python benchmarks/inference_precision.py --model outputs/scratch-small-en-es

Quality: the shipped test split (755 verses), greedy and beam 4 at batch 32, sacreBLEU 13a. Speed: the same work
timed in ABAB order (fp32, bf16, bf16, fp32, ...), greedy and beam 4 at batch 32 over the test split, greedy at
batch 1 over its first `--batch1_sentences` verses; paired ratios (adjacent in time) cancel most of a shared
machine's load. Writes results/inference_precision.json and .md. Adopt bf16 only if its BLEU is within 0.2 of fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import common
import real_text
import sacrebleu
import torch

from hf_scratch_transformer.cpu_threads import cpu_bf16_units
from hf_scratch_transformer.translation.translate import load_model_and_tokenizer
from hf_scratch_transformer.translation_core import DecodingOptions, TextOptions, TorchBackend, translate_texts


class PrecisionBackend(TorchBackend):
    """The PyTorch backend with every generate() call under `context()`."""

    def __init__(self, model, context):
        super().__init__(model)
        self.context = context

    def generate(self, *args, **kwargs):
        with self.context():
            return super().generate(*args, **kwargs)


def run(backend, tokenizer, sources, num_beams: int, batch_size: int) -> list[str]:
    options = DecodingOptions(num_beams=num_beams, batch_size=batch_size)
    return [t.text for t in translate_texts(backend, tokenizer, sources, options, TextOptions())]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model directory written by train.py")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each precision per workload")
    parser.add_argument("--batch1_sentences", type=int, default=100)
    parser.add_argument("--output", type=Path, default=common.RESULTS / "inference_precision.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(args.model)
    records = real_text.test_records("en", "es")
    sources, references = [r["source"] for r in records], [r["target"] for r in records]
    backends = {"fp32": PrecisionBackend(model, contextlib.nullcontext),
                "bf16": PrecisionBackend(model, common.precision_context("bf16"))}
    results = {"model": str(args.model), "bf16_units": cpu_bf16_units(), "bleu": {}, "seconds": {}}
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
        ratios = common.paired_ratios(seconds, "fp32", "bf16")
        results["seconds"][workload] = {**seconds, "bf16_speedup_paired": [round(r, 3) for r in ratios],
                                        "bf16_speedup_median": round(common.median(ratios), 3)}
    results["bleu_change_beam4"] = round(results["bleu"]["bf16_beam4"] - results["bleu"]["fp32_beam4"], 2)
    results["bleu_change_greedy"] = round(results["bleu"]["bf16_beam1"] - results["bleu"]["fp32_beam1"], 2)
    machine = common.machine_info(args.threads)
    lines = [f"# bf16 against fp32 inference\n\n{common.machine_line(machine)} Load average {machine['loadavg']}; "
             f"bf16 units: {results['bf16_units']}.\n\n| | fp32 | bf16 | change |\n|---|---:|---:|---:|"]
    for beams, label in ((1, "greedy"), (4, "beam 4")):
        fp32, bf16 = results["bleu"][f"fp32_beam{beams}"], results["bleu"][f"bf16_beam{beams}"]
        lines.append(f"| test BLEU, {label} | {fp32} | {bf16} | {bf16 - fp32:+.2f} |")
    for workload, figures in results["seconds"].items():
        lines.append(f"| {workload} seconds (min) | {min(figures['fp32']):.1f} | {min(figures['bf16']):.1f} | "
                     f"bf16 {figures['bf16_speedup_median']}x (median paired ratio) |")
    markdown = "\n".join(lines) + "\n"
    common.write_results({"machine": machine, "results": results}, args.output, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
