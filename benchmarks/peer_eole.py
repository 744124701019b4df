#!/usr/bin/env python
"""A peer on the same CPU: eole (the maintained successor of OpenNMT-py) against this package, the same Transformer
trained on the same tokens with the same token budget per batch at the same thread count: training tokens/s, then
greedy and beam-4 translation tokens/s at batch 1 and 32 on the test sources.

eole lives in its own virtual environment (it must not enter this project's):

    python -m venv /work/venvs/eole
    /work/venvs/eole/bin/pip install eole==0.6.4 torch==2.13.0 aiohttp     # aiohttp: eole's CLI imports it
    python benchmarks/peer_eole.py --eole /work/venvs/eole/bin/eole                     # ~20-30 min on 2 cores
    python benchmarks/peer_eole.py --eole /work/venvs/eole/bin/eole --quick             # smoke: 20 steps, 8 sentences

What is the same: the data are train.py's (the shipped corpus, train.py's joint BPE of its default size
(`vocab_size` in the results: 4,032 with the sentinels when the default was 4,000) trained as train.py trains it,
train.py's length filters), written as eole's pre-tokenized input with our vocabulary as eole's
shared vocabulary (eole's own subword models are not used); the model is the `small` preset (width 256, 3 + 3
layers, 4 heads, FFN 1,024, ReLU, pre-norm, interleaved sinusoidal positions, shared and tied embeddings, biases on
the projections, no dropout) with label smoothing 0.1 and Adam; batches are token-bucketed at 1,024 tokens counted
the same way by both (sentences x the longer padded side); every process runs at --threads threads
(OMP_NUM_THREADS, and train.py's --cpu_threads). What differs, by design of each tool: train.py applies its recipe's
training-time noise to a few sources, eole none; the learning-rate schedules differ (speed does not depend on
them). Sources end in </s> for both (written into eole's source lines, as our tokenizer adds it).

Training tokens/s: non-padding source + target tokens per second of training time, the median over the log windows
of --log_every steps after the first window (start-up, first allocations), from each tool's own log (eole's
"src/tgt tok/s", train.py's training_history.json). Translation tokens/s: new tokens per second of the decoding of
the first --test_sentences test sources (--batch1_sentences at batch 1), timed from the first batch to the last with
the model loaded (eole's "Step 0" + "Subsequent prediction" times; ours around generate()), every sentence exactly
--new_tokens new tokens (min = max length), so both do the same decoding work whatever their weights. Ours decodes in
fp32, as translate() does. Systems alternate ABAB within each measurement. Results: benchmarks/results/peer_eole.json
and .md, with the machine and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, RESULTS, alternate, loadavg, machine_info, machine_line, median, write_results

from hf_scratch_transformer.cpu_threads import available_cores, cpu_bf16_units

EOLE, OURS_FP32, OURS_DEFAULT = "eole", "ours fp32", "ours default"
MODES = {"greedy, batch 1": (1, 1), "greedy, batch 32": (1, 32), "beam 4, batch 1": (4, 1), "beam 4, batch 32": (4, 32)}
EOLE_STEP_LINE = re.compile(r"Step\s+(\d+)/\s*\d+;.*?;\s*([\d.]+)/\s*([\d.]+) tok/s;\s*([\d.]+) sec")


# ------------------------------------------------------------------------------------------------------ the data
def prepare(work: Path, test_sentences: int) -> dict:
    """train.py's training pairs and test sources as token strings (train.src / train.tgt / test.src, one sentence a
    line, tokens separated by spaces; sources end in </s> as ours do, targets get theirs from eole) and our
    vocabulary as eole's (vocab.txt, special tokens left to eole). Returns the tokenizer's vocabulary (token -> id)
    and counts."""
    from hf_scratch_transformer.data.loading import DataArguments, load_parallel_corpus
    from hf_scratch_transformer.data.preprocessing import preprocess_corpus
    from hf_scratch_transformer.data.tokenization import train_tokenizer_on_corpus

    data_args = DataArguments()  # train.py's defaults
    raw = load_parallel_corpus(data_args)
    tokenizer = train_tokenizer_on_corpus(raw["train"], data_args.source_lang, data_args.target_lang,
                                          vocab_size=data_args.tokenizer_vocab_size,
                                          max_sentences=data_args.tokenizer_max_sentences, seed=42,
                                          sentinels=data_args.mask_protected_spans)  # as train.py trains it
    train = preprocess_corpus({"train": raw["train"]}, tokenizer, data_args)[0]["train"]
    special = set(tokenizer.all_special_ids)

    def line(ids, end: str = "") -> str:
        tokens = tokenizer.convert_ids_to_tokens([i for i in ids if i not in special and i != -100])
        assert all(token.split() == [token] for token in tokens), "a token holds white space"
        return " ".join(tokens + ([end] if end else [])) + "\n"

    work.mkdir(parents=True, exist_ok=True)
    eos = tokenizer.eos_token  # eole's end of sentence too ("</s>")
    (work / "train.src").write_text("".join(line(ids, eos) for ids in train["input_ids"]), encoding="utf-8")
    (work / "train.tgt").write_text("".join(line(ids) for ids in train["labels"]), encoding="utf-8")
    sources = [pair[data_args.source_lang] for pair in raw["test"]["translation"][:test_sentences]]
    (work / "test.src").write_text("".join(line(tokenizer(text)["input_ids"], eos) for text in sources),
                                   encoding="utf-8")
    vocabulary = [token for token, index in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
                  if index not in special]
    (work / "vocab.txt").write_text("".join(token + "\n" for token in vocabulary), encoding="utf-8")
    return {"vocab": tokenizer.get_vocab(), "train_pairs": len(train), "test_sentences": len(sources),
            "vocab_size": len(tokenizer)}


# -------------------------------------------------------------------------------------------------- training
def eole_config(work: Path, steps: int, log_every: int, max_tokens: int, vocab_size: int) -> Path:
    """eole's training config: the `small` preset's Transformer on the prepared files (YAML is a JSON superset)."""
    config = {
        "src_vocab": str(work / "vocab.txt"), "tgt_vocab": str(work / "vocab.txt"), "share_vocab": True,
        "src_vocab_size": vocab_size, "tgt_vocab_size": vocab_size, "vocab_size_multiple": 1,
        "src_words_min_frequency": 0, "tgt_words_min_frequency": 0, "n_sample": 0,
        "save_data": str(work / "eole" / "data"), "overwrite": True, "seed": 42, "report_every": log_every,
        "data": {"corpus_1": {"path_src": str(work / "train.src"), "path_tgt": str(work / "train.tgt")}},
        "training": {
            "model_path": str(work / "eole" / "model"), "train_steps": steps, "save_checkpoint_steps": steps,
            "valid_steps": 10 * steps, "keep_checkpoint": 1, "world_size": 1, "gpu_ranks": [],
            "batch_type": "tokens", "batch_size": max_tokens, "batch_size_multiple": 1, "bucket_size": 65536,
            "num_workers": 0, "optim": "adam", "learning_rate": 2e-3, "decay_method": "none", "adam_beta2": 0.98,
            "label_smoothing": 0.1, "dropout": [0.0], "attention_dropout": [0.0], "max_grad_norm": 1.0,
            "normalization": "tokens", "param_init_method": "xavier_uniform", "compute_dtype": "fp32",
        },
        "model": {
            "architecture": "transformer", "hidden_size": 256, "layers": 3, "heads": 4, "transformer_ff": 1024,
            "share_embeddings": True, "share_decoder_embeddings": True, "add_qkvbias": True, "add_ffnbias": True,
            "generator_bias": False, "mlp_activation_fn": "relu", "layer_norm": "standard",
            "embeddings": {"word_vec_size": 256, "position_encoding_type": "SinusoidalInterleaved"},
        },
    }
    path = work / "eole.yaml"
    path.write_text(json.dumps(config, indent=1))
    return path


def thread_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_logged(command: list[str], log: Path, threads: int) -> str:
    """Run `command` at `threads` threads, its output in `log`; its output, or an error naming the last lines."""
    with open(log, "w") as handle:
        code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=thread_env(threads),
                              cwd=ROOT).returncode
    text = log.read_text(errors="replace")
    if code != 0:
        tail = "\n".join(text.strip().splitlines()[-5:])
        raise RuntimeError(f"{' '.join(command[:3])} ... exited {code} (log {log}):\n{tail}")
    return text


def train_eole(eole: str, work: Path, config: Path, threads: int) -> dict:
    """One eole training run: tokens/s of each log window (source + target)."""
    shutil.rmtree(work / "eole", ignore_errors=True)
    started = time.time()
    text = run_logged([eole, "train", "--config", str(config)], work / "eole_train.log", threads)
    windows = [{"step": int(step), "tokens_per_second": float(src) + float(tgt), "seconds": float(seconds)}
               for step, src, tgt, seconds in EOLE_STEP_LINE.findall(text)]
    if not windows:
        raise RuntimeError(f"no 'Step N/ M; ... tok/s' line in {work / 'eole_train.log'}")
    return {"windows": windows, "wall_seconds": round(time.time() - started, 1)}


def train_ours(work: Path, name: str, steps: int, log_every: int, max_tokens: int, threads: int) -> dict:
    """One train.py run (fp32, or the default precision): tokens/s of each log window, and its train_results."""
    output = work / name.replace(" ", "-")
    flags = ["--output_dir", str(output), "--overwrite_output_dir", "--do_train", "--max_steps", str(steps),
             "--logging_steps", str(log_every), "--eval_steps", "0", "--save_steps", "0", "--cpu_threads",
             str(threads), "--max_tokens", str(max_tokens), "--report_to", "none", "--label_smoothing_factor", "0.1"]
    if name == OURS_FP32:
        flags += ["--bf16", "false"]
    started = time.time()
    run_logged([sys.executable, str(ROOT / "train.py"), *flags], work / f"{output.name}_train.log", threads)
    history = json.loads((output / "training_history.json").read_text())
    results = json.loads((output / "train_results.json").read_text())
    windows = [{"step": row["step"], "tokens_per_second": row["tokens_per_second"]} for row in history
               if "tokens_per_second" in row]
    keep = ("train_tokens_per_second", "train_mfu", "train_flops_per_second", "train_matmul_peak_flops",
            "train_precision", "train_padding_fraction")
    return {"windows": windows, "wall_seconds": round(time.time() - started, 1), "model_dir": str(output),
            **{key: results.get(key) for key in keep}}


def window_rate(run: dict) -> float:
    """Median tokens/s of the log windows after the first (start-up excluded)."""
    rates = [window["tokens_per_second"] for window in run["windows"][1:]] or \
        [window["tokens_per_second"] for window in run["windows"]]
    return median(rates)


# ----------------------------------------------------------------------------------------------- translation
def eole_model_dir(work: Path) -> Path:
    """The saved eole model (model_path, or its last step_N folder)."""
    root = work / "eole" / "model"
    steps = sorted(root.glob("step_*"), key=lambda path: int(path.name.split("_")[1]))
    return steps[-1] if steps and not (root / "config.json").exists() else root


def translate_eole(eole: str, work: Path, source: Path, beams: int, batch: int, new_tokens: int,
                   threads: int) -> dict:
    """eole predict: seconds of decoding (Step 0 + subsequent prediction time, model loading excluded), new tokens
    counted in its output."""
    output = work / f"eole_pred_b{beams}_{batch}.txt"
    text = run_logged([eole, "predict", "--model_path", str(eole_model_dir(work)), "--src", str(source),
                       "--output", str(output), "--beam_size", str(beams), "--batch_size", str(batch),
                       "--batch_type", "sents", "--min_length", str(new_tokens), "--max_length", str(new_tokens),
                       "--report_time"], work / "eole_predict.log", threads)
    step0 = re.search(r"Step 0 time \(s\): ([\d.]+)", text)
    rest = re.search(r"Subsequent prediction time including all \(s\): ([\d.]+)", text)
    if not rest:
        raise RuntimeError(f"no 'Subsequent prediction time' in {work / 'eole_predict.log'}")
    seconds = float(rest.group(1)) + (float(step0.group(1)) if step0 else 0.0)
    lines = output.read_text(encoding="utf-8").splitlines()
    return {"seconds": seconds, "new_tokens": sum(len(line.split()) for line in lines), "sentences": len(lines)}


def translate_ours(model_dir: str, source: Path, beams: int, batch: int, new_tokens: int, threads: int) -> dict:
    """Our model in a fresh process (peer_eole.py --_translate): seconds of generate() over all batches."""
    command = [sys.executable, __file__, "--_translate", model_dir, str(source), str(beams), str(batch),
               str(new_tokens), str(threads)]
    run = subprocess.run(command, capture_output=True, text=True, env=thread_env(threads), cwd=ROOT)
    line = next((line for line in run.stdout.splitlines() if line.startswith("TRANSLATE_JSON ")), None)
    if line is None:
        raise RuntimeError(f"our translation failed: {(run.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(line[len("TRANSLATE_JSON "):])


def translate_worker(model_dir: str, source: str, beams: int, batch: int, new_tokens: int, threads: int) -> None:
    """In a fresh process: load the model (fp32, as translate() decodes), read the token lines, sort by length
    (longest first, as translate() batches), then time generate() from the first batch to the last."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from hf_scratch_transformer import ScratchTransformerForConditionalGeneration

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = ScratchTransformerForConditionalGeneration.from_pretrained(model_dir).eval()
    lines = Path(source).read_text(encoding="utf-8").splitlines()
    rows = [tokenizer.convert_tokens_to_ids(line.split()) for line in lines]
    assert all(row[-1] == tokenizer.eos_token_id for row in rows)  # the sources end in </s>, as prepare() writes them
    rows.sort(key=len, reverse=True)
    config = GenerationConfig(decoder_start_token_id=model.config.decoder_start_token_id,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              num_beams=beams, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              early_stopping=beams > 1)
    batches = []
    for start in range(0, len(rows), batch):
        padded = tokenizer.pad({"input_ids": rows[start:start + batch]}, return_tensors="pt")
        batches.append(padded)
    started = time.perf_counter()
    with torch.inference_mode():
        outputs = [model.generate(**inputs, generation_config=config) for inputs in batches]
    seconds = time.perf_counter() - started
    assert all(out.shape[1] == new_tokens + 1 for out in outputs)  # the start token, then exactly new_tokens
    print("TRANSLATE_JSON " + json.dumps({"seconds": seconds, "new_tokens": new_tokens * len(rows),
                                          "sentences": len(rows)}))


