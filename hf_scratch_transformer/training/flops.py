"""Model FLOPs of a training batch, the device's measured matrix-multiply peak, and the model-FLOPs utilisation (MFU)
of a run: the share of what the device's matmuls can do that the model's useful arithmetic used.

Model FLOPs count the multiply-adds a Transformer needs for the real (non-padding) tokens of a batch, 2 FLOPs each,
forward and backward (docs/training.md, "FLOPs and MFU"): every weight matrix a token goes through (lm_head included,
embedding lookups, biases, norms, softmax and the optimiser not), and attention's two products per query-key pair
that the masks keep. The peak is what `torch.mm` reaches on large square matrices in the dtype the run's matmuls use
(bf16 autocast runs them in bf16), on a CPU at the most threads the run may use. A run measures it at its start and,
for a share of its training time, again at its end, and takes the higher: on a shared virtual machine one second's
measurement can be half or twice another's (docs/training.md, "FLOPs and MFU").

    flops = training_flops(model.config, source_lengths, target_lengths)      # one batch
    peak = matmul_peak_flops(torch.bfloat16, torch.device("cpu"))             # FLOP/s, about a second
"""

import statistics
import time
from collections.abc import Sequence

import torch

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
START_PEAK_SECONDS = 1.0  # the matmul peak's measurement before training
END_PEAK_SECONDS, END_PEAK_SHARE, END_PEAK_MIN_SECONDS = 2.0, 0.01, 0.25  # after: 1 % of the training time, 0.25-2 s
TRAINING_MULTIPLIER = 3  # forward + backward: the backward takes two products (input and weight gradients) per one


def matmul_weights_per_token(config) -> dict[str, int]:
    """Weights that a token multiplies (biases, norms and embedding lookups excluded), by kind of token:
    each encoder layer's Q, K, V, output and FFN weights for a source token, plus the decoder layers' cross-attention
    K and V projections of it; each decoder layer's self Q, K, V, output, cross Q and output and FFN weights for a
    target token, plus the output projection (lm_head, tied to the embedding or not)."""
    width, vocab = config.d_model, config.vocab_size
    return {
        "encoder_per_source_token": config.encoder_layers * (4 * width * width + 2 * width * config.encoder_ffn_dim),
        "cross_key_value_per_source_token": config.decoder_layers * 2 * width * width,
        "decoder_per_target_token": (config.decoder_layers * (6 * width * width + 2 * width * config.decoder_ffn_dim)
                                     + width * vocab),
    }


def forward_flops(config, source_lengths: Sequence[int] | torch.Tensor,
                  target_lengths: Sequence[int] | torch.Tensor) -> float:
    """Model FLOPs of one forward over sentence pairs of these real lengths (S_i source, T_i target tokens):
    2 x weights x tokens, and 4 x d_model FLOPs per query-key pair and layer (QK^T and AV): S_i^2 in the encoder,
    T_i (T_i + 1) / 2 in the decoder's causal self-attention, S_i T_i in cross-attention."""
    source = torch.as_tensor(source_lengths, dtype=torch.float64)
    target = torch.as_tensor(target_lengths, dtype=torch.float64)
    weights = matmul_weights_per_token(config)
    dense = 2 * (source.sum() * (weights["encoder_per_source_token"] + weights["cross_key_value_per_source_token"])
                 + target.sum() * weights["decoder_per_target_token"])
    pairs = (config.encoder_layers * (source * source).sum()
             + config.decoder_layers * ((target * (target + 1) / 2).sum() + (source * target).sum()))
    return float(dense + 4 * config.d_model * pairs)


def training_flops(config, source_lengths: Sequence[int] | torch.Tensor,
                   target_lengths: Sequence[int] | torch.Tensor) -> float:
    """Model FLOPs of one training forward + backward over sentence pairs of these real lengths."""
    return TRAINING_MULTIPLIER * forward_flops(config, source_lengths, target_lengths)


def tokens_and_flops(config, batch: dict) -> tuple[int, float]:
    """(non-padding source + target tokens, `training_flops`) of a collated batch (input_ids / attention_mask (B, S),
    labels (B, T) with -100 on padding), from its real lengths. Call it on a batch still on the host: it reads the
    lengths, which on a GPU would wait for the device."""
    source_lengths, target_lengths = batch["attention_mask"].sum(1), (batch["labels"] != -100).sum(1)
    return int(source_lengths.sum() + target_lengths.sum()), training_flops(config, source_lengths, target_lengths)


# --------------------------------------------------------------------------------------------- the matmul peak


