"""Batched translation of many texts: what the `hf-scratch-translate` command runs, importable on its own.

    >>> model, tokenizer = load_model_and_tokenizer("path/to/saved_model")             # doctest: +SKIP
    >>> translate_texts(model, tokenizer, ["In the beginning.", "", "Jesus wept."])     # doctest: +SKIP
    ['En el principio.', '', 'Jesús lloró.']

Texts are sorted by length and cut into batches (little padding, so less wasted compute), translated with
`generate()`, then put back in input order. Empty (or whitespace-only) texts are never given to the model:
they translate to empty strings, so line N of the output always belongs to line N of the input.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

logger = logging.getLogger("hf_scratch_transformer")

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_WEIGHT_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


class ModelLoadError(RuntimeError):
    """The model or its tokenizer could not be loaded; the message is one line meant for a user."""


def pick_device(requested: str | None = None) -> torch.device:
    """`requested` if given (e.g. "cpu", "cuda:1"), else cuda if available, else mps if available, else cpu."""
    if requested:
        try:
            device = torch.device(requested)
        except RuntimeError as error:
            raise ValueError(f"invalid --device {requested!r}: {error}") from error
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {requested!r} asked for, but CUDA is not available here")
        if device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise ValueError(f"--device {requested!r} asked for, but MPS is not available here")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _looks_like_local_path(name: str) -> bool:
    """True for a name meant as a local path, which is then never looked up on the hub (offline, that lookup takes
    most of a minute to fail): it starts with ".", "~" or a separator, holds a backslash or more than one "/",
    ends in a file suffix such as .safetensors, or its first component is a local directory (`outputs/nothere` where
    ./outputs exists), or it has no "/" at all. Only a remaining "owner/name" is tried as a hub id."""
    first = name.split("/", 1)[0]
    return (
        name.startswith((".", "~", os.sep, "/"))
        or (os.altsep is not None and os.altsep in name)
        or "\\" in name
        or name.count("/") != 1
        or Path(name).suffix in (".safetensors", ".bin", ".json")
        or (bool(first) and Path(first).expanduser().is_dir())
    )


def load_model_and_tokenizer(name_or_path: str | os.PathLike, device: torch.device | str | None = None,
                             config_overrides: dict | None = None):
    """(model in eval mode on `device`, tokenizer) from a saved directory or a hub id.

    `config_overrides` (e.g. `{"dropout": 0.2}`) replace fields of the saved config before the model is built.

    Raises `ModelLoadError` with a one-line message for a missing directory, a directory without (safetensors)
    weights, truncated or corrupted weights, a config of a model type that does not translate, a tokenizer with more
    tokens than the model's embeddings, or a hub id that cannot be fetched. Weights are read from safetensors only,
    and no code from the directory is run (trust_remote_code=False: the package's own classes are used).
    """
    import hf_scratch_transformer  # noqa: F401  (registers the Auto classes: no trust_remote_code needed)
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        _check_model_dir(path, name)
        source = str(path)
    elif path.exists():
        raise ModelLoadError(f"--model must be a directory saved with save_pretrained, got the file {name}")
    elif _looks_like_local_path(name):
        raise ModelLoadError(f"model directory not found: {name} (a local path, so the hub was not asked)")
    else:
        source = name  # perhaps a hub id
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
        model, info = AutoModelForSeq2SeqLM.from_pretrained(source, use_safetensors=True, trust_remote_code=False,
                                                            output_loading_info=True, **(config_overrides or {}))
    except Exception as error:  # noqa: BLE001  (hub, network and format errors all end up here)
        reason = " ".join(str(error).split())[:300]
        if source is name and not path.exists():
            raise ModelLoadError(
                f"model not found: {name} is not a local directory and could not be loaded from the hub ({reason})"
            ) from error
        raise ModelLoadError(f"cannot load the model in {name}: {type(error).__name__}: {reason}") from error
    _check_loaded(model, tokenizer, info, name)
    if device is not None:
        model.to(device)
    model.eval()
    return model, tokenizer


def _check_model_dir(path: Path, name: str) -> None:
    """A saved model directory holds safetensors weights that open, config.json of a translation model and a
    tokenizer; the first thing missing or broken is named."""
    if not any((path / weights).is_file() for weights in WEIGHT_FILES):
        if any((path / weights).is_file() for weights in PICKLE_WEIGHT_FILES):
            raise ModelLoadError(
                f"{name} holds only pickled weights (pytorch_model.bin), which can run code when loaded: only "
                f"model.safetensors is read; convert them with save_pretrained(..., safe_serialization=True)"
            )
        raise ModelLoadError(
            f"no model weights in {name} (expected model.safetensors): is it a saved model directory?"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no config.json in {name}: is it a saved model directory?")
    _check_model_type(path / "config.json")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"no tokenizer in {name} (expected tokenizer.json): copy the tokenizer files saved with the model "
            f"(tokenizer.json, tokenizer_config.json) into it"
        )
    for weights in sorted(path.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem:
            raise ModelLoadError(
                f"{weights} is truncated or corrupted ({problem}): copy or download it again"
            )


def _check_loaded(model, tokenizer, info: dict, name: str) -> None:
    """Weights that fit the config, and a tokenizer that fits the embeddings (train.py saves them equal)."""
    missing = list(info.get("missing_keys") or [])
    packed = [key for key in info.get("unexpected_keys") or [] if key.endswith(("qkv_proj.weight", "kv_proj.weight"))]
    if packed:  # saved by this package before q/k/v were separate projections
        raise ModelLoadError(
            f"the weights in {name} hold packed attention projections ({packed[0]}), the layout of "
            f"hf-scratch-transformer before separate q_proj/k_proj/v_proj: load them with that version, or train again"
        )
    if missing:  # e.g. config.json naming another seq2seq type: its layers would start from random numbers
        raise ModelLoadError(
            f"the weights in {name} do not fit the {model.config.model_type!r} model its config.json describes "
            f"({len(missing)} weight(s) missing, e.g. {missing[0]}): config.json belongs to another model; copy the "
            f"config saved with these weights"
        )
    vocab_size = getattr(model.config, "vocab_size", None)
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ModelLoadError(
            f"the tokenizer in {name} has {len(tokenizer)} tokens but the model only {vocab_size} embeddings: the "
            f"tokenizer files belong to another model; copy the tokenizer saved with these weights"
        )
    if vocab_size is not None and model.config.model_type == "scratch_transformer" and len(tokenizer) != vocab_size:
        raise ModelLoadError(
            f"the tokenizer in {name} has {len(tokenizer)} tokens but the model {vocab_size} embeddings (train.py "
            f"saves them equal): the tokenizer files belong to another model; copy the tokenizer saved with these "
            f"weights"
        )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "sentencepiece.bpe.model", "spiece.model")


def _check_model_type(config_file: Path) -> None:
    """Refuse a config whose model type does not translate (e.g. a BERT config copied over), before transformers
    would ask, or fail, about it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{config_file} is not readable JSON ({error}): copy it again") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type == "scratch_transformer" or model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return
    raise ModelLoadError(
        f"{config_file} describes a model of type {model_type!r}, not a translation (sequence-to-sequence) model "
        f"such as 'scratch_transformer': is it the right directory, or was config.json replaced?"
    )


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a complete safetensors file, or None: safetensors checks the header and that the data it
    announces fills the file exactly when it opens it (the numbers are not read)."""
    try:
        with safe_open(path, framework="pt"):
            return None
    except SafetensorError as error:
        reason = str(error).removeprefix("Error while deserializing header: ")
        return f"{path.stat().st_size} bytes; safetensors: {reason}"


def _max_source_length(model, tokenizer) -> int:
    limits = [getattr(model.config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    limits = [limit for limit in limits if isinstance(limit, int) and 0 < limit < 1_000_000]
    return min(limits) if limits else 512


def _generation_kwargs(model, num_beams: int | None, max_new_tokens: int | None) -> dict:
    """Call-time overrides of the model's generation_config (only what the user asked for)."""
    kwargs = {}
    if num_beams is not None:
        kwargs["num_beams"] = num_beams
    if max_new_tokens is not None:
        kwargs["max_new_tokens"] = max_new_tokens
        # The saved max_length would otherwise compete with max_new_tokens (and warn).
        kwargs["max_length"] = None
    elif getattr(model.generation_config, "max_length", None) is None and getattr(
        model.generation_config, "max_new_tokens", None
    ) is None:
        kwargs["max_new_tokens"] = 256
    return kwargs


def length_bound(source_length: int, max_len_a: float, max_len_b: float) -> int | None:
    """fairseq's bound on a translation's length, in generated tokens (`</s>` included): `a * source tokens + b`
    (`</s>` of the source included), rounded up; None when both are 0 (no bound)."""
    if max_len_a < 0 or max_len_b < 0:
        raise ValueError(f"max_len_a and max_len_b must be >= 0, got {max_len_a} and {max_len_b}")
    if max_len_a == 0 and max_len_b == 0:
        return None
    return max(1, math.ceil(max_len_a * source_length + max_len_b))


def _new_tokens_cap(model, generation_kwargs: dict) -> int:
    """The longest translation the call allows without a source-relative bound, in new tokens, and never more
    than the decoder has positions for."""
    config = model.generation_config
    if generation_kwargs.get("max_new_tokens") is not None:
        cap = generation_kwargs["max_new_tokens"]
    elif getattr(config, "max_new_tokens", None) is not None:
        cap = config.max_new_tokens
    elif getattr(config, "max_length", None) is not None:  # counts the decoder start token of an encoder-decoder
        cap = max(1, config.max_length - 1)
    else:
        cap = 256
    positions = getattr(model.config, "max_position_embeddings", None)
    return min(cap, positions - 1) if isinstance(positions, int) and positions > 1 else cap


def decoder_start_token(model) -> int:
    """The token decoding starts from: the generation config's, else the model config's."""
    start = getattr(model.generation_config, "decoder_start_token_id", None)
    return start if start is not None else model.config.decoder_start_token_id


def without_start_token(ids, model) -> list[int]:
    """`ids` (a list or a tensor) as a list, without a leading decoder start token."""
    ids = ids.flatten().tolist() if hasattr(ids, "flatten") else list(ids)
    return ids[1:] if ids and ids[0] == decoder_start_token(model) else ids


def strip_generated(ids: list[int], model) -> list[int]:
    """Generated ids without the decoder start token, cut after the first end-of-sequence token, no padding."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) - {None}
    pad = model.generation_config.pad_token_id
    ids = without_start_token(ids, model)
    out = []
    for token_id in ids:
        if token_id in eos:
            out.append(token_id)
            break
        if token_id == pad:
            break
        out.append(token_id)
    return out


@torch.no_grad()
def generate_ids(
    model,
    tokenizer,
    texts: list[str],
    batch_size: int = 32,
    num_beams: int | None = None,
    max_new_tokens: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    max_len_a: float = 0.0,
    max_len_b: float = 0.0,
    description: str = "translating",
) -> list[list[int] | None]:
    """Generated token ids per text (see `strip_generated`), None for an empty text; in input order.

    With `max_len_a`/`max_len_b` (fairseq's names) a translation gets at most `ceil(a * source tokens + b)` new
    tokens, never more than `max_new_tokens` (or the generation_config's limit). The bound is set per batch from the
    batch's longest source; batches hold texts of similar length (sorted), so each text gets about its own bound.
    A model that rarely emits `</s>` (barely trained, or diverged) then stops near the source's length instead of
    running to the global limit.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if num_beams is not None and num_beams < 1:
        raise ValueError(f"num_beams must be at least 1, got {num_beams}: use 1 for greedy decoding")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    results: list[list[int] | None] = [None] * len(texts)
    todo = [i for i, text in enumerate(texts) if text.strip()]
    if not todo:
        return results
    max_length = _max_source_length(model, tokenizer)
    lengths = _source_lengths(model, tokenizer, texts, todo, max_length)
    # Longest first: similar lengths share a batch, and an out-of-memory batch shows up at once.
    order = sorted(todo, key=lambda i: -lengths[i])
    generation_kwargs = _generation_kwargs(model, num_beams, max_new_tokens)
    length_bound(1, max_len_a, max_len_b)  # refuses negative values before any work
    cap = _new_tokens_cap(model, generation_kwargs)
    with tqdm(total=len(order), unit="sent", desc=description, dynamic_ncols=True, disable=not progress) as bar:
        for begin in range(0, len(order), batch_size):
            indices = order[begin : begin + batch_size]
            batch = tokenizer(
                [texts[i] for i in indices], truncation=True, max_length=max_length, padding=True, return_tensors="pt"
            ).to(device)
            kwargs = generation_kwargs
            bound = length_bound(max(lengths[i] for i in indices), max_len_a, max_len_b)
            if bound is not None:
                kwargs = {**generation_kwargs, "max_new_tokens": min(bound, cap), "max_length": None}
            output = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
            for index, ids in zip(indices, output.tolist()):
                results[index] = strip_generated(ids, model)
            bar.update(len(indices))
    return results


def _source_lengths(model, tokenizer, texts: list[str], todo: list[int], max_length: int) -> dict[int, int]:
    """Token count of each text to translate (index -> length, at most `max_length`: longer texts are truncated,
    with a warning); ids outside the model's vocabulary (another model's tokenizer) are refused."""
    encoded = tokenizer([texts[i] for i in todo], verbose=False)["input_ids"]
    vocab_size = getattr(model.config, "vocab_size", None)
    outside = sorted({token for ids in encoded for token in ids if vocab_size is not None and token >= vocab_size})
    if outside:
        raise ValueError(f"input ids {outside[:10]} are outside the model's vocabulary (0..{vocab_size - 1}): the "
                         f"tokenizer belongs to another model; use the tokenizer saved with these weights")
    lengths = dict(zip(todo, map(len, encoded)))
    too_long = [i for i in todo if lengths[i] > max_length]
    if too_long:
        logger.warning(
            f"{len(too_long)} input text(s) longer than the model's limit of {max_length} tokens were truncated "
            f"to it (first: text {too_long[0] + 1}, {lengths[too_long[0]]} tokens); split long texts into sentences"
        )
        lengths.update({i: max_length for i in too_long})
    return lengths


def decode_ids(tokenizer, ids: list[int] | None) -> str:
    """One line of text: special tokens dropped, newlines in the output turned into spaces."""
    if not ids:
        return ""
    # A translation cut by max_new_tokens may end inside a multi-byte character: drop the replacement mark.
    text = tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    return " ".join(text.splitlines()) if ("\n" in text or "\r" in text) else text


def translate_texts(
    model,
    tokenizer,
    texts: list[str],
    batch_size: int = 32,
    num_beams: int | None = None,
    max_new_tokens: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    max_len_a: float = 0.0,
    max_len_b: float = 0.0,
    description: str = "translating",
) -> list[str]:
    """Translate `texts`, one output string per input, in input order; empty texts give empty strings.

    `num_beams` / `max_new_tokens` default to the model's generation_config; `progress` shows a tqdm bar;
    `max_len_a`/`max_len_b` bound each translation to `a * source tokens + b` new tokens (see `generate_ids`).
    """
    ids = generate_ids(model, tokenizer, texts, batch_size, num_beams, max_new_tokens, device, progress,
                       max_len_a=max_len_a, max_len_b=max_len_b, description=description)
    return [decode_ids(tokenizer, token_ids) for token_ids in ids]


__all__ = [
    "ModelLoadError",
    "decode_ids",
    "generate_ids",
    "length_bound",
    "load_model_and_tokenizer",
    "pick_device",
    "strip_generated",
    "translate_texts",
]
