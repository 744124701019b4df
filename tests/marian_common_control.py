"""The same common tests, run on transformers' MarianMT with the same tiny sizes: the control group of
test_transformers_common_parity.py. Not collected by default (the file name does not start with test_)."""

import unittest

from test_modeling_transformers_common import (
    ConfigTester,
    GenerationTesterMixin,
    ModelTesterMixin,
    ScratchTransformerModelTester,
)
from transformers import MarianConfig, MarianModel, MarianMTModel


class MarianModelTester(ScratchTransformerModelTester):
    def get_config(self) -> MarianConfig:
        return MarianConfig(
            vocab_size=self.vocab_size, d_model=self.hidden_size,
            encoder_layers=self.num_hidden_layers, decoder_layers=self.num_hidden_layers,
            encoder_attention_heads=self.num_attention_heads, decoder_attention_heads=self.num_attention_heads,
            encoder_ffn_dim=self.intermediate_size, decoder_ffn_dim=self.intermediate_size,
            dropout=self.dropout, attention_dropout=self.dropout, max_position_embeddings=self.max_position_embeddings,
            eos_token_id=self.eos_token_id, bos_token_id=self.bos_token_id, pad_token_id=self.pad_token_id,
            decoder_start_token_id=self.decoder_start_token_id,
        )


class MarianModelTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (MarianModel, MarianMTModel)
    is_encoder_decoder = True
    test_missing_keys = False

    def setUp(self):
        self.model_tester = MarianModelTester(self)
        self.config_tester = ConfigTester(self, config_class=MarianConfig)

    def test_config(self):
        self.config_tester.run_common_tests()
