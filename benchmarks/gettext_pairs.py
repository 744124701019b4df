"""Sentence pairs from gettext catalogs (``.mo`` / ``.po``): the cleaning and splitting rules behind
``build_corpora.py``. Pure functions on texts and polib catalogs; nothing here downloads or writes.

Rules, in order (each dropped pair is counted under its reason):

1. Entries: the header, obsolete and fuzzy entries are skipped; so are translator credits (``translator-credits``,
   KDE's ``NAME OF TRANSLATORS`` / ``EMAIL OF TRANSLATORS`` contexts). The context (``msgctxt``) is not part of the
   pair. Programs that write a context into the msgid itself name its pattern (``context_prefix``: Wesnoth's
   ``context^text``, Freeciv's ``?context:text``): the English side loses it, and so does the translation where a
   translator copied it.
2. Plural entries: the singular pair ``msgid -> msgstr[0]`` always; the plural pair ``msgid_plural -> msgstr[1]``
   too when the catalog has exactly two plural forms (one / other: Spanish, Greek), where that mapping is exact.
3. Both sides are stripped of surrounding whitespace (train.py's reader strips them anyway); inner newlines, tabs,
   markup and keyboard accelerators (``_File``, ``&File``) are kept as the catalogs have them: a mnemonic cannot be
   told reliably from an identifier's underscore (``LC_ALL``) or a literal ampersand.
4. Dropped: an empty translation (``untranslated``), an English side without a letter outside its placeholders
   (``no_words``: ``%s: %s``),
   a translation equal to the English (``identical``: an untranslated copy), and a pair whose placeholders differ
   (``placeholder_mismatch``: another multiset of ``%s`` / ``%1$s`` / ``%(name)s`` / ``%1`` / ``{name}`` /
   ``$name`` on the two sides; ``%2$s`` counts as ``%s``, ``%i`` as ``%d``).
5. One translation per English text: the one found in most catalogs, ties to the smallest string
   (``alternative_translation`` counts the others).
6. Splits by English text: texts equal up to case, placeholder names, accelerator marks, markup and trailing
   punctuation share a near-duplicate key, and a key's split is fixed by its SHA-256, so near-duplicates never
   straddle splits and a text's split does not depend on the rest of the corpus.
"""

import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field

PLACEHOLDER_RE = re.compile(
    r"""%%                                                            # an escaped percent sign: not a placeholder
      | %\([A-Za-z_][\w.-]*\)[-+#0]*\d*(?:\.\d+)?[diouxXeEfFgGcrsa]   # Python %(name)s
      | %(?:\d+\$)?[-+#0']*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|L|q|j|z|t)?[diouxXeEfFgGcsp]  # printf %1$-5.2f
      | %\d{1,2}(?!\d)                                                # Qt / KDE %1
      | \{(?:[A-Za-z_]\w*|\d+)?(?:\.\w+)*(?:![rsa])?(?::[^{}\s]*)?\}  # str.format {0} {name} {name:>8}
      | \$[A-Za-z_][\w.]*\|?                                          # Wesnoth $name (a | may end it)
    """,
    re.VERBOSE,
)
PRINTF_POSITION_RE = re.compile(r"^%\d+\$")
CREDIT_MSGIDS = {"translator-credits", "translator_credits", "TRANSLATOR-CREDITS"}
CREDIT_CONTEXTS = {"NAME OF TRANSLATORS", "EMAIL OF TRANSLATORS"}
WESNOTH_CONTEXT = r"^[^^]*\^"  # "female^Elvish Fighter": up to the first caret (sgettext)
FREECIV_CONTEXT = r"^\?[^:]*:"  # "?plural:Hungarians" (Q_)
TAG_RE = re.compile(r"</?[A-Za-z][^<>]*>")
TRAILING_RE = re.compile(r"[\s.:;!?…]+$")
WHITESPACE_RE = re.compile(r"\s+")
DROP_REASONS = ("credits", "untranslated", "no_words", "identical", "placeholder_mismatch", "alternative_translation")


@dataclass
class Harvest:
    """Pairs gathered from catalogs: per English text, each translation with the catalogs it came from; and the
    number of entries dropped per reason."""

    translations: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # en -> target -> [origin, ...]
    dropped: Counter = field(default_factory=Counter)

    def add(self, source: str, target: str, origin: str) -> None:
        origins = self.translations.setdefault(source, {}).setdefault(target, [])
        if origin not in origins:
            origins.append(origin)


# ------------------------------------------------------------------------------------------------- placeholders
def placeholders(text: str) -> list[str]:
    """The placeholders of ``text`` in order (``%%`` is none)."""
    return [match for match in PLACEHOLDER_RE.findall(text) if match != "%%"]


def placeholder_signature(text: str) -> Counter:
    """The placeholders as a multiset, positions dropped (``%2$s`` -> ``%s``) and ``%i`` read as ``%d``."""
    def normal(placeholder: str) -> str:
        if placeholder.startswith("%") and not placeholder.startswith("%("):
            placeholder = PRINTF_POSITION_RE.sub("%", placeholder)
            if placeholder.endswith("i") and not placeholder[1:].isdigit():
                placeholder = placeholder[:-1] + "d"
        return placeholder

    return Counter(normal(placeholder) for placeholder in placeholders(text))


