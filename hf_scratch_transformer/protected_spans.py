"""Protected spans: what must come back from translation exactly as it went in, exactly once (printf and format
placeholders, XML/HTML tags, URLs, e-mail addresses, a user's own patterns), and glossary terms, which come back
as their target term.

    >>> protector = SpanProtector()                                # every default kind
    >>> protected = protector.protect("Deleted <b>%d</b> files.", sentinels=True)
    >>> protected.model_text
    'Deleted ｟0｠｟1｠｟2｠ files.'
    >>> restore(protected, "Borrados ｟0｠｟1｠｟2｠ archivos.").text
    'Borrados <b>%d</b> archivos.'

Two ways to hide a span from the model, chosen by the model's tokenizer:

- **sentinels** (a model whose tokenizer has the sentinel tokens `｟0｠`, `｟1｠` ..., trained with the spans that
  both sides of a pair share masked by them): each span becomes its sentinel; the model places the sentinels, and
  restoring puts each span back where its sentinel is. A sentinel the model dropped is put back at the place the
  alignment gives, a repeated one is kept once, one the source did not have is removed.
- **stripping** (any other model, which has never seen sentinels): the spans leave the text the model reads
  (Bergamot's way with markup), and each is put back into the translation after the word aligned with the word
  next to it in the source; a paired tag goes around the translated words aligned with its content. A glossary
  term stays in the text the model reads and replaces the words aligned with it (unless the translation already
  has the target term).

Without an alignment (a backend that gives no attention), a span goes back at its relative position in the source.
Tags are then checked: if the alignment would cross or reverse a pair, every tag of the unit keeps its source order.

This file imports only the standard library: it is copied into saved model directories beside translation_core.py.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from .errors import UsageError

SENTINEL_FORMAT = "\uff5f{}\uff60"  # ｟0｠: OpenNMT's placeholder brackets, which ordinary text never holds
MAX_SENTINELS = 32  # sentinel tokens a tokenizer gets: a unit with more spans keeps the rest unprotected
_SENTINEL = re.compile("\uff5f(\\d+)\uff60")

DEFAULT_PATTERNS = {  # kind -> pattern; on overlap the earlier kind and the longer match win
    "url": r"\b(?:https?|ftp)://[^\s<>\"'{}]+[^\s<>\"'{}.,;:!?)\]]|\bwww\.[\w-]+\.[^\s<>\"'{}]*[^\s<>\"'{}.,;:!?)\]]",
    "email": r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b",
    "tag": r"<!--.*?-->|</?[A-Za-z][\w:.-]*(?:\s+[^<>]*?)?\s*/?>",
    "printf": r"%(?:\d+\$)?[-+0#']*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|L|q|j|z|t)?[diouxXeEfFgGaAcsp@]"
              r"|%\([A-Za-z_]\w*\)[-+0#]*\d*(?:\.\d+)?[diouxXeEfFgGrsac]|%%",
    "format": r"\{(?:\d+|[A-Za-z_]\w*(?:\.\w+|\[\w+\])*)?(?:![rsa])?(?::[^{}\s]*)?\}",
}
DEFAULT_KINDS = tuple(DEFAULT_PATTERNS)
_TAG_NAME = re.compile(r"<(/?)([A-Za-z][\w:.-]*)")
_PROBE = "Aa bB 0 9 %s {x} <b> </b> . , http://x.org a@b.cd"  # a pattern with an empty match here is refused


class ProtectError(UsageError, ValueError):
    """A user's pattern that cannot be used; the message names it and why."""


def sentinel(index: int) -> str:
    return SENTINEL_FORMAT.format(index)


def sentinel_tokens(count: int = MAX_SENTINELS) -> list[str]:
    """The sentinel tokens a new tokenizer gets, as plain (not special) added tokens: decoding keeps them."""
    return [sentinel(index) for index in range(count)]


def tokenizer_has_sentinels(tokenizer) -> bool:
    """True when every sentinel is one token of `tokenizer` (a model trained with masked spans)."""
    vocabulary = tokenizer.get_vocab()
    return all(token in vocabulary for token in sentinel_tokens())


def compile_user_pattern(pattern: str):
    """A user's regular expression, compiled; ProtectError when it does not compile or can match nothing at all
    (the empty string), which would protect nothing and loop."""
    try:
        compiled = re.compile(pattern)
    except re.error as error:
        raise ProtectError(f"the pattern {pattern!r} does not compile: {error}") from None
    if compiled.fullmatch("") is not None or any(m.end() == m.start() for m in compiled.finditer(_PROBE)):
        raise ProtectError(f"the pattern {pattern!r} matches the empty string: it must match at least one character")
    return compiled


