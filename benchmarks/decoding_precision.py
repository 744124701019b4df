"""Decoding speed in each precision `--dtype` offers, against MarianMT in fp32 holding the same weights (issue: speed to
the CPU's limit).

    python benchmarks/decoding_precision.py            # small preset, batch 1 and 32, greedy and beam 4
    python benchmarks/decoding_precision.py --threads 1 --output benchmarks/results/decoding_precision_1thread.json

Our model in the precisions `load_model_and_tokenizer(..., dtype=...)` gives, through `generate()` (the
package's loops), on bench_speed.py's models and batches (`common.build_pair`: random weights, random sentence
lengths), with MarianMT holding the same weights in fp32 (the speed goal's reference):

- `float32`: the weights as train.py saves them;
- `bfloat16`: the weights in bf16 (the loops attend in fp32 from `decoding.FP32_ATTENTION_MIN_SOURCES` sources);
- `bfloat16_products`: fp32 weights, every matrix product of a decoding step (and the cross-attention keys and
  values) in bf16 from the rows at which it pays (`decoding.bf16_min_rows`) and in fp32 below
  (`decoding.bf16_products_for_decoding`), the encoder in bf16 on a CPU with bf16 units
  (`translate.decoding_encoder_dtype`); `--min_rows N ...` adds the same with every product in bf16 from N rows on,
  as `bfloat16_products@N`, to compare with that rule, and `--unpacked` the same with plain bf16
  copies of the weights (`F.linear`) in place of oneDNN's prepacked ones, as `bfloat16_products_unpacked`, and
  `--fp32_cross` the same with the cross-attention keys and values projected in fp32, as
  `bfloat16_products_fp32_cross`;
- `int8`: fp32 weights, every matrix product of a decoding step in int8 (`decoding.quantize_for_decoding`), the
  encoder as in `bfloat16_products`.

`--new_tokens` new tokens a sentence (end tokens not honoured, so every variant does the same steps whatever its
roundings choose), one warm-up call each, then `--rounds` calls of each variant, alternated (the order reversed every
round). The table gives the median µs per new token and each variant's speed over Marian's: the median of the ratios
of calls adjacent in time, which cancels most of a shared machine's drift. It names what `--dtype auto` picks on
this machine. Results: `benchmarks/results/decoding_precision.json` and `.md` (machine, load, commit).
"""

import copy
import statistics
import time

import numpy as np
import torch
from common import build_pair, decoding_benchmark_parser, git_commit, loadavg, machine_info, machine_line, \
    random_batch, run_generate, write_results

from hf_scratch_transformer.decoding import bf16_products_for_decoding, quantize_for_decoding
from hf_scratch_transformer.translation.translate import inference_precision, decoding_encoder_dtype

MARIAN = "MarianMT fp32"


def our_variants(ours, min_rows: list[int] = (), unpacked: bool = False, fp32_cross: bool = False) -> dict:
    """Our model as each `--dtype` loads it; bfloat16_products also with bf16 from each of `min_rows` rows on, with
    `unpacked` with plain bf16 weights, and with `fp32_cross` with the cross-attention keys and values in fp32."""
    variants = {"float32": ours, "bfloat16": copy.deepcopy(ours).to(torch.bfloat16)}
    extra = [*(["unpacked"] if unpacked else []), *(["fp32_cross"] if fp32_cross else [])]
    for rows in [None, *min_rows, *extra]:
        products = copy.deepcopy(ours)
        bf16_products_for_decoding(products, decoding_encoder_dtype())
        if rows == "fp32_cross":
            for layer in products.decoding_weights.decoder_layers:
                del layer["cross_key_value"]  # LayerState then projects them with F.linear on the fp32 weights
        for product in [products.decoding_weights.output_projection,
                        *(p for layer in products.decoding_weights.decoder_layers for p in layer.values())]:
            if rows == "unpacked":
                product.packed_weight, product.bf16_weight = None, product.weight.bfloat16()
            elif isinstance(rows, int):
                product.min_rows = rows
        suffix = "" if rows is None else f"@{rows}" if isinstance(rows, int) else f"_{rows}"
        variants[f"bfloat16_products{suffix}"] = products
    variants["int8"] = copy.deepcopy(ours)
    quantize_for_decoding(variants["int8"], decoding_encoder_dtype())
    return variants


