"""Training-time augmentation: every change made to the training pairs while training, behind one dataclass.

`Augmentation` holds the rates (the flags of the same names, in their order; 0 turns one off). From it read the
training batches' collator (`NoiseCollator`), the resume checks (`Augmentation.settings`, part of
checkpointing.RESUME_SETTINGS) and the model card (`Augmentation.describe`). The changes:

- source changes (`SOURCE_CHANGES`, drawn in this order on each training source sentence): a paraphrase from the
  corpus in place of the sentence (another translation of the same verse, `source_paraphrases`), plain quotes for
  typographic ones as keyboards type them, lower-casing (as Marian's case augmentation), typos in words of four
  letters or more (Belinkov and Bisk, 2018), contractions as people write them (English sources: "do not" ->
  "don't"), a space before punctuation marks as some typists leave one;
- BPE-dropout (Provilkov et al., 2020) on both sides: `BPEDropout`.

Every draw is seeded by the run's seed, the epoch and the text, so every epoch sees new noise and a rerun or a resumed
run sees the same. Validation, test, translation and the saved tokenizer never see any of it. A new kind of source
noise is one field of `Augmentation` (and its flag in arguments.RunArguments), one entry of `SOURCE_CHANGES` and its
test.
"""

import heapq
import json
import logging
import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import numpy as np
from datasets import IterableDataset
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger("hf_scratch_transformer")


@dataclass(frozen=True)
class Augmentation:
    """The rates of the training-time changes (train.py's flags of the same names); the default is none at all (the
    default recipe's are recipe.DEFAULT_AUGMENTATION)."""

    bpe_dropout: float = 0.0  # merge-drop probability of BPE-dropout, both sides
    source_lowercase_rate: float = 0.0  # share of source sentences lower-cased
    source_paraphrase_rate: float = 0.0  # share of source sentences with paraphrases replaced by one
    source_plain_quotes_rate: float = 0.0  # share of source sentences with typographic quotes given plain ones
    source_typo_rate: float = 0.0  # share of source words (four letters or more) given one typo
    source_contraction_rate: float = 0.0  # share of English source sentences with pairs to contract, contracted
    source_spaced_punctuation_rate: float = 0.0  # share of source sentences with a space before , . ; : ! ?

    def __post_init__(self):
        for name, rate in asdict(self).items():
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate < 1.0:
                raise ValueError(f"--{name} must be in [0, 1), got {rate!r}")

    @classmethod
    def from_flags(cls, args) -> "Augmentation":
        """The rates of train.py's flags (a RunArguments)."""
        return cls(**{name: getattr(args, name) for name in AUGMENTATION_FLAGS})

    def settings(self) -> dict:
        """{flag: rate}: what a resumed run must keep (the draws and the batches depend on them)."""
        return asdict(self)

    def changes_sources(self, paraphrases: dict[str, list[str]]) -> bool:
        """Whether any source change can apply (paraphrases only where the corpus gives some)."""
        return any(getattr(self, change.rate) > 0 for change in SOURCE_CHANGES
                   if change.rate != "source_paraphrase_rate" or paraphrases)

    def describe(self) -> str:
        """The model card's words: "50% of the source sentences ..., BPE-dropout 0.1 (redrawn every epoch)" or
        "none"."""
        said = [change.says(getattr(self, change.rate)) for change in SOURCE_CHANGES if getattr(self, change.rate)]
        said += [f"BPE-dropout {self.bpe_dropout}"] if self.bpe_dropout else []
        return ", ".join(said) + " (redrawn every epoch)" if said else "none"


AUGMENTATION_FLAGS = tuple(field.name for field in fields(Augmentation))


# ------------------------------------------------------------------------------------------------ source changes

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


def _paraphrase(text: str, rate: float, rng: random.Random, paraphrases: dict[str, list[str]]) -> str:
    if text in paraphrases and rng.random() < rate:
        return rng.choice(paraphrases[text])
    return text


def _plain_quotes(text: str, rate: float, rng: random.Random, paraphrases) -> str:
    return text.translate(PLAIN_QUOTES) if _TYPOGRAPHIC_QUOTE.search(text) and rng.random() < rate else text


def _lowercase(text: str, rate: float, rng: random.Random, paraphrases) -> str:
    return text.lower() if rng.random() < rate else text


def _typos(text: str, rate: float, rng: random.Random, paraphrases) -> str:
    return _WORD.sub(lambda match: misspell(match.group(0), rng) if len(match.group(0)) >= 4
                     and rng.random() < rate else match.group(0), text)


