import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, GenerationConfig, GenerationMixin, TextStreamer, pipeline
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from hf_scratch_transformer import (
    ScratchTransformerConfig,
    ScratchTransformerForConditionalGeneration,
    TranslationPipeline,
    translation_pipeline,
)
from hf_scratch_transformer.modeling_scratch_transformer import PreallocatedLayer

GENERATION = dict(decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def trained(pairs, tiny_tokenizer):
    """A tiny model trained briefly on the pairs: confident, non-degenerate outputs to compare decodings on."""
    torch.manual_seed(0)
    config = ScratchTransformerConfig.from_preset("tiny", vocab_size=len(tiny_tokenizer), dropout=0.0)
    model = ScratchTransformerForConditionalGeneration(config)
    sources, targets = zip(*pairs)
    batch = tiny_tokenizer(list(sources), text_target=list(targets), padding=True, return_tensors="pt")
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] == 0, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(60):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.generation_config = GenerationConfig(**GENERATION, max_length=48)
    return model.eval()


@pytest.fixture(scope="module")
def saved_dir(trained, tiny_tokenizer, tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved_model")
    trained.save_pretrained(directory)
    tiny_tokenizer.save_pretrained(directory)
    return directory


def encode(tokenizer, texts):
    return tokenizer(texts, padding=True, return_tensors="pt")


def test_greedy_with_cache_equals_without(trained, tiny_tokenizer, pairs):
    batch = encode(tiny_tokenizer, [source for source, _ in pairs])
    cached = trained.generate(**batch, use_cache=True)
    uncached = trained.generate(**batch, use_cache=False)
    assert torch.equal(cached, uncached)
    assert cached.shape[1] > 5


@pytest.fixture
def fast_steps(monkeypatch):
    """Counts the decoding steps run by the model's own greedy loop (its cache is only used there)."""
    calls = []
    update = PreallocatedLayer.update
    monkeypatch.setattr(PreallocatedLayer, "update", lambda self, *a, **k: calls.append(1) or update(self, *a, **k))
    return calls


def transformers_greedy(model, **kwargs):
    """The same request decoded by transformers' own loop, `GenerationMixin._sample`."""
    return model.generate(**kwargs, custom_generate=GenerationMixin._sample)


@pytest.mark.parametrize(
    "options",
    [
        {},  # generation_config.json: max_length 48
        {"max_new_tokens": 20, "min_new_tokens": 10},
        {"min_length": 12, "max_length": 30},
        {"max_new_tokens": 25, "repetition_penalty": 1.5, "no_repeat_ngram_size": 2},
        {"max_new_tokens": 6, "forced_eos_token_id": 2},
        {"max_new_tokens": 15, "eos_token_id": [2, 7], "min_new_tokens": 3},
        {"max_new_tokens": 12, "decoder_input_ids": torch.tensor([[1, 40]] * 6)},  # a decoder prefix
    ],
    ids=["defaults", "min_new_tokens", "min_length", "penalties", "forced_eos", "two_eos", "prefix"],
)
def test_fast_greedy_loop_equals_transformers_loop(trained, tiny_tokenizer, pairs, fast_steps, options):
    batch = encode(tiny_tokenizer, [source for source, _ in pairs])  # padded: rows end at different steps
    ours = trained.generate(**batch, **options)
    assert fast_steps, "the model's greedy loop was not used"
    assert torch.equal(ours, transformers_greedy(trained, **batch, **options))
    assert ours.shape[1] > 3


@pytest.mark.parametrize("seed", [0, 1])
def test_fast_greedy_loop_equals_transformers_loop_on_random_models(seed, fast_steps):
    torch.manual_seed(seed)
    config = ScratchTransformerConfig.from_preset("tiny", vocab_size=50, dropout=0.0, max_position_embeddings=128)
    model = ScratchTransformerForConditionalGeneration(config).eval()
    source = torch.randint(4, 50, (5, 9))
    mask = torch.ones_like(source)
    mask[1, 6:], mask[3, 2:] = 0, 0
    options = dict(attention_mask=mask, max_new_tokens=40, **GENERATION)
    assert torch.equal(model.generate(source, **options), transformers_greedy(model, input_ids=source, **options))
    assert fast_steps


@pytest.mark.parametrize(
    "options",
    [{"return_dict_in_generate": True}, {"output_scores": True, "return_dict_in_generate": True},
     {"use_cache": False}, {"do_sample": True, "top_k": 1}],
    ids=["dict", "scores", "no_cache", "sampling"],
)
def test_other_requests_use_transformers_loop(trained, tiny_tokenizer, pairs, fast_steps, options):
    batch = encode(tiny_tokenizer, [source for source, _ in pairs[:3]])
    result = trained.generate(**batch, max_new_tokens=10, **options)
    assert not fast_steps
    sequences = result.sequences if options.get("return_dict_in_generate") else result
    assert torch.equal(sequences, trained.generate(**batch, max_new_tokens=10))  # top_k=1 sampling is greedy


def test_streamer_uses_transformers_loop(trained, tiny_tokenizer, pairs, fast_steps, capsys):
    batch = encode(tiny_tokenizer, [pairs[0][0]])
    streamed = trained.generate(**batch, max_new_tokens=8, streamer=TextStreamer(tiny_tokenizer))
    assert not fast_steps and capsys.readouterr().out.strip()
    assert torch.equal(streamed, trained.generate(**batch, max_new_tokens=8))


def test_preallocated_layer_appends_like_concatenation():
    layer, keys, values = PreallocatedLayer(), [], []
    for length in [3] + [1] * 40 + [30]:  # crosses the first capacity (32) and doubles twice
        key, value = torch.randn(2, 4, length, 8), torch.randn(2, 4, length, 8)
        keys.append(key), values.append(value)
        all_keys, all_values = layer.update(key, value)
        assert torch.equal(all_keys, torch.cat(keys, dim=2)) and torch.equal(all_values, torch.cat(values, dim=2))
    assert layer.get_seq_length() == 73


def test_cached_step_logits_equal_full_forward(trained):
    source = torch.tensor([[5, 6, 7, 8, 2]])
    decoder_ids = torch.tensor([[1, 9, 10, 11, 12]])
    full = trained(input_ids=source, decoder_input_ids=decoder_ids).logits
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    encoder_outputs = trained.get_encoder()(input_ids=source)
    steps = []
    for position in range(decoder_ids.shape[1]):
        out = trained(encoder_outputs=encoder_outputs, decoder_input_ids=decoder_ids[:, position : position + 1],
                      past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    # two tokens at once over a cache (causal mask offset by the cache length)
    cache = trained(encoder_outputs=encoder_outputs, decoder_input_ids=decoder_ids[:, :3], use_cache=True).past_key_values
    rest = trained(encoder_outputs=encoder_outputs, decoder_input_ids=decoder_ids[:, 3:], past_key_values=cache,
                   use_cache=True).logits
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
    result = trained.generate(**batch, output_attentions=True, return_dict_in_generate=True, max_new_tokens=5)
    source_length = batch["input_ids"].shape[1]
    assert len(result.encoder_attentions) == trained.config.encoder_layers
    first_step = result.cross_attentions[0]
    assert len(first_step) == trained.config.decoder_layers
    assert first_step[-1].shape[-1] == source_length
    torch.testing.assert_close(first_step[-1].sum(-1), torch.ones(first_step[-1].shape[:-1]))


def test_saved_generation_config_needs_no_arguments(saved_dir, tiny_tokenizer, pairs, trained):
    config = json.loads((saved_dir / "generation_config.json").read_text())
    assert config["decoder_start_token_id"] == 1 and config["eos_token_id"] == 2 and config["max_length"] == 48
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
            "package_imported": "hf_scratch_transformer" in sys.modules,
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
    assert torch.equal(torch.load(tmp_path / "logits.pt"), expected_logits)
