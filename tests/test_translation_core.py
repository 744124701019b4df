"""The translation core (translation_core.py) on the session's tiny trained model: batching and input order, each
sentence's own length bound, batches of one bound for a backend that bounds whole batches, the per-batch hook.
Every path through it (CLI, pipeline, translate(), CTranslate2) is compared in test_ct2.py."""

import math

import pytest
import torch
from helpers import PAIRS_EN_ES

from hf_scratch_transformer.translation_core import (
    DEFAULT_MAX_LEN_A,
    DEFAULT_MAX_LEN_B,
    DecodingOptions,
    TextOptions,
    TorchBackend,
    length_bound,
    new_tokens_cap,
    translate_batches,
    translate_texts,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["", PAIRS_EN_ES[0][0], "Jesus wept.", "  ", "God God God God God God God God", PAIRS_EN_ES[10][0],
         "Where is the river of the stars and the wife of the man?", "the"]


class RecordingBackend(TorchBackend):
    """The PyTorch backend, recording what the core asks of it; optionally one that bounds only whole batches."""

    def __init__(self, model, per_row_bounds: bool = True):
        super().__init__(model)
        self.per_row_bounds = per_row_bounds
        self.calls = []

    def generate(self, source_ids, bounds, *args):
        self.calls.append((list(map(len, source_ids)), list(bounds)))
        return super().generate(source_ids, bounds, *args)


def test_batches_are_sorted_by_length_and_results_come_back_in_input_order(trained_model):
    model, tokenizer, _ = trained_model
    backend = RecordingBackend(model)
    found = translate_batches(backend, tokenizer, TEXTS, DecodingOptions(batch_size=3))
    one_by_one = [translate_batches(TorchBackend(model), tokenizer, [text])[0] for text in TEXTS]
    assert [[h.token_ids for h in hypotheses] for hypotheses in found] == \
        [[h.token_ids for h in hypotheses] for hypotheses in one_by_one]
    assert found[0] == [] and found[3] == [] and found[2][0].text == "Jesús lloró."
    lengths = [length for batch, _ in backend.calls for length in batch]
    assert lengths == sorted(lengths, reverse=True) and len(lengths) == 6  # the two empty texts never went in
    assert [len(batch) for batch, _ in backend.calls] == [3, 3]
    sources = {len(tokenizer(text)["input_ids"]) for text in TEXTS if text.strip()}
    assert {bound for _, bounds in backend.calls for bound in bounds} == \
        {min(length_bound(n, DEFAULT_MAX_LEN_A, DEFAULT_MAX_LEN_B), 31) for n in sources}


def test_a_backend_bounding_whole_batches_gets_batches_of_one_bound(trained_model):
    model, tokenizer, _ = trained_model
    options = DecodingOptions(batch_size=4, max_len_a=0.5, max_len_b=1)
    per_row = translate_batches(TorchBackend(model), tokenizer, TEXTS, options)
    backend = RecordingBackend(model, per_row_bounds=False)
    per_batch = translate_batches(backend, tokenizer, TEXTS, options)
    assert all(len(set(bounds)) == 1 for _, bounds in backend.calls) and len(backend.calls) > 2
    assert [[h.token_ids for h in found] for found in per_batch] == [[h.token_ids for h in found] for found in per_row]


def test_on_batch_reports_the_tokens_and_seconds_of_each_batch(trained_model):
    model, tokenizer, _ = trained_model
    reports = []
    found = translate_batches(TorchBackend(model), tokenizer, TEXTS, DecodingOptions(batch_size=4, num_beams=2,
                                                                                      num_return_sequences=2),
                              on_batch=lambda tokens, seconds: reports.append((tokens, seconds)))
    assert len(reports) == 2 and all(seconds > 0 for _, seconds in reports)
    assert sum(tokens for tokens, _ in reports) == sum(len(h.token_ids) for hypotheses in found for h in hypotheses)


class MidSentenceStartBackend(TorchBackend):
    """A model whose every translation begins with a word's mid-sentence form (byte-level " Dios", not "Dios"),
    as real models sometimes do in n-best lists."""

    def __init__(self, model, tokenizer):
        super().__init__(model)
        self.ids = tokenizer(text_target=" Dios es el amor. ")["input_ids"]  # ends with </s>

    def generate(self, source_ids, bounds, num_beams, num_return_sequences, with_scores):
        return [[(self.ids, -1.0)] * num_return_sequences for _ in source_ids]


def test_translations_have_no_white_space_at_either_end(trained_model):
    model, tokenizer, _ = trained_model
    backend = MidSentenceStartBackend(model, tokenizer)
    assert tokenizer.decode(backend.ids, skip_special_tokens=True) == " Dios es el amor. "  # what the model said
    found = translate_batches(backend, tokenizer, ["God is love.", "", "Jesus wept."],
                              DecodingOptions(num_beams=2, num_return_sequences=2))
    assert [[h.text for h in hypotheses] for hypotheses in found] == [["Dios es el amor."] * 2, [],
                                                                      ["Dios es el amor."] * 2]


def test_the_length_cap_comes_from_the_generation_config_and_the_positions(trained_model):
    model, _, _ = trained_model
    config = model.generation_config  # max_length 32: 31 new tokens after the start token
    assert new_tokens_cap(config, 64) == 31 and new_tokens_cap(config, 20) == 19 and new_tokens_cap(config, 64, 5) == 5
    assert length_bound(10, 1.5, 10) == 25 and length_bound(3, 0.1, 0) == 1 and length_bound(9, 0, 0) is None
    assert length_bound(7, 0.5, 2) == math.ceil(5.5)


# ------------------------------------------------------------------------------------------ texts: translate_texts
DOCUMENT = "  Jesus wept. God is love.\n\n  The Lord is my shepherd. I shall not want. \n"


def test_a_document_is_translated_sentence_by_sentence_in_its_own_white_space(trained_model):
    model, tokenizer, _ = trained_model
    sentences = ["Jesus wept.", "God is love.", "The Lord is my shepherd.", "I shall not want."]
    alone = [found[0].text for found in translate_batches(TorchBackend(model), tokenizer, sentences)]
    backend = RecordingBackend(model)
    [translation, blank] = translate_texts(backend, tokenizer, [DOCUMENT, " \n "], DecodingOptions(batch_size=3))
    assert translation.text == f"  {alone[0]} {alone[1]}\n\n  {alone[2]} {alone[3]} \n"
    assert [segment.source for segment in translation.segments] == sentences
    assert blank.text == " \n " and blank.segments == [] and blank.hypotheses == []
    lengths = [length for batch, _ in backend.calls for length in batch]
    assert lengths == sorted(lengths, reverse=True) and len(lengths) == 4  # one sorted batch of every sentence


def test_without_segmenting_a_text_goes_to_the_model_whole(trained_model):
    model, tokenizer, _ = trained_model
    [whole] = translate_texts(TorchBackend(model), tokenizer, ["Jesus wept. God is love."],
                              text_options=TextOptions(segment=False))
    assert [segment.model_text for segment in whole.segments] == ["Jesus wept. God is love."]


@pytest.mark.parametrize("num_beams", [1, 3])
def test_confidence_is_the_mean_log_probability_of_the_tokens(trained_model, num_beams):
    """Per sentence: the mean over its tokens (</s> included) of log p(token), recomputed here by one teacher-forced
    pass; per document: all its tokens' log-probabilities over all its tokens. A length penalty changes the score,
    not the confidence."""
    model, tokenizer, _ = trained_model
    backend = TorchBackend(model, length_penalty=0.6)
    [document] = translate_texts(backend, tokenizer, [DOCUMENT], DecodingOptions(num_beams=num_beams,
                                                                                  with_scores=True))
    total, count = 0.0, 0
    for segment in document.segments:
        best = segment.hypotheses[0]
        encoded = tokenizer([segment.model_text], return_tensors="pt")
        logits = model(**encoded, decoder_input_ids=torch.tensor([[1] + best.token_ids[:-1]])).logits
        log_probs = logits.log_softmax(-1)[0, torch.arange(len(best.token_ids)), best.token_ids]
        assert best.confidence == pytest.approx(log_probs.mean().item(), abs=1e-4)
        assert best.score == pytest.approx(log_probs.sum().item() / len(best.token_ids) ** 0.6, abs=1e-4)
        total, count = total + log_probs.sum().item(), count + len(best.token_ids)
    assert document.confidence == pytest.approx(total / count, abs=1e-4) and document.confidence < 0
    assert document.hypotheses[0].confidence == document.confidence
    [unscored] = translate_texts(TorchBackend(model), tokenizer, [DOCUMENT])
    assert unscored.confidence is None and unscored.text == document.text


def test_nbest_of_a_document_joins_the_sentences_hypotheses(trained_model):
    model, tokenizer, _ = trained_model
    options = DecodingOptions(num_beams=3, num_return_sequences=2)
    [document] = translate_texts(TorchBackend(model), tokenizer, ["Jesus wept. God is love."], options)
    first, second = ([segment.hypotheses[rank].text for segment in document.segments] for rank in (0, 1))
    assert [h.text for h in document.hypotheses] == [" ".join(first), " ".join(second)]
    assert document.hypotheses[1].token_ids == [t for s in document.segments for t in s.hypotheses[1].token_ids]


def test_a_span_the_segmenter_would_cut_stays_whole_with_its_glossary_term(trained_model):
    """`%.*s` looks like the end of a sentence to the segmenter: the core finds the spans (and glossary terms) of
    the whole text first, so the span is protected whole and comes back once."""
    model, tokenizer, _ = trained_model
    text = "`%.*s' used for output. God is love."
    [translation] = translate_texts(TorchBackend(model), tokenizer, [text],
                                    text_options=TextOptions(protect=True, glossary={"God": "Dios"}))
    assert [segment.source for segment in translation.segments] == ["`%.*s' used for output.", "God is love."]
    assert [entry["text"] for entry in translation.spans] == ["%.*s"] and translation.text.count("%.*s") == 1
    assert [entry["honoured"] for entry in translation.glossary] == [True]


def test_a_sentence_longer_than_the_model_was_trained_on_goes_in_pieces(trained_model):
    """A document's sentence can be ten verses long; a model trained on verses stops early on it. train.py records
    the training sources' 90th-percentile length (generation_config.max_sentence_tokens); longer sentences of a
    segmented text are cut at clauses, and a text translated whole (segment=False) is not."""
    model, tokenizer, _ = trained_model
    sentence = "Jesus wept, and God is love, and the Lord is my shepherd, and I shall not want."
    length = len(tokenizer(sentence, add_special_tokens=False)["input_ids"])
    model.generation_config.max_sentence_tokens = length // 2
    try:
        [pieces] = translate_texts(TorchBackend(model), tokenizer, [sentence])
        [whole] = translate_texts(TorchBackend(model), tokenizer, [sentence], text_options=TextOptions(segment=False))
        [asked] = translate_texts(TorchBackend(model), tokenizer, [sentence],
                                  text_options=TextOptions(max_sentence_tokens=length))
    finally:
        del model.generation_config.max_sentence_tokens
    assert len(pieces.segments) >= 2 and " ".join(s.source for s in pieces.segments) == sentence
    assert all(s.source.endswith(",") for s in pieces.segments[:-1])  # cut at clauses
    assert len(whole.segments) == 1 and len(asked.segments) == 1


def test_the_recorded_sentence_length_is_the_90th_percentile_of_the_training_sources():
    from datasets import Dataset

    from hf_scratch_transformer.data.preprocessing import sentence_tokens

    train = Dataset.from_dict({"input_ids": [[5] * n + [2] for n in range(1, 201)]})  # sources of 1..200 tokens
    assert sentence_tokens(train) == 180 and sentence_tokens(train, percentile=99) == 198
    assert sentence_tokens(None) is None and sentence_tokens(train.select([])) is None
