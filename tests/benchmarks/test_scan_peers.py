"""The peers that ``benchmarks/scan_gpu.py`` times against the fused kernel compute the RG-LRU, as wrapped by
``benchmarks/scan_peers.py``: checked against the float64 reference, output and gradients. They run on the CPU
under ``TRITON_INTERPRET=1`` (set in conftest). Both packages are in the test extra (on Linux, where Triton ships): a
missing one fails."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from griffin.ops.rg_lru import rg_lru_ref

_spec = importlib.util.spec_from_file_location("scan_peers", Path(__file__).parents[2] / "benchmarks" / "scan_peers.py")
scan_peers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scan_peers)

if sys.platform != "linux":
    pytest.skip("the peers are Triton kernels, and Triton is only available on Linux", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PEERS = scan_peers.peer_scans(cuda=DEVICE == "cuda")


@pytest.fixture(autouse=True)
def one_config_per_autotuner(monkeypatch):
    """On the CPU (interpreter) fla's autotuners would time their configurations through a GPU driver: keep the
    first configuration of each, which they then run without timing."""
    if DEVICE == "cuda":
        return
    from triton.runtime.autotuner import Autotuner

    for module in [m for name, m in sys.modules.items() if name.startswith("fla.ops.")]:
        for kernel in vars(module).values():
            while hasattr(kernel, "fn"):  # through @triton.heuristics to the @triton.autotune inside
                if isinstance(kernel, Autotuner):
                    monkeypatch.setattr(kernel, "configs", kernel.configs[:1])
                kernel = kernel.fn


def inputs(gen: torch.Generator, batch: int, steps: int, dim: int) -> tuple[torch.Tensor, ...]:
    x, gate_x, gate_a = (torch.randn(batch, steps, dim, generator=gen).to(DEVICE) for _ in range(3))
    return x, gate_x, gate_a, torch.randn(dim, generator=gen).to(DEVICE)


# accelerated-scan under Triton's interpreter takes about 20 s on 2 cores: slow on the CPU, default on a GPU
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "accelerated-scan" and DEVICE == "cpu"
                                  else n for n in sorted(PEERS)])
def test_peer_is_the_rg_lru(name, gen):
    peer = PEERS[name]
    if isinstance(peer, str):  # accelerated-scan and fla-core are in the test extra
        pytest.fail(f"{name}: {peer}")
    if name == "fla-hgrn-chunk" and DEVICE == "cpu":
        pytest.skip("fla's chunk backward does not run under Triton's interpreter (it calls .to() on a Python int)")
    steps = 64 if name == "accelerated-scan-warp" else 45  # the warp kernel takes powers of 2 only
    assert scan_peers.max_rel_error(peer, *inputs(gen, 2, steps, 24)) < 1e-4


def test_the_check_catches_a_wrong_scan(gen):
    """The reference check fails a scan with the wrong decay constant (c = 4 instead of 8)."""
    assert scan_peers.max_rel_error(lambda *t: rg_lru_ref(*t, c=8.0), *inputs(gen, 2, 45, 24)) < 1e-6
    assert scan_peers.max_rel_error(lambda *t: rg_lru_ref(*t, c=4.0), *inputs(gen, 2, 45, 24)) > 1e-2
