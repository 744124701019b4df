"""Joint byte-level BPE tokenizer for source and target, saved as a ``PreTrainedTokenizerFast``.

NFC normalisation plus a byte-level pre-tokenizer and decoder make ``decode(encode(x)) == NFC(x)`` for every string,
so ``<unk>`` is never produced. Special tokens ``<pad>``, ``<s>``, ``</s>``, ``<unk>`` get ids 0, 1, 2, 3 (the model
config's defaults: pad=0, bos=decoder_start=1, eos=2); a post-processor appends ``</s>`` to every sequence.
Special tokens written literally in the input text (``"<s>"``) are encoded as plain text (``split_special_tokens``),
so such strings round-trip too. The language pair a tokenizer was trained for is saved with it (``source_lang`` /
``target_lang`` in tokenizer_config.json, as Marian's tokenizer does): :func:`language_pair` reads it back.

With ``sentinels=True`` (train.py's default, ``--mask_protected_spans``) the tokenizer also gets the 32 sentinel
tokens ``｟0｠`` ... ``｟31｠`` of protected_spans.py as plain added tokens, after the BPE vocabulary: each is one token
wherever it stands, and decoding keeps it (a special token would be dropped by ``skip_special_tokens=True``). Training
masks the spans both sides of a pair share with them (preprocessing.mask_shared_spans), and translation protects
spans by default for such a tokenizer (protected_spans.tokenizer_has_sentinels).
"""

import random
import re
from collections.abc import Iterable, Iterator

from datasets import Dataset, DatasetDict, IterableDatasetDict
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from ..protected_spans import sentinel_tokens

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
    sentinels: bool = False,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (at most ``max_sentences`` of them, sampled with ``seed``);
    with ``sentinels``, the sentinel tokens are added after its ``vocab_size`` tokens."""
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
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        split_special_tokens=True,
    )
    if sentinels:
        fast.add_tokens(sentinel_tokens())  # plain, not special: decode(skip_special_tokens=True) keeps them
    return fast


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
    sentinels: bool = False,
) -> PreTrainedTokenizerFast:
    """Train the joint tokenizer on both languages of ``dataset`` (the train split, a Dataset or IterableDataset),
    at most ``max_sentences`` sentences of it; the language pair is recorded with it; ``sentinels`` adds the
    sentinel tokens."""
    if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        raise TypeError("Pass the train split (a Dataset or IterableDataset), not a DatasetDict.")
    tokenizer = train_bpe_tokenizer(
        _both_sides(_sampled_pairs(dataset, max_sentences, seed), source_lang, target_lang),
        vocab_size=vocab_size,
        max_sentences=max_sentences,
        seed=seed,
        model_max_length=model_max_length,
        sentinels=sentinels,
    )
    return set_language_pair(tokenizer, source_lang, target_lang)
