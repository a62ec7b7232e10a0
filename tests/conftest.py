"""Shared test helpers: seeded generators and the reference implementations."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

import griffin.threads

griffin.threads.prefer_passive_openmp_wait()  # as the griffin command does, before torch loads its OpenMP runtime
import torch  # noqa: E402

CUDA = torch.cuda.is_available()
if not CUDA:
    # Triton kernels run in the interpreter on CPU. It must be set before anything imports triton, and
    # torch.compile (test_compile, the numba ops' torch.compiler.disable) imports it early.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests parametrised over devices run on the CPU everywhere and, where there is a GPU, on it too (full size).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU"))]


def import_official_torch():
    """``recurrentgemma.torch`` (without JAX); the package is in the test extra, so a missing one fails."""
    from griffin.interop.official import import_official_torch as load

    return load()


WORDS = "the of and a to in is you that it he was for on are as with his they at be this from".split()


def words_dataset(root: Path) -> Path:
    """A small prepared byte-level dataset (``root/prepared``) of 40 seeded documents of 20-400 common words, 10% held
    out: the training, layout and experiment tests' data."""
    from griffin.data import prepare

    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    rng = random.Random(0)
    for i in range(40):
        words = [rng.choice(WORDS) for _ in range(rng.randint(20, 400))]
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(words) + ".\n")
    out = root / "prepared"
    prepare([corpus], out, "bytes", val_fraction=0.1, seed=0, progress=False)
    return out


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


@pytest.fixture
def fault_in_children(monkeypatch):
    """``fault_in_children("step:45")``: the Python processes this test starts from then on die by SIGKILL at that
    point of training (``tests/faults`` patches griffin in them from outside); ``fault_in_children(None)``: they run
    through. The environment is restored after the test."""
    from tests.faults import ENV, child_env

    def inject(fault: str | None) -> None:
        env = child_env(fault)
        for key in ("PYTHONPATH", ENV):
            if key in env:
                monkeypatch.setenv(key, env[key])
            else:
                monkeypatch.delenv(key, raising=False)

    return inject


def seed_torch(gen: torch.Generator) -> None:
    """Seed torch's global RNG (which initialises modules) from ``gen``, so GRIFFIN_TEST_SEED replays the test."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))


def clipped_sqrt(u: torch.Tensor, max_gradient: float = 1000.0) -> torch.Tensor:
    """sqrt(u) whose derivative is 1 / sqrt(max(4u, 1 / max_gradient^2)): the bounded gradient of Section 2.4's
    sqrt(1 - a_t^2), written with a detached forward value and a straight-through derivative (no autograd.Function,
    so it shares nothing with the library's)."""
    value = torch.sqrt(u.detach())
    slope = 1.0 / torch.sqrt(torch.clamp(4.0 * u.detach(), min=1.0 / max_gradient**2))
    return value + (u - u.detach()) * slope


def rg_lru_formula(x, gate_x, gate_a, a_param, c=8.0, h0=None, reset=None):
    """The RG-LRU of Section 2.4 literally, power form (a = sigmoid(-Lambda), a_t = a^(c r_t)), a loop over time:
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t), h_t = i_t x_t at a document start. Returns (y, h_last) in the
    inputs' dtype (float64 for a reference)."""
    B, T, D = x.shape
    r, i = torch.sigmoid(gate_a), torch.sigmoid(gate_x)
    a = torch.sigmoid(-a_param)
    h = torch.zeros(B, D, dtype=x.dtype) if h0 is None else h0.to(x.dtype)
    ys = []
    for t in range(T):
        a_t = a ** (c * r[:, t])
        step = a_t * h + clipped_sqrt(1 - a_t**2) * (i[:, t] * x[:, t])
        h = step if reset is None else torch.where(reset[:, t, None], i[:, t] * x[:, t], step)
        ys.append(h)
    return torch.stack(ys, 1), h


def max_relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max over elements of |got - ref| / (|ref| + scale), scale the mean |ref| (1e-30 at least): per element, so
    that no slice (a row, a time step) can be wrong unnoticed, and relative, so that small elements count."""
    got, ref = got.detach().double(), ref.detach().double()
    scale = ref.abs().mean().clamp(min=1e-30)
    return float(((got - ref).abs() / (ref.abs() + scale)).max())
