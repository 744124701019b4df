"""Attention of the decoding loops with bf16 weights on a CPU: keys, values and queries in fp32 (the package) or
all in bf16 (issue: speed to the CPU's limit).

    python benchmarks/decoding_attention_bf16.py            # small preset, batch 1, 2, 8 and 32, beams 1 and 4
    python benchmarks/decoding_attention_bf16.py --threads 1 --output results/decoding_attention_bf16_1thread.json

With its weights in bf16 (`--dtype auto` on a CPU with AVX-512 BF16 and no AMX), a decoding step's products run in
bf16, and so would its `scaled_dot_product_attention` over the cached keys and values, one query per row. The
package's `decoding.LayerState` keeps those keys and values in fp32 instead (each cast once, when written) and casts
the query and the output at every step, when the rows are enough for that to pay. This script times both through
`generate()` (the package's loops), greedy and beam 4, at each batch size, on bench_speed.py's models and batches
(`common.build_pair`: random weights, random sentence lengths), with MarianMT holding the same weights in fp32:

- `fp32 attention`: `LayerState` with its keys and values in fp32 at every batch size;
- `bf16 attention`: the same left in bf16 at every batch size;
- `MarianMT fp32`: transformers' model of the same sizes and weights, fp32 (the speed goal's reference).

The package attends in fp32 from `decoding.FP32_ATTENTION_MIN_SOURCES` sources in a batch on, in bf16 below: the
table's last columns say which it does, and the ratio to Marian for that choice.

`--new_tokens` new tokens a sentence (end tokens not honoured), one warm-up call each, then `--rounds` calls of each
variant, alternated (the order reversed every round); the median. The two attention variants' tokens are compared
(they may differ where bf16 rounding changes a choice). Results: `benchmarks/results/decoding_attention_bf16.json`
and `.md` (machine, load, commit).
"""

import contextlib
import statistics
import time

import numpy as np
import torch
from common import build_pair, decoding_benchmark_parser, git_commit, loadavg, machine_info, machine_line, \
    random_batch, run_generate, write_results

from hf_scratch_transformer import decoding

VARIANTS = ("fp32 attention", "bf16 attention", "MarianMT fp32")


class ForcedAttentionLayerState(decoding.LayerState):
    """The decoding loops' layer with its attention in `ATTENTION_DTYPE` whatever the rows (set by `attention_in`)."""

    ATTENTION_DTYPE = torch.float32

    def __init__(self, layer, encoder_output: torch.Tensor, steps: int, beams: int = 1, **kwargs):
        super().__init__(layer, encoder_output, steps, beams, **kwargs)
        self.attends_in_fp32 = self.ATTENTION_DTYPE == torch.float32
        self.cross_keys, self.cross_values, self.self_keys, self.self_values = (
            tensor.to(self.ATTENTION_DTYPE) for tensor in (self.cross_keys, self.cross_values, self.self_keys,
                                                           self.self_values))


@contextlib.contextmanager
def attention_in(dtype: torch.dtype):
    """The loops attend in `dtype` at every batch size while inside."""
    package_state = decoding.LayerState
    decoding.LayerState = type(f"{dtype}AttentionLayerState", (ForcedAttentionLayerState,), {"ATTENTION_DTYPE": dtype})
    try:
        yield
    finally:
        decoding.LayerState = package_state


def main(argv: list[str] | None = None) -> dict:
    parser = decoding_benchmark_parser(__doc__, [1, 2, 8, 32], "decoding_attention_bf16.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = loadavg()
    ours, marian = build_pair(args.preset, args.seed)
    ours.to(torch.bfloat16).eval()
    marian.eval()
    contexts = {"fp32 attention": (ours, lambda: attention_in(torch.float32)),
                "bf16 attention": (ours, lambda: attention_in(torch.bfloat16)),
                "MarianMT fp32": (marian, contextlib.nullcontext)}

    def call(variant: str, batch: dict, beams: int) -> tuple[float, torch.Tensor]:
        model, context = contexts[variant]
        with context(), torch.inference_mode():
            started = time.perf_counter()
            tokens = run_generate(model, batch, beams, args.new_tokens)
            return time.perf_counter() - started, tokens

    rng = np.random.default_rng(args.seed)
    cases = []
    for batch_size in args.batch_sizes:
        batch = random_batch(rng, batch_size)
        for beams in args.beams:
            outputs = {variant: call(variant, batch, beams)[1] for variant in VARIANTS}  # warm-up
            seconds = {variant: [] for variant in VARIANTS}
            for round_ in range(args.rounds):
                for variant in (VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]):
                    seconds[variant].append(call(variant, batch, beams)[0])
            new_tokens = batch_size * args.new_tokens
            fp32_tokens, bf16_tokens = outputs["fp32 attention"], outputs["bf16 attention"]
            cases.append({
                "batch_size": batch_size, "beams": beams, "source_tokens": int(batch["input_ids"].shape[1]),
                "us_per_new_token": {variant: 1e6 * statistics.median(times) / new_tokens
                                     for variant, times in seconds.items()},
                "seconds": seconds,
                "same_tokens_share": float((fp32_tokens == bf16_tokens).float().mean())
                if fp32_tokens.shape == bf16_tokens.shape else 0.0})
    results = {"settings": vars(args), "machine": machine_info(args.threads), "commit": git_commit(),
               "load_before": load_before, "load_after": loadavg(), "cases": cases,
               "fp32_attention_min_sources": decoding.FP32_ATTENTION_MIN_SOURCES}
    text = markdown(results, args)
    write_results(results, args.output, text)
    print(text)
    return results


def markdown(results: dict, args) -> str:
    lines = ["# Decoding with bf16 weights on a CPU: attention in fp32 or in bf16", "",
             f"{machine_line(results['machine'])} Load average {results['load_before']} before, "
             f"{results['load_after']} after.{' ' + args.note if args.note else ''}", "",
             f"Preset {args.preset}, our weights in bf16 (random, seeded), `generate()` (the package's loops), "
             f"{args.new_tokens} new tokens a sentence (end tokens not honoured); MarianMT with the same weights in "
             f"fp32. Median of {args.rounds} calls per variant, alternated. µs per new token (lower is faster).", "",
             "| batch | beams | fp32 attention | bf16 attention | MarianMT fp32 | bf16 / fp32 attention | "
             "same tokens | the package | Marian / the package |", "|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for case in results["cases"]:
        times = case["us_per_new_token"]
        fp32, bf16, marian = (times[variant] for variant in VARIANTS)
        in_fp32 = case["batch_size"] >= results["fp32_attention_min_sources"]
        package = fp32 if in_fp32 else bf16
        lines.append(f"| {case['batch_size']} | {case['beams']} | {fp32:.1f} | {bf16:.1f} | {marian:.1f} | "
                     f"**{bf16 / fp32:.2f}×** | {100 * case['same_tokens_share']:.1f}% | "
                     f"{'fp32' if in_fp32 else 'bf16'} | {marian / package:.2f}× |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
