"""`hf-scratch-translate`: translate from the command line, print n-best lists and alignments, draw attention.

    hf-scratch-translate --model runs/en-es "In the beginning God created the heavens and the earth."
    echo "Jesus wept." | hf-scratch-translate --model runs/en-es
    hf-scratch-translate --model runs/en-es --input_file test.en --output_file test.es --num_beams 5
    hf-scratch-translate --model runs/en-es --input_file book.txt --input_format paragraphs
    hf-scratch-translate --model runs/en-es --input_file ui.en --protect on --protect_pattern 'ACME-[0-9]+'
    hf-scratch-translate --model runs/en-es --glossary terms.tsv --output_format jsonl --nbest 2 --num_beams 4 "..."
    hf-scratch-translate --model runs/en-es --nbest 3 --num_beams 5 --print_alignment "Jesus wept."
    hf-scratch-translate --model runs/en-es "Jesus wept." --attention attention.png
    hf-scratch-translate --backend ct2 --model runs/en-es-ct2 "Jesus wept."   # see hf-scratch-export-ct2

Also runnable as `python -m hf_scratch_transformer.translation.cli`. With --input_format lines (the default), lines
are separated by \\n or \\r\\n only (a form feed or U+2028 inside a line stays in it), and line N of the output
belongs to line N of the input; paragraphs (blank-line separated) and file read bigger texts
(documents.split_input). With --nbest or --print_alignment the output is one block per input text:
`H-<n>\\t<score>\\t<translation>` per hypothesis, best first, each followed by `A-<n>\\t<source word>-<target word>
...` with --print_alignment (fairseq's format; numbers from 1). --output_format jsonl writes one JSON object per
input text instead (`json_record`). Every option, pattern, glossary and input is checked before the model is
loaded. Errors print one line on stderr: exit status 2 for what the user can fix (a path, an option, a glossary, a
binary input, a broken model), 1 for the environment (a full disk), and nothing is written; a reader that closes the
output early (`| head -1`) ends the command quietly with status 0.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

from ..errors import (ScratchTransformerError, UsageError, exit_code, opened_for_reading, run_command,
                      working_directory_exists, write_error)

FLAGS = {"num_return_sequences": "--nbest"}  # core option -> this command's flag, where the names differ


class StdoutClosed(ScratchTransformerError):
    """The reader of standard output went away (`| head -1`): the command ends quietly, with status 0."""

    exit_code = 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-scratch-translate",
        description="Translate text with a saved hf_scratch_transformer model (or any transformers seq2seq model). "
        "Input comes from the TEXT arguments, else from --input_file, else from stdin, one text per line "
        "(lines end at \\n or \\r\\n; a line may hold a paragraph: it is translated sentence by sentence); each "
        "input line gives exactly one output line (empty lines stay empty), or one block with --nbest / "
        "--print_alignment, or one JSON object with --output_format jsonl. --input_format paragraphs or file reads "
        "bigger texts.",
        epilog="examples:\n"
        "  hf-scratch-translate --model runs/en-es \"Jesus wept.\"\n"
        "  echo \"Jesus wept.\" | hf-scratch-translate --model runs/en-es\n"
        "  hf-scratch-translate --model runs/en-es --input_file test.en --output_file test.es --num_beams 5\n"
        "  hf-scratch-translate --model runs/en-es --input_file book.txt --input_format paragraphs\n"
        "  hf-scratch-translate --model runs/en-es --input_file ui.en --protect on --protect_pattern 'ACME-[0-9]+'\n"
        "  hf-scratch-translate --model runs/en-es --glossary terms.tsv --output_format jsonl \"Jesus wept.\"\n"
        "  hf-scratch-translate --model runs/en-es --nbest 3 --num_beams 5 --print_alignment \"Jesus wept.\"\n"
        "  hf-scratch-translate --model runs/en-es \"Jesus wept.\" --attention attention.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("text", nargs="*", metavar="TEXT", help="texts to translate (one output line each)")
    parser.add_argument("--model", "-m", required=True, metavar="DIR",
                        help="directory written by save_pretrained (or a hub id, where the hub is reachable)")
    parser.add_argument("--input_file", "-i", metavar="FILE",
                        help="translate FILE (UTF-8 text), read as --input_format says")
    parser.add_argument("--output_file", "-o", metavar="FILE",
                        help="write translations to FILE instead of stdout (replaced only once complete)")
    _add_decoding_arguments(parser)
    _add_text_arguments(parser)
    parser.add_argument("--cpu_threads", type=int, metavar="N",
                        help="pytorch backend: torch's intra-op CPU threads, as train.py's --cpu_threads (default 0: "
                        "measured while translating, fewer when other work slows the cores down; N pins N)")
    parser.add_argument("--ct2_intra_threads", type=int, metavar="N",
                        help="ct2 backend: CTranslate2's CPU threads per batch, its intra_threads (default 0: "
                        "CTranslate2's own default, 4); batches go to it one at a time (inter_threads 1)")
    parser.add_argument("--device", metavar="DEVICE",
                        help="cpu, cuda, cuda:1, mps... (default: cuda if available, else mps, else cpu)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "bfloat16_products", "int8"),
                        default="auto",
                        help="pytorch backend: the weights' dtype while translating; or, on a CPU, fp32 weights whose "
                        "decoding steps multiply in bf16 where a product has rows enough (bfloat16_products) or in "
                        "int8 (default auto: int8 on a CPU with AVX-512 BF16 and no AMX, bfloat16_products on one "
                        "with AMX, where each translates fastest at the same BLEU; float32 elsewhere)")
    parser.add_argument("--attention", metavar="PNG",
                        help="draw the cross-attention of the translation of the FIRST non-empty input sentence "
                        "into PNG: the mean over heads of the last layer, plus every layer/head "
                        "(see --attention_all for one image per sentence)")
    parser.add_argument("--attention_all", action="store_true",
                        help="with --attention: one PNG per non-empty input line, named PNG's stem + '-<line number>' "
                        "(e.g. attention-1.png, attention-2.png; line numbers start at 1)")
    parser.add_argument("--backend", choices=("pytorch", "ct2"), default="pytorch",
                        help="pytorch: generate() on a save_pretrained directory (default); ct2: CTranslate2 on a "
                        "directory written by hf-scratch-export-ct2 (needs pip install hf-scratch-transformer[ct2])")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar when translating a file")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks and library warnings")
    return parser


def _add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """How to decode: beams, lengths, batches, n-best lists and alignments."""
    from ..translation_core import DEFAULT_BATCH_SIZE, DEFAULT_MAX_LEN_A, DEFAULT_MAX_LEN_B

    parser.add_argument("--num_beams", type=int, metavar="N", help="beam size (default: the model's generation_config)")
    parser.add_argument("--max_new_tokens", type=int, metavar="N",
                        help="longest translation in tokens (default: the model's generation_config)")
    parser.add_argument("--max_len_a", type=float, default=DEFAULT_MAX_LEN_A, metavar="A",
                        help="bound each translation to A * source tokens + B new tokens (fairseq's max_len_a/b), "
                        f"within --max_new_tokens; 0 and 0 turn the bound off (default: {DEFAULT_MAX_LEN_A:g})")
    parser.add_argument("--max_len_b", type=float, default=DEFAULT_MAX_LEN_B, metavar="B",
                        help=f"see --max_len_a (default: {DEFAULT_MAX_LEN_B:g})")
    parser.add_argument("--batch_size", type=int, default=DEFAULT_BATCH_SIZE, metavar="N",
                        help=f"sentences per batch; inputs are sorted by length first (default: {DEFAULT_BATCH_SIZE})")
    parser.add_argument("--nbest", type=int, metavar="N",
                        help="print the N best hypotheses of each input with their scores, as blocks of "
                        "'H-<line>\\t<score>\\t<translation>' lines (N at most the beam size)")
    parser.add_argument("--print_alignment", action="store_true",
                        help="after each hypothesis, print 'A-<line>\\t<src>-<tgt> ...': the hard alignment from "
                        "the cross-attention (argmax over the source of the heads' mean), special tokens left out; "
                        "pytorch backend only")
    parser.add_argument("--alignment_unit", choices=("words", "tokens"), default="words",
                        help="what alignment indices count: whitespace-separated words (default) or tokens")
    parser.add_argument("--alignment_layer", type=int, metavar="N",
                        help="decoder layer whose cross-attention gives the alignment, 1 = first (default: the last)")


def _add_text_arguments(parser: argparse.ArgumentParser) -> None:
    """What a text is (lines, paragraphs, a file), what is protected from the model, glossaries, the output's form."""
    from ..documents import INPUT_FORMATS
    from ..protected_spans import DEFAULT_KINDS

    parser.add_argument("--input_format", choices=INPUT_FORMATS, default="lines",
                        help="lines: each line is a text and gives one output line (default); paragraphs: blocks "
                        "separated by blank lines, each translated whole and written back with the input's blank "
                        "lines; file: the whole input is one document")
    parser.add_argument("--output_format", choices=("text", "jsonl"), default="text",
                        help="text: the translations (default); jsonl: one JSON object per input text with the "
                        "source, the translation, its confidence, the protected spans and glossary terms (and "
                        "'nbest' with --nbest, 'alignment' with --print_alignment)")
    parser.add_argument("--protect", choices=("auto", "on", "off"), default="auto",
                        help="hide placeholders, markup, URLs and e-mail addresses from the model and put each back "
                        "exactly once; auto (default): on for a model trained with sentinel tokens (train.py's "
                        "--mask_protected_spans), off for any other")
    parser.add_argument("--protect_kinds", metavar="KIND[,KIND]",
                        help=f"the kinds of span to protect, comma-separated, from {','.join(DEFAULT_KINDS)} (default: "
                        "all); turns --protect auto on")
    parser.add_argument("--protect_pattern", action="append", default=[], metavar="REGEX",
                        help="also protect what this Python regular expression matches (repeatable), whatever "
                        "--protect says")
    parser.add_argument("--glossary", metavar="TSV",
                        help="a UTF-8 file of `source term<TAB>target term` lines: each source term comes out as "
                        "its target term; terms that could not be honoured are named on stderr (and in jsonl)")


