"""``benchmarks/train_speed.py``: Figure 3's training step per sequence length, eager or compiled."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.test_inference_benchmark import load_benchmark

TINY = ["--width", "32", "--rnn-width", "32", "--depth", "2", "--heads", "1", "--vocab", "64", "--window", "32",
        "--tokens", "256", "--seq-lens", "64", "128", "--steps", "1", "--plot", ""]


def test_a_compiled_run_without_warm_up_is_refused():
    bench = load_benchmark("train_speed")
    with pytest.raises(SystemExit, match="--compile needs --warmup 1 or more"):
        bench.main([*TINY, "--compile", "--warmup", "0"])


@pytest.mark.slow
def test_the_compiled_step_is_timed_at_every_length(tmp_path):
    bench = load_benchmark("train_speed")
    out = tmp_path / "speed.json"
    assert bench.main([*TINY, "--families", "hawk", "--compile", "--warmup", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["args"]["compile"] is True
    rows = result["rows"]
    assert [r["seq_len"] for r in rows] == [64, 128]
    assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in rows)
