"""Cross-attention of the decoding loops on a CPU: two batched products (bmm, softmax, bmm) or torch's fused
`scaled_dot_product_attention`, at each batch size (issue: speed to the CPU's limit).

    python benchmarks/cross_attention_bmm.py            # small preset, batch 1, 4, 8, 16, 32, beams 1 and 4
    python benchmarks/cross_attention_bmm.py --threads 1 --output results/cross_attention_bmm_1thread.json

Each step of `decoding.LayerState` attends from one query per beam to a source's cross-attention keys and values,
projected once per source. From `decoding.BMM_CROSS_ATTENTION_MIN_SOURCES` sources in a batch the package computes
that attention as two batched matrix products (`LayerState.cross_attention_by_bmm`), below it calls the fused
kernel. This script times both through `generate()` (the package's loops) on bench_speed.py's random weights and
batches (`common.build_pair`, `common.random_batch`), in fp32 and in int8 as `--dtype int8` loads it
(`translate.decoding_encoder_dtype`), greedy and beam 4:

- `bmm`: cross-attention by the two products at every batch size;
- `fused`: cross-attention by `scaled_dot_product_attention` at every batch size.

`--new_tokens` new tokens a sentence (end tokens not honoured), one warm-up call each, then `--rounds` calls of
each variant, alternated (the order reversed every round); the median µs per new token and the median of adjacent
calls' ratios. The two variants' tokens are compared. Results: `benchmarks/results/cross_attention_bmm.json` and
`.md` (machine, load, commit).
"""

import contextlib
import copy
import statistics

import numpy as np
import torch
from common import build_pair, decoding_benchmark_parser, git_commit, loadavg, machine_info, machine_line, \
    paired_ratios, random_batch, run_generate, time_alternating, write_results

from hf_scratch_transformer import decoding
from hf_scratch_transformer.translation.translate import decoding_encoder_dtype

VARIANTS = ("bmm", "fused")


@contextlib.contextmanager
def cross_attention_by(variant: str):
    """The loops' cross-attention by `variant` at every batch size while inside."""
    package_threshold = decoding.BMM_CROSS_ATTENTION_MIN_SOURCES
    decoding.BMM_CROSS_ATTENTION_MIN_SOURCES = 1 if variant == "bmm" else float("inf")
    try:
        yield
    finally:
        decoding.BMM_CROSS_ATTENTION_MIN_SOURCES = package_threshold


def main(argv: list[str] | None = None) -> dict:
    parser = decoding_benchmark_parser(__doc__, [1, 4, 8, 16, 32], "cross_attention_bmm.json")
    parser.add_argument("--precisions", nargs="+", choices=["float32", "int8"], default=["float32", "int8"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = loadavg()
    ours = build_pair(args.preset, args.seed)[0].eval()
    models = {"float32": ours}
    if "int8" in args.precisions:
        models["int8"] = copy.deepcopy(ours)
        decoding.quantize_for_decoding(models["int8"], decoding_encoder_dtype())

    rng = np.random.default_rng(args.seed)
    cases = []
    for batch_size in args.batch_sizes:
        batch = random_batch(rng, batch_size)
        for precision in args.precisions:
            for beams in args.beams:
                outputs = {}

                def call(variant: str):
                    with cross_attention_by(variant):
                        outputs[variant] = run_generate(models[precision], batch, beams, args.new_tokens)

                seconds = time_alternating({variant: lambda v=variant: call(v) for variant in VARIANTS},
                                           args.rounds)
                new_tokens = batch_size * args.new_tokens
                cases.append({
                    "batch_size": batch_size, "precision": precision, "beams": beams,
                    "source_tokens": int(batch["input_ids"].shape[1]),
                    "us_per_new_token": {variant: 1e6 * statistics.median(times) / new_tokens
                                         for variant, times in seconds.items()},
                    "fused_over_bmm": statistics.median(paired_ratios(seconds, "fused", "bmm")),
                    "seconds": seconds, "same_tokens": bool(torch.equal(outputs["bmm"], outputs["fused"]))})
    results = {"settings": vars(args), "machine": machine_info(args.threads), "commit": git_commit(),
               "load_before": load_before, "load_after": loadavg(), "cases": cases,
               "bmm_cross_attention_min_sources": decoding.BMM_CROSS_ATTENTION_MIN_SOURCES}
    text = markdown(results, args)
    write_results(results, args.output, text)
    print(text)
    return results


def markdown(results: dict, args) -> str:
    lines = ["# Cross-attention of the decoding loops: two batched products or the fused kernel", "",
             f"{machine_line(results['machine'])} Load average {results['load_before']} before, "
             f"{results['load_after']} after.{' ' + args.note if args.note else ''}", "",
             f"Preset {args.preset}, random weights (seeded), `generate()` (the package's loops), {args.new_tokens} "
             f"new tokens a sentence (end tokens not honoured). Median of {args.rounds} calls per variant, "
             f"alternated; µs per new token (lower is faster) and the median ratio of adjacent calls. The package "
             f"uses the products from {results['bmm_cross_attention_min_sources']} sources.", "",
             "| batch | precision | beams | bmm µs | fused µs | fused / bmm | same tokens | the package |",
             "|---:|---|---:|---:|---:|---:|---|---|"]
    for case in results["cases"]:
        times = case["us_per_new_token"]
        package = "bmm" if case["batch_size"] >= results["bmm_cross_attention_min_sources"] else "fused"
        lines.append(f"| {case['batch_size']} | {case['precision']} | {case['beams']} | {times['bmm']:.1f} | "
                     f"{times['fused']:.1f} | **{case['fused_over_bmm']:.2f}×** | "
                     f"{'yes' if case['same_tokens'] else 'no'} | {package} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
