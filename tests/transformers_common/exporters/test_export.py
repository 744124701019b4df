"""ExportTesterMixin: the model exports with `torch.export` and the exported program computes what it does."""

import torch


class ExportTesterMixin:
    test_torch_exportable = True

    def test_torch_export(self):
        if not self.test_torch_exportable:
            self.skipTest("test_torch_exportable is False")
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config).eval()
            inputs = {key: value for key, value in inputs_dict.items() if isinstance(value, torch.Tensor)}
            with torch.no_grad():
                expected = model(**inputs, use_cache=False)
                program = torch.export.export(model, args=(), kwargs={**inputs, "use_cache": False}, strict=False)
                exported = program.module()(**inputs, use_cache=False)
            key = "logits" if "logits" in expected else "last_hidden_state"
            torch.testing.assert_close(exported[key], expected[key])
