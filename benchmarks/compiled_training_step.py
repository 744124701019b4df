"""`torch.compile` (inductor on the CPU) of the training step against eager, on train.py's own batches (issue: speed
to the CPU's limit).

    python benchmarks/compiled_training_step.py                  # idle, then with one core busy
    python benchmarks/compiled_training_step.py --bf16 false      # any train.py flag after ours

1. `train.py`'s own `main` runs `--steps` optimiser steps of the default recipe (`--do_train` only) and keeps
   `--batches` of its batches (`training_step_profile.timed_train_py_run`).
2. Two models with the same fresh weights, each with its own fused Adam: one eager, one `torch.compile(model)` as
   `--torch_compile` makes it in train.py. Their losses on the first batch are compared before either trains. The
   compiled one's first pass over the batches (compilation, and the recompiles its varying shapes cause) is timed on
   its own.
3. The bare step (the run's autocast, forward with its label smoothing, backward, clipping at 1.0, Adam) of each
   model over the same batches, `--repeats` passes each, alternated (ABAB), idle; then the same with a process
   spinning on the last core (`--busy_repeats`; 0 skips it).

Results: `benchmarks/results/compiled_training_step.json` and `.md` (machine, load, commit).
"""

import argparse
import copy
import os
import statistics
import time

import torch

from common import RESULTS, git_commit, loadavg, machine_info, write_results
from cpu_threads import start_hog
from training_step_profile import bare_step, timed_train_py_run

from hf_scratch_transformer.modeling_scratch_transformer import ScratchTransformerForConditionalGeneration
from hf_scratch_transformer.training.loop import mixed_precision_autocast


def one_pass(step, batches: list[dict]) -> float:
    started = time.perf_counter()
    for batch in batches:
        step(batch)
    return time.perf_counter() - started


def alternated_passes(steps: dict, batches: list[dict], repeats: int) -> dict[str, list[float]]:
    """Seconds of each pass, eager and compiled alternated, the order swapped every repeat (ABBA...)."""
    seconds = {name: [] for name in steps}
    for repeat in range(repeats):
        for name in (list(steps) if repeat % 2 == 0 else list(steps)[::-1]):
            seconds[name].append(one_pass(steps[name], batches))
    return seconds


def summary(seconds: dict[str, list[float]], batches: int) -> dict:
    ratios = [eager / compiled for eager, compiled in zip(seconds["eager"], seconds["compiled"])]
    return {"passes_seconds": seconds, "ms_per_step": {name: 1000 * statistics.median(values) / batches
                                                       for name, values in seconds.items()},
            "speedups": ratios, "median_speedup": statistics.median(ratios)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80, help="optimiser steps of the train.py run")
    parser.add_argument("--warmup", type=int, default=10, help="steps before batches are kept")
    parser.add_argument("--batches", type=int, default=40, help="batches kept for the two steps")
    parser.add_argument("--repeats", type=int, default=6, help="passes of each step, idle, alternated")
    parser.add_argument("--busy_repeats", type=int, default=4, help="passes of each step with one core busy (0: none)")
    parser.add_argument("--cpu_threads", type=int, default=2)
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--output", default=str(RESULTS / "compiled_training_step.json"))
    args, train_flags = parser.parse_known_args(argv)
    load_before = loadavg()
    timer = timed_train_py_run(args.steps, args.warmup, args.batches, args.cpu_threads, train_flags)
    timer.loop = None
    batches = timer.batches
    torch.set_num_threads(args.cpu_threads)

    torch.manual_seed(0)
    eager_model = ScratchTransformerForConditionalGeneration(timer.config).train()
    compiled_model = torch.compile(copy.deepcopy(eager_model))
    autocast = mixed_precision_autocast(timer.precision, torch.device("cpu"))
    with torch.no_grad(), autocast():
        first_losses = [float(model(**batches[0], label_smoothing=timer.label_smoothing).loss)
                        for model in (eager_model, compiled_model)]
    steps = {}
    for name, model in (("eager", eager_model), ("compiled", compiled_model)):
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
        steps[name] = bare_step(model, optimizer, autocast, timer.label_smoothing)
    compile_seconds = one_pass(steps["compiled"], batches)  # compilation and recompiles, then the steps
    one_pass(steps["eager"], batches)
    idle = summary(alternated_passes(steps, batches, args.repeats), len(batches))
    busy = None
    if args.busy_repeats:
        hog = start_hog(len(os.sched_getaffinity(0)) - 1)
        try:
            busy = summary(alternated_passes(steps, batches, args.busy_repeats), len(batches))
        finally:
            hog.kill()
            hog.wait()
    shapes = sorted({tuple(batch["input_ids"].shape) + tuple(batch["labels"].shape[1:]) for batch in batches})
    results = {
        "settings": vars(args) | {"train_flags": train_flags}, "machine": machine_info(args.cpu_threads),
        "commit": git_commit(), "load_before": load_before, "load_after": loadavg(), "precision": timer.precision,
        "torch": torch.__version__, "batches": len(batches), "distinct_shapes": len(shapes),
        "first_batch_loss": {"eager": first_losses[0], "compiled": first_losses[1]},
        "first_compiled_pass_seconds": compile_seconds, "idle": idle, "busy": busy,
    }
    machine = results["machine"]
    rows = [("idle", idle)] + ([("one core busy", busy)] if busy else [])
    lines = [
        "# `torch.compile` of the training step against eager, on train.py's batches", "",
        f"Machine: **{machine['cpu']}**, {machine['logical_cpus']} logical CPUs, AMX {'yes' if machine['amx'] else 'no'}, "
        f"{args.cpu_threads} thread(s); torch {torch.__version__}; commit {results['commit']}; load average "
        f"{load_before} before, {results['load_after']} after. {args.note}".rstrip(), "",
        f"{len(batches)} batches of `python train.py --max_steps {args.steps} {' '.join(train_flags)}`".rstrip()
        + f" (kept after step {args.warmup}; {timer.precision}; {len(shapes)} distinct shapes), the bare step "
        f"(autocast, forward, backward, clipping, fused Adam) of an eager model and of `torch.compile(model)` with the "
        f"same fresh weights, passes alternated. First-batch loss before training: eager {first_losses[0]:.4f}, "
        f"compiled {first_losses[1]:.4f}. The compiled model's first pass (compilation and recompiles included): "
        f"{compile_seconds:.1f} s.", "",
        "| load | passes | eager ms / step | compiled ms / step | speed-up (median of pairs) | pairs |",
        "|---|---:|---:|---:|---:|---|",
        *[f"| {load} | {len(r['speedups'])} | {r['ms_per_step']['eager']:.1f} | {r['ms_per_step']['compiled']:.1f} | "
          f"{r['median_speedup']:.2f}× | {', '.join(f'{x:.2f}' for x in r['speedups'])} |" for load, r in rows],
    ]
    write_results(results, args.output, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
