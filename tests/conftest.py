"""Fixtures shared by the test files; plain helpers (pairs, flags, the training recipe, the CLI runner) are in
helpers.py."""

import pytest
import torch
from helpers import (
    MODEL_CARD_TEMPLATE,
    PAIRS,
    TOKENIZER_TRAIN_PAIRS,
    TOKENIZER_VOCAB_SIZE,
    build_tiny_tokenizer,
    tiny_run_flags,
    train_tiny_model,
)

import hf_scratch_transformer  # noqa: F401  (registers the Auto classes)
from hf_scratch_transformer import ScratchTransformerConfig
from hf_scratch_transformer.data.loading import DataArguments, load_parallel_corpus
from hf_scratch_transformer.data.tokenization import train_tokenizer_on_corpus
from hf_scratch_transformer.training.run import main

collect_ignore = ["transformers_common"]  # mixins imported by test_modeling_transformers_common.py, not tests


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices on shared cores: one torch thread is much faster than two spinning against each other.
    Modules that want it for all their tests use `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------ a few sentence pairs


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


# -------------------------------------------------------------------------------------------- the shipped corpus


@pytest.fixture(scope="session")
def shipped_corpus():
    """The shipped English–Spanish corpus as a DatasetDict."""
    return load_parallel_corpus(DataArguments())


@pytest.fixture(scope="session")
def corpus_tokenizer(shipped_corpus):
    """A joint BPE tokenizer trained quickly on the first training pairs of the shipped corpus."""
    subset = shipped_corpus["train"].select(range(TOKENIZER_TRAIN_PAIRS))
    return train_tokenizer_on_corpus(subset, "en", "es", vocab_size=TOKENIZER_VOCAB_SIZE)


# -------------------------------------------------------------------------------------------- one trained model


@pytest.fixture(scope="session")
def trained_model(tmp_path_factory):
    """(model, tokenizer, saved directory) of a tiny model trained on PAIRS_EN_ES (helpers.train_tiny_model),
    once per session for every file that needs a model that translates."""
    model, tokenizer = train_tiny_model()
    directory = tmp_path_factory.mktemp("tiny_translation_model")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer, directory


@pytest.fixture(scope="session")
def trained_model_dir(trained_model):
    return trained_model[2]


# -------------------------------------------------------------------------------------- one finished train.py run


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """A complete tiny training run: output directory with the final model and checkpoint-2, checkpoint-4."""
    output_dir = tmp_path_factory.mktemp("finished")
    assert main(tiny_run_flags(output_dir, max_steps=4, save_steps=2, eval_steps=0, max_predict_samples=4),
                MODEL_CARD_TEMPLATE) == 0
    return output_dir
