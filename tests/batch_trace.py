"""Which batches each process trained on, recorded from outside the package.

As a module: `traced_train_batch(directory)` wraps `TrainingLoop._train_batch` so that every process appends one
JSON line per batch to `directory/rank-<rank>.jsonl` (rank, world size, machine, epoch, step, example indices,
tokens); `read_trace(directory)` reads them back. In-process tests install it with monkeypatch.

As a script, it is train.py with the trace installed, for `accelerate launch` (one trace file per process):

    accelerate launch --multi_gpu --num_processes 2 tests/batch_trace.py TRACE_DIR --preset tiny ...
"""

import json
import os
import sys
from pathlib import Path

from hf_scratch_transformer.training.loop import TrainingLoop
from hf_scratch_transformer.training.run import main

REAL_TRAIN_BATCH = TrainingLoop._train_batch
MODEL_CARD_TEMPLATE = Path(__file__).resolve().parents[1] / "model_card.md"


def traced_train_batch(directory: Path):
    """A `TrainingLoop._train_batch` that trains the batch, then records it in directory/rank-<rank>.jsonl."""
    directory = Path(directory)

    def train_batch(loop: TrainingLoop, indices: list[int], batch: dict) -> bool:
        tokens = int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
        stepped = REAL_TRAIN_BATCH(loop, indices, batch)
        accelerator = loop.accelerator
        row = {"rank": accelerator.process_index, "world_size": accelerator.num_processes,
               "machine": int(os.environ.get("GROUP_RANK", 0)), "pid": os.getpid(),
               "epoch": loop.state.epoch, "step": loop.state.global_step + 1, "indices": list(indices),
               "tokens": tokens}
        with open(directory / f"rank-{accelerator.process_index}.jsonl", "a", encoding="utf-8") as trace:
            trace.write(json.dumps(row) + "\n")
        return stepped

    return train_batch


def read_trace(directory: Path) -> dict[int, list[dict]]:
    """{rank: [row per batch, in training order]} of every process that trained."""
    ranks = {}
    for path in sorted(Path(directory).glob("rank-*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        ranks[rows[0]["rank"]] = rows
    return ranks


if __name__ == "__main__":
    trace_dir = Path(sys.argv[1])
    trace_dir.mkdir(parents=True, exist_ok=True)
    TrainingLoop._train_batch = traced_train_batch(trace_dir)
    sys.exit(main(sys.argv[2:], MODEL_CARD_TEMPLATE))
