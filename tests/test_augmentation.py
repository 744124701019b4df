"""augmentation.py: the training-time noise, on the training batches only and new at every epoch: BPE-dropout
(--bpe_dropout, seeded re-segmentation) and source noise (--source_paraphrase_rate, --source_plain_quotes_rate,
--source_lowercase_rate, --source_typo_rate, --source_contraction_rate, --source_spaced_punctuation_rate), all behind
one `Augmentation`."""

import collections
import json
import random

import pytest
import torch
from datasets import Dataset
from helpers import PAIRS, run_quick
from safetensors.torch import load_file

from hf_scratch_transformer.data.tokenization import train_tokenizer_on_corpus
from hf_scratch_transformer.training.augmentation import (
    AUGMENTATION_FLAGS,
    Augmentation,
    BPEDropout,
    NoiseCollator,
    SourceNoise,
    contract,
    misspell,
    noise_collator,
    source_paraphrases,
)
from hf_scratch_transformer.training.arguments import RunArguments
from hf_scratch_transformer.training.loop import TrainingCallback, training_callbacks

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models on shared cores
NO_SOURCE_NOISE = dict(source_paraphrase_rate=0.0, source_plain_quotes_rate=0.0, source_lowercase_rate=0.0)

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


def test_dropout_keeps_the_sentinel_tokens_whole(corpus_tokenizer):
    """A training pair masked with sentinels: BPE-dropout splits the words around them, never a sentinel itself
    (were it split into its bytes, the model would never see ｟0｠ as the one token it reads at translation)."""
    tokenizer = train_tokenizer_on_corpus(Dataset.from_dict({"translation": [{"en": a, "es": b} for a, b in PAIRS]}),
                                          "en", "es", vocab_size=300, sentinels=True)
    text = "Borrados ｟0｠ archivos de ｟1｠｟2｠, ｟31｠."
    assert BPEDropout(tokenizer, 0.0).encode(text, random.Random(0)) == tokenizer(text)["input_ids"]
    sentinel_ids = set(tokenizer.convert_tokens_to_ids(["｟0｠", "｟1｠", "｟2｠", "｟31｠"]))
    dropout = BPEDropout(tokenizer, 0.5)
    for seed in range(10):
        ids = dropout.encode(text, random.Random(seed))
        assert [token for token in ids if token in sentinel_ids] == tokenizer.convert_tokens_to_ids(
            ["｟0｠", "｟1｠", "｟2｠", "｟31｠"])
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_the_shortcut_draws_segmentations_as_often_as_the_full_algorithm(corpus_tokenizer):
    """`segment` decides in one draw whether any merge is dropped, then simulates from the first drop; its
    frequencies must match simulating every draw (`forced_merges=-1`)."""
    dropout = BPEDropout(corpus_tokenizer, 0.2)
    word = max(dropout.backend.pre_tokenizer.pre_tokenize_str(" everlasting"), key=lambda item: len(item[0]))[0]
    rng, draws = random.Random(0), 20_000
    fast = collections.Counter(tuple(dropout.segment(word, rng)) for _ in range(draws))
    full = collections.Counter(tuple(dropout.merge(word, rng, forced_merges=-1)) for _ in range(draws))
    assert len(full) > 3
    for segmentation in set(fast) | set(full):
        assert abs(fast[segmentation] - full[segmentation]) / draws < 0.015, segmentation


def test_an_invalid_rate_is_refused(corpus_tokenizer):
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        BPEDropout(corpus_tokenizer, 1.0)
    for name in AUGMENTATION_FLAGS:
        for rate in (1.0, -0.1, float("nan")):
            with pytest.raises(ValueError, match=f"--{name} must be in \\[0, 1\\), got {rate}"):
                Augmentation(**{name: rate})


# ------------------------------------------------------------------------------------------------ one dataclass


