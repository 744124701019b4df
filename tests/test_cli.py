"""The `hf-scratch-translate` command on a tiny trained model: arguments, stdin, files, attention plots, n-best
lists and alignments, the line contract, flags checked before loading, closed and full streams, unwritable paths."""

import contextlib
import copy
import io
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import PAIRS_EN_ES, REPO, png_size, start_cli
from tmpfs import small_tmpfs

from hf_scratch_transformer import plotting
from hf_scratch_transformer.decoding import bf16_products_for_decoding, quantize_for_decoding
from hf_scratch_transformer.documents import split_input
from hf_scratch_transformer.translation import cli
from hf_scratch_transformer.translation.translate import decoding_encoder_dtype, translate
from hf_scratch_transformer.translation_core import format_alignment, hard_alignment, text_alignment

SOURCES = [source for source, _ in PAIRS_EN_ES]
REFERENCES = dict(PAIRS_EN_ES)
FILE_LINES = [SOURCES[0], "", SOURCES[5], "   ", SOURCES[2], "", SOURCES[10]]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cli_runs(trained_model_dir, tmp_path_factory):
    """The console command in fresh processes, started together: each spends seconds importing torch/transformers.

    (File input and output go through the same code in-process below, to keep the suite fast.)
    """
    out = tmp_path_factory.mktemp("cli")
    runs = {
        "args": start_cli("--model", trained_model_dir, SOURCES[5], "", SOURCES[1],
                          "--attention", out / "args.png"),
        "stdin": start_cli("--model", trained_model_dir, "--num_beams", "3", stdin=f"{SOURCES[2]}\n\n{SOURCES[6]}\n"),
    }
    return out, runs


def _expected(model, tokenizer, texts, **kwargs):
    return translate(model, tokenizer, texts, batch_size=1, **kwargs)