@dataclass
class Span:
    """A protected piece of a unit: `kind`, the source `text` at [start, end), the `replacement` it comes back as
    (the text itself; a glossary term's target), the index of its paired tag, and whether it is glued to a letter,
    a digit or another span on either side in the source (`<b>word`, `%d%%`): it is glued there again."""

    kind: str
    text: str
    start: int
    end: int
    replacement: str
    pair: int | None = None
    glued_before: bool = False
    glued_after: bool = False


@dataclass
class ProtectedText:
    """A unit with its spans hidden: `model_text` is what the model reads; `anchors[i]` is where span i is in it
    (its sentinel, the gap it was stripped from, a kept term's start) and `ends[i]` where it ends there."""

    source: str
    model_text: str
    spans: list[Span]
    sentinels: bool
    anchors: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    unprotected: list[Span] = field(default_factory=list)  # beyond MAX_SENTINELS: left as text, reported
    # span index -> its sentinel's number: the spans other than terms, numbered in order as training numbered them
    sentinel_numbers: dict[int, int] = field(default_factory=dict)


@dataclass
class Restored:
    """A translation with its spans back: `outcomes[i]` says how span i came back: "model" (placed by the model:
    its sentinel, or the target term already there), "aligned" (put at the place the alignment gives),
    "replaced" (a term over the words aligned with it), "position" (at its relative position)."""

    text: str
    outcomes: list[str]


class SpanProtector:
    """Finds the spans of `kinds` (default: all of DEFAULT_PATTERNS) and of the user's `patterns` (kind "user")."""

    def __init__(self, kinds=DEFAULT_KINDS, patterns=()):
        unknown = sorted(set(kinds) - set(DEFAULT_PATTERNS))
        if unknown:
            raise ProtectError(f"unknown kind(s) of span {', '.join(unknown)}: choose from {', '.join(DEFAULT_KINDS)}")
        self.patterns = [(kind, re.compile(DEFAULT_PATTERNS[kind], re.DOTALL)) for kind in kinds]
        self.patterns += [("user", compile_user_pattern(p) if isinstance(p, str) else p) for p in patterns]

    def find(self, text: str, extra: list[Span] = ()) -> list[Span]:
        """The spans of `text`, in order, none overlapping. On overlap the user's patterns win, then the default
        kinds in DEFAULT_PATTERNS' order, then `extra` (glossary terms: never inside a URL or a tag); within one,
        the earlier and longer."""
        levels = [[Span("user", m.group(0), m.start(), m.end(), m.group(0))
                   for kind, pattern in self.patterns if kind == "user"
                   for m in pattern.finditer(text) if m.end() > m.start()]]
        levels += [[Span(kind, m.group(0), m.start(), m.end(), m.group(0)) for m in pattern.finditer(text)]
                   for kind, pattern in self.patterns if kind != "user"]
        levels.append(list(extra))
        taken: list[Span] = []
        for level in levels:
            for span in sorted(level, key=lambda span: (span.start, span.start - span.end)):
                if all(span.end <= other.start or span.start >= other.end for other in taken):
                    taken.append(span)
        taken.sort(key=lambda span: span.start)
        starts, ends = {span.start for span in taken}, {span.end for span in taken}
        for span in taken:
            span.glued_before = span.start > 0 and (text[span.start - 1].isalnum() or span.start in ends)
            span.glued_after = span.end < len(text) and (text[span.end].isalnum() or span.end in starts)
        _pair_tags(taken)
        return taken

    def protect(self, text: str, sentinels: bool, extra: list[Span] = ()) -> ProtectedText:
        """`text` with its spans hidden: as sentinels, or stripped (glossary terms stay as they are)."""
        spans = self.find(text, extra)
        return hide(text, spans, sentinels)


def _pair_tags(spans: list[Span]) -> None:
    """Link each closing tag to the opening tag of the same name before it (a stack, as a parser would)."""
    open_tags: list[int] = []
    for index, span in enumerate(spans):
        name = _TAG_NAME.match(span.text) if span.kind == "tag" and not span.text.endswith("/>") else None
        if name is None:
            continue
        if not name.group(1):
            open_tags.append(index)
            continue
        for depth in range(len(open_tags) - 1, -1, -1):
            if _TAG_NAME.match(spans[open_tags[depth]].text).group(2) == name.group(2):
                opening = open_tags.pop(depth)
                span.pair, spans[opening].pair = opening, index
                break


