"""Glossaries: source terms that must come out as given target terms ("Jehovah" -> "Yahweh", a product name).

    >>> glossary = read_glossary("terms.tsv")                  # one `source term<TAB>target term` per line
    >>> glossary = Glossary.from_pairs([("Jehovah", "Yahweh")])
    >>> [(span.text, span.replacement) for span in glossary.find("Jehovah spoke.")]
    [('Jehovah', 'Yahweh')]

A term matches where it occurs as whole words, case-sensitively; where terms overlap, the longest wins ("New
York City" over "New York"). Each occurrence becomes a protected span of kind "term" (protected_spans.py): with a
model trained with sentinels, the model places the term's sentinel, which is restored as the target term; with any
other model the source term stays in what the model reads and the translation's words aligned with it are
replaced by the target term, unless the model already wrote it. `report` says, per occurrence, whether the
translation holds the target term and how it got there; an occurrence inside another protected span (a URL, a
tag) cannot be honoured and is reported so.

This file imports only the standard library and its sibling: it is copied into saved model directories.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import UsageError, opened_for_reading
from .protected_spans import Span, occurrences


class GlossaryError(UsageError, ValueError):
    """A glossary that cannot be used; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class Glossary:
    """Source term -> target term, with a matcher for the source terms (longest first)."""

    terms: dict

    def __post_init__(self):
        for source, target in self.terms.items():
            if not isinstance(source, str) or not isinstance(target, str) or not source.strip() or not target.strip():
                raise GlossaryError(f"glossary terms must be non-empty strings, got {source!r} -> {target!r}")
        alternatives = "|".join(re.escape(term) for term in sorted(self.terms, key=len, reverse=True))
        object.__setattr__(self, "_pattern", re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)") if self.terms else None)

    @classmethod
    def from_pairs(cls, pairs) -> "Glossary":
        """A glossary from (source, target) pairs or a dict; the same source with two targets, an entry that is not a
        pair, and a path or text where terms were expected (read_glossary reads a file) are refused."""
        if isinstance(pairs, (str, bytes, os.PathLike)):
            raise GlossaryError(f"a glossary of terms was expected, got the {type(pairs).__name__} {pairs!r}: for a "
                                f"TSV file pass read_glossary({os.fspath(pairs)!r}), else a dict of source -> target")
        try:
            entries = list(pairs.items() if isinstance(pairs, dict) else pairs)
        except TypeError:
            raise GlossaryError(f"a glossary is a dict of source -> target terms or (source, target) pairs, got "
                                f"{type(pairs).__name__}") from None
        terms: dict[str, str] = {}
        for number, entry in enumerate(entries, start=1):
            if isinstance(entry, (str, bytes)) or not hasattr(entry, "__len__") or len(entry) != 2:
                raise GlossaryError(f"glossary entry {number} is {entry!r}, not a (source, target) pair")
            source, target = entry
            if source in terms and terms[source] != target:
                raise GlossaryError(f"glossary term {source!r} has two targets, {terms[source]!r} and {target!r} "
                                    f"(entry {number}): keep one")
            terms[source] = target
        return cls(terms)

    def find(self, text: str) -> list[Span]:
        """Every occurrence of a source term in `text`, as spans whose replacement is the target term."""
        if self._pattern is None:
            return []
        return [Span("term", m.group(0), m.start(), m.end(), self.terms[m.group(0)]) for m in self._pattern.finditer(text)]

    def __len__(self) -> int:
        return len(self.terms)


def read_glossary(path: str | os.PathLike) -> Glossary:
    """The glossary in a UTF-8 TSV file: one `source term<TAB>target term` per line, blank lines ignored. A line
    without exactly one tab, an empty term, the same source term with two targets, or a file that is not UTF-8
    text is refused with GlossaryError naming the line."""
    name = os.fspath(path)
    with opened_for_reading(path, "glossary file", GlossaryError) as handle:
        data = handle.read()
    if b"\0" in data:
        where = data.index(b"\0")
        raise GlossaryError(f"the glossary {name} is a binary file, not UTF-8 text (a NUL byte at byte {where}): "
                            f"give a TSV file of `source<TAB>target` lines")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise GlossaryError(f"the glossary {name} is not valid UTF-8 ({error.reason} at byte {error.start}): "
                            f"convert it, e.g. `iconv -f latin1 -t utf-8`") from None
    return parse_glossary(text, name)


def parse_glossary(text: str, name: str = "the glossary") -> Glossary:
    """The glossary in `text` (the TSV lines of a file, or typed into the demo's field), checked line by line as
    `read_glossary` checks a file; `name` says where the lines come from in the messages."""
    return Glossary.from_pairs(_entries(text.removeprefix("\ufeff"), name))


def _entries(text: str, name: str):
    """(source, target) per non-blank line, each line checked."""
    seen: dict[str, tuple[str, int]] = {}
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 2:
            found = "no tab" if len(fields) == 1 else f"{len(fields) - 1} tabs"
            raise GlossaryError(f"{name} line {number}: expected `source term<TAB>target term`, found {found}")
        source, target = (field.strip() for field in fields)
        if not source or not target:
            side = "source" if not source else "target"
            raise GlossaryError(f"{name} line {number}: the {side} term is empty")
        if source in seen and seen[source][0] != target:
            raise GlossaryError(f"{name} line {number}: {source!r} -> {target!r}, but line {seen[source][1]} gives "
                                f"{source!r} -> {seen[source][0]!r}: keep one target per source term")
        seen.setdefault(source, (target, number))
        yield source, target


def report(terms: list[Span], outcomes: list[str], translation: str, lost: list[Span] = ()) -> list[dict]:
    """Per occurrence of a source term: {"source", "target", "honoured", "how"}. An occurrence is honoured when
    the translation holds its target term (counted: two occurrences need it twice); `how` is the restoring's
    outcome ("model", "replaced", "aligned", "position"), or why it could not be honoured. `lost` are
    occurrences inside another protected span."""
    entries, needed = [], {}
    for span, outcome in zip(terms, outcomes):
        target = span.replacement
        needed[target] = needed.get(target, 0) + 1
        honoured = occurrences(target, translation) >= needed[target]
        entries.append({"source": span.text, "target": target, "honoured": honoured,
                        "how": outcome if honoured else f"{outcome}, but the target term is not in the translation"})
    entries += [{"source": span.text, "target": span.replacement, "honoured": False,
                 "how": "inside another protected span"} for span in lost]
    return entries


__all__ = ["Glossary", "GlossaryError", "parse_glossary", "read_glossary", "report"]
