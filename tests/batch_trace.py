"""Which batches each process trained on, recorded through the training loop's public callback hook.

As a module: `BatchTrace(directory)` is a `TrainingCallback` whose `on_batch_end` appends one JSON line per batch to
`directory/rank-<rank>.jsonl` (rank, world size, machine, epoch, step, example indices, tokens); `read_trace(directory)`
reads them back. In-process tests run train.py's `main` or `run_training` inside `training_callbacks(BatchTrace(d))`.

As a script, it is train.py with the trace on, for `accelerate launch` (one trace file per process):

    accelerate launch --multi_gpu --num_processes 2 tests/batch_trace.py TRACE_DIR --preset tiny ...
"""

import json
import os
import sys
from pathlib import Path

from hf_scratch_transformer.training.loop import TrainingCallback, training_callbacks
from hf_scratch_transformer.training.run import main

MODEL_CARD_TEMPLATE = Path(__file__).resolve().parents[1] / "model_card.md"


class BatchTrace(TrainingCallback):
    """Records every batch a process trained on in directory/rank-<rank>.jsonl."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def on_batch_end(self, loop, indices, batch, loss) -> None:
        accelerator = loop.accelerator
        tokens = int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
        row = {"rank": accelerator.process_index, "world_size": accelerator.num_processes,
               "machine": int(os.environ.get("GROUP_RANK", 0)), "pid": os.getpid(),
               "epoch": loop.state.epoch, "step": loop.state.global_step + 1, "indices": list(indices),
               "tokens": tokens}
        with open(self.directory / f"rank-{accelerator.process_index}.jsonl", "a", encoding="utf-8") as trace:
            trace.write(json.dumps(row) + "\n")


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
    with training_callbacks(BatchTrace(trace_dir)):
        code = main(sys.argv[2:], MODEL_CARD_TEMPLATE)
    sys.exit(code)
