"""The decode-step matmul kernel against its reference, and weight-only int8 quantisation (Section 5)."""

import os
import subprocess
import sys

import numba
import numpy as np
import pytest
import torch

from griffin.inference.cpu import matvec as matvec_module
from griffin.inference.cpu.isa import DOT_CHUNK, FAST_DOTS, FAST_TILES, VECTOR, tile_config, tile_dot_int8
from griffin.inference.cpu.matvec import MatvecWeights, matvec_cpu, matvec_op, tiles_for
from griffin.ops.matvec import check_group_size, dequantize_int8, matvec_ref, quantize_int8, quantize_row_int16

ROWS = (37, 16, 5)  # odd counts and a lone row: every tile shape, tiles ending inside a matrix
K = 48


def matrices(gen, dtype, group_size, bias=True):
    weights = [torch.randn(n, K, generator=gen) / K**0.5 for n in ROWS]
    biases = [torch.randn(n, generator=gen) if bias else None for n in ROWS]
    scales = None
    if dtype == torch.int8:
        pairs = [quantize_int8(w, group_size) for w in weights]
        weights, scales = [q for q, _ in pairs], [s for _, s in pairs]
    else:
        weights = [w.to(dtype) for w in weights]
    return weights, scales, biases


def as_multiplied(x, weights):
    """x as the kernel multiplies it: with int8 weights on a host with the unsigned x signed byte instruction, each
    row rounded to its own int16 steps (:func:`quantize_row_int16`); otherwise as it is."""
    if weights[0].dtype == torch.int8 and "int8" in matvec_module.FAST_DOTS:
        return torch.stack([xq.float() * step for xq, step in map(quantize_row_int16, x)])
    return x


@pytest.mark.parametrize("dtype,group_size", [(torch.float32, 0), (torch.bfloat16, 0), (torch.int8, 0),
                                              (torch.int8, 8), (torch.int8, 16)])
@pytest.mark.parametrize("batch", [1, 2, 4, 7, 9])
def test_kernel_equals_reference(gen, dtype, group_size, batch):
    """Weights as stored (bfloat16 widened, int8 times its group scales), float32 sums: equal to the reference (of
    x as the kernel multiplies it) up to the order of the float32 additions (each sum has K = 48 terms of order
    1/sqrt(K))."""
    weights, scales, biases = matrices(gen, dtype, group_size, bias=batch != 2)
    x = torch.randn(batch, K, generator=gen)
    prepared = MatvecWeights.prepare(weights, scales, biases)
    got = matvec_cpu(x, prepared)
    ref = matvec_ref(as_multiplied(x, weights), weights, scales, biases)
    assert got.shape == (batch, sum(ROWS)) and got.dtype == torch.float32
    assert (got - ref).abs().max() <= 2e-6 * (1 + ref.abs().max())
    # The same through the operator that torch.compile calls, and with bfloat16 activations (output in bf16).
    tiles = tiles_for([w.shape[0] for w in weights])
    op = matvec_op(x, weights, tiles, torch.from_numpy(prepared.scale), torch.from_numpy(prepared.bias),
                   torch.from_numpy(prepared.sums))
    assert torch.equal(op, got)
    xb = x.bfloat16()
    got_b = matvec_cpu(xb, prepared)
    assert got_b.dtype == torch.bfloat16
    ref_b = matvec_ref(as_multiplied(xb, weights), weights, scales, biases).float()
    assert torch.allclose(got_b.float(), ref_b, rtol=2**-7, atol=1e-6)


def host_has(dtype):
    return pytest.mark.skipif(dtype not in FAST_DOTS, reason=f"this host has no multiply-accumulate instruction for "
                              f"{dtype} weights (AVX-512 BF16 / VNNI)")


WIDE = 2 * VECTOR + 16  # inputs: two vectors of the fast loop, then a tail


