"""transformers' common model tests (ModelTesterMixin, ConfigTester, the generation checks) as test cases for this
model and, as the control group, for MarianMT at the same tiny sizes; `run_suite` runs one and reports every test's
outcome. The mixins come from `transformers_common.load_common_tests()`, called by the tests' fixture (no download
happens when this module is imported).

The tester follows transformers' own tests of Marian (tests/models/marian/test_modeling_marian.py): same tiny
sizes, same inputs. A test is skipped only for a reason that applies to Marian too.
"""

import tempfile
import unittest

from transformers import MarianConfig, MarianModel, MarianMTModel
from transformers.models.auto import modeling_auto

from hf_scratch_transformer import (
    ScratchTransformerConfig,
    ScratchTransformerForConditionalGeneration,
    ScratchTransformerModel,
)


class ScratchTransformerModelTester:
    """Tiny configs and inputs, as MarianModelTester makes them."""

    config_class = ScratchTransformerConfig

    def __init__(self, parent, ids_tensor, batch_size=13, seq_length=7, vocab_size=99, hidden_size=16,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=4, dropout=0.1,
                 max_position_embeddings=100, eos_token_id=2, pad_token_id=1, bos_token_id=0,
                 decoder_start_token_id=3):
        self.parent, self.ids_tensor, self.is_training = parent, ids_tensor, True
        self.batch_size, self.seq_length = batch_size, seq_length
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.intermediate_size, self.dropout = intermediate_size, dropout
        self.max_position_embeddings = max_position_embeddings
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.bos_token_id, self.decoder_start_token_id = bos_token_id, decoder_start_token_id
        # read by the common tests
        self.encoder_seq_length = self.decoder_seq_length = seq_length
        self.key_length = seq_length

    def get_config(self):
        return self.config_class(
            vocab_size=self.vocab_size, d_model=self.hidden_size,
            encoder_layers=self.num_hidden_layers, decoder_layers=self.num_hidden_layers,
            encoder_attention_heads=self.num_attention_heads, decoder_attention_heads=self.num_attention_heads,
            encoder_ffn_dim=self.intermediate_size, decoder_ffn_dim=self.intermediate_size,
            dropout=self.dropout, attention_dropout=self.dropout, max_position_embeddings=self.max_position_embeddings,
            eos_token_id=self.eos_token_id, bos_token_id=self.bos_token_id, pad_token_id=self.pad_token_id,
            decoder_start_token_id=self.decoder_start_token_id,
        )

    def prepare_config_and_inputs(self):
        input_ids = self.ids_tensor([self.batch_size, self.seq_length], self.vocab_size).clamp(3)
        input_ids[:, -1] = self.eos_token_id
        decoder_input_ids = self.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        config = self.get_config()
        attention_mask = input_ids.ne(config.pad_token_id)
        inputs_dict = {"input_ids": input_ids, "decoder_input_ids": decoder_input_ids,
                       "attention_mask": attention_mask, "decoder_attention_mask": attention_mask}
        return config, inputs_dict

    def prepare_config_and_inputs_for_common(self):
        return self.prepare_config_and_inputs()


class MarianModelTester(ScratchTransformerModelTester):
    config_class = MarianConfig


MODELS = {
    "scratch_transformer": (ScratchTransformerModelTester, (ScratchTransformerModel,
                                                            ScratchTransformerForConditionalGeneration)),
    "marian": (MarianModelTester, (MarianModel, MarianMTModel)),
}


def make_test_case(common, model: str) -> type[unittest.TestCase]:
    """The TestCase of `model` ("scratch_transformer" or "marian") over the common mixins of `common`
    (`load_common_tests()`'s modules)."""
    test_modeling_common, test_configuration_common, generation_test_utils = common
    # The common tests look models up in the name tables of transformers' Auto classes, where an in-tree model is
    # listed by its modeling_auto.py entry; `AutoModel.register` (what the package does) fills another table.
    modeling_auto.MODEL_MAPPING_NAMES.setdefault("scratch_transformer", "ScratchTransformerModel")
    modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.setdefault(
        "scratch_transformer", "ScratchTransformerForConditionalGeneration")
    tester_class, model_classes = MODELS[model]

    class CommonModelTest(test_modeling_common.ModelTesterMixin, generation_test_utils.GenerationTesterMixin,
                          unittest.TestCase):
        all_model_classes = model_classes
        is_encoder_decoder = True
        test_missing_keys = False  # as Marian: the tied embeddings are saved once

        def setUp(self):
            self.model_tester = tester_class(self, test_modeling_common.ids_tensor)
            self.config_tester = test_configuration_common.ConfigTester(self, config_class=tester_class.config_class)

        def test_config(self):
            self.config_tester.run_common_tests()

        def test_save_load_strict(self):
            config, _ = self.model_tester.prepare_config_and_inputs()
            for model_class in self.all_model_classes:
                with self.subTest(model_class.__name__), tempfile.TemporaryDirectory() as directory:
                    model_class(config).save_pretrained(directory)
                    _, info = model_class.from_pretrained(directory, output_loading_info=True)
                    self.assertEqual(len(info["missing_keys"]), 0, info["missing_keys"])

    CommonModelTest.__name__ = CommonModelTest.__qualname__ = f"{model}_common_model_test"
    return CommonModelTest


def run_suite(case_class: type[unittest.TestCase]) -> dict[str, tuple[str, str]]:
    """{test name: ("passed" | "failed" | "skipped", detail)} for every test of `case_class`."""
    outcomes = {}
    for test in unittest.TestLoader().loadTestsFromTestCase(case_class):
        result = unittest.TestResult()
        test.run(result)
        problems = result.errors + result.failures + [(case, "unexpected success") for case in
                                                      result.unexpectedSuccesses]
        if problems:
            outcomes[test._testMethodName] = ("failed", problems[0][1][-3000:])
        elif result.skipped and result.testsRun:
            outcomes[test._testMethodName] = ("skipped", result.skipped[0][1])
        else:
            outcomes[test._testMethodName] = ("passed", "")
    return outcomes
