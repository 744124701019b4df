"""Helpers for end-to-end runs of train.py on a small slice of the shipped corpus."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL_CARD_TEMPLATE = REPO / "model_card.md"


def tiny_run_flags(output_dir, **overrides) -> list[str]:
    """Flags of a tiny run: ~400 training pairs, small vocabulary, short evaluation; finishes in seconds."""
    flags = {
        "preset": "tiny", "output_dir": str(output_dir), "max_train_samples": 400, "max_eval_samples": 16,
        "max_predict_samples": 16, "tokenizer_vocab_size": 600, "max_tokens": 1024, "max_source_length": 96,
        "max_target_length": 96, "max_steps": 8, "logging_steps": 2, "save_steps": 4, "eval_steps": 4,
        "warmup_steps": 4, "eval_max_new_tokens": 12, "num_beams": 2, "report_to": "none",
        "max_position_embeddings": 128,
    }
    flags.update(overrides)
    argv = []
    for key, value in flags.items():
        if value is True:
            argv.append(f"--{key}")
        elif value is not False and value is not None:
            argv += [f"--{key}", str(value)]
    return argv
