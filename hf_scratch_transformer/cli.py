"""`hf-scratch-translate`: translate from the command line, and optionally draw what the model attends to.

    hf-scratch-translate --model runs/en-es "In the beginning God created the heavens and the earth."
    echo "Jesus wept." | hf-scratch-translate --model runs/en-es
    hf-scratch-translate --model runs/en-es --input_file test.en --output_file test.es --num_beams 5
    hf-scratch-translate --model runs/en-es "Jesus wept." --attention attention.png
    hf-scratch-translate --backend ct2 --model runs/en-es-ct2 "Jesus wept."   # see hf-scratch-export-ct2

Also runnable as `python -m hf_scratch_transformer.cli`. Errors (missing model, unreadable input) print one line on
stderr and exit with status 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class CLIError(Exception):
    """An error the user can fix (bad path, bad option): one line on stderr, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-scratch-translate",
        description="Translate text with a saved hf_scratch_transformer model (or any transformers seq2seq model). "
        "Input comes from the TEXT arguments, else from --input_file, else from stdin, one sentence per line; "
        "each input line gives exactly one output line (empty lines stay empty).",
        epilog="examples:\n"
        "  hf-scratch-translate --model runs/en-es \"Jesus wept.\"\n"
        "  echo \"Jesus wept.\" | hf-scratch-translate --model runs/en-es\n"
        "  hf-scratch-translate --model runs/en-es --input_file test.en --output_file test.es --num_beams 5\n"
        "  hf-scratch-translate --model runs/en-es \"Jesus wept.\" --attention attention.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("text", nargs="*", metavar="TEXT", help="sentences to translate (one output line each)")
    parser.add_argument("--model", "-m", required=True, metavar="DIR",
                        help="directory written by save_pretrained (or a hub id, where the hub is reachable)")
    parser.add_argument("--input_file", "-i", metavar="FILE", help="translate FILE (UTF-8), one sentence per line")
    parser.add_argument("--output_file", "-o", metavar="FILE",
                        help="write translations to FILE instead of stdout (one line per input line)")
    parser.add_argument("--num_beams", type=int, metavar="N", help="beam size (default: the model's generation_config)")
    parser.add_argument("--max_new_tokens", type=int, metavar="N",
                        help="longest translation in tokens (default: the model's generation_config)")
    parser.add_argument("--max_len_a", type=float, default=1.5, metavar="A",
                        help="bound each translation to A * source tokens + B new tokens (fairseq's max_len_a/b), "
                        "within --max_new_tokens; 0 and 0 turn the bound off (default: 1.5)")
    parser.add_argument("--max_len_b", type=float, default=10, metavar="B", help="see --max_len_a (default: 10)")
    parser.add_argument("--batch_size", type=int, default=32, metavar="N",
                        help="sentences per generate() call; inputs are sorted by length first (default: 32)")
    parser.add_argument("--device", metavar="DEVICE",
                        help="cpu, cuda, cuda:1, mps... (default: cuda if available, else mps, else cpu)")
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


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", newline=None) as handle:
            return handle.read().splitlines()
    except FileNotFoundError:
        raise CLIError(f"input file not found: {path}") from None
    except IsADirectoryError:
        raise CLIError(f"input file is a directory: {path}") from None
    except UnicodeDecodeError as error:
        raise CLIError(f"input file is not valid UTF-8: {path} ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise CLIError(f"cannot read input file {path}: {error.strerror or error}") from None


def _read_stdin() -> list[str]:
    """Standard input, decoded as UTF-8 strictly: binary input gets the same message as a binary file."""
    if sys.stdin is None:
        return []
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # replaced by a text-only object (tests, embedding)
        return sys.stdin.read().splitlines()
    data = stream.read()
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise CLIError(f"standard input is not valid UTF-8 ({error.reason} at byte {error.start}): convert it, "
                       f"e.g. `iconv -f latin1 -t utf-8`") from None


def _write_lines(path: str | None, lines: list[str]) -> None:
    if path is None:
        for line in lines:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="\n") as handle:
            handle.writelines(line + "\n" for line in lines)
    except OSError as error:
        raise CLIError(f"cannot write output file {path}: {error.strerror or error}") from None


def _attention_paths(base: str, line_numbers: list[int], every: bool) -> list[tuple[int, Path]]:
    base_path = Path(base)
    if not every:
        return [(line_numbers[0], base_path)] if line_numbers else []
    suffix = base_path.suffix or ".png"
    return [(n, base_path.with_name(f"{base_path.stem}-{n}{suffix}")) for n in line_numbers]


def _run(args: argparse.Namespace) -> int:
    _check_options(args)
    texts, interactive = _read_input(args)  # before loading the model: a wrong path fails fast
    if not args.debug:
        _quiet_libraries()
    if args.backend == "ct2":
        return _run_ct2(args, texts, interactive)
    from .translate import ModelLoadError, load_model_and_tokenizer, pick_device

    try:
        device = pick_device(args.device)
    except ValueError as error:
        raise CLIError(str(error)) from None
    try:
        model, tokenizer = load_model_and_tokenizer(args.model, device)
    except ModelLoadError as error:
        raise CLIError(str(error)) from None
    options = dict(batch_size=args.batch_size, num_beams=args.num_beams, max_new_tokens=args.max_new_tokens,
                   device=device, max_len_a=args.max_len_a, max_len_b=args.max_len_b)
    if interactive:  # a terminal: translate each line as it is typed
        _translate_interactively(args, model, tokenizer, options)
    else:
        _translate_all(args, model, tokenizer, texts, options)
    return EXIT_OK


