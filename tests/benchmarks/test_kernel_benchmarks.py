"""``benchmarks/rg_lru_cpu.py`` and ``benchmarks/conv1d_cpu.py``: every path timed in the same rounds, rows written."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.test_inference_benchmark import load_benchmark


def test_conv1d_benchmark_times_the_fused_kernel_and_the_reference(tmp_path, capsys):
    out = tmp_path / "conv.json"
    bench = load_benchmark("conv1d_cpu")
    assert bench.main(["--shapes", "2x16x8", "3x9x5", "--dtypes", "float32", "bfloat16", "--resets", "0.2",
                       "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["shape"], r["dtype"], r["path"]) for r in rows} == {
        (s, d, p) for s in ("2x16x8", "3x9x5") for d in ("float32", "bfloat16") for p in ("fused", "ref")}
    assert all(r["forward_s"] > 0 and r["forward_backward_s"] > 0 for r in rows)
    assert "| 3x9x5 | bfloat16 | ref |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--repeats", "0"])


def test_rg_lru_benchmark_times_every_path(tmp_path):
    out = tmp_path / "rg.json"
    assert load_benchmark("rg_lru_cpu").main(["--shapes", "2x16x8", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["path"] for r in rows] == ["fused", "unfused", "assoc"]
    assert all(r["forward_s"] > 0 and r["forward_backward_s"] > 0 for r in rows)


def test_rg_lru_benchmark_times_forward_and_backward_from_memory(tmp_path, monkeypatch):
    """``--cold``: the caches evicted before the forward and again before the backward (each eviction counted), the
    backward timed apart and added to the forward."""
    bench = load_benchmark("rg_lru_cpu")
    evictions = []
    monkeypatch.setattr(bench, "evict_caches", lambda: evictions.append(1))
    out = tmp_path / "rg.json"
    assert bench.main(["--shapes", "2x16x8", "--paths", "fused", "unfused", "--cold", "--repeats", "2",
                       "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["path"] for r in rows] == ["fused", "unfused"]
    assert all(0 < r["forward_s"] < r["forward_backward_s"] for r in rows)
    assert len(evictions) == 2 * 2 * (2 + 1)  # two per path and round, the untimed first round included
