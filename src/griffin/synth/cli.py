"""The ``griffin synth`` command line: ``griffin synth TASK``, ``griffin synth eval DIR``, ``griffin synth compare
TASK`` (Section 6.2). :func:`add_synth_parser` adds it to the ``griffin`` parser."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from griffin.arguments import renamed
from griffin.config import FAMILIES
from griffin.synth.source import DRAWS, EPISODES
from griffin.synth.tasks import TASKS, make_task
from griffin.training.config import PRECISIONS

DESCRIPTION = """Copy and retrieval tasks trained from scratch (Section 6.2, Figure 6a/6b, Appendix H).

  griffin synth TASK --family hawk --out DIR      train one family (TASK: selective-copying, induction-heads, mqar)
  griffin synth eval DIR --lengths 256 4096       accuracy of a trained run at other sequence lengths
  griffin synth compare TASK --out DIR            the three families, same budget and seed: plots and a table
  griffin synth plot DIR... --out OUT             the accuracy curves of runs, finished or not

The tasks' defaults are the paper's (Zoology's for MQAR); docs/experiments.md gives the smaller settings that train
in minutes on a CPU, and what they showed."""

ALIASES = {name: [name.replace("_", "-")] if "_" in name else [] for name in TASKS}


TASK_OPTIONS = {"selective_copying": ("num_data",), "induction_heads": (), "mqar": ("num_pairs", "power_a")}
"""The options of each task beyond its length and vocabulary (``griffin synth compare`` takes those of its task)."""


def _task_options(p: argparse.ArgumentParser, task: str | None = None) -> None:
    """The task's settings; ``task`` None: those of every task (``compare``, whose task is an argument)."""
    g = p.add_argument_group("task (defaults: the paper's / Zoology's settings)")
    g.add_argument("--seq-len", type=int, help="training sequence length (1024 / 256 / 256)")
    g.add_argument("--vocab-size", type=int, help="vocabulary (16 / 16 / 8192)")
    own = {k for name, keys in TASK_OPTIONS.items() if task in (None, name) for k in keys}
    if "num_data" in own:
        g.add_argument("--num-data", type=int, help="selective copying: data tokens to copy (16)")
    if "num_pairs" in own:
        g.add_argument("--num-pairs", type=int, help="mqar: key-value pairs (64)")
    if "power_a" in own:
        g.add_argument("--power-a", type=float, help="mqar: power law of the query gaps (0.01)")


def _train_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training (defaults: the task's CPU budget, see docs/experiments.md)")
    renamed(g, "--steps", g.add_argument("--max-steps", type=int, dest="steps", help="optimizer steps"))
    renamed(g, "--batch", g.add_argument("--batch-size", type=int, help="sequences per step"))
    g.add_argument("--lr", type=float, help="peak learning rate (AdamW, warm-up then cosine decay)")
    g.add_argument("--warmup-steps", type=int, help="linear warm-up steps (default: min(50, steps / 10))")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    g.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the training stream")
    renamed(g, "--eval-every", g.add_argument("--eval-interval", type=int, dest="eval_every",
                                              help="evaluate on the fixed held-out set every N steps"))
    g.add_argument("--eval-sequences", type=int, help="sequences in the held-out set")
    g.add_argument("--window", type=int,
                   help="Griffin's local-attention window (default: the paper's, 512 / 128 / 128, at most half of "
                        "--seq-len)")
    g.add_argument("--model", action="append", metavar="KEY=VALUE",
                   help="ModelConfig fields overriding the preset, e.g. width=128 (repeatable)")
    g.add_argument("--stop-accuracy", type=float, metavar="A",
                   help="end a run at the first evaluation whose held-out accuracy is at least A (e.g. 0.99)")
    g.add_argument("--compile", action="store_true",
                   help="the trainer's compiled step (griffin train --compile; refused where it cannot compile)")
    g.add_argument("--compile-fallback", action="store_true",
                   help="where --compile cannot run, train the uncompiled step with a warning instead of refusing")
    g.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="bf16: autocast (with --compile, refused on a CPU without a bf16 matmul); auto: bf16 on CUDA "
                        "where supported, else fp32 (griffin train --precision)")
    g.add_argument("--prefix-stream", action="store_true",
                   help="induction heads, Hawk and Griffin: each training sequence continues a stream of random "
                        "tokens (no trigger) advanced --seq-len tokens a step without gradients, so that training "
                        "meets the states long prefixes reach (docs/experiments.md)")
    g.add_argument("--stream-recall", type=int, default=0, metavar="K",
                   help="with --prefix-stream: half the rows ask for an answer their stream took in 1 to K steps "
                        "before (up to K x --stream-advance tokens back; the gradient stops at the stream's state)")
    g.add_argument("--stream-advance", type=int, default=None, metavar="N",
                   help="with --prefix-stream: the filler tokens the stream takes in each step (default: --seq-len); "
                        "--stream-recall K then asks up to K x N tokens back")
    g.add_argument("--recall-episodes", choices=EPISODES, default=EPISODES[0],
                   help="with --stream-recall, where an episode writes its answer: new-document (into an empty "
                        "state), after-filler (a new document, after 0 to K-1 steps of filler), continue (into the "
                        "stream as it is, over the earlier episodes' answers)")
    g.add_argument("--recall-draw", choices=DRAWS, default=DRAWS[0],
                   help="with --stream-recall, how each episode's steps k are drawn from 1 to K: log-uniform (most "
                        "answers near) or uniform (a quarter of the asks from the farthest half)")
    g.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    g.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="TensorBoard events in OUT/tensorboard")


