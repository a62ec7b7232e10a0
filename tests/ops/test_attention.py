"""Chunked sliding-window attention (griffin.ops.attention) against its dense-mask reference."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from griffin.ops.attention import (
    causal_attention,
    chunks_by_bmm,
    fused_sdpa,
    local_chunk,
    sliding_window_attention,
    sliding_window_attention_ref,
)
from tests.conftest import DEVICES


def inputs(gen, B, T, P, H, Hk, d, dtype, segments, requires_grad=False):
    q = torch.randn(B, T, H, d, generator=gen, dtype=torch.float64)
    k = torch.randn(B, P + T, Hk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(B, P + T, Hk, d, generator=gen, dtype=torch.float64)
    q, k, v = (t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v))
    if not segments:
        return q, k, v, None, None
    k_seg = torch.cumsum(torch.rand(B, P + T, generator=gen) < 0.05, 1) - 1  # ids from -1 up (-1: EMPTY padding)
    return q, k, v, k_seg[:, P:], k_seg


@pytest.mark.parametrize("trial", range(40))
def test_matches_reference_float64(gen, trial):
    """Fresh random shapes: several chunks, a chunk that does not divide T, keys before the queries (a cache),
    windows shorter and longer than a chunk, one or several key heads, with and without documents; the chunks by
    the fused kernel or (every other trial) by attention_bmm."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))

    def pick(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    B, T, P, window, chunk = pick(1, 3), pick(1, 200), pick(0, 50), pick(1, 70), pick(1, 40)
    H = [1, 2, 4][trial % 3]
    Hk = 1 if trial % 2 else H
    q, k, v, qs, ks = inputs(g, B, T, P, H, Hk, 8, torch.float64, segments=trial % 4 == 0)
    out = sliding_window_attention(q, k, v, window, None, qs, ks, chunk=chunk, bmm=trial % 2 == 0)
    ref = sliding_window_attention_ref(q, k, v, window, None, qs, ks)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("bmm", [False, True])
def test_matches_float64_reference_with_gradients(gen, dtype, segments, device, bmm):
    """Also on CUDA, where the chunks go through the fused (flash / memory-efficient) SDPA kernels; the chunks by
    the fused kernel or by attention_bmm (float32 inside, the output in the inputs' dtype)."""
    B, T, P, H, d, window = 2, 157, 9, 4, 16, 37
    q, k, v, qs, ks = inputs(gen, B, T, P, H, 1, d, dtype, segments)
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    qs, ks = (None, None) if qs is None else (qs.to(device), ks.to(device))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    dout = torch.randn(B, T, H, d, generator=gen, dtype=torch.float64).to(device)
    out = sliding_window_attention(q, k, v, window, 0.3, qs, ks, chunk=16, bmm=bmm)
    ref = sliding_window_attention_ref(q64, k64, v64, window, 0.3, qs, ks)
    (out.double() * dout).sum().backward()
    (ref * dout).sum().backward()
    tol = 2e-5 if dtype == torch.float32 else 4e-2
    assert out.dtype == dtype
    for got, want in [(out, ref), (q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)]:
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype, window, by_bmm", [(torch.bfloat16, 37, True), (torch.bfloat16, 300, False),
                                                   (torch.float32, 37, False)])
def test_compiled_cpu_step_attends_small_bf16_chunks_by_bmm(gen, monkeypatch, dtype, window, by_bmm):
    """Under torch.compile on a CPU, bf16 chunks of at most BMM_MAX_SPAN keys go through attention_bmm, longer or
    float32 ones through the fused kernel (never outside compilation); either way the reference's output and
    gradients."""
    import griffin.ops.attention as attention

    chosen = []

    def spy(q, span):
        chosen.append(chunks_by_bmm(q, span))
        return chosen[-1]

    assert not chunks_by_bmm(torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16), 10)  # eager: the fused kernel
    monkeypatch.setattr(attention, "chunks_by_bmm", spy)
    q, k, v, qs, ks = inputs(gen, 2, 150, 0, 4, 1, 16, dtype, True, requires_grad=True)
    fn = torch.compile(lambda q, k, v: attention.sliding_window_attention(q, k, v, window, None, qs, ks, chunk=64),
                       backend="aot_eager", fullgraph=True)
    out = fn(q, k, v)
    assert chosen == [by_bmm]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = sliding_window_attention_ref(q64, k64, v64, window, None, qs, ks)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((out.double() * dout).sum(), (q, k, v))
    want = torch.autograd.grad((ref * dout).sum(), (q64, k64, v64))
    tol = 2e-5 if dtype == torch.float32 else 4e-2
    assert out.dtype == dtype
    for a, b in [(out, ref), *zip(got, want, strict=True)]:
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