def square_operands(size: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """(left, right, out): two random (size, size) matrices in `dtype` on `device` and the product's buffer."""
    generator = torch.Generator(device=device).manual_seed(0)
    left = torch.randn(size, size, generator=generator, device=device).to(dtype)
    right = torch.randn(size, size, generator=generator, device=device).to(dtype)
    return left, right, torch.empty(size, size, dtype=dtype, device=device)


def timed_matmul(operands: tuple[torch.Tensor, ...]) -> float:
    """FLOP/s of one `torch.mm` of `square_operands` at torch's current thread count (the device waited for)."""
    left, right, out = operands
    _synchronize(left.device)
    started = time.perf_counter()
    torch.mm(left, right, out=out)
    _synchronize(left.device)
    return 2 * left.shape[0] ** 3 / (time.perf_counter() - started)


def matmul_flops(size: int, dtype: torch.dtype, device: torch.device | str = "cpu", seconds: float = 0.3,
                 min_repeats: int = 3, max_repeats: int = 100) -> list[float]:
    """FLOP/s of each timed `torch.mm` of two (size, size) matrices in `dtype` on `device` at torch's current thread
    count, after one untimed product: at least `min_repeats` products, more while `seconds` last."""
    operands = square_operands(size, dtype, device)
    timed_matmul(operands)
    rates, deadline = [], time.perf_counter() + seconds
    while len(rates) < min_repeats or (time.perf_counter() < deadline and len(rates) < max_repeats):
        rates.append(timed_matmul(operands))
    return rates


def matmul_peak_flops(dtype: torch.dtype, device: torch.device | str = "cpu", seconds: float = 1.0,
                      sizes: Sequence[int] = (1024, 2048, 4096, 8192)) -> float:
    """The device's matmul peak in FLOP/s, in about `seconds`: the median rate of square `torch.mm` at each size in
    turn (a third of the time left each), the best of them. It stops before a size whose untimed and three timed
    products (4 x 8 times the last product's time) would not fit in the time left, and after the last size."""
    best, deadline = 0.0, time.perf_counter() + seconds
    for size in sizes:
        rates = matmul_flops(size, dtype, device, seconds=max(deadline - time.perf_counter(), 0.0) / 3)
        rate = statistics.median(rates)
        best = max(best, rate)
        if 4 * 8 * (2 * size ** 3 / rate) > deadline - time.perf_counter():
            break
    return best


def end_peak_seconds(train_seconds: float) -> float:
    """How long the run's second matmul peak measurement takes after `train_seconds` of training: 1 % of them, at
    most 2 s; 0 (none) under 0.25 s, so that a short run (a test's) ends without one."""
    seconds = min(END_PEAK_SECONDS, END_PEAK_SHARE * train_seconds)
    return seconds if seconds >= END_PEAK_MIN_SECONDS else 0.0


def run_matmul_peak(accelerator, precision: str, threads, seconds: float = START_PEAK_SECONDS) -> float:
    """The matmul peak of a run, in FLOP/s: `matmul_peak_flops` in the dtype of its matmuls (its precision "fp32",
    "bf16" or "fp16") in about `seconds`, measured by every process at once on its own device (processes sharing a
    CPU share it as in training) and summed. On a CPU at the most threads the run may use (`threads`, a
    cpu_threads.ThreadTuner: its pinned count, else the cores available to the process); torch's thread count is
    given back after."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads.fixed or threads.max_threads)
    try:
        peak = matmul_peak_flops(PRECISION_DTYPES[precision], accelerator.device, seconds=seconds)
    finally:
        torch.set_num_threads(previous)
    return float(accelerator.reduce(torch.tensor(peak, device=accelerator.device), "sum"))


def training_throughput(state, peaks: Sequence[float]) -> dict:
    """train_results.json's speed figures from a RunState: tokens, tokens/s, model FLOP/s (over the same training
    seconds), the matmul peak (the highest of the run's measurements `peaks`, each listed) and the MFU (FLOP/s /
    peak). FLOP/s and MFU are None when the FLOPs are unknown (a run resumed from a checkpoint written before they
    were counted)."""
    seconds = max(state.train_seconds, 1e-9)
    peak_flops = max(peaks) if peaks else None
    rate = None if state.train_flops is None else state.train_flops / seconds
    return {"train_tokens": state.train_tokens, "train_tokens_per_second": round(state.train_tokens / seconds, 1),
            "train_flops_per_second": None if rate is None else float(f"{rate:.4g}"),
            "train_matmul_peak_flops": None if peak_flops is None else float(f"{peak_flops:.4g}"),
            "train_matmul_peak_flops_measured": [float(f"{peak:.4g}") for peak in peaks],
            "train_mfu": None if rate is None or not peak_flops else float(f"{rate / peak_flops:.4g}")}


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
