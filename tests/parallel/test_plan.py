"""The cluster planner (griffin plan): its activation model against the tensors autograd keeps on CPU, its layouts
and the refusals of counts tensor parallelism cannot split; its parameter model is checked against the tensors
the ranks hold in tests/parallel/test_parallel.py."""

from __future__ import annotations

import json

import pytest
import torch

from griffin import CausalLM, ModelConfig
from griffin.cli import main
from griffin.parallel import ParallelDims, check_tensor_parallel
from griffin.parallel.plan import GPUS, Layout, activation_bytes_per_token, estimate, parameter_shards
from tests.conftest import seed_torch


def saved_bytes_per_token(block, x, ctx, params) -> float:
    """Bytes of the distinct storages autograd saves in ``block``'s forward, parameters and the input excluded."""
    skip = {p.untyped_storage().data_ptr() for p in params} | {x.untyped_storage().data_ptr()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, ctx)
    return sum(seen.values()) / (x.shape[0] * x.shape[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_len", [64, 96, 160])  # local attention: one chunk, then padded chunks
def test_activation_model_matches_the_saved_tensors(dtype, seq_len, gen):
    seed_torch(gen)
    for family in ("griffin", "mqa"):
        config = ModelConfig(family=family, vocab_size=64, width=64, depth=3, rnn_width=96, mlp_width=192,
                             num_heads=4, head_dim=16, gate_blocks=4, attention_window=32)
        model = CausalLM(config).to(dtype)
        B = 2
        ctx = model.context(torch.zeros(B, seq_len, dtype=torch.long), torch.arange(seq_len).expand(B, seq_len), None)
        for i, kind in enumerate(config.block_types):
            x = torch.randn(B, seq_len, config.width, generator=gen).to(dtype).requires_grad_()
            got = saved_bytes_per_token(model.blocks[i], x, ctx, list(model.parameters()))
            want = activation_bytes_per_token(config, kind, seq_len, dtype.itemsize)
            assert want == pytest.approx(got, rel=0.02), (family, kind)


def test_parameter_shards_add_up():
    config = ModelConfig.from_preset("griffin-7b", depth=3)
    with torch.device("meta"):
        total = sum(p.numel() for p in CausalLM(config).parameters())
    whole = parameter_shards(config, 1, 1)
    assert sum(s["shard"] for s in whole.values()) == total
    split = parameter_shards(config, 4, 8)
    # tensor parallelism splits everything but the norms, the row-split layers' biases and the single KV head
    replicated = sum(s["tp_local"] for n, s in split.items() if s["tp_local"] == whole[n]["tp_local"])
    assert 0 < replicated < 0.01 * total
    assert sum(s["tp_local"] for s in split.values()) == (total - replicated) // 4 + replicated
    # FSDP splits each one's first dimension over dp_shard, rounded up (FSDP pads): within a few rows of 1/8
    shards, local = sum(s["shard"] for s in split.values()), sum(s["tp_local"] for s in split.values())
    assert local / 8 <= shards < 1.02 * local / 8


def test_plan_7b_on_64_h100_fits_and_names_the_fastest(tmp_path, capsys):
    assert main(["plan", "griffin-7b", "--gpus", "64", "--gpu", "h100", "--top", "3",
                 "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "fastest that fits" in out and out.count("| yes |") + out.count("| no |") == 3
    estimates = json.loads((tmp_path / "plan.json").read_text())["estimates"]
    fitting = [e for e in estimates if e["fits"]]
    assert fitting and fitting[0] == estimates[0]  # the fastest that fits comes first
    steps = [e["time"]["step"] for e in fitting]
    assert steps == sorted(steps) and 0 < fitting[0]["mfu"] < 1
    # without sharding or tensor parallelism, AdamW's state alone (16 bytes per parameter) overflows 80 GB
    config = ModelConfig.from_preset("griffin-7b")
    alone = estimate(config, GPUS["h100"], Layout(64, 1, 1, 1), 2048, 1024)
    assert not alone.fits and alone.memory["optimizer"] + alone.memory["parameters"] > 80e9


def test_bad_layouts_are_refused_with_the_values_named(capsys):
    with pytest.raises(ValueError, match=r"dp_replicate=2 × dp_shard=2 × tp=2 = 8 devices, but the world size is 4"):
        ParallelDims.resolve(4, tp=2, dp_shard=2, dp_replicate=2)
    with pytest.raises(ValueError, match=r"tp=3 × dp_shard=1 = 3 does not divide the world size 4"):
        ParallelDims.resolve(4, tp=3)
    tiny = ModelConfig.from_preset("griffin-tiny")  # vocab 32, heads 2, D_RNN 24, gate blocks 4, MLP 48
    with pytest.raises(ValueError, match=r"tp=3 .*vocab_size=32.*num_heads=2"):
        check_tensor_parallel(tiny, 3)
    with pytest.raises(ValueError, match=r"tp=4 .*num_heads=2"):
        check_tensor_parallel(tiny, 4)
    with pytest.raises(ValueError, match=r"tp=16 .*rnn_width \(D_RNN\)=24, gate_blocks=4, num_heads=2$"):
        check_tensor_parallel(tiny, 16)
    with pytest.raises(ValueError, match=r"num_kv_heads=2 \(neither 1"):
        check_tensor_parallel(tiny.replace(num_heads=4, num_kv_heads=2, vocab_size=64, rnn_width=32, mlp_width=64,
                                           gate_blocks=4), 4)
    with pytest.raises(ValueError, match="complex_lru=True"):
        check_tensor_parallel(ModelConfig.from_preset("hawk-tiny", complex_lru=True), 2)
    assert main(["plan", "griffin-7b", "--gpus", "64", "--tp", "3"]) == 2
    assert "tp=3 × dp_shard=1 does not divide --gpus 64" in capsys.readouterr().err
