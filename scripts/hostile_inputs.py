#!/usr/bin/env python
"""Try every hostile input train.py, hf-scratch-translate and the pipeline are known to meet; count the clean ones.

    python scripts/hostile_inputs.py            # all cases, a line per case, then "N hostile cases tried: M handled cleanly"
    python scripts/hostile_inputs.py -k corpus  # only cases whose category or name contains "corpus"

A case is handled cleanly when the program ends as documented: for a refusal, exit status 2 (1 for a failed run),
a message of ONE line (no traceback) that names the offending value and says what to do; for inputs that must work
(YAML's `1e-3`, `pipeline([])`...), the documented result. Runs in-process on small files in a temporary directory;
a tiny training run (a few seconds) provides the checkpoints of the resume cases. tests/test_hostile_inputs.py runs
the same cases under pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PAIRS = [
    ("In the beginning God created the heavens and the earth.", "En el principio creó Dios los cielos y la tierra."),
    ("And God said, Let there be light.", "Y dijo Dios: Sea la luz."),
    ("The earth was without form.", "Y la tierra estaba desordenada."),
    ("God saw the light, that it was good.", "Y vio Dios que la luz era buena."),
    ("There was evening and there was morning.", "Y fue la tarde y la mañana."),
    ("Jesus wept.", "Y lloró Jesús."),
] * 4


class Failure(AssertionError):
    """The case was not handled cleanly; the message says how."""


class Skipped(Exception):
    """The case cannot run here (the message says why: e.g. mounting a small file system needs root)."""


@dataclass
class Case:
    name: str
    category: str
    check: Callable[["Workspace"], str]  # returns what was seen (the message); raises Failure otherwise


class Workspace:
    """A temporary directory with the files the cases need, each made once on first use."""

    def __init__(self, root: Path):
        self.root = root
        self._finished: Path | None = None
        self._model: Path | None = None
        self._counter = 0

    def fresh(self, name: str) -> Path:
        self._counter += 1
        path = self.root / f"{self._counter:03d}-{name}"
        path.mkdir(parents=True)
        return path

    def corpus(self, records=None, name="train.jsonl") -> Path:
        records = records if records is not None else [{"translation": {"en": en, "es": es}} for en, es in PAIRS]
        path = self.fresh("corpus") / name
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        return path

    def finished_run(self) -> Path:
        """A tiny run stopped at step 4 with checkpoint-2 and checkpoint-4 (copied per case before use)."""
        if self._finished is None:
            output_dir = self.root / "finished-run"
            code, err = run_train(tiny_flags(output_dir, max_steps=4, save_steps=2))
            if code != 0:
                raise RuntimeError(f"the tiny training run failed ({code}): {err[-2000:]}")
            self._finished = output_dir
        copy = self.fresh("run")
        shutil.rmtree(copy)
        shutil.copytree(self._finished, copy)
        return copy

    def model_dir(self) -> Path:
        """The tiny run's final model (copied per case before use)."""
        run = self.finished_run()
        for checkpoint in run.glob("checkpoint-*"):
            shutil.rmtree(checkpoint)
        return run


PAGE = 4096  # tmpfs counts whole pages


