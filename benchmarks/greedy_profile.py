"""Where greedy decoding's time goes, this model against MarianMT holding the same weights (issue: speed to the CPU's
limit): torch.profiler over `generate()` of both, fixed-length greedy, batch 1 and 32, the operators side by side.

    python benchmarks/greedy_profile.py                          # small preset, 32 new tokens, all cores
    python benchmarks/greedy_profile.py --threads 1 --output benchmarks/results/greedy_profile_1thread.json
    python benchmarks/greedy_profile.py --ours_dtype bfloat16 --output benchmarks/results/greedy_profile_bf16.json

The models and batches are bench_speed.py's (`common.build_pair`, random sentence lengths; the logits agree). Each
batch is decoded once to warm up, then `--rounds` times per model under the profiler, the models alternated. The
table gives each operator's self CPU time per new token, ours and Marian's, the largest first, the wall time of the
profiled calls, and that of as many calls again without the profiler (alternated; the ratio to quote).
`--ours_dtype bfloat16`: our model's weights in bf16 (what `--dtype auto` loads on a CPU with AVX-512 BF16 and no
AMX), Marian's in fp32. Results: `benchmarks/results/greedy_profile.json` and `.md` (machine, load, commit).
"""

import argparse
import statistics
import time

import numpy as np
import torch
from common import RESULTS, build_pair, git_commit, loadavg, machine_info, machine_line, random_batch, run_generate, \
    write_results
from torch.profiler import ProfilerActivity, profile

MODELS = ("ours", "marian")


def profiled(model, batch, new_tokens: int, rounds: int) -> tuple[dict[str, float], float]:
    """Self CPU microseconds of each operator over `rounds` calls, and their wall seconds."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        started = time.perf_counter()
        for _ in range(rounds):
            run_generate(model, batch, 1, new_tokens)
        wall = time.perf_counter() - started
    return {event.key: event.self_cpu_time_total for event in profiler.key_averages()}, wall


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4, help="profiled calls, and unprofiled ones, per model and batch (alternated)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--top", type=int, default=14, help="operators in each table")
    parser.add_argument("--ours_dtype", choices=("float32", "bfloat16"), default="float32",
                        help="our model's weights (Marian's stay fp32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=str(RESULTS / "greedy_profile.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = loadavg()
    models = dict(zip(MODELS, build_pair(args.preset, args.seed)))
    models["ours"].to(getattr(torch, args.ours_dtype))
    for model in models.values():
        model.eval()
    rng = np.random.default_rng(args.seed)
    batches = {}
    for batch_size in args.batch_sizes:
        batch = random_batch(rng, batch_size)
        for model in models.values():
            run_generate(model, batch, 1, args.new_tokens)  # warm-up
        times = {name: {} for name in MODELS}
        walls = {name: 0.0 for name in MODELS}
        for round_ in range(args.rounds):
            for name in (MODELS if round_ % 2 == 0 else MODELS[::-1]):
                operators, wall = profiled(models[name], batch, args.new_tokens, 1)
                walls[name] += wall
                for key, microseconds in operators.items():
                    times[name][key] = times[name].get(key, 0.0) + microseconds
        plain = {name: [] for name in MODELS}  # the same calls without the profiler, alternated
        for round_ in range(args.rounds):
            for name in (MODELS if round_ % 2 == 0 else MODELS[::-1]):
                started = time.perf_counter()
                run_generate(models[name], batch, 1, args.new_tokens)
                plain[name].append(time.perf_counter() - started)
        tokens = args.rounds * batch_size * args.new_tokens
        batches[str(batch_size)] = {
            "source_tokens": int(batch["input_ids"].shape[1]),
            "wall_us_per_token": {name: 1e6 * walls[name] / tokens for name in MODELS},
            "unprofiled_us_per_token": {name: 1e6 * statistics.median(plain[name]) / (batch_size * args.new_tokens)
                                        for name in MODELS},
            "self_cpu_us_per_token": {name: {key: value / tokens for key, value in times[name].items()}
                                      for name in MODELS}}
    results = {"settings": vars(args), "machine": machine_info(args.threads), "commit": git_commit(),
               "load_before": load_before, "load_after": loadavg(), "batches": batches}
    text = markdown(results, args)
    write_results(results, args.output, text)
    print(text)
    return results


def markdown(results: dict, args) -> str:
    lines = ["# Greedy decoding under torch.profiler: this model against MarianMT, the same weights", "",
             f"{machine_line(results['machine'])} Load average {results['load_before']} before, "
             f"{results['load_after']} after.", "",
             f"Preset {args.preset}, our weights in {args.ours_dtype} and Marian's in float32, `generate()` greedy, {args.new_tokens} new tokens a sentence (end tokens "
             f"not honoured), {args.rounds} profiled calls per model, alternated. Self CPU time per new token, in µs "
             f"(the profiler's own cost included, so the wall figures are above bench_speed's)."]
    for batch_size, row in results["batches"].items():
        ours, marian = (row["self_cpu_us_per_token"][name] for name in MODELS)
        wall, plain = row["wall_us_per_token"], row["unprofiled_us_per_token"]
        lines += ["", f"## Batch {batch_size} ({row['source_tokens']} source tokens)", "",
                  f"Without the profiler (median of the alternated calls): ours {plain['ours']:.1f} µs a new token, "
                  f"Marian {plain['marian']:.1f} µs (**Marian / ours {plain['marian'] / plain['ours']:.2f}×**). "
                  f"Under the profiler: ours {wall['ours']:.1f} µs, Marian {wall['marian']:.1f} µs "
                  f"(Marian / ours {wall['marian'] / wall['ours']:.2f}×). Self CPU per new token: ours "
                  f"{sum(ours.values()):.1f} µs, Marian {sum(marian.values()):.1f} µs.", "",
                  "| operator | ours, µs / token | Marian, µs / token | Marian − ours |", "|---|---:|---:|---:|"]
        keys = sorted(set(ours) | set(marian), key=lambda key: -max(ours.get(key, 0.0), marian.get(key, 0.0)))
        for key in keys[:args.top]:
            lines.append(f"| `{key}` | {ours.get(key, 0.0):.1f} | {marian.get(key, 0.0):.1f} | "
                         f"{marian.get(key, 0.0) - ours.get(key, 0.0):+.1f} |")
        rest = keys[args.top:]
        lines.append(f"| the other {len(rest)} | {sum(ours.get(k, 0.0) for k in rest):.1f} | "
                     f"{sum(marian.get(k, 0.0) for k in rest):.1f} | "
                     f"{sum(marian.get(k, 0.0) - ours.get(k, 0.0) for k in rest):+.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
