"""The default recipe against a small sweep around it, on corpora unlike the shipped one (issue: a recipe for any
corpus). Each run is `python train.py` on a corpus directory of `build_corpora.py` (train/validation/test JSON lines)
with one variant's flags and nothing else, so the default row is exactly what a user of that corpus gets:

    python benchmarks/recipe_sweep.py games_en_el_5k default dropout0.1 dropout0.3 --cpu_threads 1 --note "..."
    python benchmarks/recipe_sweep.py --table          # rewrite results/recipe_sweep.md from the JSON lines
    python benchmarks/recipe_sweep.py --list

Variants (VARIANTS): the default; --dropout 0 / 0.1 / 0.3 (whatever the recipe chose, pinned); the step budget x0.5
and x2 in the same time (--max_tokens 2,048 / 512 for the budget's 1,024, so every variant sees about the same tokens;
early stopping and the best model kept as under the run-length rule; `steps1` is the budget at 1,024 tokens, the
default run spelled out where the default batch is 1,024; any `stepsF` scales likewise, so `steps0.25` is 4,096-token
batches, the x0.5 around a default of 2,048); the BPE vocabulary x0.5 and x2. `--train_flags` adds flags to every
variant (on a GPU, `--bf16 true`: the precision the CPU recipe chooses). A row of results/recipe_sweep.jsonl holds the
corpus, the variant, its flags, the recipe train.py resolved (dropout and why), the batch it trained on and the tokens
it saw (a --max_steps pinned in --train_flags keeps the tokens equal only at the batch it was pinned for), wall time,
steps, epochs, why it stopped, the best validation BLEU and the test BLEU greedy / beam 4, with the machine, load and
`--note`. The choice between variants is made on validation BLEU; the table also shows test.
"""

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

from build_corpora import DEFAULT_OUTPUT_DIR
from common import git_commit, loadavg, machine_info

from hf_scratch_transformer.data.loading import DataArguments
from hf_scratch_transformer.training.recipe import (BF16_CPU_STEP_BUDGET, DEFAULT_STEP_BUDGET, STEP_BUDGET_BATCH_TOKENS,
                                                      dropout_for)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "recipe_sweep.jsonl"
CORPORA = DEFAULT_OUTPUT_DIR  # where build_corpora.py writes the corpora a name stands for

# What the steps and bpe variants scale: the batch the step budget is counted in (train.py's batch rule gives it to
# pairs of at most 21 tokens on average, 2,048 tokens to longer ones) and train.py's --tokenizer_vocab_size default
DEFAULT_MAX_TOKENS = STEP_BUDGET_BATCH_TOKENS
DEFAULT_VOCAB = next(f.default for f in fields(DataArguments) if f.name == "tokenizer_vocab_size")


def variant_flags(name: str, step_budget: int) -> list[str]:
    """train.py flags of a variant; `step_budget` is the run-length rule's budget of the default run."""
    if name == "default":
        return []
    if name.startswith("dropout"):
        return ["--dropout", name.removeprefix("dropout")]
    if name.startswith("steps"):
        factor = float(name.removeprefix("steps"))
        return ["--max_steps", str(round(step_budget * factor)),
                "--max_tokens", str(round(DEFAULT_MAX_TOKENS / factor)),
                "--early_stopping_patience", "3", "--load_best_model_at_end", "true"]
    if name.startswith("bpe"):
        return ["--tokenizer_vocab_size", str(round(DEFAULT_VOCAB * float(name.removeprefix("bpe"))))]
    raise SystemExit(f"unknown variant {name!r}: one of {', '.join(VARIANTS)}")


VARIANTS = ["default", "dropout0", "dropout0.1", "dropout0.3", "steps0.5", "steps2", "bpe0.5", "bpe2"]


def languages(corpus: Path) -> tuple[str, str]:
    manifest = json.loads((corpus / "manifest.json").read_text())
    return manifest["languages"]["source"], manifest["languages"]["target"]


