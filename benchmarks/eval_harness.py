"""lm-evaluation-harness: griffin's ``griffin`` model against the harness' own ``hf`` model on the same weights
(exported as a HuggingFace RecurrentGemma directory, as ``griffin convert --to hf`` does), on a multiple-choice
task: per-request loglikelihoods, accuracies and the time of each, side by side.

The task is the harness' own ``arc_easy`` definition read offline (``griffin.evaluation.tasks``) with documents made
here from Python source files (no download): a question is a few lines of a file and the first half of the next
line; the choices are that line's true second half and the second halves of three other lines. Both models read
the same bytes: the HF directory gets a byte-level ``tokenizer.json`` (256 tokens, id = byte), checked to encode
every request as griffin's byte tokenizer does.

    python benchmarks/eval_harness.py                                  # a seeded griffin-cpu-sized model
    python benchmarks/eval_harness.py --checkpoint runs/griffin-cpu-hf/checkpoints/best --docs 1000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

# as griffin/__init__ does, before torch loads its OpenMP runtime: idle OpenMP workers sleep (both models run
# in this process under the same policy)
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, table, write_json  # noqa: E402

from griffin import CausalLM, ModelConfig  # noqa: E402
from griffin.data import default_corpus_files  # noqa: E402
from griffin.data.tokenizer import ByteTokenizer  # noqa: E402
from griffin.interop import export_hf, load_pretrained  # noqa: E402

HF_OVERRIDES = dict(embed_scale=True, logits_soft_cap=30.0, gate_blocks=2)  # what HF RecurrentGemma can express


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def write_byte_tokenizer(directory: Path) -> None:
    """A HF fast tokenizer whose token id is the byte: ByteLevel pre-tokenizer (no regex split), no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    b2u = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": b2u[0], "pad_token": b2u[0],
        "model_max_length": 1 << 20}))


