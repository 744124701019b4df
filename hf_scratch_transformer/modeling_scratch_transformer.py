"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017), from scratch.

Reads top to bottom as the paper: positional encoding (§3.5) -> scaled dot-product attention (§3.2.1) ->
multi-head attention (§3.2.2) -> position-wise feed-forward (§3.3) -> Add & Norm (§3.1) -> encoder and decoder
layers -> stacks -> PreTrainedModel -> ScratchTransformerModel -> ScratchTransformerForConditionalGeneration.

It is a transformers model in the way in-tree models are: attention goes through transformers' attention
interface (`attn_implementation` = "eager" | "sdpa" | "flex_attention" | a flash kernel where installed), masks
come from `transformers.masking_utils`, caches are any `Cache` (dynamic, static, compiled decoding), and hidden
states and attention weights are recorded by `capture_outputs`. Only torch, transformers and two sibling files
(the configuration, and decoding.py: greedy and beam search without generate()'s per-step machinery) are
imported, so the file also runs as `trust_remote_code` from a saved directory.

Shapes: B batch, S source length, T target tokens in this call, K keys (cached + new), D d_model, H heads,
Dh = D / H head width, F feed-forward width, V vocabulary. Tensors are (B, L, D) throughout, except where a
training batch skips its padding (`RealPositions`): then the stacks carry the N real positions as (N, D).
"""

import math
from collections.abc import Callable
from typing import Unpack

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_scratch_transformer import ScratchTransformerConfig
from .decoding import plain_decoding, search


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Teacher forcing: decoder input = labels shifted one step right behind the start token.

    labels (B, T) may hold -100 (ignored positions); they become `pad_token_id` in the decoder input.
    """
    decoder_input_ids = labels.new_empty(labels.shape)
    decoder_input_ids[:, 1:] = labels[:, :-1]
    decoder_input_ids[:, 0] = decoder_start_token_id
    return decoder_input_ids.masked_fill_(decoder_input_ids == -100, pad_token_id)


def is_right_padded(mask: torch.Tensor) -> bool:
    """Whether mask (B, L) is True on a prefix of each row (and False after it)."""
    return not (mask[:, 1:] & ~mask[:, :-1]).any()


class RealPositions:
    """The real (non-padding) positions of a padded batch, so that training computes nothing at its padding.

    Every sublayer but attention treats each position alike (§3.3), so a stack can run them on the N real
    positions alone, as (N, D) rows; attention, the one sublayer that mixes positions, lays its projections out as
    (B, L, D) again, zeros at the padding, which its mask hides (tensor2tensor's PadRemover, for every sublayer).
    """

    def __init__(self, mask: torch.Tensor):
        """mask (B, L), True at real positions."""
        self.batch_size, self.length = mask.shape
        self.index = mask.flatten().nonzero()[:, 0]  # (N,), row-major: the order of `tensor[mask]`

    def remove(self, padded: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) -> (N, ...)."""
        return padded.flatten(0, 1).index_select(0, self.index)

    def restore(self, rows: torch.Tensor) -> torch.Tensor:
        """(N, ...) -> (B, L, ...), zeros at the padding."""
        padded = rows.new_zeros(self.batch_size * self.length, *rows.shape[1:]).index_copy(0, self.index, rows)
        return padded.view(self.batch_size, self.length, *rows.shape[1:])


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed positions (§3.5): PE[pos, 2i] = sin(pos / 10000^(2i/D)), PE[pos, 2i+1] = cos(same angle).

    The table is a non-persistent buffer: never trained, never saved, rebuilt by `_init_weights` after loading.
    """

    def __init__(self, max_positions: int, d_model: int):
        super().__init__()
        self.max_positions, self.d_model = max_positions, d_model
        self.register_buffer("pe", self.build(), persistent=False)  # (max_positions, D)

    def build(self) -> torch.Tensor:
        position = torch.arange(self.max_positions, dtype=torch.float32)[:, None]  # (max_positions, 1)
        inverse_frequency = torch.exp(
            torch.arange(0, self.d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / self.d_model)
        )  # (ceil(D/2),)
        angles = position * inverse_frequency  # (max_positions, ceil(D/2))
        table = torch.empty(self.max_positions, self.d_model)
        table[:, 0::2] = torch.sin(angles)
        table[:, 1::2] = torch.cos(angles[:, : self.d_model // 2])
        return table

    def forward(self, length: int, offset: int | torch.Tensor = 0) -> torch.Tensor:
        """Encodings of positions offset .. offset + length - 1, shape (length, D).

        `offset` is the number of cached target tokens: an int, or a 0-d tensor for a static cache.
        """
        if isinstance(offset, int) and offset + length > self.max_positions:
            raise ValueError(
                f"Sequence of {offset + length} positions is longer than the model's max_position_embeddings "
                f"({self.max_positions}). Truncate the input (the tokenizer does so with truncation=True) or "
                f"generate fewer tokens."
            )
        positions = torch.arange(length, device=self.pe.device) + offset  # (length,)
        return self.pe[positions]


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention(Q, K, V) = softmax(QKᵀ / √Dh)·V (§3.2.1), written out: the "eager" implementation.

    query (B, H, T, Dh), key and value (B, H, K, Dh), attention_mask (B, 1, T, K) added to the scores (0 where
    a query may attend, the dtype's lowest value where it may not) -> output (B, T, H, Dh) and weights
    (B, H, T, K). It has the signature of transformers' attention interface, whose "sdpa", "flex_attention" and
    flash implementations compute the same thing with fused kernels (and return no weights).
    """
    scores = torch.matmul(query, key.transpose(-2, -1)) * scaling  # (B, H, T, K)
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    weights = scores.softmax(dim=-1)
    output = torch.matmul(F.dropout(weights, p=dropout, training=module.training), value)  # (B, H, T, Dh)
    return output.transpose(1, 2).contiguous(), weights


def additive_mask(mask: torch.Tensor | None, is_causal: bool, query: torch.Tensor,
                  key: torch.Tensor) -> torch.Tensor | None:
    """An "sdpa" mask as `eager_attention_forward` adds it to the scores: (B or 1, 1, T, K), fp32.

    sdpa's masks are boolean (True: may attend) or already additive; None is no mask or, for a causal attention over
    several queries, the causal mask sdpa's kernel applies itself (query i sees keys 0 to i)."""
    if mask is None:
        queries, keys = query.shape[-2], key.shape[-2]
        if not (is_causal and queries > 1):
            return None
        mask = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril(keys - queries)[None, None]
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, device=query.device).masked_fill_(~mask, torch.finfo(torch.float32).min)


def cpu_bf16_training_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                                **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention of a bf16 training step on a CPU, written out as `eager_attention_forward` is, on the mask the
    "sdpa" or "eager" implementation was given: the scores and softmax in fp32 (the bf16 query and key cast, as
    torch's kernel would take them in fp32), the weights and values multiplied in bf16 (as flash attention does on a
    GPU). query (B, H, T, Dh), key and value (B, H, K, Dh) -> output (B, T, H, Dh) in bf16, weights (B, H, T, K).

    torch's CPU kernel of scaled_dot_product_attention runs its backward 5-6x slower in bf16 than in fp32 (torch 2.13:
    benchmarks/results/attention_bf16_cpu.md), and in fp32 it took 15 % of a step at a training batch's lengths;
    written out, train.py's loop ran 1.08x as fast (benchmarks/results/training_attention_amd_tcmalloc.md). Scores in
    bf16 too were faster still, but scored lower in earlier default runs (docs/training.md#flops-and-mfu).
    """
    with torch.autocast("cpu", enabled=False):
        scores = torch.matmul(query.float(), key.float().transpose(-2, -1)) * scaling  # (B, H, T, K)
        mask = additive_mask(attention_mask, module.is_causal, query, key)
        weights = (scores + mask[..., : key.shape[-2]] if mask is not None else scores).softmax(dim=-1)
        dropped = F.dropout(weights, p=dropout, training=module.training).to(torch.bfloat16)
        output = torch.matmul(dropped, value.to(torch.bfloat16))  # (B, H, T, Dh)
    return output.transpose(1, 2).contiguous(), weights


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h)·W^O with head_i = Attention(Q·W_i^Q, K·W_i^K, V·W_i^V) (§3.2.2).

    The h per-head projections of Q, K and V are each one D -> D matrix (`q_proj`, `k_proj`, `v_proj`) whose
    output is split into heads. Self-attention projects all three from its input; cross-attention projects Q from
    the decoder and K, V from the encoder output.
    """

    def __init__(self, config: ScratchTransformerConfig, num_heads: int, layer_idx: int, *,
                 is_cross_attention: bool = False, is_causal: bool = False):
        super().__init__()
        self.config = config
        self.num_heads = num_heads
        self.head_dim = config.d_model // num_heads
        self.scaling = self.head_dim**-0.5
        self.dropout = config.attention_dropout
        self.layer_idx = layer_idx
        self.is_cross_attention = is_cross_attention
        self.is_causal = is_causal  # read by the fused kernels of the attention interface
        self.q_proj = nn.Linear(config.d_model, config.d_model)
        self.k_proj = nn.Linear(config.d_model, config.d_model)
        self.v_proj = nn.Linear(config.d_model, config.d_model)
        self.out_proj = nn.Linear(config.d_model, config.d_model)

    def split_heads(self, projected: torch.Tensor) -> torch.Tensor:
        """(B, L, D) -> (B, H, L, Dh)."""
        batch_size, length, _ = projected.shape
        return projected.view(batch_size, length, self.num_heads, self.head_dim).transpose(1, 2)

    def layer_cache(self, cache: Cache | None) -> Cache | None:
        """This attention's cache: an EncoderDecoderCache holds one for self- and one for cross-attention."""
        if not isinstance(cache, EncoderDecoderCache):
            return cache
        if self.is_cross_attention:
            return cache.cross_attention_cache
        return cache.self_attention_cache

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        cache: Cache | None = None,
        positions: RealPositions | None = None,
        encoder_positions: RealPositions | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states (B, T, D) [, encoder_hidden_states (B, S, D)] -> (B, T, D), weights (B, H, T, K) or None.

        With `positions` (and `encoder_positions`), hidden_states (and encoder_hidden_states) are the real positions'
        (N, D) rows, and so is the output: the projections run on real positions only."""
        keys_from = encoder_hidden_states if self.is_cross_attention else hidden_states  # (B, S or T, D)
        key_positions = encoder_positions if self.is_cross_attention else positions
        query = self.q_proj(hidden_states)
        query = self.split_heads(positions.restore(query) if positions is not None else query)  # (B, H, T, Dh)
        batch_size, _, length, _ = query.shape
        own_cache = self.layer_cache(cache)
        if self.is_cross_attention and own_cache is not None and cache.is_updated.get(self.layer_idx):
            # The encoder output does not change while decoding: its K/V were projected at the first step.
            key, value = own_cache.layers[self.layer_idx].keys, own_cache.layers[self.layer_idx].values
        else:
            key, value = self.k_proj(keys_from), self.v_proj(keys_from)
            if key_positions is not None:
                key, value = key_positions.restore(key), key_positions.restore(value)
            key, value = self.split_heads(key), self.split_heads(value)
            if own_cache is not None:
                key, value = own_cache.update(key, value, self.layer_idx)  # (B, H, K, Dh)
                if self.is_cross_attention:
                    cache.is_updated[self.layer_idx] = True

        implementation = self.config._attn_implementation
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        if (query.dtype == torch.bfloat16 and query.is_cpu and torch.is_grad_enabled()
                and implementation in ("sdpa", "eager")):
            attention = cpu_bf16_training_attention  # where torch's kernel is slow: a CPU, bf16, a backward to come
        output, weights = attention(
            self, query, key, value, attention_mask,
            dropout=self.dropout if self.training else 0.0, scaling=self.scaling, **kwargs,
        )  # (B, T, H, Dh)
        output = output.reshape(batch_size, length, -1)  # (B, T, D)
        return self.out_proj(positions.remove(output) if positions is not None else output), weights


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x·W1 + b1)·W2 + b2, applied to every position alike (§3.3)."""

    def __init__(self, config: ScratchTransformerConfig, ffn_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, config.d_model)
        self.activation = F.relu if config.activation_function == "relu" else F.gelu
        self.activation_dropout = config.activation_dropout

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.activation(self.fc1(hidden_states))  # (B, L, F)
        hidden_states = F.dropout(hidden_states, p=self.activation_dropout, training=self.training)
        return self.fc2(hidden_states)  # (B, L, D)


class AddAndNorm(GradientCheckpointingLayer):
    """Residual connection and LayerNorm around each sublayer (§3.1): LayerNorm(x + Dropout(Sublayer(x))).

    `normalize_before` moves the norm in front of the sublayer, x + Dropout(Sublayer(LayerNorm(x))) (pre-norm,
    the Annotated Transformer's choice); the sublayer code is the same either way.
    """

    def __init__(self, config: ScratchTransformerConfig):
        super().__init__()
        self.normalize_before = config.normalize_before
        self.dropout = config.dropout

    def sublayer_input(self, hidden_states: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
        return norm(hidden_states) if self.normalize_before else hidden_states

    def add_and_norm(self, residual: torch.Tensor, sublayer_output: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
        hidden_states = residual + F.dropout(sublayer_output, p=self.dropout, training=self.training)
        return hidden_states if self.normalize_before else norm(hidden_states)


class ScratchEncoderLayer(AddAndNorm):
    """Self-attention, then feed-forward, each wrapped in Add & Norm."""

    def __init__(self, config: ScratchTransformerConfig, layer_idx: int):
        super().__init__(config)
        self.self_attn = MultiHeadAttention(config, config.encoder_attention_heads, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.feed_forward = PositionwiseFeedForward(config, config.encoder_ffn_dim)
        # Marian's name for the feed-forward's norm (the layer's last)
        self.final_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                positions: RealPositions | None = None, **kwargs) -> torch.Tensor:
        """hidden_states (B, S, D), or (N, D) at `positions`; attention_mask as built by `create_bidirectional_mask`
        -> the same shape."""
        attention_output, _ = self.self_attn(
            self.sublayer_input(hidden_states, self.self_attn_layer_norm), attention_mask=attention_mask,
            positions=positions, **kwargs
        )
        hidden_states = self.add_and_norm(hidden_states, attention_output, self.self_attn_layer_norm)
        ffn_output = self.feed_forward(self.sublayer_input(hidden_states, self.final_layer_norm))
        return self.add_and_norm(hidden_states, ffn_output, self.final_layer_norm)


class ScratchDecoderLayer(AddAndNorm):
    """Masked self-attention, encoder-decoder (cross) attention, then feed-forward, each in Add & Norm."""

    def __init__(self, config: ScratchTransformerConfig, layer_idx: int):
        super().__init__(config)
        heads = config.decoder_attention_heads
        self.self_attn = MultiHeadAttention(config, heads, layer_idx, is_causal=True)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.cross_attn = MultiHeadAttention(config, heads, layer_idx, is_cross_attention=True)
        self.cross_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.feed_forward = PositionwiseFeedForward(config, config.decoder_ffn_dim)
        # Marian's name for the feed-forward's norm (the layer's last)
        self.final_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        self_attention_mask: torch.Tensor | None,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: EncoderDecoderCache | None = None,
        positions: RealPositions | None = None,
        encoder_positions: RealPositions | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """hidden_states (B, T, D) over encoder_hidden_states (B, S, D) -> (B, T, D); (N, D) rows where their
        `positions` are given."""
        attention_output, _ = self.self_attn(
            self.sublayer_input(hidden_states, self.self_attn_layer_norm),
            attention_mask=self_attention_mask, cache=cache, positions=positions, **kwargs,
        )
        hidden_states = self.add_and_norm(hidden_states, attention_output, self.self_attn_layer_norm)
        attention_output, _ = self.cross_attn(
            self.sublayer_input(hidden_states, self.cross_attn_layer_norm),
            attention_mask=encoder_attention_mask, encoder_hidden_states=encoder_hidden_states,
            cache=cache, positions=positions, encoder_positions=encoder_positions, **kwargs,
        )
        hidden_states = self.add_and_norm(hidden_states, attention_output, self.cross_attn_layer_norm)
        ffn_output = self.feed_forward(self.sublayer_input(hidden_states, self.final_layer_norm))
        return self.add_and_norm(hidden_states, ffn_output, self.final_layer_norm)


class ScratchTransformerPreTrainedModel(PreTrainedModel):
    """Weight init and loading shared by the stacks and the models."""

    config: ScratchTransformerConfig
    config_class = ScratchTransformerConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ScratchEncoderLayer", "ScratchDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Xavier-uniform weight matrices, zero biases, N(0, D^-1/2) embeddings, and the sinusoid table.

        The `init.*` functions skip tensors that `from_pretrained` already loaded.
        """
        if isinstance(module, nn.Linear):
            init.xavier_uniform_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            if not getattr(module.weight, "_is_hf_initialized", False):  # a view of a loaded row has no such flag
                init.normal_(module.weight, mean=0.0, std=self.config.d_model**-0.5)
                if module.padding_idx is not None:
                    init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, SinusoidalPositionalEncoding):
            init.copy_(module.pe, module.build())

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        """The ties this model declares. Unlike the default, sharing the encoder's and decoder's embeddings
        does not depend on `tie_word_embeddings` (which only ties the output projection, in `_tied_weights_keys`)."""
        if all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        return dict(self._tied_weights_keys or {})


class TransformerStack(ScratchTransformerPreTrainedModel):
    """What encoder and decoder share: token embeddings × √D plus positions, dropout (§3.4, §3.5), N layers, and a
    final LayerNorm in pre-norm. A subclass names its `layer_class` and the config field counting its layers."""

    layer_class: type[nn.Module]
    num_layers_field: str  # "encoder_layers" or "decoder_layers"

    def __init__(self, config: ScratchTransformerConfig):
        super().__init__(config)
        num_layers = getattr(config, self.num_layers_field)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model, config.pad_token_id)
        self.embed_positions = SinusoidalPositionalEncoding(config.max_position_embeddings, config.d_model)
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.dropout = config.dropout
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(num_layers))
        self.layer_norm = (nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.normalize_before
                           else None)  # the stack's last norm, pre-norm only (mBART's name)
        self.post_init()

    def token_embeddings(self, input_ids: torch.LongTensor | None, inputs_embeds: torch.Tensor | None,
                         names: str) -> torch.Tensor:
        """The embeddings (B, L, D) of input_ids, or inputs_embeds as given; exactly one of them (`names` them)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError(f"Pass exactly one of {names}.")
        return self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds

    def embed(self, inputs_embeds: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        """Token embeddings (B, L, D) × √D + the encodings of positions offset .. offset + L - 1, dropout."""
        hidden_states = inputs_embeds * self.embed_scale + self.embed_positions(inputs_embeds.shape[1], offset)
        return F.dropout(hidden_states, p=self.dropout, training=self.training)

    def final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(hidden_states) if self.layer_norm is not None else hidden_states


class ScratchEncoder(TransformerStack):
    """Embeddings followed by N encoder layers (and a final LayerNorm in pre-norm)."""

    _can_record_outputs = {
        "hidden_states": ScratchEncoderLayer,
        "attentions": OutputRecorder(MultiHeadAttention, index=1, layer_name="self_attn"),
    }

    layer_class, num_layers_field = ScratchEncoderLayer, "encoder_layers"

    @merge_with_config_defaults
    @capture_outputs
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, skip_padding: bool = False,
                **kwargs: Unpack[TransformersKwargs]) -> BaseModelOutput:
        """input_ids (B, S) or inputs_embeds (B, S, D), attention_mask (B, S) 1/0 -> last_hidden_state (B, S, D).

        `skip_padding` runs the layers at the real positions of attention_mask only (training); the output is zero
        at the padding (hidden states recorded by `output_hidden_states` are then (N, D))."""
        inputs_embeds = self.token_embeddings(input_ids, inputs_embeds,
                                              "`input_ids` and `inputs_embeds` to the encoder")
        hidden_states = self.embed(inputs_embeds)
        positions = None
        if skip_padding and attention_mask is not None and not attention_mask.all():
            positions = RealPositions(attention_mask.bool())
            hidden_states = positions.remove(hidden_states)  # (N, D)
        attention_mask = create_bidirectional_mask(
            config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask
        )
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, positions=positions, **kwargs)
        hidden_states = self.final_norm(hidden_states)
        return BaseModelOutput(last_hidden_state=positions.restore(hidden_states) if positions is not None else hidden_states)


class ScratchDecoder(TransformerStack):
    """Embeddings (offset by the cached length) followed by N decoder layers (and a final LayerNorm in pre-norm)."""

    _can_record_outputs = {
        "hidden_states": ScratchDecoderLayer,
        "attentions": OutputRecorder(MultiHeadAttention, index=1, layer_name="self_attn"),
        "cross_attentions": OutputRecorder(MultiHeadAttention, index=1, layer_name="cross_attn"),
    }

    layer_class, num_layers_field = ScratchDecoderLayer, "decoder_layers"

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")  # transformers' name before 5.24
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None, inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None, real_positions: torch.BoolTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        """input_ids (B, T) over the encoder output (B, S, D) -> last_hidden_state (B, T, D) and the cache.

        attention_mask (B, K) marks real target tokens (cached and new); the causal mask is added to it.
        `real_positions` (B, T), True on a prefix of each row (a right-padded target, training without a cache),
        runs the layers at those positions only, over the encoder output's real positions (encoder_attention_mask),
        and returns last_hidden_state (N, D): the True positions in row-major order.
        """
        inputs_embeds = self.token_embeddings(input_ids, inputs_embeds,
                                              "`decoder_input_ids` and `decoder_inputs_embeds` to the decoder")
        if real_positions is not None and (use_cache or cache is not None or not is_right_padded(real_positions)):
            raise ValueError("`real_positions` must be True on a prefix of each row, and the call use no cache: the "
                             "decoder's causal attention then never reads the positions it skips.")
        if use_cache and cache is None:
            cache = EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
        past_length = cache.get_seq_length() if cache is not None else 0

        hidden_states = self.embed(inputs_embeds, offset=past_length)
        positions = encoder_positions = None
        if real_positions is not None:
            positions = RealPositions(real_positions)
            if encoder_attention_mask is not None and not encoder_attention_mask.all():
                encoder_positions = RealPositions(encoder_attention_mask.bool())
        self_attention_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        causal_mask = create_causal_mask(
            config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
            cache=self_attention_cache,
        )
        encoder_attention_mask = create_bidirectional_mask(
            config=self.config, inputs_embeds=inputs_embeds, attention_mask=encoder_attention_mask,
            encoder_hidden_states=encoder_hidden_states,
        )
        if positions is not None:
            hidden_states = positions.remove(hidden_states)  # (N, D)
        if encoder_positions is not None:
            encoder_hidden_states = encoder_positions.remove(encoder_hidden_states)  # (N_S, D)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                causal_mask,
                encoder_hidden_states,  # positional, for gradient checkpointing
                encoder_attention_mask=encoder_attention_mask,
                cache=cache if use_cache else None,
                positions=positions,
                encoder_positions=encoder_positions,
                **kwargs,
            )
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=self.final_norm(hidden_states), cache=cache if use_cache else None
        )


class ScratchTransformerModel(ScratchTransformerPreTrainedModel):
    """The bare encoder-decoder: token ids in, decoder hidden states (B, T, D) out.

    With `share_encoder_decoder_embeddings` (§3.4: one vocabulary), `shared`, `encoder.embed_tokens` and
    `decoder.embed_tokens` are tied parameters, saved once as `shared.weight`.
    """

    def __init__(self, config: ScratchTransformerConfig):
        super().__init__(config)
        if config.share_encoder_decoder_embeddings:
            self.shared = nn.Embedding(config.vocab_size, config.d_model, config.pad_token_id)
            self._tied_weights_keys = {
                "encoder.embed_tokens.weight": "shared.weight",
                "decoder.embed_tokens.weight": "shared.weight",
            }
        else:
            self._tied_weights_keys = None
        self.encoder = ScratchEncoder(config)
        self.decoder = ScratchDecoder(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        if self.config.share_encoder_decoder_embeddings:
            self.shared = self.encoder.embed_tokens = self.decoder.embed_tokens = value
        else:
            self.encoder.embed_tokens = value

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None, cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None, decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None, decoder_real_positions: torch.BoolTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqModelOutput:
        """Encode the source (unless `encoder_outputs` are given) and decode the target prefix.

        input_ids (B, S), attention_mask (B, S) with 1 for real tokens, decoder_input_ids (B, T)
        -> last_hidden_state (B, T, D), encoder_last_hidden_state (B, S, D), cache.
        `decoder_real_positions` (B, T), a right-padded target's real positions (training), skips the padding:
        the encoder runs at attention_mask's real positions, the decoder at these, last_hidden_state is (N, D).
        """
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                skip_padding=decoder_real_positions is not None, **kwargs
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(
                last_hidden_state=encoder_outputs[0],
                hidden_states=encoder_outputs[1] if len(encoder_outputs) > 1 else None,
                attentions=encoder_outputs[2] if len(encoder_outputs) > 2 else None,
            )
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            real_positions=decoder_real_positions,
            **kwargs,
        )
        return Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            cache=decoder_outputs.cache,
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )


class ScratchTransformerForConditionalGeneration(ScratchTransformerPreTrainedModel, GenerationMixin):
    """The Transformer with its output projection to the target vocabulary: translation with `generate()`.

    Example:
        >>> import torch, hf_scratch_transformer
        >>> from transformers import AutoModelForSeq2SeqLM
        >>> config = hf_scratch_transformer.ScratchTransformerConfig.from_preset("tiny", vocab_size=100)
        >>> model = AutoModelForSeq2SeqLM.from_config(config)
        >>> source = torch.tensor([[5, 6, 7, 2]])
        >>> model.generate(source, max_new_tokens=5).shape[0]
        1
    """

    accepts_loss_kwargs = False  # the loss is a mean; the Trainer must keep dividing by accumulation steps

    def __init__(self, config: ScratchTransformerConfig):
        super().__init__(config)
        self.model = ScratchTransformerModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._tied_weights_keys = {}
        if config.share_encoder_decoder_embeddings:
            self._tied_weights_keys = {
                "model.encoder.embed_tokens.weight": "model.shared.weight",
                "model.decoder.embed_tokens.weight": "model.shared.weight",
            }
        if config.tie_word_embeddings:  # §3.4: the output projection is the (target) embedding matrix
            source = "model.shared.weight" if config.share_encoder_decoder_embeddings else "model.decoder.embed_tokens.weight"
            self._tied_weights_keys["lm_head.weight"] = source
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        label_smoothing: float = 0.0,
        logits_mask: torch.BoolTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqLMOutput:
        """Logits (B, T, V) over the target vocabulary, and the mean cross-entropy of those logits when `labels`
        (B, T) are given (positions labelled -100 are ignored).

        Without `decoder_input_ids` the decoder input is the labels shifted right (teacher forcing).
        `label_smoothing` (paper §5.4: 0.1) spreads that much of each target's probability mass over the
        vocabulary in the loss. `logits_mask` (B, T) computes the logits of the positions where it is True only,
        as (N, V) in row-major order: training scores no padding, and the output projection, the largest product
        of a target token, need not run there. Where it is True on a prefix of each row and no cache is used (a
        right-padded training batch), no layer runs at the padding of source or target (`RealPositions`).
        """
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        skip_padding = (logits_mask is not None and use_cache is False and cache is None
                        and is_right_padded(logits_mask))
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=cache,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            decoder_real_positions=logits_mask if skip_padding else None,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state  # (B, T, D), or (N, D) when skipping the padding
        if logits_mask is not None:
            hidden_states = hidden_states if skip_padding else hidden_states[logits_mask]
            labels = None if labels is None else labels[logits_mask]
        logits = self.lm_head(hidden_states)  # (B, T, V), or (N, V) under logits_mask
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100, label_smoothing=label_smoothing
            )
        # the base model's outputs (cache, hidden states, attentions) go on, its last hidden state became the logits
        return Seq2SeqLMOutput(loss=loss, logits=logits,
                               **{name: value for name, value in outputs.items() if name != "last_hidden_state"})

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """transformers' `generate()`, except that a call asking for plain greedy or beam search
        (decoding.plain_decoding) runs decoding.py's loops: the same tokens without generate()'s per-step machinery."""
        call = plain_decoding(self, inputs, generation_config, kwargs)
        if call is None:
            return super().generate(inputs, generation_config, **kwargs)
        return search(self, call)[0]


# Saving a model also copies this file and its configuration into the directory (remote code).
ScratchTransformerModel.register_for_auto_class("AutoModel")
ScratchTransformerForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")

__all__ = [
    "ScratchTransformerPreTrainedModel",
    "ScratchTransformerModel",
    "ScratchTransformerForConditionalGeneration",
    "shift_tokens_right",
]