# --------------------------------------------------------------------------------------------------------------
# Lines in, lines out
# --------------------------------------------------------------------------------------------------------------
def _read_file(path: str) -> str:
    with opened_for_reading(path, "input file") as handle:
        return _text(handle, f"input file {path}", FILE_NOT_UTF8, path)


FILE_NOT_UTF8 = "input file {path} is not valid UTF-8 ({reason}): convert it, e.g. `iconv -f latin1 -t utf-8`"
STDIN_NOT_UTF8 = "standard input is not valid UTF-8 ({reason}): convert it, e.g. `iconv -f latin1 -t utf-8`"
READ_CHUNK = 1 << 20  # bytes read at a time: a NUL byte is found within the first megabyte of an endless stream


def _text(handle, what: str, not_utf8: str, path: str = "") -> str:
    """All of a binary `handle` as UTF-8 text, read a chunk at a time. A UTF-8 byte-order mark at the start (what
    Windows editors write) is not text and is dropped; a NUL byte is no text either and ends the reading at once
    with one line (binary data, UTF-16, or an endless device such as /dev/zero, which would be read until memory
    ran out); invalid UTF-8 is refused with `not_utf8` (its {reason} names the byte), whichever comes first."""
    chunks, size = [], 0
    while chunk := handle.read(READ_CHUNK):
        nul = chunk.find(b"\0")
        chunks.append(chunk if nul < 0 else chunk[:nul])
        if nul >= 0:
            _decode(b"".join(chunks), not_utf8, path)  # invalid UTF-8 before the NUL byte is named first
            raise UsageError(f"{what} is binary, not text: {_nul_byte(size + nul)}")
        size += len(chunk)
    return _decode(b"".join(chunks), not_utf8, path)


