"""Training throughput and model-FLOPs utilisation (MFU) of this model against MarianMT of the same size, on
train.py's own batches (the shipped corpus, its joint BPE tokenizer, token-bucketed batches).

    python benchmarks/training_throughput.py                                # GPU: base, bf16, 32k-token batches
    python benchmarks/training_throughput.py --compile                      # also torch.compile both models
    python benchmarks/training_throughput.py --quick                        # CPU smoke: tiny, fp32, 1k tokens

Each step is what train.py does: forward with label smoothing 0.1, backward, gradient clipping, a fused Adam
step; bf16 through torch.autocast (Accelerate's mixed precision). Ours computes its logits and the
label-smoothed loss in forward, as train.py does; MarianMT computes its logits and the same loss here. Both models
start from the same weights (copied). The two are timed in alternation (ABAB) and the median of the repetitions
is reported.

MFU = model FLOPs of the step (the package's `training.flops`: 6 x matmul weights x non-pad tokens + attention) /
step time / the peak measured on the same device for the same dtype with torch.mm (`training.flops.matmul_flops`,
the timing train.py's own MFU uses). Results go to
`benchmarks/results/training_throughput_<device>.json` and `.md`.
"""

import argparse
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from datasets import disable_progress_bars

from common import RESULTS, VOCAB, batch_flops, build_pair, machine_info, train_py_batches, write_results

from hf_scratch_transformer.training.flops import matmul_flops
from hf_scratch_transformer.training.loss import teacher_forced_loss

LABEL_SMOOTHING = 0.1


def corpus_batches(max_tokens: int, count: int, vocab_size: int, max_train_samples: int | None = None) -> list[dict]:
    """`count` training batches exactly as train.py forms them (shuffled token buckets of `max_tokens`)."""
    batches, tokenizer_size, _ = train_py_batches(count, max_tokens, vocab_size, max_train_samples)
    if tokenizer_size > VOCAB:
        raise SystemExit(f"the tokenizer has {tokenizer_size} tokens, the models {VOCAB}")
    return batches


def matmul_peak(device: torch.device, dtype: torch.dtype, sizes=(4096, 8192)) -> float:
    """Best median FLOP/s of a square torch.mm in `dtype` on `device`."""
    return max(statistics.median(matmul_flops(n, dtype, device, seconds=0.0, min_repeats=5)) for n in sizes)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_step(name: str, model, optimizer, device: torch.device, dtype: torch.dtype):
    """One train.py step of `model` on a batch already on `device`."""
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext())

    def step(batch: dict) -> None:
        with autocast:
            if name == "scratch":
                loss = teacher_forced_loss(model, batch, LABEL_SMOOTHING)  # train.py's loss
            else:
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               labels=batch["labels"]).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                                       ignore_index=-100, label_smoothing=LABEL_SMOOTHING)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(args) -> dict:
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    batches = [{key: value.to(device) for key, value in batch.items()}
               for batch in corpus_batches(args.max_tokens, args.steps, args.vocab_size,
                                           2000 if args.quick else None)]
    ours, marian = build_pair(args.preset)
    config = ours.config
    models = {"scratch": ours.to(device).train(), "marian": marian.to(device).train()}
    steps = {}
    for name, model in models.items():
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
        compiled = torch.compile(model) if args.compile else model
        steps[name] = make_step(name, compiled, optimizer, device, dtype)
    for name in models:  # warm-up: allocator, autotuning, compilation
        for batch in batches[: args.warmup]:
            steps[name](batch)
    _sync(device)
    seconds = {name: [] for name in models}
    for repetition in range(args.repeats):
        for name in (list(models) if repetition % 2 == 0 else list(models)[::-1]):
            _sync(device)
            started = time.perf_counter()
            for batch in batches:
                steps[name](batch)
            _sync(device)
            seconds[name].append(time.perf_counter() - started)
    tokens = sum(int(b["attention_mask"].sum()) + int((b["labels"] != -100).sum()) for b in batches)
    padded = sum(b["input_ids"].numel() + b["labels"].numel() for b in batches)
    flops = sum(batch_flops(config, {key: value.cpu() for key, value in batch.items()}) for batch in batches)
    peak = matmul_peak(device, dtype, sizes=(1024, 2048) if args.quick else (4096, 8192))
    results = {"settings": vars(args), "device_name": _device_name(device), "torch": torch.__version__,
               "machine": machine_info(torch.get_num_threads()),
               "batches": len(batches), "non_pad_tokens_per_pass": tokens, "padding_fraction": 1 - tokens / padded,
               "model_flops_per_pass": flops, "matmul_peak_flops": peak, "models": {}}
    for name in models:
        median = statistics.median(seconds[name])
        results["models"][name] = {"seconds_per_pass": seconds[name], "tokens_per_second": tokens / median,
                                   "achieved_tflops": flops / median / 1e12, "mfu": flops / median / peak}
    results["speedup_vs_marian"] = (results["models"]["scratch"]["tokens_per_second"]
                                    / results["models"]["marian"]["tokens_per_second"])
    return results


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
           if line.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
    return f"{cpu[0] if cpu else 'CPU'}, {torch.get_num_threads()} threads"


def render(results: dict) -> str:
    settings = results["settings"]
    lines = [f"# Training throughput: {settings['preset']}, {settings['dtype']}, batches of ≤ "
             f"{settings['max_tokens']} tokens{', torch.compile' if settings['compile'] else ''}", "",
             f"Device: {results['device_name']}; torch {results['torch']}. {results['batches']} train.py batches "
             f"({results['non_pad_tokens_per_pass']:,} non-pad tokens, {results['padding_fraction']:.1%} padding) "
             f"per pass, {settings['repeats']} passes per model in alternation, median. Measured {settings['dtype']} "
             f"torch.mm peak: {results['matmul_peak_flops'] / 1e12:.1f} TFLOP/s.", "",
             "| model | non-pad tokens/s | model TFLOP/s | MFU |", "|---|---:|---:|---:|"]
    for name, row in results["models"].items():
        lines.append(f"| {name} | {row['tokens_per_second']:,.0f} | {row['achieved_tflops']:.2f} | "
                     f"{row['mfu']:.1%} |")
    lines += ["", f"Speed-up against MarianMT: {results['speedup_vs_marian']:.2f}×."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--max_tokens", type=int, default=32768)
    parser.add_argument("--vocab_size", type=int, default=VOCAB, help="of the tokenizer (the models have VOCAB rows)")
    parser.add_argument("--steps", type=int, default=20, help="batches per timed pass")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="CPU smoke: tiny preset, fp32, 1024-token batches")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.dtype, args.max_tokens, args.steps, args.warmup, args.repeats = "tiny", "fp32", 1024, 3, 1, 2
        args.vocab_size = 1000  # a 2,000-pair slice of the corpus
    disable_progress_bars()
    results = measure(args)
    output = Path(args.output or RESULTS / f"training_throughput_{torch.device(args.device).type}.json")
    write_results(results, output, render(results))
    print(render(results))
    return results


if __name__ == "__main__":
    main()
