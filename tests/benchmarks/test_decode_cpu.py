"""``benchmarks/decode_cpu.py`` end to end on a tiny model: the rows, the goals and the split of a step."""

from __future__ import annotations

import json

from griffin import CausalLM, ModelConfig
from griffin.inference.generate import decode_model
from griffin.inference.matvec import MatvecBlockDiagonal, MatvecLinear
from tests.benchmarks.test_inference_benchmark import load_benchmark


def test_decode_benchmark_splits_a_step_into_its_kernel_calls(tmp_path, capsys):
    out = tmp_path / "decode.json"
    main = load_benchmark("decode_cpu").main
    assert main(["--models", "griffin-tiny", "--dtypes", "bfloat16", "int8", "--batches", "1", "--no-hf",
                 "--split", "--warmup", "1", "--steps", "2", "--threads", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [(r["dtype"], r["batch"]) for r in results["rows"]] == [("bfloat16", 1), ("int8", 1)]
    assert results["machine"]["openmp"]["OMP_WAIT_POLICY"] == "passive"
    # one call per matvec module (a fused group is one) and per gate in a step
    swapped = decode_model(CausalLM(ModelConfig.from_preset("griffin-tiny")), 1)
    kernels = sum(isinstance(m, (MatvecLinear, MatvecBlockDiagonal)) for m in swapped.modules())
    assert [(s["dtype"], s["calls"]) for s in results["splits"]] == [("bfloat16", kernels), ("int8", kernels)]
    for s in results["splits"]:
        assert all(s[k] > 0 for k in ("step_ms", "kernels_inside_ms", "kernels_replayed_ms", "step_without_kernels_ms"))
    assert "the same calls replayed" in capsys.readouterr().out
