"""The workflows a newcomer tries first (issue 13): one text file prepared and trained on, a run resumed with its own
saved settings (flags given again must agree), and Ctrl-C that says how to resume."""

from __future__ import annotations

import json
import random
import signal
import sys
from pathlib import Path

import pytest

from griffin import load_pretrained
from griffin.cli import main
from griffin.interop import CheckpointError
from griffin.training import TrainConfig, Trainer
from griffin.training.checkpoint import list_checkpoints
from tests.training.signals import signal_once_ready

WORDS = "the of and a to in is you that it he was for on are as with his they at be this from".split()
TINY = ["--preset", "griffin-tiny", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1",
        "--eval-interval", "2", "--ckpt-interval", "2", "--log-interval", "1", "--warmup-steps", "1", "--lr", "0.01",
        "--sample-tokens", "4", "--no-progress", "--no-tensorboard"]


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def one_file_data(tmp_path_factory) -> Path:
    """`griffin prepare input.txt --out data` on one text file of about 40K characters (nanoGPT's input.txt, small)."""
    root = tmp_path_factory.mktemp("one-file")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) for _ in range(1200)]
    (root / "input.txt").write_text("\n".join(lines) + "\n")
    assert main(["prepare", str(root / "input.txt"), "--out", str(root / "data")]) == 0
    return root / "data"


def test_one_text_file_prepares_and_trains(one_file_data, tmp_path, capsys):
    meta = json.loads((one_file_data / "meta.json").read_text())
    assert meta["splits"]["val"]["documents"] >= 1 and meta["splits"]["train"]["documents"] >= 1
    assert meta["val_fraction"] == TrainConfig().val_fraction  # one default for prepare and train
    assert main(["train", "--data", str(one_file_data), "--out", str(tmp_path / "run"), "--max-steps", "2", *TINY]) == 0
    assert "trained 2 steps: validation loss" in capsys.readouterr().out


def test_resume_reuses_the_runs_settings(one_file_data, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["--data", str(one_file_data), "--out", str(run), *TINY, "--model", "width=24"]
    assert main(["train", "--max-steps", "2", *args]) == 0
    capsys.readouterr()
    # Only --out and --resume (and more steps): the run's own preset, width, learning rate, data, ... are reused.
    assert main(["train", "--out", str(run), "--resume", "--max-steps", "4"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in out and "trained 4 steps" in out
    latest = run / "checkpoints" / "step_00000004"
    assert load_pretrained(latest).config.width == 24
    assert json.loads((latest / "trainer.json").read_text())["config"]["lr"] == 0.01
    before = _tree(run)
    # Settings given again must agree with the run's, or are refused naming the flag and both values.
    for flags, needle in [
        (["--lr", "0.5"], "--lr 0.5 disagrees with the run's lr=0.01"),
        (["--preset", "hawk-tiny"], "--preset 'hawk-tiny' disagrees with the run's preset='griffin-tiny'"),
        (["--model", "width=32"], "--model width=32 disagrees with the run's width=24"),
        (["--model", "width=24", "--seq-len", "64"], "--seq-len 64 disagrees with the run's seq_len=32"),
        (["--data", str(tmp_path)], f"--data '{tmp_path}' disagrees with the run's data="),
    ]:
        assert main(["train", "--out", str(run), "--resume", "--max-steps", "6", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"griffin train: error: cannot resume {latest}: ") and needle in err, err
    assert _tree(run) == before
    # The same flags again are fine (here: nothing left to do at max_steps 4).
    assert main(["train", "--resume", "--max-steps", "4", *args]) == 0
    # The API refuses a config of another run by name, before it builds a model (no missing-tensor dump).
    with pytest.raises(CheckpointError, match=r"trained with preset='griffin-tiny', this run has preset='hawk-tiny'"):
        Trainer(TrainConfig(preset="hawk-tiny", data=str(one_file_data), out=str(run), resume="auto", seq_len=32,
                            batch_size=2, lr=0.01, warmup_steps=1, model={"width": 24}))


def test_ctrl_c_says_how_to_resume(one_file_data, tmp_path):
    """The first SIGINT ends `griffin train` with exit status 130 and the command that continues the run."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "griffin.cli", "train", "--data", str(one_file_data), "--out", str(run), *TINY,
               "--max-steps", "100000", "--ckpt-interval", "1", "--eval-interval", "100000"]
    # two checkpoints: the run is in its steady loop
    returncode, stdout, stderr = signal_once_ready(command, lambda: len(list_checkpoints(run / "checkpoints")) >= 2,
                                                   signal.SIGINT, poll=0.2)
    assert returncode == 130, stderr
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("griffin train: interrupted; the checkpoints in ") and \
        last.endswith(f"continue the run with its own settings: griffin train --out {run} --resume"), last
    newest = list_checkpoints(run / "checkpoints")[-1]
    step = int(newest.name.split("_")[1])
    assert main(["train", "--out", str(run), "--resume", "--max-steps", str(step + 1), "--sample-tokens", "0"]) == 0
    assert list_checkpoints(run / "checkpoints")[-1].name == f"step_{step + 1:08d}"
