"""hf_scratch_transformer: the Transformer of "Attention Is All You Need", from scratch, as a transformers model.

Importing the package registers the model with transformers' Auto classes, so
`AutoModelForSeq2SeqLM.from_pretrained(saved_dir)` works without `trust_remote_code`; it changes nothing else in
the process (no environment variable, hook, logging or warning setting, matplotlib backend or torch setting).
"""

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
