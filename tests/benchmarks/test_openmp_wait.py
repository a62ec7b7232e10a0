"""``benchmarks/openmp_wait.py`` end to end on small models: each OpenMP setting reaches its own child process."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.test_inference_benchmark import load_benchmark


@pytest.mark.slow
def test_each_setting_runs_in_a_child_with_its_environment(tmp_path):
    out = tmp_path / "openmp.json"
    main = load_benchmark("openmp_wait").main
    assert main(["--spins", "0", "2000", "--loads", "0", "1", "--repeats", "1", "--threads", "1",
                 "--decode-preset", "griffin-tiny", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["load"], r["spin"]) for r in rows] == [(0, 0), (0, 2000), (1, 0), (1, 2000)]
    for r in rows:
        assert r["env"] == {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": None if r["spin"] == 0 else "2000"}
        assert all(r[k] > 0 for k in ("forward_ms", "train_step_ms", "decode_cpu_b4_ms", "decode_b1_ms"))
        assert r["decode_b1_vs_first"] == pytest.approx(rows[2 * (r["load"])]["decode_b1_ms"] / r["decode_b1_ms"])


def test_bad_settings_are_refused():
    main = load_benchmark("openmp_wait").main
    with pytest.raises(SystemExit, match="non-negative"):
        main(["--loads", "-1"])
