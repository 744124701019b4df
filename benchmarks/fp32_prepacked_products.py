"""fp32 decoding by prepacked weights (issue: speed to the CPU's limit): what `decoding.PackedLinear` (the weight in
oneDNN's blocked layout, `torch.ops.mkldnn._linear_pointwise`) does against `F.linear` on the parameter, per product
and for whole decodings, and what `decoding.first_argmax` does against torch's max.

    python benchmarks/fp32_prepacked_products.py                # small preset, 8,000-token vocabulary, all cores
    python benchmarks/fp32_prepacked_products.py --preset base --output benchmarks/results/fp32_prepacked_base.json

1. **Products in a step's order.** Every product of every decoder layer of a `--preset` model (random weights;
   `decoding.step_products`) and the output projection, called one after the other as a step calls them, so that
   each weight has left the cores' caches by its next turn (a product timed alone keeps its weight in cache and
   flatters F.linear). Per product and row count: µs a call, F.linear / PackedLinear, rounds alternated.
2. **Whole decodings.** bench_speed's workloads (random sources of 50 % padding, exactly `--new_tokens` new tokens):
   greedy and beam 4 at batch 1 and 32, the loops with the prepacked copies (`decoding.decoding_weights`, the
   default for an fp32 model on a CPU) against the same loops on the parameters. The tokens must be identical (the
   script stops if not). Paired ratios of adjacent timings, so that a shared machine's drift cancels.
3. **The greedy token choice** over (rows, V) logits: `first_argmax` against `logits.max(dim=-1).indices`.

Results: `benchmarks/results/fp32_prepacked_products.json` and `.md` (machine, load, commit).
"""

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from common import (RESULTS, alternate, fixed_length_generation_config, git_commit, loadavg, machine_info,
                    machine_line, our_config, paired_ratios, random_batch, time_alternating, write_results)

from hf_scratch_transformer import ScratchTransformerForConditionalGeneration, decoding


def step_products(model) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(name, weight, bias) of every product a decoding step computes, in the step's order."""
    products = [(name, weight, bias) for layer in model.model.decoder.layers
                for name, (weight, bias) in decoding.step_products(layer).items()]
    return products + [("output_projection", model.lm_head.weight, model.lm_head.bias)]


def products_in_step_order(model, rows_list: list[int], steps: int, rounds: int) -> dict:
    """µs a call of each product (median over rounds, mean over its layers), F.linear and PackedLinear."""
    products = step_products(model)
    packed = [decoding.PackedLinear(weight, bias) for _, weight, bias in products]
    table = {}
    for rows in rows_list:
        inputs = {size: torch.randn(rows, size) for size in {weight.shape[1] for _, weight, _ in products}}
        variants = {
            "F.linear": [lambda x, weight=weight, bias=bias: F.linear(x, weight, bias) for _, weight, bias in products],
            "PackedLinear": packed,
        }
        timings = {variant: {name: [] for name, _, _ in products} for variant in variants}
        for round_ in range(-1, rounds):  # round -1 warms up
            for variant in alternate(list(variants), max(round_, 0)):
                spent = {name: 0.0 for name, _, _ in products}
                for _ in range(steps):
                    for (name, weight, _), function in zip(products, variants[variant]):
                        x = inputs[weight.shape[1]]
                        started = time.perf_counter()
                        function(x)
                        spent[name] += time.perf_counter() - started
                if round_ >= 0:
                    for name in spent:
                        timings[variant][name].append(spent[name])
        calls = {name: steps * sum(1 for other, _, _ in products if other == name) for name, _, _ in products}
        table[rows] = {name: {variant: 1e6 * statistics.median(timings[variant][name]) / calls[name]
                              for variant in variants} for name in calls}
    shapes = {name: list(weight.shape) for name, weight, _ in products}
    return {"shapes": shapes, "us_a_call": table,
            "packed_by_default": {name: weight.numel() >= decoding.packed_min_elements()
                                  for name, weight, _ in products}}


def whole_decodings(model, batch_sizes: list[int], beams_list: list[int], new_tokens: int, repeats: int) -> list:
    """Tokens/s of the loops with the prepacked copies and on the parameters, per workload, paired ratios."""
    real_copies = decoding.decoding_weights
    cases = []
    for batch_size in batch_sizes:
        batch = random_batch(np.random.default_rng(0), batch_size, model.config.vocab_size)
        for num_beams in beams_list:
            config = fixed_length_generation_config(num_beams, new_tokens)

            def run(copies):
                decoding.decoding_weights = copies
                try:
                    return model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                          generation_config=config)
                finally:
                    decoding.decoding_weights = real_copies

            variants = {"prepacked": lambda: run(real_copies),
                        "parameters": lambda: run(lambda model: getattr(model, "decoding_weights", None))}
            if not torch.equal(variants["prepacked"](), variants["parameters"]()):
                raise SystemExit(f"batch {batch_size}, beams {num_beams}: the prepacked copies changed the tokens")
            seconds = time_alternating(variants, repeats)
            ratios = paired_ratios(seconds, slow="parameters", fast="prepacked")
            tokens = batch_size * new_tokens
            cases.append({"batch_size": batch_size, "num_beams": num_beams, "identical_tokens": True,
                          **{f"{name}_tokens_per_s": tokens / statistics.median(times)
                             for name, times in seconds.items()},
                          "ratio_median": statistics.median(ratios),
                          "ratio_quartiles": [float(np.percentile(ratios, 25)), float(np.percentile(ratios, 75))]})
    return cases


