"""Joint byte-level BPE tokenizer for source and target, saved as a ``PreTrainedTokenizerFast``.

NFC normalisation plus a byte-level pre-tokenizer and decoder make ``decode(encode(x)) == NFC(x)`` for every string,
so ``<unk>`` is never produced. Special tokens ``<pad>``, ``<s>``, ``</s>``, ``<unk>`` get ids 0, 1, 2, 3 (the model
config's defaults: pad=0, bos=decoder_start=1, eos=2); a post-processor appends ``</s>`` to every sequence.
Special tokens written literally in the input text (``"<s>"``) are encoded as plain text (``split_special_tokens``),
so such strings round-trip too.
"""

import random
from collections.abc import Iterable, Iterator

from datasets import DatasetDict, IterableDatasetDict
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]


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
    sentences (skipped later by the preprocessing) are left out."""
    for example in dataset:
        pair = example.get("translation") or {}
        for lang in (source_lang, target_lang):
            if isinstance(pair.get(lang), str):
                yield pair[lang]


def train_tokenizer_on_corpus(
    dataset,
    source_lang: str,
    target_lang: str,
    vocab_size: int = 8000,
    max_sentences: int | None = None,
    seed: int = 0,
    model_max_length: int = 512,
) -> PreTrainedTokenizerFast:
    """Train the joint tokenizer on both languages of ``dataset`` (the train split, a Dataset or IterableDataset)."""
    if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        raise TypeError("Pass the train split (a Dataset or IterableDataset), not a DatasetDict.")
    return train_bpe_tokenizer(
        _both_sides(dataset, source_lang, target_lang),
        vocab_size=vocab_size,
        max_sentences=max_sentences,
        seed=seed,
        model_max_length=model_max_length,
    )
