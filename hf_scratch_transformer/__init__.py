"""hf_scratch_transformer: the Transformer of "Attention Is All You Need", from scratch, as a transformers model.

Importing the package registers the model with transformers' Auto classes, so
`AutoModelForSeq2SeqLM.from_pretrained(saved_dir)` works without `trust_remote_code`; it changes nothing else in
the process (no environment variable, hook, logging or warning setting, matplotlib backend or torch setting).
"""

import contextlib
import os


@contextlib.contextmanager
def _importable_working_directory():
    """Imports that work from a working directory that was deleted, where torch's MKL cannot load libtorch_cpu.so (a
    fatal error, no traceback) and transformers resolves a relative path (FileNotFoundError): they run from / and the
    process then goes back to the deleted directory through a descriptor of it. Nothing changes for the caller, and
    a command can still say in one line that relative paths lead nowhere."""
    try:
        os.getcwd()
    except FileNotFoundError:
        here = os.open(".", getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY)
        try:
            os.chdir(os.sep)
            yield
        finally:
            os.fchdir(here)
            os.close(here)
    else:
        yield


with _importable_working_directory():
    import torch  # noqa: F401  (transformers imports it lazily, after this block otherwise)
    from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

    from .configuration_scratch_transformer import PRESETS, ScratchTransformerConfig
    from .modeling_scratch_transformer import (
        ScratchTransformerForConditionalGeneration,
        ScratchTransformerModel,
        ScratchTransformerPreTrainedModel,
    )
    from .pipeline_translation import TranslationPipeline, translation_pipeline

AutoConfig.register(ScratchTransformerConfig.model_type, ScratchTransformerConfig, exist_ok=True)
AutoModel.register(ScratchTransformerConfig, ScratchTransformerModel, exist_ok=True)
AutoModelForSeq2SeqLM.register(ScratchTransformerConfig, ScratchTransformerForConditionalGeneration, exist_ok=True)

__version__ = "0.1.0"
__all__ = [
    "PRESETS",
    "ScratchTransformerConfig",
    "ScratchTransformerModel",
    "ScratchTransformerForConditionalGeneration",
    "ScratchTransformerPreTrainedModel",
    "TranslationPipeline",
    "translation_pipeline",
]
