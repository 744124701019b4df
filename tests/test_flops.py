"""flops.py: the model-FLOPs formula against torch's own count of the matmuls a real forward and backward run, the
matmul peak, and the FLOP/s and MFU a training run records in train_results.json and its model card."""

import json
import time

import pytest
import torch
from helpers import run_quick
from torch.utils.flop_counter import FlopCounterMode

from hf_scratch_transformer import ScratchTransformerConfig, ScratchTransformerForConditionalGeneration
from hf_scratch_transformer.training.flops import forward_flops, matmul_peak_flops, tokens_and_flops, training_flops
from hf_scratch_transformer.training.loop import TrainingCallback, training_callbacks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Every size different, so that a formula that swaps two of them (encoder and decoder FFN, layers, heads) is off.
CONFIG = ScratchTransformerConfig(vocab_size=53, d_model=32, encoder_layers=2, decoder_layers=3,
                                  encoder_attention_heads=4, decoder_attention_heads=2, encoder_ffn_dim=48,
                                  decoder_ffn_dim=80, dropout=0.0, max_position_embeddings=64)
LENGTHS = [(7, 5), (3, 9), (12, 12), (1, 2)]  # (source, target) real tokens of each sentence pair


def padded_batch(lengths, generator) -> dict:
    """A collated batch of these real lengths, right-padded (pad 0, labels -100)."""
    source_width, target_width = max(s for s, _ in lengths), max(t for _, t in lengths)
    input_ids = torch.zeros(len(lengths), source_width, dtype=torch.long)
    labels = torch.full((len(lengths), target_width), -100)
    for row, (source, target) in enumerate(lengths):
        input_ids[row, :source] = torch.randint(4, CONFIG.vocab_size, (source,), generator=generator)
        labels[row, :target] = torch.randint(4, CONFIG.vocab_size, (target,), generator=generator)
    return {"input_ids": input_ids, "attention_mask": (input_ids != 0).long(), "labels": labels}


def counted_flops(model, batch, backward: bool) -> int:
    """torch's FlopCounterMode total of one forward (and backward) of `model` on `batch`."""
    with FlopCounterMode(display=False) as counter:
        loss = model(**batch).loss
        if backward:
            loss.backward()
    return counter.get_total_flops()


def eager_model():
    """The model with attention written out as matmuls: torch's counter sees those (bmm), not the fused CPU kernel."""
    torch.manual_seed(0)
    model = ScratchTransformerForConditionalGeneration(CONFIG)
    model.set_attn_implementation("eager")
    return model


def masked_pairs_flops(target_lengths) -> float:
    """FLOPs of the query-key pairs the decoder's causal mask removes: the counter counts the full T x T products,
    the formula only the T (T + 1) / 2 pairs the mask keeps (4 x d_model FLOPs per pair and layer)."""
    return sum(4 * CONFIG.d_model * CONFIG.decoder_layers * (t * t - t * (t + 1) / 2) for t in target_lengths)


def test_the_formula_counts_the_matmuls_of_each_sentence_s_real_tokens():
    """Each sentence alone (no padding) through a real forward: torch's count of its matmuls (linear layers, the
    lm_head, attention's QK^T and AV) is the formula's to the FLOP once the causal mask's half is set aside. The
    formula on the padded batch equals their sum: padding is not counted. Exact agreement is expected: both count
    2 FLOPs per multiply-add of the same products, and nothing else in the model is a matmul."""
    model = eager_model().eval()
    generator = torch.Generator().manual_seed(1)
    counted = 0.0
    with torch.no_grad():
        for lengths in LENGTHS:
            single = padded_batch([lengths], generator)
            counted += counted_flops(model, single, backward=False) - masked_pairs_flops([lengths[1]])
            assert forward_flops(CONFIG, [lengths[0]], [lengths[1]]) == pytest.approx(
                counted_flops(model, single, backward=False) - masked_pairs_flops([lengths[1]]), rel=1e-12)
    tokens, flops = tokens_and_flops(CONFIG, padded_batch(LENGTHS, generator))
    assert tokens == sum(s + t for s, t in LENGTHS)
    assert flops == pytest.approx(3 * counted, rel=1e-12)


