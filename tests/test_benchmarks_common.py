"""The benchmarks' shared pieces: the weight copy into MarianMT and the ablation's eager variant compute our
model's function (tiny preset, a few seconds)."""

from pathlib import Path

import numpy as np
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
VOCAB = 512  # small, to keep the tests fast


@pytest.fixture
def common(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts run from that folder and `import common`
    import common

    return common


@pytest.fixture
def batch(common):
    return common.random_batch(np.random.default_rng(0), 4, VOCAB)


def test_weight_copy_gives_identical_logits(common, batch):
    ours, marian = common.build_pair("tiny", seed=0, vocab_size=VOCAB)
    check = common.equivalence_check(ours, marian, batch)
    assert check["max_abs_logit_diff"] < 1e-5
    assert check["loss_ours"] == pytest.approx(check["loss_marian"], abs=1e-5)


def test_equivalence_check_sees_a_wrong_weight(common, batch):
    ours, marian = common.build_pair("tiny", seed=0, vocab_size=VOCAB)
    with torch.no_grad():
        marian.model.decoder.layers[0].encoder_attn.v_proj.weight[0, 0] += 1.0
    assert common.equivalence_check(ours, marian, batch)["max_abs_logit_diff"] > 1e-3


def test_native_init_differs(common, batch):
    ours, marian = common.build_pair("tiny", seed=0, vocab_size=VOCAB, marian_init="native")
    assert common.equivalence_check(ours, marian, batch)["max_abs_logit_diff"] > 1e-3


def test_ablation_variant_computes_the_same_function(common, batch):
    import speed_ablation

    torch.manual_seed(0)
    model = speed_ablation.ScratchTransformerForConditionalGeneration(common.our_config("tiny", VOCAB))
    assert speed_ablation.same_function(model, speed_ablation.eager_copy(model), batch, 2)["same_greedy_tokens"]