def pages(size: int) -> int:
    """Bytes a file of `size` bytes takes on a tmpfs."""
    return -(-size // PAGE) * PAGE


def disk_usage(*paths: Path) -> int:
    """What the files under `paths` would take on a tmpfs (pages)."""
    files = [file for path in paths for file in ([path] if path.is_file() else path.rglob("*")) if file.is_file()]
    return sum(pages(file.stat().st_size) for file in files)


class SmallDisk:
    """A real small file system for the environment faults: a tmpfs of `size` bytes mounted at `path` (made if
    missing), which `resize` grows or shrinks and `read_only` remounts read-only; unmounted on exit. Mounting needs
    root: otherwise (or if the mount is refused) entering raises Skipped with the reason."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = Path(path), size

    def __enter__(self) -> "SmallDisk":
        if os.geteuid() != 0 or not shutil.which("mount"):
            raise Skipped("a real full disk needs a small tmpfs, and mounting one needs root (run the tests as root)")
        self.path.mkdir(parents=True, exist_ok=True)
        self._mount("-t", "tmpfs", "-o", f"size={self._kib(self.size)}k", "tmpfs", str(self.path))
        return self

    def resize(self, size: int) -> None:
        self._mount("-o", f"remount,size={self._kib(size)}k", str(self.path))
        self.size = size

    def read_only(self) -> None:
        self._mount("-o", "remount,ro", str(self.path))

    def __exit__(self, *exc) -> None:
        if subprocess.run(["umount", str(self.path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)  # a file still open: detach it

    @staticmethod
    def _kib(size: int) -> int:
        return max(1, -(-size // 1024))

    @staticmethod
    def _mount(*args: str) -> None:
        done = subprocess.run(["mount", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise Skipped(f"mount {' '.join(args)} was refused ({done.stderr.strip()}): no small tmpfs here")


def tiny_flags(output_dir, **overrides) -> list[str]:
    flags = {"preset": "tiny", "output_dir": str(output_dir), "max_train_samples": 200, "max_eval_samples": 8,
             "max_predict_samples": 4, "tokenizer_vocab_size": 400, "max_tokens": 512, "max_source_length": 64,
             "max_target_length": 64, "max_steps": 4, "logging_steps": 2, "save_steps": 2, "eval_steps": 0,
             "warmup_steps": 2, "eval_max_new_tokens": 8, "num_beams": 1, "report_to": "none",
             "max_position_embeddings": 128, "bf16": False}  # fp32 on every CPU (the default follows its bf16 units)
    from hf_scratch_transformer.training.arguments import flags_to_argv

    # "{run}" in a value stands for the output directory (resume cases name a checkpoint inside it)
    flags.update({key: value.replace("{run}", str(output_dir)) if isinstance(value, str) else value
                  for key, value in overrides.items()})
    return flags_to_argv(flags)


def run_train(argv: list[str], env: dict | None = None, stdout=None) -> tuple[int, str]:
    """train.py's main in this process: (exit status, what it printed on stderr). `env` is added to the environment
    for the run (a value None removes the variable); `stdout` replaces standard output (default: a buffer)."""
    from hf_scratch_transformer.training.run import main

    err = io.StringIO()
    saved_env = {key: os.environ.get(key) for key in (env or {})}
    os.environ.update({key: value for key, value in (env or {}).items() if value is not None})
    for key in [key for key, value in (env or {}).items() if value is None]:
        os.environ.pop(key, None)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(stdout or io.StringIO()):
            code = main(argv, REPO / "model_card.md")
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return code, err.getvalue()


@contextlib.contextmanager
def captured_logs(*names: str):
    """A buffer of what the loggers `names` log (INFO and up) inside the block, whatever logging.disable and their
    levels say (main() of this script disables the runs' log lines; both are restored after)."""
    import logging

    buffer, disabled = io.StringIO(), logging.root.manager.disable
    handler = logging.StreamHandler(buffer)
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    logging.disable(logging.NOTSET)
    for logger in loggers:
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
    try:
        yield buffer
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
        logging.disable(disabled)


def run_cli(argv: list[str], stdin: bytes | None = None) -> tuple[int, str]:
    """hf-scratch-translate's main in this process: (exit status, stderr)."""
    from hf_scratch_transformer.translation import cli

    err = io.StringIO()
    saved_stdin = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin if stdin is not None else b""), encoding="utf-8")
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main([str(a) for a in argv])
    finally:
        sys.stdin = saved_stdin
    return code, err.getvalue()


