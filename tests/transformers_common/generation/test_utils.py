"""GenerationTesterMixin: the generation checks an encoder-decoder model of this package must pass.

transformers' own mixin of this name lives in its repository's tests/generation/ (not in the source
distribution); this one checks the same contract for an encoder-decoder model: every decoding strategy against
a reference computed from plain forward passes, the cache implementations (dynamic, static, compiled) against
each other, and the dictionary outputs.
"""

import copy

import torch
from transformers import CompileConfig, GenerationConfig
from transformers.cache_utils import EncoderDecoderCache


class GenerationTesterMixin:
    max_new_tokens = 8

    # ---- helpers ------------------------------------------------------------------------------------------
    def _generation_inputs(self):
        """(config, {"input_ids", "attention_mask"}) with one right-padded row, as a tokenizer would pad it.

        The inputs are drawn from a seeded generator: token-exact comparisons between numerically different
        paths (static vs dynamic cache) would otherwise meet an occasional near-tie of two logits."""
        from ..test_modeling_common import global_rng  # the generator of ids_tensor

        global_rng.seed(0)
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        input_ids = inputs["input_ids"][:4].clone()
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, -3:] = 0
        input_ids[1, -3:] = config.pad_token_id
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}

    def _models(self, config):
        for model_class in self.all_generative_model_classes:
            torch.manual_seed(0)
            yield model_class(copy.deepcopy(config)).eval()

    def _generate(self, model, inputs, **kwargs):
        kwargs = {"max_new_tokens": self.max_new_tokens, "do_sample": False, **kwargs}
        with torch.no_grad():
            return model.generate(**inputs, **kwargs)

    def _reference_greedy(self, model, inputs, max_new_tokens):
        """Greedy decoding written as full forward passes (no cache): argmax of the last position each step,
        finished rows padded, stop when every row has emitted `</s>`."""
        config = model.generation_config
        sequences = torch.full((inputs["input_ids"].shape[0], 1), config.decoder_start_token_id)
        finished = torch.zeros(sequences.shape[0], dtype=torch.bool)
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = model(**inputs, decoder_input_ids=sequences, use_cache=False).logits[:, -1]
                next_tokens = logits.argmax(-1).masked_fill(finished, config.pad_token_id)
                sequences = torch.cat([sequences, next_tokens[:, None]], dim=-1)
                finished |= next_tokens == config.eos_token_id
                if finished.all():
                    break
        return sequences

    # ---- greedy -------------------------------------------------------------------------------------------
    def test_greedy_generate_equals_argmax_of_forward(self):
        config, inputs = self._generation_inputs()
        for model in self._models(config):
            expected = self._reference_greedy(model, inputs, self.max_new_tokens)
            # a plain argmax: no forced end token (Marian's config forces one at the maximum length)
            self.assertTrue(torch.equal(self._generate(model, inputs, forced_eos_token_id=None), expected))
            self.assertGreater(len(set(expected[:, 1:].flatten().tolist())), 1, "a degenerate reference proves nothing")

    def test_greedy_generate_without_cache(self):
        config, inputs = self._generation_inputs()
        for model in self._models(config):
            self.assertTrue(torch.equal(self._generate(model, inputs), self._generate(model, inputs, use_cache=False)))

    def test_greedy_generate_with_static_cache(self):
        config, inputs = self._generation_inputs()
        for model in self._models(config):
            dynamic = self._generate(model, inputs)
            static = self._generate(model, inputs, cache_implementation="static")
            self.assertTrue(torch.equal(dynamic, static))

    def _compiled_static_generate(self, model, inputs, backend):
        compile_config = CompileConfig(fullgraph=True, backend=backend, mode="default" if backend == "inductor" else None)
        compile_config._compile_all_devices = True  # transformers compiles decoding on accelerators only by default
        output = self._generate(model, inputs, cache_implementation="static", compile_config=compile_config)
        self.assertTrue(hasattr(model, "_compiled_call"), "generate() did not take the compiled path")
        return output

    def test_greedy_generate_compiled_fullgraph(self):
        """Full-graph capture of a decoding step (dynamo, no graph break) gives the tokens of the dynamic cache."""
        config, inputs = self._generation_inputs()
        for model in self._models(config):
            dynamic = self._generate(model, inputs)
            torch._dynamo.reset()
            self.assertTrue(torch.equal(self._compiled_static_generate(model, inputs, backend="eager"), dynamic))

    def test_greedy_generate_compiled_inductor(self):
        """The same with inductor's generated kernels (what `torch.compile` runs by default)."""
        config, inputs = self._generation_inputs()
        model = next(self._models(config))
        dynamic = self._generate(model, inputs)
        torch._dynamo.reset()
        self.assertTrue(torch.equal(self._compiled_static_generate(model, inputs, backend="inductor"), dynamic))

    def test_greedy_generate_dict_outputs(self):
        config, inputs = self._generation_inputs()
        for model in self._models(config):
            model.set_attn_implementation("eager")
            output = self._generate(model, inputs, return_dict_in_generate=True, output_scores=True,
                                    output_logits=True, output_attentions=True, output_hidden_states=True)
            new_tokens = output.sequences.shape[1] - 1
            batch = inputs["input_ids"].shape[0]
            self.assertEqual(len(output.scores), new_tokens)
            self.assertEqual(output.scores[0].shape, (batch, config.vocab_size))
            self.assertEqual(len(output.encoder_attentions), config.encoder_layers)
            self.assertEqual(len(output.encoder_hidden_states), config.encoder_layers + 1)
            self.assertEqual(len(output.decoder_attentions), new_tokens)
            self.assertEqual(len(output.cross_attentions[0]), config.decoder_layers)
            source_length = inputs["input_ids"].shape[1]
            heads = config.decoder_attention_heads
            self.assertEqual(output.cross_attentions[-1][0].shape, (batch, heads, 1, source_length))
            # padded source positions get no cross-attention
            self.assertTrue(torch.all(output.cross_attentions[0][0][1, :, :, -3:] == 0))
            self.assertTrue(isinstance(output.past_key_values, EncoderDecoderCache))
            self.assertTrue(torch.equal(output.sequences, self._generate(model, inputs)))

    def test_padded_row_decodes_as_alone(self):
        config, inputs = self._generation_inputs()
        for model in self._models(config):
            batch_output = self._generate(model, inputs)
            real = int(inputs["attention_mask"][1].sum())
            alone = self._generate(model, {"input_ids": inputs["input_ids"][1:2, :real],
                                           "attention_mask": inputs["attention_mask"][1:2, :real]})
            self.assertTrue(torch.equal(batch_output[1, : alone.shape[1]], alone[0]))

    def test_generate_from_encoder_outputs_and_inputs_embeds(self):
        config, inputs = self._generation_inputs()
        for model in self._models(config):
            expected = self._generate(model, inputs)
            with torch.no_grad():
                encoder_outputs = model.get_encoder()(**inputs)
            from_encoder = self._generate(model, {"encoder_outputs": encoder_outputs,
                                                  "attention_mask": inputs["attention_mask"]})
            embeds = model.get_input_embeddings()(inputs["input_ids"])
            from_embeds = self._generate(model, {"inputs_embeds": embeds, "attention_mask": inputs["attention_mask"]})
            self.assertTrue(torch.equal(from_encoder, expected))
            self.assertTrue(torch.equal(from_embeds, expected))

    def test_generate_continues_from_past_key_values(self):
        """The cache generate() returns continues: logits over it equal a full forward pass, and generate()
        carries on from it."""
        config, inputs = self._generation_inputs()
        for model in self._models(config):
            first = self._generate(model, inputs, min_new_tokens=3, max_new_tokens=3, return_dict_in_generate=True)
            self.assertEqual(first.past_key_values.get_seq_length(), 3)  # the last token is not yet fed
            extra = torch.randint(4, config.vocab_size, (first.sequences.shape[0], 3))
            sequences = torch.cat([first.sequences, extra], dim=-1)
            with torch.no_grad():
                full = model(**inputs, decoder_input_ids=sequences, use_cache=False).logits
                continued = model(**inputs, decoder_input_ids=sequences[:, 3:], past_key_values=first.past_key_values,
                                  use_cache=True).logits
            torch.testing.assert_close(continued, full[:, 3:], atol=1e-5, rtol=1e-5)
            again = self._generate(model, inputs, min_new_tokens=3, max_new_tokens=3, return_dict_in_generate=True)
            rest = self._generate(model, inputs, decoder_input_ids=again.sequences,
                                  past_key_values=again.past_key_values, min_new_tokens=5, max_new_tokens=5)
            self.assertEqual(rest.shape[1], again.sequences.shape[1] + 5)
            self.assertTrue(torch.equal(rest[:, : again.sequences.shape[1]], again.sequences))

    # ---- beam search and sampling -------------------------------------------------------------------------
    def test_beam_search_generate(self):
        config, inputs = self._generation_inputs()
        for model in self._models(config):
            beams = self._generate(model, inputs, num_beams=3, num_return_sequences=2, return_dict_in_generate=True,
                                   output_scores=True)
            self.assertEqual(beams.sequences.shape[0], 2 * inputs["input_ids"].shape[0])
            self.assertEqual(beams.sequences_scores.shape, (beams.sequences.shape[0],))
            # the best hypothesis of each source comes first
            self.assertTrue(torch.all(beams.sequences_scores.view(-1, 2)[:, 0] >= beams.sequences_scores.view(-1, 2)[:, 1]))
            no_cache = self._generate(model, inputs, num_beams=3, num_return_sequences=2, use_cache=False)
            static = self._generate(model, inputs, num_beams=3, num_return_sequences=2, cache_implementation="static")
            self.assertTrue(torch.equal(beams.sequences, no_cache))
            self.assertTrue(torch.equal(beams.sequences, static))

    def test_beam_search_with_one_beam_is_greedy(self):
        config, inputs = self._generation_inputs()
        for model in self._models(config):
            self.assertTrue(torch.equal(self._generate(model, inputs, num_beams=1), self._generate(model, inputs)))

    def test_sample_generate_is_reproducible_and_top_k_1_is_greedy(self):
        config, inputs = self._generation_inputs()
        for model in self._models(config):
            torch.manual_seed(1)
            first = self._generate(model, inputs, do_sample=True, num_return_sequences=2)
            torch.manual_seed(1)
            second = self._generate(model, inputs, do_sample=True, num_return_sequences=2)
            self.assertTrue(torch.equal(first, second))
            self.assertEqual(first.shape[0], 2 * inputs["input_ids"].shape[0])
            greedy_by_sampling = self._generate(model, inputs, do_sample=True, top_k=1)
            self.assertTrue(torch.equal(greedy_by_sampling, self._generate(model, inputs)))

    def test_generation_config_is_used(self):
        config, inputs = self._generation_inputs()
        for model in self._models(config):
            model.generation_config = GenerationConfig.from_dict(
                {**model.generation_config.to_dict(), "max_new_tokens": 3, "num_beams": 2}
            )
            with torch.no_grad():
                output = model.generate(**inputs)
            self.assertEqual(output.shape[1], 1 + 3)
            self.assertTrue(torch.equal(output, self._generate(model, inputs, max_new_tokens=3, num_beams=2)))
