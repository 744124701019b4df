"""Attention of a bf16 training step on a CPU: the package's (the formula with bf16 products under autocast, on
sdpa's masks) against torch's scaled_dot_product_attention in fp32 (the inputs cast, as the model did before)
(issue: speed to the CPU's limit).

    python benchmarks/training_attention_bf16.py                  # small preset, 2 threads, 24 batches of ~2,048 tokens
    python benchmarks/training_attention_bf16.py --threads 1 --output results/training_attention_bf16_1thread.json

The bare training step of train.py's bf16 recipe (autocast forward with label smoothing 0.1, backward, clipping at
1.0, fused AdamW) of one model over the same batches, its attention switched between the two (the model calls
`modeling_scratch_transformer.bf16_cpu_training_attention`; the fp32 variant puts torch's kernel in its place for the
pass). Batches: `--batches` of bench_speed's random sentence pairs (`common.random_batch`, log-normal lengths around
28 tokens, about half padding), `--sentences` pairs each. Passes of each variant alternated (the order reversed every
round), the median ms per step. A first check: both variants' losses on the first batch agree (bf16 rounding).
Results: `benchmarks/results/training_attention_bf16.json` and `.md` (machine, load, commit).
"""

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from common import RESULTS, build_pair, git_commit, loadavg, machine_info, machine_line, random_batch, write_results

from hf_scratch_transformer import modeling_scratch_transformer as modeling

VARIANTS = ("bf16 products (the package)", "fp32 kernel")


def fp32_kernel_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, is_causal=None, **kwargs):
    """torch's scaled_dot_product_attention in fp32 on sdpa's masks, autocast paused: the model's bf16 CPU training
    attention before (B, T, H, Dh) out, in the inputs' dtype; no weights."""
    causal = module.is_causal if is_causal is None else is_causal
    with torch.autocast("cpu", enabled=False):
        output = F.scaled_dot_product_attention(
            query.float(), key.float(), value.float(), attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
            is_causal=causal and attention_mask is None and query.shape[2] > 1)
    return output.to(query.dtype).transpose(1, 2).contiguous(), None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--sentences", type=int, default=40, help="sentence pairs a batch (40: ~2,300 real tokens)")
    parser.add_argument("--rounds", type=int, default=6, help="passes of each variant over the batches (alternated)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--output", default=str(RESULTS / "training_attention_bf16.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = loadavg()
    model = build_pair(args.preset, args.seed)[0].train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    rng = np.random.default_rng(args.seed)
    batches = [random_batch(rng, args.sentences) for _ in range(args.batches)]
    real_tokens = statistics.mean(int(b["attention_mask"].sum() + (b["labels"] != -100).sum()) for b in batches)
    package_attention = modeling.bf16_cpu_training_attention
    attentions = dict(zip(VARIANTS, (package_attention, fp32_kernel_attention)))

    def loss_of(batch: dict) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(**batch, label_smoothing=0.1).loss.float()

    def step(batch: dict) -> None:
        loss_of(batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    first_losses = {}
    seconds = {variant: [] for variant in VARIANTS}
    try:
        for variant in VARIANTS:
            modeling.bf16_cpu_training_attention = attentions[variant]
            first_losses[variant] = float(loss_of(batches[0]))
            step(batches[0])  # warm-up
        for round_ in range(args.rounds):
            for variant in (VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]):
                modeling.bf16_cpu_training_attention = attentions[variant]
                started = time.perf_counter()
                for batch in batches:
                    step(batch)
                seconds[variant].append(time.perf_counter() - started)
    finally:
        modeling.bf16_cpu_training_attention = package_attention
    ms = {variant: 1000 * statistics.median(times) / args.batches for variant, times in seconds.items()}
    results = {"settings": vars(args), "machine": machine_info(args.threads), "commit": git_commit(),
               "load_before": load_before, "load_after": loadavg(), "real_tokens_per_batch": real_tokens,
               "first_batch_loss": first_losses, "seconds": seconds, "ms_per_step": ms,
               "speedup": ms[VARIANTS[1]] / ms[VARIANTS[0]],
               "pair_ratios": [fp32 / ours for ours, fp32 in zip(seconds[VARIANTS[0]], seconds[VARIANTS[1]])]}
    text = markdown(results, args)
    write_results(results, args.output, text)
    print(text)
    return results


def markdown(results: dict, args) -> str:
    ours, fp32 = (results["ms_per_step"][variant] for variant in VARIANTS)
    losses = results["first_batch_loss"]
    return "\n".join([
        "# Attention of a bf16 training step on a CPU: bf16 products against torch's kernel in fp32", "",
        f"{machine_line(results['machine'])} Load average {results['load_before']} before, {results['load_after']} "
        f"after.{' ' + args.note if args.note else ''}", "",
        f"Preset {args.preset}; {args.batches} random batches of {args.sentences} sentence pairs "
        f"({results['real_tokens_per_batch']:,.0f} real tokens a batch, source + target); the bare bf16 step "
        f"(autocast, label smoothing 0.1, backward, clipping, fused AdamW); {args.rounds} passes of each variant, "
        f"alternated; the median. First-batch loss: {losses[VARIANTS[0]]:.4f} / {losses[VARIANTS[1]]:.4f}.", "",
        "| attention | ms / step | tokens / s |", "|---|---:|---:|",
        f"| {VARIANTS[0]} | {ours:.1f} | {1000 * results['real_tokens_per_batch'] / ours:,.0f} |",
        f"| {VARIANTS[1]} | {fp32:.1f} | {1000 * results['real_tokens_per_batch'] / fp32:,.0f} |", "",
        f"Speed-up of the package's attention: **{results['speedup']:.3f}×** (pairs: "
        + ", ".join(f"{ratio:.2f}" for ratio in results["pair_ratios"]) + ").", ""])


if __name__ == "__main__":
    main()
