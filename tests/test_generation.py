import json
import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import model_to_compare_decodings
from transformers import AutoModelForSeq2SeqLM, CompileConfig, GenerationConfig, pipeline
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from hf_scratch_transformer import TranslationPipeline, translation_pipeline


@pytest.fixture(scope="module")
def trained(pairs, tiny_tokenizer):
    """A tiny model trained briefly on the pairs: confident, non-degenerate outputs to compare decodings on."""
    return model_to_compare_decodings(pairs, tiny_tokenizer)


@pytest.fixture(scope="module")
def saved_dir(trained, tiny_tokenizer, tmp_path_factory):
    """Saved as docs/translating.md tells a user to save a model of their own: through the translation pipeline, which
    adds its code (model.save_pretrained alone saves the model's)."""
    directory = tmp_path_factory.mktemp("saved_model")
    translation_pipeline(trained, tiny_tokenizer).save_pretrained(directory)
    return directory


def encode(tokenizer, texts):
    return tokenizer(texts, padding=True, return_tensors="pt")


def test_greedy_with_cache_equals_without(trained, tiny_tokenizer, pairs):
    batch = encode(tiny_tokenizer, [source for source, _ in pairs])
    cached = trained.generate(**batch, use_cache=True)
    uncached = trained.generate(**batch, use_cache=False)
    assert torch.equal(cached, uncached)
    assert cached.shape[1] > 5


def compiled(backend="inductor"):
    """A CompileConfig that `generate()` honours on CPU too (by default it compiles decoding on accelerators only)."""
    config = CompileConfig(fullgraph=True, backend=backend, mode="default" if backend == "inductor" else None)
    config._compile_all_devices = True
    return config


@pytest.mark.parametrize(
    "options",
    [
        {},  # generation_config.json: max_new_tokens 47
        {"max_new_tokens": 20, "min_new_tokens": 10},
        {"min_length": 12, "max_length": 30},
        {"max_new_tokens": 25, "repetition_penalty": 1.5, "no_repeat_ngram_size": 2},
        {"max_new_tokens": 6, "forced_eos_token_id": 2},
        {"max_new_tokens": 15, "eos_token_id": [2, 7], "min_new_tokens": 3},
        {"max_new_tokens": 12, "decoder_input_ids": torch.tensor([[1, 40]] * 6)},  # a decoder prefix
        {"max_new_tokens": 12, "num_beams": 3},
    ],
    ids=["defaults", "min_new_tokens", "min_length", "penalties", "forced_eos", "two_eos", "prefix", "beams"],
)
def test_static_cache_gives_the_tokens_of_the_dynamic_cache(trained, tiny_tokenizer, pairs, options):
    batch = encode(tiny_tokenizer, [source for source, _ in pairs])  # padded: rows end at different steps
    dynamic = trained.generate(**batch, **options)
    assert torch.equal(trained.generate(**batch, **options, cache_implementation="static"), dynamic)
    assert dynamic.shape[1] > 3


def test_compiled_static_decoding_gives_the_tokens_of_the_dynamic_cache(trained, tiny_tokenizer, pairs):
    batch = encode(tiny_tokenizer, [source for source, _ in pairs])
    dynamic = trained.generate(**batch, max_new_tokens=20, num_beams=1)
    torch._dynamo.reset()
    compiled_output = trained.generate(**batch, max_new_tokens=20, num_beams=1, cache_implementation="static",
                                       compile_config=compiled())
    assert hasattr(trained, "_compiled_call"), "generate() did not compile the decoding step"
    assert torch.equal(compiled_output, dynamic)


@pytest.fixture
def transformers_warnings(caplog):
    """transformers' warnings as caplog records: its loggers do not propagate by default, `warning_once`
    remembers messages already given in this process (which would hide them from this test), and whatever ran
    before may have lowered its verbosity (a script's `set_verbosity_error`)."""
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.warning_once.cache_clear()
    transformers_logging.set_verbosity_warning()
    transformers_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            yield caplog
    finally:
        transformers_logging.disable_propagation()
        transformers_logging.set_verbosity(verbosity)


