#!/usr/bin/env python
"""Speed and memory: hf_scratch_transformer vs transformers' MarianMTModel (+ CTranslate2 for greedy decoding).

Covers parts 1-3 of the benchmark issue:
  1. training throughput (non-pad tokens/s for forward + backward + AdamW step) and model FLOPs utilisation
     against this machine's measured matmul peak of the same precision;
  2. generation throughput (new tokens/s; greedy and beam 4; batch 1 and 32; fixed number of new tokens),
     with identical weights in both models (and in CTranslate2 for the greedy reference row);
  3. peak memory (VmHWM) of training and of generation, each in a fresh subprocess.
Training and generation are measured in fp32 and, where the CPU has bf16 matrix units (AMX, AVX-512 BF16), also
under bf16 autocast, train.py's default training precision there (--precisions to choose).

Both models get the same sizes, the same weights (copied ours -> Marian, including our sinusoid table, so the
logits agree to float rounding; checked at start-up), the same batches and the same thread count. Repetitions
alternate the two models (A B, B A, A B, ...) to cancel drift on a shared machine; figures are medians.

    python benchmarks/bench_speed.py --quick                 # ~2-3 min, small preset only
    python benchmarks/bench_speed.py                         # small + base, ~10 min on 2 cores
    python benchmarks/bench_speed.py --presets small --repeats 7 --precisions fp32 bf16
    python benchmarks/bench_speed.py --ablate --threads 1      # each speed trick on and off (speed_ablation.py)

Writes benchmarks/results/speed.json, speed.md and the torch.profiler tables profile_*.txt (--ablate:
ablation.json and ablation.md).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers.utils import logging as hf_logging

from common import (
    FIRST_REAL_TOKEN, MARIAN, OURS, PAD, RESULTS, VOCAB, alternate, batch_flops, batch_tokens, build_pair,
    equivalence_check, machine_info, median, precision_context, random_batch, run_generate, time_call, write_results,
)

from hf_scratch_transformer import ScratchTransformerForConditionalGeneration
from hf_scratch_transformer.cpu_threads import cpu_bf16_units
from hf_scratch_transformer.training.flops import PRECISION_DTYPES, matmul_flops, matmul_weights_per_token
from hf_scratch_transformer.training.loss import teacher_forced_loss


# ------------------------------------------------------------------------------------------------ utilities
def measure_matmul_peak(quick: bool, precision: str = "fp32") -> dict:
    """Best-of-sizes median GFLOP/s of a square torch.mm in the precision's dtype with the benchmark's thread count
    (the package's timing, hf_scratch_transformer.training.flops.matmul_flops)."""
    out = {}
    for n in ((2048, 4096) if not quick else (2048, 3072)):
        out[str(n)] = median(matmul_flops(n, PRECISION_DTYPES[precision], seconds=0.0,
                                          min_repeats=3 if quick else 5)) / 1e9
    return {"dtype": precision, "gflops_by_size": out, "peak_gflops": max(out.values())}


def peak_key(precision: str, at_end: bool = False) -> str:
    """The results key of a matmul peak: "matmul_peak" (fp32, as before bf16 was measured) or "matmul_peak_bf16", with
    "_at_end" for the second measurement."""
    return "matmul_peak" + ("" if precision == "fp32" else f"_{precision}") + ("_at_end" if at_end else "")


def share_identical(reference: list, sequences: list) -> float:
    """Share of sentences for which two systems produced the same token ids."""
    return sum(a == b for a, b in zip(reference, sequences)) / len(sequences)


# -------------------------------------------------------------------------------------------------- kernels
def measure_kernels(cfg) -> dict:
    """The single kernels behind the decoding loops' design choices, at this preset's shapes:

    * decode: a projection of 1 or 32 rows with W stored (out, in) as nn.Linear does (F.linear multiplies by its
      transpose) versus (in, out) as our `Projection` (transformers' Conv1D layout); the tied output projection as
      F.linear(x, W) versus (W @ xᵀ)ᵀ, and versus torch.mm over a (D, V) copy at 1 to 128 rows (and the copy's
      cost); one-query attention, F.scaled_dot_product_attention versus the formula written out; argmax versus
      max().indices over (32, V) scores.
    * training: forward + backward GFLOP/s of the training step's matmul shapes (~1,900 real tokens per batch),
      the attainable ceiling for MFU on this machine (the rest of a step is softmax, norms, dropout, Adam, ...)."""
    D, F_, V = cfg.d_model, cfg.decoder_ffn_dim, cfg.vocab_size
    shapes = {"qkv": (D, 3 * D), "out": (D, D), "ffn_in": (D, F_), "ffn_out": (F_, D)}
    decode = {}
    for rows in (1, 32):
        for name, (n_in, n_out) in shapes.items():
            weight_out_in, bias = torch.randn(n_out, n_in), torch.randn(n_out)
            weight_in_out = weight_out_in.T.contiguous()
            x = torch.randn(rows, 1, n_in)
            linear = time_call(lambda: torch.nn.functional.linear(x, weight_out_in, bias))
            conv1d = time_call(lambda: torch.nn.functional.linear(x, weight_in_out.T, bias))
            decode[f"{name}_{n_in}x{n_out}_rows{rows}"] = {"linear_us": linear * 1e6, "in_out_us": conv1d * 1e6,
                                                           "speedup": linear / conv1d}
        embedding, h = torch.randn(V, D), torch.randn(rows, D)
        linear = time_call(lambda: torch.nn.functional.linear(h, embedding))
        transposed = time_call(lambda: (embedding @ h.T).T)
        decode[f"lm_head_{D}x{V}_rows{rows}"] = {"linear_us": linear * 1e6, "in_out_us": transposed * 1e6,
                                                 "speedup": linear / transposed}
    # the output projection over a (D, V) copy of the tied embedding (torch.mm(h, Eᵀ contiguous)), at the rows a
    # decoding step has (greedy: 1 to the batch; beam 4: 4 per source), and what making that copy costs
    embedding = torch.randn(V, D)
    embedding_t = embedding.T.contiguous()
    output_projection = {}
    for rows in (1, 4, 8, 16, 32, 64, 128):
        h = torch.randn(rows, D)
        linear = time_call(lambda: torch.nn.functional.linear(h, embedding))
        copied = time_call(lambda: torch.mm(h, embedding_t))
        output_projection[rows] = {"linear_us": linear * 1e6, "mm_copy_us": copied * 1e6, "speedup": linear / copied}
    transpose_copy = time_call(lambda: embedding.T.contiguous(), 20)
    # one query per row (a decoding step's attention) over 35 keys: the fused kernel against the formula written out
    one_query = {}
    for rows in (1, 32):
        heads, head_dim = cfg.decoder_attention_heads, D // cfg.decoder_attention_heads
        q = torch.randn(rows, heads, 1, head_dim)
        k, v = torch.randn(rows, heads, 35, head_dim), torch.randn(rows, heads, 35, head_dim)
        scale = q.shape[-1] ** -0.5
        fused = time_call(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale))
        written = time_call(lambda: torch.matmul((torch.matmul(q, k.transpose(-2, -1)) * scale).softmax(-1), v))
        one_query[rows] = {"sdpa_us": fused * 1e6, "written_out_us": written * 1e6, "speedup": written / fused}
    scores = torch.randn(32, V)
    argmax, maximum = time_call(lambda: scores.argmax(-1)), time_call(lambda: scores.max(-1).indices)
    training = {}
    tokens = 1900
    for name, (n_in, n_out) in {**shapes, "lm_head": (D, V)}.items():
        x = torch.randn(tokens, n_in, requires_grad=True)
        # as in the model: projections store (in, out); the tied output projection is the (V, D) embedding
        w = torch.randn(n_out, n_in, requires_grad=True) if name == "lm_head" else torch.randn(n_in, n_out, requires_grad=True)
        grad = torch.randn(tokens, n_out)

        def step():
            torch.nn.functional.linear(x, w if name == "lm_head" else w.T).backward(grad)
            x.grad = w.grad = None

        training[name] = 3 * 2 * tokens * n_in * n_out / time_call(step, 10) / 1e9
    return {"decode": decode, "argmax_us": argmax * 1e6, "max_indices_us": maximum * 1e6,
            "output_projection_rows": output_projection, "transpose_copy_us": transpose_copy * 1e6,
            "one_query_attention": one_query, "training_matmul_gflops": training, "training_tokens": tokens}