def _decode(data: bytes, not_utf8: str, path: str = "") -> str:
    mark = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[mark:].decode("utf-8")
    except UnicodeDecodeError as error:
        reason = f"{error.reason} at byte {mark + error.start}"
        raise UsageError(not_utf8.format(reason=reason, path=path)) from None


def _nul_byte(where: int) -> str:
    """Where a text's first NUL byte is, and what to do about it."""
    return (f"a NUL byte at byte {where} (a binary file, or UTF-16 text); give UTF-8 text (`iconv -f utf-16 -t "
            f"utf-8` converts UTF-16)")


def _decode_stdin(data: bytes) -> str:
    """One line typed on an interactive standard input, as UTF-8."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(STDIN_NOT_UTF8.format(reason=f"{error.reason} at byte {error.start}")) from None
    if "\0" in text:
        raise UsageError(f"standard input is binary, not text: {_nul_byte(data.find(bytes(1)))}")
    return text


def _read_stdin() -> str:
    """Standard input, decoded as UTF-8 strictly: binary input gets the same message as a binary file."""
    if sys.stdin is None:
        return ""
    stream = getattr(sys.stdin, "buffer", None)
    return sys.stdin.read() if stream is None else _text(stream, "standard input", STDIN_NOT_UTF8)


def _stdin_lines():
    """The lines of an interactive standard input as they are typed (\\n-terminated only)."""
    stream = getattr(sys.stdin, "buffer", None)
    for raw in iter(stream.readline, b"") if stream is not None else sys.stdin:
        text = _decode_stdin(raw) if isinstance(raw, bytes) else raw
        yield text[:-1].removesuffix("\r") if text.endswith("\n") else text


def _write_stdout(text: str, flush: bool = True) -> None:
    try:
        sys.stdout.write(text)
        if flush:
            sys.stdout.flush()
    except BrokenPipeError:
        raise StdoutClosed from None
    except OSError as error:  # e.g. /dev/full; what is still buffered must not fail again at exit
        _silence_stdout()
        raise write_error(error, "standard output", None) from None


def _write_file(path: str, text: str) -> None:
    """`text` into `path` through a temporary file beside it, renamed into place: an earlier file of that name
    stays whole until the new one is complete."""
    target = Path(path)
    partial = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", newline="\n", dir=target.parent,
                                         prefix=f".{target.name[:100]}.", suffix=".partial", delete=False) as handle:
            partial = handle.name
            handle.write(text)
        os.replace(partial, target)
    except OSError as error:
        if partial is not None:
            with contextlib.suppress(OSError):
                os.unlink(partial)
        raise write_error(error, "output file", path) from None


def _silence_stdout() -> None:
    """Point standard output at /dev/null, so that what is still buffered cannot fail again at exit."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)