def test_generate_with_the_saved_generation_config_does_not_warn(saved_dir, tiny_tokenizer, pairs, recwarn,
                                                                  transformers_warnings):
    """The saved beam-search config (num_beams 4, early_stopping) decodes without warnings through generate()
    and through every greedy path of the package (translation core, pipeline)."""
    from hf_scratch_transformer.translation_core import DecodingOptions, TorchBackend, translate_batches

    loaded = AutoModelForSeq2SeqLM.from_pretrained(saved_dir).eval()
    batch = encode(tiny_tokenizer, [pairs[1][0]])
    loaded.generate(**batch, max_new_tokens=5)
    loaded.generate(**batch, max_new_tokens=5, num_beams=1)
    translate_batches(TorchBackend(loaded), tiny_tokenizer, [pairs[1][0]], DecodingOptions(num_beams=1))
    translation_pipeline(saved_dir)(pairs[1][0], num_beams=1)
    assert not [str(w.message) for w in recwarn.list], [str(w.message) for w in recwarn.list]
    assert not transformers_warnings.records, [record.getMessage() for record in transformers_warnings.records]


def test_the_warning_check_sees_transformers_warnings(saved_dir, tiny_tokenizer, pairs, transformers_warnings):
    """The check above can fail: a new GenerationConfig(num_beams=1) is merged with the saved one, whose
    early_stopping=True transformers then reports as invalid for greedy search (docs/translating.md)."""
    loaded = AutoModelForSeq2SeqLM.from_pretrained(saved_dir).eval()
    loaded.generate(**encode(tiny_tokenizer, [pairs[1][0]]), generation_config=GenerationConfig(num_beams=1,
                                                                                                max_new_tokens=5))
    assert any("early_stopping" in record.getMessage() for record in transformers_warnings.records)


def test_cached_step_logits_equal_full_forward(trained):
    source = torch.tensor([[5, 6, 7, 8, 2]])
    decoder_ids = torch.tensor([[1, 9, 10, 11, 12]])
    full = trained(input_ids=source, decoder_input_ids=decoder_ids).logits
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    encoder_outputs = trained.get_encoder()(input_ids=source)
    steps = []
    for position in range(decoder_ids.shape[1]):
        out = trained(encoder_outputs=encoder_outputs, decoder_input_ids=decoder_ids[:, position : position + 1],
                      cache=cache, use_cache=True)
        cache = out.cache
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    # two tokens at once over a cache (causal mask offset by the cache length)
    cache = trained(encoder_outputs=encoder_outputs, decoder_input_ids=decoder_ids[:, :3], use_cache=True).cache
    rest = trained(encoder_outputs=encoder_outputs, decoder_input_ids=decoder_ids[:, 3:], cache=cache,
                   use_cache=True).logits
    torch.testing.assert_close(rest, full[:, 3:], atol=1e-5, rtol=1e-5)


def test_the_cache_is_also_taken_under_its_name_before_transformers_5_24(trained):
    source, decoder_ids = torch.tensor([[5, 6, 7, 8, 2]]), torch.tensor([[1, 9, 10, 11, 12]])
    full = trained(input_ids=source, decoder_input_ids=decoder_ids).logits
    prefix = trained(input_ids=source, decoder_input_ids=decoder_ids[:, :3], use_cache=True)
    with pytest.warns(FutureWarning, match="past_key_values"):
        rest = trained(encoder_outputs=(prefix.encoder_last_hidden_state,), decoder_input_ids=decoder_ids[:, 3:],
                       past_key_values=prefix.cache, use_cache=True).logits
    torch.testing.assert_close(rest, full[:, 3:], atol=1e-5, rtol=1e-5)


