"""Joint byte-level BPE tokenizer for source and target, saved as a ``PreTrainedTokenizerFast``.

NFC normalisation plus a byte-level pre-tokenizer and decoder make ``decode(encode(x)) == NFC(x)`` for every string,
so ``<unk>`` is never produced. Special tokens ``<pad>``, ``<s>``, ``</s>``, ``<unk>`` get ids 0, 1, 2, 3 (the model
config's defaults: pad=0, bos=decoder_start=1, eos=2); a post-processor appends ``</s>`` to every sequence.
Special tokens written literally in the input text (``"<s>"``) are encoded as plain text (``split_special_tokens``),
so such strings round-trip too. The language pair a tokenizer was trained for is saved with it (``source_lang`` /
``target_lang`` in tokenizer_config.json, as Marian's tokenizer does): :func:`language_pair` reads it back.
"""

import heapq
import json
import random
import re
from collections.abc import Iterable, Iterator

from datasets import Dataset, DatasetDict, IterableDatasetDict
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
# BPE training time grows with the square of a word's length (a 1 MB run without spaces: minutes); texts with a
# longer whitespace-free run are left out of tokenizer training (and the training pairs holding them are dropped).
MAX_WORD_CHARS = 1000
_GIANT_WORD = re.compile(r"\S{%d}" % (MAX_WORD_CHARS + 1))
SAMPLE_BATCH = 1000  # rows read at a time from a Dataset for tokenizer training


def tokenizer_can_train_on(text: str) -> bool:
    """True unless ``text`` holds a run of more than ``MAX_WORD_CHARS`` characters without whitespace."""
    return _GIANT_WORD.search(text) is None


def language_pair(tokenizer) -> tuple[str | None, str | None]:
    """(source, target) language codes the tokenizer was trained for, or (None, None) when it does not say.

    Reads what :func:`set_language_pair` saved (``source_lang`` / ``target_lang`` in tokenizer_config.json), and a
    Marian tokenizer's attributes of the same names."""
    saved = getattr(tokenizer, "init_kwargs", None) or {}
    source = getattr(tokenizer, "source_lang", None) or saved.get("source_lang")
    target = getattr(tokenizer, "target_lang", None) or saved.get("target_lang")
    return (source, target) if source and target else (None, None)


def set_language_pair(tokenizer, source_lang: str, target_lang: str):
    """Record the language pair with ``tokenizer``: save_pretrained writes it to tokenizer_config.json and
    from_pretrained reads it back (see :func:`language_pair`). Returns the tokenizer."""
    tokenizer.init_kwargs.update(source_lang=source_lang, target_lang=target_lang)
    return tokenizer