def test_the_augmentation_is_the_flags_in_their_order_and_names():
    run_fields = [name for name in RunArguments.__dataclass_fields__ if name in AUGMENTATION_FLAGS]
    assert run_fields == list(AUGMENTATION_FLAGS)  # keyword fields in the flags' order
    args = RunArguments(bpe_dropout=0.1, source_typo_rate=0.02, source_lowercase_rate=0.0)
    augmentation = Augmentation.from_flags(args)
    assert augmentation.settings() == {name: getattr(args, name) for name in AUGMENTATION_FLAGS}
    assert augmentation.describe() == ("50% of the source sentences with a paraphrase in the corpus replaced by it, "
                                       "plain quotes in 50% of the source sentences with typographic ones, typos in "
                                       "2% of the source words, BPE-dropout 0.1 (redrawn every epoch)")
    assert Augmentation().describe() == "none" and not Augmentation().changes_sources({"a": ["b"]})


def test_a_run_without_augmentation_keeps_the_plain_collator(corpus_tokenizer):
    from transformers import DataCollatorForSeq2Seq

    plain = DataCollatorForSeq2Seq(corpus_tokenizer)
    lengths = dict(seed=0, max_source_length=96, max_target_length=96)
    assert noise_collator(plain, corpus_tokenizer, Augmentation(), **lengths) is plain
    # paraphrases at a rate, but none in the corpus: nothing to change either
    assert noise_collator(plain, corpus_tokenizer, Augmentation(source_paraphrase_rate=0.5), paraphrases={},
                          **lengths) is plain
    assert isinstance(noise_collator(plain, corpus_tokenizer, Augmentation(bpe_dropout=0.1), **lengths), NoiseCollator)


# ------------------------------------------------------------------------------------------------ in a training run


class RecordBatches(TrainingCallback):
    """(epoch, example indices, input_ids) of every training batch in `seen`, their labels in `labels`."""

    def __init__(self):
        self.seen, self.labels = [], []

    def on_batch_end(self, loop, indices, batch, loss):
        self.seen.append((loop.state.epoch, list(indices), batch["input_ids"].clone()))
        self.labels.append(batch["labels"].clone())


@pytest.fixture
def recorded():
    """The batches of the runs of this test."""
    recorder = RecordBatches()
    with training_callbacks(recorder):
        yield recorder


def decoded_sources(seen, tokenizer) -> list[str]:
    """The source sentences of recorded batches, as text."""
    return [tokenizer.decode([token for token in row if token], skip_special_tokens=True)
            for _, _, input_ids in seen for row in input_ids.tolist()]


def test_each_epoch_sees_a_new_segmentation_and_evaluation_none(tmp_path, recorded, corpus_tokenizer):
    seen = recorded.seen
    flags = dict(max_train_samples=24, max_steps=12, bpe_dropout=0.3, eval_steps=0, save_steps=0,
                 **NO_SOURCE_NOISE)  # BPE-dropout alone: source noise would also change the ids
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


class EncoderInputs(TrainingCallback):
    """The source ids the encoder reads outside training mode (validation and test), as lists without padding."""

    def __init__(self):
        self.rows = []

    def on_train_begin(self, loop):
        loop.model.get_encoder().register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs):
        if not module.training:
            ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
            self.rows += [row[: int(length)] for row, length in zip(ids.tolist(), mask.sum(dim=1).tolist())]


def test_evaluation_batches_do_not_use_dropout(tmp_path, shipped_corpus):
    """With a high BPE-dropout, every source that validation and test encode has the tokenizer's own ids."""
    from transformers import AutoTokenizer

    inputs = EncoderInputs()
    with training_callbacks(inputs):
        run_quick(tmp_path / "run", max_steps=2, eval_steps=1, bpe_dropout=0.5, max_eval_samples=8,
                  max_predict_samples=8, **NO_SOURCE_NOISE)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run")
    sources = [pair["en"] for split in ("validation", "test") for pair in shipped_corpus[split]["translation"][:8]]
    plain = {tuple(ids) for ids in tokenizer(sources, truncation=True, max_length=96)["input_ids"]}
    assert len(inputs.rows) >= 16 and all(tuple(row) in plain for row in inputs.rows)


