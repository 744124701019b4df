#!/usr/bin/env python
"""Train the from-scratch Transformer on a parallel corpus and write a Hub-format model directory.

    accelerate launch train.py                      # small preset, English->Spanish, the shipped corpus
    python train.py --preset tiny --max_steps 100   # a smoke run
    python train.py configs/small-en-es.json        # flags from a JSON or YAML file
    python train.py --help                          # every flag

The work happens in `hf_scratch_transformer.training`; this file only hands it the model-card template.
"""

import sys
from pathlib import Path

from hf_scratch_transformer.training import main

if __name__ == "__main__":
    sys.exit(main(model_card_template=Path(__file__).resolve().with_name("model_card.md")))
