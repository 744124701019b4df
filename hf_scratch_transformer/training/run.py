"""Training with Accelerate and the paper's recipe; `train.py` is a thin command line over `main()`.

`run_training` reads as the data flow: corpus -> joint BPE tokenizer -> tokenised, filtered splits -> model ->
training (Adam + warm-up schedule + label smoothing, periodic validation and checkpoints) -> validation and test
(BLEU, chrF; greedy and beam search) -> a Hub-format output directory with a model card -> optionally the hub.
Each step's machinery lives in its own module: `arguments` (flags and their checks), `recipe` (the default recipe,
resolved from the flags and the machine), `data` (corpus, tokenizer, preprocessing, batches), `augmentation`
(training-time noise), `distributed` (launching, Accelerate, several processes), `loop` (the training loop),
`evaluation`, `run_directory` (the output directory: lock, checks, checkpoints, staging, write faults),
`checkpointing` (resuming) and `model_directory` (the Hub-format model and the hub).
"""

import json
import logging
import signal
import sys
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import datasets
import transformers
from accelerate.utils import set_seed
from datasets import Dataset, IterableDataset
from transformers import AutoTokenizer, GenerationConfig

from .arguments import ModelArguments, RunArguments, check_model_flags, check_values, parse_arguments
from .augmentation import noise_collator, read_paraphrases
from .checkpointing import (
    RunState,
    average_checkpoints,
    check_resume,
    check_same_architecture,
    check_same_data,
    data_fingerprint,
    declare_tied_weights,
    list_checkpoints,
    quiet_save_warnings,
    saved_dropout,
)
from ..configuration_scratch_transformer import ScratchTransformerConfig
from ..data.loading import CorpusError, DataArguments, load_parallel_corpus
from ..data.batching import TrainingBatches
from ..memory_allocator import describe_allocator
from ..data.preprocessing import (TrainingData, evaluation_pairs, make_collator, mean_pair_tokens, preprocess_corpus,
                                  sentence_tokens)
from .distributed import (
    check_launch,
    is_lost_process_error,
    join_processes,
    launched_rank,
    launcher_precision,
    lost_process_fault,
    report_to_launcher,
    start_accelerator,
    stop_watching,
    trackers,
)
from ..errors import (
    EnvironmentFault,
    RunInterrupted,
    ScratchTransformerError,
    TrainingFault,
    UsageError,
    exit_code,
    print_results,
)
from .evaluation import Evaluator
from .loop import TrainingLoop, active_callbacks, train_results
from .model_directory import (
    as_lines,
    hardware_description,
    model_card,
    push_to_hub,
    result_files,
    save_model,
    save_results,
)
from ..modeling_scratch_transformer import ScratchTransformerForConditionalGeneration
from .recipe import Recipe, resolve_recipe
from .run_directory import (
    ALL_RESULTS_FILE,
    OutputDirLock,
    claim_output_dir,
    remove_checkpoints,
    resolve_checkpoint,
    set_newer_checkpoints_aside,
    stage_tokenizer,
    staging_folder,
    tokenizer_staging,
)
from .tracking import end_tracker_logs, restore_thread_excepthook, start_tracker_logs
from ..data.tokenization import train_tokenizer_on_corpus
from ..translation.translate import TEST_SOURCES_FILE, ModelLoadError, load_model_and_tokenizer

logger = logging.getLogger("hf_scratch_transformer")


def run_training(model_args: ModelArguments, data_args: DataArguments, args: RunArguments,
                 model_card_template: str | Path | None = None) -> dict:
    """Train (--do_train), evaluate (--do_eval), predict (--do_predict), save (and push); with no --do_* flag all
    three. Returns the figures written to all_results.json (run_translation.py's key names)."""
    lock = OutputDirLock(Path(args.output_dir))
    try:
        return _run_training(model_args, data_args, args, model_card_template, lock)
    except RuntimeError as error:  # a collective operation failed: another process (or machine) was lost
        if not is_lost_process_error(error):
            raise
        kept = list_checkpoints(Path(args.output_dir))
        raise lost_process_fault(error, kept[-1] if kept else None, args.ddp_timeout) from error
    finally:
        stop_watching()
        lock.release()


