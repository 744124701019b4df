"""Hostile cases of translating: hf-scratch-translate's flags, lines and streams, poisoned or mismatched model
directories, unwritable paths, the Python API and the pipeline, the CTranslate2 export, real text (a broken
glossary, a user's pattern that cannot be used, a binary input file: refused before anything is loaded or
written; a 5 MB line: translated) and issue 42's input reading (a byte-order mark, /dev/zero, a working directory
deleted before the command starts, an empty --model).

Each case asserts the class of outcome: a refusal is ONE line naming the cause, with exit status 2 (the user's
to fix) or 1 (the environment); an input that must work gives the documented result.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

from hostile_inputs import REPO, Case, Failure, Workspace, _expect_value_error, one_line

CATEGORY = "translation"


def run(argv: list, stdin: bytes = b"", stdout=None) -> tuple[int, str, str]:
    """hf-scratch-translate's main in this process: (exit status, stderr, stdout); argparse's own refusals
    (SystemExit) count as exit statuses. `stdout` replaces standard output (default: captured)."""
    from hf_scratch_transformer.translation import cli

    err, out = io.StringIO(), stdout if stdout is not None else io.StringIO()
    saved = sys.stdin, sys.stdout
    sys.stdin, sys.stdout = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"), out
    try:
        with contextlib.redirect_stderr(err):
            try:
                code = cli.main([str(a) for a in argv])
            except SystemExit as exit_:
                code = exit_.code
    finally:
        sys.stdin, sys.stdout = saved
    return code, err.getvalue(), out.getvalue() if isinstance(out, io.StringIO) else ""


def refused(argv_of, code: int, *parts) -> callable:
    """A check: the command given `argv_of(ws)` ends with `code` and one line naming every part."""
    def check(ws: Workspace) -> str:
        status, err, _ = run(argv_of(ws))
        return one_line(status, err, code, *parts)
    return check


# ----------------------------------------------------------------------------- flags, checked before the model
def flag(name: str, value: str, *parts) -> Case:
    """The flag is refused by name although --model does not exist: checked before anything is loaded."""
    return Case(f"cli_{name.strip('-')}_{value}", CATEGORY,
                refused(lambda ws: ["--model", ws.root / "no-such-model", name, value, "Jesus wept."], 2, name, *parts))


FLAG_CASES = [
    flag("--max_len_a", "nan", "finite", "got nan"),
    flag("--max_len_b", "inf", "finite", "got inf"),
    flag("--max_len_a", "-0.5", ">= 0", "got -0.5"),
    flag("--num_beams", "-1", "whole number >= 1", "got -1"),
    flag("--batch_size", "0", "whole number >= 1", "got 0"),
    flag("--max_new_tokens", "0", "whole number >= 1", "got 0"),
    flag("--nbest", "0", "whole number >= 1", "got 0"),
    flag("--batch_size", "nan", "invalid int value: 'nan'"),
    Case("cli_nbest_above_the_beam_size", CATEGORY, refused(
        lambda ws: ["--model", ws.model_dir(), "--nbest", "4", "--num_beams", "2", "x"], 2, "--nbest",
        "at most the beam size (2)")),
    Case("cli_alignment_layer_out_of_range", CATEGORY, refused(
        lambda ws: ["--model", ws.model_dir(), "--print_alignment", "--alignment_layer", "5", "x"], 2,
        "--alignment_layer", "1 to 2", "got 5")),
    Case("cli_ct2_print_alignment", CATEGORY, refused(
        lambda ws: ["--backend", "ct2", "--model", ws.root / "x", "--print_alignment", "x"], 2,
        "--print_alignment needs the default backend")),
]


# ------------------------------------------------------------------------------------------------ lines in, out
def _lines_kept(data: bytes, expected_lines: int):
    def check(ws: Workspace) -> str:
        status, err, out = run(["--model", ws.model_dir()], stdin=data)
        if status != 0 or "Traceback" in err:
            raise Failure(f"exit status {status}: {err.strip()[-300:]}")
        lines = out.split("\n")
        if lines[-1] != "" or len(lines) - 1 != expected_lines or any("\r" in line for line in lines):
            raise Failure(f"{expected_lines} input lines gave {len(lines) - 1} output lines: {out!r}")
        return f"{expected_lines} lines in, {expected_lines} lines out"
    return check


BREAKS = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
LINE_CASES = [
    Case("unicode_line_breaks_inside_lines", CATEGORY, _lines_kept(
        "".join(f"God is love.{mark}Jesus wept.\n" for mark in BREAKS).encode("utf-8"), len(BREAKS))),
    Case("crlf_line_endings", CATEGORY, _lines_kept(b"Jesus wept.\r\n\r\nGod is love.\r\n", 3)),
]


# ------------------------------------------------------------------------------------------- poisoned models
def damaged(name: str, damage, *parts) -> Case:
    def check(ws: Workspace) -> str:
        model = ws.model_dir()
        damage(model)
        status, err, out = run(["--model", model, "Jesus wept."])
        if out:
            raise Failure(f"translated anyway: {out!r}")
        return one_line(status, err, 2, *parts)
    return Case(name, CATEGORY, check)


def _tensors(change):
    def damage(model: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(model / "model.safetensors")
        change(tensors)
        save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return damage


def _config(**values):
    def damage(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        config.update(values)
        (model / "config.json").write_text(json.dumps(config))
    return damage


def _nan(tensors) -> None:
    tensors["model.shared.weight"][:] = float("nan")


def _inf(tensors) -> None:
    tensors["model.encoder.layers.0.feed_forward.fc1.weight"][3, 3] = float("inf")


def _text(filename: str, text: str):
    return lambda model: (model / filename).write_text(text)


MODEL_CASES = [
    damaged("all_nan_weights", _tensors(_nan), "NaN or infinite", "model.shared.weight", "earlier checkpoint"),
    damaged("one_inf_weight", _tensors(_inf), "NaN or infinite", "model.encoder.layers.0.feed_forward.fc1.weight"),
    damaged("missing_tensor", _tensors(lambda t: t.pop("model.decoder.layers.1.feed_forward.fc2.bias")),
            "model.safetensors", "lacks 1 tensor(s)", "model.decoder.layers.1.feed_forward.fc2.bias"),
    damaged("extra_tensor", _tensors(lambda t: t.__setitem__("model.decoder.gate", t["model.shared.weight"][:2] * 1)),
            "model.safetensors", "holds 1 tensor(s)", "model.decoder.gate"),
    damaged("config_d_model_contradicts_weights", _config(d_model=96), "config.json", "contradicts model.safetensors",
            "d_model 96"),
    damaged("config_vocab_size_contradicts_weights", _config(vocab_size=500), "contradicts model.safetensors",
            "model.shared.weight"),
    damaged("garbage_tokenizer_json", _text("tokenizer.json", "\x00\x01 not json"), "tokenizer.json",
            "not valid JSON"),
    damaged("tokenizer_json_of_no_tokenizer", _text("tokenizer.json", "[1, 2, 3]"), "tokenizer", "cannot be read"),
    damaged("garbage_tokenizer_config", _text("tokenizer_config.json", "{"), "tokenizer_config.json",
            "not valid JSON"),
]


# ----------------------------------------------------------------------------------------------- paths
def _fast_missing(ws: Workspace) -> str:
    saved, offline = os.getcwd(), os.environ.pop("HF_HUB_OFFLINE", None)
    os.chdir(ws.fresh("empty"))
    try:
        started = time.perf_counter()
        status, err, _ = run(["--model", "outputs/does-not-exist", "x"])
        seconds = time.perf_counter() - started
    finally:
        os.chdir(saved)
        if offline is not None:
            os.environ["HF_HUB_OFFLINE"] = offline
    if seconds >= 5:
        raise Failure(f"took {seconds:.1f} s")
    return one_line(status, err, 2, "no such directory outputs/does-not-exist")


PATH_CASES = [
    Case("missing_local_model_fails_fast", CATEGORY, _fast_missing),
    Case("model_is_a_file", CATEGORY, refused(
        lambda ws: ["--model", ws.model_dir() / "config.json", "x"], 2, "is a file, not a model directory")),
    Case("model_name_too_long", CATEGORY, refused(
        lambda ws: ["--model", ws.root / ("m" * 300), "x"], 2, "File name too long")),
    Case("output_file_name_too_long", CATEGORY, refused(
        lambda ws: ["--model", ws.model_dir(), "-o", ws.root / ("o" * 300), "x"], 2, "output file",
        "File name too long")),
    Case("output_file_is_a_directory", CATEGORY, refused(
        lambda ws: ["--model", ws.model_dir(), "-o", ws.fresh("a-directory"), "x"], 2, "cannot write output file")),
    Case("attention_png_name_too_long", CATEGORY, refused(
        lambda ws: ["--model", ws.model_dir(), "--attention", ws.root / ("a" * 300 + ".png"), "x"], 2,
        "cannot write attention plot", "File name too long")),
]


# ---------------------------------------------------------------------------------------------- streams
def _full_stdout(ws: Workspace) -> str:
    with open("/dev/full", "w", encoding="utf-8") as full:
        status, err, _ = run(["--model", ws.model_dir(), "Jesus wept."], stdout=full)
    return one_line(status, err, 1, "no space left on device writing standard output")


def _closed_pipe(ws: Workspace) -> str:
    reader, writer = os.pipe()
    os.close(reader)  # `| head -1` that has already gone
    with os.fdopen(writer, "w", encoding="utf-8") as pipe:
        status, err, _ = run(["--model", ws.model_dir(), "Jesus wept.", "God is love."], stdout=pipe)
    if status != 0 or err:
        raise Failure(f"exit status {status}, stderr {err!r}")
    return "exit status 0, nothing on stderr"


def _deleted_working_directory(ws: Workspace) -> str:
    model, saved, gone = ws.model_dir(), os.getcwd(), ws.fresh("gone")
    os.chdir(gone)
    gone.rmdir()
    try:
        status, err, out = run(["--model", model, "Jesus wept."])
        if status != 0 or not out.strip():
            raise Failure(f"absolute paths should still work: exit status {status}, {err.strip()[-200:]}")
        status, err, _ = run(["--model", model, "-o", "relative.txt", "Jesus wept."])
    finally:
        os.chdir(saved)
    return one_line(status, err, 2, "working directory was deleted", "relative.txt")


STREAM_CASES = [Case("stdout_is_dev_full", CATEGORY, _full_stdout),
                Case("stdout_closed_early", CATEGORY, _closed_pipe),
                Case("working_directory_deleted", CATEGORY, _deleted_working_directory)]


# ------------------------------------------------------------------------------------------ API and pipeline
def _loaded(ws: Workspace):
    from hf_scratch_transformer.translation.translate import load_model_and_tokenizer

    if not hasattr(ws, "_translation_model"):
        ws._translation_model = load_model_and_tokenizer(ws.model_dir())
    return ws._translation_model


def _api(texts, kind, *parts, **options):
    def check(ws: Workspace) -> str:
        from hf_scratch_transformer.translation.translate import translate

        model, tokenizer = _loaded(ws)
        return _expect_value_error(lambda: translate(model, tokenizer, texts, **options), *parts, kind=kind)
    return check


def _pipeline_none(ws: Workspace) -> str:
    from hf_scratch_transformer import translation_pipeline

    pipe = translation_pipeline(*_loaded(ws))
    return _expect_value_error(lambda: pipe(["Jesus wept.", None]), "texts[1] is None", kind=TypeError)


def _ct2_export_name_too_long(ws: Workspace) -> str:
    from hf_scratch_transformer.export.ct2 import main

    parent = ws.fresh("ct2")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["--model", str(ws.model_dir()), "--output_dir", str(parent / ("c" * 300))])
    if list(parent.iterdir()):
        raise Failure(f"left behind: {[path.name for path in parent.iterdir()]}")
    return one_line(status, err.getvalue().replace("hf-scratch-export-ct2: error: ", "error: "), 2,
                    "File name too long")


API_CASES = [
    Case("api_none_among_texts", CATEGORY, _api(["Jesus wept.", None], TypeError, "texts[1] is None")),
    Case("api_a_string_not_a_list", CATEGORY, _api("Jesus wept.", TypeError, "list of strings", "[text]")),
    Case("api_nan_max_len_a", CATEGORY, _api(["x"], ValueError, "max_len_a", "got nan", max_len_a=float("nan"))),
    Case("api_nbest_above_beams", CATEGORY, _api(["x"], ValueError, "num_return_sequences", "beam size (2)",
                                                 num_beams=2, num_return_sequences=3)),
    Case("pipeline_none_among_texts", CATEGORY, _pipeline_none),
    Case("ct2_export_name_too_long", CATEGORY, _ct2_export_name_too_long),
]



# ------------------------------------------------------------------------------------- input reading (issue 42)
def _translated_lines(argv: list, stdin: bytes = b"") -> list[str]:
    status, err, out = run(argv, stdin=stdin)
    if status != 0 or "Traceback" in err:
        raise Failure(f"exit status {status}: {err.strip()[-300:]}")
    return out.split("\n")[:-1]


def _byte_order_mark(through_stdin: bool):
    """A UTF-8 byte-order mark (what Windows editors write first) is not text: the first line translates as the
    same line without it."""
    def check(ws: Workspace) -> str:
        data = "\ufeffJesus wept.\nJesus wept.\n".encode("utf-8")
        if through_stdin:
            lines = _translated_lines(["--model", ws.model_dir()], stdin=data)
        else:
            path = ws.fresh("bom") / "input.txt"
            path.write_bytes(data)
            lines = _translated_lines(["--model", ws.model_dir(), "--input_file", path])
        if len(lines) != 2 or lines[0] != lines[1]:
            raise Failure(f"the line after the byte-order mark translates otherwise: {lines}")
        return "the first line translates as without the mark"
    return check


def command(argv: list, cwd_script: str = "", memory_gib: int = 4, timeout: int = 180) -> tuple[int, str, str]:
    """`python -m hf_scratch_transformer.translation.cli ARGV` in a new process, its memory bounded (a runaway read
    ends in MemoryError, not in the machine's memory), after the shell commands `cwd_script` (e.g. a cd into a
    directory that is then deleted): (exit status, stderr, stdout)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1"}

    def bounded():
        limit = memory_gib << 30
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    python = " ".join(shlex.quote(part) for part in [sys.executable, "-m", "hf_scratch_transformer.translation.cli",
                                                      *map(str, argv)])
    done = subprocess.run(["sh", "-c", f"{cwd_script} exec {python}"], capture_output=True, text=True, env=env,
                          preexec_fn=bounded, timeout=timeout, stdin=subprocess.DEVNULL)
    return done.returncode, done.stderr, done.stdout


