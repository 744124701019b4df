"""model_directory.py: the model directory is in safetensors only, with the code trust_remote_code runs; the hub
push fails cleanly. (A failed final save on a real full disk: test_run_directory.py.)"""

import json
import os
import subprocess
import sys
import textwrap

from helpers import MODEL_CARD_TEMPLATE, tiny_run_flags
from transformers import AutoModelForSeq2SeqLM

from hf_scratch_transformer.training.run import main


def test_weights_are_written_only_as_safetensors(finished_run):
    pickles = [path for path in finished_run.rglob("*") if path.suffix in (".bin", ".pt", ".pth", ".pkl")]
    for path in pickles:  # Accelerate's optimiser / RNG states, never weights; they load with weights_only=True
        assert path.parent.name.startswith("checkpoint-") and path.name.startswith(("optimizer", "random_states"))
        from accelerate.utils import load as accelerate_load

        accelerate_load(path, map_location="cpu")  # weights_only=True under the hood (see the SIGTERM test)
    assert (finished_run / "model.safetensors").is_file() and (finished_run / "checkpoint-4" / "model.safetensors").is_file()
    # trust_remote_code=True would execute exactly these files, saved beside the weights
    assert {path.name for path in finished_run.glob("*.py")} == {
        "modeling_scratch_transformer.py", "configuration_scratch_transformer.py", "pipeline_translation.py",
        "translation_core.py", "decoding.py", "errors.py", "documents.py", "protected_spans.py", "glossary.py"}


def test_the_model_directory_translates_through_remote_code_where_the_package_cannot_be_imported(finished_run,
                                                                                                 tmp_path):
    """What a user of the Hub gets: `pipeline("translation", model=dir, trust_remote_code=True)` in a fresh process
    in which importing hf_scratch_transformer fails, so every line run comes from the directory."""
    script = textwrap.dedent(f"""
        import json, sys
        sys.modules["hf_scratch_transformer"] = None  # `import hf_scratch_transformer` now raises ImportError
        from transformers import pipeline
        translator = pipeline("translation", model={str(finished_run)!r}, trust_remote_code=True)
        print(json.dumps({{"pipeline": type(translator).__module__ + "." + type(translator).__name__,
                          "translations": translator(["Jesus wept.", ""], max_new_tokens=6),
                          "nbest": translator("Jesus wept.", num_beams=2, num_return_sequences=2, max_new_tokens=6)}}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["pipeline"].startswith("transformers_modules.") and report["pipeline"].endswith(
        "pipeline_translation.TranslationPipeline")
    [first, empty] = report["translations"]  # a model trained 4 steps: its translation may be empty too
    assert set(first) == {"translation_text"} and empty == {"translation_text": ""}
    assert [set(hypothesis) for hypothesis in report["nbest"]] == [{"translation_text", "score"}] * 2
    assert report["nbest"][0]["score"] >= report["nbest"][1]["score"]


def test_push_to_hub_offline_fails_cleanly_and_keeps_the_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(tiny_run_flags(tmp_path, max_steps=2, eval_steps=0, push_to_hub=True, hub_model_id="me/tiny"),
                MODEL_CARD_TEMPLATE)
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1
    assert message.startswith("training stopped: could not push to the hub repository 'me/tiny'")
    assert f"saved and complete in {tmp_path}" in message
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert model.num_parameters() > 0 and (tmp_path / "README.md").is_file()


def test_a_text_with_line_breaks_keeps_line_n_for_text_n():
    """A software corpus holds messages of two lines: written as they are, test_sources.txt had 2,735 lines for
    2,408 sources and line N no longer belonged to prediction N."""
    from hf_scratch_transformer.training.model_directory import as_lines, result_files

    texts = ["one", "two\nlines", "a\r\nb\u2028c\x85d", ""]
    assert as_lines(texts).splitlines() == ["one", "two lines", "a b c d", ""]
    predictions = result_files({}, {}, texts)["generated_predictions.txt"]
    assert len(predictions.splitlines()) == len(texts)
