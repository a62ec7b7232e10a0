"""``benchmarks/decode_cold_start.py``: the rows, the check that cached kernels generate what fresh ones did, and (slow:
it compiles every decode kernel into a new cache) the script end to end."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.test_inference_benchmark import load_benchmark

benchmark = load_benchmark("decode_cold_start")


def fake_worker(calls: list, tokens_of_second=(5, 6)):
    """A worker that answers from a table: the first call per cache compiles (slow), the second reads the cache."""
    def run(preset, dtype, tokens, threads, cache):
        calls.append((preset, dtype, tokens, threads, cache))
        (cache / "kernel.nbc").write_bytes(b"x" * 2**20)
        cold = sum(c[4] == cache for c in calls) == 1
        return {"import_s": 1.0, "first_s": 60.0 if cold else 2.0, "second_s": 0.01,
                "tokens": [5, 6] if cold else list(tokens_of_second)}
    return run


def test_each_dtype_compiles_into_a_new_cache_then_reads_it(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(benchmark, "run_worker", fake_worker(calls))
    out = tmp_path / "cold.json"
    assert benchmark.main(["--dtypes", "float32", "int8", "--tokens", "3", "--out", str(out)]) == 0
    assert [c[:4] for c in calls] == [("griffin-tiny", "float32", 3, 1)] * 2 + [("griffin-tiny", "int8", 3, 1)] * 2
    assert calls[0][4] == calls[1][4] != calls[2][4] == calls[3][4]  # one new cache per dtype, reused once
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["cold_first_s"], r["cached_first_s"], r["cold_over_cached"], r["cache_mb"])
            for r in rows] == [("float32", 60.0, 2.0, 30.0, 1.0), ("int8", 60.0, 2.0, 30.0, 1.0)]
    assert "| griffin-tiny | int8 | 60.0 | 2.00 |" in capsys.readouterr().out


def test_cached_kernels_that_generate_other_tokens_stop_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(benchmark, "run_worker", fake_worker([], tokens_of_second=(5, 7)))
    with pytest.raises(SystemExit, match="cached kernels generated \\[5, 7\\], the freshly compiled ones \\[5, 6\\]"):
        benchmark.main(["--dtypes", "float32", "--out", str(tmp_path / "cold.json")])


@pytest.mark.parametrize("option", ["--tokens", "--threads"])
def test_bad_counts_are_refused_before_any_worker_runs(tmp_path, monkeypatch, capsys, option):
    calls = []
    monkeypatch.setattr(benchmark, "run_worker", fake_worker(calls))
    with pytest.raises(SystemExit) as stop:
        benchmark.main([option, "0", "--out", str(tmp_path / "cold.json")])
    assert stop.value.code == 2 and not calls
    assert "--tokens and --threads must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_the_script_end_to_end(tmp_path):
    """Compiles griffin-tiny's fp32 decode kernels into a new cache (minutes on 2 cores), then reads them."""
    out = tmp_path / "cold.json"
    assert benchmark.main(["--dtypes", "float32", "--tokens", "2", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["cache_mb"] > 1 and row["cold_first_s"] > 0 and row["steady_s"] > 0  # the kernels cached