def _check_options(args: argparse.Namespace) -> None:
    if args.batch_size < 1:
        raise CLIError(f"--batch_size must be at least 1, got {args.batch_size}")
    if args.num_beams is not None and args.num_beams < 1:
        raise CLIError(f"--num_beams must be at least 1, got {args.num_beams}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise CLIError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    if args.max_len_a < 0 or args.max_len_b < 0:
        raise CLIError(f"--max_len_a and --max_len_b must be >= 0, got {args.max_len_a} and {args.max_len_b}")
    if args.text and args.input_file:
        raise CLIError("give either TEXT arguments or --input_file, not both")
    if args.attention_all and not args.attention:
        raise CLIError("--attention_all needs --attention PNG")


def _read_input(args: argparse.Namespace) -> tuple[list[str], bool]:
    """(texts, interactive): TEXT arguments, --input_file or piped stdin; a terminal on stdin is interactive."""
    if args.text:
        return list(args.text), False
    if args.input_file:
        return _read_lines(args.input_file), False
    if sys.stdin is not None and sys.stdin.isatty() and not args.output_file:
        return [], True
    return _read_stdin(), False


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


def _translate_interactively(args: argparse.Namespace, model, tokenizer, options: dict) -> None:
    """Translate each line of the terminal as it is typed (the first one drawn with --attention)."""
    from .translate import decode_ids, generate_ids

    print("Type a sentence and press Enter (Ctrl-D to quit).", file=sys.stderr)
    line_number, drawn = 0, False
    for line in sys.stdin:
        line_number += 1
        text = line.rstrip("\r\n")
        [ids] = generate_ids(model, tokenizer, [text], **options)
        print(decode_ids(tokenizer, ids), flush=True)
        if args.attention and ids and (args.attention_all or not drawn):
            [(_, path)] = _attention_paths(args.attention, [line_number], args.attention_all)
            _draw(model, tokenizer, text, ids, path)
            drawn = True


def _translate_all(args: argparse.Namespace, model, tokenizer, texts: list[str], options: dict) -> None:
    """Translate every text (sorted batches, written in input order), then draw the attention plots asked for."""
    from .translate import decode_ids, generate_ids

    progress = bool(args.input_file) and not args.no_progress
    all_ids = generate_ids(model, tokenizer, texts, progress=progress, **options)
    _write_lines(args.output_file, [decode_ids(tokenizer, ids) for ids in all_ids])
    if args.attention:
        line_numbers = [i + 1 for i, ids in enumerate(all_ids) if ids]
        if not line_numbers:
            print("warning: no non-empty input sentence, so no attention plot was drawn", file=sys.stderr)
        for line_number, path in _attention_paths(args.attention, line_numbers, args.attention_all):
            _draw(model, tokenizer, texts[line_number - 1], all_ids[line_number - 1], path)


def _run_ct2(args: argparse.Namespace, texts: list[str], interactive: bool) -> int:
    """`--backend ct2`: the same input, output and batching as the default backend, decoded by CTranslate2."""
    from .export_ct2 import CT2ExportError, CT2Translator, ct2_device

    if args.attention:
        raise CLIError("--attention needs the default backend (CTranslate2 returns no attention weights here)")
    try:
        device, device_index = ct2_device(args.device)
        translator = CT2Translator(args.model, device=device, device_index=device_index)
        translator.decoding_options(args.num_beams, args.max_new_tokens)  # refuse unsupported settings up front
    except (CT2ExportError, ValueError) as error:
        raise CLIError(str(error)) from None
    options = dict(batch_size=args.batch_size, num_beams=args.num_beams, max_new_tokens=args.max_new_tokens)
    beams = args.num_beams if args.num_beams is not None else (translator.generation_config.num_beams or 1)
    if beams > 1 and translator.generation_config.early_stopping is not True:
        print("note: CTranslate2's beam search stops when num_beams hypotheses have ended, as generate() does with "
              "early_stopping=True; this model's generation_config has early_stopping="
              f"{translator.generation_config.early_stopping!r}", file=sys.stderr)
    if interactive:
        print("Type a sentence and press Enter (Ctrl-D to quit).", file=sys.stderr)
        for line in sys.stdin:
            print(translator.translate([line.rstrip("\r\n")], **options)[0], flush=True)
        return EXIT_OK
    progress = bool(args.input_file) and not args.no_progress
    _write_lines(args.output_file, translator.translate(texts, progress=progress, **options))
    return EXIT_OK


def _draw(model, tokenizer, text: str, ids: list[int], path: Path) -> None:
    from . import plotting

    title = text if len(text) <= 90 else text[:87] + "..."
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Glyph .* missing from font")  # CJK, emoji: drawn as boxes
            plotting.plot_translation_attention(model, tokenizer, text, ids, path, title=title)
    except TypeError as error:
        raise CLIError(f"this model cannot return attention weights ({error})") from None
    except OSError as error:
        raise CLIError(f"cannot write attention plot {path}: {error.strerror or error}") from None
    print(f"attention plot written to {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the command with `argv` (default: sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except CLIError as error:
        if args.debug:
            raise
        print(f"hf-scratch-translate: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into `head`
        return EXIT_OK
    except Exception as error:  # noqa: BLE001
        if args.debug:
            raise
        message = " ".join(str(error).split())[:500]
        print(f"hf-scratch-translate: error: {type(error).__name__}: {message} (run with --debug for the traceback)",
              file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
