"""``griffin eval loss | harness | export-tasks | phonebook``: the command line of :mod:`griffin.evaluation`.

Every input is checked (checkpoints, tokenizers, data, tasks) before anything is computed; results are written at
the end, atomically (JSON beside the PNG plots)."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

from griffin.interop import DTYPES
from griffin.io import write_json

LOSS_JSON, POSITION_JSON, POSITION_PNG = "loss.json", "per_position.json", "per_position.png"
PHONEBOOK_JSON, PHONEBOOK_PNG = "phonebook.json", "phonebook.png"


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _labels(checkpoints: list[str], labels: list[str] | None, models: list[Any]) -> list[str]:
    if labels:
        if len(labels) != len(checkpoints):
            raise ValueError(f"{len(labels)} --label for {len(checkpoints)} checkpoints")
        return labels
    names = [m.config.name or m.config.family for m in models]
    return names if len(set(names)) == len(names) else [f"{n} ({c})" for n, c in zip(names, checkpoints, strict=True)]


def train_length(checkpoint: str | Path) -> int | None:
    """The sequence length a ``griffin train`` checkpoint was trained with (from its trainer state), if known."""
    from griffin.training.checkpoint import TRAINER_STATE

    path = Path(checkpoint) / TRAINER_STATE
    try:
        return int(json.loads(path.read_text())["config"]["seq_len"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def _load_all(args: argparse.Namespace):
    from griffin.evaluation.loading import load_for_eval

    loaded = [load_for_eval(c, args.tokenizer, args.dtype, args.device) for c in args.checkpoints]
    models = [m for m, _ in loaded]
    return loaded, _labels(args.checkpoints, args.label, models)


def cmd_loss(args: argparse.Namespace) -> int:
    from griffin.evaluation.documents import load_documents
    from griffin.evaluation.loss import evaluate_loss, per_position_loss
    from griffin.evaluation.plots import plot_per_position

    if args.per_position and args.max_length is None:
        raise ValueError("--per-position needs --max-length L (e.g. 16x the training length)")
    loaded, labels = _load_all(args)
    docs = {}
    for (_, tok), ckpt in zip(loaded, args.checkpoints, strict=True):  # every tokenizer checked against the data
        stream = load_documents(args.data, tok, split=args.split, text_field=args.text_field)
        docs[ckpt] = list(stream if args.per_position else itertools.islice(stream, args.max_documents))
    if args.per_position:
        longest = max(len(d) for d in docs[args.checkpoints[0]])
        if longest < args.max_length:
            raise ValueError(f"no document of {args.data} has --max-length={args.max_length} tokens (the longest "
                             f"has {longest}): lower --max-length or give longer documents")
    out = Path(args.out)
    results: dict[str, Any] = {}
    timing: dict[str, float] = {}
    for (model, tok), ckpt, label in zip(loaded, args.checkpoints, labels, strict=True):
        start = time.perf_counter()
        if args.per_position:
            r = per_position_loss(model, docs[ckpt], args.max_length, chunk_size=args.chunk_size,
                                  batch_size=args.batch_size, num_buckets=args.buckets,
                                  max_documents=args.max_documents)
            print(f"{label}: {r.documents} documents of >= {args.max_length} tokens ({r.short_documents} shorter, "
                  f"left out); loss by position:")
            for a, b, loss in zip(r.bucket_start, r.bucket_end, r.bucket_loss, strict=True):
                print(f"  [{a:>6}, {b:>6}): {loss:.4f}")
        else:
            r = evaluate_loss(model, docs[ckpt], tok, chunk_size=args.chunk_size, batch_size=args.batch_size)
            bpb = f"{r.bits_per_byte:.4f}" if r.bits_per_byte is not None else "n/a"
            print(f"{label}: {r.documents} documents, {r.tokens:,} tokens: loss {r.mean_loss:.4f} nats/token, "
                  f"perplexity {r.perplexity:.3f}, {bpb} bits/byte")
        timing[label] = time.perf_counter() - start
        results[label] = r
    payload = {"data": str(args.data), "split": args.split, "chunk_size": args.chunk_size,
               "checkpoints": dict(zip(labels, args.checkpoints, strict=True)), "seconds": timing,
               "results": {k: v.to_dict() for k, v in results.items()}}
    if args.per_position:
        payload["max_length"] = args.max_length
        payload["train_length"] = {lab: train_length(c) for lab, c in zip(labels, args.checkpoints, strict=True)}
        write_json(out / POSITION_JSON, payload)
        plot_per_position(results, out / POSITION_PNG,
                          {k: v for k, v in payload["train_length"].items() if v is not None})
        print(f"wrote {out / POSITION_JSON} and {out / POSITION_PNG}")
    else:
        write_json(out / LOSS_JSON, payload)
        print(f"wrote {out / LOSS_JSON}")
    return 0


def cmd_harness(args: argparse.Namespace) -> int:
    try:
        from griffin.evaluation.harness import evaluate_tasks
    except ImportError as err:
        raise ValueError(f"griffin eval harness needs lm-evaluation-harness ({err}): pip install 'griffin[eval]'") \
            from None
    from griffin.evaluation.tasks import expand

    tasks = [t for t in args.tasks.split(",") if t.strip()]
    expand(tasks)  # unknown tasks refused before the model loads
    if not Path(args.checkpoint).exists():
        raise FileNotFoundError(f"no checkpoint at {args.checkpoint}")
    start = time.perf_counter()
    results = evaluate_tasks(args.checkpoint, tasks, args.task_data, num_fewshot=args.num_fewshot,
                             limit=args.limit, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
                             batch_size=args.batch_size, adapter=args.adapter)
    seconds = time.perf_counter() - start
    from lm_eval.utils import make_table

    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    payload = {"checkpoint": args.checkpoint, "tasks": tasks, "seconds": seconds,
               "results": results.get("results", {}), "groups": results.get("groups", {}),
               "n-samples": results.get("n-samples", {}), "versions": results.get("versions", {})}
    out = Path(args.out) / "harness.json"
    write_json(out, json.loads(json.dumps(payload, default=float)))
    print(f"wrote {out} ({seconds:.1f} s)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from griffin.evaluation.tasks import export_tasks

    if args.old_out is not None:
        print("griffin eval export-tasks: the positional output directory is renamed --out; the old spelling goes "
              "in the next release", file=sys.stderr)
    out = args.out or args.old_out
    if out is None:
        raise ValueError("give the output directory: --out DIR")
    written = export_tasks(out, [t for t in args.tasks.split(",") if t.strip()])
    print(f"wrote {len(written)} files under {out}; copy it to the offline machine and pass --task-data")
    return 0


def cmd_phonebook(args: argparse.Namespace) -> int:
    from griffin.evaluation.phonebook import evaluate_phonebook
    from griffin.evaluation.plots import plot_phonebook

    loaded, labels = _load_all(args)
    results = {}
    timing = {}
    for (model, tok), label in zip(loaded, labels, strict=True):
        start = time.perf_counter()
        r = evaluate_phonebook(model, tok, args.entries, args.seeds, args.samples, args.batch_size,
                               args.chunk_size)
        timing[label] = time.perf_counter() - start
        results[label] = r
        print(f"{label}:")
        for n, m, s, t in zip(r.entries, r.mean, r.std, r.prompt_tokens, strict=True):
            print(f"  {n:>5} entries (~{t:,.0f} tokens): accuracy {m:.3f} +- {s:.3f}")
    out = Path(args.out)
    payload = {"checkpoints": dict(zip(labels, args.checkpoints, strict=True)), "seconds": timing,
               "results": {k: v.to_dict() for k, v in results.items()}}
    write_json(out / PHONEBOOK_JSON, payload)
    plot_phonebook(results, out / PHONEBOOK_PNG)
    print(f"wrote {out / PHONEBOOK_JSON} and {out / PHONEBOOK_PNG}")
    return 0


def _model_options(p: argparse.ArgumentParser, several: bool = True) -> None:
    if several:
        p.add_argument("checkpoints", nargs="+", metavar="CKPT", help="checkpoints to evaluate (overlaid in plots)")
        p.add_argument("--label", action="append", help="a name per checkpoint, in order (default: the family)")
    p.add_argument("--tokenizer", default="auto", help="'auto' (the checkpoint's own, else bytes), 'bytes' or a file")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="cast the weights")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--chunk-size", type=int, default=1024, help="tokens per forward pass (bounds memory)")


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """The ``eval`` subcommand and its own subcommands."""
    p = sub.add_parser("eval", help="evaluate checkpoints: held-out loss (per position), lm-eval tasks, phonebook",
                       description=__doc__)
    ev = p.add_subparsers(dest="eval_command", required=True)

    q = ev.add_parser("loss", help="held-out loss, perplexity and bits/byte; --per-position for Figure 5")
    _model_options(q)
    q.add_argument("--data", required=True, nargs="+",
                   help="a dataset prepared by `griffin prepare` (its --split) or text/JSONL/parquet files")
    q.add_argument("--split", default="val", help="split of a prepared dataset")
    q.add_argument("--text-field", default="text", help="the text field of JSONL/parquet records")
    q.add_argument("--per-position", action="store_true", help="mean loss at each position up to --max-length")
    q.add_argument("--max-length", type=int, default=None, help="positions scored per document (per-position)")
    q.add_argument("--buckets", type=int, default=24, help="log-spaced position buckets")
    q.add_argument("--batch-size", type=int, default=8, help="documents streamed side by side")
    q.add_argument("--max-documents", type=int, default=None,
                   help="evaluate at most this many documents (per-position: of those long enough)")
    q.add_argument("--out", default="runs/eval", help="directory for the JSON (and plot)")
    q.set_defaults(func=cmd_loss)

    q = ev.add_parser("harness", help="lm-evaluation-harness tasks, offline (the paper's six, phonebook)")
    q.add_argument("checkpoint", help="a griffin, HF RecurrentGemma or official checkpoint (or a LoRA adapter "
                   "directory: its base model with it)")
    q.add_argument("--adapter", metavar="DIR", help="a LoRA adapter directory (PEFT's format, "
                   "`griffin finetune`) merged into the checkpoint's weights")
    _model_options(q, several=False)
    q.add_argument("--tasks", required=True,
                   help="comma-separated: paper, mmlu, hellaswag, piqa, winogrande, arc_easy, arc_challenge, "
                        "phonebook, phonebook_N, mmlu_<subject>_continuation")
    q.add_argument("--task-data", default=None, help="directory of exported task JSONL files (export-tasks)")
    q.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    q.add_argument("--limit", type=float, default=None, help="documents per task (or a fraction)")
    q.add_argument("--batch-size", type=int, default=16, help="contexts per batch")
    q.add_argument("--out", default="runs/eval", help="directory for harness.json, the results")
    q.set_defaults(func=cmd_harness)

    q = ev.add_parser("export-tasks", help="download the task documents as JSONL (needs internet and `datasets`)")
    q.add_argument("--out", help="output directory (pass it to `griffin eval harness --task-data`); required")
    q.add_argument("old_out", nargs="?", help=argparse.SUPPRESS)  # the positional of the last release
    q.add_argument("--tasks", default="paper", help="comma-separated tasks (default: the paper's six)")
    q.set_defaults(func=cmd_export)

    q = ev.add_parser("phonebook", help="phonebook lookup accuracy against book length (Section 6.2)")
    _model_options(q)
    q.add_argument("--entries", type=_int_list, default=[10, 20, 40, 80, 160], help="book lengths, e.g. 10,20,40")
    q.add_argument("--seeds", type=_int_list, default=[0, 1, 2], help="seeds (mean +- std over them)")
    q.add_argument("--samples", type=int, default=20, help="lookups per book length and seed")
    q.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    q.add_argument("--out", default="runs/eval", help="directory for the JSON and plot")
    q.set_defaults(func=cmd_phonebook)
