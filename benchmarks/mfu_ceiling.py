"""What MFU a training step's own matrix shapes allow (issue: speed to the CPU's limit): each weight product of a
step, forward and both backward products, timed alone with `torch.mm` in the run's dtype at a default batch's token
counts, against the square-matrix peak that train.py's `train_mfu` divides by, measured in the same run.

    python benchmarks/mfu_ceiling.py                                  # small preset, bf16, train.py's default batch
    python benchmarks/mfu_ceiling.py --dtype fp32 --output benchmarks/results/mfu_ceiling_fp32.json

A step multiplies N tokens (rows) by each weight (out × in): forward (N × in)·(in × out), the input gradient
(N × out)·(out × in) and the weight gradient (out × N)·(N × in), the same FLOPs each. Source tokens go through the
encoder's weights and the decoder's cross-attention key and value projections, target tokens through the decoder's
other weights and the output projection (`training.flops.matmul_weights_per_token`, the FLOP count train.py uses).
Each distinct shape is timed (`--repeats` alternated rounds after one untimed product); the step's rate is all
their FLOPs (each shape times the weights of that shape) over all their time. That is a ceiling for the step's MFU:
attention's products (1.5 % of the model FLOPs at sentences of 30 tokens), the norms, softmaxes, casts and the
optimiser, which cost time and count no or few FLOPs, come on top. The defaults are the default run's batches on the
shipped corpus (3,959 tokens a step, source and target about equal; `train_tokens` / `train_steps`). Results:
`benchmarks/results/mfu_ceiling.json` and `.md` (machine, load, commit).
"""

import argparse
import statistics
import time

import torch
from common import RESULTS, alternate, git_commit, loadavg, machine_info, machine_line, our_config, write_results

from hf_scratch_transformer.training.flops import PRECISION_DTYPES, matmul_peak_flops, matmul_weights_per_token

KINDS = ("forward", "input gradient", "weight gradient")


def weight_shapes(config, source_tokens: int, target_tokens: int) -> list[dict]:
    """The distinct (rows, out, in) of a step's weight products, with how many weights of that shape it multiplies
    and which tokens (side) go through them; per token of each side they add up to `matmul_weights_per_token`."""
    width, vocab = config.d_model, config.vocab_size
    encoder, decoder = config.encoder_layers, config.decoder_layers
    shapes = [
        ("encoder square (Q, K, V, output)", "source", width, width, 4 * encoder),
        ("encoder feed-forward in", "source", config.encoder_ffn_dim, width, encoder),
        ("encoder feed-forward out", "source", width, config.encoder_ffn_dim, encoder),
        ("cross-attention keys, values", "source", width, width, 2 * decoder),
        ("decoder square (self Q, K, V, output; cross Q, output)", "target", width, width, 6 * decoder),
        ("decoder feed-forward in", "target", config.decoder_ffn_dim, width, decoder),
        ("decoder feed-forward out", "target", width, config.decoder_ffn_dim, decoder),
        ("output projection", "target", vocab, width, 1),
    ]
    weights = matmul_weights_per_token(config)
    per_token = {side: sum(out * inputs * count for _, s, out, inputs, count in shapes if s == side)
                 for side in ("source", "target")}
    assert per_token == {"source": weights["encoder_per_source_token"] + weights["cross_key_value_per_source_token"],
                         "target": weights["decoder_per_target_token"]}, "the shapes miss weights the FLOPs count"
    tokens = {"source": source_tokens, "target": target_tokens}
    return [dict(name=name, side=side, rows=tokens[side], out=out, inputs=inputs, count=count)
            for name, side, out, inputs, count in shapes]