# ------------------------------------------------------------------------------------------------- training
def train_step(model, opt, batch, autocast=contextlib.nullcontext):
    """One step of plain cross-entropy: MarianMT's own loss, ours as train.py computes it (training/loss.py)."""
    with autocast():
        if isinstance(model, ScratchTransformerForConditionalGeneration):
            loss = teacher_forced_loss(model, batch, 0.0)
        else:
            loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["labels"]).loss
    loss.float().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def bench_training(models: dict, cfg, batches, repeats, warmup, steps_per_rep, precision: str = "fp32") -> dict:
    """Training tokens/s and model GFLOP/s of each model (forward under `precision`'s autocast), alternated ABAB."""
    opts, autocast = {}, precision_context(precision)
    for name, m in models.items():
        m.train()
        opts[name] = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for name, m in models.items():
        for i in range(warmup):
            train_step(m, opts[name], batches[i % len(batches)], autocast)
    rates = {n: [] for n in models}
    flops_rates = {n: [] for n in models}
    for rep in range(repeats):
        chosen = [batches[(rep * steps_per_rep + j) % len(batches)] for j in range(steps_per_rep)]
        tokens = sum(sum(batch_tokens(b)) for b in chosen)
        flops = sum(batch_flops(cfg, b) for b in chosen)
        for name in alternate(list(models), rep):
            gc.collect()
            t = time.perf_counter()
            for b in chosen:
                train_step(models[name], opts[name], b, autocast)
            dt = time.perf_counter() - t
            rates[name].append(tokens / dt)
            flops_rates[name].append(flops / dt / 1e9)
    return {
        name: {
            "tokens_per_s": median(rates[name]),
            "tokens_per_s_all": [round(r, 1) for r in rates[name]],
            "tokens_per_s_best": max(rates[name]),
            "achieved_gflops": median(flops_rates[name]),
        }
        for name in models
    }


# ----------------------------------------------------------------------------------------------- generation
def bench_generation(models: dict, batch, num_beams, new_tokens, repeats, warmup,
                     precision: str = "fp32") -> tuple[dict, list]:
    """new tokens/s of each model's generate() (under `precision`'s autocast), alternated ABAB; returns the figures
    and our sequences."""
    for m in models.values():
        m.eval()
    autocast = precision_context(precision)

    def generate(m):
        with autocast():
            return run_generate(m, batch, num_beams, new_tokens)
    fns = {name: (lambda m=m: generate(m)) for name, m in models.items()}
    outputs = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            outputs[name] = fn()
    times = {n: [] for n in fns}
    for rep in range(repeats):
        for name in alternate(list(fns), rep):
            fn = fns[name]
            t = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - t)
    n_new = batch["input_ids"].shape[0] * new_tokens
    res = {name: {"tokens_per_s": n_new / median(ts), "median_s": median(ts), "tokens_per_s_best": n_new / min(ts),
                  "seconds_all": [round(t, 4) for t in ts]} for name, ts in times.items()}
    # sanity: every system produced exactly new_tokens tokens per sentence, and how often they agree
    seqs = {name: [row[1:].tolist() for row in out] for name, out in outputs.items()}  # without the start token
    for name, sequences in seqs.items():
        assert all(len(s) == new_tokens for s in sequences), f"{name} did not produce {new_tokens} tokens"
    for name, sequences in seqs.items():
        if name != OURS:
            res[name]["same_output_as_scratch"] = share_identical(seqs[OURS], sequences)
    return res, seqs[OURS]


