"""decoding.py: a call for plain greedy or beam search gives transformers' generate() tokens (and scores) from the
package's own loops; every other call is transformers' generate() itself."""

import copy
import re

import pytest
import torch
from helpers import GENERATION, model_to_compare_decodings
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList, TextStreamer
from transformers.generation.logits_process import SuppressTokensLogitsProcessor

from hf_scratch_transformer import ScratchTransformerConfig, ScratchTransformerForConditionalGeneration
from hf_scratch_transformer import decoding
from hf_scratch_transformer.decoding import beam_search, greedy_search, plain_decoding
from hf_scratch_transformer.translation_core import DecodingOptions, SourceLengthBound, TorchBackend, translate_batches

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def trained(pairs, tiny_tokenizer):
    """A tiny model trained briefly on the pairs (post-norm, as train.py's): rows end at different steps."""
    return model_to_compare_decodings(pairs, tiny_tokenizer)


@pytest.fixture(scope="module")
def batch(pairs, tiny_tokenizer):
    return tiny_tokenizer([source for source, _ in pairs], padding=True, return_tensors="pt")


def takes_the_loop(model, batch, options: dict) -> bool:
    """Whether model.generate(**batch, **options) runs decoding.py's loops (plain_decoding sees what generate() passes
    it)."""
    options = dict(options)
    generation_config = options.pop("generation_config", None)
    return plain_decoding(model, None, generation_config, {**batch, **options}) is not None


def transformers_generate(model, *args, **kwargs):
    """transformers' own generate(), which the model's generate() hands every call but plain greedy and beam ones."""
    return GenerationMixin.generate(model, *args, **kwargs)


@pytest.mark.parametrize("options", [
    {"num_beams": 1},  # the saved max_new_tokens 47
    {"num_beams": 1, "max_new_tokens": 7},
    {"num_beams": 1, "max_new_tokens": 20, "min_new_tokens": 10},
    {"num_beams": 1, "min_length": 12, "max_length": 30},
    {"num_beams": 1, "max_new_tokens": 15, "eos_token_id": [2, 7], "min_new_tokens": 3},
    {"num_beams": 1, "length_penalty": 1.3, "temperature": 0.7},  # read by beam search and sampling only
    {"generation_config": GenerationConfig(**GENERATION, max_new_tokens=9, num_beams=1)},
], ids=["saved", "short", "min_new_tokens", "min_length", "two_eos", "ignored_settings", "generation_config"])
def test_plain_greedy_gives_the_tokens_of_transformers_generate(trained, batch, options):
    assert takes_the_loop(trained, batch, options)
    ours = trained.generate(**batch, **options)
    reference = transformers_generate(trained, **batch, **options)
    assert torch.equal(ours, reference)
    assert ours.shape[1] > 3


def test_a_model_saved_by_train_py_takes_the_loop(trained, batch):
    """train.py saves a custom entry in the generation config (max_sentence_tokens, read by translate_texts), which
    generate() does not read: it must not send the call to transformers' loop."""
    trained.generation_config.max_sentence_tokens = 56
    try:
        assert takes_the_loop(trained, batch, {"num_beams": 1})
        assert takes_the_loop(trained, batch, {"generation_config": GenerationConfig(**GENERATION, num_beams=1)})
        assert torch.equal(trained.generate(**batch, num_beams=1), transformers_generate(trained, **batch, num_beams=1))
    finally:
        del trained.generation_config.max_sentence_tokens


def test_rows_end_at_different_steps_and_are_padded_as_generate_pads_them(trained, batch):
    ours = trained.generate(**batch, num_beams=1)
    ended = (ours == 2).int().argmax(dim=1)
    assert len(set(ended.tolist())) > 1, "every row ended at the same step: the case is not exercised"
    assert (ours == 0).any()
    assert torch.equal(ours, transformers_generate(trained, **batch, num_beams=1))


def test_inputs_without_a_mask_and_positional_inputs(trained, batch):
    """generate() infers no mask for an encoder-decoder model (every position counts) and takes the ids positionally."""
    ids = batch["input_ids"]
    assert torch.equal(trained.generate(ids, num_beams=1), transformers_generate(trained, ids, num_beams=1))


def test_a_pre_norm_model_with_gelu(batch):
    torch.manual_seed(3)
    config = ScratchTransformerConfig.from_preset("tiny", vocab_size=99, dropout=0.0, normalize_before=True,
                                                  activation_function="gelu", scale_embedding=False)
    model = ScratchTransformerForConditionalGeneration(config).eval()
    ids = batch["input_ids"].clamp(max=98)
    mask = batch["attention_mask"]
    options = dict(GENERATION, max_new_tokens=12, num_beams=1)
    assert plain_decoding(model, ids, None, {"attention_mask": mask, **options}) is not None
    assert torch.equal(model.generate(ids, attention_mask=mask, **options),
                       transformers_generate(model, ids, attention_mask=mask, **options))


