"""`--bf16` on a CPU: does bf16 autocast make train.py's training step faster than fp32 on this CPU?

    python benchmarks/cpu_precision.py                      # small preset, 1,024-token batches, 1 and 2 threads
    python benchmarks/cpu_precision.py --threads 1 --passes 4
    python benchmarks/cpu_precision.py --busy                # one core spun by another process

Two copies of the same model (the `small` preset and train.py's default BPE vocabulary; the results record
`vocab_size`: 4,000 in the files of before its default became 8,000), each with its own fused Adam,
train on the same train.py batches: one in fp32, one under `torch.autocast("cpu", dtype=torch.bfloat16)` (what
Accelerate's `mixed_precision="bf16"`, i.e. `--bf16`, does). The step is train.py's: forward with label smoothing
0.1, backward, gradient clipping, Adam. The two are timed in alternation (ABAB), a pass over the batches each, and
the per-pass ratios are reported (adjacent in time, so they cancel most of the load of other jobs). Also: a matmul
of the model's own shapes (1,024 tokens x 256 -> 1,024) and a large square one in fp32 and bf16, which says whether
the CPU has fast bf16 matrix units (AMX: `amx_tile` in /proc/cpuinfo; AVX-512 BF16: `avx512_bf16`), and the training
loss of both copies on a held-out batch after the timed passes (same start, same batches: a first look at whether bf16
changes what is learnt, not a BLEU figure). `--busy` measures with a process spinning on the last core, as another
program would. Results: `benchmarks/results/cpu_precision.{json,md}` (`_PRESET` for other presets, `_amx` on a CPU with
AMX, `_busy` with one core busy).
"""

import argparse
import os
import statistics

import torch
from datasets import disable_progress_bars

from common import (RESULTS, cpu_model_and_flags, machine_info, machine_line, our_config, paired_ratios,
                    time_alternating, time_call, train_py_batches, write_results)
from cpu_threads import start_hog
from training_throughput import make_step

from hf_scratch_transformer import ScratchTransformerForConditionalGeneration
from hf_scratch_transformer.data.loading import DataArguments


def training_pass(model, optimizer, batches: list[dict], bf16: bool):
    """A function that trains `model` on every batch once, with training_throughput.py's train.py step."""
    step = make_step("scratch", model, optimizer, torch.device("cpu"), torch.bfloat16 if bf16 else torch.float32)

    def run() -> None:
        for batch in batches:
            step(batch)

    return run


def matmul_seconds(shape: tuple[int, int, int], dtype: torch.dtype) -> float:
    """Median seconds of an (m x k) @ (k x n) matmul in `dtype`."""
    m, k, n = shape
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    return time_call(lambda: a @ b, repeats=20, warmup=3)


def measure(threads: int, batches: list[dict], held_out: dict, vocab_size: int, passes: int,
            preset: str = "small") -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = our_config(preset, vocab_size=vocab_size)
    models = {"fp32": ScratchTransformerForConditionalGeneration(config).train()}
    models["bf16"] = ScratchTransformerForConditionalGeneration(config).train()
    models["bf16"].load_state_dict(models["fp32"].state_dict())
    runs = {}
    for name, model in models.items():
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9, fused=True)
        runs[name] = training_pass(model, optimizer, batches, bf16=name == "bf16")
    seconds = time_alternating(runs, repeats=passes, warmup=1)
    ratios = paired_ratios(seconds, "fp32", "bf16")  # > 1: bf16 faster
    tokens = sum(int(b["attention_mask"].sum()) + int((b["labels"] != -100).sum()) for b in batches)
    with torch.no_grad():
        losses = {name: round(float(model.eval()(**held_out).loss), 4) for name, model in models.items()}
    matmuls = {}
    width = config.d_model
    for label, shape in ((f"model shape 1024x{width} @ {width}x1024", (1024, width, 1024)), ("square 2048", (2048,) * 3)):
        fp32, bf16 = matmul_seconds(shape, torch.float32), matmul_seconds(shape, torch.bfloat16)
        matmuls[label] = {"fp32_seconds": fp32, "bf16_seconds": bf16, "bf16_speedup": fp32 / bf16}
    return {"threads": threads, "seconds_per_pass": seconds,
            "tokens_per_second": {name: tokens / statistics.median(s) for name, s in seconds.items()},
            "bf16_speedup_per_pass": ratios, "bf16_speedup_median": statistics.median(ratios),
            "held_out_loss_after_training": losses, "matmul": matmuls}