@host_has("bfloat16")
@pytest.mark.parametrize("rows", [1, 16, 37])
def test_bf16_instruction_path_equals_reference(gen, rows):
    """One bfloat16 row against bfloat16 weights through ``vdpbf16ps`` (exact products, float32 sums): the float32
    reference up to the order of the additions. Three matrices in one call (one parallel region over the tiles of
    all of them), so that each output lands in its own matrix's columns."""
    ws = [(torch.randn(n, WIDE, generator=gen) / WIDE**0.5).bfloat16() for n in (rows, 5, 21)]
    bs = [torch.randn(w.shape[0], generator=gen) for w in ws]
    x = torch.randn(1, WIDE, generator=gen).bfloat16()
    got = matvec_cpu(x, MatvecWeights.prepare(ws, None, bs), torch.float32)
    ref = matvec_ref(x.float(), [w.float() for w in ws], None, bs)
    assert (got - ref).abs().max() <= 2e-6 * (1 + ref.abs().max())


@host_has("int8")
@pytest.mark.parametrize("group_size", [0, 8, 16, 136])
@pytest.mark.parametrize("batch", [1, 2, 3, 8])
def test_int8_instruction_path_is_within_the_rounding_of_x(gen, group_size, batch):
    """int8 weights times rows rounded to int16 steps, each its own (``vpdpbusd``, exact integer sums; groups of 136
    mix the vector loop and the tail, groups of 8 and 16 are all tail): equal to the reference of the rounded rows up
    to float32 rounding, and within step / 2 * sum |W| of the reference of the rows as given. Three matrices in one
    call (37, 5 and 22 rows: tiles that end inside a block of weight rows), so that each output row takes its own
    matrix's weight sums, scales and bias; 3 input rows end inside a block of input rows."""
    K = 2 * 136
    pairs = [quantize_int8(torch.randn(n, K, generator=gen) / K**0.5, group_size) for n in (37, 5, 22)]
    qs, scales = [q for q, _ in pairs], [s for _, s in pairs]
    bs = [torch.randn(q.shape[0], generator=gen) for q in qs]
    x = torch.randn(batch, K, generator=gen) * torch.rand(batch, K, generator=gen) ** 3  # entries far below the max
    x[-1] *= 1000  # rows of very different sizes: each has its own step
    got = matvec_cpu(x, MatvecWeights.prepare(qs, scales, bs))
    rounded = [quantize_row_int16(row) for row in x]
    ref = matvec_ref(torch.stack([xq.float() * step for xq, step in rounded]), qs, scales, bs)
    assert ((got - ref).abs() <= 2e-6 * (1 + ref.abs().amax(1, keepdim=True))).all()
    sums = torch.cat([dequantize_int8(q, s).abs().sum(1) for q, s in pairs])
    bound = torch.stack([step / 2 * sums for _, step in rounded])
    assert ((got - matvec_ref(x, qs, scales, bs)).abs() <= bound + 2e-6 * (1 + ref.abs())).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rounds_x_to_int16_steps_as_the_reference(gen, dtype):
    """The kernel's own rounding of a row to int16 steps (numba, before the int8 kernel; written as the bytes of
    x + 32768) is the reference's, bit for bit: the same float32 step and quotients, ties to even; 0 for a row with
    inf or NaN, and a zero row."""
    x = (torch.randn(300, generator=gen) * torch.rand(300, generator=gen) ** 4).to(dtype)
    x[5] = x.abs().max() * 0.5  # a tie or two: exactly half of 32767 steps is 16383.5
    bits = (x.view(torch.uint16) if dtype == torch.bfloat16 else x).numpy()
    high, low = np.empty(300, np.uint8), np.empty(300, np.uint8)
    step = matvec_module._quantize_row_int16(bits, high, low)
    ref_q, ref_step = quantize_row_int16(x)
    q = torch.from_numpy(high.astype(np.int32) * 256 + low - 32768)
    assert step == ref_step and torch.equal(q, ref_q.int())
    assert matvec_module._quantize_row_int16(np.zeros(8, np.float32), high[:8], low[:8]) == 1.0
    assert (high[:8] == 128).all() and not low[:8].any()
    for bad in (float("inf"), -float("inf"), float("nan")):  # (the kernel finds max |x| from the bits)
        x[7] = bad
        assert matvec_module._quantize_row_int16(x.float().numpy(), high, low) == 0.0
        assert matvec_module._quantize_row_int16(x.bfloat16().view(torch.uint16).numpy(), high, low) == 0.0
        with pytest.raises(ValueError, match="infinite or NaN"):
            quantize_row_int16(x)


