"""``griffin plan``: the cluster planner on the command line (:mod:`griffin.parallel.plan`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from griffin.arguments import renamed
from griffin.config import PRESETS, ModelConfig
from griffin.io import write_json
from griffin.parallel.context_parallel import check_context_parallel
from griffin.parallel.plan import GPUS, Layout, describe, estimate, format_plan, plan


def cmd_plan(args: argparse.Namespace) -> int:
    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; see `griffin presets`")
    config = ModelConfig.from_preset(args.preset)
    gpu = GPUS[args.gpu]
    if args.gpus < 1:
        raise ValueError(f"--gpus {args.gpus} must be positive")
    cp = args.cp
    check_context_parallel(config, cp, args.seq_len)
    if args.tp or args.dp_shard or args.dp_replicate:  # one layout, in detail
        tp, dp_shard = args.tp or 1, args.dp_shard or 1
        cp_text = f" × cp={cp}" if cp > 1 else ""
        if args.gpus % (tp * dp_shard * cp):
            raise ValueError(f"tp={tp} × dp_shard={dp_shard}{cp_text} does not divide --gpus {args.gpus}")
        replicate = args.dp_replicate or args.gpus // (tp * dp_shard * cp)
        if replicate * dp_shard * cp * tp != args.gpus:
            raise ValueError(f"dp_replicate={replicate} × dp_shard={dp_shard}{cp_text} × tp={tp} = "
                             f"{replicate * dp_shard * cp * tp}, not --gpus {args.gpus}")
        layout = Layout(replicate, dp_shard, tp, args.micro_batch, args.activation_checkpointing,
                        args.sequence_parallel, args.cpu_offload, cp)
        estimates = [estimate(config, gpu, layout, args.seq_len, args.global_batch, args.loss_chunk)]
        e = estimates[0]
        print(f"{args.preset} on {args.gpus} x {gpu.name}: {describe(e)}; {'fits' if e.fits else 'does NOT fit'}")
        print("  memory per GPU: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in e.memory.items()))
        print("  communication per GPU per step: " + ", ".join(f"{k} {v / 1e9:.1f} GB"
                                                             for k, v in e.communication.items()))
        print("  time per step: " + ", ".join(f"{k} {v:.3f} s" for k, v in e.time.items()))
    else:
        estimates = plan(config, args.gpus, gpu, args.seq_len, args.global_batch, args.loss_chunk, cp)
        print(format_plan(config, estimates, gpu, args.gpus, args.seq_len, args.global_batch, args.top))
    if args.json:
        write_json(Path(args.json), {"preset": args.preset, "gpus": args.gpus, "gpu": args.gpu,
                                     "seq_len": args.seq_len, "global_batch": args.global_batch,
                                     "estimates": [json.loads(json.dumps(e.to_dict())) for e in estimates]})
    return 0


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="the cluster planner: memory, communication, step time and MFU of each layout of "
                       "a model on N GPUs (docs/distributed.md)")
    p.add_argument("preset", help="a model preset, e.g. griffin-7b, hawk-14b, recurrentgemma-9b (`griffin presets`)")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="GPU kind")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (the paper's)")
    renamed(p, "--global-batch", p.add_argument("--global-batch-size", type=int, default=1024, dest="global_batch",
                                                help="sequences per optimizer step"))
    p.add_argument("--loss-chunk", type=int, default=4096, help="rows of logits at a time in the loss (0: all)")
    p.add_argument("--top", type=int, default=12, help="layouts shown")
    p.add_argument("--tp", type=int, default=0, help="evaluate this layout only (with --dp-shard, --dp-replicate)")
    p.add_argument("--dp-shard", type=int, default=0,
                   help="evaluate one layout with this many ZeRO-3 shards (0: 1 when --tp or --dp-replicate is given)")
    p.add_argument("--dp-replicate", type=int, default=0,
                   help="evaluate one layout with this many replicas (0: the GPUs that tp and dp_shard leave)")
    p.add_argument("--cp", type=int, default=1,
                   help="context parallelism: each sequence split over this many GPUs (activations ÷ cp, plus the "
                        "carry, halo and key/value exchanges); the other dims share the GPUs it leaves")
    renamed(p, "--micro-batch", p.add_argument("--micro-batch-size", type=int, default=1, dest="micro_batch",
                                               help="sequences per GPU per micro-step (one layout)"))
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="count activations as recomputed per block (only block inputs kept)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="count norms and the residual stream split along the sequence over the tp devices")
    p.add_argument("--cpu-offload", action="store_true",
                   help="count FSDP's sharded parameters, gradients and optimizer states as held in CPU memory")
    p.add_argument("--json", metavar="PATH", help="also write every estimate as JSON")
    p.set_defaults(func=cmd_plan)


__all__ = ["add_plan_parser", "cmd_plan"]
