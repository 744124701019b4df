"""Hostile environments of a training run: a full disk at each write (on a real small tmpfs, see
hostile_inputs.SmallDisk: these cases are skipped with the reason where mounting needs root), a read-only output
directory, a name too long; and the output-directory and resume checks (changed training data, contradictory flags,
evaluating into a model directory, a checkpoint of another run continued into a finished one). Issue 42's runs: what
a launcher or a shell leaves in the environment (WORLD_SIZE, accelerate's simple launcher, its --mixed_precision,
OMP_NUM_THREADS), --cpu_threads above the cores, the results printed into a closed pipe or /dev/full, the files'
permissions under the umask, the log's warnings and the model card's links. Each case asserts the class of outcome
and that nothing saved was lost."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from hostile_inputs import (
    PAGE,
    PAIRS,
    Case,
    Failure,
    SmallDisk,
    Workspace,
    captured_logs,
    disk_usage,
    one_line,
    run_train,
    tiny_flags,
)


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



# ----------------------------------------------------------------------------- a checkpoint of another run (issue 42)


def _resume_into_another_finished_run(ws: Workspace) -> str:
    """`--resume_from_checkpoint A/checkpoint-4 --output_dir B` where B holds a finished run: B's model would be
    replaced and its checkpoints rotated away."""
    other, run = ws.finished_run(), ws.finished_run()
    before = _digests(other)
    checkpoint = other / "checkpoint-4"
    message = _refused_unchanged(run, tiny_flags(run, max_steps=6, resume_from_checkpoint=str(checkpoint)),
                                 f"--resume_from_checkpoint {checkpoint}", str(run), "a finished run",
                                 "--resume_from_checkpoint latest", "--overwrite_output_dir")
    if _digests(other) != before:
        raise Failure(f"the refused resume changed {other}")
    return message


def _trained(argv: list[str], **env) -> str:
    code, err = run_train(argv, env=env or None)
    if code != 0:
        raise Failure(f"exit status {code}: {err.strip().splitlines()[-1:] if err.strip() else ''}")
    return err


def _resume_own_checkpoint_by_path(ws: Workspace) -> str:
    """Resuming into the run's own directory, its checkpoint named by path, goes on as before."""
    run = ws.finished_run()
    _trained(tiny_flags(run, max_steps=6, resume_from_checkpoint=str(run / "checkpoint-4")))
    if "checkpoint-6" not in _complete_checkpoints(run):
        raise Failure(f"no checkpoint-6 after resuming {run / 'checkpoint-4'}: {_left(run)}")
    return "resumed at step 4, checkpoint-6 written"


def _overwrite_continues_another_run(ws: Workspace) -> str:
    """With --overwrite_output_dir the other run's checkpoint continues into the finished directory, which is
    started over (its own checkpoints go); the other run is not touched."""
    other, run = ws.finished_run(), ws.finished_run()
    before = _digests(other)
    _trained(tiny_flags(run, max_steps=6, resume_from_checkpoint=str(other / "checkpoint-4"),
                        overwrite_output_dir=True))
    if _complete_checkpoints(run) != ["checkpoint-6"] or _digests(other) != before:
        raise Failure(f"{run} holds {_complete_checkpoints(run)} (expected checkpoint-6 alone), or {other} changed")
    return "continued from the other run at step 4 into the directory started over: checkpoint-6 alone"


ANOTHER_RUN_CASES = [
    Case("resume_into_another_finished_run", "resume", _resume_into_another_finished_run),
    Case("resume_own_checkpoint_by_path", "resume", _resume_own_checkpoint_by_path),
    Case("overwrite_continues_another_runs_checkpoint", "resume", _overwrite_continues_another_run),
]


# ----------------------------------------------------------------------- what the launcher left in the environment


def _refused_before_any_work(name: str, env: dict, *parts, **flags) -> Case:
    """train.py run with `env` added to the environment stops with one line (exit 2) and creates nothing."""
    def check(ws: Workspace) -> str:
        output_dir = ws.root / f"never-{name}"
        message = one_line(*run_train(tiny_flags(output_dir, **flags), env=env), 2, *parts)
        if output_dir.exists():
            raise Failure(f"{output_dir} was created although the launch was refused before any work")
        return message
    return Case(name, "launch", check)


NO_LAUNCHER = {"RANK": None, "LOCAL_RANK": None, "MASTER_ADDR": None, "MASTER_PORT": None}


def _launcher_precision_applies(ws: Workspace) -> str:
    """`accelerate launch --mixed_precision bf16 train.py` without --bf16: the run trains in bf16 and says why."""
    run = ws.fresh("launcher-bf16")
    with captured_logs("hf_scratch_transformer") as log:
        _trained(tiny_flags(run, bf16=None, max_steps=2, save_steps=0), ACCELERATE_MIXED_PRECISION="bf16")
    precision = json.loads((run / "train_results.json").read_text())["recipe"]["precision"]
    line = "bf16 mixed precision (accelerate launch --mixed_precision bf16)"
    if precision != "bf16" or line not in log.getvalue():
        raise Failure(f"trained in {precision}; the log does not say {line!r}")
    return f"trained in bf16: {line}"


