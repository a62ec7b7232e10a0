"""``benchmarks/openmp_wait.py`` end to end on small models: each OpenMP setting reaches its own child process."""

from __future__ import annotations

import json
import math

import pytest

from tests.benchmarks.test_inference_benchmark import load_benchmark


@pytest.mark.slow
def test_each_setting_runs_in_a_child_with_its_environment(tmp_path):
    """Every setting and load in a child process of its own, whose environment held the setting and whose OpenMP
    runtime (each one the child loaded) read it, and which timed each of its five measurements; the torch-only
    setting (griffin train's) reaches torch's runtime alone, numba's passive."""
    out = tmp_path / "openmp.json"
    main = load_benchmark("openmp_wait").main
    assert main(["--spins", "0", "2000", "--torch-spins", "3000", "--loads", "0", "1", "--repeats", "1",
                 "--threads", "1", "--decode-preset", "griffin-tiny", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["load"], r["spin"], r["torch_only"]) for r in rows] == [
        (0, 0, False), (0, 2000, False), (0, 3000, True), (1, 0, False), (1, 2000, False), (1, 3000, True)]
    for r in rows:
        spins = [d["GOMP_SPINCOUNT"] for d in r["runtimes"]]
        assert all(d["OMP_WAIT_POLICY"] == "PASSIVE" for d in r["runtimes"]), r["runtimes"]
        if r["torch_only"]:  # torch's runtime loads first; the variable is gone before numba's (the RG-LRU) starts
            assert r["env"] == {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": None}
            assert spins == ["3000", "0"], r["runtimes"]
        else:  # libgomp: passive waiting spins 0 times unless GOMP_SPINCOUNT says otherwise
            assert r["env"] == {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": None if r["spin"] == 0 else "2000"}
            assert spins and set(spins) == {str(r["spin"])}, r["runtimes"]
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("forward_ms", "train_step_ms", "compiled_step_ms",
                                                              "decode_cpu_b4_ms", "decode_b1_ms"))


def test_openmp_displays_are_read_one_per_runtime():
    """What two runtimes print with OMP_DISPLAY_ENV (an older libgomp's format, and a newer one's with [host] and
    [all] prefixes: the first value of a name kept), among other lines of stderr."""
    displays = load_benchmark("openmp_wait").openmp_displays("""warning: x = 1

OPENMP DISPLAY ENVIRONMENT BEGIN
  _OPENMP = '201511'
  OMP_WAIT_POLICY = 'PASSIVE'
  GOMP_SPINCOUNT = '0'
OPENMP DISPLAY ENVIRONMENT END
y = 2
OPENMP DISPLAY ENVIRONMENT BEGIN
  [host] OMP_WAIT_POLICY = 'ACTIVE'
  [all] OMP_WAIT_POLICY = 'PASSIVE'
  GOMP_SPINCOUNT = '300000'
OPENMP DISPLAY ENVIRONMENT END
""")
    assert displays == [{"_OPENMP": "201511", "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"},
                        {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}]


def test_bad_settings_are_refused():
    main = load_benchmark("openmp_wait").main
    with pytest.raises(SystemExit, match="non-negative"):
        main(["--loads", "-1"])
