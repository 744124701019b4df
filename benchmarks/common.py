"""What the benchmark scripts share: synthetic batches and train.py's batches, the model pair (ours and a MarianMT of
the same sizes holding the same weights), the equivalence check, model FLOPs of a training batch (the package's
`training.flops`), train.py's autocast for a precision, fixed-length generation, timing helpers (medians, ABAB
alternation, paired ratios), machine information and the writing of results (JSON + Markdown).

The scripts run as `python benchmarks/<script>.py`, which puts this folder on `sys.path`, so they `import common`;
importing it also puts the repository root on `sys.path`, so this checkout's package is used, installed or not.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402
from transformers import GenerationConfig, MarianConfig, MarianMTModel  # noqa: E402

from hf_scratch_transformer.configuration_scratch_transformer import ScratchTransformerConfig  # noqa: E402
from hf_scratch_transformer.cpu_threads import cpu_model_and_flags  # noqa: E402
from hf_scratch_transformer.modeling_scratch_transformer import ScratchTransformerForConditionalGeneration
from hf_scratch_transformer.training.flops import tokens_and_flops  # noqa: E402  (the package's, one formula)
from hf_scratch_transformer.training.loop import mixed_precision_autocast  # noqa: E402  (train.py's autocast)

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 8000
PAD, BOS, EOS = 0, 1, 2
FIRST_REAL_TOKEN = 4  # 0 pad, 1 <s>, 2 </s>, 3 <unk>
OURS, MARIAN = "scratch", "marian"


# ----------------------------------------------------------------------------------------------------- batches
def sentence_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    """Subword lengths of n sentences: a log-normal with mean ~30 and median ~28, clipped to 10..60 tokens
    (roughly what a 8k BPE gives on Bible / news sentences)."""
    return np.clip(np.round(rng.lognormal(mean=math.log(28.0), sigma=0.4, size=n)), 10, 60).astype(int)


def batch_of_lengths(rng: np.random.Generator, source_lengths: np.ndarray, vocab_size: int = VOCAB,
                     target_range: tuple[int, int] = (10, 60)) -> dict:
    """Random ids, right-padded, for sources of the given lengths; target length ~ source length x U(0.8, 1.25)
    (clipped to `target_range`); both sides end in </s>. Returns input_ids / attention_mask (B, S) and labels (B, T) with
    -100 on padding: the collator's format."""
    batch_size = len(source_lengths)
    target_lengths = np.round(source_lengths * rng.uniform(0.8, 1.25, batch_size))
    target_lengths = np.clip(target_lengths, *target_range).astype(int)
    input_ids = torch.full((batch_size, int(source_lengths.max())), PAD, dtype=torch.long)
    labels = torch.full((batch_size, int(target_lengths.max())), -100, dtype=torch.long)
    for row, (source, target) in enumerate(zip(source_lengths, target_lengths)):
        input_ids[row, : source - 1] = torch.from_numpy(rng.integers(FIRST_REAL_TOKEN, vocab_size, source - 1))
        input_ids[row, source - 1] = EOS
        labels[row, : target - 1] = torch.from_numpy(rng.integers(FIRST_REAL_TOKEN, vocab_size, target - 1))
        labels[row, target - 1] = EOS
    return {"input_ids": input_ids, "attention_mask": (input_ids != PAD).long(), "labels": labels}


def random_batch(rng: np.random.Generator, batch_size: int, vocab_size: int = VOCAB) -> dict[str, torch.Tensor]:
    """`batch_size` sentence pairs of random lengths (`sentence_lengths`): about half the positions are padding."""
    return batch_of_lengths(rng, sentence_lengths(rng, batch_size), vocab_size)


