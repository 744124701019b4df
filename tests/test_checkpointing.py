"""checkpointing.py: resuming (bit for bit, or refused with one line naming what differs) and averaging."""

import json
import os
import shutil
import signal

import pytest
import torch
from helpers import (
    MODEL_CARD_TEMPLATE,
    digests,
    fails_with,
    pair_records,
    quick_flags,
    run_quick,
    run_tiny,
    saved_files,
    tiny_run_flags,
    write_jsonl,
)
from safetensors.torch import load_file

from hf_scratch_transformer.training.arguments import RunArguments
from hf_scratch_transformer.training.checkpointing import read_run_state
from hf_scratch_transformer.training.loop import TrainingCallback, training_callbacks
from hf_scratch_transformer.training.run_directory import CHECKPOINT_COMPLETE, list_checkpoints
from hf_scratch_transformer.training.run import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models on shared cores


# ------------------------------------------------------------------------------------------------------------ resuming


class CtrlCAfterStep(TrainingCallback):
    """A real SIGINT to this process at the end of step `step`."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, loop):
        if loop.state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGINT)


def test_stop_and_resume_ends_with_the_same_weights(tmp_path, capsys):
    """Stopped by Ctrl-C mid-run, under the default (linear, length-dependent) schedule."""
    flags = dict(max_steps=12, save_steps=4, eval_steps=0, max_train_samples=40, max_tokens=256,
                 cpu_threads=1)  # bit for bit only at a pinned thread count (an adapted one changes the sums)
    run_tiny(tmp_path / "straight", **flags)
    with training_callbacks(CtrlCAfterStep(5)):  # seen after step 6
        message = fails_with(tiny_run_flags(tmp_path / "resumed", **flags), capsys, code=130)
    assert "checkpoint saved at step 6" in message
    run_tiny(tmp_path / "resumed", **flags, resume_from_checkpoint="latest")
    straight = load_file(tmp_path / "straight" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    state = json.loads((tmp_path / "resumed" / "checkpoint-12" / "run_state.json").read_text())
    assert state["global_step"] == 12 and state["epoch"] >= 1  # the run crossed an epoch boundary


def test_resume_with_another_model_config_is_refused(finished_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = digests(run_dir / "checkpoint-4")
    message = fails_with(tiny_run_flags(run_dir, max_steps=6, save_steps=2, eval_steps=0, d_model=96, ffn_dim=128,
                                        resume_from_checkpoint="latest"), capsys)
    assert "checkpoint-4 was made with another model config (" in message
    assert "d_model 64 -> 96" in message and "encoder_ffn_dim 256 -> 128" in message
    assert "resume with the same --preset and size flags" in message
    assert digests(run_dir / "checkpoint-4") == before and saved_files(run_dir) == saved_files(finished_run)


def test_resume_in_another_precision_is_refused(finished_run, tmp_path, capsys):
    """The precision sets the run-length rule's steps on a CPU (Recipe.step_budget), hence the schedule: a run
    trained in fp32 is not continued in bf16 (as when a checkpoint moves to a CPU where bf16 is the default)."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = digests(run_dir / "checkpoint-4")
    message = fails_with(tiny_run_flags(run_dir, max_steps=6, resume_from_checkpoint="latest", bf16=True), capsys)
    assert "checkpoint-4 was trained with other settings (--bf16 False -> True)" in message
    assert digests(run_dir / "checkpoint-4") == before


