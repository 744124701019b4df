#!/usr/bin/env python
"""This CPU's matrix-multiply peak in fp32 and bf16: square `torch.mm` of 1,024 to 8,192, at 1 thread and at all
cores, the two dtypes alternated product by product (ABAB), so that a load that comes and goes hits both.

    python benchmarks/matmul_peak.py                    # sizes 1024 2048 4096 8192, 5 rounds (~3-5 min on 2 cores)
    python benchmarks/matmul_peak.py --quick            # sizes 1024 2048, 3 rounds (seconds)
    python benchmarks/matmul_peak.py --sizes 2048 4096 --rounds 7 --threads 1 2
    python benchmarks/matmul_peak.py --precisions fp32 bf16 --sizes 1024   # bf16 on a CPU without bf16 units too

On a CPU without bf16 units (neither AMX nor AVX-512 BF16) bf16 is emulated and only fp32 is timed unless
`--precisions` asks for bf16: there a 1,024-square bf16 product ran at 0.9 GFLOP/s (AMD EPYC with AVX2 only,
against 80-106 in fp32), so the default sizes would take an hour.

The timing is the package's (hf_scratch_transformer.training.flops: `square_operands`, `timed_matmul`), the one
train.py's `train_mfu` divides by; each (dtype, size) gets one untimed product first. Writes
benchmarks/results/matmul_peak_<cpu>.json and .md, naming the CPU (model, AMX / AVX-512 BF16 / neither) and the load
average before and after. Run it on a quiet machine: another process on the cores lowers every figure.
"""

from __future__ import annotations

import argparse
import re

import torch

from common import RESULTS, alternate, loadavg, machine_info, machine_line, median, write_results

from hf_scratch_transformer.cpu_threads import available_cores, cpu_bf16_units, cpu_model_and_flags
from hf_scratch_transformer.training.flops import PRECISION_DTYPES, square_operands, timed_matmul

PRECISIONS = ("fp32", "bf16")


def default_precisions() -> list[str]:
    """fp32, and bf16 where the CPU has bf16 matrix units (elsewhere it is emulated, and very slow)."""
    return list(PRECISIONS) if cpu_bf16_units() else ["fp32"]


def cpu_slug() -> str:
    """A file-name form of the CPU: its model name without trademarks, and its bf16 units ("amx", "avx512_bf16",
    "no_bf16")."""
    name = re.sub(r"\((R|TM|tm|r)\)|\bCPU\b|\bProcessor\b|@.*", " ", cpu_model_and_flags()[0])
    units = (cpu_bf16_units() or "no bf16").lower().replace("-", "").replace(" ", "_")
    return "_".join(re.findall(r"[a-z0-9]+", name.lower()) + [units])


def measure_threads(threads: int, sizes: list[int], rounds: int, precisions: list[str]) -> dict:
    """{precision: {size: [GFLOP/s of each round]}} at `threads` threads: per size, one untimed product per dtype,
    then `rounds` rounds of one product per dtype in alternating order."""
    torch.set_num_threads(threads)
    rates = {precision: {} for precision in precisions}
    for size in sizes:
        operands = {precision: square_operands(size, PRECISION_DTYPES[precision]) for precision in precisions}
        for precision in precisions:
            timed_matmul(operands[precision])
        for precision in precisions:
            rates[precision][str(size)] = []
        for round_ in range(rounds):
            for precision in alternate(list(precisions), round_):
                rates[precision][str(size)].append(round(timed_matmul(operands[precision]) / 1e9, 1))
        print(f"{threads} thread(s), {size}: " + ", ".join(
            f"{precision} {median(rates[precision][str(size)]):.0f} GFLOP/s" for precision in precisions), flush=True)
        del operands
    return rates


def summary(rates: dict) -> dict:
    """{precision: {"peak_gflops", "best_size"}}: the best median over the sizes."""
    out = {}
    for precision, by_size in rates.items():
        best = max(by_size, key=lambda size: median(by_size[size]))
        out[precision] = {"peak_gflops": median(by_size[best]), "best_size": int(best)}
    if "bf16" in out and "fp32" in out:
        out["bf16_over_fp32"] = out["bf16"]["peak_gflops"] / out["fp32"]["peak_gflops"]
    return out