LAUNCH_CASES = [
    _refused_before_any_work("world_size_left_in_the_environment", {"WORLD_SIZE": "2", **NO_LAUNCHER},
                             "WORLD_SIZE=2", "no launcher", "unset WORLD_SIZE", "accelerate launch --multi_gpu"),
    _refused_before_any_work("accelerate_simple_launcher_num_processes_2",
                             {"ACCELERATE_USE_CPU": "False", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                              "LOCAL_RANK": None, "WORLD_SIZE": None},
                             "--num_processes N", "starts only one process", "--multi_gpu"),
    _refused_before_any_work("launcher_bf16_against_bf16_false", {"ACCELERATE_MIXED_PRECISION": "bf16"},
                             "--mixed_precision bf16", "--bf16 false", "contradict"),
    _refused_before_any_work("launcher_fp8", {"ACCELERATE_MIXED_PRECISION": "fp8"}, "--mixed_precision fp8",
                             "bf16, fp16 or no", bf16=None),
    Case("launcher_bf16_applies", "launch", _launcher_precision_applies),
]


# ---------------------------------------------------------------------------------------------- CPU threads


def _thread_results(ws: Workspace, name: str, env: dict | None = None, **flags) -> tuple[dict, str]:
    """(train_results.json, the log) of a tiny run with `env` added to the environment."""
    run = ws.fresh(name)
    with captured_logs("hf_scratch_transformer") as log:
        _trained(tiny_flags(run, max_steps=2, save_steps=0, **flags), **(env or {}))
    return json.loads((run / "train_results.json").read_text()), log.getvalue()


def _cpu_threads_above_the_cores(ws: Workspace) -> str:
    from hf_scratch_transformer.cpu_threads import thread_limit

    limit = thread_limit()
    results, log = _thread_results(ws, "threads-999", cpu_threads=999)
    warning = f"--cpu_threads 999 is more than this process may use ({limit.reason}): {limit.threads} thread(s) used"
    if results["train_cpu_threads"] != limit.threads or warning not in log:
        raise Failure(f"trained with {results['train_cpu_threads']} threads; the log does not say {warning!r}")
    return warning


def _omp_num_threads_is_a_limit(ws: Workspace) -> str:
    """A user's OMP_NUM_THREADS=1 (no launcher) bounds the thread tuner, and the log says so."""
    results, log = _thread_results(ws, "threads-omp", {"OMP_NUM_THREADS": "1", "ACCELERATE_MIXED_PRECISION": None,
                                                       "TORCHELASTIC_RUN_ID": None})
    line = "1 CPU thread(s) for training (the most it may use, OMP_NUM_THREADS=1"
    if results["train_cpu_threads"] != 1 or "OMP_NUM_THREADS=1" not in results["train_cpu_thread_limit"] \
            or line not in log:
        raise Failure(f"{results['train_cpu_threads']} threads, limit {results.get('train_cpu_thread_limit')!r}; "
                      f"the log does not say {line!r}")
    return line + ")"


def _launchers_omp_default_is_no_limit(ws: Workspace) -> str:
    """Under accelerate launch, OMP_NUM_THREADS=1 is the launcher's default for every process: no limit, said so."""
    from hf_scratch_transformer.cpu_threads import thread_limit

    results, log = _thread_results(ws, "threads-launcher",
                                   {"OMP_NUM_THREADS": "1", "ACCELERATE_MIXED_PRECISION": "no"})
    note = "OMP_NUM_THREADS=1 is what accelerate launch sets for each process when given no value"
    limit = results.get("train_cpu_thread_limit", "")
    unpinned = thread_limit({key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}).threads
    if not limit.startswith(f"{unpinned} (") or note not in limit or note not in log:
        raise Failure(f"limit {limit!r}; the log does not say {note!r}")
    return note


THREAD_CASES = [Case("cpu_threads_above_the_cores", "threads", _cpu_threads_above_the_cores),
                Case("omp_num_threads_is_a_limit", "threads", _omp_num_threads_is_a_limit),
                Case("launchers_omp_default_is_no_limit", "threads", _launchers_omp_default_is_no_limit)]


# ------------------------------------------------------------------------------- train.py's own standard output


