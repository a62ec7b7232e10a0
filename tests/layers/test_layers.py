"""Every layer against an independent formula written here (paper, Section 2 and Appendices A-B)."""

import math

import pytest
import torch
import torch.nn.functional as F

from griffin import ModelConfig
from griffin.inference.cpu.prepack import PackedLinear, can_prepack
from griffin.layers import (
    CGLRU,
    RGLRU,
    BlockDiagonalLinear,
    CausalConv1D,
    Context,
    GatedMLP,
    MultiQueryAttention,
    RMSNorm,
)
from griffin.layers.quantized import Int8BlockDiagonalLinear
from griffin.layers.recurrent_block import RecurrentBlock
from griffin.layers.rg_lru import DENSE_GATES_MAX_WIDTH, dense_gates
from griffin.layers.rope import apply_rope, rope_angles, rope_angles_cpu, rope_angles_ref
from griffin.ops.attention import AMX_CAUSAL_BMM_MAX_LEN, CAUSAL_BMM_CHUNK, CAUSAL_BMM_MAX_LEN, MAX_CHUNK
from tests.conftest import rg_lru_formula, seed_torch


def rand(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=dtype)


def random_resets(gen, B, T, p=0.1):
    reset = torch.rand(B, T, generator=gen) < p
    reset[:, 0] = True
    return reset


def test_rmsnorm(gen):
    norm = RMSNorm(7, eps=1e-6).double()
    with torch.no_grad():
        norm.scale.copy_(rand(gen, 7))
    x = rand(gen, 3, 5, 7)
    expected = x / torch.sqrt((x**2).sum(-1, keepdim=True) / 7 + 1e-6) * (1 + norm.scale)
    torch.testing.assert_close(norm(x), expected)


@pytest.mark.parametrize("approx", ["tanh", "none"])
def test_gated_mlp(gen, approx):
    mlp = GatedMLP(6, 18, approx).double()
    x = rand(gen, 2, 4, 6)

    def gelu(u):
        if approx == "none":
            return 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))
        return 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))

    gate = gelu(x @ mlp.gate_proj.weight.T + mlp.gate_proj.bias)
    up = x @ mlp.up_proj.weight.T + mlp.up_proj.bias
    expected = (gate * up) @ mlp.down_proj.weight.T + mlp.down_proj.bias
    torch.testing.assert_close(mlp(x), expected)


def test_rope_is_a_rotation_by_position(gen):
    B, T, H, d, rot = 2, 9, 3, 8, 4
    x = rand(gen, B, T, H, d)
    pos = torch.randint(0, 100, (B, T), generator=gen)
    cos, sin = rope_angles(pos, rot, 10_000.0)
    y = apply_rope(x, cos.double(), sin.double())
    # Independent formula: pair (j, j + rot/2) is a complex number turned by pos * base^(-2j/rot).
    half = rot // 2
    z = torch.complex(x[..., :half], x[..., half:rot])
    theta = pos[..., None, None].double() * 10_000.0 ** (-2 * torch.arange(half).double() / rot)
    z = z * torch.polar(torch.ones_like(theta), theta)
    expected = torch.cat([z.real, z.imag, x[..., rot:]], dim=-1)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    # Relative: q.k depends on the position difference only.
    q, k = rand(gen, 1, 1, 1, d), rand(gen, 1, 1, 1, d)

    def dot(pq, pk):
        cq, sq = rope_angles(torch.tensor([[pq]]), rot, 10_000.0)
        ck, sk = rope_angles(torch.tensor([[pk]]), rot, 10_000.0)
        return (apply_rope(q, cq.double(), sq.double()) * apply_rope(k, ck.double(), sk.double())).sum()

    torch.testing.assert_close(dot(10, 3), dot(107, 100), atol=1e-5, rtol=1e-5)


