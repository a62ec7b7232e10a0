"""Quiet by default (issue 35): griffin's numba kernels compile without warnings, ``griffin train`` ending with a
sample prints none, numba's warnings about its own internals are kept out of a kernel's compilation by
:func:`griffin.ops.jit.kernel` (only there: a user's own numba functions keep them), and ``griffin --verbose`` shows
them again."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numba
import numpy as np
import pytest
import torch
from numba.core.caching import NullCache
from numba.core.errors import NumbaIRAssumptionWarning, NumbaWarning
from numba.extending import overload

from griffin.cli import build_parser, main
from griffin.inference.cpu.block_step import _matmul_phase
from griffin.inference.cpu.matvec import MatvecWeights, kernel_settings, prepare_rows, rows_buffers
from griffin.inference.cpu.tasks import counters
from griffin.ops import jit
from tests.conftest import words_dataset


def _recorded(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return caught


# The decode step's matmul phase, twice in one function as the block kernels inline it (griffin.inference.cpu.block_step
# ._mlp_tasks): where it inlined a task that returned its inlined call's value, numba's SSA pass found a variable of no
# scope, a NumbaIRAssumptionWarning at every compilation of a block kernel. A plain njit function (no disk cache, no
# filter), compiled afresh in each process.
@numba.njit
def _two_matmul_phases(x, m, settings, out):
    c = counters(2, 1)
    buffers = rows_buffers(x)
    prepare_rows(x, m[0], settings, buffers)
    _matmul_phase(c, 0, np.int64(0), x, buffers, m, settings, out)
    _matmul_phase(c, 1, np.int64(0), x, buffers, m, settings, out)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.int8, marks=pytest.mark.slow)])
def test_the_decode_step_matmul_compiles_without_warnings(dtype):
    """float32 weights (on every host, the widened path), int8 ones (the host's int8 path, if it has one: ``griffin
    generate --quantize int8``), at one row."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 32, generator=gen)
    x = torch.randn(1, 32, generator=gen)
    if dtype == torch.int8:
        scale = weight.abs().amax(1, keepdim=True) / 127
        weight = (weight / scale).round().to(torch.int8)
        m = MatvecWeights.prepare([weight], [scale]).kernel_args()
        want = x @ (weight.float() * scale).T
    else:
        m = MatvecWeights.prepare([weight]).kernel_args()
        want = x @ weight.T
    out = np.zeros((1, 40), np.float32)
    caught = _recorded(lambda: _two_matmul_phases(x.numpy(), m, kernel_settings(), out))
    assert [str(w.message) for w in caught] == []
    torch.testing.assert_close(torch.from_numpy(out), want, rtol=1e-3, atol=1e-3)


# A function that makes numba warn about its IR (the pattern above: an inline overload returning its inlined call's
# value, at two call sites), to see where the warning is shown.
@numba.njit(inline="always")
def _toy_inner(t, out):
    if out.shape[0] > 1:
        out[t] += 1.0


def _toy_task(t, out):
    raise NotImplementedError


@overload(_toy_task, inline="always")
def _toy_task_impl(t, out):
    return lambda t, out: _toy_inner(t, out)


def _toy(out):
    for t in range(out.shape[0]):
        _toy_task(t, out)
    for t in range(out.shape[0]):
        _toy_task(t, out)


def _toy_kernel():
    """A fresh :func:`griffin.ops.jit.kernel` of :func:`_toy` (compiled at its first call: no disk cache)."""
    dispatcher = jit.kernel()(_toy)
    dispatcher._cache = NullCache()
    return dispatcher


def _ir_warnings(dispatcher) -> list[warnings.WarningMessage]:
    def call():
        dispatcher(np.zeros(3))

    return [w for w in _recorded(call) if issubclass(w.category, NumbaIRAssumptionWarning)]


def test_kernels_compile_quietly_unless_verbose(monkeypatch):
    monkeypatch.delenv(jit.VERBOSE_ENV, raising=False)
    filters = list(warnings.filters)
    assert _ir_warnings(numba.njit(_toy)) != []  # (the toy does make numba warn)
    assert _ir_warnings(_toy_kernel()) == []
    assert warnings.filters == filters  # nothing left behind for the user's code
    assert _ir_warnings(numba.njit(_toy)) != []  # a user's own function keeps numba's warnings
    with warnings.catch_warnings(record=True) as caught:  # inside a user's function, a kernel is still quiet
        warnings.simplefilter("always")
        kernel = _toy_kernel()
        numba.njit(lambda out: kernel(out))(np.zeros(3))
    assert not [w for w in caught if issubclass(w.category, NumbaWarning)]
    monkeypatch.setenv(jit.VERBOSE_ENV, "1")
    assert jit.verbose()
    assert _ir_warnings(_toy_kernel()) != []
    monkeypatch.setenv(jit.VERBOSE_ENV, "0")
    assert not jit.verbose()


def test_the_verbose_flag_turns_the_filter_off(monkeypatch, capsys):
    """``griffin --verbose CMD`` (a command that stops at once here: no prompt given)."""
    monkeypatch.delenv(jit.VERBOSE_ENV, raising=False)
    assert main(["generate", "no-checkpoint"]) == 2
    assert not jit.verbose()
    assert main(["--verbose", "generate", "no-checkpoint"]) == 2
    assert os.environ[jit.VERBOSE_ENV] == "1" and jit.verbose()
    assert _ir_warnings(_toy_kernel()) != []
    assert "--verbose" in build_parser().format_help()


@pytest.mark.slow
def test_train_ending_with_a_sample_prints_no_warning(tmp_path):
    """``griffin train`` at tiny sizes, its kernels compiled afresh (an empty numba cache): no line of its output
    names a warning (numba's compiler warnings of the decode engine that samples at the end were ~200 lines)."""
    dataset = words_dataset(tmp_path / "data")
    env = {k: v for k, v in os.environ.items() if k not in (jit.VERBOSE_ENV, "PYTHONWARNINGS")}
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba")
    run = subprocess.run(
        [sys.executable, "-m", "griffin.cli", "train", "--preset", "griffin-tiny", "--data", str(dataset), "--out",
         str(tmp_path / "run"), "--seq-len", "32", "--batch-size", "4", "--max-steps", "2", "--eval-interval", "2",
         "--eval-batches", "1", "--ckpt-interval", "2", "--no-progress", "--no-tensorboard", "--sample-tokens", "5"],
        env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stderr
    assert "sample:" in run.stdout
    assert any((tmp_path / "numba").rglob("*.nbi"))  # the kernels were compiled here, not loaded
    noisy = [line for line in (run.stdout + run.stderr).splitlines() if "Warning" in line]
    assert noisy == []
