"""What the spawned processes of tests/parallel run: each joins a gloo process group, lays a tiny model over a
``dp_replicate × dp_shard × tp`` mesh and compares itself with one process computing the same thing (rank 0
computes that reference too: the models are tiny). Results go to a JSON file per rank; the tests read them."""

from __future__ import annotations

import importlib
import json
import os
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from griffin import CausalLM, ModelConfig
from griffin.ops.cross_entropy import IGNORE_INDEX
from griffin.parallel import (
    ParallelDims,
    ParallelOptions,
    build_mesh,
    clip_grad_norm_,
    load_sharded,
    parallelize,
    save_sharded,
)

DTYPES = {"float32": torch.float32, "float64": torch.float64}
# Each family's tiny preset, with the options the parallel paths treat differently: Griffin with a logit soft-cap
# and the sqrt(D) embedding scale, MQA with an output layer of its own (untied, split column-wise).
OVERRIDES = {"hawk": {}, "griffin": {"logits_soft_cap": 3.0, "embed_scale": True}, "mqa": {"tie_embeddings": False}}


def tiny(family: str) -> ModelConfig:
    return ModelConfig.from_preset(f"{family}-tiny", **OVERRIDES[family])


def run(rank: int, world: int, port: int, out: str, fn_name: str, kwargs: dict) -> None:
    """torch.multiprocessing.spawn's entry point: the process group, then ``fn_name(**kwargs)`` (a function of this
    module, or ``"module:function"`` of another); a failure is written to ``out/error-<rank>.txt`` (and re-raised) so
    that the test shows it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    module, _, name = fn_name.rpartition(":")
    fn = getattr(importlib.import_module(module), name) if module else globals()[name]
    try:
        result = fn(rank=rank, world=world, out=Path(out), **kwargs)
        (Path(out) / f"result-{rank}.json").write_text(json.dumps(result))
    except BaseException:
        (Path(out) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def batches(config: ModelConfig, seed: int, steps: int, batch: int, seq_len: int) -> list[dict[str, torch.Tensor]]:
    """Seeded global batches of packed documents: token ids, positions (documents start at random offsets) and
    targets with ignored positions."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)
        starts = torch.rand(batch, seq_len, generator=gen) < 0.1
        starts[:, 0] = True
        steps_ = torch.arange(seq_len).expand(batch, seq_len)
        first = torch.cummax(torch.where(starts, steps_, 0), dim=1).values  # each token's document start
        targets = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)
        targets[torch.rand(batch, seq_len, generator=gen) < 0.1] = IGNORE_INDEX
        out.append({"input_ids": ids, "positions": steps_ - first, "targets": targets})
    return out


