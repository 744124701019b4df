"""Training tokens per second of train.py's own loop at several batch sizes (`--max_tokens`), in alternation.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python benchmarks/batch_tokens_throughput.py
    python benchmarks/batch_tokens_throughput.py --max_tokens 1024 2048 --tokens 400000 --rounds 3

Each round runs `train.py`'s `main` once per batch size (`training_step_profile.timed_train_py_run`: the default
recipe, `--do_train` only, `--dropout 0` so that every size trains the same model) for about `--tokens` training
tokens each: steps = tokens / the batch size, the first sixth of them untimed (warm-up, the first batches' allocations).
The loop is timed from the end of one batch to the end of the next (data, augmentation, step, logging, thread tuner),
and its non-padding tokens (source + target) per second are reported per round and as the median, with the ratio of
each size to the first within each round (the machine's drift between rounds cancels). A run's setup (tokenizer,
data) is not timed. tcmalloc is used if preloaded, as train.py preloads it where the machine has it.

Results: `benchmarks/results/batch_tokens_throughput.json` and `.md` (machine, load, commit).
"""

import argparse
import statistics

import torch

from common import RESULTS, git_commit, loadavg, machine_info, write_results
from training_step_profile import timed_train_py_run

from hf_scratch_transformer.memory_allocator import loaded_allocator


def loop_tokens_per_second(timer) -> tuple[float, float]:
    """(non-pad tokens per second, ms per step) between the timed batch ends of a BatchTimer."""
    seconds = timer.times[-1] - timer.times[0]
    return sum(timer.tokens[1:]) / seconds, 1000 * seconds / (len(timer.times) - 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_tokens", type=int, nargs="+", default=[1024, 2048], help="batch sizes, in tokens")
    parser.add_argument("--tokens", type=int, default=400_000, help="about this many training tokens per run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of one run per batch size (ABAB)")
    parser.add_argument("--cpu_threads", type=int, default=2, help="train.py's --cpu_threads")
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--output", default=str(RESULTS / "batch_tokens_throughput.json"))
    args, train_flags = parser.parse_known_args(argv)
    # a step holds about 1.9 tokens per --max_tokens (source + target, the padding left out); at least 6 steps a run
    steps = {size: max(6, round(args.tokens / (1.9 * size))) for size in args.max_tokens}
    load_before = loadavg()
    rounds: list[dict] = []
    for _ in range(args.rounds):
        row = {}
        for size in args.max_tokens:
            timer = timed_train_py_run(steps[size], max(2, steps[size] // 6), 0, args.cpu_threads,
                                       ["--max_tokens", str(size), "--dropout", "0", *train_flags])
            tokens_per_second, ms_per_step = loop_tokens_per_second(timer)
            row[str(size)] = {"tokens_per_second": round(tokens_per_second, 1), "ms_per_step": round(ms_per_step, 1),
                              "timed_steps": len(timer.times) - 1,
                              "tokens_per_step": round(sum(timer.tokens[1:]) / (len(timer.times) - 1), 1)}
        rounds.append(row)
    first = str(args.max_tokens[0])
    summary = {}
    for size in map(str, args.max_tokens):
        speeds = [row[size]["tokens_per_second"] for row in rounds]
        ratios = [row[size]["tokens_per_second"] / row[first]["tokens_per_second"] for row in rounds]
        summary[size] = {"median_tokens_per_second": round(statistics.median(speeds), 1),
                         "ratios_to_first": [round(ratio, 3) for ratio in ratios],
                         "median_ratio_to_first": round(statistics.median(ratios), 3)}
    allocator = loaded_allocator()
    results = {
        "settings": vars(args) | {"train_flags": train_flags, "steps": steps},
        "machine": machine_info(args.cpu_threads), "commit": git_commit(), "allocator": allocator,
        "load_before": load_before, "load_after": loadavg(), "rounds": rounds, "summary": summary,
    }
    machine = results["machine"]
    lines = [
        "# Training tokens per second of train.py's loop by batch size", "",
        f"Machine: **{machine['cpu']}**, {machine['logical_cpus']} logical CPUs, {args.cpu_threads} thread(s); "
        f"torch {torch.__version__}; commit {results['commit']}; allocator {allocator or 'the C library malloc'}; "
        f"load average {load_before} before, {results['load_after']} after. {args.note}", "",
        f"`python train.py --max_tokens N --dropout 0 --max_steps S {' '.join(train_flags)}` (the default recipe "
        f"otherwise), about {args.tokens:,} training tokens a run, the first sixth of the steps untimed; "
        f"{args.rounds} round(s), one run per size in each, alternated.", "",
        f"| --max_tokens | steps | tokens / step | median tokens / s | ratio to {first} per round | median ratio |",
        "|---:|---:|---:|---:|---|---:|",
    ]
    for size in map(str, args.max_tokens):
        per_step = statistics.median(row[size]["tokens_per_step"] for row in rounds)
        lines.append(f"| {size} | {steps[int(size)]} | {per_step:,.0f} | "
                     f"{summary[size]['median_tokens_per_second']:,.0f} | "
                     f"{' / '.join(f'{r:.3f}' for r in summary[size]['ratios_to_first'])} | "
                     f"{summary[size]['median_ratio_to_first']:.3f} |")
    write_results(results, args.output, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