@host_has("int8")
@pytest.mark.parametrize("value", [3.0, -3.0])
@pytest.mark.parametrize("batch", [1, 3])
def test_int8_instruction_path_does_not_overflow(gen, value, batch):
    """The extreme int16 and int8 values (x = +-32767 steps, w = +-127 and -128) over more inputs than one sum of
    vpdpbusd's int32 lanes holds exactly (chunks of DOT_CHUNK): the exact products, summed in int64."""
    K = 2 * DOT_CHUNK + VECTOR + 8
    q = torch.full((3, K), 127, dtype=torch.int8)
    q[1], q[2] = -127, -128
    x = torch.full((batch, K), value)
    x[1:] *= -1  # the other rows the other sign
    got = matvec_cpu(x, MatvecWeights.prepare([q], [torch.ones(3, 1)]))
    assert torch.allclose(got, x[:, :1] * K * torch.tensor([[127.0, -127.0, -128.0]]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("batch", [1, 3])
def test_rows_with_infinities_and_nans_as_the_reference(gen, dtype, batch):
    """A row with inf and NaN entries: the int8 path cannot round it to int16 steps, so it takes the float32 kernel;
    the outputs are inf / NaN where the reference's are."""
    weights, scales, biases = matrices(gen, dtype, 0)
    x = torch.randn(batch, K, generator=gen).bfloat16()
    x[-1, 3], x[-1, 7] = float("inf"), float("nan")
    got = matvec_cpu(x, MatvecWeights.prepare(weights, scales, biases), torch.float32)
    ref = matvec_ref(x.float(), weights, scales, biases)
    assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.isinf(), ref.isinf())


@pytest.mark.parametrize("dtype,group_size", [(torch.bfloat16, 0), (torch.int8, 0), (torch.int8, 136)])
def test_generic_one_row_path_equals_reference(gen, monkeypatch, dtype, group_size):
    """With no fast instruction (GRIFFIN_MATVEC=generic, or a host without them) one row is widened to float32 and
    multiplied as it is: the reference up to the order of the additions."""
    monkeypatch.setattr(matvec_module, "FAST_DOTS", frozenset())
    K = 2 * 136
    w = torch.randn(37, K, generator=gen) / K**0.5
    q, scale = quantize_int8(w, group_size) if dtype == torch.int8 else (w.bfloat16(), None)
    x = torch.randn(1, K, generator=gen).bfloat16()
    got = matvec_cpu(x, MatvecWeights.prepare([q], None if scale is None else [scale]), torch.float32)
    ref = matvec_ref(x.float(), [q], None if scale is None else [scale])
    assert (got - ref).abs().max() <= 2e-6 * (1 + ref.abs().max())


def test_kernel_input_shapes(gen):
    weights, scales, biases = matrices(gen, torch.float32, 0)
    prepared = MatvecWeights.prepare(weights, scales, biases)
    x = torch.randn(2, 3, K, generator=gen)
    assert torch.allclose(matvec_cpu(x, prepared), matvec_ref(x, weights, scales, biases), atol=1e-5)
    with pytest.raises(ValueError, match="input width 47"):
        matvec_cpu(torch.randn(1, 47), prepared)
    with pytest.raises(ValueError, match="one dtype"):
        MatvecWeights.prepare([weights[0], weights[1].bfloat16()])
    with pytest.raises(ValueError, match="need their scales"):
        MatvecWeights.prepare([quantize_int8(weights[0])[0]])
    with pytest.raises(ValueError, match="scales are for int8 weights, not torch.bfloat16"):
        MatvecWeights.prepare([weights[0].bfloat16()], [torch.ones(weights[0].shape[0], 1)])
    with pytest.raises(ValueError, match="float16"):
        MatvecWeights.prepare([weights[0].half()])


@pytest.mark.parametrize("group_size", [0, 8, 24])
def test_quantize_int8_rounds_within_half_a_step(gen, group_size):
    w = torch.randn(20, 48, generator=gen) * torch.rand(20, 1, generator=gen) * 3
    w[3] = 0.0  # an all-zero row: scale 1, values 0
    q, scale = quantize_int8(w, group_size)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert scale.shape == (20, 1 if group_size == 0 else 48 // group_size) and scale.dtype == torch.float32
    back = dequantize_int8(q, scale)
    step = scale.repeat_interleave(48 // scale.shape[1], 1)
    # half a step, plus float32 rounding of w / scale and q * scale near a tie (|w| up to 127 steps: ~1e-5 steps)
    assert ((back - w).abs() <= step * (0.5 + 1e-4)).all()
    assert (back[3] == 0).all()
    groups = w.reshape(20, scale.shape[1], -1).abs().amax(-1)  # each group's largest entry is exactly +-127 steps
    assert torch.equal(q.reshape(20, scale.shape[1], -1).abs().amax(-1)[groups > 0], torch.full_like(
        groups[groups > 0], 127, dtype=torch.int8))


@pytest.mark.parametrize("bad", [3, -8, 12, 8.0, True])
def test_unsupported_group_sizes_are_named(bad):
    with pytest.raises(ValueError, match=f"group_size={bad!r}"):
        check_group_size(bad)


def test_group_size_must_divide_the_inputs():
    with pytest.raises(ValueError, match="group_size=32 does not divide the 48 inputs of layer blocks.0.x"):
        check_group_size(32, 48, "blocks.0.x")
    with pytest.raises(ValueError, match="group_size=32"):
        quantize_int8(torch.randn(4, 48), 32)


@pytest.mark.parametrize(("dtype", "rows"), [(torch.int8, 1), (torch.int8, 5), (torch.bfloat16, 1),
                                             (torch.float32, 1)])
@pytest.mark.parametrize("ahead", [0, 64, 4096, 1 << 30])
def test_prefetch_distance_changes_no_output(gen, monkeypatch, dtype, rows, ahead):
    """The kernels prefetch the weights ahead (none, within a row or block, a few rows ahead, past every matrix's
    end): at one row (every dtype) and several (int8), the outputs are the same bits whatever the distance."""
    base = [torch.randn(n, 192, generator=gen) for n in (37, 5, 22)]
    if dtype == torch.int8:
        pairs = [quantize_int8(w, 0) for w in base]
        prepared = MatvecWeights.prepare([q for q, _ in pairs], [s for _, s in pairs])
    else:
        prepared = MatvecWeights.prepare([w.to(dtype) for w in base])
    x = torch.randn(rows, 192, generator=gen).to(torch.float32 if dtype == torch.float32 else torch.bfloat16)
    expected = matvec_cpu(x, prepared, torch.float32)
    monkeypatch.setattr(matvec_module, "PREFETCH_BYTES", ahead)
    assert torch.equal(matvec_cpu(x, prepared, torch.float32), expected)


needs_tiles = pytest.mark.skipif("int8" not in FAST_TILES, reason="this host has no int8 tile unit (AMX)")


@needs_tiles
def test_tile_product_is_the_exact_integer_sum(gen):
    """``tile_dot_int8``: 16 weight rows from any row against 16 columns of unsigned bytes in the tile layout, over a
    range of k, equal the int64 products, including the extreme values (w = -128 and 127 against 255)."""
    rng = np.random.default_rng(0)
    k = 640
    w = rng.integers(-128, 128, (40, k)).astype(np.int8)
    w[21, :] = -128
    b = rng.integers(0, 256, (k, 16)).astype(np.uint8)
    b[:, 3] = 255
    packed = np.ascontiguousarray(b.reshape(k // 4, 4, 16).transpose(0, 2, 1).reshape(k // 4, 64))
    out = np.empty((16, 16), np.int32)

    @numba.njit
    def call(config, w, row, packed, start, n, out):  # type: ignore[no-untyped-def]
        tile_dot_int8(config, w, row, packed, start, n, out)

    for row, start, n in ((0, 0, k), (21, 128, 384), (24, 64, 64)):
        call(tile_config(), w, row, packed, start, n, out)
        expected = w[row : row + 16, start : start + n].astype(np.int64) @ b[start : start + n].astype(np.int64)
        assert np.array_equal(out, expected), (row, start, n)


@needs_tiles
@pytest.mark.parametrize(("k", "rows", "batch", "group_size"), [
    (192, (37, 5, 22), 5, 0),  # tiles ending inside a matrix, a matrix of fewer than 16 rows
    (2048, (64, 16), 8, 0),  # full tiles, one block of 8 input rows
    (200, (33,), 13, 0),  # a group's tail past the tile products (200 = 128 + 72), two blocks of input rows
    (384, (40,), 3, 128),  # groups of 128
    (256, (16,), 16, 32),  # groups smaller than one tile product: the tail alone
    (131, (20,), 3, 0),  # inputs not a multiple of 4: the last packed word part zeros
])
def test_tile_kernel_equals_the_vpdpbusd_kernel_bit_for_bit(gen, monkeypatch, k, rows, batch, group_size):
    """Several rows of int8 weights through the tile unit (AMX ``tdpbsud``): the same exact integer sums as the
    ``vpdpbusd`` kernel's, then the same float32 operations, so the same bits; and the reference's values of x as
    both multiply it."""
    pairs = [quantize_int8(torch.randn(n, k, generator=gen) / k**0.5, group_size) for n in rows]
    weights, scales = [q for q, _ in pairs], [s for _, s in pairs]
    biases = [torch.randn(n, generator=gen) for n in rows]
    prepared = MatvecWeights.prepare(weights, scales, biases)
    x = torch.randn(batch, k, generator=gen).bfloat16()
    tiled = matvec_cpu(x, prepared, torch.float32)
    ref = matvec_ref(as_multiplied(x, weights), weights, scales, biases, out_dtype=torch.float32)
    assert (tiled - ref).abs().max() <= 1e-5 * (1 + ref.abs().max())
    monkeypatch.setattr(matvec_module, "FAST_TILES", frozenset())
    assert torch.equal(tiled, matvec_cpu(x, prepared, torch.float32))


def test_no_tiles_without_the_unit_or_when_asked(monkeypatch):
    """GRIFFIN_MATVEC=no-tiles (and =generic) turns the tile unit off; a host without it reports none."""
    from griffin.inference.cpu import isa

    for setting in ("no-tiles", "generic"):
        monkeypatch.setenv("GRIFFIN_MATVEC", setting)
        assert isa.host_tiles() == frozenset()
    monkeypatch.delenv("GRIFFIN_MATVEC")
    monkeypatch.setattr(isa.llvm, "get_host_cpu_features", lambda: {"avx512f": True})
    assert isa.host_tiles() == frozenset()


ONE_ROW = """
import sys, torch
from griffin.inference.cpu.matvec import MatvecWeights, matvec_cpu
q = torch.full((3, 256), 127, dtype=torch.int8)
for dtype in sys.argv[1:]:
    x = torch.full((1, 256), 3.0).to(getattr(torch, dtype))
    print(matvec_cpu(x, MatvecWeights.prepare([q], [torch.ones(3, 1)]), torch.float32)[0, 0].item())
"""


def test_one_row_kernels_load_from_the_cache_in_every_specialisation(tmp_path):
    """The cached entry (``_matvec_rows_kernel``) run from numba's cache with two specialisations, bfloat16 and
    float32 rows, in later processes. When it was a function calling parallel kernels without being one, compiled the
    plain way, the second one crashed (numba issue 8578)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    for dtypes in (["bfloat16"], ["float32"], ["float32", "bfloat16"]):
        done = subprocess.run([sys.executable, "-c", ONE_ROW, *dtypes], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, (dtypes, done.returncode, done.stderr[-2000:])
        assert [float(v) for v in done.stdout.split()] == pytest.approx([3.0 * 127 * 256] * len(dtypes), rel=1e-2)


SETTINGS = """
import torch
from griffin.inference.cpu.matvec import MatvecWeights, matvec_cpu
x = torch.full((3, 256), 1e-6)
x[:, 0] = 1.0
prepared = MatvecWeights.prepare([torch.ones(2, 256, dtype=torch.int8)], [torch.ones(2, 1)])
print(matvec_cpu(x[:1], prepared)[0, 0].item(), matvec_cpu(x, prepared)[0, 0].item())
"""


@host_has("int8")
def test_kernels_compiled_under_other_settings_follow_the_current_ones(tmp_path):
    """Kernels compiled and cached in a process that takes no instruction path (``GRIFFIN_MATVEC=generic``: x as it
    is, 1 + 255e-6) still hold the paths, and a later process that loads them from the cache takes them, at one row
    and at three (x rounded to int16 steps of 1/32767: its 1e-6 entries, below half a step, become 0): the paths are
    compiled where the host has them, and a flag read at each call picks one. When the settings of the compiling
    process decided, the later one got the generic kernel from the cache."""
    outs = []
    for setting in ("generic", ""):
        env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "GRIFFIN_MATVEC": setting}
        done = subprocess.run([sys.executable, "-c", SETTINGS], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (setting, done.stderr[-2000:])
        outs.append([float(v) for v in done.stdout.split()])
    assert outs[0] == pytest.approx([1 + 255e-6] * 2, rel=1e-6)
    assert outs[1] == [1.0, 1.0]


GUARDED = """
import ctypes, mmap, numpy as np, torch
from griffin.ops.matvec import quantize_int8
from griffin.inference.cpu.matvec import MatvecWeights, matvec_cpu
from griffin.ops.matvec import matvec_ref
rows, k, page = 3, 2 * 65536 + 136, mmap.PAGESIZE  # (three DOT_CHUNK pieces: where the bug showed)
buffer = mmap.mmap(-1, 4 * page + rows * k)
libc = ctypes.CDLL(None, use_errno=True)
base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
end = (base + rows * k + page - 1) // page * page  # the page after the matrix's last byte: no access
assert libc.mprotect(ctypes.c_void_p(end), ctypes.c_size_t(page), 0) == 0, ctypes.get_errno()
w = np.frombuffer(buffer, np.int8, rows * k, end - base - rows * k).reshape(rows, k)
q, scale = quantize_int8(torch.randn(rows, k))
w[:] = q.numpy()
weights = torch.from_numpy(w)
x = torch.randn(5, k).bfloat16()
got = matvec_cpu(x, MatvecWeights.prepare([weights], [scale]), torch.float32)
ref = matvec_ref(x.float(), [weights], [scale])
print(float((got - ref).abs().max()), float(ref.abs().max()))
"""


def test_several_rows_never_read_past_a_matrix():
    """A 3-row int8 matrix that ends where an unreadable page begins, at 5 rows: no kernel (the AMX one loads tiles of
    16 rows) reads past its last row. (With the padded copy assigned to the matrix's variable inside the prange loop,
    the tile loads read the matrix itself, 13 rows past its end: where the heap had room after it this went
    unnoticed, elsewhere it crashed; this test crashed on that code every time.)"""
    done = subprocess.run([sys.executable, "-c", GUARDED], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    error, largest = map(float, done.stdout.split())
    assert error <= 1e-4 * largest  # (x rounded to int16 steps, float32 sums of 131208 terms)