# English auxiliaries and pronouns as people contract them; the first letter keeps its case. A sentence drawn
# contracts every pair it holds, as one writer would.
_NOT_CONTRACTIONS = {"do": "don't", "does": "doesn't", "did": "didn't", "is": "isn't", "are": "aren't",
                     "was": "wasn't", "were": "weren't", "have": "haven't", "has": "hasn't", "had": "hadn't",
                     "will": "won't", "would": "wouldn't", "could": "couldn't", "should": "shouldn't",
                     "must": "mustn't", "need": "needn't", "shall": "shan't", "can": "can't"}
_VERB_CONTRACTIONS = {"am": "'m", "are": "'re", "is": "'s", "will": "'ll", "have": "'ve", "would": "'d"}
_SUBJECTS = {"am": ("I",), "are": ("you", "we", "they"), "have": ("I", "you", "we", "they"),
             "is": ("he", "she", "it", "that", "there", "here", "what", "who", "where"),
             "will": ("I", "you", "we", "they", "he", "she", "it", "that", "there"),
             "would": ("I", "you", "we", "they", "he", "she")}
CONTRACTIONS = ([(rf"\b({verb}) not\b", short) for verb, short in _NOT_CONTRACTIONS.items()]
                + [(r"\b(can)not\b", "can't"), (r"\b(let) us\b", "let's")]
                + [(rf"\b({subject}) {verb}\b(?=\s+\w)", subject + suffix)  # before a word: "it is." stays
                   for verb, suffix in _VERB_CONTRACTIONS.items()
                   for subject in _SUBJECTS[verb]])
_CONTRACTION_PATTERNS = [(re.compile(pattern, re.IGNORECASE), short) for pattern, short in CONTRACTIONS]
_SPACEABLE_PUNCTUATION = re.compile(r"(?<=[^\s\d])([,.;:!?])(?=\s|$)")


def contract(text: str) -> str:
    """`text` with every listed English pair contracted ("do not" -> "don't", "It is" -> "It's")."""
    for pattern, short in _CONTRACTION_PATTERNS:
        text = pattern.sub(lambda match: short[0].upper() + short[1:] if match.group(1)[0].isupper() else short, text)
    return text


def _contractions(text: str, rate: float, rng: random.Random, paraphrases) -> str:
    contracted = contract(text)
    return contracted if contracted != text and rng.random() < rate else text


def _spaced_punctuation(text: str, rate: float, rng: random.Random, paraphrases) -> str:
    return _SPACEABLE_PUNCTUATION.sub(r" \1", text) if _SPACEABLE_PUNCTUATION.search(text) and rng.random() < rate \
        else text


@dataclass(frozen=True)
class SourceChange:
    """One kind of source noise: its rate (an Augmentation field), the change (text, rate, rng, paraphrases) ->
    text, drawing from rng only where it can apply, and the model card's words for a rate."""

    rate: str
    apply: Callable[[str, float, random.Random, dict], str]
    says: Callable[[float], str]


# In the order they are drawn on a sentence: a change appended at the end leaves the draws of the others as they are.
SOURCE_CHANGES = (
    SourceChange("source_paraphrase_rate", _paraphrase,
                 lambda rate: f"{rate:.0%} of the source sentences with a paraphrase in the corpus replaced by it"),
    SourceChange("source_plain_quotes_rate", _plain_quotes,
                 lambda rate: f"plain quotes in {rate:.0%} of the source sentences with typographic ones"),
    SourceChange("source_lowercase_rate", _lowercase, lambda rate: f"{rate:.0%} of the source sentences lower-cased"),
    SourceChange("source_typo_rate", _typos, lambda rate: f"typos in {rate:.0%} of the source words"),
    SourceChange("source_contraction_rate", _contractions,
                 lambda rate: f"contractions in {rate:.0%} of the source sentences that can have them"),
    SourceChange("source_spaced_punctuation_rate", _spaced_punctuation,
                 lambda rate: f"a space before punctuation in {rate:.0%} of the source sentences"),
)


