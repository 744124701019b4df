#!/usr/bin/env python
"""Quality: hf_scratch_transformer vs transformers' MarianMTModel (parts 4 and 5 of the benchmark issue).

  equal_budget_bleu (part 4): quality at an equal training budget. Our model and a MarianMTModel of identical
     sizes (width, depths, heads, FFN, vocabulary, shared + tied embeddings, dropout 0.1, ReLU, sqrt(d_model)
     embedding scale, post-norm), both starting from the same weights (ours copied into Marian; `--marian_init
     native` gives Marian its own seeded init), trained in ONE plain loop in this process: the same tokenizer
     (joint BPE, `train_tokenizer_on_corpus`), the same token-bucketed batches in the same order, the same schedule
     (Adam b=(0.9, 0.98) eps=1e-9, lr 1e-3, linear warm-up then inverse sqrt, label smoothing 0.1, grad clip 1.0),
     the two models alternating step by step (AB, BA, ...). Then test BLEU/chrF with greedy and beam 4, plus each
     model's training time and tokens/s.
  time_to_target_bleu (part 5): time to a target BLEU, end to end, as each user would run it: `run_training`
     (what `train.py` runs, with its defaults) versus `Seq2SeqTrainer` + MarianMTModel of the same size (AdamW lr
     5e-4, `inverse_sqrt` with 400 warm-up steps, label smoothing 0.1, random batches of 64, 3 epochs,
     `predict_with_generate`). Both evaluate greedy test BLEU every `--eval_steps` steps; time to quality = the
     first training time at which our curve reaches the BLEU the Seq2SeqTrainer run ends with (linear
     interpolation between evaluation points).

    python benchmarks/bench_quality.py --quick --threads 1      # ~3-5 min on 2 cores: tiny preset, 2,000 pairs
    python benchmarks/bench_quality.py                          # full: small preset, whole corpus (many hours)
    python benchmarks/bench_quality.py --parts equal_budget_bleu --preset small --max_train_samples 5000 --max_steps 600

    python benchmarks/bench_quality.py --render benchmarks/results/quality.json   # rewrite the .md only

Writes benchmarks/results/quality.json and quality.md (or --output / its .md beside it).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import GenerationConfig, MarianMTModel, get_inverse_sqrt_schedule
from transformers.models.marian.modeling_marian import shift_tokens_right
from transformers.utils import logging as hf_logging

from common import (
    MARIAN, OURS, RESULTS, build_pair, equivalence_check, loadavg, machine_info, machine_line, marian_config,
    our_config, write_results,
)
from hf_scratch_transformer.arguments import parse_arguments
from hf_scratch_transformer.loop import TrainingLoop
from hf_scratch_transformer.training import run_training
from hf_scratch_transformer.data import (
    SHIPPED_CORPUS_FILES,
    DataArguments,
    evaluation_pairs,
    is_nonempty_pair,
    load_parallel_corpus,
    make_batch_sampler,
    make_collator,
    preprocess_corpus,
)
from hf_scratch_transformer.evaluation import evaluate_translations, translation_scores
from hf_scratch_transformer.tokenization import train_tokenizer_on_corpus

hf_logging.set_verbosity_error()
SRC, TGT = "en", "es"
# The two measurements; results written before the rename used the issue's part numbers as keys.
EQUAL_BUDGET, TIME_TO_TARGET = "equal_budget_bleu", "time_to_target_bleu"
OLD_KEYS = {"part4": EQUAL_BUDGET, "part5": TIME_TO_TARGET}

# Budgets. Full = the issue's settings; quick = a smoke run that shows the machinery works (its BLEU is tiny).
FULL = dict(preset="small", max_train_samples=None, epochs=3.0, max_steps=-1, eval_samples=None, warmup_steps=400,
            eval_steps=250, logging_steps=50, eval_max_new_tokens=256, vocab_size=8000)
QUICK = dict(preset="tiny", max_train_samples=2000, epochs=3.0, max_steps=-1, eval_samples=100, warmup_steps=100,
             eval_steps=25, logging_steps=25, eval_max_new_tokens=96, vocab_size=8000)
MAX_LENGTH = 256  # train.py's --max_source_length / --max_target_length default


def generation_config(cfg, max_length: int, num_beams: int = 1) -> GenerationConfig:
    return GenerationConfig(
        decoder_start_token_id=cfg.decoder_start_token_id, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id, num_beams=num_beams, max_length=max_length, early_stopping=num_beams > 1,
    )


def build_models(preset: str, vocab_size: int, seed: int, marian_init: str):
    ours, marian = build_pair(preset, seed, vocab_size, marian_init)
    for model in (ours, marian):
        model.generation_config = generation_config(ours.config, MAX_LENGTH + 1)
    return ours.config, ours, marian


# -------------------------------------------------------------------------------------------------- the corpus
def data_arguments(budget: dict, **extra) -> DataArguments:
    return DataArguments(source_lang=SRC, target_lang=TGT, max_train_samples=budget["max_train_samples"],
                         max_eval_samples=budget["eval_samples"], max_predict_samples=budget["eval_samples"],
                         tokenizer_vocab_size=budget["vocab_size"], **extra)


def prepare_corpus(budget: dict, seed: int):
    """Shipped corpus -> joint BPE tokenizer (train split) -> tokenised, filtered splits (train.py's recipe)."""
    data_args = data_arguments(budget)
    raw = load_parallel_corpus(data_args, seed=seed)
    tokenizer = train_tokenizer_on_corpus(raw["train"], SRC, TGT, vocab_size=budget["vocab_size"],
                                          max_sentences=data_args.tokenizer_max_sentences, seed=seed)
    tokenizer.model_max_length = MAX_LENGTH
    datasets, report = preprocess_corpus(raw, tokenizer, data_args)
    test_sources, test_references = evaluation_pairs(raw["test"], data_args)
    return data_args, tokenizer, datasets, report, test_sources, test_references


# ------------------------------------------------------------------------------- BLEU at an equal training budget
def smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.1) -> torch.Tensor:
    """The training loop's loss (loop.py): label-smoothed cross-entropy over the non-padding target tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                           label_smoothing=smoothing)


def training_loss(name: str, model, batch: dict, cfg) -> torch.Tensor:
    """The label-smoothed (0.1) loss of one batch, each model called the way its own trainer calls it."""
    if name == OURS:  # as loop.py: with labels, our model derives decoder inputs, skips padding, computes the loss
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                     label_smoothing=0.1).loss
    # Marian as Seq2SeqTrainer runs it with label smoothing: decoder inputs = labels shifted right, no labels passed
    decoder_input_ids = shift_tokens_right(batch["labels"], cfg.pad_token_id, cfg.decoder_start_token_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   decoder_input_ids=decoder_input_ids).logits
    return smoothed_loss(logits, batch["labels"])


def equal_budget_bleu(budget: dict, args, corpus) -> dict:
    """Both models trained in one loop on the same batches from the same weights, then test BLEU / chrF."""
    data_args, tokenizer, datasets, report, test_sources, test_references = corpus
    cfg, ours, marian = build_models(budget["preset"], len(tokenizer), args.seed, args.marian_init)
    models = {OURS: ours, MARIAN: marian}
    collator = make_collator(tokenizer)
    train = datasets["train"]
    sampler = make_batch_sampler(train, data_args, 64, shuffle=True, seed=args.seed)  # token-bucketed (2048)
    total = budget["max_steps"] if budget["max_steps"] > 0 else math.ceil(budget["epochs"] * len(sampler))
    first_batch = collator([train[i] for i in next(iter(sampler))])
    same_function = equivalence_check(ours, marian, first_batch) if args.marian_init == "copy" else None
    print(f"[equal budget] {len(train)} training pairs, {len(sampler)} batches/epoch, {total} steps per model",
          flush=True)
    progress = train_alternating(models, cfg, budget, args.seed, total, sampler, lambda indices: collator(
        [train[i] for i in indices]))
    result = {
        "config": {k: getattr(cfg, k) for k in ("vocab_size", "d_model", "encoder_layers", "decoder_layers",
                                                "encoder_attention_heads", "encoder_ffn_dim", "dropout")},
        "parameters": {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()},
        "marian_init": args.marian_init, "train_pairs": len(train), "filtered": report["train"],
        "test_pairs": len(test_sources), "steps": progress["steps"],
        "epochs": round(progress["steps"] / len(sampler), 3), "train_tokens": progress["train_tokens"],
        "batches": f"token-bucketed, <= {data_args.max_tokens} tokens (batch x longest side)",
        "initial_equivalence": same_function, "curve": progress["curve"], "models": {},
    }
    for name, model in models.items():
        figures = {"train_seconds": round(progress["seconds"][name], 1),
                   "train_tokens_per_s": round(progress["train_tokens"] / progress["seconds"][name], 1),
                   "final_train_loss": progress["curve"][-1][f"loss_{name}"],
                   **test_scores(model, tokenizer, test_sources, test_references, budget["eval_max_new_tokens"])}
        result["models"][name] = figures
        print(f"[equal budget] {name}: {figures}", flush=True)
    return result


def train_alternating(models: dict, cfg, budget: dict, seed: int, total: int, sampler, collate) -> dict:
    """`total` optimiser steps of each model on the same batches, alternating AB, BA, ... with the same dropout
    RNG state; returns the steps, tokens, each model's training seconds and the logged loss curve."""
    optimizers, schedulers = {}, {}
    for name, model in models.items():
        model.train()
        optimizers[name] = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
        schedulers[name] = get_inverse_sqrt_schedule(optimizers[name], num_warmup_steps=budget["warmup_steps"])
    seconds = {name: 0.0 for name in models}
    losses = {name: [] for name in models}
    curve, tokens_done, step, epoch = [], 0, 0, 0
    while step < total:
        sampler.set_epoch(epoch)
        for indices in sampler:
            batch = collate(indices)
            for name in ([OURS, MARIAN] if step % 2 == 0 else [MARIAN, OURS]):
                torch.manual_seed(seed * 1_000_003 + step)  # same dropout RNG state for both at every step
                start = time.perf_counter()
                loss = training_loss(name, models[name], batch, cfg)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(models[name].parameters(), 1.0)
                optimizers[name].step()
                optimizers[name].zero_grad(set_to_none=True)
                schedulers[name].step()
                seconds[name] += time.perf_counter() - start
                if not torch.isfinite(loss):
                    raise RuntimeError(f"{name}: non-finite loss at step {step + 1}")
                losses[name].append(loss.item())
            tokens_done += int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
            step += 1
            if step % budget["logging_steps"] == 0 or step == total:
                row = {"step": step, "train_tokens": tokens_done,
                       **{f"loss_{n}": round(sum(values) / len(values), 4) for n, values in losses.items()},
                       **{f"seconds_{n}": round(seconds[n], 2) for n in models}}
                curve.append(row)
                print(f"[equal budget] {json.dumps(row)}", flush=True)
                losses = {name: [] for name in models}
            if step >= total:
                break
        else:
            epoch += 1
    return {"steps": step, "train_tokens": tokens_done, "seconds": seconds, "curve": curve}


