"""This checkout's model against the model of an earlier commit, on the same weights: greedy decoding and training.

The earlier package is read from git (`git show COMMIT:hf_scratch_transformer/...`) into a temporary directory and
imported under another name, so both run in one process on the same batches, alternated ABAB (ratios hold on a
busy machine; absolute figures do not). Weights are copied from the old model (its `Projection` layers store
(in, out) matrices, today's `nn.Linear` stores (out, in); its packed Q/K/V and K/V rows are split into today's
q/k/v projections) and the two are checked to give the same logits.

Decoding paths timed for this checkout: the dynamic cache (generate's default), the static cache, and the static
cache compiled by `torch.compile` (inductor), which transformers uses on accelerators by default and on CPU when
asked. The old commit decodes with whatever it had (main before issue 11: its own greedy loop).

    python benchmarks/bench_against_commit.py --commit f640c1f --preset small --threads 2
"""

import argparse
import importlib
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import CompileConfig, GenerationConfig
from transformers.pytorch_utils import Conv1D

from common import (
    BOS, EOS, PAD, RESULTS, ROOT, VOCAB, batch_of_lengths, batch_tokens, machine_info, machine_line, median,
    padding_share, sentence_lengths, time_alternating, write_results,
)

import hf_scratch_transformer  # common put this checkout first on sys.path
from hf_scratch_transformer import ScratchTransformerConfig, ScratchTransformerForConditionalGeneration

REPO = ROOT


def import_package_at(commit: str, directory: Path):
    """Import hf_scratch_transformer as it was at `commit`, as the package `old_hf_scratch_transformer`."""
    package = directory / "old_hf_scratch_transformer"
    package.mkdir()
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{commit}:hf_scratch_transformer"], cwd=REPO,
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith(".py"):
            source = subprocess.run(["git", "show", f"{commit}:hf_scratch_transformer/{name}"], cwd=REPO,
                                    check=True, capture_output=True, text=True).stdout
            if name == "__init__.py":  # do not register a second class for the same model_type
                source = "\n".join(line for line in source.splitlines() if ".register(" not in line)
            (package / name).write_text(source)
    sys.path.insert(0, str(directory))
    return importlib.import_module("old_hf_scratch_transformer.modeling_scratch_transformer")


@torch.no_grad()
def same_weights(old_model, new_model) -> None:
    state = {}
    for name, module in old_model.named_modules():
        if isinstance(module, Conv1D):  # (in, out) -> (out, in)
            state[f"{name}.weight"], state[f"{name}.bias"] = module.weight.T.contiguous(), module.bias
    for name, tensor in old_model.state_dict().items():
        state.setdefault(name, tensor)
    for name in [name for name in state if ".qkv_proj." in name or ".kv_proj." in name]:
        letters = "qkv" if ".qkv_proj." in name else "kv"  # packed rows: q, k, v (or k, v)
        template = name.replace(f".{letters}_proj.", ".{}_proj.")
        for letter, rows in zip(letters, state.pop(name).chunk(len(letters))):
            state[template.format(letter)] = rows
    missing, unexpected = new_model.load_state_dict(state, strict=False)
    assert not unexpected and all(key.endswith(".pe") for key in missing), (missing, unexpected)


def random_batch(rng: np.random.Generator, lengths: np.ndarray) -> dict:
    """Right-padded source ids of the given lengths, targets of about the same lengths, labels -100 on padding."""
    return batch_of_lengths(rng, lengths, target_range=(4, 80))


def training_batches(rng, kind: str, count: int, max_tokens: int = 2048) -> list[dict]:
    """'random': 64 sentences of random lengths (about a third padding); 'bucketed': sentences of similar length
    up to `max_tokens` per batch, as train.py's token-bucketed sampler makes them (a few % padding)."""
    batches = []
    for _ in range(count):
        lengths = sentence_lengths(rng, 64 if kind == "random" else 2000)
        if kind == "bucketed":
            lengths = np.sort(lengths)
            start = int(rng.integers(0, len(lengths) - 200))
            size = max_tokens // int(lengths[min(start + 80, len(lengths) - 1)])
            lengths = lengths[start : start + size]
        batches.append(random_batch(rng, lengths))
    return batches


def median_seconds(functions: dict, repeats: int) -> dict:
    """Median seconds of each function, run ABAB... after one warm-up call each."""
    return {name: median(values) for name, values in time_alternating(functions, repeats).items()}


def greedy_functions(old_model, new_model, batch, new_tokens):
    compile_config = CompileConfig(fullgraph=True, mode="default")
    compile_config._compile_all_devices = True
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    outputs = {}

    def run(name, model, **kwargs):
        config = GenerationConfig(decoder_start_token_id=BOS, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=1,
                                  **kwargs)

        def call():
            with torch.inference_mode():
                outputs[name] = model.generate(**inputs, generation_config=config)
        return call

    functions = {
        "commit": run("commit", old_model),
        "dynamic": run("dynamic", new_model),
        "static": run("static", new_model, cache_implementation="static"),
        "static_compiled": run("static_compiled", new_model, cache_implementation="static",
                               compile_config=compile_config),
    }
    return functions, outputs


