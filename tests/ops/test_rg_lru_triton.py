"""The fused Triton RG-LRU (Section 2.4, Section 4.2) against the reference ``rg_lru_ref`` in float64.

Without CUDA the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, set before Triton is imported) on
tiny shapes; with CUDA they are compiled and also checked at full size, under torch.compile and in a CUDA graph.
Every check draws fresh random inputs, so an output element the kernel failed to write cannot match by chance.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if sys.platform != "linux":  # the test extra installs Triton on Linux, where it ships; a missing one fails there
    pytest.skip("Triton is only available on Linux", allow_module_level=True)
import triton  # noqa: E402,F401

import griffin.ops.rg_lru.triton as rg_lru_triton_module  # noqa: E402
from griffin.ops.rg_lru import rg_lru, rg_lru_ref  # noqa: E402
from griffin.ops.rg_lru.triton import rg_lru_triton, select_config  # noqa: E402
from tests.conftest import max_relative_error  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# Per-element errors (tests.conftest.max_relative_error), so that one unwritten (row, t) slice fails (it errs by ~1):
# bf16 outputs and gradients are rounded to bf16 (2^-9 relative) after float32 arithmetic on the same bf16 inputs and
# the same bf16 dy as the reference (up to 7.2e-3 seen over 19 seeds of every case); float32 runs see approximate
# exp/rcp/sqrt (a few ulp) and cancellation in the gate gradients (up to 1.1e-4 seen on an H100, 3.3e-4 in dgate_a on
# an H200 at full size).
TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}


def _inputs(gen: torch.Generator, shape: tuple[int, int, int], dtype: torch.dtype, h0: bool, reset: str):
    """Random x, gates, Lambda (a^c spread over [0.3, 0.9995]), h0 and document starts ("none"/"random"/"start")."""
    batch, steps, dim = shape
    x, gate_x, gate_a = (torch.randn(shape, generator=gen) for _ in range(3))
    a_param = torch.empty(dim).uniform_(-9.0, 1.0, generator=gen)
    init = torch.randn(batch, dim, generator=gen) if h0 else None
    starts = None
    if reset != "none":
        starts = torch.rand(batch, steps, generator=gen) < 0.05
        starts[0, 0] = True
        if reset == "start":
            starts[:, 0] = True
    tensors = [t.to(DEVICE, dtype) for t in (x, gate_x, gate_a)] + [a_param.to(DEVICE)]
    return tensors, None if init is None else init.to(DEVICE), None if starts is None else starts.to(DEVICE)


def _check(gen: torch.Generator, shape, dtype, h0: bool, reset: str, chunk_t: int = 0, states: bool = False) -> None:
    tensors, init, starts = _inputs(gen, shape, dtype, h0, reset)
    leaves = [t.clone().requires_grad_() for t in tensors] + ([init.clone().requires_grad_()] if h0 else [])
    y, h_last = rg_lru_triton(*leaves[:4], 8.0, leaves[4] if h0 else None, starts, chunk_t=chunk_t,
                              save_states=states)
    assert y.dtype == dtype and h_last.dtype == torch.float32

    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    y_ref, h_ref = rg_lru_ref(*ref_leaves[:4], 8.0, ref_leaves[4] if h0 else None, starts)
    dy = torch.randn(y_ref.shape, generator=gen).to(DEVICE, torch.float64)
    dh = torch.randn(h_ref.shape, generator=gen).to(DEVICE, torch.float64)
    ((y.double() * dy).sum() + (h_last.double() * dh).sum()).backward()
    # the kernel is handed dy rounded to y's dtype: the reference gets the same, or bf16's rounding of dy, summed over
    # up to 1 / (1 - a) steps with cancellation, would count against the kernel
    ((y_ref * dy.to(dtype).double()).sum() + (h_ref * dh.float().double()).sum()).backward()

    tol = TOL[dtype]
    names = ["x", "gate_x", "gate_a", "a_param", "h0"]
    errors = {"y": max_relative_error(y, y_ref), "h_last": max_relative_error(h_last, h_ref)}
    errors.update({f"d{n}": max_relative_error(a.grad, b.grad)
                   for n, a, b in zip(names, leaves, ref_leaves, strict=False)})
    assert all(torch.isfinite(torch.tensor(list(errors.values())))), errors
    assert max(errors.values()) < tol, errors


TINY = [(1, 1, 1), (2, 7, 5), (3, 37, 20), (2, 64, 16)]
# the backward from the state before every step (save_states) or from a checkpoint every time tile
STATES = pytest.mark.parametrize("states", [False, True], ids=["ckpt", "states"])


@STATES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", TINY, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(gen, shape, dtype, states) -> None:
    _check(gen, shape, dtype, h0=True, reset="random", states=states)


@STATES
@pytest.mark.parametrize("h0", [False, True], ids=["no_h0", "h0"])
@pytest.mark.parametrize("reset", ["none", "start"])
def test_h0_and_resets(gen, h0, reset, states) -> None:
    _check(gen, (3, 29, 18), torch.float32, h0=h0, reset=reset, states=states)


def _time_tile() -> int:
    """The least time step count that both the forward and the backward tile divide."""
    x = torch.empty(1, 1, 1, device=DEVICE)
    return math.lcm(select_config(x, backward=False).block_t, select_config(x, backward=True).block_t)


@pytest.mark.parametrize(("tiles_per_chunk", "dtype"), [(2, torch.float32), (3, torch.bfloat16),
                                                       pytest.param(3, torch.float32, marks=pytest.mark.slow),
                                                       pytest.param(2, torch.bfloat16, marks=pytest.mark.slow)],
                         ids=["2-fp32", "3-bf16", "3-fp32", "2-bf16"])
@STATES
def test_chunked_in_time(gen, dtype, tiles_per_chunk, states) -> None:
    """Chunks scanned in parallel, then the carry fix-up: same function as the sequential variant."""
    tile = _time_tile()
    _check(gen, (2, 8 * tile - 3, 21), dtype, h0=True, reset="random", chunk_t=tiles_per_chunk * tile, states=states)


def test_chunk_must_be_a_multiple_of_the_tile() -> None:
    tile = _time_tile()
    with pytest.raises(ValueError, match="multiple"):
        select_config(torch.empty(1, 4 * tile, 1, device=DEVICE), backward=True, chunk_t=2 * tile - 1)


def test_non_contiguous_inputs_and_no_grad(gen) -> None:
    tensors, init, starts = _inputs(gen, (2, 13, 10), torch.float32, h0=True, reset="random")
    x, gate_x, gate_a, a_param = tensors
    x_t = x.transpose(0, 1).contiguous().transpose(0, 1)
    with torch.no_grad():
        y, h_last = rg_lru_triton(x_t, gate_x, gate_a, a_param, 8.0, init, starts)
    y_ref, h_ref = rg_lru_ref(x.double(), gate_x.double(), gate_a.double(), a_param.double(), 8.0, init, starts)
    assert max_relative_error(y, y_ref) < TOL[torch.float32] and max_relative_error(h_last, h_ref) < TOL[torch.float32]


def test_dispatch(gen, monkeypatch) -> None:
    tensors, init, starts = _inputs(gen, (2, 9, 6), torch.float32, h0=True, reset="random")
    expected, _ = rg_lru_triton(*tensors, 8.0, init, starts)
    got, _ = rg_lru(*tensors, 8.0, init, starts, backend="triton")
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    monkeypatch.setenv("GRIFFIN_RG_LRU_BACKEND", "triton")
    torch.testing.assert_close(rg_lru(*tensors, 8.0, init, starts)[0], expected, rtol=0, atol=0)
    monkeypatch.setenv("GRIFFIN_RG_LRU_BACKEND", "ref")
    ref, _ = rg_lru(*tensors, 8.0, init, starts)
    torch.testing.assert_close(ref, expected, rtol=1e-4, atol=1e-5)


FULL = [((8, 2048, 1024), torch.bfloat16), ((1, 4096, 2560), torch.bfloat16), ((3, 1031, 333), torch.float32)]


@requires_cuda
@pytest.mark.parametrize("shape,dtype", FULL, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
@STATES
def test_full_size(gen, shape, dtype, states) -> None:
    _check(gen, shape, dtype, h0=True, reset="random", states=states)


@requires_cuda
@pytest.mark.parametrize("chunk_t", [256, 1024])
@STATES
def test_full_size_chunked(gen, chunk_t, states) -> None:
    _check(gen, (2, 4000, 768), torch.bfloat16, h0=True, reset="random", chunk_t=chunk_t, states=states)


@requires_cuda
@STATES
def test_torch_compile_and_cuda_graph(gen, states) -> None:
    tensors, init, starts = _inputs(gen, (2, 300, 96), torch.bfloat16, h0=True, reset="random")
    leaves = [t.clone().requires_grad_() for t in tensors]

    def loss(x, gate_x, gate_a, a_param):
        y, h_last = rg_lru_triton(x, gate_x, gate_a, a_param, 8.0, init, starts, save_states=states)
        return y.float().square().sum() + h_last.sum()

    eager = torch.autograd.grad(loss(*leaves), leaves)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*leaves), leaves)
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)

    static = [t.detach().clone() for t in tensors]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles the kernels) on a side stream before capture
        rg_lru_triton(*static, 8.0, init, starts)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph, _ = rg_lru_triton(*static, 8.0, init, starts)
    fresh, _, _ = _inputs(gen, (2, 300, 96), torch.bfloat16, h0=False, reset="none")
    for dst, src in zip(static, fresh, strict=True):
        dst.copy_(src)
    graph.replay()
    torch.testing.assert_close(y_graph, rg_lru_triton(*static, 8.0, init, starts)[0], rtol=0, atol=0)


def test_the_environment_sets_the_default_of_save_states() -> None:
    """GRIFFIN_RG_LRU_STATES=1 turns save_states on for calls that leave it None (the model's), read at import; any
    other value than 1, 0 or empty is refused."""
    code = "import griffin.ops.rg_lru.triton as k; print(k.SAVE_STATES)"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    for value, expected in (("1", "True"), ("0", "False"), (None, "False")):
        env.pop("GRIFFIN_RG_LRU_STATES", None)
        if value is not None:
            env["GRIFFIN_RG_LRU_STATES"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected, (value, out.stdout, out.stderr[-2000:])
    env["GRIFFIN_RG_LRU_STATES"] = "true"  # not a value it takes: refused by name, not read as off
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "GRIFFIN_RG_LRU_STATES='true': expected 1" in out.stderr, out.stderr[-2000:]


def test_host_tensors_are_refused_before_a_compiled_launch(gen, monkeypatch) -> None:
    """Outside the interpreter the kernels read device memory only: a CPU tensor is named at once, not in the
    launcher (which says "Pointer argument (at 0) cannot be accessed from Triton")."""
    monkeypatch.setattr(rg_lru_triton_module, "INTERPRETED", False)
    tensors, init, starts = _inputs(gen, (1, 5, 16), torch.float32, h0=True, reset="random")
    tensors = [t.cpu() for t in tensors]
    with pytest.raises(ValueError, match="rg_lru_triton: x is on cpu, but the Triton kernel runs on CUDA"):
        rg_lru_triton(*tensors, 8.0, init.cpu(), starts.cpu())
