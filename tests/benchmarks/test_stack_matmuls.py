"""``benchmarks/stack_matmuls.py``: the three paths run on a small preset and count the matrices' bytes."""

from __future__ import annotations

import json

import pytest

from griffin.inference.cpu import isa
from tests.benchmarks.test_inference_benchmark import load_benchmark


@pytest.mark.slow
@pytest.mark.skipif(not {"bfloat16", "int8"} <= isa.DOT_INSTRUCTIONS,
                    reason="this host has no one-row bfloat16 and int8 instructions")
def test_each_path_is_timed_for_both_weights(tmp_path):
    out = tmp_path / "stack.json"
    assert load_benchmark("stack_matmuls").main(["--model", "griffin-cpu", "--rounds", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["dtype"], r["path"]) for r in rows} == {(d, p) for d in ("bfloat16", "int8")
                                                        for p in ("stack", "matmuls alone", "dots alone")}
    assert all(r["ms"] > 0 and len(r["ms_all"]) == 2 for r in rows)
    gb = {r["dtype"]: r["gb"] for r in rows}
    assert gb["int8"] == pytest.approx(gb["bfloat16"] / 2)  # the same matrices, one byte a weight instead of two