def one_line(code: int, err: str, expected_code: int, *parts: str) -> str:
    """The exit status is `expected_code` and stderr ends in one line naming every part; returns that line."""
    if "Traceback" in err:
        raise Failure(f"a traceback: {err.strip().splitlines()[-1] if err.strip() else ''}")
    lines = [line for line in err.strip().splitlines() if line.strip()]
    message = lines[-1] if lines else ""
    if code != expected_code:
        raise Failure(f"exit status {code}, expected {expected_code}: {message}")
    if message.startswith(("error: ", "hf-scratch-translate: error: ", "hf-scratch-demo: error: ",
                           "training stopped: ")) is False:
        raise Failure(f"the last line is not an error message: {message!r}")
    missing = [part for part in parts if part not in message]
    if missing:
        raise Failure(f"the message does not name {missing}: {message}")
    return message


# ---------------------------------------------------------------------------------------------------------- cases


def flag_case(name, flags: dict, *parts) -> Case:
    def check(ws: Workspace) -> str:
        output_dir = ws.root / f"never-{name}"
        message = one_line(*run_train(tiny_flags(output_dir, **flags)), 2, *parts)
        if output_dir.exists():
            raise Failure(f"{output_dir} was created although the flags were refused before any work")
        return message
    return Case(name, "flags", check)


FLAG_CASES = [
    flag_case("nan_learning_rate", {"learning_rate": "nan"}, "--learning_rate", "nan"),
    flag_case("inf_learning_rate", {"learning_rate": "inf"}, "--learning_rate", "inf"),
    flag_case("negative_learning_rate", {"learning_rate": -0.001}, "--learning_rate", "-0.001"),
    flag_case("negative_warmup", {"warmup_steps": -5}, "--warmup_steps", "-5"),
    flag_case("label_smoothing_one", {"label_smoothing_factor": 1.0}, "--label_smoothing_factor", "1.0", "[0, 1)"),
    flag_case("label_smoothing_negative", {"label_smoothing_factor": -0.1}, "--label_smoothing_factor", "-0.1"),
    flag_case("adam_beta1_above_one", {"adam_beta1": 1.5}, "--adam_beta1", "1.5", "[0, 1)"),
    flag_case("adam_beta2_negative", {"adam_beta2": -0.1}, "--adam_beta2", "-0.1"),
    flag_case("adam_epsilon_zero", {"adam_epsilon": 0}, "--adam_epsilon", "0"),
    flag_case("negative_threads", {"cpu_threads": -1}, "--cpu_threads", "-1"),
    flag_case("negative_source_length", {"max_source_length": -3}, "--max_source_length", "-3"),
    flag_case("zero_target_length", {"max_target_length": 0}, "--max_target_length", "0"),
    flag_case("split_percentage_zero", {"validation_split_percentage": 0}, "--validation_split_percentage", "0"),
    flag_case("split_percentage_hundred", {"validation_split_percentage": 100}, "--validation_split_percentage",
              "100"),
    flag_case("zero_epochs_no_steps", {"num_train_epochs": 0, "max_steps": -1}, "--num_train_epochs", "0",
              "--max_steps"),
    flag_case("negative_epochs_no_steps", {"num_train_epochs": -2, "max_steps": -1}, "--num_train_epochs", "-2"),
    flag_case("negative_eval_steps", {"eval_steps": -1}, "--eval_steps", "-1"),
    flag_case("negative_save_steps", {"save_steps": -10}, "--save_steps", "-10"),
    flag_case("nan_grad_norm", {"max_grad_norm": "nan"}, "--max_grad_norm", "nan"),
    flag_case("dropout_one", {"dropout": 1.0}, "--dropout", "1.0"),
    flag_case("nan_weight_decay", {"weight_decay": "nan"}, "--weight_decay", "nan"),
    flag_case("length_ratio_below_one", {"max_length_ratio": 0.5}, "--max_length_ratio", "0.5"),
    flag_case("tiny_vocabulary", {"tokenizer_vocab_size": 10}, "--tokenizer_vocab_size", "10"),
    flag_case("zero_train_samples", {"max_train_samples": 0}, "--max_train_samples", "0"),
    flag_case("zero_save_total_limit", {"save_total_limit": 0}, "--save_total_limit", "0"),
    flag_case("negative_workers", {"dataloader_num_workers": -1}, "--dataloader_num_workers", "-1"),
    flag_case("not_a_number", {"max_steps": "many"}, "--max_steps", "many"),
    flag_case("streaming_with_epochs", {"streaming": True, "max_steps": -1, "num_train_epochs": 2}, "--streaming",
              "--max_steps", "--num_train_epochs"),
    flag_case("negative_seed", {"seed": -1}, "--seed", "-1"),
    flag_case("seed_past_32_bits", {"seed": 2**32}, "--seed", "4294967296"),
    flag_case("unknown_tracker", {"report_to": "bogus"}, "--report_to", "bogus"),
    flag_case("nan_max_len_a", {"max_len_a": "nan"}, "--max_len_a", "nan"),
    flag_case("inf_max_len_b", {"max_len_b": "inf"}, "--max_len_b", "inf"),
    flag_case("zero_beams", {"num_beams": 0}, "--num_beams", "0"),
    flag_case("unknown_scheduler", {"lr_scheduler_type": "foo"}, "--lr_scheduler_type", "foo"),
    flag_case("unknown_hub_strategy", {"hub_strategy": "sometimes"}, "--hub_strategy", "sometimes"),
    flag_case("patience_without_validation", {"early_stopping_patience": 2, "eval_steps": 0},
              "--early_stopping_patience", "--eval_steps"),
]


