"""`griffin synth`: a few training steps for every task and family through the trainer, the run directory it leaves
(checkpoint, task.json, curve), exact resume, `synth eval` and `synth compare` on the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from griffin import load_pretrained
from griffin.cli import main
from griffin.synth import MQAR, InductionHeads, SelectiveCopying, TaskSource, load_run, train_task
from griffin.training import TrainConfig, Trainer
from tests.conftest import seed_torch

TASKS = {"selective_copying": SelectiveCopying(seq_len=24, num_data=4), "induction_heads": InductionHeads(seq_len=20),
         "mqar": MQAR(seq_len=32, vocab_size=48, num_pairs=4)}
QUICK = dict(steps=2, batch_size=2, eval_every=1, eval_sequences=4, progress=False, tensorboard=False, window=8)


def seed_of(gen: torch.Generator) -> int:
    return int(torch.randint(0, 2**20, (1,), generator=gen))


@pytest.mark.parametrize("family", ["mqa", "hawk", "griffin"])
@pytest.mark.parametrize("name", sorted(TASKS))
def test_a_few_steps_of_every_task_and_family(name, family, tmp_path, gen):
    task = TASKS[name]
    result = train_task(task, family, tmp_path, seed=seed_of(gen), **QUICK)
    assert result.steps == 2 and [r["step"] for r in result.history] == [0, 1, 2]
    assert all(0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["perfect"] <= 1.0 for r in result.history)
    model = load_pretrained(tmp_path)
    assert model.config.family == family and model.config.vocab_size == task.vocab_size
    assert model.config.width == 64 and model.config.depth == 5
    if family == "griffin":
        assert model.config.block_types[2] == "local_attention" and model.config.attention_window == 8
    loaded, spec = load_run(tmp_path)
    assert spec == task
    assert json.loads((tmp_path / "result.json").read_text())["history"] == result.history
    assert (tmp_path / "accuracy.png").stat().st_size > 0 and (tmp_path / "log.jsonl").is_file()
    evals = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["accuracy"] for r in evals if r["kind"] == "eval"] == [r["accuracy"] for r in result.history]


@pytest.mark.parametrize("stream", [{}, {"prefix_stream": True}, {"prefix_stream": True, "stream_recall": 2},
                                    {"prefix_stream": True, "stream_recall": 2, "recall_episodes": "after-filler",
                                     "recall_draw": "uniform", "stream_advance": 24}],
                         ids=["plain", "prefix_stream", "stream_recall", "after_filler_uniform_advance"])
def test_resume_continues_the_task_stream_exactly(tmp_path, gen, stream):
    """(With the prefix stream, its cache is in the checkpoint: without it the resumed steps would start from another
    state, and the weights would differ; with recall, the episodes' answers and steps left, and the filler steps
    before the next write.)"""
    task, seed = TASKS["induction_heads"], seed_of(gen)
    prefix_stream = bool(stream)
    opts = dict(QUICK, steps=4, ckpt_every=2, eval_every=2, seed=seed, **stream)
    whole = train_task(task, "griffin", tmp_path / "whole", **opts)
    part = tmp_path / "part"
    train_task(task, "griffin", part, **opts)
    step4 = part / "checkpoints" / "step_00000004"
    for path in sorted(step4.iterdir()):
        path.unlink()
    step4.rmdir()
    (part / "checkpoints" / "latest").unlink()
    assert (part / "checkpoints" / "step_00000002" / "source_state.safetensors").is_file() == prefix_stream
    resumed = train_task(task, "griffin", part, resume=True, **opts)
    assert resumed.history == whole.history
    a, b = load_pretrained(tmp_path / "whole").state_dict(), load_pretrained(part).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_trainer_refuses_a_source_that_is_not_one(tmp_path, gen):
    cfg = TrainConfig(preset="hawk-tiny", out=str(tmp_path), progress=False, tensorboard=False)
    with pytest.raises(TypeError, match="BatchSource"):
        Trainer(cfg, source=object())

    class NoLoss(TaskSource):
        def evaluate(self, model):
            return {"accuracy": 0.0}

    seed_torch(gen)
    trainer = Trainer(cfg, source=NoLoss(InductionHeads(seq_len=8), 2, eval_sequences=2))
    with pytest.raises(ValueError, match="no 'val_loss'"):
        trainer.evaluate()


@pytest.mark.parametrize("family", ["mqa", "griffin"])
def test_whole_rows_train_without_positions_as_with_them(tmp_path, gen, family):
    """A source of whole rows (each row one document from position 0): the model is given no positions (plain causal
    attention, no document mask) and trains as it does given the positions (3 steps, within rounding); a batch whose
    positions say otherwise is refused."""
    seed = seed_of(gen)

    class Packed(TaskSource):
        whole_rows = False

    def trainer(source_type, out):
        cfg = TrainConfig(preset=f"{family}-synthetic", out=str(tmp_path / out), progress=False, tensorboard=False,
                          seq_len=24, batch_size=2, max_steps=3, eval_interval=10**6, sample_tokens=0, precision="fp32",
                          model={"vocab_size": 16, "attention_window": 8}, data="synthetic:induction_heads")
        torch.manual_seed(seed)
        return Trainer(cfg, source=source_type(InductionHeads(seq_len=24), 2, seed=seed, eval_sequences=2))

    whole, packed = trainer(TaskSource, "whole"), trainer(Packed, "packed")
    given = []
    forward = whole.forward
    whole.forward = lambda ids, positions, **kw: given.append(positions) or forward(ids, positions, **kw)
    for _ in range(3):
        a, b = whole.train_step(), packed.train_step()
        torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-5, atol=1e-6)
    assert given == [None] * 3

    class Lying(TaskSource):
        def __next__(self):
            batch = super().__next__()
            return type(batch)(batch.input_ids, batch.positions.flip(1), batch.targets)

    lying = trainer(Lying, "lying")
    with pytest.raises(ValueError, match="Lying says whole_rows"):
        lying.train_step()


def test_command_line_train_eval_compare(tmp_path, capsys):
    quick = ["--max-steps", "2", "--batch-size", "2", "--eval-interval", "1", "--eval-sequences", "4", "--no-progress",
             "--no-tensorboard", "--seq-len", "16", "--window", "8"]
    run = tmp_path / "hawk"
    assert main(["synth", "induction-heads", "--family", "hawk", "--out", str(run), *quick]) == 0
    assert "held-out accuracy" in capsys.readouterr().out
    assert main(["synth", "eval", str(run), "--lengths", "16", "64", "--sequences", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| 64 |" in out
    lengths = json.loads((run / "lengths.json").read_text())["lengths"]
    assert [r["length"] for r in lengths] == [16, 64]
    assert main(["synth", "eval", str(tmp_path), "--lengths", "16"]) == 2
    assert "holds no task.json" in capsys.readouterr().err
    assert main(["synth", "eval", str(run), "--lengths", "16", "--sequences", "2", "--horizons", "48",
                 "--out", str(tmp_path / "horizons"), "--no-progress"]) == 0
    assert "memory horizons" in capsys.readouterr().out
    horizons = json.loads((tmp_path / "horizons" / "lengths.json").read_text())["horizons"]
    assert horizons["length"] == 48 and [r["block"] for r in horizons["blocks"]] == [0, 1, 2, 3, 4]
    assert all(r["longest"] >= r["median"] > 0 for r in horizons["blocks"])

    cmp = tmp_path / "compare"
    args = ["synth", "compare", "induction_heads", "--out", str(cmp), *quick, "--lengths", "16", "32",
            "--sequences", "2", "--attention-max-length", "16"]
    assert main(args) == 0
    table = (cmp / "table.md").read_text()
    assert all(f"| {family} |" in table for family in ("mqa", "hawk", "griffin"))
    summary = json.loads((cmp / "compare.json").read_text())
    lengths = {r["family"]: [m["length"] for m in r["lengths"]] for r in summary["runs"]}
    assert lengths == {"mqa": [16], "hawk": [16, 32], "griffin": [16, 32]}
    assert (cmp / "accuracy.png").stat().st_size > 0 and (cmp / "lengths.png").stat().st_size > 0
    # a second run reuses the finished runs (same settings) instead of training again
    stamp = (cmp / "hawk" / "model.safetensors").stat().st_mtime_ns
    assert main(args) == 0
    assert (cmp / "hawk" / "model.safetensors").stat().st_mtime_ns == stamp
    assert Path(cmp / "griffin" / "task.json").is_file()
    # --horizons is refused for a model without a recurrent block, before anything is evaluated or written
    files = {f: f.stat().st_mtime_ns for f in (cmp / "mqa").rglob("*")}
    assert main(["synth", "eval", str(cmp / "mqa"), "--lengths", "16", "--horizons", "32", "--no-progress"]) == 2
    assert "an mqa model without an RG-LRU" in capsys.readouterr().err
    assert {f: f.stat().st_mtime_ns for f in (cmp / "mqa").rglob("*")} == files


def test_compare_checks_everything_before_training(tmp_path):
    from griffin.synth.compare import compare

    task = TASKS["induction_heads"]
    with pytest.raises(ValueError, match="seq_len=2 is too short"):
        compare(task, tmp_path / "a", lengths=[64, 2], **QUICK)
    with pytest.raises(ValueError, match="unknown family 'rwkv'"):
        compare(task, tmp_path / "b", families=["hawk", "rwkv"], **QUICK)
    with pytest.raises(ValueError, match="steps=0 must be a positive integer"):
        compare(task, tmp_path / "c", **dict(QUICK, steps=0))
    assert not any(tmp_path.iterdir()), "nothing trained, nothing written"


def test_eval_refuses_a_length_the_task_cannot_have(tmp_path, capsys):
    run = tmp_path / "run"
    train_task(TASKS["selective_copying"], "hawk", run, **QUICK)
    assert main(["synth", "eval", str(run), "--lengths", "64", "7", "--no-progress"]) == 2
    assert "seq_len=7 is too short" in capsys.readouterr().err
    assert not (run / "lengths.json").exists()


def test_default_window_is_at_most_half_the_sequence():
    from griffin.synth.tasks import make_task
    from griffin.synth.train import resolve_options

    assert resolve_options(make_task("selective_copying"))["window"] == 512  # the paper's, at T = 1024
    assert resolve_options(make_task("selective_copying", seq_len=64, num_data=8))["window"] == 32
    assert resolve_options(make_task("selective_copying", seq_len=64, num_data=8), window=48)["window"] == 48


def test_stop_accuracy_ends_the_run_at_the_first_evaluation_that_reaches_it(tmp_path):
    task = TASKS["selective_copying"]
    opts = dict(QUICK, steps=8, eval_every=2, seed=0)
    whole = train_task(task, "hawk", tmp_path / "whole", **opts)
    later = [r for r in whole.history if r["step"] > 0]
    target = max(r["accuracy"] for r in later)
    assert target > 0
    first = next(r["step"] for r in later if r["accuracy"] >= target)
    stopped = train_task(task, "hawk", tmp_path / "stopped", stop_accuracy=target, **opts)
    assert stopped.stopped_early == (first < 8) and stopped.steps == first
    assert stopped.history == [r for r in whole.history if r["step"] <= first]
    assert load_pretrained(tmp_path / "stopped").config.family == "hawk"
    # a finished comparison run: `synth compare` does not train it again
    from griffin.synth.compare import finished_run
    from griffin.synth.train import resolve_options

    options = resolve_options(task, **{k: v for k, v in opts.items() if k not in ("progress", "tensorboard")},
                              stop_accuracy=target)
    assert finished_run(tmp_path / "stopped", task, options) is not None
    with pytest.raises(ValueError, match="stop_accuracy=1.5 must be a number in"):
        resolve_options(task, stop_accuracy=1.5)


def test_a_run_started_from_another_begins_at_its_weights(tmp_path, gen):
    """A length curriculum: the run at T = 20 (window 8) starts from the model trained at T = 12 (window 4)."""
    from griffin.synth.evaluate import held_out, score

    seed = seed_of(gen)
    short = tmp_path / "short"
    train_task(InductionHeads(seq_len=12), "griffin", short, **dict(QUICK, window=4, seed=seed))
    longer = tmp_path / "long"
    result = train_task(TASKS["induction_heads"], "griffin", longer, init=str(short), **dict(QUICK, seed=seed))
    assert result.options["init"] == str(short)
    start, _ = load_run(short)
    assert start.config.attention_window == 4
    widened = type(start)(start.config.replace(attention_window=8))
    widened.load_state_dict(start.state_dict())
    want = score(widened, held_out(TASKS["induction_heads"], 4, 32))
    assert result.history[0]["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
    trained = load_pretrained(longer)
    assert trained.config.attention_window == 8 and trained.config == widened.config
    assert any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), start.state_dict().values(),
                                                         strict=True))


def test_a_run_refuses_to_start_from_another_task_or_family(tmp_path, capsys):
    run = tmp_path / "hawk"
    train_task(TASKS["induction_heads"], "hawk", run, **QUICK)
    with pytest.raises(ValueError, match="holds a hawk model, this run trains griffin"):
        train_task(TASKS["induction_heads"], "griffin", tmp_path / "a", init=str(run), **QUICK)
    with pytest.raises(ValueError, match="was trained on InductionHeads.*this run is SelectiveCopying"):
        train_task(TASKS["selective_copying"], "hawk", tmp_path / "b", init=str(run), **QUICK)
    with pytest.raises(ValueError, match=r"model overrides \['width'\] with init="):
        train_task(TASKS["induction_heads"], "hawk", tmp_path / "c", init=str(run), model={"width": 32}, **QUICK)
    with pytest.raises(ValueError, match="not a `griffin synth` run directory"):
        train_task(TASKS["induction_heads"], "hawk", tmp_path / "d", init=str(tmp_path), **QUICK)
    args = ["synth", "induction-heads", "--family", "hawk", "--out", str(tmp_path / "e"), "--seq-len", "16",
            "--init", str(run), "--max-steps", "1", "--eval-interval", "1", "--eval-sequences", "2", "--batch-size",
            "2", "--no-progress", "--no-tensorboard"]
    assert main(args) == 0
    assert json.loads((tmp_path / "e" / "result.json").read_text())["options"]["init"] == str(run)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_fine_tune_may_change_only_weight_free_fields():
    with pytest.raises(ValueError, match=r"--model width: a fine-tune \(--init\) keeps"):
        TrainConfig(init="some/checkpoint", model={"width": 32, "attention_window": 8})
    assert TrainConfig(init="some/checkpoint", model={"attention_window": 8}).model == {"attention_window": 8}


def test_compare_from_an_earlier_comparison(tmp_path, capsys):
    # (evaluated at two short lengths: the default, the training length doubled up to 65,536, took 2.5 minutes)
    quick = ["--max-steps", "2", "--batch-size", "2", "--eval-interval", "1", "--eval-sequences", "4", "--no-progress",
             "--no-tensorboard", "--lengths", "20", "40", "--sequences", "4"]
    short, longer = tmp_path / "short", tmp_path / "long"
    assert main(["synth", "compare", "induction-heads", "--out", str(short), "--families", "hawk", "griffin",
                 "--seq-len", "12", "--window", "4", *quick]) == 0
    assert main(["synth", "compare", "induction-heads", "--out", str(tmp_path / "x"), "--families", "mqa",
                 "--init", str(short), "--seq-len", "20", *quick]) == 2
    assert "not a `griffin synth` run directory" in capsys.readouterr().err
    assert not (tmp_path / "x" / "mqa").exists()
    assert main(["synth", "compare", "induction-heads", "--out", str(longer), "--families", "hawk", "griffin",
                 "--init", str(short), "--seq-len", "20", "--window", "8", *quick]) == 0
    summary = json.loads((longer / "compare.json").read_text())
    assert summary["options"]["init"] == str(short)
    for row in summary["runs"]:
        assert row["options"]["init"] == str(short / row["family"])
    assert load_pretrained(longer / "griffin").config.attention_window == 8


def test_sigterm_stops_a_run_with_its_checkpoint_and_resume_finishes_it(tmp_path, capsys):
    import signal
    import sys

    from tests.training.signals import signal_once_ready

    run = tmp_path / "run"
    args = ["synth", "induction-heads", "--family", "hawk", "--out", str(run), "--seq-len", "16", "--batch-size", "2",
            "--warmup-steps", "2", "--eval-interval", "1000", "--eval-sequences", "4", "--threads", "1",
            "--no-progress", "--no-tensorboard"]

    def trained() -> list[int]:
        log = run / "log.jsonl"
        lines = log.read_text().splitlines() if log.exists() else []
        return [r["step"] for r in map(json.loads, (x for x in lines if x.endswith("}"))) if r["kind"] == "train"]

    command = [sys.executable, "-m", "griffin.cli", *args, "--max-steps", "100000"]
    code, _, stderr = signal_once_ready(command, lambda: bool(trained()), signal.SIGTERM, poll=0.02)
    assert code == 143, stderr
    (stop,) = [r for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if r["kind"] == "stop"]
    step = stop["step"]
    ckpt = run / "checkpoints" / f"step_{step:08d}"
    assert stop["reason"] == "SIGTERM" and Path(stop["checkpoint"]) == ckpt and ckpt.is_dir()
    assert stderr.strip().splitlines()[-1] == (f"griffin synth: training stopped by SIGTERM after step {step}; "
                                               f"checkpoint: {ckpt}; continue with the same command and --resume")
    assert not (run / "result.json").exists() and not (run / "model.safetensors").exists()
    # the stopped run is evaluated from its checkpoint (task.json is written when a run starts)
    assert main(["synth", "eval", str(run), "--lengths", "16", "--no-progress"]) == 2
    assert "holds no model yet (the run has not finished)" in capsys.readouterr().err
    assert main(["synth", "eval", str(run / "checkpoints" / "latest"), "--lengths", "16", "32", "--sequences", "2",
                 "--no-progress"]) == 0
    assert "| 32 |" in capsys.readouterr().out
    assert main([*args, "--max-steps", str(step + 3), "--resume"]) == 0
    assert f"after {step + 3} steps" in capsys.readouterr().out
    assert json.loads((run / "result.json").read_text())["steps"] == step + 3


def test_plot_draws_the_curves_of_runs_from_their_logs(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    first = train_task(TASKS["induction_heads"], "hawk", a, **dict(QUICK, steps=4, eval_every=2))
    train_task(TASKS["induction_heads"], "mqa", b, **QUICK)
    png = tmp_path / "plots" / "accuracy.png"
    assert main(["synth", "plot", str(a), str(b), "--out", str(png.parent), "--label", "Hawk", "--label", "MQA"]) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 0
    assert f"Hawk: 3 evaluations to step 4; last {first.history[-1]['accuracy']:.4f}" in out
    from griffin.synth.plots import run_curve

    assert run_curve(a) == [(r["step"], r["accuracy"]) for r in first.history]
    assert not (png.parent / "lengths.png").exists(), "no run evaluated at other lengths yet"
    assert main(["synth", "eval", str(a), "--lengths", "64", "16", "--sequences", "2", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["synth", "plot", str(a), str(b), "--out", str(png.parent), "--label", "Hawk", "--label", "MQA"]) == 0
    out = capsys.readouterr().out
    evaluated = json.loads((a / "lengths.json").read_text())["lengths"]
    want = ", ".join(f"{r['accuracy']:.3f} at {r['length']:,}" for r in sorted(evaluated, key=lambda r: r["length"]))
    assert f"Hawk: {want}" in out and "MQA: " not in out.split("accuracy.png")[-1]
    assert (png.parent / "lengths.png").stat().st_size > 0
    assert main(["synth", "plot", str(a), str(b), "--out", str(png.parent), "--label", "Hawk"]) == 2
    assert "1 --label for 2 run directories" in capsys.readouterr().err
    assert main(["synth", "plot", str(tmp_path), "--out", str(png.parent)]) == 2
    assert "holds no log.jsonl" in capsys.readouterr().err
    # a checkpoint: the run's curve to its step, its own evaluation at other lengths
    ckpt = a / "checkpoints" / "step_00000002"
    assert run_curve(ckpt) == [(r["step"], r["accuracy"]) for r in first.history if r["step"] <= 2]
    assert main(["synth", "eval", str(ckpt), "--lengths", "32", "--sequences", "2", "--no-progress"]) == 0
    assert main(["synth", "plot", str(ckpt), str(a), "--out", str(png.parent), "--label", "step 2",
                 "--label", "step 4"]) == 0
    out = capsys.readouterr().out
    at_32 = json.loads((ckpt / "lengths.json").read_text())["lengths"][0]["accuracy"]
    assert "step 2: 2 evaluations to step 2" in out and f"step 2: {at_32:.3f} at 32" in out


def test_precision_bf16_trains_under_autocast_and_a_compiled_bf16_step_is_refused_without_it(tmp_path, capsys,
                                                                                               monkeypatch, gen):
    task, seed = TASKS["induction_heads"], seed_of(gen)
    fp32 = train_task(task, "hawk", tmp_path / "fp32", seed=seed, **QUICK)
    bf16 = train_task(task, "hawk", tmp_path / "bf16", seed=seed, precision="bf16", **QUICK)
    assert bf16.options["precision"] == "bf16" and bf16.config["precision"] == "bf16"
    assert fp32.options["precision"] == "auto"
    assert [r["val_loss"] for r in bf16.history] != [r["val_loss"] for r in fp32.history]  # autocast did run
    with pytest.raises(ValueError, match="precision='fp16'"):
        train_task(task, "hawk", tmp_path / "bad", precision="fp16", **QUICK)
    monkeypatch.setattr("griffin.training.fast.native_bf16", lambda device: False)  # any host: as on an AVX2 CPU
    args = ["synth", "induction-heads", "--family", "hawk", "--out", str(tmp_path / "cli"), "--seq-len", "20",
            "--max-steps", "2", "--batch-size", "2", "--eval-sequences", "4", "--window", "8", "--no-progress",
            "--no-tensorboard", "--compile", "--precision", "bf16"]
    assert main(args) == 2
    assert "no native bf16 matmul" in capsys.readouterr().err
    assert not (tmp_path / "cli" / "checkpoints").exists()


def test_plots_tell_up_to_thirty_curves_apart():
    """Past the colour cycle's ten colours a curve changes its line and marker, not only repeats a colour; a
    family keeps its own colour wherever it comes."""
    from griffin.synth.plots import COLORS, _style

    styles = [_style(i, f"run {i}") for i in range(30)]
    assert len(set(styles)) == 30
    assert _style(12, "hawk")[1] == COLORS["hawk"]
