"""``benchmarks/inference.py`` end to end on a tiny model: its peers (HF transformers' RecurrentGemma and the
official recurrentgemma package) run the same weights, and the benchmark checks that they agree with griffin."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module, loaded from its path with its folder on ``sys.path`` (so that
    its sibling ``common`` imports); registered in ``sys.modules`` (its dataclasses look their module up there)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


main = load_benchmark("inference").main


def test_inference_benchmark_compares_the_same_model_with_its_peers(tmp_path, capsys):
    out = tmp_path / "inference.json"
    argv = ["--families", "griffin", "--width", "32", "--depth", "3", "--heads", "2", "--vocab", "64", "--window",
            "8", "--batch", "2", "--prompt", "12", "--lengths", "4", "--throughput-lengths", "4", "--min-batch", "2",
            "--max-batch", "2", "--hf-lengths", "5", "--check-tokens", "6", "--copy-mb", "1", "--threads", "1",
            "--out", str(out), "--figures", ""]
    assert main(argv) == 0
    results = json.loads(out.read_text())
    names = {check["peer"] for check in results["peer_checks"]}
    assert names == {"HF", "official"}  # both are test dependencies
    for check in results["peer_checks"]:  # same weights: the same logits and greedy tokens
        assert check["max_logit_diff"] < 1e-4 and check["token_agreement"] == 1.0, check
    assert [(r["prompt"], r["tokens"]) for r in results["peers"]] == [(1, 5), (12, 5)]
    for row in results["peers"]:
        for name in names:
            assert row[f"ratio_{name}"] == pytest.approx(row[f"{name}_s"] / row["griffin_s"])
    assert "ratio HF" in capsys.readouterr().out