def hide(text: str, spans: list[Span], sentinels: bool) -> ProtectedText:
    """The model's text of `text` and its (sorted, non-overlapping) spans: each span its sentinel, or stripped
    (white space left doubled or before punctuation by a stripped span is dropped; terms stay)."""
    unprotected = spans[MAX_SENTINELS:] if sentinels else []
    spans = spans[:MAX_SENTINELS] if sentinels else spans
    protected = ProtectedText(text, "", spans, sentinels, unprotected=unprotected)
    model, position = "", 0
    for index, span in enumerate(spans):
        before = len(model)
        model = _append_text(model, text[position : span.start], sentinels)
        if len(model) < before + span.start - position:  # a space at the end was dropped: anchors move back
            protected.anchors = [min(anchor, len(model)) for anchor in protected.anchors]
            protected.ends = [min(end, len(model)) for end in protected.ends]
        protected.anchors.append(len(model))
        # a glossary term stays as text: hidden behind a sentinel, a content word leaves a sentence the model never
        # saw in training (5 BLEU lost on the shipped test split); the target term replaces its translation
        if span.kind == "term":
            model += span.text
        elif sentinels:
            protected.sentinel_numbers[index] = len(protected.sentinel_numbers)
            model += sentinel(protected.sentinel_numbers[index])
        protected.ends.append(len(model))
        position = span.end
    model = _append_text(model, text[position:], sentinels)
    protected.model_text = model if sentinels else model.rstrip()
    if not sentinels:  # what was stripped from the start leaves white space there
        shift = len(model) - len(model.lstrip())
        protected.model_text = protected.model_text.lstrip()
        protected.anchors = [max(anchor - shift, 0) for anchor in protected.anchors]
        protected.ends = [max(end - shift, 0) for end in protected.ends]
    return protected


def _append_text(model: str, piece: str, sentinels: bool) -> str:
    if not sentinels and model.endswith(" ") and piece[:1] in (" ", ",", ".", ";", ":", "!", "?", ")"):
        model = model[:-1]
    return model + piece


# --------------------------------------------------------------------------------------------------------------
# Restoring
# --------------------------------------------------------------------------------------------------------------
Links = list[tuple[int, int, int]]  # (start, end) of a source token in the model text, its white space left out,
#                                     and the index of the translation word aligned with it: one per target token


def _mark(index: int) -> str:
    return f"\0{index}\0"


_MARK = re.compile("\0(\\d+)\0")


class _Draft:
    """The translation's words, indexed as the alignment counts them, and the span marks placed in and between
    them: a mark inserted at gap g comes before word g (g = len(words): at the end)."""

    def __init__(self, translation: str, spans: list[Span]):
        self.words = translation.split()
        self.spans = spans
        self.gaps: dict[int, list[int]] = {}
        self.keys: dict[int, tuple] = {}  # an order of its own within its gap (the members of a group)

    def insert(self, gap: int, index: int, key: tuple | None = None) -> None:
        self.gaps.setdefault(min(max(gap, 0), len(self.words)), []).append(index)
        if key is not None:
            self.keys[index] = key

    def remove(self, indices: set[int]) -> None:
        """Take the marks of `indices` out, from the gaps and from inside words."""
        self.gaps = {gap: [i for i in marks if i not in indices] for gap, marks in self.gaps.items()}
        self.words = [_MARK.sub(lambda m: "" if int(m.group(1)) in indices else m.group(0), w) for w in self.words]

    def tokens(self, source_order: bool = False) -> list[str]:
        """Words and marks in order. Marks sharing a gap: closing tags first (a tag closed there, another opened),
        then the others, each group in source order; with `source_order`, all in source order."""
        def rank(index: int) -> tuple:
            pair = self.spans[index].pair
            closing = pair is not None and pair < index
            return self.keys.get(index) or (0 if closing or source_order else 1, index, 0)

        out = []
        for gap in range(len(self.words) + 1):
            out += [_mark(index) for index in sorted(self.gaps.get(gap, []), key=rank)]
            if gap < len(self.words) and self.words[gap]:
                out.append(self.words[gap])
        return out


