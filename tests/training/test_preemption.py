"""Cluster behaviour of `griffin train` (issue 35): SIGTERM (SLURM's or Kubernetes' notice before preemption) stops
at the next step with its checkpoint written, exit 143, and `--resume` continues bit for bit; the library's stop
request (`train(cfg, stop=...)`); `--resume` with nothing to resume is refused, `--resume if-any` starts a new run."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from griffin import load_pretrained
from griffin.cli import EXIT_TERMINATED, main
from griffin.training import StopRequest, TrainConfig, Trainer, TrainingStopped
from griffin.training.checkpoint import list_checkpoints
from tests.conftest import words_dataset
from tests.training.signals import signal_once_ready

# A constant learning rate after warm-up (min_lr_ratio 1): the schedule does not depend on max_steps, so a run
# started for 100,000 steps, stopped and resumed to step F matches a run of F steps. One thread in every process:
# the same arithmetic in the child and in this one. No sample at the end (equal weights sample alike; its decode
# kernels compile on first use).
ARGS = ["--preset", "griffin-tiny", "--seq-len", "32", "--batch-size", "4", "--warmup-steps", "2",
        "--min-lr-ratio", "1", "--lr", "0.01", "--eval-interval", "1000", "--eval-batches", "2", "--log-interval", "1",
        "--ckpt-interval", "1000", "--no-progress", "--no-tensorboard", "--sample-tokens", "0", "--threads", "1"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return words_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture
def keep_threads():
    """`--threads 1` in this process is undone after the test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def records(out: Path, kind: str) -> list[dict]:
    log = out / "log.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    return [r for r in map(json.loads, (line for line in lines if line.endswith("}"))) if r["kind"] == kind]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out, "train")}


def test_sigterm_checkpoints_and_resume_is_bit_identical(dataset, tmp_path, keep_threads, capsys):
    run, ref = tmp_path / "run", tmp_path / "ref"
    command = [sys.executable, "-m", "griffin.cli", "train", "--data", str(dataset), "--out", str(run), *ARGS,
               "--max-steps", "100000"]
    returncode, stdout, stderr = signal_once_ready(command, lambda: max(losses(run), default=0) >= 2,
                                                   signal.SIGTERM, poll=0.02)
    assert returncode == EXIT_TERMINATED == 143, stderr
    assert "Traceback" not in stderr and "trained" not in stdout
    (stop,) = records(run, "stop")
    step = stop["step"]
    ckpt = run / "checkpoints" / f"step_{step:08d}"
    assert stderr.strip().splitlines()[-1] == (f"griffin train: stopped by SIGTERM after step {step}; checkpoint: "
                                               f"{ckpt}; continue with: griffin train --out {run} --resume")
    assert stop.pop("wall_s") > 0
    assert stop == {"kind": "stop", "step": step, "reason": "SIGTERM", "checkpoint": str(ckpt)}
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == [ckpt.name] and max(losses(run)) == step
    saved = json.loads((ckpt / "trainer.json").read_text())
    assert (saved["step"], saved["val_loss"], saved["best_step"]) == (step, None, None)  # not evaluated, not `best`

    final = step + 3
    assert main(["train", "--out", str(run), "--resume", "--max-steps", str(final), "--threads", "1"]) == 0
    assert f"resumed from {ckpt} at step {step}" in capsys.readouterr().out
    assert main(["train", "--data", str(dataset), "--out", str(ref), *ARGS, "--max-steps", str(final)]) == 0
    assert losses(run) == losses(ref) and sorted(losses(ref)) == list(range(1, final + 1))
    a, b = (load_pretrained(out / "checkpoints" / "latest") for out in (run, ref))
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    states = [json.loads((out / "checkpoints" / "latest" / "trainer.json").read_text()) for out in (run, ref)]
    for key in ("step", "tokens", "val_loss", "best_val_loss", "best_step", "loader"):
        assert states[0][key] == states[1][key], key


def tiny(dataset: Path, out: Path, **kw) -> TrainConfig:
    base = dict(preset="griffin-tiny", data=str(dataset), out=str(out), seq_len=32, batch_size=4, max_steps=10,
                warmup_steps=2, eval_interval=2, eval_batches=2, log_interval=1, ckpt_interval=2, keep_last=1,
                progress=False, tensorboard=False, sample_tokens=0, lr=1e-2)
    return TrainConfig(**{**base, **kw})


