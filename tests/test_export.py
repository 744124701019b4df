"""export.py: the output directory is written whole or not at all, in safetensors only; the hub push fails cleanly."""

import os
import shutil

from helpers import MODEL_CARD_TEMPLATE, digests, fails_with, tiny_run_flags
from transformers import AutoModelForSeq2SeqLM

from hf_scratch_transformer import ScratchTransformerForConditionalGeneration
from hf_scratch_transformer.training import main
from hf_scratch_transformer.translate import load_model_and_tokenizer


def test_failed_final_save_leaves_the_previous_model_intact(finished_run, tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = digests(run_dir)
    real_save = ScratchTransformerForConditionalGeneration.save_pretrained

    def disk_full(self, directory, *args, **kwargs):
        if os.path.basename(str(directory)).startswith(".staging-"):
            real_save(self, directory, *args, **kwargs)  # a partial write, then the failure
            raise OSError(28, "No space left on device")
        return real_save(self, directory, *args, **kwargs)

    monkeypatch.setattr(ScratchTransformerForConditionalGeneration, "save_pretrained", disk_full)
    message = fails_with(tiny_run_flags(run_dir, max_steps=2, save_steps=0, eval_steps=0, overwrite_output_dir=True,
                                        max_predict_samples=4), capsys, code=1)
    assert message.startswith(f"training stopped: could not save the final model in {run_dir}")
    assert "No space left on device" in message and "before this save are unchanged" in message
    assert f"the last checkpoint is {run_dir / 'checkpoint-2'}" in message
    assert digests(run_dir) == before  # every file of the previous model, byte for byte
    assert not list(run_dir.glob(".staging-*"))
    load_model_and_tokenizer(run_dir)


def test_weights_are_written_only_as_safetensors(finished_run):
    pickles = [path for path in finished_run.rglob("*") if path.suffix in (".bin", ".pt", ".pth", ".pkl")]
    for path in pickles:  # Accelerate's optimiser / RNG states, never weights; they load with weights_only=True
        assert path.parent.name.startswith("checkpoint-") and path.name.startswith(("optimizer", "random_states"))
        from accelerate.utils import load as accelerate_load

        accelerate_load(path, map_location="cpu")  # weights_only=True under the hood (see the SIGTERM test)
    assert (finished_run / "model.safetensors").is_file() and (finished_run / "checkpoint-4" / "model.safetensors").is_file()
    # trust_remote_code=True would execute exactly these files, saved beside the weights
    assert {"modeling_scratch_transformer.py", "configuration_scratch_transformer.py",
            "pipeline_translation.py"} <= {path.name for path in finished_run.glob("*.py")}


def test_push_to_hub_offline_fails_cleanly_and_keeps_the_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(tiny_run_flags(tmp_path, max_steps=2, eval_steps=0, push_to_hub=True, hub_model_id="me/tiny"),
                MODEL_CARD_TEMPLATE)
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1
    assert message.startswith("training stopped: could not push to the hub repository 'me/tiny'")
    assert f"saved and complete in {tmp_path}" in message
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert model.num_parameters() > 0 and (tmp_path / "README.md").is_file()
