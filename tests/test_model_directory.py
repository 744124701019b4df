"""model_directory.py: the model directory is in safetensors only, with the code trust_remote_code runs; the hub
push fails cleanly. (A failed final save on a real full disk: test_run_directory.py.)"""

from helpers import MODEL_CARD_TEMPLATE, tiny_run_flags
from transformers import AutoModelForSeq2SeqLM

from hf_scratch_transformer.training.run import main


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
