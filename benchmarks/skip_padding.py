"""train.py's loop with the model skipping the padding of its training batches against computing it, alternated
(issue: speed to the CPU's limit).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python benchmarks/skip_padding.py --note "idle"

`padding skipped` is train.py as it is: `teacher_forced_loss` passes `logits_mask` (the labelled positions, a prefix of
each row), and the model runs no layer at a padded position of source or target (`RealPositions`). `padding computed`
makes the model take the path it takes for a mask with gaps: every layer over the padded (B, L) batch, the output
projection over the labelled positions only. The runs, their timing and their figures are `train_py_variants.py`'s;
the first batch's loss must agree. Results: `benchmarks/results/skip_padding.json` and `.md` (machine, load, commit).
"""

from contextlib import contextmanager

import train_py_variants
from common import RESULTS

from hf_scratch_transformer import modeling_scratch_transformer as modeling


def padding(skipped: bool):
    @contextmanager
    def variant():
        kept = modeling.is_right_padded
        if not skipped:
            modeling.is_right_padded = lambda mask: False
        try:
            yield
        finally:
            modeling.is_right_padded = kept
    return variant


def main(argv: list[str] | None = None) -> dict:
    return train_py_variants.main(
        argv, doc=__doc__, script=__file__,
        variants={"padding skipped": padding(True), "padding computed": padding(False)},
        title="train.py's loop: the model skipping the batches' padding against computing it", column="padding",
        default_output=RESULTS / "skip_padding.json")


if __name__ == "__main__":
    main()