class SourceNoise:
    """The source changes of `augmentation` on one sentence; `paraphrases` maps a source sentence, as the collator
    decodes it, to its paraphrases. Rates 0 leave the text as it is and draw nothing. False when nothing can
    change."""

    def __init__(self, augmentation: Augmentation, paraphrases: dict[str, list[str]] | None = None):
        self.paraphrases = paraphrases or {}
        self.changes = [(change, getattr(augmentation, change.rate)) for change in SOURCE_CHANGES
                        if getattr(augmentation, change.rate) > 0
                        and (change.rate != "source_paraphrase_rate" or self.paraphrases)]

    def __bool__(self) -> bool:
        return bool(self.changes)

    def apply(self, text: str, rng: random.Random) -> str:
        """`text` with this noise drawn from `rng`."""
        for change, rate in self.changes:
            text = change.apply(text, rate, rng, self.paraphrases)
        return text


def source_paraphrases(raw_train, tokenizer, source_lang: str) -> dict[str, list[str]]:
    """{source sentence: its paraphrases} from the training split's optional ``paraphrases`` field (a dict
    language -> list of other wordings of that side, as in the shipped corpus). The keys are the sentences as the
    training collator decodes them from their token ids, so that it finds them. Empty for a streamed split or a
    corpus without the field."""
    if isinstance(raw_train, IterableDataset) or "paraphrases" not in (raw_train.column_names or []):
        return {}
    sources, alternatives = [], []
    for example in raw_train.select_columns(["translation", "paraphrases"]):
        found = [text for text in (example["paraphrases"] or {}).get(source_lang) or [] if text and text.strip()]
        source = (example["translation"] or {}).get(source_lang)
        if found and isinstance(source, str) and source.strip():
            sources.append(source)
            alternatives.append(found)
    # verbose=False: no "Token indices sequence length is longer than ..." warning; these ids are only decoded
    decoded = (tokenizer.batch_decode(tokenizer(sources, verbose=False)["input_ids"], skip_special_tokens=True)
               if sources else [])
    paraphrases: dict[str, list[str]] = {}
    for key, found in zip(decoded, alternatives):
        paraphrases.setdefault(key, []).extend(text for text in found if text not in paraphrases.get(key, []))
    return paraphrases


def read_paraphrases(raw_train, tokenizer, data_args, augmentation: Augmentation,
                     log: bool = True) -> dict[str, list[str]]:
    """The run's paraphrase table (empty when --source_paraphrase_rate is 0), with one log line saying what it
    holds."""
    if not augmentation.source_paraphrase_rate:
        return {}
    table = source_paraphrases(raw_train, tokenizer, data_args.source_lang)
    if log:
        logger.info("source paraphrases: %s", "not read from a streamed corpus" if data_args.streaming else (
            f"{len(table)} training sources have some; {augmentation.source_paraphrase_rate:.0%} of them are "
            f"replaced by one each epoch" if table else
            f"none in the corpus (a `paraphrases` field with {data_args.source_lang!r} in it)"))
    return table


# ------------------------------------------------------------------------------------------------ BPE-dropout


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
        # plain added tokens (the sentinels ｟0｠...) are whole tokens wherever they stand, as the tokenizer has them
        special = set(tokenizer.all_special_tokens)
        self.added = {token: index for token, index in tokenizer.get_added_vocab().items() if token not in special}
        alternatives = "|".join(re.escape(token) for token in sorted(self.added, key=len, reverse=True))
        self._added_pattern = re.compile(f"({alternatives})") if self.added else None
        self._deterministic: dict[str, tuple[list[str], int]] = {}  # word -> (its BPE pieces, merges applied)

    def encode(self, text: str, rng: random.Random) -> list[int]:
        """Token ids of `text` with `</s>` appended, as `tokenizer(text)["input_ids"]` but with dropout."""
        normalized = self.backend.normalizer.normalize_str(text)
        pieces = self._added_pattern.split(normalized) if self._added_pattern else [normalized]
        ids = []
        for position, piece in enumerate(pieces):  # odd positions: the added tokens the text held
            if position % 2:
                ids.append(self.added[piece])
                continue
            words = [word for word, _ in self.backend.pre_tokenizer.pre_tokenize_str(piece)] if piece else []
            ids += [self.vocab[token] for word in words for token in self.segment(word, rng)]
        return ids + [self.eos_id]

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
        return self.merge(word, rng, forced_merges=first_drop - 1)

    def _remember(self, word: str) -> tuple[list[str], int]:
        symbols = self.merge(word, None, forced_merges=None)
        merges = len(word) - len(symbols)  # each merge joins two symbols into one
        self._deterministic[word] = (symbols, merges)
        return symbols, merges

    def merge(self, word: str, rng: random.Random | None, forced_merges: int | None) -> list[str]:
        """BPE over the characters of `word`. rng None: no dropout. Otherwise the first `forced_merges` merges are
        applied, the next candidate is dropped, and every later candidate is dropped with probability p
        (`forced_merges=-1`: every candidate, the first included, is dropped with probability p: the algorithm
        without `segment`'s shortcut)."""
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


