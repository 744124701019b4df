"""train.py's loop in bf16 on a CPU with attention written out (bf16 products, the softmax in fp32) against torch's
sdpa kernel in fp32, alternated (issue: speed to the CPU's limit).

    python benchmarks/training_attention.py                     # 3 rounds, 2 threads
    python benchmarks/training_attention.py --cpu_threads 1 --note "one core busy"

`written out, bf16 products` is the model as it is (`MultiHeadAttention.attention_function`: training in bf16 on a
CPU, "sdpa" runs `eager_attention_forward` under autocast with sdpa's masks made additive); `sdpa kernel in fp32` is
what the model did before: query, key and value cast to fp32 and torch's scaled_dot_product_attention called with
autocast paused (its CPU kernel runs the backward 5-6x slower in bf16: `attention_bf16_cpu.py`). The runs, their
timing and their figures are `train_py_variants.py`'s. On a CPU without bf16 units train.py trains in fp32, where
both variants are the kernel: give `--bf16 true` to compare there. Results:
`benchmarks/results/training_attention.json` and `.md` (machine, load, commit).
"""

from contextlib import contextmanager

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import train_py_variants
from common import RESULTS

from hf_scratch_transformer.modeling_scratch_transformer import MultiHeadAttention


def sdpa_in_fp32(module, query, key, value, attention_mask, **kwargs):
    """torch's kernel on fp32 copies of query, key and value, autocast paused; the output back in their dtype."""
    with torch.autocast("cpu", enabled=False):
        output, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                                 **kwargs)
    return output.to(query.dtype), weights


@contextmanager
def sdpa_kernel_in_fp32():
    written_out = MultiHeadAttention.attention_function

    def attention_function(self, query, key, attention_mask):
        bf16_cpu_training = query.dtype == torch.bfloat16 and query.is_cpu and torch.is_grad_enabled()
        if self.config._attn_implementation == "sdpa" and bf16_cpu_training:  # the model's exception
            return sdpa_in_fp32, attention_mask
        return written_out(self, query, key, attention_mask)

    MultiHeadAttention.attention_function = attention_function
    try:
        yield
    finally:
        MultiHeadAttention.attention_function = written_out


@contextmanager
def as_it_is():
    yield


VARIANTS = {"written out, bf16 products": as_it_is, "sdpa kernel in fp32": sdpa_kernel_in_fp32}


def main(argv: list[str] | None = None) -> dict:
    return train_py_variants.main(
        argv, doc=__doc__, script=__file__, variants=VARIANTS,
        title="train.py's loop in bf16 on a CPU: attention written out against sdpa's kernel in fp32",
        column="attention", default_output=RESULTS / "training_attention.json")


if __name__ == "__main__":
    main()
