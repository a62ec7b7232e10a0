"""What the spawned processes of tests/parallel/test_context_parallel.py run: each joins a gloo process group, lays a
tiny float64 model over the cp ranks (griffin.parallel.context_parallel) and compares its losses, gradients and
AdamW weights with one process running the whole sequences (every rank computes that reference: the models are
tiny). Results go to a JSON file per rank."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from griffin import CausalLM
from griffin.ops.cross_entropy import IGNORE_INDEX
from griffin.parallel.context_parallel import apply_context_parallel, shard_sequence
from tests.parallel.workers import tiny


def case_positions(kind: str, batch: int, seq_len: int, cp: int, gen: torch.Generator) -> torch.Tensor | None:
    """Each token's position in its document, with documents starting where ``kind`` says (row 0; row 1 has random
    starts and, with ``pad``, 3 padding tokens first); None: one document per row."""
    if kind == "none":
        return None
    shard = seq_len // cp
    starts = torch.rand(batch, seq_len, generator=gen) < 0.15
    at = {"boundary": shard, "after": shard + 1, "inside": shard + shard // 2, "random": None, "pad": None}[kind]
    if at is not None:
        starts[0] = False
        starts[0, at] = True
    starts[:, 0] = True
    steps = torch.arange(seq_len).expand(batch, seq_len)
    first = torch.cummax(torch.where(starts, steps, 0), dim=1).values
    positions = steps - first
    if kind == "pad":
        positions = positions.clone()
        positions[1, :3] = -1
        positions[1, 3:] = torch.arange(seq_len - 3)
    return positions


def relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def compare(rank: int, world: int, out: Path, seed: int, cases: list[dict], steps: int = 3) -> dict:
    """For each case (family, seq_len, positions kind, config overrides): the largest relative differences of the
    summed loss, every gradient and the weights after ``steps`` AdamW steps between the cp ranks and one process."""
    group = dist.group.WORLD
    results = {}
    for case in cases:
        config = tiny(case["family"]).replace(**case.get("overrides", {}))
        batch, seq_len = 2, case["seq_len"]
        gen = torch.Generator().manual_seed(seed)
        data = []
        for _ in range(steps):
            ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)
            targets = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)
            targets[torch.rand(batch, seq_len, generator=gen) < 0.1] = IGNORE_INDEX
            data.append((ids, case_positions(case["positions"], batch, seq_len, world, gen), targets))
        torch.manual_seed(seed)
        ref = CausalLM(config).double()
        model = CausalLM(config).double()
        model.load_state_dict(ref.state_dict())
        apply_context_parallel(model, group)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ref, model)]
        loss_err = grad_err = 0.0
        for ids, positions, targets in data:
            count = int((targets != IGNORE_INDEX).sum())
            ref_loss = ref(ids, positions, targets=targets) / count
            ref_loss.backward()
            mine = [None if t is None else shard_sequence(t, rank, world) for t in (ids, positions, targets)]
            loss = model(mine[0], mine[1], targets=mine[2]) / count
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total, group=group)
            ref_loss = float(ref_loss.detach())
            loss_err = max(loss_err, abs(float(total) - ref_loss) / abs(ref_loss))
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                dist.all_reduce(p.grad, group=group)  # the loss is the sum of the ranks' losses
                grad_err = max(grad_err, relative(p.grad, q.grad))
            for opt in opts:
                opt.step()
                opt.zero_grad()
        weight_err = max(relative(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
        results[case["name"]] = {"loss_err": loss_err, "grad_err": grad_err, "weight_err": weight_err}
    return results


def layout_training(rank: int, world: int, out: Path, layout: tuple[int, int, int, int], families: list[str],
                    seed: int, steps: int = 3, batch: int = 4, seq_len: int = 16,
                    activation_checkpointing: bool = False) -> dict:
    """``dp_replicate × dp_shard × tp × cp`` through :func:`griffin.parallel.parallelize` (FSDP over dp_shard × cp),
    float64, against one process: losses, every gathered gradient after the first step, gradient norms and the
    weights after ``steps`` AdamW steps; the largest relative differences (on rank 0)."""
    from griffin.parallel import ParallelDims, ParallelOptions, build_mesh, clip_grad_norm_, parallelize
    from tests.parallel.workers import batches, full, plain_name, reference

    dims = ParallelDims(*layout)
    mesh = build_mesh(dims, "cpu")
    result = {}
    for family in families:
        config = tiny(family)
        data = batches(config, seed, steps, batch, seq_len)
        ref = reference(config, torch.float64, seed, data, 1e-2, 1e-8, 0, 1.0) if rank == 0 else None
        torch.manual_seed(seed)
        options = ParallelOptions(activation_checkpointing=activation_checkpointing)
        model = parallelize(CausalLM(config).double(), mesh, dims, options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.1)
        losses, norms, grad_err = [], [], 0.0
        for step, b in enumerate(data):
            losses.append(cp_step(model, b, dims, rank))
            if step == 0:
                for name, p in model.named_parameters():
                    grad = full(p.grad)
                    if ref is not None:
                        grad_err = max(grad_err, relative(grad, ref["grads"][plain_name(name)]))
            norms.append(float(clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            opt.zero_grad()
        weights = {plain_name(n): full(p.detach()) for n, p in model.named_parameters()}
        if ref is None:
            continue
        result[family] = {
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"], strict=True)),
            "norm_err": max(abs(a - b) / abs(b) for a, b in zip(norms, ref["norms"], strict=True)),
            "grad_err": grad_err,
            "weight_err": max(relative(w, ref["weights"][n]) for n, w in weights.items()),
        }
    return result


def cp_step(model: CausalLM, b: dict, dims, rank: int) -> float:
    """Forward and backward of this rank's rows (dp) and sequence shard (cp) of the global batch ``b``, scaled for
    FSDP's mean over the dp × cp ranks; the global mean loss."""
    count = int((b["targets"] != IGNORE_INDEX).sum())
    rows = b["input_ids"].shape[0] // dims.dp
    dp_rank, cp_rank = dims.dp_rank(rank), dims.cp_rank(rank)
    mine = {k: shard_sequence(v[dp_rank * rows : (dp_rank + 1) * rows], cp_rank, dims.cp) for k, v in b.items()}
    loss = model(mine["input_ids"], mine["positions"], targets=mine["targets"])
    (loss * dims.dp * dims.cp / count).backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / dims.tp / count