def test_scores(model, tokenizer, sources, references, max_new_tokens: int) -> dict:
    """Test BLEU / chrF and decoding seconds with greedy and beam-4 search (eval mode)."""
    model.eval()
    figures = {}
    for beams in (1, 4):
        start = time.perf_counter()
        scores, _ = evaluate_translations(model, tokenizer, sources, references, num_beams=beams, batch_size=64,
                                          max_new_tokens=max_new_tokens)
        key = "greedy" if beams == 1 else f"beam{beams}"
        figures[f"test_bleu_{key}"], figures[f"test_chrf_{key}"] = scores["bleu"], scores["chrf"]
        figures[f"test_decode_seconds_{key}"] = round(time.perf_counter() - start, 1)
    return figures


# ------------------------------------------------------------------------------- time to a target BLEU, end to end
def corpus_file_flags() -> list[str]:
    """The shipped corpus with the TEST split as the periodic-evaluation split, so both curves are test BLEU."""
    return ["--train_file", str(SHIPPED_CORPUS_FILES["train"]), "--validation_file", str(SHIPPED_CORPUS_FILES["test"]),
            "--test_file", str(SHIPPED_CORPUS_FILES["test"])]


def run_ours(budget: dict, args, workdir: Path) -> dict:
    """`run_training` with train.py's defaults; TrainingLoop.train / TrainingLoop.validate are wrapped (in this process only)
    to timestamp the end of the setup and each evaluation, so the evaluation time can be taken out of the clock."""
    argv = ["--output_dir", str(workdir / "ours"), "--overwrite_output_dir", "--report_to", "none",
            "--preset", budget["preset"], "--seed", str(args.seed), "--num_train_epochs", str(budget["epochs"]),
            "--max_steps", str(budget["max_steps"]), "--warmup_steps", str(budget["warmup_steps"]),
            "--eval_steps", str(budget["eval_steps"]), "--logging_steps", str(budget["logging_steps"]),
            "--eval_max_new_tokens", str(budget["eval_max_new_tokens"]), "--num_beams", "1",
            "--tokenizer_vocab_size", str(budget["vocab_size"]), *corpus_file_flags()]
    if budget["max_train_samples"]:
        argv += ["--max_train_samples", str(budget["max_train_samples"])]
    if budget["eval_samples"]:
        argv += ["--max_eval_samples", str(budget["eval_samples"]), "--max_predict_samples", str(budget["eval_samples"])]
    marks: dict = {"evals": []}
    original_train, original_validate = TrainingLoop.train, TrainingLoop.validate

    def train(self):
        marks["setup_end"] = time.time()  # setup done: training starts
        marks["total_steps"] = self.total_steps
        original_train(self)

    def validate(self):
        start = time.time()
        row = original_validate(self)  # in eval mode (no dropout), as Seq2SeqTrainer scores
        marks["evals"].append({"step": self.state.global_step, "start": start, "end": time.time(),
                               "bleu": row.get("eval_bleu"), "chrf": row.get("eval_chrf")})
        return row

    model_args, data_args, train_args = parse_arguments(argv)
    TrainingLoop.train, TrainingLoop.validate = train, validate
    t0 = time.time()
    try:
        results = run_training(model_args, data_args, train_args)
    finally:
        TrainingLoop.train, TrainingLoop.validate = original_train, original_validate
    end = time.time()
    return curve_from_marks("train.py (run_training, our defaults)", t0, marks, end, {
        "flags": argv, "train_steps": results["train_steps"], "train_tokens": results["train_tokens"],
        "train_tokens_per_second": results["train_tokens_per_second"], "train_pairs": results["train_samples"],
        # --num_beams 1: the test decoding (predict_*) is greedy
        "final_test_bleu_greedy": results.get("predict_bleu"), "final_test_chrf_greedy": results.get("predict_chrf"),
    })