@pytest.mark.parametrize("trial", range(12))
def test_causal_attention_in_chunks_matches_the_fused_kernel_float64(gen, trial):
    """Global causal attention by chunks through attention_bmm (chunk sizes that do or do not divide T, one or
    several key heads, with and without documents) against the fused kernel over the whole T x T: outputs and
    gradients in float64."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    T = int(torch.randint(1, 150, (1,), generator=g))
    chunk = int(torch.randint(1, 70, (1,), generator=g))
    H, Hk = [(1, 1), (2, 1), (4, 2)][trial % 3]
    q, k, v, _, _ = inputs(g, 2, T, 0, H, Hk, 8, torch.float64, False, requires_grad=True)
    seg = torch.cumsum(torch.rand(2, T, generator=g) < 0.05, 1) if trial % 2 else None
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (N, H, T, d)
    out = causal_attention(q, k, v, 0.4, seg, seg, chunk=chunk)
    ref = causal_attention(q, k, v, 0.4, seg, seg)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * dout).sum(), (q, k, v))
    want = torch.autograd.grad((ref * dout).sum(), (q, k, v))
    for a, b in [(out, ref), *zip(got, want, strict=True)]:
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if seg is None:  # the reference is the fused causal kernel itself
        torch.testing.assert_close(ref, F.scaled_dot_product_attention(
            q, k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1), is_causal=True, scale=0.4),
            rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("trial", range(16))
def test_causal_attention_with_a_window_matches_the_dense_reference_float64(gen, trial):
    """Local attention through causal_attention's chunks (each over the keys from the first its window reaches:
    chunks that do or do not divide T, windows shorter and longer than a chunk or than T, one or several key heads,
    with and without documents) and unchunked, against sliding_window_attention_ref: outputs and gradients in
    float64."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))

    def pick(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    T, window = pick(1, 150), pick(1, 80)
    chunk = None if trial % 4 == 3 else pick(1, 70)
    H, Hk = [(1, 1), (2, 1), (4, 2)][trial % 3]
    q, k, v, qs, ks = inputs(g, 2, T, 0, H, Hk, 8, torch.float64, trial % 2 == 1, requires_grad=True)
    out = causal_attention(*(t.transpose(1, 2) for t in (q, k, v)), 0.4, qs, ks, chunk=chunk, window=window)
    ref = sliding_window_attention_ref(q, k, v, window, 0.4, qs, ks)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out.transpose(1, 2) * dout).sum(), (q, k, v))
    want = torch.autograd.grad((ref * dout).sum(), (q, k, v))
    for a, b in [(out.transpose(1, 2), ref), *zip(got, want, strict=True)]:
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


