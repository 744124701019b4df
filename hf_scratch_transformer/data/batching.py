"""Training batches: fairseq-style token buckets or fixed sentence counts, for an in-memory split and for a streamed
one, sharded the same way over processes.

One packing rule (`pack`): a batch closes when one more pair would make batch size × its longest pair exceed the
token budget (or holds a fixed number of pairs). One sharding rule (`rounds`): the batches form rounds of one batch
per process, and batch k goes to process k % world_size. An in-memory split is sorted by length before packing (little
padding), and its batch count is evened out over the processes (`shard_batches`). A streamed split is packed as it
is read: its order is the stream's (shuffled within a buffer), since sorting would need the whole split, so its batches
hold more padding; its length is unknown, so a last incomplete round is dropped (`stream_batches`). `TrainingBatches`
gives one process its batches, epoch by epoch, for either kind.
"""

import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain
from typing import TypeVar

import numpy as np
import torch
from datasets import Dataset
from torch.utils.data import DataLoader, Sampler

from .loading import DataArguments
from .preprocessing import sequence_lengths

Item = TypeVar("Item")
STREAM_SHUFFLE_BUFFER = 10_000  # examples in the shuffle buffer of a --streaming training split
TRAINING_COLUMNS = ("input_ids", "attention_mask", "labels")


def pack(items: Iterable[tuple[Item, int]], max_tokens: int, batch_size: int = 0) -> Iterator[list[Item]]:
    """Greedy batches of (item, length) pairs, in the order given. With a token budget (`max_tokens` > 0) a batch
    closes when one more pair would make batch size × the longest length in it exceed `max_tokens`; without one,
    every `batch_size` pairs."""
    batch, longest = [], 0
    for item, length in items:
        full = (len(batch) + 1) * max(longest, length) > max_tokens if max_tokens else len(batch) >= batch_size
        if batch and full:
            yield batch
            batch, longest = [], 0
        batch.append(item)
        longest = max(longest, length)
    if batch:
        yield batch


def rounds(batches: Iterable[Item], num_replicas: int) -> Iterator[list[Item]]:
    """Consecutive rounds of `num_replicas` batches (batch k is in place k % num_replicas of its round); a last
    incomplete round is dropped."""
    round_ = []
    for batch in batches:
        round_.append(batch)
        if len(round_) == num_replicas:
            yield round_
            round_ = []


def shard_batches(batches: list[list[int]], num_replicas: int, rank: int, drop_last: bool) -> list[list[int]]:
    """The batches of one process: batch k goes to process k % ``num_replicas`` (see :func:`rounds`).

    To give every process the same number of batches (so DDP never waits on a process that ran out), the batch count
    is first made a multiple of ``num_replicas``: with ``drop_last`` the surplus batches are dropped; otherwise the
    largest batches are split in two, so every example is still seen exactly once. Only when there are fewer
    examples than processes are batches repeated from the start.
    """
    if num_replicas == 1:
        return batches
    batches = [list(batch) for batch in batches]
    surplus = len(batches) % num_replicas
    if surplus and drop_last:
        batches = batches[: len(batches) - surplus]
    elif surplus:
        for repeat in range(num_replicas - surplus):
            largest = max(range(len(batches)), key=lambda i: len(batches[i]))
            batch = batches[largest]
            if len(batch) < 2:
                batches.append(batches[repeat % len(batches)])
            else:
                batches[largest : largest + 1] = [batch[: len(batch) // 2], batch[len(batch) // 2 :]]
    return [round_[rank] for round_ in rounds(batches, num_replicas)]


def stream_batches(examples: Iterable[dict], max_tokens: int, batch_size: int, num_replicas: int = 1, rank: int = 0,
                   skip_rounds: int = 0) -> Iterator[tuple[list[int], list[dict]]]:
    """The batches of one process formed while reading a stream of tokenised pairs: (positions in the stream,
    features) each. Every process reads the same stream and forms the same batches (:func:`pack`, in stream order:
    a stream cannot be sorted by length); batch k goes to process k % num_replicas, and only whole rounds are kept
    (:func:`rounds`), so every process takes the same number of steps. `skip_rounds` rounds are read and skipped
    (resuming after them)."""
    def pairs():
        for position, example in enumerate(examples):
            features = {key: example[key] for key in TRAINING_COLUMNS}
            yield (position, features), max(len(features["input_ids"]), len(features["labels"]))

    for number, round_ in enumerate(rounds(pack(pairs(), max_tokens, batch_size), num_replicas)):
        if number >= skip_rounds:
            positions, features = zip(*round_[rank])
            yield list(positions), list(features)


class ShardedBatchSampler(Sampler[list[int]]):
    """Batches of one epoch (``all_batches``, seeded by ``seed + epoch``), of which each process keeps its share
    (:func:`shard_batches`). Subclasses decide how the batches are formed."""

    def __init__(self, shuffle: bool = True, seed: int = 0, num_replicas: int = 1, rank: int = 0,
                 drop_last: bool = False):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas}).")
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def sampler(self) -> Sampler:
        """Lets Accelerate's ``DataLoaderShard.set_epoch`` find :meth:`set_epoch` through its batch-sampler wrapper."""
        return self

    def all_batches(self) -> list[list[int]]:
        """This epoch's batches over all processes, in iteration order before sharding (defined by subclasses)."""
        raise TypeError(f"{type(self).__name__} must define all_batches()")

    def __iter__(self) -> Iterator[list[int]]:
        return iter(shard_batches(self.all_batches(), self.num_replicas, self.rank, self.drop_last))

    def __len__(self) -> int:
        return len(shard_batches(self.all_batches(), self.num_replicas, self.rank, self.drop_last))