def train_functions(old_model, new_model, batches):
    optimizers = {name: torch.optim.Adam(model.parameters(), lr=1e-5) for name, model in
                  (("commit", old_model), ("checkout", new_model))}
    position = {"commit": 0, "checkout": 0}

    def run(name, model, **kwargs):
        def call():
            model.train()
            for batch in batches:
                loss = model(**batch, label_smoothing=0.1, **kwargs).loss
                loss.backward()
                optimizers[name].step()
                optimizers[name].zero_grad(set_to_none=True)
            position[name] += 1
        return call

    return {"commit": run("commit", old_model), "checkout": run("checkout", new_model)}


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commit", required=True)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new_tokens", type=int, default=40)
    parser.add_argument("--skip_training", action="store_true")
    return parser.parse_args()


def short_commit(revision: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", revision], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout.strip()


def model_pair(old, preset: str):
    """The old commit's model and this checkout's, same sizes and weights (no dropout)."""
    sizes = dict(vocab_size=VOCAB, max_position_embeddings=256, dropout=0.0)
    old_config = old.ScratchTransformerConfig.from_preset(preset, **sizes)
    old_model = old.ScratchTransformerForConditionalGeneration(old_config)
    new_model = ScratchTransformerForConditionalGeneration(ScratchTransformerConfig.from_preset(preset, **sizes))
    same_weights(old_model.eval(), new_model.eval())
    return old_model, new_model


@torch.no_grad()
def logit_difference(old_model, new_model, batch) -> float:
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    decoder_input_ids = new_model.prepare_decoder_input_ids_from_labels(batch["labels"])
    return (old_model(**inputs, decoder_input_ids=decoder_input_ids).logits
            - new_model(**inputs, decoder_input_ids=decoder_input_ids).logits).abs().max().item()


def measure_greedy(old_model, new_model, rng, args) -> dict:
    figures = {}
    for batch_size in (1, 32):
        batch = random_batch(rng, sentence_lengths(rng, batch_size))
        functions, outputs = greedy_functions(old_model, new_model, batch, args.new_tokens)
        seconds = median_seconds(functions, args.repeats)
        same = {name: bool(torch.equal(outputs[name], outputs["commit"])) for name in outputs}
        tokens = batch_size * args.new_tokens
        figures[f"batch_{batch_size}"] = {
            name: {"tokens_per_s": tokens / s, "vs_commit": seconds["commit"] / s, "same_tokens": same[name]}
            for name, s in seconds.items()
        }
        print(f"greedy batch {batch_size}: {figures[f'batch_{batch_size}']}", flush=True)
    return figures


def measure_training(old_model, new_model, rng, args) -> dict:
    figures = {}
    for kind in ("bucketed", "random"):
        batches = training_batches(rng, kind, 4)
        seconds = median_seconds(train_functions(old_model, new_model, batches), args.repeats)
        tokens = sum(sum(batch_tokens(b)) for b in batches)
        figures[kind] = {"padding_share": padding_share(batches),
                         **{name: {"tokens_per_s": tokens / s, "vs_commit": seconds["commit"] / s}
                            for name, s in seconds.items()}}
        print(f"training {kind}: {figures[kind]}", flush=True)
    return figures


def render_markdown(results: dict, args) -> str:
    lines = [f"# {args.preset}: checkout {results['checkout']} against commit {results['commit']}", "",
             f"{machine_line(results['machine'])} Same weights (max |logit difference| "
             f"{results['max_abs_logit_difference']:.1e}); median of {args.repeats} alternated runs; "
             f"{args.new_tokens} new tokens per sentence.", "",
             "| greedy | path | new tokens/s | vs commit | same tokens |", "|---|---|---:|---:|---|"]
    for batch_name, paths in results["greedy"].items():
        for path, figures in paths.items():
            lines.append(f"| {batch_name.replace('_', ' ')} | {path} | {figures['tokens_per_s']:.0f} | "
                         f"{figures['vs_commit']:.2f}x | {figures['same_tokens']} |")
    if results["training"]:
        lines += ["", "| training batches | padding | commit tokens/s | checkout tokens/s | checkout vs commit |",
                  "|---|---:|---:|---:|---:|"]
        for kind, figures in results["training"].items():
            lines.append(f"| {kind} | {figures['padding_share']:.1%} | {figures['commit']['tokens_per_s']:.0f} | "
                         f"{figures['checkout']['tokens_per_s']:.0f} | {figures['checkout']['vs_commit']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_arguments()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    results = {"commit": short_commit(args.commit), "checkout": short_commit("HEAD"), "preset": args.preset,
               "threads": args.threads, "machine": machine_info(args.threads), "greedy": {}, "training": {}}
    with tempfile.TemporaryDirectory() as directory:
        old_model, new_model = model_pair(import_package_at(args.commit, Path(directory)), args.preset)
        difference = logit_difference(old_model, new_model, random_batch(rng, sentence_lengths(rng, 8)))
        results["max_abs_logit_difference"] = difference
        assert difference < 1e-4, difference
        results["greedy"] = measure_greedy(old_model, new_model, rng, args)
        if not args.skip_training:
            results["training"] = measure_training(old_model, new_model, rng, args)
    markdown = render_markdown(results, args)
    write_results(results, RESULTS / f"against_{results['commit']}_{args.preset}.json", markdown)
    print(markdown)


if __name__ == "__main__":
    print(f"hf_scratch_transformer from {Path(hf_scratch_transformer.__file__).parent}", file=sys.stderr)
    main()
