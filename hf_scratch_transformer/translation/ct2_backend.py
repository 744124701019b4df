"""CTranslate2 as a backend of the translation core: `CT2Backend` translates with a directory written by
`hf-scratch-export-ct2` (export/ct2.py), for `hf-scratch-translate --backend ct2`.

    backend = CT2Backend("outputs/ct2-int8", intra_threads=2)
    translate_batches(backend, backend.tokenizer, ["Jesus wept."], DecodingOptions(num_beams=4))

Such a directory holds the CTranslate2 model (`model.bin`, `config.json`, `shared_vocabulary.json`: the tokens in id
order), the tokenizer files, the model's `generation_config.json` and `hf_scratch_transformer_ct2.json` (what was
exported, from where). This module owns that format's names (INFO_FILE, `vocabulary_tokens`), which the exporter
writes.

CTranslate2 is an optional dependency: `pip install hf-scratch-transformer[ct2]`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import UsageError

INSTALL_HINT = "pip install hf-scratch-transformer[ct2]"
INFO_FILE = "hf_scratch_transformer_ct2.json"
# generation_config fields the CTranslate2 backend cannot honour: refused rather than silently ignored
UNSUPPORTED_GENERATION = {
    "do_sample": False, "num_beam_groups": 1, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
}


class CT2Error(UsageError, ValueError):
    """A model CTranslate2 cannot load, export or translate with (a ValueError too); the message is one line meant
    for a user."""


class CT2NotInstalledError(CT2Error, ImportError):
    """The optional `ctranslate2` package is missing."""


def require_ctranslate2():
    """The `ctranslate2` module, or CT2NotInstalledError with the install command."""
    try:
        import ctranslate2
    except ImportError as error:
        raise CT2NotInstalledError(
            f"CTranslate2 is not installed ({error}): install it with `{INSTALL_HINT}`"
        ) from None
    return ctranslate2


def vocabulary_tokens(tokenizer, size: int) -> list[str]:
    """The tokenizer's tokens in id order, `size` of them: ids the tokenizer lacks (embeddings padded to a
    multiple) get unique placeholders, which the model never sees in input and practically never generates."""
    from ..translation_core import check_tokenizer_fits

    try:
        check_tokenizer_fits(tokenizer, size)
    except ValueError as error:
        raise CT2Error(str(error)) from None
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    taken = set(by_id.values())
    tokens = []
    for index in range(size):
        token = by_id.get(index)
        if token is None:
            token = f"<unused_{index}>"
            while token in taken:
                token = "_" + token
            taken.add(token)
        tokens.append(token)
    return tokens


def ct2_device(requested: str | None = None) -> tuple[str, int]:
    """(CTranslate2 device, device index) for a --device value such as "cpu", "cuda" or "cuda:1"; without one,
    cuda when CTranslate2 sees a GPU, else cpu."""
    ctranslate2 = require_ctranslate2()
    if not requested:
        return ("cuda", 0) if ctranslate2.get_cuda_device_count() > 0 else ("cpu", 0)
    kind, _, index = requested.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise CT2Error(f"invalid --device {requested!r} for the ct2 backend: use cpu, cuda or cuda:N")
    if kind == "cuda" and ctranslate2.get_cuda_device_count() <= int(index or 0):
        raise CT2Error(f"--device {requested!r} asked for, but CTranslate2 sees no such CUDA device here")
    return kind, int(index or 0)


class CT2Backend:
    """A directory written by `export_ct2`, loaded: the CTranslate2 backend of the translation core
    (translation_core.translate_batches), with the tokenizer saved beside it (`.tokenizer`).

    `intra_threads`: CTranslate2's threads for one batch on a CPU (0: CTranslate2's default). Batches go to it one
    at a time, so its `inter_threads` (batches translated in parallel) is 1.

    Decoding settings come from the exported generation_config.json: greedy or beam search, the length limit,
    `min_length`, `length_penalty`, `repetition_penalty` and `no_repeat_ngram_size`; settings CTranslate2 cannot
    honour (sampling, forced or suppressed tokens...) are refused at load. CTranslate2 bounds only a whole batch,
    so the core gives it batches of sentences with one bound (`per_row_bounds = False`). Its beam search stops
    once `num_beams` hypotheses have ended, which is `generate(..., early_stopping=True)` (what train.py saves).
    Its scores (`return_scores`) give the core's confidence, and its attention (`cross_attention`) places protected
    spans and glossary terms by alignment, as with the PyTorch backend.
    """

    per_row_bounds = False

    def __init__(self, model_dir, device: str = "cpu", device_index: int = 0, compute_type: str = "default",
                 intra_threads: int = 0):
        ctranslate2 = require_ctranslate2()
        from transformers import GenerationConfig

        from ..translation_core import check_tokenizer_fits
        from .translate import load_tokenizer

        path = Path(model_dir).expanduser()
        _check_ct2_dir(path, model_dir)
        try:
            self.translator = ctranslate2.Translator(str(path), device=device, device_index=device_index,
                                                     compute_type=compute_type, intra_threads=intra_threads,
                                                     inter_threads=1)
        except (RuntimeError, ValueError) as error:
            raise CT2Error(f"cannot load the CTranslate2 model in {model_dir}: {error}") from None
        self.tokenizer = load_tokenizer(str(path), os.fspath(model_dir))
        has_config = (path / "generation_config.json").is_file()
        self.generation_config = GenerationConfig.from_pretrained(str(path)) if has_config else GenerationConfig()
        _check_generation_config(self.generation_config)
        info = _read_json(path / INFO_FILE, {})
        self.tokens = _read_json(path / "shared_vocabulary.json", None) or vocabulary_tokens(self.tokenizer,
                                                                                              len(self.tokenizer))
        self.index = {token: i for i, token in enumerate(self.tokens)}
        self.vocab_size = len(self.tokens)
        self.max_positions = info.get("max_position_embeddings")
        try:
            check_tokenizer_fits(self.tokenizer, self.vocab_size)
        except ValueError as error:
            raise CT2Error(f"{model_dir}: {error}") from None

    def generate(self, source_ids: list[list[int]], bounds: list[int], num_beams: int, num_return_sequences: int,
                 with_scores: bool) -> list[list[tuple[list[int], float | None]]]:
        """Per source, `num_return_sequences` (token ids, score) pairs, best first; `bounds` are all equal."""
        gc = self.generation_config
        min_new_tokens = gc.min_new_tokens if gc.min_new_tokens is not None else max((gc.min_length or 0) - 1, 0)
        results = self.translator.translate_batch(
            [[self.tokens[token_id] for token_id in ids] for ids in source_ids],
            beam_size=num_beams, num_hypotheses=num_return_sequences, max_decoding_length=max(bounds),
            min_decoding_length=min_new_tokens,
            length_penalty=gc.length_penalty if gc.length_penalty is not None else 1.0,
            repetition_penalty=gc.repetition_penalty if gc.repetition_penalty is not None else 1.0,
            no_repeat_ngram_size=gc.no_repeat_ngram_size or 0, patience=1, return_scores=with_scores,
            return_end_token=True,  # ids end with </s> as generate()'s do; its length normalisation counts it too
            max_input_length=0, max_batch_size=0,  # the core has cut and batched the inputs
        )
        return [[([self.index[token] for token in hypothesis], score if with_scores else None)
                 for hypothesis, score in zip(result.hypotheses, result.scores or [None] * len(result.hypotheses))]
                for result in results]


    def cross_attention(self, source_ids: list[list[int]], target_ids: list[list[int]]) -> list:
        """Per (source, translation) pair, the cross-attention CTranslate2 returns (`return_attention`) with the
        translation forced as the target prefix, a (T, S) tensor: row t is what the step that produced target token t
        attended to, as the core's alignment needs it. CTranslate2 gives the mean of the model's alignment heads of
        its last decoder layer; hf-scratch-export-ct2 exports CTranslate2's default of one alignment head, so it is
        that layer's first head (the PyTorch backend averages all of them)."""
        import torch

        results = self.translator.translate_batch(
            [[self.tokens[token_id] for token_id in ids] for ids in source_ids],
            target_prefix=[[self.tokens[token_id] for token_id in ids] for ids in target_ids],
            beam_size=1, max_decoding_length=max(map(len, target_ids)), min_decoding_length=0, return_attention=True,
            return_end_token=True, max_input_length=0, max_batch_size=0,
        )
        return [torch.tensor(result.attention[0], dtype=torch.float32)[: len(target), : len(source)]
                for result, source, target in zip(results, source_ids, target_ids)]


