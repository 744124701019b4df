"""A style-shifted copy of English source sentences: the same content, written the way other people write.

The shipped corpus's English is the World English Bible: modern American spelling, no contractions, "you".
Users' sentences differ. `style_shift` rewrites a sentence with deterministic, seeded perturbations, in this order:

1. British spelling: a fixed list of American -> British words (honor -> honour, center -> centre, -ize -> -ise...).
2. Archaic pronouns and verbs, as in older translations: you -> thee / ye, your -> thy / thine, yourself -> thyself,
   has -> hath, does -> doth, says -> saith.
3. Contractions: do not -> don't, it is -> it's, will not -> won't, ... (every listed pair).
4. Casing: one sentence in five (seeded) is lower-cased.
5. Punctuation spacing: one sentence in four (seeded) gets a space before , . ; : ! ?
6. Typos: each word of four letters or more gets, with probability 3 % (seeded), one of: two inner letters swapped,
   an inner letter dropped, an inner letter doubled.

`style_shifted(sources, seed)` applies it to a list, sentence i with `random.Random(f"{seed}:{i}")`: the same
input and seed give the same output on every machine. The references are unchanged: a model robust to how the source
is written loses little BLEU on the shifted sources. `kinds` applies only some of the perturbations (names in
PERTURBATIONS) with the same random draws, so that one perturbation alone lower-cases, spaces or misspells the same
sentences it does in the full shift (typos: the same draws, over words the skipped rewrites did not change).

    python benchmarks/style_shift.py --split test --show 5      # print a few pairs, and how many each kind changes
"""

import argparse
import random
import re

from hf_scratch_transformer.training.augmentation import misspell

BRITISH = {
    "honor": "honour", "honors": "honours", "honored": "honoured", "dishonor": "dishonour", "color": "colour",
    "colors": "colours", "neighbor": "neighbour", "neighbors": "neighbours", "favor": "favour", "favored": "favoured",
    "labor": "labour", "labored": "laboured", "savior": "saviour", "behavior": "behaviour", "splendor": "splendour",
    "odor": "odour", "vapor": "vapour", "valor": "valour", "armor": "armour", "center": "centre", "gray": "grey",
    "judgment": "judgement", "judgments": "judgements", "traveled": "travelled", "traveler": "traveller",
    "counselor": "counsellor", "offense": "offence", "defense": "defence", "jewelry": "jewellery",
    "realize": "realise", "recognize": "recognise", "apologize": "apologise", "baptize": "baptise",
    "baptized": "baptised", "worshiped": "worshipped", "marveled": "marvelled", "plow": "plough",
}
ARCHAIC = [  # (pattern, replacement), applied in order; word boundaries, case kept for the first letter
    (r"\byou are\b", "ye are"), (r"\byourself\b", "thyself"),
    (r"\byours\b", "thine"), (r"\byour (?=[aeiouAEIOU])", "thine "), (r"\byour\b", "thy"), (r"\byou\b", "thee"),
    (r"\bhas\b", "hath"), (r"\bdoes\b", "doth"), (r"\bsays\b", "saith"),
]
CONTRACTIONS = [
    ("do not", "don't"), ("does not", "doesn't"), ("did not", "didn't"), ("is not", "isn't"), ("are not", "aren't"),
    ("was not", "wasn't"), ("were not", "weren't"), ("will not", "won't"), ("would not", "wouldn't"),
    ("cannot", "can't"), ("could not", "couldn't"), ("should not", "shouldn't"), ("have not", "haven't"),
    ("has not", "hasn't"), ("it is", "it's"), ("that is", "that's"), ("there is", "there's"), ("I am", "I'm"),
    ("I will", "I'll"), ("I have", "I've"), ("we are", "we're"), ("they are", "they're"), ("he is", "he's"),
    ("she is", "she's"), ("let us", "let's"), ("who is", "who's"), ("what is", "what's"),
]
TYPO_RATE, LOWER_CASE_SHARE, SPACED_PUNCTUATION_SHARE = 0.03, 0.2, 0.25
PERTURBATIONS = ("british", "archaic", "contractions", "casing", "punctuation", "typos")  # in the order applied


def _keep_case(replacement: str, original: str) -> str:
    return replacement[0].upper() + replacement[1:] if original[:1].isupper() else replacement


def _replace_words(text: str, pattern: str, replacement: str) -> str:
    return re.sub(pattern, lambda match: _keep_case(replacement, match.group(0)), text, flags=re.IGNORECASE)


def _typo(word: str, rng: random.Random) -> str:
    if len(word) < 4 or not word.isalpha() or rng.random() >= TYPO_RATE:
        return word
    return misspell(word, rng)  # the typos of training's --source_typo_rate: inner letters only


def style_shift(text: str, rng: random.Random, kinds: tuple[str, ...] = PERTURBATIONS) -> str:
    """`text` rewritten by the perturbations of the module docstring named in `kinds`, drawing from `rng`."""
    unknown = set(kinds) - set(PERTURBATIONS)
    if unknown:
        raise ValueError(f"unknown perturbations {sorted(unknown)}; choose from {', '.join(PERTURBATIONS)}")
    if "british" in kinds:
        for american, british in BRITISH.items():
            text = _replace_words(text, rf"\b{american}\b", british)
    if "archaic" in kinds:
        for pattern, replacement in ARCHAIC:
            text = _replace_words(text, pattern, replacement)
    if "contractions" in kinds:
        for long, short in CONTRACTIONS:
            text = _replace_words(text, rf"\b{long}\b", short)
    if rng.random() < LOWER_CASE_SHARE and "casing" in kinds:
        text = text.lower()
    if rng.random() < SPACED_PUNCTUATION_SHARE and "punctuation" in kinds:
        text = re.sub(r"(?<=\w)([,.;:!?])", r" \1", text)
    if "typos" not in kinds:
        return text
    return re.sub(r"[A-Za-z]+", lambda match: _typo(match.group(0), rng), text)


def style_shifted(sources: list[str], seed: int = 0, kinds: tuple[str, ...] = PERTURBATIONS) -> list[str]:
    """Every source style-shifted, sentence i with its own seeded generator."""
    return [style_shift(text, random.Random(f"{seed}:{index}"), kinds) for index, text in enumerate(sources)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", default="test", choices=("validation", "test"))
    parser.add_argument("--show", type=int, default=5)
    args = parser.parse_args()
    from hf_scratch_transformer.data.loading import DataArguments, load_parallel_corpus
    from hf_scratch_transformer.data.preprocessing import evaluation_pairs

    data_args = DataArguments()
    sources, _ = evaluation_pairs(load_parallel_corpus(data_args)[args.split], data_args)
    shifted = style_shifted(sources)
    changed = sum(a != b for a, b in zip(sources, shifted))
    print(f"{changed} of {len(sources)} {args.split} sources changed")
    for kind in PERTURBATIONS:
        alone = style_shifted(sources, kinds=(kind,))
        print(f"  {kind}: {sum(a != b for a, b in zip(sources, alone))} alone")
    for original, new in list(zip(sources, shifted))[: args.show]:
        print(f"- {original}\n+ {new}")


if __name__ == "__main__":
    main()
