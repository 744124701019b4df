"""From how many rows a decoding step's matrix product pays in bf16 (issue: speed to the CPU's limit): each product
of a preset's decoding step, alone, in fp32 (`F.linear`) and in bf16 (`decoding.Bf16Linear` forced to bf16: the
input cast, oneDNN's product on the prepacked weight, the output cast back), at each row count, alternated.

    python benchmarks/bf16_product_rows.py                     # small preset, 8,000-token vocabulary, all cores
    python benchmarks/bf16_product_rows.py --preset base --vocab_size 16000 \
        --output benchmarks/results/bf16_product_rows_base.json

The products are those `bf16_products_for_decoding` copies: a decoder layer's six (`decoding.step_products`), its
cross-attention keys and values (one product, run on the B·S source positions) and the output projection, with
random weights. For each, the median µs of `--calls` calls per row count and variant, rounds alternated; the rows
from which bf16 was faster; and the rows from which `Bf16Linear` multiplies in bf16 by default
(`decoding.bf16_min_rows`). A product alone is not a step: its weights and inputs stay in cache between calls, and a
step's other work runs between them, so the whole-decoding figures of `decoding_precision.py` are what choose
the threshold; this table shows where it comes from. Results: `benchmarks/results/bf16_product_rows.json` and
`.md` (machine, load, commit).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from common import RESULTS, alternate, git_commit, loadavg, machine_info, machine_line, our_config, write_results

from hf_scratch_transformer import ScratchTransformerForConditionalGeneration, decoding


def products_of(preset: str, vocab_size: int) -> dict[str, decoding.Bf16Linear]:
    """The bf16 copies `bf16_products_for_decoding` makes of a `preset` model (random weights), by name: its first
    decoder layer's (the layers' products are alike in size) and the output projection."""
    torch.manual_seed(0)
    model = ScratchTransformerForConditionalGeneration(our_config(preset, vocab_size)).eval()
    decoding.bf16_products_for_decoding(model, torch.float32)
    copies = model.decoding_weights
    return {**copies.decoder_layers[0], "output_projection": copies.output_projection}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--vocab_size", type=int, default=8000)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128])
    parser.add_argument("--calls", type=int, default=200, help="calls per timing")
    parser.add_argument("--rounds", type=int, default=5, help="timings of each variant (alternated)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--output", default=str(RESULTS / "bf16_product_rows.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = loadavg()
    rows_table = {}
    for name, in_bf16 in products_of(args.preset, args.vocab_size).items():
        weight, bias, default_rows = in_bf16.weight, in_bf16.bias, in_bf16.min_rows
        in_bf16.min_rows = 1  # bf16 at every row count
        cases = []
        for rows in args.rows:
            inputs = torch.randn(rows, 1, weight.shape[1])
            variants = {"fp32": lambda: F.linear(inputs, weight, bias), "bf16": lambda: in_bf16(inputs)}
            for function in variants.values():
                for _ in range(10):  # warm-up
                    function()
            timings = {variant: [] for variant in variants}
            for round_ in range(args.rounds):
                for variant in alternate(list(variants), round_):
                    started = time.perf_counter()
                    for _ in range(args.calls):
                        variants[variant]()
                    timings[variant].append(1e6 * (time.perf_counter() - started) / args.calls)
            cases.append({"rows": rows, **{f"{variant}_us": statistics.median(times)
                                           for variant, times in timings.items()}})
        faster = [case["rows"] for case in cases if case["bf16_us"] < case["fp32_us"]]
        # the smallest row count from which bf16 was faster at every larger row count measured
        from_rows = next((case["rows"] for index, case in enumerate(cases)
                          if all(later["bf16_us"] < later["fp32_us"] for later in cases[index:])), None)
        rows_table[name] = {"shape": list(weight.shape), "cases": cases, "bf16_faster_at": faster,
                            "bf16_faster_from": from_rows, "bf16_min_rows": default_rows}
    results = {"settings": vars(args), "machine": machine_info(args.threads), "commit": git_commit(),
               "load_before": load_before, "load_after": loadavg(), "products": rows_table}
    text = markdown(results, args)
    write_results(results, args.output, text)
    print(text)
    return results


def markdown(results: dict, args) -> str:
    lines = ["# From how many rows a decoding step's product pays in bf16", "",
             f"{machine_line(results['machine'])} Load average {results['load_before']} before, "
             f"{results['load_after']} after.{' ' + args.note if args.note else ''}", "",
             f"Preset {args.preset}, vocabulary {args.vocab_size:,}, random weights. Each product alone, µs a call "
             f"(median of {args.rounds} alternated timings of {args.calls} calls): fp32 `F.linear` / bf16 "
             "(`Bf16Linear`: casts included). **Bold**: the faster. Last columns: the rows from which bf16 was "
             "faster at every larger count measured, and those from which `Bf16Linear` multiplies in bf16 "
             f"(`bf16_min_rows`: {decoding.BF16_MIN_MULTIPLY_ADDS:,} multiply-adds over the weight's elements).", "",
             "| product (out × in) | " + " | ".join(f"{rows} row{'s' if rows > 1 else ''}" for rows in args.rows)
             + " | bf16 faster from | bf16 from (default) |",
             "|---|" + "---:|" * (len(args.rows) + 2)]
    for name, row in results["products"].items():
        cells = []
        for case in row["cases"]:
            fp32, bf16 = f"{case['fp32_us']:.1f}", f"{case['bf16_us']:.1f}"
            cells.append(f"{fp32} / **{bf16}**" if case["bf16_us"] < case["fp32_us"] else f"**{fp32}** / {bf16}")
        out_features, in_features = row["shape"]
        lines.append(f"| {name} ({out_features} × {in_features}) | " + " | ".join(cells)
                     + f" | {row['bf16_faster_from'] or '—'} | {row['bf16_min_rows']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
