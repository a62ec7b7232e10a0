"""``benchmarks/decode_cpu.py`` end to end on a tiny model: the rows, the goals and the split of a step."""

from __future__ import annotations

import json
import mmap
import statistics

import pytest
import torch

from griffin import CausalLM, ModelConfig
from griffin.inference.cpu import isa
from griffin.inference.cpu import matvec as matvec_module
from griffin.inference.cpu.linear import MatvecLinear
from griffin.inference.cpu.prepack import PackedLinear
from griffin.inference.generate import decode_model
from griffin.model import ResidualBlock
from griffin.quantize import quantize_int8
from tests.benchmarks.test_inference_benchmark import load_benchmark


def test_decode_benchmark_splits_a_step_into_its_kernel_calls(tmp_path, capsys):
    out = tmp_path / "decode.json"
    benchmark = load_benchmark("decode_cpu")
    main = benchmark.main
    assert main(["--models", "griffin-tiny", "--dtypes", "bfloat16", "int8", "--batches", "1", "2", "--no-hf",
                 "--split", "--unfused", "--no-prefetch-too", "--no-tiles-too", "--kernel-by-kernel-too", "--profile",
                 "--warmup", "1", "--steps", "2", "--threads", "1", "--read-gib", "0.01", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    runs = [("bfloat16", 1), ("bfloat16", 2), ("int8", 1), ("int8", 2)]
    tiled = "int8" in matvec_module.FAST_TILES
    paths = [(r["dtype"], r["batch"], r["path"]) for r in results["rows"]]
    assert paths == [(*run, path) for run in runs for path in ("griffin", "griffin unfused")
                     + (("griffin, kernel by kernel",) if benchmark.one_call_per_block(*run) else ())
                     + (("griffin, no prefetch",) if run[1] == 1 or (run == ("int8", 2) and not tiled) else ())
                     + (("griffin, no tiles",) if run == ("int8", 2) and tiled else ())]
    for r in results["rows"]:  # each unfused run against the fused one of its weights and batch
        fused = [o for o in results["rows"] if o["path"] == "griffin" and (o["dtype"], o["batch"]) == (r["dtype"],
                                                                                                      r["batch"])]
        assert r["vs_fused"] == pytest.approx(r["tokens_per_s"] / fused[0]["tokens_per_s"])
        # the read rate between the steps: one sum after each round of timed steps, shared by the fused and unfused
        assert len(r["reads_gbps_between"]) == 2 and r["reads_gbps_between"] == fused[0]["reads_gbps_between"]
        assert r["between_fraction"] == pytest.approx(r["weight_gbps"] / statistics.median(r["reads_gbps_between"]))
    goals = [g for g in results["goals"] if g["goal"].startswith("bf16")]
    assert [g["value"] for g in goals] == [r["between_fraction"] for r in results["rows"]
                                           if (r["path"], r["dtype"], r["batch"]) == ("griffin", "bfloat16", 1)]
    assert results["machine"]["openmp"]["OMP_WAIT_POLICY"] == "passive"
    assert matvec_module.PREFETCH_BYTES > 0  # restored after the runs without it
    assert matvec_module.FAST_TILES == isa.FAST_TILES
    # one call per weight matmul module in a step (a fused group is one; the gates run inside the fused recurrent
    # block's kernel): the matvec kernel at one row and for int8, oneDNN's prepacked matmuls for bfloat16 at two
    model = CausalLM(ModelConfig.from_preset("griffin-tiny")).to(torch.bfloat16)
    calls = {}
    for dtype, batch in runs:
        swapped = decode_model(quantize_int8(model) if dtype == "int8" else model, batch)
        assert not any(isinstance(m, ResidualBlock) for m in swapped.modules())  # every block fused
        calls[dtype, batch] = sum(isinstance(m, (MatvecLinear, PackedLinear)) for m in swapped.modules())
    assert calls["bfloat16", 2] > calls["bfloat16", 1]  # oneDNN: each projection of a group is a call
    assert [(s["dtype"], s["batch"], s["calls"]) for s in results["splits"]] == [(*run, calls[run]) for run in runs]
    for s in results["splits"]:
        assert all(s[k] > 0 for k in ("step_ms", "kernels_inside_ms", "kernels_replayed_ms", "step_without_kernels_ms"))
    assert "the same calls replayed" in capsys.readouterr().out
    for prof in results["profiles"]:  # the numba kernels under their own names
        ops = {o["op"] for o in prof["ops"]}
        assert {"matvec (numba)", "residual blocks, one call per step (numba)"} <= ops, ops  # one row: the output
        # layer, one call for the blocks


def test_int8_beside_bf16_is_timed_in_turn_with_it(tmp_path):
    """``--int8-beside-bf16``: an int8 copy of the bfloat16 model (quantised apart: the bfloat16 model keeps its
    weights), its steps in turn with the bfloat16 model's, and its ratio to that run as a goal of its own."""
    out = tmp_path / "beside.json"
    benchmark = load_benchmark("decode_cpu")
    assert benchmark.main(["--models", "griffin-tiny", "--dtypes", "bfloat16", "--batches", "1", "2", "--no-hf",
                           "--int8-beside-bf16", "--warmup", "1", "--steps", "2", "--threads", "1", "--read-gib",
                           "0.01", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    rows = {(r["path"], r["batch"]): r for r in results["rows"]}
    assert sorted(rows) == sorted((p, b) for p in ("griffin", benchmark.BESIDE) for b in (1, 2))
    for b in (1, 2):
        bf16, int8 = rows["griffin", b], rows[benchmark.BESIDE, b]
        assert (bf16["dtype"], int8["dtype"]) == ("bfloat16", "int8")
        assert int8["weight_gb"] < 0.75 * bf16["weight_gb"]  # the int8 copy's own bytes
        assert int8["reads_gbps_between"] == bf16["reads_gbps_between"]  # one run, the same rounds
        assert int8["vs_bf16"] == pytest.approx(int8["tokens_per_s"] / bf16["tokens_per_s"])
    goals = [g for g in results["goals"] if g["goal"] == "int8 >= 1.8x bf16 tokens/s, steps in turn"]
    assert [g["value"] for g in goals] == [rows[benchmark.BESIDE, b]["vs_bf16"] for b in (1, 2)]


@pytest.mark.parametrize("turn,expected", [(1, [2, 3, 4, 5]), (2, [4, 6, 8, 10]), (3, [5, 6, 8, 9])])
def test_turns_of_several_steps_leave_out_the_first_of_each(monkeypatch, turn, expected):
    """``--turn-steps``: each model takes ``turn`` steps per turn; after the warm-up round, every step of a turn but
    the first is timed (all of them for 1), until ``steps`` are, and no stream runs short. A fake clock advances
    by the index of the token each step makes, so the times say which steps were timed."""
    benchmark = load_benchmark("decode_cpu")
    clock = [0.0]
    made = []

    def stream(model, prompts, max_new_tokens, **kw):  # type: ignore[no-untyped-def]
        made.append(0)
        slot = len(made) - 1
        for t in range(max_new_tokens):
            clock[0] += t
            made[slot] = t + 1
            yield t

    monkeypatch.setattr(benchmark, "generate_stream", stream)
    monkeypatch.setattr(benchmark.time, "perf_counter", lambda: clock[0])
    times, rates = benchmark.interleaved_steps([None, None], torch.zeros(1, 2), 1, 4, False, turn=turn)
    assert times == [expected, expected] and rates == []
    rounds = 1 + -(-4 // max(turn - 1, 1))
    assert made == [rounds * turn + 1] * 2  # every token asked for was made
    with pytest.raises(ValueError, match="turn=0"):
        benchmark.interleaved_steps([None], torch.zeros(1, 2), 1, 4, False, turn=0)


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no madvise(MADV_HUGEPAGE) on this platform")
def test_huge_page_copy_holds_the_same_model_in_2_mib_aligned_memory():
    """``--huge-pages-too``'s copy: the tensors of 2 MiB or more moved, 2 MiB-aligned, same values; the same logits."""
    benchmark = load_benchmark("decode_cpu")
    t = torch.randn(3 << 19, generator=torch.Generator().manual_seed(0)).bfloat16().view(3, -1)
    moved = benchmark.huge_page_tensor(t)
    assert torch.equal(moved, t) and moved.dtype == t.dtype and moved.shape == t.shape
    assert moved.data_ptr() % benchmark.HUGE_PAGE == 0 and moved.data_ptr() != t.data_ptr()
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_preset("griffin-tiny").replace(vocab_size=40_000)).eval()  # a 2.6 MB embedding
    copy = benchmark.huge_page_copy(model)
    assert copy.embed.weight.data_ptr() % benchmark.HUGE_PAGE == 0
    assert copy.embed.weight.data_ptr() != model.embed.weight.data_ptr()
    tokens = torch.randint(0, 40_000, (2, 7))
    with torch.no_grad():
        assert torch.equal(copy(tokens), model(tokens))
