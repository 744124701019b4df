"""`torch.compile` (inductor on the CPU) of the greedy decoding step with a static self-attention cache, against the
package's eager step (issue: speed to the CPU's limit).

    python benchmarks/compiled_decoding.py --model outputs/scratch-small-en-es      # idle, then with one core busy
    python benchmarks/compiled_decoding.py --model DIR --batch_sizes 1 32 --new_tokens 32 --cpu_threads 2

The sources are the first sentences of the model directory's `test_sources.txt` (what train.py's --do_predict
wrote), one batch per batch size. For each, `--new_tokens` greedy steps (end tokens not honoured, so every variant
does the same work) of four decoders over the same encoder output:

- `eager`: the step of `decoding.greedy_search` as it runs in the package (`LayerState.step` of each layer, the final
  norm, the output projection, the first maximum);
- `static eager`: the same arithmetic with the self-attention keys and values in buffers of all `--new_tokens`
  positions from the start, written with `index_copy_` at a position tensor and attended with a mask of the
  positions filled, so that no shape and no Python value changes from step to step;
- `compiled`: that static step (the layers, the final norm, the output projection and the maximum) through
  `torch.compile`;
- `compiled, frozen weights`: the same with inductor's `freezing` (the weights folded in as constants, so that its
  matrix products can use pre-packed weights).

Every variant must choose the same tokens as `eager` (checked). The compiled variants' first call (compilation) is
timed on its own; then the variants run alternated (the order reversed every repeat), idle and with a process spinning
on the last core. Results: `benchmarks/results/compiled_decoding.json` and `.md` (machine, load, commit).
"""

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import RESULTS, git_commit, loadavg, machine_info, write_results
from cpu_threads import start_hog
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from hf_scratch_transformer.decoding import LayerState

VARIANTS = ("eager", "static eager", "compiled", "compiled, frozen weights")


class StaticLayerState(LayerState):
    """A decoder layer's step with self-attention buffers of `steps` positions from the start (zeros, so the masked
    positions add nothing), written at `position` (1,) and attended under `filled` (1, 1, 1, steps)."""

    def __init__(self, layer, encoder_output: torch.Tensor, steps: int):
        super().__init__(layer, encoder_output, steps)
        self.self_keys = encoder_output.new_zeros(encoder_output.shape[0], self.heads, steps, self.head_dim)
        self.self_values = torch.zeros_like(self.self_keys)

    def static_step(self, hidden: torch.Tensor, position: torch.Tensor, filled: torch.Tensor,
                    source_mask: torch.Tensor | None) -> torch.Tensor:
        def self_attention(x: torch.Tensor) -> torch.Tensor:
            query, key, value = self.self_query_key_value(x).chunk(3, dim=-1)
            self.self_keys.index_copy_(2, position, self.split_heads(key))
            self.self_values.index_copy_(2, position, self.split_heads(value))
            output = F.scaled_dot_product_attention(self.split_heads(query), self.self_keys, self.self_values,
                                                    attn_mask=filled, scale=self.scaling)
            return self.self_output(output.transpose(1, 2).reshape(x.shape))

        hidden = self.add_and_norm(hidden, self.self_norm, self_attention)
        hidden = self.add_and_norm(hidden, self.cross_norm, lambda x: self.cross_attention(x, source_mask))
        return self.add_and_norm(hidden, self.final_norm,
                                 lambda x: self.fc2(self.activation(self.fc1(x))))


class Decoders:
    """The four variants' greedy decoding of one batch for a fixed number of steps."""

    def __init__(self, model, batch: dict, steps: int):
        self.model, self.decoder, self.steps = model, model.model.decoder, steps
        with torch.no_grad():
            self.encoder_output = model.get_encoder()(**batch).last_hidden_state
        mask = batch["attention_mask"]
        self.source_mask = None if bool(mask.all()) else mask.bool()[:, None, None, :]
        self.compiled = {"compiled": torch.compile(self.static_layers_and_choice),
                         "compiled, frozen weights": torch.compile(self.static_layers_and_choice,
                                                                   options={"freezing": True})}

    def static_layers_and_choice(self, layers, hidden, position, filled, source_mask) -> torch.Tensor:
        for state in layers:
            hidden = state.static_step(hidden, position, filled, source_mask)
        return self.model.lm_head(self.decoder.final_norm(hidden)[:, 0]).max(dim=-1).indices

    @torch.no_grad()
    def __call__(self, variant: str) -> torch.Tensor:
        """(B, steps) tokens chosen."""
        decoder, batch_size = self.decoder, self.encoder_output.shape[0]
        tokens = torch.full((batch_size,), self.model.config.decoder_start_token_id)
        chosen = []
        if variant == "eager":
            layers = [LayerState(layer, self.encoder_output, self.steps) for layer in decoder.layers]
            for step in range(self.steps):
                hidden = decoder.embed(decoder.embed_tokens(tokens)[:, None], offset=step)
                for state in layers:
                    hidden = state.step(hidden, step, self.source_mask)
                tokens = self.model.lm_head(decoder.final_norm(hidden)[:, 0]).max(dim=-1).indices
                chosen.append(tokens)
            return torch.stack(chosen, dim=1)
        layers = [StaticLayerState(layer, self.encoder_output, self.steps) for layer in decoder.layers]
        step_function = self.compiled.get(variant, self.static_layers_and_choice)
        positions = torch.arange(self.steps)
        for step in range(self.steps):
            hidden = decoder.embed(decoder.embed_tokens(tokens)[:, None], offset=step)
            tokens = step_function(layers, hidden, positions[step:step + 1], (positions <= step)[None, None, None, :],
                                   self.source_mask)
            chosen.append(tokens)
        return torch.stack(chosen, dim=1)