def render(results: dict) -> str:
    machine = results["machine"]
    precisions = results.get("precisions", list(PRECISIONS))
    both = int("fp32" in precisions and "bf16" in precisions)
    lines = [f"# Matrix-multiply peak of this CPU: {machine['cpu']}", "",
             f"bf16 matrix units: **{results['bf16_units'] or 'none (bf16 is emulated)'}**; AVX-512 "
             f"{'yes' if machine['avx512f'] else 'no'}. {machine_line(machine)}",
             f"Load average (1, 5, 15 min) before: {results['loadavg_before']}, after: {results['loadavg_after']}.",
             f"Square `torch.mm`, GFLOP/s (2·n³ / seconds of one product): median of {results['rounds']} rounds, "
             f"{' and '.join(precisions)} alternated product by product (ABAB), min-max in brackets; one untimed "
             "product each first.", "",
             f"| threads | size | {' | '.join(precisions)} |{' bf16 / fp32 |' if both else ''}",
             f"|---:|---:|{'---:|' * (len(precisions) + both)}"]
    for threads, rates in results["gflops"].items():
        for size in rates[precisions[0]]:
            cells = [f"{median(rates[p][size]):,.0f} ({min(rates[p][size]):,.0f}-{max(rates[p][size]):,.0f})"
                     for p in precisions]
            ratio = [f"{median(rates['bf16'][size]) / median(rates['fp32'][size]):.2f}x"] if both else []
            lines.append(f"| {threads} | {size} | " + " | ".join(cells + ratio) + " |")
    lines += ["", f"| threads | {' | '.join(f'{p} peak' for p in precisions)} |{' bf16 / fp32 |' if both else ''}",
              f"|---:|{'---:|' * (len(precisions) + both)}"]
    for threads, peak in results["peaks"].items():
        cells = [f"**{peak[p]['peak_gflops']:,.0f}** GFLOP/s (n={peak[p]['best_size']})" for p in precisions]
        ratio = [f"{peak['bf16_over_fp32']:.2f}x"] if both else []
        lines.append(f"| {threads} | " + " | ".join(cells + ratio) + " |")
    lines += ["", "train.py measures the same products in about a second at the start of training, in the precision "
              "it trains in, and divides its model FLOP/s by that (`train_mfu` in train_results.json; "
              "docs/training.md, \"FLOPs and MFU\")."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="sizes 1024 2048, 3 rounds")
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="default 1024 2048 4096 8192")
    ap.add_argument("--rounds", type=int, default=None, help="timed products per dtype and size (default 5)")
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1 and all available cores")
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=None,
                    help="default: fp32, and bf16 where the CPU has bf16 matrix units")
    ap.add_argument("--output", default=None, help="default results/matmul_peak_<cpu>.json (.md beside it)")
    args = ap.parse_args(argv)
    precisions = args.precisions or default_precisions()
    sizes = args.sizes or ([1024, 2048] if args.quick else [1024, 2048, 4096, 8192])
    rounds = args.rounds or (3 if args.quick else 5)
    thread_counts = args.threads or sorted({1, available_cores()})
    before = loadavg()
    gflops = {str(threads): measure_threads(threads, sizes, rounds, precisions) for threads in thread_counts}
    results = {"machine": machine_info(max(thread_counts)), "bf16_units": cpu_bf16_units(), "sizes": sizes,
               "precisions": precisions,
               "rounds": rounds, "loadavg_before": before, "loadavg_after": loadavg(), "gflops": gflops,
               "peaks": {threads: summary(rates) for threads, rates in gflops.items()}}
    out = args.output or RESULTS / f"matmul_peak_{cpu_slug()}.json"
    markdown = render(results)
    write_results(results, out, markdown)
    print(markdown)
    return results


if __name__ == "__main__":
    main()
