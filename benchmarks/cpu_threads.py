"""The CPU-thread policy, measured: the default (adaptive) against fixed thread counts, on a quiet machine and with
one core taken by another process.

    python benchmarks/cpu_threads.py                    # quiet and busy, 2 rounds (ABAB...), ~40 min on 2 cores
    python benchmarks/cpu_threads.py --rounds 1 --steps 100 --sentences 100   # a quick look

For each load (quiet; busy: a `while True: pass` process pinned to the last core, killed after each measurement)
and each round, in turn: `train.py` with the default policy, `--cpu_threads 1` and `--cpu_threads <all cores>`
(training tokens/s of the `small` preset on the shipped corpus, from train_results.json: setup excluded), then
`hf-scratch-translate` greedy on test sentences with the same three settings (sentences/s of the whole command,
model loading included). Results: benchmarks/results/cpu_threads.{json,md}. Run it on an otherwise idle machine:
the "quiet" figures assume nothing else runs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine_info, machine_line, write_results

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "cpu_threads.json"


def start_hog(core: int) -> subprocess.Popen:
    """A process spinning on `core` until killed (bounded by the caller)."""
    code = f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    return subprocess.Popen([sys.executable, "-c", code])


def train_tokens_per_second(threads: int | None, steps: int, model_dir: Path, work: Path, env: dict) -> float:
    output_dir = Path(tempfile.mkdtemp(dir=work))
    flags = ["--model_name_or_path", str(model_dir), "--do_train", "--max_steps", str(steps), "--eval_steps", "0",
             "--save_steps", "0", "--report_to", "none", "--max_train_samples", "8000", "--output_dir",
             str(output_dir), "--logging_steps", "25", "--bf16", "false",
             "--source_lowercase_rate", "0", "--source_paraphrase_rate", "0",
             "--source_plain_quotes_rate", "0"]  # fp32 and no source noise, as measured
    if threads is not None:
        flags += ["--cpu_threads", str(threads)]
    subprocess.run([sys.executable, str(REPO / "train.py"), *flags], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "TQDM_DISABLE": "1", **env})
    return json.loads((output_dir / "train_results.json").read_text())["train_tokens_per_second"]


def translate_sentences_per_second(threads: int | None, model_dir: Path, sources: Path, work: Path,
                                   env: dict) -> float:
    command = [sys.executable, "-m", "hf_scratch_transformer.translation.cli", "--model", str(model_dir), "--input_file",
               str(sources), "--output_file", str(work / "out.txt"), "--num_beams", "1", "--no_progress"]
    if threads is not None:
        command += ["--cpu_threads", str(threads)]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, **env})
    return len(sources.read_text().splitlines()) / (time.perf_counter() - started)


def measure(args, model_dir: Path, sources: Path, work: Path) -> list[dict]:
    cores = len(os.sched_getaffinity(0))
    # label: (--cpu_threads, extra environment); OpenMP's passive wait policy is the environment setting tried
    settings = {"default (adaptive)": (None, {}), "--cpu_threads 1": (1, {}), f"--cpu_threads {cores}": (cores, {}),
                f"--cpu_threads {cores}, OMP_WAIT_POLICY=PASSIVE": (cores, {"OMP_WAIT_POLICY": "PASSIVE"})}
    if args.settings:  # "default", "1", "2", "passive"
        short = {"default": "default (adaptive)", "passive": f"--cpu_threads {cores}, OMP_WAIT_POLICY=PASSIVE"}
        settings = {label: settings[label] for label in (short.get(name, f"--cpu_threads {name}")
                                                          for name in args.settings)}
    rows = []
    for load in args.loads:
        for round_ in range(args.rounds):
            for label, (threads, env) in settings.items():
                hog = start_hog(cores - 1) if load == "busy" else None
                try:
                    tokens = train_tokens_per_second(threads, args.steps, model_dir, work, env)
                    sentences = translate_sentences_per_second(threads, model_dir, sources, work, env)
                finally:
                    if hog is not None:
                        hog.kill()
                        hog.wait()
                row = {"load": load, "round": round_, "setting": label, "train_tokens_per_second": tokens,
                       "translate_sentences_per_second": round(sentences, 2)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| load | setting | training tokens/s (median, range) | vs best fixed | translation sentences/s | "
             "vs best fixed |", "|---|---|---:|---:|---:|---:|"]
    for load in ("quiet", "busy"):
        mine = [row for row in rows if row["load"] == load]
        if not mine:
            continue
        settings = list(dict.fromkeys(row["setting"] for row in mine))
        medians = {key: {s: statistics.median(r[key] for r in mine if r["setting"] == s) for s in settings}
                   for key in ("train_tokens_per_second", "translate_sentences_per_second")}
        best = {key: max(v for s, v in values.items() if s.startswith("--")) for key, values in medians.items()}
        for setting in settings:
            cells = []
            for key in ("train_tokens_per_second", "translate_sentences_per_second"):
                values = [r[key] for r in mine if r["setting"] == setting]
                cells += [f"{medians[key][setting]:,.1f} ({min(values):,.1f}–{max(values):,.1f})",
                          f"{medians[key][setting] / best[key]:.2f}×"]
            lines.append(f"| {load} | {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a trained small model (default: train one, 200 steps)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300, help="training steps per measurement")
    parser.add_argument("--sentences", type=int, default=300, help="test sentences translated per measurement")
    parser.add_argument("--loads", nargs="+", choices=["quiet", "busy"], default=["quiet", "busy"])
    parser.add_argument("--settings", nargs="+", help="only these settings (default: all), e.g. default 2")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where to write (JSON; the .md beside it)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cpu-threads-") as tmp:
        work = Path(tmp)
        model_dir = args.model or _train_small_model(work)
        from hf_scratch_transformer.data.loading import DataArguments, load_parallel_corpus
        from hf_scratch_transformer.data.preprocessing import evaluation_pairs

        sources, _ = evaluation_pairs(load_parallel_corpus(DataArguments())["test"], DataArguments())
        source_file = work / "sources.txt"
        source_file.write_text("".join(line + "\n" for line in sources[: args.sentences]), encoding="utf-8")
        rows = measure(args, model_dir, source_file, work)
    machine = machine_info(threads=0)  # the thread count is what is measured
    result = {"machine": machine, "steps": args.steps, "sentences": args.sentences, "rounds": args.rounds,
              "rows": rows, "table": table(rows)}
    write_results(result, args.results, (
        f"# CPU threads: the adaptive default against fixed counts\n\n{machine_line(machine)} AMX: "
        f"{'yes' if machine['amx'] else 'no'}. `python benchmarks/cpu_threads.py {' '.join(sys.argv[1:])}`. Busy: one core spun by another process. Training: the `small` "
        f"preset, 1,024-token batches, tokens/s from train_results.json; translation: greedy, the whole command "
        f"(model loading included).\n\n{result['table']}\n"))
    print(result["table"])


def _train_small_model(work: Path) -> Path:
    model_dir = work / "model"
    subprocess.run([sys.executable, str(REPO / "train.py"), "--max_steps", "200", "--eval_steps", "0",
                    "--save_steps", "0", "--report_to", "none", "--do_train", "--bf16", "false",
                    "--source_lowercase_rate", "0", "--source_paraphrase_rate", "0",
                    "--source_plain_quotes_rate", "0", "--output_dir",
                    str(model_dir)],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return model_dir


if __name__ == "__main__":
    main()