def test_a_run_with_dropout_resumes_exactly(tmp_path):
    # inverse_sqrt: a schedule that does not depend on the run's length, so 4 steps extended to 8 are 8 steps
    flags = dict(max_train_samples=24, bpe_dropout=0.2, eval_steps=0, save_steps=4, lr_scheduler_type="inverse_sqrt",
                 cpu_threads=1)  # bit for bit only at a pinned thread count
    run_quick(tmp_path / "straight", max_steps=8, **flags)
    run_quick(tmp_path / "resumed", max_steps=4, **flags)
    run_quick(tmp_path / "resumed", max_steps=8, resume_from_checkpoint="latest", **flags)
    straight, resumed = load_file(tmp_path / "straight" / "model.safetensors"), load_file(
        tmp_path / "resumed" / "model.safetensors")
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


# ------------------------------------------------------------------------------------------------ source noise


def test_source_noise_is_seeded_and_does_what_it_says():
    sentence = "Jesus wept, and the disciples remembered what he had said about the temple."
    assert SourceNoise(Augmentation()).apply(sentence, random.Random(0)) == sentence
    lowered = [SourceNoise(Augmentation(source_lowercase_rate=0.3)).apply(sentence, random.Random(seed))
               for seed in range(400)]
    assert set(lowered) == {sentence, sentence.lower()}
    assert 0.22 < lowered.count(sentence.lower()) / 400 < 0.38
    noisy = SourceNoise(Augmentation(source_typo_rate=0.5))
    assert noisy.apply(sentence, random.Random(3)) == noisy.apply(sentence, random.Random(3))
    changed = 0
    for seed in range(50):
        words, noisy_words = sentence.split(), noisy.apply(sentence, random.Random(seed)).split()
        assert len(words) == len(noisy_words)
        for word, noisy_word in zip(words, noisy_words):
            if word != noisy_word:
                changed += 1
                assert len(word.strip(",.")) >= 4 and word[0] == noisy_word[0] and word[-1] == noisy_word[-1]
                assert abs(len(word) - len(noisy_word)) <= 1 and set(noisy_word) <= set(word)
    assert changed > 50
    assert misspell("Señor", random.Random(1)) != "Señor"


def test_source_noise_changes_training_sources_each_epoch_and_never_targets(tmp_path, recorded):
    from transformers import AutoTokenizer

    def rows(recorder) -> dict:
        """{(epoch, example): (source ids, target ids)}, padding left out: the noise changes lengths, so the two
        runs' batches are packed differently."""
        found = {}
        for (epoch, indices, input_ids), labels in zip(recorder.seen, recorder.labels):
            for index, source, target in zip(indices, input_ids.tolist(), labels.tolist()):
                found[epoch, index] = ([t for t in source if t], [t for t in target if t != -100])
        return found

    flags = dict(max_train_samples=24, max_steps=12, eval_steps=0, save_steps=0, **NO_SOURCE_NOISE)
    run_quick(tmp_path / "noisy", **{**flags, "source_lowercase_rate": 0.5, "source_typo_rate": 0.2})
    noisy_rows = rows(recorded)
    recorded.seen.clear(), recorded.labels.clear()
    run_quick(tmp_path / "plain", **flags)
    plain_rows = rows(recorded)
    both = plain_rows.keys() & noisy_rows.keys()
    assert len(both) >= 24  # the same examples in the same epochs (a whole epoch at least)
    assert all(plain_rows[key][1] == noisy_rows[key][1] for key in both)  # targets are never noised
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "plain")
    sources = collections.defaultdict(dict)
    for epoch, index in both:
        sources[index][epoch] = tuple(tokenizer.decode(found[epoch, index][0], skip_special_tokens=True)
                                      for found in (plain_rows, noisy_rows))
    pairs = [pair for epochs in sources.values() for pair in epochs.values()]
    assert any(noisy == noisy.lower() and plain != plain.lower() for plain, noisy in pairs)  # lower-cased
    assert any(noisy.lower() != plain.lower() for plain, noisy in pairs)  # misspelt
    assert any(plain == noisy for plain, noisy in pairs)  # and some left as they are
    twice = [epochs for epochs in sources.values() if len(epochs) >= 2]
    assert any(len({noisy for _, noisy in epochs.values()}) > 1 for epochs in twice)  # redrawn each epoch
    saved = (tmp_path / "noisy" / "tokenizer.json").read_text()
    assert saved == (tmp_path / "plain" / "tokenizer.json").read_text()
    card = " ".join((tmp_path / "noisy" / "README.md").read_text().split())
    assert ("training-time noise: 50% of the source sentences lower-cased, typos in 20% of the source words "
            "(redrawn every epoch).") in card


