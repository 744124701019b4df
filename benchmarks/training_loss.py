"""train.py's loop with its loss (training/loss.py) against the model's own loss, alternated (issue: speed to the CPU's
limit).

    python benchmarks/training_loss.py                                         # on the system's malloc
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python benchmarks/training_loss.py \
        --output benchmarks/results/training_loss_tcmalloc.json

`loss.py` (what train.py trains on: `teacher_forced_loss`, no fp32 copy of the logits) against `the model's loss`
(`forward(labels=..., label_smoothing=...)`: `F.cross_entropy` on the logits cast to fp32), put in its place for a run;
the runs, their timing and their figures are `train_py_variants.py`'s. The malloc is the process's (a child inherits
LD_PRELOAD): run it once as it is and once with tcmalloc preloaded. Results: `benchmarks/results/training_loss.json`
and `.md` (machine, load, commit).
"""

from contextlib import contextmanager

import torch

import train_py_variants
from common import RESULTS

from hf_scratch_transformer.training import loop
from hf_scratch_transformer.training import loss as loss_module


def models_own_loss(model, batch: dict, smoothing: float) -> torch.Tensor:
    """The loss as the model computes it when given labels (F.cross_entropy on the fp32 logits)."""
    return model(**batch, label_smoothing=smoothing).loss.float()


LOSSES = {"loss.py": loss_module.teacher_forced_loss, "the model's loss": models_own_loss}


def loss_in_the_loop(name: str):
    @contextmanager
    def variant():
        loop.teacher_forced_loss = LOSSES[name]
        try:
            yield
        finally:
            loop.teacher_forced_loss = loss_module.teacher_forced_loss
    return variant


def main(argv: list[str] | None = None) -> dict:
    return train_py_variants.main(
        argv, doc=__doc__, script=__file__, variants={name: loss_in_the_loop(name) for name in LOSSES},
        title="train.py's loop: its loss (training/loss.py) against the model's own loss", column="loss",
        default_output=RESULTS / "training_loss.json")


if __name__ == "__main__":
    main()
