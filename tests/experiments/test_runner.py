"""The experiments' runner: a tiny grid end to end (train, skip what is done, resume what was interrupted, analyse),
and the grids' refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from griffin.cli import is_user_error
from griffin.experiments import ExperimentError, Grid, Run, run_grid
from griffin.experiments.scaling import Ladder, analyse
from tests.conftest import words_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return words_dataset(tmp_path_factory.mktemp("data"))


def tiny_ladder(**kw) -> Ladder:
    options = dict(rungs=[{"name": f"d{w}", "width": w, "depth": 3} for w in (16, 24, 32)],
                   families=("hawk", "griffin"), seq_len=16, batch_size=4, tokens_per_parameter=0.25,
                   train={"eval_batches": 2, "tensorboard": False})
    options.update(kw)
    return Ladder(**options)


@pytest.fixture(scope="module")
def finished(dataset, tmp_path_factory) -> tuple[Path, dict]:
    """A tiny scaling grid (two families, three rungs) trained two runs at a time."""
    out = tmp_path_factory.mktemp("grid")
    return out, run_grid(tiny_ladder().grid(1.0, {"data": str(dataset)}), out, workers=2, threads=1, progress=False)


def test_a_tiny_scaling_grid_runs_end_to_end_then_skips_what_is_done(dataset, finished):
    tmp_path, results = finished
    grid = tiny_ladder().grid(1.0, {"data": str(dataset)})
    assert [r["name"] for r in results["runs"]] == [r.name for r in grid.runs]
    for r, run in zip(results["runs"], grid.runs, strict=True):
        summary = r["summary"]
        assert summary["steps"] == run.settings["max_steps"] >= 50
        assert summary["tokens"] == run.settings["max_steps"] * 4 * 16 == run.tags["tokens"]
        assert summary["parameters"] == run.tags["parameters"]
        assert summary["val_loss"] < summary["unigram_loss"]  # it learned something
    assert json.loads((tmp_path / "results.json").read_text())["runs"] == results["runs"]
    # the larger rungs train for more tokens (proportional to their parameters) and cost more FLOPs
    flops = {r["name"]: r["summary"]["flops"] for r in results["runs"]}
    assert flops["griffin-d16"] < flops["griffin-d24"] < flops["griffin-d32"]

    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.glob("runs/*/log.jsonl")}
    again = run_grid(grid, tmp_path, workers=2, progress=False)  # nothing to train: every run has its result
    assert again["runs"] == results["runs"]
    assert stamps == {p: p.stat().st_mtime_ns for p in tmp_path.glob("runs/*/log.jsonl")}

    summary = analyse(results, tmp_path)
    assert set(summary["fits"]) == {"hawk", "griffin"} and all(f["b"] > 0 for f in summary["fits"].values())
    assert (tmp_path / "scaling.png").stat().st_size > 10_000 and (tmp_path / "fits.json").is_file()
    assert "| hawk | 3 |" in summary["table"] and list(summary["crossovers"]) == ["hawk / griffin"]

    changed = tiny_ladder(lr=1e-2).grid(1.0, {"data": str(dataset)})
    with pytest.raises(ValueError, match="run hawk-d16 .* was trained with lr=.*another --out"):
        run_grid(changed, tmp_path, progress=False)


def test_an_interrupted_run_resumes_exactly(dataset, finished, tmp_path, fault_in_children):
    grid = tiny_ladder(rungs=[{"name": "d16", "width": 16, "depth": 3}], families=("griffin",)).grid(
        1.0, {"data": str(dataset)})
    whole = next(r for r in finished[1]["runs"] if r["name"] == "griffin-d16")  # the same run, uninterrupted
    fault_in_children("step:45")  # the training process is killed after step 45
    failed = r"(?s)run griffin-d16 failed \(killed by signal 9\).*again to resume"
    with pytest.raises(ExperimentError, match=failed) as err:
        run_grid(grid, tmp_path, threads=1, progress=False)
    assert is_user_error(err.value)  # griffin experiment: one line and exit status 2, no traceback
    assert not (tmp_path / "runs/griffin-d16/result.json").exists()
    fault_in_children(None)
    resumed = run_grid(grid, tmp_path, threads=1, progress=False)["runs"][0]
    assert "resumed from" in (tmp_path / "runs/griffin-d16/train.log").read_text()
    assert resumed["summary"]["val_loss"] == whole["summary"]["val_loss"]
    assert resumed["summary"]["curve"] == whole["summary"]["curve"]


def test_grids_that_cannot_compare_are_refused(dataset, tmp_path):
    a = Run("a", {"preset": "griffin-tiny", "data": str(dataset), "max_steps": 5})
    b = Run("b", {"preset": "hawk-tiny", "data": str(tmp_path), "max_steps": 5})
    with pytest.raises(ValueError, match="disagree on data: a has data=.*, b has data="):
        Grid("x", [a, b]).check()
    with pytest.raises(ValueError, match="two runs of the x grid are named 'a'"):
        Grid("x", [a, a]).check()
    with pytest.raises(ValueError, match="run name 'a/b'"):
        Grid("x", [Run("a/b", a.settings)]).check()
    with pytest.raises(ValueError, match="run c: unknown key 'max_step'"):
        Grid("x", [Run("c", {"max_step": 5})]).check()
    with pytest.raises(ValueError, match="has no runs"):
        Grid("x", []).check()
    with pytest.raises(ValueError, match="workers=0"):
        run_grid(Grid("x", [a]), tmp_path, workers=0)


def test_long_context_and_window_analyses_on_finished_runs(dataset, finished, tmp_path):
    from griffin.experiments import long_context, window

    _, results = finished
    runs = {r["name"]: r for r in results["runs"]}
    evaluate = long_context.per_position_evaluation(64, max_windows=20)
    pair = []
    for name, length in (("griffin-d16", 16), ("griffin-d32", 64)):  # stand-ins for a run at T and one at 4T
        evaluation = evaluate(None, finished[0] / "runs" / name, dataset)
        pp = evaluation["per_position"]
        assert pp["max_length"] == 64 and pp["documents"] == 20 and len(pp["position_loss"]) == 63
        pair.append({**runs[name], "tags": {"family": "griffin", "train_length": length}, "evaluation": evaluation})
    summary = long_context.analyse({"runs": pair}, tmp_path)
    verdict = summary["verdict"]["griffin"]
    assert set(verdict["mean_loss_within_T"]) == {16, 64} and "| griffin | 64 |" in summary["table"]
    assert (tmp_path / "long_context.png").stat().st_size > 10_000

    labelled = []
    for name, model, window_, length in (("griffin-d16", "griffin", 8, 16), ("hawk-d16", "mqa", 16, 16),
                                         ("hawk-d24", "mqa-local", 8, 16), ("griffin-d24", "griffin", 8, 32),
                                         ("hawk-d32", "mqa", 32, 32)):
        labelled.append({**runs[name], "tags": {"model": model, "window": window_, "train_length": length}})
    summary = window.analyse({"runs": labelled}, tmp_path)
    losses = summary["val_loss"]["16"]
    assert losses["griffin w8"] == runs["griffin-d16"]["summary"]["val_loss"]
    claims = summary["claims"]["16"]
    assert claims["every_griffin_beats_global_mqa"] == (losses["griffin w8"] < losses["mqa global"])
    assert claims["every_local_mqa_worse_than_global"] == (losses["mqa-local w8"] > losses["mqa global"])
    assert (tmp_path / "window.png").stat().st_size > 10_000


@pytest.mark.slow
def test_runs_launched_under_torchrun(dataset, tmp_path):
    """The launcher path of the paper's ladders: each run is `torchrun ... -m griffin.cli train` over two processes
    (parameters sharded over both, ZeRO-3, gloo; the batch is the global batch), and its result is the
    single-process run's within float tolerance."""
    import sys

    grid = tiny_ladder(rungs=[{"name": "d16", "width": 16, "depth": 3}], families=("griffin",)).grid(
        1.0, {"data": str(dataset)})
    launcher = f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2"
    one = run_grid(grid, tmp_path / "one", threads=1, progress=False)["runs"][0]
    grid.runs[0].settings["dp_shard"] = 2
    grid.split_batch(2)  # griffin train's batch is per process: 2 x 2 sequences = the one process' 4
    two = run_grid(grid, tmp_path / "two", launcher=launcher, progress=False)["runs"][0]
    assert "2 data-parallel ranks of 2 sequences" in (tmp_path / "two/runs/griffin-d16/train.log").read_text()
    assert two["summary"]["steps"] == one["summary"]["steps"] and two["summary"]["tokens"] == one["summary"]["tokens"]

    def train_losses(root: Path) -> dict[int, float]:  # (the held-out batches are per rank: compare training)
        records = [json.loads(x) for x in (root / "runs/griffin-d16/log.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}

    ref, got = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert got.keys() == ref.keys() and len(ref) > 5
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step
