"""Where a default training step's time goes, and what train.py's loop adds to it (issue: speed to the CPU's limit).

    python benchmarks/training_step_profile.py                    # 200 steps of `python train.py`, then the profile
    python benchmarks/training_step_profile.py --steps 300 --cpu_threads 1 --note "one core busy"

1. `train.py`'s own `main` runs `--steps` optimiser steps of the default recipe on the shipped corpus (`--do_train` only:
   no test); a `TrainingCallback` notes the time and the non-padding tokens of every batch after `--warmup` steps and
   keeps a copy of `--batches` of them.
2. The bare step on those same batches, in the same process: a fresh model of the run's configuration, the run's
   autocast (`training.loop.mixed_precision_autocast`), forward with the run's label smoothing, backward, clipping at
   1.0, a fused Adam step; `--repeats` passes, the median, each pass followed by a pass of train.py's own step
   (`TrainingLoop._train_batch` of the run's loop: its model, optimiser and Accelerate wrappers) over the same
   batches (ABAB). The bare step against train.py's step, interleaved, is what the step's wrappers cost; against the
   loop's ms/step (measured before, with the data, augmentation, tuner and logging between steps), what the loop
   costs besides.
3. `torch.profiler` over `--profile_steps` bare steps: time per operator, and grouped (matrix products, dtype casts,
   attention (the kernel, or the batched products of the written-out formula), the softmax and loss, the optimiser,
   the rest).

Results: `benchmarks/results/training_step_profile.json` and `.md` (machine, load, commit). The loop's row runs
before the other two, not interleaved with them: on a shared machine its ratio to them carries the machine's drift
(the load averages before and after are written beside it); the two steps' rows are interleaved.
"""

import argparse
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from common import RESULTS, git_commit, loadavg, machine_info, write_results

from hf_scratch_transformer.modeling_scratch_transformer import ScratchTransformerForConditionalGeneration
from hf_scratch_transformer.training.loop import TrainingCallback, mixed_precision_autocast, training_callbacks
from hf_scratch_transformer.training.loss import teacher_forced_loss
from hf_scratch_transformer.training.run import main as train_main

# Operator groups of the profile (substrings of aten operator names, first match wins).
GROUPS = [
    ("matrix products", ("aten::mm", "aten::addmm", "aten::linear")),
    ("dtype casts", ("aten::copy_", "aten::_to_copy", "aten::to")),
    # Training in bf16 on a CPU, attention is written out: its products are the step's only batched ones (bmm).
    ("attention", ("scaled_dot_product", "aten::bmm")),
    ("softmax and loss", ("log_softmax", "aten::_softmax", "nll_loss", "cross_entropy", "scatter_add")),
    ("optimiser and clipping", ("_fused_adam", "linalg_vector_norm", "_foreach", "clip_grad")),
]


class BatchTimer(TrainingCallback):
    """Times every batch of the loop after `warmup` optimiser steps and keeps copies of `keep` batches."""

    def __init__(self, warmup: int, keep: int):
        self.warmup, self.keep = warmup, keep
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.batches: list[dict] = []
        self.config = self.precision = self.label_smoothing = self.loop = None

    def on_train_begin(self, loop) -> None:
        self.config, self.precision = loop.model.config, loop.recipe.precision
        self.label_smoothing = loop.args.label_smoothing_factor
        self.loop = loop

    def on_batch_end(self, loop, indices, batch, loss) -> None:
        if self.loop is None:  # the run has ended: its steps are now timed by `main`
            return
        if loop.state.global_step + 1 < self.warmup:  # this batch ends optimiser step global_step + 1
            return
        self.times.append(time.perf_counter())
        self.tokens.append(int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum()))
        if len(self.batches) < self.keep:
            self.batches.append({key: batch[key].clone() for key in ("input_ids", "attention_mask", "labels")})


def timed_train_py_run(steps: int, warmup: int, keep: int, cpu_threads: int, train_flags: list[str]) -> BatchTimer:
    """`train.py`'s own `main` for `steps` optimiser steps (`--do_train` only, in a temporary output_dir), timed and
    `keep` of its batches kept by a `BatchTimer`."""
    timer = BatchTimer(warmup, keep)
    with tempfile.TemporaryDirectory() as output_dir, training_callbacks(timer):
        code = train_main(["--output_dir", output_dir, "--max_steps", str(steps), "--do_train", "true",
                           "--cpu_threads", str(cpu_threads), *train_flags])
    if code != 0:
        raise SystemExit(f"the train.py run failed (exit {code}): see its message above")
    return timer


