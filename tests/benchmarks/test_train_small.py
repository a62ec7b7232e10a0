"""``benchmarks/train_small.py``: the side-by-side timing of the reference, compiled and bf16 steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.test_inference_benchmark import load_benchmark


def test_bf16_is_refused_up_front_on_a_cpu_without_a_bf16_matmul(monkeypatch, capsys):
    bench = load_benchmark("train_small")
    monkeypatch.setattr(bench, "native_bf16", lambda device: False)
    with pytest.raises(SystemExit):
        bench.main(["--cases", "hawk-256x16", "--bf16"])
    assert "--bf16: this CPU has no native bf16 matmul" in capsys.readouterr().err


@pytest.mark.slow
def test_every_step_is_timed_side_by_side(tmp_path):
    bench = load_benchmark("train_small")
    out = tmp_path / "small.json"
    bf16 = ["--bf16"] if bench.native_bf16(bench.torch.device("cpu")) else []
    assert bench.main(["--cases", "hawk-256x16", "--rounds", "1", "--steps", "1", "--warmup", "1", *bf16,
                       "--profile", "1", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["cases"][0]
    keys = ["reference", "fast"] + (["fast_bf16"] if bf16 else [])
    assert sorted(row["rounds"]) == sorted(keys)
    assert all(row[f"{k}_tokens_per_s"] > 0 for k in keys)
    assert row["speedup"] == pytest.approx(row["fast_tokens_per_s"] / row["reference_tokens_per_s"])
    if bf16:  # the bf16 step's MFU also against the bf16 peak its trainer reports (at least the fp32 one)
        assert row["bf16_peak_flops"] >= row["peak_flops"] and "bf16" in row["bf16_peak_source"]
        assert row["fast_bf16_mfu_bf16_peak"] == pytest.approx(
            row["fast_bf16_tokens_per_s"] * row["flops_per_token"] / row["bf16_peak_flops"])
    # every step profiled; Inductor's kernels are named (and counted) only in the compiled ones
    assert sorted(row["profiles"]) == sorted(keys)
    for key, prof in row["profiles"].items():
        groups = [prof[name] for name in ("matmuls", *bench.GROUPS)]
        assert all(0 <= share for share in groups) and sum(groups) <= 1 + 1e-9
        assert prof["matmuls"] > 0 and prof["rg_lru"] > 0 and prof["conv1d"] > 0
        assert (prof["inductor"] > 0) == (key != "reference"), key
    from torch._inductor import config as inductor_config

    assert not inductor_config.cpp.enable_kernel_profile  # restored for what runs next in this process


def test_an_unknown_base_revision_is_refused_by_name(capsys):
    bench = load_benchmark("train_small")
    with pytest.raises(SystemExit, match="no git revision 'no-such-rev'"):
        bench.main(["--cases", "hawk-256x16", "--base", "no-such-rev"])


@pytest.mark.slow
@pytest.mark.parametrize("step", ["reference", "fast"])
def test_the_base_revision_takes_its_turn_in_a_worker(tmp_path, step):
    """--base HEAD: that revision's step (its reference, or with --base-step its compiled one) in its own worker."""
    bench = load_benchmark("train_small")
    out = tmp_path / "small.json"
    assert bench.main(["--cases", "hawk-256x16", "--rounds", "2", "--steps", "1", "--warmup", "1", "--threads", "1",
                       "--base", "HEAD", "--base-step", step, "--out", str(out)]) == 0
    row = json.loads(out.read_text())["cases"][0]
    assert len(row["rounds"]["base"]) == 2 and row["base_tokens_per_s"] > 0 and row["base_step"] == step
    assert Path(row["base_griffin"]).parts[-3:] == ("base", "src", "griffin")  # the extracted revision, not this tree
    assert row["base_threads_after"] == 1
    assert row["fast_over_base"] == pytest.approx(row["fast_tokens_per_s"] / row["base_tokens_per_s"])


@pytest.mark.slow
def test_the_main_job_runs_each_way_as_a_griffin_train_process(tmp_path):
    """--main-job: the reference, the compiled step and the base revision each trained by `griffin train` (a short
    job here), their wall times and final validation losses recorded, the ratios computed from them."""
    bench = load_benchmark("train_small")
    out = tmp_path / "small.json"
    assert bench.main(["--cases", "hawk-256x16", "--rounds", "1", "--steps", "1", "--warmup", "1", "--threads", "1",
                       "--main-job", "--main-job-steps", "3", "--base", "HEAD", "--out", str(out)]) == 0
    job = json.loads(out.read_text())["main_job"]
    for way in ("reference", "fast", "base"):
        assert job[way]["steps"] == 3 and job[way]["wall_s"] > 0 and 0 < job[way]["val_loss"] < 6
    assert job["base"]["val_loss"] == pytest.approx(job["reference"]["val_loss"], abs=1e-3)  # HEAD: the same job
    assert job["fast_over_base"] == pytest.approx(job["base"]["wall_s"] / job["fast"]["wall_s"])
