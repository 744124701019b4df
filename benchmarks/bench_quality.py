#!/usr/bin/env python
"""Quality: hf_scratch_transformer vs transformers' MarianMTModel (parts 4 and 5 of the benchmark issue).

  4. Quality at an equal budget. Our model and a MarianMTModel of identical sizes (width, depths, heads, FFN,
     vocabulary, shared + tied embeddings, dropout 0.1, ReLU, sqrt(d_model) embedding scale, post-norm), both
     starting from the same weights (ours copied into Marian; `--marian_init native` gives Marian its own seeded
     init), trained in ONE plain loop in this process: the same tokenizer (joint BPE, `train_tokenizer_on_corpus`),
     the same token-bucketed batches in the same order, the same schedule (Adam b=(0.9, 0.98) eps=1e-9, lr 1e-3,
     linear warm-up then inverse sqrt, label smoothing 0.1, grad clip 1.0), the two models alternating step by
     step (AB, BA, ...). Then test BLEU/chrF with greedy and beam 4, plus each model's training time and tokens/s.
  5. Time to quality, end to end, as each user would run it: `run_training` (what `train.py` runs, with its
     defaults) versus `Seq2SeqTrainer` + MarianMTModel of the same size (AdamW lr 5e-4, `inverse_sqrt` with 400
     warm-up steps, label smoothing 0.1, random batches of 64, 3 epochs, `predict_with_generate`). Both evaluate
     greedy test BLEU every `--eval_steps` steps; time to quality = the first training time at which our curve
     reaches the BLEU the Seq2SeqTrainer run ends with (linear interpolation between evaluation points).

    python benchmarks/bench_quality.py --quick --threads 1      # ~3-5 min on 2 cores: tiny preset, 2,000 pairs
    python benchmarks/bench_quality.py                          # full: small preset, whole corpus (many hours)
    python benchmarks/bench_quality.py --parts 4 --preset small --max_train_samples 5000 --max_steps 600

Writes benchmarks/results/quality.json and quality.md (or --output / its .md beside it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import transformers  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig,
    MarianConfig,
    MarianMTModel,
    get_inverse_sqrt_schedule,
)
from transformers.models.marian.modeling_marian import shift_tokens_right  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from bench_speed import copy_weights_to_marian, equivalence_check, machine_info  # noqa: E402
from hf_scratch_transformer.arguments import parse_arguments  # noqa: E402
from hf_scratch_transformer.loop import Trainer  # noqa: E402
from hf_scratch_transformer.training import run_training  # noqa: E402
from hf_scratch_transformer.configuration_scratch_transformer import ScratchTransformerConfig  # noqa: E402
from hf_scratch_transformer.data import (  # noqa: E402
    SHIPPED_CORPUS_FILES,
    DataArguments,
    evaluation_pairs,
    is_nonempty_pair,
    load_parallel_corpus,
    make_batch_sampler,
    make_collator,
    preprocess_corpus,
)
from hf_scratch_transformer.evaluation import evaluate_translations, translation_scores  # noqa: E402
from hf_scratch_transformer.modeling_scratch_transformer import (  # noqa: E402
    ScratchTransformerForConditionalGeneration,
)
from hf_scratch_transformer.tokenization import train_tokenizer_on_corpus  # noqa: E402

hf_logging.set_verbosity_error()
RESULTS = Path(__file__).resolve().parent / "results"
OURS, MARIAN = "scratch", "marian"
SRC, TGT = "en", "es"

# Budgets. Full = the issue's settings; quick = a smoke run that shows the machinery works (its BLEU is tiny).
FULL = dict(preset="small", max_train_samples=None, epochs=3.0, max_steps=-1, eval_samples=None, warmup_steps=400,
            eval_steps=250, logging_steps=50, eval_max_new_tokens=256, vocab_size=8000)
QUICK = dict(preset="tiny", max_train_samples=2000, epochs=3.0, max_steps=-1, eval_samples=100, warmup_steps=100,
             eval_steps=25, logging_steps=25, eval_max_new_tokens=96, vocab_size=8000)
MAX_LENGTH = 256  # train.py's --max_source_length / --max_target_length default


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


# ----------------------------------------------------------------------------------------------------- models
def marian_config(cfg: ScratchTransformerConfig) -> MarianConfig:
    """A MarianConfig with the sizes and options of our config (as in bench_speed.build_pair)."""
    return MarianConfig(
        vocab_size=cfg.vocab_size, decoder_vocab_size=cfg.vocab_size, d_model=cfg.d_model,
        encoder_layers=cfg.encoder_layers, decoder_layers=cfg.decoder_layers,
        encoder_attention_heads=cfg.encoder_attention_heads, decoder_attention_heads=cfg.decoder_attention_heads,
        encoder_ffn_dim=cfg.encoder_ffn_dim, decoder_ffn_dim=cfg.decoder_ffn_dim,
        dropout=cfg.dropout, attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout,
        activation_function="relu", scale_embedding=True, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, pad_token_id=cfg.pad_token_id, eos_token_id=cfg.eos_token_id,
        bos_token_id=cfg.bos_token_id, decoder_start_token_id=cfg.decoder_start_token_id, forced_eos_token_id=None,
        max_position_embeddings=cfg.max_position_embeddings,
    )


def generation_config(cfg, max_length: int, num_beams: int = 1) -> GenerationConfig:
    return GenerationConfig(
        decoder_start_token_id=cfg.decoder_start_token_id, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id, num_beams=num_beams, max_length=max_length, early_stopping=num_beams > 1,
    )


def build_models(preset: str, vocab_size: int, seed: int, marian_init: str):
    torch.manual_seed(seed)
    cfg = ScratchTransformerConfig.from_preset(preset, vocab_size=vocab_size, dropout=0.1, attention_dropout=0.0,
                                               activation_dropout=0.0)
    ours = ScratchTransformerForConditionalGeneration(cfg)
    torch.manual_seed(seed)
    marian = MarianMTModel(marian_config(cfg))
    if marian_init == "copy":
        copy_weights_to_marian(ours, marian)
    for model in (ours, marian):
        model.generation_config = generation_config(cfg, MAX_LENGTH + 1)
    return cfg, ours, marian


# -------------------------------------------------------------------------------------------------- the corpus
def data_arguments(s: dict, **extra) -> DataArguments:
    return DataArguments(source_lang=SRC, target_lang=TGT, max_train_samples=s["max_train_samples"],
                         max_eval_samples=s["eval_samples"], max_predict_samples=s["eval_samples"],
                         tokenizer_vocab_size=s["vocab_size"], **extra)


def prepare_corpus(s: dict, seed: int):
    """Shipped corpus -> joint BPE tokenizer (train split) -> tokenised, filtered splits (train.py's recipe)."""
    data_args = data_arguments(s)
    raw = load_parallel_corpus(data_args, seed=seed)
    tokenizer = train_tokenizer_on_corpus(raw["train"], SRC, TGT, vocab_size=s["vocab_size"],
                                          max_sentences=data_args.tokenizer_max_sentences, seed=seed)
    tokenizer.model_max_length = MAX_LENGTH
    datasets, report = preprocess_corpus(raw, tokenizer, data_args)
    test_sources, test_references = evaluation_pairs(raw["test"], data_args)
    return data_args, tokenizer, datasets, report, test_sources, test_references


# ------------------------------------------------------------------------------------------------------ part 4
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


def part4(s: dict, args, corpus) -> dict:
    data_args, tokenizer, datasets, report, test_sources, test_references = corpus
    cfg, ours, marian = build_models(s["preset"], len(tokenizer), args.seed, args.marian_init)
    models = {OURS: ours, MARIAN: marian}
    optimizers, schedulers = {}, {}
    for name, model in models.items():
        model.train()
        optimizers[name] = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
        schedulers[name] = get_inverse_sqrt_schedule(optimizers[name], num_warmup_steps=s["warmup_steps"])
    collator = make_collator(tokenizer)
    train = datasets["train"]
    sampler = make_batch_sampler(train, data_args, 64, shuffle=True, seed=args.seed)  # token-bucketed (2048)
    steps_per_epoch = len(sampler)
    total = s["max_steps"] if s["max_steps"] > 0 else math.ceil(s["epochs"] * steps_per_epoch)
    seconds = {n: 0.0 for n in models}
    window = {n: [] for n in models}
    curve = []
    tokens_done, step, epoch = 0, 0, 0
    first = collator([train[i] for i in next(iter(sampler))])
    same_function = equivalence_check(ours, marian, first) if args.marian_init == "copy" else None
    for model in models.values():
        model.train()
    print(f"[part 4] {len(train)} training pairs, {steps_per_epoch} batches/epoch, {total} steps per model", flush=True)
    while step < total:
        sampler.set_epoch(epoch)
        for indices in sampler:
            batch = collator([train[i] for i in indices])
            tokens = int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
            order = [OURS, MARIAN] if step % 2 == 0 else [MARIAN, OURS]
            for name in order:
                model, opt = models[name], optimizers[name]
                torch.manual_seed(args.seed * 1_000_003 + step)  # same dropout RNG state for both at every step
                t = time.perf_counter()
                loss = training_loss(name, model, batch, cfg)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                schedulers[name].step()
                seconds[name] += time.perf_counter() - t
                if not torch.isfinite(loss):
                    raise RuntimeError(f"{name}: non-finite loss at step {step + 1}")
                window[name].append(loss.item())
            tokens_done += tokens
            step += 1
            if step % s["logging_steps"] == 0 or step == total:
                row = {"step": step, "train_tokens": tokens_done,
                       **{f"loss_{n}": round(sum(w) / len(w), 4) for n, w in window.items()},
                       **{f"seconds_{n}": round(seconds[n], 2) for n in models}}
                curve.append(row)
                print(f"[part 4] {json.dumps(row)}", flush=True)
                window = {n: [] for n in models}
            if step >= total:
                break
        else:
            epoch += 1
    result = {
        "config": {k: getattr(cfg, k) for k in ("vocab_size", "d_model", "encoder_layers", "decoder_layers",
                                                "encoder_attention_heads", "encoder_ffn_dim", "dropout")},
        "parameters": {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()},
        "marian_init": args.marian_init, "train_pairs": len(train), "filtered": report["train"],
        "test_pairs": len(test_sources), "steps": step, "epochs": round(step / steps_per_epoch, 3),
        "train_tokens": tokens_done, "batches": f"token-bucketed, <= {data_args.max_tokens} tokens (batch x longest side)",
        "initial_equivalence": same_function, "curve": curve, "models": {},
    }
    for name, model in models.items():
        model.eval()
        r = {"train_seconds": round(seconds[name], 1), "train_tokens_per_s": round(tokens_done / seconds[name], 1),
             "final_train_loss": curve[-1][f"loss_{name}"]}
        for beams in (1, 4):
            t = time.perf_counter()
            scores, _ = evaluate_translations(model, tokenizer, test_sources, test_references, num_beams=beams,
                                              batch_size=64, max_new_tokens=s["eval_max_new_tokens"])
            key = "greedy" if beams == 1 else f"beam{beams}"
            r[f"test_bleu_{key}"], r[f"test_chrf_{key}"] = scores["bleu"], scores["chrf"]
            r[f"test_decode_seconds_{key}"] = round(time.perf_counter() - t, 1)
        result["models"][name] = r
        print(f"[part 4] {name}: {r}", flush=True)
    return result


# ------------------------------------------------------------------------------------------------------ part 5
def corpus_file_flags() -> list[str]:
    """The shipped corpus with the TEST split as the periodic-evaluation split, so both curves are test BLEU."""
    return ["--train_file", str(SHIPPED_CORPUS_FILES["train"]), "--validation_file", str(SHIPPED_CORPUS_FILES["test"]),
            "--test_file", str(SHIPPED_CORPUS_FILES["test"])]


def run_ours(s: dict, args, workdir: Path) -> dict:
    """`run_training` with train.py's defaults; Trainer.train / Trainer.validate are wrapped (in this process only)
    to timestamp the end of the setup and each evaluation, so the evaluation time can be taken out of the clock."""
    argv = ["--output_dir", str(workdir / "ours"), "--overwrite_output_dir", "--report_to", "none",
            "--preset", s["preset"], "--seed", str(args.seed), "--num_train_epochs", str(s["epochs"]),
            "--max_steps", str(s["max_steps"]), "--warmup_steps", str(s["warmup_steps"]),
            "--eval_steps", str(s["eval_steps"]), "--logging_steps", str(s["logging_steps"]),
            "--eval_max_new_tokens", str(s["eval_max_new_tokens"]), "--num_beams", "1",
            "--tokenizer_vocab_size", str(s["vocab_size"]), *corpus_file_flags()]
    if s["max_train_samples"]:
        argv += ["--max_train_samples", str(s["max_train_samples"])]
    if s["eval_samples"]:
        argv += ["--max_eval_samples", str(s["eval_samples"]), "--max_predict_samples", str(s["eval_samples"])]
    marks: dict = {"evals": []}
    original_train, original_validate = Trainer.train, Trainer.validate

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
    Trainer.train, Trainer.validate = train, validate
    t0 = time.time()
    try:
        results = run_training(model_args, data_args, train_args)
    finally:
        Trainer.train, Trainer.validate = original_train, original_validate
    end = time.time()
    return curve_from_marks("train.py (run_training, our defaults)", t0, marks, end, {
        "flags": argv, "train_steps": results["train_steps"], "train_tokens": results["train_tokens"],
        "train_tokens_per_second": results["train_tokens_per_second"], "train_pairs": results["train_samples"],
        # --num_beams 1: the test decoding (predict_*) is greedy
        "final_test_bleu_greedy": results.get("predict_bleu"), "final_test_chrf_greedy": results.get("predict_chrf"),
    })


def run_marian_trainer(s: dict, args, workdir: Path) -> dict:
    """What a transformers user writes: tokenise with datasets.map, DataCollatorForSeq2Seq, Seq2SeqTrainer."""
    from accelerate.state import AcceleratorState
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    AcceleratorState._reset_state(reset_partial_state=True)  # run_training's Accelerator ran in this process
    marks: dict = {"evals": []}
    t0 = time.time()
    data_args = data_arguments(s)
    data_args.train_file, data_args.validation_file, data_args.test_file = (
        str(SHIPPED_CORPUS_FILES["train"]), str(SHIPPED_CORPUS_FILES["test"]), str(SHIPPED_CORPUS_FILES["test"]))
    raw = load_parallel_corpus(data_args, seed=args.seed)
    # No pretrained Marian tokenizer exists for this corpus (and there is no network): the same joint BPE recipe.
    tokenizer = train_tokenizer_on_corpus(raw["train"], SRC, TGT, vocab_size=s["vocab_size"], seed=args.seed,
                                          max_sentences=data_args.tokenizer_max_sentences)
    tokenizer.model_max_length = MAX_LENGTH
    nonempty = lambda ex: is_nonempty_pair(ex, SRC, TGT)  # noqa: E731

    def tokenize(batch):
        inputs = tokenizer([p[SRC] for p in batch["translation"]], max_length=MAX_LENGTH, truncation=True)
        inputs["labels"] = tokenizer(text_target=[p[TGT] for p in batch["translation"]], max_length=MAX_LENGTH,
                                     truncation=True)["input_ids"]
        return inputs

    columns = raw["train"].column_names
    train_ds = raw["train"].filter(nonempty).map(tokenize, batched=True, remove_columns=columns)
    eval_raw = raw["validation"].filter(nonempty)
    eval_ds = eval_raw.map(tokenize, batched=True, remove_columns=eval_raw.column_names)
    references = [ex["translation"][TGT] for ex in eval_raw]

    cfg = ScratchTransformerConfig.from_preset(s["preset"], vocab_size=len(tokenizer), dropout=0.1,
                                               attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(args.seed)
    model = MarianMTModel(marian_config(cfg))
    gen = generation_config(cfg, s["eval_max_new_tokens"] + 1, num_beams=1)
    model.generation_config = gen

    def compute_metrics(prediction):
        ids = np.where(prediction.predictions < 0, tokenizer.pad_token_id, prediction.predictions)
        texts = [t.strip() for t in tokenizer.batch_decode(ids, skip_special_tokens=True)]
        return translation_scores(texts, references)

    class TimedTrainer(Seq2SeqTrainer):
        def evaluate(self, *a, **k):
            start = time.time()
            metrics = super().evaluate(*a, **k)
            marks["evals"].append({"step": self.state.global_step, "start": start, "end": time.time(),
                                   "bleu": metrics.get("eval_bleu"), "chrf": metrics.get("eval_chrf")})
            return metrics

    options = dict(
        output_dir=str(workdir / "marian"), per_device_train_batch_size=64, per_device_eval_batch_size=64,
        learning_rate=5e-4, lr_scheduler_type="inverse_sqrt", warmup_steps=s["warmup_steps"],
        label_smoothing_factor=0.1, num_train_epochs=s["epochs"], max_steps=s["max_steps"], eval_strategy="steps",
        eval_steps=s["eval_steps"], logging_steps=s["logging_steps"], predict_with_generate=True,
        generation_config=gen, report_to="none", use_cpu=True, seed=args.seed, disable_tqdm=True,
    )  # optimizer: the default AdamW (betas 0.9/0.999, eps 1e-8, no weight decay); checkpoints: the defaults
    targs = Seq2SeqTrainingArguments(**options)
    trainer = TimedTrainer(model=model, args=targs, train_dataset=train_ds, eval_dataset=eval_ds,
                           data_collator=DataCollatorForSeq2Seq(tokenizer, model=model), processing_class=tokenizer,
                           compute_metrics=compute_metrics)
    marks["setup_end"] = time.time()
    out = trainer.train()
    if not marks["evals"] or marks["evals"][-1]["step"] != trainer.state.global_step:
        trainer.evaluate()  # the BLEU the run ends with
    end = time.time()
    marks["total_steps"] = trainer.state.global_step
    return curve_from_marks("Seq2SeqTrainer + MarianMTModel", t0, marks, end, {
        "train_steps": trainer.state.global_step, "train_pairs": len(train_ds),
        "train_runtime_reported": out.metrics.get("train_runtime"),
        "final_test_bleu_greedy": marks["evals"][-1]["bleu"], "final_test_chrf_greedy": marks["evals"][-1]["chrf"],
    })


def curve_from_marks(label: str, t0: float, marks: dict, end: float, extra: dict) -> dict:
    """(training seconds, BLEU) points: wall time since the end of the setup minus the time spent in earlier
    evaluations (an evaluation's own time is not counted either); `elapsed_with_setup_s` adds the setup."""
    setup = marks["setup_end"] - t0
    eval_time, points = 0.0, []
    for e in marks["evals"]:
        train_s = e["start"] - marks["setup_end"] - eval_time
        eval_time += e["end"] - e["start"]
        points.append({"step": e["step"], "train_s": round(train_s, 2), "elapsed_with_setup_s": round(train_s + setup, 2),
                       "bleu": e["bleu"], "chrf": e["chrf"], "eval_s": round(e["end"] - e["start"], 2)})
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


def part5(s: dict, args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="bench_quality_"))
    try:
        ours = run_ours(s, args, workdir)
        print(f"[part 5] ours: {json.dumps(ours['points'])}", flush=True)
        marian = run_marian_trainer(s, args, workdir)
        print(f"[part 5] marian: {json.dumps(marian['points'])}", flush=True)
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
    a, b = result["time_to_target"][OURS]["train_s"], result["time_to_target"][MARIAN]["train_s"]
    result["speedup_train_s"] = round(b / a, 2) if a and b else None
    return result


# ----------------------------------------------------------------------------------------------------- report
def fmt(x, spec=".1f", none="n/a"):
    return none if x is None else format(x, spec)


def render_markdown(res: dict) -> str:
    m, s = res["machine"], res["settings"]
    quick = s["quick"]
    busy = max(res["loadavg_start"][:1] + res["loadavg_end"][:1] or [0]) > s["threads"] + 0.5
    L = ["# Quality: hf_scratch_transformer vs MarianMTModel (parts 4-5)", ""]
    reduced = not quick and any(s.get(k) != v for k, v in FULL.items() if k != "logging_steps")
    mode = "quick" if quick else ("reduced" if reduced else "full")
    if quick:
        L += ["> **QUICK MODE — a smoke run, not the benchmark.** Tiny budget (see below); BLEU at this budget is near "
              "zero and the comparison says little about quality. Run without `--quick` for the real figures.", ""]
    elif reduced:
        L += ["> **REDUCED BUDGET — not the issue's full settings** (those take ~5 h on 2 cores). Both models get the "
              "same reduced budget (see below), so the comparison is fair, but absolute BLEU is far below a full run's.",
              ""]
    L += [f"Machine: **{m['cpu']}**, {m['logical_cpus']} logical CPUs, torch threads {s['threads']}; Python "
          f"{m['python']}, torch {m['torch']}, transformers {m['transformers']}; {m['date_utc']} UTC, commit "
          f"{m.get('git_commit', '?')}.",
          f"Mode: **{mode}**; preset `{s['preset']}`, training pairs "
          f"{s['max_train_samples'] or 'all'}, {s['epochs']} epochs" + (f" (max_steps {s['max_steps']})" if s['max_steps'] > 0 else "")
          + f", warm-up {s['warmup_steps']} steps, test pairs {s['eval_samples'] or 'all'}, vocabulary "
          f"{s['vocab_size']}, longest translation {s['eval_max_new_tokens']} tokens, seed {s['seed']}. "
          f"Total wall time of this run: {res['wall_s'] / 60:.1f} min.",
          f"Load average at start / end: {res['loadavg_start'][:1]} / {res['loadavg_end'][:1]}"
          + (" — **another job was using the CPUs: the timings are noisy** (ratios from the same run are more "
             "reliable than absolute figures)." if busy else "."), ""]
    p4 = res.get("part4")
    if p4:
        c = p4["config"]
        L += ["## 4. Quality at an equal budget", "",
              f"One loop, models alternating per step; {p4['steps']} steps ({p4['epochs']} epochs) of the same "
              f"{p4['batches']} batches, {p4['train_tokens']:,} training tokens (non-pad src+tgt) each; "
              f"{p4['train_pairs']:,} training pairs, {p4['test_pairs']} test pairs. Model: d_model {c['d_model']}, "
              f"{c['encoder_layers']}+{c['decoder_layers']} layers, {c['encoder_attention_heads']} heads, FFN "
              f"{c['encoder_ffn_dim']}, vocabulary {c['vocab_size']}, dropout {c['dropout']}; parameters "
              f"{p4['parameters'][OURS]:,} (ours) / {p4['parameters'][MARIAN]:,} (Marian, incl. its frozen "
              f"position table and final_logits_bias). Initial weights: "
              + (f"identical (ours copied into Marian; max |logit diff| before training "
                 f"{p4['initial_equivalence']['max_abs_logit_diff']:.1e})." if p4["initial_equivalence"]
                 else "each its own seeded init."),
              "", "| | scratch | MarianMT |", "|---|---:|---:|"]
        a, b = p4["models"][OURS], p4["models"][MARIAN]
        for key, label in (("test_bleu_greedy", "test BLEU, greedy"), ("test_bleu_beam4", "test BLEU, beam 4"),
                           ("test_chrf_greedy", "test chrF, greedy"), ("test_chrf_beam4", "test chrF, beam 4"),
                           ("final_train_loss", "last logged training loss (label-smoothed)"),
                           ("train_seconds", "training time, s (fwd+bwd+clip+step)"),
                           ("train_tokens_per_s", "training tokens/s")):
            spec = {"train_tokens_per_s": ",.0f", "final_train_loss": ".3f", "train_seconds": ".1f"}.get(key, ".2f")
            L.append(f"| {label} | {fmt(a[key], spec)} | {fmt(b[key], spec)} |")
        L.append("")
    p5 = res.get("part5")
    if p5:
        o, mr = p5["runs"][OURS], p5["runs"][MARIAN]
        to, tm = p5["time_to_target"][OURS], p5["time_to_target"][MARIAN]
        L += ["## 5. Time to quality, end to end", "",
              f"Target: the greedy test BLEU the Seq2SeqTrainer run ends with, **{fmt(p5['target_bleu'], '.2f')}**. "
              f"Times are training wall time (evaluation time taken out; checkpoint saving left in), and in brackets "
              f"the same plus the setup (corpus loading, tokenizer training, tokenisation, model creation).", "",
              "| | train.py (ours) | Seq2SeqTrainer + MarianMT |", "|---|---:|---:|",
              f"| optimiser steps | {o['train_steps']} | {mr['train_steps']} |",
              f"| final greedy test BLEU / chrF | {fmt(o['final_test_bleu_greedy'], '.2f')} / "
              f"{fmt(o['final_test_chrf_greedy'], '.2f')} | {fmt(mr['final_test_bleu_greedy'], '.2f')} / "
              f"{fmt(mr['final_test_chrf_greedy'], '.2f')} |",
              f"| time to target BLEU, s | **{fmt(to['train_s'])}** ({fmt(to['elapsed_with_setup_s'])}) | "
              f"**{fmt(tm['train_s'])}** ({fmt(tm['elapsed_with_setup_s'])}) |",
              f"| total training time, s (+ setup) | {fmt(o['points'][-1]['train_s'])} (+{o['setup_s']:.1f}) | "
              f"{fmt(mr['points'][-1]['train_s'])} (+{mr['setup_s']:.1f}) |",
              f"| whole run incl. evaluations and final test, s | {o['wall_s']:.1f} | {mr['wall_s']:.1f} |",
              "", f"Speed-up to target (Marian time / our time, training time): "
              f"**{fmt(p5['speedup_train_s'], '.2f')}x**." if p5["speedup_train_s"] else
              "Speed-up to target: n/a (a curve never reached the target).", "",
              "Curves (step: training s → greedy test BLEU):", ""]
        bounded = [run["label"] for name, run in p5["runs"].items() if p5["time_to_target"][name]["upper_bound_only"]]
        if not p5["target_bleu"]:
            bounded = bounded or ["both runs"]
            L[-2:-2] = ["**The target is 0 BLEU: every run reaches it at once, so this time-to-quality ratio only "
                        "reflects the speed of the first steps, not quality.**", ""]
        if bounded:
            L[-2:-2] = [f"Resolution: evaluation every {s['eval_steps']} steps; {' and '.join(bounded)} reached the "
                        f"target at the first evaluation, so that time is only an upper bound.", ""]
        for name, run in ((OURS, o), (MARIAN, mr)):
            L.append(f"* {run['label']}: " + ", ".join(f"{p['step']}: {p['train_s']:.0f}s → {fmt(p['bleu'], '.2f')}"
                                                    for p in run["points"]))
        L.append("")
    L += ["See `benchmarks/README.md` (section *Quality benchmark*) for the method.", ""]
    return "\n".join(L)


# ------------------------------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke budget: tiny preset, 2,000 pairs, 100 test pairs")
    ap.add_argument("--parts", nargs="+", type=int, default=[4, 5], choices=[4, 5])
    ap.add_argument("--preset", default=None, help="model size (full: small, quick: tiny)")
    ap.add_argument("--max_train_samples", type=int, default=None, help="first N training pairs (full: all)")
    ap.add_argument("--epochs", type=float, default=None, help="epochs for both parts (default 3)")
    ap.add_argument("--max_steps", type=int, default=None, help="if > 0: steps instead of epochs (both parts)")
    ap.add_argument("--eval_samples", type=int, default=None, help="first N test pairs (full: all 755)")
    ap.add_argument("--warmup_steps", type=int, default=None, help="full: 400, quick: 100")
    ap.add_argument("--eval_steps", type=int, default=None, help="part 5 evaluation interval (full 250, quick 25)")
    ap.add_argument("--eval_max_new_tokens", type=int, default=None, help="full 256, quick 96")
    ap.add_argument("--vocab_size", type=int, default=None, help="tokenizer vocabulary (8000)")
    ap.add_argument("--marian_init", choices=["copy", "native"], default="copy",
                    help="part 4: Marian starts from our initial weights (copy) or from its own seeded init")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--output", default=str(RESULTS / "quality.json"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    s = dict(QUICK if args.quick else FULL)
    for key in s:
        if getattr(args, key, None) is not None:
            s[key] = getattr(args, key)
    if args.epochs is not None:
        s["epochs"] = args.epochs
    s["logging_steps"] = min(s["logging_steps"], s["eval_steps"])
    if s["eval_steps"] % s["logging_steps"]:
        s["logging_steps"] = s["eval_steps"]
    started = time.time()
    res = {"machine": machine_info(args.threads),
           "settings": {**s, "quick": args.quick, "parts": args.parts, "threads": args.threads, "seed": args.seed,
                        "marian_init": args.marian_init},
           "loadavg_start": loadavg()}
    print(f"settings: {res['settings']}", flush=True)
    if 4 in args.parts:
        corpus = prepare_corpus(s, args.seed)
        res["part4"] = part4(s, args, corpus)
        del corpus
    if 5 in args.parts:
        res["part5"] = part5(s, args)
    res["loadavg_end"] = loadavg()
    res["wall_s"] = round(time.time() - started, 1)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    md = render_markdown(res)
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
