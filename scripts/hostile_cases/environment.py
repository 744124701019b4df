"""Hostile environments of a training run: a full disk at each write (on a real small tmpfs, see
hostile_inputs.SmallDisk: these cases are skipped with the reason where mounting needs root), a read-only output
directory, a name too long; and the output-directory and resume checks (changed training data, contradictory flags,
evaluating into a model directory). Each case asserts the class of outcome and that nothing saved was lost."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hostile_inputs import PAGE, Case, Failure, SmallDisk, Workspace, disk_usage, one_line, run_train, tiny_flags


def _digests(directory: Path) -> dict:
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def _left(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir()) if directory.is_dir() else []


def _expect_left(directory: Path, expected: list[str]) -> None:
    """After a failed write: exactly `expected` in the directory (no .tmp, no .staging-*, no .tokenizer, no lock)."""
    if _left(directory) != expected:
        raise Failure(f"after the failed write {directory} holds {_left(directory)}, expected {expected}")


def _complete_checkpoints(directory: Path) -> list[str]:
    from hf_scratch_transformer.training.run_directory import list_checkpoints

    return [path.name for path in list_checkpoints(directory)]


def _sizes(ws: Workspace) -> dict:
    """Pages a checkpoint, the tokenizer and the weights of the workspace's tiny run take (the same flags give the
    same sizes)."""
    run = ws.finished_run()
    return {"checkpoint": disk_usage(run / "checkpoint-2"), "weights": disk_usage(run / "model.safetensors"),
            "tokenizer": disk_usage(run / "tokenizer.json", run / "tokenizer_config.json")}


# ------------------------------------------------------------------------------------------- a full disk at each write


def _full_at_the_lock(ws: Workspace) -> str:
    with SmallDisk(ws.fresh("disk"), PAGE) as disk:
        (disk.path / "ballast").write_bytes(b"x" * PAGE)  # whatever filled the disk stays
        run = disk.path / "run"
        message = one_line(*run_train(tiny_flags(run)), 1, f"could not write the lock in {run}",
                           "No space left on device", "free space")
        _expect_left(disk.path, ["ballast", "run"])
        _expect_left(run, [])
    return message


def _full_at_the_tokenizer(ws: Workspace) -> str:
    with SmallDisk(ws.fresh("disk"), 3 * PAGE) as disk:
        run = disk.path / "run"
        message = one_line(*run_train(tiny_flags(run)), 1, f"could not write the tokenizer in {run / '.tokenizer'}",
                           "No space left on device", "free there", "run the same command again")
        _expect_left(run, [])
    return message


def _full_at_a_checkpoint(ws: Workspace) -> str:
    sizes = _sizes(ws)
    with SmallDisk(ws.fresh("disk"), PAGE + sizes["tokenizer"] + sizes["checkpoint"] * 3 // 2) as disk:
        run = disk.path / "run"
        message = one_line(*run_train(tiny_flags(run, max_steps=4, save_steps=2)), 1,
                           f"could not write checkpoint-4 in {run}", "No space left on device", "needed",
                           f"the last complete checkpoint, {run / 'checkpoint-2'}, is unchanged",
                           "--resume_from_checkpoint latest")
        _expect_left(run, ["checkpoint-2"])
        if _complete_checkpoints(run) != ["checkpoint-2"]:
            raise Failure("checkpoint-2 is no longer complete")
    return message


def _full_at_the_final_save(ws: Workspace) -> str:
    sizes = _sizes(ws)
    with SmallDisk(ws.fresh("disk"), PAGE + sizes["tokenizer"] + sizes["checkpoint"] + sizes["weights"] // 2) as disk:
        run = disk.path / "run"
        message = one_line(*run_train(tiny_flags(run, max_steps=2, save_steps=0)), 1,
                           f"could not write the final model in {run}", "No space left on device",
                           f"the last checkpoint is {run / 'checkpoint-2'}", "--resume_from_checkpoint latest")
        _expect_left(run, ["checkpoint-2"])
    return message


def _full_at_the_result_files(ws: Workspace) -> str:
    """An evaluation of a model into a small disk that holds a file of the user's."""
    model = ws.model_dir()
    with SmallDisk(ws.fresh("disk"), 2 * PAGE) as disk:
        run = disk.path / "run"
        run.mkdir()
        (run / "notes.txt").write_text("mine")
        flags = tiny_flags(run, model_name_or_path=model, do_predict=True)
        message = one_line(*run_train(flags), 1, f"could not write the result files in {run}",
                           "No space left on device", "the files there before are unchanged")
        _expect_left(run, ["notes.txt"])
    return message


def _tracker_logs_case(name: str, read_only: bool, *parts) -> Case:
    """The trackers' folder (output_dir/runs) on its own small file system, full or read-only."""
    def check(ws: Workspace) -> str:
        run = ws.fresh("run")
        with SmallDisk(run / "runs", PAGE) as disk:
            if read_only:
                disk.read_only()
            flags = tiny_flags(run, report_to="tensorboard", overwrite_output_dir=True)
            message = one_line(*run_train(flags), 1, f"could not write the tensorboard logs in {run / 'runs'}", *parts)
        _expect_left(run, ["runs"])
        return message
    return Case(name, "faults", check)


def _read_only_output_dir(ws: Workspace) -> str:
    with SmallDisk(ws.fresh("disk"), 64 * PAGE) as disk:
        (disk.path / "run").mkdir()
        disk.read_only()
        return one_line(*run_train(tiny_flags(disk.path / "run")), 1, f"could not write the lock in {disk.path}/run",
                        "Read-only file system", "make it writable or choose another --output_dir")


