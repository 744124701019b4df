"""train.py's loop in bf16 on a CPU with attention written out (bf16 products, the softmax in fp32) against what the
model does, torch's sdpa kernel in fp32, alternated (issue: speed to the CPU's limit). Tried, not adopted.

    python benchmarks/training_attention.py                     # 3 rounds, 2 threads
    python benchmarks/training_attention.py --cpu_threads 1 --note "one core busy"

`sdpa kernel in fp32` is the model as it is: training in bf16 on a CPU, `MultiHeadAttention` casts query, key and
value to fp32 and calls torch's scaled_dot_product_attention with autocast paused (its CPU kernel runs the backward
5-6x slower in bf16: `attention_bf16_cpu.py`). `written out, bf16 products` puts `written_out_forward` in its place
for a run: the model's `eager_attention_forward` under autocast (the products in bf16, the softmax in fp32), with
sdpa's masks made additive (`additive_mask`, the causal one included where sdpa passes none). A bare step on random
batches ran 1.18x faster this way; train.py's loop did not (results). The runs, their timing and their figures are
`train_py_variants.py`'s. On a CPU without bf16 units train.py trains in fp32, where neither variant applies: give
`--bf16 true` there. Results: `benchmarks/results/training_attention.json` and `.md` (machine, load, commit).
"""

from contextlib import contextmanager, nullcontext

import torch

import train_py_variants
from common import RESULTS

from hf_scratch_transformer.modeling_scratch_transformer import MultiHeadAttention, eager_attention_forward


def additive_mask(sdpa_mask: torch.Tensor | None, is_causal: bool, query: torch.Tensor,
                  key: torch.Tensor) -> torch.Tensor | None:
    """An "sdpa" mask as `eager_attention_forward` takes it: (B or 1, 1, T, K) to add to the scores, fp32.

    sdpa's masks are boolean (True: may attend) or already additive; None means no mask, or, for a causal attention
    over several queries, the causal mask sdpa's kernel applies itself (`is_causal`: query i sees keys 0 to i)."""
    if sdpa_mask is None:
        queries, keys = query.shape[-2], key.shape[-2]
        if not (is_causal and queries > 1):
            return None
        sdpa_mask = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril()[None, None]
    if sdpa_mask.dtype != torch.bool:
        return sdpa_mask
    lowest = torch.finfo(torch.float32).min
    return torch.zeros(sdpa_mask.shape, device=query.device).masked_fill_(~sdpa_mask, lowest)


def bf16_cpu_training(module: MultiHeadAttention, hidden_states: torch.Tensor, cache) -> bool:
    return (module.config._attn_implementation == "sdpa" and hidden_states.is_cpu and torch.is_grad_enabled()
            and cache is None and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16)


def written_out_forward(original):
    """`MultiHeadAttention.forward`, its bf16 training on a CPU written out (everything else: `original`)."""
    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, cache=None, positions=None,
                encoder_positions=None, **kwargs):
        if not bf16_cpu_training(self, hidden_states, cache):
            return original(self, hidden_states, attention_mask, encoder_hidden_states, cache, positions,
                            encoder_positions, **kwargs)
        # A training batch that skips its padding gives (N, D) rows at `positions`: laid out as (B, L, D) again, as
        # the model's own forward does.
        keys_from = encoder_hidden_states if self.is_cross_attention else hidden_states  # (B, S or T, D) or rows
        key_positions = encoder_positions if self.is_cross_attention else positions

        def padded(projected, at):
            return at.restore(projected) if at is not None else projected

        query = self.split_heads(padded(self.q_proj(hidden_states), positions))  # (B, H, T, Dh), bf16 under autocast
        key = self.split_heads(padded(self.k_proj(keys_from), key_positions))
        value = self.split_heads(padded(self.v_proj(keys_from), key_positions))
        batch_size, _, length, _ = query.shape
        output, weights = eager_attention_forward(
            self, query, key, value, additive_mask(attention_mask, self.is_causal, query, key),
            dropout=self.dropout if self.training else 0.0, scaling=self.scaling)  # (B, T, H, Dh)
        output = output.reshape(batch_size, length, -1)
        return self.out_proj(positions.remove(output) if positions is not None else output), weights
    return forward


@contextmanager
def written_out():
    original = MultiHeadAttention.forward
    MultiHeadAttention.forward = written_out_forward(original)
    try:
        yield
    finally:
        MultiHeadAttention.forward = original


VARIANTS = {"written out, bf16 products": written_out, "sdpa kernel in fp32": nullcontext}  # the model as it is


def main(argv: list[str] | None = None) -> dict:
    return train_py_variants.main(
        argv, doc=__doc__, script=__file__, variants=VARIANTS,
        title="train.py's loop in bf16 on a CPU: attention written out against sdpa's kernel in fp32",
        column="attention", default_output=RESULTS / "training_attention.json")


if __name__ == "__main__":
    main()