def test_library_stop_request_checkpoints_without_moving_best(dataset, tmp_path, monkeypatch):
    """`Trainer.run(stop=...)`: stopped after update 5 (between checkpoints), its checkpoint leaves `best` (step 2)
    where it was; resumed, the run ends as one straight through. A request before the first step stops at once."""
    scripted = {0: 5.0, 2: 3.0, 4: 4.0, 6: 4.5, 8: 3.5, 10: 3.8}
    monkeypatch.setattr(Trainer, "evaluate", lambda self: scripted[self.step])
    straight = Trainer(tiny(dataset, tmp_path / "straight"))
    straight.run()

    stopped = Trainer(tiny(dataset, tmp_path / "run"))
    with pytest.raises(TrainingStopped, match="stopped by a stop request after step 5") as info:
        stopped.run(stop=lambda: stopped.step >= 5)
    root = tmp_path / "run" / "checkpoints"
    assert (info.value.step, info.value.checkpoint, info.value.reason) == (5, root / "step_00000005", "a stop request")
    assert [p.name for p in list_checkpoints(root)] == ["step_00000002", "step_00000005"]  # step 4 pruned, 2 is best
    assert (root / "best").resolve().name == "step_00000002" and (root / "latest").resolve().name == "step_00000005"
    state = json.loads((root / "latest" / "trainer.json").read_text())
    assert (state["best_val_loss"], state["best_step"], state["val_loss"]) == (3.0, 2, None)

    event = threading.Event()
    event.set()  # before the first step of a resumed run: nothing new to save, the checkpoint resumed from named
    with pytest.raises(TrainingStopped) as info:
        Trainer(tiny(dataset, tmp_path / "run", resume="auto")).run(stop=event)
    assert (info.value.step, info.value.checkpoint) == (5, root / "step_00000005")
    request = StopRequest()
    request.set("maintenance")
    with pytest.raises(TrainingStopped, match="by maintenance after step 0; no checkpoint"):  # a new run: none yet
        Trainer(tiny(dataset, tmp_path / "new")).run(stop=request)
    with pytest.raises(TypeError, match="stop must be"):
        Trainer(tiny(dataset, tmp_path / "new2")).run(stop=5)

    resumed = Trainer(tiny(dataset, tmp_path / "run", resume="auto"))
    assert (resumed.step, resumed.best_val, resumed.best_step) == (5, 3.0, 2)
    resumed.run(stop=lambda: False)
    for field in ("step", "tokens", "best_val", "best_step"):
        assert getattr(resumed, field) == getattr(straight, field), field
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert losses(tmp_path / "run") == losses(tmp_path / "straight")
    roots = [tmp_path / out / "checkpoints" for out in ("straight", "run")]
    assert [[p.name for p in list_checkpoints(r)] for r in roots] == [["step_00000002", "step_00000010"]] * 2


def test_stop_request_on_signal_leaves_a_host_handler_alone():
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with StopRequest.on_signal(signal.SIGTERM) as request:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # a second one (a launcher forwarding it again) changes nothing
            for _ in range(100):
                if request.is_set():
                    break
                time.sleep(0.01)
            assert request.reason == "SIGTERM"
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

        seen = []
        signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
        with StopRequest.on_signal(signal.SIGTERM) as request:  # a host program's own handler stays
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        assert seen == [signal.SIGTERM] and not request.is_set()
    finally:
        signal.signal(signal.SIGTERM, previous)


TINY = ["--preset", "griffin-tiny", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--eval-interval",
        "2", "--ckpt-interval", "2", "--warmup-steps", "1", "--sample-tokens", "0", "--no-progress", "--no-tensorboard"]


def test_resume_with_nothing_to_resume_is_refused(dataset, tmp_path, capsys):
    out = tmp_path / "typo"
    assert main(["train", "--data", str(dataset), "--out", str(out), "--resume", "--max-steps", "2", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"griffin train: error: --resume: no checkpoint to resume in {out} ") and \
        "--resume if-any" in err and len(err.splitlines()) == 1, err
    assert not out.exists()
    config = tmp_path / "run.toml"
    config.write_text(f'resume = "auto"\nout = "{out}"\n')
    assert main(["train", "--config", str(config), "--data", str(dataset), "--max-steps", "2", *TINY]) == 2
    assert f"no checkpoint to resume in {out}" in capsys.readouterr().err and not out.exists()


def test_resume_if_any_starts_a_new_run_then_resumes_it(dataset, tmp_path, capsys):
    out = tmp_path / "run"
    command = ["train", "--data", str(dataset), "--out", str(out), "--resume", "if-any", *TINY]
    assert main([*command, "--max-steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert "resumed from" not in printed and "trained 2 steps" in printed
    assert main([*command, "--max-steps", "4"]) == 0
    printed = capsys.readouterr().out
    assert f"resumed from {out / 'checkpoints' / 'step_00000002'} at step 2" in printed and "trained 4 steps" in printed
    config = tmp_path / "run.toml"  # the same in a config file
    config.write_text(f'resume = "if-any"\nout = "{out}"\nmax_steps = 6\n')
    assert main(["train", "--config", str(config)]) == 0
    assert f"resumed from {out / 'checkpoints' / 'step_00000004'} at step 4" in capsys.readouterr().out