def config_case(name, filename, content, *parts, extra_flags=(), names_file=True) -> Case:
    def check(ws: Workspace) -> str:
        path = ws.fresh("config") / filename
        if content is None:
            path.mkdir()
        else:
            path.write_text(content)
        output_dir = ws.root / f"never-{name}"
        named = (str(path),) if names_file else ()  # values checked after parsing are named as flags
        return one_line(*run_train([str(path), "--output_dir", str(output_dir), *extra_flags]), 2, *named, *parts)
    return Case(name, "config", check)


def config_value_case(name, content, expected: dict, extra_flags=(), filename="run.yaml", flags_first=False) -> Case:
    """A config file that must be read as meant (named first, or after `extra_flags` with `flags_first`)."""
    def check(ws: Workspace) -> str:
        from hf_scratch_transformer.training.arguments import parse_arguments

        path = ws.fresh("config") / filename
        path.write_text(content)
        argv = [*extra_flags, str(path)] if flags_first else [str(path), *extra_flags]
        parsed = {}
        for group in parse_arguments(argv):
            parsed.update(vars(group))
        wrong = {key: parsed[key] for key, value in expected.items()
                 if parsed[key] != value or type(parsed[key]) is not type(value)}
        if wrong:
            raise Failure(f"read as {wrong}, expected {expected}")
        return f"read as {expected}"
    return Case(name, "config", check)


