"""The training loss: label-smoothed cross-entropy (paper §5.4) over the model's logits, without an fp32 copy of them.

The model's own loss (`ScratchTransformerForConditionalGeneration.forward(labels=...)`) is `F.cross_entropy` on the
logits cast to fp32: under bf16 autocast that makes four (tokens, vocabulary) fp32 tensors a step, about 65 MB each
at 2,048-token batches (the cast, the log-softmax, the gradient of the log-probabilities and of the logits) and a
bf16 copy of the gradient. On glibc's malloc each of them is a fresh mmap that the kernel faults in and zeroes.
`label_smoothed_cross_entropy` gives the same value and gradient from the logits in their own dtype, a chunk of rows
at a time in fp32 (on a CPU, chunks that fit a core's cache), and makes one (tokens, vocabulary) tensor a step: the
gradient, in the logits' dtype.
"""

import torch

CPU_CHUNK_ELEMENTS = 2**19  # logits taken to fp32 at once on a CPU: 2 MB, about a core's L2 cache (64 rows of 8,000)
IGNORE_INDEX = -100  # label of positions without a target (padding), as transformers' losses


def chunk_rows(logits: torch.Tensor) -> int:
    """Rows of (N, V) logits taken at once: a cache-sized chunk on a CPU, all of them elsewhere (a GPU: one kernel
    launch per operation, not one per chunk)."""
    return max(1, CPU_CHUNK_ELEMENTS // logits.shape[1]) if logits.is_cpu else max(1, len(logits))


class LabelSmoothedCrossEntropy(torch.autograd.Function):
    """Mean over non-ignored rows of (1 - ε)·(-log p_label) + ε·mean over the vocabulary of (-log p): torch's
    `F.cross_entropy(logits.float(), labels, ignore_index=-100, label_smoothing=ε)`.

    Forward: each chunk of rows log-softmaxed in fp32. Backward: the gradient with respect to the logits,
    softmax(z) - (1 - ε)·onehot(label) - ε / V, recomputed chunk by chunk from the saved logits rather than kept
    from the forward as a (N, V) tensor, so that gradient scaling (accumulation, fp16's loss scale) applies in fp32
    before the cast to the logits' dtype."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> torch.Tensor:
        """logits (N, V) in any float dtype, labels (N,) with IGNORE_INDEX where there is no target: a scalar, fp32."""
        kept = labels != IGNORE_INDEX
        targets = labels.clamp(min=0).unsqueeze(1)  # (N, 1); ignored rows point anywhere, their weight is 0
        row_weights = kept.float() / kept.sum().clamp(min=1)  # (N,): 1/count on kept rows
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        rows = chunk_rows(logits)
        for start in range(0, len(logits), rows):
            chunk = slice(start, start + rows)
            log_probabilities = torch.log_softmax(logits[chunk].float(), dim=-1)
            row_loss = (-(1 - smoothing) * log_probabilities.gather(1, targets[chunk]).squeeze(1)
                        - smoothing * log_probabilities.mean(dim=-1))
            total += (row_loss * row_weights[chunk]).sum()
        ctx.save_for_backward(logits, targets, row_weights)
        ctx.smoothing = smoothing
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        logits, targets, row_weights = ctx.saved_tensors
        smoothing, vocabulary = ctx.smoothing, logits.shape[1]
        scales = (row_weights * grad_output).unsqueeze(1)  # (N, 1)
        grad = torch.empty_like(logits)
        rows = chunk_rows(logits)
        for start in range(0, len(logits), rows):
            chunk = slice(start, start + rows)
            probabilities = torch.softmax(logits[chunk].float(), dim=-1).sub_(smoothing / vocabulary)
            probabilities.scatter_add_(
                1, targets[chunk], torch.full(targets[chunk].shape, smoothing - 1.0, device=logits.device))
            grad[chunk] = probabilities.mul_(scales[chunk])
        return grad, None, None


def label_smoothed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> torch.Tensor:
    """The mean label-smoothed cross-entropy of logits (..., V) against labels (...) (IGNORE_INDEX: no target), fp32;
    0 when no position has a target."""
    return LabelSmoothedCrossEntropy.apply(logits.flatten(0, -2), labels.flatten(), smoothing)


def teacher_forced_loss(model, batch: dict, smoothing: float) -> torch.Tensor:
    """The training loss of a batch (`input_ids`, `attention_mask`, `labels`, each (B, length)): the decoder reads
    the labels shifted right, and its logits at the positions with a label (`logits_mask`: the output projection
    skips the padding) are scored against them."""
    labels = batch["labels"]
    scored = labels != IGNORE_INDEX  # (B, T)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   decoder_input_ids=shift_right(model, labels), use_cache=False, logits_mask=scored).logits
    return label_smoothed_cross_entropy(logits, labels[scored], smoothing)


def shift_right(model, labels: torch.Tensor) -> torch.Tensor:
    """The decoder input of teacher forcing: the model's own shift (through a DDP wrapper too)."""
    return getattr(model, "module", model).prepare_decoder_input_ids_from_labels(labels)
