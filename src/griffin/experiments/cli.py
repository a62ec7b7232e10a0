"""``griffin experiment scaling | long-context | window``: build the grid, train what is not done, analyse, plot."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from griffin.arguments import renamed
from griffin.config import FAMILIES
from griffin.experiments.scaling import check_families

EXPERIMENTS = ("scaling", "long-context", "window")
SHAPE_FLAGS = ("seq_len", "batch_size", "steps", "width", "depth", "lr")


def _settings(items: list[str] | None) -> dict[str, Any]:
    """``--set key=value`` training settings for every run (``device=cuda``, ``precision=bf16``, ``compile=true``)."""
    from griffin.training import TrainConfig
    from griffin.training.config import parse_model_override

    names = set(TrainConfig.__dataclass_fields__)
    out = {}
    for item in items or []:
        key, value = parse_model_override(item)
        if key not in names:
            raise ValueError(f"--set {item!r}: {key!r} is not a griffin train setting")
        if key in ("model", "out", "data", "resume", "seq_len", "batch_size", "max_steps"):
            raise ValueError(f"--set {key}=...: the experiment sets {key} itself")
        out[key] = value
    return out


def build_grid(args: argparse.Namespace):
    data = {"data": ",".join(str(Path(p).resolve()) for p in args.data) if args.data else "",
            "tokenizer": args.tokenizer}
    families = tuple(args.families) if args.families else None
    check_families(families or ())
    shape = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
    if args.experiment == "scaling":
        from griffin.experiments.scaling import paper_ladder, scaling_grid

        if shape:
            raise ValueError(f"--{next(iter(shape)).replace('_', '-')} sets the runs of long-context and window; the "
                             "scaling ladder's sizes and lengths come from the ladder (--config FILE)")
        ladder = paper_ladder(args.config) if args.config else None
        grid = scaling_grid(args.budget, families, ladder, data)
    elif args.config:
        raise ValueError(f"--config is a ladder file of the scaling experiment, not of {args.experiment}")
    elif args.experiment == "long-context":
        from griffin.experiments.long_context import long_context_grid

        grid = long_context_grid(families or FAMILIES, budget=args.budget, data=data, **shape)
    else:
        if families:
            raise ValueError("the window experiment compares Griffin with MQA (global and local): --families does not "
                             "apply")
        from griffin.experiments.window import window_grid

        grid = window_grid(budget=args.budget, data=data, **shape)
    extra = _settings(args.set)
    for run in grid.runs:
        run.settings.update(extra)
    if args.data_parallel > 1:
        if not args.launcher:
            raise ValueError("--data-parallel needs --launcher (the command that starts the ranks, e.g. torchrun)")
        grid.split_batch(args.data_parallel)
    return grid


def cmd_experiment(args: argparse.Namespace) -> int:
    from griffin.experiments.runner import describe_grid, run_grid

    grid = build_grid(args)
    grid.check()
    out = Path(args.out or f"runs/experiments/{args.experiment}")
    if args.dry_run:
        rows = describe_grid(grid)
        print(f"{grid.experiment}: {len(rows)} runs, {sum(r['flops'] for r in rows):.3e} training FLOPs in all")
        for r in rows:
            print(f"  {r['name']:<28} {r['parameters']:>12,} parameters {r['tokens']:>14,} tokens "
                  f"{r['flops']:.3e} FLOPs")
        return 0
    evaluate = None
    if args.experiment == "long-context":
        from griffin.experiments.long_context import per_position_evaluation

        evaluate = per_position_evaluation(grid.meta["eval_length"])
    results = run_grid(grid, out, workers=args.workers, threads=args.threads, launcher=args.launcher,
                       evaluate=evaluate, progress=args.progress)
    if args.experiment == "scaling":
        from griffin.experiments.scaling import analyse
    elif args.experiment == "long-context":
        from griffin.experiments.long_context import analyse
    else:
        from griffin.experiments.window import analyse
    summary = analyse(results, out)
    print(summary["table"])
    if "measured" in summary:
        print(summary["measured"])
    print(f"wrote {out / 'results.json'} and the analysis beside it")
    return 0


def add_experiment_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("experiment", help="the paper's training experiments: scaling curves (Figure 1a), "
                       "long-context training (Figure 5), the local-attention window (Appendix F)",
                       epilog="examples:\n"
                              "  griffin experiment scaling --dry-run            the CPU ladder, without training\n"
                              "  griffin experiment scaling --budget 0.5 --workers 2\n"
                              "  griffin experiment long-context --out runs/exp/long\n"
                              "  griffin experiment window --budget 0.5\n"
                              "  griffin experiment scaling --config configs/experiments/scaling-paper.toml "
                              "--data DATA \\\n      --launcher 'torchrun --nproc-per-node 8' --set device=cuda "
                              "--set compile=true\n")
    p.add_argument("experiment", choices=EXPERIMENTS, help="which experiment")
    p.add_argument("--out", help="directory of the runs, results.json and plots (default: runs/experiments/NAME); "
                   "running again skips finished runs and resumes an interrupted one")
    p.add_argument("--budget", type=float, default=1.0, help="scale every run's training tokens (and steps)")
    p.add_argument("--families", nargs="+", metavar="FAMILY", help=f"a subset of {', '.join(FAMILIES)}")
    p.add_argument("--config", help="scaling: a ladder file (configs/experiments/scaling-paper.toml: the paper's "
                   "sizes and token counts)")
    shape = p.add_argument_group("long-context and window runs (defaults: the CPU sizes in docs/experiments.md)")
    shape.add_argument("--seq-len", type=int, help="the base training length T")
    shape.add_argument("--batch-size", type=int, help="sequences per step at T (divided by the length factor above T)")
    renamed(shape, "--steps", shape.add_argument("--max-steps", type=int, dest="steps",
                                                 help="optimizer steps of every run (before --budget)"))
    shape.add_argument("--width", type=int, help="model width D (the shape rules of the scaling ladder)")
    shape.add_argument("--depth", type=int, help="residual blocks")
    shape.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--data", nargs="+", help="a dataset from `griffin prepare`, or text/JSONL/parquet files "
                   "(default: the embedded corpus, the Python standard library's source)")
    p.add_argument("--tokenizer", default="bytes", help="tokenizer for --data files that must be prepared")
    p.add_argument("--workers", type=int, default=1, help="runs trained at the same time")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per run (0: the cores shared by the workers)")
    p.add_argument("--launcher", help="command that replaces `python` for each run, e.g. "
                   "'torchrun --nproc-per-node 8' (the distributed trainer)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="N", help="data-parallel ranks the launcher "
                   "starts for each run (processes / tp): each takes 1/N of the batch, so the global batch and the "
                   "tokens stay the experiment's")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="a griffin train setting for every run "
                   "(device=cuda, precision=bf16, compile=true, tp=2, ...)")
    p.add_argument("--dry-run", action="store_true", help="list the runs with their parameters, tokens and FLOPs")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    p.set_defaults(func=cmd_experiment)
