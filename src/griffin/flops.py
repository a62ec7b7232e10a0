"""FLOP counts of MQA, Hawk and Griffin, and the peak FLOP/s they are measured against (Sections 2 and 3.3).

:func:`flops_per_token` counts the forward pass of :class:`griffin.model.CausalLM` per token, component by
component, for any :class:`~griffin.config.ModelConfig`. One multiply-add is 2 FLOPs. The components fall in
three groups:

* ``MATMUL_KEYS``, exact: every weight matrix applied to the token (dense linear layers, the block-diagonal RG-LRU
  gates, the tied output layer). Biases are elementwise adds and are counted with the elementwise terms.
* ``ATTENTION_KEYS``, exact for a causal sequence of ``seq_len`` tokens: Q·K^T and P·V over the (query, key) pairs
  that attention may see, averaged over the positions: a global-attention query at position t sees t + 1 keys, a
  local one min(t + 1, window). This is the useful work; a kernel that computes the full T×T (or chunk × span)
  score matrix and masks it executes more (``torch.utils.flop_counter`` counts that executed work).
* ``ELEMENTWISE_KEYS``, approximate: norms, residual adds, biases, GeLU, the Conv1D, the RG-LRU gate nonlinearities
  and recurrence, RoPE and softmax. Each arithmetic operation or transcendental function (exp, tanh, sigmoid,
  softplus, sqrt) counts as one FLOP per element, per-channel constants (softplus(Λ), 1 + scale) are free. These
  are a few percent of the total at the paper's sizes.

The paper's argument (Section 3.3) in these terms: linear layers cost O(T·D²) per sequence (a constant per token),
the RG-LRU O(T·D), global attention O(T²·D) (per token: grows linearly in T) and local attention O(T·window·D)
(per token: saturates at the window).
"""

from __future__ import annotations

import functools
import platform
import re
import time

import torch

from griffin.config import ModelConfig

MATMUL_KEYS = ("mlp", "recurrent_linear", "rg_lru_gates", "attention_linear", "lm_head")
ATTENTION_KEYS = ("global_attention", "local_attention")
ELEMENTWISE_KEYS = ("embedding", "norms", "residual", "mlp_elementwise", "recurrent_elementwise", "conv1d", "rg_lru",
                    "attention_elementwise", "logits_elementwise")
COMPONENTS = MATMUL_KEYS + ATTENTION_KEYS + ELEMENTWISE_KEYS

# Approximate FLOPs per element of the elementwise operations (one per arithmetic op or transcendental).
RMSNORM_FLOPS = 4  # square, sum, multiply by rsqrt, multiply by (1 + scale)
GELU_FLOPS = {"tanh": 9, "none": 5}  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); 0.5 x (1 + erf(x / sqrt 2))
RG_LRU_FLOPS = 15  # 2 gate biases, 2 sigmoids, -c r sp (2), exp, exp(2 .) (2), 1 - ., sqrt, x i m (2), a h + b (2)
CG_LRU_EXTRA_FLOPS = 12  # per complex channel: angle c r theta (2), polar (4), complex a h costs 6 more than real
SOFTMAX_FLOPS = 5  # per score: scale, subtract max, exp, sum, divide
ROPE_FLOPS = 3  # per rotated dimension: x1 cos - x2 sin and x2 cos + x1 sin is 6 FLOPs per pair


