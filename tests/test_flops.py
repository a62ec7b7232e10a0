"""griffin.flops against torch.utils.flop_counter on real forward passes, and its scaling in T (Section 3.3)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import griffin.layers.attention as attention_layer
import griffin.ops.attention as attention_ops
from griffin import CausalLM, ModelConfig
from griffin.flops import (
    ATTENTION_KEYS,
    COMPONENTS,
    ELEMENTWISE_KEYS,
    MATMUL_KEYS,
    cpu_isa_peak,
    flops_per_token,
    matmul_flops_per_token,
    mean_keys_seen,
    model_flops_utilization,
    peak_flops,
    table_peak,
    training_flops_per_token,
)
from griffin.model import count_parameters
from tests.conftest import seed_torch

aten = torch.ops.aten

CONFIGS = {
    **{f"{family}-tiny": ModelConfig.from_preset(f"{family}-tiny") for family in ("mqa", "hawk", "griffin")},
    **{f"{family}-synthetic": ModelConfig.from_preset(f"{family}-synthetic") for family in ("mqa", "griffin")},
    # grouped-query attention, untied output layer, soft-cap, embedding scale, the complex CG-LRU
    "griffin-gqa-untied-complex": ModelConfig.from_preset(
        "griffin-tiny", num_heads=4, num_kv_heads=2, head_dim=4, tie_embeddings=False, logits_soft_cap=30.0,
        embed_scale=True, complex_lru=True, depth=6, block_types=None),
}


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def count_forward(model: CausalLM, ids: torch.Tensor, monkeypatch) -> tuple[int, int, float]:
    """FlopCounterMode's count of one forward pass (matmuls, bmm, SDPA), the attention FLOPs the SDPA calls
    execute (every score they compute, masked or not) and the useful ones (4 d per visible (query, key) pair)."""
    executed, useful = [0], [0.0]

    def record_executed(q, k):
        executed[0] += 4 * q.shape[-1] * math.prod(q.shape[:-1]) * k.shape[-2]

    causal_attention, ops_sdpa = attention_layer.causal_attention, attention_ops.fused_sdpa
    local_attention = attention_layer.sliding_window_attention

    def recording_causal_attention(q, k, v, scale=None, q_seg=None, k_seg=None, window=None):  # global: (N, H, T, d)
        assert window is None  # eager local attention goes through the sliding-window kernel
        tq = q.shape[-2]
        if q_seg is None:
            pairs = math.prod(q.shape[:-2]) * tq * (tq + 1) / 2
        else:
            idx = torch.arange(tq)
            seen = (idx[:, None] >= idx[None, :]) & (q_seg[:, :, None] == k_seg[:, None, :])
            pairs = q.shape[1] * seen.sum().item()
        useful[0] += 4 * q.shape[-1] * pairs
        return causal_attention(q, k, v, scale, q_seg, k_seg, window=window)

    def recording_ops_sdpa(q, k, v, mask=None, scale=None, causal=False):  # the fused kernel, global or in chunks
        record_executed(q, k)
        return ops_sdpa(q, k, v, mask, scale, causal)

    def recording_local_attention(q, k, v, window, scale=None, q_seg=None, k_seg=None):  # (B, T, H, d)
        T = q.shape[1]
        delta = torch.arange(T)[:, None] - torch.arange(T)[None, :]
        useful[0] += 4 * q.shape[-1] * q.shape[0] * q.shape[2] * ((delta >= 0) & (delta < window)).sum().item()
        return local_attention(q, k, v, window, scale, q_seg, k_seg)

    monkeypatch.setattr(attention_layer, "causal_attention", recording_causal_attention)
    monkeypatch.setattr(attention_ops, "fused_sdpa", recording_ops_sdpa)
    monkeypatch.setattr(attention_layer, "sliding_window_attention", recording_local_attention)
    # SDPA on CPU runs as _scaled_dot_product_flash_attention_for_cpu, which FlopCounterMode does not know.
    counter = FlopCounterMode(display=False,
                              custom_mapping={aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop})
    with counter, torch.no_grad():
        model(ids)
    return counter.get_total_flops(), executed[0], useful[0]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seq_len", [5, 64, 300])
def test_matmuls_and_attention_match_flop_counter(gen, name, seq_len, monkeypatch):
    """Weight matmuls exactly as FlopCounterMode counts them; attention exactly as the masks let queries see."""
    monkeypatch.setenv("GRIFFIN_RG_LRU_BACKEND", "ref")  # plain PyTorch ops (FlopCounterMode ignores them anyway)
    config = CONFIGS[name]
    seed_torch(gen)
    model = CausalLM(config)
    batch = 2
    ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    counted, executed_attention, useful_attention = count_forward(model, ids, monkeypatch)

    ours = flops_per_token(config, seq_len)
    tokens = batch * seq_len
    matmuls = tokens * sum(ours[k] for k in MATMUL_KEYS)
    assert counted == pytest.approx(matmuls + executed_attention, rel=1e-12, abs=0.5)
    assert tokens * sum(ours[k] for k in ATTENTION_KEYS) == pytest.approx(useful_attention, rel=1e-12, abs=0.5)
    # Kernels compute the whole (chunk of the) score matrix: never less than the useful work.
    assert executed_attention >= useful_attention
    if "attention" not in config.block_types and "local_attention" not in config.block_types:
        assert executed_attention == 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_breakdown_is_complete(name):
    config = CONFIGS[name]
    ours = flops_per_token(config, 100)
    assert set(ours) == set(COMPONENTS) | {"total"}
    assert len(COMPONENTS) == len(set(COMPONENTS))
    assert ours["total"] == pytest.approx(sum(ours[k] for k in COMPONENTS))
    assert all(v >= 0 for v in ours.values())
    assert matmul_flops_per_token(config, 100) == pytest.approx(
        ours["total"] - sum(ours[k] for k in ELEMENTWISE_KEYS))
    assert (ours["rg_lru_gates"] > 0) == ("recurrent" in config.block_types)
    assert ours["embedding"] == (config.width if config.embed_scale else 0)


def test_global_attention_grows_linearly_and_local_saturates():
    """Section 3.3: per token, global attention costs O(T D), local attention O(window D), linear layers O(D^2)."""
    W = 512
    mqa = ModelConfig.from_preset("mqa-400m", attention_window=W)
    griffin = ModelConfig.from_preset("griffin-400m", attention_window=W)
    H, d = mqa.num_heads, mqa.head_dim
    n_global, n_local = mqa.depth, griffin.block_types.count("local_attention")
    for T in (1, 2, 100, W, 4 * W, 16 * W):
        assert flops_per_token(mqa, T)["global_attention"] == pytest.approx(n_global * 2 * H * d * (T + 1))
        local = flops_per_token(griffin, T)["local_attention"]
        assert local <= n_local * 4 * H * d * W
        if T <= W:
            assert local == pytest.approx(n_local * 2 * H * d * (T + 1))  # the window is not reached yet
        assert flops_per_token(griffin, T)["global_attention"] == 0
    g = [flops_per_token(mqa, T)["global_attention"] for T in (2048, 4096, 8192)]
    assert g[1] / g[0] == pytest.approx(2, rel=1e-3) and g[2] / g[1] == pytest.approx(2, rel=1e-3)
    lo = [flops_per_token(griffin, T)["local_attention"] for T in (4 * W, 8 * W, 16 * W)]
    assert lo[0] < lo[1] < lo[2] < 1.12 * lo[0]  # mean keys: W (1 - (W - 1) / 2T) -> W
    assert lo[2] == pytest.approx(n_local * 4 * H * d * W, rel=0.04)
    # The linear layers do not depend on T.
    for config in (mqa, griffin):
        assert [sum(flops_per_token(config, T)[k] for k in MATMUL_KEYS) for T in (10, 10_000)] == pytest.approx(
            [sum(flops_per_token(config, 10)[k] for k in MATMUL_KEYS)] * 2)


def test_mean_keys_seen_matches_brute_force():
    for T in (1, 7, 50):
        for W in (None, 1, 3, 7, 60):
            brute = sum(t + 1 if W is None else min(t + 1, W) for t in range(T)) / T
            assert mean_keys_seen(T, W) == pytest.approx(brute)
    with pytest.raises(ValueError):
        mean_keys_seen(0)


@pytest.mark.parametrize("family", ["hawk", "griffin", "mqa"])
def test_paper_scale_is_about_6n(family):
    """At 1.3B and T=2048, training FLOPs per token are the usual 6 N (weights) plus a little attention."""
    config = ModelConfig.from_preset(f"{family}-1.3b")
    n = count_parameters(config)
    ratio = training_flops_per_token(config, 2048) / (6 * n)
    assert 0.95 < ratio < 1.15, ratio
    ours = flops_per_token(config, 2048)
    elementwise = sum(ours[k] for k in ELEMENTWISE_KEYS)
    assert elementwise < 0.01 * ours["total"]  # approximate, and small
    assert training_flops_per_token(config, 2048) == pytest.approx(3 * ours["total"])
    assert training_flops_per_token(config, 2048, include_elementwise=False) == pytest.approx(
        3 * (ours["total"] - elementwise))


def test_model_flops_utilization():
    config = ModelConfig.from_preset("griffin-tiny")
    per_token = training_flops_per_token(config, 64, include_elementwise=False)
    assert model_flops_utilization(config, 64, 1000.0, 2 * per_token * 1000.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        model_flops_utilization(config, 64, 1000.0, 0.0)


def test_peak_flops_on_cpu_cannot_read_below_a_measured_matmul():
    from griffin.flops import _measured_peak

    rate, source = peak_flops("cpu", torch.float32)
    measured = _measured_peak("cpu", torch.float32, 1024, 0.25)  # the cached measurement peak_flops made
    assert rate >= measured > 1e8
    assert source.startswith("ISA peak: ") or source == "measured: 1024^3 fp32 matmul"
    assert peak_flops(torch.device("cpu"), torch.float32) == (rate, source)  # cached


def test_cpu_isa_peak_from_cpuinfo():
    info = "processor\t: 0\ncpu MHz\t\t: 2596.130\nflags\t\t: fpu sse2 avx fma avx2 avx512f avx512_bf16\n"
    rate, source = cpu_isa_peak(torch.float32, 2, info)
    assert rate == pytest.approx(2 * 2.59613e9 * 64)
    assert source == "ISA peak: 2 threads x 2.60 GHz x 64 fp32 FLOP/cycle (AVX-512)"
    assert cpu_isa_peak(torch.bfloat16, 1, info)[0] == pytest.approx(2.59613e9 * 128)
    avx2 = info.replace(" avx512f avx512_bf16", "")
    assert cpu_isa_peak(torch.float32, 4, avx2)[0] == pytest.approx(4 * 2.59613e9 * 32)
    assert cpu_isa_peak(torch.bfloat16, 4, avx2)[0] == pytest.approx(4 * 2.59613e9 * 32)  # no bf16 units
    assert cpu_isa_peak(torch.float32, 2, "processor\t: 0\n") is None  # no clock listed: measured instead


def test_gpu_table():
    assert table_peak("NVIDIA H100 80GB HBM3", torch.bfloat16, True) == (989.4e12, "table: NVIDIA H100 SXM bf16 dense")
    assert table_peak("NVIDIA H100 PCIe", torch.float16, True)[0] == 756e12
    assert table_peak("NVIDIA H200", torch.float32, True) == (494.7e12, "table: NVIDIA H200 tf32 dense")
    assert table_peak("NVIDIA H200", torch.float32, False)[0] == pytest.approx(66.9e12)
    assert table_peak("NVIDIA A100-SXM4-80GB", torch.bfloat16, True)[0] == 312e12
    assert table_peak("NVIDIA A10", torch.bfloat16, True)[0] == 125e12
    assert table_peak("NVIDIA L4", torch.bfloat16, True)[0] == 121e12
    assert table_peak("NVIDIA GeForce RTX 4090", torch.bfloat16, True)[0] == pytest.approx(165.2e12)
    assert table_peak("NVIDIA A10G", torch.bfloat16, True) is None  # not the A10: measured instead
    assert table_peak("NVIDIA H100 80GB HBM3", torch.float64, True) is None
