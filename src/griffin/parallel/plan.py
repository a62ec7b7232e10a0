"""The cluster planner (``griffin plan``): for a model on N GPUs of a kind, the bytes each device holds, the
communication of tensor parallelism, FSDP and context parallelism per step, and a step-time and MFU estimate for
every layout ``dp_replicate × dp_shard × tp`` (with or without activation checkpointing and sequence parallelism, at
the fastest micro-batch that fits; with a given ``cp``, each sequence split over cp devices); it names the layouts
that fit and the fastest (Section 4.1).

Memory per device, bytes (the model's own accounting, as :mod:`griffin.parallel` lays it out):

- parameters, gradients and AdamW's two moments, float32, each this device's share: every parameter's
  tensor-parallel shard (:func:`~griffin.parallel.tensor_parallel.parameter_shard_dims`) split again by FSDP along
  its first dimension over dp_shard (rounded up, as FSDP pads) — exact, checked against the tensors the ranks hold
  (tests/parallel, benchmarks/distributed_cpu.py); on the CPU with ``cpu_offload``;
- gathered: FSDP's unsharded copies in the compute dtype of two residual blocks (the running one and the
  prefetched one) and of the root (embedding, final norm), and one block's gradients in float32 before their
  reduce-scatter;
- activations: what autograd keeps per token of each residual block (:func:`activation_bytes_per_token`,
  counted tensor by tensor from the implementation and checked against the saved tensors of a forward pass on CPU),
  divided by tp where tensor parallelism splits the tensor and, with sequence parallelism, the norms too; with
  activation checkpointing only each block's input stays, plus one block recomputed; plus the loss's logits,
  ``loss_chunk`` rows of V/tp at a time. Under context parallelism each device holds seq_len / cp tokens of each
  sequence (activations ÷ cp), plus what the shard boundaries add (:func:`context_parallel_bytes`): the Conv1D
  halo and the RG-LRU carries, local attention's (window - 1) earlier keys and values, and for global attention the
  gathered keys and values of the whole sequence; FSDP then shards over dp_shard × cp;
- a reserve for the CUDA context, NCCL buffers and fragmentation (``RESERVE_BYTES``).

Time per step, seconds: matmul FLOPs (:func:`griffin.flops.training_flops_per_token`, split over tp; one more
forward pass with activation checkpointing) at ``MATMUL_EFFICIENCY`` of the data sheet's dense bf16 peak; the
elementwise work and the scan as memory-bound (each activation byte written once and read twice at HBM bandwidth);
tensor parallelism's all-reduces on the critical path (NVLink inside a node, the network across); FSDP's gathers and
reduce-scatters overlapped with compute, only their excess exposed; context parallelism's all-gathers (forward) and
all-reduces (backward) of carries, halos and keys on the critical path. These are modelling assumptions, not
measurements: GPU runs of these layouts are not part of this repository's measured results (docs/distributed.md).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

import torch

from griffin.config import ModelConfig
from griffin.flops import training_flops_per_token
from griffin.model import CausalLM
from griffin.ops.attention import local_chunk
from griffin.parallel.context_parallel import check_context_parallel
from griffin.parallel.mesh import ParallelDims
from griffin.parallel.tensor_parallel import check_tensor_parallel, parameter_shard_dims

GB = 1e9
GIB = 1 << 30
RESERVE_BYTES = 4 * GIB  # CUDA context, NCCL buffers, allocator fragmentation
MATMUL_EFFICIENCY = 0.6  # fraction of the dense bf16 peak that large training matmuls reach (assumed)
LATENCY_S = {"nvlink": 10e-6, "network": 30e-6}  # per collective


@dataclass(frozen=True)
class GPU:
    """A GPU kind: dense bf16 FLOP/s, HBM bytes and bytes/s, NVLink and network bytes/s per GPU and direction."""

    name: str
    flops: float
    memory: float
    hbm_bandwidth: float
    nvlink: float
    network: float
    per_node: int = 8


# NVIDIA data sheets (SXM modules, dense bf16); DGX-style nodes of 8 with one 400 Gb/s (A100: 200 Gb/s) NIC per GPU.
GPUS = {
    "h100": GPU("NVIDIA H100 SXM 80GB", 989.4e12, 80 * GB, 3.35e12, 450 * GB, 50 * GB),
    "h200": GPU("NVIDIA H200 SXM 141GB", 989.4e12, 141 * GB, 4.8e12, 450 * GB, 50 * GB),
    "a100": GPU("NVIDIA A100 SXM 80GB", 312e12, 80 * GB, 2.039e12, 300 * GB, 25 * GB),
}


@dataclass(frozen=True)
class Layout:
    """A way to run: the mesh sizes, sequences per device per micro-step, and the per-block options."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    micro_batch: int = 1
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    cpu_offload: bool = False
    cp: int = 1

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(self.dp_replicate, self.dp_shard, self.tp, self.cp)

    def __str__(self) -> str:
        flags = "".join(f" +{n}" for n, on in (("ac", self.activation_checkpointing), ("sp", self.sequence_parallel),
                                                ("offload", self.cpu_offload)) if on)
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        return f"{self.dp_replicate}x{self.dp_shard}x{self.tp}{cp} mb{self.micro_batch}{flags}"


