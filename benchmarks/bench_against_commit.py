"""This checkout's model against the model of an earlier commit, on the same weights: greedy decoding and training.

The earlier package is read from git (`git show COMMIT:hf_scratch_transformer/...`) into a temporary directory and
imported under another name, so both run in one process on the same batches, alternated ABAB (ratios hold on a
busy machine; absolute figures do not). Weights are copied from the old model (its `Projection` layers store
(in, out) matrices; today's `nn.Linear` stores (out, in)) and the two are checked to give the same logits.

Decoding paths timed for this checkout: the dynamic cache (generate's default), the static cache, and the static
cache compiled by `torch.compile` (inductor), which transformers uses on accelerators by default and on CPU when
asked. The old commit decodes with whatever it had (main before issue 11: its own greedy loop).

    python benchmarks/bench_against_commit.py --commit f640c1f --preset small --threads 2
"""

import argparse
import importlib
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import CompileConfig, GenerationConfig
from transformers.pytorch_utils import Conv1D

import hf_scratch_transformer
from hf_scratch_transformer import ScratchTransformerConfig, ScratchTransformerForConditionalGeneration

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
VOCAB, PAD, BOS, EOS = 8000, 0, 1, 2


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
    missing, unexpected = new_model.load_state_dict(state, strict=False)
    assert not unexpected and all(key.endswith(".pe") for key in missing), (missing, unexpected)


def random_batch(rng: np.random.Generator, lengths: np.ndarray) -> dict:
    """Right-padded source ids of the given lengths, targets of about the same lengths, labels -100 on padding."""
    target_lengths = np.clip(np.round(lengths * rng.uniform(0.8, 1.25, len(lengths))), 4, 80).astype(int)
    input_ids = torch.full((len(lengths), int(lengths.max())), PAD)
    labels = torch.full((len(lengths), int(target_lengths.max())), -100)
    for row, (source, target) in enumerate(zip(lengths, target_lengths)):
        input_ids[row, : source - 1] = torch.from_numpy(rng.integers(4, VOCAB, source - 1))
        input_ids[row, source - 1] = EOS
        labels[row, : target - 1] = torch.from_numpy(rng.integers(4, VOCAB, target - 1))
        labels[row, target - 1] = EOS
    return {"input_ids": input_ids, "attention_mask": (input_ids != PAD).long(), "labels": labels}


def sentence_lengths(rng, n):
    return np.clip(np.round(rng.lognormal(math.log(28.0), 0.4, n)), 10, 60).astype(int)


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


def padding_share(batches) -> float:
    real = sum(int(b["attention_mask"].sum()) + int((b["labels"] != -100).sum()) for b in batches)
    total = sum(b["input_ids"].numel() + b["labels"].numel() for b in batches)
    return 1 - real / total


def median(values):
    return float(np.median(values))


def time_alternating(functions: dict, repeats: int) -> dict:
    """Median seconds of each function, run ABAB... after one warm-up call each."""
    for function in functions.values():
        function()
    seconds = {name: [] for name in functions}
    for repeat in range(repeats):
        order = list(functions) if repeat % 2 == 0 else list(functions)[::-1]
        for name in order:
            start = time.perf_counter()
            functions[name]()
            seconds[name].append(time.perf_counter() - start)
    return {name: median(values) for name, values in seconds.items()}


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

    return {"commit": run("commit", old_model), "checkout": run("checkout", new_model, skip_logits=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commit", required=True)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new_tokens", type=int, default=40)
    parser.add_argument("--skip_training", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    commit = subprocess.run(["git", "rev-parse", "--short", args.commit], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    results = {"commit": commit, "checkout": head, "preset": args.preset, "threads": args.threads,
               "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                          f"torch {torch.__version__}", "greedy": {}, "training": {}}
    with tempfile.TemporaryDirectory() as directory:
        old = import_package_at(args.commit, Path(directory))
        sizes = dict(vocab_size=VOCAB, max_position_embeddings=256, dropout=0.0)
        old_config = old.ScratchTransformerConfig.from_preset(args.preset, **sizes)
        old_model = old.ScratchTransformerForConditionalGeneration(old_config).eval()
        new_model = ScratchTransformerForConditionalGeneration(
            ScratchTransformerConfig.from_preset(args.preset, **sizes)).eval()
        same_weights(old_model, new_model)
        check = random_batch(rng, sentence_lengths(rng, 8))
        with torch.no_grad():
            inputs = {k: check[k] for k in ("input_ids", "attention_mask")}
            decoder_input_ids = new_model.prepare_decoder_input_ids_from_labels(check["labels"])
            difference = (old_model(**inputs, decoder_input_ids=decoder_input_ids).logits
                          - new_model(**inputs, decoder_input_ids=decoder_input_ids).logits).abs().max().item()
        results["max_abs_logit_difference"] = difference
        assert difference < 1e-4, difference

        for batch_size in (1, 32):
            batch = random_batch(rng, sentence_lengths(rng, batch_size))
            functions, outputs = greedy_functions(old_model, new_model, batch, args.new_tokens)
            seconds = time_alternating(functions, args.repeats)
            same = {name: bool(torch.equal(outputs[name], outputs["commit"])) for name in outputs}
            tokens = batch_size * args.new_tokens
            results["greedy"][f"batch_{batch_size}"] = {
                name: {"tokens_per_s": tokens / s, "vs_commit": seconds["commit"] / s, "same_tokens": same[name]}
                for name, s in seconds.items()
            }
            print(json.dumps({f"greedy batch {batch_size}": results["greedy"][f"batch_{batch_size}"]}), flush=True)

        if not args.skip_training:
            for kind in ("bucketed", "random"):
                batches = training_batches(rng, kind, 4)
                seconds = time_alternating(train_functions(old_model, new_model, batches), args.repeats)
                tokens = sum(int(b["attention_mask"].sum()) + int((b["labels"] != -100).sum()) for b in batches)
                results["training"][kind] = {
                    "padding_share": padding_share(batches),
                    **{name: {"tokens_per_s": tokens / s, "vs_commit": seconds["commit"] / s}
                       for name, s in seconds.items()},
                }
                print(json.dumps({f"training {kind}": results["training"][kind]}), flush=True)

    RESULTS.mkdir(exist_ok=True)
    name = f"against_{commit}_{args.preset}"
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2))
    lines = [f"# {args.preset}: checkout {head} against commit {commit}", "",
             f"{results['machine']}; same weights (max |logit difference| {difference:.1e}); median of "
             f"{args.repeats} alternated runs; {args.new_tokens} new tokens per sentence.", "",
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
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    print(f"hf_scratch_transformer from {Path(hf_scratch_transformer.__file__).parent}", file=sys.stderr)
    main()