def mean_keys_seen(seq_len: int, window: int | None = None) -> float:
    """Keys a query sees, averaged over the T positions of a causal sequence: (T + 1) / 2 for global attention,
    the mean of min(t + 1, window) for local attention."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be positive")
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def flops_per_token(config: ModelConfig, seq_len: int) -> dict[str, float]:
    """Forward-pass FLOPs per token of ``CausalLM(config)`` on causal sequences of ``seq_len`` tokens, by component.

    The keys are ``COMPONENTS`` (see the module docstring for which are exact and which approximate) and
    ``"total"``, their sum. The embedding lookup costs nothing (the optional sqrt(D) scale is D multiplies).
    """
    D, V, F, R = config.width, config.vocab_size, config.mlp_width, config.rnn_width
    H, Hk, d = config.num_heads, config.num_kv_heads, config.head_dim
    lru, K, blocks = config.lru_width, config.conv1d_width, config.gate_blocks
    gelu = GELU_FLOPS[config.gelu_approximation]
    out = dict.fromkeys(COMPONENTS, 0.0)

    out["embedding"] = float(D) if config.embed_scale else 0.0
    for kind in config.block_types:  # Section 2.1: x + temporal(RMSNorm(x)), then + MLP(RMSNorm(.))
        out["norms"] += 2 * RMSNORM_FLOPS * D
        out["residual"] += 2 * D
        # Section 2.2: gated MLP, two D -> F branches, GeLU on one, product, F -> D (all with biases).
        out["mlp"] += 2 * 3 * D * F
        out["mlp_elementwise"] += (2 * F + D) + gelu * F + F
        if kind == "recurrent":  # Section 2.3, Figure 2c
            out["recurrent_linear"] += 2 * 3 * D * R  # linear_y, linear_x (D -> R), linear_out (R -> D)
            out["recurrent_elementwise"] += (2 * R + D) + gelu * R + R  # biases, GeLU branch, product
            out["conv1d"] += 2 * K * R  # K multiplies, K - 1 adds, the bias
            # Section 2.4: W_a and W_x are block-diagonal, R -> lru in `blocks` blocks each.
            out["rg_lru_gates"] += 2 * 2 * R * lru / blocks
            out["rg_lru"] += RG_LRU_FLOPS * lru + (CG_LRU_EXTRA_FLOPS * lru if config.complex_lru else 0)
        else:  # Section 2.3: (local) MQA with RoPE
            out["attention_linear"] += 2 * D * H * d + 2 * 2 * D * Hk * d + 2 * H * d * D  # q; k, v; output
            local = kind == "local_attention"
            keys = mean_keys_seen(seq_len, config.attention_window if local else None)
            out["local_attention" if local else "global_attention"] += 2 * 2 * H * d * keys  # Q K^T and P V
            out["attention_elementwise"] += (ROPE_FLOPS * config.rope_dim * (H + Hk) + SOFTMAX_FLOPS * H * keys
                                             + D)  # RoPE on q and k, softmax, the output bias
    out["norms"] += RMSNORM_FLOPS * D  # final norm
    out["lm_head"] = 2.0 * D * V
    out["logits_elementwise"] = 3.0 * V if config.logits_soft_cap else 0.0
    out = {k: float(v) for k, v in out.items()}
    out["total"] = sum(out.values())
    return out


def matmul_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """The exact part of :func:`flops_per_token`: weight matmuls plus causal attention (``MATMUL_KEYS`` and
    ``ATTENTION_KEYS``), the "model FLOPs" of PaLM's MFU (Chowdhery et al., 2022, Appendix B)."""
    counts = flops_per_token(config, seq_len)
    return sum(counts[k] for k in MATMUL_KEYS + ATTENTION_KEYS)


def training_flops_per_token(config: ModelConfig, seq_len: int, *, include_elementwise: bool = True) -> float:
    """FLOPs of one training step per token, by the usual convention: 3 x forward (the backward pass costs about
    twice the forward: one matmul for the input gradient and one for the weight gradient per forward matmul). The
    optimizer step and the loss are not counted. ``include_elementwise=False`` counts matmuls and attention only."""
    if include_elementwise:
        return 3.0 * flops_per_token(config, seq_len)["total"]
    return 3.0 * matmul_flops_per_token(config, seq_len)


def model_flops_utilization(config: ModelConfig, seq_len: int, tokens_per_second: float, peak_flops: float,
                            *, include_elementwise: bool = False) -> float:
    """Model FLOPs utilization (MFU) of training: training FLOPs per token x tokens/s over the peak FLOP/s.

    By default only matmuls and causal attention count (PaLM's definition): elementwise work does not run on the
    matrix units, and its count here is approximate.
    """
    if peak_flops <= 0:
        raise ValueError(f"peak_flops={peak_flops} must be positive")
    flops = training_flops_per_token(config, seq_len, include_elementwise=include_elementwise)
    return flops * tokens_per_second / peak_flops


# Peak FLOP/s -------------------------------------------------------------------------------------------------
# Dense (no 2:4 sparsity) peaks from NVIDIA's data sheets, TFLOP/s: (bf16/fp16 tensor core with fp32 accumulate,
# tf32 tensor core, fp32 without tensor cores). Matched against torch.cuda.get_device_name in order.
GPU_PEAK_TFLOPS: tuple[tuple[str, str, tuple[float, float, float]], ...] = (
    (r"\bH100\b.*\bPCIe\b", "NVIDIA H100 PCIe", (756.0, 378.0, 51.2)),
    (r"\bH100\b.*\bNVL\b", "NVIDIA H100 NVL", (835.0, 417.5, 60.0)),
    (r"\bH200\b.*\bNVL\b", "NVIDIA H200 NVL", (835.0, 417.5, 60.0)),
    (r"\bG?H100\b", "NVIDIA H100 SXM", (989.4, 494.7, 66.9)),
    (r"\bG?H200\b", "NVIDIA H200", (989.4, 494.7, 66.9)),
    (r"\bA100\b", "NVIDIA A100", (312.0, 156.0, 19.5)),
    (r"\bL40S\b", "NVIDIA L40S", (362.0, 183.0, 91.6)),
    (r"\bL4\b", "NVIDIA L4", (121.0, 60.0, 30.3)),
    (r"\bA10\b", "NVIDIA A10", (125.0, 62.5, 31.2)),
    (r"\bRTX 4090\b", "NVIDIA GeForce RTX 4090", (165.2, 82.6, 82.6)),
    (r"\bRTX 3090\b", "NVIDIA GeForce RTX 3090", (71.0, 35.6, 35.6)),
)