CONFIG_CASES = [
    config_case("yaml_broken_syntax", "run.yaml", "preset: [tiny\nmax_steps: 2\n", "not valid YAML"),
    config_case("json_broken_syntax", "run.json", '{"preset": "tiny", "max_steps": 2', "not valid JSON"),
    config_case("yaml_top_level_list", "run.yaml", "- preset\n- tiny\n", "not a list"),
    config_case("json_wrong_type", "run.json", '{"max_steps": "many"}', "--max_steps", "'many'"),
    config_case("yaml_list_value", "run.yaml", "max_steps: [1, 2]\n", "max_steps", "not a list"),
    config_case("yaml_unknown_key", "run.yaml", "preset: tiny\nlerning_rate: 0.1\n", "'lerning_rate'"),
    config_case("yaml_nan_learning_rate", "run.yaml", "learning_rate: .nan\n", "--learning_rate", "nan",
                names_file=False),
    config_case("config_is_a_directory", "run.yaml", None, "is a directory"),
    config_value_case("yaml_1e-3_is_a_float", "learning_rate: 1e-3\n", {"learning_rate": 0.001}),
    config_value_case("yaml_string_no_is_false", 'normalize_before: "no"\nstreaming: "false"\n',
                      {"normalize_before": False, "streaming": False}),
    config_value_case("config_plus_flags", "preset: tiny\nmax_steps: 100\nlearning_rate: 0.002\n",
                      {"preset": "tiny", "max_steps": 7, "learning_rate": 0.002}, extra_flags=("--max_steps", "7")),
    config_case("yaml_nan_max_len_a", "run.yaml", "max_len_a: .nan\n", "--max_len_a", "nan", names_file=False),
    config_value_case("dashed_keys", "preset: tiny\nmax-steps: 9\nlearning-rate: 0.003\n",
                      {"max_steps": 9, "learning_rate": 0.003}),
    config_value_case("config_after_flags", "preset: tiny\nmax_steps: 100\n", {"preset": "tiny", "max_steps": 7},
                      extra_flags=("--max_steps", "7"), flags_first=True),
    config_value_case("upper_case_suffix", "preset: tiny\nmax_steps: 11\n", {"max_steps": 11}, filename="RUN.YAML"),
    config_value_case("home_in_output_dir", "output_dir: ~/runs/x\n", {"output_dir": str(Path.home() / "runs/x")}),
]
CONFIG_CASES.append(Case("missing_config_file", "config", lambda ws: one_line(
    *run_train([str(ws.root / "nope.yaml")]), 2, str(ws.root / "nope.yaml"), "does not exist")))


def corpus_case(name, records_or_text, *parts, filename="train.jsonl", flag="train_file") -> Case:
    def check(ws: Workspace) -> str:
        good = ws.corpus()
        path = ws.fresh("corpus") / filename
        if isinstance(records_or_text, str):
            path.write_text(records_or_text, encoding="utf-8")
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in records_or_text), encoding="utf-8")
        files = {"train_file": str(good), "validation_file": str(good), "test_file": str(good), flag: str(path)}
        return one_line(*run_train(tiny_flags(ws.fresh("out"), **files)), 2, path.name, *parts)
    return Case(name, "corpus", check)


GOOD = {"translation": {"en": "Hello.", "es": "Hola."}}
CORPUS_CASES = [
    corpus_case("translation_is_a_string", [GOOD, {"translation": "Hello"}], "line 2", "`translation` must be an object"),
    corpus_case("translation_is_a_list", [GOOD, GOOD, {"translation": ["a", "b"]}], "line 3", "got list"),
    corpus_case("sentence_is_a_number", [GOOD, {"translation": {"en": 5, "es": "x"}}], "line 2",
                "`translation.en` must be a string"),
    corpus_case("sentence_is_an_object", [GOOD, {"translation": {"en": "x", "es": {"t": "y"}}}], "line 2",
                "`translation.es` must be a string"),
    corpus_case("column_is_a_list", [{"en": "a", "es": "b"}, {"en": ["a"], "es": "b"}], "line 2",
                "`en` must be a string"),
    corpus_case("record_is_a_list", [GOOD, ["a", "b"]], "line 2", "a JSON object per line is expected"),
    corpus_case("json_array_of_strings", json.dumps([GOOD, "oops"]), "record 2", "got str", filename="train.json"),
    corpus_case("validation_record_wrong", [GOOD, {"translation": 3}], "validation file", "line 2",
                flag="validation_file"),
]


def directory_as_file(flag):
    def check(ws: Workspace) -> str:
        good, directory = ws.corpus(), ws.fresh("a-directory.jsonl")
        files = {"train_file": str(good), "validation_file": str(good), flag: str(directory)}
        return one_line(*run_train(tiny_flags(ws.fresh("out"), **files)), 2, str(directory), "is a directory")
    return Case(f"directory_as_{flag}", "corpus", check)


CORPUS_CASES += [directory_as_file("train_file"), directory_as_file("validation_file")]