# ------------------------------------------------------------------------------------------------------ report
def render(results: dict) -> str:
    machine, systems = results["machine"], results["systems"]
    lines = ["# Same CPU, same model, same data: eole against hf-scratch-transformer", "",
             f"{machine_line(machine)} bf16 matrix units: {results['bf16_units'] or 'none'}. Load average (1, 5, 15 "
             f"min) before: {results['loadavg_before']}, after: {results['loadavg_after']}. eole "
             f"{results['eole_version']}.",
             f"Settings: {results['settings']['steps']} training steps of {results['settings']['max_tokens']}-token "
             f"batches, {results['settings']['threads']} thread(s) for every process, {results['settings']['rounds']} "
             f"round(s) alternating the systems (ABAB); {results['data']['train_pairs']:,} training pairs, vocabulary "
             f"{results['data']['vocab_size']:,} (ours, shared); translation of {results['data']['test_sentences']} "
             f"test sources ({results['settings']['batch1_sentences']} at batch 1), exactly "
             f"{results['settings']['new_tokens']} new tokens each. Medians over the rounds; every round in the "
             "JSON.", "",
             "| measure | " + " | ".join(systems) + " |", "|---|" + "---:|" * len(systems)]
    training = results["training"]
    lines.append("| training, non-pad tokens/s (src+tgt) | " + " | ".join(
        f"{training[name]['tokens_per_second']:,.0f}" if name in training else "—" for name in systems) + " |")
    lines.append("| training precision | " + " | ".join(training.get(name, {}).get("precision") or "—"
                                                      for name in systems) + " |")
    lines.append("| training MFU (train.py's train_mfu, whole run) | " + " | ".join(
        f"{training[name]['mfu']:.1%}" if training.get(name, {}).get("mfu") else "—" for name in systems) + " |")
    for mode, measured in results["translation"].items():
        lines.append(f"| {mode}, new tokens/s | " + " | ".join(
            f"{measured[name]['tokens_per_second']:,.0f}" if name in measured else "—" for name in systems) + " |")
    if results.get("errors"):
        lines += ["", "Errors:", ""] + [f"- {name}: `{error}`" for name, error in results["errors"].items()]
    lines += ["", "Translation rows: both decode in fp32 (ours: the model of the `ours fp32` run; `ours default` "
              "trained in the default precision and decodes in fp32 too, so only `ours fp32` is timed). How each "
              "figure is measured: the docstring of benchmarks/peer_eole.py."]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------------------------- main