def sample_sentences(texts: Iterable[str], max_sentences: int, seed: int = 0) -> list[str]:
    """Uniform reservoir sample of at most ``max_sentences`` texts from a stream of any length."""
    rng = random.Random(seed)
    reservoir: list[str] = []
    for seen, text in enumerate(texts):
        if seen < max_sentences:
            reservoir.append(text)
        else:
            slot = rng.randint(0, seen)
            if slot < max_sentences:
                reservoir[slot] = text
    return reservoir


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 8000,
    max_sentences: int | None = None,
    seed: int = 0,
    model_max_length: int = 512,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (at most ``max_sentences`` of them, sampled with ``seed``)."""
    if max_sentences is not None:
        texts = sample_sentences(texts, max_sentences, seed)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    eos_id = tokenizer.token_to_id("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        split_special_tokens=True,
    )


def _both_sides(dataset, source_lang: str, target_lang: str) -> Iterator[str]:
    """Yield the source then the target sentence of every example of a (possibly streaming) dataset; missing or null
    sentences (skipped later by the preprocessing) and sentences the tokenizer cannot train on in linear time
    (:func:`tokenizer_can_train_on`; their pairs are dropped by the preprocessing) are left out."""
    batches = dataset.iter(batch_size=SAMPLE_BATCH)
    for batch in batches:
        for pair in batch["translation"]:
            for lang in (source_lang, target_lang):
                text = (pair or {}).get(lang)
                if isinstance(text, str) and tokenizer_can_train_on(text):
                    yield text


def _sampled_pairs(dataset, max_sentences: int | None, seed: int):
    """The pairs to train on: all of them when they hold at most ``max_sentences`` sentences or the dataset is
    streamed (then :func:`sample_sentences` samples the stream), else a seeded uniform sample of
    ``max_sentences // 2`` pairs read from a Dataset in index order (not every row of a large corpus is read)."""
    if max_sentences is None or not isinstance(dataset, Dataset) or 2 * len(dataset) <= max_sentences:
        return dataset
    chosen = sorted(random.Random(seed).sample(range(len(dataset)), max_sentences // 2))
    return dataset.select(chosen, keep_in_memory=True)


def train_tokenizer_on_corpus(
    dataset,
    source_lang: str,
    target_lang: str,
    vocab_size: int = 8000,
    max_sentences: int | None = None,
    seed: int = 0,
    model_max_length: int = 512,
) -> PreTrainedTokenizerFast:
    """Train the joint tokenizer on both languages of ``dataset`` (the train split, a Dataset or IterableDataset),
    at most ``max_sentences`` sentences of it; the language pair is recorded with it."""
    if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        raise TypeError("Pass the train split (a Dataset or IterableDataset), not a DatasetDict.")
    tokenizer = train_bpe_tokenizer(
        _both_sides(_sampled_pairs(dataset, max_sentences, seed), source_lang, target_lang),
        vocab_size=vocab_size,
        max_sentences=max_sentences,
        seed=seed,
        model_max_length=model_max_length,
    )
    return set_language_pair(tokenizer, source_lang, target_lang)


class BPEDropout:
    """BPE-dropout (Provilkov et al., 2020): segment text with the trained merges, dropping each merge with
    probability `p`, so that training sees a different segmentation of the same sentence every time.

    The algorithm is that of `tokenizers`' BPE with `dropout` (a merge popped from the priority queue is set aside
    with probability p and put back after the next merge that is applied; segmentation ends when the queue is
    empty), with a seeded `random.Random` instead of an unseedable global generator, so that runs and resumptions
    are exact. With p = 0 the ids equal the tokenizer's own. Used for training batches only: evaluation, inference
    and the saved tokenizer never see it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, p: float):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"BPE-dropout probability must be in [0, 1), got {p}")
        state = json.loads(tokenizer.backend_tokenizer.to_str())
        if state["model"]["type"] != "BPE":
            raise ValueError(f"BPE-dropout needs a BPE tokenizer, got a {state['model']['type']} model")
        self.p = p
        self.vocab: dict[str, int] = state["model"]["vocab"]
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["model"]["merges"]]
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.backend = tokenizer.backend_tokenizer
        self.eos_id = tokenizer.eos_token_id
        self._deterministic: dict[str, tuple[list[str], int]] = {}  # word -> (its BPE pieces, merges applied)

    def encode(self, text: str, rng: random.Random) -> list[int]:
        """Token ids of `text` with `</s>` appended, as `tokenizer(text)["input_ids"]` but with dropout."""
        normalized = self.backend.normalizer.normalize_str(text)
        words = [word for word, _ in self.backend.pre_tokenizer.pre_tokenize_str(normalized)]
        return [self.vocab[piece] for word in words for piece in self.segment(word, rng)] + [self.eos_id]

    def segment(self, word: str, rng: random.Random) -> list[str]:
        """The pieces of one pre-tokenized word. Without any drop the result is the deterministic segmentation,
        which happens with probability (1 - p)^merges: one draw decides that, and otherwise the position of the
        first drop is drawn and the merging is simulated from there (the same distribution, fewer draws)."""
        pieces, merges = self._deterministic.get(word) or self._remember(word)
        if merges == 0 or rng.random() >= 1.0 - (1.0 - self.p) ** merges:
            return pieces
        # The first drop happens at merge k (1-based) with probability ∝ (1-p)^(k-1) p, given that one happens.
        first_drop, survive = merges, 1.0
        threshold = rng.random() * (1.0 - (1.0 - self.p) ** merges)
        for k in range(1, merges + 1):
            if threshold < survive * self.p:
                first_drop = k
                break
            threshold -= survive * self.p
            survive *= 1.0 - self.p
        return self._merge(word, rng, forced_merges=first_drop - 1)

    def _remember(self, word: str) -> tuple[list[str], int]:
        symbols = self._merge(word, None, forced_merges=None)
        merges = len(word) - len(symbols)  # each merge joins two symbols into one
        self._deterministic[word] = (symbols, merges)
        return symbols, merges

    def _merge(self, word: str, rng: random.Random | None, forced_merges: int | None) -> list[str]:
        """BPE over the characters of `word`. rng None: no dropout. Otherwise the first `forced_merges` merges are
        applied, the next candidate is dropped, and every later candidate is dropped with probability p."""
        symbols = list(word)
        nxt, prv = list(range(1, len(symbols) + 1)), list(range(-1, len(symbols) - 1))
        nxt[-1] = -1
        queue = [(rank, i) for i in range(len(symbols) - 1)
                 if (rank := self.ranks.get((symbols[i], symbols[i + 1]))) is not None]
        heapq.heapify(queue)
        skipped, applied = [], 0
        while queue:
            rank, i = heapq.heappop(queue)
            j = nxt[i] if symbols[i] else -1
            if j < 0 or self.ranks.get((symbols[i], symbols[j])) != rank:
                continue  # an entry made stale by an earlier merge
            if rng is not None and (applied == forced_merges or (applied > forced_merges and rng.random() < self.p)):
                skipped.append((rank, i))
                forced_merges = -1 if applied == forced_merges else forced_merges
                continue
            for entry in skipped:
                heapq.heappush(queue, entry)
            skipped.clear()
            symbols[i], symbols[j] = symbols[i] + symbols[j], ""
            nxt[i] = nxt[j]
            if nxt[i] >= 0:
                prv[nxt[i]] = i
            applied += 1
            for left, right in ((prv[i], i), (i, nxt[i])):
                if left >= 0 and right >= 0 and (r := self.ranks.get((symbols[left], symbols[right]))) is not None:
                    heapq.heappush(queue, (r, left))
        return [symbol for symbol in symbols if symbol]


class SourceNoise:
    """Training-time noise on the source text, so that the model does not rely on one way of writing it, in this
    order: a share of the sentences that have paraphrases in the corpus (another translation of the same verse)
    replaced by one of them; a share of the sentences with typographic quotes or apostrophes given plain ones, as
    keyboards type them; a share of sentences lower-cased (as Marian's case augmentation); and typos in a share of
    the words of four letters or more (one of: two inner letters swapped, an inner letter dropped, an inner letter
    doubled, as in Belinkov and Bisk, 2018). Used for training batches only, redrawn every epoch; rates 0 leave the
    text as it is and draw nothing. `paraphrases` maps a source sentence, as the collator decodes it, to its
    paraphrases."""

    def __init__(self, lowercase_rate: float = 0.0, typo_rate: float = 0.0, paraphrase_rate: float = 0.0,
                 paraphrases: dict[str, list[str]] | None = None, plain_quotes_rate: float = 0.0):
        for name, rate in (("lower-casing", lowercase_rate), ("typo", typo_rate), ("paraphrase", paraphrase_rate),
                           ("plain quotes", plain_quotes_rate)):
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"source {name} rate must be in [0, 1), got {rate}")
        self.lowercase_rate, self.typo_rate, self.plain_quotes_rate = lowercase_rate, typo_rate, plain_quotes_rate
        self.paraphrase_rate, self.paraphrases = (paraphrase_rate, paraphrases) if paraphrases else (0.0, {})

    def __bool__(self) -> bool:
        return any(rate > 0 for rate in (self.lowercase_rate, self.typo_rate, self.paraphrase_rate,
                                         self.plain_quotes_rate))

    def apply(self, text: str, rng: random.Random) -> str:
        """`text` with this noise drawn from `rng`."""
        if self.paraphrase_rate and text in self.paraphrases and rng.random() < self.paraphrase_rate:
            text = rng.choice(self.paraphrases[text])
        if self.plain_quotes_rate and _TYPOGRAPHIC_QUOTE.search(text) and rng.random() < self.plain_quotes_rate:
            text = text.translate(PLAIN_QUOTES)
        if self.lowercase_rate and rng.random() < self.lowercase_rate:
            text = text.lower()
        if not self.typo_rate:
            return text
        return _WORD.sub(lambda match: misspell(match.group(0), rng) if len(match.group(0)) >= 4
                         and rng.random() < self.typo_rate else match.group(0), text)


_WORD = re.compile(r"[^\W\d_]+")  # a run of letters, in any script
PLAIN_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})  # ‘ ’ “ ” -> ' "
_TYPOGRAPHIC_QUOTE = re.compile("[\u2018\u2019\u201c\u201d]")


def misspell(word: str, rng: random.Random) -> str:
    """`word` (four letters or more) with one typo among its inner letters: the first and last stay."""
    i = rng.randrange(1, len(word) - 2)
    kind = rng.randrange(3)
    if kind == 0:
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    if kind == 1:
        return word[:i] + word[i + 1:]
    return word[:i] + word[i] + word[i:]
