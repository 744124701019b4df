"""The style-shifted source behind README's robustness figure (`benchmarks/style_shift.py`): deterministic, each
perturbation does what its docstring says, and one perturbation alone changes what it changes in the full shift."""

import random

import pytest
from style_shift import PERTURBATIONS, style_shift, style_shifted  # benchmarks/ is on pytest's pythonpath

SOURCES = [
    "You will not find your neighbor's color in the center; it is his honor.",
    "Jesus wept.",
    "He says that you are the light of the world, and your Father does not forget you.",
    "I am the way: I will not leave you, and I have called you by name.",
] * 25


def test_the_same_sources_and_seed_give_the_same_shift_and_another_seed_another():
    assert style_shifted(SOURCES) == style_shifted(list(SOURCES))
    assert style_shifted(SOURCES, seed=1) != style_shifted(SOURCES)


def test_the_word_rewrites_apply_to_every_sentence():
    shifted = style_shift(SOURCES[0], random.Random(0), kinds=("british", "archaic", "contractions"))
    assert shifted == "Thee won't find thy neighbour's colour in the centre; it's his honour."
    third = style_shift(SOURCES[2], random.Random(0), kinds=("archaic",))
    assert third == "He saith that ye are the light of the world, and thy Father doth not forget thee."


def test_casing_punctuation_and_typos_touch_a_seeded_share_of_sentences():
    def changed(kind: str) -> float:
        return sum(a != b for a, b in zip(SOURCES, style_shifted(SOURCES, kinds=(kind,)))) / len(SOURCES)

    assert 0.08 < changed("casing") < 0.35  # one in five
    assert 0.12 < changed("punctuation") < 0.40  # one in four
    assert 0.05 < changed("typos") < 0.8  # 3 % of the words of four letters or more
    lowered = [b for a, b in zip(SOURCES, style_shifted(SOURCES, kinds=("casing",))) if a != b]
    assert all(text == text.lower() for text in lowered)


def test_one_perturbation_alone_lower_cases_the_sentences_the_full_shift_lower_cases():
    full = style_shifted(SOURCES)
    alone = style_shifted(SOURCES, kinds=("casing",))
    lowered_alone = {i for i, (a, b) in enumerate(zip(SOURCES, alone)) if a != b}
    lowered_in_full = {i for i, text in enumerate(full) if text == text.lower()}
    assert lowered_alone and lowered_alone == lowered_in_full


def test_no_perturbation_leaves_the_sources_as_they_are_and_an_unknown_one_is_refused():
    assert style_shifted(SOURCES, kinds=()) == SOURCES
    assert set(PERTURBATIONS) == {"british", "archaic", "contractions", "casing", "punctuation", "typos"}
    with pytest.raises(ValueError, match="unknown perturbations"):
        style_shifted(SOURCES, kinds=("leet",))
