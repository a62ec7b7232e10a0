"""The fast training step (`--compile`, griffin.training.fast) against the uncompiled reference over a few hundred
steps, what it refuses, the fallback it takes only when asked, and torch's thread count under griffin's kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from griffin.synth import SelectiveCopying, TaskSource
from griffin.training import TrainConfig, Trainer
from griffin.training.fast import CompiledStep, FastPathError, native_bf16, resolve_autocast

TASK = SelectiveCopying(seq_len=24, num_data=4)


def config(out: Path, family: str, **kw) -> TrainConfig:
    base = dict(preset=f"{family}-tiny", model={"vocab_size": TASK.vocab_size}, seq_len=TASK.seq_len, batch_size=8,
                max_steps=200, warmup_steps=20, lr=3e-3, eval_interval=1000, log_interval=1, ckpt_interval=1000,
                out=str(out), progress=False, tensorboard=False, sample_tokens=0, threads=1,
                data=f"synthetic:{TASK.name}")
    base.update(kw)
    return TrainConfig(**base)


def train_losses(cfg: TrainConfig, task=TASK) -> tuple[list[float], Trainer]:
    trainer = Trainer(cfg, source=TaskSource(task, cfg.batch_size, seed=0, eval_sequences=8))
    trainer.run()
    records = [json.loads(line) for line in (Path(cfg.out) / "log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"], trainer


@pytest.mark.parametrize("family", ["hawk", pytest.param("griffin", marks=pytest.mark.slow),
                                    pytest.param("mqa", marks=pytest.mark.slow)])
def test_fast_step_trains_as_the_reference_for_200_steps(family, tmp_path):
    """fp32: the compiled model and the fused AdamW give the reference's losses within rounding at every step of
    200 (the differences, from reordered sums, grow with training but stay below 1e-3 relative)."""
    ref, eager = train_losses(config(tmp_path / "ref", family))
    got, fast = train_losses(config(tmp_path / "fast", family, compile=True))
    assert isinstance(fast.forward, CompiledStep) and fast.forward.compiled
    assert all(g["fused"] for g in fast.optimizer.param_groups) and not eager.optimizer.param_groups[0]["fused"]
    assert len(ref) == len(got) == 200
    assert ref[-1] < ref[0] - 0.3  # it learned something, so the comparison covers real updates
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got, strict=True))
    assert worst < 1e-3, worst
    a, b = eager.model.state_dict(), fast.model.state_dict()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-2, atol=1e-3, msg=name)


def test_a_compiler_failure_is_refused_before_any_update_unless_a_fallback_is_asked(tmp_path, monkeypatch):
    def broken(gm, example_inputs):
        raise RuntimeError("no C++ compiler here")

    real_init = CompiledStep.__init__

    def init(self, module, fallback=False):
        real_init(self, module, fallback)
        self._step = torch.compile(module, backend=broken)

    monkeypatch.setattr(CompiledStep, "__init__", init)
    cfg = config(tmp_path / "refused", "hawk", compile=True, max_steps=3)
    with pytest.raises(FastPathError, match=r"torch.compile failed on this model .*no C\+\+ compiler.*"
                                            r"--compile-fallback"):
        train_losses(cfg)
    assert not (tmp_path / "refused" / "checkpoints").exists()

    with pytest.warns(UserWarning, match="training uncompiled"):
        got, trainer = train_losses(config(tmp_path / "fallback", "hawk", compile=True, compile_fallback=True,
                                           max_steps=3))
    assert not trainer.forward.compiled
    monkeypatch.undo()
    ref, _ = train_losses(config(tmp_path / "ref", "hawk", max_steps=3))
    assert got == pytest.approx(ref, rel=1e-6)  # the uncompiled step (fused AdamW still: the same up to rounding)


NO_BF16 = pytest.mark.skipif(not native_bf16(torch.device("cpu")),
                             reason="the compiled bf16 step is refused on a CPU without a bf16 matmul")


@pytest.mark.parametrize("family, compile", [("hawk", False), pytest.param("hawk", True, marks=NO_BF16),
                                             pytest.param("mqa", True, marks=[NO_BF16, pytest.mark.slow]),
                                             pytest.param("griffin", True, marks=[NO_BF16, pytest.mark.slow])])
def test_bf16_autocast_trains_as_fp32_within_a_stated_tolerance_for_200_steps(family, compile, tmp_path):
    """bf16 autocast (matmuls in bf16, the RG-LRU, Conv1D and loss in fp32; the compiled step's attention by
    attention_bmm, its scores bf16) against fp32, each run with seeds 0, 1 and 2 and the losses averaged over the
    seeds: every step's mean loss within 5% of fp32's, the last 20 steps' within 1%. One seed's run is not enough: past
    the task's first learning step the two trajectories part by chance, as two fp32 seeds do. Hawk's eager step, last
    20 steps: on a Zen 4 seed 0 within 0.03%; on an Intel Xeon with AMX seed 0 1.26% above fp32 and seeds 1 and 2
    0.15% and 0.27% below, the mean 0.28% above, while the fp32 seeds' own last 20 steps range from 2.27 to 2.35."""
    ref = [train_losses(config(tmp_path / f"ref{seed}", family, seed=seed))[0] for seed in range(3)]
    runs = [train_losses(config(tmp_path / f"bf16_{seed}", family, precision="bf16", compile=compile, seed=seed))
            for seed in range(3)]
    got = [losses for losses, _ in runs]
    trainer = runs[0][1]
    assert trainer.autocast == torch.bfloat16 and trainer.model.loss.float32_logits  # 'auto' on CPU
    assert got[0] != ref[0]  # the matmuls did run in bf16
    ref, got = ([sum(step) / 3 for step in zip(*losses, strict=True)] for losses in (ref, got))
    assert ref[-1] < ref[0] - 0.3
    assert max(abs(a - b) / abs(a) for a, b in zip(ref, got, strict=True)) < 0.05
    last = sum(ref[-20:]) / 20
    assert abs(sum(got[-20:]) / 20 - last) / last < 0.01