# --------------------------------------------------------------------------------------------------------------
# Options, model, output blocks
# --------------------------------------------------------------------------------------------------------------
def _decoding_options(args: argparse.Namespace):
    """The core's options from the flags, checked before anything is loaded; a bad value names its flag."""
    from ..translation_core import DecodingOptions, InvalidOption

    if args.nbest is not None and args.nbest < 1:
        raise UsageError(f"--nbest must be a whole number >= 1, got {args.nbest}")
    if args.cpu_threads is not None and args.cpu_threads < 0:
        raise UsageError(f"--cpu_threads must be a whole number >= 0 (0: adapted to the load), got {args.cpu_threads}")
    if args.backend == "ct2" and args.dtype != "auto":
        raise UsageError(f"--dtype {args.dtype} is the pytorch backend's: a CTranslate2 model keeps the precision it "
                         f"was exported in (hf-scratch-export-ct2 --quantization)")
    if args.ct2_intra_threads is not None and args.ct2_intra_threads < 0:
        raise UsageError(f"--ct2_intra_threads must be a whole number >= 0 (0: CTranslate2's default), got "
                         f"{args.ct2_intra_threads}")
    try:
        return DecodingOptions(num_beams=args.num_beams, num_return_sequences=args.nbest or 1,
                               max_new_tokens=args.max_new_tokens, max_len_a=args.max_len_a,
                               max_len_b=args.max_len_b, batch_size=args.batch_size,
                               with_scores=_block_output(args) or args.output_format == "jsonl")
    except InvalidOption as error:
        raise UsageError(_flag_message(error)) from None


