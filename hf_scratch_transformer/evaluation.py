"""BLEU and chrF through `evaluate`, offline: the metric scripts ship inside the package."""

from pathlib import Path

import evaluate
import torch

from .translate import decode_ids, generate_ids

METRICS_DIR = Path(__file__).resolve().parent / "metrics"


def load_metric(name: str) -> evaluate.EvaluationModule:
    """`evaluate.load` of a metric shipped with the package: "sacrebleu_local" or "chrf_local"."""
    return evaluate.load(str(METRICS_DIR / name))


def translation_scores(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Corpus BLEU (sacrebleu, 13a tokenisation) and chrF of detokenised predictions against one reference each."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references.")
    bleu = load_metric("sacrebleu_local").compute(predictions=predictions, references=references)
    chrf = load_metric("chrf_local").compute(predictions=predictions, references=references)
    return {"bleu": round(bleu["score"], 2), "chrf": round(chrf["score"], 2)}


def evaluate_translations(
    model, tokenizer, sources: list[str], references: list[str], num_beams: int = 1, batch_size: int = 64,
    max_new_tokens: int = 256, progress: bool = False, max_len_a: float = 0.0, max_len_b: float = 0.0,
    description: str = "translating",
) -> tuple[dict[str, float], list[str]]:
    """Translate `sources` and score them: ({"bleu", "chrf", "gen_len"}, predictions).

    `gen_len` is run_translation.py's: the mean length of the generated token sequences (`</s>` counted, the
    decoder start token and padding not). `max_len_a`/`max_len_b` bound each translation (see `generate_ids`).
    """
    ids = generate_ids(
        model, tokenizer, sources, batch_size=batch_size, num_beams=num_beams, max_new_tokens=max_new_tokens,
        progress=progress, max_len_a=max_len_a, max_len_b=max_len_b, description=description,
    )
    predictions = [decode_ids(tokenizer, token_ids) for token_ids in ids]
    scores = translation_scores(predictions, references)
    scores["gen_len"] = round(sum(len(token_ids or []) for token_ids in ids) / max(len(ids), 1), 4)
    return scores, predictions


@torch.no_grad()
def evaluation_loss(model, batches, device: torch.device) -> float:
    """Token-level cross-entropy (no label smoothing) over padded batches with -100 labels."""
    was_training = model.training
    model.eval()
    total_loss, total_tokens = 0.0, 0
    for batch in batches:
        labels = batch["labels"].to(device)
        mean_loss = model(
            input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device), labels=labels
        ).loss
        tokens = int((labels != -100).sum())
        total_loss += mean_loss.item() * tokens
        total_tokens += tokens
    model.train(was_training)
    return total_loss / max(total_tokens, 1)
