"""The chunked cross-entropy of soft-capped logits (griffin.ops.cross_entropy) against its plain reference, and the
model's loss mode (``CausalLM.forward(..., targets=...)``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from griffin import CausalLM, ModelConfig
from griffin.ops.cross_entropy import IGNORE_INDEX, chunked_cross_entropy, cross_entropy_ref
from tests.conftest import DEVICES, perturb_


def inputs(gen, shape, dim, vocab, dtype, device="cpu"):
    h = (torch.randn(*shape, dim, generator=gen, dtype=torch.float64) * 2).to(device, dtype).requires_grad_()
    weight = torch.randn(vocab, dim, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, shape, generator=gen)
    targets[torch.rand(shape, generator=gen) < 0.2] = IGNORE_INDEX
    return h, weight, targets.to(device)


def loss_and_grads(fn, h, weight, *args):
    loss = fn(h, weight, *args)
    return (loss, *torch.autograd.grad(loss * 0.7, (h, weight)))


@pytest.mark.parametrize("trial", range(12))
def test_matches_reference_float64(gen, trial):
    """Fresh shapes; chunks of 1 row, not dividing the rows, all rows at once, more than the rows; cap on and off."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    rows, dim, vocab = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 40), (1, 12), (2, 50)))
    chunk = [1, 7, rows, rows + 5][trial % 4]
    cap = 30.0 * (trial % 2)
    h, weight, targets = inputs(g, (rows,), dim, vocab, torch.float64)
    got = loss_and_grads(chunked_cross_entropy, h, weight, targets, cap, chunk)
    want = loss_and_grads(cross_entropy_ref, h, weight, targets, cap)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference_in_low_precision(gen, dtype, device):
    """(B, T, D) hidden states, logits soft-capped at 3 (so that the cap matters), chunks of 5 rows."""
    h, weight, targets = inputs(gen, (3, 17), 16, 40, dtype, device)
    got = loss_and_grads(chunked_cross_entropy, h, weight, targets, 3.0, 5)
    want = loss_and_grads(cross_entropy_ref, *(t.detach().double().requires_grad_() for t in (h, weight)), targets,
                          3.0)
    assert got[1].dtype == got[2].dtype == dtype and got[1].shape == h.shape
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * b.abs().max().item())


def test_autocast_runs_the_matmuls_in_bfloat16(gen):
    h, weight, targets = inputs(gen, (2, 9), 8, 30, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(chunked_cross_entropy, h, weight, targets, 30.0, 4)
        want = loss_and_grads(cross_entropy_ref, h, weight, targets, 30.0)
    exact = loss_and_grads(cross_entropy_ref, h, weight, targets, 30.0)
    assert got[1].dtype == got[2].dtype == torch.float32
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
    # bf16 matmuls, not float32 ones: seen in the gradients, whose many entries each move by bfloat16's rounding (the
    # loss, one sum of rounding errors of either sign, can land within 1e-6 of float32's by chance: seed 1466949249)
    for a, c in zip(got[1:], exact[1:], strict=True):
        assert not torch.allclose(a, c, rtol=1e-6, atol=0)


class LargestOutput(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_never_holds_all_logits(gen):
    """No tensor of the forward or backward is larger than a chunk of logits (or the weight)."""
    h, weight, targets = inputs(gen, (64,), 4, 100, torch.float32)
    with LargestOutput() as mode:
        loss_and_grads(chunked_cross_entropy, h, weight, targets, 30.0, 8)
    assert mode.numel <= 8 * 100 < 64 * 100
    with LargestOutput() as mode:
        loss_and_grads(cross_entropy_ref, h, weight, targets, 30.0)
    assert mode.numel >= 64 * 100  # the check can fail


@pytest.mark.parametrize("bad, message", [
    (dict(chunk=0), "chunk=0 must be a positive int"),
    (dict(chunk=2.5), "chunk=2.5 must be a positive int"),
    (dict(targets=torch.zeros(3, dtype=torch.long)), r"targets must have shape \(2, 5\)"),
    (dict(targets=torch.full((2, 5), 30)), r"target id 30 is outside the vocabulary \[0, 30\)"),
    (dict(targets=torch.full((2, 5), -1)), r"target id -1 is outside"),
])  # fmt: skip
def test_bad_input_is_named(gen, bad, message):
    h, weight, targets = inputs(gen, (2, 5), 4, 30, torch.float32)
    args = dict(targets=targets, chunk=4) | bad
    with pytest.raises(ValueError, match=message):
        chunked_cross_entropy(h, weight, args["targets"], 30.0, args["chunk"])


@pytest.mark.parametrize("family", ["griffin", "mqa"])
def test_model_loss_mode(gen, family):
    """``model(ids, targets=..., loss_chunk=n)`` = the cross-entropy of ``model(ids)``, chunked or not, with the
    same gradients; targets of the wrong shape are refused."""
    model = CausalLM(ModelConfig.from_preset(f"{family}-tiny"))
    perturb_(model, gen)
    ids = torch.randint(0, 32, (2, 11), generator=gen)
    targets = ids.roll(-1, 1)
    targets[:, -1] = IGNORE_INDEX
    logits = model(ids)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    for loss_chunk in (0, 3):
        loss = model(ids, targets=targets, loss_chunk=loss_chunk)
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
        for got, ref in zip(torch.autograd.grad(loss, list(model.parameters())), want_grads, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5 * ref.abs().max().item())  # fp32 rounding
    with pytest.raises(ValueError, match="targets must have the shape of input_ids"):
        model(ids, targets=targets[:, :5])
    with pytest.raises(ValueError, match="without logits_to_keep"):
        model(ids, targets=targets, logits_to_keep=1)


@pytest.mark.parametrize("loss_chunk", [0, 5])
def test_float32_logits_under_autocast(gen, loss_chunk):
    """``LanguageModelLoss.float32_logits``: under bf16 autocast the output layer's matmul runs in float32 on the
    same hidden states (the trainer's ``logits_precision='fp32'``), whole or chunked; without it, in bf16. The
    backward pass outside autocast, as the trainer runs it."""
    from griffin.model import LanguageModelLoss

    h, weight, targets = inputs(gen, (3, 7), 16, 40, torch.float32)
    exact = loss_and_grads(cross_entropy_ref, h, weight, targets, 30.0)
    losses = []
    for float32_logits in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(LanguageModelLoss(30.0, float32_logits)(h, weight, targets, loss_chunk))
    fp32, bf16 = ((loss, *torch.autograd.grad(loss * 0.7, (h, weight))) for loss in losses)
    for a, b in zip(fp32, exact, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    for a, b in zip(bf16[1:], exact[1:], strict=True):  # the bf16 matmul's rounding, seen in every gradient
        assert not torch.allclose(a, b, rtol=1e-4, atol=0)