def _results_into_a_closed_pipe(ws: Workspace) -> str:
    """`python train.py ... | head -1` where head has gone when the results are printed: exit 0, nothing on
    stderr after the log, the model saved."""
    run = ws.fresh("pipe")
    reader, writer = os.pipe()
    os.close(reader)
    with os.fdopen(writer, "w", encoding="utf-8") as pipe:
        code, err = run_train(tiny_flags(run, max_steps=2, save_steps=0), stdout=pipe)
    last = err.strip().splitlines()[-1:]
    if code != 0 or "Traceback" in err or "Error" in err or not (run / "model.safetensors").is_file():
        raise Failure(f"exit status {code}: {last}")
    return "exit status 0, the model saved, no error"


def _results_into_dev_full(ws: Workspace) -> str:
    run = ws.fresh("full")
    with open("/dev/full", "w", encoding="utf-8") as full:
        code, err = run_train(tiny_flags(run, max_steps=2, save_steps=0), stdout=full)
    message = one_line(code, err, 1, "no space left on device writing standard output",
                       f"saved in {run / 'all_results.json'}")
    if not (run / "model.safetensors").is_file():
        raise Failure("the model was not saved")
    return message


STREAM_CASES = [Case("train_results_into_a_closed_pipe", "streams", _results_into_a_closed_pipe),
                Case("train_results_into_dev_full", "streams", _results_into_dev_full)]


# ---------------------------------------------------------------------------------- files, log and model card


def _files_follow_the_umask(ws: Workspace) -> str:
    """Every file of the output directory (the model, its checkpoints) has the mode the umask gives a new file:
    0644 under 022, 0640 under 027 (safetensors alone wrote 0600)."""
    seen = []
    for umask in (0o022, 0o027):
        run = ws.fresh(f"umask-{umask:03o}")
        previous = os.umask(umask)
        try:
            _trained(tiny_flags(run, max_steps=2, save_steps=2))
        finally:
            os.umask(previous)
        expected = 0o666 & ~umask
        wrong = {str(path.relative_to(run)): f"{path.stat().st_mode & 0o777:04o}" for path in run.rglob("*")
                 if path.is_file() and path.stat().st_mode & 0o777 != expected}
        if wrong:
            raise Failure(f"under umask {umask:03o} these files are not {expected:04o}: {wrong}")
        seen.append(f"{expected:04o} under umask {umask:03o}")
    return "every file " + ", ".join(seen)


def _no_token_indices_warning(ws: Workspace) -> str:
    """A training source far over --max_source_length 64 (a whole chapter on one line, as the shipped corpus has
    one), with paraphrases: it is read for the paraphrase table and dropped as too long before the model, so
    transformers' "Token indices sequence length is longer than ... indexing errors" warning must not be printed."""
    from transformers import AutoTokenizer

    chapter = " ".join(en for en, _ in PAIRS[:6]) * 12
    records = [{"translation": {"en": en, "es": es}, "paraphrases": {"en": [en.replace("God", "the Lord")]}}
               for en, es in PAIRS] + [{"translation": {"en": chapter, "es": chapter},
                                        "paraphrases": {"en": [chapter.lower()]}}]
    good, run = ws.corpus(), ws.fresh("warning")
    train = ws.corpus(records)
    with captured_logs("transformers", "hf_scratch_transformer") as log:
        _trained(tiny_flags(run, max_steps=2, save_steps=0, train_file=str(train), validation_file=str(good),
                            test_file=str(good)))
    if "Token indices sequence length" in log.getvalue():
        raise Failure("the log warns: " + next(line for line in log.getvalue().splitlines() if "Token indices" in line))
    tokenizer = AutoTokenizer.from_pretrained(run)
    length = len(tokenizer(chapter, verbose=False)["input_ids"])
    if length <= tokenizer.model_max_length:  # the run did meet an over-long text, or the case proves nothing
        raise Failure(f"the long source has {length} tokens, not over {tokenizer.model_max_length}: proves nothing")
    return f"a source of {length} tokens (limit {tokenizer.model_max_length}): no 'Token indices' warning"


def _model_card_links(ws: Workspace) -> str:
    """The model card links only what exists: no page of a package index the project is not published on, and
    every relative link names a file of the model directory."""
    run = ws.finished_run()
    card = (run / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", card) + re.findall(r"https?://[^\s)>\]]+", card)
    dead = [link for link in links if "pypi.org" in link or
            (not re.match(r"[a-z]+://|#|mailto:", link) and not (run / link).exists())]
    if dead:
        raise Failure(f"the model card links what does not exist: {dead}")
    return f"{len(links)} link(s), none dead"


FILE_CASES = [Case("model_files_follow_the_umask", "output", _files_follow_the_umask),
              Case("no_token_indices_warning", "output", _no_token_indices_warning),
              Case("model_card_links_only_what_exists", "output", _model_card_links)]

CASES = FAULT_CASES + OUTPUT_CASES + RESUME_CASES + ANOTHER_RUN_CASES + LAUNCH_CASES + THREAD_CASES + STREAM_CASES \
    + FILE_CASES