def _run_training(model_args: ModelArguments, data_args: DataArguments, args: RunArguments,
                  model_card_template, lock: OutputDirLock) -> dict:
    started, output_dir = time.time(), Path(args.output_dir)
    accelerator, recipe = _start(model_args, data_args, args, lock)
    checkpoint = _prepare_output_dir(data_args, args, recipe, output_dir, accelerator)
    set_seed(args.seed)
    # A model to start from is loaded first: a wrong path or contradicting size flags fail before the corpus.
    pretrained = _load_pretrained(model_args, data_args) if model_args.model_name_or_path else None
    raw = _load_corpus(data_args, args)
    fingerprint = data_fingerprint(raw["train"], data_args) if args.do_train else {}
    if checkpoint is not None:
        check_same_data(checkpoint, fingerprint, args.ignore_data_changes)
    tokenizer = _tokenizer(raw, data_args, args, accelerator, checkpoint, pretrained)
    data = _prepare_data(raw, tokenizer, data_args, args, accelerator)
    paraphrases = read_paraphrases(raw["train"], tokenizer, data_args, recipe.augmentation) if args.do_train else {}
    collator = make_collator(tokenizer)
    if args.do_train:  # the corpus is known: the recipe's choices that depend on it, the batch first
        recipe = recipe.for_corpus(mean_pair_tokens(data.datasets["train"]),
                                   max(data_args.max_source_length, data_args.max_target_length))
    batches = _training_batches(data, collator, tokenizer, paraphrases, data_args, args, recipe, accelerator)
    if batches is not None:
        recipe = recipe.for_run(recipe.run_length(args, batches.steps_per_epoch(args.gradient_accumulation_steps)),
                                saved_dropout(checkpoint))
        if accelerator.is_main_process and recipe.batch_by_rule:
            logger.info(f"the recipe for this corpus: {recipe.batch_line()}")
        if accelerator.is_main_process and "dropout" in recipe.new_model_settings:
            logger.info(f"the recipe for this corpus: {recipe.dropout_line()}")
    model = _model(model_args, data_args, args, recipe, tokenizer, pretrained, checkpoint, data)
    evaluator = Evaluator(accelerator, model, tokenizer, data, collator, data_args, args)
    phases, trainer = {}, None
    if args.do_train:
        trainer = TrainingLoop(accelerator, model, tokenizer, batches, evaluator, args, data_args, recipe,
                               output_dir, active_callbacks())
        if checkpoint is not None:
            trainer.resume(checkpoint)
        trainer.state.data_fingerprint = fingerprint
        if trackers(args):
            start_tracker_logs(accelerator, _hyperparameters(model_args, data_args, args))
        phases["train"] = _train(trainer, model, data, args, output_dir)
    else:
        model.to(accelerator.device).eval()
    state = trainer.state if trainer is not None else RunState()
    if args.do_eval and (validation := _evaluate(evaluator, trainer, state, data, args, phases)):
        phases["eval"] = validation
    if args.do_predict:
        phases["predict"] = evaluator.test()
    results = _results(phases, evaluator, started)
    if accelerator.is_main_process:
        _export(results, phases, model, tokenizer, evaluator, trainer, model_card_template, accelerator,
                model_args=model_args, data_args=data_args, args=args, recipe=recipe, data=data, state=state)
    if args.do_train:
        end_tracker_logs(accelerator)
        if args.push_to_hub and accelerator.is_main_process:
            results["hub_commit"] = push_to_hub(args, output_dir, output_dir, None, "Training finished")
    return results


# ------------------------------------------------------------------------------------------------------ the steps


def _start(model_args: ModelArguments, data_args: DataArguments, args: RunArguments,
           lock: OutputDirLock) -> tuple:
    """Checks before any work, the output directory claimed (locked by the main process), the recipe resolved for
    the device of this process (printed once when training), then Accelerate: (accelerator, recipe)."""
    check_values(model_args, data_args, args)
    check_launch(args)
    _quiet_libraries(args.verbose)
    claim_output_dir(args, lock if launched_rank() == 0 else None)  # the main process, before Accelerate
    recipe = resolve_recipe(model_args, data_args, args, join_processes(args.ddp_timeout).device,
                            launcher_precision())
    accelerator = start_accelerator(args, Path(args.output_dir), recipe.precision,
                                    partial(staging_folder, what="the shared-directory check"))
    if args.do_train and accelerator.is_main_process:
        logger.info(recipe.describe())
    return accelerator, recipe