def ct2_worker(preset: str, seed: int, threads: int, batches_file: str, new_tokens: int, repeats: int,
               warmup: int) -> None:
    """Runs in a fresh process: CTranslate2 greedy decoding of the saved batches with our weights; prints JSON.

    Not in the benchmark process: once CTranslate2 (which bundles its own OpenMP runtime) has run in a process,
    PyTorch's small decoding ops there slow down ~3x (measured at batch 1: 682 -> 198 new tokens/s), even while
    CTranslate2 is idle, which would corrupt every other generation figure. For the same reason PyTorch runs
    single-threaded here (it only builds the weights and checks log-probs), so that only CTranslate2's own
    OpenMP threads (`threads` of them) are running while it is timed."""
    torch.set_num_threads(1)
    ours, _ = build_pair(preset, seed)
    saved = torch.load(batches_file)
    ct2 = CT2Reference(ours, threads)
    result = {"version": ct2.version, "logprob_diff": ct2.check_logits(ours, saved["check"]), "greedy": {}}
    for name, batch in saved["generation"].items():
        sequences = ct2.translate(batch, 1, new_tokens)  # compared with ours in the benchmark process
        by_threads = {}
        for n in sorted({1, threads}):  # its best setting: on a 2-vCPU machine 1 thread was ~6x faster at batch 1
            ct2.set_threads(n)
            for _ in range(warmup):
                ct2.translate(batch, 1, new_tokens)
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                ct2.translate(batch, 1, new_tokens)
                times.append(time.perf_counter() - t)
            n_new = batch["input_ids"].shape[0] * new_tokens
            by_threads[n] = {"tokens_per_s": n_new / median(times), "median_s": median(times),
                             "tokens_per_s_best": n_new / min(times), "seconds_all": [round(t, 4) for t in times]}
        best = max(by_threads, key=lambda n: by_threads[n]["tokens_per_s"])
        result["greedy"][name] = {**by_threads[best], "intra_threads": best, "sequences": sequences,
                                  "tokens_per_s_by_intra_threads": {n: r["tokens_per_s"] for n, r in by_threads.items()}}
    print("CT2_JSON " + json.dumps(result))


def measure_ct2(preset, seed, threads, gen_batches, check_batch, new_tokens, repeats, warmup) -> dict:
    with tempfile.TemporaryDirectory(prefix="ct2_batches_") as tmp:
        path = Path(tmp) / "batches.pt"
        torch.save({"generation": gen_batches, "check": check_batch}, path)
        cmd = [sys.executable, __file__, "--_ct2-worker", preset, str(seed), str(threads), str(path),
               str(new_tokens), str(repeats), str(warmup)]
        run = subprocess.run(cmd, capture_output=True, text=True)
    line = next((l for l in run.stdout.splitlines() if l.startswith("CT2_JSON ")), None)
    if line is None:
        raise RuntimeError((run.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads(line[len("CT2_JSON "):])


# ---------------------------------------------------------------------------------------------- CTranslate2
class CT2Reference:
    """Our weights in a CTranslate2 TransformerSpec, built by hf_scratch_transformer.export.ct2.build_spec
    (our sinusoid table, <s> start, (out, in) weights whatever the layers store)."""

    def __init__(self, ours, threads: int):
        import ctranslate2

        from hf_scratch_transformer.export.ct2 import build_spec  # the product's exporter, not a copy of it

        self.version = ctranslate2.__version__
        self.tokens = ["<pad>", "<s>", "</s>", "<unk>"] + [f"t{i}" for i in range(FIRST_REAL_TOKEN, VOCAB)]
        with torch.no_grad():
            spec = build_spec(ours, self.tokens)
        spec.optimize(quantization="float32")
        self.tmp = tempfile.TemporaryDirectory(prefix="ct2_bench_")
        spec.save(self.tmp.name)
        self.set_threads(threads)
        self.index = {t: i for i, t in enumerate(self.tokens)}

    def set_threads(self, threads: int) -> None:
        import ctranslate2

        self.translator = ctranslate2.Translator(
            self.tmp.name, device="cpu", compute_type="float32", intra_threads=threads, inter_threads=1
        )

    def translate(self, batch, num_beams, new_tokens):
        source = [[self.tokens[i] for i in row if i != PAD] for row in batch["input_ids"].tolist()]
        results = self.translator.translate_batch(
            source, beam_size=num_beams, max_decoding_length=new_tokens, min_decoding_length=new_tokens,
            max_batch_size=0, return_scores=False,
        )
        return [[self.index[t] for t in r.hypotheses[0]] for r in results]

    @torch.no_grad()
    def check_logits(self, ours, batch) -> float:
        """Max |log-softmax difference| of teacher-forced target scores, CT2 vs ours (eval mode)."""
        ours.eval()
        src = [[self.tokens[i] for i in row if i != PAD] for row in batch["input_ids"][:4].tolist()]
        # CT2 appends </s> to each target itself, so score the labels without their final </s>
        tgt = [[self.tokens[i] for i in row if i != -100][:-1] for row in batch["labels"][:4].tolist()]
        ct = self.translator.score_batch(src, tgt)
        out = ours(input_ids=batch["input_ids"][:4], attention_mask=batch["attention_mask"][:4],
                   labels=batch["labels"][:4])
        lp = out.logits.log_softmax(-1)
        worst = 0.0
        for i, r in enumerate(ct):
            ids = [self.index[t] for t in r.tokens]  # the target tokens + </s>, as scored by CT2
            mine = lp[i, torch.arange(len(ids)), torch.tensor(ids)]
            worst = max(worst, (mine - torch.tensor(r.log_probs)).abs().max().item())
        return worst


# ----------------------------------------------------------------------------------------------- profiling
def write_profiles(ours, cfg_name, train_batch, gen_batches, new_tokens) -> dict[str, str]:
    from torch.profiler import ProfilerActivity, profile

    files = {}
    RESULTS.mkdir(parents=True, exist_ok=True)
    model = copy.deepcopy(ours)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt, train_batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(model, opt, train_batch)
    path = RESULTS / f"profile_train_{cfg_name}.txt"
    path.write_text(
        f"torch.profiler, scratch model, one training step (fwd+bwd+AdamW), preset {cfg_name}, "
        f"batch {tuple(train_batch['input_ids'].shape)} src / {tuple(train_batch['labels'].shape)} tgt\n\n"
        + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    )
    files["train"] = path.name
    model.eval()
    for name, batch in gen_batches.items():
        run_generate(model, batch, 1, new_tokens)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            run_generate(model, batch, 1, new_tokens)
        path = RESULTS / f"profile_generate_greedy_{name}_{cfg_name}.txt"
        path.write_text(
            f"torch.profiler, scratch model, greedy generate(), preset {cfg_name}, batch "
            f"{batch['input_ids'].shape[0]}, {new_tokens} new tokens; grouped by input shape\n\n"
            + prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=40)
        )
        files[f"generate_greedy_{name}"] = path.name
    return files


# -------------------------------------------------------------------------------------------------- memory
def memory_worker(model_name, preset, task, new_tokens, seed) -> None:
    """Runs in a fresh process: build both models (same weights), keep one, run the task, print JSON.

    Peak = the kernel's resident-set high-water mark (VmHWM), reset just before the task through
    /proc/self/clear_refs so that building the models does not count. (ru_maxrss is not usable in a child of
    the big benchmark process: Linux carries it across fork+exec, so every child reported the parent's peak.)"""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))
    ours, marian = build_pair(preset, seed)
    model = ours if model_name == OURS else marian
    del ours, marian
    gc.collect()
    rng = np.random.default_rng(seed + 1)
    if task == "train":
        batches = [random_batch(rng, 64) for _ in range(3)]
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        run = lambda: [train_step(model, opt, b) for b in batches]  # noqa: E731
    else:
        _, beams, bs = task.split("_")  # e.g. generate_beam4_b32
        batch = random_batch(rng, int(bs[1:]))
        beams = 1 if beams == "greedy" else int(beams.replace("beam", ""))
        run = lambda: run_generate(model, batch, beams, new_tokens)  # noqa: E731
    gc.collect()
    setup_peak = proc_status_mib("VmHWM")
    reset = reset_peak_rss()
    before = proc_status_mib("VmRSS")
    run()
    peak = proc_status_mib("VmHWM")
    print("MEMORY_JSON " + json.dumps({"peak_rss_mib": peak, "rss_before_task_mib": before,
                                       "task_delta_mib": peak - before, "setup_peak_rss_mib": setup_peak,
                                       "peak_reset_before_task": reset}))