def test_rope_angles_are_one_operator_in_a_compiled_cpu_step(gen):
    """Under torch.compile on a CPU the angles come from griffin::rope_angles_cpu (computed once, not recomputed by
    Inductor inside the rotation of every q and k element), the reference's numbers bit for bit; eager calls are
    the reference itself."""
    positions = torch.randint(0, 5000, (3, 17), generator=gen)
    torch.library.opcheck(rope_angles_cpu, (positions, 16, 10_000.0))
    want = rope_angles_ref(positions, 16, 10_000.0)
    assert all(torch.equal(a, b) for a, b in zip(rope_angles(positions, 16, 10_000.0), want, strict=True))
    x = rand(gen, 3, 17, 2, 32, dtype=torch.float32).requires_grad_()
    torch._dynamo.reset()
    fn = torch.compile(lambda x, p: (apply_rope(x, *rope_angles(p, 16, 10_000.0)), rope_angles(p, 16, 10_000.0)),
                       fullgraph=True)
    with torch.profiler.profile() as prof:
        y, angles = fn(x, positions)
        y.square().sum().backward()
    assert any(e.name == "griffin::rope_angles_cpu" for e in prof.events())
    assert all(torch.equal(a, b) for a, b in zip(angles, want, strict=True))
    x_ref = x.detach().requires_grad_()
    y_ref = apply_rope(x_ref, *want)
    y_ref.square().sum().backward()
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, x_ref.grad)


def compiled_bf16_against_float64(gen, cfg: ModelConfig, local: bool, T: int, packed: bool) -> None:
    """The attention layer in float64, eager, then in bf16 compiled (aot_eager, as a compiled CPU step traces it) on
    the same weights and input: the output and gradients within bf16's rounding."""
    att = MultiQueryAttention(cfg, local=local).double()
    B = 2
    segments, positions = documents(gen, B, T, 0.01) if packed else (None, torch.arange(T).expand(B, T))
    x = rand(gen, B, T, cfg.width)
    dout = rand(gen, B, T, cfg.width)
    want = att(x.requires_grad_(), attention_context(positions, segments, cfg, torch.float64))
    want_grads = torch.autograd.grad((want * dout).sum(), [x, *att.parameters()])
    att16 = MultiQueryAttention(cfg, local=local).to(torch.bfloat16)
    att16.load_state_dict(att.state_dict())
    x16 = x.detach().to(torch.bfloat16).requires_grad_()
    torch._dynamo.reset()
    fn = torch.compile(lambda x: att16(x, attention_context(positions, segments, cfg, torch.bfloat16)),
                       backend="aot_eager", fullgraph=True)
    out = fn(x16)
    got_grads = torch.autograd.grad((out.double() * dout).sum(), [x16, *att16.parameters()])
    for a, b in [(out, want), *zip(got_grads, want_grads, strict=True)]:
        torch.testing.assert_close(a.double(), b, rtol=5e-2, atol=5e-2 * b.abs().max().item())