def test_a_training_step_is_three_forwards():
    """Forward + backward as torch counts them (input and weight gradients of every product) is 3 x the forward:
    the formula's multiplier."""
    model = eager_model().train()
    batch = padded_batch([(9, 6)], torch.Generator().manual_seed(2))
    both = counted_flops(model, batch, backward=True) - 3 * masked_pairs_flops([6])
    assert both == pytest.approx(training_flops(CONFIG, [9], [6]), rel=1e-12)


def test_the_matmul_peak_is_the_rate_of_torch_mm_in_about_the_time_given():
    """The peak against the same products timed here (a busy core can slow either a few times), within its time."""
    began = time.perf_counter()
    peak = matmul_peak_flops(torch.float32, seconds=0.5, sizes=(256, 512))
    elapsed = time.perf_counter() - began
    left, right = torch.randn(512, 512), torch.randn(512, 512)
    torch.mm(left, right)
    began = time.perf_counter()
    for _ in range(10):
        torch.mm(left, right)
    observed = 10 * 2 * 512 ** 3 / (time.perf_counter() - began)
    assert elapsed < 2, elapsed
    assert observed / 5 < peak < observed * 5, (peak, observed)


class FlopsOfBatches(TrainingCallback):
    """The FLOPs of every batch trained, counted from the tensors the loop trained on."""

    def __init__(self):
        self.flops = 0.0

    def on_batch_end(self, loop, indices, batch, loss):
        self.flops += tokens_and_flops(loop.model.config, {key: value.cpu() for key, value in batch.items()})[1]


def test_a_run_records_its_flops_per_second_and_mfu(tmp_path):
    """train_results.json: the FLOPs of all trained batches over the seconds of train_tokens_per_second, their
    share of the matmul peak measured at the start (an MFU in (0, 1]), and the card's line."""
    batches = FlopsOfBatches()
    with training_callbacks(batches):
        run_quick(tmp_path / "out", max_steps=4, logging_steps=3, save_steps=0, eval_steps=0)
    results = json.loads((tmp_path / "out" / "train_results.json").read_text())
    seconds = results["train_tokens"] / results["train_tokens_per_second"]
    assert results["train_flops_per_second"] * seconds == pytest.approx(batches.flops, rel=2e-3)
    assert 0 < results["train_mfu"] <= 1, results
    assert results["train_mfu"] == pytest.approx(
        results["train_flops_per_second"] / results["train_matmul_peak_flops"], rel=2e-3)
    assert len(results["train_matmul_peak_flops_measured"]) == 1  # seconds of training: no second measurement
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"{results['train_mfu']:.1%} of the fp32 matmul peak measured at the start" in card


