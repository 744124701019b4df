"""The package's own greedy and beam search (hf_scratch_transformer/decoding.py) against transformers' generate() on
real text: a trained model translating the shipped test split through the package's translation path, as the
command line does (sorted batches, a length bound per source), with each decoding done once by the package's loops
and once by transformers' generate().

    python benchmarks/decoding_loops.py --model outputs/scratch-small-en-es

Unlike bench_speed.py (random weights, exactly 32 new tokens per sentence: the cost of a step), sentences here end
where the model ends them, so what a batch does with sentences that have ended counts too. Workloads: greedy and
beam 4 at batch 32 over the test split (755 verses), beam 4 at batch 1 over its first `--batch1_sentences` verses.
Each is timed in ABAB order (ours, generate(), generate(), ours, ...); paired ratios (adjacent in time) cancel most
of a shared machine's load. The translations must be identical (same token ids): the script stops if they are not.
Writes results/decoding_loops.json and .md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import common
import real_text
import sacrebleu
import torch

from hf_scratch_transformer.translation.translate import load_model_and_tokenizer
from hf_scratch_transformer.translation_core import DecodingOptions, TorchBackend, translate_batches


class GenerateBackend(TorchBackend):
    """The PyTorch backend with every call sent to transformers' generate() (never the package's loops)."""

    def _plain_call(self, *args, **kwargs):
        return None


def run(backend, tokenizer, sources: list[str], num_beams: int, batch_size: int) -> list[list[int]]:
    options = DecodingOptions(num_beams=num_beams, batch_size=batch_size)
    return [row[0].token_ids if row else [] for row in translate_batches(backend, tokenizer, sources, options)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model directory written by train.py")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each decoder per workload")
    parser.add_argument("--batch1_sentences", type=int, default=100)
    parser.add_argument("--output", type=Path, default=common.RESULTS / "decoding_loops.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(args.model)
    records = real_text.test_records("en", "es")
    sources, references = [r["source"] for r in records], [r["target"] for r in records]
    backends = {"ours": TorchBackend(model), "generate": GenerateBackend(model)}
    workloads = {"greedy_b32": (sources, 1, 32), "beam4_b32": (sources, 4, 32),
                 "beam4_b1": (sources[: args.batch1_sentences], 4, 1)}
    results = {"model": str(args.model), "workloads": {}}
    for workload, (texts, beams, batch) in workloads.items():
        outputs = {}

        def translating(name, backend):
            def call():
                outputs[name] = run(backend, tokenizer, texts, beams, batch)
            return call

        seconds = common.time_alternating({name: translating(name, backend) for name, backend in backends.items()},
                                          args.repeats, warmup=0)
        if outputs["ours"] != outputs["generate"]:
            differ = sum(a != b for a, b in zip(outputs["ours"], outputs["generate"]))
            raise SystemExit(f"{workload}: {differ} of {len(texts)} translations differ between the loops and "
                             "generate()")
        new_tokens = sum(len(ids) for ids in outputs["ours"])
        ratios = common.paired_ratios(seconds, "generate", "ours")
        entry = {"sentences": len(texts), "num_beams": beams, "batch_size": batch, "new_tokens": new_tokens,
                 "seconds": seconds, "speedup_paired": [round(r, 3) for r in ratios],
                 "speedup_median": round(common.median(ratios), 3), "identical": True}
        if len(texts) == len(sources):
            decoded = tokenizer.batch_decode(outputs["ours"], skip_special_tokens=True)
            entry["test_bleu"] = round(sacrebleu.corpus_bleu(decoded, [references]).score, 2)
        results["workloads"][workload] = entry
        print(workload, entry)
    machine = common.machine_info(args.threads)
    lines = [f"# The package's decoding loops against transformers' generate(), on the test split\n\n"
             f"{common.machine_line(machine)} Load average {machine['loadavg']}. Model: `{args.model}`. "
             f"{args.repeats} timed runs of each, ABAB; the translations of the two were identical.\n\n"
             "| workload | sentences | new tokens | ours, s (min) | generate(), s (min) | speed-up (median paired) | "
             "test BLEU |\n|---|---:|---:|---:|---:|---:|---:|"]
    for workload, entry in results["workloads"].items():
        lines.append(f"| {workload} | {entry['sentences']} | {entry['new_tokens']:,} | "
                     f"{min(entry['seconds']['ours']):.1f} | {min(entry['seconds']['generate']):.1f} | "
                     f"**{entry['speedup_median']}x** | {entry.get('test_bleu', '')} |")
    markdown = "\n".join(lines) + "\n"
    common.write_results({"machine": machine, "results": results}, args.output, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