def restore(protected: ProtectedText, translation: str, links: Links | None = None) -> Restored:
    """The translation with every span back exactly once (see the module's docstring). `links` align the model
    text's tokens with the translation's words (None: no alignment, relative positions)."""
    spans = protected.spans
    if not spans:  # a sentinel model may still write a sentinel: one the source does not hold is removed
        stray = protected.sentinels and any(m.group(0) not in protected.source for m in _SENTINEL.finditer(translation))
        if stray:
            translation = _SENTINEL.sub(lambda m: m.group(0) if m.group(0) in protected.source else "", translation)
            translation = re.sub(" {2,}", " ", translation).strip()
        return Restored(translation, [])
    draft = _Draft(translation, spans)
    links = links or []
    if protected.sentinels:
        outcomes = _place_sentinels(protected, draft, links)
    else:
        outcomes = _place_stripped(protected, draft, links)
    source_order = False
    if not _tags_well_formed(spans, draft.tokens()):
        tags = {index for index, span in enumerate(spans) if span.pair is not None}
        draft.remove(tags)
        for index in sorted(tags):
            draft.insert(_relative_gap(protected, index, len(draft.words)), index)
            outcomes[index] = "position"
        source_order = True
    return Restored(_render(draft.tokens(source_order), spans, protected.source), outcomes)


def _place_sentinels(protected: ProtectedText, draft: _Draft, links: Links) -> list[str]:
    """Sentinels in the model's output become marks: the first of each index kept, later ones and unknown ones
    removed; a missing one is inserted by the alignment. Glossary terms (kept as text) as without sentinels."""
    seen: set[int] = set()

    span_of = {number: index for index, number in protected.sentinel_numbers.items()}

    def mark(match) -> str:
        index = span_of.get(int(match.group(1)))
        if index is None or index in seen:
            return ""
        seen.add(index)
        return _mark(index)

    draft.words = [_SENTINEL.sub(mark, word) for word in draft.words]
    credited: dict[str, int] = {}
    return [_place_term(draft, protected, index, links, credited) if span.kind == "term"
            else "model" if index in seen else _insert(draft, protected, index, links)
            for index, span in enumerate(protected.spans)]


def _place_stripped(protected: ProtectedText, draft: _Draft, links: Links) -> list[str]:
    """Kept terms replace the words aligned with them; stripped spans are inserted by the alignment, a paired
    tag around the words aligned with its content."""
    outcomes = [""] * len(protected.spans)
    credited: dict[str, int] = {}
    for index, span in enumerate(protected.spans):
        if span.kind == "term":
            outcomes[index] = _place_term(draft, protected, index, links, credited)
    for index, span in enumerate(protected.spans):
        if outcomes[index]:
            continue
        pair = span.pair
        if pair is not None and pair > index and protected.anchors[pair] == protected.anchors[index]:
            # a pair around nothing the model read (`<b>%d</b>`): the group goes in one piece, in source order
            outcome = _insert(draft, protected, index, links, key=(1, index, 0))
            gap = next(gap for gap, marks in draft.gaps.items() if index in marks)
            for member in range(index + 1, pair + 1):
                draft.insert(gap, member, key=(1, index, member - index))
                outcomes[member] = outcome
            outcomes[index] = outcome
            continue
        if pair is not None and pair > index:
            content = _aligned_words(links, protected.anchors[index], protected.anchors[pair])
            if content:
                draft.insert(min(content), index)
                draft.insert(max(content) + 1, pair)
                outcomes[index] = outcomes[pair] = "aligned"
                continue
        outcomes[index] = _insert(draft, protected, index, links)
    return outcomes


def occurrences(term: str, text: str) -> int:
    """How often `term` occurs in `text` as a whole word (or words)."""
    return len(re.findall(rf"(?<!\w){re.escape(term)}(?!\w)", text))


def _place_term(draft: _Draft, protected: ProtectedText, index: int, links: Links, credited: dict) -> str:
    """A glossary term: "model" when the translation already has its target (once per occurrence in the
    source), else the words aligned with the source term replaced by the target, else inserted."""
    span = protected.spans[index]
    target = span.replacement
    if occurrences(target, " ".join(draft.words)) > credited.get(target, 0):
        credited[target] = credited.get(target, 0) + 1
        return "model"  # no mark: the model wrote the term itself
    aligned = [word for word in _aligned_words(links, protected.anchors[index], protected.ends[index])
               if "\0" not in draft.words[word]]  # a word another term replaced stays that term's
    if not aligned:
        return _insert(draft, protected, index, links)
    run = _longest_run(aligned)[: len(span.replacement.split())]  # alignment noise must not eat a sentence
    first, last = run[0], run[-1]
    prefix = re.match(r"\W*", draft.words[first]).group(0)
    suffix = re.search(r"\W*$", draft.words[last]).group(0)
    draft.words[first : last + 1] = [prefix + _mark(index) + suffix] + [""] * (last - first)
    return "replaced"