def proc_status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB -> MiB
    return float("nan")


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def measure_memory(model_name, preset, task, new_tokens, seed, threads) -> dict:
    cmd = [sys.executable, __file__, "--_memory-worker", model_name, preset, task, str(new_tokens), str(seed)]
    env = {**os.environ, "BENCH_THREADS": str(threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("MEMORY_JSON "))
    return json.loads(line[len("MEMORY_JSON "):])


# ------------------------------------------------------------------------------------------------- report
def ratio(a, b):
    return a / b if b else float("nan")


def targets(results) -> list[dict]:
    """Issue 43's goals against MarianMT for every precision measured (fp32 first), and memory."""
    rows = []
    for preset, figures in results["presets"].items():
        for precision in results["settings"].get("precisions", ["fp32"]):
            rows += precision_targets(f"[{preset}]" + ("" if precision == "fp32" else f" {precision}"),
                                      precision_figures(figures, precision))
        mem = figures.get("memory", {}).get("train")
        if mem:
            ours_mib, marian_mib = mem[OURS]["task_delta_mib"], mem[MARIAN]["task_delta_mib"]
            rows.append(dict(target=f"[{preset}] peak training memory <= MarianMT's",
                             value=f"{ours_mib:.0f} vs {marian_mib:.0f} MiB (task delta); peak RSS "
                                   f"{mem[OURS]['peak_rss_mib']:.0f} vs {mem[MARIAN]['peak_rss_mib']:.0f} MiB",
                             met=ours_mib <= marian_mib and mem[OURS]["peak_rss_mib"] <= mem[MARIAN]["peak_rss_mib"],
                             gap=None if ours_mib <= marian_mib else f"{(ours_mib / marian_mib - 1) * 100:.0f}% more"))
    return rows


# issue 43's goal for the default run's model FLOP utilisation, of the measured matmul peak of its precision
MFU_GOAL = 0.60


def precision_targets(label: str, figures: dict) -> list[dict]:
    """The training, MFU, greedy and CTranslate2 rows of one preset in one precision."""
    training = figures["training"]
    speedup = ratio(training[OURS]["tokens_per_s"], training[MARIAN]["tokens_per_s"])
    rows = [dict(target=f"{label} training tokens/s >= 1.3x MarianMT", value=f"{speedup:.2f}x",
                 met=speedup >= 1.3, gap=None if speedup >= 1.3 else f"{(1.3 / speedup - 1) * 100:.0f}% short")]
    mfu = training[OURS]["mfu"]
    rows.append(dict(target=f"{label} training MFU >= {MFU_GOAL:.0%} of measured matmul peak", value=f"{mfu:.0%}",
                     met=mfu >= MFU_GOAL, gap=None if mfu >= MFU_GOAL else f"{(MFU_GOAL - mfu) * 100:.0f} points short"))
    for size in ("b1", "b32"):
        greedy = figures["generation"].get(f"greedy_{size}")
        if not greedy:
            continue
        speedup = ratio(greedy[OURS]["tokens_per_s"], greedy[MARIAN]["tokens_per_s"])
        rows.append(dict(target=f"{label} greedy {size} tokens/s >= 2x MarianMT", value=f"{speedup:.2f}x",
                         met=speedup >= 2, gap=None if speedup >= 2 else f"{(2 / speedup - 1) * 100:.0f}% short"))
        if "ctranslate2" in greedy:
            ct2_ratio = ratio(greedy["ctranslate2"]["tokens_per_s"], greedy[OURS]["tokens_per_s"])
            rows.append(dict(target=f"{label} greedy {size}: CTranslate2 fp32 <= 2x our speed",
                             value=f"CT2 is {ct2_ratio:.2f}x ours", met=ct2_ratio <= 2,
                             gap=None if ct2_ratio <= 2 else f"we need {ct2_ratio / 2:.2f}x more speed"))
    return rows


def real_share(results) -> float:
    real = sum(b["src_tokens"] + b["tgt_tokens"] for b in results["train_batches"])
    padded = sum(math.prod(b["padded_shape"][0]) + math.prod(b["padded_shape"][1]) for b in results["train_batches"])
    return real / padded


def kernel_section(preset: str, figures: dict, peak_gflops: float) -> list[str]:
    """The Markdown lines of the kernel table of one preset."""
    kernels = figures["kernels"]
    lines = ["", f"## Kernels at the {preset} preset's shapes", "",
          "Decode-step projections: time of one call with W stored (out, in), as nn.Linear, against (in, out), as "
          "our `Projection` (transformers' Conv1D layout); the output projection (tied to the (V, D) embedding) "
          "as F.linear(x, W) against (W @ xᵀ)ᵀ.", "",
          "| projection | rows | (out, in), µs | (in, out), µs | speed-up |", "|---|---:|---:|---:|---:|"]
    for key, timing in kernels["decode"].items():
        name, rows = key.rsplit("_rows", 1)
        lines.append(f"| {name} | {rows} | {timing['linear_us']:.1f} | {timing['in_out_us']:.1f} | {timing['speedup']:.2f}x |")
    if "output_projection_rows" in kernels:  # results written before these two tables have neither
        lines += ["", "The output projection over a (D, V) copy of the tied embedding (`torch.mm(h, Eᵀ)` with Eᵀ "
                  f"contiguous) against F.linear(h, E), by rows; making the copy costs "
                  f"{kernels['transpose_copy_us']:,.0f} µs once:", "",
                  "| rows | F.linear, µs | mm over the copy, µs | speed-up |", "|---:|---:|---:|---:|",
                  *[f"| {rows} | {t['linear_us']:.0f} | {t['mm_copy_us']:.0f} | {t['speedup']:.2f}x |"
                    for rows, t in kernels["output_projection_rows"].items()],
                  "", "One query per row over 35 keys (a decoding step's attention): "
                  "`F.scaled_dot_product_attention` against softmax(QKᵀ·scale)·V written out:", "",
                  "| rows | SDPA, µs | written out, µs | SDPA's speed-up |", "|---:|---:|---:|---:|",
                  *[f"| {rows} | {t['sdpa_us']:.1f} | {t['written_out_us']:.1f} | {t['speedup']:.2f}x |"
                    for rows, t in kernels["one_query_attention"].items()]]
    lines += ["", f"Greedy token choice over (32, {figures['config']['vocab_size']}) scores: argmax {kernels['argmax_us']:.0f} µs, "
          f"max().indices {kernels['max_indices_us']:.0f} µs (same result: the first maximum).", "",
          f"Training matmuls alone (forward + backward, {kernels['training_tokens']:,} tokens, fp32): "
          + ", ".join(f"{shape} {gflops:.0f}" for shape, gflops in kernels["training_matmul_gflops"].items())
          + f" GFLOP/s, i.e. {min(kernels['training_matmul_gflops'].values()) / peak_gflops:.0%}-"
          f"{max(kernels['training_matmul_gflops'].values()) / peak_gflops:.0%} of the measured peak: "
          "the ceiling for MFU before softmax, norms, dropout, attention and the optimiser take their share."]
    return lines


def generation_label(key: str) -> str:
    """"greedy_b32" -> "greedy, batch 32"; "beam4_b1" -> "beam 4, batch 1"."""
    mode, size = key.split("_")
    return f"{mode.replace('beam', 'beam ')}, batch {size[1:]}"


def precision_section(results, precision: str) -> list[str]:
    """The Markdown lines of the table of another precision than fp32 (bf16 autocast): training and generation."""
    start, end = results[peak_key(precision)], results.get(peak_key(precision, at_end=True), {})
    lines = ["", f"## {precision} autocast", "",
             "The same batches and weights, every forward under `torch.autocast(\"cpu\", torch.bfloat16)` as "
             f"train.py's bf16 runs (matmuls in bf16, the loss and the optimiser in fp32). This CPU's bf16 matrix units: "
             f"{results['settings'].get('bf16_units') or 'none (bf16 is emulated)'}; bf16 is train.py's default "
             f"training precision on a CPU that has them. `translate()` and the pipeline decode in the weights' dtype (fp32 "
             f"as saved), the CLI and the demo with int8 products on a CPU with AVX-512 BF16 and no AMX: the generation "
             f"rows (autocast) say what bf16 decoding would give. Measured {precision} matmul peak (torch.mm): "
             f"**{start['peak_gflops']:.0f} GFLOP/s** ("
             + ", ".join(f"{k}: {v:.0f}" for k, v in start["gflops_by_size"].items())
             + (f"; {end['peak_gflops']:.0f} when re-measured at the end" if end else "")
             + f"). MFU uses the higher one, {results['mfu_peak_gflops_' + precision]:.0f} GFLOP/s.", "",
             "| preset | measure | scratch | MarianMT | ratio |", "|---|---|---:|---:|---:|"]
    for preset, figures in results["presets"].items():
        training, generation = figures[precision]["training"], figures[precision]["generation"]
        lines.append(f"| {preset} | training, non-pad tokens/s (src+tgt) | {training[OURS]['tokens_per_s']:,.0f} | "
                     f"{training[MARIAN]['tokens_per_s']:,.0f} | "
                     f"**{ratio(training[OURS]['tokens_per_s'], training[MARIAN]['tokens_per_s']):.2f}x** |")
        lines.append(f"| {preset} | training MFU (model GFLOP/s / {precision} peak) | "
                     f"{training[OURS]['mfu'] * 100:.1f}% ({training[OURS]['achieved_gflops']:.0f}) | "
                     f"{training[MARIAN]['mfu'] * 100:.1f}% ({training[MARIAN]['achieved_gflops']:.0f}) | |")
        for key, measured in generation.items():
            lines.append(f"| {preset} | {generation_label(key)}, new tokens/s | "
                         f"{measured[OURS]['tokens_per_s']:,.0f} | {measured[MARIAN]['tokens_per_s']:,.0f} | "
                         f"**{ratio(measured[OURS]['tokens_per_s'], measured[MARIAN]['tokens_per_s']):.2f}x** |")
    return lines


def render_markdown(results) -> str:
    machine = results["machine"]
    lines = [
        "# Speed and memory: hf_scratch_transformer vs MarianMTModel",
        "",
        f"Machine: **{machine['cpu']}**, {machine['logical_cpus']} logical CPUs, torch threads {machine['torch_threads']}, "
        f"AVX-512 {'yes' if machine['avx512f'] else 'no'}, AMX {'yes' if machine['amx'] else 'no'}; "
        f"Python {machine['python']}, torch {machine['torch']}, transformers {machine['transformers']}, "
        f"CTranslate2 {machine.get('ctranslate2') or 'not installed'}; {machine['date_utc']} UTC, commit {machine.get('git_commit', '?')}.",
        f"Mode: {'quick' if results['settings']['quick'] else 'full'}; "
        f"{results['settings']['repeats']} timed repetitions per figure (median, models alternated ABAB) after "
        f"{results['settings']['warmup']} warm-up; {results['settings']['new_tokens']} new tokens per sentence in "
        f"generation; training batches of {results['settings']['train_batch_size']} sentence pairs.",
        f"Measured fp32 matmul peak (torch.mm): **{results['matmul_peak']['peak_gflops']:.0f} GFLOP/s** "
        f"({', '.join(f'{k}: {v:.0f}' for k, v in results['matmul_peak']['gflops_by_size'].items())}; "
        f"{results['matmul_peak_at_end']['peak_gflops']:.0f} GFLOP/s when re-measured at the end: a gap means "
        f"the shared machine was busy). MFU uses the higher one, {results['mfu_peak_gflops']:.0f} GFLOP/s.",
        f"Precisions: {', '.join(results['settings'].get('precisions', ['fp32']))} (the first table is fp32). "
        f"Presets in this run: {', '.join(results['settings']['presets'])}. Training batches hold "
        f"{real_share(results):.0%} real tokens (the rest is padding); MFU counts only the real ones.",
        "",
        "| preset | measure | scratch | MarianMT | ratio | CTranslate2 fp32 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for preset, figures in results["presets"].items():
        training = figures["training"]
        lines.append(f"| {preset} | training, non-pad tokens/s (src+tgt) | {training[OURS]['tokens_per_s']:,.0f} | "
                 f"{training[MARIAN]['tokens_per_s']:,.0f} | **{ratio(training[OURS]['tokens_per_s'], training[MARIAN]['tokens_per_s']):.2f}x** | |")
        lines.append(f"| {preset} | training MFU (model GFLOP/s / peak) | {training[OURS]['mfu'] * 100:.1f}% "
                 f"({training[OURS]['achieved_gflops']:.0f}) | {training[MARIAN]['mfu'] * 100:.1f}% ({training[MARIAN]['achieved_gflops']:.0f}) | | |")
        for key, greedy in figures["generation"].items():
            ct2 = greedy.get("ctranslate2")
            ct2_cell = f"{ct2['tokens_per_s']:,.0f}" + (f" ({ct2['intra_threads']} thr)" if "intra_threads" in ct2 else "") if ct2 else ""
            lines.append(f"| {preset} | {generation_label(key)}, new tokens/s | {greedy[OURS]['tokens_per_s']:,.0f} | "
                     f"{greedy[MARIAN]['tokens_per_s']:,.0f} | **{ratio(greedy[OURS]['tokens_per_s'], greedy[MARIAN]['tokens_per_s']):.2f}x** | {ct2_cell} |")
        for task, mem in figures.get("memory", {}).items():
            lines.append(f"| {preset} | peak RSS {task}, MiB (task delta) | {mem[OURS]['peak_rss_mib']:,.0f} "
                     f"(+{mem[OURS]['task_delta_mib']:,.0f}) | {mem[MARIAN]['peak_rss_mib']:,.0f} "
                     f"(+{mem[MARIAN]['task_delta_mib']:,.0f}) | {ratio(mem[OURS]['task_delta_mib'], mem[MARIAN]['task_delta_mib']):.2f}x | |")
    for precision in results["settings"].get("precisions", ["fp32"])[1:]:
        lines += precision_section(results, precision)
    for preset, figures in results["presets"].items():
        if figures.get("kernels"):
            lines += kernel_section(preset, figures, results["mfu_peak_gflops"])
    lines += ["", "## Targets", "", "| target | measured | met | gap |", "|---|---|:-:|---|"]
    for t in results["targets"]:
        lines.append(f"| {t['target']} | {t['value']} | {'yes' if t['met'] else '**no**'} | {t['gap'] or ''} |")
    lines += [""]
    checks = []
    for preset, figures in results["presets"].items():
        check = figures["equivalence"]
        checks.append(f"{preset}: max |logit diff| scratch vs Marian {check['max_abs_logit_diff']:.1e}"
                      + (f", scratch vs CT2 max |log-prob diff| {figures['ct2_logprob_diff']:.1e}" if figures.get("ct2_logprob_diff") is not None else ""))
    lines.append("Same-function checks (identical weights): " + "; ".join(checks) + ".")
    if results.get("ct2_error"):
        lines.append(f"CTranslate2 row missing: {results['ct2_error']}")
    prof = results.get("profiles", {})
    if prof:
        lines.append("Where a target is missed, see the torch.profiler tables: "
                 + ", ".join(f"[{v}]({v})" for v in prof.values()) + ".")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------- main
def parse_arguments(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small preset, 3 repeats, short generations")
    ap.add_argument("--presets", nargs="+", default=None, help="default: small base (quick: small)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repetitions per figure (default 5, quick 3)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per sentence (default 32, quick 24)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=None,
                    help="training and generation precisions (default: fp32, and bf16 autocast where the CPU has "
                         "bf16 matrix units: train.py's default training precision there); fp32 must be among "
                         "them, the report being read against it")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-ct2", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--output", default=None, help="results JSON (default results/speed.json; with --ablate "
                                                         "results/ablation.json); the .md is written beside it")
    ap.add_argument("--render", metavar="JSON", help="only recompute MFU/targets and rewrite the .md of a results JSON")
    ap.add_argument("--ablate", action="store_true",
                    help="instead: each speed trick of our model on and off on the same batches (speed_ablation.py)")
    ap.add_argument("--_memory-worker", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--_ct2-worker", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.precisions and "fp32" not in args.precisions:
        # the report reads every other precision against the fp32 figures (its first table, the kernels, CTranslate2)
        ap.error(f"--precisions {' '.join(args.precisions)}: add fp32 (--precisions fp32 "
                 f"{' '.join(args.precisions)}): the report is read against the fp32 figures")
    if args.precisions:
        args.precisions = ["fp32"] + [p for p in dict.fromkeys(args.precisions) if p != "fp32"]
    return args


def main():
    hf_logging.set_verbosity_error()  # here, not at import: the tests import this script beside others
    args = parse_arguments()
    if args._ct2_worker:
        preset, seed, threads, path, n, reps, warm = args._ct2_worker
        ct2_worker(preset, int(seed), int(threads), path, int(n), int(reps), int(warm))
    elif args._memory_worker:
        name, preset, task, n, seed = args._memory_worker
        memory_worker(name, preset, task, int(n), int(seed))
    elif args.render:
        finish(json.loads(Path(args.render).read_text()), Path(args.render))
    elif args.ablate:
        import speed_ablation

        speed_ablation.run(args)
    else:
        compare_with_marian(args)


def compare_with_marian(args) -> None:
    """Parts 1-3 for every preset: generation, CTranslate2, profiles, kernels, training, memory."""
    torch.set_num_threads(args.threads)
    presets = args.presets or (["small"] if args.quick else ["small", "base"])
    precisions = args.precisions or (["fp32", "bf16"] if cpu_bf16_units() else ["fp32"])
    settings = dict(quick=args.quick, presets=presets, precisions=precisions, bf16_units=cpu_bf16_units(),
                    repeats=args.repeats or (3 if args.quick else 5),
                    # 3: with 1 warm-up the first figure measured (greedy, batch 1) read 0.79x Marian where 3 give
                    # 1.02x on the same machine (Intel Xeon with AMX, idle): the first calls still warm up oneDNN
                    warmup=args.warmup if args.warmup is not None else 3,
                    new_tokens=args.new_tokens or (24 if args.quick else 32), train_batch_size=64, steps_per_rep=1,
                    seed=args.seed, vocab_size=VOCAB, length_distribution="lognormal(ln 28, 0.4) clipped to [10, 60]; "
                    "target = source x U(0.8, 1.25)")
    rng = np.random.default_rng(args.seed + 1)
    train_batches = [random_batch(rng, settings["train_batch_size"]) for _ in range(max(4, settings["steps_per_rep"] * 2))]
    gen_batches = {"b1": random_batch(rng, 1), "b32": random_batch(rng, 32)}
    results = {
        "machine": machine_info(args.threads),
        "settings": settings,
        "train_batches": [dict(zip(("src_tokens", "tgt_tokens"), batch_tokens(b)),
                               padded_shape=[list(b["input_ids"].shape), list(b["labels"].shape)])
                          for b in train_batches],
        "presets": {},
    }
    print(f"machine: {results['machine']['cpu']}, threads {args.threads}", flush=True)
    for precision in precisions:
        results[peak_key(precision)] = peak = measure_matmul_peak(args.quick, precision)
        print(f"{precision} matmul peak: {peak['peak_gflops']:.0f} GFLOP/s", flush=True)
    for preset in presets:
        results["presets"][preset] = bench_preset(preset, args, settings, results, train_batches, gen_batches)
    for precision in precisions:  # drift / contention indicator
        results[peak_key(precision, at_end=True)] = measure_matmul_peak(args.quick, precision)
    results["machine"]["loadavg_at_end"] = list(os.getloadavg())
    finish(results, Path(args.output or RESULTS / "speed.json"))


def bench_preset(preset, args, settings, results, train_batches, gen_batches) -> dict:
    """Every figure of one preset (appends CTranslate2 errors and profile names to `results`)."""
    repeats, warmup, new_tokens = settings["repeats"], settings["warmup"], settings["new_tokens"]
    ours, marian = build_pair(preset, args.seed)
    cfg = ours.config
    figures = {
        "config": {k: getattr(cfg, k) for k in ("d_model", "encoder_layers", "decoder_layers",
                                                "encoder_attention_heads", "encoder_ffn_dim", "vocab_size", "dropout")},
        "parameters": sum(p.numel() for p in ours.parameters()),
        "parameters_marian": sum(p.numel() for p in marian.parameters()),
        "matmul_params_per_token": matmul_weights_per_token(cfg),
        "equivalence": equivalence_check(ours, marian, train_batches[0]),
    }
    print(f"[{preset}] params {figures['parameters']:,}; equivalence {figures['equivalence']}", flush=True)
    # 2. generation (before training changes the weights; both hold the same weights anyway)
    our_sequences = {}
    for precision in settings["precisions"]:
        generation = precision_figures(figures, precision).setdefault("generation", {})
        for mode, beams in (("greedy", 1), ("beam4", 4)):
            for size, batch in gen_batches.items():
                measured, sequences = bench_generation(
                    {OURS: ours, MARIAN: marian}, batch, beams, new_tokens, repeats, warmup, precision)
                generation[f"{mode}_{size}"] = measured
                if precision == "fp32":
                    our_sequences[f"{mode}_{size}"] = sequences
                print(f"[{preset}] {precision} {mode} {size}: "
                      + ", ".join(f"{k} {v['tokens_per_s']:.0f} tok/s" for k, v in measured.items()), flush=True)
    if not args.no_ct2:  # in its own process (see ct2_worker), same weights and batches
        add_ct2_figures(preset, args, settings, results, figures, our_sequences, gen_batches, train_batches[0])
    if not args.no_profile and preset == settings["presets"][0]:
        results.setdefault("profiles", {}).update(
            {f"{preset}_{k}": v for k, v in write_profiles(ours, preset, train_batches[0], gen_batches,
                                                           new_tokens).items()})
    figures["kernels"] = measure_kernels(cfg)
    # 1. training throughput, each precision from the same weights
    figures["training_flops_per_batch"] = [batch_flops(cfg, b) for b in train_batches]
    for precision in settings["precisions"]:
        models = {OURS: copy.deepcopy(ours), MARIAN: copy.deepcopy(marian)}
        training = bench_training(models, cfg, train_batches, repeats, warmup, settings["steps_per_rep"], precision)
        precision_figures(figures, precision)["training"] = training
        print(f"[{preset}] {precision} training: " + ", ".join(
            f"{k} {v['tokens_per_s']:.0f} tok/s {v['achieved_gflops']:.0f} GFLOP/s" for k, v in training.items()),
            flush=True)
        del models
    del ours, marian
    gc.collect()
    # 3. memory, one fresh process per (model, task)
    if not args.no_memory:
        figures["memory"] = {}
        for task in ("train", "generate_beam4_b32"):
            figures["memory"][task] = {name: measure_memory(name, preset, task, new_tokens, args.seed, args.threads)
                                       for name in (OURS, MARIAN)}
            print(f"[{preset}] memory {task}: {figures['memory'][task]}", flush=True)
    return figures


def precision_figures(figures: dict, precision: str) -> dict:
    """Where a precision's training and generation figures go: the preset's own entries for fp32 (the layout of
    earlier results files), figures["bf16"] for bf16."""
    return figures if precision == "fp32" else figures.setdefault(precision, {})


def add_ct2_figures(preset, args, settings, results, figures, our_sequences, gen_batches, check_batch) -> None:
    """CTranslate2's greedy rows (or the reason they are missing, in results["ct2_error"])."""
    try:
        ct2 = measure_ct2(preset, args.seed, args.threads, gen_batches, check_batch, settings["new_tokens"],
                          settings["repeats"], settings["warmup"])
    except Exception as exc:  # reported in the results, never faked
        results["ct2_error"] = f"{type(exc).__name__}: {exc}"
        print("CTranslate2 unavailable:", results["ct2_error"], flush=True)
        return
    figures["ct2_logprob_diff"] = ct2["logprob_diff"]
    results["machine"]["ctranslate2"] = ct2["version"]
    for size, measured in ct2["greedy"].items():
        sequences = measured.pop("sequences")
        measured["same_output_as_scratch"] = share_identical(our_sequences[f"greedy_{size}"], sequences)
        figures["generation"][f"greedy_{size}"]["ctranslate2"] = measured
        print(f"[{preset}] greedy {size}: ctranslate2 {measured['tokens_per_s']:.0f} tok/s "
              f"({measured['intra_threads']} intra-op threads)", flush=True)


def finish(results: dict, out: Path) -> None:
    """MFU of each precision against the higher of its two peak measurements (a busy machine only lowers the
    measured peak, and a lower peak would flatter the MFU), the target check, then speed.json and speed.md."""
    for precision in results["settings"].get("precisions", ["fp32"]):
        peak = max(results[peak_key(precision)]["peak_gflops"],
                   results.get(peak_key(precision, at_end=True), {}).get("peak_gflops", 0))
        results["mfu_peak_gflops" + ("" if precision == "fp32" else f"_{precision}")] = peak
        for figures in results["presets"].values():
            for v in precision_figures(figures, precision)["training"].values():
                v["mfu"] = v["achieved_gflops"] / peak
    results["targets"] = targets(results)
    md = render_markdown(results)
    write_results(results, out, md)
    print(md)


if __name__ == "__main__":
    main()