def _endless_input(through_stdin: bool):
    """/dev/zero never ends: refused at its first byte, a NUL, instead of read until memory runs out."""
    def check(ws: Workspace) -> str:
        started = time.perf_counter()
        if through_stdin:
            status, err, _ = command(["--model", ws.model_dir()], cwd_script="exec < /dev/zero &&")
            parts = ("standard input is binary", "NUL byte at byte 0")
        else:
            status, err, _ = command(["--model", ws.model_dir(), "--input_file", "/dev/zero"])
            parts = ("input file /dev/zero is binary", "NUL byte at byte 0")
        message = one_line(status, err, 2, *parts)
        if time.perf_counter() - started > 120:
            raise Failure(f"took {time.perf_counter() - started:.0f} s")
        return message
    return check


def _started_in_a_deleted_directory(ws: Workspace) -> str:
    """The command started from a working directory that was deleted before (a real one: importing torch and
    transformers there fails unless handled): absolute paths work, a relative one is refused in one line."""
    def enter() -> str:
        gone = shlex.quote(str(ws.fresh("deleted")))
        return f"cd {gone} && rmdir {gone} &&"

    model = ws.model_dir()
    status, err, out = command(["--model", model, "Jesus wept."], cwd_script=enter())
    if status != 0 or len(out.splitlines()) != 1:
        raise Failure(f"an absolute --model should work: exit status {status}, {err.strip()[-300:]}")
    status, err, _ = command(["--model", model, "--input_file", "relative.txt"], cwd_script=enter())
    return one_line(status, err, 2, "working directory was deleted", "--input_file relative.txt")