def test_logits_precision_resolves_per_device_and_refuses_another_loss():
    """'auto': float32 logits under autocast on CPU (not on CUDA, nor over a bf16 frozen model); 'fp32' refused for
    a loss that cannot compute them (the vocabulary-parallel one)."""
    from griffin.model import LanguageModelLoss
    from griffin.training.trainer import resolve_float32_logits

    cpu, cuda, bf16, plain = torch.device("cpu"), torch.device("cuda"), torch.bfloat16, LanguageModelLoss(None)

    def resolve(device=cpu, autocast=bf16, loss=plain, **kw):
        return resolve_float32_logits(TrainConfig(**kw), device, autocast, loss)

    assert resolve() and resolve(logits_precision="fp32", device=cuda)
    assert not resolve(device=cuda) and not resolve(autocast=None) and not resolve(logits_precision="bf16")
    assert not resolve(lora_rank=4, init="ckpt", base_dtype="bfloat16") and resolve(lora_rank=4, init="ckpt")
    assert not resolve(loss=torch.nn.Module())
    with pytest.raises(ValueError, match="logits_precision='fp32' is not supported by Module"):
        resolve(loss=torch.nn.Module(), logits_precision="fp32")
    with pytest.raises(ValueError, match="logits_precision"):
        TrainConfig(logits_precision="fp16")


def test_bf16_on_a_cpu_without_it_is_refused_or_trained_in_fp32_when_asked(tmp_path, monkeypatch):
    monkeypatch.setattr("griffin.training.fast.native_bf16", lambda device: False)  # any host: as on an AVX2 CPU
    with pytest.raises(FastPathError, match="no native bf16 matmul.*--precision fp32.*--compile-fallback"):
        Trainer(config(tmp_path / "a", "hawk", compile=True, precision="bf16"),
                source=TaskSource(TASK, 8, seed=0, eval_sequences=8))
    with pytest.warns(UserWarning, match="training in fp32"):
        assert resolve_autocast(torch.bfloat16, torch.device("cpu"), fallback=True) is None
    assert resolve_autocast(None, torch.device("cpu"), fallback=False) is None
    # the uncompiled step is left as it was: bf16 autocast, however slow, where asked for without --compile
    trainer = Trainer(config(tmp_path / "b", "hawk", precision="bf16"), source=TaskSource(TASK, 8, seed=0))
    assert trainer.autocast == torch.bfloat16


def test_griffins_kernels_keep_torchs_thread_count():
    """numba's OpenMP pool, started by the first RG-LRU kernel, used to set torch's thread count to every core:
    `--threads 1` became 2 threads after the first step (and runs side by side oversubscribed the cores)."""
    code = """
import torch
torch.set_num_threads(1)
from griffin.ops.rg_lru import rg_lru
x = torch.randn(2, 16, 8, requires_grad=True)
y, _ = rg_lru(x, x, x, torch.randn(8), backend="cpu")
y.sum().backward()
print(torch.get_num_threads())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["1"], out.stdout + out.stderr


def test_check_compiles_on_the_training_shape_without_touching_the_weights(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback warning on a model that compiles
        trainer = Trainer(config(tmp_path, "hawk", compile=True, max_steps=1),
                          source=TaskSource(TASK, 8, seed=0, eval_sequences=8))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer._check_compiles()
    assert all(p.grad is None for p in trainer.model.parameters())
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.slow
@pytest.mark.skipif(not native_bf16(torch.device("cpu")), reason="the compiled bf16 step needs a bf16 matmul")
def test_a_bf16_compile_is_cached_across_processes(tmp_path):
    """The bf16 step's graph holds autocast's enter/exit nodes (the float32 logits): marked cacheable, the second of
    two processes compiling the same step (a fresh Inductor cache) hits AOTAutograd's cache."""
    code = f"""
import json, torch
from torch._dynamo.utils import counters
from griffin.synth import SelectiveCopying, TaskSource
from griffin.training import TrainConfig, Trainer
task = SelectiveCopying(seq_len=24, num_data=4)
cfg = TrainConfig(preset="griffin-tiny", model={{"vocab_size": task.vocab_size}}, seq_len=24, batch_size=8,
                  max_steps=1, out={str(tmp_path / "run")!r}, progress=False, tensorboard=False, sample_tokens=0,
                  threads=1, data=f"synthetic:{{task.name}}", compile=True, precision="bf16")
Trainer(cfg, source=TaskSource(task, 8, seed=0, eval_sequences=8))._check_compiles()
print(json.dumps(dict(counters["aot_autograd"])))
"""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      timeout=600, check=True).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[0].get("autograd_cache_saved") == 1, runs
    assert runs[1].get("autograd_cache_hit") == 1, runs


def test_the_compiled_step_gives_the_same_weights_twice_on_two_threads(tmp_path):
    """Two runs of the compiled step on two threads, the same seed: the same loss at every step and the same weights
    (the embedding's gradient was summed by atomic adds from both threads, in a different order each run)."""
    task = SelectiveCopying(seq_len=256, num_data=8)
    (losses_a, a), (losses_b, b) = (
        train_losses(config(tmp_path / name, "hawk", preset="hawk-synthetic", compile=True, threads=2, seq_len=256,
                            batch_size=16, max_steps=8, model={"vocab_size": task.vocab_size}), task)
        for name in ("a", "b"))
    assert losses_a == losses_b
    weights_b = b.model.state_dict()
    for name, value in a.model.state_dict().items():
        assert torch.equal(value, weights_b[name]), name
