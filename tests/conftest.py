"""Shared test helpers: seeded generators and the reference implementations."""

from __future__ import annotations

import os
import random

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # Triton kernels run in the interpreter on CPU. It must be set before anything imports triton, and
    # torch.compile (test_compile, the numba ops' torch.compiler.disable) imports it early.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests parametrised over devices run on the CPU everywhere and, where there is a GPU, on it too (full size).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU"))]


def import_official_torch():
    """``recurrentgemma.torch`` (without JAX), or skip the test if the package is not installed."""
    from griffin.bench import import_official_torch as load

    try:
        return load()
    except ImportError as err:
        pytest.skip(str(err))


def perturb_(module: torch.nn.Module, generator: torch.Generator, scale: float = 0.1) -> None:
    """Move norm scales and biases (zero at init) away from their initial values."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("scale", "bias", "b") or "norm" in name or leaf.endswith("_bias"):
                p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * scale)


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator with a fresh seed for every test run; the seed is printed (shown if the test fails) and can be
    fixed with GRIFFIN_TEST_SEED to reproduce a failure."""
    seed = int(os.environ.get("GRIFFIN_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"{request.node.nodeid}: GRIFFIN_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)
