"""The whole model under torch.compile (issue 5): same logits and gradients as eager, packed documents included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from griffin import CausalLM, ModelConfig
from tests.conftest import DEVICES, perturb_, seed_torch


def _loss_and_grads(model, ids, positions):
    model.zero_grad(set_to_none=True)
    logits = model(ids, positions)
    F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
    return logits.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


def assert_grads_close(grad: torch.Tensor, ref: torch.Tensor, rtol: float, name: str) -> None:
    """Gradients equal within float32 rounding of the tensor's scale: an element that is a sum of large terms of
    both signs keeps their rounding (atol 1e-5 of the largest element, at least 1e-5)."""
    atol = 1e-5 * max(1.0, ref.abs().max().item())
    torch.testing.assert_close(grad, ref, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def check_compiled_matches_eager(family: str, gen: torch.Generator, device: str = "cpu") -> None:
    """Inductor-compiled model (the CPU and Triton kernels are operators it calls as they are): results must not
    change."""
    torch._dynamo.reset()
    model = CausalLM(ModelConfig.from_preset(f"{family}-tiny"))
    perturb_(model, gen)
    model.to(device)
    ids = torch.randint(0, model.config.vocab_size, (2, 23), generator=gen).to(device)
    positions = torch.cat([torch.arange(9), torch.arange(14)]).expand(2, -1).to(device)  # two packed documents
    ref_logits, ref_grads = _loss_and_grads(model, ids, positions)
    logits, grads = _loss_and_grads(torch.compile(model), ids, positions)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    for name, grad in grads.items():
        assert_grads_close(grad, ref_grads[name], 1e-3, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["griffin", "hawk", "mqa"])
def test_compiled_model_matches_eager(family, gen, device):
    check_compiled_matches_eager(family, gen, device)


def test_compiled_chunked_local_attention_matches_eager(gen, monkeypatch):
    """Local attention in several query chunks (4 queries, window 6, 23 tokens, two documents) under compile."""
    monkeypatch.setattr("griffin.ops.attention.MIN_CHUNK", 4)
    monkeypatch.setattr("griffin.ops.attention.MAX_CHUNK", 4)
    check_compiled_matches_eager("griffin", gen)


# the chunked loss (loss_chunk=7) traced once, through Griffin (every block type); with the others: slow
@pytest.mark.parametrize(("family", "loss_chunk"), [("mqa", 0), ("hawk", 0), ("griffin", 0), ("griffin", 7),
                                                    pytest.param("mqa", 7, marks=pytest.mark.slow),
                                                    pytest.param("hawk", 7, marks=pytest.mark.slow)])
def test_training_forward_and_loss_trace_as_one_graph(family, loss_chunk, gen):
    """fullgraph=True: the training forward and loss of packed documents have no graph break and no host sync
    (validation happens at the boundaries); traced through AOTAutograd (forward and backward), the loss and every
    gradient equal eager's."""
    torch._dynamo.reset()
    seed_torch(gen)
    model = CausalLM(ModelConfig.from_preset(f"{family}-tiny"))
    perturb_(model, gen)
    ids = torch.randint(0, 32, (2, 23), generator=gen)
    targets = torch.randint(0, 32, (2, 23), generator=gen)
    targets[0, :3] = -100
    positions = torch.cat([torch.arange(9), torch.arange(14)]).expand(2, -1)

    def step(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(ids, positions, targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    compiled = torch.compile(lambda i, p, t: model(i, p, targets=t, loss_chunk=loss_chunk), fullgraph=True,
                             backend="aot_eager")
    loss, grads = step(compiled)
    ref_loss, ref_grads = step(lambda i, p, t: model(i, p, targets=t, loss_chunk=loss_chunk))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():  # (compiled, GeLU takes its sigmoid form: float32 rounding apart from F.gelu)
        assert_grads_close(grad, ref_grads[name], 1e-4, name)