def run(corpus: Path, variant: str, args) -> dict:
    source, target = languages(corpus)
    output_dir = args.output_root / f"{corpus.name}-{variant}"
    flags = variant_flags(variant, args.step_budget) + shlex.split(args.train_flags)
    if args.record_only:  # a run made before, whose row was not written: read its output directory
        return row(corpus, variant, flags, output_dir, args, wall=None, load="(recorded afterwards)")
    command = [sys.executable, str(REPO / "train.py"), "--output_dir", str(output_dir), "--overwrite_output_dir",
               "--train_file", str(corpus / "train.jsonl"), "--validation_file", str(corpus / "validation.jsonl"),
               "--test_file", str(corpus / "test.jsonl"), "--source_lang", source, "--target_lang", target,
               "--seed", str(args.seed), *(["--cpu_threads", str(args.cpu_threads)] if args.cpu_threads else []),
               *flags]
    load_before, started = loadavg(), time.perf_counter()
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(output_dir.parent / f"{corpus.name}-{variant}.log", "w") as stream:
        subprocess.run(command, check=True, cwd=REPO, stdout=stream, stderr=subprocess.STDOUT,
                       env={**os.environ, "TQDM_DISABLE": "1"})
    return row(corpus, variant, flags, output_dir, args, time.perf_counter() - started,
               f"{load_before} -> {loadavg()}")


def row(corpus: Path, variant: str, flags: list[str], output_dir: Path, args, wall: float | None, load: str) -> dict:
    """The results row of a finished run in `output_dir`."""
    results = json.loads((output_dir / "all_results.json").read_text())
    train = json.loads((output_dir / "train_results.json").read_text())
    config = json.loads((output_dir / "config.json").read_text())
    keys = ("train_steps", "epoch", "stop_reason", "best_step", "best_metric", "predict_bleu_greedy", "predict_bleu",
            "train_cpu_threads", "train_samples", "total_runtime")
    # the epochs the run planned (what the recipe's dropout rule reads): its steps per epoch from what it trained,
    # its planned steps from --max_steps or the run-length rule (at most the step budget and 100 epochs)
    per_epoch = results["train_steps"] / results["epoch"]
    planned = (int(flags[flags.index("--max_steps") + 1]) if "--max_steps" in flags
               else min(args.step_budget, math.ceil(100 * per_epoch)))
    return {"corpus": corpus.name, "variant": variant, "flags": " ".join(flags) or "(none)", "seed": args.seed,
            "planned_epochs": round(planned / per_epoch, 2),
            # recorded afterwards: train.py's own total_runtime (start to the results, without the interpreter's start)
            "wall_minutes": round((wall if wall is not None else results["total_runtime"]) / 60, 1),
            **{key: results.get(key) for key in keys},
            # the batch the run trained on (--max_tokens or the recipe's batch rule) and the tokens it saw: variants
            # are compared at equal tokens, which a pinned --max_steps with a batch the rule chose can break
            "batch_tokens": train.get("recipe", {}).get("batch_tokens"), "train_tokens": train.get("train_tokens"),
            "dropout": config.get("dropout"), "recipe": train.get("recipe", {}).get("description"),
            "load": load, "note": args.note, "machine": machine_info(threads=args.cpu_threads),
            "commit": args.commit or git_commit()}