def main(argv: list[str] | None = None) -> dict:
    parser = decoding_benchmark_parser(__doc__, [1, 32], "decoding_precision.json")
    parser.add_argument("--min_rows", type=int, nargs="*", default=[],
                        help="also bfloat16_products with bf16 from each of these rows on")
    parser.add_argument("--unpacked", action="store_true",
                        help="also bfloat16_products with plain bf16 weights, not oneDNN's prepacked ones")
    parser.add_argument("--fp32_cross", action="store_true",
                        help="also bfloat16_products with the cross-attention keys and values projected in fp32")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = loadavg()
    ours, marian = build_pair(args.preset, args.seed)
    models = {**our_variants(ours.eval(), args.min_rows, args.unpacked, args.fp32_cross), MARIAN: marian.eval()}
    variants = list(models)

    def call(variant: str, batch: dict, beams: int) -> float:
        started = time.perf_counter()
        run_generate(models[variant], batch, beams, args.new_tokens)
        return time.perf_counter() - started

    rng = np.random.default_rng(args.seed)
    cases = []
    for batch_size in args.batch_sizes:
        batch = random_batch(rng, batch_size)
        for beams in args.beams:
            for variant in variants:  # warm-up
                call(variant, batch, beams)
            seconds = {variant: [] for variant in variants}
            for round_ in range(args.rounds):
                for variant in (variants if round_ % 2 == 0 else variants[::-1]):
                    seconds[variant].append(call(variant, batch, beams))
            new_tokens = batch_size * args.new_tokens
            cases.append({
                "batch_size": batch_size, "beams": beams, "source_tokens": int(batch["input_ids"].shape[1]),
                "us_per_new_token": {variant: 1e6 * statistics.median(times) / new_tokens
                                     for variant, times in seconds.items()},
                "over_marian": {variant: statistics.median(m / o for m, o in zip(seconds[MARIAN], times))
                                for variant, times in seconds.items() if variant != MARIAN},
                "seconds": seconds})
    results = {"settings": vars(args), "variants": variants, "machine": machine_info(args.threads),
               "commit": git_commit(),
               "load_before": load_before, "load_after": loadavg(), "cases": cases,
               "auto_precision": inference_precision("cpu")}
    text = markdown(results, args)
    write_results(results, args.output, text)
    print(text)
    return results


def markdown(results: dict, args) -> str:
    variants = results["variants"]
    ours = [variant for variant in variants if variant != MARIAN]
    lines = ["# Decoding speed in each precision, against MarianMT fp32", "",
             f"{machine_line(results['machine'])} Load average {results['load_before']} before, "
             f"{results['load_after']} after.{' ' + args.note if args.note else ''}", "",
             f"Preset {args.preset}, random weights (seeded) shared with MarianMT, `generate()` (the package's loops), "
             f"{args.new_tokens} new tokens a sentence (end tokens not honoured). Median of {args.rounds} calls per "
             f"variant, alternated; µs per new token (lower is faster), and speed over Marian's (the median of "
             f"adjacent calls' ratios). `--dtype auto` picks **{results['auto_precision']}** on this machine.", "",
             "| batch | beams | " + " | ".join(f"{v} µs" for v in variants) + " | "
             + " | ".join(f"{v} / Marian" for v in ours) + " |",
             "|---:|---:|" + "---:|" * (len(variants) + len(ours))]
    for case in results["cases"]:
        times, speed = case["us_per_new_token"], case["over_marian"]
        lines.append(f"| {case['batch_size']} | {case['beams']} | "
                     + " | ".join(f"{times[v]:.1f}" for v in variants) + " | "
                     + " | ".join(f"{speed[v]:.2f}×" for v in ours) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