def token_choice(vocab_size: int, rows_list: list[int], repeats: int) -> list:
    cases = []
    for rows in rows_list:
        logits = torch.randn(rows, vocab_size)
        variants = {"max": lambda: logits.max(dim=-1).indices, "first_argmax": lambda: decoding.first_argmax(logits)}
        seconds = time_alternating({name: lambda f=f: [f() for _ in range(50)] for name, f in variants.items()},
                                   repeats)
        cases.append({"rows": rows, **{f"{name}_us": 1e6 * statistics.median(times) / 50
                                       for name, times in seconds.items()}})
    return cases


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--vocab_size", type=int, default=8000)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128])
    parser.add_argument("--steps", type=int, default=20, help="steps' worth of products per timing")
    parser.add_argument("--rounds", type=int, default=6, help="timings of each variant (alternated)")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=12, help="alternated decodings of each variant")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--output", default=str(RESULTS / "fp32_prepacked_products.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not decoding.fp32_prepacking_available():
        raise SystemExit("this torch cannot prepack fp32 weights for oneDNN: nothing to compare")
    torch.manual_seed(0)
    model = ScratchTransformerForConditionalGeneration(our_config(args.preset, args.vocab_size)).eval()
    load_before = loadavg()
    with torch.no_grad():
        products = products_in_step_order(model, args.rows, args.steps, args.rounds)
        decodings = whole_decodings(model, args.batch_sizes, args.beams, args.new_tokens, args.repeats)
        choice = token_choice(args.vocab_size, [1, 8, 16, 32, 128], args.rounds)
    results = {"settings": vars(args), "machine": machine_info(args.threads), "commit": git_commit(),
               "load_before": load_before, "load_after": loadavg(),
               "packed_min_elements": decoding.packed_min_elements(),
               "argmax_by_blocks_min_rows": decoding.ARGMAX_BY_BLOCKS_MIN_ROWS,
               "products": products, "decodings": decodings, "token_choice": choice}
    text = markdown(results, args)
    write_results(results, args.output, text)
    print(text)
    return results


def markdown(results: dict, args) -> str:
    products = results["products"]
    lines = ["# fp32 decoding by prepacked weights", "",
             f"{machine_line(results['machine'])} Load average {results['load_before']} before, "
             f"{results['load_after']} after.{' ' + args.note if args.note else ''}", "",
             f"Preset {args.preset}, vocabulary {args.vocab_size:,}, random weights.", "",
             "## Products in a step's order", "",
             f"µs a call, F.linear / PackedLinear (median of {args.rounds} alternated timings of {args.steps} steps' "
             "products, each product called in the step's order; the faster in bold). Last column: whether the loops "
             f"multiply by a prepacked copy (weights of {results['packed_min_elements']:,} elements or more).", "",
             "| product (out × in) | " + " | ".join(f"{rows} row{'s' if rows > 1 else ''}" for rows in args.rows)
             + " | prepacked |", "|---|" + "---:|" * (len(args.rows) + 1)]
    for name, shape in products["shapes"].items():
        cells = []
        for rows in args.rows:
            plain, packed = (products["us_a_call"][rows][name][variant] for variant in ("F.linear", "PackedLinear"))
            cells.append(f"{plain:.0f} / **{packed:.0f}**" if packed < plain else f"**{plain:.0f}** / {packed:.0f}")
        lines.append(f"| {name} ({shape[0]} × {shape[1]}) | " + " | ".join(cells)
                     + f" | {'yes' if products['packed_by_default'][name] else 'no'} |")
    lines += ["", "## Whole decodings", "",
              f"Exactly {args.new_tokens} new tokens a sentence; new tokens/s (median of {args.repeats} alternated "
              "decodings each); ratio: the paired ratios' median (quartiles). The tokens were identical in every "
              "workload.", "",
              "| workload | prepacked | parameters | ratio |", "|---|---:|---:|---:|"]
    for case in results["decodings"]:
        low, high = case["ratio_quartiles"]
        workload = "greedy" if case["num_beams"] == 1 else f"beam {case['num_beams']}"
        lines.append(f"| {workload}, batch {case['batch_size']} | {case['prepacked_tokens_per_s']:,.0f} | "
                     f"{case['parameters_tokens_per_s']:,.0f} | **{case['ratio_median']:.2f}x** "
                     f"({low:.2f}-{high:.2f}) |")
    lines += ["", "## The greedy token choice", "",
              f"µs over (rows, {args.vocab_size:,}) logits: torch's max with indices / `first_argmax` (by blocks from "
              f"{results['argmax_by_blocks_min_rows']} rows).", "",
              "| rows | max | first_argmax |", "|---:|---:|---:|"]
    lines += [f"| {case['rows']} | {case['max_us']:.0f} | {case['first_argmax_us']:.0f} |"
              for case in results["token_choice"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
