"""The training loss (training/loss.py): torch's label-smoothed cross-entropy, value and gradient, without an fp32
copy of the logits; and the loss train.py's loop trains on."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from hf_scratch_transformer import ScratchTransformerConfig, ScratchTransformerForConditionalGeneration
from hf_scratch_transformer.training import loss as training_loss
from hf_scratch_transformer.training.loss import CPU_CHUNK_ELEMENTS, label_smoothed_cross_entropy, teacher_forced_loss

VOCABULARY = 2_003


def reference_and_ours(logits, labels, smoothing, grad_scale):
    """(loss, gradient) of torch's F.cross_entropy on the fp32 logits and of ours, each backward from loss × scale."""
    results = []
    for loss_of in (lambda z: F.cross_entropy(z.flatten(0, -2).float(), labels.flatten(), ignore_index=-100,
                                              label_smoothing=smoothing),
                    lambda z: label_smoothed_cross_entropy(z, labels, smoothing)):
        z = logits.detach().clone().requires_grad_()
        value = loss_of(z)
        (value * grad_scale).backward()
        results.append((value.detach(), z.grad))
    return results


@pytest.mark.parametrize("chunks", ["cache-sized", "one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_loss_and_its_gradient_are_torch_s_label_smoothed_cross_entropy(dtype, smoothing, chunks, monkeypatch):
    """Both ways of chunking the rows: a CPU's cache-sized chunks, and one chunk of all rows (what a GPU takes)."""
    torch.manual_seed(0)
    # more rows than a chunk, a partial last chunk, ignored positions in every chunk, logits of a wide range
    length = CPU_CHUNK_ELEMENTS // VOCABULARY + 37
    assert training_loss.chunk_rows(torch.empty(3 * length, VOCABULARY)) < length
    if chunks == "one":
        monkeypatch.setattr(training_loss, "chunk_rows", len)
    logits = (torch.randn(3, length, VOCABULARY) * 4).to(dtype)
    labels = torch.randint(0, VOCABULARY, (3, length))
    labels[:, ::5] = -100
    (reference, reference_grad), (ours, our_grad) = reference_and_ours(logits, labels, smoothing, grad_scale=0.25)
    assert ours.dtype == torch.float32 and our_grad.dtype == dtype
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    tolerance = dict(rtol=1e-5, atol=1e-8) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-8)
    torch.testing.assert_close(our_grad.float(), reference_grad.float(), **tolerance)
    assert our_grad[labels == -100].abs().max() == 0


def test_a_batch_without_targets_has_loss_and_gradient_zero():
    logits = torch.randn(4, VOCABULARY, requires_grad=True)
    value = label_smoothed_cross_entropy(logits, torch.full((4,), -100), 0.1)
    value.backward()
    assert value.item() == 0 and logits.grad.abs().max() == 0


def largest_allocation(run) -> int:
    """The largest single CPU allocation (bytes) made while `run()` runs, by torch's profiler."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        run()
    return max(event.cpu_memory_usage for event in profiler.events())


def test_bf16_logits_get_no_fp32_copy_forward_or_backward():
    """What the module is for: torch's loss makes (N, V) fp32 tensors from bf16 logits; ours makes nothing larger
    than the bf16 gradient."""
    logits = torch.randn(600, VOCABULARY).bfloat16().requires_grad_()
    labels = torch.randint(0, VOCABULARY, (600,))
    fp32_copy_bytes = logits.numel() * 4
    reference = largest_allocation(lambda: F.cross_entropy(logits.float(), labels, label_smoothing=0.1).backward())
    assert reference >= fp32_copy_bytes  # the measurement sees the copy it is there to catch
    ours = largest_allocation(lambda: label_smoothed_cross_entropy(logits, labels, 0.1).backward())
    assert ours <= logits.numel() * 2 + 4096 < fp32_copy_bytes


def test_teacher_forced_loss_is_the_model_s_own_loss_with_its_gradients():
    torch.manual_seed(0)
    config = ScratchTransformerConfig.from_preset("tiny", vocab_size=97, dropout=0.0)
    models = [ScratchTransformerForConditionalGeneration(config) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    batch = {"input_ids": torch.randint(4, 97, (3, 9)), "attention_mask": torch.ones(3, 9, dtype=torch.long),
             "labels": torch.randint(4, 97, (3, 7))}
    batch["attention_mask"][0, -3:] = 0
    batch["labels"][1, -2:] = -100
    own = models[0](**batch, label_smoothing=0.1).loss
    ours = teacher_forced_loss(models[1], batch, 0.1)
    torch.testing.assert_close(ours, own)
    own.backward()
    ours.backward()
    for (name, first), second in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(second.grad, first.grad, msg=name)


def test_teacher_forced_loss_runs_the_output_projection_on_the_labelled_positions_only():
    """The padded target positions (label -100) never reach the output projection: its rows are the labelled ones."""
    config = ScratchTransformerConfig.from_preset("tiny", vocab_size=97, dropout=0.0)
    model = ScratchTransformerForConditionalGeneration(config)
    rows = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0].shape[0]))
    labels = torch.randint(4, 97, (3, 7))
    labels[0, -4:], labels[2, -1:] = -100, -100
    batch = {"input_ids": torch.randint(4, 97, (3, 9)), "attention_mask": torch.ones(3, 9, dtype=torch.long),
             "labels": labels}
    teacher_forced_loss(model, batch, 0.1).backward()
    assert rows == [3 * 7 - 5]


def test_train_py_s_loop_trains_on_this_loss(monkeypatch):
    """TrainingLoop._loss goes through teacher_forced_loss (so the speed figures of this module are train.py's)."""
    from hf_scratch_transformer.training import loop

    calls = []
    real = training_loss.teacher_forced_loss
    monkeypatch.setattr(loop, "teacher_forced_loss", lambda *args: calls.append(args) or real(*args))
    config = ScratchTransformerConfig.from_preset("tiny", vocab_size=97, dropout=0.0)
    fake_loop = type("FakeLoop", (), {"autocast": staticmethod(lambda: torch.autocast("cpu", enabled=False)),
                                      "train_model": ScratchTransformerForConditionalGeneration(config),
                                      "args": type("Args", (), {"label_smoothing_factor": 0.1})()})()
    batch = {"input_ids": torch.randint(4, 97, (2, 5)), "attention_mask": torch.ones(2, 5, dtype=torch.long),
             "labels": torch.randint(4, 97, (2, 4))}
    value = loop.TrainingLoop._loss(fake_loop, batch)
    assert len(calls) == 1 and calls[0][2] == 0.1
    torch.testing.assert_close(value, fake_loop.train_model(**batch, label_smoothing=0.1).loss)
