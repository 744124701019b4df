#!/usr/bin/env python
"""Train the from-scratch Transformer on a parallel corpus and write a Hub-format model directory.

    python train.py                                 # small preset, English->Spanish, the shipped corpus
    python train.py --preset tiny --max_steps 200 --max_eval_samples 100 --max_predict_samples 100 \
        --output_dir outputs/tiny                   # a smoke run
    python train.py configs/tiny-smoke.yaml         # flags from a JSON or YAML file (see configs/)
    python train.py --model_name_or_path outputs/tiny --do_predict --max_predict_samples 100 \
        --output_dir outputs/tiny-eval              # predict only, with an existing model
    python train.py --help                          # every flag

`python train.py` runs one process; `accelerate launch train.py` runs the same code in as many processes as
accelerate is configured for (`accelerate launch --quiet ...` for one process: a failed run then ends with this
script's one-line error and no accelerate traceback).

The work happens in `hf_scratch_transformer.training.run`; this file chooses the process's malloc (tcmalloc when the
machine has it), sets MKL's reproducibility mode and hands the run the model-card template.
"""

import importlib.util
import os
import sys
from pathlib import Path


def _relaunch_for_training() -> None:
    """memory_allocator.relaunch_for_training, loaded from its file: importing it through the package would import
    torch first, and the process may be about to start again (see that module)."""
    package = importlib.util.find_spec("hf_scratch_transformer")  # found, not imported
    if package is None or not package.submodule_search_locations:
        return
    path = Path(next(iter(package.submodule_search_locations))) / "memory_allocator.py"
    spec = importlib.util.spec_from_file_location("hf_scratch_transformer_memory_allocator", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.relaunch_for_training()


if __name__ == "__main__":
    # glibc's malloc gives the largest tensors of a step back to the kernel, which then faults in and zeroes fresh
    # pages every step; tcmalloc keeps them. When the machine has tcmalloc, the process runs again with it preloaded
    # (same pid and arguments) before anything else happens (memory_allocator.py).
    _relaunch_for_training()
    # MKL's conditional numerical reproducibility: without it MKL may pick its code path by how the memory happens to
    # be aligned, so the same run at the same thread count can end with other weights; with it a matrix product
    # repeats bit for bit at a fixed thread count (the guarantee of a pinned --cpu_threads N), and STRICT keeps the
    # bits of its sums for any thread count (the speed was the same within noise). MKL reads the variable once, when
    # it first runs, so it is set before torch is imported; a value already set is kept. It is the training
    # command's choice: importing the package changes no environment variable.
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

    from hf_scratch_transformer.training.run import main

    sys.exit(main(model_card_template=Path(__file__).resolve().with_name("model_card.md")))
