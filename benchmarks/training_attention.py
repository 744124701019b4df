"""train.py's loop in bf16 on a CPU with the model's written-out attention against torch's sdpa kernel in fp32 (what
the model did before), alternated (issue: speed to the CPU's limit).

    python benchmarks/training_attention.py                     # 3 rounds, 2 threads
    python benchmarks/training_attention.py --cpu_threads 1 --note "one core busy"

`written out, fp32 scores` is the model as it is: training in bf16 on a CPU, `MultiHeadAttention` attends with
`cpu_bf16_training_attention` (the scores and softmax in fp32, the weights-by-values product in bf16). `sdpa kernel
in fp32` puts `sdpa_in_fp32` in its place for a run: query, key and value cast to fp32 and torch's
scaled_dot_product_attention called with autocast paused, on the same masks. The runs, their timing and their figures
are `train_py_variants.py`'s. On a CPU without bf16 units train.py trains in fp32, where neither variant applies:
give `--bf16 true` there. Results: `benchmarks/results/training_attention.json` and `.md` (machine, load, commit).
"""

from contextlib import contextmanager, nullcontext

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import train_py_variants
from common import RESULTS

from hf_scratch_transformer import modeling_scratch_transformer as modeling


def sdpa_in_fp32(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """What a bf16 training step on a CPU attended with before `cpu_bf16_training_attention`: torch's kernel in fp32
    on the "sdpa" masks, the output cast back to the query's dtype."""
    with torch.autocast("cpu", enabled=False):
        output, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                                 scaling=scaling, dropout=dropout)
    return output.to(query.dtype), weights


@contextmanager
def sdpa_kernel_in_fp32():
    original = modeling.cpu_bf16_training_attention
    modeling.cpu_bf16_training_attention = sdpa_in_fp32
    try:
        yield
    finally:
        modeling.cpu_bf16_training_attention = original


VARIANTS = {"written out, fp32 scores": nullcontext, "sdpa kernel in fp32": sdpa_kernel_in_fp32}  # the model first


def main(argv: list[str] | None = None) -> dict:
    return train_py_variants.main(
        argv, doc=__doc__, script=__file__, variants=VARIANTS,
        title="train.py's loop in bf16 on a CPU: the written-out attention against sdpa's kernel in fp32",
        column="attention", default_output=RESULTS / "training_attention.json")


if __name__ == "__main__":
    main()
