"""Scale-out training on CPU (gloo, spawned processes, tiny models of each family), against one process: tensor
parallelism (tp = 2), ZeRO-3 (dp_shard = 2) and both (2 × 2 on 4 processes); the Conv1D and RG-LRU shards without
communication; sharded checkpoints written on 4 ranks and loaded on 1 and on 2 with another layout; a rank killed
while writing; conversion to one checkpoint. The spawned processes run tests/parallel/workers.py; the two
multi-process runs are shared by the tests below (module fixtures), to keep the suite's cost to two spawns."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.multiprocessing as mp

from griffin import CausalLM, load_pretrained
from griffin.cli import main
from griffin.interop import CheckpointError
from griffin.parallel import load_sharded, load_sharded_model, save_sharded
from griffin.training.checkpoint import find_resumable, verify_checkpoint
from tests.conftest import seed_torch
from tests.parallel import workers


@pytest.fixture(scope="module")
def seed() -> int:
    """The seed of every random input of this module (printed; GRIFFIN_TEST_SEED replays it, as ``gen`` does)."""
    value = int(os.environ.get("GRIFFIN_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"tests/parallel: GRIFFIN_TEST_SEED={value}")
    return value


@pytest.fixture(scope="module")
def four(tmp_path_factory, seed) -> dict:
    out = tmp_path_factory.mktemp("four")
    ckpt = out / "ckpt" / "step_00000002"
    result = workers.spawn(4, "four_ranks", out / "run", seed=seed, ckpt=str(ckpt))
    return {**result[0], "ckpt": ckpt, "ranks": result}


@pytest.fixture(scope="module")
def two(tmp_path_factory, seed, four) -> dict:
    out = tmp_path_factory.mktemp("two")
    result = workers.spawn(2, "two_ranks", out / "run", seed=seed, ckpt=str(four["ckpt"]))
    return {**result[0], "ranks": result}


def check_against_one_process(result: dict, tol: float) -> None:
    for family, r in result.items():
        for key in ("loss_err", "grad_err", "norm_err", "weight_err"):
            assert r[key] < tol, (family, key, r[key], r)


def test_2x2_on_four_processes_equals_one_process_float32(four):
    """dp_shard = 2 × tp = 2: losses, every gathered gradient, gradient norms and the weights after 3 AdamW steps
    within 1e-5 of one process (relative to each tensor's scale; weights to the model's). Float32 sums in another
    order: up to 5.1e-6 in a gradient and 2.7e-7 in the weights over 5 seeds; a wrong shard is off by about 1 in a
    gradient and by about the learning rate (1e-3) in the weights."""
    check_against_one_process(four["compare"], 1e-5)


def test_tp2_and_dp_shard2_equal_one_process_float64(two):
    check_against_one_process(two["tp"], 1e-11)  # with the chunked vocabulary-parallel loss
    check_against_one_process(two["dp_shard"], 1e-11)


def test_conv1d_and_rg_lru_shards_issue_no_collective(two):
    comm = two["comm"]
    assert comm["local"] == 0, comm  # forward and backward of the Conv1D and the RG-LRU on their channels
    # the whole recurrent residual block: one all-reduce per sub-block in each direction (Megatron)
    assert sum(comm["forward"].values()) == 2 and all("all_reduce" in k for k in comm["forward"]), comm
    assert sum(comm["backward"].values()) == 2 and all("all_reduce" in k for k in comm["backward"]), comm


def test_planner_memory_model_equals_the_shards_the_ranks_hold(two):
    """Parameters, gradients and AdamW moments per rank (float32): the largest rank's local shards equal the
    planner's figures (FSDP pads the first dimension to a multiple of dp_shard: the largest rank holds the padded
    share), for tp = 2, dp_shard = 2 and dp_replicate = 2."""
    for layout, held in two["held"].items():
        for key in ("parameters", "gradients", "optimizer"):
            assert held[key] <= held["planned"][key], (layout, key, held)
    ranks = [r["held"] for r in two["ranks"]]
    for layout in two["held"]:
        for key in ("parameters", "gradients", "optimizer"):
            assert max(r[layout][key] for r in ranks) == two["held"][layout]["planned"][key], (layout, key)


def test_logits_gathered_over_the_vocabulary(two):
    for family in ("hawk", "griffin", "mqa"):
        assert two["logits"][family] < 1e-12, (family, two["logits"])
        assert two["logits"][f"{family}-cache-refused"] is True, family


def test_checkpoint_written_on_four_ranks_resumes_on_one_process(four, seed):
    ckpt = four["ckpt"]
    verify_checkpoint(ckpt)  # the manifest covers every rank's shards
    got = workers.load_then_train(0, 1, ckpt.parent, (1, 1, 1), "griffin", seed, 2, 2, str(ckpt))["losses"]
    assert got == pytest.approx(four["after_save"]["losses"], rel=1e-5)


def test_checkpoint_written_on_four_ranks_resumes_on_two_with_another_layout(four, two):
    assert two["resumed"]["losses"] == pytest.approx(four["after_save"]["losses"], rel=1e-5)


def test_sharded_checkpoint_of_another_config_is_refused(four):
    other = CausalLM(workers.tiny("griffin").replace(width=32, num_heads=4))
    with pytest.raises(CheckpointError, match=r"another model: width=16 there, 32 here;.* num_heads=2 there, 4 here"):
        load_sharded(four["ckpt"], other)


def test_convert_sharded_checkpoint_to_griffin(four, tmp_path, capsys):
    model = load_sharded_model(four["ckpt"])
    assert main(["convert", str(four["ckpt"]), str(tmp_path / "one")]) == 0
    assert "gathered from a sharded checkpoint" in capsys.readouterr().out
    converted = load_pretrained(tmp_path / "one")
    for (name, p), q in zip(model.named_parameters(), converted.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_sharded_checkpoint_of_one_process_converts_to_hf(tmp_path, gen):
    """One process writes a sharded checkpoint too (no process group); `griffin convert --to hf` gathers it."""
    seed_torch(gen)
    model = CausalLM(workers.tiny("griffin").replace(gate_blocks=2))  # HF ties the gate blocks to the heads
    opt = torch.optim.AdamW(model.parameters())
    save_sharded(tmp_path / "step_00000000", model, opt, {"step": 0})
    assert main(["convert", str(tmp_path / "step_00000000"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=gen)
    torch.testing.assert_close(load_pretrained(tmp_path / "hf")(ids), model(ids), rtol=1e-5, atol=1e-5)


def test_rank_killed_while_writing_leaves_the_previous_checkpoint(tmp_path, gen):
    root = tmp_path / "checkpoints"
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        workers.spawn(2, "killed_during_save", tmp_path / "run", seed=seed, root=str(root))
    assert not (root / "step_00000002").exists()  # the interrupted step never became a checkpoint
    assert find_resumable(root) == root / "step_00000001"
    model = CausalLM(workers.tiny("griffin"))
    assert load_sharded(root / "step_00000001", model, torch.optim.AdamW(model.parameters()))["step"] == 1


def test_killed_checkpoint_debris_is_not_loadable(tmp_path):
    debris = tmp_path / ".tmp-step_00000002"
    debris.mkdir()
    with pytest.raises(CheckpointError, match="not a sharded checkpoint"):
        load_sharded(debris, CausalLM(workers.tiny("hawk")))


# Slow: every option and layout, float64 ------------------------------------------------------------------------------
@pytest.mark.slow
def test_sequence_parallel_and_activation_checkpointing_equal_one_process(tmp_path, seed):
    result = workers.spawn(2, "options_and_hsdp", tmp_path, seed=seed)[0]
    check_against_one_process(result["tp_sp_ac"], 1e-11)
    check_against_one_process(result["dp_ac"], 1e-11)


@pytest.mark.slow
def test_2x2_and_hsdp_layouts_equal_one_process_float64(tmp_path, seed):
    result = workers.spawn(4, "options_and_hsdp", tmp_path, seed=seed, timeout=900)[0]
    for layout in ("2x2", "hsdp_tp", "hsdp"):
        check_against_one_process(result[layout], 1e-11)


@pytest.mark.slow
def test_compiled_blocks_equal_one_process(tmp_path, seed):
    result = workers.spawn(2, "compiled_blocks", tmp_path, seed=seed, timeout=900)[0]
    check_against_one_process(result["tp"], 1e-10)
    check_against_one_process(result["dp"], 1e-10)