def tokenised_with_datasets_map(budget: dict, seed: int):
    """The shipped corpus (test split for evaluation), the joint BPE recipe (no pretrained Marian tokenizer exists
    for this corpus, and there is no network), `datasets.map` tokenisation: the tokenizer, train and evaluation
    datasets and the evaluation references."""
    data_args = data_arguments(budget)
    data_args.train_file, data_args.validation_file, data_args.test_file = (
        str(SHIPPED_CORPUS_FILES["train"]), str(SHIPPED_CORPUS_FILES["test"]), str(SHIPPED_CORPUS_FILES["test"]))
    raw = load_parallel_corpus(data_args, seed=seed)
    tokenizer = train_tokenizer_on_corpus(raw["train"], SRC, TGT, vocab_size=budget["vocab_size"], seed=seed,
                                          max_sentences=data_args.tokenizer_max_sentences)
    tokenizer.model_max_length = MAX_LENGTH

    def nonempty(example):
        return is_nonempty_pair(example, SRC, TGT)

    def tokenize(batch):
        inputs = tokenizer([p[SRC] for p in batch["translation"]], max_length=MAX_LENGTH, truncation=True)
        inputs["labels"] = tokenizer(text_target=[p[TGT] for p in batch["translation"]], max_length=MAX_LENGTH,
                                     truncation=True)["input_ids"]
        return inputs

    train_ds = raw["train"].filter(nonempty).map(tokenize, batched=True, remove_columns=raw["train"].column_names)
    eval_raw = raw["validation"].filter(nonempty)
    eval_ds = eval_raw.map(tokenize, batched=True, remove_columns=eval_raw.column_names)
    return tokenizer, train_ds, eval_ds, [example["translation"][TGT] for example in eval_raw]