def test_sources_the_noise_leaves_alone_keep_their_ids(corpus_tokenizer):
    """Only the sentences the noise changed are encoded again; the others keep the ids preprocessing gave them, here
    one token per character, which encoding the text again would merge."""
    from transformers import DataCollatorForSeq2Seq

    text = "In the beginning God created the heavens."
    merged = corpus_tokenizer(text)["input_ids"]
    characters = "".join(corpus_tokenizer.convert_ids_to_tokens(merged[:-1]))
    split = corpus_tokenizer.convert_tokens_to_ids(list(characters)) + merged[-1:]
    assert split != merged and corpus_tokenizer.decode(split, skip_special_tokens=True) == text
    collator = NoiseCollator(DataCollatorForSeq2Seq(corpus_tokenizer), corpus_tokenizer,
                             Augmentation(source_lowercase_rate=0.5), seed=0,
                             max_lengths={"input_ids": 96, "labels": 96})
    outcomes = set()
    for epoch in range(12):
        collator.set_epoch(epoch)
        ids = collator([{"input_ids": split, "labels": merged}])["input_ids"][0].tolist()
        assert ids in (split, corpus_tokenizer(text.lower())["input_ids"]), epoch
        outcomes.add(ids == split)
    assert outcomes == {True, False}  # left alone in some epochs, lower-cased in others


def test_each_epoch_is_packed_by_the_lengths_its_noise_gives(corpus_tokenizer):
    """The noise changes a source's length (typos, lower-casing, BPE-dropout split words into more pieces), so the
    token buckets are packed by the lengths each epoch's batches will hold (`NoiseCollator.lengths`, drawn ahead):
    every collated row has the length drawn for it, and every batch keeps to the budget with its noise in it."""
    from transformers import DataCollatorForSeq2Seq

    from hf_scratch_transformer.data.batching import TrainingBatches
    from hf_scratch_transformer.data.loading import DataArguments

    texts = [(source * (1 + i % 3), target) for i, (source, target) in enumerate(PAIRS * 8)]
    dataset = Dataset.from_dict({"input_ids": [corpus_tokenizer(s)["input_ids"] for s, _ in texts],
                                 "labels": [corpus_tokenizer(t)["input_ids"] for _, t in texts]})
    budget = 2 * max(len(ids) for ids in dataset["input_ids"])
    collator = NoiseCollator(DataCollatorForSeq2Seq(corpus_tokenizer), corpus_tokenizer,
                             Augmentation(source_typo_rate=0.3, bpe_dropout=0.3), seed=0,
                             max_lengths={"input_ids": budget, "labels": budget})
    batches = TrainingBatches(dataset, collator, DataArguments(max_tokens=budget, max_source_length=budget,
                                                               max_target_length=budget), 8, seed=0)
    grew = 0
    for epoch in range(3):
        source_lengths, target_lengths = collator.lengths(dataset, epoch)
        for indices, batch in batches.epoch(epoch, 0):
            held = batch["attention_mask"].sum(1).tolist()
            assert held == source_lengths[indices].tolist()
            assert ((batch["labels"] != -100).sum(1)).tolist() == target_lengths[indices].tolist()
            assert len(indices) * max(batch["input_ids"].shape[1], batch["labels"].shape[1]) <= budget
            grew += sum(length > len(dataset[i]["input_ids"]) for i, length in zip(indices, held))
    assert grew  # the noise did lengthen sources, which the packing before it would have put over the budget


