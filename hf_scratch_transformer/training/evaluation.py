"""BLEU and chrF through `evaluate`, offline (the metric scripts ship inside the package); the validation and test
of a training run (`Evaluator`)."""

import json
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path

import evaluate
import torch
from torch.utils.data import DataLoader

from ..cpu_threads import thread_tuner
from ..data.batching import make_batch_sampler
from .tracking import log_to_trackers
from ..translation_core import DEFAULT_BATCH_SIZE, DEFAULT_MAX_LEN_A, DEFAULT_MAX_LEN_B
from ..translation_core import DecodingOptions, TextOptions, TorchBackend, translate_texts

logger = logging.getLogger("hf_scratch_transformer")

METRICS_DIR = Path(__file__).resolve().parents[1] / "metrics"  # shipped inside the package


@contextmanager
def as_saved(model):
    """`model` (unwrapped) as it is saved and as users load it: in fp32, without the fp16 autocast wrapper that
    Accelerate puts on its `forward` for --fp16 training (an instance attribute beside `_original_forward`), put back
    after. So --fp16 runs validate and score their test split as the saved weights translate (--bf16's autocast is
    the training loop's own, around its forward only)."""
    wrapped = model.__dict__.get("forward") if "_original_forward" in model.__dict__ else None
    if wrapped is not None:
        del model.forward  # the class's forward: the saved model's
    try:
        yield model
    finally:
        if wrapped is not None:
            model.forward = wrapped


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
    model, tokenizer, sources: list[str], references: list[str], num_beams: int = 1,
    batch_size: int = DEFAULT_BATCH_SIZE, max_new_tokens: int | None = None, progress: bool = False,
    max_len_a: float = DEFAULT_MAX_LEN_A, max_len_b: float = DEFAULT_MAX_LEN_B, description: str = "translating",
    on_batch=None,
) -> tuple[dict[str, float], list[str]]:
    """Translate `sources` through the translation core as a user's texts are translated, and score them:
    ({"bleu", "chrf", "gen_len"}, predictions).

    Each source is one unit (a corpus pair is one segment: no sentence splitting, an over-long one is cut into
    pieces rather than truncated), its protected spans protected as translation does by default: on for a model
    whose tokenizer has the sentinel tokens (trained with masked spans), so a placeholder in a source comes back
    exactly once, as a user gets it. `gen_len` is run_translation.py's: the mean length of the generated token
    sequences (`</s>` counted, the decoder start token and padding not). `max_len_a`/`max_len_b` bound each
    translation (translation_core); `max_new_tokens` None: the model's generation_config decides;
    `on_batch(tokens_generated, seconds)` is called after each batch (translation_core.translate_batches).
    """
    options = DecodingOptions(num_beams=num_beams, batch_size=batch_size, max_new_tokens=max_new_tokens,
                              max_len_a=max_len_a, max_len_b=max_len_b)
    found = translate_texts(TorchBackend(model), tokenizer, sources, options, TextOptions(segment=False),
                            progress=progress, description=description, on_batch=on_batch)
    predictions = [translation.text.strip() for translation in found]  # one line each, whatever the source's ends
    scores = translation_scores(predictions, references)
    lengths = [len(translation.hypotheses[0].token_ids) if translation.hypotheses else 0 for translation in found]
    scores["gen_len"] = round(sum(lengths) / max(len(lengths), 1), 4)
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


# ------------------------------------------------------------------------------------- evaluation during a run


def log_row(accelerator, state, row: dict) -> None:
    """A row of figures ({"step": N, ...}): into the run's history, Accelerate's trackers and the log."""
    state.history.append(row)
    log_to_trackers(accelerator, {key: value for key, value in row.items() if key != "step"}, row["step"])
    if accelerator.is_main_process:
        logger.info(json.dumps(row))