def measure_training(args, work: Path, systems: list[str], config: Path, results: dict) -> dict:
    runs = {name: [] for name in systems}
    for round_ in range(args.rounds):
        for name in alternate(list(systems), round_):
            try:
                run = (train_eole(args.eole, work, config, args.threads) if name == EOLE else
                       train_ours(work, name, args.steps, args.log_every, args.max_tokens, args.threads))
            except (RuntimeError, OSError) as error:
                results["errors"][f"{name} training"] = str(error)
                print(f"{name} training failed: {error}", flush=True)
                continue
            runs[name].append(run)
            print(f"round {round_}: {name} training {window_rate(run):,.0f} tokens/s", flush=True)
    results["training_runs"] = runs
    return {name: {"tokens_per_second": median([window_rate(run) for run in done]),
                   "rounds": [round(window_rate(run), 1) for run in done],
                   "precision": done[-1].get("train_precision", "fp32"),
                   "mfu": median([run["train_mfu"] for run in done]) if done[-1].get("train_mfu") else None}
            for name, done in runs.items() if done}


def measure_translation(args, work: Path, results: dict) -> dict:
    """Greedy and beam 4 at batch 1 and 32, eole against our fp32 model, alternated."""
    ours_runs = results["training_runs"].get(OURS_FP32)
    decoders = {}
    if results["training_runs"].get(EOLE):
        decoders[EOLE] = lambda source, beams, batch: translate_eole(args.eole, work, source, beams, batch,
                                                                     args.new_tokens, args.threads)
    if ours_runs:
        decoders[OURS_FP32] = lambda source, beams, batch: translate_ours(ours_runs[-1]["model_dir"], source, beams,
                                                                          batch, args.new_tokens, args.threads)
    first = work / "test_batch1.src"
    lines = (work / "test.src").read_text(encoding="utf-8").splitlines(keepends=True)
    first.write_text("".join(lines[: args.batch1_sentences]), encoding="utf-8")
    table = {}
    for mode, (beams, batch) in MODES.items():
        source = first if batch == 1 else work / "test.src"
        rounds = {name: [] for name in decoders}
        for round_ in range(args.rounds):
            for name in alternate(list(decoders), round_):
                try:
                    rounds[name].append(decoders[name](source, beams, batch))
                except (RuntimeError, OSError) as error:
                    results["errors"][f"{name} {mode}"] = str(error)
        table[mode] = {name: {"tokens_per_second": median([r["new_tokens"] / r["seconds"] for r in done]),
                              "rounds": done} for name, done in rounds.items() if done}
        print(f"{mode}: " + ", ".join(f"{name} {row['tokens_per_second']:,.0f} tokens/s"
                                      for name, row in table[mode].items()), flush=True)
    return table