def _output_under_a_file(ws: Workspace) -> str:
    blocker = ws.fresh("blocker") / "a-file"
    blocker.write_text("x")
    output_dir = blocker / "out"
    return one_line(*run_train(tiny_flags(output_dir)), 2, str(output_dir), "not writable")


def _output_is_a_file(ws: Workspace) -> str:
    path = ws.fresh("file") / "model"
    path.write_text("x")
    return one_line(*run_train(tiny_flags(path)), 2, str(path), "is a file")


def _output_locked(ws: Workspace) -> str:
    from hf_scratch_transformer.training.run_directory import OutputDirLock

    output_dir = ws.fresh("locked")
    other_run = OutputDirLock(output_dir)  # held here, as a run in this process would hold it
    other_run.acquire()
    try:
        message = one_line(*run_train(tiny_flags(output_dir)), 2, str(output_dir), f"pid {os.getpid()}", "in use")
        if not other_run.path.exists():
            raise Failure("the other run's lock was removed")
    finally:
        other_run.release()
    return message


OUTPUT_CASES = [Case("output_dir_not_writable", "output", _output_under_a_file),
                Case("output_dir_is_a_file", "output", _output_is_a_file),
                Case("output_dir_in_use", "output", _output_locked)]


def resume_case(name, prepare, flags: dict, *parts) -> Case:
    def check(ws: Workspace) -> str:
        run = ws.finished_run()
        prepare(run)
        before = sorted(path.name for path in run.iterdir())
        message = one_line(*run_train(tiny_flags(run, max_steps=6, **flags)), 2, *parts)
        after = sorted(path.name for path in run.iterdir())
        if after != before:
            raise Failure(f"the refused resume changed {run}: {before} -> {after}")
        return message
    return Case(name, "resume", check)


def _nothing(run: Path) -> None:
    pass


def _world_size_two(run: Path) -> None:
    state_file = run / "checkpoint-4" / "run_state.json"
    state = json.loads(state_file.read_text())
    state["world_size"] = 2
    state_file.write_text(json.dumps(state))
    marker = run / "checkpoint-4" / "checkpoint_complete.json"
    listed = json.loads(marker.read_text())
    listed["files"]["run_state.json"] = state_file.stat().st_size
    marker.write_text(json.dumps(listed))


def _unmark(run: Path) -> None:
    (run / "checkpoint-4" / "checkpoint_complete.json").unlink()


RESUME_CASES = [
    resume_case("older_checkpoint_while_newer_exist", _nothing, {"resume_from_checkpoint": "{run}/checkpoint-2"},
                "checkpoint-2", "checkpoint-4", "--overwrite_newer_checkpoints"),
    resume_case("changed_learning_rate", _nothing, {"resume_from_checkpoint": "latest", "learning_rate": 0.01},
                "--learning_rate 0.002 -> 0.01"),
    resume_case("changed_warmup", _nothing, {"resume_from_checkpoint": "latest", "warmup_steps": 50},
                "--warmup_steps 2 -> 50"),
    resume_case("changed_corpus_size", _nothing, {"resume_from_checkpoint": "latest", "max_train_samples": 100},
                "--max_train_samples 200 -> 100"),
    resume_case("other_number_of_processes", _world_size_two, {"resume_from_checkpoint": "latest"},
                "written by 2 process(es)", "this run has 1", "--num_processes 2"),
    resume_case("incomplete_checkpoint_named", _unmark, {"resume_from_checkpoint": "{run}/checkpoint-4"},
                "checkpoint-4", "not a complete checkpoint", "checkpoint_complete.json"),
]
def launch_case(name, env: dict, *parts) -> Case:
    def check(ws: Workspace) -> str:
        return one_line(*run_train(tiny_flags(ws.fresh("out")), env=env), 2, *parts)
    return Case(name, "launch", check)


LAUNCH_CASES = [
    launch_case("cpu_num_processes_2_starts_one", {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1",
                                                   "MASTER_PORT": "29500"}, "--cpu --num_processes N", "--multi_gpu"),
    launch_case("fsdp_on_cpu", {"ACCELERATE_USE_FSDP": "true"}, "FSDP", "multi_gpu.yaml", "cpu_2proc.yaml"),
]