def table() -> str:
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    machine = rows[-1]["machine"] if rows else {}
    lines = ["# The default recipe against a sweep around it, on corpora unlike the shipped one", "",
             "`python benchmarks/recipe_sweep.py CORPUS VARIANT...`: `python train.py` on the corpus with the variant's "
             "flags and nothing else. Validation BLEU (greedy, of the kept model) chooses; test BLEU greedy / beam 4 "
             "is reported once. sacreBLEU 13a. The recipe's column: the dropout train.py's recipe gives that corpus "
             "(`training.recipe.dropout_for` of the planned epochs), i.e. which row is the default run.",
             f"Last machine: {machine.get('cpu', '?')}, {machine.get('logical_cpus', '?')} logical CPUs, AMX "
             f"{'yes' if machine.get('amx') else 'no'}; the load column says what else ran.", "",
             "| corpus | variant | flags | dropout | the recipe's dropout | steps (epochs) | batch, tokens trained | "
             "stopped by | wall | validation BLEU | test greedy / beam 4 | load, note | commit |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|---|"]

    def trained(row: dict) -> str:  # rows written before the batch was recorded show "?"
        batch = f"{row['batch_tokens']:,}" if row.get("batch_tokens") else "?"
        return f"{batch}, {row['train_tokens'] / 1e6:.1f}M" if row.get("train_tokens") else f"{batch}, ?"

    for row in rows:
        epochs = f"{row['epoch']:.3g}" if isinstance(row.get("epoch"), (int, float)) else "?"
        planned = row.get("planned_epochs")
        lines.append(
            f"| {row['corpus']} | {row['variant']} | `{row['flags']}` | {row['dropout']} | "
            f"{dropout_for(planned)[0] if planned else '?'} ({planned} epochs planned) | {row['train_steps']:,} ({epochs}) | "
            f"{trained(row)} | "
            f"{row['stop_reason']} | {row['wall_minutes']} min | {row['best_metric']} | "
            f"{row['predict_bleu_greedy']} / {row['predict_bleu']} | {row['load']}; {row['note']} | "
            f"{row.get('commit', '?')} |")
    groups = {}
    for row in rows:
        groups.setdefault((row["corpus"], row["seed"]), []).append(row)
    lines += ["", "The best variant on validation, per corpus and seed (a variant named by its flags: the defaults it "
              "scales changed between runs):", ""]

    def named(row: dict) -> str:
        if row["flags"] and row["flags"] != "(none)":
            return f"{row['variant']} (`{row['flags']}`)"
        return f"{row['variant']} (of commit {row.get('commit', '?')})"

    for (corpus, seed), group in groups.items():
        chosen = max(group, key=lambda row: row["best_metric"] or 0)
        lines.append(f"- {corpus}, seed {seed}: {named(chosen)} (validation {chosen['best_metric']}, test "
                     f"{chosen['predict_bleu_greedy']} / {chosen['predict_bleu']}) of "
                     f"{', '.join(named(row) for row in group)}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", nargs="?", help="a corpus name under work/corpora, or a corpus directory")
    parser.add_argument("variants", nargs="*", metavar="VARIANT", help=f"default: default; any of {', '.join(VARIANTS)}")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--cpu_threads", type=int, default=0, help="train.py's --cpu_threads (0: its default)")
    parser.add_argument("--step_budget", type=int, default=BF16_CPU_STEP_BUDGET,
                        help=f"the default run's step budget, which the steps variants scale ({BF16_CPU_STEP_BUDGET:,} "
                             f"with bf16 on a CPU with bf16 units, {DEFAULT_STEP_BUDGET:,} in fp32)")
    parser.add_argument("--train_flags", default="",
                        help="train.py flags added to every variant's, as one string (on a GPU, for example, "
                             "\"--bf16 true\", the precision the CPU recipe chooses there); recorded in the row's flags")
    parser.add_argument("--note", default="", help="what else ran on the machine (written beside the figures)")
    parser.add_argument("--output_root", type=Path, default=REPO / "outputs" / "recipe-sweep")
    parser.add_argument("--record_only", action="store_true",
                        help="write the rows of runs already made in --output_root (no training)")
    parser.add_argument("--commit", help="with --record_only: the commit the runs were made at")
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    if args.list:
        print("\n".join(f"{name}: {' '.join(variant_flags(name, args.step_budget)) or '(none)'}" for name in VARIANTS))
        return
    if not args.table:
        if not args.corpus:
            parser.error("name a corpus (or --table / --list)")
        corpus = Path(args.corpus) if Path(args.corpus).is_dir() else CORPORA / args.corpus
        if not (corpus / "train.jsonl").is_file():
            parser.error(f"{corpus} has no train.jsonl: build it with benchmarks/build_corpora.py")
        for variant in args.variants or ["default"]:
            variant_flags(variant, args.step_budget)  # an unknown name fails before any run
        for variant in args.variants or ["default"]:
            row = run(corpus, variant, args)
            with open(RESULTS, "a") as stream:
                stream.write(json.dumps(row, ensure_ascii=False) + "\n")
            print(json.dumps({key: row[key] for key in ("corpus", "variant", "best_metric", "predict_bleu_greedy",
                                                         "predict_bleu", "wall_minutes")}), flush=True)
    if RESULTS.exists():
        RESULTS.with_suffix(".md").write_text(table())


if __name__ == "__main__":
    main()