def _flag_message(error) -> str:
    flag = FLAGS.get(error.name, f"--{error.name}")
    return f"{flag} must be {error.requirement}, got {error.value!r}"


def _text_options(args: argparse.Namespace):
    """The core's TextOptions from the flags: the kinds and patterns checked and the glossary file read, before
    anything is loaded; a refusal names its flag (or the glossary's file and line)."""
    from ..glossary import read_glossary
    from ..protected_spans import DEFAULT_KINDS, ProtectError, SpanProtector, compile_user_pattern
    from ..translation_core import TextOptions

    protect = {"auto": None, "on": True, "off": False}[args.protect]
    kinds = DEFAULT_KINDS
    if args.protect_kinds is not None:
        kinds = tuple(kind.strip() for kind in args.protect_kinds.split(",") if kind.strip())
        if not kinds:
            raise UsageError(f"--protect_kinds names no kind: give some of {','.join(DEFAULT_KINDS)}, or --protect off")
        protect = True if protect is None else protect
    try:
        SpanProtector(kinds)
    except ProtectError as error:
        raise UsageError(f"--protect_kinds {args.protect_kinds}: {error}") from None
    for pattern in args.protect_pattern:
        try:
            compile_user_pattern(pattern)
        except ProtectError as error:
            raise UsageError(f"--protect_pattern: {error}") from None
    glossary = read_glossary(args.glossary) if args.glossary else None
    return TextOptions(protect=protect, protect_kinds=kinds, protect_patterns=args.protect_pattern, glossary=glossary)


def _block_output(args: argparse.Namespace) -> bool:
    return args.nbest is not None or args.print_alignment


def _check_combinations(args: argparse.Namespace) -> None:
    if args.text and args.input_file:
        raise UsageError("give either TEXT arguments or --input_file, not both")
    if args.text and args.input_format != "lines":
        raise UsageError(f"--input_format {args.input_format} reads --input_file or standard input: TEXT arguments "
                         f"could be one {args.input_format} each or one document together, so give the text in a "
                         f"file (or translate the arguments one per line, without --input_format)")
    if args.protect == "off" and args.protect_kinds is not None:
        raise UsageError("--protect off protects no kind of span, but --protect_kinds names some: drop one of them "
                         "(--protect_pattern alone protects only your patterns)")
    if args.attention_all and not args.attention:
        raise UsageError("--attention_all needs --attention PNG")
    if (args.alignment_layer is not None or args.alignment_unit != "words") and not args.print_alignment:
        raise UsageError("--alignment_layer and --alignment_unit need --print_alignment")
    if args.backend == "ct2" and args.cpu_threads is not None:
        raise UsageError("--cpu_threads sets torch's threads (the pytorch backend); CTranslate2's are "
                         "--ct2_intra_threads N")
    if args.backend != "ct2" and args.ct2_intra_threads is not None:
        raise UsageError("--ct2_intra_threads sets CTranslate2's threads (--backend ct2); the pytorch backend's are "
                         "--cpu_threads N")
    if args.backend == "ct2" and args.attention:
        raise UsageError("--attention needs the default backend (CTranslate2 returns no attention weights here)")
    if args.backend == "ct2" and args.print_alignment:
        raise UsageError("--print_alignment needs the default backend (the alignment is read from the PyTorch model's "
                         "cross-attention): drop --backend ct2")


