"""translate.py: loading a model directory (every broken or poisoned one refused with one line) and translating any
input through `translate()`: n-best lists with scores, alignments, checked options and inputs.
Cases tested elsewhere: too-long ids given to the model (test_modeling.py); a directory without weights and
unreadable CLI input (test_cli.py); the length bound and local paths (test_workflows.py); the core's batching
(test_translation_core.py)."""

import json
import logging
import shutil
import unicodedata

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from hf_scratch_transformer import translation_pipeline
from hf_scratch_transformer.translation import cli
from hf_scratch_transformer import cpu_threads, decoding
from hf_scratch_transformer.translation.translate import (ModelLoadError, inference_precision,
                                                            load_model_and_tokenizer, translate)
from hf_scratch_transformer.translation_core import TorchBackend, format_alignment, hard_alignment


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
    if case == "packed_attention_projections":  # a layout this version does not have: extra and missing tensors
        tensors = load_file(weights)
        for key in [k for k in tensors if k.endswith("self_attn.q_proj.weight")]:
            prefix = key[: -len("q_proj.weight")]
            tensors[prefix + "qkv_proj.weight"] = torch.cat([tensors.pop(prefix + f"{n}_proj.weight") for n in "qkv"])
        save_file(tensors, weights, metadata={"format": "pt"})
        return "tensor(s) of the model config.json describes (e.g. model."
    if case in ("nan_weights", "inf_weights"):
        tensors = load_file(weights)
        tensors["model.decoder.layers.1.feed_forward.fc2.weight"][0, 0] = float("nan" if case == "nan_weights" else "inf")
        save_file(tensors, weights, metadata={"format": "pt"})
        return "hold NaN or infinite values (model.decoder.layers.1.feed_forward.fc2.weight)"
    if case in ("missing_tensor", "extra_tensor"):
        tensors = load_file(weights)
        if case == "missing_tensor":
            del tensors["model.encoder.layers.0.feed_forward.fc1.bias"]
        else:
            tensors["model.encoder.extra_gate"] = torch.ones(3)
        save_file(tensors, weights, metadata={"format": "pt"})
        return ("lacks 1 tensor(s) of the model config.json describes (e.g. model.encoder.layers.0.feed_forward.fc1.bias)"
                if case == "missing_tensor" else "holds 1 tensor(s) the model config.json describes does not have (e.g. "
                "model.encoder.extra_gate)")
    if case == "config_contradicts_weights":
        config = json.loads((model_dir / "config.json").read_text())
        config["d_model"] = 96
        (model_dir / "config.json").write_text(json.dumps(config))
        return "contradicts model.safetensors: model.decoder.layer_norm.bias is (64,) in the weights but (96,)"
    if case in ("garbage_tokenizer_json", "empty_tokenizer_json"):
        (model_dir / "tokenizer.json").write_text("{garbage" if case == "garbage_tokenizer_json" else "")
        return "tokenizer.json is not valid JSON"
    if case == "tokenizer_json_of_no_tokenizer":
        (model_dir / "tokenizer.json").write_text('{"version": "1.0"}')
        return "cannot be read"
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
        size = json.loads((model_dir / "config.json").read_text())["vocab_size"]  # 600 and the sentinel tokens
        return f"tokens but the model only {size} embeddings: ids from {size} on are outside the model's vocabulary"
    raise AssertionError(case)


BROKEN = ["no_weights", "pickle_weights_only", "truncated_safetensors", "corrupted_safetensors_header",
          "packed_attention_projections", "other_model_type", "tokenizer_larger_than_embeddings", "nan_weights",
          "inf_weights", "missing_tensor", "extra_tensor", "config_contradicts_weights", "garbage_tokenizer_json",
          "empty_tokenizer_json", "tokenizer_json_of_no_tokenizer"]


@pytest.mark.parametrize("case", BROKEN)
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
    with pytest.raises(ValueError, match=r"the tokenizer has \d+ tokens but the model only \d+ embeddings"):
        translation_pipeline(str(model_copy))


# ----------------------------------------------------------------------------------------------------------- inference


