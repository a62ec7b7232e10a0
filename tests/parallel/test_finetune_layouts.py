"""`griffin finetune --lora-rank 0` (a full fine-tune from a checkpoint, on packed examples) under torchrun (CPU, gloo):
the losses of one process on tensor-parallel and sharded layouts, and LoRA under data parallelism; activation
checkpointing in one process."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from griffin import CausalLM
from griffin.cli import main
from griffin.config import ModelConfig
from griffin.interop import save_pretrained


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Griffin checkpoint and 96 prompt/completion pairs."""
    root = tmp_path_factory.mktemp("finetune")
    torch.manual_seed(0)
    save_pretrained(CausalLM(ModelConfig.from_preset("griffin-tiny", vocab_size=256)), root / "base")
    rng = random.Random(0)
    lines = []
    for _ in range(96):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(json.dumps({"prompt": f"{a} + {b} =", "completion": f" {a + b}"}))
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return root / "base", root / "pairs.jsonl"


def args(base: tuple[Path, Path], out: Path, batch_size: int, **extra) -> list[str]:
    flags = {"data": base[1], "out": out, "seq-len": 64, "batch-size": batch_size, "max-steps": 4, "warmup-steps": 2,
             "eval-interval": 2, "eval-batches": 2, "log-interval": 1, "ckpt-interval": 2, "lr": 0.01,
             "threads": 1, "eval-examples": 2, **extra}
    return [str(base[0]), *(x for k, v in flags.items() for x in (f"--{k}", str(v))), "--no-progress",
            "--no-tensorboard"]


def losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def torchrun(n: int, argv: list[str]) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                          "-m", "griffin.cli", "finetune", *argv], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run


@pytest.mark.slow
def test_full_finetune_on_tp2_dp_shard2_matches_one_process(base, tmp_path):
    """4 processes, tp = 2 × dp_shard = 2 with 2 rows each = one process with 4 rows: the same step losses, from the
    same checkpoint's weights (set on every rank's shards), on the same packed examples."""
    assert main(["finetune", *args(base, tmp_path / "one", 4, **{"lora-rank": 0})]) == 0
    run = torchrun(4, args(base, tmp_path / "tp2x2", 2, tp=2, **{"dp-shard": 2, "lora-rank": 0}))
    assert "layout dp_replicate=1 × dp_shard=2 × tp=2 over 4 processes" in run.stdout
    ref, got = losses(tmp_path / "one"), losses(tmp_path / "tp2x2")
    assert got.keys() == ref.keys() == {1, 2, 3, 4}
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step


@pytest.mark.slow
def test_lora_under_data_parallelism_matches_one_process(base, tmp_path):
    """LoRA on 2 data-parallel processes (DistributedDataParallel over the adapters) with 2 rows each = one process
    with 4 rows; LoRA with a sharded layout is refused, naming what runs instead."""
    assert main(["finetune", *args(base, tmp_path / "one", 4, **{"lora-rank": 4})]) == 0
    torchrun(2, args(base, tmp_path / "ddp", 2, **{"lora-rank": 4}))
    ref, got = losses(tmp_path / "one"), losses(tmp_path / "ddp")
    assert got.keys() == ref.keys() == {1, 2, 3, 4}
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "griffin.cli", "finetune", *args(base, tmp_path / "fsdp", 2, **{"dp-shard": 2})],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode != 0 and "tp and dp_shard lay out a full fine-tune (--lora-rank 0)" in run.stderr


@pytest.mark.parametrize("rank", [0, 4])
def test_activation_checkpointing_in_one_process_changes_nothing(base, tmp_path, rank):
    """``--activation-checkpointing`` without a layout (one process) recomputes each block in the backward pass: the
    same losses and weights, for a full fine-tune and for LoRA with dropout (its random draws replayed)."""
    runs = {}
    for flag in ("--no-activation-checkpointing", "--activation-checkpointing"):
        out = tmp_path / flag.strip("-")
        argv = args(base, out, 4, **{"lora-rank": rank, "lora-dropout": 0.1, "eval-examples": 0})
        assert main(["finetune", *argv, flag]) == 0
        weights = "adapter_model.safetensors" if rank else "model.safetensors"
        runs[flag] = losses(out), load_file(out / "checkpoints" / "step_00000004" / weights)
    (plain, plain_weights), (checkpointed, checkpointed_weights) = runs.values()
    assert plain == checkpointed and len(plain) == 4
    assert plain_weights.keys() == checkpointed_weights.keys()
    for name, tensor in plain_weights.items():
        assert torch.equal(tensor, checkpointed_weights[name]), name
