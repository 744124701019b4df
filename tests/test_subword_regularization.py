"""BPE-dropout (--bpe_dropout): seeded re-segmentation of the training batches only, new at every epoch."""

import collections
import json
import random

import pytest
import torch
from helpers import PAIRS, run_quick
from safetensors.torch import load_file

from hf_scratch_transformer.loop import BPEDropoutCollator, TrainingLoop
from hf_scratch_transformer.tokenization import BPEDropout

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models on shared cores

TEXTS = [text for pair in PAIRS for text in pair] + [
    "Señor, ¿dónde estás?  Tabs\tand “quotes” — <s> written out", "Ünïcödé: ΑΒΓ, 漢字, emoji 🙂", "a", ""]


def test_without_dropout_the_ids_are_the_tokenizers(corpus_tokenizer):
    plain = BPEDropout(corpus_tokenizer, 0.0)
    for text in TEXTS:
        assert plain.encode(text, random.Random(0)) == corpus_tokenizer(text)["input_ids"], text


def test_dropout_is_seeded_varied_and_keeps_the_text(corpus_tokenizer):
    dropout = BPEDropout(corpus_tokenizer, 0.3)
    text = PAIRS[0][0]
    segmentations = {tuple(dropout.encode(text, random.Random(seed))) for seed in range(20)}
    assert len(segmentations) > 5  # a new segmentation for (almost) every seed
    assert dropout.encode(text, random.Random(7)) == dropout.encode(text, random.Random(7))
    expected = corpus_tokenizer.decode(corpus_tokenizer(text)["input_ids"], skip_special_tokens=True)
    for ids in segmentations:
        assert corpus_tokenizer.decode(list(ids), skip_special_tokens=True) == expected
        assert ids[-1] == corpus_tokenizer.eos_token_id
    assert min(map(len, segmentations)) >= len(corpus_tokenizer(text)["input_ids"])  # dropout only splits


def test_the_shortcut_draws_segmentations_as_often_as_the_full_algorithm(corpus_tokenizer):
    """`segment` decides in one draw whether any merge is dropped, then simulates from the first drop; its
    frequencies must match simulating every draw (`forced_merges=-1`)."""
    dropout = BPEDropout(corpus_tokenizer, 0.2)
    word = max(dropout.backend.pre_tokenizer.pre_tokenize_str(" everlasting"), key=lambda item: len(item[0]))[0]
    rng, draws = random.Random(0), 20_000
    fast = collections.Counter(tuple(dropout.segment(word, rng)) for _ in range(draws))
    full = collections.Counter(tuple(dropout._merge(word, rng, forced_merges=-1)) for _ in range(draws))
    assert len(full) > 3
    for segmentation in set(fast) | set(full):
        assert abs(fast[segmentation] - full[segmentation]) / draws < 0.015, segmentation


def test_an_invalid_rate_is_refused(corpus_tokenizer):
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        BPEDropout(corpus_tokenizer, 1.0)


# ------------------------------------------------------------------------------------------------ in a training run


def record_batches(monkeypatch) -> list[tuple[int, list[int], torch.Tensor]]:
    """(epoch, example indices, input_ids) of every training batch of the runs that follow."""
    seen, real = [], TrainingLoop._train_batch

    def recording(self, indices, batch):
        seen.append((self.state.epoch, list(indices), batch["input_ids"].clone()))
        return real(self, indices, batch)

    monkeypatch.setattr(TrainingLoop, "_train_batch", recording)
    return seen


def test_each_epoch_sees_a_new_segmentation_and_evaluation_none(tmp_path, monkeypatch, corpus_tokenizer):
    seen = record_batches(monkeypatch)
    flags = dict(max_train_samples=24, max_steps=12, bpe_dropout=0.3, eval_steps=0, save_steps=0)
    run_quick(tmp_path / "dropout", **flags)
    by_example = collections.defaultdict(dict)
    for epoch, indices, input_ids in seen:
        for row, index in zip(input_ids.tolist(), indices):
            by_example[index][epoch] = [token for token in row if token != 0]
    twice = [epochs for epochs in by_example.values() if len(epochs) >= 2]
    assert twice, "the run must see examples in two epochs"
    assert any(len({tuple(ids) for ids in epochs.values()}) > 1 for epochs in twice)
    # the saved tokenizer is the one trained without dropout, and has no dropout itself
    run_quick(tmp_path / "plain", **{**flags, "bpe_dropout": 0.0})
    saved = (tmp_path / "dropout" / "tokenizer.json").read_text()
    assert saved == (tmp_path / "plain" / "tokenizer.json").read_text()
    assert json.loads(saved)["model"]["dropout"] is None


def test_evaluation_batches_do_not_use_dropout(tmp_path, monkeypatch):
    collators = []
    real = TrainingLoop.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        collators.append((self.batches.collator, self.evaluator.collator))

    monkeypatch.setattr(TrainingLoop, "__init__", spy)
    run_quick(tmp_path / "run", max_steps=2, bpe_dropout=0.2)
    (training, evaluation), = collators
    assert isinstance(training, BPEDropoutCollator) and not isinstance(evaluation, BPEDropoutCollator)


def test_a_run_with_dropout_resumes_exactly(tmp_path):
    # inverse_sqrt: a schedule that does not depend on the run's length, so 4 steps extended to 8 are 8 steps
    flags = dict(max_train_samples=24, bpe_dropout=0.2, eval_steps=0, save_steps=4, lr_scheduler_type="inverse_sqrt")
    run_quick(tmp_path / "straight", max_steps=8, **flags)
    run_quick(tmp_path / "resumed", max_steps=4, **flags)
    run_quick(tmp_path / "resumed", max_steps=8, resume_from_checkpoint="latest", **flags)
    straight, resumed = load_file(tmp_path / "straight" / "model.safetensors"), load_file(
        tmp_path / "resumed" / "model.safetensors")
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