def bare_step(model, optimizer, autocast, label_smoothing: float):
    def step(batch: dict) -> None:
        with autocast():
            loss = teacher_forced_loss(model, batch, label_smoothing)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def grouped(table) -> dict[str, float]:
    """Self CPU milliseconds per operator group."""
    totals = {name: 0.0 for name, _ in GROUPS} | {"the rest": 0.0}
    for event in table:
        if not event.key.startswith("aten::"):
            continue
        group = next((name for name, keys in GROUPS if any(key in event.key for key in keys)), "the rest")
        totals[group] += event.self_cpu_time_total / 1000
    return totals


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="optimiser steps of the train.py run")
    parser.add_argument("--warmup", type=int, default=50, help="steps before the loop's timing starts")
    parser.add_argument("--batches", type=int, default=60, help="batches kept for the bare step")
    parser.add_argument("--repeats", type=int, default=3, help="passes of each step over the kept batches (median)")
    parser.add_argument("--profile_steps", type=int, default=10)
    parser.add_argument("--cpu_threads", type=int, default=2, help="train.py's --cpu_threads, and the bare step's")
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--output", default=str(RESULTS / "training_step_profile.json"))
    args, train_flags = parser.parse_known_args(argv)
    if args.steps <= args.warmup + 1:
        parser.error("--steps must exceed --warmup by at least 2")
    load_before = loadavg()
    timer = timed_train_py_run(args.steps, args.warmup, args.batches, args.cpu_threads, train_flags)
    # The first timestamp closes the warm-up's last step; the batches after it are the loop's timed ones.
    loop_seconds = timer.times[-1] - timer.times[0]
    loop_tokens = sum(timer.tokens[1:])
    loop_steps = len(timer.times) - 1

    torch.set_num_threads(args.cpu_threads)
    torch.manual_seed(0)
    model = ScratchTransformerForConditionalGeneration(timer.config).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    step = bare_step(model, optimizer, mixed_precision_autocast(timer.precision, torch.device("cpu")),
                     timer.label_smoothing)
    loop, timer.loop = timer.loop, None

    def loop_step(batch: dict) -> None:
        loop._train_batch([], dict(batch))

    for batch in timer.batches[:5]:
        step(batch)
        loop_step(batch)
    passes, loop_step_passes = [], []
    for _ in range(args.repeats):  # ABAB: the bare step, then train.py's step, over the same batches
        for function, times in ((step, passes), (loop_step, loop_step_passes)):
            started = time.perf_counter()
            for batch in timer.batches:
                function(batch)
            times.append(time.perf_counter() - started)
    bare_tokens = sum(int(b["attention_mask"].sum()) + int((b["labels"] != -100).sum()) for b in timer.batches)
    bare_seconds = statistics.median(passes)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for batch in timer.batches[: args.profile_steps]:
            step(batch)
    events = profiler.key_averages()
    groups = grouped(events)
    total = sum(groups.values())
    results = {
        "settings": vars(args) | {"train_flags": train_flags}, "machine": machine_info(args.cpu_threads),
        "commit": git_commit(), "load_before": load_before, "load_after": loadavg(),
        "precision": timer.precision, "vocab_size": timer.config.vocab_size,
        "loop": {"steps": loop_steps, "ms_per_step": 1000 * loop_seconds / loop_steps,
                 "tokens_per_step": loop_tokens / loop_steps, "tokens_per_second": loop_tokens / loop_seconds},
        "loop_step": {"steps": len(timer.batches), "passes_seconds": loop_step_passes,
                      "ms_per_step": 1000 * statistics.median(loop_step_passes) / len(timer.batches)},
        "bare": {"steps": len(timer.batches), "passes_seconds": passes,
                 "ms_per_step": 1000 * bare_seconds / len(timer.batches),
                 "tokens_per_step": bare_tokens / len(timer.batches), "tokens_per_second": bare_tokens / bare_seconds},
        "profile_ms_per_step": {name: ms / args.profile_steps for name, ms in groups.items()},
        "profile_top": [{"operator": e.key, "self_ms_per_step": e.self_cpu_time_total / 1000 / args.profile_steps,
                         "calls_per_step": e.count / args.profile_steps}
                        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]],
    }
    machine, loop, bare, loop_step = results["machine"], results["loop"], results["bare"], results["loop_step"]
    lines = [
        "# A default training step: what the loop adds, and where the time goes", "",
        f"Machine: **{machine['cpu']}**, {machine['logical_cpus']} logical CPUs, AMX {'yes' if machine['amx'] else 'no'}, "
        f"{args.cpu_threads} thread(s); torch {torch.__version__}; commit {results['commit']}; load average "
        f"{load_before} before, {results['load_after']} after. {args.note}".rstrip(), "",
        f"`python train.py --max_steps {args.steps} --cpu_threads {args.cpu_threads} {' '.join(train_flags)}`"
        f"".replace("  ", " ").rstrip() + f" ({timer.precision}, BPE vocabulary {timer.config.vocab_size:,} with the "
        f"sentinels), timed after step {args.warmup}; then the bare step and train.py's step on {len(timer.batches)} "
        f"of the same batches, {args.repeats} passes each, alternated (ABAB), median.", "",
        "| | steps | ms / step | non-pad tokens / step | tokens / s |", "|---|---:|---:|---:|---:|",
        f"| train.py's loop | {loop['steps']} | {loop['ms_per_step']:.1f} | {loop['tokens_per_step']:.0f} | "
        f"{loop['tokens_per_second']:,.0f} |",
        f"| bare step (forward, backward, clipping, fused Adam) | {bare['steps']} | {bare['ms_per_step']:.1f} | "
        f"{bare['tokens_per_step']:.0f} | {bare['tokens_per_second']:,.0f} |",
        f"| train.py's step (`TrainingLoop._train_batch`), interleaved with the bare step | {loop_step['steps']} | "
        f"{loop_step['ms_per_step']:.1f} | {bare['tokens_per_step']:.0f} | "
        f"{1000 * bare['tokens_per_step'] / loop_step['ms_per_step']:,.0f} |", "",
        f"Passes (bare / train.py's step): {', '.join(f'{a:.2f} / {b:.2f} s' for a, b in zip(passes, loop_step_passes))}.",
        "",
        f"## torch.profiler, {args.profile_steps} bare steps (self CPU time per step, grouped)", "",
        "| group | ms / step | share |", "|---|---:|---:|",
        *[f"| {name} | {ms / args.profile_steps:.1f} | {ms / total:.1%} |" for name, ms in groups.items()], "",
        "| operator | self ms / step | calls / step |", "|---|---:|---:|",
        *[f"| `{row['operator']}` | {row['self_ms_per_step']:.1f} | {row['calls_per_step']:.0f} |"
          for row in results["profile_top"]],
    ]
    write_results(results, args.output, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