def _read_json(path: Path, default):
    """The JSON in `path`, `default` when there is no such file; a file that is not JSON is named in one line."""
    if not path.is_file():
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CT2Error(f"{path} is not readable JSON ({error}): export the model again") from None


def _check_ct2_dir(path: Path, name) -> None:
    """A local directory (never a hub id) holding a CTranslate2 model and tokenizer files."""
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist (no such directory)"
        raise CT2Error(f"model directory not found: {name} {what}; the ct2 backend reads a local directory "
                       f"written by hf-scratch-export-ct2")
    if not (path / "model.bin").is_file():
        raise CT2Error(f"{name} is not a CTranslate2 model directory (no model.bin): export it first with "
                       f"hf-scratch-export-ct2 --model {name} --output_dir DIR")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CT2Error(f"no tokenizer files in {name}: was it written by hf-scratch-export-ct2?")


def _check_generation_config(generation_config) -> None:
    """Refuse the generation_config settings CTranslate2 cannot honour, rather than ignore them."""
    for name, default in UNSUPPORTED_GENERATION.items():
        value = getattr(generation_config, name, default)
        if value not in (default, None):
            raise CT2Error(f"generation_config sets {name}={value!r}, which the CTranslate2 backend does not "
                           f"support")


__all__ = ["CT2Backend", "CT2Error", "CT2NotInstalledError", "INFO_FILE", "INSTALL_HINT", "ct2_device",
           "require_ctranslate2", "vocabulary_tokens"]
