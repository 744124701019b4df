"""The Hub-format model directory a run leaves in its output directory (weights, config, tokenizer, result files,
history, curves, model card), the facts of its model card, and the hub upload.

Everything is written into a hidden staging folder of the run directory and moved in file by file, so a failed save
leaves the previous model as it was; a failed write ends in one line (run_directory.guarded_write).
"""

import json
import logging
import os
import platform
import re
from pathlib import Path

import torch
import transformers
from huggingface_hub import HfApi

from ..cpu_threads import cpu_bf16_units, cpu_model_and_flags
from ..data.loading import SHIPPED_DATASET_ID
from ..errors import TrainingFault
from .model_card import render_model_card
from ..pipeline_translation import TranslationPipeline
from ..plotting import plot_training_curves
from .run_directory import (
    ALL_RESULTS_FILE,
    HUB_IGNORE,
    PREDICTIONS_FILE,
    follow_umask,
    remove_quietly,
    results_file,
    staging_folder,
    tokenizer_staging,
)

logger = logging.getLogger("hf_scratch_transformer")


# ---------------------------------------------------------------------------------------------------- result files


_LINE_BREAKS = re.compile(r"\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")  # what str.splitlines ends a line at


def as_lines(texts: list[str]) -> str:
    """`texts` one per line, in order: a line break inside a text (a gettext message of two lines) becomes a space,
    so line N of the file is always text N."""
    return "".join(_LINE_BREAKS.sub(" ", text) + "\n" for text in texts)


def result_files(results: dict, phases: dict, predictions: list[str] | None) -> dict[str, str]:
    """run_translation.py's result files: {train,eval,predict}_results.json, all_results.json (`results`) and
    generated_predictions.txt (one line per test source, in order)."""
    files = {results_file(phase): json.dumps(values, indent=2) for phase, values in phases.items() if values}
    files[ALL_RESULTS_FILE] = json.dumps(results, indent=2)
    if predictions is not None:
        files[PREDICTIONS_FILE] = as_lines(predictions)
    return files


def save_results(output_dir: Path, results: dict, phases: dict, predictions: list[str] | None) -> None:
    """Without training: write the result files into output_dir (all_results.json merged into an existing one,
    as transformers' Trainer.save_metrics does), staged then moved in."""
    previous = output_dir / ALL_RESULTS_FILE
    try:
        merged = {**json.loads(previous.read_text()), **results} if previous.is_file() else results
    except ValueError:
        merged = results
    kept = "the files there before are unchanged"
    with staging_folder(output_dir, "the result files", kept=kept, then="run the same command again") as staging:
        for name, text in result_files(merged, phases, predictions).items():
            (staging / name).write_text(text, encoding="utf-8")
        _move_in(staging, output_dir)


def _move_in(staging: Path, output_dir: Path) -> None:
    """Move every file of a staging folder into output_dir (a rename on the same file system: no space needed)."""
    for path in staging.iterdir():
        os.replace(path, output_dir / path.name)


# ------------------------------------------------------------------------------------------- the model directory


def save_model_files(model, tokenizer, folder: Path) -> None:
    """The model, its tokenizer and the code that `pipeline("translation", model=folder, trust_remote_code=True)`
    runs (pipeline_translation.py and the files it imports), saved as the translation pipeline saves itself; the
    model stays on its device."""
    TranslationPipeline(model=model, tokenizer=tokenizer, device=model.device).save_pretrained(folder)


def save_model(output_dir: Path, model, tokenizer, files: dict[str, str], history: list[dict],
               last_checkpoint: Path | None) -> None:
    """Write the Hub-format directory: the model, its tokenizer, `files` (name -> text: result files, model card),
    training_history.json and training_curves.png, staged then moved in file by file; the tokenizer staged during
    setup is removed once the model is saved."""
    model.config.use_cache = True
    kept = (f"the model files there before this save are unchanged and the last checkpoint is {last_checkpoint}"
            if last_checkpoint else "the model files there before this save are unchanged")
    with staging_folder(output_dir, "the final model", needed=model.get_memory_footprint(return_buffers=False),
                        kept=kept, then="run again with --resume_from_checkpoint latest") as staging:
        save_model_files(model, tokenizer, staging)
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
        (staging / "training_history.json").write_text(json.dumps(history, indent=1))
        plot_training_curves(history, staging / "training_curves.png")
        follow_umask(staging)
        _move_in(staging, output_dir)
    remove_quietly(tokenizer_staging(output_dir))


# ------------------------------------------------------------------------------------------------- the model card