def loading_case(name, damage, *parts, stdin: bytes | None = None) -> Case:
    def check(ws: Workspace) -> str:
        model = ws.model_dir()
        extra = damage(model, ws)
        return one_line(*run_cli(["--model", model, *extra], stdin=stdin), 2, *parts)
    return Case(name, "loading", check)


def _other_model_type(model: Path, ws) -> list:
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "bart"
    (model / "config.json").write_text(json.dumps(config))
    return ["Hello."]


def _no_tokenizer(model: Path, ws) -> list:
    (model / "tokenizer.json").unlink()
    return ["Hello."]


def _smaller_tokenizer(model: Path, ws) -> list:
    from hf_scratch_transformer.data.tokenization import train_bpe_tokenizer

    train_bpe_tokenizer(["a few words of another corpus"] * 5, vocab_size=300).save_pretrained(model)
    return ["Hello."]


def _binary_file(model: Path, ws) -> list:
    path = ws.fresh("input") / "binary.txt"
    path.write_bytes(b"\xff\xfe\x00\x01binary")
    return ["--input_file", path]


LOADING_CASES = [
    loading_case("config_of_another_model_type", _other_model_type, "'bart'", "config.json belongs to another model"),
    loading_case("missing_tokenizer_json", _no_tokenizer, "no tokenizer", "tokenizer.json"),
    loading_case("tokenizer_with_smaller_vocabulary", _smaller_tokenizer, "tokens but the model", "embeddings",
                 "another model"),
    loading_case("binary_stdin", lambda model, ws: [], "standard input is not valid UTF-8", "byte 0",
                 stdin=b"\xff\xfe\x00binary"),
    loading_case("binary_input_file", _binary_file, "not valid UTF-8", "binary.txt"),
    loading_case("cli_num_beams_zero", lambda model, ws: ["--num_beams", "0", "Hello."], "--num_beams", "got 0"),
]


def _pipeline(ws: Workspace):
    from hf_scratch_transformer import translation_pipeline

    if not hasattr(ws, "_pipeline"):
        ws._pipeline = translation_pipeline(ws.model_dir())
    return ws._pipeline


def _expect_value_error(call, *parts, kind: type = ValueError) -> str:
    """`call()` raises `kind` (ValueError unless given) with a one-line message naming every part."""
    try:
        call()
    except kind as error:
        message = str(error)
        if "\n" in message or any(part not in message for part in parts):
            raise Failure(f"{kind.__name__} without {parts} on one line: {message!r}") from None
        return message
    except Exception as error:  # noqa: BLE001
        raise Failure(f"{type(error).__name__} instead of a {kind.__name__}: {error}") from None
    raise Failure("no error")


def _expect_result(call, expected) -> str:
    result = call()
    if result != expected:
        raise Failure(f"returned {result!r}, expected {expected!r}")
    return f"returned {result!r}"


def _oov(ws: Workspace) -> str:
    """A tokenizer with more tokens than the model has embeddings (the model's own, one word added): refused."""
    import copy

    from hf_scratch_transformer.translation.translate import translate

    pipeline = _pipeline(ws)
    bigger = copy.deepcopy(pipeline.tokenizer)
    bigger.add_tokens(["Zorobabelito"])
    vocab_size = pipeline.model.get_input_embeddings().num_embeddings
    text = "In the beginning Zorobabelito created the heavens and the earth."
    return _expect_value_error(lambda: translate(pipeline.model, bigger, [text]), "outside the model's vocabulary",
                               f"0..{vocab_size - 1}")


INFERENCE_CASES = [
    Case("pipeline_empty_list", "inference", lambda ws: _expect_result(lambda: _pipeline(ws)([]), [])),
    Case("pipeline_empty_string", "inference",
         lambda ws: _expect_result(lambda: _pipeline(ws)([""]), [{"translation_text": ""}])),
    Case("pipeline_num_beams_zero", "inference", lambda ws: _expect_value_error(
        lambda: _pipeline(ws)("Jesus wept.", num_beams=0), "num_beams", "got 0")),
    Case("out_of_vocabulary_ids", "inference", _oov),
]


