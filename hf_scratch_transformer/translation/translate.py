"""Loading a model (every broken or poisoned directory refused with one line) and translating texts with it.

    >>> model, tokenizer = load_model_and_tokenizer("outputs/en-es")                          # doctest: +SKIP
    >>> translate(model, tokenizer, ["In the beginning.", "", "Jesus wept."])                 # doctest: +SKIP
    ['En el principio.', '', 'Jesús lloró.']
    >>> translate(model, tokenizer, ["Jesus wept."], num_beams=4, num_return_sequences=2)     # doctest: +SKIP
    [[Hypothesis(text='Jesús lloró.', score=-0.21, token_ids=[...]), Hypothesis(text=..., score=-0.93, ...)]]

`translate` goes through the package's one translation core (translation_core.translate_texts): documents split
into sentences and put back in their own white space, protected spans, glossaries, sorted batches, input order,
the length bound `max_len_a * source tokens + max_len_b`, n-best with scores and confidence.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from ..decoding import bf16_products_for_decoding, quantize_for_decoding
from ..errors import UsageError
from ..translation_core import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_LEN_A,
    DEFAULT_MAX_LEN_B,
    DecodingOptions,
    Hypothesis,
    TextOptions,
    TextTranslation,
    TorchBackend,
    check_tokenizer_fits,
    translate_texts,
)

logger = logging.getLogger("hf_scratch_transformer")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TEST_SOURCES_FILE = "test_sources.txt"  # a trained model's test sources (line N for prediction N): the demo's examples
PICKLE_WEIGHT_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "sentencepiece.bpe.model", "spiece.model")
JSON_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
HUB_TIMEOUT = 10  # seconds for the one request that looks a hub id up


class ModelLoadError(UsageError, RuntimeError):
    """The model or its tokenizer could not be loaded (a RuntimeError too); the message is one line meant for a user
    and names the directory or hub id to fix."""


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


# --------------------------------------------------------------------------------------------------------------
# Where a model is: a local directory or a hub id
# --------------------------------------------------------------------------------------------------------------
def looks_like_a_path(name: str) -> bool:
    """True for a name meant as a local path: it starts with "./", "../", a separator or "~", its first component
    is an existing directory (`outputs/nothere` where ./outputs exists), or it is no valid hub id (more than one
    "/", a backslash, "..", ...). A remaining `name` or `owner/name` is a hub id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    first = name.replace("\\", "/").split("/", 1)[0]
    if name.startswith(("./", "../", ".\\", "..\\", "/", "~", os.sep)) or name in (".", ".."):
        return True
    if first != name and first and Path(first).is_dir():
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def locate_model(name_or_path: str | os.PathLike) -> tuple[str, bool]:
    """Where to load a model from: (local directory, False) or (hub id, local_files_only).

    A name that exists on disk is a model directory (a file is refused). A name that looks like a path
    (`looks_like_a_path`) and does not exist is refused at once: the hub is never asked. Anything else is a hub
    id, looked up with one request (at most HUB_TIMEOUT seconds): a hub that cannot be reached (or HF_HUB_OFFLINE)
    falls back to the cached copy when there is one (local_files_only=True), else the id is refused in one line.
    Every train.py and command-line option that names a model comes through here.
    """
    name = os.fspath(name_or_path)
    if not name.strip():  # Path("") is the working directory, which would be searched for weights
        raise ModelLoadError(f"the model name is empty ({name!r}): give the directory saved with save_pretrained, "
                             f"or a hub id (owner/name)")
    path = Path(name).expanduser()
    try:
        path.stat()
    except FileNotFoundError:
        pass
    except OSError as error:  # a name too long, a loop of links, no permission
        raise ModelLoadError(f"cannot open the model directory {name}: {error.strerror or error}") from None
    if path.is_dir():
        return str(path), False
    if path.exists():
        raise ModelLoadError(f"{name} is a file, not a model directory: give the directory saved with "
                             f"save_pretrained (it holds config.json and model.safetensors)")
    if looks_like_a_path(name):
        raise ModelLoadError(f"model directory not found: no such directory {name} (a local path, so the hub "
                             f"was not asked)")
    return name, _hub_is_unreachable(name)