class TokenBucketBatchSampler(ShardedBatchSampler):
    """fairseq-style batches of similar-length pairs under a token budget.

    The cost of a batch is ``len(batch) * max(longest source, longest target)`` (the padded size of the larger side,
    ``</s>`` included) and never exceeds ``max_tokens``. Pairs are sorted by length with a seeded random tie-break,
    packed greedily (:func:`pack`), and the batch order is shuffled with ``seed + epoch`` (call :meth:`set_epoch`).
    With several processes every process builds the same batches and keeps its share (see :func:`shard_batches`):
    ``__len__`` is equal on all ranks and, unless ``drop_last``, the union over ranks is the whole epoch without
    overlap.

    `epoch_lengths(epoch)`, when given, returns the (source, target) lengths that epoch's batches will hold (after
    training-time noise, which changes them): each epoch is then sorted and packed by those, so its batches keep to
    the budget and to little padding as they are trained on.

    Under Accelerate, either build it with ``num_replicas=accelerator.num_processes, rank=accelerator.process_index``
    and do not pass that DataLoader through ``accelerator.prepare`` (no example repeated), or build it with
    ``num_replicas=1`` and let ``prepare`` shard it (Accelerate then evens out the ranks by repeating a few
    batches). The batch count can differ by a few between epochs, since the length ties are broken anew.
    """

    def __init__(
        self,
        src_lengths: Sequence[int],
        tgt_lengths: Sequence[int],
        max_tokens: int,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        epoch_lengths: Callable[[int], tuple[Sequence[int], Sequence[int]]] | None = None,
    ):
        super().__init__(shuffle, seed, num_replicas, rank, drop_last)
        self.epoch_lengths = epoch_lengths
        if len(src_lengths) != len(tgt_lengths):
            raise ValueError(f"{len(src_lengths)} source lengths but {len(tgt_lengths)} target lengths.")
        # numpy arrays: 4 bytes a pair, where Python lists of ints took ~40
        self.src_lengths = np.asarray(src_lengths, dtype=np.int32)
        self.tgt_lengths = np.asarray(tgt_lengths, dtype=np.int32)
        self.lengths = np.maximum(self.src_lengths, self.tgt_lengths)
        longest = int(self.lengths.max()) if len(self.lengths) else 0
        if max_tokens < longest:
            raise ValueError(
                f"max_tokens={max_tokens} is smaller than the longest example ({longest} tokens); raise --max_tokens "
                "or lower --max_source_length / --max_target_length."
            )
        self.max_tokens = max_tokens
        self._cache: tuple[int, list[list[int]]] | None = None

    def all_batches(self) -> list[list[int]]:
        """This epoch's batches over all processes, in iteration order before sharding."""
        if self._cache and self._cache[0] == self.epoch:
            return self._cache[1]
        src_lengths, lengths = self.src_lengths, self.lengths
        if self.epoch_lengths is not None:
            src_lengths, tgt_lengths = (np.asarray(side, dtype=np.int32) for side in self.epoch_lengths(self.epoch))
            if len(src_lengths) != len(self.lengths) or len(tgt_lengths) != len(self.lengths):
                raise ValueError(f"epoch_lengths gave {len(src_lengths)} / {len(tgt_lengths)} lengths for "
                                 f"{len(self.lengths)} pairs")
            lengths = np.maximum(src_lengths, tgt_lengths)
        rng = random.Random(self.seed + self.epoch)
        order = list(range(len(lengths)))
        if self.shuffle:
            rng.shuffle(order)
        order = np.array(order, dtype=np.int64)
        # a stable sort by (length, source length): the shuffle breaks the ties
        key = lengths[order].astype(np.int64) * (int(src_lengths.max(initial=0)) + 1) + src_lengths[order]
        order = order[np.argsort(key, kind="stable")]
        batches = list(pack(zip(order.tolist(), lengths[order].tolist()), self.max_tokens))
        if self.shuffle:
            rng.shuffle(batches)
        self._cache = (self.epoch, batches)
        return batches


class SentenceBatchSampler(ShardedBatchSampler):
    """Fixed-size batches of ``batch_size`` pairs in a seeded random order (reshuffled by :meth:`set_epoch`),
    sharded across processes like :class:`TokenBucketBatchSampler`."""

    def __init__(self, num_examples: int, batch_size: int, **sharding):
        """sharding: shuffle, seed, num_replicas, rank, drop_last, as for TokenBucketBatchSampler."""
        super().__init__(**sharding)
        self.num_examples, self.batch_size = num_examples, batch_size

    def all_batches(self) -> list[list[int]]:
        order = list(range(self.num_examples))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return list(pack(((index, 0) for index in order), 0, self.batch_size))


