"""Scale-out on CPU (gloo): what each rank holds and how fast each layout trains (Section 4.1).

For 1, 2 and 4 processes and each layout ``dp_replicate × dp_shard × tp`` of them, a Griffin is trained for a few
AdamW steps (float32, ``--batch`` sequences of ``--seq-len`` tokens per data-parallel rank) and each rank reports
the bytes of the parameters, gradients and AdamW moments it holds (its local shards: ZeRO-3 keeps about 1/N of
them), the planner's prediction beside them (:func:`griffin.parallel.plan.memory_per_device`), the process's peak
resident memory, and the training tokens/s of the whole layout. CPU gloo is not the target of these layouts:
tokens/s are reported as measured, to show the machinery runs, not to rank the layouts.

    python benchmarks/distributed_cpu.py                   # griffin-cpu widened to 4.5M parameters; ~5 min on 2 cores
    python benchmarks/distributed_cpu.py --width 128 --steps 2     # quicker

Context parallelism (``--cp 1,2,4``, after the layouts; ``--layouts ''`` for it alone): one sequence of
``--cp-seq-len`` tokens split over cp processes (:mod:`griffin.parallel.context_parallel`); each rank reports the
activation bytes it holds at the end of the forward pass (the peak of activation memory: the distinct storages
autograd keeps for the backward pass, parameters and token ids excluded, as tests/parallel/test_plan.py counts
them), beside the planner's ``activations`` for the same layout (float32):

    python benchmarks/distributed_cpu.py --layouts '' --cp 1,2,4 --cp-seq-len 4096

Writes a Markdown table to stdout and JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, progress, table, write_json  # noqa: E402

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (1, 4, 1), (1, 2, 2), (2, 2, 1), (1, 1, 4)]


def config_of(args: argparse.Namespace):
    from griffin.config import ModelConfig

    return ModelConfig.from_preset("griffin-cpu", width=args.width, rnn_width=args.width * 3 // 2,
                                   num_heads=4, head_dim=args.width // 4, gate_blocks=4, depth=args.depth)


def worker(rank: int, world: int, port: int, layout: tuple[int, int, int], args: argparse.Namespace,
           out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    from griffin.model import CausalLM
    from griffin.parallel import ParallelDims, build_mesh, clip_grad_norm_, parallelize
    from griffin.parallel.plan import Layout, memory_per_device

    config = config_of(args)
    dims = ParallelDims(*layout)
    torch.manual_seed(0)
    model = CausalLM(config)
    if world > 1:
        parallelize(model, build_mesh(dims, "cpu"), dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dims.dp_rank(rank))
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len + 1), generator=gen)

    def step() -> None:
        loss = model(ids[:, :-1], targets=ids[:, 1:]) / ids[:, 1:].numel()
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the gradients allocated, as during a step

    step()
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if world > 1:
        dist.barrier()
    elapsed = time.perf_counter() - start

    def local_bytes(tensors) -> int:
        return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)

    moments = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    held = {"parameters": local_bytes(model.parameters()),
            "gradients": local_bytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer": local_bytes(moments)}
    planned = memory_per_device(config, Layout(*layout), args.seq_len, compute_bytes=4)
    result = {"rank": rank, "held": held, "held_total": sum(held.values()),
              "planned_total": planned["parameters"] + planned["gradients"] + planned["optimizer"],
              "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "tokens_per_s": dims.dp * args.batch * args.seq_len * args.steps / elapsed}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def cp_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """One rank of a cp = world run: its shard of one ``--cp-seq-len`` sequence, the activation bytes autograd keeps."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    from griffin.model import CausalLM
    from griffin.parallel import apply_context_parallel, shard_sequence
    from griffin.parallel.plan import Layout, memory_per_device

    config = config_of(args)
    torch.manual_seed(0)
    model = CausalLM(config)
    if world > 1:
        apply_context_parallel(model, dist.group.WORLD)
    ids = torch.randint(0, config.vocab_size, (1, args.cp_seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = (shard_sequence(t, rank, world) for t in (ids[:, :-1], ids[:, 1:]))
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in (ids, inputs, targets)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(inputs, targets=targets)
    loss.backward()  # (the backward pass's collectives pair up across the ranks)
    elapsed = time.perf_counter() - start
    planned = memory_per_device(config, Layout(cp=world), args.cp_seq_len, compute_bytes=4, loss_chunk=0)
    result = {"rank": rank, "activation_bytes": sum(seen.values()), "planned": planned["activations"],
              "seconds": elapsed, "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def run_cp(cp: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(cp_worker, args=(cp, port, args, out), nprocs=cp, start_method="spawn")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(cp)]
    return {"cp": cp, "tokens_per_rank": args.cp_seq_len // cp, "ranks": ranks,
            "measured_mb": max(r["activation_bytes"] for r in ranks) / 1e6, "planned_mb": ranks[0]["planned"] / 1e6,
            "seconds": max(r["seconds"] for r in ranks), "rss_mb": max(r["max_rss"] for r in ranks) / 1e6}


def run_layout(layout: tuple[int, int, int], args: argparse.Namespace) -> dict:
    from griffin.parallel import ParallelDims

    world = ParallelDims(*layout).world_size
    with tempfile.TemporaryDirectory() as out:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(worker, args=(world, port, layout, args, out), nprocs=world, start_method="spawn")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    return {"layout": "x".join(map(str, layout)), "world": world, "ranks": ranks,
            "held_max": max(r["held_total"] for r in ranks), "planned": ranks[0]["planned_total"],
            "rss_max": max(r["max_rss"] for r in ranks), "tokens_per_s": ranks[0]["tokens_per_s"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up step)")
    parser.add_argument("--layouts", default=",".join("x".join(map(str, lay)) for lay in LAYOUTS),
                        help="dp_replicate x dp_shard x tp, comma separated")
    parser.add_argument("--cp", default="", help="context-parallel sizes to measure activations at, e.g. 1,2,4")
    parser.add_argument("--cp-seq-len", type=int, default=4096, help="the sequence split over the cp ranks")
    parser.add_argument("--out", default="benchmarks/results/distributed_cpu.json")
    args = parser.parse_args(argv)
    layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",") if item]
    from griffin.model import count_parameters

    n_params = count_parameters(config_of(args))
    print(f"Griffin of width {args.width}, depth {args.depth}: {n_params:,} parameters; {args.batch} x {args.seq_len} "
          f"tokens per data-parallel rank, float32, AdamW, {args.steps} timed steps", flush=True)
    rows = []
    bar = progress(len(layouts), "layouts")
    for layout in layouts:
        rows.append(run_layout(layout, args))
        bar.update(1)
    bar.close()
    cp_rows = [run_cp(int(cp), args) for cp in args.cp.split(",") if cp]
    if cp_rows:
        base_cp = cp_rows[0]["measured_mb"] if cp_rows[0]["cp"] == 1 else float("nan")
        for r in cp_rows:
            r["fraction"] = r["measured_mb"] / base_cp
            r["ratio"] = r["measured_mb"] / r["planned_mb"]
        print(f"\nContext parallelism: one sequence of {args.cp_seq_len} tokens, float32, activations per rank at "
              "the end of the forward pass")
        print(table(cp_rows, [("cp", "cp", "d"), ("tokens per rank", "tokens_per_rank", "d"),
                              ("measured MB (max over ranks)", "measured_mb", ".2f"),
                              ("planner MB", "planned_mb", ".2f"), ("measured / planner", "ratio", ".3f"),
                              ("of cp = 1", "fraction", ".3f"), ("forward+backward s", "seconds", ".2f"),
                              ("peak RSS per rank MB", "rss_mb", ".0f")]))
    if not rows:
        write_json(args.out, {"machine": machine_info(torch.device("cpu")), "args": vars(args), "cp": cp_rows})
        return 0
    base = rows[0]["held_max"] if rows and rows[0]["world"] == 1 else None
    for r in rows:
        r["held_mb"] = r["held_max"] / 1e6
        r["planned_mb"] = r["planned"] / 1e6
        r["fraction"] = r["held_max"] / base if base else float("nan")
        r["rss_mb"] = r["rss_max"] / 1e6
    print(table(rows, [("layout (R x S x T)", "layout", "s"), ("processes", "world", "d"),
                       ("held per rank MB (params+grads+AdamW)", "held_mb", ".2f"),
                       ("planner MB", "planned_mb", ".2f"), ("of one process", "fraction", ".3f"),
                       ("peak RSS per rank MB", "rss_mb", ".0f"), ("tokens/s", "tokens_per_s", ",.0f")]))
    write_json(args.out, {"machine": machine_info(torch.device("cpu")), "parameters": n_params,
                          "args": vars(args), "rows": rows, "cp": cp_rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
