"""How the data path scales: train.py's corpus loading, tokenizer training, preprocessing and the way to the first
training step on corpora of 30k, 300k and 1M pairs, with peak memory, a second run on the `datasets` cache, 1 and 2
preprocessing workers, and --streaming.

    python benchmarks/data_scaling.py                           # 30k, 300k, 1M pairs (hours on 2 cores)
    python benchmarks/data_scaling.py --sizes 30000 300000      # a subset
    python benchmarks/data_scaling.py --quick                   # 2k pairs, one configuration: the code path

The corpora are the shipped training pairs repeated, every copy made distinct by a number in front of both sides
("3 In the beginning..."), written in the formats users have: plain-text pairs (train.en + train.es) and JSON Lines.
Validation and test are the shipped files (64 pairs each are used). Each measurement is one `train.py` run in a fresh
process (`--do_train --max_steps 1`, the tiny model, everything else train.py's defaults: a BPE of
--tokenizer_vocab_size tokens (4,000 when results/data_scaling.* were measured, 8,000 today) trained on at most
500,000 sampled sentences, token batches of 1,024) whose phases are timed by wrapping the functions
train.py calls (`load_parallel_corpus`, `train_tokenizer_on_corpus`, `preprocess_corpus`, the first loss). Peak RSS
is the process's maximum resident set (getrusage), and that of its worker processes (`--preprocessing_num_workers
2`) apart. The first run of each configuration starts from an empty `datasets` cache (HF_DATASETS_CACHE); the second
run is the same command again, on that cache. Results: benchmarks/results/data_scaling.{json,md}.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
SHIPPED = ROOT / "hf_scratch_transformer" / "corpus"
MODES = {"map": {}, "map2": {"preprocessing_num_workers": 2}, "stream": {"streaming": True}}
DEFAULT_CONFIGS = ["plain:map", "plain:map2", "plain:stream", "jsonl:map"]
PHASES = ("load_s", "tokenizer_s", "preprocess_s", "setup_s", "first_step_s")
RSS_BOUND_MIB = 4096
LEGEND = (
    "Columns: *load* reads the corpus into the `datasets` cache (with --streaming: one checking pass over the files); "
    "*tokenizer* trains the BPE (on at most 500,000 sampled sentences); *preprocess* tokenises and filters every "
    "split (with --streaming this happens while batches are read, so its cost is in the next columns); *setup* runs "
    "from the end of preprocessing to the first step (validation pairs, model, batch sampler; with --streaming also "
    "the first 10,000-pair shuffle buffer); *to first step* counts from the start of the process. *peak RSS*: the "
    "train.py process; *workers' peak*: its largest child process (the --preprocessing_num_workers 2 workers in the "
    "map2 rows). *first*: empty `datasets` cache; *second*: the same command again on that cache.")


# ------------------------------------------------------------------------------------------------------ corpora


def shipped_pairs() -> list[tuple[str, str]]:
    with gzip.open(SHIPPED / "bible_en_es.train.jsonl.gz", "rt", encoding="utf-8") as handle:
        return [(record["translation"]["en"], record["translation"]["es"]) for record in map(json.loads, handle)]


def numbered_pairs(size: int, base: list[tuple[str, str]]):
    """`size` distinct pairs: the shipped pairs, then copies numbered 1, 2, ... in front of both sides."""
    for index in range(size):
        en, es = base[index % len(base)]
        copy = index // len(base)
        yield (en, es) if copy == 0 else (f"{copy} {en}", f"{copy} {es}")


def write_corpus(folder: Path, size: int, corpus_format: str, base) -> str:
    """The --train_file value of a corpus of `size` pairs in `corpus_format` ("plain" or "jsonl"), written once."""
    folder.mkdir(parents=True, exist_ok=True)
    done = folder / f".complete-{size}-{corpus_format}"
    target = folder / ("train" if corpus_format == "plain" else "train.jsonl")
    if done.exists():
        return str(target)
    if corpus_format == "plain":
        with open(folder / "train.en", "w", encoding="utf-8") as en, open(folder / "train.es", "w",
                                                                            encoding="utf-8") as es:
            for source, target_text in numbered_pairs(size, base):
                en.write(source + "\n")
                es.write(target_text + "\n")
    else:
        with open(target, "w", encoding="utf-8") as handle:
            for source, target_text in numbered_pairs(size, base):
                handle.write(json.dumps({"translation": {"en": source, "es": target_text}}, ensure_ascii=False) + "\n")
    done.touch()
    return str(target)


# ------------------------------------------------------------------------------------------------ one measured run


def train_argv(train_file: str, output_dir: Path, mode: str) -> list[str]:
    flags = {"train_file": train_file, "validation_file": str(SHIPPED / "bible_en_es.validation.jsonl.gz"),
             "test_file": str(SHIPPED / "bible_en_es.test.jsonl.gz"), "output_dir": str(output_dir),
             "preset": "tiny", "do_train": True, "max_steps": 1, "logging_steps": 1, "save_steps": 0,
             "eval_steps": 0, "max_eval_samples": 64, "max_predict_samples": 64, "report_to": "none",
             "bf16": "false", "source_lowercase_rate": 0, "source_paraphrase_rate": 0,
             "source_plain_quotes_rate": 0, **MODES[mode]}  # fp32 and no source noise, as the rows ran
    argv = []
    for key, value in flags.items():
        argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return argv


def child(argv: list[str], measurement: Path, cache: Path | None = None) -> int:
    """In a fresh process: train.py's main with its phases timed; the figures go to `measurement` (JSON). `cache`:
    the datasets cache to use when run in an existing process (a new one reads HF_DATASETS_CACHE)."""
    started = time.time()
    from hf_scratch_transformer.training import run as training

    marks = {"imported": time.time()}
    with _instrumented(training, marks, cache):
        code = training.main(argv)
    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    figures = {"exit_code": code, "import_s": marks["imported"] - started,
               "peak_rss_mib": own.ru_maxrss / 1024, "workers_peak_rss_mib": workers.ru_maxrss / 1024,
               **_phases(marks, started)}
    measurement.write_text(json.dumps(figures))
    return code


@contextmanager
def _instrumented(training, marks: dict, cache: Path | None):
    """The functions train.py calls for each phase, wrapped to record when they start and end (restored after); the
    start of training recorded by a callback of the training loop."""
    import datasets

    from hf_scratch_transformer.training.loop import TrainingCallback, training_callbacks

    class FirstStep(TrainingCallback):
        def on_train_begin(self, loop):
            marks.setdefault("first_step", time.time())

    names = {"load": "load_parallel_corpus", "tokenizer": "train_tokenizer_on_corpus",
             "preprocess": "preprocess_corpus"}
    originals = {attribute: getattr(training, attribute) for attribute in names.values()}
    real_cache = datasets.config.HF_DATASETS_CACHE
    for name, attribute in names.items():
        setattr(training, attribute, _timed(name, originals[attribute], marks))
    datasets.config.HF_DATASETS_CACHE = cache or real_cache
    try:
        with training_callbacks(FirstStep()):
            yield
    finally:
        for attribute, function in originals.items():
            setattr(training, attribute, function)
        datasets.config.HF_DATASETS_CACHE = real_cache


def _timed(name: str, function, marks: dict):
    def timed(*args, **kwargs):
        start = time.time()
        result = function(*args, **kwargs)
        marks[name] = (start, time.time())
        return result
    return timed


def _phases(marks: dict, started: float) -> dict:
    """Seconds of each phase; setup_s: from the end of preprocessing to the first step (validation pairs, the
    model, the batch sampler); first_step_s: from the process start."""
    phases = {f"{name}_s": mark[1] - mark[0] for name, mark in marks.items() if isinstance(mark, tuple)}
    if "first_step" in marks and "preprocess" in marks:
        phases["setup_s"] = marks["first_step"] - marks["preprocess"][1]
    phases["first_step_s"] = marks["first_step"] - started if "first_step" in marks else None
    return phases


def measure(train_file: str, mode: str, cache: Path, output_dir: Path, in_process: bool) -> dict:
    """One run; `in_process` (the test) skips the fresh process, so its memory figures are not the run's."""
    argv = train_argv(train_file, output_dir, mode)
    measurement = output_dir.with_suffix(".json")
    shutil.rmtree(output_dir, ignore_errors=True)
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    started = time.time()
    if in_process:
        child(argv, measurement, cache)
    else:
        done = subprocess.run([sys.executable, __file__, "--child", str(measurement), "--", *argv], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"train.py failed ({done.returncode}): {done.stderr[-3000:]}")
    figures = json.loads(measurement.read_text())
    figures["wall_s"] = time.time() - started
    figures["cache_mib"] = _size_mib(cache)
    return figures


