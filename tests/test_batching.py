"""data/batching.py: token-bucketed and sentence batches of an in-memory split and of a streamed one, packed by one
rule and sharded over processes by one rule (batch k to process k % world_size)."""

import pytest
import torch
from datasets import Dataset, DatasetDict

from hf_scratch_transformer.data.batching import (
    SentenceBatchSampler,
    TokenBucketBatchSampler,
    TrainingBatches,
    make_batch_sampler,
    pack,
    padding_fraction,
    shard_batches,
    stream_batches,
)
from hf_scratch_transformer.data.loading import DataArguments
from hf_scratch_transformer.data.preprocessing import make_collator, preprocess_corpus, sequence_lengths



@pytest.fixture(scope="module")
def train_lengths(shipped_corpus, corpus_tokenizer):
    """Token lengths (</s> included) of the shipped training split, truncated like preprocessing does."""
    pairs = shipped_corpus["train"]["translation"]
    encode = lambda texts: corpus_tokenizer(texts, truncation=True, max_length=256)["input_ids"]  # noqa: E731
    return [len(x) for x in encode([p["en"] for p in pairs])], [len(x) for x in encode([p["es"] for p in pairs])]


def batch_cost(batch, src_lengths, tgt_lengths):
    return len(batch) * max(max(src_lengths[i], tgt_lengths[i]) for i in batch)


@pytest.mark.parametrize("max_tokens", [1024, 4096])
def test_token_batches_respect_the_budget_and_cover_the_epoch_once(train_lengths, max_tokens):
    src, tgt = train_lengths
    sampler = TokenBucketBatchSampler(src, tgt, max_tokens, seed=0)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    assert max(batch_cost(b, src, tgt) for b in batches) <= max_tokens
    assert sorted(i for b in batches for i in b) == list(range(len(src)))
    assert padding_fraction(batches, src, tgt) < 0.10


def test_token_batches_pad_far_less_than_random_sentence_batches(train_lengths):
    src, tgt = train_lengths
    token_padding = padding_fraction(list(TokenBucketBatchSampler(src, tgt, 4096)), src, tgt)
    sentence_padding = padding_fraction(list(SentenceBatchSampler(len(src), 64)), src, tgt)
    assert token_padding < 0.10 < sentence_padding


def test_token_batches_reshuffle_each_epoch_reproducibly(train_lengths):
    src, tgt = train_lengths
    sampler = TokenBucketBatchSampler(src, tgt, 4096, seed=5)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second
    assert sorted(i for b in second for i in b) == list(range(len(src)))
    assert list(TokenBucketBatchSampler(src, tgt, 4096, seed=5)) == first


@pytest.mark.parametrize("num_replicas", [2, 3])
@pytest.mark.parametrize("sampler_class", ["token", "sentence"])
def test_processes_share_the_epoch_without_overlap(train_lengths, num_replicas, sampler_class):
    src, tgt = train_lengths

    def make(rank):
        if sampler_class == "token":
            return TokenBucketBatchSampler(src, tgt, 4096, seed=3, num_replicas=num_replicas, rank=rank)
        return SentenceBatchSampler(len(src), 64, seed=3, num_replicas=num_replicas, rank=rank)

    samplers = [make(rank) for rank in range(num_replicas)]
    for sampler in samplers:
        sampler.set_epoch(2)
    per_rank = [list(sampler) for sampler in samplers]
    assert len({len(sampler) for sampler in samplers}) == 1
    assert [len(batches) for batches in per_rank] == [len(samplers[0])] * num_replicas
    seen = [i for batches in per_rank for b in batches for i in b]
    assert sorted(seen) == list(range(len(src)))
    if sampler_class == "token":
        assert max(batch_cost(b, src, tgt) for batches in per_rank for b in batches) <= 4096