def _hub_is_unreachable(repo_id: str) -> bool:
    """True when the hub cannot be reached but a cached copy of `repo_id` exists; ModelLoadError when neither the
    hub nor the cache has it; False when the hub knows it."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        huggingface_hub.model_info(repo_id, timeout=HUB_TIMEOUT)
        return False
    except GatedRepoError:
        return False  # from_pretrained names what access is needed
    except RepositoryNotFoundError:
        raise ModelLoadError(f"model not found: no such directory {repo_id}, and no such model on the hub (if it "
                             f"is private, log in with `hf auth login`)") from None
    except Exception as error:  # noqa: BLE001  (offline mode, DNS, connection, timeout: the hub is out of reach)
        if isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str):
            return True
        reason = " ".join(str(error).split()).split(". ")[0][:160] or type(error).__name__
        raise ModelLoadError(f"model not found: no such directory {repo_id}, and the hub could not be reached to "
                             f"look it up as a model id ({reason}): check the path, or the network") from None


# --------------------------------------------------------------------------------------------------------------
# Loading, with every check once
# --------------------------------------------------------------------------------------------------------------
# What a model may translate in (the command line's and the demo's --dtype; "auto": `inference_precision`): its weights
# in fp32 or bf16; or, on a CPU, fp32 weights whose decoding steps multiply in bf16 from a few rows on
# (`decoding.bf16_products_for_decoding`) or in int8 (`decoding.quantize_for_decoding`)
PRECISIONS = ("float32", "bfloat16", "bfloat16_products", "int8")
# the precisions that give fp32 weights decoding copies, on a CPU only
DECODING_COPIES = {"bfloat16_products": bf16_products_for_decoding, "int8": quantize_for_decoding}


def inference_precision(device: torch.device | str | None, requested: str = "auto") -> str:
    """What a model translates in: `requested` (one of PRECISIONS), or with "auto" on a CPU "int8" where it has
    AVX-512 BF16 and no AMX, "bfloat16_products" where it has AMX, and "float32" elsewhere.

    On a CPU with AVX-512 BF16 and no AMX (an AMD EPYC) a decoding step is bound by reading its weights: on three
    corpora int8 products (the encoder in bf16) decoded 1.2-2.3x as fast as fp32 (greedy at batch 1 1.9-2.3x) and bf16
    weights 1.3-1.9x, test BLEU within 0.2 of fp32. On a Xeon with AMX bf16 weights and int8 were slower than fp32 at
    batch 1 (0.70x, 0.83x); bf16 products where a product has rows enough (`decoding.bf16_min_rows`; the encoder
    and the cross-attention keys and values in bf16) ran greedy at batch 32 1.27x, beam 4 at batch 32 1.26x and
    greedy at batch 1 1.01x as fast as fp32, test BLEU +0.26 / +0.08
    (benchmarks/results/inference_precision*.md, decoding_precision_amx.md)."""
    if requested in PRECISIONS:
        return requested
    if requested != "auto":
        raise ValueError(f"dtype {requested!r} is not one of auto, {', '.join(PRECISIONS)}")
    from ..cpu_threads import cpu_bf16_units

    if torch.device(device or "cpu").type != "cpu":
        return "float32"
    return {"AVX-512 BF16": "int8", "AMX": "bfloat16_products"}.get(cpu_bf16_units(), "float32")


def slower_than_float32(precision: str) -> str | None:
    """Why `precision` decodes slower than float32 on this CPU, or None: int8 on a CPU without int8 dot-product units
    (AMX, AVX-512 VNNI or AVX-VNNI) and bf16 on one without bf16 units, where each is emulated. "auto" never
    chooses them there; asked for by name, they are loaded, with this said."""
    from ..cpu_threads import cpu_bf16_units, cpu_int8_units

    if precision == "int8" and cpu_int8_units() is None:
        return ("dtype int8 on this CPU, which has no int8 dot-product units (AMX, AVX-512 VNNI or AVX-VNNI): there "
                "int8 decoding ran at 0.75x float32's speed greedy at batch 1 and 0.10-0.19x at batch 32 (an AMD "
                "EPYC with AVX2 only), so this translates slower than --dtype auto (float32 here)")
    if precision in ("bfloat16", "bfloat16_products") and cpu_bf16_units() is None:
        return (f"dtype {precision} on this CPU, which has no bf16 matrix units (AVX-512 BF16 or AMX): a bf16 "
                f"product ran some 100x slower than a float32 one (an AMD EPYC with AVX2 only), so this translates "
                f"slower than --dtype auto (float32 here)")
    return None


def decoding_encoder_dtype() -> torch.dtype:
    """The dtype the encoder runs in under int8 or bf16-products decoding (`decoding.quantize_for_decoding`,
    `decoding.bf16_products_for_decoding`): bf16 on a CPU with bf16 units (AMX or AVX-512 BF16), where it took half
    the time of fp32 at the same test BLEU, fp32 on a CPU without, where bf16 products are emulated."""
    from ..cpu_threads import cpu_bf16_units

    return torch.bfloat16 if cpu_bf16_units() is not None else torch.float32


def load_model_and_tokenizer(name_or_path: str | os.PathLike, device: torch.device | str | None = None,
                             config_overrides: dict | None = None, dtype: str | None = None):
    """(model in eval mode on `device`, tokenizer) from a saved directory or a hub id (see `locate_model`).

    `config_overrides` (e.g. `{"dropout": 0.2}`) replace fields of the saved config before the model is built.
    `dtype`: None (the dtype the weights were saved in: fp32 for train.py's), "float32", "bfloat16",
    "bfloat16_products" or "int8" (fp32 weights, the decoding loops' products in bf16 from a few rows on or in int8,
    the encoder in `decoding_encoder_dtype()`, on a CPU), or "auto"
    (`inference_precision`: what translates fastest on `device` at the same BLEU).

    Raises `ModelLoadError` with a one-line message for: a missing directory; no, pickled-only, truncated or
    corrupted weights; a config.json that is no JSON or of a model type that does not translate; a tokenizer that
    is missing, unreadable or does not fit the embeddings; tensors missing from or extra in the weights; a config
    whose sizes contradict the weights; weights holding NaN or inf; a hub id that cannot be fetched. Weights are
    read from safetensors only, and no code from the directory is run (the package's own classes are used).
    """
    import hf_scratch_transformer  # noqa: F401  (registers the Auto classes: no trust_remote_code needed)
    from transformers import AutoModelForSeq2SeqLM

    if dtype in DECODING_COPIES and torch.device(device or "cpu").type != "cpu":
        raise ModelLoadError(f"dtype {dtype} translates on a CPU only, not on {device}: use float32 or bfloat16")
    name = os.fspath(name_or_path)
    source, local_only = locate_model(name)
    if Path(source).is_dir():
        check_model_dir(Path(source), name)
    tokenizer = load_tokenizer(source, name, local_only)
    try:
        model, info = AutoModelForSeq2SeqLM.from_pretrained(
            source, use_safetensors=True, trust_remote_code=False, output_loading_info=True,
            ignore_mismatched_sizes=True, local_files_only=local_only, **(config_overrides or {}))
    except Exception as error:  # noqa: BLE001  (hub, network and format errors all end up here)
        reason = " ".join(str(error).split())[:300]
        raise ModelLoadError(f"cannot load the model in {name}: {type(error).__name__}: {reason}") from error
    check_loaded_model(model, tokenizer, info, name)
    if device is not None:
        model.to(device)
    if dtype is not None:  # after the checks, which read the weights as saved
        precision = inference_precision(device, dtype)
        if torch.device(device or "cpu").type == "cpu" and (slower := slower_than_float32(precision)):
            logger.warning(slower)
        model.to(torch.bfloat16 if precision == "bfloat16" else torch.float32)
        if precision in DECODING_COPIES:
            DECODING_COPIES[precision](model, decoding_encoder_dtype())
    model.eval()
    return model, tokenizer


def load_tokenizer(source: str, name: str, local_files_only: bool = False):
    """The tokenizer saved in `source` (a directory or hub id); one line naming `name` if it cannot be read."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=False, local_files_only=local_files_only)
    except Exception as error:  # noqa: BLE001  (tokenizers raises a bare Exception for a malformed file)
        reason = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
        if not Path(source).is_dir():
            raise ModelLoadError(f"cannot load the tokenizer of {name} from the hub ({reason})") from None
        raise ModelLoadError(f"the tokenizer in {name} cannot be read ({reason}): copy the tokenizer files saved "
                             f"with the model (tokenizer.json, tokenizer_config.json) again") from None


def check_model_dir(path: Path, name: str) -> None:
    """A saved model directory holds safetensors weights that open, config.json of a translation model and a
    tokenizer whose JSON files parse; the first thing missing or broken is named."""
    if not any((path / weights).is_file() for weights in WEIGHT_FILES):
        if any((path / weights).is_file() for weights in PICKLE_WEIGHT_FILES):
            raise ModelLoadError(
                f"{name} holds only pickled weights (pytorch_model.bin), which can run code when loaded: only "
                f"model.safetensors is read; convert them with save_pretrained(..., safe_serialization=True)"
            )
        raise ModelLoadError(f"no model weights in {name} (expected model.safetensors): is it a saved model directory?")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no config.json in {name}: is it a saved model directory?")
    _check_model_type(path / "config.json")
    if not any((path / file).is_file() for file in TOKENIZER_FILES):
        raise ModelLoadError(f"no tokenizer in {name} (expected tokenizer.json): copy the tokenizer files saved with "
                             f"the model (tokenizer.json, tokenizer_config.json) into it")
    for file in JSON_TOKENIZER_FILES:
        problem = _json_problem(path / file) if (path / file).is_file() else None
        if problem:
            raise ModelLoadError(f"{path / file} is not valid JSON ({problem}): copy the tokenizer files saved with "
                                 f"the model again")
    for weights in sorted(path.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem:
            raise ModelLoadError(f"{weights} is truncated or corrupted ({problem}): copy or download it again")


def _json_problem(path: Path) -> str | None:
    try:
        json.loads(path.read_text(encoding="utf-8"))
        return None
    except (OSError, ValueError) as error:
        return " ".join(str(error).split())[:120] or "empty file"


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


def check_loaded_model(model, tokenizer, info: dict, name: str) -> None:
    """The weights fit the config (no tensor missing, extra or of another shape), hold only finite numbers, and the
    tokenizer fits the embeddings (exactly, for this package's models: train.py saves them equal)."""
    _check_tensor_names(model, info, name)
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched:
        key, in_file, in_model = mismatched[0]
        raise ModelLoadError(
            f"config.json in {name} contradicts model.safetensors: {key} is {tuple(in_file)} in the weights but "
            f"{tuple(in_model)} for the config ({len(mismatched)} tensor(s) differ; d_model "
            f"{getattr(model.config, 'd_model', '?')}): copy the config.json saved with these weights"
        )
    with torch.no_grad():
        poisoned = next((key for key, tensor in model.state_dict().items()
                         if tensor.is_floating_point() and not torch.isfinite(tensor).all()), None)
    if poisoned is not None:
        raise ModelLoadError(f"the weights in {name} hold NaN or infinite values ({poisoned}): the model is corrupted "
                             f"(saved after training diverged?); use an earlier checkpoint, or train again")
    try:
        check_tokenizer_fits(tokenizer, getattr(model.config, "vocab_size", None),
                             exact=model.config.model_type == "scratch_transformer")
    except ValueError as error:
        raise ModelLoadError(f"{name}: {error}") from None


def _check_tensor_names(model, info: dict, name: str) -> None:
    """Tensors missing from the weights or extra in them, told apart from a config of another model (most
    tensors missing)."""
    missing, unexpected = list(info.get("missing_keys") or []), list(info.get("unexpected_keys") or [])
    expected = len(model.state_dict())
    if missing and (len(missing) * 2 > expected or model.config.model_type != "scratch_transformer"):
        raise ModelLoadError(
            f"the weights in {name} do not fit the {model.config.model_type!r} model its config.json describes "
            f"({len(missing)} of {expected} tensors missing, e.g. {missing[0]}): config.json belongs to another "
            f"model; copy the config saved with these weights"
        )
    if missing:
        raise ModelLoadError(f"model.safetensors in {name} lacks {len(missing)} tensor(s) of the model config.json "
                             f"describes (e.g. {missing[0]}): the file is incomplete, or config.json belongs to a "
                             f"bigger model; copy both again from where the model was saved")
    if unexpected:
        raise ModelLoadError(f"model.safetensors in {name} holds {len(unexpected)} tensor(s) the model config.json "
                             f"describes does not have (e.g. {unexpected[0]}): the weights belong to another "
                             f"architecture or size; copy the config.json saved with them")


# --------------------------------------------------------------------------------------------------------------
# Translating
# --------------------------------------------------------------------------------------------------------------
def translate(model, tokenizer, texts: list[str], *, num_beams: int | None = None,
              num_return_sequences: int | None = None, max_new_tokens: int | None = None,
              max_len_a: float = DEFAULT_MAX_LEN_A, max_len_b: float = DEFAULT_MAX_LEN_B,
              batch_size: int = DEFAULT_BATCH_SIZE, segment: bool = True, source_lang: str | None = None,
              protect: bool | None = None, protect_kinds=None, protect_patterns=(), glossary=None,
              max_sentence_tokens: int | None = None, details: bool = False, progress: bool = False,
              description: str = "translating",
              on_batch: Callable[[int, float], None] | None = None,
              **generate_kwargs) -> list[str] | list[list[Hypothesis]] | list[TextTranslation]:
    """Translate `texts` (a list of strings, each of any length: a sentence, a paragraph, a document) in input
    order.

    Without `num_return_sequences`: one string per text (white space alone comes back as it is). With
    `num_return_sequences=N`: per text its N best `Hypothesis` (text, score, token_ids, confidence), best first (an
    empty list for a text of white space); N is at most the beam size. With `details=True`: a `TextTranslation`
    per text (translation, confidence, n-best, and per sentence what happened to protected spans and glossary
    terms). `num_beams` / `max_new_tokens` default to the model's generation_config; each sentence's translation
    gets at most `max_len_a * source tokens + max_len_b` new tokens (0 and 0: no bound). How texts are read
    (translation_core.TextOptions): `segment` (split into sentences), `source_lang`, `protect` (None: on for a
    model trained with sentinel tokens), `protect_kinds`, `protect_patterns`, `glossary` (a Glossary, a dict or
    pairs), `max_sentence_tokens` (longer sentences go in pieces; None: the length the model was trained on).
    `progress` shows a tqdm bar; `on_batch(tokens_generated, seconds)` is called after each batch; further
    keyword arguments go to `generate()` (e.g. `length_penalty=1.2`).
    """
    options = DecodingOptions(
        num_beams=num_beams, num_return_sequences=1 if num_return_sequences is None else num_return_sequences,
        max_new_tokens=max_new_tokens, max_len_a=max_len_a, max_len_b=max_len_b, batch_size=batch_size,
        with_scores=num_return_sequences is not None or details,
    )
    reading = TextOptions(segment=segment, source_lang=source_lang, protect=protect, protect_patterns=protect_patterns,
                          glossary=glossary, max_sentence_tokens=max_sentence_tokens,
                          **({} if protect_kinds is None else {"protect_kinds": protect_kinds}))
    found = translate_texts(TorchBackend(model, **generate_kwargs), tokenizer, texts, options, reading,
                            progress=progress, description=description, on_batch=on_batch)
    if details:
        return found
    if num_return_sequences is None:
        return [translation.text for translation in found]
    return [translation.hypotheses for translation in found]


__all__ = [
    "Hypothesis",
    "ModelLoadError",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "locate_model",
    "looks_like_a_path",
    "pick_device",
    "translate",
]