def _length_options(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--lengths", type=int, nargs="+", required=required, metavar="T",
                   help="evaluation sequence lengths, e.g. 256 1024 4096 65536")
    p.add_argument("--sequences", type=int, default=32, help="held-out sequences per length")
    renamed(p, "--eval-batch", p.add_argument("--eval-batch-size", type=int, default=8, dest="eval_batch",
                                              help="sequences per forward pass of the evaluation"))
    p.add_argument("--chunk-size", type=int, default=1024,
                   help="tokens per chunk of the cached forward: bounds the memory of Hawk and Griffin")


def _task(args: argparse.Namespace, name: str):
    return make_task(name, seq_len=args.seq_len, vocab_size=args.vocab_size, num_data=getattr(args, "num_data", None),
                     num_pairs=getattr(args, "num_pairs", None), power_a=getattr(args, "power_a", None))


def _train_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from griffin.training.config import parse_model_override

    model = dict(parse_model_override(item) for item in args.model or [])
    return dict(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                weight_decay=args.weight_decay, seed=args.seed, eval_every=args.eval_every,
                eval_sequences=args.eval_sequences, window=args.window, model=model,
                stop_accuracy=args.stop_accuracy, compile=args.compile, precision=args.precision,
                compile_fallback=args.compile_fallback, init=getattr(args, "init", None),
                prefix_stream=args.prefix_stream, stream_recall=args.stream_recall,
                recall_episodes=args.recall_episodes, recall_draw=args.recall_draw,
                stream_advance=args.stream_advance)


def _stopped(stopped: Exception, hint: str) -> int:
    """What ``griffin synth`` says and returns when SIGTERM stopped it (after the checkpoint of its step)."""
    print(f"griffin synth: {stopped}; {hint}", file=sys.stderr)
    return 128 + signal.SIGTERM