def _prepare_output_dir(data_args: DataArguments, args: RunArguments, recipe: Recipe, output_dir: Path,
                        accelerator) -> Path | None:
    """The checkpoint to resume from (checked against this run, newer ones set aside on request), or None; a
    training run with --overwrite_output_dir removes the earlier run's checkpoints (also when it continues a
    checkpoint of another directory, which check_output_flags allows), once the resume is checked."""
    checkpoint = None
    if args.resume_from_checkpoint:
        checkpoint = resolve_checkpoint(args.resume_from_checkpoint, output_dir)
        check_resume(checkpoint, args, data_args, recipe, accelerator.num_processes)
    if args.overwrite_output_dir and args.do_train and accelerator.is_main_process:
        remove_checkpoints(output_dir)
    if checkpoint is not None:
        set_newer_checkpoints_aside(checkpoint, output_dir, args.overwrite_newer_checkpoints,
                                    accelerator.is_main_process)
        accelerator.wait_for_everyone()
    return checkpoint


def _load_pretrained(model_args: ModelArguments, data_args: DataArguments):
    """(model, tokenizer) of --model_name_or_path, refused with one line if unusable or contradicted by flags."""
    name = model_args.model_name_or_path
    try:
        model, tokenizer = load_model_and_tokenizer(name, config_overrides=model_args.dropout_overrides())
    except ModelLoadError as error:
        raise UsageError(f"--model_name_or_path: {error}") from error
    if getattr(model.config, "model_type", None) != ScratchTransformerConfig.model_type:
        raise UsageError(f"--model_name_or_path {name} is a {model.config.model_type!r} model: train.py trains "
                         f"and fine-tunes only {ScratchTransformerConfig.model_type!r} models")
    check_model_flags(model_args, data_args, model.config, name)
    logger.info(f"starting from {name}: {model.num_parameters() / 1e6:.1f} M parameters, its tokenizer "
                f"({len(tokenizer)} tokens; --tokenizer_vocab_size is not used)")
    return model, tokenizer


def _load_corpus(data_args: DataArguments, args: RunArguments):
    """The raw splits; without --do_train, no training split."""
    corpus_args = data_args
    if not args.do_train and not data_args.train_file and (data_args.test_file or data_args.validation_file):
        # Evaluating an existing model needs no training file: the loader wants one, so it gets a given file,
        # whose "train" split is dropped below.
        corpus_args = replace(data_args, train_file=data_args.test_file or data_args.validation_file)
    try:
        raw = load_parallel_corpus(corpus_args, seed=args.seed)
    except (CorpusError, ConnectionError) as error:
        raise UsageError(str(error)) from error
    if not args.do_train:  # evaluation only: the training split is not needed
        raw = type(raw)({name: split for name, split in raw.items() if name != "train"})
    return raw


def _tokenizer(raw, data_args: DataArguments, args: RunArguments, accelerator, checkpoint, pretrained):
    """The tokenizer a resumed checkpoint was trained with, the one of --model_name_or_path, or one trained on the
    training split (main process; staged in output_dir for the other processes)."""
    if checkpoint is not None:
        return AutoTokenizer.from_pretrained(checkpoint)
    if pretrained is not None:
        return pretrained[1]
    if accelerator.is_main_process:
        tokenizer = train_tokenizer_on_corpus(
            raw["train"], data_args.source_lang, data_args.target_lang, vocab_size=data_args.tokenizer_vocab_size,
            max_sentences=data_args.tokenizer_max_sentences, seed=args.seed,
            sentinels=data_args.mask_protected_spans,
        )
        tokenizer.model_max_length = max(data_args.max_source_length, data_args.max_target_length)
        stage_tokenizer(tokenizer, Path(args.output_dir))
    accelerator.wait_for_everyone()
    return AutoTokenizer.from_pretrained(tokenizer_staging(Path(args.output_dir)))


def _prepare_data(raw, tokenizer, data_args: DataArguments, args: RunArguments, accelerator) -> TrainingData:
    """Tokenised, filtered splits and the evaluation pairs; refused if nothing is left to train or validate on."""
    started = time.time()
    with accelerator.main_process_first():
        splits, report = preprocess_corpus(raw, tokenizer, data_args)
    logger.info("tokenised and filtered in %.1f s: %s", time.time() - started, "; ".join(
        f"{split} {counts['kept']} of {counts['input']} pairs kept" for split, counts in report.items()))
    if data_args.streaming:
        # Validation and test are read once and kept in memory (bounded by --max_eval/predict_samples);
        # only the training split streams.
        splits = {name: split if name == "train" else Dataset.from_list(list(split)) for name, split in splits.items()}
    if args.do_train and not _has_examples(splits["train"]):
        raise UsageError(f"every training pair was filtered out ({report['train']}): check the "
                         f"language keys and --max_source_length/--max_target_length/--max_length_ratio")
    for split, counts in report.items():
        if counts["empty"]:
            logger.warning(f"{split}: {counts['empty']} of {counts['input']} pairs skipped, a side missing, null "
                           f"or empty")
    data = TrainingData(splits, report, *evaluation_pairs(raw["validation"], data_args),
                        *evaluation_pairs(raw["test"], data_args))
    if (args.do_train or args.do_eval) and not data.eval_sources:
        raise UsageError("the validation split has no usable pairs: give --validation_file with pairs in it")
    return data