@pytest.mark.parametrize("options", [
    {"num_beams": 3, "do_sample": True},
    {"num_beams": 1, "do_sample": True},
    {"num_beams": 1, "repetition_penalty": 1.5},
    {"num_beams": 1, "no_repeat_ngram_size": 2},
    {"num_beams": 1, "forced_eos_token_id": 2},
    {"num_beams": 1, "output_scores": True, "return_dict_in_generate": True},
    {"num_beams": 1, "cache_implementation": "static"},
    {"num_beams": 1, "decoder_input_ids": torch.tensor([[1, 40]] * 6)},
    {"num_beams": 1, "logits_processor": LogitsProcessorList([SuppressTokensLogitsProcessor([40])])},
    {"num_beams": 1, "stopping_criteria": [SourceLengthBound([3] * 6)]},
    {"num_beams": 4, "stopping_criteria": [SourceLengthBound([3] * 6)]},
    {"num_beams": 4, "no_repeat_ngram_size": 2},
    {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5},
    {"num_beams": 3, "num_return_sequences": 4},  # refused by transformers
    {"num_beams": 4, "output_scores": True, "return_dict_in_generate": True},
    {"num_beams": 1, "num_return_sequences": 2},  # refused by transformers
    {"num_beams": 1, "output_attentions": True, "return_dict_in_generate": True},
], ids=["beam_sampling", "sampling", "repetition_penalty", "no_repeat_ngram", "forced_eos", "scores", "static_cache",
        "prefix", "logits_processor", "stopping_criteria", "beam_stopping_criteria", "beam_no_repeat_ngram",
        "beam_groups", "beam_num_return_sequences", "beam_scores", "num_return_sequences", "attentions"])
def test_every_other_call_is_transformers_generate(trained, batch, options):
    assert not takes_the_loop(trained, batch, options)
    if options.get("do_sample"):
        return  # sampled tokens differ from call to call; that the call is generate()'s is what matters
    try:
        reference = transformers_generate(trained, **batch, **options)
    except ValueError as error:  # a call transformers refuses is refused the same way
        with pytest.raises(ValueError, match=re.escape(str(error))):
            trained.generate(**batch, **options)
        return
    ours = trained.generate(**batch, **options)
    if isinstance(ours, torch.Tensor):
        assert torch.equal(ours, reference)
    else:
        assert torch.equal(ours.sequences, reference.sequences)


def test_a_streamer_a_model_in_training_and_the_eager_kernel_take_generate(trained, batch, tiny_tokenizer):
    streamer = TextStreamer(tiny_tokenizer)
    assert plain_decoding(trained, None, None, {**batch, "num_beams": 1, "streamer": streamer}) is None
    trained.train()
    try:
        assert plain_decoding(trained, None, None, {**batch, "num_beams": 1}) is None
    finally:
        trained.eval()
    trained.config._attn_implementation = "eager"
    try:
        assert plain_decoding(trained, None, None, {**batch, "num_beams": 1}) is None
    finally:
        trained.config._attn_implementation = "sdpa"


def test_bounds_per_row_and_step_log_probs_are_generate_s(trained, batch):
    """What the translation backend asks for: each row its own bound on new tokens, and the log-probability of each
    emitted token (generate()'s compute_transition_scores with normalized logits)."""
    bounds = [3, 47, 5, 47, 1, 20]
    sequences, log_probs = greedy_search(trained, batch["input_ids"], batch["attention_mask"], torch.tensor(bounds),
                                         eos_token_ids=[2], pad_token_id=0, decoder_start_token_id=1,
                                         with_log_probs=True)
    output = transformers_generate(trained, **batch, num_beams=1, max_new_tokens=max(bounds),
                                   return_dict_in_generate=True,
                                   output_scores=True, stopping_criteria=[SourceLengthBound(bounds)])
    assert torch.equal(sequences, output.sequences)
    expected = trained.compute_transition_scores(output.sequences, output.scores, normalize_logits=True)
    lengths = [next((i + 1 for i, token in enumerate(row[1:]) if token == 2), bound)
               for row, bound in zip(sequences.tolist(), bounds)]  # new tokens up to the end token or the bound
    assert len(set(lengths)) > 2
    for row, length in enumerate(lengths):
        assert torch.allclose(log_probs[row, :length], expected[row, :length], atol=1e-5)
    for row, bound in enumerate(bounds):
        assert (sequences[row, 1 + bound :] == 0).all()


def rows_embedded_per_step(model, monkeypatch, search) -> tuple:
    """(what `search()` returns, the rows the decoder embedded at each step): how many rows each step computed."""
    rows_embedded = []
    embed = model.model.decoder.embed_tokens
    with monkeypatch.context() as patch:
        patch.setattr(embed, "forward", lambda tokens: rows_embedded.append(tokens.shape[0]) or type(embed).forward(
            embed, tokens))
        return search(), rows_embedded