def _size_mib(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) / 2**20 if folder.exists() else 0


# ----------------------------------------------------------------------------------------------------- the matrix


def run_matrix(sizes: list[int], configs: list[str], work: Path, in_process: bool, keep_caches: bool) -> list[dict]:
    base, rows = shipped_pairs(), []
    for size in sizes:
        for config in configs:
            corpus_format, mode = config.split(":")
            train_file = write_corpus(work / f"corpus-{size}-{corpus_format}", size, corpus_format, base)
            cache = work / f"cache-{size}-{corpus_format}-{mode}"
            shutil.rmtree(cache, ignore_errors=True)
            for run in ("first", "second"):
                figures = measure(train_file, mode, cache, work / f"run-{size}-{config.replace(':', '-')}-{run}",
                                  in_process)
                rows.append({"pairs": size, "format": corpus_format, "mode": mode, "run": run, **figures})
                print(_row_line(rows[-1]), flush=True)
            if not keep_caches:
                shutil.rmtree(cache, ignore_errors=True)
    return rows


def _row_line(row: dict) -> str:
    phases = " ".join(f"{key}={row[key]:.1f}" for key in PHASES if row.get(key) is not None)
    return (f"{row['pairs']:>8} {row['format']:5} {row['mode']:6} {row['run']:6} {phases} "
            f"rss={row['peak_rss_mib']:.0f}MiB workers={row['workers_peak_rss_mib']:.0f}MiB")