READING_CASES = [
    Case("byte_order_mark_in_input_file", CATEGORY, _byte_order_mark(through_stdin=False)),
    Case("byte_order_mark_on_stdin", CATEGORY, _byte_order_mark(through_stdin=True)),
    Case("input_file_dev_zero", CATEGORY, _endless_input(through_stdin=False)),
    Case("stdin_dev_zero", CATEGORY, _endless_input(through_stdin=True)),
    Case("started_in_a_deleted_working_directory", CATEGORY, _started_in_a_deleted_directory),
    Case("empty_model_name", CATEGORY, refused(lambda ws: ["--model", "", "Jesus wept."], 2,
                                               "the model name is empty", "save_pretrained")),
]
# ---------------------------------------------------------------------------------------- real text (issue 41)
def _nothing_written(argv_of, *parts) -> callable:
    """The command given `argv_of(ws)` and an --output_file ends with exit status 2 and one line naming every
    part, before the model is loaded (it does not exist here), and the output file is not created."""
    def check(ws: Workspace) -> str:
        folder = ws.fresh("real-text")
        output = folder / "out.txt"
        status, err, out = run(["--model", ws.root / "no-such-model", *argv_of(folder), "-o", output])
        if output.exists() or out:
            raise Failure(f"something was written: {output.exists()=}, stdout {out[:100]!r}")
        return one_line(status, err, 2, *parts)
    return check