def test_ended_rows_leave_the_greedy_batch(trained, batch, monkeypatch):
    """Rows that ended stop being computed (a quarter of the batch at a time), and the tokens stay generate()'s."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    bounds = [47] + [2] * (ids.shape[0] - 1)
    (sequences, _), rows_embedded = rows_embedded_per_step(trained, monkeypatch, lambda: greedy_search(
        trained, ids, mask, torch.tensor(bounds), eos_token_ids=[2], pad_token_id=0, decoder_start_token_id=1))
    assert rows_embedded[0] == ids.shape[0] and rows_embedded[-1] == 1 and len(rows_embedded) > 5, rows_embedded
    reference = transformers_generate(trained, ids, attention_mask=mask, num_beams=1, max_new_tokens=47,
                                      stopping_criteria=[SourceLengthBound(bounds)])
    assert torch.equal(sequences, reference)


@pytest.mark.parametrize("decoding", [
    dict(num_beams=1),
    dict(num_beams=4, num_return_sequences=2),
], ids=["greedy", "beam_nbest"])
def test_the_translation_backend_gives_the_hypotheses_and_scores_of_generate(trained, tiny_tokenizer, pairs,
                                                                             monkeypatch, decoding):
    sources = [source for source, _ in pairs] + ["", pairs[0][0] * 3]
    options = DecodingOptions(**decoding, with_scores=True, max_len_a=0.5, max_len_b=2)  # bounds differ per source
    fast = translate_batches(TorchBackend(trained), tiny_tokenizer, sources, options)
    monkeypatch.setattr(TorchBackend, "_plain_call", lambda *args: None)
    reference = translate_batches(TorchBackend(trained), tiny_tokenizer, sources, options)
    assert [[h.token_ids for h in row] for row in fast] == [[h.token_ids for h in row] for row in reference]
    assert [h.score for row in fast for h in row] == pytest.approx([h.score for row in reference for h in row],
                                                                    abs=1e-5)


# ------------------------------------------------------------------------------------------------ beam search
@pytest.mark.parametrize("options", [
    {},  # the saved num_beams 4 with early_stopping True and max_new_tokens 47
    {"num_beams": 3, "max_new_tokens": 9},
    {"num_beams": 4, "early_stopping": False},
    {"num_beams": 5, "early_stopping": "never", "length_penalty": 1.3},
    {"num_beams": 4, "early_stopping": "never", "length_penalty": -0.5},
    {"num_beams": 4, "num_return_sequences": 3},
    {"num_beams": 3, "min_new_tokens": 12, "length_penalty": 0.6},
    {"num_beams": 2, "min_length": 8, "max_length": 30},
    {"num_beams": 4, "max_new_tokens": 15, "eos_token_id": [2, 7], "min_new_tokens": 3},  # 3K candidates a step
    {"generation_config": GenerationConfig(**GENERATION, max_new_tokens=9)},  # the model's num_beams 4 fills it in
], ids=["saved", "short", "no_early_stopping", "never_long", "never_short", "num_return_sequences", "min_new_tokens",
        "min_length", "two_eos", "generation_config"])
def test_plain_beam_search_gives_the_tokens_of_transformers_generate(trained, batch, options):
    assert takes_the_loop(trained, batch, options)
    ours = trained.generate(**batch, **options)
    reference = transformers_generate(trained, **batch, **options)
    assert ours.shape == reference.shape and torch.equal(ours, reference)
    assert ours.shape[1] > 3


def test_beam_search_on_a_pre_norm_model_with_gelu(batch):
    torch.manual_seed(3)
    config = ScratchTransformerConfig.from_preset("tiny", vocab_size=99, dropout=0.0, normalize_before=True,
                                                  activation_function="gelu", scale_embedding=False)
    model = ScratchTransformerForConditionalGeneration(config).eval()
    ids, mask = batch["input_ids"].clamp(max=98), batch["attention_mask"]
    options = dict(GENERATION, max_new_tokens=12, num_beams=4, num_return_sequences=2)
    assert plain_decoding(model, ids, None, {"attention_mask": mask, **options}) is not None
    assert torch.equal(model.generate(ids, attention_mask=mask, **options),
                       transformers_generate(model, ids, attention_mask=mask, **options))


@pytest.mark.parametrize("early_stopping", [True, False])
def test_beam_search_bounds_per_row_and_scores_are_generate_s(trained, batch, early_stopping):
    """What the translation backend asks for: each source its own bound on new tokens (sources at their bound leave
    the batch while others go on), and each hypothesis's score (generate()'s sequences_scores)."""
    bounds = [3, 47, 5, 47, 1, 20]
    sequences, scores = beam_search(trained, batch["input_ids"], batch["attention_mask"], torch.tensor(bounds),
                                    eos_token_ids=[2], pad_token_id=0, decoder_start_token_id=1, num_beams=4,
                                    early_stopping=early_stopping, num_return_sequences=2)
    output = transformers_generate(trained, **batch, num_beams=4, max_new_tokens=max(bounds), num_return_sequences=2,
                                   early_stopping=early_stopping, return_dict_in_generate=True, output_scores=True,
                                   stopping_criteria=[SourceLengthBound(bounds)])
    assert torch.equal(sequences, output.sequences)
    assert torch.allclose(scores, output.sequences_scores, atol=1e-5)
    assert sequences.shape[1] > 6


def test_a_source_that_runs_to_its_bound_does_not_hold_the_others(trained, batch, monkeypatch):
    """Sources whose hypotheses can no longer change leave the batch: a source searched for 40 steps after the others
    ended costs the steps of one source, and every source's hypotheses are still generate()'s."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    bounds = [47] + [6] * (ids.shape[0] - 1)
    (sequences, _), rows_embedded = rows_embedded_per_step(trained, monkeypatch, lambda: beam_search(
        trained, ids, mask, torch.tensor(bounds), eos_token_ids=[2], pad_token_id=0, decoder_start_token_id=1,
        num_beams=4, early_stopping=True))
    assert rows_embedded[0] == 4 * ids.shape[0] and rows_embedded[-1] == 4 and len(rows_embedded) > 10, rows_embedded
    reference = transformers_generate(trained, ids, attention_mask=mask, num_beams=4, max_new_tokens=47,
                                      early_stopping=True, stopping_criteria=[SourceLengthBound(bounds)])
    assert torch.equal(sequences, reference)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_the_self_attention_buffers_grow_as_sentences_do(trained, batch, monkeypatch, num_beams):
    """The buffers start with room for a few positions and double when full (here from 3: 6, 12, 24, 48), copying
    what they hold: the tokens stay generate()'s."""
    monkeypatch.setattr(decoding, "INITIAL_POSITIONS", 3)
    grown = []
    original = decoding.LayerState.grow
    monkeypatch.setattr(decoding.LayerState, "grow", lambda state: grown.append(state.self_keys.shape[2]) or
                        original(state))
    options = {"num_beams": num_beams, "max_new_tokens": 47, "min_new_tokens": 30}
    ours = trained.generate(**batch, **options)
    assert sorted(set(grown)) == [3, 6, 12, 24]
    assert torch.equal(ours, transformers_generate(trained, **batch, **options))


