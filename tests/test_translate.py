"""translate.py: loading a model directory (every broken one refused with one line) and translating any input.
Cases tested elsewhere: too-long ids given to the model (test_modeling.py); a directory without weights and
unreadable CLI input (test_cli.py)."""

import json
import logging
import shutil
import unicodedata

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from hf_scratch_transformer import cli, translation_pipeline
from hf_scratch_transformer.translate import ModelLoadError, load_model_and_tokenizer, translate_texts


# ------------------------------------------------------------------------------------------------------------- loading


@pytest.fixture
def model_copy(finished_run, tmp_path):
    """A copy of the finished run's final model (no checkpoints) to break."""
    copy = tmp_path / "model"
    shutil.copytree(finished_run, copy, ignore=shutil.ignore_patterns("checkpoint-*"))
    return copy


def _break(case, model_dir):
    weights = model_dir / "model.safetensors"
    if case == "no_weights":
        weights.unlink()
        return "no model weights"
    if case == "pickle_weights_only":
        torch.save(load_file(weights), model_dir / "pytorch_model.bin")
        weights.unlink()
        return "only pickled weights (pytorch_model.bin)"
    if case == "truncated_safetensors":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) * 2 // 3])
        return "model.safetensors is truncated or corrupted"
    if case == "corrupted_safetensors_header":
        data = bytearray(weights.read_bytes())
        data[8:40] = b"\x00" * 32
        weights.write_bytes(bytes(data))
        return f"model.safetensors is truncated or corrupted ({len(data)} bytes; safetensors: invalid JSON in header"
    if case == "packed_attention_projections":  # the layout saved before q/k/v were separate
        tensors = load_file(weights)
        for key in [k for k in tensors if k.endswith("self_attn.q_proj.weight")]:
            prefix = key[: -len("q_proj.weight")]
            tensors[prefix + "qkv_proj.weight"] = torch.cat([tensors.pop(prefix + f"{n}_proj.weight") for n in "qkv"])
        save_file(tensors, weights, metadata={"format": "pt"})
        return "hold packed attention projections"
    if case == "other_model_type":
        config = json.loads((model_dir / "config.json").read_text())
        config["model_type"] = "bert"
        (model_dir / "config.json").write_text(json.dumps(config))
        return "describes a model of type 'bert', not a translation"
    if case == "tokenizer_larger_than_embeddings":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer.add_tokens([f"extra{i}" for i in range(50)])
        tokenizer.save_pretrained(model_dir)
        return "embeddings: the tokenizer files belong to another model"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["no_weights", "pickle_weights_only", "truncated_safetensors",
                                  "corrupted_safetensors_header", "packed_attention_projections", "other_model_type",
                                  "tokenizer_larger_than_embeddings"])
def test_broken_model_directory_gives_one_line(case, model_copy, capsys):
    expected = _break(case, model_copy)
    with pytest.raises(ModelLoadError) as error:
        load_model_and_tokenizer(model_copy)
    assert expected in str(error.value) and "\n" not in str(error.value)
    # the command line: one line, exit status 2, nothing on stdout, no interactive trust_remote_code prompt
    assert cli.main(["--model", str(model_copy), "Jesus wept."]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and expected in captured.err


def test_pipeline_refuses_a_tokenizer_larger_than_the_embeddings(model_copy):
    _break("tokenizer_larger_than_embeddings", model_copy)
    with pytest.raises(ValueError, match=r"The tokenizer has \d+ tokens but the model only \d+ embeddings"):
        translation_pipeline(str(model_copy))


# ----------------------------------------------------------------------------------------------------------- inference


@pytest.fixture(scope="module")
def finished_model(finished_run):
    """(model, tokenizer) of the finished run, as a user loads them: the package's tokenizer, trained by train.py."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices on shared cores
    yield load_model_and_tokenizer(finished_run)
    torch.set_num_threads(threads)


def test_empty_and_whitespace_inputs_translate_to_empty_lines(finished_model):
    model, tokenizer = finished_model
    assert translate_texts(model, tokenizer, ["", "   ", "\t\n", "Jesus wept.", ""])[:3] == ["", "", ""]
    assert translate_texts(model, tokenizer, ["", "   "]) == ["", ""]


def test_too_long_input_is_truncated_with_a_warning(finished_model, caplog):
    model, tokenizer = finished_model
    long_text = " ".join(["In the beginning God created the heavens and the earth."] * 30)
    with caplog.at_level(logging.WARNING, logger="hf_scratch_transformer"):
        [translation] = translate_texts(model, tokenizer, [long_text], max_new_tokens=4)
    assert isinstance(translation, str)
    assert "1 input text(s) longer than the model's limit of 96 tokens were truncated" in caplog.text
    # the pipeline truncates as well; with truncation=False the model's own error names the limit
    # (the model given too-long ids: tests/test_modeling.py::test_too_long_input_raises_a_clear_error)
    pipe = translation_pipeline(model, tokenizer)
    assert set(pipe(long_text, max_new_tokens=4)[0]) == {"translation_text"}
    with pytest.raises(ValueError, match="max_position_embeddings"):
        pipe(long_text, truncation=False, max_new_tokens=4)


def test_unknown_characters_never_become_unk(finished_model):
    model, tokenizer = finished_model
    texts = ["漢字とかな", "emoji 🙂🧪", "\u0378 unassigned", "zero\u200bwidth", "control \x00\x07", "<s> </s> <pad>"]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == unicodedata.normalize("NFC", text)
    assert all(isinstance(out, str) for out in translate_texts(model, tokenizer, texts, max_new_tokens=4))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=80))
def test_any_unicode_string_goes_through_tokenizer_and_model(finished_model, text):
    model, tokenizer = finished_model
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == unicodedata.normalize("NFC", text)
    [translation] = translate_texts(model, tokenizer, [text], max_new_tokens=3)
    assert isinstance(translation, str) and "\n" not in translation
    if not text.strip():
        assert translation == ""