def reference(config: ModelConfig, dtype: torch.dtype, seed: int, data: list[dict], lr: float, eps: float,
              chunk: int, clip: float) -> dict:
    """One process: losses, gradients after the first step, gradient norms and weights after every step."""
    torch.manual_seed(seed)
    model = CausalLM(config).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps, weight_decay=0.1)
    losses, norms, first_grads = [], [], None
    for batch in data:
        count = int((batch["targets"] != IGNORE_INDEX).sum())
        loss = model(batch["input_ids"], batch["positions"], targets=batch["targets"], loss_chunk=chunk) / count
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "grads": first_grads,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare_training(rank: int, world: int, out: Path, layout: tuple[int, int, int], families: list[str],
                     dtype: str, seed: int, chunk: int = 0, sequence_parallel: bool = False,
                     activation_checkpointing: bool = False, steps: int = 3, batch: int = 4,
                     seq_len: int = 16, lr: float = 1e-2, eps: float = 1e-8, compile: bool = False) -> dict:
    """For each family: losses, every gradient (gathered) after the first step, gradient norms and the weights
    after ``steps`` AdamW steps on the layout, against one process; the largest relative differences.

    In float32, AdamW turns rounding differences Δg of gradients near zero into update differences up to
    lr·Δg/eps, and they compound over the steps: 2 x 2 against one process in float32 differed by up to 1.7e-5 in
    the weights with lr = 1e-3, eps = 1e-6 (seed 238550746, MQA), by at most 2.7e-7 with lr = 1e-3, eps = 1e-4
    (the same seed and 4 others, 3 families), which float32 comparisons use. A wrong gradient still moves a weight
    by about lr."""
    dims = ParallelDims(*layout)
    mesh = build_mesh(dims, "cpu")
    result = {}
    for family in families:
        config = tiny(family)
        data = batches(config, seed, steps, batch, seq_len)
        ref = reference(config, DTYPES[dtype], seed, data, lr, eps, chunk, 1.0) if rank == 0 else None
        torch.manual_seed(seed)
        model = CausalLM(config).to(DTYPES[dtype])
        options = ParallelOptions(sequence_parallel=sequence_parallel,
                                  activation_checkpointing=activation_checkpointing, compile=compile)
        parallelize(model, mesh, dims, options)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps, weight_decay=0.1)
        dp_rank, rows = dims.dp_rank(rank), batch // dims.dp
        losses, norms, grad_err = [], [], 0.0
        for step, b in enumerate(data):
            count = int((b["targets"] != IGNORE_INDEX).sum())
            mine = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in b.items()}
            loss = model(mine["input_ids"], mine["positions"], targets=mine["targets"], loss_chunk=chunk)
            (loss * dims.dp / count).backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / dims.tp / count)
            if step == 0:
                for name, p in model.named_parameters():
                    grad = full(p.grad)  # a collective: every rank gathers
                    if ref is not None:
                        grad_err = max(grad_err, relative(grad, ref["grads"][plain_name(name)]))
            norms.append(float(clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            opt.zero_grad()
        weights = {plain_name(n): full(p.detach()).double() for n, p in model.named_parameters()}
        if activation_checkpointing:  # the wrapper's module is not in the names checkpoints see
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            assert sorted(get_model_state_dict(model)) == sorted(ref["weights"] if ref else weights)
        if ref is None:
            continue
        weight_err = max(float((w - ref["weights"][n].double()).abs().max()) for n, w in weights.items())
        scale = max(float(w.abs().max()) for w in ref["weights"].values())
        result[family] = {
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"], strict=True)),
            "norm_err": max(abs(a - b) / abs(b) for a, b in zip(norms, ref["norms"], strict=True)),
            "grad_err": grad_err, "weight_err": weight_err / scale, "losses": losses, "ref_losses": ref["losses"],
        }
    return result


def plain_name(name: str) -> str:
    """A parameter's name without activation checkpointing's wrapper module."""
    return name.replace("_checkpoint_wrapped_module.", "")


def relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (the scale of the tensor; 1e-30 at least)."""
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def no_comm_in_local_shards(rank: int, world: int, out: Path, seed: int) -> dict:
    """CommDebugMode: the Conv1D and the RG-LRU of a tensor-parallel recurrent block issue no collective (forward and
    backward); the whole recurrent residual block issues one all-reduce per sub-block each way."""
    from torch.distributed.tensor.debug import CommDebugMode

    from griffin.layers import Context

    dims = ParallelDims(1, 1, world)
    mesh = build_mesh(dims, "cpu")
    config = ModelConfig.from_preset("hawk-tiny")
    torch.manual_seed(seed)
    model = parallelize(CausalLM(config), mesh, dims)
    block = model.blocks[0]
    gen = torch.Generator().manual_seed(seed)
    B, T, R = 2, 12, config.rnn_width // world
    u = torch.randn(B, T, R, generator=gen, requires_grad=True)
    reset = torch.rand(B, T, generator=gen) < 0.2
    with CommDebugMode() as local_comm:
        conv = block.temporal_block.conv_1d(u, reset)
        h, _ = block.temporal_block.rg_lru(conv, reset)
        h.square().sum().backward()
    x = torch.randn(B, T, config.width, generator=gen, requires_grad=True)
    ctx = Context(torch.arange(T).expand(B, T), reset)
    with CommDebugMode() as forward_comm:
        y = block(x, ctx)
    with CommDebugMode() as backward_comm:
        y.square().sum().backward()
    return {"local": local_comm.get_total_counts(), "local_grads": [p.grad is not None for p in (u,)],
            "forward": {str(k): v for k, v in forward_comm.get_comm_counts().items()},
            "backward": {str(k): v for k, v in backward_comm.get_comm_counts().items()}}


def save_then_train(rank: int, world: int, out: Path, layout: tuple[int, int, int], family: str, seed: int,
                    steps_before: int, steps_after: int, ckpt: str, batch: int = 4, seq_len: int = 16) -> dict:
    """Train ``steps_before`` steps on the layout, save a sharded checkpoint, then train ``steps_after`` more; the
    losses after the checkpoint are what a resume on another layout must reproduce."""
    dims = ParallelDims(*layout)
    mesh = build_mesh(dims, "cpu") if world > 1 else None
    config = tiny(family)
    data = batches(config, seed, steps_before + steps_after, batch, seq_len)
    torch.manual_seed(seed)
    model = CausalLM(config)
    if mesh is not None:
        parallelize(model, mesh, dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step, b in enumerate(data):
        if step == steps_before:
            save_sharded(Path(ckpt), model, opt, {"step": step}, {"layout": list(layout)})
        losses.append(train_step(model, opt, b, dims, rank))
    return {"losses": losses[steps_before:]}


def load_then_train(rank: int, world: int, out: Path, layout: tuple[int, int, int], family: str, seed: int,
                    steps_before: int, steps_after: int, ckpt: str, batch: int = 4, seq_len: int = 16) -> dict:
    """Load the sharded checkpoint on this layout (another one than it was written on) and train the next steps."""
    dims = ParallelDims(*layout)
    mesh = build_mesh(dims, "cpu") if world > 1 else None
    config = tiny(family)
    data = batches(config, seed, steps_before + steps_after, batch, seq_len)
    torch.manual_seed(seed + 1)  # other weights: the checkpoint must overwrite them all
    model = CausalLM(config)
    if mesh is not None:
        parallelize(model, mesh, dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    state = load_sharded(Path(ckpt), model, opt)
    losses = [train_step(model, opt, b, dims, rank) for b in data[state["step"]:]]
    return {"losses": losses}


def train_step(model: CausalLM, opt: torch.optim.Optimizer, b: dict, dims: ParallelDims, rank: int) -> float:
    """One AdamW step on this rank's share of the global batch ``b``; the global mean loss."""
    count = int((b["targets"] != IGNORE_INDEX).sum())
    rows = b["input_ids"].shape[0] // dims.dp
    dp_rank = dims.dp_rank(rank)
    mine = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in b.items()}
    loss = model(mine["input_ids"], mine["positions"], targets=mine["targets"])
    (loss * dims.dp / count).backward()
    total = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(total)
    clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return float(total) / dims.tp / count


def killed_during_save(rank: int, world: int, out: Path, seed: int, root: str) -> dict:
    """Save step 1, then step 2 with rank 1 killed (SIGKILL) right after writing its shard (tests/faults)."""
    from tests.faults import install

    install("sharded_checkpoint:2:1")  # patches this process's griffin.parallel.checkpoint; step 1 is saved whole
    dims = ParallelDims(1, world, 1)
    mesh = build_mesh(dims, "cpu")
    config = tiny("griffin")
    data = batches(config, seed, 2, 4, 16)
    torch.manual_seed(seed)
    model = parallelize(CausalLM(config), mesh, dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, data[0], dims, rank)
    save_sharded(Path(root) / "step_00000001", model, opt, {"step": 1})
    train_step(model, opt, data[1], dims, rank)
    save_sharded(Path(root) / "step_00000002", model, opt, {"step": 2})
    return {"finished": True}




def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, fn_name: str, out: Path, timeout: float = 300, **kwargs) -> list[dict]:
    """Run ``fn_name`` in ``world`` spawned processes; return each rank's result (raise with a rank's traceback if
    one failed)."""
    import torch.multiprocessing as mp

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(run, args=(world, free_port(), str(out), fn_name, kwargs), nprocs=world,
                             start_method="spawn", join=False)
    import time

    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn_name} on {world} processes took over {timeout} s")
    except mp.ProcessRaisedException as err:
        errors = [p.read_text() for p in sorted(out.glob("error-*.txt"))]
        raise AssertionError("\n".join(errors) or str(err)) from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [json.loads((out / f"result-{r}.json").read_text()) for r in range(world)]


