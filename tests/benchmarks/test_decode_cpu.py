"""``benchmarks/decode_cpu.py`` end to end on a tiny model: the rows, the goals and the split of a step."""

from __future__ import annotations

import json
import mmap
from types import SimpleNamespace

import pytest
import torch

from griffin import CausalLM, ModelConfig
from griffin.inference.cpu import isa
from griffin.inference.cpu import matvec as matvec_module
from griffin.inference.cpu.linear import Int8PackLinear, MatvecLinear
from griffin.inference.cpu.prepack import PackedLinear, can_prepack
from griffin.inference.generate import decode_model
from griffin.model import ResidualBlock
from griffin.quantize import quantization_of, quantize_int8
from tests.benchmarks.test_inference_benchmark import load_benchmark


def test_decode_benchmark_splits_a_step_into_its_kernel_calls(tmp_path, capsys):
    """The smoke test of the options timed in turn, the split and the profile: the rows of each run, timed in turn
    with the fused one (the same rounds of reads between them), a goal per bfloat16 run at one row, a split of each
    step with its number of matmul calls, the numba kernels under their names. What the split measures: the next
    test."""
    out = tmp_path / "decode.json"
    benchmark = load_benchmark("decode_cpu")
    main = benchmark.main
    assert main(["--models", "griffin-tiny", "--dtypes", "bfloat16", "int8", "--batches", "1", "2", "--no-hf",
                 "--split", "--unfused", "--no-prefetch-too", "--no-tiles-too", "--kernel-by-kernel-too", "--profile",
                 "--warmup", "1", "--steps", "2", "--threads", "1", "--read-gib", "0.01", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    runs = RUNS
    tiled = "int8" in matvec_module.FAST_TILES
    paths = [(r["dtype"], r["batch"], r["path"]) for r in results["rows"]]
    assert paths == [(*run, path) for run in runs for path in ("griffin", "griffin unfused")
                     + (("griffin, kernel by kernel",) if benchmark.one_call_per_block(*run) else ())
                     + (("griffin, no prefetch",) if run[1] == 1 or (run == ("int8", 2) and not tiled) else ())
                     + (("griffin, no tiles",) if run == ("int8", 2) and tiled else ())]
    for r in results["rows"]:  # each run in turn with the fused one of its weights and batch
        (fused,) = [o for o in results["rows"] if o["path"] == "griffin" and (o["dtype"], o["batch"]) == (r["dtype"],
                                                                                                         r["batch"])]
        # the read rate between the steps: one sum after each round of timed steps, shared by the runs in turn
        assert len(r["reads_gbps_between"]) == 2 and r["reads_gbps_between"] == fused["reads_gbps_between"]
        assert len(r["steps_ms"]) == 2
    goals = [g for g in results["goals"] if g["goal"].startswith("bf16")]
    assert [g["model"] for g in goals] == ["griffin-tiny"]
    assert results["machine"]["openmp"]["OMP_WAIT_POLICY"] == "passive"
    assert matvec_module.PREFETCH_BYTES > 0  # restored after the runs without it
    assert matvec_module.FAST_TILES == isa.FAST_TILES
    # one call per weight matmul module in a step (a fused group is one; the gates run inside the fused recurrent
    # block's kernel): the matvec kernel at one row, and at two for int8 where the host has vpdpbusd (else PyTorch's
    # int8pack matmuls), oneDNN's prepacked matmuls for bfloat16 at two where oneDNN has a bfloat16 path on this CPU
    model = CausalLM(ModelConfig.from_preset("griffin-tiny")).to(torch.bfloat16)
    calls = {}
    for dtype, batch in runs:
        swapped = decode_model(quantize_int8(model) if dtype == "int8" else model, batch)
        assert not any(isinstance(m, ResidualBlock) for m in swapped.modules())  # every block fused
        calls[dtype, batch] = sum(isinstance(m, MATMUL_MODULES) for m in swapped.modules())
    if can_prepack(model.output_weight):
        assert calls["bfloat16", 2] > calls["bfloat16", 1]  # oneDNN: each projection of a group is a call
    assert [(s["dtype"], s["batch"], s["calls"]) for s in results["splits"]] == [(*run, calls[run]) for run in runs]
    assert "the same calls replayed" in capsys.readouterr().out
    for prof in results["profiles"]:  # the numba kernels under their own names
        ops = {o["op"] for o in prof["ops"]}
        assert {"matvec (numba)", "residual blocks, one call per step (numba)"} <= ops, ops  # one row: the output
        # layer, one call for the blocks


RUNS = [("bfloat16", 1), ("bfloat16", 2), ("int8", 1), ("int8", 2)]
MATMUL_MODULES = (MatvecLinear, PackedLinear, Int8PackLinear)  # one call each per step


@pytest.mark.parametrize("dtype,batch", RUNS)
def test_split_times_the_matmul_calls_and_the_rest_of_the_step(monkeypatch, dtype, batch):
    """``split_step`` on a fake clock that only the weight matmuls move, 1 ms a call: the whole step is its calls,
    so are the calls timed inside it and replayed, and the step with the calls answered from memory takes none of
    it. The matmuls run once per call in each step of the warm-up, the timed steps and the recorded step, and once
    per replay, never in the answered steps."""
    benchmark = load_benchmark("decode_cpu")
    clock, ran = [0.0], []

    def spy(original):
        def call(self, *args, **kwargs):
            ran.append(self)
            clock[0] += 1e-3
            return original(self, *args, **kwargs)

        return call

    for cls, name in benchmark.MATMULS.items():
        monkeypatch.setattr(cls, name, spy(getattr(cls, name)))
    monkeypatch.setattr(benchmark, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_preset("griffin-tiny")).to(torch.bfloat16)
    model = quantize_int8(model) if dtype == "int8" else model
    prompts = torch.randint(0, model.config.vocab_size, (batch, 5))
    warmup, steps = 1, 3
    split = benchmark.split_step(model, prompts, warmup, steps)
    calls = split["calls"]
    assert calls > 0 and len(ran) == calls * (warmup + steps + 1 + steps)
    assert split["step_ms"] == pytest.approx(calls)  # every fake ms of a step is a matmul's
    assert split["kernels_inside_ms"] == pytest.approx(calls)
    assert split["kernels_replayed_ms"] == pytest.approx(calls)
    assert split["step_without_kernels_ms"] == 0


def test_int8_beside_bf16_is_timed_in_turn_with_it(tmp_path, monkeypatch):
    """``--int8-beside-bf16``: an int8 copy of the bfloat16 model (quantised apart: the bfloat16 model keeps its
    weights), a step of each in turn, each timed on its own. On a fake clock on which a bfloat16 step takes 2 s and
    an int8 one 1 s: the streams alternate, each row holds its model's times, and the goal is the int8 copy's 2x."""
    out = tmp_path / "beside.json"
    benchmark = load_benchmark("decode_cpu")
    clock, order = [0.0], []
    original = benchmark.generate_stream

    def stream(model, *args, **kwargs):
        for token in original(model, *args, **kwargs):
            order.append(model)
            clock[0] += 1.0 if quantization_of(model) is not None else 2.0
            yield token

    monkeypatch.setattr(benchmark, "generate_stream", stream)
    monkeypatch.setattr(benchmark, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(benchmark, "read_seconds", lambda x: 1.0)
    assert benchmark.main(["--models", "griffin-tiny", "--dtypes", "bfloat16", "--batches", "1", "2", "--no-hf",
                           "--int8-beside-bf16", "--warmup", "1", "--steps", "2", "--threads", "1", "--read-gib",
                           "0.01", "--out", str(out)]) == 0
    bf16, int8 = order[:2]
    assert quantization_of(bf16) is None and next(bf16.parameters()).dtype == torch.bfloat16
    assert quantization_of(int8) is not None
    assert order == [bf16, int8] * (len(order) // 2)  # in turn: a step of one, then of the other
    results = json.loads(out.read_text())
    rows = {(r["path"], r["batch"]): r for r in results["rows"]}
    assert sorted(rows) == sorted((p, b) for p in ("griffin", benchmark.BESIDE) for b in (1, 2))
    for b in (1, 2):
        bf16_row, int8_row = rows["griffin", b], rows[benchmark.BESIDE, b]
        assert (bf16_row["dtype"], int8_row["dtype"]) == ("bfloat16", "int8")
        assert (bf16_row["steps_ms"], int8_row["steps_ms"]) == ([2000.0] * 2, [1000.0] * 2)
        assert int8_row["weight_gb"] < 0.75 * bf16_row["weight_gb"]  # the int8 copy's own bytes
        assert int8_row["reads_gbps_between"] == bf16_row["reads_gbps_between"]  # one run, the same rounds
    goals = [g for g in results["goals"] if g["goal"] == "int8 >= 1.8x bf16 tokens/s, steps in turn"]
    assert [(g["batch"], g["value"], g["met"]) for g in goals] == [(1, 2.0, True), (2, 2.0, True)]


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
