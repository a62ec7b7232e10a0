"""Deliberate bugs and the tests that must catch them: a mutation check that anyone can repeat.

Each mutation replaces one snippet of the library's source with a wrong one. For each, this script copies the
working tree to a temporary directory, applies the bug there (the working tree is never touched), runs the tests
named for it and requires them to **fail**; with ``--full`` it runs the whole default suite instead. The unmutated
copy is run first and must pass, so a failure is the bug's doing.

    python tools/mutations.py                  # every mutation, its own tests (a few minutes)
    python tools/mutations.py pad-mask --full  # one mutation against the whole default suite
    python tools/mutations.py --list           # the table: bug -> tests
    python tools/mutations.py --record tests/mutations.md   # run, then write the table with the outcomes

A mutation whose snippet is no longer in the source (the code moved) is reported as stale: update its ``path`` and
``old`` here, so that the check keeps guarding the same behaviour. One whose tests all skip on this host (a kernel for
instructions the CPU lacks) is reported as not run here.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    bug: str  # what goes wrong for users
    path: str  # file, relative to the repository root
    old: str  # the correct snippet (must occur exactly once)
    new: str  # the bug
    tests: tuple[str, ...]  # pytest node ids (or -k expressions after "-k ") that must fail


MUTATIONS = [
    Mutation(
        "pad-mask",
        "left padding leaks into the Conv1D when it is not reset at prompt starts (HF semantics): batched prefill "
        "differs from each prompt run alone",
        "src/griffin/layers/recurrent_block.py",
        "u = u.masked_fill(ctx.pad[..., None], 0.0)",
        "u = u",
        ("tests/inference/test_generate.py::test_mixed_prompt_lengths_in_one_batch",),
    ),
    Mutation(
        "conv-carry",
        "a document starting in the last K-1 tokens of a cached chunk still sees the previous document's Conv1D "
        "inputs in the next chunk",
        "src/griffin/layers/conv1d.py",
        "    if reset is not None:\n        r = torch.cat(",
        "    if False:\n        r = torch.cat(",
        ("tests/inference/test_generate.py::test_document_starts_near_a_chunk_boundary",),
    ),
    Mutation(
        "sqrt-clip",
        "the gradient of sqrt(1 - a_t^2) is unbounded: NaN gradients once a_t rounds to 1",
        "src/griffin/ops/rg_lru/reference.py",
        "torch.sqrt(torch.clip(4.0 * x, min=1.0 / MAX_SQRT_GRADIENT**2))",
        "torch.sqrt(4.0 * x)",
        ("tests/ops/test_rg_lru.py::test_gradients_at_extreme_decays_match_the_bounded_formula",),
    ),
    Mutation(
        "sqrt-clip-cpu",
        "the fused CPU kernel's gradient of sqrt(1 - a_t^2) is unbounded: NaN gradients once a_t rounds to 1",
        "src/griffin/ops/rg_lru/cpu.py",
        "d_u = dh * xt[j] * i / max(2.0 * mult, _MIN_2U)",
        "d_u = dh * xt[j] * i / (2.0 * mult)",
        ("tests/ops/test_rg_lru.py::test_gradients_at_extreme_decays_match_the_bounded_formula",),
    ),
    Mutation(
        "resume-best",
        "a resumed run forgets its best validation loss: the `best` link and pruning then keep, or delete, the "
        "wrong checkpoint",
        "src/griffin/training/trainer.py",
        '            self.best_val, self.best_step = state["best_val_loss"], state["best_step"]\n',
        "",
        ("tests/training/test_train.py::test_resume_restores_the_whole_trainer_state",),
    ),
    Mutation(
        "resume-tokens",
        "a resumed run counts its training tokens from zero",
        "src/griffin/training/trainer.py",
        'self.step, self.tokens = state["step"], state["tokens"]',
        'self.step, self.tokens = state["step"], 0',
        ("tests/training/test_train.py::test_resume_restores_the_whole_trainer_state",),
    ),
    Mutation(
        "untied-head",
        "an untied model's output layer uses the embedding matrix",
        "src/griffin/model.py",
        "logits = self.lm_head(self.final_norm(h))",
        "logits = F.linear(self.final_norm(h), self.embed.weight)",
        ("tests/test_model.py::test_output_layer_soft_capped",),
    ),
    Mutation(
        "paper-depth",
        "the 1.3B models are 22 blocks deep instead of Appendix C's 24",
        "src/griffin/config.py",
        '"1.3b": (2048, 2560, 24, 16)',
        '"1.3b": (2048, 2560, 22, 16)',
        ("tests/test_config.py::test_paper_presets_match_appendix_c",),
    ),
    Mutation(
        "paper-rnn-width",
        "the 7B models' RNN width is 5120 instead of Appendix C's 5632",
        "src/griffin/config.py",
        '"7b": (4096, 5632, 32, 32)',
        '"7b": (4096, 5120, 32, 32)',
        ("tests/test_config.py::test_paper_presets_match_appendix_c",),
    ),
    Mutation(
        "local-dense",
        "local attention builds one dense T x T mask (memory quadratic in the sequence length)",
        "src/griffin/ops/attention.py",
        "if T <= C:  # one chunk",
        "if True:  # one chunk",
        ("tests/ops/test_attention.py::test_never_a_full_mask",),
    ),
    Mutation(
        "a-init-uniform",
        "the decay a is initialised uniform on [0.9, 0.999] instead of a^2 uniform (Section 2.4)",
        "src/griffin/layers/rg_lru.py",
        "a_param.uniform_(min_rad**2 + eps, max_rad**2 + eps)\n        a_param.log_().mul_(0.5)",
        "a_param.uniform_(min_rad + eps, max_rad + eps)\n        a_param.log_()",
        ("tests/layers/test_layers.py::test_a_init_range",),
    ),
    Mutation(
        "tp-kv-grad",
        "tensor parallelism: the replicated key/value head of MQA is updated with each device's own query heads' "
        "share of its gradient (the classic bug: no sum over the tp devices)",
        "src/griffin/parallel/tensor_parallel.py",
        "        if sum_grads and isinstance(param, DTensor):\n            local = sum_grad(",
        "        if False:\n            local = sum_grad(",
        ("tests/parallel/test_parallel.py::test_tp2_and_dp_shard2_equal_one_process_float64",),
    ),
    Mutation(
        "decode-gates",
        "the fused decode step's RG-LRU takes the recurrence gate where the input gate belongs",
        "src/griffin/inference/cpu/block_step.py",
        "multiplier * (sigmoid_vectorizable(_rounded(gx_row[o], like))",
        "multiplier * (sigmoid_vectorizable(_rounded(ga_row[o], like))",
        ("tests/inference/cpu/test_block_step.py::test_recurrent_step_equals_the_block",
         "tests/inference/cpu/test_fused.py::test_fused_step_equals_the_unfused_copy"),
    ),
    Mutation(
        "decode-attention-documents",
        "the fused decode step's attention sees every slot of the cache, the other documents' keys too",
        "src/griffin/inference/cpu/block_step.py",
        "        if seg_cache[b, s] == segments[b]:\n            visible[m] = s",
        "        if True:\n            visible[m] = s",
        ("tests/inference/cpu/test_block_step.py::test_attention_step_equals_the_layer",
         "tests/inference/cpu/test_fused.py::test_fused_step_equals_the_unfused_copy"),
    ),
    Mutation(
        "decode-conv-state",
        "the fused decode step does not shift the Conv1D's history: the next token sees stale inputs",
        "src/griffin/inference/cpu/block_step.py",
        "                past[i] = newer[i]",
        "                past[i] = past[i]",
        ("tests/inference/cpu/test_block_step.py::test_recurrent_step_equals_the_block",),
    ),
    Mutation(
        "decode-block-row-rounding",
        "the one-call block step adds the temporal block's output to the residual unrounded (the model rounds it to "
        "its dtype as the output projection's result)",
        "src/griffin/inference/cpu/block_step.py",
        "            residual[b, d] = narrow(widen(x[b, d]) + _rounded(mixed[b, d], like), like)",
        "            residual[b, d] = narrow(widen(x[b, d]) + mixed[b, d], like)",
        ("tests/inference/cpu/test_fused.py::test_stack_step_equals_the_kernel_by_kernel_step",
         "tests/inference/cpu/test_fused.py::test_fused_step_equals_the_unfused_copy"),
    ),
    Mutation(
        "int16-steps-infinity",
        "the kernel's max |x| from the bits of a bfloat16 row takes an infinite entry for a finite one (the row would "
        "be rounded to int16 steps of inf)",
        "src/griffin/inference/cpu/matvec.py",
        "            return widen(m), m < np.uint16(0x7F80)",
        "            return widen(m), m <= np.uint16(0x7F80)",
        ("tests/inference/cpu/test_matvec.py::test_kernel_rounds_x_to_int16_steps_as_the_reference",),
    ),
    Mutation(
        "tasks-share-overlap",
        "a worker's share of a phase's tasks in a block's parallel region reaches into the next worker's (a task run "
        "twice: a matmul's tile written twice, the recurrence of a gate block stepped twice)",
        "src/griffin/inference/cpu/tasks.py",
        "        if i < hi:",
        "        if i <= hi and i < tasks:",
        ("tests/inference/cpu/test_tasks.py::test_phases_run_each_task_once_and_end_with_any_thread_count",),
    ),
    Mutation(
        "stack-check-after-write",
        "the stack's step no longer checks every global attention cache for room before the first block runs (a full "
        "cache stops the step after the blocks before it have written their caches)",
        "src/griffin/inference/cpu/block_step.py",
        "    _check_attention_caches(attention)\n    n = order.shape[0]",
        "    n = order.shape[0]",
        ("tests/inference/cpu/test_fused.py::test_stack_step_with_a_full_global_cache_writes_nothing",),
    ),
    Mutation(
        "stack-stale-cache",
        "the stack prepared on a cache is kept after one of the cache's tensors was replaced (the step reads and "
        "writes the old tensor)",
        "src/griffin/inference/cpu/fused.py",
        "        if self._stack is None or self._stack[0] != where:",
        "        if self._stack is None:",
        ("tests/inference/cpu/test_fused.py::test_stack_step_follows_a_cache_whose_tensors_were_replaced",),
    ),
    Mutation(
        "tiles-low-byte",
        "the AMX kernel adds each input row's high-byte sums where its low-byte sums belong (int8 decode of several "
        "rows off by up to 1/128 of each row's scale, on hosts with AMX)",
        "src/griffin/inference/cpu/matvec.py",
        "acc[e, m] += np.int64(block[e, m]) * 256 + np.int64(block[e, TILE_INPUTS + m])",
        "acc[e, m] += np.int64(block[e, m]) * 256 + np.int64(block[e, m])",
        ("tests/inference/cpu/test_matvec.py::test_tile_kernel_equals_the_vpdpbusd_kernel_bit_for_bit",),
    ),
    Mutation(
        "tiles-past-the-matrix",
        "the AMX kernel loads a matrix's last tile of fewer than 16 rows from the matrix itself, not a padded copy: "
        "its tile loads read past the matrix (a crash where nothing is mapped there)",
        "src/griffin/inference/cpu/matvec.py",
        "_tile_rows(high, low, packed, steps, padded, np.int64(0), c0, rows, sums, scale, bias, config, out)",
        "_tile_rows(high, low, packed, steps, weights[j], r0, c0, rows, sums, scale, bias, config, out)",
        ("tests/inference/cpu/test_matvec.py::test_several_rows_never_read_past_a_matrix",),
    ),
    Mutation(
        "int8-gates-unscaled",
        "int8 RG-LRU gates are summed without their scales in the decode kernels (every gate's input off by the "
        "factor 127 / max |w| of its column)",
        "src/griffin/inference/cpu/matvec.py",
        "acc[o] = widen(bias[h, o]) + acc[o] * scale[h, o]",
        "acc[o] = widen(bias[h, o]) + acc[o]",
        ("tests/inference/cpu/test_linear.py::test_block_diagonal_kernel_equals_the_layer",
         "tests/inference/cpu/test_block_step.py::test_recurrent_step_equals_the_block"),
    ),
    Mutation(
        "int8-group-offset-dropped",
        "the one-row int8 kernel's group sum forgets the -32768 sum(w) of the int16 offset (every output off by "
        "32768 step scale sum(w) of its group)",
        "src/griffin/inference/cpu/matvec.py",
        "acc = np.int64(vector_sum) * np.int64(-OFFSET)",
        "acc = np.int64(0)",
        ("tests/inference/cpu/test_matvec.py::test_int8_instruction_path_is_within_the_rounding_of_x",),
    ),
    Mutation(
        "kernel-cache-kept",
        "a cached numba kernel is checked against its own file only (a kernel that inlines from another file runs "
        "the older code after that file changed)",
        "src/griffin/ops/jit.py",
        "    _locator_classes = [type(f\"Kernel{c.__name__}\", (_StampedBySources, c), {})",
        "    _locator_classes = [type(f\"Kernel{c.__name__}\", (c,), {})",
        ("tests/ops/test_kernel_cache.py::test_a_change_to_another_kernel_source_compiles_the_kernel_again",),
    ),
    Mutation(
        "int8-gates-float-on-load",
        "an int8 checkpoint's gates load into float layers (the int8 values read as floats: gates off by the "
        "factor 1 / scale)",
        "src/griffin/quantize.py",
        "            elif full in gates and isinstance(child, BlockDiagonalLinear):",
        "            elif False:",
        ("tests/test_quantize.py::test_int8_round_trips_through_save_and_load",),
    ),
]


def source_files() -> list[str]:
    """Tracked and untracked-but-not-ignored files: the working tree as it stands."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line and (ROOT / line).is_file()]