def test_resume_with_the_masking_of_protected_spans_changed_is_refused(finished_run, tmp_path, capsys):
    """The masking changes the training pairs themselves (and the tokenizer's sentinels): a run started with it is
    not continued without it."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    message = fails_with(tiny_run_flags(run_dir, max_steps=6, resume_from_checkpoint="latest",
                                        mask_protected_spans=False), capsys)
    assert "checkpoint-4 was trained with other settings (--mask_protected_spans True -> False)" in message


def forget_the_packing(checkpoint):
    """The run state of `checkpoint` as a version before the batch-packing setting saved it."""
    state_file = checkpoint / "run_state.json"
    state = json.loads(state_file.read_text())
    del state["settings"]["batch_packing"]
    state_file.write_text(json.dumps(state))
    marker = checkpoint / CHECKPOINT_COMPLETE  # the checkpoint stays complete: its marker records each file's size
    complete = json.loads(marker.read_text())
    complete["files"]["run_state.json"] = state_file.stat().st_size
    marker.write_text(json.dumps(complete))


def test_resume_of_a_noised_run_packed_before_its_noise_is_refused(finished_run, tmp_path, capsys):
    """Runs saved before the batches were packed by the lengths after the training noise packed them by the
    tokenised ones: resumed now, the rest of the epoch would be other batches (examples trained twice, others not
    at all), so it is refused."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    assert read_run_state(run_dir / "checkpoint-4").settings["batch_packing"] == "by the lengths after the training noise"
    forget_the_packing(run_dir / "checkpoint-4")
    message = fails_with(tiny_run_flags(run_dir, max_steps=6, resume_from_checkpoint="latest"), capsys)
    assert ("checkpoint-4 was trained with other settings (the packing of the training batches (this version packs "
            "them by the lengths the noise gives) 'by the tokenised lengths' -> 'by the lengths after the training "
            "noise')") in message


def test_resume_of_a_run_without_noise_saved_before_the_packing_setting_goes_on(tmp_path, capsys):
    """Without training noise the packing never changed: such a checkpoint resumes."""
    run_dir = tmp_path / "run"
    no_noise = dict(source_paraphrase_rate=0.0, source_plain_quotes_rate=0.0, source_lowercase_rate=0.0,
                    eval_steps=0, save_steps=2, max_predict_samples=4)
    assert main(tiny_run_flags(run_dir, max_steps=2, **no_noise), MODEL_CARD_TEMPLATE) == 0
    assert read_run_state(run_dir / "checkpoint-2").settings["batch_packing"] == "by the tokenised lengths"
    forget_the_packing(run_dir / "checkpoint-2")
    assert main(tiny_run_flags(run_dir, max_steps=4, resume_from_checkpoint="latest", **no_noise),
                MODEL_CARD_TEMPLATE) == 0
    assert read_run_state(run_dir / "checkpoint-4").global_step == 4