def make_task(docs: int, seed: int) -> list[dict]:
    """ARC-format documents (question, choices, answerKey) from lines of the standard library's source."""
    rng = random.Random(seed)
    files = default_corpus_files()
    rng.shuffle(files)
    lines: list[tuple[list[str], str]] = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for i in range(2, len(text)):
            if 30 <= len(text[i].strip()) <= 90 and text[i].isascii():
                lines.append((text[max(0, i - 3) : i], text[i]))
        if len(lines) > 20 * docs:
            break
    picks = rng.sample(lines, docs)
    out = []
    for context, line in picks:
        half = len(line) // 2
        wrong = [other[len(other) // 2 :] for _, other in rng.sample(lines, 3)]
        choices = [line[half:]] + wrong
        rng.shuffle(choices)
        question = "\n".join(context + [line[:half]])
        answer = "ABCD"[choices.index(line[half:])]
        out.append({"id": f"line-{len(out)}", "question": question,
                    "choices": {"text": choices, "label": list("ABCD")}, "answerKey": answer})
    return out


def timed_lm(lm):
    """Wrap ``lm.loglikelihood`` to record the seconds spent in it (wall, and CPU time of the process: on a shared
    host the wall time also counts the other processes' share of the cores)."""
    inner = lm.loglikelihood
    lm.seconds = lm.cpu_seconds = 0.0

    def loglikelihood(requests, *args, **kwargs):
        start, cpu = time.perf_counter(), time.process_time()
        out = inner(requests, *args, **kwargs)
        lm.seconds += time.perf_counter() - start
        lm.cpu_seconds += time.process_time() - cpu
        return out

    lm.loglikelihood = loglikelihood
    return lm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a griffin checkpoint HF can express (default: a seeded random model)")
    parser.add_argument("--docs", type=int, default=1000, help="questions (4 requests each)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/eval_harness.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from griffin.evaluation.harness import GriffinLM
    from griffin.evaluation.tasks import render_tasks

    if args.checkpoint:
        model = load_pretrained(args.checkpoint, dtype=torch.float32)
    else:
        torch.manual_seed(args.seed)
        model = CausalLM(ModelConfig.from_preset("griffin-cpu", **HF_OVERRIDES)).eval()
    docs = make_task(args.docs, args.seed)
    with tempfile.TemporaryDirectory(prefix="eval-harness-") as tmp:
        tmp = Path(tmp)
        (tmp / "data" / "arc_easy").mkdir(parents=True)
        (tmp / "data" / "arc_easy" / "test.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        render_tasks(["arc_easy"], tmp / "data", tmp / "tasks")
        export_hf(model, tmp / "hf")
        write_byte_tokenizer(tmp / "hf")

        lms = {
            "griffin": timed_lm(GriffinLM(model=model, tokenizer="bytes", batch_size=args.batch_size)),
            "hf": timed_lm(HFLM(pretrained=str(tmp / "hf"), dtype="float32", device="cpu",
                                batch_size=args.batch_size)),
        }
        probe = [f"Question: {d['question']}\nAnswer: {c}" for d in docs[:50] for c in d["choices"]["text"]]
        hf_tok, ours = lms["hf"].tokenizer, ByteTokenizer()
        bad = [s for s in probe if hf_tok.encode(s, add_special_tokens=False) != ours.encode(s)]
        if bad:
            raise SystemExit(f"the HF byte tokenizer differs from griffin's on {bad[0]!r}")
        results, wall = {}, {}
        for name, lm in lms.items():
            start = time.perf_counter()
            results[name] = simple_evaluate(model=lm, tasks=["arc_easy"], task_manager=TaskManager(
                include_path=str(tmp / "tasks")), log_samples=True, bootstrap_iters=0)
            wall[name] = time.perf_counter() - start

    # the tokens each model runs through its forward passes (bytes: one token each): hf every request whole (its
    # last token predicts nothing), griffin each distinct context once, then each continuation but its last token
    pairs = [(str(a[0]), str(a[1])) for smp in results["griffin"]["samples"]["arc_easy"] for a in smp["arguments"]]
    hf_tokens = sum(len((ctx + cont).encode()) - 1 for ctx, cont in pairs)
    griffin_tokens = sum(len(ctx.encode()) for ctx in {ctx for ctx, _ in pairs}) + \
        sum(len(cont.encode()) - 1 for _, cont in pairs)
    samples = {n: sorted(r["samples"]["arc_easy"], key=lambda s: s["doc_id"]) for n, r in results.items()}
    lls = {n: np.array([[resp[0][0] for resp in s["resps"]] for s in ss]) for n, ss in samples.items()}
    diff = float(np.abs(lls["griffin"] - lls["hf"]).max())
    scores = {n: {m: float(r["results"]["arc_easy"][f"{m},none"]) for m in ("acc", "acc_norm")}
              for n, r in results.items()}
    rows = [{"model": n, "requests": lls[n].size, "acc": scores[n]["acc"], "acc_norm": scores[n]["acc_norm"],
             "loglikelihood_s": lms[n].seconds, "loglikelihood_cpu_s": lms[n].cpu_seconds, "wall_s": wall[n]}
            for n in lms]
    speedup = lms["hf"].seconds / lms["griffin"].seconds
    speedup_cpu = lms["hf"].cpu_seconds / lms["griffin"].cpu_seconds
    print(table(rows, [("model", "model", "s"), ("requests", "requests", "d"), ("acc", "acc", ".4f"),
                       ("acc_norm", "acc_norm", ".4f"), ("loglikelihood s", "loglikelihood_s", ".1f"),
                       ("loglikelihood CPU s", "loglikelihood_cpu_s", ".1f"), ("wall s", "wall_s", ".1f")]))
    print(f"tokens run: hf {hf_tokens:,}, griffin {griffin_tokens:,} ({hf_tokens / griffin_tokens:.2f}x fewer)")
    print(f"max |griffin - hf| per-request loglikelihood: {diff:.2e}; griffin {speedup:.2f}x faster "
          f"(loglikelihood time), {speedup_cpu:.2f}x (its CPU time), {wall['hf'] / wall['griffin']:.2f}x (wall)")
    write_json(args.out, {"benchmark": "eval_harness", "machine": machine_info(torch.device("cpu")),
                          "checkpoint": args.checkpoint or f"random griffin-cpu {HF_OVERRIDES} seed {args.seed}",
                          "docs": args.docs, "batch_size": args.batch_size, "rows": rows,
                          "max_abs_loglikelihood_diff": diff, "tokens_hf": hf_tokens, "tokens_griffin": griffin_tokens,
                          "scores_equal": scores["griffin"] == scores["hf"],
                          "speedup_loglikelihood": speedup, "speedup_loglikelihood_cpu": speedup_cpu,
                          "threads": torch.get_num_threads(), "speedup_wall": wall["hf"] / wall["griffin"]})
    if diff > 1e-4 or scores["griffin"] != scores["hf"]:
        raise SystemExit("griffin and hf disagree")


if __name__ == "__main__":
    main()