def run_marian_trainer(budget: dict, args, workdir: Path) -> dict:
    """What a transformers user writes: tokenise with datasets.map, DataCollatorForSeq2Seq, Seq2SeqTrainer."""
    from accelerate.state import AcceleratorState
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    AcceleratorState._reset_state(reset_partial_state=True)  # run_training's Accelerator ran in this process
    marks: dict = {"evals": []}
    t0 = time.time()
    tokenizer, train_ds, eval_ds, references = tokenised_with_datasets_map(budget, args.seed)
    cfg = our_config(budget["preset"], len(tokenizer))
    torch.manual_seed(args.seed)
    model = MarianMTModel(marian_config(cfg))
    gen = generation_config(cfg, budget["eval_max_new_tokens"] + 1, num_beams=1)
    model.generation_config = gen

    def compute_metrics(prediction):
        ids = np.where(prediction.predictions < 0, tokenizer.pad_token_id, prediction.predictions)
        texts = [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]
        return translation_scores(texts, references)

    class TimedTrainer(Seq2SeqTrainer):
        def evaluate(self, *args, **kwargs):
            start = time.time()
            metrics = super().evaluate(*args, **kwargs)
            marks["evals"].append({"step": self.state.global_step, "start": start, "end": time.time(),
                                   "bleu": metrics.get("eval_bleu"), "chrf": metrics.get("eval_chrf")})
            return metrics

    options = dict(
        output_dir=str(workdir / "marian"), per_device_train_batch_size=64, per_device_eval_batch_size=64,
        learning_rate=5e-4, lr_scheduler_type="inverse_sqrt", warmup_steps=budget["warmup_steps"],
        label_smoothing_factor=0.1, num_train_epochs=budget["epochs"], max_steps=budget["max_steps"], eval_strategy="steps",
        eval_steps=budget["eval_steps"], logging_steps=budget["logging_steps"], predict_with_generate=True,
        generation_config=gen, report_to="none", use_cpu=True, seed=args.seed, disable_tqdm=True,
    )  # optimizer: the default AdamW (betas 0.9/0.999, eps 1e-8, no weight decay); checkpoints: the defaults
    training_arguments = Seq2SeqTrainingArguments(**options)
    trainer = TimedTrainer(model=model, args=training_arguments, train_dataset=train_ds, eval_dataset=eval_ds,
                           data_collator=DataCollatorForSeq2Seq(tokenizer, model=model), processing_class=tokenizer,
                           compute_metrics=compute_metrics)
    marks["setup_end"] = time.time()
    train_output = trainer.train()
    if not marks["evals"] or marks["evals"][-1]["step"] != trainer.state.global_step:
        trainer.evaluate()  # the BLEU the run ends with
    end = time.time()
    marks["total_steps"] = trainer.state.global_step
    return curve_from_marks("Seq2SeqTrainer + MarianMTModel", t0, marks, end, {
        "train_steps": trainer.state.global_step, "train_pairs": len(train_ds),
        "train_runtime_reported": train_output.metrics.get("train_runtime"),
        "final_test_bleu_greedy": marks["evals"][-1]["bleu"], "final_test_chrf_greedy": marks["evals"][-1]["chrf"],
    })