@pytest.fixture(scope="module")
def finished_model(finished_run):
    """(model, tokenizer) of the finished run, as a user loads them: the package's tokenizer, trained by train.py."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices on shared cores
    yield load_model_and_tokenizer(finished_run)
    torch.set_num_threads(threads)


def test_white_space_alone_comes_back_as_it_is_and_never_reaches_the_model(finished_model):
    model, tokenizer = finished_model
    assert translate(model, tokenizer, ["", "   ", "\t\n", "Jesus wept.", ""])[:3] == ["", "   ", "\t\n"]
    assert translate(model, tokenizer, ["", "   "], num_return_sequences=1) == [[], []]


def test_too_long_input_is_split_and_translated_whole_with_a_warning(finished_model, caplog):
    """A text longer than the model's limit (96 tokens here) is cut into sentences, and one sentence longer than
    the limit into pieces: every piece is translated, nothing is cut off (the pipeline does the same)."""
    model, tokenizer = finished_model
    sentence = "In the beginning God created the heavens and the earth."
    document = " ".join([sentence] * 30)
    one_sentence = ", and ".join([sentence[:-1]] * 12) + "."  # no sentence end until the last word
    assert len(tokenizer(one_sentence)["input_ids"]) > 96
    with caplog.at_level(logging.WARNING, logger="hf_scratch_transformer"):
        [whole, long_one] = translate(model, tokenizer, [document, one_sentence], details=True, max_new_tokens=4)
    assert len(whole.segments) == 30 and "truncated" not in caplog.text
    assert "1 sentence(s) longer than the model's limit of 95 tokens were split into" in caplog.text
    assert len(long_one.segments) >= 2 and " ".join(s.source for s in long_one.segments) == one_sentence
    assert all(len(tokenizer(s.model_text)["input_ids"]) <= 96 for s in long_one.segments)
    pipe = translation_pipeline(model, tokenizer)
    assert pipe(one_sentence, max_new_tokens=4) == [{"translation_text": long_one.text}]


def test_unknown_characters_never_become_unk(finished_model):
    model, tokenizer = finished_model
    texts = ["漢字とかな", "emoji 🙂🧪", "\u0378 unassigned", "zero\u200bwidth", "control \x00\x07", "<s> </s> <pad>"]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == unicodedata.normalize("NFC", text)
    assert all(isinstance(out, str) for out in translate(model, tokenizer, texts, max_new_tokens=4))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=80))
def test_any_unicode_string_goes_through_tokenizer_and_model(finished_model, text):
    model, tokenizer = finished_model
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == unicodedata.normalize("NFC", text)
    [translation] = translate(model, tokenizer, [text], max_new_tokens=3)
    assert isinstance(translation, str) and translation.count("\n") <= text.count("\n")  # only the text's own
    if not text.strip():
        assert translation == text  # white space alone comes back as it is


# ------------------------------------------------------------------------------------ inputs and options, checked


@pytest.mark.parametrize("texts, named", [(["Jesus wept.", None], "texts[1] is None"),
                                         (["a", b"bytes"], "texts[1] is b'bytes'"),
                                         ("Jesus wept.", "texts must be a list of strings, got str"),
                                         ([3.5], "texts[0] is 3.5")])
def test_texts_that_are_not_strings_are_named_in_one_line(trained_model, texts, named):
    model, tokenizer, _ = trained_model
    with pytest.raises(TypeError) as error:
        translate(model, tokenizer, texts)
    assert named in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("option, value, requirement", [
    ("max_len_a", float("nan"), "a finite number >= 0"), ("max_len_b", float("inf"), "a finite number >= 0"),
    ("max_len_a", -1.0, "a finite number >= 0"), ("num_beams", 0, "a whole number >= 1"),
    ("batch_size", 0, "a whole number >= 1"), ("max_new_tokens", -3, "a whole number >= 1"),
    ("num_return_sequences", 0, "a whole number >= 1"), ("num_beams", True, "a whole number >= 1"),
    ("num_return_sequences", 3, "at most the beam size (2)"),
])
def test_decoding_options_are_refused_by_name_before_any_work(trained_model, option, value, requirement,
                                                              monkeypatch):
    model, tokenizer, _ = trained_model
    monkeypatch.setattr(TorchBackend, "generate", lambda *a, **k: pytest.fail("decoding ran"))
    kwargs = {"num_beams": 2} if option == "num_return_sequences" else {}
    with pytest.raises(ValueError) as error:
        translate(model, tokenizer, ["Jesus wept."], **{**kwargs, option: value})
    assert str(error.value) == f"{option} must be {requirement}, got {value!r}"


# ------------------------------------------------------------------------------------------- n-best, alignments


def test_nbest_gives_n_hypotheses_per_text_best_first(trained_model):
    model, tokenizer, _ = trained_model
    texts = ["Jesus wept.", "", "God is love.", "The Lord is my shepherd."]
    found = translate(model, tokenizer, texts, num_beams=5, num_return_sequences=4)
    assert [len(hypotheses) for hypotheses in found] == [4, 0, 4, 4]
    for hypotheses in found:
        scores = [h.score for h in hypotheses]
        assert scores == sorted(scores, reverse=True) and all(score <= 0 for score in scores)
        assert len({tuple(h.token_ids) for h in hypotheses}) == len(hypotheses)  # distinct hypotheses
    assert [found[i][0].text for i in (0, 2, 3)] == ["Jesús lloró.", "Dios es amor.", "El Señor es mi pastor."]
    # the best of the n-best list is the translation itself
    assert [h[0].text if h else "" for h in found] == translate(model, tokenizer, texts, num_beams=5)


def test_a_score_is_the_length_normalised_log_probability(trained_model):
    """Greedy and beam scores: the sum of the tokens' log-probabilities, </s> included, over the length
    (length_penalty 1), recomputed here by a teacher-forced forward pass."""
    model, tokenizer, _ = trained_model
    for beams in (1, 3):
        [[best]] = translate(model, tokenizer, ["The tree of life."], num_beams=beams, num_return_sequences=1)
        batch = tokenizer(["The tree of life."], return_tensors="pt")
        labels = torch.tensor([best.token_ids])
        with torch.no_grad():
            log_probs = model(**batch, labels=labels).logits.log_softmax(-1)
        expected = log_probs.gather(-1, labels[..., None]).sum().item() / len(best.token_ids)
        assert best.score == pytest.approx(expected, abs=1e-4)


def test_alignments_are_pairs_within_the_words_and_tokens_of_both_sides(trained_model):
    model, tokenizer, _ = trained_model
    source = "In the beginning God created the heavens and the earth."
    [[best]] = translate(model, tokenizer, [source], num_return_sequences=1)
    assert best.text == "En el principio creó Dios los cielos y la tierra."
    words = hard_alignment(model, tokenizer, source, best.token_ids)
    assert words == sorted(set(words)) and words
    assert all(0 <= s < len(source.split()) and 0 <= t < len(best.text.split()) for s, t in words)
    assert {t for _, t in words} == set(range(len(best.text.split())))  # every target word is aligned
    tokens = hard_alignment(model, tokenizer, source, best.token_ids, unit="tokens", layer=0)
    source_tokens = len(tokenizer(source)["input_ids"]) - 1  # without </s>
    assert sorted({t for _, t in tokens}) == list(range(len(best.token_ids) - 1))  # one pair per target token
    assert all(0 <= s < source_tokens for s, _ in tokens)
    assert format_alignment([(0, 1), (2, 0)]) == "0-1 2-0"
    with pytest.raises(ValueError, match="not a decoder layer: the model has 2"):
        hard_alignment(model, tokenizer, source, best.token_ids, layer=2)


@pytest.mark.parametrize("flags, device, chosen", [
    ({"avx512_bf16", "avx512_vnni"}, "cpu", "int8"),  # an AMD EPYC (Zen 4): decoding is bound by reading the weights
    ({"avx512_bf16", "amx_bf16"}, "cpu", "bfloat16_products"),  # a Xeon with AMX: bf16 products from 16 rows on
    ({"avx512f"}, "cpu", "float32"),  # no bf16 units
    ({"avx512_bf16"}, "cuda", "float32"),
    ({"avx512_bf16", "amx_bf16"}, "cuda", "float32"),
])
def test_dtype_auto_is_int8_with_avx512_bf16_and_no_amx_and_bf16_products_with_amx(trained_model_dir, monkeypatch,
                                                                                    flags, device, chosen):
    """The CPU's flags faked as /proc/cpuinfo would give them; a model loaded with dtype="auto" on the CPU follows
    them, an explicit dtype wins, and the library's default stays the weights as saved (fp32, no int8 copies)."""
    monkeypatch.setattr(cpu_threads, "cpu_model_and_flags", lambda: ("a CPU", flags))
    assert inference_precision(torch.device(device)) == chosen
    for requested in ("float32", "bfloat16", "bfloat16_products", "int8"):
        assert inference_precision(torch.device(device), requested) == requested
    if device == "cpu":
        model, _ = load_model_and_tokenizer(trained_model_dir, "cpu", dtype="auto")
        weights = torch.bfloat16 if chosen == "bfloat16" else torch.float32
        assert {parameter.dtype for parameter in model.parameters()} == {weights}
        assert hasattr(model, "decoding_weights") == (chosen in ("int8", "bfloat16_products"))
        if chosen != "float32":
            product = {"int8": decoding.Int8Linear, "bfloat16_products": decoding.Bf16Linear}[chosen]
            assert isinstance(model.decoding_weights.output_projection, product)
        model, _ = load_model_and_tokenizer(trained_model_dir, "cpu")
        assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}
        assert not hasattr(model, "decoding_weights")


