"""Context parallelism (griffin.parallel.context_parallel) on CPU: gloo, spawned processes, tiny float64 models of
each family; cp = 2 and cp = 4 against one process running the whole sequences: the loss, every gradient and the
weights after 3 AdamW steps within 1e-10, with documents starting exactly at a shard boundary, one token after it,
inside a shard, at random and after padding; a local-attention window longer than a shard, and a Conv1D halo longer
than a shard. Then cp as a mesh dim through ``parallelize`` (FSDP over dp_shard × cp): cp = 2 (also with activation
checkpointing), cp × dp_shard and cp × tp on 4 ranks, a cp = 2 checkpoint resumed on one process; `griffin train
--cp 2` under torchrun; the refusals; the planner's counts. One spawn per cp (module fixtures), every case inside
it: the default suite spawns 2 processes once (about 40 s on 2 cores); cp = 4 and the 4-rank layouts are slow."""

from __future__ import annotations

import os
import random

import pytest
import torch

from griffin.parallel.context_parallel import check_context_parallel, combine_carries, shard_sequence
from tests.parallel import cp_workers
from tests.parallel.workers import spawn, tiny

TOL = 1e-10
# (name, family, seq_len, positions, overrides): seq_len 24 gives shards of 12 (cp = 2) and 6 (cp = 4); the tiny
# models' window is 6 (5 keys back), the Conv1D's width 4 (3 inputs back).
CASES = [
    ("hawk_boundary", "hawk", 24, "boundary", {}),
    ("hawk_after", "hawk", 24, "after", {}),
    ("hawk_inside", "hawk", 24, "inside", {}),
    ("hawk_one_document", "hawk", 24, "none", {}),
    ("hawk_halo_over_shards", "hawk", 8, "random", {}),  # cp = 4: shards of 2 < K - 1 = 3
    ("griffin_boundary", "griffin", 24, "boundary", {"logits_soft_cap": 3.0, "embed_scale": True}),
    ("griffin_after", "griffin", 24, "after", {}),
    ("griffin_inside_pad", "griffin", 24, "pad", {}),
    ("griffin_window_over_shards", "griffin", 24, "inside", {"attention_window": 16}),
    ("griffin_one_document", "griffin", 24, "none", {"attention_window": 16}),
    ("mqa_boundary", "mqa", 24, "boundary", {"tie_embeddings": False}),
    ("mqa_random", "mqa", 24, "random", {}),
    ("mqa_one_document", "mqa", 24, "none", {}),
]


