"""glossary.py: the TSV file checked line by line, terms matched as whole words (longest first), and every
occurrence of a source term honoured in the translation (or reported) on the session's tiny trained model."""

import pytest

from hf_scratch_transformer.glossary import Glossary, GlossaryError, read_glossary
from hf_scratch_transformer.translation.translate import translate
from hf_scratch_transformer.translation_core import DecodingOptions, TextOptions, TorchBackend, translate_texts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_tsv_file_with_a_bom_crlf_and_blank_lines(tmp_path):
    path = tmp_path / "terms.tsv"
    path.write_bytes("\ufeffJesus\tCristo\r\n\r\n  Lord \t Señor \nGod\tDios\nGod\tDios\n".encode())
    assert read_glossary(path).terms == {"Jesus": "Cristo", "Lord": "Señor", "God": "Dios"}


@pytest.mark.parametrize("content, message", [
    (b"Jesus\tCristo\nGod Dios\n", "line 2: expected `source term<TAB>target term`, found no tab"),
    (b"Jesus\tCristo\tX\n", "line 1: expected `source term<TAB>target term`, found 2 tabs"),
    (b"Jesus\tCristo\n\n \tDios\n", "line 3: the source term is empty"),
    (b"Jesus\t \n", "line 1: the target term is empty"),
    (b"Jesus\tCristo\nGod\tDios\nJesus\tJesucristo\n",
     "line 3: 'Jesus' -> 'Jesucristo', but line 1 gives 'Jesus' -> 'Cristo': keep one target per source term"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is a binary file, not UTF-8 text (a NUL byte at byte 8)"),
    (b"Jes\xfas\tCristo\n", "is not valid UTF-8 (invalid start byte at byte 3)"),
])
def test_a_broken_glossary_is_refused_in_one_line_naming_where(tmp_path, content, message):
    path = tmp_path / "terms.tsv"
    path.write_bytes(content)
    with pytest.raises(GlossaryError) as caught:
        read_glossary(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert str(path) in str(caught.value)


def test_a_missing_glossary_or_a_directory_is_named(tmp_path):
    with pytest.raises(GlossaryError, match="glossary file not found"):
        read_glossary(tmp_path / "nope.tsv")
    with pytest.raises(GlossaryError, match="is a directory"):
        read_glossary(tmp_path)
    with pytest.raises(GlossaryError, match="has two targets"):
        Glossary.from_pairs([("a", "b"), ("a", "c")])
    with pytest.raises(GlossaryError, match="non-empty strings"):
        Glossary({"a": ""})


def test_terms_match_whole_words_case_sensitively_longest_first():
    glossary = Glossary.from_pairs({"New York": "Nueva York", "New York City": "Ciudad de Nueva York", "God": "Dios"})
    found = glossary.find("New York City and New York, God's Godly god.")
    assert [(span.text, span.replacement) for span in found] == [
        ("New York City", "Ciudad de Nueva York"), ("New York", "Nueva York"), ("God", "Dios")]


# ------------------------------------------------------------------------------------------------- on a model
TERMS = {"Jesus": "Cristo", "God": "Dios", "light": "lumbre", "Lord": "Jehová"}
TEXTS = ["Jesus wept.", "God is love. God saw the light, that it was good.", "The Lord is my shepherd.",
         "And there was light.", "Peace be with you."]


def test_every_occurrence_is_honoured_and_reported(trained_model):
    model, tokenizer, _ = trained_model
    plain = translate(model, tokenizer, TEXTS)
    assert "Cristo" not in plain[0] and "Jehová" not in plain[2]  # what the model says without a glossary
    found = translate_texts(TorchBackend(model), tokenizer, TEXTS, DecodingOptions(num_beams=2),
                            TextOptions(glossary=TERMS))
    report = [entry for translation in found for entry in translation.glossary]
    expected = sum(text.count(term) for text in TEXTS for term in TERMS if term != "light") + 2  # "light" twice
    assert len(report) == expected and all(entry["honoured"] for entry in report), report
    for translation in found:
        for entry in translation.glossary:
            assert entry["target"] in translation.text
    assert {entry["how"] for entry in report} >= {"model", "replaced"}  # "Dios" was there already; "Cristo" not
    assert found[-1].glossary == [] and found[-1].text == plain[-1]  # no term, no change


def test_a_term_inside_a_protected_span_is_reported_not_honoured(trained_model):
    model, tokenizer, _ = trained_model
    [translation] = translate(model, tokenizer, ["God is love, see http://God.org/light"], protect=True,
                              glossary=Glossary.from_pairs({"God": "Dios", "light": "lumbre"}), details=True)
    assert [(entry["source"], entry["honoured"]) for entry in translation.glossary] == [
        ("God", True), ("God", False), ("light", False)]
    assert "http://God.org/light" in translation.text
    assert translation.glossary[1]["how"] == "inside another protected span"


def test_a_path_or_entries_that_are_not_pairs_are_refused_naming_what_to_pass():
    from pathlib import Path

    with pytest.raises(GlossaryError, match=r"for a TSV file pass read_glossary\('terms.tsv'\)"):
        Glossary.from_pairs("terms.tsv")
    with pytest.raises(GlossaryError, match=r"for a TSV file pass read_glossary"):
        Glossary.from_pairs(Path("terms.tsv"))
    with pytest.raises(GlossaryError, match=r"glossary entry 2 is \('God', 'Dios', 'x'\), not a \(source, target\)"):
        Glossary.from_pairs([("Jesus", "Jesús"), ("God", "Dios", "x")])
    with pytest.raises(GlossaryError, match="glossary entry 1 is 'Go'"):
        Glossary.from_pairs(["Go"])  # a two-character string would otherwise unpack as a pair
    with pytest.raises(GlossaryError, match="got int"):
        Glossary.from_pairs(3)


def test_protect_patterns_given_as_one_string_are_refused_not_taken_character_by_character():
    from hf_scratch_transformer.protected_spans import ProtectError

    with pytest.raises(ProtectError, match=r"protect_patterns must be a list, got the str 'ACME-\[0-9\]\+'"):
        TextOptions(protect_patterns="ACME-[0-9]+")
    assert TextOptions(protect_patterns=["ACME-[0-9]+"]).protect_patterns == ("ACME-[0-9]+",)
