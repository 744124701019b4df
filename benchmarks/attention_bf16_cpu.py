#!/usr/bin/env python
"""torch's CPU scaled-dot-product attention, forward + backward, in fp32, in bf16, and in fp32 for bf16 inputs (what
the model does when it trains in bf16 on a CPU), at the shapes of train.py's default batches: 30 sentences of 34
tokens, the small preset's 4 heads of 64. CPU time of one thread (`time.thread_time`), ABAB over the variants,
median of the repetitions; the machine, its bf16 units and the load average are recorded.

    python benchmarks/attention_bf16_cpu.py               # writes results/attention_bf16_cpu.json and .md
    python benchmarks/attention_bf16_cpu.py --threads 2

The finding (torch 2.13, an Intel Xeon with AMX): the flash-attention kernel's backward runs 5-6x slower in bf16
than in fp32, so bf16 training spent a third of its step there; the model attends in fp32 when it trains in bf16
on a CPU (modeling_scratch_transformer.MultiHeadAttention).
"""

import argparse
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import RESULTS, alternate, machine_info, machine_line, write_results
from hf_scratch_transformer.cpu_threads import cpu_bf16_units

BATCH, HEADS, LENGTH, HEAD_DIM = 30, 4, 34, 64


def variant(dtype: torch.dtype, in_fp32: bool, causal: bool, backend: SDPBackend):
    """A forward + backward of one attention call with fresh inputs of `dtype` (cast to fp32 first if `in_fp32`)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, LENGTH, HEAD_DIM, generator=generator).to(dtype).requires_grad_()
               for _ in range(3))
    mask = None if causal else torch.ones(BATCH, 1, 1, LENGTH, dtype=torch.bool)

    def run() -> None:
        query, key, value = (q.float(), k.float(), v.float()) if in_fp32 else (q, k, v)
        with sdpa_kernel(backend):
            output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                                      is_causal=causal)
        output.to(dtype).sum().backward()
    return run


def measure(threads: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    results = {}
    for causal in (False, True):
        runs = {"fp32": variant(torch.float32, False, causal, SDPBackend.FLASH_ATTENTION),
                "bf16": variant(torch.bfloat16, False, causal, SDPBackend.FLASH_ATTENTION),
                "bf16 in fp32": variant(torch.bfloat16, True, causal, SDPBackend.FLASH_ATTENTION),
                "bf16, math kernel": variant(torch.bfloat16, False, causal, SDPBackend.MATH)}
        for run in runs.values():
            run()
        seconds = {name: [] for name in runs}
        for repeat in range(repeats):
            for name in alternate(list(runs), repeat):
                started = time.thread_time()
                runs[name]()
                seconds[name].append(time.thread_time() - started)
        results["causal" if causal else "padding mask"] = {
            name: round(statistics.median(values) * 1000, 3) for name, values in seconds.items()}
    return results


def render(results: dict) -> str:
    lines = ["# CPU attention in bf16: forward + backward", "", machine_line(results["machine"]) + f" bf16 units: "
             f"{results['bf16_units'] or 'none'}; load average before/after {results['load_before']} / "
             f"{results['machine']['loadavg']}.", "",
             f"One `scaled_dot_product_attention` call and its backward, (B, H, T, Dh) = ({BATCH}, {HEADS}, {LENGTH}, "
             f"{HEAD_DIM}); milliseconds of CPU time, median of {results['repeats']} ABAB repetitions.", "",
             "| mask | fp32 | bf16 | bf16 in fp32 | bf16, math kernel | bf16 / fp32 |", "|---|---:|---:|---:|---:|---:|"]
    for mask, row in results["milliseconds"].items():
        lines.append(f"| {mask} | {row['fp32']} | {row['bf16']} | {row['bf16 in fp32']} | {row['bf16, math kernel']} | "
                     f"{row['bf16'] / row['fp32']:.1f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    load_before = machine_info(args.threads)["loadavg"]
    milliseconds = measure(args.threads, args.repeats)
    results = {"milliseconds": milliseconds, "repeats": args.repeats, "bf16_units": cpu_bf16_units(),
               "load_before": load_before, "machine": machine_info(args.threads)}
    suffix = "" if args.threads == 1 else f"_{args.threads}threads"
    write_results(results, RESULTS / f"attention_bf16_cpu{suffix}.json", render(results))
    print(render(results))


if __name__ == "__main__":
    main()