def test_batches_are_split_rather_than_repeated_to_even_out_ranks():
    sampler = TokenBucketBatchSampler([5] * 9, [5] * 9, max_tokens=15, shuffle=False, num_replicas=2, rank=0)
    assert len(sampler.all_batches()) == 3
    ranks = [list(TokenBucketBatchSampler([5] * 9, [5] * 9, 15, shuffle=False, num_replicas=2, rank=r)) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 2
    assert sorted(i for batches in ranks for b in batches for i in b) == list(range(9))


def test_drop_last_gives_equal_counts_by_dropping_the_surplus():
    ranks = [SentenceBatchSampler(10, 2, num_replicas=3, rank=r, drop_last=True) for r in range(3)]
    assert [len(r) for r in ranks] == [1, 1, 1]


def test_budget_smaller_than_longest_example_is_refused():
    with pytest.raises(ValueError, match="max_tokens=10.*longest example \\(12 tokens\\)"):
        TokenBucketBatchSampler([3, 12], [4, 5], max_tokens=10)


def test_batch_sampler_feeds_a_dataloader(shipped_corpus, corpus_tokenizer):
    raw = DatasetDict({name: shipped_corpus[name].select(range(64)) for name in ("train", "validation", "test")})
    processed, _ = preprocess_corpus(raw, corpus_tokenizer, DataArguments())
    sampler = make_batch_sampler(processed["train"], DataArguments(max_tokens=512), batch_size=8)
    assert isinstance(sampler, TokenBucketBatchSampler)
    src, tgt = sequence_lengths(processed["train"])
    collator = make_collator(corpus_tokenizer)
    loader = torch.utils.data.DataLoader(processed["train"], batch_sampler=sampler, collate_fn=collator)
    sizes = [batch["input_ids"].shape for batch in loader]
    assert sum(shape[0] for shape in sizes) == 64 and all(shape[0] * shape[1] <= 512 for shape in sizes)
    assert isinstance(make_batch_sampler(processed["train"], DataArguments(max_tokens=0), batch_size=8), SentenceBatchSampler)
    assert len(src) == len(tgt) == 64


def test_padding_fraction_counts_source_and_target_padding():
    assert padding_fraction([[0, 1]], [2, 4], [3, 3]) == pytest.approx(2 / 14)


def test_samplers_work_under_accelerate_sharding():
    from accelerate.data_loader import prepare_data_loader

    lengths = [(i * 7) % 50 + 1 for i in range(1001)]
    sampler = TokenBucketBatchSampler(lengths, lengths, max_tokens=200, seed=0)
    loader = torch.utils.data.DataLoader(list(range(1001)), batch_sampler=sampler, collate_fn=lambda batch: batch)
    shards = [prepare_data_loader(loader, num_processes=2, process_index=rank, put_on_device=False) for rank in (0, 1)]
    for shard in shards:
        shard.set_epoch(3)
    per_process = [list(shard) for shard in shards]
    assert sampler.epoch == 3
    assert len(per_process[0]) == len(per_process[1])
    assert {i for batches in per_process for batch in batches for i in batch} == set(range(1001))


# ------------------------------------------------------------------------------------------------------ one rule


def test_pack_closes_a_batch_before_the_budget_is_passed_by_its_longest_pair():
    lengths = [3, 5, 2, 2, 9, 1, 1]
    assert list(pack(zip("abcdefg", lengths), max_tokens=10)) == [["a", "b"], ["c", "d"], ["e"], ["f", "g"]]
    assert list(pack(zip("abcdefg", lengths), max_tokens=0, batch_size=3)) == [["a", "b", "c"], ["d", "e", "f"],
                                                                              ["g"]]


def stream_of(lengths):
    """Tokenised pairs whose longer side has these lengths (sources one token shorter)."""
    return [{"input_ids": [5] * max(1, length - 1), "attention_mask": [1] * max(1, length - 1),
             "labels": [6] * length, "unused": 0} for length in lengths]


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
@pytest.mark.parametrize("max_tokens, batch_size", [(40, 0), (0, 4)], ids=["token_budget", "sentences"])
def test_a_stream_is_packed_and_sharded_as_an_in_memory_split_in_the_same_order(num_replicas, max_tokens, batch_size):
    """The same packing rule and batch k to process k % world_size; a stream drops its last incomplete round, as an
    in-memory split does with drop_last."""
    lengths = [(i * 7) % 13 + 1 for i in range(101)]
    in_memory = list(pack(zip(range(len(lengths)), lengths), max_tokens, batch_size))
    for rank in range(num_replicas):
        streamed = list(stream_batches(stream_of(lengths), max_tokens, batch_size, num_replicas, rank))
        expected = [batch for k, batch in enumerate(in_memory[: len(in_memory) - len(in_memory) % num_replicas])
                    if k % num_replicas == rank]
        assert [positions for positions, _ in streamed] == expected
        assert all(len(features) == len(positions) and set(features[0]) == {"input_ids", "attention_mask", "labels"}
                   for positions, features in streamed)
        evened = in_memory[: len(in_memory) - len(in_memory) % num_replicas]
        assert shard_batches(evened, num_replicas, rank, drop_last=False) == expected


def test_a_stream_respects_the_budget_and_resumes_after_whole_rounds():
    lengths = [(i * 5) % 17 + 1 for i in range(200)]
    rounds = [list(stream_batches(stream_of(lengths), 48, 0, 2, rank)) for rank in (0, 1)]
    assert len(rounds[0]) == len(rounds[1])
    for positions, features in rounds[0] + rounds[1]:
        assert len(features) * max(max(len(f["input_ids"]), len(f["labels"])) for f in features) <= 48
    seen = [i for batches in rounds for positions, _ in batches for i in positions]
    assert len(seen) == len(set(seen))
    resumed = list(stream_batches(stream_of(lengths), 48, 0, 2, 1, skip_rounds=3))
    assert [positions for positions, _ in resumed] == [positions for positions, _ in rounds[1][3:]]


def test_training_batches_of_a_stream_give_each_process_its_share(tmp_path):
    rows = stream_of([(i * 3) % 11 + 2 for i in range(60)])
    stream = Dataset.from_list(rows).to_iterable_dataset()
    args = DataArguments(streaming=True, max_tokens=40, max_source_length=20, max_target_length=20)
    per_rank = [list(TrainingBatches(stream, lambda features: features, args, 8, seed=1, num_replicas=2,
                                     rank=rank).epoch(0, 0)) for rank in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) > 3
    positions = [i for batches in per_rank for indices, _ in batches for i in indices]
    assert len(positions) == len(set(positions))
    again = list(TrainingBatches(stream, lambda features: features, args, 8, seed=1, num_replicas=2,
                                 rank=1).epoch(0, 2))  # resumed after 2 rounds
    assert [indices for indices, _ in again] == [indices for indices, _ in per_rank[1][2:]]
    other_epoch = list(TrainingBatches(stream, lambda features: features, args, 8, seed=1, num_replicas=2,
                                       rank=1).epoch(1, 0))
    assert [indices for indices, _ in other_epoch] != [indices for indices, _ in per_rank[1]]  # reshuffled