def batch_tokens(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(non-pad source tokens, non-pad target tokens)."""
    return int(batch["attention_mask"].sum()), int((batch["labels"] != -100).sum())


def padding_share(batches) -> float:
    """Share of padding among all source and label positions of the batches."""
    real = sum(sum(batch_tokens(b)) for b in batches)
    total = sum(b["input_ids"].numel() + b["labels"].numel() for b in batches)
    return 1 - real / total


def train_py_batches(count: int, max_tokens: int = 2048, vocab_size: int = VOCAB, max_train_samples: int | None = None,
                     spread: bool = False, seed: int = 42) -> tuple[list[dict], int, int]:
    """`count` training batches as train.py forms them: the shipped corpus (its first `max_train_samples` training
    pairs), the joint BPE tokenizer trained on them, train.py's filters, shuffled token buckets of `max_tokens`.
    The first `count` batches of the epoch, or with `spread` batches spaced evenly over it (short and long
    sentences alike). Returns the batches (input_ids, attention_mask, labels), the tokenizer's size and the number
    of batches in the epoch."""
    from hf_scratch_transformer.data.loading import DataArguments, load_parallel_corpus
    from hf_scratch_transformer.data.batching import make_batch_sampler
    from hf_scratch_transformer.data.preprocessing import make_collator, preprocess_corpus
    from hf_scratch_transformer.data.tokenization import train_tokenizer_on_corpus

    data_args = DataArguments(max_tokens=max_tokens, tokenizer_vocab_size=vocab_size,
                              max_train_samples=max_train_samples)
    raw = load_parallel_corpus(data_args)
    tokenizer = train_tokenizer_on_corpus(raw["train"], data_args.source_lang, data_args.target_lang,
                                          vocab_size=vocab_size)
    train = preprocess_corpus({"train": raw["train"]}, tokenizer, data_args)[0]["train"]
    epoch = list(make_batch_sampler(train, data_args, batch_size=64, shuffle=True, seed=seed))
    every = max(1, len(epoch) // count) if spread else 1
    collate = make_collator(tokenizer)
    batches = [collate([train[i] for i in indices]) for indices in epoch[: every * count : every]]
    keys = ("input_ids", "attention_mask", "labels")
    return [{key: batch[key] for key in keys} for batch in batches], len(tokenizer), len(epoch)


# -------------------------------------------------------------------------------------------------- the models
def our_config(preset: str, vocab_size: int = VOCAB, **overrides) -> ScratchTransformerConfig:
    """The benchmarks' configuration: the preset's sizes, dropout 0.1 on the residual paths only."""
    settings = dict(vocab_size=vocab_size, dropout=0.1, attention_dropout=0.0, activation_dropout=0.0)
    return ScratchTransformerConfig.from_preset(preset, **{**settings, **overrides})


def marian_config(cfg: ScratchTransformerConfig) -> MarianConfig:
    """A MarianConfig with the sizes and options of our config: same width, depths, heads, FFN, vocabulary, ReLU,
    √d_model embedding scale, shared + tied embeddings, dropouts, post-norm, same special tokens."""
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


def build_pair(preset: str, seed: int = 0, vocab_size: int = VOCAB, marian_init: str = "copy"):
    """Our model (random init, seeded) and a MarianMTModel of identical sizes; with marian_init="copy" (default)
    Marian holds our weights, with "native" its own initialisation from the same seed."""
    torch.manual_seed(seed)
    cfg = our_config(preset, vocab_size)
    ours = ScratchTransformerForConditionalGeneration(cfg)
    torch.manual_seed(seed)
    marian = MarianMTModel(marian_config(cfg))
    if marian_init == "copy":
        copy_weights_to_marian(ours, marian)
    return ours, marian


@torch.no_grad()
def copy_weights_to_marian(ours, marian) -> None:
    """Copy every weight (same names, (out, in) linear weights in both); copy our interleaved sinusoid table into
    Marian's position embedding so the two compute the same function."""
    o, m = ours.model, marian.model
    m.shared.weight.copy_(o.shared.weight)
    assert marian.lm_head.weight.data_ptr() == m.shared.weight.data_ptr(), "Marian lm_head is not tied"
    for stack_o, stack_m in ((o.encoder, m.encoder), (o.decoder, m.decoder)):
        stack_m.embed_positions.weight.copy_(stack_o.embed_positions.pe[: stack_m.embed_positions.weight.shape[0]])

    def copy(dst, src):  # linear layers and LayerNorms
        dst.weight.copy_(src.weight)
        dst.bias.copy_(src.bias)

    def attention(dst, src):
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            copy(getattr(dst, name), getattr(src, name))

    def common_parts(ours_layer, marian_layer):
        attention(marian_layer.self_attn, ours_layer.self_attn)
        copy(marian_layer.self_attn_layer_norm, ours_layer.self_attn_layer_norm)
        copy(marian_layer.fc1, ours_layer.feed_forward.fc1)
        copy(marian_layer.fc2, ours_layer.feed_forward.fc2)
        copy(marian_layer.final_layer_norm, ours_layer.final_layer_norm)

    for ours_layer, marian_layer in zip(o.encoder.layers, m.encoder.layers):
        common_parts(ours_layer, marian_layer)
    for ours_layer, marian_layer in zip(o.decoder.layers, m.decoder.layers):
        common_parts(ours_layer, marian_layer)
        attention(marian_layer.encoder_attn, ours_layer.cross_attn)
        copy(marian_layer.encoder_attn_layer_norm, ours_layer.cross_attn_layer_norm)
    marian.final_logits_bias.zero_()


@torch.no_grad()
def equivalence_check(ours, marian, batch) -> dict:
    """Max |logit difference| over the scored positions of `batch` (eval mode) and both losses."""
    ours.eval(), marian.eval()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    ours_out, marian_out = ours(**inputs), marian(**inputs)
    scored = batch["labels"] != -100
    diff = (ours_out.logits - marian_out.logits)[scored].abs().max().item()
    return {"max_abs_logit_diff": diff, "loss_ours": ours_out.loss.item(), "loss_marian": marian_out.loss.item()}


# -------------------------------------------------------------------------------------------------- generation
def fixed_length_generation_config(num_beams: int, new_tokens: int) -> GenerationConfig:
    """Exactly `new_tokens` new tokens per sentence whatever the weights (min = max), greedy or beam search."""
    return GenerationConfig(
        decoder_start_token_id=BOS, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
        num_beams=num_beams, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        early_stopping=True if num_beams > 1 else False, use_cache=True,
    )


@torch.inference_mode()
def run_generate(model, batch, num_beams: int, new_tokens: int) -> torch.Tensor:
    return model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          generation_config=fixed_length_generation_config(num_beams, new_tokens))