@pytest.mark.parametrize("num_beams", [1, 4])
def test_from_eight_sources_cross_attention_is_two_batched_products_with_generate_s_tokens(trained, batch,
                                                                                          monkeypatch, num_beams):
    """From BMM_CROSS_ATTENTION_MIN_SOURCES sources on a CPU every step's cross-attention is bmm, softmax, bmm (the
    fused kernel was the slower there), the padded sources masked as before: the tokens stay transformers'
    generate()'s, and ended rows and sources leave the batch as they did. Below, scaled_dot_product_attention."""
    many = {key: value.repeat(2, 1) for key, value in batch.items()}  # 12 sources, padded
    assert not bool(many["attention_mask"].all())
    by_bmm = []
    original = decoding.LayerState.cross_attention_by_bmm
    monkeypatch.setattr(decoding.LayerState, "cross_attention_by_bmm", lambda state, query, mask: by_bmm.append(
        query.shape[0]) or original(state, query, mask))
    options = {"num_beams": num_beams, "max_new_tokens": 30}
    for inputs in (many, batch):
        by_bmm.clear()
        ours = trained.generate(**inputs, **options)
        assert torch.equal(ours, transformers_generate(trained, **inputs, **options))
        sources = inputs["input_ids"].shape[0]
        if sources >= decoding.BMM_CROSS_ATTENTION_MIN_SOURCES:
            steps = ours.shape[1] - 1
            assert by_bmm[0] == sources and len(by_bmm) == steps * trained.config.decoder_layers, (len(by_bmm), steps)
            assert min(by_bmm) < sources  # sources (or rows) that ended left the batch on the way
        else:
            assert sources < decoding.BMM_CROSS_ATTENTION_MIN_SOURCES and not by_bmm
    # the products compute the fused kernel's attention, the padding masked (the tokens alone barely depend on it)
    with torch.no_grad():
        encoder_output = trained.get_encoder()(**many).last_hidden_state
        state = decoding.LayerState(trained.model.decoder.layers[0], encoder_output, 4, num_beams)
    assert state.cross_attends_by_bmm
    query = torch.randn(12, state.heads, num_beams, state.head_dim)
    source_mask = many["attention_mask"].bool()[:, None, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, state.cross_keys.transpose(2, 3), state.cross_values, attn_mask=source_mask, scale=state.scaling)
    torch.testing.assert_close(state.cross_attention_by_bmm(query, source_mask), expected)
    assert not torch.allclose(state.cross_attention_by_bmm(query, None), expected)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_bf16_weights_on_a_cpu_attend_in_fp32_from_eight_sources(trained, batch, monkeypatch, num_beams):
    """With bf16 weights the loops keep the attention's keys and values in fp32 once the sources reach
    FP32_ATTENTION_MIN_SOURCES (a CPU's bf16 attention over one query per row is the slower), in bf16 below (the query
    follows them: scaled_dot_product_attention refuses mixed dtypes); the tokens stay the fp32 model's on this trained
    one, whose choices are clear. Under autocast over fp32 weights the loops leave the dtypes to autocast."""
    states = []
    build = decoding.LayerState.__init__
    monkeypatch.setattr(decoding.LayerState, "__init__", lambda state, *args, **kwargs: build(state, *args, **kwargs)
                        or states.append(state))
    model_bf16 = copy.deepcopy(trained).to(torch.bfloat16)
    options = {"num_beams": num_beams, "max_new_tokens": 20}
    many = {key: value.repeat(2, 1) for key, value in batch.items()}  # 12 sources
    one = {key: value[:1] for key, value in batch.items()}
    for inputs, sources in ((many, 12), (one, 1)):
        states.clear()
        tokens = model_bf16.generate(**inputs, **options)
        expected = torch.float32 if sources >= decoding.FP32_ATTENTION_MIN_SOURCES else torch.bfloat16
        assert len(states) == trained.config.decoder_layers
        for state in states:
            assert state.attends_in_fp32 == (expected == torch.float32)
            assert {state.self_keys.dtype, state.self_values.dtype, state.cross_keys.dtype,
                    state.cross_values.dtype} == {expected}
        states.clear()
        assert torch.equal(tokens, trained.generate(**inputs, **options))
        assert {state.self_keys.dtype for state in states} == {torch.float32}
    states.clear()
    monkeypatch.setattr(decoding, "packed_min_elements", lambda: 0)  # what an AVX-512 CPU prepacks: every product
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 weights: autocast's choice, no casts of the loops
        trained.generate(**many, **options)
    assert not any(state.attends_in_fp32 for state in states) and states[0].cross_keys.dtype == torch.bfloat16


