"""Training batches: fairseq-style token buckets or fixed sentence counts, sharded the same way over processes."""

import random
from collections.abc import Iterator, Sequence
from itertools import chain

import numpy as np
from datasets import Dataset
from torch.utils.data import Sampler

from .loading import DataArguments
from .preprocessing import sequence_lengths



def shard_batches(batches: list[list[int]], num_replicas: int, rank: int, drop_last: bool) -> list[list[int]]:
    """The batches of one process: every ``num_replicas``-th batch starting at ``rank``.

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
    return batches[rank::num_replicas]


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
    packed greedily, and the batch order is shuffled with ``seed + epoch`` (call :meth:`set_epoch`). With several
    processes every process builds the same batches and keeps its share (see :func:`shard_batches`): ``__len__`` is
    equal on all ranks and, unless ``drop_last``, the union over ranks is the whole epoch without overlap.

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
    ):
        super().__init__(shuffle, seed, num_replicas, rank, drop_last)
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
        rng = random.Random(self.seed + self.epoch)
        order = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(order)
        order = np.array(order, dtype=np.int64)
        # a stable sort by (length, source length): the shuffle breaks the ties
        key = self.lengths[order].astype(np.int64) * (int(self.src_lengths.max(initial=0)) + 1) + \
            self.src_lengths[order]
        order = order[np.argsort(key, kind="stable")]
        batches = _pack_sorted(order.tolist(), self.lengths[order].tolist(), self.max_tokens)
        if self.shuffle:
            rng.shuffle(batches)
        self._cache = (self.epoch, batches)
        return batches


def _pack_sorted(order: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy batches of the pairs `order` (sorted by non-decreasing `lengths`, aligned with it): a batch closes when
    one more pair would make batch size x its longest pair exceed `max_tokens`."""
    batches, batch = [], []
    for index, length in zip(order, lengths):
        if batch and (len(batch) + 1) * length > max_tokens:
            batches.append(batch)
            batch = []
        batch.append(index)
    if batch:
        batches.append(batch)
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
        return [order[start : start + self.batch_size] for start in range(0, self.num_examples, self.batch_size)]


def make_batch_sampler(
    dataset: Dataset,
    args: DataArguments,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    num_replicas: int = 1,
    rank: int = 0,
    drop_last: bool = False,
) -> Sampler[list[int]]:
    """Token-bucketed batches when ``args.max_tokens`` is set, else fixed batches of ``batch_size`` pairs."""
    if args.max_tokens:
        src_lengths, tgt_lengths = sequence_lengths(dataset)
        return TokenBucketBatchSampler(
            src_lengths, tgt_lengths, args.max_tokens, shuffle, seed, num_replicas, rank, drop_last
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