def test_resume_from_a_half_copied_checkpoint_is_refused(finished_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    weights = run_dir / "checkpoint-4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    # the truncated checkpoint no longer counts as complete (its completion marker records the sizes) ...
    message = fails_with(tiny_run_flags(run_dir, max_steps=6, resume_from_checkpoint=str(run_dir / "checkpoint-4")),
                         capsys)
    assert f"--resume_from_checkpoint {run_dir / 'checkpoint-4'}: not a complete checkpoint" in message
    assert "model.safetensors is missing or has another size" in message
    # ... so `latest` is checkpoint-2, and resuming from it would overwrite checkpoint-4: refused, both named
    message = fails_with(tiny_run_flags(run_dir, max_steps=6, resume_from_checkpoint="latest"), capsys)
    assert f"resuming from {run_dir / 'checkpoint-2'} (step 2)" in message
    assert "checkpoint-4 (incomplete)" in message and "--overwrite_newer_checkpoints" in message


def test_resume_from_a_corrupted_checkpoint_is_refused(finished_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    weights = run_dir / "checkpoint-4" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"\xff" * 8  # same size, broken header
    weights.write_bytes(bytes(data))
    message = fails_with(tiny_run_flags(run_dir, max_steps=6, resume_from_checkpoint="latest"), capsys)
    assert f"checkpoint {run_dir / 'checkpoint-4'} cannot be loaded" in message
    assert "incomplete or corrupted; resume from an earlier checkpoint-N" in message


def test_resuming_an_older_checkpoint_moves_the_newer_ones_aside_when_asked(tmp_path, capsys):
    run_quick(tmp_path, max_steps=4, save_steps=2, eval_steps=0)
    newer = load_file(tmp_path / "checkpoint-4" / "model.safetensors")
    run_quick(tmp_path, max_steps=4, save_steps=2, eval_steps=0, resume_from_checkpoint=str(tmp_path / "checkpoint-2"),
        overwrite_newer_checkpoints=True, learning_rate=RunArguments().learning_rate)  # the default, given explicitly
    [aside] = tmp_path.glob("abandoned-after-2-*")
    assert sorted(path.name for path in aside.iterdir()) == ["checkpoint-4"]
    assert all(torch.equal(newer[name], value) for name, value in
               load_file(aside / "checkpoint-4" / "model.safetensors").items())  # kept as it was
    assert [path.name for path in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]  # rotation kept
    state = json.loads((tmp_path / "checkpoint-4" / "run_state.json").read_text())
    assert state["global_step"] == 4


def test_a_checkpoint_counts_only_with_its_completion_marker_and_files(tmp_path):
    run_quick(tmp_path, max_steps=4, save_steps=2, eval_steps=0)
    assert [path.name for path in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]
    (tmp_path / "checkpoint-4" / "optimizer.bin").unlink()  # a file listed by the marker is gone
    assert [path.name for path in list_checkpoints(tmp_path)] == ["checkpoint-2"]
    (tmp_path / "checkpoint-2" / CHECKPOINT_COMPLETE).unlink()  # no marker: not complete
    assert list_checkpoints(tmp_path) == []


def test_resume_on_changed_training_data_is_refused_unless_asked(tmp_path, capsys):
    """The corpus file at the same path changed by one letter: same size, same number of pairs; the hash of the
    sampled pairs tells. With --ignore_data_changes the run goes on and records the new data."""
    corpus = write_jsonl(tmp_path / "train.jsonl", pair_records())
    run_dir = tmp_path / "run"
    flags = dict(train_file=corpus, save_steps=2, eval_steps=0)  # validation and test are carved out of it
    run_quick(run_dir, max_steps=2, **flags)
    corpus.write_text(corpus.read_text(encoding="utf-8").replace("Jesus wept.", "Jesus wepT."), encoding="utf-8")
    checkpoint = run_dir / "checkpoint-2"
    before = digests(checkpoint)
    message = fails_with(quick_flags(run_dir, max_steps=4, **flags, resume_from_checkpoint="latest"), capsys)
    assert message == (f"error: the training data changed since {checkpoint} was saved ({corpus}: other text in the "
                       f"64 pairs sampled): the resumed run would go on with its tokenizer and position in the data "
                       f"on other pairs; resume with the data it was trained on, start a new --output_dir, or add "
                       f"--ignore_data_changes to continue on the new data")
    assert digests(checkpoint) == before and not (run_dir / "checkpoint-4").exists()
    argv = quick_flags(run_dir, max_steps=4, **flags, resume_from_checkpoint="latest", ignore_data_changes=True)
    assert main(argv, MODEL_CARD_TEMPLATE) == 0
    old, new = read_run_state(checkpoint).data_fingerprint, read_run_state(run_dir / "checkpoint-4").data_fingerprint
    assert new["sample_sha256"] != old["sample_sha256"] and new["pairs"] == old["pairs"]


def test_max_steps_below_the_checkpoint_is_refused_before_any_work(finished_run, capsys):
    before = digests(finished_run / "checkpoint-4")
    message = fails_with(tiny_run_flags(finished_run, max_steps=3, resume_from_checkpoint="latest"), capsys)
    assert message == (f"error: checkpoint {finished_run / 'checkpoint-4'} is at step 4, past the 3 steps this run is "
                       f"set to (--max_steps, or --num_train_epochs): the resumed run would save that longer-trained "
                       f"model as its result; raise --max_steps to train on from step 4, or resume from a "
                       f"checkpoint-N with N <= 3")
    assert digests(finished_run / "checkpoint-4") == before


# ----------------------------------------------------------------------------------------------------------- averaging


def test_checkpoint_averaging(tmp_path):
    results = run_tiny(tmp_path, max_steps=8, save_steps=2, save_total_limit=3, average_checkpoints=3, eval_steps=0)
    assert results["averaged_checkpoints"] == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    final = load_file(tmp_path / "model.safetensors")
    parts = [load_file(tmp_path / name / "model.safetensors") for name in results["averaged_checkpoints"]]
    torch.testing.assert_close(final["model.shared.weight"], sum(p["model.shared.weight"] for p in parts) / 3)
    card = (tmp_path / "README.md").read_text()  # the model card states what the final weights are
    assert "Final weights: the average of the last 3 checkpoints (checkpoint-4, checkpoint-6, checkpoint-8)" in card


def test_the_data_fingerprint_counts_both_files_of_plain_text_pairs(tmp_path):
    """A prefix of plain-text pairs (train.en + train.es) is sized by both files: a change to either shows."""
    from datasets import Dataset

    from hf_scratch_transformer.training.checkpointing import data_fingerprint
    from hf_scratch_transformer.data.loading import DataArguments

    (tmp_path / "train.en").write_text("Jesus wept.\nGod is love.\n", encoding="utf-8")
    (tmp_path / "train.es").write_text("Jesús lloró.\nDios es amor.\n", encoding="utf-8")
    data_args = DataArguments(train_file=str(tmp_path / "train"))
    split = Dataset.from_list([{"translation": {"en": "Jesus wept.", "es": "Jesús lloró."}}])
    before = data_fingerprint(split, data_args)
    assert before["bytes"] == len("Jesus wept.\nGod is love.\n") + len("Jesús lloró.\nDios es amor.\n".encode())
    (tmp_path / "train.es").write_text("Jesús lloró.\nDios es amor!!\n", encoding="utf-8")
    assert data_fingerprint(split, data_args)["bytes"] == before["bytes"] + 1


def test_resume_with_the_corpus_named_by_another_path_goes_on_and_another_file_is_refused(tmp_path, capsys,
                                                                                          monkeypatch):
    """A run started with `--train_file train.jsonl` from the corpus's folder resumes with the absolute path or a
    link to the same file; a copy of the file under another name is another setting and stays refused."""
    corpus = write_jsonl(tmp_path / "train.jsonl", pair_records())
    run_dir = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    run_quick(run_dir, max_steps=2, train_file="train.jsonl", save_steps=2, eval_steps=0)
    (tmp_path / "link.jsonl").symlink_to(corpus)
    argv = quick_flags(run_dir, max_steps=4, train_file=tmp_path / "link.jsonl", save_steps=2, eval_steps=0,
                       resume_from_checkpoint="latest")
    assert main(argv, MODEL_CARD_TEMPLATE) == 0
    assert read_run_state(run_dir / "checkpoint-4").global_step == 4
    shutil.copy(corpus, tmp_path / "copy.jsonl")
    message = fails_with(quick_flags(run_dir, max_steps=6, train_file=tmp_path / "copy.jsonl", save_steps=2,
                                     eval_steps=0, resume_from_checkpoint="latest"), capsys)
    # recorded as the file it names, so that the message names both files in full
    assert (f"was trained with other settings (--train_file {os.path.realpath(corpus)!r} -> "
            f"{os.path.realpath(tmp_path / 'copy.jsonl')!r})") in message


@pytest.mark.parametrize("flags, packing", [
    ({}, "by the lengths after the training noise"),  # the default recipe's noise, token buckets
    ({"streaming": True}, "by the tokenised lengths"),  # a stream is packed in its order, not by length
    ({"max_tokens": 0}, "by the tokenised lengths"),  # fixed-size batches: not packed by length
    ({"source_paraphrase_rate": 0.0, "source_plain_quotes_rate": 0.0, "source_lowercase_rate": 0.0},
     "by the tokenised lengths"),  # no noise
])
def test_the_packing_setting_changes_only_where_the_packing_did(tmp_path, flags, packing):
    """Only runs whose batches the new packing changes refuse a checkpoint saved before the setting existed."""
    from hf_scratch_transformer.training.arguments import parse_arguments
    from hf_scratch_transformer.training.checkpointing import resume_settings
    from hf_scratch_transformer.training.recipe import resolve_recipe

    model_args, data_args, args = parse_arguments(quick_flags(tmp_path, **flags))
    recipe = resolve_recipe(model_args, data_args, args, torch.device("cpu"))
    assert resume_settings(args, data_args, recipe)["batch_packing"] == packing
