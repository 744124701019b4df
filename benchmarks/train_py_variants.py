"""train.py's loop with two variants of the package's code, alternated: what `training_loss.py` and
`training_attention.py` share (issue: speed to the CPU's limit).

Each round runs `train.py`'s `main` once per variant, each in a process of its own (`--in_process`: in this one;
`training_step_profile.timed_train_py_run`: the default recipe, `--do_train` only), the variant put in place for that
run by a context manager, the order swapped every round. The loop is timed from the end of one batch to the end of the
next after `--warmup` steps; reported per run: non-padding tokens per second, ms per step, the first batch's loss (the
same model from the same seed: the variants must agree), the minor page faults of the process during the run (the
kernel's count, getrusage) and its peak resident memory. The malloc is the process's (a child inherits LD_PRELOAD).
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from common import git_commit, loadavg, machine_info, write_results
from training_step_profile import timed_train_py_run

from hf_scratch_transformer.memory_allocator import loaded_allocator
from hf_scratch_transformer.training import loop

RESULT_PREFIX = "train.py variant result: "
Variants = dict[str, Callable[[], AbstractContextManager]]  # name -> the variant put in place for one run


class FirstLoss(loop.TrainingCallback):
    def __init__(self):
        self.value = None

    def on_batch_end(self, training_loop, indices, batch, loss) -> None:
        if self.value is None:
            self.value = float(loss)


def timed_run(variant: Callable[[], AbstractContextManager], steps: int, warmup: int, cpu_threads: int,
              train_flags: list[str]) -> dict:
    first, faults_before = FirstLoss(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with variant(), loop.training_callbacks(first):
        timer = timed_train_py_run(steps, warmup, 0, cpu_threads, train_flags)
    seconds = timer.times[-1] - timer.times[0]
    return {"tokens_per_second": round(sum(timer.tokens[1:]) / seconds, 1),
            "ms_per_step": round(1000 * seconds / (len(timer.times) - 1), 1), "timed_steps": len(timer.times) - 1,
            "first_batch_loss": first.value,
            "minor_page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before,
            "peak_resident_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def run_in_child(script: str, name: str, args, train_flags: list[str]) -> dict:
    """`timed_run` in a process of its own (the malloc's state starts fresh; peak memory is the run's)."""
    result = subprocess.run([sys.executable, script, "--child", name, "--steps", str(args.steps), "--warmup",
                             str(args.warmup), "--cpu_threads", str(args.cpu_threads), *train_flags],
                            capture_output=True, text=True, cwd=Path(script).parent)
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"the {name} run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix(RESULT_PREFIX))


def main(argv: list[str] | None, *, doc: str, script: str, variants: Variants, title: str, column: str,
         default_output: Path) -> dict:
    """Run the comparison (or, with --child NAME, one run of one variant); the first variant is the candidate, its
    tokens/s divided by the second's are the speed-ups."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=160, help="optimiser steps of each run")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps at the start of each run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of one run per variant (ABBA...)")
    parser.add_argument("--cpu_threads", type=int, default=2, help="train.py's --cpu_threads")
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--output", default=str(default_output))
    parser.add_argument("--in_process", action="store_true",
                        help="every run in this process (default: each in a process of its own)")
    parser.add_argument("--child", choices=list(variants), help=argparse.SUPPRESS)  # one run, its figures on stdout
    args, train_flags = parser.parse_known_args(argv)
    if args.child:
        result = timed_run(variants[args.child], args.steps, args.warmup, args.cpu_threads, train_flags)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return result
    candidate, baseline = list(variants)
    load_before, rounds = loadavg(), []
    for round_ in range(args.rounds):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        rounds.append({name: timed_run(variants[name], args.steps, args.warmup, args.cpu_threads, train_flags)
                       if args.in_process else run_in_child(script, name, args, train_flags) for name in order})
        print(f"round {round_ + 1}: {rounds[-1]}", flush=True)
    ratios = [row[candidate]["tokens_per_second"] / row[baseline]["tokens_per_second"] for row in rounds]
    summary = {name: {"median_tokens_per_second": statistics.median(row[name]["tokens_per_second"] for row in rounds),
                      "median_ms_per_step": statistics.median(row[name]["ms_per_step"] for row in rounds),
                      "median_minor_page_faults": statistics.median(row[name]["minor_page_faults"] for row in rounds),
                      "median_peak_resident_mb": statistics.median(row[name]["peak_resident_mb"] for row in rounds)}
               for name in variants}
    summary["speedups"] = [round(ratio, 3) for ratio in ratios]
    summary["median_speedup"] = round(statistics.median(ratios), 3)
    allocator = loaded_allocator()
    results = {"settings": vars(args) | {"train_flags": train_flags}, "machine": machine_info(args.cpu_threads),
               "commit": git_commit(), "allocator": allocator, "load_before": load_before, "load_after": loadavg(),
               "rounds": rounds, "summary": summary}
    machine = results["machine"]
    lines = [
        f"# {title}", "",
        f"Machine: **{machine['cpu']}**, {machine['logical_cpus']} logical CPUs, {args.cpu_threads} thread(s); "
        f"torch {torch.__version__}; commit {results['commit']}; malloc: {allocator or 'the C library malloc'}; "
        f"load average {load_before} before, {results['load_after']} after. {args.note}", "",
        f"`python train.py --max_steps {args.steps} {' '.join(train_flags)}` (the default recipe otherwise), timed "
        f"after step {args.warmup}; {args.rounds} round(s), one run per {column} in each, the order swapped every "
        f"round. {candidate} against {baseline}, per round: {' / '.join(f'{r:.3f}' for r in ratios)}x the tokens/s "
        f"(median **{summary['median_speedup']:.3f}x**).", "",
        f"| {column} | median tokens / s | median ms / step | median minor page faults a run | median peak resident MB "
        "| first-batch loss |", "|---|---:|---:|---:|---:|---|",
    ]
    for name in variants:
        lines.append(f"| {name} | {summary[name]['median_tokens_per_second']:,.0f} | "
                     f"{summary[name]['median_ms_per_step']:.1f} | {summary[name]['median_minor_page_faults']:,.0f} | "
                     f"{summary[name]['median_peak_resident_mb']:,.0f} | "
                     f"{' / '.join(format(row[name]['first_batch_loss'], '.4f') for row in rounds)} |")
    write_results(results, args.output, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return results