@pytest.mark.parametrize("T, bmm_calls", [(40, 1), (300, -(-300 // CAUSAL_BMM_CHUNK)), (CAUSAL_BMM_MAX_LEN + 1, 0)])
@pytest.mark.parametrize("packed", [False, True])
def test_compiled_cpu_global_attention_attends_bf16_sequences_by_bmm(gen, monkeypatch, T, bmm_calls, packed):
    """Global attention in a compiled bf16 CPU step: up to BMM_MAX_SPAN tokens through one attention_bmm call, up
    to CAUSAL_BMM_MAX_LEN in chunks of CAUSAL_BMM_CHUNK queries (the causal mask, and the documents' when packed),
    longer sequences through the fused kernel (as is the eager float64 layer); either way the float64 layer's output
    and gradients within bf16's rounding."""
    import griffin.ops.attention as attention

    calls, attention_bmm = [], attention.attention_bmm

    def spy(*args):
        calls.append(True)
        return attention_bmm(*args)

    monkeypatch.setattr(attention, "attention_bmm", spy)
    cfg = ModelConfig(width=32, num_heads=2, num_kv_heads=1, head_dim=16, depth=1, family="mqa")
    compiled_bf16_against_float64(gen, cfg, False, T, packed)
    assert len(calls) == bmm_calls


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_compiled_cpu_global_attention_on_amx_takes_the_fused_kernel_beyond_its_limit(gen, monkeypatch, amx, packed):
    """On a CPU with AMX, global attention over more than AMX_CAUSAL_BMM_MAX_LEN tokens goes through the fused causal
    kernel (no mask), documents (a mask) still through attention_bmm's chunks; without AMX, attention_bmm up to
    CAUSAL_BMM_MAX_LEN. Either way the float64 layer's output and gradients within bf16's rounding."""
    import griffin.ops.attention as attention

    calls, attention_bmm = [], attention.attention_bmm
    monkeypatch.setattr(attention, "attention_bmm", lambda *args: calls.append(True) or attention_bmm(*args))
    monkeypatch.setattr(attention, "AMX", amx)
    T = AMX_CAUSAL_BMM_MAX_LEN + 1
    cfg = ModelConfig(width=32, num_heads=2, num_kv_heads=1, head_dim=16, depth=1, family="mqa")
    compiled_bf16_against_float64(gen, cfg, False, T, packed)
    assert len(calls) == (0 if amx and not packed else -(-T // CAUSAL_BMM_CHUNK))


@pytest.mark.parametrize("T, window, bmm_calls", [(40, 16, 1), (300, 100, -(-300 // CAUSAL_BMM_CHUNK)),
                                                  (CAUSAL_BMM_CHUNK * 3, 2 * CAUSAL_BMM_CHUNK + 1, 3)])
@pytest.mark.parametrize("packed", [False, True])
def test_compiled_cpu_local_attention_attends_bf16_sequences_by_causal_chunks(gen, monkeypatch, T, window, bmm_calls,
                                                                             packed):
    """Local attention in a compiled bf16 CPU step over up to CAUSAL_BMM_MAX_LEN tokens: causal_attention with the
    window, in chunks of CAUSAL_BMM_CHUNK queries through attention_bmm, each over the keys from the first its
    window reaches (the sliding-window kernel runs only in the eager float64 layer); the float64 layer's output and
    gradients within bf16's rounding."""
    import griffin.layers.attention as attention_layer
    import griffin.ops.attention as attention

    key_spans, sliding = [], []
    attention_bmm, sliding_window_attention = attention.attention_bmm, attention_layer.sliding_window_attention

    def spy(q, k, *args):
        key_spans.append((q.shape[2], k.shape[2]))
        return attention_bmm(q, k, *args)

    def sliding_spy(*args):
        sliding.append(args[0].dtype)
        return sliding_window_attention(*args)

    monkeypatch.setattr(attention, "attention_bmm", spy)
    monkeypatch.setattr(attention_layer, "sliding_window_attention", sliding_spy)
    cfg = ModelConfig(width=32, num_heads=2, num_kv_heads=1, head_dim=16, depth=1, family="mqa",
                      attention_window=window)
    compiled_bf16_against_float64(gen, cfg, True, T, packed)
    C = CAUSAL_BMM_CHUNK
    assert sliding == [torch.float64]
    assert key_spans == [(min(C, T - lo), min(lo + C, T) - max(0, lo - window + 1)) for lo in range(0, T, C)]
    assert len(key_spans) == bmm_calls


def naive_attention(att: MultiQueryAttention, x, positions, segments, window):
    """Softmax attention written out query by query, with an explicit list of visible keys."""
    B, T, _ = x.shape
    cos, sin = rope_angles(positions, att.config.rope_dim, att.config.rope_base)
    q = apply_rope(att.proj_q(x).view(B, T, att.num_heads, att.head_dim), cos.double(), sin.double())
    k = apply_rope(att.proj_k(x).view(B, T, att.num_kv_heads, att.head_dim), cos.double(), sin.double())
    v = att.proj_v(x).view(B, T, att.num_kv_heads, att.head_dim)
    groups = att.num_heads // att.num_kv_heads
    out = torch.zeros(B, T, att.num_heads, att.head_dim, dtype=x.dtype)
    for b in range(B):
        for t in range(T):
            keys = [s for s in range(T) if s <= t and (window is None or t - s < window)
                    and (segments is None or segments[b, s] == segments[b, t])]
            for h in range(att.num_heads):
                kv = h // groups
                scores = torch.stack([q[b, t, h] @ k[b, s, kv] for s in keys]) / math.sqrt(att.head_dim)
                p = torch.softmax(scores, 0)
                out[b, t, h] = sum(p[i] * v[b, s, kv] for i, s in enumerate(keys))
    return att.proj_final(out.reshape(B, T, -1))


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("packed", [False, True])
def test_attention_against_naive(gen, local, kv_heads, packed):
    cfg = ModelConfig(width=16, num_heads=4, num_kv_heads=kv_heads, head_dim=6, rope_fraction=2 / 3,
                      attention_window=5, depth=1, family="mqa")
    att = MultiQueryAttention(cfg, local=local).double()
    B, T = 2, 13
    x = rand(gen, B, T, 16)
    segments, positions = documents(gen, B, T, 0.2) if packed else (None, torch.arange(T).expand(B, T))
    ctx = attention_context(positions, segments, cfg, torch.float64)
    torch.testing.assert_close(att(x, ctx), naive_attention(att, x, positions, segments, 5 if local else None))


def _doc_positions(reset_row):
    out, p = [], 0
    for r in reset_row.tolist():
        p = 0 if r else p + 1
        out.append(p)
    return out


def documents(gen, B, T, p):
    """Random document ids (B, T) and each token's position in its document, documents starting with probability p."""
    reset = random_resets(gen, B, T, p)
    return torch.cumsum(reset, 1), torch.stack([torch.tensor(_doc_positions(r)) for r in reset])


@pytest.mark.parametrize("window", [3, 64, 200])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_local_attention_matches_full_mask(gen, window, packed):
    """Sequences longer than a chunk go through the chunked path; compare with one explicit T x T mask."""
    cfg = ModelConfig(width=16, num_heads=2, head_dim=8, attention_window=window, depth=1, family="griffin")
    att = MultiQueryAttention(cfg, local=True).double()
    B, T = 2, 3 * MAX_CHUNK + 37
    x = rand(gen, B, T, 16)
    reset = random_resets(gen, B, T, 0.01) if packed else torch.zeros(B, T, dtype=torch.bool)
    segments = torch.cumsum(reset, 1) if packed else None
    positions = torch.stack([torch.tensor(_doc_positions(r)) for r in reset])
    ctx = attention_context(positions, segments, cfg, torch.float64)
    q = apply_rope(att.proj_q(x).view(B, T, 2, 8), *ctx.rope).transpose(1, 2)
    k = apply_rope(att.proj_k(x).view(B, T, 1, 8), *ctx.rope).transpose(1, 2)
    v = att.proj_v(x).view(B, T, 1, 8).transpose(1, 2)
    i = torch.arange(T)
    mask = (i[:, None] >= i[None]) & (i[:, None] - i[None] < window)
    if packed:
        mask = mask & (segments[:, :, None] == segments[:, None, :])
        mask = mask[:, None]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=8**-0.5, enable_gqa=True)
    ref = att.proj_final(ref.transpose(1, 2).reshape(B, T, -1))
    torch.testing.assert_close(att(x, ctx), ref)


@pytest.mark.parametrize("packed", [False, True])
def test_conv1d(gen, packed):
    conv = CausalConv1D(5, 4).double()
    with torch.no_grad():
        conv.b.copy_(rand(gen, 5))
    B, T = 3, 17
    x = rand(gen, B, T, 5)
    reset = random_resets(gen, B, T, 0.25) if packed else None
    expected = torch.zeros(B, T, 5, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            acc = conv.b.clone()
            for s in range(4):
                if t - s < 0:
                    break
                if packed and bool(reset[b, t - s + 1 : t + 1].any()):
                    break  # a document started after t - s
                acc = acc + conv.w[3 - s] * x[b, t - s]
            expected[b, t] = acc
    torch.testing.assert_close(conv(x, reset), expected)
    if not packed:
        ref = F.conv1d(x.transpose(1, 2), conv.w.T[:, None, :], conv.b, padding=3, groups=5)[..., :T].transpose(1, 2)
        torch.testing.assert_close(conv(x), ref)


def test_conv1d_with_state_continues_the_sequence(gen):
    conv = CausalConv1D(4, 4).double()
    x = rand(gen, 2, 11, 4)
    full = conv(x)
    torch.testing.assert_close(conv(x[:, 8:], state=x[:, 5:8]), full[:, 8:])
    torch.testing.assert_close(conv(x[:, 10:], state=x[:, 7:10]), full[:, 10:])


def test_block_diagonal_linear(gen):
    lin = BlockDiagonalLinear(12, 6, 3).double()
    x = rand(gen, 2, 5, 12)
    dense = torch.block_diag(*lin.w)  # (12, 6)
    torch.testing.assert_close(lin(x), x @ dense + lin.b.reshape(-1))


def test_a_init_range(gen):
    """a = exp(-softplus(Lambda)) has a^2 uniform on [0.9^2, 0.999^2] (Section 2.4, "uniform on a ring"), not a
    uniform on [0.9, 0.999]: a Kolmogorov-Smirnov statistic over 200,000 channels tells the two apart (their CDFs
    differ by up to 0.013; the statistic's 0.999 quantile is 1.95 / sqrt(n) = 0.0044)."""
    seed_torch(gen)
    n = 200_000
    lru = RGLRU(n, 20_000)  # gate blocks of 10 x 10: the decay parameter alone is large
    a = torch.exp(-F.softplus(lru.a_param.detach().double())).sort().values
    assert 0.9 - 1e-6 <= a.min() and a.max() <= 0.999 + 1e-6
    empirical = torch.arange(1, n + 1, dtype=torch.float64) / n

    def ks(cdf):
        return float(torch.maximum((empirical - cdf).abs(), (empirical - 1 / n - cdf).abs()).max())

    a2_uniform = ((a**2 - 0.81) / (0.999**2 - 0.81)).clamp(0, 1)
    a_uniform = ((a - 0.9) / 0.099).clamp(0, 1)
    assert ks(a2_uniform) < 1.95 / n**0.5
    assert ks(a_uniform) > 2 * 1.95 / n**0.5


def test_a_init_rule_of_the_paper(gen):
    """a_init_rule="paper": a^c (the decay at r_t = 1) uniform on [0.9, 0.999] (Section 2.4's text), for the RG-LRU
    and the CG-LRU, so -log a starts about c times smaller on average than on the ring (the released
    implementation, where a itself spans [0.9, 0.999])."""
    seed_torch(gen)
    n = 200_000
    lru = RGLRU(n, 20_000, c=8.0, a_init_rule="paper")
    ac = torch.exp(-8.0 * F.softplus(lru.a_param.detach().double())).sort().values
    assert 0.9 - 1e-6 <= ac.min() and ac.max() <= 0.999 + 1e-6
    empirical = torch.arange(1, n + 1, dtype=torch.float64) / n
    cdf = ((ac - 0.9) / 0.099).clamp(0, 1)
    assert float((empirical - cdf).abs().max()) < 1.95 / n**0.5 + 1 / n
    ring = RGLRU(n, 20_000, c=8.0)
    ratio = F.softplus(ring.a_param.detach().double()).mean() / F.softplus(lru.a_param.detach().double()).mean()
    assert 7.0 < ratio < 9.0  # about c = 8
    cg = CGLRU(8, 2, c=4.0, a_init_rule="paper")
    ac = torch.exp(-4.0 * F.softplus(cg.a_param.detach()))
    assert (ac >= 0.9 - 1e-6).all() and (ac <= 0.999 + 1e-6).all()


def lru_formula(lru: RGLRU, x, reset, h0=None):
    """Section 2.4 literally (tests.conftest.rg_lru_formula) with the layer's gates."""
    return rg_lru_formula(x, lru.input_gate(x), lru.a_gate(x), lru.a_param, lru.c, h0, reset)


@pytest.mark.parametrize("packed", [False, True])
def test_rg_lru(gen, packed):
    lru = RGLRU(12, 3).double()
    with torch.no_grad():
        lru.a_gate.b.copy_(rand(gen, 3, 4))
    B, T = 2, 19
    x = rand(gen, B, T, 12)
    reset = random_resets(gen, B, T, 0.2) if packed else None
    h0 = rand(gen, B, 12)
    y, h = lru(x, reset, h0)
    ey, eh = lru_formula(lru, x, reset if packed else None, h0)
    if not packed:  # h0 only matters without a reset at t = 0
        torch.testing.assert_close(y, ey)
        torch.testing.assert_close(h, eh)
    else:
        ey, eh = lru_formula(lru, x, reset)
        torch.testing.assert_close(y, ey)


def test_cg_lru(gen):
    lru = CGLRU(8, 2).double()
    B, T = 2, 11
    x = rand(gen, B, T, 8)
    y, _ = lru(x)
    r = torch.sigmoid(lru.a_gate(x))
    i = torch.sigmoid(lru.input_gate(x))
    modulus = torch.sigmoid(-lru.a_param)  # a~ = sigma(-Lambda) e^(i theta)
    xc = torch.complex(x[..., :4], x[..., 4:])
    h = torch.zeros(B, 4, dtype=torch.complex128)
    ys = []
    for t in range(T):
        a_t = modulus ** (lru.c * r[:, t]) * torch.exp(1j * lru.theta * lru.c * r[:, t])  # a~^(c r_t)
        h = a_t * h + torch.sqrt(1 - a_t.abs() ** 2) * (i[:, t] * xc[:, t])
        ys.append(torch.cat([h.real, h.imag], -1))
    torch.testing.assert_close(y, torch.stack(ys, 1))


def test_recurrent_block_composition(gen):
    cfg = ModelConfig(family="hawk", width=8, rnn_width=12, gate_blocks=3, depth=1)
    block = RecurrentBlock(cfg).double()
    x = rand(gen, 2, 7, 8)
    y_branch = F.gelu(block.linear_y(x), approximate="tanh")
    u = block.conv_1d(block.linear_x(x))
    u, _ = lru_formula(block.rg_lru, u, None)
    torch.testing.assert_close(block(x, Context(torch.arange(7).expand(2, 7))), block.linear_out(u * y_branch))


def test_gradcheck_layers(gen, monkeypatch):
    """float64 gradcheck of the document-aware Conv1D, the RG-LRU operator and chunked local attention."""
    from griffin.ops.rg_lru import rg_lru

    B, T, D = 2, 9, 3
    reset = random_resets(gen, B, T, 0.3)
    conv = CausalConv1D(D, 4).double()
    x = rand(gen, B, T, D).requires_grad_()
    assert torch.autograd.gradcheck(lambda u: conv(u, reset), (x,))
    gx, ga = rand(gen, B, T, D).requires_grad_(), rand(gen, B, T, D).requires_grad_()
    lam, h0 = rand(gen, D).requires_grad_(), rand(gen, B, D).requires_grad_()
    reset[1, 0] = False  # row 1 continues from h0
    assert torch.autograd.gradcheck(lambda *a: rg_lru(*a[:4], 8.0, a[4], reset), (x, gx, ga, lam, h0))

    cfg = ModelConfig(width=4, num_heads=2, head_dim=4, attention_window=3, depth=1, gate_blocks=2)
    att = MultiQueryAttention(cfg, local=True).double()
    monkeypatch.setattr("griffin.ops.attention.MIN_CHUNK", 4)  # several chunks at a small T
    xa = rand(gen, 1, 11, 4).requires_grad_()
    ctx = attention_context(torch.arange(xa.shape[1])[None], None, cfg, torch.float64)
    assert torch.autograd.gradcheck(lambda u: att(u, ctx), (xa,))


# Caches (Section 5): a layer fed its input in pieces through its cache equals the layer on the whole input -------
CACHE_DTYPES = [torch.float32, torch.bfloat16]
PIECES = [(0, 5), *((t, t + 1) for t in range(5, 11))]  # a prompt longer than the window (5), then single tokens


def tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 3e-2


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_block_diagonal_linear_any_leading_shape(gen, dtype):
    lin = BlockDiagonalLinear(12, 6, 3)
    dense = torch.block_diag(*lin.w.detach().double())
    for shape in [(12,), (5, 12), (3, 1, 12), (2, 4, 3, 12)]:
        x = rand(gen, *shape, dtype=torch.float64)
        y = lin.to(dtype)(x.to(dtype))
        assert y.shape == (*shape[:-1], 6) and y.dtype == dtype
        expected = x.to(dtype).double() @ dense.to(dtype).double() + lin.b.double().reshape(-1)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(y.double(), expected, atol=tol, rtol=tol)


def test_dense_gates_equal_each_block_diagonal_gate(gen):
    """One dense matmul with the gates' block-diagonal weights side by side: each gate's output and every gradient
    as the gates' own batched matmuls, in float64."""
    gates = [BlockDiagonalLinear(24, 24, 3).double() for _ in range(2)]
    for g in gates:
        torch.nn.init.normal_(g.b)
    x = rand(gen, 2, 7, 24).requires_grad_()
    dout = [rand(gen, 2, 7, 24) for _ in gates]
    params = [x, *(p for g in gates for p in g.parameters())]
    got = dense_gates(x, *gates)
    want = [g(x) for g in gates]
    grads = [torch.autograd.grad(sum((y * d).sum() for y, d in zip(ys, dout, strict=True)), params)
             for ys in (got, want)]
    for a, b in [*zip(got, want, strict=True), *zip(*grads, strict=True)]:
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("width, int8, dense", [(DENSE_GATES_MAX_WIDTH, False, True),
                                                (2 * DENSE_GATES_MAX_WIDTH, False, False),
                                                (DENSE_GATES_MAX_WIDTH, True, False)])
def test_compiled_cpu_rg_lru_computes_narrow_gates_densely(gen, monkeypatch, width, int8, dense):
    """In a compiled CPU step an RG-LRU up to DENSE_GATES_MAX_WIDTH wide takes its gates from dense_gates, a wider
    one, one with int8 gates (whose ``w`` is not the weights) and every eager call from the gates themselves; the
    compiled output and gradients are the eager ones."""
    import griffin.layers.rg_lru as module

    calls = []

    def spy(*args):
        calls.append(True)
        return dense_gates(*args)

    monkeypatch.setattr(module, "dense_gates", spy)
    lru = RGLRU(width, 8)
    if int8:
        lru.input_gate, lru.a_gate = map(Int8BlockDiagonalLinear.from_float, (lru.input_gate, lru.a_gate))
    x = rand(gen, 2, 9, width, dtype=torch.float32).requires_grad_()
    want = lru(x)[0]
    assert not calls
    want_grads = torch.autograd.grad(want.square().sum(), [x, *lru.parameters()])
    torch._dynamo.reset()
    got = torch.compile(lambda x: lru(x)[0], fullgraph=True)(x)
    got_grads = torch.autograd.grad(got.square().sum(), [x, *lru.parameters()])
    assert calls == ([True] if dense else [])
    for a, b in [(got, want), *zip(got_grads, want_grads, strict=True)]:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("lru_type", [RGLRU, CGLRU])
@torch.no_grad()
def test_lru_state_carries_over(gen, dtype, lru_type):
    """One token at a time through the state equals the whole sequence: in bfloat16 to about one rounding of the
    output (the single-token path computes a_t in float32 like the fused kernels; rounded to bfloat16, a_t near 1
    made 5% of random cases differ by up to 6%)."""
    seed_torch(gen)
    lru = lru_type(12, 3).to(dtype)
    lru.a_gate.b.copy_(rand(gen, 3, lru.a_gate.b.shape[1]))
    x = rand(gen, 4, 11, 12).to(dtype)
    start = torch.zeros(4, 11, dtype=torch.bool)
    start[:, 0] = True
    whole, h_whole = lru(x, start)
    h, outs = None, []
    for a, b in PIECES:
        y, h = lru(x[:, a:b], start[:, a:b] if a == 0 else None, h)
        outs.append(y)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(torch.cat(outs, 1), whole, atol=tol, rtol=tol)
    torch.testing.assert_close(h, h_whole, atol=tol, rtol=tol)


def attention_context(positions, segments, cfg, dtype, cache_len=None):
    from griffin.layers.rope import rope_angles

    cos, sin = rope_angles(positions, cfg.rope_dim, cfg.rope_base)
    return Context(positions, segments=segments, rope=(cos.to(dtype), sin.to(dtype)), cache_len=cache_len)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 2])
@torch.no_grad()
def test_attention_cache_carries_over(gen, dtype, local, kv_heads):
    """A prompt longer than the window, then one token at a time, through the block's KV cache (a ring buffer that
    wraps, or preallocated slots): the outputs of the whole sequence at once."""
    cfg = ModelConfig(width=16, num_heads=4, num_kv_heads=kv_heads, head_dim=6, rope_fraction=2 / 3,
                      attention_window=5, depth=1, family="griffin" if local else "mqa",
                      block_types=("local_attention" if local else "attention",))
    att = MultiQueryAttention(cfg, local=local).to(dtype)
    B, T = 3, 11
    x = rand(gen, B, T, 16).to(dtype)
    positions = torch.arange(T).expand(B, T)
    whole = att(x, attention_context(positions, None, cfg, dtype))
    cache = att.init_cache(B, T, dtype, "cpu")
    assert cache.k.shape == (B, 5 if local else T, kv_heads, 6)
    outs = []
    for a, b in PIECES:
        ctx = attention_context(positions[:, a:b], torch.zeros(B, b - a, dtype=torch.long), cfg, dtype, b)
        outs.append(att(x[:, a:b], ctx, cache))
    tol = tolerance(dtype)
    torch.testing.assert_close(torch.cat(outs, 1), whole, atol=tol, rtol=tol)
    assert cache.count.tolist() == [T] * B


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@torch.no_grad()
def test_recurrent_block_state_carries_over(gen, dtype):
    cfg = ModelConfig(family="hawk", width=8, rnn_width=12, gate_blocks=3, depth=1)
    block = RecurrentBlock(cfg).to(dtype)
    x = rand(gen, 3, 11, 8).to(dtype)
    positions = torch.arange(11).expand(3, 11)
    whole = block(x, Context(positions, reset=positions == 0))
    state = block.init_cache(3, None, dtype, "cpu")
    assert state.h.dtype == torch.float32 and state.conv.shape == (3, 3, 12)
    outs = [block(x[:, a:b], Context(positions[:, a:b], reset=positions[:, a:b] == 0 if a == 0 else None), state)
            for a, b in PIECES]
    tol = tolerance(dtype)
    torch.testing.assert_close(torch.cat(outs, 1), whole, atol=tol, rtol=tol)


@pytest.mark.skipif(not can_prepack(torch.zeros(1, 1)), reason="PyTorch without oneDNN")
@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_packed_linear(gen, dtype):
    layer = torch.nn.Linear(16, 24).to(dtype)
    if not can_prepack(layer.weight):
        pytest.skip(f"oneDNN has no {dtype} path on this CPU (bfloat16 needs AVX-512)")
    packed = PackedLinear(layer.weight, layer.bias, batch_size=5)
    assert packed.weight is layer.weight and "packed" not in packed.state_dict()
    x = rand(gen, 5, 16).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        torch.testing.assert_close(packed(x), layer(x), atol=tol, rtol=tol)
        torch.testing.assert_close(packed(x[:3]), layer(x[:3]), atol=tol, rtol=tol)  # another batch size
        layer.weight.add_(1.0)  # the packed copy does not follow: one packing per generation
        assert not torch.allclose(packed(x), layer(x), atol=tol, rtol=tol)


@pytest.mark.skipif(not can_prepack(torch.zeros(1, 1)), reason="PyTorch without oneDNN")
def test_packed_linear_is_an_opaque_op_under_compile(gen):
    """Under torch.compile the packed matmul runs as griffin::prepacked_linear (inductor cannot lower oneDNN's op):
    a compiled call traces it through its fake implementation, runs it, and equals the eager call."""
    layer = torch.nn.Linear(16, 24)
    packed = PackedLinear(layer.weight, layer.bias, batch_size=5)
    x = rand(gen, 5, 16).float()
    torch._dynamo.reset()
    compiled = torch.compile(packed, fullgraph=True)
    with torch.no_grad(), torch.profiler.profile() as prof:
        out = compiled(x)
    assert any(e.name == "griffin::prepacked_linear" for e in prof.events())
    with torch.no_grad():
        assert torch.equal(out, packed(x))