def _file(folder: Path, name: str, data: bytes) -> Path:
    (folder / name).write_bytes(data)
    return folder / name


def _glossary(data: bytes):
    return lambda folder: ["--glossary", _file(folder, "terms.tsv", data), "Jesus wept."]


def _five_megabyte_line(ws: Workspace) -> str:
    """A document of 5 MB on one line finishes (its sentences translated in batches; an over-long one cut into
    pieces), one output line for the one input line."""
    folder = ws.fresh("five-mb")
    source = _file(folder, "line.txt", (("God saw the light " * 300 + ". ") * 960)[:5_000_000].encode() + b"\n")
    started = time.perf_counter()
    status, err, out = run(["--model", ws.model_dir(), "-i", source, "--max_new_tokens", "1", "--batch_size", "512",
                            "--no_progress"])
    seconds = time.perf_counter() - started
    if status != 0 or out.count("\n") != 1 or not out.strip():
        raise Failure(f"exit status {status}, {out.count(chr(10))} output lines: {err.strip()[-300:]}")
    if seconds > 600:
        raise Failure(f"took {seconds:.0f} s")
    return f"5 MB in one line: one line out in {seconds:.0f} s"


def _jsonl_of_awkward_lines(extra: list):
    """--output_format jsonl (with `extra` flags) of lines holding U+2028, U+0085, a lone \\r, only white space,
    nothing, and a glossary term: exactly one JSON object per input line however the output is split (str.splitlines
    included), each naming its line's source, in order."""
    def check(ws: Workspace) -> str:
        folder = ws.fresh("jsonl")
        sources = ["God saw the light.\u2028Jesus wept.", "Jesus\x85wept.", "God\rsaw.", "   ", "", "Jesús lloró."]
        glossary = _file(folder, "terms.tsv", "Jesus\tJesús\n".encode())
        status, err, out = run(["--model", ws.model_dir(), "--output_format", "jsonl", "--glossary", glossary,
                                "--no_progress", *extra], stdin="\n".join(sources).encode() + b"\n")
        if status != 0 or "Traceback" in err:
            raise Failure(f"exit status {status}: {err.strip()[-300:]}")
        records = [json.loads(line) for line in out.splitlines()]
        if [record["source"] for record in records] != sources or [r["id"] for r in records] != [1, 2, 3, 4, 5, 6]:
            raise Failure(f"{len(records)} objects for {len(sources)} lines: {[r.get('source') for r in records]}")
        if extra and not all(len(record["nbest"]) == 2 for record in records if record["source"].strip()):
            raise Failure("--nbest 2 did not give two hypotheses per text")
        return f"{len(records)} JSON objects for {len(sources)} awkward lines, in order"
    return check