def make_batch_sampler(
    dataset: Dataset,
    args: DataArguments,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    num_replicas: int = 1,
    rank: int = 0,
    drop_last: bool = False,
    epoch_lengths: Callable[[int], tuple[Sequence[int], Sequence[int]]] | None = None,
) -> Sampler[list[int]]:
    """Token-bucketed batches when ``args.max_tokens`` is set (packed by `epoch_lengths` when given: see
    TokenBucketBatchSampler), else fixed batches of ``batch_size`` pairs."""
    if args.max_tokens:
        src_lengths, tgt_lengths = sequence_lengths(dataset)
        return TokenBucketBatchSampler(
            src_lengths, tgt_lengths, args.max_tokens, shuffle, seed, num_replicas, rank, drop_last, epoch_lengths
        )
    return SentenceBatchSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed, num_replicas=num_replicas,
                                rank=rank, drop_last=drop_last)


def padding_fraction(batches: Sequence[Sequence[int]], src_lengths: Sequence[int], tgt_lengths: Sequence[int]) -> float:
    """Share of padding among all source and target positions once each batch is padded to its longest sequence."""
    batches = [batch for batch in batches if len(batch)]
    if not batches:
        return 0.0
    rows = np.fromiter(chain.from_iterable(batches), dtype=np.int64)
    sizes = np.fromiter(map(len, batches), dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    padded = real = 0
    for lengths in (src_lengths, tgt_lengths):
        values = np.asarray(lengths, dtype=np.int64)[rows]
        padded += int((np.maximum.reduceat(values, starts) * sizes).sum())
        real += int(values.sum())
    return 1 - real / padded if padded else 0.0


class TrainingBatches:
    """The training batches of one process (`rank` of `num_replicas`), epoch by epoch: an in-memory split through a
    sharded batch sampler (:func:`make_batch_sampler`, reshuffled every epoch with `seed`), or a streamed split
    shuffled with `seed` in a buffer of STREAM_SHUFFLE_BUFFER and packed as it is read (:func:`stream_batches`).
    `collator` turns a list of features into a batch; if it has `set_epoch`, it is told the epoch first, and if it
    has `lengths(dataset, epoch)` (training.augmentation.NoiseCollator: the lengths after its noise), an in-memory
    split's token buckets are packed by those."""

    def __init__(self, dataset, collator, data_args: DataArguments, batch_size: int, seed: int, num_replicas: int = 1,
                 rank: int = 0, num_workers: int = 0):
        self.dataset, self.collator, self.data_args, self.batch_size = dataset, collator, data_args, batch_size
        self.seed, self.num_replicas, self.rank, self.num_workers = seed, num_replicas, rank, num_workers
        epoch_lengths = (lambda epoch: collator.lengths(dataset, epoch)) if hasattr(collator, "lengths") else None
        self.sampler = None if data_args.streaming else make_batch_sampler(
            dataset, data_args, batch_size, shuffle=True, seed=seed, num_replicas=num_replicas, rank=rank,
            epoch_lengths=epoch_lengths)
        self.per_epoch = 0 if self.sampler is None else len(self.sampler)  # this process's; unknown when streamed

    def steps_per_epoch(self, accumulation: int) -> int | None:
        """Optimiser steps in an epoch of batches accumulated by `accumulation` (None when streamed: unknown)."""
        return None if self.sampler is None else math.ceil(self.per_epoch / accumulation)

    def epoch_fraction(self, epoch: int, done: int) -> float:
        """Epochs done after `done` batches of epoch `epoch`; when streamed, the length of an epoch is unknown, so
        only whole epochs count."""
        return round(epoch + (done / self.per_epoch if self.per_epoch else 0.0), 3)

    def epoch(self, epoch: int, done: int) -> Iterator[tuple[list[int], dict]]:
        """(example indices, collated batch) of this process for the rest of epoch `epoch`, after the `done` batches
        it already trained on; indices are positions in the (shuffled) stream when streamed."""
        if hasattr(self.collator, "set_epoch"):
            self.collator.set_epoch(epoch)
        if self.sampler is None:
            stream = self.dataset.shuffle(seed=self.seed, buffer_size=STREAM_SHUFFLE_BUFFER)
            stream.set_epoch(epoch)
            for positions, features in stream_batches(stream, self.data_args.max_tokens, self.batch_size,
                                                      self.num_replicas, self.rank, skip_rounds=done):
                yield positions, self.collator(features)
            return
        self.sampler.set_epoch(epoch)
        batches = list(self.sampler)[done:]
        # A private generator: creating the loader must not draw from the global RNG (exact resumption).
        loader = DataLoader(self.dataset, batch_sampler=batches, collate_fn=self.collator,
                            num_workers=self.num_workers, generator=torch.Generator())
        yield from zip(batches, loader)
