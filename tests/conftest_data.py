"""Fixtures for the data and tokenizer tests: the shipped corpus and a small tokenizer trained on part of it."""

import pytest

from hf_scratch_transformer.data import DataArguments, load_parallel_corpus
from hf_scratch_transformer.tokenization import train_tokenizer_on_corpus

TOKENIZER_TRAIN_PAIRS = 3000
TOKENIZER_VOCAB_SIZE = 1000


@pytest.fixture(scope="session")
def shipped_corpus():
    """The shipped English–Spanish corpus as a DatasetDict."""
    return load_parallel_corpus(DataArguments())


@pytest.fixture(scope="session")
def corpus_tokenizer(shipped_corpus):
    """A joint BPE tokenizer trained quickly on the first training pairs of the shipped corpus."""
    subset = shipped_corpus["train"].select(range(TOKENIZER_TRAIN_PAIRS))
    return train_tokenizer_on_corpus(subset, "en", "es", vocab_size=TOKENIZER_VOCAB_SIZE)