def timed(function, *args) -> float:
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started


def alternated(decoders: Decoders, repeats: int) -> dict[str, list[float]]:
    seconds = {variant: [] for variant in VARIANTS}
    for repeat in range(repeats):
        for variant in (VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]):
            seconds[variant].append(timed(decoders, variant))
    return seconds


def summary(seconds: dict[str, list[float]], tokens: int) -> dict:
    speedups = {variant: [eager / other for eager, other in zip(seconds["eager"], seconds[variant])]
                for variant in VARIANTS[1:]}
    return {"seconds": seconds, "tokens_per_second": {variant: tokens / statistics.median(values)
                                                      for variant, values in seconds.items()},
            "speedups": speedups, "median_speedup": {variant: statistics.median(values)
                                                     for variant, values in speedups.items()}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("outputs/scratch-small-en-es"),
                        help="a model directory train.py wrote, with its test_sources.txt")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=8, help="calls of each variant, idle, alternated")
    parser.add_argument("--busy_repeats", type=int, default=6, help="the same with one core busy (0: none)")
    parser.add_argument("--cpu_threads", type=int, default=2)
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--output", default=str(RESULTS / "compiled_decoding.json"))
    args = parser.parse_args(argv)
    load_before = loadavg()
    torch.set_num_threads(args.cpu_threads)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sources = (args.model / "test_sources.txt").read_text(encoding="utf-8").splitlines()
    rows = {}
    for batch_size in args.batch_sizes:
        batch = dict(tokenizer(sources[:batch_size], return_tensors="pt", padding=True))
        decoders = Decoders(model, batch, args.new_tokens)
        first_call = {variant: timed(decoders, variant) for variant in decoders.compiled}  # compilation
        reference = decoders("eager")
        same = {variant: bool(torch.equal(decoders(variant), reference)) for variant in VARIANTS[1:]}
        tokens = batch_size * args.new_tokens
        row = {"source_tokens": int(batch["input_ids"].shape[1]), "first_call_seconds": first_call,
               "same_tokens_as_eager": same, "idle": summary(alternated(decoders, args.repeats), tokens)}
        if args.busy_repeats:
            hog = start_hog(len(os.sched_getaffinity(0)) - 1)
            try:
                row["busy"] = summary(alternated(decoders, args.busy_repeats), tokens)
            finally:
                hog.kill()
                hog.wait()
        rows[str(batch_size)] = row
    results = {"settings": vars(args) | {"model": str(args.model)}, "machine": machine_info(args.cpu_threads),
               "commit": git_commit(), "torch": torch.__version__, "load_before": load_before,
               "load_after": loadavg(), "batches": rows}
    write_results(results, args.output, markdown(results, args))
    print(markdown(results, args))
    return results


def markdown(results: dict, args) -> str:
    machine = results["machine"]
    lines = [
        "# `torch.compile` of the greedy decoding step (static cache) against the package's eager step", "",
        f"Machine: **{machine['cpu']}**, {machine['logical_cpus']} logical CPUs, AMX {'yes' if machine['amx'] else 'no'}, "
        f"{args.cpu_threads} thread(s); torch {results['torch']}; commit {results['commit']}; load average "
        f"{results['load_before']} before, {results['load_after']} after. {args.note}".rstrip(), "",
        f"Model `{args.model}`, fp32; the first sentences of its test_sources.txt; {args.new_tokens} greedy steps per "
        f"sentence. New tokens a second (median of the alternated calls) and the speed-up over `eager` (median of the "
        f"pairs); the compiled variants' first call (compilation) timed on its own.", "",
        "| batch (source tokens) | load | " + " | ".join(f"{variant}, tokens/s" for variant in VARIANTS)
        + " | " + " | ".join(f"{variant}, speed-up" for variant in VARIANTS[1:]) + " |",
        "|---|---|" + "---:|" * (2 * len(VARIANTS) - 1),
    ]
    for batch_size, row in results["batches"].items():
        for load in ("idle", "busy"):
            if load not in row:
                continue
            figures = row[load]
            lines.append(
                f"| {batch_size} ({row['source_tokens']}) | {'idle' if load == 'idle' else 'one core busy'} | "
                + " | ".join(f"{figures['tokens_per_second'][variant]:,.0f}" for variant in VARIANTS) + " | "
                + " | ".join(f"{figures['median_speedup'][variant]:.2f}×" for variant in VARIANTS[1:]) + " |")
    lines += ["", "First compiled call (compilation included) and whether each variant chose the eager step's tokens:",
              ""]
    for batch_size, row in results["batches"].items():
        first = ", ".join(f"{variant} {seconds:.1f} s" for variant, seconds in row["first_call_seconds"].items())
        same = ", ".join(f"{variant} {'yes' if equal else 'NO'}" for variant, equal in row["same_tokens_as_eager"].items())
        lines.append(f"- batch {batch_size}: {first}; same tokens: {same}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