@pytest.mark.parametrize("flags, slower", [
    ({"avx2", "fma"}, {"int8", "bfloat16", "bfloat16_products"}),  # an AMD EPYC (Zen 3): AVX2 only, both emulated
    ({"avx2", "avx_vnni"}, {"bfloat16", "bfloat16_products"}),  # int8 dot products, no bf16 units
    ({"avx512_bf16", "avx512_vnni"}, set()),  # an AMD EPYC (Zen 4)
    ({"avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"}, set()),  # a Xeon with AMX
], ids=["avx2", "avx_vnni", "avx512_bf16", "amx"])
def test_a_dtype_emulated_on_this_cpu_is_loaded_with_one_warning_that_says_so(trained_model_dir, monkeypatch, caplog,
                                                                             flags, slower):
    """The CPU's flags faked as /proc/cpuinfo gives them: int8 without int8 dot-product units and bf16 without bf16
    units load as asked, with a warning naming the dtype; auto, float32 and what the CPU has units for, without."""
    monkeypatch.setattr(cpu_threads, "cpu_model_and_flags", lambda: ("a CPU", flags))
    for dtype in ("auto", "float32", "bfloat16", "bfloat16_products", "int8"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_scratch_transformer"):
            load_model_and_tokenizer(trained_model_dir, "cpu", dtype=dtype)
        warned = [record.getMessage() for record in caplog.records if "slower than --dtype auto" in record.getMessage()]
        assert len(warned) == (dtype in slower), (dtype, warned)
        assert all(message.startswith(f"dtype {dtype} on this CPU, which has no ") for message in warned)


def test_a_dtype_that_is_not_offered_is_refused_not_read_as_fp32(trained_model_dir):
    with pytest.raises(ValueError, match="^dtype 'float16' is not one of auto, float32, bfloat16, bfloat16_products, int8$"):
        load_model_and_tokenizer(trained_model_dir, "cpu", dtype="float16")


@pytest.mark.parametrize("flags, encoder_dtype", [
    ({"avx512_bf16", "avx512_vnni"}, torch.bfloat16),  # an AMD EPYC (Zen 4)
    ({"avx512_bf16", "amx_bf16"}, torch.bfloat16),  # a Xeon with AMX
    ({"avx512f", "avx512_vnni"}, torch.float32),  # no bf16 units: bf16 would be emulated
])
@pytest.mark.parametrize("dtype, product", [("int8", decoding.Int8Linear),
                                            ("bfloat16_products", decoding.Bf16Linear)])
def test_dtypes_int8_and_bf16_products_load_fp32_weights_with_copies_for_a_cpu_only(
        trained_model_dir, monkeypatch, flags, encoder_dtype, dtype, product):
    """dtype="int8" or "bfloat16_products": the weights stay fp32 and the decoding loops get their copies, with a bf16
    copy of the encoder where the CPU (its flags faked) has bf16 units; asked for another device it is refused in one
    line, before anything is moved there (this machine has no GPU: a move would fail otherwise)."""
    monkeypatch.setattr(cpu_threads, "cpu_model_and_flags", lambda: ("a CPU", flags))
    model, _ = load_model_and_tokenizer(trained_model_dir, "cpu", dtype=dtype)
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}
    assert len(model.decoding_weights.decoder_layers) == model.config.decoder_layers
    assert all(isinstance(function, product) for layer in model.decoding_weights.decoder_layers
               for function in layer.values())
    encoder = model.decoding_weights.encoder
    if encoder_dtype == torch.float32:
        assert encoder is None  # the loops run the model's own
    else:
        assert {parameter.dtype for parameter in encoder.parameters()} == {encoder_dtype}
    with pytest.raises(ModelLoadError, match=f"^dtype {dtype} translates on a CPU only, not on cuda: use float32 or "
                                             "bfloat16$"):
        load_model_and_tokenizer(trained_model_dir, "cuda", dtype=dtype)