def operands(shape: dict, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The two matrices of one product of `shape`: forward, input gradient or weight gradient."""
    rows, out, inputs = shape["rows"], shape["out"], shape["inputs"]
    sizes = {"forward": ((rows, inputs), (inputs, out)), "input gradient": ((rows, out), (out, inputs)),
             "weight gradient": ((out, rows), (rows, inputs))}[kind]
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*size, generator=generator).to(dtype) for size in sizes)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--vocab_size", type=int, default=8032,
                        help="the default run's tokenizer: BPE 8,000 and its special tokens")
    parser.add_argument("--source_tokens", type=int, default=1980)
    parser.add_argument("--target_tokens", type=int, default=1979)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--repeats", type=int, default=5, help="alternated rounds over every product")
    parser.add_argument("--peak_seconds", type=float, default=2.0, help="each square-peak measurement (before, after)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--output", default=str(RESULTS / "mfu_ceiling.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = PRECISION_DTYPES[args.dtype]
    load_before = loadavg()
    peaks = [matmul_peak_flops(dtype, seconds=args.peak_seconds)]
    shapes = weight_shapes(our_config(args.preset, args.vocab_size), args.source_tokens, args.target_tokens)
    products = [(index, kind, operands(shape, kind, dtype)) for index, shape in enumerate(shapes) for kind in KINDS]
    for _, _, (left, right) in products:  # untimed first products
        torch.mm(left, right)
    seconds = {(index, kind): [] for index, kind, _ in products}
    for round_ in range(args.repeats):
        for index, kind, (left, right) in alternate(products, round_):
            started = time.perf_counter()
            torch.mm(left, right)
            seconds[(index, kind)].append(time.perf_counter() - started)
    peaks.append(matmul_peak_flops(dtype, seconds=args.peak_seconds))
    rows, total_flops, total_seconds = [], 0.0, 0.0
    for index, shape in enumerate(shapes):
        flops = 2 * shape["rows"] * shape["out"] * shape["inputs"]
        times = {kind: statistics.median(seconds[(index, kind)]) for kind in KINDS}
        rows.append({**shape, "flops_per_product": flops,
                     "gflops_per_second": {kind: flops / time_ / 1e9 for kind, time_ in times.items()}})
        total_flops += shape["count"] * flops * len(KINDS)
        total_seconds += shape["count"] * sum(times.values())
    peak = max(peaks)
    rate = total_flops / total_seconds
    results = {"settings": vars(args), "machine": machine_info(args.threads), "commit": git_commit(),
               "load_before": load_before, "load_after": loadavg(), "square_peaks_flops": peaks, "shapes": rows,
               "step_weight_flops": total_flops, "step_weight_seconds": total_seconds,
               "weight_products_flops_per_second": rate, "ceiling_mfu": rate / peak}
    text = markdown(results, args)
    write_results(results, args.output, text)
    print(text)
    return results


def markdown(results: dict, args) -> str:
    peaks = ", ".join(f"{peak / 1e9:,.0f}" for peak in results["square_peaks_flops"])
    lines = ["# What MFU a training step's own matrix shapes allow", "",
             f"{machine_line(results['machine'])} Load average {results['load_before']} before, "
             f"{results['load_after']} after.{' ' + args.note if args.note else ''}", "",
             f"Preset {args.preset}, vocabulary {args.vocab_size:,}, {args.dtype}; a step of {args.source_tokens:,} "
             f"source and {args.target_tokens:,} target tokens. Each weight product alone (`torch.mm`, median of "
             f"{args.repeats} alternated rounds), GFLOP/s. Square-matrix peak (train.py's `train_mfu` divisor), "
             f"before and after: {peaks} GFLOP/s.", "",
             "| weights (rows × out × in) | weights a step | forward | input gradient | weight gradient |",
             "|---|---:|---:|---:|---:|"]
    for row in results["shapes"]:
        rates = row["gflops_per_second"]
        lines.append(f"| {row['name']} ({row['rows']:,} × {row['out']:,} × {row['inputs']:,}) | {row['count']} | "
                     + " | ".join(f"{rates[kind]:,.0f}" for kind in KINDS) + " |")
    rate, flops = results["weight_products_flops_per_second"], results["step_weight_flops"]
    lines += ["", f"**The step's weight products alone: {rate / 1e9:,.0f} GFLOP/s, {results['ceiling_mfu']:.1%} of the "
                  f"square peak** ({flops / 1e9:,.1f} GFLOP in {results['step_weight_seconds'] * 1e3:,.1f} ms): a "
                  "ceiling for the step's MFU, before attention, the element-wise work and the optimiser."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
