import pytest
from transformers import AutoConfig

from hf_scratch_transformer import PRESETS, ScratchTransformerConfig


def test_defaults_are_the_paper_base_model():
    config = ScratchTransformerConfig()
    assert (config.d_model, config.encoder_layers, config.decoder_layers) == (512, 6, 6)
    assert (config.encoder_attention_heads, config.encoder_ffn_dim, config.dropout) == (8, 2048, 0.1)
    assert config.normalize_before is False and config.scale_embedding and config.tie_word_embeddings


@pytest.mark.parametrize(
    "name, expected",
    [("tiny", (64, 2, 4, 256)), ("small", (256, 3, 4, 1024)), ("base", (512, 6, 8, 2048)), ("big", (1024, 6, 16, 4096))],
)
def test_presets(name, expected):
    config = ScratchTransformerConfig.from_preset(name, vocab_size=1000)
    assert (config.d_model, config.encoder_layers, config.encoder_attention_heads, config.encoder_ffn_dim) == expected
    assert config.decoder_layers == config.encoder_layers and config.vocab_size == 1000


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="tiny, small, base, big"):
        ScratchTransformerConfig.from_preset("huge")


def test_standard_aliases():
    config = ScratchTransformerConfig.from_preset("small")
    assert config.hidden_size == 256 and config.num_attention_heads == 4 and config.num_hidden_layers == 3
    config.hidden_size = 128
    assert config.d_model == 128
    # generate() sizes its cache from the decoder depth
    assert ScratchTransformerConfig(decoder_layers=5).get_text_config(decoder=True).num_hidden_layers == 5


@pytest.mark.parametrize(
    "aliases, message",
    [({"hidden_size": 30, "num_attention_heads": 4}, "divisible"), ({"num_hidden_layers": 0}, "encoder_layers"),
     ({"hidden_size": -8}, "d_model"), ({"num_attention_heads": 0}, "encoder_attention_heads")],
)
def test_impossible_sizes_given_by_their_standard_aliases_are_refused(aliases, message):
    with pytest.raises(ValueError, match=message):
        ScratchTransformerConfig(**aliases)


def test_round_trip_through_auto_config(tmp_path):
    config = ScratchTransformerConfig.from_preset("tiny", vocab_size=123, normalize_before=True, dropout=0.3)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, ScratchTransformerConfig)
    assert loaded.to_diff_dict() == config.to_diff_dict()
    assert set(loaded.auto_map) == {"AutoConfig", "AutoModel", "AutoModelForSeq2SeqLM"}
    assert "translation" in loaded.custom_pipelines


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(d_model=100, encoder_attention_heads=8), "encoder_attention_heads"),
        (dict(d_model=96, decoder_attention_heads=5), "decoder_attention_heads"),
        (dict(d_model=0), "d_model"),
        (dict(encoder_layers=-1), "encoder_layers"),
        (dict(decoder_ffn_dim=0), "decoder_ffn_dim"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(dropout=1.0), "dropout"),
        (dict(attention_dropout=-0.1), "attention_dropout"),
        (dict(activation_dropout="x"), "activation_dropout"),
        (dict(vocab_size=10, pad_token_id=10), "pad_token_id"),
        (dict(vocab_size=10, eos_token_id=[2, 12]), "eos_token_id"),
        (dict(decoder_start_token_id=-1), "decoder_start_token_id"),
        (dict(activation_function="swish"), "activation_function"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        ScratchTransformerConfig(**overrides)


def test_every_preset_is_valid():
    for name in PRESETS:
        ScratchTransformerConfig.from_preset(name)