def test_an_int8_product_is_the_fp32_product_within_its_rounding():
    """Int8Linear: each output is x·w + b with w and x rounded to 127 steps of their row's largest magnitude, so its
    error is bounded by a small share of |x|·|w|; no bias is a zero bias; any leading shape is kept."""
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 40, generator=generator), torch.randn(48, generator=generator)
    inputs = torch.randn(3, 5, 40, generator=generator)
    exact = torch.nn.functional.linear(inputs, weight, bias)
    for with_bias in (bias, None):
        found = decoding.Int8Linear(weight, with_bias)(inputs)
        assert found.shape == (3, 5, 48) and found.dtype == torch.float32
        bound = inputs.abs().amax(-1, keepdim=True) * weight.abs().amax(-1) * 40 / 127  # both roundings, each ≤ ½ step
        assert ((found - (exact if with_bias is not None else exact - bias)).abs() <= bound).all()
    rounded = decoding.Int8Linear(weight, bias)(inputs)
    assert (rounded - exact).abs().max() < 0.05 * exact.abs().max()  # the bound above is loose; this one is not
    assert not torch.equal(rounded, exact)  # really rounded


@pytest.mark.parametrize("encoder_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_beams", [1, 4])
def test_a_model_quantized_for_decoding_multiplies_in_int8_and_keeps_its_translations(trained, batch, monkeypatch,
                                                                                      num_beams, encoder_dtype):
    """quantize_for_decoding: every matrix product of a decoding step (six a layer and the output projection) goes
    through torch._int_mm, the encoder runs in `encoder_dtype` (bf16: a copy, the model's own encoder is not called),
    and on this trained model, whose choices are clear, the tokens are the fp32 model's; the model's own weights and
    forward are untouched."""
    quantized = copy.deepcopy(trained)
    decoding.quantize_for_decoding(quantized, encoder_dtype)
    calls, encoders = [], []
    int_mm = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(tuple(b.shape)) or int_mm(a, b))
    for encoder in {quantized.get_encoder(), quantized.decoding_weights.encoder} - {None}:
        encoder.register_forward_hook(lambda module, args, kwargs, output: encoders.append(
            (module is quantized.get_encoder(), output.last_hidden_state.dtype)), with_kwargs=True)
    options = {"num_beams": num_beams, "max_new_tokens": 20}
    tokens = quantized.generate(**batch, **options)
    assert encoders == [(encoder_dtype == torch.float32, encoder_dtype)]
    assert torch.equal(tokens, trained.generate(**batch, **options))
    calls.clear()
    quantized.generate(**batch, num_beams=num_beams, max_new_tokens=12, min_new_tokens=12)  # 12 steps for every row
    assert len(calls) == 12 * (6 * trained.config.decoder_layers + 1)
    assert (trained.config.d_model, trained.config.vocab_size) in calls  # the output projection
    calls.clear()
    with torch.no_grad():
        assert torch.equal(quantized(**batch, decoder_input_ids=tokens).logits,
                           trained(**batch, decoder_input_ids=tokens).logits)
    assert not calls
    assert {parameter.dtype for parameter in quantized.parameters()} == {torch.float32}


@pytest.mark.parametrize("copies, what", [(decoding.quantize_for_decoding, "int8"),
                                          (decoding.bf16_products_for_decoding, "bf16-products")])
def test_decoding_copies_refuse_weights_they_cannot_copy(trained, copies, what):
    with pytest.raises(ValueError, match=f"{what} decoding copies fp32 weights on a CPU, not torch.bfloat16 on cpu"):
        copies(copy.deepcopy(trained).to(torch.bfloat16))
    with pytest.raises(ValueError, match=f"encoder of {what} decoding runs in torch.float32 or torch.bfloat16, not "
                                         "torch.float16"):
        copies(copy.deepcopy(trained), torch.float16)


