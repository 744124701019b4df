"""Training speed under each malloc train.py can run on (issue: speed to the CPU's limit; memory_allocator.py).

    python benchmarks/memory_allocator.py                          # 3 rounds of 150-step runs, every setting
    python benchmarks/memory_allocator.py --rounds 2 --steps 300 --note "one core busy"

Each round runs `train.py --max_steps --steps --do_train true --cpu_threads 2` once per setting, in the same order
every round (ABAB...), each in its own process on the shipped corpus with the default recipe:
- `system malloc`: glibc's malloc as it comes (HF_SCRATCH_TRANSFORMER_ALLOCATOR=system);
- `train.py's default`: what train.py chooses by itself (memory_allocator.relaunch_for_training: tcmalloc when the
  machine has it, the system's malloc otherwise; the table's second column says which ran).
A 150-step run shows the page faults and the speed of the first minute; whether a choice holds over a whole run is
for whole runs to show (glibc's tunables did not: docs/training.md, "The memory allocator").
Per run: training tokens/s (train_results.json, training time only), and from the kernel (getrusage of the child)
minor page faults, system and user CPU seconds of the whole process. Results: `benchmarks/results/memory_allocator.json`
and `.md` (machine, load before and after, commit).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS, ROOT, git_commit, loadavg, machine_info, machine_line, write_results

from hf_scratch_transformer.cpu_threads import cpu_bf16_units
from hf_scratch_transformer.memory_allocator import ALLOCATOR_VARIABLE, RELAUNCHED_VARIABLE


def settings() -> dict[str, dict[str, str]]:
    """Name -> the environment it adds to a clean one."""
    return {"system malloc": {ALLOCATOR_VARIABLE: "system"}, "train.py's default": {}}


def one_run(steps: int, extra_env: dict[str, str], flags: list[str]) -> dict:
    environ = {key: value for key, value in os.environ.items()
               if key not in ("LD_PRELOAD", "GLIBC_TUNABLES", ALLOCATOR_VARIABLE, RELAUNCHED_VARIABLE)}
    with tempfile.TemporaryDirectory() as output_dir:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--output_dir", output_dir, "--max_steps",
                                 str(steps), "--do_train", "true", "--cpu_threads", "2", "--save_steps", "0",
                                 "--report_to", "none", *flags], capture_output=True, text=True, cwd=ROOT,
                                env={**environ, **extra_env})
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if result.returncode != 0:
            raise SystemExit(f"train.py failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        train = json.loads((Path(output_dir) / "train_results.json").read_text())
    return {"tokens_per_second": train["train_tokens_per_second"],
            "memory_allocator": train.get("train_memory_allocator"),
            "minor_faults": after.ru_minflt - before.ru_minflt,
            "system_seconds": round(after.ru_stime - before.ru_stime, 2),
            "user_seconds": round(after.ru_utime - before.ru_utime, 2)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="optimiser steps of each train.py run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--output", default=str(RESULTS / "memory_allocator.json"))
    args, train_flags = parser.parse_known_args(argv)
    chosen, load_before = settings(), loadavg()
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    for round_ in range(args.rounds):
        for name, extra_env in chosen.items():
            runs[name].append(one_run(args.steps, extra_env, train_flags))
            print(f"round {round_ + 1} {name}: {runs[name][-1]}", flush=True)
    baseline = statistics.median(run["tokens_per_second"] for run in runs["system malloc"])
    summary = {name: {"median_tokens_per_second": statistics.median(run["tokens_per_second"] for run in rows),
                      "median_minor_faults": statistics.median(run["minor_faults"] for run in rows),
                      "median_system_seconds": statistics.median(run["system_seconds"] for run in rows),
                      "median_user_seconds": statistics.median(run["user_seconds"] for run in rows),
                      "memory_allocator": rows[0]["memory_allocator"],
                      # each round's ratio against that round's system-malloc run: the pairs share the load
                      "ratios_to_system_malloc": [round(run["tokens_per_second"] / base["tokens_per_second"], 3)
                                                  for run, base in zip(rows, runs["system malloc"])]}
               for name, rows in runs.items()}
    results = {"settings": vars(args) | {"train_flags": train_flags}, "machine": machine_info(2),
               "commit": git_commit(), "load_before": load_before, "load_after": loadavg(), "note": args.note,
               "runs": runs, "summary": summary}
    lines = ["# Training speed by memory allocator", "",
             f"{machine_line(results['machine'])} bf16 units: {cpu_bf16_units() or 'none'}; load average {load_before} before, "
             f"{results['load_after']} after{'; ' + args.note if args.note else ''}.", "",
             f"`train.py --max_steps {args.steps} --do_train true --cpu_threads 2` (default recipe, shipped corpus), "
             f"{args.rounds} rounds, the settings in turn each round; medians, and each round's ratio to that round's "
             f"system-malloc run.", "",
             "| setting | what the run reported | tokens/s | vs system malloc | per round | minor page faults | "
             "system CPU s | user CPU s |", "|---|---|---:|---:|---|---:|---:|---:|"]
    for name, row in summary.items():
        lines.append(f"| {name} | {row['memory_allocator']} | {row['median_tokens_per_second']:,.0f} | "
                     f"{row['median_tokens_per_second'] / baseline:.2f}x | "
                     f"{', '.join(f'{ratio:.2f}' for ratio in row['ratios_to_system_malloc'])} | "
                     f"{row['median_minor_faults']:,.0f} | {row['median_system_seconds']:.1f} | "
                     f"{row['median_user_seconds']:.1f} |")
    write_results(results, Path(args.output), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
