"""`griffin train --tp N --dp-shard N --dp-replicate N` under torchrun (CPU, gloo): the losses of one process,
sharded checkpoints that resume on 1 process and on another layout, and the layout flags' refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from griffin.cli import main
from griffin.parallel import is_sharded
from griffin.training import TrainConfig, train
from tests.conftest import words_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return words_dataset(tmp_path_factory.mktemp("data"))


def args(dataset: Path, out: Path, batch_size: int, **extra) -> list[str]:
    flags = {"preset": "griffin-tiny", "data": dataset, "out": out, "seq-len": 32, "batch-size": batch_size,
             "max-steps": 4, "warmup-steps": 2, "eval-interval": 2, "eval-batches": 2, "log-interval": 1,
             "ckpt-interval": 2, "keep-last": 5, "lr": 0.01, "sample-tokens": 8, "sample-prompt": "the ",
             "threads": 1, **extra}
    return [*(x for k, v in flags.items() for x in (f"--{k}", str(v))), "--no-progress", "--no-tensorboard"]


def losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def torchrun(n: int, argv: list[str]) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                          "-m", "griffin.cli", "train", *argv], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run


def test_layout_flags_are_refused_with_the_values_named(dataset, tmp_path, capsys):
    for key, value in (("tp", 0), ("dp_shard", 0), ("dp_replicate", -1)):
        with pytest.raises(ValueError, match=f"{key}={value}"):
            TrainConfig(**{key: value})
    assert main(["train", *args(dataset, tmp_path / "a", 4, tp=2)]) == 2
    assert "tp=2 × dp_shard=1 = 2 does not divide the world size 1" in capsys.readouterr().err
    assert main(["train", *args(dataset, tmp_path / "b", 4, **{"dp-replicate": 2})]) == 2
    assert "dp_replicate=2 with tp=1 and dp_shard=1 must equal the world size 1" in capsys.readouterr().err
    assert main(["train", *args(dataset, tmp_path / "c", 4), "--sequence-parallel"]) == 2  # (activation checkpointing
    assert "sequence_parallel apply to a layout with tp > 1 or dp_shard > 1" in capsys.readouterr().err  # runs alone)


def test_loader_position_is_shared_out_again_on_another_layout(dataset):
    """The windows 2 ranks of 2 sequences read in 3 steps are those 1 rank of 4 and 4 ranks of 1 read in 3 steps."""
    from griffin.data import PackedLoader
    from griffin.training.layout import translate_loader_state

    def seen(world: int, batch: int, steps: int, state=None) -> set[int]:
        windows = set()
        for rank in range(world):
            loader = PackedLoader(dataset, "train", 32, batch, seed=3, rank=rank, world_size=world)
            if state is not None:
                loader.load_state_dict(translate_loader_state(state, batch, world, loader.windows_per_rank))
            for _ in range(steps):
                windows |= set(loader.next_windows().tolist())
        return windows

    two = [PackedLoader(dataset, "train", 32, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    for loader in two:
        for _ in range(3):
            loader.next_windows()
    state = two[0].state_dict()
    later = seen(2, 2, 2, {**state})
    assert seen(1, 4, 2, state) == later == seen(4, 1, 2, state)
    with pytest.raises(Exception, match=r"2 sequences × 2 data-parallel ranks = 4 per step, this run reads 3 × 1"):
        translate_loader_state(state, 3, 1, 100)


def test_evaluation_batches_are_even_on_every_rank():
    """Under FSDP every rank must run the same forward passes: shares are padded with all-ignored batches."""
    from griffin.data import Batch
    from griffin.ops.cross_entropy import IGNORE_INDEX
    from griffin.training.layout import even_share

    batches = [Batch(torch.full((2, 4), i), torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
               for i in range(3)]
    shares = [even_share(batches, r, 4) for r in range(4)]
    assert [len(s) for s in shares] == [1, 1, 1, 1]
    assert (shares[3][0].targets == IGNORE_INDEX).all() and (shares[2][0].input_ids == 2).all()


@pytest.mark.slow
def test_torchrun_tp2_dp_shard2_matches_one_process_and_resumes_on_other_layouts(dataset, tmp_path):
    """4 processes, tp = 2 × dp_shard = 2, 2 sequences per data-parallel rank = one process with 4 sequences;
    its sharded step-2 checkpoint resumes on 1 process (batch 4) and on dp_shard = 4 (batch 1) to the same losses."""
    one = train(TrainConfig(**{k.replace("-", "_"): v for k, v in _flags(dataset, tmp_path / "one", 4).items()}))
    run = torchrun(4, args(dataset, tmp_path / "tp2x2", 2, tp=2, **{"dp-shard": 2}))
    assert run.stdout.count("trained 4 steps") == 4  # every rank reports
    assert "layout dp_replicate=1 × dp_shard=2 × tp=2 over 4 processes" in run.stdout
    ref, got = losses(one.out), losses(tmp_path / "tp2x2")
    assert got.keys() == ref.keys()
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    step2 = tmp_path / "tp2x2" / "checkpoints" / "step_00000002"
    assert is_sharded(step2) and (tmp_path / "tp2x2" / "checkpoints" / "latest").resolve() == \
        (tmp_path / "tp2x2" / "checkpoints" / "step_00000004").resolve()
    assert main(["train", *args(dataset, tmp_path / "resumed1", 4, resume=step2)]) == 0
    torchrun(4, args(dataset, tmp_path / "resumed4", 1, resume=step2, **{"dp-shard": 4}))
    for out in ("resumed1", "resumed4"):
        resumed = losses(tmp_path / out)
        assert sorted(resumed) == [3, 4], out
        for step in resumed:
            assert resumed[step] == pytest.approx(ref[step], rel=1e-5), (out, step)
    # the sharded checkpoint converts to one griffin checkpoint that generates
    assert main(["convert", str(step2), str(tmp_path / "gathered")]) == 0
    assert main(["generate", str(tmp_path / "gathered"), "--prompt", "the", "--max-new-tokens", "4"]) == 0


@pytest.mark.slow
def test_single_process_checkpoint_resumes_on_a_layout(dataset, tmp_path):
    """A checkpoint of one process (griffin's single-file format) resumes on tp = 2 to the same losses."""
    one = train(TrainConfig(**{k.replace("-", "_"): v for k, v in _flags(dataset, tmp_path / "one", 4).items()}))
    step2 = tmp_path / "one" / "checkpoints" / "step_00000002"
    assert not is_sharded(step2)
    torchrun(2, args(dataset, tmp_path / "tp2", 4, resume=step2, tp=2))
    resumed, ref = losses(tmp_path / "tp2"), losses(one.out)
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert resumed[step] == pytest.approx(ref[step], rel=1e-5), step


def _flags(dataset: Path, out: Path, batch_size: int) -> dict:
    return {"preset": "griffin-tiny", "data": str(dataset), "out": str(out), "seq_len": 32, "batch_size": batch_size,
            "max_steps": 4, "warmup_steps": 2, "eval_interval": 2, "eval_batches": 2, "log_interval": 1,
            "ckpt_interval": 2, "keep_last": 5, "lr": 0.01, "sample_tokens": 8, "sample_prompt": "the ",
            "threads": 1, "progress": False, "tensorboard": False}