# ------------------------------------------------------------------------------------------------ the collator


class NoiseCollator:
    """Collates training pairs with the run's augmentation: each side is decoded back to its text, the source is
    given `SourceNoise`, and the texts are encoded again with BPE-dropout when its rate is above 0; without it, only
    the sources the noise changed are encoded again (the others keep their ids). Every draw is seeded by `seed`, the
    epoch (`set_epoch`) and the text. Sequences stay within `max_lengths` ({"input_ids": ..., "labels": ...},
    `</s>` kept). `lengths` draws an epoch's noise ahead, so that its batches are packed by the lengths they will
    hold (data.batching.TrainingBatches). Build it with `noise_collator`, which leaves a run without augmentation
    the plain collator."""

    def __init__(self, collator, tokenizer, augmentation: Augmentation, *, seed: int, max_lengths: dict[str, int],
                 paraphrases: dict[str, list[str]] | None = None):
        self.collator, self.tokenizer, self.seed, self.max_lengths = collator, tokenizer, seed, max_lengths
        self.dropout = BPEDropout(tokenizer, augmentation.bpe_dropout) if augmentation.bpe_dropout > 0 else None
        self.source_noise = SourceNoise(augmentation, paraphrases)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self, features: list[dict]) -> dict:
        encoded = [{} for _ in features]
        for key in self.max_lengths:
            for example, ids in zip(encoded, self.side(features, key, self.epoch)):
                example[key] = ids
        for example in encoded:
            example["attention_mask"] = [1] * len(example["input_ids"])
        return self.collator(encoded)

    def lengths(self, dataset, epoch: int, chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
        """(source lengths, target lengths) of every pair of `dataset` (its `input_ids` and `labels`) as epoch
        `epoch`'s batches will hold them, after their noise: what that epoch's batches are packed by."""
        lengths = []
        for key in self.max_lengths:
            column = dataset[key]
            lengths.append(np.fromiter((len(ids) for start in range(0, len(column), chunk)
                                        for ids in self.side([{key: ids} for ids in column[start:start + chunk]],
                                                             key, epoch)), dtype=np.int32, count=len(column)))
        return lengths[0], lengths[1]

    def side(self, features: list[dict], key: str, epoch: int) -> list[list[int]]:
        """The ids of one side ("input_ids" or "labels") of every pair under epoch `epoch`'s noise, cut to that
        side's maximum length (`</s>` kept)."""
        max_length = self.max_lengths[key]
        return [ids if len(ids) <= max_length else ids[: max_length - 1] + ids[-1:]
                for ids in self._noised(features, key, epoch)]

    def _noised(self, features: list[dict], key: str, epoch: int) -> list[list[int]]:
        noised = key == "input_ids" and bool(self.source_noise)
        all_ids = [feature[key] for feature in features]
        if self.dropout is None and not noised:  # nothing to redraw on this side: keep its ids
            return all_ids
        texts = self.tokenizer.batch_decode(all_ids, skip_special_tokens=True)
        plain = texts
        if noised:
            texts = [self.source_noise.apply(text, random.Random(f"{self.seed}:{epoch}:noise:{text}"))
                     for text in plain]
        if self.dropout is not None:
            return [self.dropout.encode(text, random.Random(f"{self.seed}:{epoch}:{key}:{text}"))
                    for text in texts]
        changed = [i for i, (text, before) in enumerate(zip(texts, plain)) if text != before]
        if changed:  # only the sentences the noise changed need encoding again
            for i, ids in zip(changed, self.tokenizer([texts[i] for i in changed], verbose=False)["input_ids"]):
                all_ids[i] = ids
        return all_ids


def noise_collator(collator, tokenizer, augmentation: Augmentation, *, seed: int, max_source_length: int,
                   max_target_length: int, paraphrases: dict[str, list[str]] | None = None):
    """The training batches' collator: a `NoiseCollator` over `collator` when the augmentation changes anything,
    else `collator` itself."""
    if augmentation.bpe_dropout == 0 and not augmentation.changes_sources(paraphrases or {}):
        return collator
    return NoiseCollator(collator, tokenizer, augmentation, seed=seed, paraphrases=paraphrases,
                         max_lengths={"input_ids": max_source_length, "labels": max_target_length})