class Evaluator:
    """Validation (loss, greedy BLEU/chrF, divergence check) and test (loss, BLEU/chrF greedy and with beam
    search) of a run's model, on the main process; the other processes wait."""

    def __init__(self, accelerator, model, tokenizer, data, collator, data_args, args):
        self.accelerator, self.model, self.tokenizer, self.data = accelerator, model, tokenizer, data
        self.collator, self.data_args, self.args = collator, data_args, args
        self.is_main = accelerator.is_main_process
        self.divergence: str | None = None  # the last divergence warning, if any
        self.test_predictions: list[str] | None = None  # beam-search translations of the test sources
        self.threads = thread_tuner(accelerator.device, "translation", args.cpu_threads)

    def _batches(self, split: str) -> DataLoader:
        dataset = self.data.datasets[split]
        sampler = make_batch_sampler(dataset, self.data_args, self.args.per_device_eval_batch_size, shuffle=False)
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=self.collator)

    def _decoding_options(self) -> dict:
        """How validation and test translate: bounded to a * source length + b, a progress bar on the main process,
        the CPU threads adapted to the measured speed (the thread count of decoding is applied here)."""
        if self.threads is not None:
            self.threads.activate()
        return dict(batch_size=self.args.per_device_eval_batch_size, max_new_tokens=self.args.eval_max_new_tokens,
                    max_len_a=self.args.max_len_a, max_len_b=self.args.max_len_b, progress=self.is_main,
                    on_batch=self.threads.record if self.threads is not None else None)

    def validate(self, state) -> dict:
        """Validation loss and greedy BLEU/chrF at `state.global_step`, logged into `state.history`."""
        row = {}
        if self.is_main:
            started = time.perf_counter()
            with as_saved(self.accelerator.unwrap_model(self.model).eval()) as model:  # no dropout either
                loss = evaluation_loss(model, self._batches("validation"), self.accelerator.device)
                scores, _ = evaluate_translations(model, self.tokenizer, self.data.eval_sources,
                                                  self.data.eval_references, num_beams=1,
                                                  description=f"validation, step {state.global_step}",
                                                  **self._decoding_options())
            model.train(self.args.do_train)
            row = {"step": state.global_step, "eval_loss": round(loss, 4), "eval_bleu": scores["bleu"],
                   "eval_chrf": scores["chrf"], "eval_gen_len": scores["gen_len"],
                   "eval_runtime": round(time.perf_counter() - started, 2)}
            earlier = [r["eval_loss"] for r in state.history if "eval_loss" in r]
            log_row(self.accelerator, state, row)
            warning = divergence_warning(row, earlier, len(self.tokenizer), self.args.warmup_steps)
            if warning:
                self.divergence = warning
                logger.warning(warning)
        self.accelerator.wait_for_everyone()
        return row

    def test(self) -> dict:
        """Test loss, and BLEU/chrF/gen_len with beam search (`predict_*`, run_translation.py's names) and, for
        comparison, greedy decoding (`predict_*_greedy`), on the main process."""
        results = {}
        if self.is_main and self.data.test_sources:
            with as_saved(self.accelerator.unwrap_model(self.model).eval()) as model:
                results["predict_loss"] = round(
                    evaluation_loss(model, self._batches("test"), self.accelerator.device), 4)
                for beams in sorted({1, self.args.num_beams}):
                    results.update(self._test_decoding(model, beams))
            results["predict_samples"] = len(self.data.test_sources)
            results["predict_samples_per_second"] = round(
                len(self.data.test_sources) / max(results["predict_runtime"], 1e-9), 3)
            logger.info(json.dumps(results))
        self.accelerator.wait_for_everyone()
        return results

    def _test_decoding(self, model, beams: int) -> dict:
        """The test scores of one decoding; `_greedy` names them unless it is the --num_beams one."""
        started = time.time()
        name = "greedy" if beams == 1 else f"beam {beams}"
        scores, predictions = evaluate_translations(
            model, self.tokenizer, self.data.test_sources, self.data.test_references, num_beams=beams,
            description=f"test, {name}", **self._decoding_options(),
        )
        if beams == self.args.num_beams:
            self.test_predictions = predictions
        suffix = "_greedy" if beams != self.args.num_beams else ""
        return {f"predict_bleu{suffix}": scores["bleu"], f"predict_chrf{suffix}": scores["chrf"],
                f"predict_gen_len{suffix}": scores["gen_len"], f"predict_runtime{suffix}": round(time.time() - started, 2)}


def divergence_warning(row: dict, earlier_losses: list[float], vocab_size: int, warmup_steps: int) -> str | None:
    """A finite divergence seen at validation: after warm-up, a loss half a nat above that of guessing every token
    uniformly (ln V), or 50% and 1 nat above the best validation loss so far. None when the run looks healthy."""
    loss, uniform = row["eval_loss"], math.log(vocab_size)
    best = min(earlier_losses, default=math.inf)
    if loss > uniform + 0.5 and row["step"] > warmup_steps:
        why = f"above {uniform:.2f}, the loss of guessing uniformly among {vocab_size} tokens"
    elif loss > 1.5 * best and loss > best + 1:
        why = f"up from {best} at best"
    else:
        return None
    return (f"training is diverging: validation loss {loss} at step {row['step']} is {why} (BLEU {row['eval_bleu']}); "
            f"lower --learning_rate, raise --warmup_steps or use --normalize_before (pre-norm), then start again "
            f"or resume from a checkpoint written before the loss rose")
