"""``benchmarks/finetune.py --quick`` end to end: griffin and HF transformers + PEFT fine-tune the same exported model
with the same LoRA adapters (written by griffin, loaded by PEFT) on the same rows, each in its own process; their step
losses agree to float32 rounding."""

from __future__ import annotations

import json

from tests.benchmarks.test_inference_benchmark import load_benchmark


def test_finetune_benchmark_trains_the_same_adapters_in_both(tmp_path, capsys):
    out = tmp_path / "finetune.json"
    assert load_benchmark("finetune").main(["--quick", "--threads", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["args"]["quick"] and results["model"]["lora_params"] > 0
    assert [r["seq_len"] for r in results["rows"]] == [192]
    steps = results["args"]["warmup"] + results["args"]["steps"]
    for row in results["rows"]:
        griffin, hf = row["griffin"], row["hf"]
        assert griffin["trainable"] == hf["trainable"] == results["model"]["lora_params"]
        # The same adapters from the same start: every step's loss agrees to float32 rounding, not only the first
        # (which a base model without adapters would also give), so the updates agree too.
        assert len(griffin["losses"]) == len(hf["losses"]) == steps
        assert row["max_loss_rel_diff"] < 1e-5, (griffin["losses"], hf["losses"])
        assert len(set(griffin["losses"])) == steps  # the rows differ from step to step
        for side in (griffin, hf):
            assert len(side["times_s"]) == results["args"]["steps"] and side["tokens_per_s"] > 0
            assert side["peak_above_base_mib"] > 0 and side["peak_mib"] >= side["base_mib"]
        assert row["speedup"] == griffin["tokens_per_s"] / hf["tokens_per_s"]
        assert row["memory_ratio"] == hf["peak_above_base_mib"] / griffin["peak_above_base_mib"]
    for key in ("machine", "command", "model", "rows", "runs", "wall_s"):
        assert key in results
    assert {"transformers", "peft", "torch", "cpu"} <= set(results["machine"])
    assert "griffin / HF" in capsys.readouterr().out
