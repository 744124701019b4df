import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from helpers import TOKENIZER_VOCAB_SIZE
from hf_scratch_transformer.data.tokenization import sample_sentences, train_bpe_tokenizer, train_tokenizer_on_corpus

UNSEEN_TEXTS = [
    "你好，世界。日本語のテキスト",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇪🇸",
    "“curly” ‘quotes’ — dashes… «guillemets» ½ ﬁ",
    "tabs\tand  double  spaces\nnew line",
    "  leading and trailing spaces  ",
    "combining n\u0303 becomes ñ under NFC",
    "literal special tokens <s> <pad> </s> <unk> stay text",
    "",
]


def roundtrip(tokenizer, text):
    return tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True)


def test_special_tokens_have_the_config_ids(corpus_tokenizer):
    assert corpus_tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<s>", "</s>", "<unk>"]
    assert (corpus_tokenizer.pad_token_id, corpus_tokenizer.bos_token_id, corpus_tokenizer.eos_token_id) == (0, 1, 2)
    assert len(corpus_tokenizer) == TOKENIZER_VOCAB_SIZE


def test_saved_tokenizer_reloads_with_autotokenizer_and_encodes_targets(corpus_tokenizer, tmp_path):
    corpus_tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    encoded = reloaded("In the beginning", text_target="En el principio")
    assert set(encoded) == {"input_ids", "attention_mask", "labels"}
    assert encoded["input_ids"][-1] == 2 and encoded["labels"][-1] == 2
    assert 1 not in encoded["labels"]
    assert encoded["labels"] == corpus_tokenizer(text_target="En el principio")["input_ids"]


@pytest.mark.parametrize("language", ["en", "es"])
def test_every_validation_sentence_round_trips(corpus_tokenizer, shipped_corpus, language):
    texts = [pair[language] for pair in shipped_corpus["validation"]["translation"]]
    encoded = corpus_tokenizer(texts)["input_ids"]
    decoded = corpus_tokenizer.batch_decode(encoded, skip_special_tokens=True)
    assert decoded == [unicodedata.normalize("NFC", text) for text in texts]
    assert all(3 not in ids for ids in encoded)


@pytest.mark.parametrize("text", UNSEEN_TEXTS)
def test_unseen_text_round_trips_without_unk(corpus_tokenizer, text):
    assert roundtrip(corpus_tokenizer, text) == unicodedata.normalize("NFC", text)
    assert corpus_tokenizer.unk_token_id not in corpus_tokenizer(text)["input_ids"]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_text_round_trips(corpus_tokenizer, text):
    assert roundtrip(corpus_tokenizer, text) == unicodedata.normalize("NFC", text)


def test_max_sentences_samples_deterministically():
    texts = [f"sentence {i}" for i in range(1000)]
    sample = sample_sentences(iter(texts), 50, seed=3)
    assert len(sample) == 50 and len(set(sample)) == 50 and set(sample) <= set(texts)
    assert sample == sample_sentences(iter(texts), 50, seed=3)
    assert sample != sample_sentences(iter(texts), 50, seed=4)
    assert sample_sentences(iter(texts[:10]), 50) == texts[:10]


def test_tokenizer_trained_on_a_sample_still_covers_all_bytes():
    tokenizer = train_bpe_tokenizer(["abc abd abe"] * 100, vocab_size=300, max_sentences=5)
    assert roundtrip(tokenizer, "ĳ xyz ✓") == "ĳ xyz ✓"


def test_corpus_training_wants_a_split_not_a_dict(shipped_corpus):
    with pytest.raises(TypeError, match="train split"):
        train_tokenizer_on_corpus(shipped_corpus, "en", "es", vocab_size=300)


def test_language_pair_is_saved_with_the_tokenizer_and_read_back(tmp_path):
    from datasets import Dataset

    from hf_scratch_transformer.data.tokenization import language_pair

    pairs = Dataset.from_dict({"translation": [{"es": "Hola, mundo.", "en": "Hello, world."}] * 20})
    tokenizer = train_tokenizer_on_corpus(pairs, "es", "en", vocab_size=300)
    assert language_pair(tokenizer) == ("es", "en")
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert language_pair(reloaded) == ("es", "en")
    reloaded.save_pretrained(tmp_path / "again")  # survives a second save too
    assert language_pair(AutoTokenizer.from_pretrained(tmp_path / "again")) == ("es", "en")


def test_language_pair_is_unknown_for_a_tokenizer_that_does_not_say(tmp_path):
    from types import SimpleNamespace

    from hf_scratch_transformer.data.tokenization import language_pair

    plain = train_bpe_tokenizer(["a few words"] * 5, vocab_size=300)
    plain.save_pretrained(tmp_path)
    assert language_pair(AutoTokenizer.from_pretrained(tmp_path)) == (None, None)
    marian_like = SimpleNamespace(source_lang="de", target_lang="en", init_kwargs={})  # MarianTokenizer's attributes
    assert language_pair(marian_like) == ("de", "en")


def test_a_large_dataset_is_sampled_by_pairs_without_reading_every_row():
    from datasets import Dataset

    from hf_scratch_transformer.data.tokenization import _sampled_pairs

    pairs = Dataset.from_dict({"translation": [{"en": f"s{i}", "es": f"f{i}"} for i in range(1000)]})
    sample = _sampled_pairs(pairs, max_sentences=100, seed=1)
    english = [pair["en"] for pair in sample["translation"]]
    assert len(english) == 50 == len(set(english))
    assert english == [pair["en"] for pair in _sampled_pairs(pairs, 100, seed=1)["translation"]]
    assert english != [pair["en"] for pair in _sampled_pairs(pairs, 100, seed=2)["translation"]]
    assert _sampled_pairs(pairs, max_sentences=2000, seed=1) is pairs  # small enough: every pair, in order


def test_a_tokenizer_with_sentinels_keeps_each_as_one_plain_token(tmp_path):
    """sentinels=True (train.py's default) adds ｟0｠...｟31｠ after the BPE vocabulary: one token each wherever
    they stand, kept by decode(skip_special_tokens=True), saved and reloaded; the rest of the text tokenizes as
    without them."""
    from hf_scratch_transformer.protected_spans import MAX_SENTINELS, sentinel, sentinel_tokens, tokenizer_has_sentinels

    texts = ["In the beginning God created.", "En el principio creó Dios.", "Delete %d files."] * 5
    plain = train_bpe_tokenizer(texts, vocab_size=300)
    with_sentinels = train_bpe_tokenizer(texts, vocab_size=300, sentinels=True)
    assert not tokenizer_has_sentinels(plain) and tokenizer_has_sentinels(with_sentinels)
    assert len(with_sentinels) == len(plain) + MAX_SENTINELS
    assert with_sentinels.convert_tokens_to_ids(sentinel_tokens()) == list(range(len(plain), len(with_sentinels)))
    assert not set(sentinel_tokens()) & set(with_sentinels.all_special_tokens)
    text = f"Borrar {sentinel(0)}{sentinel(31)} archivos {sentinel(7)}."
    ids = with_sentinels(text)["input_ids"]
    assert sum(token >= len(plain) for token in ids) == 3
    assert with_sentinels.decode(ids, skip_special_tokens=True) == text
    assert with_sentinels("Delete files.")["input_ids"] == plain("Delete files.")["input_ids"]
    with_sentinels.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer_has_sentinels(reloaded) and reloaded(text)["input_ids"] == ids