def test_a_product_turns_bf16_where_its_rows_times_its_weight_reach_the_threshold():
    """bf16_min_rows: BF16_MIN_MULTIPLY_ADDS over the weight's elements, rounded up, at least 2; what the small
    preset's products get from it (the 256x256 ones from 48 rows, the feed-forward's from 12, an 8,000-token output
    projection from 2, and a 16,000-token one, over the threshold alone, also from 2)."""
    threshold = decoding.BF16_MIN_MULTIPLY_ADDS
    assert threshold == 3 * 2**20
    for (out_features, in_features), rows in {(256, 256): 48, (768, 256): 16, (1024, 256): 12, (256, 1024): 12,
                                              (512, 256): 24, (8000, 256): 2, (16000, 512): 2}.items():
        weight = torch.empty(out_features, in_features)
        assert decoding.bf16_min_rows(weight) == rows
        assert (rows - 1) * weight.numel() < threshold or rows == 2
        assert rows * weight.numel() >= threshold
        assert decoding.Bf16Linear(weight, None).min_rows == rows


def test_a_bf16_product_is_the_fp32_one_below_its_rows_and_bf16_from_there(monkeypatch):
    """Bf16Linear: below its `min_rows` rows exactly the fp32 product; from there the bf16 product (inputs, weights
    and bias rounded to bf16) returned in fp32, from oneDNN's prepacked copy of the weights where this torch offers
    one, else from F.linear on a plain bf16 copy, which computes the same."""
    torch.manual_seed(0)
    weight, bias = torch.randn(1024, 256), torch.randn(1024)
    product = decoding.Bf16Linear(weight, bias)
    minimum = product.min_rows
    assert minimum == 12
    few, many = torch.randn(minimum - 1, 1, 256), torch.randn(minimum, 1, 256)
    assert torch.equal(product(few), torch.nn.functional.linear(few, weight, bias))
    found = product(many)
    assert found.shape == (minimum, 1, 1024) and found.dtype == torch.float32
    in_bf16 = torch.nn.functional.linear(many.bfloat16(), weight.bfloat16(), bias.bfloat16()).float()
    torch.testing.assert_close(found, in_bf16, rtol=1 / 128, atol=1 / 16)  # sums in another order, at most
    exact = torch.nn.functional.linear(many, weight, bias)
    assert (found - exact).abs().max() > 1e-3 and (found - exact).abs().max() < 0.02 * exact.abs().max()
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert product.packed_weight is not None and product.bf16_weight is None
    assert decoding.Bf16Linear(weight, bias, min_rows=1).min_rows == 1  # given, not computed
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)  # a torch built without oneDNN
    plain = decoding.Bf16Linear(weight, bias)
    assert plain.packed_weight is None and plain.bf16_weight.dtype == torch.bfloat16
    torch.testing.assert_close(plain(many), in_bf16, rtol=0, atol=0)
    assert torch.equal(plain(few), product(few))