def _nan_without_checkpoint(ws: Workspace) -> str:
    import torch

    from hf_scratch_transformer.training.loop import TrainingCallback, training_callbacks

    class NanWeights(TrainingCallback):  # the embedding set to NaN before the first step: its loss is NaN
        def on_train_begin(self, loop):
            with torch.no_grad():
                loop.model.get_input_embeddings().weight.fill_(float("nan"))

    output_dir = ws.fresh("nan")
    with training_callbacks(NanWeights()):
        message = one_line(*run_train(tiny_flags(output_dir, save_steps=0)), 1, "loss became nan at step 1",
                           "no checkpoint", "--overwrite_output_dir")
    if "--resume_from_checkpoint" in message:
        raise Failure(f"advises resuming with no checkpoint to resume from: {message}")
    return message


FAULT_CASES = [Case("nan_loss_without_checkpoint", "faults", _nan_without_checkpoint)]

CASES = (FLAG_CASES + CONFIG_CASES + CORPUS_CASES + OUTPUT_CASES + RESUME_CASES + LAUNCH_CASES + LOADING_CASES
         + INFERENCE_CASES + FAULT_CASES)
CASE_MODULES = Path(__file__).resolve().parent / "hostile_cases"  # more cases: one module per theme, each a CASES list


def all_cases() -> list[Case]:
    """The cases above, then those of every module in scripts/hostile_cases/ (in file-name order)."""
    import importlib.util

    cases = list(CASES)
    for path in sorted(CASE_MODULES.glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"hostile_cases.{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cases += module.CASES
    return cases


def run_cases(cases: list[Case], root: Path, verbose: bool = True) -> tuple[int, list[tuple[Case, str]]]:
    """(cases handled cleanly, [(case, why not)] for those that were not); skipped cases are in neither."""
    ws = Workspace(root)
    clean, failures = 0, []
    for case in cases:
        try:
            seen = case.check(ws)
            clean += 1
            if verbose:
                print(f"ok    {case.category:9} {case.name}: {seen}", flush=True)
        except Skipped as reason:  # neither clean nor a failure: counted apart by main()
            if verbose:
                print(f"skip  {case.category:9} {case.name}: {reason}", flush=True)
        except Exception as error:  # noqa: BLE001  (a crash of the case is a failure of the case)
            failures.append((case, f"{type(error).__name__}: {error}"))
            if verbose:
                print(f"FAIL  {case.category:9} {case.name}: {type(error).__name__}: {error}", flush=True)
    return clean, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only cases whose category or name contains this")
    args = parser.parse_args(argv)
    import logging

    import torch
    import transformers

    threads, offline = torch.get_num_threads(), os.environ.get("HF_HUB_OFFLINE")
    torch.set_num_threads(1)  # tiny models
    os.environ["HF_HUB_OFFLINE"] = "1"
    cases = [case for case in all_cases() if args.k in case.category or args.k in case.name]
    logging.disable(logging.WARNING)  # the runs' own progress lines; the verdicts are printed below
    transformers.logging.disable_progress_bar()
    try:
        with tempfile.TemporaryDirectory(prefix="hostile-") as root:
            clean, failures = run_cases(cases, Path(root))
    finally:  # leave the calling process as it was (the tests call main())
        logging.disable(logging.NOTSET)
        transformers.logging.enable_progress_bar()
        torch.set_num_threads(threads)
        if offline is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = offline
    skipped = len(cases) - clean - len(failures)
    print(f"{len(cases)} hostile cases tried: {clean} handled cleanly" + (f", {skipped} skipped" if skipped else ""))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.modules.setdefault("hostile_inputs", sys.modules[__name__])  # the theme modules import this one by name
    sys.exit(main())
