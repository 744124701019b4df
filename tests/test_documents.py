"""documents.py: texts cut into sentences and put back in their own white space, over-long sentences cut into
pieces that fit, files read as lines, paragraphs or one text."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
from helpers import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_scratch_transformer.protected_spans import SpanProtector
from hf_scratch_transformer.documents import (
    SegmenterMissing,
    split_document,
    split_input,
    split_long,
)


def rebuilt(layout) -> str:
    return layout.join([unit.text for unit in layout.units])


def test_sentences_and_paragraphs_with_their_white_space():
    text = "  Mr. Smith paid 3.5 dollars. He left...  Then he said “Hi.”\n\n \n Gen. 1 ends.\nA new line. "
    layout = split_document(text, "en")
    assert layout.leading == "  "
    assert [(unit.text, unit.separator) for unit in layout.units] == [
        ("Mr. Smith paid 3.5 dollars.", " "), ("He left...", "  "), ("Then he said “Hi.”", "\n\n \n "),
        ("Gen. 1 ends.", "\n"), ("A new line.", " ")]
    assert rebuilt(layout) == text
    assert layout.join(["A.", "B.", "C.", "D.", "E."]) == "  A. B.  C.\n\n \n D.\nE. "


def test_a_paragraph_never_shares_a_sentence_with_the_next_one():
    layout = split_document("no full stop here\n\nnor here", "en")
    assert [unit.text for unit in layout.units] == ["no full stop here", "nor here"]


def test_without_segmenting_a_text_is_one_unit_and_white_space_alone_none():
    layout = split_document("\tJesus wept. God is love.\n", "en", segment=False)
    assert (layout.leading, [(u.text, u.separator) for u in layout.units]) == ("\t", [("Jesus wept. God is love.",
                                                                                        "\n")])
    blank = split_document(" \n\t ", "en")
    assert blank.units == [] and blank.join([]) == " \n\t "
    with pytest.raises(ValueError, match="2 translations for 1 units"):
        layout.join(["a", "b"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["Jesus wept.", "Mr. Smith", "3.5", "...", "“Hi.”", " ", "  ", "\n", "\n\n", "\r\n",
                                 "\t", "word", "?", "¡Hola!", "EE. UU.", "\u2028", "\n \n"]), max_size=20).map("".join))
def test_every_character_of_a_text_is_in_a_unit_or_a_separator(text):
    layout = split_document(text, "es")
    assert rebuilt(layout) == text
    assert all(unit.text and unit.text == unit.text.strip() for unit in layout.units)
    assert all(not separator.strip() for separator in [layout.leading] + [u.separator for u in layout.units])


def test_no_sentence_ends_inside_a_protected_span():
    """The segmenter takes the "." of `%.*s` or of a tag's attribute for a full stop; the pieces of a cut inside
    a span given to keep whole are one unit again, with their white space."""
    text = "`%.*s' used for output. Next <a href=\"x. Y\">one</a>. Last %.2f."
    assert "`%." in [unit.text for unit in split_document(text, "en").units]  # what the segmenter alone does
    ranges = [(span.start, span.end) for span in SpanProtector().find(text)]
    layout = split_document(text, "en", keep_whole=ranges)
    assert [(unit.text, unit.separator) for unit in layout.units] == [
        ("`%.*s' used for output.", " "), ('Next <a href="x. Y">one</a>.', " "), ("Last %.2f.", "")]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["Jesus wept.", "%.*s", "%.2f", " ", "\n\n", "e.g.", "<b x=\"a. B\">", "</b>", ".",
                                 "See www.x.org.", "{0}", "Amen"]), max_size=16).map("".join))
def test_units_never_cut_a_span_and_join_back(text):
    ranges = [(span.start, span.end) for span in SpanProtector().find(text)]
    layout = split_document(text, "en", keep_whole=ranges)
    assert rebuilt(layout) == text
    position, cuts = len(layout.leading), []
    for unit in layout.units[:-1]:
        position += len(unit.text)
        cuts.append((position, position + len(unit.separator)))
        position += len(unit.separator)
    assert not [(cut, span) for cut in cuts for span in ranges if span[0] < cut[0] and span[1] > cut[1]]


def test_a_missing_segmenter_is_one_line_saying_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencex", None)  # as if not installed: import raises ImportError
    with pytest.raises(SegmenterMissing, match=r"needs the sentencex package.*pip install sentencex"):
        split_document("Jesus wept. God is love.", "en")


# ------------------------------------------------------------------------------------------------ over-long text
def token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_a_long_sentence_is_cut_at_clauses_first(tiny_tokenizer):
    clause = "and God saw the light, that it was good"
    text = ", ".join([clause] * 8) + "."
    pieces = split_long(text, tiny_tokenizer, 40)
    assert len(pieces) >= 2 and all(token_count(tiny_tokenizer, p.text) <= 40 for p in pieces)
    assert "".join(p.text + p.separator for p in pieces) == text
    assert all(p.text.endswith(",") for p in pieces[:-1])  # each piece ends a clause


def test_without_clauses_between_words_and_without_spaces_between_tokens(tiny_tokenizer):
    words = " ".join(["light"] * 60)
    pieces = split_long(words, tiny_tokenizer, 25)
    assert all(p.text.split(" ") == ["light"] * len(p.text.split(" ")) for p in pieces)  # no word cut
    assert "".join(p.text + p.separator for p in pieces) == words
    glued = "lightdarkness" * 30
    pieces = split_long(glued, tiny_tokenizer, 25)
    assert len(pieces) > 2 and all(token_count(tiny_tokenizer, p.text) <= 25 for p in pieces)
    assert "".join(p.text + p.separator for p in pieces) == glued


def test_a_cut_never_falls_inside_a_protected_range(tiny_tokenizer):
    text = " ".join(["word"] * 20) + ' <a href="x y z w v u t s">' + " ".join(["word"] * 20)
    start = text.index("<a")
    end = text.index(">") + 1
    shortest = token_count(tiny_tokenizer, text[start - 1 : end]) + 1  # the range fits in a piece
    for limit in range(shortest, shortest + 30, 3):
        pieces = split_long(text, tiny_tokenizer, limit, [(start, end)])
        assert any('<a href="x y z w v u t s">' in p.text for p in pieces), limit


def test_a_short_sentence_is_one_piece(tiny_tokenizer):
    assert [(p.text, p.separator) for p in split_long("Jesus wept.", tiny_tokenizer, 64)] == [("Jesus wept.", "")]


def test_a_five_megabyte_line_is_cut_in_seconds_not_hours(tmp_path):
    """A 5 MB document on one line, with sentences and with none, goes through segmentation and splitting in a
    fresh process (a hang would be a timeout) and every character comes back."""
    script = textwrap.dedent("""
        from helpers import build_tiny_tokenizer, PAIRS
        from hf_scratch_transformer.documents import split_document, split_long
        tokenizer = build_tiny_tokenizer([text for pair in PAIRS for text in pair])
        for text in (("In the beginning God created the heavens. " * 130000)[:5_000_000], "light " * 850_000):
            layout = split_document(text, "en")
            pieces = [piece for unit in layout.units if len(unit.text) > 200 for piece in split_long(unit.text,
                                                                                                     tokenizer, 60)]
            assert layout.leading + "".join(u.text + u.separator for u in layout.units) == text
            assert sum(len(p.text) for p in pieces) >= len(text.replace(" ", "")) or len(layout.units) > 1
            print(len(layout.units), len(pieces))
    """)
    tests_first = os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300,
                            env={**os.environ, "PYTHONPATH": tests_first})
    assert result.returncode == 0, result.stderr
    counts = [list(map(int, line.split())) for line in result.stdout.split("\n") if line]
    assert counts[0] == [119048, 0] and counts[1][0] == 1 and counts[1][1] > 10_000


# ------------------------------------------------------------------------------------------------ files as texts
@pytest.mark.parametrize("input_format, expected, rebuilt", [
    ("lines", ["Jesus wept.", "God is love.", "", "Amen.", "  "], "Jesus wept.\nGod is love.\n\nAmen.\n  \n"),
    ("paragraphs", ["Jesus wept.\r\nGod is love.", "Amen."], None),
    ("file", ["Jesus wept.\r\nGod is love.\n\nAmen.\n  \n"], None),
])
def test_a_file_is_read_as_lines_paragraphs_or_one_text(input_format, expected, rebuilt):
    """The texts of a file, and its frame: the translations written back with the file's own separators (lines:
    each followed by \\n, the CRLF and a missing last line break made \\n)."""
    content = "Jesus wept.\r\nGod is love.\n\nAmen.\n  \n"
    layout = split_input(content, input_format)
    assert [unit.text for unit in layout.units] == expected
    assert layout.join([unit.text for unit in layout.units]) == (rebuilt or content)
    assert split_input("a\nb", "lines").join(["x", "y"]) == "x\ny\n"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["Amen.", "a b", " ", "\t", "\n", "\r\n", "\n \n", "\u2028", "x\ry"]),
                max_size=20).map("".join))
def test_paragraphs_come_back_in_the_files_own_blank_lines(content):
    layout = split_input(content, "paragraphs")
    assert layout.join([unit.text for unit in layout.units]) == content
    assert all(unit.text.strip() and not re.search(r"\n[^\S\n]*\n", unit.text) for unit in layout.units)
    assert split_input(content, "file").join([content] if content else []) == content


def test_an_unknown_input_format_is_refused():
    with pytest.raises(ValueError, match="must be one of lines, paragraphs, file"):
        split_input("x", "chapters")


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.sampled_from("ab ,.;\u2014\n"), min_size=1, max_size=300))
def test_pieces_always_fit_and_join_back(tiny_tokenizer, text):
    pieces = split_long(text.strip() or "a", tiny_tokenizer, 10)
    assert "".join(p.text + p.separator for p in pieces) == (text.strip() or "a")
    assert all(token_count(tiny_tokenizer, p.text) <= 10 for p in pieces)


def test_a_long_run_of_white_space_is_split_in_linear_time():
    """A line of 300,000 spaces: the blank-line and clause patterns start a match only where a run of white space
    starts; tried at every position inside it (the old patterns), each attempt rescans the rest: hours. A child
    process with a time limit, so that a regression fails instead of hanging; the searches are timed in it, apart
    from the imports (which took over a minute on 2 cores with two training runs beside them)."""
    script = textwrap.dedent("""
        import time
        from hf_scratch_transformer.documents import _BLANK_LINES, _CLAUSE_END
        started = time.perf_counter()
        text = "Jesus wept." + " " * 300_000 + "x"
        assert _CLAUSE_END.search(text) is None and _BLANK_LINES.search(text) is None
        assert _CLAUSE_END.search("wept" + " " * 50_000 + "- and") and _BLANK_LINES.search("a" + " " * 50_000 + "\\n\\nb")
        assert time.perf_counter() - started < 20, time.perf_counter() - started
    """)
    subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True, timeout=600)
