"""The embedding lookup in compiled CPU steps (griffin.ops.embedding): eager's numbers, the same gradient every run
on two threads, and which modules take the operator."""

import pytest
import torch
from torch import nn

from griffin.ops.embedding import embed, embedding_cpu_fwd


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def lookup_loss(module: nn.Module, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return (embed(module, ids) * g).sum()  # the lookup's output gradient is g itself, in either step


def test_compiled_lookup_gives_eagers_values_and_the_same_gradient_every_run(gen, two_threads):
    """16 rows, 32,768 tokens: every row is a sum of ~2,000 token gradients. Compiled on two threads, the table's
    gradient is eager's bit for bit, ten times over (with the module's forward compiled instead, Inductor's atomic
    adds from both threads, this fails)."""
    module = nn.Embedding(16, 64)
    nn.init.normal_(module.weight, generator=gen)
    ids = torch.randint(0, 16, (8, 4096), generator=gen)
    g = torch.randn(8, 4096, 64, generator=gen)

    def grad(f):
        module.weight.grad = None
        f(module, ids, g).backward()
        return module.weight.grad.clone()

    want = grad(lookup_loss)
    compiled = torch.compile(lookup_loss, fullgraph=True)
    for _ in range(10):
        assert torch.equal(grad(compiled), want)
    assert torch.equal(torch.compile(embed, fullgraph=True)(module, ids), module(ids))


def test_which_lookups_take_the_operator():
    """Compiled plain nn.Embedding lookups go through the operator; eager calls and embeddings with a padding row
    (whose gradient the operator does not zero) keep the module's forward."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(any(n.target is torch.ops.griffin.embedding_cpu_fwd.default for n in gm.graph.nodes))
        return gm.forward

    ids = torch.tensor([[1, 0, 3]])
    plain, padded = nn.Embedding(5, 4), nn.Embedding(5, 4, padding_idx=0)
    for module in (plain, padded):
        torch._dynamo.reset()
        out = torch.compile(embed, backend=backend, fullgraph=True)(module, ids)
        assert torch.equal(out, module(ids))
    assert seen == [True, False]
    assert torch.equal(embed(plain, ids), plain(ids))


def test_opcheck(gen):
    weight = torch.randn(7, 5, generator=gen, requires_grad=True)
    ids = torch.randint(0, 7, (3, 11), generator=gen)
    torch.library.opcheck(embedding_cpu_fwd, (weight, ids))
