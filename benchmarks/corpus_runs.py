"""The default recipe on more than one corpus: the shipped corpus en→es and es→en, and 3,000 / 10,000 training pairs,
each run end to end with no size or length flags (the run-length rule decides when to stop).

    python benchmarks/corpus_runs.py en-es --note "idle"            # one run; appends a row to the results
    python benchmarks/corpus_runs.py es-en 3k --note "..."           # several, one after the other
    python benchmarks/corpus_runs.py --table                        # rewrite results/corpus_runs.md
    python benchmarks/corpus_runs.py --list

Each run is `python train.py --output_dir DIR --bf16 false <its flags>` (fp32, as on a CPU without AVX-512 BF16) timed from start to exit (corpus, tokenizer, training,
validation, test decoding, save). A row of `benchmarks/results/corpus_runs.jsonl` holds the flags, the wall time,
the steps, why the run stopped, the best validation step and test BLEU / chrF greedy and beam 4 from
all_results.json, with the machine, its load average at start and end, and `--note` (say what else was running).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import loadavg, machine_info

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "corpus_runs.jsonl"

RUNS = {
    "en-es": [],  # the Quickstart's `python train.py`
    "es-en": ["--source_lang", "es", "--target_lang", "en"],
    "10k": ["--max_train_samples", "10000"],
    "3k": ["--max_train_samples", "3000"],
}


def run(name: str, output_root: Path, note: str, extra: list[str]) -> dict:
    output_dir = output_root / f"corpus-run-{name}"
    # pinned as the rows ran: fp32 (the default before bf16 on CPUs with AVX-512 BF16) and no source lower-casing
    command = [sys.executable, str(REPO / "train.py"), "--output_dir", str(output_dir), "--overwrite_output_dir",
               "--bf16", "false", "--source_lowercase_rate", "0", "--source_paraphrase_rate", "0",
               "--source_plain_quotes_rate", "0", *RUNS[name], *extra]
    load_before, started = loadavg(), time.perf_counter()
    output_root.mkdir(parents=True, exist_ok=True)
    log = output_root / f"corpus-run-{name}.log"
    with open(log, "w") as stream:
        subprocess.run(command, check=True, cwd=REPO, stdout=stream, stderr=subprocess.STDOUT,
                       env={**os.environ, "TQDM_DISABLE": "1"})
    wall = time.perf_counter() - started
    results = json.loads((output_dir / "all_results.json").read_text())
    keys = ("train_steps", "epoch", "stop_reason", "stop_detail", "best_step", "best_metric", "train_cpu_threads",
            "train_cpu_thread_changes", "train_tokens_per_second", "train_runtime", "train_samples",
            "predict_bleu_greedy", "predict_bleu", "predict_chrf_greedy", "predict_chrf", "eval_bleu")
    row = {"name": name, "flags": RUNS[name] + extra, "wall_minutes": round(wall / 60, 2), "note": note,
           "loadavg_start": load_before, "loadavg_end": loadavg(), "output_dir": str(output_dir), "log": str(log),
           **{key: results.get(key) for key in keys}, "machine": machine_info(threads=0)}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as stream:
        stream.write(json.dumps(row) + "\n")
    return row


def table(rows: list[dict]) -> str:
    lines = ["| run | flags | training pairs | wall time | steps (epochs) | stopped by | best step | test BLEU greedy "
             "/ beam 4 | test chrF greedy / beam 4 | load | commit |", "|---|---|---:|---:|---:|---|---:|---:|---:|---|---|"]
    for row in rows:
        flags = " ".join(row["flags"]) or "(none)"
        lines.append(
            f"| {row['name']} | `{flags}` | {row['train_samples']:,} | {row['wall_minutes']:.1f} min | "
            f"{row['train_steps']:,} ({row['epoch']:.1f}) | {row['stop_reason']} | {row.get('best_step') or '—'} | "
            f"{row['predict_bleu_greedy']:.2f} / {row['predict_bleu']:.2f} | "
            f"{row['predict_chrf_greedy']:.2f} / {row['predict_chrf']:.2f} | {row['note']} "
            f"(load {row['loadavg_start'][0]:.1f} → {row['loadavg_end'][0]:.1f}) | "
            f"{(row['machine'].get('git_commit') or '?')[:7]} |")
    return "\n".join(lines)


def write_table() -> str:
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    machine = rows[-1]["machine"]
    text = (f"# The default recipe on more than one corpus\n\n`python benchmarks/corpus_runs.py NAME --note ...`: "
            f"`python train.py --bf16 false` with the flags shown and nothing else (fp32, as on a CPU without "
            f"AVX-512 BF16; the run-length rule decides the steps), "
            f"timed end to end. Test split of the shipped corpus (755 pairs), sacreBLEU 13a. Machine: "
            f"{machine['cpu']}, {machine['logical_cpus']} logical CPUs, AVX-512 {'yes' if machine['avx512f'] else 'no'}"
            f", AMX {'yes' if machine['amx'] else 'no'}; torch {machine['torch']}, transformers "
            f"{machine['transformers']}. The load column says what else ran.\n\n{table(rows)}\n")
    RESULTS.with_suffix(".md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"runs: {', '.join(RUNS)}")
    parser.add_argument("--note", default="", help="what else ran on the machine (written beside the figures)")
    parser.add_argument("--output_root", type=Path, default=REPO / "outputs")
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--list", action="store_true")
    args, extra = parser.parse_known_args()  # anything else goes to train.py (e.g. --cpu_threads 1)
    unknown = [name for name in args.names if name not in RUNS]
    if unknown:
        parser.error(f"unknown run(s) {', '.join(unknown)}: choose from {', '.join(RUNS)}")
    if args.list:
        for name, flags in RUNS.items():
            print(name, " ".join(flags))
        return
    for name in args.names:
        print(json.dumps(run(name, args.output_root, args.note, extra)), flush=True)
    if args.table or args.names:
        print(write_table())


if __name__ == "__main__":
    main()