def batch_flops(cfg, batch) -> float:
    """Model FLOPs of one training forward + backward on `batch` (hf_scratch_transformer.training.flops)."""
    return tokens_and_flops(cfg, batch)[1]


def precision_context(precision: str):
    """A factory of the context a forward runs in at `precision` ("fp32" or "bf16"), as train.py's loop makes it."""
    return mixed_precision_autocast(precision, torch.device("cpu"))


# ------------------------------------------------------------------------------------------------------ timing
def median(values) -> float:
    return float(statistics.median(values))


def decoding_benchmark_parser(doc: str, batch_sizes: list[int], output_name: str):
    """The arguments the decoding benchmarks share (preset, batch sizes, beams, new tokens, alternated rounds,
    threads, seed, note, results file); a script adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=batch_sizes)
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8, help="timed calls of each variant (alternated)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--output", default=str(RESULTS / output_name))
    return parser


def alternate(names: list, repeat: int) -> list:
    """ABAB order: the names as given on even repetitions, reversed on odd ones."""
    return names if repeat % 2 == 0 else names[::-1]


def time_call(function, repeats: int = 50, warmup: int = 5) -> float:
    """Median seconds of function() after warm-up."""
    for _ in range(warmup):
        function()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - start)
    return median(seconds)


def time_alternating(functions: dict, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of every call of each function, run in ABAB order after `warmup` calls each."""
    for function in functions.values():
        for _ in range(warmup):
            function()
    seconds = {name: [] for name in functions}
    for repeat in range(repeats):
        for name in alternate(list(functions), repeat):
            start = time.perf_counter()
            functions[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def paired_ratios(seconds: dict[str, list[float]], slow: str, fast: str) -> list[float]:
    """Per-repetition ratio seconds[slow] / seconds[fast]: the two runs of a repetition are adjacent in time, so
    their ratio cancels most of the load that other jobs put on a shared machine."""
    return [a / b for a, b in zip(seconds[slow], seconds[fast])]


# ----------------------------------------------------------------------------------------------------- machine
def loadavg() -> list[float]:
    """1, 5 and 15-minute load averages (empty where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def git_commit() -> str | None:
    """The checkout's short commit, marked "+changes" when the package or the benchmarks differ from it."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "hf_scratch_transformer", "benchmarks"],
                               cwd=ROOT, capture_output=True).returncode == 1
        return (out.stdout.strip() + ("+changes" if dirty else "")) or None
    except OSError:
        return None


def package_version(name: str) -> str | None:
    """Installed version without importing the package (importing ctranslate2 loads its OpenMP runtime)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine_info(threads: int) -> dict:
    """CPU model, cores, torch threads, instruction sets, versions, date, commit and load average."""
    cpu, flags = cpu_model_and_flags()
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": threads,
        "avx512f": "avx512f" in flags, "amx": "amx_tile" in flags,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ctranslate2": package_version("ctranslate2"),
        "platform": platform.platform(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "git_commit": git_commit(),
        "loadavg": loadavg(),
    }


def machine_line(machine: dict) -> str:
    """One Markdown sentence describing the machine of a results file."""
    return (f"Machine: **{machine['cpu']}**, {machine['logical_cpus']} logical CPUs, torch threads "
            f"{machine['torch_threads']}; Python {machine['python']}, torch {machine['torch']}, transformers "
            f"{machine['transformers']}; {machine['date_utc']} UTC, commit {machine.get('git_commit') or '?'}.")


# ----------------------------------------------------------------------------------------------------- results
def write_results(results: dict, json_path: Path, markdown: str) -> None:
    """`results` as indented JSON at json_path and `markdown` beside it (same name, .md)."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    json_path.with_suffix(".md").write_text(markdown)