def four_ranks(rank: int, world: int, out: Path, seed: int, ckpt: str) -> dict:
    """The 4-process part of the default suite: 2 x 2 (dp_shard x tp) against one process in float32, for each
    family; then a sharded checkpoint of a Griffin written on 2 x 2 and the losses of the steps after it."""
    compare = compare_training(rank, world, out, (1, 2, 2), ["hawk", "griffin", "mqa"], "float32", seed, lr=1e-3,
                               eps=1e-4)
    after = save_then_train(rank, world, out, (1, 2, 2), "griffin", seed, 2, 2, ckpt)
    return {"compare": compare, "after_save": after}


def two_ranks(rank: int, world: int, out: Path, seed: int, ckpt: str) -> dict:
    """The 2-process part of the default suite: tp = 2 (chunked loss) and dp_shard = 2 against one process in
    float64, for each family; the Conv1D and RG-LRU shards without collectives; gathered logits; and the 2 x 2
    checkpoint loaded on tp = 2."""
    return {
        "tp": compare_training(rank, world, out, (1, 1, 2), ["hawk", "griffin", "mqa"], "float64", seed, chunk=7),
        "dp_shard": compare_training(rank, world, out, (1, 2, 1), ["hawk", "griffin", "mqa"], "float64", seed),
        "comm": no_comm_in_local_shards(rank, world, out, seed),
        "logits": logits_match(rank, world, out, seed),
        "resumed": load_then_train(rank, world, out, (1, 1, 2), "griffin", seed, 2, 2, ckpt),
        "held": held_bytes(rank, world, out, [(1, 1, 2), (1, 2, 1), (2, 1, 1)]),
    }


