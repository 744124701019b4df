"""Shared fixtures: a tiny config, a tiny byte-level BPE tokenizer and a handful of sentence pairs."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # lets test files import the conftest_* helper modules
collect_ignore = ["transformers_common"]  # mixins imported by test_modeling_transformers_common.py, not tests

import hf_scratch_transformer  # noqa: E402  (registers the Auto classes)
from hf_scratch_transformer import ScratchTransformerConfig  # noqa: E402
from hf_scratch_transformer.tokenization import train_bpe_tokenizer  # noqa: E402

PAIRS = [
    ("In the beginning God created the heavens and the earth.", "En el principio creó Dios los cielos y la tierra."),
    ("And God said, Let there be light.", "Y dijo Dios: Sea la luz."),
    ("The earth was without form.", "Y la tierra estaba desordenada."),
    ("God saw the light, that it was good.", "Y vio Dios que la luz era buena."),
    ("There was evening and there was morning.", "Y fue la tarde y la mañana."),
    ("Jesus wept.", "Y lloró Jesús."),
]


def build_tiny_tokenizer(texts, vocab_size=400):
    """The package's byte-level BPE, trained on a few sentences: ids <pad>=0 <s>=1 </s>=2 <unk>=3."""
    return train_bpe_tokenizer(texts, vocab_size=vocab_size, model_max_length=64)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def pairs():
    return PAIRS


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer([text for pair in PAIRS for text in pair])


@pytest.fixture
def tiny_config():
    """Width 32, 2+2 layers, 4 heads, no dropout: small enough for exact checks in milliseconds."""
    return ScratchTransformerConfig.from_preset(
        "tiny", vocab_size=99, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0,
        max_position_embeddings=64,
    )