def cmd_train(args: argparse.Namespace) -> int:
    from griffin.synth.train import train_task
    from griffin.training import StopRequest, TrainingStopped

    task = _task(args, args.task)
    # SIGTERM (a scheduler's notice): stop at the next step with its checkpoint written; --resume continues it
    with StopRequest.on_signal(signal.SIGTERM) as stop:
        try:
            result = train_task(task, args.family, args.out, resume=args.resume, progress=args.progress,
                                tensorboard=args.tensorboard, threads=args.threads, stop=stop, **_train_kwargs(args))
        except TrainingStopped as stopped:
            return _stopped(stopped, "continue with the same command and --resume")
    print(f"\n{args.family} on {task}: held-out accuracy {result.accuracy:.4f} "
          f"(perfect sequences {result.perfect:.4f}) after {result.steps} steps; 90% at step {result.steps_to_90}, "
          f"99% at step {result.steps_to_99}; {result.wall_s:.0f} s")
    print(f"model + task: {args.out} (griffin synth eval {args.out} --lengths ...)   curve: "
          f"{Path(args.out) / 'accuracy.png'}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from griffin.io import write_json
    from griffin.synth.ablation import check_silenceable, silenced_prefix
    from griffin.synth.evaluate import evaluate_lengths, load_run
    from griffin.synth.plots import plot_answer_channels, plot_silenced_prefix
    from griffin.synth.tasks import InductionHeads

    model, task = load_run(args.dir)
    if args.horizons:  # refused before the evaluation runs
        task.with_length(args.horizons)
        if "recurrent" not in model.config.block_types or model.config.complex_lru:
            raise ValueError(f"--horizons: {args.dir} is an {model.config.family} model without an RG-LRU "
                             "(no recurrent block, or the complex CG-LRU)")
    for flag, asked in (("--silence-prefix", args.silence_prefix), ("--answer-channels", args.answer_channels)):
        if asked and task.name != "induction_heads":
            raise ValueError(f"{flag}: {args.dir} was trained on {task.name}; the prefix and the answer are those of "
                             "an induction-heads sequence (before its trigger, and after it)")
        if asked:
            check_silenceable(model)
    kwargs = dict(sequences=args.sequences, batch_size=args.eval_batch, chunk_size=args.chunk_size,
                  progress=args.progress, distance_bins=args.distance_bins)
    results = evaluate_lengths(model, task, args.lengths, **kwargs)
    print(f"{model.config.family} on {task} (trained at {task.seq_len}):")
    _print_lengths(results, args.distance_bins)
    record = {"task": task.to_dict(), "family": model.config.family, "lengths": results}
    if args.silence_prefix:
        with silenced_prefix(model, InductionHeads.TRIGGER):
            record["silenced_prefix"] = evaluate_lengths(model, task, args.lengths, **kwargs)
        print("\nthe same sequences, every RG-LRU's writes silenced before the first trigger (gates unchanged):")
        _print_lengths(record["silenced_prefix"], args.distance_bins)
        if args.distance_bins:
            figure = Path(args.out or args.dir) / "silenced_prefix.png"
            plot_silenced_prefix(record, figure, f"{model.config.family}, trained at T = {task.seq_len}")
            print(f"wrote {figure}")
    if args.horizons:
        record["horizons"] = _horizons(model, task, args.horizons, min(args.sequences, args.eval_batch))
    if args.answer_channels:
        record["answer_channels"] = _answer_channels(model, task, args.lengths, args.sequences, args.eval_batch)
        figure = Path(args.out or args.dir) / "answer_channels.png"
        plot_answer_channels(record, figure, f"{model.config.family}, trained at T = {task.seq_len}")
        print(f"wrote {figure}")
    out = Path(args.out or args.dir) / "lengths.json"
    write_json(out, record)
    print(f"wrote {out}")
    return 0


def _print_lengths(results: list[dict[str, Any]], distance_bins: int) -> None:
    print("| length | accuracy | perfect sequences | loss | seconds |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['length']:,} | {r['accuracy']:.4f} | {r['perfect']:.4f} | {r['val_loss']:.4f} | "
              f"{r['seconds']:.1f} |")
    if distance_bins:
        print("\naccuracy by recall distance (answers in the bin):\n| length | distance | answers | accuracy |\n"
              "|---|---|---|---|")
        for r in results:
            for b in r["by_distance"]:
                print(f"| {r['length']:,} | {b['from']:,}–{b['to'] - 1:,} | {b['answers']} | {b['accuracy']:.4f} |")


def _horizons(model, task, length: int, sequences: int) -> dict[str, Any]:
    """Print and return the memory horizons (:func:`griffin.synth.evaluate.memory_horizons`) of each recurrent
    block on held-out sequences of ``length``: the longest channel's, the median channel's."""
    from griffin.synth.evaluate import held_out, memory_horizons

    t = task.with_length(length)
    horizons = memory_horizons(model, held_out(t, sequences, sequences)[0].input_ids)
    rows = [{"block": i, "longest": float(h.max()), "median": float(h.median())}
            for i, h in zip([i for i, k in enumerate(model.config.block_types) if k == "recurrent"], horizons,
                            strict=True)]
    print(f"\nmemory horizons (tokens after which a channel keeps e^-1 of its state; {sequences} sequences of "
          f"{length:,}):\n| block | longest channel | median channel |\n|---|---|---|")
    for r in rows:
        print(f"| {r['block']} | {r['longest']:,.0f} | {r['median']:,.0f} |")
    return {"length": length, "sequences": sequences, "blocks": rows}


def _answer_channels(model, task, lengths: list[int], sequences: int, batch_size: int) -> list[dict[str, Any]]:
    """Print and return, per length and recurrent block, the channel that holds the answer
    (:func:`griffin.synth.ablation.answer_channels`) on the held-out sequences of that length."""
    import torch

    from griffin.synth.ablation import answer_channels, answer_shares
    from griffin.synth.evaluate import held_out
    from griffin.synth.tasks import InductionHeads

    blocks = [i for i, k in enumerate(model.config.block_types) if k == "recurrent"]
    out = []
    print("\nthe answer's channel per recurrent block: the RG-LRU state at the final trigger split into what the "
          "writes before the first trigger, while it is in the Conv1D's view (the answer) and after it left there; "
          "the channel whose answer / |prefix + after| (median over the sequences) is largest\n"
          "| length | block | channel | answer / rest | answer | prefix | after | its horizon | channels >= 1 | "
          "state RMS |\n|---|---|---|---|---|---|---|---|---|---|")
    for length in lengths:
        batches = held_out(task.with_length(length), sequences, batch_size)
        per_batch = [answer_shares(model, b.input_ids, InductionHeads.TRIGGER) for b in batches]
        n = [len(b.input_ids) for b in batches]
        merged = [(torch.cat([p[i][0] for p in per_batch], 1),
                   sum(p[i][1] * k for p, k in zip(per_batch, n, strict=True)) / sum(n))
                  for i in range(len(blocks))]
        rows = [{"block": b, **r} for b, r in zip(blocks, answer_channels(merged), strict=True)]
        for r in rows:
            print(f"| {length:,} | {r['block']} | {r['channel']} | {r['ratio']:.3g} | {r['answer']:.3g} | "
                  f"{r['prefix']:.3g} | {r['after']:.3g} | {r['horizon']:,.0f} | {r['channels_over_1']} | "
                  f"{r['state_rms']:.3g} |")
        out.append({"length": length, "sequences": sum(n), "blocks": rows})
    return out


def cmd_plot(args: argparse.Namespace) -> int:
    from griffin.synth.evaluate import run_files
    from griffin.synth.plots import plot_accuracy, plot_lengths, run_curve, run_lengths

    labels = args.label or [Path(d).name for d in args.dirs]
    if len(labels) != len(args.dirs):
        raise ValueError(f"{len(labels)} --label for {len(args.dirs)} run directories: give one per run or none")
    curves = {label: run_curve(d) for label, d in zip(labels, args.dirs, strict=True)}
    out = Path(args.out) / "accuracy.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_accuracy(curves, out, args.title)
    for label, points in curves.items():
        best = max(points, key=lambda p: p[1])
        print(f"{label}: {len(points)} evaluations to step {points[-1][0]:,}; last {points[-1][1]:.4f}, best "
              f"{best[1]:.4f} at step {best[0]:,}")
    print(f"wrote {out}")
    lengths = {label: run_lengths(d) for label, d in zip(labels, args.dirs, strict=True)}
    if any(lengths.values()):  # runs evaluated at other lengths (griffin synth eval DIR): Figure 6b's axes
        trained = {run_files(d)[0].seq_len for d, points in zip(args.dirs, lengths.values(), strict=True) if points}
        out = Path(args.out) / "lengths.png"
        plot_lengths(lengths, out, args.title, train_length=trained.pop() if len(trained) == 1 else None)
        for label, points in lengths.items():
            if points:
                print(f"{label}: " + ", ".join(f"{acc:.3f} at {n:,}" for n, acc in points))
        print(f"wrote {out}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from griffin.synth.compare import compare
    from griffin.training import StopRequest, TrainingStopped

    task = _task(args, args.task)
    lengths = args.lengths
    if lengths is None and task.name == "induction_heads":
        from griffin.synth.evaluate import default_lengths

        lengths = default_lengths(task)
    with StopRequest.on_signal(signal.SIGTERM) as stop:
        try:
            summary = compare(task, args.out, args.families, lengths=lengths or (),
                              attention_max_length=args.attention_max_length, eval_length_sequences=args.sequences,
                              eval_batch_size=args.eval_batch, chunk_size=args.chunk_size, progress=args.progress,
                              tensorboard=args.tensorboard, threads=args.threads, stop=stop, **_train_kwargs(args))
        except TrainingStopped as stopped:
            return _stopped(stopped, "run the same command again to go on")
    print((Path(args.out) / "table.md").read_text())
    print(f"wrote {args.out}/accuracy.png" + (f", {args.out}/lengths.png" if summary["lengths"] else "")
          + ", compare.json, table.md")
    return 0


def add_synth_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``griffin synth`` and its sub-commands to the ``griffin`` parser's sub-commands."""
    p = sub.add_parser("synth", help="copy and retrieval tasks trained from scratch (Section 6.2): selective "
                       "copying, induction heads, MQAR", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="synth_command", required=True, metavar="{TASK,eval,compare}")
    for name in TASKS:
        t = actions.add_parser(name, aliases=ALIASES[name], help=f"train one family on {name}")
        t.add_argument("--family", choices=FAMILIES, default="griffin", help="model family")
        t.add_argument("--out", required=True, help="run directory: checkpoints, logs, the final model, task.json")
        t.add_argument("--resume", action="store_true", help="continue the run in OUT from its newest checkpoint")
        t.add_argument("--init", metavar="DIR",
                       help="start from the model of another run of this task and family, or from one of its "
                            "checkpoints (e.g. trained at a shorter --seq-len: a length curriculum), instead of a new "
                            "model")
        _task_options(t, name)
        _train_options(t)
        t.set_defaults(func=cmd_train, task=name)

    e = actions.add_parser("eval", help="accuracy of a trained run at other sequence lengths")
    e.add_argument("dir", help="a `griffin synth` run directory (model + task.json), or one of its checkpoints "
                               "(DIR/checkpoints/NAME: a run not finished or stopped)")
    _length_options(e, required=True)
    e.add_argument("--distance-bins", type=int, default=0, metavar="K",
                   help="also split each length's accuracy by how far back the answer lies: K equal bins of "
                        "1 .. length - 1 (e.g. 4 at T = 256 puts Griffin's window of 128 at a bin edge)")
    e.add_argument("--horizons", type=int, default=0, metavar="N",
                   help="also each recurrent block's memory horizons (tokens after which an RG-LRU channel keeps "
                        "e^-1 of its state), measured on held-out sequences of length N (e.g. 4096)")
    e.add_argument("--answer-channels", action="store_true",
                   help="induction heads: also, at each length, the channel of each recurrent block that holds the "
                        "answer: its state at the final trigger split into the writes before the trigger, the answer's "
                        "and the later ones (on --sequences sequences, one forward each, no cache)")
    e.add_argument("--silence-prefix", action="store_true",
                   help="induction heads: also evaluate with every RG-LRU's writes silenced before the first trigger "
                        "(the gates unchanged): how much of what is lost at a length is the prefix written before it")
    e.add_argument("--out", help="directory of lengths.json (default: DIR)")
    e.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    e.set_defaults(func=cmd_eval)

    g = actions.add_parser("plot", help="held-out accuracy against training step of runs, finished or not, from their "
                           "log.jsonl; and against the evaluation length of those evaluated (lengths.json)")
    g.add_argument("dirs", nargs="+", metavar="DIR", help="`griffin synth` run directories, or their checkpoints "
                   "(DIR/checkpoints/NAME: the run's curve to that step, and the checkpoint's own lengths.json)")
    g.add_argument("--out", required=True, help="output directory (accuracy.png; lengths.png if a DIR holds the "
                                                "lengths.json of `griffin synth eval DIR`)")
    g.add_argument("--label", action="append", help="a run's name in the legend, one per DIR in order (default: "
                   "the directories' names)")
    g.add_argument("--title", default="held-out accuracy", help="the plot's title")
    g.set_defaults(func=cmd_plot)

    c = actions.add_parser("compare", help="the three families with the same budget and seeds: Figure 6a/6b plots "
                           "and a table")
    c.add_argument("task", type=lambda name: name.replace("-", "_"), choices=sorted(TASKS), help="the task")
    c.add_argument("--out", required=True, help="output directory (one run directory per family, plots, table)")
    c.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES), help="families to compare")
    c.add_argument("--init", metavar="DIR",
                   help="start each family from DIR/FAMILY, the run of an earlier `synth compare` of this task (e.g. "
                        "at a shorter --seq-len: a length curriculum), instead of a new model")
    _task_options(c)
    _train_options(c)
    _length_options(c, required=False)  # induction heads: 256, 512, ..., 65536 unless given
    c.add_argument("--attention-max-length", type=int, default=8192,
                   help="evaluate global attention (MQA) up to this length only: its cost grows with the square of "
                        "the length")
    c.set_defaults(func=cmd_compare)