# ----------------------------------------------------------------------------------------------------- entries
def plural_count(catalog) -> int | None:
    """``nplurals`` of the catalog's Plural-Forms header, None without one."""
    match = re.search(r"nplurals\s*=\s*(\d+)", catalog.metadata.get("Plural-Forms", ""))
    return int(match.group(1)) if match else None


def entry_pairs(entry, nplurals: int | None) -> list[tuple[str, str]]:
    """(English, translation) pairs of one catalog entry by rule 2, before cleaning."""
    if not entry.msgid_plural:
        return [(entry.msgid, entry.msgstr)]
    forms = entry.msgstr_plural
    pairs = [(entry.msgid, forms.get(0, ""))]
    if nplurals == 2:
        pairs.append((entry.msgid_plural, forms.get(1, "")))
    return pairs


def drop_reason(source: str, target: str) -> str | None:
    """Why a stripped pair is dropped (rule 4), or None to keep it."""
    if not target:
        return "untranslated"
    if not any(char.isalpha() for char in PLACEHOLDER_RE.sub("", source)):
        return "no_words"
    if target == source:
        return "identical"
    if placeholder_signature(source) != placeholder_signature(target):
        return "placeholder_mismatch"
    return None


def harvest_catalog(catalog, origin: str, harvest: Harvest, context_prefix: str | None = None) -> int:
    """Add the kept pairs of a polib catalog to ``harvest`` under ``origin``; returns the number of pairs seen.
    ``context_prefix``: a regular expression of the context a program writes at the start of its msgids."""
    nplurals, seen = plural_count(catalog), 0
    prefix = re.compile(context_prefix) if context_prefix else None
    for entry in catalog:
        if not entry.msgid or entry.obsolete or "fuzzy" in entry.flags:
            continue
        for source, target in entry_pairs(entry, nplurals):
            seen += 1
            if source in CREDIT_MSGIDS or entry.msgctxt in CREDIT_CONTEXTS:
                harvest.dropped["credits"] += 1
                continue
            context = prefix.match(source) if prefix else None
            if context:
                source, target = source[context.end():], target.removeprefix(context.group())
            source, target = source.strip(), target.strip()
            reason = drop_reason(source, target)
            if reason:
                harvest.dropped[reason] += 1
            else:
                harvest.add(source, target, origin)
    return seen


def chosen_pairs(harvest: Harvest) -> list[dict]:
    """One record per English text (rule 5): ``{"source", "target", "origins"}``, in English-text order; the
    translations not chosen are counted in ``harvest.dropped``."""
    records = []
    for source in sorted(harvest.translations):
        options = harvest.translations[source]
        target = min(options, key=lambda text: (-len(options[text]), text))
        harvest.dropped["alternative_translation"] += len(options) - 1
        records.append({"source": source, "target": target, "origins": sorted(options[target])})
    return records


# ------------------------------------------------------------------------------------------------------ splits
def near_duplicate_key(text: str) -> str:
    """The English text up to case, placeholder names, accelerator marks, markup, whitespace and trailing
    punctuation: texts with one key always land in one split."""
    key = PLACEHOLDER_RE.sub(lambda match: "%" if match.group() != "%%" else "%%", text)
    key = TAG_RE.sub(" ", key).replace("_", "").replace("&", "")
    key = WHITESPACE_RE.sub(" ", key.casefold()).strip()
    return TRAILING_RE.sub("", key)


def key_hash(key: str, salt: str = "split") -> int:
    """A stable 64-bit number for a key (SHA-256 of salt + key)."""
    return int.from_bytes(hashlib.sha256(f"{salt}\0{key}".encode()).digest()[:8], "big")


def split_of(key: str, validation_permille: int, test_permille: int) -> str:
    """The split of a near-duplicate key: its hash modulo 1000 below test_permille -> test, below test_permille +
    validation_permille -> validation, else train."""
    bucket = key_hash(key) % 1000
    if bucket < test_permille:
        return "test"
    return "validation" if bucket < test_permille + validation_permille else "train"


def capped(records: list[dict], max_pairs: int | None) -> list[dict]:
    """At most ``max_pairs`` records, whole near-duplicate groups taken in the order of a second hash of their key
    (a deterministic sample that keeps groups together); all records when max_pairs is None."""
    if max_pairs is None:
        return records
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(near_duplicate_key(record["source"]), []).append(record)
    sample = []
    for key in sorted(groups, key=lambda key: (key_hash(key, "sample"), key)):
        if len(sample) + len(groups[key]) > max_pairs:
            break
        sample.extend(groups[key])
    return sample


def split_records(records: list[dict], validation_permille: int, test_permille: int) -> dict[str, list[dict]]:
    """The records per split (rule 6), each split ordered by the hash of the key (so the first N lines of a file are
    a sample of it, not the texts starting with "A"), then by English text."""
    splits: dict[str, list[dict]] = {"train": [], "validation": [], "test": []}
    for record in records:
        splits[split_of(near_duplicate_key(record["source"]), validation_permille, test_permille)].append(record)
    for split in splits.values():
        split.sort(key=lambda record: (key_hash(near_duplicate_key(record["source"])), record["source"]))
    return splits