def held_bytes(rank: int, world: int, out: Path, layouts: list[tuple[int, int, int]]) -> dict:
    """After one AdamW step of a tiny Griffin on each layout: the bytes of parameters, gradients and AdamW's moments
    this rank holds (its local shards), beside the planner's figures for the layout."""
    from griffin.parallel.plan import Layout, memory_per_device

    config = tiny("griffin")
    result = {}
    for layout in layouts:
        dims = ParallelDims(*layout)
        mesh = build_mesh(dims, "cpu")
        torch.manual_seed(0)
        model = parallelize(CausalLM(config), mesh, dims)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        b = batches(config, 0, 1, 4, 16)[0]
        train_step(model, opt, b, dims, rank)
        for p in model.parameters():  # zero_grad dropped them: one more backward to hold gradients
            p.grad = torch.zeros_like(p)

        def local_bytes(tensors) -> int:
            return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)

        moments = [v for state in opt.state.values() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")]
        planned = memory_per_device(config, Layout(*layout), 16, compute_bytes=4)
        result["x".join(map(str, layout))] = {
            "parameters": local_bytes(model.parameters()), "gradients": local_bytes(p.grad for p in model.parameters()),
            "optimizer": local_bytes(moments),
            "planned": {k: planned[k] for k in ("parameters", "gradients", "optimizer")},
        }
    return result


def logits_match(rank: int, world: int, out: Path, seed: int) -> dict:
    """Logits (no targets) of a tp = 2 model, gathered over the vocabulary, against one process; each family."""
    dims = ParallelDims(1, 1, world)
    mesh = build_mesh(dims, "cpu")
    errors = {}
    for family in ("hawk", "griffin", "mqa"):
        config = tiny(family)
        b = batches(config, seed, 1, 2, 16)[0]
        torch.manual_seed(seed)
        ref = CausalLM(config).double()
        torch.manual_seed(seed)
        model = parallelize(CausalLM(config).double(), mesh, dims)
        with torch.no_grad():
            want = ref(b["input_ids"], b["positions"])
            got = model(b["input_ids"], b["positions"])
            try:  # inference caches hold whole widths: a tensor-parallel model refuses them
                model(b["input_ids"], cache=model.init_cache(2, 32))
                errors[f"{family}-cache-refused"] = False
            except ValueError as err:
                errors[f"{family}-cache-refused"] = "gather it into one model" in str(err)
        errors[family] = relative(got, want)
    return errors


def options_and_hsdp(rank: int, world: int, out: Path, seed: int) -> dict:
    """The slow part: on 2 ranks, tp = 2 with sequence parallelism and activation checkpointing, dp_shard = 2 with
    activation checkpointing; on 4 ranks, 2 x 2 and HSDP layouts; float64 against one process."""
    families = ["hawk", "griffin", "mqa"]
    if world == 2:
        return {"tp_sp_ac": compare_training(rank, world, out, (1, 1, 2), families, "float64", seed,
                                             sequence_parallel=True, activation_checkpointing=True),
                "dp_ac": compare_training(rank, world, out, (1, 2, 1), families, "float64", seed,
                                          activation_checkpointing=True)}
    return {"2x2": compare_training(rank, world, out, (1, 2, 2), families, "float64", seed),
            "hsdp_tp": compare_training(rank, world, out, (2, 1, 2), families, "float64", seed),
            "hsdp": compare_training(rank, world, out, (2, 2, 1), families, "float64", seed)}


def compiled_blocks(rank: int, world: int, out: Path, seed: int) -> dict:
    """tp = 2 and dp_shard = 2 with every block compiled (torch.compile), float64 against one (eager) process."""
    return {"tp": compare_training(rank, world, out, (1, 1, 2), ["griffin"], "float64", seed, compile=True),
            "dp": compare_training(rank, world, out, (1, 2, 1), ["griffin"], "float64", seed, compile=True)}