def copy_tree(dest: Path) -> None:
    for rel in source_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)


def pytest_args(tests: tuple[str, ...], full: bool) -> list[str]:
    if full:
        return []
    args: list[str] = []
    for test in tests:
        args += test.split(" ", 1) if test.startswith("-k ") else [test]
    return args


def run_tests(tree: Path, tests: tuple[str, ...], full: bool) -> tuple[bool, float, str]:
    """(passed, seconds, last lines of the output) of pytest in ``tree``, importing griffin from there."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src") + os.pathsep + str(tree)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *pytest_args(tests, full)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
    return proc.returncode == 0, time.perf_counter() - start, tail


def check(mutation: Mutation, full: bool, baseline: bool = True) -> dict[str, str]:
    """Apply ``mutation`` to a copy of the tree and run its tests (or the whole suite); ``baseline``: run them on the
    unmutated copy first (the whole suite's baseline is run once, by :func:`main`)."""
    with tempfile.TemporaryDirectory(prefix=f"mutation-{mutation.name}-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        path = tree / mutation.path
        text = path.read_text() if path.is_file() else ""
        if text.count(mutation.old) != 1:
            return {"outcome": "STALE", "detail": f"{mutation.path} does not hold the snippet exactly once"}
        if baseline:
            passed, _, tail = run_tests(tree, mutation.tests, full)
            if not passed:
                return {"outcome": "BASELINE FAILS", "detail": tail}
            summary = tail.splitlines()[-1] if tail else ""
            if "skipped" in summary and "passed" not in summary:  # e.g. a kernel for an instruction this host lacks
                return {"outcome": "NOT RUN HERE", "detail": f"its tests skip on this host: {summary}"[:160]}
        path.write_text(text.replace(mutation.old, mutation.new))
        passed, seconds, tail = run_tests(tree, mutation.tests, full)
        failed = [line for line in tail.splitlines() if line.startswith("FAILED")]
        if passed:
            return {"outcome": "MISSED", "detail": f"the tests pass with the bug ({seconds:.0f} s)"}
        return {"outcome": "caught", "detail": (failed[0] if failed else tail.splitlines()[-1])[:160]}


def table(results: dict[str, dict[str, str]] | None = None) -> str:
    lines = ["| mutation | the bug | file | tests that must fail |" + (" outcome |" if results else ""),
             "|---|---|---|---|" + ("---|" if results else "")]
    for m in MUTATIONS:
        tests = "<br>".join(f"`{t}`" for t in m.tests)
        row = f"| `{m.name}` | {m.bug} | `{m.path}` | {tests} |"
        if results and m.name in results:
            row += f" {results[m.name]['outcome']} |"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="mutations to check (default: all)")
    parser.add_argument("--full", action="store_true", help="run the whole default suite for each mutation")
    parser.add_argument("--list", action="store_true", help="print the table of mutations and exit")
    parser.add_argument("--record", metavar="MD", help="write the table with the outcomes to this Markdown file")
    args = parser.parse_args(argv)
    if args.list:
        print(table())
        return 0
    known = {m.name for m in MUTATIONS}
    unknown = sorted(set(args.names) - known)
    if unknown:
        parser.error(f"unknown mutations {unknown}; known: {sorted(known)}")
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    results: dict[str, dict[str, str]] = {}
    if args.full:  # the whole suite must pass on the unmutated tree, once
        with tempfile.TemporaryDirectory(prefix="mutation-baseline-") as tmp:
            copy_tree(Path(tmp))
            passed, seconds, tail = run_tests(Path(tmp), (), True)
        print(f"{'baseline':>16}: {'passes' if passed else 'FAILS':<14} {seconds:5.0f} s  {tail.splitlines()[-1]}")
        if not passed:
            return 1
    for m in chosen:
        start = time.perf_counter()
        results[m.name] = check(m, args.full, baseline=not args.full)
        print(f"{m.name:>16}: {results[m.name]['outcome']:<14} {time.perf_counter() - start:5.0f} s  "
              f"{results[m.name]['detail']}", flush=True)
    if args.record:
        scope = "the whole default suite" if args.full else "the tests named for each"
        header = (f"# Mutation check\n\nDeliberate bugs and the tests that catch them, written by "
                  f"`python tools/mutations.py --record {args.record}`{' --full' if args.full else ''} on "
                  f"{datetime.date.today()} (each bug applied to a copy of the tree, then {scope} run; "
                  "`caught` means the tests failed). Re-run it after moving code: a stale snippet is reported.\n\n")
        Path(args.record).write_text(header + table(results) + "\n")
    return 0 if all(r["outcome"] in ("caught", "NOT RUN HERE") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