def test_source_noise_flags_are_checked_before_training(tmp_path):
    from helpers import quick_flags

    from hf_scratch_transformer.training.arguments import parse_arguments
    from hf_scratch_transformer.errors import UsageError

    for flag, value in (("source_lowercase_rate", 1.0), ("source_typo_rate", -0.1), ("source_paraphrase_rate", 1.0),
                        ("source_plain_quotes_rate", 1.0), ("source_contraction_rate", 1.5),
                        ("source_spaced_punctuation_rate", -0.5)):
        with pytest.raises(UsageError, match=flag):
            parse_arguments(quick_flags(tmp_path, **{flag: value}))


def test_plain_quotes_replace_typographic_ones_at_their_rate():
    sentence = "Don’t say “no”, it’s God’s ‘word’."
    plain = "Don't say \"no\", it's God's 'word'."
    noise = SourceNoise(Augmentation(source_plain_quotes_rate=0.3))
    drawn = [noise.apply(sentence, random.Random(seed)) for seed in range(500)]
    assert set(drawn) == {sentence, plain}
    assert 0.23 < drawn.count(plain) / 500 < 0.37
    rng = random.Random(5)  # a sentence without typographic quotes draws nothing
    assert noise.apply("Jesus wept.", rng) == "Jesus wept." and rng.random() == random.Random(5).random()
    assert noise.apply(plain, random.Random(0)) == plain


def test_plain_quotes_reach_the_training_sources(tmp_path, recorded):
    seen = recorded.seen
    flags = dict(max_train_samples=80, max_steps=12, eval_steps=0, save_steps=0, **NO_SOURCE_NOISE)
    run_quick(tmp_path / "plain-quotes", **{**flags, "source_plain_quotes_rate": 0.5})
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "plain-quotes")
    sources = decoded_sources(seen, tokenizer)
    typed, typographic = (sum(any(mark in source for mark in marks) for source in sources)
                          for marks in (("'", '"'), ("\u2019", "\u201c")))
    assert typed and typographic  # some sentences typed plain, others left as the corpus has them
    seen.clear()
    run_quick(tmp_path / "typographic", **flags)
    assert not any("'" in source or '"' in source for source in decoded_sources(seen, tokenizer))
    card = " ".join((tmp_path / "plain-quotes" / "README.md").read_text().split())
    assert "plain quotes in 50% of the source sentences with typographic ones" in card


def test_contract_writes_english_as_people_type_it():
    assert contract("Do not be afraid; I am the way, and you are not alone.") == \
        "Don't be afraid; I'm the way, and you aren't alone."
    assert contract("He cannot come, let us go. It is there, that is all.") == \
        "He can't come, let's go. It's there, that's all."
    assert contract("i will see: they have said it would not be.") == "I'll see: they've said it wouldn't be."
    # only whole words, and a verb that ends the clause stays ("it is." cannot be "it's.")
    for kept in ("The island is green.", "Who knows what it is?", "Donot hide.", "Isaac is here, he is."):
        assert contract(kept) == kept