@dataclass
class Estimate:
    """The planner's numbers for one layout (bytes per device, bytes sent per device per step, seconds)."""

    layout: Layout
    memory: dict[str, float]
    communication: dict[str, float]
    time: dict[str, float]
    tokens_per_s: float
    mfu: float
    fits: bool
    grad_accum: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["layout"] = {**asdict(self.layout), "name": str(self.layout)}
        return out


# Memory ------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _meta_model(config: ModelConfig) -> CausalLM:
    with torch.device("meta"):
        return CausalLM(config)


@functools.lru_cache(maxsize=64)
def _tp_shapes(config: ModelConfig, tp: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    model = _meta_model(config)
    dims = parameter_shard_dims(config, tp, model=model)
    out = []
    for name, p in model.named_parameters():
        shape = list(p.shape)
        if dims[name] is not None:
            shape[dims[name]] //= tp
        out.append((name, tuple(shape)))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def parameter_shards(config: ModelConfig, tp: int, dp_shard: int) -> dict[str, dict[str, int | str]]:
    """Elements of each parameter on one device: ``tp_local`` after tensor parallelism, ``shard`` after FSDP's split
    of the first dimension over dp_shard (padded up); keyed by parameter name, with its ``group`` (``blocks.i`` or
    ``root``: FSDP's units). Cached: do not modify the result."""
    out: dict[str, dict[str, int | str]] = {}
    for name, shape in _tp_shapes(config, tp):
        local = math.prod(shape)
        first = shape[0] if shape else 1
        shard = math.ceil(first / dp_shard) * (local // first) if dp_shard > 1 else local
        group = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"
        out[name] = {"tp_local": local, "shard": shard, "group": group}
    return out


def activation_bytes_per_token(config: ModelConfig, kind: str, seq_len: int, compute_bytes: int = 2, tp: int = 1,
                               sequence_parallel: bool = False) -> float:
    """Bytes autograd keeps per token for one residual block of ``kind`` (``recurrent``, ``attention``,
    ``local_attention``) on one of tp devices, the matmuls in ``compute_bytes`` (2: bf16, 4: float32), the norms
    in float32; counted from the implementation (per token, D = width, R = D_RNN, F = MLP width):

    - the two RMSNorms: their float32 inputs and normalised outputs (4 · 4D, less the block's input itself when
      computing in float32; sequence parallelism splits them over tp) and their outputs in the compute dtype
      (2 · D), which the linear layers keep; 8 bytes of rsqrt;
    - gated MLP: both branches, the GeLU and the product, 4F / tp in the compute dtype;
    - recurrent block: 8 tensors of R / tp (branches, Conv1D input and output, gates, RG-LRU output) in the
      compute dtype, and the float32 RG-LRU output when computing in bf16;
    - attention: the output (H · head_dim / tp), the RoPE angles, and what the attention kernel keeps: for global
      attention (and local attention over no more than one chunk of queries) the queries and output
      (2 · H · head_dim / tp), keys and values (2 · H_kv · head_dim, / tp when split), the mask of the packed
      documents (one element per key of the sequence) and the softmax statistics (float32, one per query head);
      for local attention in chunks of C queries (:func:`griffin.ops.attention.local_chunk`), the same per chunk
      with the C + window - 1 keys that reach it, the sequence padded to whole chunks.
    """
    D, R, F = config.width, config.rnn_width, config.mlp_width
    b = compute_bytes
    norms = (4 * 4 * D - (4 * D if b >= 4 else 0)) / (tp if sequence_parallel else 1) + 2 * D * b + 8
    total = norms + 4 * F * b / tp
    if kind == "recurrent":
        total += 8 * R * b / tp + (4 * R / tp if b < 4 else 0)
    else:
        heads = config.num_heads * config.head_dim * b / tp  # bytes of one query-sized tensor
        kv = config.num_kv_heads * config.head_dim * b / (tp if config.num_kv_heads % tp == 0 else 1)
        stats = 4 * config.num_heads / tp
        total += heads + config.rope_dim * b
        chunk = local_chunk(config.attention_window)
        if kind == "local_attention" and config.attention_window < seq_len and chunk < seq_len:
            span = chunk + config.attention_window - 1
            padding = math.ceil(seq_len / chunk) * chunk / seq_len
            total += padding * (2 * heads + 2 * kv * span / chunk + span * b + stats)
        else:
            total += heads + 2 * kv + seq_len * b + stats
    return total


def context_parallel_bytes(config: ModelConfig, seq_len: int, cp: int, compute_bytes: int = 2,
                           tp: int = 1) -> float:
    """Bytes per sequence that autograd keeps on one of cp devices beyond its seq_len / cp tokens' activations
    (:mod:`griffin.parallel.context_parallel`), summed over the blocks: per recurrent block the scan's output from a
    zero state, which the RG-LRU kernel keeps beside the corrected one ((seq_len / cp) · R / tp), the Conv1D halo
    ((K - 1) · R / tp) and the gathered carries (2 · cp · R / tp, float32 or wider; the decay correction keeps
    nothing per token: its decays are recomputed in the backward pass); per local-attention block the
    (window - 1) earlier keys and values; per global-attention block the keys and values gathered from the earlier
    shards (those of the last rank: (seq_len - seq_len / cp) · 2 · H_kv · head_dim). 0 without cp; the counts
    are checked against the tensors autograd keeps in benchmarks/distributed_cpu.py (``--cp``)."""
    if cp == 1:
        return 0.0
    b, R = compute_bytes, config.rnn_width / tp
    acc = max(4, b)
    kv = config.num_kv_heads * config.head_dim * b / (tp if config.num_kv_heads % tp == 0 else 1)
    shard = seq_len // cp
    total = 0.0
    for kind in config.block_types:
        if kind == "recurrent":
            total += (shard + config.conv1d_width - 1) * R * b + 2 * cp * R * acc
        elif kind == "local_attention":
            total += (config.attention_window - 1) * 2 * kv
        else:
            total += (seq_len - shard) * 2 * kv
    return total


def context_parallel_traffic(config: ModelConfig, seq_len: int, cp: int, compute_bytes: int = 2,
                             tp: int = 1) -> tuple[float, int]:
    """(bytes one device sends per sequence, forward and backward; collectives on the critical path): per block, an
    all-gather over cp in the forward pass (ring: (cp - 1) / cp of the gathered tensor) and an all-reduce of its
    gradient in the backward pass (2 (cp - 1) / cp of it). Gathered per rank: the recurrent blocks' carries
    (2 · R float32) and Conv1D tails ((K - 1) · R), local attention's last (window - 1) keys and values (or the
    whole shard if shorter), global attention's whole shard of keys and values."""
    if cp == 1:
        return 0.0, 0
    b, R = compute_bytes, config.rnn_width / tp
    kv = config.num_kv_heads * config.head_dim * b / (tp if config.num_kv_heads % tp == 0 else 1)
    shard = seq_len // cp
    sent, collectives = 0.0, 0
    for kind in config.block_types:
        if kind == "recurrent":
            per_rank = 2 * R * max(4, b) + min(config.conv1d_width - 1, shard) * R * b
            collectives += 4
        elif kind == "local_attention":
            per_rank = min(config.attention_window - 1, shard) * 2 * kv
            collectives += 2
        else:
            per_rank = shard * 2 * kv
            collectives += 2
        sent += 3 * (cp - 1) * per_rank  # all-gather: (cp-1)/cp of cp shares; all-reduce: twice that
    return sent, collectives


def memory_per_device(config: ModelConfig, layout: Layout, seq_len: int, compute_bytes: int = 2,
                      loss_chunk: int = 4096) -> dict[str, float]:
    """Bytes one device holds at its peak, by kind (see the module docstring); ``total`` is their sum."""
    cp = layout.cp
    shards = parameter_shards(config, layout.tp, layout.dp_shard * cp)
    sharded = sum(s["shard"] for s in shards.values())
    groups: dict[str, int] = {}
    for s in shards.values():
        groups[s["group"]] = groups.get(s["group"], 0) + s["tp_local"]
    biggest_block = max((v for k, v in groups.items() if k != "root"), default=0)
    root = groups.get("root", 0)
    on_device = 0.0 if layout.cpu_offload else 1.0
    mem = {"parameters": 4.0 * sharded * on_device, "gradients": 4.0 * sharded * on_device,
           "optimizer": 8.0 * sharded * on_device}
    fsdp = layout.dims.dp * cp > 1
    mem["gathered"] = (compute_bytes * (2 * biggest_block + root) + 4.0 * biggest_block) if fsdp else 0.0
    tokens = layout.micro_batch * seq_len // cp  # this device's shard of each sequence
    # local attention chunks the shard; global attention's queries see up to the whole sequence's keys
    per_block = [activation_bytes_per_token(config, kind, seq_len // cp if kind == "local_attention" else seq_len,
                                            compute_bytes, layout.tp, layout.sequence_parallel)
                 for kind in config.block_types]
    stream = config.width * compute_bytes / (layout.tp if layout.sequence_parallel else 1)
    if layout.activation_checkpointing:
        blocks = tokens * (stream * len(per_block) + max(per_block))
    else:
        blocks = tokens * sum(per_block)
    rows = min(tokens, loss_chunk) if loss_chunk else tokens
    head = tokens * (2 * stream + 4 * config.width) + 2 * 4.0 * rows * config.vocab_size / layout.tp
    mem["activations"] = blocks + head
    if cp > 1:
        mem["activations"] += layout.micro_batch * context_parallel_bytes(config, seq_len, cp, compute_bytes,
                                                                           layout.tp)
    mem["reserve"] = float(RESERVE_BYTES)
    mem["total"] = sum(mem.values())
    return mem


# Communication and time --------------------------------------------------------------------------------------------
def _bandwidth(gpu: GPU, span: int) -> tuple[float, str]:
    """Bytes/s per GPU of a ring over ``span`` consecutive ranks: NVLink inside a node, the network across."""
    return (gpu.nvlink, "nvlink") if span <= gpu.per_node else (gpu.network, "network")


def estimate(config: ModelConfig, gpu: GPU, layout: Layout, seq_len: int, global_batch: int,
             loss_chunk: int = 4096) -> Estimate:
    """The memory, communication and time of one optimizer step of ``global_batch`` sequences of ``seq_len`` tokens
    on ``layout`` (``layout.micro_batch`` sequences per device at a time, accumulated)."""
    check_tensor_parallel(config, layout.tp)
    dims = layout.dims
    if seq_len % layout.cp:
        raise ValueError(f"seq_len={seq_len} is not a multiple of cp={layout.cp}")
    notes = []
    if global_batch % dims.dp:
        raise ValueError(f"global_batch={global_batch} is not divisible by the {dims.dp} data-parallel ranks")
    per_rank = global_batch // dims.dp
    if per_rank % layout.micro_batch:
        raise ValueError(f"micro_batch={layout.micro_batch} does not divide the {per_rank} sequences per rank")
    accum = per_rank // layout.micro_batch
    b = 2  # bf16 compute
    mem = memory_per_device(config, layout, seq_len, b, loss_chunk)
    fits = mem["total"] <= gpu.memory
    shards = parameter_shards(config, layout.tp, layout.dp_shard)
    tp_local = sum(s["tp_local"] for s in shards.values())
    # tensor parallelism: per micro-batch, two all-reduces per block forward and backward (one more pair of each
    # with recomputation), the embedding's and the loss's; ring all-reduce moves 2 (n-1)/n of the tensor
    tokens = layout.micro_batch * seq_len // layout.cp
    comm: dict[str, float] = {"tp": 0.0, "fsdp": 0.0, "replicate": 0.0, "cp": 0.0}
    times = {}
    if layout.tp > 1:
        per_block = 4 + (2 if layout.activation_checkpointing else 0)
        n_allreduce = per_block * config.depth + 2
        size = tokens * config.width * b
        comm["tp"] = accum * n_allreduce * 2 * (layout.tp - 1) / layout.tp * size
        bw, link = _bandwidth(gpu, layout.tp)
        times["tp_comm"] = comm["tp"] / bw + accum * n_allreduce * LATENCY_S[link]
    else:
        times["tp_comm"] = 0.0
    if layout.cp > 1:
        sent, collectives = context_parallel_traffic(config, seq_len, layout.cp, b, layout.tp)
        comm["cp"] = accum * layout.micro_batch * sent
        bw, link = _bandwidth(gpu, layout.tp * layout.cp)
        times["cp_comm"] = comm["cp"] / bw + accum * collectives * LATENCY_S[link]
    else:
        times["cp_comm"] = 0.0
    if dims.dp * layout.cp > 1:
        n = layout.dp_shard * layout.cp
        gathers = 2 * (n - 1) / n * tp_local * b  # forward and backward all-gathers of the bf16 parameters
        scatter = (n - 1) / n * tp_local * 4  # reduce-scatter of float32 gradients
        comm["fsdp"] = accum * (gathers + scatter)
        bw, link = _bandwidth(gpu, layout.tp * n)
        times["fsdp_comm"] = comm["fsdp"] / bw + accum * 3 * (config.depth + 1) * LATENCY_S[link] * (n > 1)
        if layout.dp_replicate > 1:
            r = layout.dp_replicate
            comm["replicate"] = accum * 2 * (r - 1) / r * sum(s["shard"] for s in shards.values()) * 4
            times["fsdp_comm"] += comm["replicate"] / gpu.network
    else:
        times["fsdp_comm"] = 0.0
    if layout.cpu_offload:  # the sharded state crosses PCIe twice a step and AdamW runs on the CPU
        notes.append("cpu_offload: PCIe transfers and the CPU optimizer step are not modelled")
    step_tokens = per_rank * seq_len // layout.cp
    matmul = training_flops_per_token(config, seq_len, include_elementwise=False) * step_tokens / layout.tp
    if layout.activation_checkpointing:
        matmul *= 4 / 3
    times["compute"] = matmul / (gpu.flops * MATMUL_EFFICIENCY)
    per_token = sum(activation_bytes_per_token(config, kind, seq_len, b, layout.tp, layout.sequence_parallel)
                    for kind in config.block_types)
    times["memory_bound"] = 3 * per_token * step_tokens / gpu.hbm_bandwidth
    busy = times["compute"] + times["memory_bound"]
    times["fsdp_exposed"] = max(0.0, times["fsdp_comm"] - busy)
    times["step"] = busy + times["tp_comm"] + times["cp_comm"] + times["fsdp_exposed"]
    tokens_per_s = global_batch * seq_len / times["step"]
    model_flops = training_flops_per_token(config, seq_len, include_elementwise=False)
    mfu = model_flops * tokens_per_s / (gpu.flops * dims.world_size)
    return Estimate(layout, mem, comm, times, tokens_per_s, mfu, fits, accum, notes)


def candidate_layouts(config: ModelConfig, gpus: int, gpu: GPU, seq_len: int, global_batch: int,
                      cp: int = 1) -> list[Layout]:
    """Every layout of ``gpus`` devices this model can run: tp dividing the model's counts and at most a node,
    any split of the rest (after ``cp``) into dp_replicate × dp_shard, micro-batches of powers of two dividing each
    rank's sequences, with and without activation checkpointing (and sequence parallelism when tp > 1 and cp = 1)."""
    check_context_parallel(config, cp, seq_len)
    out = []
    for tp in range(1, min(gpus, gpu.per_node) + 1):
        if gpus % (tp * cp):
            continue
        try:
            check_tensor_parallel(config, tp)
        except ValueError:
            continue
        dp = gpus // (tp * cp)
        if global_batch % dp:
            continue
        per_rank = global_batch // dp
        for dp_shard in (d for d in range(1, dp + 1) if dp % d == 0):
            micro = [m for m in (2**i for i in range(0, 12)) if m <= per_rank and per_rank % m == 0]
            for mb in micro:
                for ac in (False, True):
                    for sp in ((False, True) if tp > 1 and seq_len % tp == 0 and cp == 1 else (False,)):
                        out.append(Layout(dp // dp_shard, dp_shard, tp, mb, ac, sp, cp=cp))
    return out


def plan(config: ModelConfig, gpus: int, gpu: GPU, seq_len: int = 2048, global_batch: int = 1024,
         loss_chunk: int = 4096, cp: int = 1) -> list[Estimate]:
    """Every candidate layout's estimate, keeping per (mesh, options) the fastest micro-batch that fits (or the
    smallest if none does); fitting layouts first, fastest first."""
    if gpus < 1:
        raise ValueError(f"gpus={gpus} must be positive")
    best: dict[tuple, Estimate] = {}
    for layout in candidate_layouts(config, gpus, gpu, seq_len, global_batch, cp):
        est = estimate(config, gpu, layout, seq_len, global_batch, loss_chunk)
        key = (layout.dp_replicate, layout.dp_shard, layout.tp, layout.activation_checkpointing,
               layout.sequence_parallel)
        old = best.get(key)
        if old is None or (est.fits, -est.time["step"]) > (old.fits, -old.time["step"]):
            best[key] = est
    if not best:
        raise ValueError(f"no layout of {gpus} GPUs splits this model with global_batch={global_batch}: tp must "
                         "divide the GPUs and the model's heads, widths, gate blocks and vocabulary")
    return sorted(best.values(), key=lambda e: (not e.fits, round(e.time["step"], 6), e.memory["total"]))


# Output ------------------------------------------------------------------------------------------------------------
def format_plan(config: ModelConfig, estimates: list[Estimate], gpu: GPU, gpus: int, seq_len: int,
                global_batch: int, top: int = 12) -> str:
    """The planner's report: the model and cluster, a table of the fastest layouts (fitting ones first), the
    fastest that fits with its memory breakdown."""
    n = sum(p.numel() for p in _meta_model(config).parameters())
    lines = [f"{config.name or config.family}: {n / 1e9:.2f}B parameters; {gpus} x {gpu.name} "
             f"({gpu.memory / GB:.0f} GB, {gpu.flops / 1e12:.0f} TFLOP/s bf16, NVLink {gpu.nvlink / GB:.0f} GB/s, "
             f"network {gpu.network / GB:.0f} GB/s per GPU); {global_batch} x {seq_len} tokens per step",
             "",
             "| layout (R x S x T) | micro-batch x accum | AC | SP | memory/GPU GB | params+grads+Adam GB | "
             "activations GB | TP GB/step | FSDP GB/step | step s | tokens/s | MFU | fits |",
             "|---|---:|:-:|:-:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|"]
    for e in estimates[:top]:
        m, c, lay = e.memory, e.communication, e.layout
        state = m["parameters"] + m["gradients"] + m["optimizer"]
        lines.append(f"| {lay.dp_replicate} x {lay.dp_shard} x {lay.tp} | {lay.micro_batch} x {e.grad_accum} | "
                     f"{'y' if lay.activation_checkpointing else '-'} | {'y' if lay.sequence_parallel else '-'} | "
                     f"{m['total'] / GB:.1f} | {state / GB:.1f} | {m['activations'] / GB:.1f} | "
                     f"{c['tp'] / GB:.1f} | {(c['fsdp'] + c['replicate']) / GB:.1f} | {e.time['step']:.2f} | "
                     f"{e.tokens_per_s:,.0f} | {e.mfu:.1%} | {'yes' if e.fits else 'no'} |")
    fitting = [e for e in estimates if e.fits]
    lines.append("")
    lines.append(f"{len(fitting)} of {len(estimates)} layouts fit in {gpu.memory / GB:.0f} GB.")
    if fitting:
        e = fitting[0]
        lines.append(f"fastest that fits: {describe(e)}")
        lines.append("  memory per GPU: " + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in e.memory.items()))
        lines.append("  time per step: " + ", ".join(f"{k} {v:.3f} s" for k, v in e.time.items()))
    return "\n".join(lines)


def describe(e: Estimate) -> str:
    lay = e.layout
    return (f"dp_replicate={lay.dp_replicate} x dp_shard={lay.dp_shard}"
            + (f" x cp={lay.cp}" if lay.cp > 1 else "") + f" x tp={lay.tp}, micro-batch "
            f"{lay.micro_batch} x {e.grad_accum} accumulated"
            + (", activation checkpointing" if lay.activation_checkpointing else "")
            + (", sequence parallel" if lay.sequence_parallel else "")
            + f": {e.memory['total'] / GB:.1f} GB per GPU, {e.time['step']:.2f} s per step, "
              f"{e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%}")


__all__ = ["GPUS", "GPU", "Estimate", "Layout", "activation_bytes_per_token", "candidate_layouts",
           "context_parallel_bytes", "context_parallel_traffic", "describe",
           "estimate", "format_plan", "memory_per_device", "parameter_shards", "plan"]