@pytest.mark.parametrize("num_beams", [1, 4])
def test_bf16_products_for_decoding_multiply_in_bf16_from_their_rows_and_keep_the_translations(
        trained, batch, monkeypatch, num_beams):
    """bf16_products_for_decoding: each of a step's products (six a layer and the output projection) and each
    layer's cross-attention keys and values (one product a call, over the B·S source positions) is a Bf16Linear,
    fp32 below its rows and bf16 from there; the encoder runs as a bf16 copy; and on this trained model, whose
    choices are clear, the tokens are the fp32 model's with products on both sides of their thresholds; the model's
    own weights and forward are untouched. (The tiny model's products are too small for bf16 at the real threshold:
    it is lowered so that its square ones turn bf16 from 16 rows.)"""
    width = trained.config.d_model
    monkeypatch.setattr(decoding, "BF16_MIN_MULTIPLY_ADDS", 16 * width * width)
    copied = copy.deepcopy(trained)
    decoding.bf16_products_for_decoding(copied)
    assert {parameter.dtype for parameter in copied.decoding_weights.encoder.parameters()} == {torch.bfloat16}
    cross = copied.decoding_weights.decoder_layers[0]["cross_key_value"]
    assert cross.weight.shape == (2 * width, width) and cross.min_rows == 8
    calls = []  # (rows, in bf16) of each product called
    call = decoding.Bf16Linear.__call__
    monkeypatch.setattr(decoding.Bf16Linear, "__call__", lambda product, inputs: calls.append(
        (inputs.numel() // inputs.shape[-1], inputs.numel() // inputs.shape[-1] >= product.min_rows))
        or call(product, inputs))
    encoders = []
    copied.decoding_weights.encoder.register_forward_hook(
        lambda module, args, output: encoders.append(output.last_hidden_state.dtype))
    many = {key: value.repeat(3, 1) for key, value in batch.items()}  # 18 sources
    options = {"num_beams": num_beams, "max_new_tokens": 20}
    layers = trained.config.decoder_layers
    for inputs in (batch, many):
        calls.clear()
        assert torch.equal(copied.generate(**inputs, **options), trained.generate(**inputs, **options))
        sources, positions = inputs["input_ids"].shape
        assert calls[:layers] == [(sources * positions, True)] * layers  # the keys and values, in bf16
        assert calls[layers][0] == sources * num_beams  # then the first step's products
    assert encoders == [torch.bfloat16, torch.bfloat16]
    calls.clear()
    three = {key: value[:3] for key, value in batch.items()}
    copied.generate(**three, num_beams=num_beams, max_new_tokens=12, min_new_tokens=12)  # 12 steps for every row
    assert len(calls) == layers + 12 * (6 * layers + 1)
    # 3 or 12 rows: the square products in fp32, the output projection in bf16
    assert {in_bf16 for _, in_bf16 in calls[layers:]} == {False, True}
    with torch.no_grad():
        tokens = trained.generate(**batch, **options)
        assert torch.equal(copied(**batch, decoder_input_ids=tokens).logits,
                           trained(**batch, decoder_input_ids=tokens).logits)
    assert {parameter.dtype for parameter in copied.parameters()} == {torch.float32}


# ---------------------------------------------------------------------- fp32 decoding by prepacked weights
needs_prepacking = pytest.mark.skipif(not decoding.fp32_prepacking_available(),
                                      reason="this torch cannot prepack fp32 weights for oneDNN")


@needs_prepacking
@pytest.mark.parametrize("num_beams", [1, 4])
def test_an_fp32_model_decodes_by_prepacked_copies_with_generate_s_tokens(trained, batch, monkeypatch, num_beams):
    """With every product over `packed_min_elements()` (an AVX2 CPU's leaves the tiny model's out) the loops multiply
    by `PackedLinear` copies, fc1 applying the ReLU in its call, and give transformers' generate() tokens."""
    model = copy.deepcopy(trained)
    monkeypatch.setattr(decoding, "packed_min_elements", lambda: 0)
    calls = []
    original = decoding.PackedLinear.__call__
    monkeypatch.setattr(decoding.PackedLinear, "__call__", lambda product, inputs: calls.append(
        product.activation) or original(product, inputs))
    options = {"num_beams": num_beams, "max_new_tokens": 30}
    ours = model.generate(**batch, **options)
    assert torch.equal(ours, transformers_generate(model, **batch, **options))
    copies = decoding.decoding_weights(model)
    assert isinstance(copies.output_projection, decoding.PackedLinear)
    assert copies.decoder_layers[0]["fc1"].activation == "relu" and copies.decoder_layers[0]["fc1_applies_activation"]
    steps = ours.shape[1] - 1
    # each step: six products per layer and the output projection (beam search's last step may end before it)
    assert len(calls) >= (steps - 1) * (6 * model.config.decoder_layers + 1)
    assert calls.count("relu") >= (steps - 1) * model.config.decoder_layers


@needs_prepacking
def test_a_gelu_model_s_prepacked_feed_forward_applies_its_gelu_apart(batch, monkeypatch):
    monkeypatch.setattr(decoding, "packed_min_elements", lambda: 0)
    torch.manual_seed(0)
    config = ScratchTransformerConfig.from_preset("tiny", vocab_size=60, activation_function="gelu")
    model = ScratchTransformerForConditionalGeneration(config).eval()
    ids = batch["input_ids"].clamp(max=59)
    options = {"num_beams": 1, "max_new_tokens": 12, "min_new_tokens": 12, "decoder_start_token_id": 1,
               "pad_token_id": 0, "eos_token_id": 2}
    assert torch.equal(model.generate(ids, attention_mask=batch["attention_mask"], **options),
                       transformers_generate(model, ids, attention_mask=batch["attention_mask"], **options))
    layer = decoding.decoding_weights(model).decoder_layers[0]
    assert layer["fc1"].activation == "none" and "fc1_applies_activation" not in layer


@needs_prepacking
def test_prepacked_copies_are_made_again_when_a_weight_changes(trained, batch, monkeypatch):
    """The copies live with the model between calls (training's validation decodes after every update): the same
    copies while the weights stay, new ones after an in-place update (an optimizer step) or replaced weights."""
    model = copy.deepcopy(trained)
    monkeypatch.setattr(decoding, "packed_min_elements", lambda: 0)
    options = {"num_beams": 1, "max_new_tokens": 20}
    before = model.generate(**batch, **options)
    copies = decoding.decoding_weights(model)
    assert decoding.decoding_weights(model) is copies
    with torch.no_grad():  # an update in place, as an optimizer's: storage kept, version bumped
        for parameter in model.model.decoder.layers[-1].feed_forward.parameters():
            parameter.mul_(-3.0)
    after = model.generate(**batch, **options)
    assert decoding.decoding_weights(model) is not copies
    assert torch.equal(after, transformers_generate(model, **batch, **options))
    assert not torch.equal(after, before)  # the update changes the translations the copies give
    copies = decoding.decoding_weights(model)
    model.load_state_dict(trained.state_dict())  # other weights loaded into the same parameters
    assert decoding.decoding_weights(model) is not copies
    assert torch.equal(model.generate(**batch, **options), before)


@needs_prepacking
@pytest.mark.parametrize("update", ["train.py's fused Adam", "a write through .data"])
def test_prepacked_copies_follow_updates_that_bump_no_version(trained, batch, monkeypatch, update):
    """train.py's optimizer (torch's fused Adam) and writes through `parameter.data` change the weights in place
    without bumping their version: the loops still decode with the weights as they are now, as validation during
    training must."""
    from types import SimpleNamespace

    from hf_scratch_transformer.training.loop import make_optimizer

    model = copy.deepcopy(trained)
    monkeypatch.setattr(decoding, "packed_min_elements", lambda: 0)
    options = {"num_beams": 1, "max_new_tokens": 20}
    before = model.generate(**batch, **options)
    if update == "train.py's fused Adam":
        settings = SimpleNamespace(weight_decay=0.0, learning_rate=0.05, adam_beta1=0.9, adam_beta2=0.98,
                                   adam_epsilon=1e-9)
        optimizer = make_optimizer(model, settings, torch.device("cpu"))
        model(**batch, labels=before[:, 1:].clone()).loss.backward()
        optimizer.step()
    else:
        for parameter in model.model.decoder.layers[-1].feed_forward.parameters():
            parameter.data.mul_(-3.0)
    after = model.generate(**batch, **options)
    assert torch.equal(after, transformers_generate(model, **batch, **options))
    assert not torch.equal(after, before)


@needs_prepacking
@pytest.mark.parametrize("capability, packed", [("AVX512", True), ("AVX2", False)])
def test_which_products_are_prepacked_follows_the_cpu_s_vector_units(trained, batch, monkeypatch, capability, packed):
    """With AVX-512 every product of a step is prepacked, the tiny model's small ones too; with AVX2 only the weights of
    2**17 elements or more (none of the tiny model's); the tokens stay generate()'s either way."""
    model = copy.deepcopy(trained)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    ours = model.generate(**batch, num_beams=1, max_new_tokens=20)
    copies = decoding.decoding_weights(model)
    weights = [model.lm_head.weight, *(weight for layer in model.model.decoder.layers
                                       for weight, _ in decoding.step_products(layer).values())]
    products = [copies.output_projection, *(layer[name] for layer, decoder_layer in
                                            zip(copies.decoder_layers, model.model.decoder.layers)
                                            for name in decoding.step_products(decoder_layer))]
    assert len(products) == len(weights) and max(weight.numel() for weight in weights) < 2**17
    assert [isinstance(product, decoding.PackedLinear) for product in products] == [packed] * len(products)
    assert torch.equal(ours, transformers_generate(model, **batch, num_beams=1, max_new_tokens=20))


@needs_prepacking
def test_copies_given_to_the_model_come_before_the_prepacked_ones(trained):
    model = copy.deepcopy(trained)
    decoding.quantize_for_decoding(model)
    assert decoding.decoding_weights(model) is model.decoding_weights
    assert decoding.decoding_weights(copy.deepcopy(trained).to(torch.bfloat16)) is None


@pytest.mark.parametrize("num_beams", [1, 4])
def test_the_encoder_computes_nothing_at_the_sources_padding(trained, batch, num_beams):
    """The loops' encoder runs its layers on the sources' real positions only; the tokens stay generate()'s."""
    assert not bool(batch["attention_mask"].all())
    rows = []
    hook = trained.get_encoder().layers[0].feed_forward.fc1.register_forward_hook(
        lambda module, inputs, output: rows.append(inputs[0].shape[:-1].numel()))
    try:
        ours = trained.generate(**batch, num_beams=num_beams, max_new_tokens=20)
    finally:
        hook.remove()
    assert rows == [int(batch["attention_mask"].sum())]
    assert torch.equal(ours, transformers_generate(trained, **batch, num_beams=num_beams, max_new_tokens=20))


@pytest.mark.parametrize("rows", [1, decoding.ARGMAX_BY_BLOCKS_MIN_ROWS, 40])
@pytest.mark.parametrize("vocabulary", [1, 64, 200, 7919])
def test_first_argmax_is_torch_s_argmax(rows, vocabulary):
    """Ties give the first maximum, NaN counts as the maximum, a row all -inf gives 0; vocabularies that are not a
    multiple of the block."""
    torch.manual_seed(0)
    logits = torch.randn(rows, vocabulary).round(decimals=1)  # many ties
    logits[0] = float("-inf")
    if rows > 3 and vocabulary > 10:
        logits[1, vocabulary - 1] = float("inf")
        logits[2, 5], logits[2, 3] = float("nan"), float("inf")
        logits[3, :] = 7.0
    assert torch.equal(decoding.first_argmax(logits), logits.argmax(dim=-1))


@needs_prepacking
def test_a_model_that_decoded_by_prepacked_copies_still_copies_and_pickles(trained, batch, monkeypatch):
    """oneDNN's prepacked tensors have no storage to copy: they are kept beside the model, not in it."""
    import pickle

    # A fresh model with trained's weights: the module-scoped `trained` may carry transformers' own output-capturing
    # hooks (local functions, installed by any earlier call that asked for attentions or hidden states), which no
    # transformers model can pickle; this test is about what decoding.py leaves behind.
    model = type(trained)(trained.config).eval()
    model.load_state_dict(trained.state_dict())
    model.generation_config = copy.deepcopy(trained.generation_config)
    monkeypatch.setattr(decoding, "packed_min_elements", lambda: 0)
    options = {"num_beams": 1, "max_new_tokens": 20}
    tokens = model.generate(**batch, **options)
    assert isinstance(decoding.decoding_weights(model).output_projection, decoding.PackedLinear)
    copied = copy.deepcopy(model)
    assert decoding.decoding_weights(copied) is not decoding.decoding_weights(model)
    assert torch.equal(copied.generate(**batch, **options), tokens)
    assert torch.equal(pickle.loads(pickle.dumps(model)).generate(**batch, **options), tokens)