def test_contractions_and_spaced_punctuation_apply_at_their_rates_and_draw_only_where_they_can():
    for rate_name, sentence, changed in (
            ("source_contraction_rate", "They will not go, for it is late.", "They won't go, for it's late."),
            ("source_spaced_punctuation_rate", "Wait, what? Go: now; 3.5 km.", "Wait , what ? Go : now ; 3.5 km .")):
        noise = SourceNoise(Augmentation(**{rate_name: 0.3}))
        drawn = [noise.apply(sentence, random.Random(seed)) for seed in range(500)]
        assert set(drawn) == {sentence, changed}
        assert 0.23 < drawn.count(changed) / 500 < 0.37
        rng = random.Random(5)  # a sentence neither can change draws nothing: the later changes see the same draws
        assert noise.apply("Jesus wept", rng) == "Jesus wept" and rng.random() == random.Random(5).random()


def test_contractions_and_spaced_punctuation_reach_the_training_sources(tmp_path, recorded):
    seen = recorded.seen
    flags = dict(max_train_samples=80, max_steps=12, eval_steps=0, save_steps=0, **NO_SOURCE_NOISE)
    run_quick(tmp_path / "typed", **{**flags, "source_contraction_rate": 0.9, "source_spaced_punctuation_rate": 0.9})
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "typed")
    sources = decoded_sources(seen, tokenizer)
    assert any("n't" in source or "'s " in source or "'ll" in source for source in sources)
    assert any(" ," in source or " ." in source for source in sources)
    seen.clear()
    run_quick(tmp_path / "as-written", **flags)
    plain = decoded_sources(seen, tokenizer)
    assert not any("n't" in source for source in plain) and not any(" ." in source for source in plain)
    card = " ".join((tmp_path / "typed" / "README.md").read_text().split())
    assert ("contractions in 90% of the source sentences that can have them, a space before punctuation in 90% of "
            "the source sentences") in card


# ------------------------------------------------------------------------------------------------ paraphrases


def test_paraphrase_noise_swaps_in_a_paraphrase_at_its_rate():
    sentence, other = "Honor your father and your mother.", "Love your enemies."
    paraphrases = {sentence: ["Honour thy father and thy mother.", "Honour thy father and mother."]}
    noise = SourceNoise(Augmentation(source_paraphrase_rate=0.4), paraphrases)
    drawn = [noise.apply(sentence, random.Random(seed)) for seed in range(500)]
    assert set(drawn) == {sentence, *paraphrases[sentence]}
    assert 0.33 < sum(text != sentence for text in drawn) / 500 < 0.47
    # a sentence without paraphrases is left as it is and draws nothing: the other noise sees the same draws
    rng = random.Random(5)
    assert noise.apply(other, rng) == other and rng.random() == random.Random(5).random()
    assert not SourceNoise(Augmentation(source_paraphrase_rate=0.4), {})  # nothing to swap in: no noise at all


def test_source_paraphrases_come_from_the_corpus_keyed_as_the_collator_decodes(shipped_corpus, corpus_tokenizer):
    subset = shipped_corpus["train"].select(range(200))
    table = source_paraphrases(subset, corpus_tokenizer, "en")
    assert len(table) == len({example["translation"]["en"] for example in subset})
    for example in subset:
        decoded = corpus_tokenizer.decode(corpus_tokenizer(example["translation"]["en"])["input_ids"],
                                          skip_special_tokens=True)
        assert example["paraphrases"]["en"][0] in table[decoded]  # the King James Version of the verse
    assert source_paraphrases(subset, corpus_tokenizer, "es") == {}  # the shipped corpus paraphrases English only
    assert source_paraphrases(subset.select_columns(["translation"]), corpus_tokenizer, "en") == {}
    assert source_paraphrases(subset.to_iterable_dataset(), corpus_tokenizer, "en") == {}