def _load(args: argparse.Namespace, options):
    """(backend, tokenizer, model or None for ct2); the beam size and --alignment_layer checked against them."""
    if args.backend == "ct2":
        backend = _load_ct2(args)
        tokenizer, model = backend.tokenizer, None
    else:
        from ..cpu_threads import thread_tuner
        from .translate import load_model_and_tokenizer, pick_device
        from ..translation_core import TorchBackend

        try:
            model, tokenizer = load_model_and_tokenizer(args.model, pick_device(args.device), dtype=args.dtype)
        except ValueError as error:  # an invalid --device (a model that cannot be loaded is a ModelLoadError)
            raise UsageError(str(error)) from None
        backend = TorchBackend(model)
        backend.threads = thread_tuner(next(model.parameters()).device, "translation", args.cpu_threads or 0)
        if backend.threads is not None:
            backend.threads.activate()
    from ..translation_core import InvalidOption

    try:
        options.beams(backend.generation_config)
    except InvalidOption as error:
        raise UsageError(_flag_message(error)) from None
    layers = getattr(getattr(model, "config", None), "decoder_layers", None)
    if args.alignment_layer is not None and layers and not 1 <= args.alignment_layer <= layers:
        raise UsageError(f"--alignment_layer must be a decoder layer, 1 to {layers}, got {args.alignment_layer}")
    return backend, tokenizer, model


def _load_ct2(args: argparse.Namespace):
    from .ct2_backend import CT2Backend, ct2_device

    device, device_index = ct2_device(args.device)
    backend = CT2Backend(args.model, device=device, device_index=device_index,
                         intra_threads=args.ct2_intra_threads or 0)
    config = backend.generation_config
    beams = args.num_beams if args.num_beams is not None else (config.num_beams or 1)
    if beams > 1 and config.early_stopping is not True:
        print("note: CTranslate2's beam search stops when num_beams hypotheses have ended, as generate() does with "
              f"early_stopping=True; this model's generation_config has early_stopping={config.early_stopping!r}",
              file=sys.stderr)
    return backend


def _block(number: int, translation, args: argparse.Namespace, model, tokenizer) -> list[str]:
    """The H (and A) lines of one input text, with --nbest / --print_alignment."""
    if not translation.hypotheses:  # a blank input: one empty hypothesis keeps it visible
        return [f"H-{number}\t\t"] + ([f"A-{number}\t"] if args.print_alignment else [])
    from ..translation_core import format_alignment

    lines = []
    for rank, hypothesis in enumerate(translation.hypotheses):
        score = "" if hypothesis.score is None else f"{hypothesis.score:.4f}"
        lines.append(f"H-{number}\t{score}\t{_one_line(hypothesis.text)}")
        if args.print_alignment:
            lines.append(f"A-{number}\t{format_alignment(_alignment(translation, rank, args, model, tokenizer))}")
    return lines


def _alignment(translation, rank: int, args: argparse.Namespace, model, tokenizer) -> list[tuple[int, int]]:
    from ..translation_core import text_alignment

    layer = -1 if args.alignment_layer is None else args.alignment_layer - 1
    return text_alignment(model, tokenizer, translation, rank, layer, args.alignment_unit)


def json_record(number: int, translation, args: argparse.Namespace, model=None, tokenizer=None) -> dict:
    """The --output_format jsonl object of input text `number` (from 1): "id", "source", "translation",
    "confidence" (the mean log-probability per token, None for a text the model was not given), "spans" and
    "glossary" (how each protected span and glossary term came back: TextTranslation's reports); with --nbest,
    "nbest": [{"text", "score", "confidence"}] best first; with --print_alignment, "alignment" ([source, target]
    pairs of the best, as the A lines count them), also in each n-best entry."""
    record = {"id": number, "source": translation.source, "translation": translation.text,
              "confidence": translation.confidence, "spans": translation.spans, "glossary": translation.glossary}
    if args.nbest is not None:
        record["nbest"] = [{"text": h.text, "score": h.score, "confidence": h.confidence}
                           for h in translation.hypotheses]
    if args.print_alignment:
        record["alignment"] = _alignment(translation, 0, args, model, tokenizer) if translation.hypotheses else []
        for rank, entry in enumerate(record.get("nbest", [])):
            entry["alignment"] = _alignment(translation, rank, args, model, tokenizer)
    return record


def _json_line(record: dict) -> str:
    """One JSON line, UTF-8 as it is, with the three characters `str.splitlines()` would cut at escaped too (JSON
    escapes the control characters already)."""
    text = json.dumps(record, ensure_ascii=False)
    return text.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029") + "\n"