REAL_TEXT_CASES = [
    Case("glossary_malformed_line", CATEGORY, _nothing_written(
        _glossary(b"Jesus\tCristo\nGod Dios\n"), "terms.tsv line 2", "expected `source term<TAB>target term`")),
    Case("glossary_empty_term", CATEGORY, _nothing_written(
        _glossary(b"Jesus\tCristo\nGod\t  \n"), "terms.tsv line 2: the target term is empty")),
    Case("glossary_duplicate_terms", CATEGORY, _nothing_written(
        _glossary(b"Jesus\tCristo\nGod\tDios\nJesus\tJesucristo\n"), "terms.tsv line 3", "but line 1 gives",
        "keep one target per source term")),
    Case("protect_pattern_does_not_compile", CATEGORY, _nothing_written(
        lambda folder: ["--protect_pattern", "[a-", "Jesus wept."], "--protect_pattern", "'[a-' does not compile")),
    Case("protect_pattern_matches_empty", CATEGORY, _nothing_written(
        lambda folder: ["--protect_pattern", "x?", "Jesus wept."], "--protect_pattern", "matches the empty string")),
    Case("input_file_in_utf16", CATEGORY, _nothing_written(
        lambda folder: ["-i", _file(folder, "notepad.txt", "Jesus wept.\n".encode("utf-16-le"))], "notepad.txt",
        "is binary, not text", "NUL byte at byte 1", "iconv -f utf-16")),
    Case("input_file_with_nul_bytes", CATEGORY, _nothing_written(
        lambda folder: ["-i", _file(folder, "core.dump", b"ELF\x00\x01\x02 Jesus")], "core.dump",
        "is binary, not text", "NUL byte at byte 3")),
    Case("five_megabyte_line", CATEGORY, _five_megabyte_line),
    Case("jsonl_of_awkward_lines", CATEGORY, _jsonl_of_awkward_lines([])),
    Case("jsonl_nbest_of_awkward_lines", CATEGORY, _jsonl_of_awkward_lines(["--nbest", "2", "--num_beams", "2"])),
]

CASES = (FLAG_CASES + LINE_CASES + MODEL_CASES + PATH_CASES + STREAM_CASES + API_CASES + REAL_TEXT_CASES
         + READING_CASES)
