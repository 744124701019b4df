"""Documents: a text of any length cut into the sentences a model translates, and the translations put back with
the text's own white space.

    >>> layout = split_document("  Jesus wept. God is love.\\n\\nAmen. ", "en")
    >>> layout.leading, [(u.text, u.separator) for u in layout.units]
    ('  ', [('Jesus wept.', ' '), ('God is love.', '\\n\\n'), ('Amen.', ' ')])
    >>> layout.join(["Jesús lloró.", "Dios es amor.", "Amén."])
    '  Jesús lloró. Dios es amor.\\n\\nAmén. '

Paragraphs are separated by blank lines (a line of white space only) and never share a sentence; inside a
paragraph the sentences are found by sentencex (Wikimedia's segmenter, ~300 languages; benchmarks/
sentence_segmenters.py compares it with pysbd, sentence-splitter, syntok and nupunkt). A single line break inside
a paragraph is white space: hard-wrapped prose stays one sentence where the segmenter says so.

A sentence longer than the model's limit is cut further (`split_long`): at a clause boundary (after , ; : or a
dash) in the second half of the longest piece that fits, else between words, else between tokens (a text with no
spaces); the cuts never fall inside a protected span. Every character of the input belongs to exactly one unit or
separator, so nothing is dropped.

This file imports only the standard library (and sentencex, inside `sentences`): it is copied into saved model
directories beside translation_core.py.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

from .errors import UsageError

SEGMENTER_PACKAGE = "sentencex"
INPUT_FORMATS = ("lines", "paragraphs", "file")  # how a file is cut into texts: see `split_input`
DEFAULT_LANGUAGE = "en"  # the segmenter's rules when neither the caller nor the tokenizer names the language
# Two or more line breaks, blanks between; and where a clause may end. A match of white space starts only where a run
# of it starts (the look-behind): tried at every position inside a run, each attempt would scan the rest of the run,
# and a long run (a line of 5 MB of spaces) would take hours.
_BLANK_LINES = re.compile(r"(?<![^\S\n])[^\S\n]*\n(?:[^\S\n]*\n)+[^\S\n]*")
_CLAUSE_END = re.compile(r"[,;:\u2013\u2014)\]»”\"]\s+|(?<!\s)\s+[\u2013\u2014-]\s+")
_SPACE = re.compile(r"\s+")


class SegmenterMissing(UsageError, ImportError):
    """sentencex is not installed: the message says how to install it."""


@dataclass
class Unit:
    """One piece of a text that the model translates alone, and the white space that follows it in the text."""

    text: str
    separator: str = ""


@dataclass
class Layout:
    """A text cut into units: `leading` white space, then each unit followed by its separator (the last one's is
    the text's trailing white space). `leading + "".join(u.text + u.separator for u in units)` is the text."""

    leading: str
    units: list[Unit] = field(default_factory=list)

    def join(self, translations: list[str]) -> str:
        """The translations of the units in the text's frame: its leading white space and separators."""
        if len(translations) != len(self.units):
            raise ValueError(f"{len(translations)} translations for {len(self.units)} units")
        return self.leading + "".join(text + unit.separator for text, unit in zip(translations, self.units))


def source_language(tokenizer) -> str | None:
    """The source language the tokenizer was trained for (train.py saves `source_lang` with it), or None."""
    saved = getattr(tokenizer, "init_kwargs", None) or {}
    return getattr(tokenizer, "source_lang", None) or saved.get("source_lang") or None


def sentences(text: str, language: str | None) -> list[str]:
    """`text` (one paragraph) cut into sentences by sentencex, each with its trailing white space, so that they
    join back into `text`."""
    try:
        import sentencex
    except ImportError:
        raise SegmenterMissing(f"splitting texts into sentences needs the {SEGMENTER_PACKAGE} package, which cannot "
                               f"be imported: pip install {SEGMENTER_PACKAGE} (or translate without segmenting, "
                               f"segment=False)") from None
    found = list(sentencex.segment(language or DEFAULT_LANGUAGE, text))
    if "".join(found) != text:  # never seen; a changed library must not lose text silently
        return [text]
    return found


def split_document(text: str, language: str | None, segment: bool = True,
                   keep_whole: list[tuple[int, int]] = ()) -> Layout:
    """`text` as leading white space and units: its sentences (paragraphs split at blank lines first), or, without
    `segment`, the whole text stripped as one unit. Two sentences cut inside a `keep_whole` character range of
    `text` (a protected span: the segmenter may take the "." of `%.*s` for a full stop) are one unit."""
    stripped = text.lstrip()
    layout = Layout(text[: len(text) - len(stripped)])
    if not stripped:
        layout.leading = text
        return layout
    if not segment:
        body = stripped.rstrip()
        layout.units.append(Unit(body, stripped[len(body):]))
        return layout
    for paragraph, blank in _paragraphs(stripped):
        for sentence in sentences(paragraph, language) if paragraph.strip() else []:
            _append(layout, sentence)
        _append(layout, blank)
    if keep_whole:
        _rejoin(layout, keep_whole)
    return layout


def _rejoin(layout: Layout, keep_whole: list[tuple[int, int]]) -> None:
    """Join each unit with the next where a range (sorted, not overlapping) starts in it and ends after the white
    space between them: the cut fell inside the range."""
    ranges = sorted(keep_whole)
    starts = [start for start, _ in ranges]
    joined, position, continues = [], len(layout.leading), False
    for unit in layout.units:
        if continues:
            previous = joined[-1]
            previous.text += previous.separator + unit.text
            previous.separator = unit.separator
        else:
            joined.append(unit)
        text_end = position + len(unit.text)
        position = text_end + len(unit.separator)
        last = bisect.bisect_left(starts, text_end) - 1  # the last range starting before the cut
        continues = last >= 0 and ranges[last][1] > position
    layout.units = joined


def _paragraphs(text: str):
    """(paragraph, the blank lines after it) pairs that join back into `text`; the last blank is ""."""
    position = 0
    for blank in _BLANK_LINES.finditer(text):
        yield text[position : blank.start()], blank.group(0)
        position = blank.end()
    yield text[position:], ""


def _append(layout: Layout, piece: str) -> None:
    """Add `piece` (a sentence with its white space, or white space alone) to the layout."""
    body = piece.strip()
    if not body:
        if layout.units:
            layout.units[-1].separator += piece
        else:
            layout.leading += piece
        return
    start = piece.index(body[0])
    if start:
        _append(layout, piece[:start])
    layout.units.append(Unit(body, piece[start + len(body):]))


def model_text(unit_text: str) -> str:
    """What the model reads for a unit: runs of white space (a hard-wrapped line break) made one space."""
    return _SPACE.sub(" ", unit_text)


# --------------------------------------------------------------------------------------------------------------
# Sentences longer than the model's limit
# --------------------------------------------------------------------------------------------------------------
def split_long(text: str, tokenizer, max_tokens: int, keep_whole: list[tuple[int, int]] = ()) -> list[Unit]:
    """`text` in pieces of at most `max_tokens` tokens each (special tokens not counted), cut at clause
    boundaries, else between words, else between tokens; never inside a `keep_whole` character range. One piece
    when it fits. The pieces and their separators join back into `text`."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    offsets = [(start, end) for start, end in encoded["offset_mapping"] if end > start]
    if len(offsets) <= max_tokens:
        return [Unit(text)]
    limit, max_tokens = max_tokens, max(max_tokens - 2, 1)  # a piece alone may take a token or two more
    starts = [start for start, _ in offsets]
    ranges = sorted(keep_whole)
    range_ends = [end for _, end in ranges]
    pieces, begin = [], 0  # begin: the character where the current piece starts
    while True:
        first = bisect.bisect_left(starts, begin)
        if len(offsets) - first <= max_tokens:
            pieces.append(Unit(text[begin:]))
            return _fit(pieces, tokenizer, limit)
        window_end = offsets[first + max_tokens - 1][1]  # the last character that fits
        nearby = []  # the protected ranges that touch the window
        for start, end in ranges[bisect.bisect_right(range_ends, begin):]:
            if start >= window_end:
                break
            nearby.append((start, end))
        cut = _cut_point(text, begin, window_end, offsets[first + max_tokens][0], nearby)
        piece = text[begin:cut].rstrip()
        after = _SPACE.match(text, cut)
        after = after.end() if after else cut  # the white space after the cut goes too
        pieces.append(Unit(piece, text[begin + len(piece) : after]))
        begin = after


def _cut_point(text: str, begin: int, window_end: int, next_token: int, keep_whole) -> int:
    """Where to end a piece that starts at `begin` and may reach `window_end`: after the last clause boundary in
    the window's second half, else at its last white space, else right after a protected range, else at the token
    boundary `next_token`; never inside a protected range unless the range alone is longer than the window."""
    def allowed(cut: int) -> bool:
        return cut > begin and not any(start < cut < end for start, end in keep_whole)

    window = text[begin:window_end]
    clauses = [begin + m.end() for m in _CLAUSE_END.finditer(window) if m.end() > len(window) // 2]
    spaces = [begin + m.start() for m in _SPACE.finditer(window)]
    range_ends = [end for _, end in keep_whole if begin < end <= window_end]
    for candidates in (clauses, spaces, range_ends, [min(next_token, window_end)]):
        found = [cut for cut in candidates if allowed(cut)]
        if found:
            return max(found)
    return min(next_token, window_end)


def _fit(pieces: list[Unit], tokenizer, max_tokens: int) -> list[Unit]:
    """Re-tokenized alone, a piece may still come out longer than in context: cut such a piece again."""
    texts = [piece.text for piece in pieces]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]]
    fitted = []
    for piece, length in zip(pieces, lengths):
        if length <= max_tokens or max_tokens < 4:
            fitted.append(piece)
            continue
        again = split_long(piece.text, tokenizer, max_tokens - 2)
        again[-1].separator += piece.separator
        fitted.extend(again)
    return fitted


# --------------------------------------------------------------------------------------------------------------
# Files as texts
# --------------------------------------------------------------------------------------------------------------
def split_input(content: str, input_format: str) -> Layout:
    """A file's content as the texts to translate (the layout's units) and what stands between them (their
    separators), so that `layout.join(translations)` writes the translations back in the file's own frame:

    - "lines": each line (ended by \\n or \\r\\n, or by the end of the file) is a text, empty or not, and its
      separator is "\\n": output line N belongs to input line N;
    - "paragraphs": blocks separated by blank lines (lines of white space only) are the texts, and the blank lines
      between them, the white space before the first and after the last, come back as they were;
    - "file": the whole content is one text (which keeps its own white space).
    """
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input format must be one of {', '.join(INPUT_FORMATS)}, got {input_format!r}")
    if input_format == "file":
        return Layout("", [Unit(content)] if content else [])
    if input_format == "paragraphs":
        layout = Layout("")
        for paragraph, blank in _paragraphs(content):
            _append(layout, paragraph)
            _append(layout, blank)
        return layout
    lines = content.split("\n")
    if lines[-1] == "":
        lines.pop()
    return Layout("", [Unit(line.removesuffix("\r"), "\n") for line in lines])


__all__ = [
    "DEFAULT_LANGUAGE",
    "INPUT_FORMATS",
    "Layout",
    "SegmenterMissing",
    "Unit",
    "model_text",
    "sentences",
    "source_language",
    "split_document",
    "split_input",
    "split_long",
]