def test_file_to_file_keeps_alignment_order_and_writes_one_png_per_sentence(cli_runs, trained_model, tmp_path, capsys):
    # (requesting cli_runs starts the subprocesses now; their results are checked at the end of the module)
    model, tokenizer, model_dir = trained_model
    input_file = tmp_path / "input.en"
    input_file.write_text("\n".join(FILE_LINES) + "\n", encoding="utf-8")
    output_file = tmp_path / "out" / "output.es"
    status = cli.main(["--model", str(model_dir), "--input_file", str(input_file), "--output_file", str(output_file),
                       "--batch_size", "2", "--attention", str(tmp_path / "file.png"), "--attention_all"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert captured.out == ""
    written = output_file.read_text(encoding="utf-8").split("\n")
    assert written[-1] == "" and len(written) == len(FILE_LINES) + 1
    # batched (sorted by length, batch of 2) == one at a time, in input order; blank lines stay blank
    assert written[:-1] == _expected(model, tokenizer, FILE_LINES)
    assert [line.strip() == "" for line in written[:-1]] == [line.strip() == "" for line in FILE_LINES]
    assert written[3] == FILE_LINES[3] == "   "  # white space alone comes back as it is
    assert sum(written[i] == REFERENCES.get(FILE_LINES[i]) for i in range(len(FILE_LINES))) >= 2
    non_empty = [i + 1 for i, line in enumerate(FILE_LINES) if line.strip()]
    assert sorted(p.name for p in tmp_path.glob("file-*.png")) == sorted(f"file-{n}.png" for n in non_empty)
    for number in non_empty:
        assert min(png_size(tmp_path / f"file-{number}.png")) >= 500
    assert "translating" in captured.err  # the progress bar


def test_attention_matrix_given_to_the_plot(trained_model, tmp_path, monkeypatch, capsys):
    """In-process: the plot gets (layers, heads, T, S) with T generated tokens, S source tokens, rows summing to 1."""
    model, tokenizer, model_dir = trained_model
    captured = {}
    original = plotting.plot_attention

    def spy(attention, source_labels, target_labels, path, **kwargs):
        captured.update(attention=attention, source_labels=source_labels, target_labels=target_labels)
        return original(attention, source_labels, target_labels, path, **kwargs)

    monkeypatch.setattr(plotting, "plot_attention", spy)
    text = SOURCES[0]
    assert cli.main(["--model", str(model_dir), "", text, SOURCES[3], "--attention", str(tmp_path / "a.png"),
                     "--dtype", "float32"]) == 0  # the rows sum to 1 within fp32's rounding
    stdout = capsys.readouterr().out.split("\n")
    assert stdout[0] == "" and stdout[1] == REFERENCES[text]

    [[best]] = translate(model, tokenizer, [text], num_return_sequences=1)
    target_ids = best.token_ids
    source_ids = tokenizer(text)["input_ids"]
    attention = captured["attention"]
    config = model.config
    assert attention.shape == (config.decoder_layers, config.decoder_attention_heads, len(target_ids), len(source_ids))
    mean_last_layer = attention[-1].mean(0)  # what the big heatmap shows
    assert mean_last_layer.shape == (len(target_ids), len(source_ids))
    torch.testing.assert_close(mean_last_layer.sum(-1), torch.ones(len(target_ids)))
    assert len(captured["source_labels"]) == len(source_ids) and captured["source_labels"][-1] == "</s>"
    assert len(captured["target_labels"]) == len(target_ids) and captured["target_labels"][-1] == "</s>"
    assert (tmp_path / "a.png").is_file() and not (tmp_path / "a-2.png").exists()  # only the first sentence


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_dir", "model directory not found"),
        ("no_weights", "no model weights"),
        ("missing_input", "input file not found"),
        ("directory_input", "input file is a directory"),
        ("bad_utf8", "not valid UTF-8"),
    ],
)
def test_errors_are_one_line_with_exit_status_2(case, message, trained_model_dir, tmp_path, capsys):
    (tmp_path / "empty_model").mkdir()
    (tmp_path / "empty_model" / "config.json").write_text("{}")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9\n")
    args = {
        "missing_dir": ["--model", str(tmp_path / "nope"), "hello"],
        "no_weights": ["--model", str(tmp_path / "empty_model"), "hello"],
        "missing_input": ["--model", str(trained_model_dir), "--input_file", str(tmp_path / "nope.txt")],
        "directory_input": ["--model", str(trained_model_dir), "--input_file", str(tmp_path)],
        "bad_utf8": ["--model", str(trained_model_dir), "--input_file", str(tmp_path / "bad.txt")],
    }[case]
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err and "Traceback" not in captured.err
    assert captured.err.count("\n") == 1 and captured.err.startswith("hf-scratch-translate: error:")
    with pytest.raises(Exception):  # --debug shows the real exception
        cli.main([*args, "--debug"])