def model_card(template: str | Path, *, model, model_args, data_args, args, recipe, results: dict, state, data,
               predictions: list[str] | None, hardware: str, output_dir: Path) -> str:
    """The model card of a run: the template filled with its corpus, sizes, recipe (recipe.Recipe), measured figures
    and five sample translations. `data` is the run's TrainingData (splits, filter report, evaluation pairs)."""
    config = model.config
    dataset_name, description, shipped = _dataset_facts(data_args)
    samples = [{"source": _table_cell(s), "reference": _table_cell(r), "prediction": _table_cell(p)}
               for s, r, p in list(zip(data.test_sources, data.test_references, predictions or []))[:5]]
    return render_model_card(
        template, model_name=output_dir.name, source_lang=data_args.source_lang,
        target_lang=data_args.target_lang, dataset_name=dataset_name, results=_test_scores(results, args.num_beams),
        dataset_description=description, test_pairs=len(data.test_sources),
        train_pairs="streamed" if data_args.streaming else len(data.datasets["train"]),
        validation_pairs=len(data.eval_sources), filter_summary=_filter_summary(data.filter_report["train"]),
        architecture=_architecture(config, model_args), parameters=f"{model.num_parameters() / 1e6:.1f}M",
        vocab_size=config.vocab_size, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        adam_epsilon=args.adam_epsilon, learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
        lr_scheduler=args.lr_scheduler_type, label_smoothing=args.label_smoothing_factor,
        dropout=(f"{config.dropout} (attention {config.attention_dropout}, after the feed-forward activation "
                 f"{config.activation_dropout})"),
        training_noise=recipe.augmentation.describe(), recipe="; ".join(recipe.lines()),
        final_weights=_final_weights(results), training_end=results.get("stop_detail") or "not recorded",
        decoding=_decoding(args), max_grad_norm=args.max_grad_norm, batching=_batching(recipe, args),
        steps=state.global_step,
        epochs=round(results.get("epoch", state.epoch), 2), train_tokens=f"{state.train_tokens:,}",
        hardware=hardware, precision=_precision(recipe), training_speed=_training_speed(results), train_time=f"{results['train_runtime'] / 60:.1f} minutes",
        software=(f"hf-scratch-transformer, PyTorch {torch.__version__}, transformers {transformers.__version__}, "
                  f"Python {platform.python_version()}"),
        sample_translations=samples, decoding_for_samples=f"beam {args.num_beams}",
        repo_or_dir=args.hub_model_id or str(output_dir),
        example_source=data.test_sources[0] if data.test_sources else "Hello.",
        domain_note="the Bible in early-20th-century Spanish and modern English" if shipped else "the corpus above",
        max_source_length=data_args.max_source_length,
    )


def _precision(recipe) -> str:
    return "fp32" if recipe.precision == "fp32" else f"{recipe.precision} mixed precision"


def _training_speed(results: dict) -> str:
    """Training tokens/s, model FLOP/s and their share of the measured matmul peak (flops.training_throughput)."""
    speed = f"{results['train_tokens_per_second']:,.0f} non-padding tokens/s"
    if results.get("train_mfu") is None:
        return speed + " (model FLOPs not counted: resumed from a checkpoint written before they were)"
    used = (f"{speed}, {results['train_flops_per_second'] / 1e9:,.1f} model GFLOP/s: {results['train_mfu']:.1%} of "
            f"the {results['train_precision']} matmul peak")
    measured = results.get("train_matmul_peak_flops_measured") or []
    if len(measured) < 2:
        return f"{used} measured at the start, {results['train_matmul_peak_flops'] / 1e9:,.0f} GFLOP/s (MFU)"
    return (f"{used}, {results['train_matmul_peak_flops'] / 1e9:,.0f} GFLOP/s (MFU; the higher of those measured at "
            f"the start and at the end of training, {measured[0] / 1e9:,.0f} and {measured[1] / 1e9:,.0f} GFLOP/s)")


def _final_weights(results: dict) -> str:
    averaged = results.get("averaged_checkpoints") or []
    if results.get("best_model_checkpoint"):
        metric = results["metric_for_best_model"].removeprefix("eval_")
        return (f"the best validated checkpoint, {results['best_model_checkpoint']} (validation {metric} "
                f"{results['best_metric']})")
    if not averaged:
        return "the weights after the last step"
    return f"the average of the last {len(averaged)} checkpoints ({', '.join(map(str, averaged))})"


def _decoding(args) -> str:
    return (f"beam {args.num_beams} (greedy also reported), at most {args.max_len_a:g} × source length + "
            f"{args.max_len_b:g} new tokens")


