"""Choose the training recipe by measurement: run `train.py` with named settings and score each on the validation
split of the shipped corpus (the test split is not looked at here; the chosen default is tested once, at the end).

    python benchmarks/recipe_ablation.py --list
    python benchmarks/recipe_ablation.py baseline vocab4k --jobs 2 --threads 1
    python benchmarks/recipe_ablation.py --table          # rewrite results/recipe_ablation.md from the .jsonl

Every run appends one JSON line to `benchmarks/results/recipe_ablation.jsonl`: its flags, the commit, the
machine, how many runs shared it, validation BLEU/chrF/loss of the final model (greedy; optionally beam search
and the last checkpoint before averaging), steps, epochs and training throughput. Runs are seeded (42) and
deterministic given the thread count; wall times depend on how loaded the machine was (`jobs` says).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "recipe_ablation.jsonl"
TABLE = RESULTS.with_suffix(".md")
OUTPUTS = REPO / "outputs" / "ablation"
sys.path.insert(0, str(REPO))  # this checkout's package, installed or not (runs in worktrees stay apart)

from hf_scratch_transformer.training.arguments import flags_to_argv  # noqa: E402

# train.py's defaults at the start of the ablation (commit 86dc356): small preset, joint BPE 8000, token batches
# of 2048, Adam 1e-3, 400 warm-up steps then inverse-sqrt, label smoothing 0.1, dropout 0.1, post-norm, 3 epochs.
# Each run below changes the named flags only; stage 2 runs combine what stage 1 found.
AVERAGE_LAST_5 = {"average_checkpoints": 5, "save_steps": 100, "save_total_limit": 5}
RUNS: dict[str, dict] = {
    # stage 1: one lever at a time, 3 epochs; each run also averages its last 5 checkpoints (100 steps apart), and
    # --last scores the last checkpoint alone, so every run gives the lever with and without averaging.
    "baseline": {**AVERAGE_LAST_5},
    "vocab4k": {"tokenizer_vocab_size": 4000, **AVERAGE_LAST_5},
    "tokens1024": {"max_tokens": 1024, **AVERAGE_LAST_5},
    "linear-decay": {"lr_scheduler_type": "linear", **AVERAGE_LAST_5},
    "lr2e-3": {"learning_rate": 2e-3, **AVERAGE_LAST_5},
    "prenorm-lr2e-3": {"normalize_before": True, "learning_rate": 2e-3, **AVERAGE_LAST_5},
    "enc6-dec2": {"encoder_layers": 6, "decoder_layers": 2, **AVERAGE_LAST_5},
    "vocab2k": {"tokenizer_vocab_size": 2000, **AVERAGE_LAST_5},
    "ls0.2": {"label_smoothing_factor": 0.2, **AVERAGE_LAST_5},
    "dropout0.2": {"dropout": 0.2, **AVERAGE_LAST_5},
}
# stage 3: the rest of the levers, each against `python train.py` with no flags (the defaults of b4be7ba: BPE 4,000,
# batches of 1,024 tokens, the run-length rule's 5,000 steps, validation every 2,000 steps), changing the named flags
# only, so a stage-3 run with no flags was the default run of b4be7ba (`corpus_runs.py en-es`; post-norm, Adam 1e-3,
# pinned in STAGE3_BASE_FLAGS now that stage 3 made pre-norm at 2e-3 the default). The validation cadence stays the
# default's too: each validation draws from the random stream training uses, so it is part of the recipe. Levers
# that change the time per step run for the same time instead of the same steps: their steps are scaled by the
# step-time ratio measured on 1,024-token batches, 1 thread (enc5-dec2 0.99x, wide384 2+2 1.26x the small preset's
# step time).
RUNS.update({
    "s3-baseline": {},
    "s3-lr2e-3": {"learning_rate": 2e-3},
    "s3-prenorm-lr2e-3": {"normalize_before": True, "learning_rate": 2e-3},
    "s3-enc5-dec2": {"encoder_layers": 5, "decoder_layers": 2},
    "s3-vocab2k": {"tokenizer_vocab_size": 2000},
    "s3-ls0.2": {"label_smoothing_factor": 0.2},
    "s3-dropout0.2": {"dropout": 0.2},
    "s3-dropout0.3": {"dropout": 0.3},
    "s3-bpe-dropout0.1": {"bpe_dropout": 0.1},
    "s3-bpe-dropout0.05": {"bpe_dropout": 0.05},
    "s3-bf16": {"bf16": True},  # autocast; pays on CPUs with bf16 matrix instructions (benchmarks/cpu_precision.py)
    "s3-wide384-2+2": {"d_model": 384, "encoder_layers": 2, "decoder_layers": 2, "attention_heads": 6,
                       "ffn_dim": 1536, "max_steps": 3968},
})

# stage 4: the 30-minute budget. The default of ac6cd5a (pre-norm, Adam 2e-3, inverse-sqrt, 5,000 steps) took 36.3 min
# idle at 2 threads; these runs stop at 3,600 steps (about 27 minutes there) and change the schedule to spend them
# better: a higher peak rate, and a linear decay to 0 at the last step. Against `python train.py` of ac6cd5a otherwise.
RUNS.update({
    "s4-lr3e-3": {"learning_rate": 3e-3, "max_steps": 3600},
    "s4-linear-lr3e-3": {"learning_rate": 3e-3, "lr_scheduler_type": "linear", "max_steps": 3600},
    "s4-linear": {"lr_scheduler_type": "linear", "max_steps": 3600},
    # on top of the default that s4-linear made (3,600 steps, linear decay): how much dropout the short budget wants
    "s4-dropout0.2": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.2},
    "s4-dropout0.0": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.0},
    "s4-dropout0.0-seed2": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.0, "seed": 7},
    # subword regularisation in place of dropout: robustness to how the source is spelt
    "s4-dropout0.0-bpe-dropout0.05": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.0,
                                      "bpe_dropout": 0.05},
    # on top of the default that these made (no dropout): the vocabulary and the depth split, at the same steps
    # (enc5-dec2's step takes 0.99x the small preset's, stage 3)
    "s4-dropout0.0-vocab2k": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.0,
                              "tokenizer_vocab_size": 2000},
    "s4-dropout0.0-enc5-dec2": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.0,
                                "encoder_layers": 5, "decoder_layers": 2},
    "s4-dropout0.0-ls0.2": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.0,
                            "label_smoothing_factor": 0.2},
    "s4-dropout0.0-ls0.2-seed2": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.0,
                                  "label_smoothing_factor": 0.2, "seed": 7},
    # training-time source noise against the two style-shift perturbations a model can learn from the corpus alone
    # (casing, typos): lower-case 10 % of the training sources and misspell 2 % of their words, redrawn every epoch
    "s4-dropout0.0-noise": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.0,
                            "source_lowercase_rate": 0.1, "source_typo_rate": 0.02},
    "s4-dropout0.0-noise-seed2": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.0,
                                  "source_lowercase_rate": 0.1, "source_typo_rate": 0.02, "seed": 7},
    # bf16 autocast on the default recipe (item 4): same steps, two seeds; this EPYC has AVX-512 BF16 but no AMX
    "s4-dropout0.0-bf16": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.0, "bf16": True},
    "s4-dropout0.0-bf16-seed2": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.0, "bf16": True,
                                 "seed": 7},
    # bf16 at the fp32 run's time: its training ran at 1.20x the fp32 seed-7 run's tokens/s (3,652 against 3,043, one
    # thread each, two runs side by side), so 1.2x the steps
    "s4-dropout0.0-bf16-4320": {"lr_scheduler_type": "linear", "max_steps": 4320, "dropout": 0.0, "bf16": True},
    "s4-dropout0.0-bf16-4320-seed2": {"lr_scheduler_type": "linear", "max_steps": 4320, "dropout": 0.0, "bf16": True,
                                      "seed": 7},
    # lower-casing alone, at half the rate, on today's default (bf16, 4,320 steps): lower-casing was the perturbation
    # the noise run learnt best (-1.5 to -0.2), the typos cost it plain-source BLEU for little
    "s4-dropout0.0-bf16-4320-lower0.05": {"lr_scheduler_type": "linear", "max_steps": 4320, "dropout": 0.0,
                                          "bf16": True, "source_lowercase_rate": 0.05},
    "s4-dropout0.0-bf16-4320-lower0.05-seed2": {"lr_scheduler_type": "linear", "max_steps": 4320, "dropout": 0.0,
                                                "bf16": True, "source_lowercase_rate": 0.05, "seed": 7},
    # the same in fp32 at 3,600 steps (the default on CPUs without AVX-512 BF16): a default must hold on both branches
    "s4-dropout0.0-lower0.05": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.0,
                                "source_lowercase_rate": 0.05},
    "s4-dropout0.0-lower0.05-seed2": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.0,
                                      "source_lowercase_rate": 0.05, "seed": 7},
    # paraphrased sources on today's default: half the sources that have a paraphrase in the corpus (the shipped
    # corpus: the King James Version of each English verse) replaced by it, drawn anew every epoch
    "s4-dropout0.0-bf16-4320-lower0.05-para0.5": {"lr_scheduler_type": "linear", "max_steps": 4320, "dropout": 0.0,
                                                  "bf16": True, "source_lowercase_rate": 0.05,
                                                  "source_paraphrase_rate": 0.5},
    "s4-dropout0.0-bf16-4320-lower0.05-para0.5-seed2": {"lr_scheduler_type": "linear", "max_steps": 4320,
                                                        "dropout": 0.0, "bf16": True, "source_lowercase_rate": 0.05,
                                                        "source_paraphrase_rate": 0.5, "seed": 7},
    # and plain quotes: the corpus's English has only typographic apostrophes and quotes (9,009 ’ in the training
    # sources, no '), keyboards type plain ones; half the sources that have typographic ones get plain ones
    "s4-dropout0.0-bf16-4320-lower0.05-para0.5-quotes0.5": {"lr_scheduler_type": "linear", "max_steps": 4320,
                                                            "dropout": 0.0, "bf16": True,
                                                            "source_lowercase_rate": 0.05,
                                                            "source_paraphrase_rate": 0.5,
                                                            "source_plain_quotes_rate": 0.5},
    "s4-dropout0.0-bf16-4320-lower0.05-para0.5-quotes0.5-seed2": {"lr_scheduler_type": "linear", "max_steps": 4320,
                                                                  "dropout": 0.0, "bf16": True,
                                                                  "source_lowercase_rate": 0.05,
                                                                  "source_paraphrase_rate": 0.5,
                                                                  "source_plain_quotes_rate": 0.5, "seed": 7},
    # and typos at half the rate tried before (0.01 of the words): misspelt words are the largest style-shift loss
    # left on this recipe (0.6-1.2 BLEU); 0.02 with lower-casing at 0.1 had cost about a point on the plain source
    "s4-dropout0.0-bf16-4320-lower0.05-para0.5-quotes0.5-typo0.01": {"lr_scheduler_type": "linear", "max_steps": 4320,
                                                                     "dropout": 0.0, "bf16": True,
                                                                     "source_lowercase_rate": 0.05,
                                                                     "source_paraphrase_rate": 0.5,
                                                                     "source_plain_quotes_rate": 0.5,
                                                                     "source_typo_rate": 0.01},
    "s4-dropout0.0-bf16-4320-lower0.05-para0.5-quotes0.5-typo0.01-seed2": {
        "lr_scheduler_type": "linear", "max_steps": 4320, "dropout": 0.0, "bf16": True, "source_lowercase_rate": 0.05,
        "source_paraphrase_rate": 0.5, "source_plain_quotes_rate": 0.5, "source_typo_rate": 0.01, "seed": 7},
    # the same in fp32 at 3,600 steps: the fp32 branch, and on a CPU with AMX the time-equal comparator of bf16 at 4,320
    "s4-dropout0.0-lower0.05-para0.5-quotes0.5": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.0,
                                                  "source_lowercase_rate": 0.05, "source_paraphrase_rate": 0.5,
                                                  "source_plain_quotes_rate": 0.5},
    "s4-dropout0.0-lower0.05-para0.5-quotes0.5-seed2": {"lr_scheduler_type": "linear", "max_steps": 3600,
                                                        "dropout": 0.0, "source_lowercase_rate": 0.05,
                                                        "source_paraphrase_rate": 0.5, "source_plain_quotes_rate": 0.5,
                                                        "seed": 7},
    # fp32 at those steps: how much of bf16-4320's gain is the steps alone (and whether it fits the budget in fp32)
    "s4-dropout0.0-4320-seed2": {"lr_scheduler_type": "linear", "max_steps": 4320, "dropout": 0.0, "seed": 7},
    # the rest of the dropout sweep: 0.3 (0.2 was already behind no dropout)
    "s4-dropout0.3": {"lr_scheduler_type": "linear", "max_steps": 3600, "dropout": 0.3},
    # wider and shallower at equal time: its step took 1.26x the small preset's in stage 3 (3,968 steps for 5,000)
    "s4-dropout0.0-wide384-2+2": {"lr_scheduler_type": "linear", "max_steps": 2858, "dropout": 0.0, "d_model": 384,
                                  "encoder_layers": 2, "decoder_layers": 2, "attention_heads": 6, "ffn_dim": 1536},
})

# stage 5: the moonshot (30 BLEU beam 4 in 25 minutes). Against train.py's defaults of the commit that runs them
# (after the training step got 1.6x faster in bf16 on a CPU: attention in fp32, 191c1ac); a row that sets
# --max_steps keeps the run-length rule's early stopping and best-model choice, so only the length differs.
RULE_LIKE = {"early_stopping_patience": 3, "load_best_model_at_end": True}
RUNS.update({
    "s5-default": {},
    "s5-steps6500": {"max_steps": 6500, **RULE_LIKE},
})

BASE_FLAGS = {"do_train": True, "do_eval": True, "eval_steps": 0, "report_to": "none", "overwrite_output_dir": True,
              "seed": 42, "save_total_limit": 1, "save_steps": 0, "num_train_epochs": 4.5,  # stages 1 and 2
              # the defaults of 86dc356 that later stages changed, written out
              "tokenizer_vocab_size": 8000, "max_tokens": 2048, "learning_rate": 1e-3,
              "lr_scheduler_type": "inverse_sqrt", "normalize_before": False, "dropout": 0.1,
              # no source noise unless the row says so (the defaults: lower-casing 0.05 since
              # s4-dropout0.0-bf16-4320-lower0.05, paraphrases and plain quotes 0.5 since its -para0.5-quotes0.5)
              "source_lowercase_rate": 0.0, "source_paraphrase_rate": 0.0, "source_plain_quotes_rate": 0.0,
              "bf16": False}  # every stage ran in fp32 unless its row says bf16 (now the default on CPUs with
                              # AVX-512 BF16 and no AMX: recipe.BF16_CPU_STEP_BUDGET)
# the rest is train.py's defaults, except the two that stage 3 itself changed (pre-norm and 2e-3 since ac6cd5a)
# and the run-length rule of then (5,000 steps, early stopping after 3 validations, the best model kept), written out
# since stage 4 shortened the rule's budget and made the decay linear
STAGE3_BASE_FLAGS = {"report_to": "none", "overwrite_output_dir": True, "normalize_before": False,
                     "learning_rate": 1e-3, "lr_scheduler_type": "inverse_sqrt", "max_steps": 5000,
                     "early_stopping_patience": 3, "load_best_model_at_end": True, "dropout": 0.1, "bf16": False,
                     "source_lowercase_rate": 0.0, "source_paraphrase_rate": 0.0, "source_plain_quotes_rate": 0.0}


# stage 4 starts from the defaults of 7f779db; the two it changed (linear decay, then no dropout) are written out
STAGE4_BASE_FLAGS = {"report_to": "none", "overwrite_output_dir": True, "lr_scheduler_type": "inverse_sqrt",
                     "dropout": 0.1, "bf16": False, "source_lowercase_rate": 0.0, "source_paraphrase_rate": 0.0,
                     "source_plain_quotes_rate": 0.0}


# stage 5 runs train.py's defaults of the day
STAGE5_BASE_FLAGS = {"report_to": "none", "overwrite_output_dir": True}


def command_line(name: str, flags: dict, threads: int) -> list[str]:
    base = {"s3-": STAGE3_BASE_FLAGS, "s4-": STAGE4_BASE_FLAGS, "s5-": STAGE5_BASE_FLAGS}.get(name[:3], BASE_FLAGS)
    merged = {**base, "output_dir": str(OUTPUTS / name), "cpu_threads": threads, **flags}
    return [sys.executable, str(REPO / "train.py"), *flags_to_argv(merged)]


def score_on_validation(model_dir: Path, num_beams: int, threads: int, length_penalty: float = 1.0,
                        split: str = "validation", shifted: bool = False, kinds: tuple[str, ...] | None = None,
                        king_james: bool = False) -> dict:
    """Validation (or test) BLEU/chrF of a saved model (or checkpoint), decoded as train.py decodes (bounded
    lengths); with `shifted`, of the style-shifted sources (benchmarks/style_shift.py) against the same references,
    with only the perturbations in `kinds` when given; with `king_james`, of the King James Version of the same
    verses (the corpus's `paraphrases`) as the sources."""
    import torch

    from hf_scratch_transformer import ScratchTransformerForConditionalGeneration
    from hf_scratch_transformer.data.loading import DataArguments, load_parallel_corpus
    from hf_scratch_transformer.data.preprocessing import evaluation_pairs, is_nonempty_pair
    from hf_scratch_transformer.training.evaluation import evaluate_translations
    from transformers import AutoTokenizer

    torch.set_num_threads(threads)
    from style_shift import PERTURBATIONS, style_shifted

    data_args = DataArguments()
    raw = load_parallel_corpus(data_args)[split]
    sources, references = evaluation_pairs(raw, data_args)
    if king_james:
        sources = [example["paraphrases"]["en"][0] for example in raw
                   if is_nonempty_pair(example, data_args.source_lang, data_args.target_lang)]
    sources = style_shifted(sources, kinds=kinds or PERTURBATIONS) if shifted else sources
    tokenizer = AutoTokenizer.from_pretrained(model_dir.parent if model_dir.name.startswith("checkpoint-")
                                              else model_dir)
    model = ScratchTransformerForConditionalGeneration.from_pretrained(model_dir).eval()
    model.generation_config.length_penalty = length_penalty
    scores, _ = evaluate_translations(model, tokenizer, sources, references, num_beams=num_beams, batch_size=64,
                                      max_new_tokens=256, max_len_a=1.5, max_len_b=10)
    return scores


def run_one(name: str, flags: dict, threads: int, jobs: int, beam: bool, last: bool, note: str = "") -> dict:
    started = time.time()
    log = OUTPUTS / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        code = subprocess.call(command_line(name, flags, threads), stdout=handle, stderr=subprocess.STDOUT,
                               cwd=REPO, env={**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(REPO)})
    return record_run(name, flags, threads, jobs, beam, last, note, code, round(time.time() - started, 1))


def record_run(name: str, flags: dict, threads: int, jobs: int, beam: bool, last: bool, note: str = "",
               code: int = 0, wall_seconds: float | None = None) -> dict:
    """Score a finished run's output directory and append its record to the results."""
    record = {"name": name, "flags": flags, "exit_code": code, "wall_seconds": wall_seconds,
              "threads": threads, "jobs": jobs, "note": note, "commit": _commit(), "machine": _machine(),
              "date": time.strftime("%Y-%m-%d %H:%M")}
    results_file = OUTPUTS / name / "all_results.json"
    if code == 0 and results_file.exists():
        results = json.loads(results_file.read_text())
        record.update({key: results.get(key) for key in (
            "eval_bleu", "eval_chrf", "eval_loss", "eval_gen_len", "train_steps", "epoch", "train_runtime",
            "train_tokens_per_second", "train_loss", "divergence_warning", "best_step", "stop_reason",
            "predict_bleu_greedy", "predict_bleu")})  # predict_*: the test split, which stage 3 runs score too
        if beam:
            record["eval_bleu_beam4"] = score_on_validation(OUTPUTS / name, 4, threads)["bleu"]
        record["eval_bleu_shifted"] = score_on_validation(OUTPUTS / name, 1, threads, shifted=True)["bleu"]
        checkpoints = sorted((OUTPUTS / name).glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
        if last and flags.get("average_checkpoints", 1) > 1 and checkpoints:
            record["eval_bleu_last_checkpoint"] = score_on_validation(checkpoints[-1], 1, threads)["bleu"]
    with open(RESULTS, "a") as handle:
        handle.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)
    return record


DECODINGS = [(1, 1.0), (4, 0.6), (4, 1.0), (4, 1.4), (6, 1.0)]  # (beams, length penalty)


def score_decodings(model_dir: Path, threads: int) -> None:
    """Validation BLEU of one trained model under each decoding of DECODINGS, one record each."""
    for beams, penalty in DECODINGS:
        started = time.time()
        scores = score_on_validation(model_dir, beams, threads, penalty)
        record = {"kind": "decoding", "name": f"beam {beams}, length penalty {penalty}", "model": str(model_dir),
                  "num_beams": beams, "length_penalty": penalty, "eval_bleu": scores["bleu"],
                  "eval_chrf": scores["chrf"], "eval_gen_len": scores["gen_len"],
                  "seconds": round(time.time() - started, 1), "threads": threads, "commit": _commit(),
                  "machine": _machine(), "date": time.strftime("%Y-%m-%d %H:%M")}
        with open(RESULTS, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)


def score_robustness(model_dirs: list[Path], split: str, beam: bool, threads: int, breakdown: bool = False,
                     king_james: bool = False) -> None:
    """BLEU of trained models on a split's sources and on their style-shifted copy (greedy; beam 4 with `beam`), one
    record each: the robustness figure. With `breakdown`, also greedy BLEU with each perturbation alone; with
    `king_james`, also BLEU with the King James Version of the same verses as the sources (real older English)."""
    from style_shift import PERTURBATIONS

    for model_dir in model_dirs:
        record = {"kind": "robustness", "name": model_dir.name, "model": str(model_dir), "split": split}
        for beams in (1, 4) if beam else (1,):
            label = "greedy" if beams == 1 else f"beam{beams}"
            record[label] = score_on_validation(model_dir, beams, threads, split=split)["bleu"]
            shifted = score_on_validation(model_dir, beams, threads, split=split, shifted=True)
            record[f"{label}_shifted"] = shifted["bleu"]
            if king_james:
                record[f"{label}_king_james"] = score_on_validation(model_dir, beams, threads, split=split,
                                                                    king_james=True)["bleu"]
        if breakdown:
            record["greedy_alone"] = {kind: score_on_validation(model_dir, 1, threads, split=split, shifted=True,
                                                                kinds=(kind,))["bleu"] for kind in PERTURBATIONS}
        record.update(threads=threads, commit=_commit(), machine=_machine(), date=time.strftime("%Y-%m-%d %H:%M"))
        with open(RESULTS, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)


def _decoding_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    lines = ["", f"## Decoding, on the model in `{rows[0]['model']}`", "",
             "| decoding | val BLEU | val chrF | mean length | seconds | threads | commit |",
             "|---|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['name']} | {r['eval_bleu']} | {r['eval_chrf']} | {r['eval_gen_len']} | {r['seconds']} | "
              f"{r['threads']} | {r['commit']} |" for r in rows]
    return "\n".join(lines) + "\n"


def write_table() -> None:
    every = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    rows = [row for row in every if row.get("kind") not in ("decoding", "robustness")]
    lines = ["| run | flags (changed from the stage's defaults) | seed | val BLEU greedy | val BLEU beam 4 | "
             "last ckpt, greedy | val BLEU style-shifted | test greedy / beam 4 | val loss | steps | epochs | "
             "train min | tok/s | threads × jobs | machine | commit |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|---|"]
    for row in rows:
        flags = ", ".join(f"{key}={value}" for key, value in row["flags"].items()) or "(defaults)"
        def cell(key: str, fmt: str = "{}", row=row) -> str:
            return "" if row.get(key) is None else fmt.format(row[key])

        status = ("" if row["exit_code"] == 0 else " (stopped by hand)"
                  if str(row.get("stop_reason", "")).startswith("stopped by hand") else f" (exit {row['exit_code']})")
        test = ("" if row.get("predict_bleu_greedy") is None
                else f"{row['predict_bleu_greedy']} / {row.get('predict_bleu', '')}")
        lines.append(
            f"| {row['name']}{status} | {flags} | {row['flags'].get('seed', 42)} | {cell('eval_bleu')} | "
            f"{cell('eval_bleu_beam4')} | {cell('eval_bleu_last_checkpoint')} | {cell('eval_bleu_shifted')} | "
            f"{test} | {cell('eval_loss')} | "
            f"{cell('train_steps')} | {cell('epoch')} | "
            f"{'' if row.get('train_runtime') is None else round(row['train_runtime'] / 60, 1)} | "
            f"{cell('train_tokens_per_second', '{:,.0f}')} | {row['threads']} × {row['jobs']} | "
            f"{_short_machine(row.get('machine', ''))} | {row['commit']} |")
    notes = [f"- {row['name']}: {row['note']}" for row in rows if row.get("note")]
    TABLE.write_text("# Recipe ablation: validation split of the shipped corpus\n\nGenerated by "
                     "`python benchmarks/recipe_ablation.py --table` from `recipe_ablation.jsonl` (every run, in "
                     "the order run). Validation split, 788 pairs; `val BLEU greedy` is the final model "
                     "(the average of the last checkpoints when averaging; stage 3: the best validated step), "
                     "`last ckpt` the last checkpoint alone, `style-shifted` the same validation verses with their "
                     "English source rewritten by `benchmarks/style_shift.py`, `test` the test split as train.py "
                     "scores it (stages 3 and 4). A run stopped by hand shows its last validation's figures (see its note). "
                     "Stages 1-2 changed flags from the defaults of e00bf89 (3 epochs, validated at the end); "
                     "stage 3 (`s3-*`) from `python train.py` with no flags as of b4be7ba (post-norm, Adam 1e-3; "
                     "pre-norm at 2e-3 is the default since ac6cd5a); stage 4 (`s4-*`) from `python train.py` as of "
                     "7f779db with `--lr_scheduler_type inverse_sqrt --dropout 0.1` (pre-norm, Adam 2e-3; linear "
                     "decay for 3,600 steps is the default since aa60da3, no dropout since ab5a820; bf16 with "
                     "4,320 steps on CPUs with AVX-512 BF16 since f7eea74; 5 % of the sources lower-cased since b66e4aa; paraphrases and plain quotes at 0.5, and bf16 on CPUs with AMX too, since 0f14453). The `bf16` rows run before 5f62e84 were "
                     "validated and tested under bf16 autocast, as train.py then did; their saved fp32 weights' test "
                     "scores, as users decode them, are in the robustness table. Later rows (`lower0.05`) decode "
                     "the saved weights. `threads × jobs`: torch threads of the "
                     "training run × runs side by side; other jobs may have shared the machine too, so `train min` and `tok/s` compare nothing — use steps "
                     "and epochs. Machines: Xeon = Intel Xeon Processor, Xeon (AMX) = one with AMX (and AVX-512 BF16), EPYC = AMD EPYC (AVX-512, no AMX), "
                     "2 logical cores each.\n\n"
                     + "\n".join(lines) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")
                     + _robustness_table([r for r in every if r.get("kind") == "robustness"])
                     + _decoding_table([r for r in every if r.get("kind") == "decoding"]))
    print(TABLE.read_text())


def _robustness_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    lines = ["", "## Robustness: plain and style-shifted English source (`--robustness`)", "",
             "| model | split | BLEU greedy | shifted | change | BLEU beam 4 | shifted | change | machine | commit |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        def drop(key: str, r=r) -> str:
            return "" if r.get(key) is None else f"{r[f'{key}_shifted'] - r[key]:+.2f}"

        lines.append(f"| {r['name']} | {r['split']} | {r['greedy']} | {r['greedy_shifted']} | {drop('greedy')} | "
                     f"{r.get('beam4', '')} | {r.get('beam4_shifted', '')} | {drop('beam4')} | "
                     f"{_short_machine(r.get('machine', ''))} | {r['commit']} |")
    broken_down = [r for r in rows if r.get("greedy_alone")]
    if broken_down:
        kinds = list(broken_down[0]["greedy_alone"])
        lines += ["", "What each perturbation costs alone (`--robustness ... --breakdown`; greedy BLEU change against "
                  "the plain source; the perturbations of `benchmarks/style_shift.py` one at a time, with the random draws "
                  "of the full shift):", "",
                  "| model | split | plain | all | " + " | ".join(kinds) + " | sum of parts |",
                  "|---|---|---:|---:|" + "---:|" * (len(kinds) + 1)]
        for r in broken_down:
            costs = [r["greedy_alone"][kind] - r["greedy"] for kind in kinds]
            lines.append(f"| {r['name']} | {r['split']} | {r['greedy']} | {r['greedy_shifted'] - r['greedy']:+.2f} | "
                         + " | ".join(f"{cost:+.2f}" for cost in costs) + f" | {sum(costs):+.2f} |")
    with_king_james = [r for r in rows if "greedy_king_james" in r]
    if with_king_james:
        lines += ["", "Real older English (`--robustness ... --king_james`): the King James Version (1769) of the same "
                  "verses as the source, the same Spanish references:", "",
                  "| model | split | BLEU greedy | King James | change | BLEU beam 4 | King James | change |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in with_king_james:
            beam = (f"{r['beam4']} | {r['beam4_king_james']} | {r['beam4_king_james'] - r['beam4']:+.2f}"
                    if "beam4_king_james" in r else " | | ")
            lines.append(f"| {r['name']} | {r['split']} | {r['greedy']} | {r['greedy_king_james']} | "
                         f"{r['greedy_king_james'] - r['greedy']:+.2f} | {beam} |")
    return "\n".join(lines) + "\n"


def _short_machine(machine: str) -> str:
    short = "EPYC" if "EPYC" in machine else "Xeon" if "Xeon" in machine else machine
    return f"{short} (AMX)" if "AMX" in machine else short


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    amx = Path("/proc/cpuinfo").exists() and "amx_tile" in Path("/proc/cpuinfo").read_text()
    return f"{cpu}{' (AMX)' if amx else ''}, {os.cpu_count()} logical cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help="names from RUNS (see --list)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME:JSON",
                        help='an extra run: name, then its flags as JSON, e.g. \'v4k-avg:{"tokenizer_vocab_size": 4000}\'')
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side")
    parser.add_argument("--note", default="", help="what else ran on the machine (recorded with each run)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run")
    parser.add_argument("--beam", action="store_true", help="also score the final model with beam 4")
    parser.add_argument("--last", action="store_true", help="also score the last checkpoint when averaging")
    parser.add_argument("--decoding", metavar="MODEL_DIR", help="score a trained model under each of DECODINGS")
    parser.add_argument("--robustness", nargs="+", metavar="MODEL_DIR",
                        help="score trained models on --split and on its style-shifted sources")
    parser.add_argument("--breakdown", action="store_true",
                        help="with --robustness: also score each style-shift perturbation alone (greedy)")
    parser.add_argument("--king_james", action="store_true",
                        help="with --robustness: also score the King James Version of the same verses as the source")
    parser.add_argument("--split", default="validation", choices=("validation", "test"))
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--record", action="store_true",
                        help="only score the runs' existing output directories (e.g. runs whose runner was stopped)")
    args = parser.parse_args()
    if args.list:
        for name, flags in RUNS.items():
            print(f"{name:16} {json.dumps(flags)}")
        return
    if args.table:
        write_table()
        return
    if args.decoding:
        score_decodings(Path(args.decoding), args.threads)
        write_table()
        return
    if args.robustness:
        score_robustness([Path(path) for path in args.robustness], args.split, args.beam, args.threads,
                         args.breakdown, args.king_james)
        return
    runs = {name: RUNS[name] for name in args.runs}
    for extra in args.set:
        name, flags = extra.split(":", 1)
        runs[name] = json.loads(flags)
    work = record_run if args.record else run_one
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda item: work(*item, args.threads, args.jobs, args.beam, args.last, args.note),
                      runs.items()))
    write_table()


if __name__ == "__main__":
    main()