def curve_from_marks(label: str, t0: float, marks: dict, end: float, extra: dict) -> dict:
    """(training seconds, BLEU) points: wall time since the end of the setup minus the time spent in earlier
    evaluations (an evaluation's own time is not counted either); `elapsed_with_setup_s` adds the setup."""
    setup = marks["setup_end"] - t0
    eval_time, points = 0.0, []
    for evaluation in marks["evals"]:
        train_s = evaluation["start"] - marks["setup_end"] - eval_time
        eval_time += evaluation["end"] - evaluation["start"]
        points.append({"step": evaluation["step"], "train_s": round(train_s, 2),
                       "elapsed_with_setup_s": round(train_s + setup, 2), "bleu": evaluation["bleu"],
                       "chrf": evaluation["chrf"], "eval_s": round(evaluation["end"] - evaluation["start"], 2)})
    return {"label": label, "setup_s": round(setup, 2), "wall_s": round(end - t0, 2),
            "eval_total_s": round(eval_time, 2), "points": points, **extra}


def time_to(points: list[dict], target: float, key: str) -> float | None:
    """First time the curve reaches `target` BLEU, linearly interpolated between evaluation points."""
    previous = None
    for p in points:
        if p["bleu"] is not None and p["bleu"] >= target:
            if previous is None or previous["bleu"] is None:
                return p[key]
            fraction = (target - previous["bleu"]) / max(p["bleu"] - previous["bleu"], 1e-9)
            return round(previous[key] + fraction * (p[key] - previous[key]), 2)
        previous = p
    return None