def test_padded_batch_decodes_as_each_sentence_alone(trained, tiny_tokenizer, pairs):
    sources = [source for source, _ in pairs]
    batch = trained.generate(**encode(tiny_tokenizer, sources))
    batch_texts = tiny_tokenizer.batch_decode(batch, skip_special_tokens=True)
    alone_texts = [
        tiny_tokenizer.decode(trained.generate(**encode(tiny_tokenizer, [source]))[0], skip_special_tokens=True)
        for source in sources
    ]
    assert batch_texts == alone_texts


def test_beam_search_and_sampling(trained, tiny_tokenizer, pairs):
    batch = encode(tiny_tokenizer, [pairs[0][0], pairs[5][0]])
    beams = trained.generate(**batch, num_beams=4, num_return_sequences=2, max_new_tokens=20)
    assert beams.shape[0] == 4
    scored = trained.generate(**batch, num_beams=4, max_new_tokens=20, output_scores=True, return_dict_in_generate=True)
    assert scored.sequences_scores.shape == (2,)
    uncached = trained.generate(**batch, num_beams=4, max_new_tokens=20, use_cache=False)
    assert torch.equal(trained.generate(**batch, num_beams=4, max_new_tokens=20), uncached)
    torch.manual_seed(1)
    sampled = trained.generate(**batch, do_sample=True, top_k=10, max_new_tokens=20)
    assert sampled.shape[0] == 2 and (sampled[:, 0] == 1).all()


def test_generate_returns_attentions(trained, tiny_tokenizer, pairs):
    batch = encode(tiny_tokenizer, [pairs[0][0]])
    trained.set_attn_implementation("eager")  # the fused kernels return no weights
    try:
        result = trained.generate(**batch, output_attentions=True, return_dict_in_generate=True, max_new_tokens=5)
    finally:
        trained.set_attn_implementation("sdpa")
    source_length = batch["input_ids"].shape[1]
    assert len(result.encoder_attentions) == trained.config.encoder_layers
    first_step = result.cross_attentions[0]
    assert len(first_step) == trained.config.decoder_layers
    assert first_step[-1].shape[-1] == source_length
    torch.testing.assert_close(first_step[-1].sum(-1), torch.ones(first_step[-1].shape[:-1]))


def test_saved_generation_config_needs_no_arguments(saved_dir, tiny_tokenizer, pairs, trained):
    config = json.loads((saved_dir / "generation_config.json").read_text())
    assert config["decoder_start_token_id"] == 1 and config["eos_token_id"] == 2 and config["max_new_tokens"] == 47
    assert "max_length" not in config
    loaded = AutoModelForSeq2SeqLM.from_pretrained(saved_dir).eval()
    batch = encode(tiny_tokenizer, [pairs[1][0]])
    assert torch.equal(loaded.generate(**batch), trained.generate(**batch))


def test_translation_pipeline_from_object_and_directory(trained, tiny_tokenizer, saved_dir, pairs):
    expected = tiny_tokenizer.decode(trained.generate(**encode(tiny_tokenizer, [pairs[0][0]]))[0], skip_special_tokens=True)
    from_object = translation_pipeline(trained, tiny_tokenizer)
    assert isinstance(from_object, TranslationPipeline)
    assert from_object(pairs[0][0]) == [{"translation_text": expected}]
    assert from_object([pairs[0][0], pairs[1][0]])[0] == {"translation_text": expected}
    from_directory = pipeline("translation", model=str(saved_dir), trust_remote_code=True)
    assert from_directory(pairs[0][0]) == [{"translation_text": expected}]
    assert from_directory(pairs[0][0], num_beams=3, max_new_tokens=4)[0]["translation_text"]