def eole_version(eole: str) -> str | None:
    pip = Path(eole).with_name("pip")
    shown = subprocess.run([str(pip), "show", "eole"], capture_output=True, text=True).stdout if pip.exists() else ""
    return next((line.split(":", 1)[1].strip() for line in shown.splitlines() if line.startswith("Version:")), None)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eole", default="/work/venvs/eole/bin/eole", help="the eole command of its own venv")
    ap.add_argument("--quick", action="store_true", help="smoke: 20 steps, 1 round, 8 test sentences, 8 tokens")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default 200)")
    ap.add_argument("--log_every", type=int, default=None, help="steps per log window (default 10)")
    ap.add_argument("--rounds", type=int, default=None, help="ABAB rounds (default 2)")
    ap.add_argument("--threads", type=int, default=available_cores())
    ap.add_argument("--max_tokens", type=int, default=1024, help="token budget per batch (train.py's default)")
    ap.add_argument("--test_sentences", type=int, default=None, help="test sources translated (default 128)")
    ap.add_argument("--batch1_sentences", type=int, default=None, help="of which at batch 1 (default 32)")
    ap.add_argument("--new_tokens", type=int, default=None, help="new tokens per sentence (default 40)")
    ap.add_argument("--work", default=None, help="working folder (default benchmarks/work/peer_eole)")
    ap.add_argument("--output", default=None, help="default results/peer_eole.json (.md beside it)")
    ap.add_argument("--_translate", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._translate:
        model_dir, source, beams, batch, new_tokens, threads = args._translate
        translate_worker(model_dir, source, int(beams), int(batch), int(new_tokens), int(threads))
        return {}
    quick = args.quick
    args.steps = args.steps or (20 if quick else 200)
    args.log_every = args.log_every or (5 if quick else 10)
    args.rounds = args.rounds or (1 if quick else 2)
    args.test_sentences = args.test_sentences or (8 if quick else 128)
    args.batch1_sentences = args.batch1_sentences or (4 if quick else 32)
    args.new_tokens = args.new_tokens or (8 if quick else 40)
    work = Path(args.work or ROOT / "benchmarks" / "work" / "peer_eole")
    results = {"settings": {k: v for k, v in vars(args).items() if not k.startswith("_")},
               "bf16_units": cpu_bf16_units(), "eole_version": eole_version(args.eole), "loadavg_before": loadavg(),
               "errors": {}}
    systems = [EOLE, OURS_FP32] + ([OURS_DEFAULT] if cpu_bf16_units() else [])  # the default is fp32 elsewhere
    results["systems"] = systems
    data = prepare(work, args.test_sentences)
    results["data"] = {key: value for key, value in data.items() if key != "vocab"}
    config = eole_config(work, args.steps, args.log_every, args.max_tokens, data["vocab_size"])
    results["training"] = measure_training(args, work, systems, config, results)
    check_same_vocabulary(results, data["vocab"])
    results["translation"] = measure_translation(args, work, results)
    results["loadavg_after"] = loadavg()
    results["machine"] = machine_info(args.threads)
    markdown = render(results)
    write_results(results, Path(args.output or RESULTS / "peer_eole.json"), markdown)
    print(markdown)
    return results


def check_same_vocabulary(results: dict, vocab: dict) -> None:
    """train.py's runs must have trained the tokenizer eole's data was written with."""
    from transformers import AutoTokenizer

    for name in (OURS_FP32, OURS_DEFAULT):
        for run in results["training_runs"].get(name, []):
            if AutoTokenizer.from_pretrained(run["model_dir"]).get_vocab() != vocab:
                raise SystemExit(f"{run['model_dir']}: train.py trained another tokenizer than the one eole's data "
                                 f"was written with; the comparison would not be on the same tokens")


if __name__ == "__main__":
    main()
