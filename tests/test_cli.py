"""The `hf-scratch-translate` command on a tiny trained model: arguments, stdin, files, attention plots, errors."""

import pytest
import torch
from helpers import PAIRS_EN_ES, png_size, start_cli

from hf_scratch_transformer import cli, plotting
from hf_scratch_transformer.translate import generate_ids, translate_texts

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
    return translate_texts(model, tokenizer, texts, batch_size=1, **kwargs)


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
    assert [bool(line) for line in written[:-1]] == [bool(line.strip()) for line in FILE_LINES]
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
    assert cli.main(["--model", str(model_dir), "", text, SOURCES[3], "--attention", str(tmp_path / "a.png")]) == 0
    stdout = capsys.readouterr().out.split("\n")
    assert stdout[0] == "" and stdout[1] == REFERENCES[text]

    [target_ids] = generate_ids(model, tokenizer, [text])
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