def growth(rows: list[dict]) -> list[dict]:
    """Per configuration and run, the exponent k of time ~ pairs^k between consecutive sizes (1: linear), per
    phase, and the peak RSS at each size."""
    found = []
    keys = sorted({(row["format"], row["mode"], row["run"]) for row in rows})
    for key in keys:
        series = sorted((row for row in rows if (row["format"], row["mode"], row["run"]) == key),
                        key=lambda row: row["pairs"])
        for small, large in zip(series, series[1:]):
            ratio = math.log(large["pairs"] / small["pairs"])
            exponents = {phase: round(math.log(large[phase] / small[phase]) / ratio, 2) for phase in PHASES
                         if small.get(phase) and large.get(phase) and small[phase] > 0.05}
            found.append({"format": key[0], "mode": key[1], "run": key[2], "from": small["pairs"],
                          "to": large["pairs"], "exponents": exponents})
    return found


def markdown(results: dict) -> str:
    lines = ["# Data path scaling", "", results["machine_line"], "", results["note"], "", LEGEND, "",
             "| pairs | format | mode | run | load s | tokenizer s | preprocess s | setup s | to first step s | "
             "peak RSS MiB | workers' peak MiB | cache MiB |", "|" + "---|" * 12]
    for row in results["rows"]:
        cells = [f"{row[key]:.1f}" if row.get(key) is not None else "–" for key in PHASES]
        lines.append(f"| {row['pairs']:,} | {row['format']} | {row['mode']} | {row['run']} | {' | '.join(cells)} | "
                     f"{row['peak_rss_mib']:.0f} | {row['workers_peak_rss_mib']:.0f} | {row['cache_mib']:.0f} |")
    lines += ["", "Growth exponent k of each phase's time ~ pairs^k between consecutive sizes (1 = linear; phases "
              "under 0.05 s left out):", "", "| format | mode | run | pairs | exponents |", "|---|---|---|---|---|"]
    for entry in results["growth"]:
        exponents = ", ".join(f"{phase[:-2]} {value}" for phase, value in entry["exponents"].items())
        lines.append(f"| {entry['format']} | {entry['mode']} | {entry['run']} | {entry['from']:,} → "
                     f"{entry['to']:,} | {exponents} |")
    lines += ["", f"Peak RSS bound: {results['rss_bound']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[30_000, 300_000, 1_000_000])
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS,
                        help="FORMAT:MODE, FORMAT plain or jsonl, MODE map, map2 (2 workers) or stream")
    parser.add_argument("--work", type=Path, default=Path("/tmp/hf-scratch-data-scaling"))
    parser.add_argument("--output", type=Path, default=RESULTS / "data_scaling.json")
    parser.add_argument("--keep-caches", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2,000 pairs, plain:map, in this process (the test)")
    parser.add_argument("--note", default="", help="a sentence on the conditions (e.g. a busy machine)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.configs = [2000], ["plain:map"]
    rows = run_matrix(args.sizes, args.configs, args.work, in_process=args.quick, keep_caches=args.keep_caches)
    results = summarise(rows, args)
    _write(results, args.output)
    return results


def summarise(rows: list[dict], args) -> dict:
    largest = max(row["pairs"] for row in rows)
    peaks = [max(row["peak_rss_mib"], row["workers_peak_rss_mib"]) for row in rows if row["pairs"] == largest]
    bound = (f"every process stayed under {RSS_BOUND_MIB:,} MiB at {largest:,} pairs (highest {max(peaks):.0f} MiB)"
             if max(peaks) < RSS_BOUND_MIB else f"EXCEEDED: {max(peaks):.0f} MiB at {largest:,} pairs")
    return {"rows": rows, "growth": growth(rows), "rss_bound": bound, "sizes": args.sizes, "configs": args.configs,
            "note": args.note or "Timings are only comparable between runs on the same, otherwise idle machine.",
            **_machine()}


def _machine() -> dict:
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from common import machine_info, machine_line  # torch and transformers: imported only here, in the parent

    machine = machine_info(threads=os.cpu_count() or 1)
    return {"machine": machine, "machine_line": machine_line(machine)}


def _write(results: dict, output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    output.with_suffix(".md").write_text(markdown(results))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[4:], Path(sys.argv[2])))
    main()