def table_peak(name: str, dtype: torch.dtype, tf32: bool) -> tuple[float, str] | None:
    """The dense peak FLOP/s of a known GPU (by its CUDA device name) in ``dtype``, or None if unknown."""
    for pattern, label, (half, tf32_peak, fp32) in GPU_PEAK_TFLOPS:
        if re.search(pattern, name):
            if dtype in (torch.bfloat16, torch.float16):
                return half * 1e12, f"table: {label} {_dtype_name(dtype)} dense"
            if dtype == torch.float32:
                return (tf32_peak * 1e12, f"table: {label} tf32 dense") if tf32 else \
                    (fp32 * 1e12, f"table: {label} fp32 (no tensor cores)")
            return None
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}.get(
        dtype, str(dtype).removeprefix("torch."))


@functools.cache
def _measured_peak(device: str, dtype: torch.dtype, size: int, budget_s: float) -> float:
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(size, size, device=dev, generator=gen).to(dtype)
    b = torch.randn(size, size, device=dev, generator=gen).to(dtype)

    def once() -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        torch.mm(a, b)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - start

    once()  # warm-up: threads, allocator, kernel selection
    deadline = time.perf_counter() + budget_s
    best = once()
    while time.perf_counter() < deadline:
        best = min(best, once())
    return 2.0 * size**3 / best


def cpu_name() -> str:
    """The CPU's model name (as ``lscpu`` prints it), for the machine line of a measurement."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_isa_peak(dtype: torch.dtype, threads: int, cpuinfo: str | None = None) -> tuple[float, str] | None:
    """An upper bound of a CPU's FLOP/s from ``/proc/cpuinfo`` (Linux; None elsewhere): ``threads`` × the highest
    listed clock × the FLOPs one core can issue per cycle given its vector ISA (AVX-512: 64 fp32, AVX2 + FMA: 32, AVX:
    16, else 8; twice that in bf16 with AVX-512 BF16 or AMX). A data-sheet-style peak: no load on the machine can
    lower it, so utilization against it never reads above 100% (cores that split 512-bit work or run below that clock
    make it an overestimate)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    clocks = [float(m) for m in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", cpuinfo, re.M)]
    flags_line = re.search(r"^flags\s*:(.*)$", cpuinfo, re.M)
    if not clocks or flags_line is None or threads < 1:
        return None
    flags = set(flags_line.group(1).split())
    isa, per_cycle = next((name, n) for name, n, need in (
        ("AVX-512", 64, {"avx512f"}), ("AVX2+FMA", 32, {"avx2", "fma"}), ("AVX", 16, {"avx"}), ("SSE", 8, set()))
        if need <= flags)
    if dtype == torch.bfloat16 and flags & {"avx512_bf16", "amx_bf16"}:
        per_cycle, isa = 2 * per_cycle, isa + " BF16"
    ghz = max(clocks) / 1e3
    rate = threads * ghz * 1e9 * per_cycle
    return rate, f"ISA peak: {threads} threads x {ghz:.2f} GHz x {per_cycle} {_dtype_name(dtype)} FLOP/cycle ({isa})"


def peak_flops(device: torch.device | str, dtype: torch.dtype, *, budget_s: float = 0.25,
               refresh: bool = False) -> tuple[float, str]:
    """The peak FLOP/s to measure utilization against, and where it comes from.

    Known NVIDIA GPUs: the data sheet's dense peak (``"table: NVIDIA H100 SXM bf16 dense"``; float32 counts as tf32
    when PyTorch lets matmuls use it). CPUs: the larger of :func:`cpu_isa_peak` (for torch's threads) and the best
    rate of repeated 1024^3 matmuls, so that a machine busy with other work while it is measured cannot make the
    peak low and utilization read above 100%. Unknown GPUs: the best rate of repeated 4096^3 matmuls in ``dtype`` for
    about ``budget_s`` seconds after a warm-up (``"measured: 4096^3 bf16 matmul"``), an achievable rate rather than a
    data-sheet peak. Measurements are cached per device and dtype unless ``refresh``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        tf32 = torch.get_float32_matmul_precision() != "highest"
        known = table_peak(torch.cuda.get_device_name(device), dtype, tf32)
        if known is not None:
            return known
    size = 1024 if device.type == "cpu" else 4096
    if refresh:
        _measured_peak.cache_clear()
    rate = _measured_peak(str(device), dtype, size, budget_s)
    measured = rate, f"measured: {size}^3 {_dtype_name(dtype)} matmul"
    isa = cpu_isa_peak(dtype, torch.get_num_threads()) if device.type == "cpu" else None
    return isa if isa is not None and isa[0] > rate else measured


__all__ = [
    "ATTENTION_KEYS", "COMPONENTS", "ELEMENTWISE_KEYS", "MATMUL_KEYS", "cpu_isa_peak", "cpu_name", "flops_per_token",
    "matmul_flops_per_token", "mean_keys_seen", "model_flops_utilization", "peak_flops", "training_flops_per_token",
]
