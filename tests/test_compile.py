"""The whole model under torch.compile (issue 5): same logits and gradients as eager, packed documents included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from griffin import CausalLM, ModelConfig
from tests.conftest import DEVICES, perturb_


def _loss_and_grads(model, ids, positions):
    model.zero_grad(set_to_none=True)
    logits = model(ids, positions)
    F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
    return logits.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


def check_compiled_matches_eager(family: str, gen: torch.Generator, device: str = "cpu") -> None:
    """Graph breaks are allowed (the numba kernels run eagerly; the Triton kernel is an op inductor calls);
    results must not change."""
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
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["griffin", "hawk", "mqa"])
def test_compiled_model_matches_eager(family, gen, device):
    check_compiled_matches_eager(family, gen, device)


def test_compiled_chunked_local_attention_matches_eager(gen, monkeypatch):
    """Local attention in several query chunks (4 queries, window 6, 23 tokens, two documents) under compile."""
    monkeypatch.setattr("griffin.ops.attention.MIN_CHUNK", 4)
    monkeypatch.setattr("griffin.ops.attention.MAX_CHUNK", 4)
    check_compiled_matches_eager("griffin", gen)