def time_to_target_bleu(budget: dict, args) -> dict:
    """train.py and Seq2SeqTrainer + MarianMT one after the other; when each reaches the BLEU Marian ends with."""
    workdir = Path(tempfile.mkdtemp(prefix="bench_quality_"))
    try:
        ours = run_ours(budget, args, workdir)
        print(f"[time to target] ours: {json.dumps(ours['points'])}", flush=True)
        marian = run_marian_trainer(budget, args, workdir)
        print(f"[time to target] marian: {json.dumps(marian['points'])}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    target = marian["final_test_bleu_greedy"]
    result = {"target_bleu": target, "runs": {OURS: ours, MARIAN: marian}, "time_to_target": {}}
    for name, run in result["runs"].items():
        result["time_to_target"][name] = {key: time_to(run["points"], target, key)
                                          for key in ("train_s", "elapsed_with_setup_s")}
        first = run["points"][0]["bleu"] if run["points"] else None
        # reached at the first evaluation: the time is an upper bound (nothing is known before that point)
        result["time_to_target"][name]["upper_bound_only"] = first is not None and target is not None and first >= target
    ours_s, marian_s = result["time_to_target"][OURS]["train_s"], result["time_to_target"][MARIAN]["train_s"]
    result["speedup_train_s"] = round(marian_s / ours_s, 2) if ours_s and marian_s else None
    return result


# ----------------------------------------------------------------------------------------------------- report
def fmt(value, spec=".1f", none="n/a"):
    return none if value is None else format(value, spec)


def with_new_keys(res: dict) -> dict:
    """Results written before the rename keep their figures under "part4" / "part5": read them under the new names."""
    res = {OLD_KEYS.get(key, key): value for key, value in res.items()}
    settings = res["settings"]
    settings["parts"] = [OLD_KEYS.get(f"part{part}", part) for part in settings.get("parts", [])]
    return res


def render_markdown(res: dict) -> str:
    res = with_new_keys(res)
    lines = header_lines(res)
    if res.get(EQUAL_BUDGET):
        lines += equal_budget_lines(res[EQUAL_BUDGET])
    if res.get(TIME_TO_TARGET):
        lines += time_to_target_lines(res[TIME_TO_TARGET], res["settings"]["eval_steps"])
    lines += ["See `benchmarks/README.md` (section *Quality benchmark*) for the method.", ""]
    return "\n".join(lines)


def header_lines(res: dict) -> list[str]:
    machine, settings = res["machine"], res["settings"]
    quick = settings["quick"]
    busy = max(res["loadavg_start"][:1] + res["loadavg_end"][:1] or [0]) > settings["threads"] + 0.5
    lines = ["# Quality: hf_scratch_transformer vs MarianMTModel (BLEU at an equal budget, time to a target BLEU)", ""]
    reduced = not quick and any(settings.get(k) != v for k, v in FULL.items() if k != "logging_steps")
    mode = "quick" if quick else ("reduced" if reduced else "full")
    if quick:
        lines += ["> **QUICK MODE — a smoke run, not the benchmark.** Tiny budget (see below); BLEU at this budget is "
                  "near zero and the comparison says little about quality. Run without `--quick` for the real "
                  "figures.", ""]
    elif reduced:
        lines += ["> **REDUCED BUDGET — not the issue's full settings** (those take ~5 h on 2 cores). Both models get "
                  "the same reduced budget (see below), so the comparison is fair, but absolute BLEU is far below a "
                  "full run's.", ""]
    lines += [machine_line({**machine, "torch_threads": settings["threads"]}),
              f"Mode: **{mode}**; preset `{settings['preset']}`, training pairs "
              f"{settings['max_train_samples'] or 'all'}, {settings['epochs']} epochs"
              + (f" (max_steps {settings['max_steps']})" if settings['max_steps'] > 0 else "")
              + f", warm-up {settings['warmup_steps']} steps, test pairs {settings['eval_samples'] or 'all'}, "
              f"vocabulary {settings['vocab_size']}, longest translation {settings['eval_max_new_tokens']} tokens, "
              f"seed {settings['seed']}. Total wall time of this run: {res['wall_s'] / 60:.1f} min.",
              f"Load average at start / end: {res['loadavg_start'][:1]} / {res['loadavg_end'][:1]}"
              + (" — **another job was using the CPUs: the timings are noisy** (ratios from the same run are more "
                 "reliable than absolute figures)." if busy else "."), ""]
    return lines


def equal_budget_lines(equal: dict) -> list[str]:
    config = equal["config"]
    lines = ["## BLEU at an equal training budget (`equal_budget_bleu`)", "",
             f"One loop, models alternating per step; {equal['steps']} steps ({equal['epochs']} epochs) of the same "
             f"{equal['batches']} batches, {equal['train_tokens']:,} training tokens (non-pad src+tgt) each; "
             f"{equal['train_pairs']:,} training pairs, {equal['test_pairs']} test pairs. Model: d_model "
             f"{config['d_model']}, {config['encoder_layers']}+{config['decoder_layers']} layers, "
             f"{config['encoder_attention_heads']} heads, FFN {config['encoder_ffn_dim']}, vocabulary "
             f"{config['vocab_size']}, dropout {config['dropout']}; parameters {equal['parameters'][OURS]:,} (ours) / "
             f"{equal['parameters'][MARIAN]:,} (Marian, incl. its frozen position table and final_logits_bias). "
             "Initial weights: "
             + (f"identical (ours copied into Marian; max |logit diff| before training "
                f"{equal['initial_equivalence']['max_abs_logit_diff']:.1e})." if equal["initial_equivalence"]
                else "each its own seeded init."),
             "", "| | scratch | MarianMT |", "|---|---:|---:|"]
    ours, marian = equal["models"][OURS], equal["models"][MARIAN]
    for key, label in (("test_bleu_greedy", "test BLEU, greedy"), ("test_bleu_beam4", "test BLEU, beam 4"),
                       ("test_chrf_greedy", "test chrF, greedy"), ("test_chrf_beam4", "test chrF, beam 4"),
                       ("final_train_loss", "last logged training loss (label-smoothed)"),
                       ("train_seconds", "training time, s (fwd+bwd+clip+step)"),
                       ("train_tokens_per_s", "training tokens/s")):
        spec = {"train_tokens_per_s": ",.0f", "final_train_loss": ".3f", "train_seconds": ".1f"}.get(key, ".2f")
        lines.append(f"| {label} | {fmt(ours[key], spec)} | {fmt(marian[key], spec)} |")
    return lines + [""]


def time_to_target_lines(timed: dict, eval_steps: int) -> list[str]:
    ours, marian = timed["runs"][OURS], timed["runs"][MARIAN]
    ours_time, marian_time = timed["time_to_target"][OURS], timed["time_to_target"][MARIAN]
    lines = ["## Time to a target BLEU, end to end (`time_to_target_bleu`)", "",
             f"Target: the greedy test BLEU the Seq2SeqTrainer run ends with, **{fmt(timed['target_bleu'], '.2f')}**. "
             f"Times are training wall time (evaluation time taken out; checkpoint saving left in), and in brackets "
             f"the same plus the setup (corpus loading, tokenizer training, tokenisation, model creation).", "",
             "| | train.py (ours) | Seq2SeqTrainer + MarianMT |", "|---|---:|---:|",
             f"| optimiser steps | {ours['train_steps']} | {marian['train_steps']} |",
             f"| final greedy test BLEU / chrF | {fmt(ours['final_test_bleu_greedy'], '.2f')} / "
             f"{fmt(ours['final_test_chrf_greedy'], '.2f')} | {fmt(marian['final_test_bleu_greedy'], '.2f')} / "
             f"{fmt(marian['final_test_chrf_greedy'], '.2f')} |",
             f"| time to target BLEU, s | **{fmt(ours_time['train_s'])}** ({fmt(ours_time['elapsed_with_setup_s'])}) | "
             f"**{fmt(marian_time['train_s'])}** ({fmt(marian_time['elapsed_with_setup_s'])}) |",
             f"| total training time, s (+ setup) | {fmt(ours['points'][-1]['train_s'])} (+{ours['setup_s']:.1f}) | "
             f"{fmt(marian['points'][-1]['train_s'])} (+{marian['setup_s']:.1f}) |",
             f"| whole run incl. evaluations and final test, s | {ours['wall_s']:.1f} | {marian['wall_s']:.1f} |",
             "", f"Speed-up to target (Marian time / our time, training time): "
             f"**{fmt(timed['speedup_train_s'], '.2f')}x**." if timed["speedup_train_s"] else
             "Speed-up to target: n/a (a curve never reached the target).", "",
             "Curves (step: training s → greedy test BLEU):", ""]
    bounded = [run["label"] for name, run in timed["runs"].items() if timed["time_to_target"][name]["upper_bound_only"]]
    if not timed["target_bleu"]:
        bounded = bounded or ["both runs"]
        lines[-2:-2] = ["**The target is 0 BLEU: every run reaches it at once, so this time-to-quality ratio only "
                        "reflects the speed of the first steps, not quality.**", ""]
    if bounded:
        lines[-2:-2] = [f"Resolution: evaluation every {eval_steps} steps; {' and '.join(bounded)} reached the "
                        f"target at the first evaluation, so that time is only an upper bound.", ""]
    for run in (ours, marian):
        lines.append(f"* {run['label']}: " + ", ".join(f"{p['step']}: {p['train_s']:.0f}s → {fmt(p['bleu'], '.2f')}"
                                                       for p in run["points"]))
    return lines + [""]


# ------------------------------------------------------------------------------------------------------- main
PART_NAMES = {"4": EQUAL_BUDGET, "5": TIME_TO_TARGET, EQUAL_BUDGET: EQUAL_BUDGET, TIME_TO_TARGET: TIME_TO_TARGET}


def parse_arguments():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke budget: tiny preset, 2,000 pairs, 100 test pairs")
    ap.add_argument("--parts", nargs="+", default=[EQUAL_BUDGET, TIME_TO_TARGET], choices=list(PART_NAMES),
                    help=f"{EQUAL_BUDGET} (or 4, the issue's part number) and/or {TIME_TO_TARGET} (or 5)")
    ap.add_argument("--preset", default=None, help="model size (full: small, quick: tiny)")
    ap.add_argument("--max_train_samples", type=int, default=None, help="first N training pairs (full: all)")
    ap.add_argument("--epochs", type=float, default=None, help="epochs for both measurements (default 3)")
    ap.add_argument("--max_steps", type=int, default=None, help="if > 0: steps instead of epochs (both)")
    ap.add_argument("--eval_samples", type=int, default=None, help="first N test pairs (full: all 755)")
    ap.add_argument("--warmup_steps", type=int, default=None, help="full: 400, quick: 100")
    ap.add_argument("--eval_steps", type=int, default=None, help="time-to-target evaluation interval (full 250, quick 25)")
    ap.add_argument("--eval_max_new_tokens", type=int, default=None, help="full 256, quick 96")
    ap.add_argument("--vocab_size", type=int, default=None, help="tokenizer vocabulary (8000)")
    ap.add_argument("--marian_init", choices=["copy", "native"], default="copy",
                    help="equal budget: Marian starts from our initial weights (copy) or from its own seeded init")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--output", default=str(RESULTS / "quality.json"))
    ap.add_argument("--render", metavar="JSON", help="only rewrite a results JSON (old keys part4/part5 renamed) "
                                                     "and its .md")
    args = ap.parse_args()
    args.parts = list(dict.fromkeys(PART_NAMES[part] for part in args.parts))
    return args


def budget_from(args) -> dict:
    """The quick or full budget, with the values given on the command line."""
    budget = dict(QUICK if args.quick else FULL)
    for key in budget:
        if getattr(args, key, None) is not None:
            budget[key] = getattr(args, key)
    if args.epochs is not None:
        budget["epochs"] = args.epochs
    budget["logging_steps"] = min(budget["logging_steps"], budget["eval_steps"])
    if budget["eval_steps"] % budget["logging_steps"]:
        budget["logging_steps"] = budget["eval_steps"]
    return budget


def main():
    args = parse_arguments()
    if args.render:
        res = with_new_keys(json.loads(Path(args.render).read_text()))
        write_results(res, Path(args.render), render_markdown(res))
        return
    torch.set_num_threads(args.threads)
    budget = budget_from(args)
    started = time.time()
    res = {"machine": machine_info(args.threads),
           "settings": {**budget, "quick": args.quick, "parts": args.parts, "threads": args.threads,
                        "seed": args.seed, "marian_init": args.marian_init},
           "loadavg_start": loadavg()}
    print(f"settings: {res['settings']}", flush=True)
    if EQUAL_BUDGET in args.parts:
        res[EQUAL_BUDGET] = equal_budget_bleu(budget, args, prepare_corpus(budget, args.seed))
    if TIME_TO_TARGET in args.parts:
        res[TIME_TO_TARGET] = time_to_target_bleu(budget, args)
    res["loadavg_end"] = loadavg()
    res["wall_s"] = round(time.time() - started, 1)
    md = render_markdown(res)
    write_results(res, Path(args.output), md)
    print(md)


if __name__ == "__main__":
    main()
