#!/usr/bin/env python
"""What packing the training batches by the source lengths *after* each epoch's source noise (train.py's packing)
saves against packing by the lengths before it (the packing it replaced): the padded positions and the FLOPs a step
computes, on train.py's own batches of the shipped corpus (or the corpus its flags name).

The sampler (`data.batching.TokenBucketBatchSampler`) packs by lengths; the collator
(`training.augmentation.NoiseCollator`) changes the sources (paraphrases, plain quotes, lower-casing), so a source
side packed by its lengths before the noise and padded to its longest changed sentence holds more padding than the
packing planned. This script draws each epoch's lengths as train.py does (`NoiseCollator.lengths`, the same seeds),
packs the pairs both ways with the same budget, and counts, per epoch: batches, real and padded positions on each
side, and the model FLOPs of a training step over the padded batches (`training.flops.training_flops` at the padded
lengths: what the products compute) against those of the real tokens (what MFU counts). It also times that noise
pass over the whole split, the work packing after the noise adds at each epoch's start.

    python benchmarks/packing_after_noise.py --tokenizer outputs/scratch-small-en-es
    python benchmarks/packing_after_noise.py --tokenizer DIR --epochs 2 -- --train_file data/train.jsonl ...

Nothing is trained; it reads the corpus and the tokenizer of a run (a model directory or its `.tokenizer` staging
folder). Writes benchmarks/results/packing_after_noise.json and .md.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from common import RESULTS, git_commit, loadavg, machine_info, write_results

from transformers import AutoTokenizer

from hf_scratch_transformer.configuration_scratch_transformer import ScratchTransformerConfig
from hf_scratch_transformer.data.batching import TokenBucketBatchSampler
from hf_scratch_transformer.data.loading import load_parallel_corpus
from hf_scratch_transformer.data.preprocessing import make_collator, mean_pair_tokens, preprocess_corpus, \
    sequence_lengths
from hf_scratch_transformer.training.arguments import parse_arguments
from hf_scratch_transformer.training.augmentation import noise_collator, read_paraphrases
from hf_scratch_transformer.training.flops import training_flops
from hf_scratch_transformer.training.recipe import DEFAULT_AUGMENTATION, batch_tokens_for


def epoch_costs(batches: list[np.ndarray], source: np.ndarray, target: np.ndarray, config) -> dict:
    """Positions and FLOPs of one epoch's batches, each padded to its longest source and target."""
    padded_source = sum(len(b) * int(source[b].max()) for b in batches)
    padded_target = sum(len(b) * int(target[b].max()) for b in batches)
    padded_flops = sum(training_flops(config, [int(source[b].max())] * len(b), [int(target[b].max())] * len(b))
                       for b in batches)
    return {"batches": len(batches), "source_positions": padded_source, "target_positions": padded_target,
            "source_tokens": int(source.sum()), "target_tokens": int(target.sum()),
            "padded_flops": padded_flops, "real_flops": training_flops(config, source.tolist(), target.tolist())}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a run's model directory or .tokenizer folder")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--preset", default="small", help="the model whose step FLOPs are counted")
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--output", default=str(RESULTS / "packing_after_noise.json"))
    args, train_flags = parser.parse_known_args(argv)
    _, data_args, run_args = parse_arguments([flag for flag in train_flags if flag != "--"])
    load_before = loadavg()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    raw = load_parallel_corpus(data_args, seed=args.seed)
    train = preprocess_corpus(raw, tokenizer, data_args)[0]["train"]
    budget = data_args.max_tokens or batch_tokens_for(mean_pair_tokens(train))  # the batch rule's, as train.py's
    paraphrases = read_paraphrases(raw["train"], tokenizer, data_args, DEFAULT_AUGMENTATION, log=False)
    collator = noise_collator(make_collator(tokenizer), tokenizer, DEFAULT_AUGMENTATION, seed=args.seed,
                              max_source_length=data_args.max_source_length,
                              max_target_length=data_args.max_target_length, paraphrases=paraphrases)
    config = ScratchTransformerConfig.from_preset(args.preset, vocab_size=len(tokenizer))
    source_before, target = sequence_lengths(train)
    epochs = []
    for epoch in range(args.epochs):
        started = time.perf_counter()
        source_after, target_after = collator.lengths(train, epoch)  # what train.py now packs each epoch by
        noise_seconds = time.perf_counter() - started
        assert (target_after == target).all()  # the default recipe changes sources only
        row = {"epoch": epoch, "noise_pass_seconds": noise_seconds}
        for packing, lengths in (("before_noise", source_before), ("after_noise", source_after)):
            sampler = TokenBucketBatchSampler(lengths, target, budget, seed=args.seed)
            sampler.set_epoch(epoch)
            row[packing] = epoch_costs([np.asarray(b) for b in sampler.all_batches()], source_after, target, config)
        epochs.append(row)
        print(f"epoch {epoch}: {row}", flush=True)
    results = {"settings": vars(args) | {"train_flags": train_flags, "batch_tokens": budget, "pairs": len(train),
                                         "augmentation": DEFAULT_AUGMENTATION.describe()},
               "machine": machine_info(1), "commit": git_commit(), "load_before": load_before,
               "load_after": loadavg(), "epochs": epochs}

    def share(row, key):
        return sum(epoch[row][key] for epoch in epochs)

    lines = ["# Packing by the source lengths after the noise, against before it", "",
             f"{len(train):,} training pairs, {budget:,}-token batches, the default recipe's source noise "
             f"({results['settings']['augmentation']}), seed {args.seed}, epochs 0-{args.epochs - 1}; step FLOPs "
             f"of the `{args.preset}` preset (vocabulary {len(tokenizer):,}). Commit {results['commit']}; "
             f"{results['machine']['cpu']}; load average {load_before} before, {results['load_after']} after. "
             f"{args.note}".rstrip(), "",
             "| packing by the source lengths | batches / epoch | source positions / batch | padding, source | "
             "target positions / batch | padding, target | padding, both | real tokens / batch | "
             "padded FLOPs / real FLOPs | padded FLOPs / epoch (T) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for packing in ("before_noise", "after_noise"):
        batches = share(packing, "batches")
        source, target = share(packing, "source_positions"), share(packing, "target_positions")
        real_source, real_target = share(packing, "source_tokens"), share(packing, "target_tokens")
        lines.append(f"| {packing.replace('_', ' ')} | {batches / len(epochs):.1f} | {source / batches:,.0f} | "
                     f"{1 - real_source / source:.1%} | {target / batches:,.0f} | {1 - real_target / target:.1%} | "
                     f"{1 - (real_source + real_target) / (source + target):.1%} | "
                     f"{(real_source + real_target) / batches:,.0f} | "
                     f"{share(packing, 'padded_flops') / share(packing, 'real_flops'):.3f} | "
                     f"{share(packing, 'padded_flops') / len(epochs) / 1e12:.2f} |")
    before, after = share("before_noise", "padded_flops"), share("after_noise", "padded_flops")
    per_step = after / before * share("before_noise", "batches") / share("after_noise", "batches")
    noise_seconds = ", ".join(f"{epoch['noise_pass_seconds']:.1f}" for epoch in epochs)
    lines += ["", f"Packed after the noise, an epoch computes {after / before:.3f}x the FLOPs (the same pairs and "
              f"noise); a step {per_step:.3f}x as many. The noise pass over the split took {noise_seconds} s "
              f"(epochs in order)."]
    write_results(results, args.output, "\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main()