def render(results: dict) -> str:
    machine = results["machine"]
    lines = ["# `--bf16` against fp32 on the CPU (`benchmarks/cpu_precision.py`)", "",
             machine_line(machine) + f" AMX: {'yes' if machine['amx'] else 'no'}; AVX-512 BF16: "
             f"{'yes' if results['avx512_bf16'] else 'no'}. Load average before {results['load_before']}, after "
             f"{machine['loadavg']}. "
             + ("**Busy**: a process spun on the last core throughout. " if results.get("busy") else "")
             + results["note"], "",
             f"`{results.get('preset', 'small')}` preset, BPE {results['vocab_size']:,}, {results['batches']} train.py batches of "
             f"{results['max_tokens']:,} tokens per pass, {results['passes']} passes per precision in alternation "
             "(ABAB); speed-up = fp32 seconds / bf16 seconds of adjacent passes (median, min-max). "
             "Loss: label-smoothed "
             "training loss of each copy on a held-out batch after the passes (same start, same batches).", "",
             "| threads | fp32 tokens/s | bf16 tokens/s | bf16 speed-up | held-out loss fp32 / bf16 | matmul bf16 "
             "speed-up: model shape / square 2048 |", "|---:|---:|---:|---:|---:|---:|"]
    for row in results["rows"]:
        ratios, matmul = row["bf16_speedup_per_pass"], list(row["matmul"].values())
        lines.append(f"| {row['threads']} | {row['tokens_per_second']['fp32']:,.0f} | "
                     f"{row['tokens_per_second']['bf16']:,.0f} | **{row['bf16_speedup_median']:.2f}×** "
                     f"({min(ratios):.2f}-{max(ratios):.2f}) | {row['held_out_loss_after_training']['fp32']} / "
                     f"{row['held_out_loss_after_training']['bf16']} | {matmul[0]['bf16_speedup']:.2f}× / "
                     f"{matmul[1]['bf16_speedup']:.2f}× |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, default=12, help="train.py batches per pass")
    parser.add_argument("--passes", type=int, default=6, help="timed passes per precision (ABAB)")
    parser.add_argument("--max_tokens", type=int, default=1024)
    parser.add_argument("--vocab_size", type=int, default=DataArguments.tokenizer_vocab_size)
    parser.add_argument("--preset", default="small", help="model size (results: cpu_precision.json for small, "
                        "cpu_precision_PRESET.json for the others; cpu_precision_amx*.json on a CPU with AMX)")
    parser.add_argument("--busy", action="store_true", help="measure with one core busy: a process spinning on the "
                        "last core throughout (results: cpu_precision*_busy.json)")
    parser.add_argument("--note", default="", help="what else ran on the machine")
    args = parser.parse_args()
    disable_progress_bars()
    load_before = machine_info(0)["loadavg"]
    batches, vocab_size, _ = train_py_batches(args.batches + 1, args.max_tokens, args.vocab_size, spread=True)
    hog = start_hog(len(os.sched_getaffinity(0)) - 1) if args.busy else None
    try:
        rows = [measure(threads, batches[:-1], batches[-1], vocab_size, args.passes, args.preset)
                for threads in args.threads]
    finally:
        if hog is not None:
            hog.kill()
    results = {"machine": machine_info(max(args.threads)), "busy": args.busy, "avx512_bf16": "avx512_bf16" in cpu_model_and_flags()[1],
               "load_before": load_before, "note": args.note, "vocab_size": vocab_size, "batches": args.batches,
               "max_tokens": args.max_tokens, "passes": args.passes, "preset": args.preset, "rows": rows}
    amx = "amx_tile" in cpu_model_and_flags()[1]
    name = ("cpu_precision" + ("_amx" if amx else "") + ("" if args.preset == "small" else f"_{args.preset}")
            + ("_busy" if args.busy else ""))
    write_results(results, RESULTS / f"{name}.json", render(results))
    print(render(results))


if __name__ == "__main__":
    main()