@pytest.fixture(scope="module")
def seed() -> int:
    value = int(os.environ.get("GRIFFIN_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"tests/parallel/test_context_parallel: GRIFFIN_TEST_SEED={value}")
    return value


def cases() -> list[dict]:
    return [{"name": n, "family": f, "seq_len": t, "positions": p, "overrides": o} for n, f, t, p, o in CASES]


@pytest.fixture(scope="module")
def cp2(tmp_path_factory, seed) -> dict:
    """One 2-process spawn for every cp = 2 check (a spawn costs most of the time)."""
    out = tmp_path_factory.mktemp("cp2")
    ckpt = out / "ckpt" / "step_00000002"
    result = spawn(2, "tests.parallel.cp_workers:two_ranks", out / "run", seed=seed, ckpt=str(ckpt), cases=cases())[0]
    return {**result, "ckpt": ckpt, "seed": seed}


@pytest.fixture(scope="module")
def cp4(tmp_path_factory, seed) -> dict:
    out = tmp_path_factory.mktemp("cp4")
    return spawn(4, "tests.parallel.cp_workers:four_ranks", out / "run", seed=seed, cases=cases())[0]


def check(result: dict, name: str) -> None:
    r = result[name]
    for key in ("loss_err", "grad_err", "weight_err", "norm_err"):
        if key in r:
            assert r[key] < TOL, (name, key, r)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_cp2_equals_one_process(cp2, name):
    """cp = 2: loss, gradients and weights after 3 AdamW steps within 1e-10 of one process (float64)."""
    check(cp2["compare"], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_cp4_equals_one_process(cp4, name):
    """cp = 4: shards of 6 tokens (2 for the halo case), the window of 16 reaching 3 shards back."""
    check(cp4["compare"], name)


@pytest.mark.parametrize("family", ["hawk", "griffin", "mqa"])
def test_cp2_layout_equals_one_process(cp2, family):
    """cp = 2 as a mesh dim through parallelize (FSDP over the cp ranks reduces their gradients): losses, gathered
    gradients, clipped norms and weights after 3 AdamW steps within 1e-10 of one process (float64)."""
    check(cp2["cp2"], family)


@pytest.mark.parametrize("family", ["hawk", "griffin", "mqa"])
def test_cp2_with_activation_checkpointing_equals_one_process(cp2, family):
    """cp = 2 with each block recomputed in the backward pass: the recomputed forward's collectives pair up."""
    check(cp2["cp2_ac"], family)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp_dp_shard", "cp_tp"])
@pytest.mark.parametrize("family", ["hawk", "griffin", "mqa"])
def test_cp_with_dp_shard_and_tp_on_four_ranks(cp4, layout, family):
    """cp = 2 × dp_shard = 2 (FSDP over the flattened dp_shard × cp) and cp = 2 × tp = 2, against one process."""
    check(cp4[layout], family)


def test_cp2_checkpoint_resumes_on_one_process(cp2):
    """A sharded checkpoint written at cp = 2 loads on one process (the same parameters) and the next two losses are
    those the cp = 2 run had."""
    losses = cp_workers.resume_one_process("griffin", cp2["seed"], str(cp2["ckpt"]))
    expected = cp2["after_save"]["losses"]
    assert len(losses) == len(expected) == 2
    for got, want in zip(losses, expected, strict=True):
        assert abs(got - want) <= 1e-10 * abs(want), (losses, expected)


def test_carry_scan_is_the_sequential_recurrence():
    """combine_carries folds the shards' (h_j, A_j) into the state entering each shard: the recurrence run over the
    shards' summaries, h <- A_j h + h_j."""
    gen = torch.Generator().manual_seed(0)
    h, a = torch.randn(4, 2, 3, generator=gen, dtype=torch.float64), torch.rand(4, 2, 3, generator=gen,
                                                                                dtype=torch.float64)
    state = torch.zeros(2, 3, dtype=torch.float64)
    for r in range(4):
        torch.testing.assert_close(combine_carries(h, a, r), state, rtol=0, atol=1e-15)
        state = a[r] * state + h[r]


@pytest.mark.parametrize("with_reset", [False, True])
def test_decay_correction_matches_its_autograd_reference(with_reset):
    """_ShardDecay and _DecayCorrection (which keep only gate_a and recompute the decays in the backward pass) give
    the values and gradients of shard_decay's plain expression, with and without document starts."""
    from griffin.parallel.context_parallel import _DecayCorrection, _ShardDecay, shard_decay

    gen = torch.Generator().manual_seed(1)
    B, T, D = 2, 7, 5

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    y, h_local, gate_a, a_param, h_in = leaf(B, T, D), leaf(B, D), leaf(B, T, D), leaf(D), leaf(B, D)
    reset = (torch.rand(B, T, generator=gen) < 0.2) if with_reset else None
    if reset is not None:
        reset[0, 3] = True
    w_out, w_last, w_a = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((B, T, D), (B, D), (B, D)))
    inputs = (y, h_local, gate_a, a_param, h_in)

    decay = shard_decay(gate_a, a_param, 8.0, reset)
    ref = ((y + decay * h_in[:, None]) * w_out).sum() + ((h_local + decay[:, -1] * h_in) * w_last).sum()
    ref = ref + (decay[:, -1] * w_a).sum()
    ref_grads = torch.autograd.grad(ref, inputs)
    out, last = _DecayCorrection.apply(y, h_local, gate_a, a_param, h_in, 8.0, reset)
    got = (out * w_out).sum() + (last * w_last).sum() + (_ShardDecay.apply(gate_a, a_param, 8.0, reset) * w_a).sum()
    torch.testing.assert_close(got, ref, rtol=1e-13, atol=0)
    for g, r in zip(torch.autograd.grad(got, inputs), ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-14)


def test_bad_inputs_name_the_values():
    with pytest.raises(ValueError, match="seq_len=10 is not a multiple of cp=4"):
        check_context_parallel(tiny("hawk"), 4, 10)
    with pytest.raises(ValueError, match="complex_lru=True"):
        check_context_parallel(tiny("hawk").replace(complex_lru=True), 2, 8)
    with pytest.raises(ValueError, match="attention_document_mask=False"):
        check_context_parallel(tiny("griffin").replace(attention_document_mask=False), 2, 8)
    check_context_parallel(tiny("hawk").replace(attention_document_mask=False), 2, 8)  # no attention to mask
    with pytest.raises(ValueError, match="cp=0"):
        check_context_parallel(tiny("hawk"), 0)
    with pytest.raises(ValueError, match="length 10 over cp=4"):
        shard_sequence(torch.zeros(1, 10), 0, 4)
    check_context_parallel(tiny("griffin").replace(complex_lru=True), 1, 7)  # cp = 1 splits nothing


# griffin train --cp N -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from tests.conftest import words_dataset

    return words_dataset(tmp_path_factory.mktemp("data"))


def test_train_cp_flags_are_refused_with_the_values_named(dataset, tmp_path, capsys):
    """Before any work: a sequence length cp does not divide, cp = 0, a cp the world size does not hold."""
    from griffin.cli import main
    from griffin.training import TrainConfig
    from tests.parallel.test_train_layouts import args

    with pytest.raises(ValueError, match="seq_len=32 over cp=3 devices: it must be a multiple of cp"):
        TrainConfig(seq_len=32, cp=3)
    with pytest.raises(ValueError, match="cp=0 must be a positive integer"):
        TrainConfig(cp=0)
    assert main(["train", *args(dataset, tmp_path / "a", 4, cp=3)]) == 2
    assert "seq_len=32 over cp=3" in capsys.readouterr().err
    assert main(["train", *args(dataset, tmp_path / "b", 4, cp=2)]) == 2
    assert "tp=1 × dp_shard=1 × cp=2 = 2 does not divide the world size 1" in capsys.readouterr().err
    assert not (tmp_path / "b" / "checkpoints").exists()


@pytest.mark.slow
def test_torchrun_cp2_matches_one_process_and_resumes_on_one(dataset, tmp_path):
    """`griffin train --cp 2` on 2 processes (float32) gives one process's losses; its sharded step-2 checkpoint
    resumes on one process to the same next losses."""
    from griffin.cli import main
    from griffin.training import TrainConfig, train
    from tests.parallel.test_train_layouts import _flags, args, losses, torchrun

    one = train(TrainConfig(**{k.replace("-", "_"): v for k, v in _flags(dataset, tmp_path / "one", 4).items()}))
    run = torchrun(2, args(dataset, tmp_path / "cp2", 4, cp=2))
    assert "layout dp_replicate=1 × dp_shard=1 × cp=2 × tp=1 over 2 processes" in run.stdout
    ref, got = losses(one.out), losses(tmp_path / "cp2")
    assert got.keys() == ref.keys()
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    step2 = tmp_path / "cp2" / "checkpoints" / "step_00000002"
    assert main(["train", *args(dataset, tmp_path / "resumed", 4, resume=step2)]) == 0
    resumed = losses(tmp_path / "resumed")
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert resumed[step] == pytest.approx(got[step], rel=1e-5), step


# griffin plan --cp N -------------------------------------------------------------------------------------------
def test_plan_counts_context_parallelism(capsys):
    """Activations ÷ cp plus the boundaries' extras (none for cp = 1), parameters sharded over dp_shard × cp, the
    carry/halo/key traffic counted; a cp that does not divide the sequence is refused with the values named."""
    from griffin import ModelConfig
    from griffin.cli import main
    from griffin.parallel.plan import GPUS, Layout, context_parallel_bytes, estimate, memory_per_device

    config = ModelConfig.from_preset("griffin-7b")
    one = memory_per_device(config, Layout(), 32768)
    four = memory_per_device(config, Layout(cp=4), 32768)
    extra = context_parallel_bytes(config, 32768, 4)
    assert context_parallel_bytes(config, 32768, 1) == 0
    assert 0 < extra < 0.05 * four["activations"]
    # (within 2%: local attention pads each shard to whole chunks of queries, not the whole sequence)
    assert four["activations"] == pytest.approx(one["activations"] / 4 + extra, rel=2e-2)
    assert four["parameters"] == pytest.approx(one["parameters"] / 4, rel=1e-3)  # FSDP over the 4 cp ranks
    e = estimate(config, GPUS["h100"], Layout(cp=4, tp=2), 32768, 8)
    assert e.communication["cp"] > 0 and e.time["cp_comm"] > 0
    assert main(["plan", "griffin-7b", "--gpus", "6", "--seq-len", "1000", "--cp", "3"]) == 2
    assert "seq_len=1000 is not a multiple of cp=3" in capsys.readouterr().err
    assert main(["plan", "griffin-7b", "--gpus", "8", "--seq-len", "8192", "--cp", "4", "--tp", "2"]) == 0
    assert "x cp=4 x tp=2" in capsys.readouterr().out