def _output(args: argparse.Namespace, layout, found: list, model, tokenizer, first: int = 1) -> str:
    """What is written for the texts of `layout` and their translations `found` (numbered from `first`): JSON
    lines, H/A blocks, or the translations in the input's frame (one line each for --input_format lines)."""
    numbered = list(enumerate(found, start=first))
    if args.output_format == "jsonl":
        return "".join(_json_line(json_record(n, t, args, model, tokenizer)) for n, t in numbered)
    if _block_output(args):
        return "".join(line + "\n" for n, t in numbered for line in _block(n, t, args, model, tokenizer))
    one_line = args.input_format == "lines"
    return layout.join([_one_line(t.text) if one_line else t.text for t in found])


def _warn_unhonoured(found: list, args: argparse.Namespace, first: int = 1) -> None:
    """One line on stderr when some glossary term occurrences are not in the translation (jsonl names each)."""
    entries = [(number, entry) for number, translation in enumerate(found, start=first)
               for entry in translation.glossary]
    missed = [(number, entry) for number, entry in entries if not entry["honoured"]]
    if missed:
        number, entry = missed[0]
        unit = {"lines": "line", "paragraphs": "paragraph", "file": "text"}[args.input_format]
        print(f"warning: {len(missed)} of {len(entries)} glossary term occurrence(s) could not be honoured (first: "
              f"{unit} {number}, {entry['source']!r} -> {entry['target']!r}: {entry['how']}); --output_format jsonl "
              f"reports each", file=sys.stderr)


def _one_line(text: str) -> str:
    """A translation as one output line: a line break kept from the input's white space (a lone \\r between two
    sentences) printed as a space, as in the model's own output."""
    return text.replace("\r\n", " ").replace("\r", " ").replace("\n", " ")


def _first_unit(translation) -> tuple[str, list[int]] | None:
    """(what the model read, the best token ids) of a text's first translated unit: what --attention draws."""
    for segment in translation.segments:
        if segment.hypotheses and segment.hypotheses[0].token_ids:
            return segment.model_text, segment.hypotheses[0].token_ids
    return None


# --------------------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------------------
def _run(args: argparse.Namespace) -> int:
    options = _decoding_options(args)  # every value checked before the model is loaded
    _check_combinations(args)
    reading = _text_options(args)  # kinds, patterns and the glossary too
    layout, interactive = _read_input(args)  # before loading the model: a wrong path or a binary file fails fast
    if not args.debug:
        _quiet_libraries()
    backend, tokenizer, model = _load(args, options)
    if interactive:  # a terminal: translate each line as it is typed
        _translate_interactively(args, backend, tokenizer, model, options, reading)
    else:
        _translate_all(args, backend, tokenizer, model, layout, options, reading)
    return 0


def _read_input(args: argparse.Namespace):
    """(layout of the input texts, interactive): TEXT arguments (one line each), --input_file or piped stdin read
    as --input_format says; a terminal on stdin is interactive (line by line)."""
    from ..documents import Layout, Unit, split_input

    if args.text:
        return Layout("", [Unit(text, "\n") for text in args.text]), False
    if args.input_file:
        return split_input(_read_file(args.input_file), args.input_format), False
    if args.input_format == "lines" and sys.stdin is not None and sys.stdin.isatty() and not args.output_file:
        return None, True
    return split_input(_read_stdin(), args.input_format), False


def _quiet_libraries() -> None:
    """No advisory warnings, progress bars or info logs of transformers and the hub (--debug keeps them)."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        import huggingface_hub.utils

        huggingface_hub.utils.logging.set_verbosity_error()
    except (ImportError, AttributeError):
        pass


def _threads_hook(backend):
    """The adaptive CPU-thread policy's measurement of each batch (None for CTranslate2 and fixed counts)."""
    threads = getattr(backend, "threads", None)
    return threads.record if threads is not None else None


