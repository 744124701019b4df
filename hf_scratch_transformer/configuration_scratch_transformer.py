"""Configuration of the from-scratch encoder-decoder Transformer (Vaswani et al., 2017).

Field names follow transformers' seq2seq configs (Marian, BART) so that `generate()`, pipelines, the Trainer
and anyone who has read a Marian config feel at home. This file imports only transformers: it is copied into
every saved model directory for `trust_remote_code=True`.
"""

import copy

from transformers import PreTrainedConfig

# The paper's sizes (Table 3) plus two smaller ones for CPUs and tests.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256),
    "small": dict(d_model=256, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024),
    "base": dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                 decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048),
    "big": dict(d_model=1024, encoder_layers=6, decoder_layers=6, encoder_attention_heads=16,
                decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096),
}
DEFAULT_PRESET = "small"  # what train.py builds when no --preset (and no --model_name_or_path) is given


# Written into every saved config so that a directory loads with `trust_remote_code=True` in a process that has
# never imported this package: the Auto classes and the translation pipeline find their code in the directory.
AUTO_MAP = {
    "AutoConfig": "configuration_scratch_transformer.ScratchTransformerConfig",
    "AutoModel": "modeling_scratch_transformer.ScratchTransformerModel",
    "AutoModelForSeq2SeqLM": "modeling_scratch_transformer.ScratchTransformerForConditionalGeneration",
}
CUSTOM_PIPELINES = {
    "translation": {
        "impl": "pipeline_translation.TranslationPipeline",
        "pt": ["AutoModelForSeq2SeqLM"],
        "tf": [],
        "type": "text",
    }
}


class ScratchTransformerConfig(PreTrainedConfig):
    r"""Hyperparameters of the Transformer of "Attention Is All You Need".

    The defaults are the paper's *base* model with post-norm, √d_model-scaled embeddings and one vocabulary
    shared by the source embedding, the target embedding and the output projection (§3.4).

    Args:
        vocab_size: size of the (joint) vocabulary.
        d_model: width of every residual stream (the paper's d_model).
        encoder_layers / decoder_layers: number of layers per stack (N).
        encoder_attention_heads / decoder_attention_heads: heads per attention block (h); d_k = d_model / h.
        encoder_ffn_dim / decoder_ffn_dim: inner width of the position-wise feed-forward network (d_ff).
        dropout: dropout on embeddings and on every sublayer output before the residual add (P_drop).
        attention_dropout: dropout on the attention weights.
        activation_dropout: dropout after the feed-forward ReLU.
        activation_function: "relu" as in the paper; "gelu" also works.
        max_position_embeddings: longest sequence the sinusoidal table covers.
        layer_norm_eps: epsilon of every LayerNorm.
        normalize_before: False = post-norm, LayerNorm(x + Sublayer(x)) as in the paper; True = pre-norm,
            x + Sublayer(LayerNorm(x)) with a final LayerNorm per stack (the Annotated Transformer).
        scale_embedding: multiply token embeddings by √d_model before adding positions (§3.4).
        share_encoder_decoder_embeddings: one embedding matrix for source and target tokens (joint vocabulary).
        tie_word_embeddings: the output projection reuses the (target) embedding matrix.

    Example:
        >>> from hf_scratch_transformer import ScratchTransformerConfig
        >>> config = ScratchTransformerConfig.from_preset("small", vocab_size=8000)
        >>> config.hidden_size, config.num_attention_heads
        (256, 4)
    """

    model_type = "scratch_transformer"
    keys_to_ignore_at_inference = ["cache"]
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "encoder_attention_heads",
        "num_hidden_layers": "encoder_layers",
    }

    vocab_size: int = 32000
    d_model: int = 512
    encoder_layers: int = 6
    decoder_layers: int = 6
    encoder_attention_heads: int = 8
    decoder_attention_heads: int = 8
    encoder_ffn_dim: int = 2048
    decoder_ffn_dim: int = 2048
    dropout: float | int = 0.1
    attention_dropout: float | int = 0.0
    activation_dropout: float | int = 0.0
    activation_function: str = "relu"
    max_position_embeddings: int = 1024
    layer_norm_eps: float = 1e-5
    normalize_before: bool = False
    scale_embedding: bool = True
    share_encoder_decoder_embeddings: bool = True
    tie_word_embeddings: bool = True
    is_encoder_decoder: bool = True
    use_cache: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    decoder_start_token_id: int | None = 1

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)  # resolves the standard aliases (`hidden_size`, ...) first
        self._validate_sizes()
        # Deep copies: transformers' pipeline() rewrites the entries of a config it loads in place.
        self.auto_map = {**AUTO_MAP, **(getattr(self, "auto_map", None) or {})}
        self.custom_pipelines = copy.deepcopy({**CUSTOM_PIPELINES, **(getattr(self, "custom_pipelines", None) or {})})

    def _validate_sizes(self) -> None:
        """Raise a ValueError naming the offending field, before any module is built."""
        for name in ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
                     "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        for name in ("encoder_attention_heads", "decoder_attention_heads"):
            if self.d_model % getattr(self, name):
                raise ValueError(
                    f"`d_model` ({self.d_model}) must be divisible by `{name}` ({getattr(self, name)}): "
                    f"each head gets d_model / heads dimensions."
                )
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"`{name}` must be a probability in [0, 1), got {value!r}.")
        if self.activation_function not in ("relu", "gelu"):
            raise ValueError(f"`activation_function` must be 'relu' or 'gelu', got {self.activation_function!r}.")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            for token_id in value if isinstance(value, list) else [value]:
                if token_id is not None and not 0 <= token_id < self.vocab_size:
                    raise ValueError(
                        f"`{name}` ({token_id}) is outside the vocabulary [0, {self.vocab_size}): "
                        f"special token ids must index rows of the embedding matrix."
                    )

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ScratchTransformerConfig":
        """A config with the sizes of a named preset (`tiny`, `small`, `base`, `big`), then `overrides`."""
        if name not in PRESETS:
            raise ValueError(f"Unknown preset {name!r}: choose one of {', '.join(PRESETS)}.")
        return cls(**{**PRESETS[name], **overrides})


ScratchTransformerConfig.register_for_auto_class()

__all__ = ["ScratchTransformerConfig", "PRESETS", "DEFAULT_PRESET", "AUTO_MAP", "CUSTOM_PIPELINES"]