def test_a_run_measures_the_peak_again_at_its_end_and_takes_the_higher(tmp_path, monkeypatch):
    """A run as long as a real one (the end measurement's share of the training time raised to all of it) measures
    the peak again after training. The machine is made ten times as fast at the end: the MFU is against that higher
    peak, and the card names both."""
    from hf_scratch_transformer.training import flops

    monkeypatch.setattr(flops, "END_PEAK_SHARE", 1.0)
    monkeypatch.setattr(flops, "END_PEAK_MIN_SECONDS", 0.01)
    real_peak, real_product, calls = flops.matmul_peak_flops, flops.timed_matmul, []

    def peak_of_a_machine_that_speeds_up(dtype, device="cpu", seconds=1.0, **kwargs):
        calls.append(seconds)
        if len(calls) == 2:  # at the end, every product ten times as fast (a virtual machine's host gave it more)
            monkeypatch.setattr(flops, "timed_matmul", lambda operands: 10 * real_product(operands))
        return real_peak(dtype, device, seconds=seconds, **kwargs)

    monkeypatch.setattr(flops, "matmul_peak_flops", peak_of_a_machine_that_speeds_up)
    run_quick(tmp_path / "out", max_steps=4, logging_steps=3, save_steps=0, eval_steps=0)
    results = json.loads((tmp_path / "out" / "train_results.json").read_text())
    start, end = results["train_matmul_peak_flops_measured"]
    assert calls[0] == flops.START_PEAK_SECONDS and 0 < calls[1] <= flops.END_PEAK_SECONDS
    assert end > 2 * start and results["train_matmul_peak_flops"] == end  # the higher one, not the first
    assert results["train_mfu"] == pytest.approx(results["train_flops_per_second"] / end, rel=2e-3)
    card = " ".join((tmp_path / "out" / "README.md").read_text().split())
    assert (f"{results['train_mfu']:.1%} of the fp32 matmul peak, {end / 1e9:,.0f} GFLOP/s (MFU; the higher of those "
            f"measured at the start and at the end of training, {start / 1e9:,.0f} and {end / 1e9:,.0f} GFLOP/s)"
            in card)


def test_the_end_measurement_takes_a_share_of_the_training_time_and_none_after_a_short_run():
    from hf_scratch_transformer.training.flops import END_PEAK_SECONDS, end_peak_seconds

    assert end_peak_seconds(1410.0) == END_PEAK_SECONDS  # the moonshot's 23.5 minutes: 2 s
    assert end_peak_seconds(60.0) == pytest.approx(0.6)
    assert end_peak_seconds(5.0) == 0.0


def write_as_before_flops(checkpoint):
    """The checkpoint's run state as a version before FLOPs were counted wrote it: no train_flops (and the listing
    of its files, written last, with that file's size)."""
    state = json.loads((checkpoint / "run_state.json").read_text())
    del state["train_flops"]
    (checkpoint / "run_state.json").write_text(json.dumps(state, indent=1))
    listing = json.loads((checkpoint / "checkpoint_complete.json").read_text())
    listing["files"]["run_state.json"] = (checkpoint / "run_state.json").stat().st_size
    (checkpoint / "checkpoint_complete.json").write_text(json.dumps(listing, indent=1))


def test_a_run_resumed_from_a_checkpoint_without_flops_records_no_mfu(tmp_path):
    """A checkpoint written before FLOPs were counted (its run_state.json has no train_flops): the FLOPs of its steps
    are unknown, so the resumed run records no FLOP/s and no MFU rather than a rate of its own steps over all the
    seconds; a checkpoint that has them carries them on."""
    run_quick(tmp_path / "out", max_steps=2, logging_steps=1, save_steps=2, eval_steps=0)
    carried = json.loads((tmp_path / "out" / "checkpoint-2" / "run_state.json").read_text())["train_flops"]
    assert carried > 0
    run_quick(tmp_path / "out", max_steps=4, logging_steps=1, save_steps=2, eval_steps=0,
              resume_from_checkpoint="latest")
    results = json.loads((tmp_path / "out" / "train_results.json").read_text())
    assert 0 < results["train_mfu"] <= 1
    write_as_before_flops(tmp_path / "out" / "checkpoint-4")
    run_quick(tmp_path / "out", max_steps=6, logging_steps=1, save_steps=2, eval_steps=0,
              resume_from_checkpoint="latest")
    results = json.loads((tmp_path / "out" / "train_results.json").read_text())
    assert results["train_steps"] == 6 and results["train_tokens_per_second"] > 0
    assert results["train_flops_per_second"] is None and results["train_mfu"] is None
    assert results["train_matmul_peak_flops"] > 0
    assert "model FLOPs not counted: resumed from a checkpoint written before they were" in \
        (tmp_path / "out" / "README.md").read_text()