def _dataset_facts(data_args) -> tuple[str, str, bool]:
    """(dataset name, description, whether it is the shipped corpus)."""
    shipped = data_args.dataset_name is None and data_args.train_file is None
    dataset_name = data_args.dataset_name or (SHIPPED_DATASET_ID if shipped else "local files")
    description = ("the verse-aligned English–Spanish Bible shipped with hf-scratch-transformer (World English "
                   "Bible ↔ Reina-Valera 1909, public domain)" if shipped else f"`{dataset_name}`")
    return dataset_name, description, shipped


def _test_scores(results: dict, num_beams: int) -> dict:
    """{decoding name: {"bleu", "chrf"}} of the test decodings that ran."""
    decodings = {"_greedy": "greedy", "": "greedy" if num_beams == 1 else f"beam {num_beams}"}
    return {label: {"bleu": results[f"predict_bleu{suffix}"], "chrf": results[f"predict_chrf{suffix}"]}
            for suffix, label in decodings.items() if f"predict_bleu{suffix}" in results}


def _filter_summary(report: dict) -> str:
    if report["input"] is None:
        return "streamed: empty, over-long and implausible-length-ratio pairs dropped as read"
    masked = (f"; in {report['masked']} of the pairs kept, the protected spans both sides share were masked by "
              f"sentinel tokens" if report.get("masked") else "")
    return (f"{report['empty']} empty, {report['too_long']} over-long and {report['bad_ratio']} "
            f"implausible-length-ratio pairs dropped of {report['input']}{masked}")


def _architecture(config, model_args) -> str:
    origin = (f"(started from `{model_args.model_name_or_path}`)" if model_args.model_name_or_path
              else f"(preset `{model_args.preset_name()}`)")
    return (f"{config.encoder_layers}+{config.decoder_layers} layers, d_model {config.d_model}, "
            f"{config.encoder_attention_heads} heads, FFN {config.encoder_ffn_dim}, "
            f"{'pre' if config.normalize_before else 'post'}-norm " + origin)


def _batching(recipe, args) -> str:
    batches = (f"token-bucketed, at most {recipe.batch_tokens} tokens per batch and process" if recipe.batch_tokens
               else f"{args.per_device_train_batch_size} sentences per batch and process")
    return batches + f", gradient accumulation {args.gradient_accumulation_steps}"


def hardware_description(device: torch.device, processes: int) -> str:
    """The GPU's name or the CPU's (with its bf16 matrix units, which decide whether `--bf16` pays there), and the
    number of processes: the model card's hardware line."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device) + f", {processes} process(es)"
    units = cpu_bf16_units()
    units = {"AVX-512 BF16": "AVX-512 BF16, no AMX", None: "no bf16 units"}.get(units, units)
    return f"{cpu_model_and_flags()[0]} ({units}), {os.cpu_count()} logical cores, {processes} process(es)"


def _table_cell(text: str, limit: int = 300) -> str:
    """Text safe inside a Markdown table cell."""
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ------------------------------------------------------------------------------------------------------------ hub


def hub_repo(args, output_dir: Path) -> str:
    return args.hub_model_id or output_dir.resolve().name


def push_to_hub(args, output_dir: Path, folder: Path, path_in_repo: str | None = None,
                message: str = "Upload model") -> str:
    """Upload `folder` (output_dir itself, a checkpoint, or a staged snapshot) to --hub_model_id; the commit's URL.
    Any failure ends in a TrainingFault that says the local model is complete and how to upload it later."""
    repo_id = hub_repo(args, output_dir)
    try:
        api = HfApi(token=args.hub_token)
        api.create_repo(repo_id, private=args.hub_private_repo, exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder), path_in_repo=path_in_repo,
                                   commit_message=message, ignore_patterns=HUB_IGNORE)
    except Exception as error:  # any failure of the network or the hub ends in the same advice
        raise TrainingFault(
            f"could not push to the hub repository {repo_id!r}: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}. The model is saved and complete in "
            f"{output_dir}; upload it later with `hf upload {repo_id} {output_dir}`"
        ) from error
    return str(getattr(commit, "commit_url", commit))


def push_during_training(args, output_dir: Path, model, tokenizer, checkpoint: Path, step: int) -> None:
    """--hub_strategy every_save / checkpoint, after a checkpoint: the model (and with `checkpoint`, the checkpoint
    under last-checkpoint/). Failures are logged, training goes on."""
    try:
        if args.hub_strategy == "checkpoint":
            push_to_hub(args, output_dir, checkpoint, "last-checkpoint", f"Checkpoint at step {step}")
        with staging_folder(output_dir, "a snapshot for the hub") as staging:
            save_model_files(model, tokenizer, staging)
            push_to_hub(args, output_dir, staging, None, f"Model at step {step}")
    except TrainingFault as error:
        logger.warning(f"push during training failed, training goes on: {error}")
