"""``benchmarks/serve_load.py --quick`` end to end: a tiny model behind ``griffin serve`` (subprocesses), HF's
``generate`` and static batching on the same weights, the multi-turn chat with and without the prefix cache, the
few-shot workload with and without block prefix states."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.test_inference_benchmark import load_benchmark


@pytest.mark.slow
def test_serve_load_benchmark_runs_every_system_on_the_same_weights(tmp_path):
    out = tmp_path / "serve.json"
    assert load_benchmark("serve_load").main(["--quick", "--out", str(out), "--figure", str(tmp_path / "f.png")]) == 0
    results = json.loads(out.read_text())
    assert results["model"]["hf_greedy_agreement"] == 1.0  # HF runs the same weights
    assert [r["concurrency"] for r in results["levels"]] == [1, 4]
    for row in results["levels"]:
        for system in ("serve", "static", "hf"):
            assert row[system]["tok_per_s"] > 0 and row[system]["latency_med_s"] > 0
    cache, no_cache = results["chat"]["cache"], results["chat"]["no_cache"]
    assert [t["prompt_tokens"] for t in cache] == [t["prompt_tokens"] for t in no_cache]
    assert cache[0]["cached_tokens"] == 0 and all(t["cached_tokens"] > 0 for t in cache[1:])
    assert all(t["cached_tokens"] == 0 for t in no_cache)
    fewshot = results["fewshot"]  # block prefix states: the shared preamble is read once, the outputs are the same
    assert fewshot["equal_outputs"] and fewshot["blocks"]["cached_tokens"] > 0
    assert fewshot["blocks"]["prompt_tokens_computed"] < fewshot["no_blocks"]["prompt_tokens_computed"]
    assert (tmp_path / "f.png").stat().st_size > 0