def _model(model_args: ModelArguments, data_args: DataArguments, args: RunArguments, recipe: Recipe, tokenizer,
           pretrained, checkpoint: Path | None, data: TrainingData):
    """The model of --model_name_or_path, or a new one of the configured size and the recipe's new-model settings
    (checked against a checkpoint to resume), with the generation settings of evaluation and of the saved model."""
    if pretrained is not None:
        model = pretrained[0]
    else:
        model = ScratchTransformerForConditionalGeneration(recipe.new_model_config(model_args, len(tokenizer)))
    if checkpoint is not None:
        check_same_architecture(checkpoint, model.config)
    config = model.config
    model.generation_config = GenerationConfig(
        decoder_start_token_id=config.decoder_start_token_id, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        # max_new_tokens rather than max_length: a call with its own max_new_tokens then gives no warning.
        num_beams=args.num_beams, max_new_tokens=data_args.max_target_length, early_stopping=args.num_beams > 1,
    )
    if (trained := sentence_tokens(data.datasets.get("train"))) is not None:
        model.generation_config.max_sentence_tokens = trained  # translate_texts cuts longer sentences of documents
    declare_tied_weights(model)
    return model


def _training_batches(data: TrainingData, collator, tokenizer, paraphrases: dict, data_args: DataArguments,
                      args: RunArguments, recipe: Recipe, accelerator) -> TrainingBatches | None:
    """This process's training batches, `collator`'s with the recipe's augmentation (None without --do_train)."""
    if not args.do_train:
        return None
    collator = noise_collator(collator, tokenizer, recipe.augmentation, seed=args.seed,
                              max_source_length=data_args.max_source_length,
                              max_target_length=data_args.max_target_length, paraphrases=paraphrases)
    batching = replace(data_args, max_tokens=recipe.batch_tokens or 0)  # --max_tokens or the recipe's batch rule
    return TrainingBatches(data.datasets["train"], collator, batching, args.per_device_train_batch_size,
                           args.seed, accelerator.num_processes, accelerator.process_index,
                           args.dataloader_num_workers)


def _train(trainer: TrainingLoop, model, data: TrainingData, args: RunArguments, output_dir: Path) -> dict:
    """Train (then average the last checkpoints on request): train_results.json's figures."""
    started = time.time()
    allocator = describe_allocator() if trainer.accelerator.device.type == "cpu" else None
    if allocator is not None and trainer.is_main:
        logger.info(f"memory allocator: {allocator}")
    trainer.train()
    averaged = average_checkpoints(model, output_dir, args.average_checkpoints) if args.average_checkpoints > 1 else []
    phase = {**train_results(trainer, time.time() - started), "filtered": data.filter_report}
    if allocator is not None:
        phase["train_memory_allocator"] = allocator
    if averaged:
        phase["averaged_checkpoints"] = averaged
    return phase


def _evaluate(evaluator: Evaluator, trainer: TrainingLoop | None, state: RunState, data: TrainingData,
              args: RunArguments, phases: dict) -> dict | None:
    """Validation at the end: eval_results.json's figures (None on the processes that do not evaluate). The
    validation of the final weights made during training, if any, is not made again."""
    started = time.time()
    made = trainer.final_validation if trainer is not None else None
    validation = dict(made) if made and trainer.is_main else evaluator.validate(state)
    if not validation:
        return None
    runtime = validation.get("eval_runtime", time.time() - started)  # a validation made during training: its own
    phase = {**{key: value for key, value in validation.items() if key not in ("step", "eval_runtime")},
             "eval_samples": len(data.eval_sources), "eval_runtime": round(runtime, 2),
             "eval_samples_per_second": round(len(data.eval_sources) / max(runtime, 1e-9), 3)}
    if args.do_train:
        phase["epoch"] = phases["train"]["epoch"]
    return phase