def test_help_mentions_first_sentence(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "FIRST non-empty input sentence" in help_text and "--attention_all" in help_text


# The subprocess runs (started by the first test, so they overlap with the in-process tests).
def test_text_arguments_and_attention_png(cli_runs, trained_model):
    model, tokenizer, _ = trained_model
    out, runs = cli_runs
    result = runs["args"].result()
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    assert lines[-1] == "" and len(lines) == 4, result.stdout  # one line per argument, the empty one kept
    assert lines[:3] == _expected(model, tokenizer, [SOURCES[5], "", SOURCES[1]])
    assert lines[1] == ""
    assert lines[0] == REFERENCES[SOURCES[5]]  # the model learned its training pairs
    width, height = png_size(out / "args.png")
    assert width >= 500 and height >= 500
    assert "Traceback" not in result.stderr


def test_stdin_line_by_line(cli_runs, trained_model):
    model, tokenizer, _ = trained_model
    result = cli_runs[1]["stdin"].result()
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == _expected(model, tokenizer, [SOURCES[2], "", SOURCES[6]], num_beams=3)


# ------------------------------------------------------------------------------------------------- line contract
LINE_BREAKS_INSIDE_A_LINE = ["\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def test_only_newline_and_crlf_end_a_line(trained_model, tmp_path, monkeypatch, capsys):
    """Every other Unicode line break stays inside its line: output line N belongs to input line N, from stdin
    and from a file, and CRLF endings are not part of the text."""
    model, tokenizer, model_dir = trained_model
    lines = [f"God is love.{mark}Jesus wept." for mark in LINE_BREAKS_INSIDE_A_LINE] + ["", SOURCES[0]]
    data = "\r\n".join(lines[:3]) + "\r\n" + "\n".join(lines[3:]) + "\n"
    kept = translate(model, tokenizer, lines)  # a lone \r between two sentences is white space kept ...
    assert any("\r" in text for text in kept)
    expected = [text.replace("\r", " ") for text in kept]  # ... which the command prints as a space
    assert cli.main(["--model", str(model_dir), "--input_file", str(_write(tmp_path / "in.txt", data)),
                     "--no_progress"]) == 0
    assert capsys.readouterr().out.split("\n") == expected + [""]
    _stdin(monkeypatch, data.encode("utf-8"))
    assert cli.main(["--model", str(model_dir)]) == 0
    assert capsys.readouterr().out.split("\n") == expected + [""]
    lines = split_input("a\r\nb\rc\n\nd", "lines")
    assert [unit.text for unit in lines.units] == ["a", "b\rc", "", "d"] and split_input("", "lines").units == []


def _write(path, text: str):
    path.write_bytes(text.encode("utf-8"))
    return path


# ------------------------------------------------------------------------------------------ n-best, alignments
def _blocks(output: str) -> list[list[str]]:
    return [line.split("\t") for line in output.split("\n")[:-1]]


def test_nbest_blocks_are_the_api_hypotheses_in_input_order(trained_model, capsys):
    model, tokenizer, model_dir = trained_model
    texts = [SOURCES[3], "", SOURCES[1]]
    # the fixture's model is fp32: so is the command line's here (--dtype auto may choose bf16 on this CPU)
    assert cli.main(["--model", str(model_dir), "--nbest", "3", "--num_beams", "4", "--dtype", "float32", *texts]) == 0
    rows = _blocks(capsys.readouterr().out)
    found = translate(model, tokenizer, texts, num_beams=4, num_return_sequences=3)
    assert rows == [["H-1", f"{h.score:.4f}", h.text] for h in found[0]] + [["H-2", "", ""]] + \
        [["H-3", f"{h.score:.4f}", h.text] for h in found[2]]
    for number in ("H-1", "H-3"):
        scores = [float(score) for tag, score, _ in rows if tag == number]
        assert len(scores) == 3 and scores == sorted(scores, reverse=True)


def test_print_alignment_follows_each_hypothesis_within_bounds(trained_model, capsys):
    model, tokenizer, model_dir = trained_model
    text = SOURCES[0]
    assert cli.main(["--model", str(model_dir), "--print_alignment", "--nbest", "2", "--num_beams", "2", text]) == 0
    rows = _blocks(capsys.readouterr().out)
    assert [row[0] for row in rows] == ["H-1", "A-1", "H-1", "A-1"]
    for (_, _, translation), (_, pairs) in zip(rows[0::2], rows[1::2]):
        pairs = [tuple(map(int, pair.split("-"))) for pair in pairs.split()]
        assert pairs and all(0 <= s < len(text.split()) and 0 <= t < len(translation.split()) for s, t in pairs)
    [[best, _]] = translate(model, tokenizer, [text], num_beams=2, num_return_sequences=2)
    assert rows[1][1] == format_alignment(hard_alignment(model, tokenizer, text, best.token_ids))
    assert cli.main(["--model", str(model_dir), "--print_alignment", "--alignment_unit", "tokens",
                     "--alignment_layer", "1", text]) == 0
    assert _blocks(capsys.readouterr().out)[1][1] == format_alignment(
        hard_alignment(model, tokenizer, text, best.token_ids, layer=0, unit="tokens"))


# ------------------------------------------------------------------------------------- flags checked before loading
@pytest.mark.parametrize("flag, value, named", [
    ("--max_len_a", "nan", "--max_len_a must be a finite number >= 0, got nan"),
    ("--max_len_b", "inf", "--max_len_b must be a finite number >= 0, got inf"),
    ("--max_len_a", "-1", "--max_len_a must be a finite number >= 0, got -1.0"),
    ("--num_beams", "-2", "--num_beams must be a whole number >= 1, got -2"),
    ("--batch_size", "0", "--batch_size must be a whole number >= 1, got 0"),
    ("--max_new_tokens", "0", "--max_new_tokens must be a whole number >= 1, got 0"),
    ("--nbest", "-1", "--nbest must be a whole number >= 1, got -1"),
    ("--batch_size", "nan", "argument --batch_size: invalid int value: 'nan'"),
])
def test_numeric_flags_are_refused_by_name_before_the_model_is_loaded(flag, value, named, tmp_path, capsys):
    missing_model = tmp_path / "no-such-model"  # were the model loaded first, this would be the error
    with pytest.raises(SystemExit) if value == "nan" and flag == "--batch_size" else contextlib.nullcontext() as exit:
        status = cli.main(["--model", str(missing_model), flag, value, "Jesus wept."])
    status = exit.value.code if exit is not None else status
    err = capsys.readouterr().err
    assert status == 2 and named in err.strip().splitlines()[-1] and "Traceback" not in err


def test_nbest_above_the_beam_size_is_refused_after_loading(trained_model_dir, capsys):
    assert cli.main(["--model", str(trained_model_dir), "--nbest", "3", "--num_beams", "2", "x"]) == 2
    assert capsys.readouterr().err == "hf-scratch-translate: error: --nbest must be at most the beam size (2), got 3\n"


def test_a_dtype_with_the_ct2_backend_is_refused_before_loading(tmp_path, capsys):
    """A CTranslate2 model's precision is its export's: a --dtype for it would be silently ignored."""
    assert cli.main(["--backend", "ct2", "--model", str(tmp_path / "nowhere"), "--dtype", "bfloat16", "x"]) == 2
    assert capsys.readouterr().err == (
        "hf-scratch-translate: error: --dtype bfloat16 is the pytorch backend's: a CTranslate2 model keeps the "
        "precision it was exported in (hf-scratch-export-ct2 --quantization)\n")


# ------------------------------------------------------------------------------------ local paths, never the hub
def test_a_missing_local_path_fails_in_seconds_without_asking_the_hub(tmp_path, monkeypatch, capsys):
    """`outputs/does-not-exist` with no ./outputs either, offline variables unset and no network: before, about a
    minute of hub retries; now one short look-up (or none) and one line."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in ("outputs/does-not-exist", "./does-not-exist", "outputs/a/b"):
        started = time.perf_counter()
        assert cli.main(["--model", name, "Jesus wept."]) == 2
        assert time.perf_counter() - started < 5
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"no such directory {name}" in err


# -------------------------------------------------------------------------------------------- streams and paths
def _popen_cli(*args, stdout):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "hf_scratch_transformer.translation.cli", *map(str, args)], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.PIPE)


def test_a_closed_pipe_ends_quietly_and_a_full_stdout_in_one_line(trained_model_dir):
    """`| head -1` that has gone (the read end closed before anything is written): status 0, nothing on stderr.
    /dev/full as stdout: status 1, one line. Real processes, real streams."""
    with open("/dev/full", "w") as full:
        runs = {"closed": _popen_cli("--model", trained_model_dir, stdout=subprocess.PIPE),
                "full": _popen_cli("--model", trained_model_dir, stdout=full)}
        runs["closed"].stdout.close()
        results = {name: run.communicate(b"Jesus wept.\nGod is love.\n" * 50, timeout=300)[1].decode()
                   for name, run in runs.items()}
    assert runs["closed"].returncode == 0 and results["closed"] == ""
    assert runs["full"].returncode == 1
    assert results["full"] == ("hf-scratch-translate: error: no space left on device writing standard output: free "
                               "some space, or write elsewhere\n")


def test_unwritable_output_paths_are_one_line_and_keep_the_earlier_file(trained_model_dir, tmp_path, capsys):
    (tmp_path / "a-directory").mkdir()
    long_name = tmp_path / ("x" * 300 + ".txt")
    for flags, status, message in [
        (["--output_file", long_name], 2, "File name too long; choose another path"),
        (["--output_file", tmp_path / "a-directory"], 2, f"cannot write output file {tmp_path / 'a-directory'}"),
        (["--attention", tmp_path / ("y" * 300 + ".png")], 2, "cannot write attention plot"),
    ]:
        assert cli.main(["--model", str(trained_model_dir), *map(str, flags), "Jesus wept."]) == status
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]  # no temporary file left


def test_read_only_and_full_filesystems_keep_the_earlier_output(trained_model_dir, tmp_path, capsys):
    def earlier(path):
        (path / "out.txt").write_text("earlier translations\n")

    with small_tmpfs(tmp_path / "ro", 64, earlier, read_only=True) as read_only:
        assert cli.main(["--model", str(trained_model_dir), "-o", str(read_only / "out.txt"), "Jesus wept."]) == 2
        assert "Read-only file system; choose another path" in capsys.readouterr().err
        assert (read_only / "out.txt").read_text() == "earlier translations\n"
    lines = "\n".join(SOURCES * 20) + "\n"  # ~10 KB of translations for a 8 KiB filesystem
    with small_tmpfs(tmp_path / "full", 8, earlier) as full:
        assert cli.main(["--model", str(trained_model_dir), "-i", str(_write(tmp_path / "in.txt", lines)),
                         "-o", str(full / "out.txt"), "--no_progress"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"no space left on device writing output file {full / 'out.txt'}" in err
        assert sorted(path.name for path in full.iterdir()) == ["out.txt"]
        assert (full / "out.txt").read_text() == "earlier translations\n"


def test_a_working_directory_deleted_under_the_command(trained_model, tmp_path, monkeypatch, capsys):
    model, tokenizer, model_dir = trained_model
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert cli.main(["--model", str(model_dir), "-o", str(tmp_path / "out.txt"), "Jesus wept."]) == 0
    assert (tmp_path / "out.txt").read_text() == translate(model, tokenizer, ["Jesus wept."])[0] + "\n"
    assert cli.main(["--model", str(model_dir), "-o", "relative.txt", "Jesus wept."]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the working directory was deleted, so --output_file relative.txt" in err


# ------------------------------------------------------------------------------------ documents, formats, reports
DOCUMENT = "Jesus wept. God is love.\r\n\r\n  The Lord is my shepherd.\nI shall not want.\n \n\nAmen"


def test_input_formats_write_each_text_back_in_the_input_s_own_frame(trained_model, tmp_path, capsys):
    """lines: a line per line; paragraphs: each block translated whole, the blank lines (CRLF, spaces, three line
    breaks) and the missing final line break as in the input; file: the whole input as one document."""
    model, tokenizer, model_dir = trained_model
    source = _write(tmp_path / "doc.txt", DOCUMENT)
    outputs = {}
    for input_format in ("lines", "paragraphs", "file"):
        assert cli.main(["--model", str(model_dir), "-i", str(source), "--input_format", input_format,
                         "--no_progress"]) == 0
        outputs[input_format] = capsys.readouterr().out
    lines = DOCUMENT.replace("\r\n", "\n").split("\n")
    assert outputs["lines"] == "".join(text.replace("\r", " ") + "\n" for text in translate(model, tokenizer, lines))
    blocks = ["Jesus wept. God is love.", "The Lord is my shepherd.\nI shall not want.", "Amen"]
    one, two, three = translate(model, tokenizer, blocks)
    assert "\n" in two and outputs["paragraphs"] == f"{one}\r\n\r\n  {two}\n \n\n{three}"
    assert outputs["file"] == translate(model, tokenizer, [DOCUMENT])[0] == outputs["paragraphs"]
    assert cli.main(["--model", str(model_dir), "--input_format", "paragraphs", "--nbest", "1", "-i", str(source),
                     "--no_progress"]) == 0
    assert [row[0] for row in _blocks(capsys.readouterr().out)] == ["H-1", "H-2", "H-3"]


def test_jsonl_has_one_object_per_input_with_confidence_nbest_alignment_and_reports(trained_model, tmp_path, capsys):
    model, tokenizer, model_dir = trained_model
    glossary = _write(tmp_path / "terms.tsv", "Jesus\tCristo\nGod\tDios\n")
    texts = ["Jesus wept.", "", "Read <b>%d</b> at http://God.org now.", "God is love.\u2028Jesus wept."]
    assert cli.main(["--model", str(model_dir), "--output_format", "jsonl", "--nbest", "2", "--num_beams", "2",
                     "--print_alignment", "--protect", "on", "--glossary", str(glossary), "--dtype", "float32",
                     *texts]) == 0  # as the fixture's fp32 model
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == len(texts)  # U+2028 escaped: a JSON line is a line for every reader
    records = [json.loads(line) for line in captured.out.splitlines()]
    found = translate(model, tokenizer, texts, num_beams=2, num_return_sequences=2, protect=True, details=True,
                      glossary={"Jesus": "Cristo", "God": "Dios"})
    for number, (record, translation) in enumerate(zip(records, found), start=1):
        assert record["id"] == number and record["source"] == texts[number - 1]
        assert (record["translation"], record["confidence"]) == (translation.text, translation.confidence)
        assert record["spans"] == translation.spans and record["glossary"] == translation.glossary
        assert [(h["text"], h["score"], h["confidence"]) for h in record["nbest"]] == \
            [(h.text, h.score, h.confidence) for h in translation.hypotheses]
        assert record["alignment"] == [list(pair) for pair in text_alignment(model, tokenizer, translation)]
        assert [h["alignment"] for h in record["nbest"]] == \
            [[list(pair) for pair in text_alignment(model, tokenizer, translation, rank)] for rank in range(2)] \
            if translation.hypotheses else record["nbest"] == []
    assert records[1] == {"id": 2, "source": "", "translation": "", "confidence": None, "spans": [], "glossary": [],
                          "nbest": [], "alignment": []}
    assert records[0]["confidence"] < 0 and "Cristo" in records[0]["translation"]
    assert [span["text"] for span in records[2]["spans"]] == ["<b>", "%d", "</b>", "http://God.org"]
    assert [(entry["source"], entry["honoured"]) for entry in records[2]["glossary"]] == [("God", False)]
    assert captured.err.strip() == ("warning: 1 of 4 glossary term occurrence(s) could not be honoured (first: line 3, "
                                    "'God' -> 'Dios': inside another protected span); --output_format jsonl reports "
                                    "each")


def test_protect_flags_choose_kinds_and_the_user_s_patterns(trained_model, capsys):
    model, tokenizer, model_dir = trained_model
    text = "Order ACME-42 with <b>%d</b> items, {name}."

    def spans(*flags):
        assert cli.main(["--model", str(model_dir), "--output_format", "jsonl", *flags, text]) == 0
        record = json.loads(capsys.readouterr().out)
        assert all(record["translation"].count(span["text"]) == 1 for span in record["spans"])
        return [(span["kind"], span["text"]) for span in record["spans"]]

    assert spans() == [] and spans("--protect", "off") == []  # the default for a model without sentinels: off
    assert spans("--protect", "on") == [("tag", "<b>"), ("printf", "%d"), ("tag", "</b>"), ("format", "{name}")]
    assert spans("--protect_kinds", "printf, format") == [("printf", "%d"), ("format", "{name}")]
    assert spans("--protect", "off", "--protect_pattern", r"ACME-\d+") == [("user", "ACME-42")]
    assert spans("--protect", "on", "--protect_pattern", r"ACME-\d+", "--protect_pattern", "items")[:2] == \
        [("user", "ACME-42"), ("tag", "<b>")]
    assert cli.main(["--model", str(model_dir), "--protect_kinds", "printf", text]) == 0
    expected = translate(model, tokenizer, [text], protect=True, protect_kinds=["printf"])[0]
    assert capsys.readouterr().out == expected + "\n"


GLOSSARIES = {
    "malformed": ("Jesus\tCristo\nGod Dios\n", "line 2: expected `source term<TAB>target term`, found no tab"),
    "empty_term": ("Jesus\tCristo\n\n\tDios\n", "line 3: the source term is empty"),
    "two_targets": ("Jesus\tCristo\nGod\tDios\nJesus\tJesucristo\n",
                    "line 3: 'Jesus' -> 'Jesucristo', but line 1 gives 'Jesus' -> 'Cristo'"),
}


@pytest.mark.parametrize("case", [*GLOSSARIES, "pattern_does_not_compile", "pattern_matches_empty", "unknown_kind",
                                  "binary_input", "utf16_input", "kinds_with_protect_off",
                                  "arguments_as_paragraphs"])
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, tmp_path, capsys):
    """Refused before the model is loaded (it does not even exist here), and neither an earlier output file nor a
    new one is touched."""
    source = _write(tmp_path / "in.txt", "Jesus wept.\n")
    if case in GLOSSARIES:
        flags, expected = ["--glossary", str(_write(tmp_path / "terms.tsv", GLOSSARIES[case][0])),
                           "-i", str(source)], [str(tmp_path / "terms.tsv"), GLOSSARIES[case][1]]
    else:
        (tmp_path / "binary.txt").write_bytes(b"Jesus wept.\n\x00\x01\x02\xff")
        (tmp_path / "utf16.txt").write_bytes("Jesus wept.\n".encode("utf-16-le"))
        flags, expected = {
            "pattern_does_not_compile": (["--protect_pattern", "x(", "-i", str(source)],
                                         ["--protect_pattern", "'x(' does not compile"]),
            "pattern_matches_empty": (["--protect_pattern", "[0-9]*", "-i", str(source)],
                                      ["--protect_pattern", "'[0-9]*' matches the empty string"]),
            "unknown_kind": (["--protect_kinds", "printf,emoji", "-i", str(source)], ["--protect_kinds", "emoji"]),
            "binary_input": (["-i", str(tmp_path / "binary.txt")],
                             [f"input file {tmp_path / 'binary.txt'} is binary, not text", "NUL byte at byte 12"]),
            "utf16_input": (["-i", str(tmp_path / "utf16.txt")],
                            [f"input file {tmp_path / 'utf16.txt'} is binary, not text: a NUL byte at byte 1",
                             "iconv -f utf-16"]),
            "kinds_with_protect_off": (["--protect", "off", "--protect_kinds", "url", "-i", str(source)],
                                       ["--protect off", "--protect_kinds"]),
            "arguments_as_paragraphs": (["--input_format", "paragraphs", "Jesus wept."],
                                        ["--input_format paragraphs", "TEXT arguments"]),
        }[case]
    earlier, new = tmp_path / "earlier.txt", tmp_path / "new.txt"
    earlier.write_text("earlier translations\n")
    for output in (earlier, new):
        status = cli.main(["--model", str(tmp_path / "no-such-model"), *flags, "-o", str(output)])
        captured = capsys.readouterr()
        assert status == 2 and captured.out == "" and captured.err.count("\n") == 1, captured.err
        assert all(part in captured.err for part in expected), captured.err
    assert earlier.read_text() == "earlier translations\n" and not new.exists()
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".")) == []


def test_piped_paragraphs_and_binary_standard_input_in_a_real_process(trained_model):
    """The streams themselves: paragraphs from a pipe come back byte for byte in their frame (no line break added
    at the end), jsonl lines are UTF-8, and binary stdin is refused in one line with nothing on stdout."""
    model, tokenizer, model_dir = trained_model
    runs = {"paragraphs": (_popen_cli("--model", model_dir, "--input_format", "paragraphs", stdout=subprocess.PIPE),
                           DOCUMENT.encode()),
            "jsonl": (_popen_cli("--model", model_dir, "--output_format", "jsonl", stdout=subprocess.PIPE),
                      "Jesús wept.\n".encode()),
            "binary": (_popen_cli("--model", model_dir, stdout=subprocess.PIPE), b"Jesus wept.\n\x00")}
    results = {name: (process.communicate(data, timeout=300), process.returncode)
               for name, (process, data) in runs.items()}
    one, two, three = translate(model, tokenizer, ["Jesus wept. God is love.",
                                                   "The Lord is my shepherd.\nI shall not want.", "Amen"])
    (out, _), status = results["paragraphs"]
    assert status == 0 and out == f"{one}\r\n\r\n  {two}\n \n\n{three}".encode()
    (out, _), status = results["jsonl"]
    assert status == 0 and json.loads(out)["source"] == "Jesús wept." and "Jesús".encode() in out
    (out, err), status = results["binary"]
    assert (status, out) == (2, b"")
    assert err == (b"hf-scratch-translate: error: standard input is binary, not text: a NUL byte at byte 12 (a "
                   b"binary file, or UTF-16 text); give UTF-8 text (`iconv -f utf-16 -t utf-8` converts UTF-16)\n")


# ------------------------------------------------------------------------------------ input reading (issue 42)
def test_a_utf8_byte_order_mark_is_not_translated_from_a_file_or_stdin(trained_model_dir, tmp_path, capsys,
                                                                       monkeypatch):
    data = "\ufeffJesus wept.\nJesus wept.\n".encode("utf-8")
    path = tmp_path / "windows.txt"
    path.write_bytes(data)
    assert cli.main(["--model", str(trained_model_dir), "--input_file", str(path), "--no_progress"]) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first == second
    _stdin(monkeypatch, data)
    assert cli.main(["--model", str(trained_model_dir), "--no_progress"]) == 0
    assert capsys.readouterr().out.splitlines() == [first, second]


def test_dev_zero_as_input_is_refused_at_its_first_byte_not_read_until_memory_runs_out(tmp_path):
    """A real process with its address space bounded to 3 GiB: reading /dev/zero whole would end in MemoryError."""
    import resource

    def bounded():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for extra, stdin in ((["--input_file", "/dev/zero"], subprocess.DEVNULL), ([], open("/dev/zero", "rb"))):
        with stdin if stdin is not subprocess.DEVNULL else contextlib.nullcontext():
            done = subprocess.run([sys.executable, "-m", "hf_scratch_transformer.translation.cli", "--model",
                                   str(tmp_path / "no-model"), *extra], stdin=stdin, capture_output=True, text=True,
                                  env=env, preexec_fn=bounded, timeout=300)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-500:]
        assert "is binary, not text: a NUL byte at byte 0" in done.stderr and done.stdout == ""


def test_an_empty_model_name_is_one_line(capsys):
    assert cli.main(["--model", "", "Jesus wept."]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "the model name is empty" in err and "save_pretrained" in err


def copy_in_precision(model, dtype: str):
    """A copy of `model` as `--dtype bfloat16`, `bfloat16_products` or `int8` loads it."""
    copied = copy.deepcopy(model)
    if dtype == "int8":
        quantize_for_decoding(copied, decoding_encoder_dtype())
        return copied
    if dtype == "bfloat16_products":
        bf16_products_for_decoding(copied, decoding_encoder_dtype())
        return copied
    return copied.to(torch.bfloat16)


@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat16_products", "int8"])
def test_dtype_bfloat16_bf16_products_or_int8_translates_as_the_api_on_a_copy_in_that_precision(trained_model, capsys,
                                                                                              dtype):
    """`--dtype bfloat16` loads the weights in bf16, `bfloat16_products` and `int8` give the decoding loops bf16 or
    int8 copies of fp32 weights; the output is the API's on such a copy of the model (scores, confidence and
    alignment computed from its weights, the decoding loops' scores in fp32)."""
    model, tokenizer, model_dir = trained_model
    texts = [SOURCES[0], "", SOURCES[3]]
    assert cli.main(["--model", str(model_dir), "--output_format", "jsonl", "--num_beams", "2", "--print_alignment",
                     "--dtype", dtype, *texts]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    found = translate(copy_in_precision(model, dtype), tokenizer, texts, num_beams=2, details=True)
    assert [(record["translation"], record["confidence"]) for record in records] == \
        [(translation.text, translation.confidence) for translation in found]
    assert records[0]["translation"] and records[2]["translation"]