def save_then_resume(rank: int, world: int, out: Path, layout: tuple[int, int, int, int], family: str, seed: int,
                     ckpt: str, steps_before: int = 2, steps_after: int = 2) -> dict:
    """Train ``steps_before`` steps on the layout, save a sharded checkpoint, train ``steps_after`` more (their
    losses are what a resume on one process must reproduce)."""
    from griffin.parallel import ParallelDims, build_mesh, clip_grad_norm_, parallelize, save_sharded
    from tests.parallel.workers import batches

    dims = ParallelDims(*layout)
    config = tiny(family)
    data = batches(config, seed, steps_before + steps_after, 4, 16)
    torch.manual_seed(seed)
    model = parallelize(CausalLM(config).double(), build_mesh(dims, "cpu"), dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step, b in enumerate(data):
        if step == steps_before:
            save_sharded(Path(ckpt), model, opt, {"step": step}, {"layout": list(layout)})
        losses.append(cp_step(model, b, dims, rank))
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return {"losses": losses[steps_before:]}


def resume_one_process(family: str, seed: int, ckpt: str, steps_before: int = 2, steps_after: int = 2) -> list[float]:
    """Load the sharded checkpoint into one process (no process group) and train the next steps; their losses."""
    from griffin.parallel import load_sharded
    from tests.parallel.workers import batches

    config = tiny(family)
    data = batches(config, seed, steps_before + steps_after, 4, 16)
    torch.manual_seed(seed + 1)  # other weights: the checkpoint must overwrite them all
    model = CausalLM(config).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    state = load_sharded(Path(ckpt), model, opt)
    losses = []
    for b in data[state["step"]:]:
        count = int((b["targets"] != IGNORE_INDEX).sum())
        loss = model(b["input_ids"], b["positions"], targets=b["targets"]) / count
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def two_ranks(rank: int, world: int, out: Path, seed: int, ckpt: str, cases: list[dict]) -> dict:
    """The 2-process part (default suite): the cases at cp = 2; cp = 2 through parallelize (FSDP over cp) for each
    family, without and with activation checkpointing; a cp = 2 Griffin checkpoint and the losses after it."""
    return {"compare": compare(rank, world, out, seed, cases),
            "cp2": layout_training(rank, world, out, (1, 1, 1, 2), ["hawk", "griffin", "mqa"], seed),
            "cp2_ac": layout_training(rank, world, out, (1, 1, 1, 2), ["hawk", "griffin", "mqa"], seed,
                                      activation_checkpointing=True),
            "after_save": save_then_resume(rank, world, out, (1, 1, 1, 2), "griffin", seed, ckpt)}


def four_ranks(rank: int, world: int, out: Path, seed: int, cases: list[dict]) -> dict:
    """The 4-process part (slow): the cases at cp = 4; cp = 2 × dp_shard = 2 and cp = 2 × tp = 2."""
    return {"compare": compare(rank, world, out, seed, cases),
            "cp_dp_shard": layout_training(rank, world, out, (1, 2, 1, 2), ["hawk", "griffin", "mqa"], seed),
            "cp_tp": layout_training(rank, world, out, (1, 1, 2, 2), ["hawk", "griffin", "mqa"], seed)}