def _results(phases: dict, evaluator: Evaluator, started: float) -> dict:
    """all_results.json: every phase's figures, a divergence warning if one was given, the total runtime."""
    results = {key: value for phase in phases.values() for key, value in phase.items()}
    if evaluator.divergence:
        results["divergence_warning"] = evaluator.divergence
    results["total_runtime"] = round(time.time() - started, 1)
    return results


def _export(results: dict, phases: dict, model, tokenizer, evaluator: Evaluator, trainer: TrainingLoop | None,
            model_card_template, accelerator, **run) -> None:
    """The main process writes the output directory: the Hub-format model after training (with a model card when
    a template is given), the result files only otherwise."""
    output_dir = Path(run["args"].output_dir)
    if trainer is None:
        save_results(output_dir, results, phases, evaluator.test_predictions)
        return
    files = result_files(results, phases, evaluator.test_predictions)
    if evaluator.test_predictions is not None:  # the demo's example sentences, beside their translations
        files[TEST_SOURCES_FILE] = as_lines(evaluator.data.test_sources)
    if model_card_template is not None:
        files["README.md"] = model_card(
            model_card_template, model=model, results=results, predictions=evaluator.test_predictions,
            hardware=hardware_description(accelerator.device, accelerator.num_processes), output_dir=output_dir,
            **run)
    save_model(output_dir, model, tokenizer, files, trainer.state.history, trainer.last_checkpoint)


# ------------------------------------------------------------------------------------------------------ helpers


def _hyperparameters(model_args: ModelArguments, data_args: DataArguments, args: RunArguments) -> dict:
    """Every flag with a simple value, for the trackers."""
    flat = {**asdict(model_args), **asdict(data_args), **asdict(args)}
    return {key: value for key, value in flat.items() if isinstance(value, (int, float, str, bool))}


def _quiet_libraries(verbose: bool) -> None:
    """One log line per phase instead of a `datasets` progress bar per map/filter, no transformers bar per save, no
    warning about the declared weight ties at every checkpoint; --verbose shows them again."""
    if verbose:
        datasets.enable_progress_bars()
        transformers.utils.logging.enable_progress_bar()
    else:
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()  # "Writing model shards" at every save
    quiet_save_warnings(not verbose)


def _has_examples(split) -> bool:
    return next(iter(split), None) is not None if isinstance(split, IterableDataset) else len(split) > 0


# ------------------------------------------------------------------------------------------------ command line


def main(argv: list[str] | None = None, model_card_template: str | Path | None = None) -> int:
    """Command-line entry: 0 on success, 2 for a usage error, 1 for a training fault, 130/143 on SIGINT/SIGTERM."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    transformers.logging.set_verbosity_warning()
    previous_sigterm = _raise_on_sigterm()
    try:
        model_args, data_args, args = parse_arguments(argv)
        results = run_training(model_args, data_args, args, model_card_template)
    except SystemExit:  # --help (argparse errors are UsageErrors, see parse_arguments)
        raise
    except (ScratchTransformerError, KeyboardInterrupt) as error:
        return _fail(error, debug)
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
        restore_thread_excepthook()  # a run that failed before its trackers ended
    if launched_rank() == 0:  # the other processes print errors only
        try:
            print_results(json.dumps({key: value for key, value in results.items() if key != "filtered"}, indent=1),
                          Path(args.output_dir) / ALL_RESULTS_FILE)
        except EnvironmentFault as error:
            return _fail(error, debug)
    return 0


def _raise_on_sigterm():
    """Outside the training loop (whose handler saves a checkpoint first) SIGTERM ends the run like Ctrl-C, with a
    message and exit code 143 rather than a silent kill. Returns the previous handler (None off the main thread)."""
    def interrupt(signum, frame):
        raise RunInterrupted("SIGTERM received outside the training loop: nothing was saved since the last "
                             "checkpoint, if any", signum)
    try:
        return signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        return None


def _fail(error: BaseException, debug: bool) -> int:
    """One line on stderr (and to the launcher) for what ended the run; its exit status (errors.exit_code)."""
    if isinstance(error, KeyboardInterrupt):  # outside the training loop, whose handler saves a checkpoint first
        message = "interrupted outside the training loop: nothing was saved since the last checkpoint, if any"
    else:
        heading = ("interrupted" if isinstance(error, RunInterrupted) else
                   "training stopped" if isinstance(error, TrainingFault) else "error")
        message = f"{heading}: {error}"
    if debug:
        logger.exception(message)
    print(message, file=sys.stderr)
    report_to_launcher(message)
    return exit_code(error)
