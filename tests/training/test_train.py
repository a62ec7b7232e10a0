"""Training: config checks, optimizer groups, schedule, exact resume (also after SIGKILL), checkpoint integrity,
non-finite losses and the `griffin train` command line."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from griffin import CausalLM, ModelConfig, load_pretrained
from griffin.cli import main
from griffin.interop import CheckpointError
from griffin.training import TrainConfig, Trainer, TrainingError, train
from griffin.training.checkpoint import find_resumable, list_checkpoints, verify_checkpoint
from griffin.training.trainer import build_optimizer, learning_rate, no_weight_decay
from tests.conftest import WORDS, words_dataset
from tests.faults import child_env, install


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return words_dataset(tmp_path_factory.mktemp("data"))


def tiny(dataset: Path, out: Path, **kw) -> TrainConfig:
    base = dict(preset="griffin-tiny", data=str(dataset), out=str(out), seq_len=32, batch_size=4, max_steps=6,
                warmup_steps=2, eval_interval=3, eval_batches=2, log_interval=1, ckpt_interval=3, progress=False,
                tensorboard=False, sample_tokens=8, sample_prompt="the ", lr=1e-2)
    base.update(kw)
    return TrainConfig(**base)


def losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


# Config --------------------------------------------------------------------------------------------------------
def test_config_refuses_unknown_keys_and_wrong_types(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('max_step = 10\n')
    with pytest.raises(ValueError, match="unknown key 'max_step'.*max_steps"):
        TrainConfig.from_toml(bad)
    bad.write_text('lr = "fast"\n')
    with pytest.raises(TypeError, match="lr='fast' must be of type float"):
        TrainConfig.from_toml(bad)
    bad.write_text('max_steps = 1.5\n')
    with pytest.raises(TypeError, match="max_steps"):
        TrainConfig.from_toml(bad)
    bad.write_text('[model]\nwidht = 3\n')
    with pytest.raises(ValueError, match="unknown model key 'widht'"):
        TrainConfig.from_toml(bad)
    bad.write_text('compile = 1\n')
    with pytest.raises(TypeError, match="compile"):
        TrainConfig.from_toml(bad)
    bad.write_text('max_steps = [\n')
    with pytest.raises(ValueError, match="not valid TOML"):
        TrainConfig.from_toml(bad)
    with pytest.raises(ValueError, match="unknown preset 'griffin-cpuu'.*griffin-cpu"):
        TrainConfig(preset="griffin-cpuu")
    for key, value in [("lr", 0.0), ("batch_size", 0), ("on_nan", "ignore"), ("val_fraction", 1.0)]:
        with pytest.raises(ValueError, match=key):
            TrainConfig(**{key: value})


def test_config_precedence_and_model_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('preset = "hawk-cpu"\nmax_steps = 50\nlr = 1\n[model]\ndepth = 3\n')
    cfg = TrainConfig.from_toml(path, max_steps=7, model={"width": 64})
    assert (cfg.preset, cfg.max_steps, cfg.lr) == ("hawk-cpu", 7, 1.0) and isinstance(cfg.lr, float)
    model = cfg.model_config(vocab_size=300)
    assert (model.family, model.depth, model.width, model.vocab_size) == ("hawk", 3, 64, 300)


CONFIGS = Path(__file__).parents[2] / "configs"
PAPER_CONFIG = re.compile(r"paper-(hawk|griffin|mqa)-(\d+(?:\.\d+)?)([mb])\.toml")
CPU_CONFIGS = {"cpu-demo.toml": "griffin", "hawk-cpu.toml": "hawk", "mqa-cpu.toml": "mqa"}


def _as_trained_by_the_cli(path: Path, monkeypatch, *flags: str) -> TrainConfig:
    """The TrainConfig ``griffin train --config path *flags`` trains with (training itself stubbed out)."""
    import griffin.training
    from griffin.training.trainer import TrainResult

    seen = []

    def fake_train(cfg, stop=None):
        seen.append(cfg)
        return TrainResult(0, math.nan, math.nan, math.nan, 0.0, Path(cfg.out), Path(cfg.out))

    monkeypatch.setattr(griffin.training, "train", fake_train)
    assert main(["train", "--config", str(path), *flags]) == 0
    (cfg,) = seen
    return cfg


def _parameters(cfg: TrainConfig) -> tuple[ModelConfig, int]:
    with torch.device("meta"):  # the 1.3B models too, without their memory
        model = CausalLM(cfg.model_config())
    return model.config, model.num_parameters()


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.toml")))
def test_shipped_config_is_read_alike_by_the_cli_and_claimed_below(name, monkeypatch):
    """`griffin train --config` trains each shipped config as written (a flag overriding one key), its model
    builds, and each file is one whose claims the tests below check."""
    path = CONFIGS / name
    cfg = TrainConfig.from_toml(path)
    assert _as_trained_by_the_cli(path, monkeypatch) == cfg
    assert _as_trained_by_the_cli(path, monkeypatch, "--max-steps", "7") == dataclasses.replace(cfg, max_steps=7)
    model, n = _parameters(cfg)
    assert cfg.preset.startswith(model.family + "-") and n > 0
    assert PAPER_CONFIG.fullmatch(name) or name in CPU_CONFIGS, f"configs/{name}: no test checks what it claims"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("paper-*.toml")))
def test_paper_configs_are_what_their_names_and_comments_say(name):
    """paper-FAMILY-SIZE.toml: the FAMILY-SIZE preset, about SIZE parameters, a 32K vocabulary, and the sequence
    length, batch, accumulation and token budget its comment states."""
    path = CONFIGS / name
    family, size, unit = PAPER_CONFIG.fullmatch(name).groups()
    cfg = TrainConfig.from_toml(path)
    model, n = _parameters(cfg)
    assert cfg.preset == f"{family}-{size}{unit}" and model.family == family
    assert 0.8 < n / (float(size) * {"m": 1e6, "b": 1e9}[unit]) < 1.2, n
    assert round(model.vocab_size / 1000) == 32
    comment = " ".join(line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#"))
    assert "bf16 autocast" in comment and cfg.precision in ("auto", "bf16")
    seq_len = int(re.search(r"sequences of (\d+) tokens", comment)[1])
    batch, micro, accum, tokens = re.search(r"batches of\s+(\d+) sequences \((\d+) x (\d+) accumulated\) = "
                                            r"([\d,]+) tokens", comment).groups()
    assert (cfg.seq_len, cfg.batch_size, cfg.grad_accum) == (seq_len, int(micro), int(accum))
    assert cfg.batch_size * cfg.grad_accum == int(batch) and int(batch) * seq_len == int(tokens.replace(",", ""))
    budget = re.search(r"about (\d+(?:\.(\d+))?)B training tokens", comment)
    trained = cfg.max_steps * cfg.batch_size * cfg.grad_accum * cfg.seq_len / 1e9
    assert f"{trained:.{len(budget[2] or '')}f}" == budget[1], trained
    assert 0 < cfg.warmup_steps < cfg.max_steps


def test_cpu_configs_are_the_defaults_and_differ_only_in_the_family():
    """cpu-demo.toml: a ~1.4M-parameter Griffin with the defaults of `griffin train`; hawk-cpu.toml and
    mqa-cpu.toml: the same data, budget and schedule with the other families."""
    demo = TrainConfig.from_toml(CONFIGS / "cpu-demo.toml")
    assert demo == TrainConfig()
    for name, family in CPU_CONFIGS.items():
        cfg = TrainConfig.from_toml(CONFIGS / name)
        model, n = _parameters(cfg)
        assert model.family == family and cfg.out == f"runs/{family}-cpu"
        assert dataclasses.replace(cfg, preset=demo.preset, out=demo.out) == demo
        if name == "cpu-demo.toml":
            assert round(n / 1e5) == 14  # "~1.4M-parameter"


def test_cli_flags_cover_every_config_field(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for field in TrainConfig.__dataclass_fields__:
        assert "--" + field.replace("_", "-") in text


# Optimizer and schedule ----------------------------------------------------------------------------------------
def test_no_weight_decay_on_norms_biases_and_decay_parameter():
    model = CausalLM(TrainConfig(preset="griffin-tiny").model_config())
    plain = {n for n, p in model.named_parameters() if no_weight_decay(n, p)}
    assert any(n.endswith("rg_lru.a_param") for n in plain)
    assert any("norm" in n for n in plain) and any(n.endswith(".b") for n in plain)
    assert not any(n.endswith("rg_lru.a_param") or "norm" in n for n in set(dict(model.named_parameters())) - plain)
    groups = build_optimizer(model, TrainConfig(weight_decay=0.3)).param_groups
    assert [g["weight_decay"] for g in groups] == [0.3, 0.0]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_learning_rate_warmup_then_cosine():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    lrs = [learning_rate(s, cfg) for s in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[60] == pytest.approx(0.55)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert learning_rate(110, cfg) == pytest.approx(0.1)


def test_grad_accumulation_matches_a_bigger_batch(dataset, tmp_path):
    one = Trainer(tiny(dataset, tmp_path / "a", batch_size=4, grad_accum=1))
    two = Trainer(tiny(dataset, tmp_path / "b", batch_size=2, grad_accum=2))
    for _ in range(3):
        a, b = one.train_step(), two.train_step()
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    for p, q in zip(one.model.parameters(), two.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_chunked_loss_matches_the_whole_loss(dataset, tmp_path):
    """``loss_chunk``: the same losses and weights as computing every logit at once (to float32 rounding)."""
    whole = Trainer(tiny(dataset, tmp_path / "a"))
    chunked = Trainer(tiny(dataset, tmp_path / "b", loss_chunk=7))
    for _ in range(3):
        a, b = whole.train_step(), chunked.train_step()
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert whole.evaluate() == pytest.approx(chunked.evaluate(), rel=1e-5)
    for p, q in zip(whole.model.parameters(), chunked.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


# A run, its outputs, and exact resume ---------------------------------------------------------------------------
def test_training_run_writes_everything(dataset, tmp_path):
    result = train(tiny(dataset, tmp_path / "run", tensorboard=True, max_steps=12, keep_last=1))
    out = result.out
    assert result.step == 12 and math.isfinite(result.val_loss)
    evals = [r["val_loss"] for r in result.history if r["kind"] == "eval"]
    assert evals[-1] < evals[0] - 0.5  # it learns
    assert (out / "loss.png").stat().st_size > 1000 and list((out / "tensorboard").iterdir())
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("eval") == 5
    walls = [r["wall_s"] for r in records]  # seconds since the run started, on every record
    assert 0 < walls[0] and walls == sorted(walls) and walls[-1] > walls[0]
    steps = [p.name for p in list_checkpoints(out / "checkpoints")]
    best = (out / "checkpoints" / "best").resolve().name
    assert steps[-1] == "step_00000012" and set(steps) == {best, "step_00000012"}
    model = load_pretrained(out / "checkpoints" / "latest")
    assert model.config.vocab_size == 256
    assert result.sample.startswith("the ")


def test_resume_in_process_is_bit_identical(dataset, tmp_path):
    full = train(tiny(dataset, tmp_path / "full"))
    half = tiny(dataset, tmp_path / "half", max_steps=6)
    trainer = Trainer(half)
    for _ in range(3):
        trainer.train_step()
    trainer.save(trainer.evaluate())
    del trainer
    resumed = train(tiny(dataset, tmp_path / "half", resume="auto"))
    ref = {r["step"]: r["loss"] for r in full.history if r["kind"] == "train"}
    got = losses(resumed.out)
    assert [got[s] for s in range(4, 7)] == [ref[s] for s in range(4, 7)]
    assert resumed.val_loss == full.val_loss and resumed.sample == full.sample


class Interrupted(Exception):
    pass


def test_resume_restores_the_whole_trainer_state(dataset, tmp_path, monkeypatch):
    """A run interrupted after its step-4 checkpoint and resumed ends in the state of one run straight through:
    every counter, the loader, the weights and optimizer, the log, the checkpoints kept and the `best` link. The
    validation losses are scripted so that the best checkpoint (step 2) is neither the first nor the last."""
    scripted = {0: 5.0, 2: 3.0, 4: 4.0, 6: 4.5, 8: 3.5, 10: 3.8}
    monkeypatch.setattr(Trainer, "evaluate", lambda self: scripted[self.step])
    cfg = dict(max_steps=10, eval_interval=2, ckpt_interval=2, keep_last=1, sample_tokens=0)
    straight = Trainer(tiny(dataset, tmp_path / "straight", **cfg))
    straight.run()

    def interrupt():
        raise Interrupted

    with monkeypatch.context() as m, pytest.raises(Interrupted):
        install("step:5", action=interrupt, set_attr=m.setattr)  # after update 5: checkpoint 4 is the newest
        Trainer(tiny(dataset, tmp_path / "resumed", **cfg)).run()
    resumed = Trainer(tiny(dataset, tmp_path / "resumed", resume="auto", **cfg))
    assert resumed.step == 4 and resumed.tokens == 4 * 4 * 32 and (resumed.best_val, resumed.best_step) == (3.0, 2)
    resumed.run()

    for field in ("step", "tokens", "best_val", "best_step", "skipped"):
        assert getattr(resumed, field) == getattr(straight, field), field
    assert resumed.loader.state_dict() == straight.loader.state_dict()
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    opt_a, opt_b = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for i in opt_a:
        for key in opt_a[i]:
            assert torch.equal(torch.as_tensor(opt_a[i][key]), torch.as_tensor(opt_b[i][key])), (i, key)
    roots = [Path(t.cfg.out) / "checkpoints" for t in (straight, resumed)]
    assert [[p.name for p in list_checkpoints(r)] for r in roots] == [["step_00000002", "step_00000010"]] * 2
    assert [(r / "best").resolve().name for r in roots] == ["step_00000002"] * 2
    saved = [json.loads((r / "latest" / "trainer.json").read_text()) for r in roots]
    for key in ("step", "tokens", "val_loss", "best_val_loss", "best_step", "loader"):
        assert saved[0][key] == saved[1][key], key

    def records(out):  # the log without timings
        timing = {"tokens_per_s", "mfu", "wall_s"}
        return [{k: v for k, v in r.items() if k not in timing} for r in (json.loads(line) for line in
                (Path(out) / "log.jsonl").read_text().splitlines()) if r["kind"] in ("train", "eval")]

    assert records(resumed.cfg.out) == records(straight.cfg.out)


def _run_cli(args: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    """``griffin train`` in a child process, killed (SIGKILL) at ``fault`` (tests/faults)."""
    return subprocess.run([sys.executable, "-m", "griffin.cli", "train", *args], env=child_env(fault),
                          capture_output=True, text=True, timeout=300)


# a kill after a step is also caught through the experiments runner (tests/experiments); the full pair is slow
@pytest.mark.parametrize("fault", [pytest.param("step:5", marks=pytest.mark.slow), "checkpoint:6"])
def test_sigkill_then_resume_equals_uninterrupted(dataset, tmp_path, fault):
    """Killed mid-run (after an update, or while writing a checkpoint), then resumed: the same losses, bitwise."""
    args = ["--preset", "griffin-tiny", "--data", str(dataset), "--seq-len", "32", "--batch-size", "4",
            "--max-steps", "9", "--warmup-steps", "2", "--eval-interval", "3", "--eval-batches", "2",
            "--log-interval", "1", "--ckpt-interval", "3", "--no-progress", "--no-tensorboard", "--lr", "0.01",
            "--sample-tokens", "8"]
    ref = _run_cli([*args, "--out", str(tmp_path / "ref")])
    assert ref.returncode == 0, ref.stderr
    killed = _run_cli([*args, "--out", str(tmp_path / "run")], fault=fault)
    assert killed.returncode == -9
    # killed where named: after update 5 before its log record; in checkpoint 6 after the model, before the rest
    assert max(losses(tmp_path / "run")) == {"step:5": 4, "checkpoint:6": 6}[fault]
    if fault.startswith("checkpoint"):
        (debris,) = (tmp_path / "run" / "checkpoints").glob(".tmp-step_00000006-*")  # half-written debris
        assert (debris / "model.safetensors").is_file() and not (debris / "optimizer.safetensors").exists()
    resumed = _run_cli([*args, "--out", str(tmp_path / "run"), "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    assert losses(tmp_path / "run") == losses(tmp_path / "ref")
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))
    sample = resumed.stdout.split("sample:")[1]
    assert sample == ref.stdout.split("sample:")[1]


# Checkpoint integrity -------------------------------------------------------------------------------------------
def test_corrupted_checkpoint_is_refused_and_the_previous_one_used(dataset, tmp_path):
    out = tmp_path / "run"
    train(tiny(dataset, out, keep_last=3))
    root = out / "checkpoints"
    good, bad = list_checkpoints(root)[-2:]
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors is .* bytes.*truncated"):
        verify_checkpoint(bad)
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="model.safetensors does not match its SHA-256"):
        verify_checkpoint(bad)
    with pytest.raises(CheckpointError, match="SHA-256"):
        Trainer(tiny(dataset, out, resume=str(bad), max_steps=7))
    with pytest.warns(UserWarning, match=f"skipping checkpoint {bad.name}"):
        assert find_resumable(root) == good
    with pytest.warns(UserWarning):
        trainer = Trainer(tiny(dataset, out, resume="auto", max_steps=7))
    assert trainer.step == 3
    (good / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        verify_checkpoint(good)


def test_resume_refuses_a_changed_batch_layout(dataset, tmp_path):
    train(tiny(dataset, tmp_path / "run", max_steps=3))
    with pytest.raises(ValueError, match="already holds checkpoints.*--resume"):
        Trainer(tiny(dataset, tmp_path / "run", max_steps=3))  # a fresh run would mix with the old checkpoints
    with pytest.raises(CheckpointError, match="batch_size=4.*batch_size=8"):
        Trainer(tiny(dataset, tmp_path / "run", resume="auto", batch_size=8))


# Non-finite losses ----------------------------------------------------------------------------------------------
def _poison(trainer: Trainer, at_steps: set[int]) -> None:
    original = trainer._loss_sum

    def loss_sum(batch):
        loss, n = original(batch)
        return (loss * math.nan, n) if trainer.step + 1 in at_steps else (loss, n)

    trainer._loss_sum = loss_sum


def test_non_finite_loss_stops_before_touching_the_weights(dataset, tmp_path):
    trainer = Trainer(tiny(dataset, tmp_path / "run"))
    trainer.train_step()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    _poison(trainer, {2})
    with pytest.raises(TrainingError, match="non-finite step 2: loss=nan.*before updating the weights"):
        trainer.train_step()
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_non_finite_loss_skip_policy(dataset, tmp_path):
    trainer = Trainer(tiny(dataset, tmp_path / "run", on_nan="skip", max_skips=2))
    _poison(trainer, {1, 3, 4, 5})
    assert trainer.train_step()["skipped"]
    assert not trainer.train_step()["skipped"]
    assert trainer.train_step()["skipped"] and trainer.train_step()["skipped"]
    with pytest.raises(TrainingError, match="3 consecutive updates skipped"):
        trainer.train_step()


# Bad input is refused before any training --------------------------------------------------------------------------
def test_bad_data_is_refused_early(dataset, tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Trainer(tiny(tmp_path / "nowhere", tmp_path / "run"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no documents|empty"):
        Trainer(tiny(empty, tmp_path / "run"))
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.txt").write_text("just a few words here")
    (small / "b.txt").write_text("and a few more")
    with pytest.raises(ValueError, match="tokens; seq_len 32 needs at least 33"):
        Trainer(tiny(small, tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists()
    with pytest.raises(ValueError, match="vocab_size=100 is smaller"):
        Trainer(tiny(dataset, tmp_path / "run", model={"vocab_size": 100}))
    config = tmp_path / "bad.toml"
    config.write_text("learning_rate = 0.1\n")
    assert main(["train", "--config", str(config)]) == 2
    assert "unknown key 'learning_rate'" in capsys.readouterr().err


def test_cli_train_end_to_end(dataset, tmp_path, capsys):
    code = main(["train", "--preset", "hawk-tiny", "--data", str(dataset), "--out", str(tmp_path / "run"),
                 "--seq-len", "32", "--batch-size", "4", "--max-steps", "4", "--eval-interval", "2",
                 "--ckpt-interval", "2", "--no-progress", "--no-tensorboard", "--model", "depth=2",
                 "--sample-tokens", "5"])
    assert code == 0
    out = capsys.readouterr().out
    assert "trained 4 steps: validation loss" in out and "sample:" in out
    assert load_pretrained(tmp_path / "run" / "checkpoints" / "latest").config.depth == 2


def test_bpe_run_keeps_its_tokenizer_beside_the_checkpoint(tmp_path, capsys):
    from griffin.data.tokenizer import load_tokenizer, train_bpe

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(1)
    for i in range(12):
        (corpus / f"{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(300)))
    tok = train_bpe([corpus], tmp_path / "tok.json", vocab_size=300)
    result = train(tiny(corpus, tmp_path / "run", tokenizer=str(tok), max_steps=3, sample_tokens=4))
    ckpt = result.checkpoint
    assert (ckpt / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert load_pretrained(ckpt).config.vocab_size == load_tokenizer(tok).vocab_size
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--prompt", "the of", "--max-new-tokens", "3", "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("the of")


def test_data_parallel_over_two_processes_matches_one(dataset, tmp_path):
    """torchrun with 2 CPU processes (gloo), 2 sequences each = one process with 4 sequences (up to rounding)."""
    one = train(tiny(dataset, tmp_path / "one", batch_size=4, max_steps=4, eval_interval=2, ckpt_interval=2))
    args = ["--preset", "griffin-tiny", "--data", str(dataset), "--out", str(tmp_path / "two"), "--seq-len", "32",
            "--batch-size", "2", "--max-steps", "4", "--warmup-steps", "2", "--eval-interval", "2",
            "--eval-batches", "2", "--log-interval", "1", "--ckpt-interval", "2", "--no-progress",
            "--no-tensorboard", "--lr", "0.01", "--sample-tokens", "8", "--sample-prompt", "the ", "--threads", "1"]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "griffin.cli", "train", *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("trained 4 steps") == 2 and "data parallel over 2 processes" in run.stdout
    ref, got = losses(one.out), losses(tmp_path / "two")
    assert got.keys() == ref.keys()
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    a = load_pretrained(one.checkpoint)
    b = load_pretrained(tmp_path / "two" / "checkpoints" / "latest")
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


# the chunked loss compiled is also traced against eager in tests/test_compile.py (fullgraph, griffin)
@pytest.mark.parametrize("loss_chunk", [0, pytest.param(7, marks=pytest.mark.slow)])
def test_compiled_training_matches_eager(dataset, tmp_path, loss_chunk):
    eager = train(tiny(dataset, tmp_path / "eager", max_steps=3, ckpt_interval=3))
    compiled = train(tiny(dataset, tmp_path / "compiled", max_steps=3, ckpt_interval=3, compile=True,
                          loss_chunk=loss_chunk))
    ref, got = losses(eager.out), losses(compiled.out)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step