def _translate_interactively(args, backend, tokenizer, model, options, reading) -> None:
    """Translate each line of the terminal as it is typed (the first one drawn with --attention)."""
    from ..documents import Layout, Unit
    from ..translation_core import translate_texts

    print("Type a sentence and press Enter (Ctrl-D to quit).", file=sys.stderr)
    drawn = False
    for line_number, text in enumerate(_stdin_lines(), start=1):
        found = translate_texts(backend, tokenizer, [text], options, reading, on_batch=_threads_hook(backend))
        _write_stdout(_output(args, Layout("", [Unit(text, "\n")]), found, model, tokenizer, first=line_number))
        _warn_unhonoured(found, args, first=line_number)
        unit = _first_unit(found[0])
        if args.attention and unit and (args.attention_all or not drawn):
            [(_, path)] = _attention_paths(args.attention, [line_number], args.attention_all)
            _draw(model, tokenizer, *unit, path)
            drawn = True


def _translate_all(args, backend, tokenizer, model, layout, options, reading) -> None:
    """Translate every text (sorted batches, written in input order), then draw the attention plots asked for."""
    from ..translation_core import translate_texts

    progress = bool(args.input_file) and not args.no_progress
    found = translate_texts(backend, tokenizer, [unit.text for unit in layout.units], options, reading,
                            progress=progress, on_batch=_threads_hook(backend))
    output = _output(args, layout, found, model, tokenizer)
    if args.output_file:
        _write_file(args.output_file, output)
    else:
        _write_stdout(output)
    _warn_unhonoured(found, args)
    if args.attention:
        units = {i + 1: _first_unit(translation) for i, translation in enumerate(found)}
        numbers = [number for number, unit in units.items() if unit]
        if not numbers:
            print("warning: no non-empty input sentence, so no attention plot was drawn", file=sys.stderr)
        for number, path in _attention_paths(args.attention, numbers, args.attention_all):
            _draw(model, tokenizer, *units[number], path)


def _attention_paths(base: str, line_numbers: list[int], every: bool) -> list[tuple[int, Path]]:
    base_path = Path(base)
    if not every:
        return [(line_numbers[0], base_path)] if line_numbers else []
    suffix = base_path.suffix or ".png"
    return [(n, base_path.with_name(f"{base_path.stem}-{n}{suffix}")) for n in line_numbers]


def _draw(model, tokenizer, text: str, ids: list[int], path: Path) -> None:
    from .. import plotting

    title = text if len(text) <= 90 else text[:87] + "..."
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Glyph .* missing from font")  # CJK, emoji: drawn as boxes
            plotting.plot_translation_attention(model, tokenizer, text, ids, path, title=title)
    except TypeError as error:
        raise UsageError(f"this model cannot return attention weights ({error})") from None
    except OSError as error:
        raise write_error(error, "attention plot", path) from None
    print(f"attention plot written to {path}", file=sys.stderr)


def _refuse_relative_paths(args: argparse.Namespace) -> None:
    """Run from a deleted working directory, relative paths cannot be found (absolute ones still work)."""
    for flag, value in (("--model", args.model), ("--input_file", args.input_file), ("--glossary", args.glossary),
                        ("--output_file", args.output_file), ("--attention", args.attention)):
        if value and not os.path.isabs(os.path.expanduser(value)) and (flag != "--model" or os.sep in value):
            raise UsageError(f"the working directory was deleted, so {flag} {value} cannot be found: cd to an existing "
                             f"directory or give an absolute path")


def main(argv: list[str] | None = None) -> int:
    """Run the command with `argv` (default: sys.argv[1:]); returns the exit status."""
    args = build_parser().parse_args(argv)
    return run_command("hf-scratch-translate", lambda: _run_until_the_reader_leaves(args), debug=args.debug)


def _run_until_the_reader_leaves(args) -> int:
    """`_run`, ended quietly (exit 0) when the reader of standard output leaves (piped into `head`: the reader has
    what it wanted)."""
    try:
        if not working_directory_exists():
            _refuse_relative_paths(args)
        return _run(args)
    except StdoutClosed as closed:
        _silence_stdout()
        return exit_code(closed)


if __name__ == "__main__":
    sys.exit(main())