def _longest_run(indices: list[int]) -> list[int]:
    """The longest run of consecutive numbers in sorted `indices` (the first such run on a tie)."""
    runs: list[list[int]] = []
    for value in indices:
        if runs and value == runs[-1][-1] + 1:
            runs[-1].append(value)
        else:
            runs.append([value])
    return max(runs, key=len)


def _aligned_words(links: Links, start: int, end: int) -> list[int]:
    """The translation's words aligned with source characters [start, end): those most of whose tokens align
    inside it, else the one with the most tokens aligned inside it; sorted."""
    inside, total = Counter(), Counter()
    for s, e, word in links:
        total[word] += 1
        if start <= s and e <= end:
            inside[word] += 1
    words = sorted(word for word in inside if inside[word] * 2 > total[word])
    return words or ([max(inside, key=lambda word: (inside[word], -word))] if inside else [])


def _insert(draft: _Draft, protected: ProtectedText, index: int, links: Links, key: tuple | None = None) -> str:
    """Put span `index` after the word aligned with the nearest source token before its place, or before the
    word aligned with the nearest token after it, whichever token is nearer; else at its relative position."""
    anchor, end = protected.anchors[index], protected.ends[index]
    nearest = sorted((anchor - e, 0, word) if e <= anchor else (s - end, 1, word)
                     for s, e, word in links if e <= anchor or s >= end)
    if nearest:
        _, after_span, word = nearest[0]
        draft.insert(word if after_span else word + 1, index, key)
        return "aligned"
    draft.insert(_relative_gap(protected, index, len(draft.words)), index, key)
    return "position"


def _relative_gap(protected: ProtectedText, index: int, count: int) -> int:
    """The gap at span `index`'s relative position in the model text."""
    return round(protected.anchors[index] / max(len(protected.model_text), 1) * count)


def _tags_well_formed(spans: list[Span], tokens: list[str]) -> bool:
    """Each paired tag opens before it closes, and pairs nest as in a parse."""
    stack: list[int] = []
    for index in (int(i) for token in tokens for i in _MARK.findall(token)):
        pair = spans[index].pair
        if pair is None:
            continue
        if index < pair:
            stack.append(index)
        elif not stack or stack.pop() != pair:
            return False
    return not stack


# a letter or digit of a script that puts spaces between words: not Chinese, Japanese, Thai, Lao, Myanmar or Khmer,
# where a span written against a word is the normal case
_SPACED_WORD_CHARACTER = r"[^\W\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]"


def _render(tokens: list[str], spans: list[Span], source: str) -> str:
    """The tokens joined by spaces, each mark replaced by its span, glued to its neighbour where the source had
    no white space on that side, and parted from a letter or digit the model glued it to where the source's
    span has none on that side (`el｟1｠amor` for `love, <b>%d</b>` is `el %d amor`, not `el%damor`)."""
    text = " ".join(tokens)
    for index, span in enumerate(spans):
        mark = _mark(index)
        if span.kind == "term":  # a term stands for words: it keeps the spacing around it
            continue
        if span.glued_before:
            text = text.replace(" " + mark, mark)
        if span.glued_after:
            text = text.replace(mark + " ", mark)
        # an opening tag goes against the word it opens, a closing tag against the word it closes
        opening, closing = span.pair is not None and span.pair > index, span.pair is not None and span.pair < index
        if not closing and not re.match(r"\w", source[span.start - 1 : span.start]):
            text = re.sub(rf"(?<={_SPACED_WORD_CHARACTER}){re.escape(mark)}", " " + mark, text)
        if not opening and not re.match(r"\w", source[span.end : span.end + 1]):
            text = re.sub(rf"{re.escape(mark)}(?={_SPACED_WORD_CHARACTER})", mark + " ", text)
    text = re.sub(" {2,}", " ", text).strip()
    return _MARK.sub(lambda m: spans[int(m.group(1))].replacement, text)


__all__ = [
    "DEFAULT_KINDS",
    "DEFAULT_PATTERNS",
    "MAX_SENTINELS",
    "ProtectError",
    "ProtectedText",
    "Restored",
    "Span",
    "SpanProtector",
    "compile_user_pattern",
    "hide",
    "occurrences",
    "restore",
    "sentinel",
    "sentinel_tokens",
    "tokenizer_has_sentinels",
]
