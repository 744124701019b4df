"""CTranslate2: export a trained model (`export_ct2`, the `hf-scratch-export-ct2` command) to a directory that
`hf-scratch-translate --backend ct2` translates with (translation/ct2_backend.py).

    hf-scratch-export-ct2 --model outputs/scratch-small-en-es --output_dir outputs/scratch-small-en-es-ct2
    hf-scratch-export-ct2 --model outputs/scratch-small-en-es --output_dir outputs/ct2-int8 --quantization int8
    hf-scratch-translate --backend ct2 --model outputs/ct2-int8 "Jesus wept."

transformers' `ct2-transformers-converter` cannot read this model (its own start token and vocabulary), so the
CTranslate2 `TransformerSpec` is built here from the loaded model: every weight is read from the module that uses it
(linear layers store (out, in), as CTranslate2 wants them; CTranslate2's fused Q/K/V and K/V matrices are our
q/k/v rows stacked). The output directory holds the CTranslate2 model (`model.bin`, `config.json`,
`shared_vocabulary.json` with the tokens in id order), the tokenizer files, the model's `generation_config.json`
and `hf_scratch_transformer_ct2.json` (what was exported, from where).

CTranslate2 is an optional dependency: `pip install hf-scratch-transformer[ct2]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
from pathlib import Path

from ..errors import run_command, write_error
from ..translation.ct2_backend import INFO_FILE, INSTALL_HINT, CT2Error, require_ctranslate2, vocabulary_tokens

logger = logging.getLogger("hf_scratch_transformer")
QUANTIZATIONS = ("float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "float16", "bfloat16")


class CT2ExportError(CT2Error):
    """The model cannot be exported to CTranslate2; the message is one line meant for a user."""


def unexpressible_settings(config) -> list[str]:
    """What in `config` CTranslate2's TransformerSpec cannot express (empty when the model exports).

    Expressible, and handled by `build_spec`: post-norm and pre-norm (`normalize_before`, with the final LayerNorm
    per stack), ReLU and exact (erf) GELU, √d_model or no embedding scaling, any LayerNorm epsilon, different head
    counts and FFN widths in encoder and decoder, separate encoder/decoder embeddings, an untied output projection,
    any `max_position_embeddings` (the sinusoid table itself is exported) and any decoder start token.
    """
    problems = []
    model_type = getattr(config, "model_type", None)
    if model_type != "scratch_transformer":
        problems.append(
            f"model_type is {model_type!r}, not 'scratch_transformer' (for transformers' own models use "
            f"CTranslate2's ct2-transformers-converter)"
        )
        return problems
    activation = config.activation_function
    if activation not in ("relu", "gelu"):
        problems.append(f"activation_function {activation!r} has no CTranslate2 equivalent here (relu, gelu do)")
    eos = config.eos_token_id
    eos_ids = sorted(set(eos)) if isinstance(eos, list) else [eos]
    if len(eos_ids) != 1 or eos_ids[0] is None:
        problems.append(f"eos_token_id {eos!r}: a CTranslate2 model stores exactly one end token")
    if config.decoder_start_token_id is None and config.bos_token_id is None:
        problems.append("neither decoder_start_token_id nor bos_token_id is set: no token to start decoding with")
    return problems


def _numpy(tensor):
    import numpy as np

    return np.ascontiguousarray(tensor.detach().float().cpu().numpy())


def build_spec(model, tokens: list[str]):
    """A validated CTranslate2 TransformerSpec holding `model`'s weights (a ScratchTransformerForConditionalGeneration)
    and the vocabulary `tokens` (id order). Raises CT2ExportError for what CTranslate2 cannot express, including
    any parameter of the model that the spec has no place for."""
    require_ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    config = model.config
    problems = unexpressible_settings(config)
    if problems:
        raise CT2ExportError("cannot export to CTranslate2: " + "; ".join(problems))
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU}[config.activation_function]
    pre_norm = bool(config.normalize_before)
    encoder_spec = transformer_spec.TransformerEncoderSpec(
        config.encoder_layers, config.encoder_attention_heads, pre_norm=pre_norm, activation=activation
    )
    decoder_spec = transformer_spec.TransformerDecoderSpec(
        config.decoder_layers, config.decoder_attention_heads, pre_norm=pre_norm, activation=activation
    )
    spec = transformer_spec.TransformerSpec(encoder_spec, decoder_spec)
    copier = _WeightCopier()
    base = model.model
    for stack_spec, stack in ((spec.encoder, base.encoder), (spec.decoder, base.decoder)):
        _copy_stack(copier, stack_spec, stack, config, is_decoder=stack is base.decoder)
    copier.linear(spec.decoder.projection, model.lm_head)
    unused = [name for name, parameter in model.named_parameters(remove_duplicate=False)
              if id(parameter) not in copier.used]
    if unused:
        raise CT2ExportError(
            f"cannot export to CTranslate2: {len(unused)} parameter(s) have no place in a CTranslate2 Transformer "
            f"(first: {unused[0]})"
        )
    _set_vocabulary(spec, tokens, config)
    spec.validate()
    return spec


class _WeightCopier:
    """Copies parameters into spec fields as numpy arrays: one array per parameter, so tied weights stay one array
    (saved once by CTranslate2); `used` holds the ids of the parameters copied."""

    def __init__(self):
        self.used: set[int] = set()
        self.arrays: dict[int, object] = {}

    def array(self, parameter):
        self.used.add(id(parameter))
        if id(parameter) not in self.arrays:
            self.arrays[id(parameter)] = _numpy(parameter)
        return self.arrays[id(parameter)]

    def linear(self, target, module) -> None:
        target.weight = self.array(module.weight)
        if getattr(module, "bias", None) is not None:
            target.bias = self.array(module.bias)

    def fused_linear(self, target, modules) -> None:
        """CTranslate2's attention projects Q, K, V (or K, V) with one matrix: the modules' rows, stacked."""
        import numpy as np

        target.weight = np.concatenate([self.array(module.weight) for module in modules])
        target.bias = np.concatenate([self.array(module.bias) for module in modules])

    def layer_norm(self, target, module) -> None:
        target.gamma, target.beta = self.array(module.weight), self.array(module.bias)


def _copy_stack(copier: _WeightCopier, stack_spec, stack, config, is_decoder: bool) -> None:
    """Embeddings, positions, the final LayerNorm (pre-norm) and every layer of an encoder or decoder stack."""
    stack_spec.scale_embeddings = math.sqrt(config.d_model) if config.scale_embedding else 1.0
    stack_spec.position_encodings.encodings = _numpy(stack.embed_positions.pe)
    embeddings = stack_spec.embeddings[0] if isinstance(stack_spec.embeddings, list) else stack_spec.embeddings
    embeddings.weight = copier.array(stack.embed_tokens.weight)
    if config.normalize_before:
        copier.layer_norm(stack_spec.layer_norm, stack.layer_norm)
    elif getattr(stack, "layer_norm", None) is not None:
        raise CT2ExportError("cannot export to CTranslate2: a final stack LayerNorm in a post-norm model")
    for layer_spec, layer in zip(stack_spec.layer, stack.layers):
        attention = layer.self_attn
        copier.fused_linear(layer_spec.self_attention.linear[0], [attention.q_proj, attention.k_proj, attention.v_proj])
        copier.linear(layer_spec.self_attention.linear[1], layer.self_attn.out_proj)
        copier.layer_norm(layer_spec.self_attention.layer_norm, layer.self_attn_layer_norm)
        if is_decoder:
            copier.linear(layer_spec.attention.linear[0], layer.cross_attn.q_proj)
            copier.fused_linear(layer_spec.attention.linear[1], [layer.cross_attn.k_proj, layer.cross_attn.v_proj])
            copier.linear(layer_spec.attention.linear[2], layer.cross_attn.out_proj)
            copier.layer_norm(layer_spec.attention.layer_norm, layer.cross_attn_layer_norm)
        copier.linear(layer_spec.ffn.linear_0, layer.feed_forward.fc1)
        copier.linear(layer_spec.ffn.linear_1, layer.feed_forward.fc2)
        copier.layer_norm(layer_spec.ffn.layer_norm, layer.final_layer_norm)


def _set_vocabulary(spec, tokens: list[str], config) -> None:
    """The shared vocabulary and the special tokens, by name."""
    spec.register_source_vocabulary(tokens)
    spec.register_target_vocabulary(tokens)
    start = config.decoder_start_token_id if config.decoder_start_token_id is not None else config.bos_token_id
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    spec.config.decoder_start_token = tokens[start]
    spec.config.bos_token = tokens[config.bos_token_id if config.bos_token_id is not None else start]
    spec.config.eos_token = tokens[eos]
    unk = getattr(config, "unk_token_id", None)
    spec.config.unk_token = tokens[unk] if isinstance(unk, int) else ("<unk>" if "<unk>" in tokens else tokens[eos])
    spec.config.layer_norm_epsilon = float(config.layer_norm_eps)


def export_ct2(model_dir, output_dir, quantization: str | None = None, force: bool = False) -> Path:
    """Export the saved model in `model_dir` to a CTranslate2 model directory `output_dir`; returns its path.

    `quantization`: None / "float32" keeps fp32 weights; "int8", "int8_float32", "int8_float16",
    "int8_bfloat16", "float16" or "bfloat16" store quantized weights (CTranslate2's `--quantization`).
    Writes the CTranslate2 model, the tokenizer files, generation_config.json and hf_scratch_transformer_ct2.json
    into a hidden folder beside `output_dir`, renamed into place when complete: a failed write (full disk,
    read-only folder) leaves nothing behind, and a directory replaced with `force` stays until the new one is in.
    Raises CT2NotInstalledError without ctranslate2, CT2ExportError for a model CTranslate2 cannot express, an
    unknown quantization or an output directory that is not empty (unless `force`), CT2Error for a tokenizer that
    does not fit the model, errors.write_error's UsageError or EnvironmentFault when the files cannot be written, and
    translate.ModelLoadError for a directory that does not hold a loadable model.
    """
    ctranslate2 = require_ctranslate2()
    quantization = quantization or "float32"
    output = _check_export_target(model_dir, output_dir, quantization, force)
    from ..translation.translate import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_dir, "cpu")
    problems = unexpressible_settings(model.config)
    if problems:
        raise CT2ExportError("cannot export to CTranslate2: " + "; ".join(problems))
    tokens = vocabulary_tokens(tokenizer, model.config.vocab_size)
    import torch

    with torch.no_grad():
        spec = build_spec(model, tokens)
    spec.optimize(quantization=quantization)
    from .. import __version__

    info = {"format": 1, "exported_from": os.fspath(model_dir), "quantization": quantization,
            "hf_scratch_transformer": __version__, "ctranslate2": ctranslate2.__version__,
            "max_position_embeddings": model.config.max_position_embeddings, "vocab_size": model.config.vocab_size,
            "tokenizer_size": len(tokenizer)}

    def write(directory: Path) -> None:
        spec.save(str(directory))
        tokenizer.save_pretrained(directory)  # tokenizer.json, tokenizer_config.json: no clash with CT2's files
        model.generation_config.save_pretrained(directory)
        (directory / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")

    write_directory(output, write, "the CTranslate2 model")
    return output


def _check_export_target(model_dir, output_dir, quantization: str, force: bool) -> Path:
    if quantization not in QUANTIZATIONS:
        raise CT2ExportError(f"unknown quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    output = Path(output_dir).expanduser()
    try:
        if output.exists() and not output.is_dir():
            raise CT2ExportError(f"--output_dir {output} exists and is not a directory")
        if output.is_dir() and any(output.iterdir()) and not force:
            raise CT2ExportError(f"--output_dir {output} is not empty (use --force to overwrite)")
    except OSError as error:  # a name too long, a folder that cannot be listed
        raise write_error(error, "the CTranslate2 model", output) from None
    if Path(model_dir).expanduser().resolve() == output.resolve():
        raise CT2ExportError("--output_dir must differ from --model (both would hold a config.json)")
    return output


def write_directory(output: Path, write, what: str) -> None:
    """`write(folder)` into a hidden folder beside `output`, then renamed to `output` (replacing it, when it
    exists, only once the new one is complete). On an OSError nothing new is left behind (folders created for it
    included) and errors.write_error says what happened in one line."""
    created = [parent for parent in reversed(output.parents) if not parent.exists()]
    staging = output.parent / f".{output.name}.partial-{os.getpid()}"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        write(staging)
        _replace_directory(staging, output)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise write_error(error, what, output) from None


def _replace_directory(new: Path, target: Path) -> None:
    """Rename the complete folder `new` to `target`; an existing `target` is set aside first and removed after."""
    if not target.exists():
        os.rename(new, target)
        return
    aside = target.parent / f".{target.name}.replaced-{os.getpid()}"
    os.rename(target, aside)
    try:
        os.rename(new, target)
    except OSError:
        os.rename(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- command
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-scratch-export-ct2",
        description="Export a saved hf_scratch_transformer model to a CTranslate2 model directory (with the "
        f"tokenizer files beside it). Needs the optional dependency: {INSTALL_HINT}",
        epilog="example:\n  hf-scratch-export-ct2 --model outputs/scratch-small-en-es --output_dir outputs/ct2 "
        "--quantization int8\n  hf-scratch-translate --backend ct2 --model outputs/ct2 \"Jesus wept.\"",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", "-m", required=True, metavar="DIR", help="directory written by save_pretrained")
    parser.add_argument("--output_dir", "-o", required=True, metavar="OUT", help="CTranslate2 model directory to write")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="weight type to store (default: float32)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty --output_dir")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `hf-scratch-export-ct2` with `argv`; returns the exit status (errors.exit_code: 2 for a problem the user
    can fix, 1 for a full disk)."""
    args = build_parser().parse_args(argv)
    if not args.debug:
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    return run_command("hf-scratch-export-ct2", lambda: _export(args), debug=args.debug)


def _export(args) -> int:
    require_ctranslate2()
    if not args.debug:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    output = export_ct2(args.model, args.output_dir, args.quantization, force=args.force)
    print(f"CTranslate2 model ({args.quantization or 'float32'}) written to {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