def test_remote_code_in_a_process_without_the_package(saved_dir, trained, tiny_tokenizer, pairs, tmp_path):
    """auto_map names all three Auto classes and the pipeline; nothing imports hf_scratch_transformer."""
    batch = encode(tiny_tokenizer, [pairs[2][0]])
    decoder_input_ids = torch.tensor([[1, 5, 6, 7]])
    expected_logits = trained(**batch, decoder_input_ids=decoder_input_ids).logits
    expected_text = tiny_tokenizer.decode(trained.generate(**batch)[0], skip_special_tokens=True)
    torch.save({"batch": dict(batch), "decoder_input_ids": decoder_input_ids}, tmp_path / "inputs.pt")
    script = textwrap.dedent(f"""
        import sys, json, torch
        sys.modules["hf_scratch_transformer"] = None  # importing the package now fails: only the directory's code runs
        from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, pipeline
        directory, inputs = {str(saved_dir)!r}, torch.load({str(tmp_path / "inputs.pt")!r})
        config = AutoConfig.from_pretrained(directory, trust_remote_code=True)
        base = AutoModel.from_pretrained(directory, trust_remote_code=True)
        model, info = AutoModelForSeq2SeqLM.from_pretrained(directory, trust_remote_code=True, output_loading_info=True)
        logits = model.eval()(**inputs["batch"], decoder_input_ids=inputs["decoder_input_ids"]).logits
        torch.save(logits, {str(tmp_path / "logits.pt")!r})
        translator = pipeline("translation", model=directory, trust_remote_code=True)
        print(json.dumps({{
            "config": type(config).__name__, "base": type(base).__name__, "model": type(model).__name__,
            "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
            "tied": model.lm_head.weight is model.model.shared.weight,
            "translation": translator({pairs[2][0]!r})[0]["translation_text"],
            "package_imported": sys.modules.get("hf_scratch_transformer") is not None,
        }}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {
        "config": "ScratchTransformerConfig", "base": "ScratchTransformerModel",
        "model": "ScratchTransformerForConditionalGeneration", "missing": [], "unexpected": [], "tied": True,
        "translation": expected_text, "package_imported": False,
    }
    # another process may order its sums differently (it failed bit-equality once, on a loaded machine)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected_logits, rtol=0, atol=1e-5)


def test_the_pipeline_reads_documents_protects_spans_and_honours_a_glossary(trained_model):
    from hf_scratch_transformer.translation.translate import translate

    model, tokenizer, _ = trained_model
    pipe = translation_pipeline(model, tokenizer)
    document = "Jesus wept.  God is love.\n\nThe Lord is my shepherd."
    assert pipe(document) == [{"translation_text": translate(model, tokenizer, [document])[0]}]
    assert pipe(document)[0]["translation_text"].count("\n\n") == 1
    [result] = pipe("Jesus wept <b>%d</b> times.", protect=True, glossary={"Jesus": "Cristo"}, return_details=True)
    assert set(result) == {"translation_text", "confidence", "spans", "glossary"} and result["confidence"] < 0
    assert result["translation_text"].count("<b>%d</b>") == 1 and "Cristo" in result["translation_text"], result
    assert [entry["honoured"] for entry in result["glossary"]] == [True]
    assert [entry["text"] for entry in result["spans"]] == ["<b>", "%d", "</b>"]
    [[best, second]] = pipe(["God is love."], num_beams=3, num_return_sequences=2, segment=False)
    assert best["score"] >= second["score"]


def test_a_directory_saved_by_the_pipeline_translates_documents_as_remote_code(saved_dir, tmp_path):
    """The pipeline's save copies every module the translation core reads texts with (documents, protected spans,
    glossary): `pipeline(..., trust_remote_code=True)` translates a document with a glossary and a placeholder in a
    process where importing the package fails."""
    directory = saved_dir
    script = textwrap.dedent(f"""
        import sys, json
        sys.modules["hf_scratch_transformer"] = None  # `import hf_scratch_transformer` now raises ImportError
        from transformers import pipeline
        translator = pipeline("translation", model={str(directory)!r}, trust_remote_code=True)
        [result] = translator("Jesus wept.  God is love. %s", glossary={{"God": "Dios"}}, protect=True,
                              return_details=True)
        print(json.dumps({{"text": result["translation_text"], "glossary": result["glossary"],
                          "package_imported": sys.modules.get("hf_scratch_transformer") is not None}}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["package_imported"] is False and report["text"].count("%s") == 1
    assert [entry["honoured"] for entry in report["glossary"]] == [True]