def _name_too_long(ws: Workspace) -> str:
    run = ws.fresh("long") / ("x" * 300)
    return one_line(*run_train(tiny_flags(run)), 1, "File name too long", "300 characters", "allows 255",
                    "choose a shorter --output_dir")


FAULT_CASES = [
    Case("disk_full_at_the_lock", "faults", _full_at_the_lock),
    Case("disk_full_at_the_tokenizer", "faults", _full_at_the_tokenizer),
    Case("disk_full_at_a_checkpoint", "faults", _full_at_a_checkpoint),
    Case("disk_full_at_the_final_save", "faults", _full_at_the_final_save),
    Case("disk_full_at_the_result_files", "faults", _full_at_the_result_files),
    _tracker_logs_case("disk_full_at_the_tensorboard_logs", False, "No space left on device"),
    _tracker_logs_case("read_only_tensorboard_logs", True, "Read-only file system"),
    Case("read_only_output_dir", "faults", _read_only_output_dir),
    Case("output_dir_name_too_long", "faults", _name_too_long),
]


# ------------------------------------------------------------------------------------------ output directory checks


def _refused_unchanged(run: Path, argv: list[str], *parts) -> str:
    """A refusal (exit 2) that leaves every file of `run` as it was."""
    before = _digests(run)
    message = one_line(*run_train(argv), 2, *parts)
    if _digests(run) != before:
        raise Failure(f"the refused run changed files in {run}")
    return message


def _overwrite_with_resume(ws: Workspace) -> str:
    run = ws.finished_run()
    return _refused_unchanged(run, tiny_flags(run, overwrite_output_dir=True, resume_from_checkpoint="latest"),
                              "--overwrite_output_dir", "--resume_from_checkpoint latest", "give only one")


def _evaluation_into_a_model_directory(flag: str, replaced: str) -> Case:
    def check(ws: Workspace) -> str:
        model = ws.model_dir()
        return _refused_unchanged(model, tiny_flags(model, model_name_or_path=model, **{flag: True}),
                                  str(model), replaced, "--overwrite_output_dir")
    return Case(f"{flag}_into_a_model_directory", "output", check)


OUTPUT_CASES = [
    Case("overwrite_together_with_resume", "output", _overwrite_with_resume),
    _evaluation_into_a_model_directory("do_predict", "generated_predictions.txt"),
    _evaluation_into_a_model_directory("do_eval", "eval_results.json"),
]


# ------------------------------------------------------------------------------------------------- resume checks


def _changed_corpus(ws: Workspace) -> str:
    """A run on a corpus file, then more pairs appended to that file before resuming."""
    corpus = ws.corpus()
    run = ws.fresh("run")
    code, err = run_train(tiny_flags(run, train_file=corpus, max_steps=2, save_steps=2))
    if code != 0:
        raise Failure(f"the first run failed ({code}): {err.strip().splitlines()[-1:]}")
    with corpus.open("a", encoding="utf-8") as more:
        more.write(json.dumps({"translation": {"en": "A new line.", "es": "Una línea nueva."}}) + "\n")
    return _refused_unchanged(run, tiny_flags(run, train_file=corpus, max_steps=4, save_steps=2,
                                              resume_from_checkpoint="latest"),
                              "the training data changed since", str(corpus), "bytes", "--ignore_data_changes")


def _max_steps_below(ws: Workspace) -> str:
    run = ws.finished_run()
    return _refused_unchanged(run, tiny_flags(run, max_steps=3, resume_from_checkpoint="latest"),
                              "is at step 4", "past the 3 steps", "--max_steps")


def _epochs_below(ws: Workspace) -> str:
    run = ws.finished_run()
    return _refused_unchanged(run, tiny_flags(run, max_steps=-1, num_train_epochs=0.01,
                                              resume_from_checkpoint="latest"),
                              "is at step 4", "past the 1 steps", "--num_train_epochs")


def _checked_before_moving_aside(ws: Workspace) -> str:
    run = ws.finished_run()
    flags = tiny_flags(run, resume_from_checkpoint=str(run / "checkpoint-2"), overwrite_newer_checkpoints=True,
                       learning_rate=0.01)
    message = _refused_unchanged(run, flags, "--learning_rate 0.002 -> 0.01")
    if list(run.glob("abandoned-after-*")) or not (run / "checkpoint-4").is_dir():
        raise Failure("checkpoint-4 was moved aside by a resume that was then refused")
    return message


def _unreadable_run_state(ws: Workspace) -> str:
    run = ws.finished_run()
    state = run / "checkpoint-4" / "run_state.json"
    state.write_bytes(b"\x00" * state.stat().st_size)  # same size: the completion marker still agrees
    return _refused_unchanged(run, tiny_flags(run, max_steps=6, resume_from_checkpoint="latest"),
                              "checkpoint-4 has no readable run_state.json", "resume from another checkpoint-N")


RESUME_CASES = [
    Case("resume_on_a_changed_corpus_file", "resume", _changed_corpus),
    Case("resume_with_max_steps_below_the_checkpoint", "resume", _max_steps_below),
    Case("resume_with_epochs_ending_before_the_checkpoint", "resume", _epochs_below),
    Case("refused_resume_moves_no_checkpoint_aside", "resume", _checked_before_moving_aside),
    Case("resume_from_an_unreadable_run_state", "resume", _unreadable_run_state),
]

CASES = FAULT_CASES + OUTPUT_CASES + RESUME_CASES
