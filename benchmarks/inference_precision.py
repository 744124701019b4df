"""bf16 inference on a CPU with bf16 units, against fp32: test BLEU and speed of a trained model, through the package's
own translation path (translate_texts with the PyTorch backend), in three precisions: fp32; `bf16` (every generate()
call under torch.autocast("cpu", bfloat16), as train.py's bf16 evaluation runs it: fp32 weights cast at each matrix
product); `bf16_weights` (the model's weights stored in bf16, `model.to(torch.bfloat16)`, as
`from_pretrained(..., dtype=torch.bfloat16)` loads it: no casts; the decoding loops
take the logits in fp32).

    python benchmarks/inference_precision.py --model outputs/scratch-small-en-es

Quality: the shipped test split (755 verses), greedy and beam 4 at batch 32, sacreBLEU 13a. Speed: the same work
timed in alternating order (fp32, bf16, bf16_weights, then reversed, ...), greedy and beam 4 at batch 32 over the test split, greedy at
batch 1 over its first `--batch1_sentences` verses; paired ratios (adjacent in time) cancel most of a shared
machine's load. Writes results/inference_precision.json and .md. Adopt a bf16 path only if its BLEU is within 0.2 of fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
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
                "bf16": PrecisionBackend(model, common.precision_context("bf16")),
                "bf16_weights": PrecisionBackend(copy.deepcopy(model).to(torch.bfloat16), contextlib.nullcontext)}
    bf16_names = [name for name in backends if name != "fp32"]
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
        results["seconds"][workload] = dict(seconds)
        for name in bf16_names:
            ratios = common.paired_ratios(seconds, "fp32", name)
            results["seconds"][workload][f"{name}_speedup_paired"] = [round(r, 3) for r in ratios]
            results["seconds"][workload][f"{name}_speedup_median"] = round(common.median(ratios), 3)
    for name in bf16_names:
        for beams, label in ((1, "greedy"), (4, "beam4")):
            change = results["bleu"][f"{name}_beam{beams}"] - results["bleu"][f"fp32_beam{beams}"]
            results[f"{name}_bleu_change_{label}"] = round(change, 2)
    machine = common.machine_info(args.threads)
    lines = [f"# bf16 against fp32 inference\n\n{common.machine_line(machine)} Load average {machine['loadavg']}; "
             f"bf16 units: {results['bf16_units']}. `bf16`: autocast over fp32 weights; `bf16_weights`: the weights "
             f"stored in bf16. Speed-up: the median of the fp32 time over the variant's time, paired with the fp32 "
             f"run next to it.\n\n| | fp32 | " + " | ".join(bf16_names) + " |\n|---|---:|"
             + "---:|" * len(bf16_names)]
    for beams, label in ((1, "greedy"), (4, "beam 4")):
        fp32 = results["bleu"][f"fp32_beam{beams}"]
        cells = [f"{results['bleu'][f'{name}_beam{beams}']} ({results['bleu'][f'{name}_beam{beams}'] - fp32:+.2f})"
                 for name in bf16_names]
        lines.append(f"| test BLEU, {label} | {fp32} | " + " | ".join(cells) + " |")
    for workload, figures in results["seconds"].items():
        cells = [f"{min(figures[name]):.1f} s, {figures[f'{name}_speedup_median']}x" for name in bf16_names]
        lines.append(f"| {workload}: fastest seconds, speed-up | {min(figures['fp32']):.1f} s | "
                     + " | ".join(cells) + " |")
    markdown = "\n".join(lines) + "\n"
    common.write_results({"machine": machine, "results": results}, args.output, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