def test_paraphrases_replace_training_sources_only(tmp_path, recorded, shipped_corpus):
    from transformers import AutoTokenizer

    seen = recorded.seen
    flags = dict(max_train_samples=80, max_steps=12, eval_steps=0, save_steps=0, **NO_SOURCE_NOISE)
    run_quick(tmp_path / "paraphrased", **{**flags, "source_paraphrase_rate": 0.5})
    paraphrased = list(seen)
    seen.clear()
    run_quick(tmp_path / "plain", **flags)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "plain")
    king_james = {tokenizer.decode(tokenizer(example["paraphrases"]["en"][0])["input_ids"], skip_special_tokens=True)
                  for example in shipped_corpus["train"].select(range(80))}
    sources, plain_sources = decoded_sources(paraphrased, tokenizer), decoded_sources(seen, tokenizer)
    assert 0.25 < sum(source in king_james for source in sources) / len(sources) < 0.75
    assert not any(source in king_james for source in plain_sources)
    tokenizers = [(tmp_path / name / "tokenizer.json").read_text() for name in ("paraphrased", "plain")]
    assert tokenizers[0] == tokenizers[1]  # trained on the corpus's translations only
    card = " ".join((tmp_path / "paraphrased" / "README.md").read_text().split())
    assert "training-time noise: 50% of the source sentences with a paraphrase in the corpus replaced by it" in card
    # Spanish to English: the English paraphrases are targets there, which the noise never touches
    seen.clear()
    run_quick(tmp_path / "es-en-paraphrased", source_lang="es", target_lang="en",
              **{**flags, "source_paraphrase_rate": 0.5})
    es_paraphrased = list(seen)
    seen.clear()
    run_quick(tmp_path / "es-en-plain", source_lang="es", target_lang="en", **flags)
    assert len(seen) == len(es_paraphrased)
    assert all(torch.equal(a[2], b[2]) for a, b in zip(seen, es_paraphrased))


def test_a_json_lines_corpus_of_ones_own_gives_paraphrases(tmp_path, corpus_tokenizer):
    from helpers import CORPUS_PAIRS, write_jsonl

    from hf_scratch_transformer.data.loading import DataArguments, load_parallel_corpus

    records = [{"translation": {"en": en, "es": es}, "paraphrases": {"en": [en.upper()] if i % 2 else []}}
               for i, (en, es) in enumerate(CORPUS_PAIRS)]
    train = write_jsonl(tmp_path / "train.jsonl", records)
    raw = load_parallel_corpus(DataArguments(train_file=str(train), validation_file=str(train)))
    table = source_paraphrases(raw["train"], corpus_tokenizer, "en")
    with_some = {corpus_tokenizer.decode(corpus_tokenizer(en)["input_ids"], skip_special_tokens=True): [en.upper()]
                 for i, (en, _) in enumerate(CORPUS_PAIRS) if i % 2}
    assert table == with_some
    records[3]["paraphrases"] = {"en": "not a list"}
    write_jsonl(train, records)
    from hf_scratch_transformer.data.corpus_files import CorpusError

    with pytest.raises(CorpusError, match=r"line 4: `paraphrases` must be an object of lists of strings"):
        load_parallel_corpus(DataArguments(train_file=str(train), validation_file=str(train)))


def test_reading_paraphrases_of_an_over_long_source_does_not_warn_about_indexing_errors(corpus_tokenizer):
    """The shipped corpus has a source of 6,000 tokens (dropped as too long before the model): tokenising it for the
    paraphrase table must not print transformers' "Token indices sequence length ... indexing errors"."""
    import copy
    import io
    import logging

    from hf_scratch_transformer.training.augmentation import source_paraphrases

    tokenizer = copy.deepcopy(corpus_tokenizer)
    tokenizer.model_max_length = 16
    long_source = "In the beginning God created the heaven and the earth. " * 20
    raw = Dataset.from_list([{"translation": {"en": long_source, "es": "x"},
                              "paraphrases": {"en": ["In the start God made it all."], "es": []}}])
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    try:
        table = source_paraphrases(raw, tokenizer, "en")
    finally:
        transformers_logger.removeHandler(handler)
    assert len(tokenizer(long_source, verbose=False)["input_ids"]) > 16 and len(table) == 1
    assert "Token indices sequence length" not in buffer.getvalue()