class FusedKernelDtypes(TorchDispatchMode):
    """Records the dtype of the queries of each fused attention kernel that runs while active."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.name():
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_compiled_cpu_bf16_step_attends_long_chunks_by_the_fused_kernel_in_float32(gen, monkeypatch):
    """Chunks of more than BMM_MAX_SPAN keys in a compiled bf16 CPU step: the fused kernel runs on float32 copies,
    even under autocast (which would cast them back to bf16); the output is bf16, the reference's within its
    rounding. (The choice is made while compiling: here it is made so in an eager call, to see the kernels run.)"""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k, v, qs, ks = inputs(gen, 2, 300, 0, 2, 1, 16, torch.bfloat16, False, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), FusedKernelDtypes() as kernels:
        out = sliding_window_attention(q, k, v, 250, None, chunk=64)
    assert kernels.dtypes and set(kernels.dtypes) == {torch.float32} and out.dtype == torch.bfloat16
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = sliding_window_attention_ref(q64, k64, v64, 250)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((out.double() * dout).sum(), (q, k, v))
    want = torch.autograd.grad((ref * dout).sum(), (q64, k64, v64))
    for a, b in [(out, ref), *zip(got, want, strict=True)]:
        torch.testing.assert_close(a.double(), b, rtol=4e-2, atol=4e-2)


def test_gradcheck(gen):
    q, k, v, qs, ks = inputs(gen, 2, 13, 3, 2, 1, 4, torch.float64, segments=True, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v: sliding_window_attention(q, k, v, 4, None, qs, ks, chunk=3), (q, k, v))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_sdpa_shares_key_heads_without_enable_gqa_under_a_mask(gen, monkeypatch, kv_heads, masked):
    """Query head h uses key/value head h // (H / H_kv); with a mask, enable_gqa is never passed (CUDA's fused
    kernels refuse the pair and PyTorch falls back to the math kernel)."""
    N, H, L, S, d = 3, 4, 5, 7, 8
    q = torch.randn(N, H, L, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(N, kv_heads, S, d, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(N, 1, L, S, generator=gen) < 0.7 if masked else None
    if masked:
        mask[..., 0] = True  # no fully masked row
    calls = []
    original = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    out = fused_sdpa(q, k, v, mask, 0.3)
    G = H // kv_heads
    ref = original(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask, scale=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert calls[0].get("enable_gqa", False) == (kv_heads != H and not masked)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operator returns while active (in elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("window", [3, 100, 600, 1500])
def test_default_chunk_gives_the_reference_within_its_band(gen, window):
    """With the default chunk (windows below, inside and above the range where it is a quarter of the window), over
    several chunks, a shorter last one and a cache: the reference's result, and no tensor larger than the band of
    keys a chunk can see, B H T (C + window - 1)."""
    C = local_chunk(window)
    B, T, P, H = 2, 3 * C + 5, 7, 2
    q, k, v, qs, ks = inputs(gen, B, T, P, H, 1, 8, torch.float64, segments=window == 100)
    with LargestTensor() as mode:
        out = sliding_window_attention(q, k, v, window, None, qs, ks)
    assert mode.largest <= B * H * T * (C + window - 1), mode.largest
    torch.testing.assert_close(out, sliding_window_attention_ref(q, k, v, window, None, qs, ks), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("segments", [False, True])
def test_never_a_full_mask(gen, segments):
    """Memory O(T (C + window)): for a 64K-token sequence and a 128-token window, no tensor (mask, scores, key
    chunks) exceeds one value per query and key it may see, B H T (C + window - 1), a 1/200 of a T x T mask; the
    result is that of the dense reference."""
    B, T, H, d, window = 1, 65536, 1, 4, 128
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for _ in range(3))
    seg = torch.cumsum(torch.rand(B, T, generator=gen) < 0.001, 1) if segments else None
    with LargestTensor() as mode:
        out = sliding_window_attention(q, k, v, window, q_seg=seg, k_seg=seg)
    assert mode.largest <= B * H * T * (local_chunk(window) + window - 1), mode.largest
    ref = sliding_window_attention_ref(q[:, -512:], k[:, -512 - window:], v[:, -512 - window:], window,
                                       q_seg=None if seg is None else seg[:, -512:],
                                       k_seg=None if seg is None else seg[:, -512 - window:])
    torch.testing.assert_close(out[:, -512:], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad, message", [
    (dict(window=0), "window=0"),
    (dict(window=2.5), "window=2.5"),
    (dict(k=torch.zeros(2, 3, 1, 4)), "at least T=5 keys"),
    (dict(q=torch.zeros(2, 5, 3, 4), k=torch.zeros(2, 5, 2, 4), v=torch.zeros(2, 5, 2, 4)), "multiple"),
    (dict(q=torch.zeros(2, 5, 4)), "expects q"),
    (dict(q_seg=torch.zeros(2, 5, dtype=torch.long)), "both q_seg and k_seg"),
    (dict(q_seg=torch.zeros(2, 4, dtype=torch.long), k_seg=torch.zeros(2, 5, dtype=torch.long)), "segments must"),
])
def test_bad_input_is_named(bad, message):
    args = dict(q=torch.zeros(2, 5, 2, 4), k=torch.zeros(2, 5, 1, 4), v=torch.zeros(2, 5, 1, 4), window=3,
                q_seg=None, k_seg=None)
    args.update(bad)
    if "k" in bad and "v" not in bad:
        args["v"] = args["k"]
    with pytest.raises(ValueError, match=message):
        sliding_window_attention(**args)
