"""Hostile texts of the surfaces issue 41 added, through translate(), the pipeline and hf-scratch-translate:
documents (a single line of 5 MB, text of white space or blank lines only), glossaries (a malformed file, entries
that are not pairs, a path where terms were expected) and protected spans (a pattern that matches the empty string
or does not compile, a string where a list was expected).

A refusal is a UsageError (a ValueError too) of ONE line naming the value and the fix; an input that must work is
checked for the documented result: white space comes back as it was, and a document of megabytes finishes in
seconds, not hours (a regular expression tried at every position of a long run of white space is quadratic).
"""

from __future__ import annotations

import time

from hostile_inputs import Case, Failure, Workspace, _expect_value_error, run_cli

FIVE_MB = 5_000_000


def _loaded(ws: Workspace):
    """(model, tokenizer) of the workspace's tiny run, loaded once (shared with the translation cases)."""
    from hf_scratch_transformer.translation.translate import load_model_and_tokenizer

    if not hasattr(ws, "_translation_model"):
        ws._translation_model = load_model_and_tokenizer(ws.model_dir())
    return ws._translation_model


def _translate(ws: Workspace, texts: list, **options):
    from hf_scratch_transformer.translation.translate import translate

    model, tokenizer = _loaded(ws)
    return translate(model, tokenizer, texts, max_new_tokens=8, **options)


def _within(seconds: float, call):
    started = time.perf_counter()
    result = call()
    if time.perf_counter() - started > seconds:
        raise Failure(f"took {time.perf_counter() - started:.0f} s (more than {seconds} s)")
    return result


# ------------------------------------------------------------------------------------------------------ documents
def _five_mb_of_white_space_between_two_sentences(ws: Workspace) -> str:
    blank = " " * FIVE_MB
    [translation] = _within(60, lambda: _translate(ws, ["Jesus wept." + blank + "God is love."]))
    if blank not in translation or translation.startswith(" ") or translation.endswith(" "):
        raise Failure(f"the 5 MB run of spaces did not come back between the two translations: {len(translation)}")
    return f"a line of {FIVE_MB + 23:,} characters translated, its white space kept"


def _five_mb_line_through_the_pipeline(ws: Workspace) -> str:
    from hf_scratch_transformer import translation_pipeline

    pipe = translation_pipeline(*_loaded(ws))
    blank = "\t \u00a0" * (FIVE_MB // 3)
    [result] = _within(60, lambda: pipe(["Jesus wept." + blank + "God is love."], max_new_tokens=8))
    if blank not in result["translation_text"]:
        raise Failure("the blank run did not come back")
    return "the pipeline kept a 5 MB run of tabs, spaces and no-break spaces"


def _five_mb_line_of_white_space_through_the_cli(ws: Workspace) -> str:
    path = ws.fresh("blank") / "input.txt"
    path.write_text(" " * FIVE_MB + "\n" + "Jesus wept.\n", encoding="utf-8")
    code, err = _within(60, lambda: run_cli(["--model", ws.model_dir(), "--input_file", path]))
    if code != 0 or "Traceback" in err:
        raise Failure(f"exit status {code}: {err.strip()[-300:]}")
    return "a 5 MB line of spaces and a sentence: exit status 0"


def _white_space_only(ws: Workspace) -> str:
    texts = [" ", "\t\t", "\u3000", "", "\u00a0 \u2003"]
    return _expect_same(_translate(ws, texts), texts)


def _blank_lines_only(ws: Workspace) -> str:
    texts = ["\n\n \n\t\n", "\r\n\r\n", "\n" * 10_000]
    return _expect_same(_translate(ws, texts), texts)


def _expect_same(found: list, expected: list) -> str:
    if found != expected:
        raise Failure(f"returned {found!r:.200}, expected the texts as they were")
    return f"{len(expected)} texts of white space returned as they were"


DOCUMENT_CASES = [
    Case("five_mb_line_of_spaces_between_two_sentences", "documents", _five_mb_of_white_space_between_two_sentences),
    Case("five_mb_line_through_the_pipeline", "documents", _five_mb_line_through_the_pipeline),
    Case("five_mb_line_of_spaces_through_the_cli", "documents", _five_mb_line_of_white_space_through_the_cli),
    Case("texts_of_white_space_only", "documents", _white_space_only),
    Case("documents_of_blank_lines_only", "documents", _blank_lines_only),
]


# ----------------------------------------------------------------------------------------------------- glossaries
def _glossary_file(content: bytes, *parts):
    """read_glossary of a file holding `content`, as a caller of translate() would pass it: refused in one line."""
    def check(ws: Workspace) -> str:
        from hf_scratch_transformer.glossary import read_glossary

        path = ws.fresh("glossary") / "terms.tsv"
        path.write_bytes(content)
        return _expect_value_error(lambda: _translate(ws, ["God is love."], glossary=read_glossary(path)),
                                   str(path), *parts)
    return check


def _glossary_value(value, *parts):
    def check(ws: Workspace) -> str:
        return _expect_value_error(lambda: _translate(ws, ["God is love."], glossary=value), *parts)
    return check


GLOSSARY_CASES = [
    Case("glossary_line_without_a_tab", "glossary", _glossary_file(b"God\tDios\nlove amor\n", "line 2", "no tab")),
    Case("glossary_line_with_two_tabs", "glossary", _glossary_file(b"God\tDios\tSe\xc3\xb1or\n", "line 1", "2 tabs")),
    Case("glossary_empty_target_term", "glossary", _glossary_file(b"God\t \n", "line 1", "target term is empty")),
    Case("glossary_two_targets", "glossary", _glossary_file(b"God\tDios\nGod\tSe\xc3\xb1or\n", "line 2", "line 1",
                                                             "keep one target")),
    Case("glossary_binary_file", "glossary", _glossary_file(b"God\tDios\n\x00\x01", "binary", "NUL byte")),
    Case("glossary_latin1_file", "glossary", _glossary_file(b"God\tSe\xf1or\n", "not valid UTF-8", "iconv")),
    Case("glossary_empty_source_term_in_a_dict", "glossary", _glossary_value({"": "Dios"}, "non-empty strings")),
    Case("glossary_entry_not_a_pair", "glossary", _glossary_value([("God",)], "entry 1", "not a (source, target) pair")),
    Case("glossary_a_path_not_terms", "glossary", _glossary_value("terms.tsv", "read_glossary('terms.tsv')")),
    Case("glossary_a_number", "glossary", _glossary_value(42, "dict of source -> target", "got int")),
]


# -------------------------------------------------------------------------------------------- protected spans
def _protect(*parts, **options):
    def check(ws: Workspace) -> str:
        return _expect_value_error(lambda: _translate(ws, ["See https://example.com now."], **options), *parts)
    return check


PROTECT_CASES = [
    Case("protect_pattern_matching_the_empty_string", "protect",
         _protect("'x*'", "matches the empty string", protect_patterns=["x*"])),
    Case("protect_pattern_that_does_not_compile", "protect",
         _protect("'(unclosed'", "does not compile", protect_patterns=["(unclosed"])),
    Case("protect_pattern_a_string_not_a_list", "protect",
         _protect("protect_patterns must be a list", "['x*']", protect_patterns="x*")),
    Case("protect_unknown_kind", "protect", _protect("telephone", "choose from url", protect_kinds=["telephone"])),
    Case("protect_kinds_a_string_not_a_list", "protect",
         _protect("protect_kinds must be a list", "['url']", protect_kinds="url")),
]

CASES = DOCUMENT_CASES + GLOSSARY_CASES + PROTECT_CASES
