"""End-to-end fine-tuning runs (`griffin finetune` = `griffin train --init CKPT`): a griffin directory, an HF
RecurrentGemma directory and an official .pt fine-tune alike (LoRA), and in full; a fine-tune stopped mid-run resumes
exactly; the LoRA checkpoint is an adapter directory that generate, info and merge take; held-out exact match and the
sample in the log; the refusals; the Conv1D reset switched on for packed examples from a checkpoint without it.

The base: griffin-tiny with RecurrentGemma's settings (HF-exportable), random weights, byte tokenizer. The data: 48
prompt/completion pairs `letters?` -> `ok` (a constant reply: a full fine-tune gets every held-out reply right within
6 steps). One thread everywhere: the runs compared bit for bit do the same arithmetic."""

from __future__ import annotations

import contextlib
import io
import json
import random
import signal
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from griffin import CausalLM, ModelConfig, load_pretrained
from griffin.cli import EXIT_TERMINATED, _printable, main
from griffin.data.examples import ExampleSplit
from griffin.finetune.evaluate import reply_span
from griffin.interop import export_hf, quantize_checkpoint, save_official, save_pretrained
from griffin.training import TrainConfig, Trainer, TrainingStopped
from griffin.training.checkpoint import list_checkpoints
from tests.training.signals import signal_once_ready

STEPS = 6
RUN = ["--seq-len", "64", "--batch-size", "4", "--max-steps", str(STEPS), "--warmup-steps", "1", "--eval-interval", "3",
       "--ckpt-interval", "3", "--log-interval", "1", "--eval-batches", "2", "--eval-examples", "4", "--val-fraction",
       "0.1", "--no-progress", "--no-tensorboard", "--threads", "1"]
LORA = ["--lora-rank", "4", "--lr", "0.03"]
FULL = ["--lora-rank", "0", "--lr", "0.01"]


@pytest.fixture(scope="module", autouse=True)
def keep_threads():
    """`--threads 1` in this process is undone after the module."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> SimpleNamespace:
    """The same tiny model as a griffin directory, an HF RecurrentGemma directory and an official .pt (with its
    sidecar), and the pairs to fine-tune on."""
    root = tmp_path_factory.mktemp("bases")
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_preset("griffin-tiny", vocab_size=256, gate_blocks=2, embed_scale=True,
                                             logits_soft_cap=30.0))
    save_pretrained(model, root / "griffin")
    with pytest.warns(UserWarning, match="Conv1D"):  # HF's config has no Conv1D reset: this model's has
        export_hf(model, root / "hf")
    save_official(model, root / "official" / "model.pt")
    rng = random.Random(0)
    lines = []
    for _ in range(48):
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 6)))
        lines.append(json.dumps({"prompt": f"{word}?", "completion": "ok"}))
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return SimpleNamespace(root=root, griffin=root / "griffin", hf=root / "hf", official=root / "official" / "model.pt",
                           data=root / "pairs.jsonl")


def finetune(base: Path, data: Path, out: Path, *flags: str) -> str:
    """`griffin finetune` (exit 0 asserted); its stdout."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["finetune", str(base), "--data", str(data), "--out", str(out), *RUN, *flags])
    assert code == 0, printed.getvalue()[-2000:]
    return printed.getvalue()


@pytest.fixture(scope="module")
def lora_run(bases, tmp_path_factory) -> SimpleNamespace:
    out = tmp_path_factory.mktemp("lora") / "run"
    return SimpleNamespace(out=out, printed=finetune(bases.griffin, bases.data, out, *LORA))


@pytest.fixture(scope="module")
def hf_lora_run(bases, tmp_path_factory) -> SimpleNamespace:
    out = tmp_path_factory.mktemp("hf-lora") / "run"
    return SimpleNamespace(out=out, printed=finetune(bases.hf, bases.data, out, *LORA))


@pytest.fixture(scope="module")
def official_lora_run(bases, tmp_path_factory) -> SimpleNamespace:
    out = tmp_path_factory.mktemp("official-lora") / "run"
    return SimpleNamespace(out=out, printed=finetune(bases.official, bases.data, out, *LORA))


@pytest.fixture(scope="module")
def full_run(bases, tmp_path_factory) -> SimpleNamespace:
    out = tmp_path_factory.mktemp("full") / "run"
    return SimpleNamespace(out=out, printed=finetune(bases.griffin, bases.data, out, *FULL))


def records(out: Path, kind: str) -> list[dict]:
    """The log's records of this kind, without their wall_s (the time since the run started)."""
    return [{k: v for k, v in r.items() if k != "wall_s"}
            for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if r["kind"] == kind]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out, "train")}


def trainer_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer.json").read_text())


def assert_loss_falls(out: Path) -> None:
    train, evals = losses(out), records(out, "eval")
    assert sorted(train) == list(range(1, STEPS + 1))
    assert train[STEPS] < train[1] - 1.0, train
    assert evals[0]["step"] == 0 and evals[-1]["step"] == STEPS
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.0, evals


# 1. Every checkpoint format fine-tunes ---------------------------------------------------------------------------
def test_lora_fine_tunes_a_griffin_an_hf_and_an_official_checkpoint_alike(bases, lora_run, hf_lora_run,
                                                                           official_lora_run):
    for run in (lora_run, hf_lora_run, official_lora_run):
        assert_loss_falls(run.out)
        latest = run.out / "checkpoints" / "latest"
        assert (latest / "adapter_model.safetensors").is_file() and not (latest / "model.safetensors").exists()
    # The same weights in three formats train the same: the HF one with the Conv1D reset switched on (test 6).
    assert losses(hf_lora_run.out) == losses(lora_run.out) == losses(official_lora_run.out)
    for run, base in ((lora_run, bases.griffin), (hf_lora_run, bases.hf), (official_lora_run, bases.official)):
        config = json.loads((run.out / "checkpoints" / "latest" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(base.resolve())


def test_full_fine_tune_trains_every_weight(bases, full_run):
    assert_loss_falls(full_run.out)
    latest = full_run.out / "checkpoints" / "latest"
    assert (latest / "model.safetensors").is_file() and not (latest / "adapter_config.json").exists()
    base, tuned = load_pretrained(bases.griffin), load_pretrained(latest)
    assert tuned.config == base.config
    changed = {name for (name, p), q in zip(base.named_parameters(), tuned.parameters(), strict=True)
               if not torch.equal(p, q)}
    assert changed == {name for name, _ in base.named_parameters()}  # the RG-LRU gates and norms too, not only LoRA's


# 2. Stopped and resumed: exactly the uninterrupted run ----------------------------------------------------------
def stop_at(reference: Path, out: Path, step: int) -> None:
    """The run of ``reference``'s settings in ``out``, stopped after ``step`` by a stop request."""
    saved = trainer_state(reference / "checkpoints" / "latest")["config"]
    trainer = Trainer(TrainConfig.from_dict({**saved, "out": str(out)}))
    with pytest.raises(TrainingStopped) as stopped:
        trainer.run(stop=lambda: trainer.step >= step)
    assert stopped.value.step == step and stopped.value.checkpoint == out / "checkpoints" / f"step_{step:08d}"


def assert_same_run(run: Path, ref: Path) -> None:
    assert losses(run) == losses(ref) and sorted(losses(ref)) == list(range(1, STEPS + 1))
    assert records(run, "eval") == records(ref, "eval")  # val loss, exact match and sample at steps 0, 3 and 6
    states = [trainer_state(out / "checkpoints" / "latest") for out in (run, ref)]
    for key in ("step", "tokens", "val_loss", "best_val_loss", "best_step", "loader"):
        assert states[0][key] == states[1][key], key


def test_stopped_lora_fine_tune_resumes_to_the_same_adapters(bases, lora_run, tmp_path, capsys):
    run = tmp_path / "run"
    stop_at(lora_run.out, run, 4)
    assert main(["finetune", str(bases.griffin), "--out", str(run), "--resume", "--threads", "1"]) == 0
    assert f"resumed from {run / 'checkpoints' / 'step_00000004'} at step 4" in capsys.readouterr().out
    assert_same_run(run, lora_run.out)
    got, want = (load_file(out / "checkpoints" / "latest" / "adapter_model.safetensors") for out in (run, lora_run.out))
    assert got.keys() == want.keys() and len(want) == 2 * 25  # A and B of every projection the base has
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert all(want[k].abs().sum() > 0 for k in want if k.endswith("lora_B.weight"))  # B starts at zero: trained


def test_stopped_full_fine_tune_resumes_to_the_same_weights(full_run, tmp_path, capsys):
    run = tmp_path / "run"
    stop_at(full_run.out, run, 4)
    assert main(["train", "--out", str(run), "--resume", "--threads", "1"]) == 0  # griffin train resumes it too
    assert f"resumed from {run / 'checkpoints' / 'step_00000004'} at step 4" in capsys.readouterr().out
    assert_same_run(run, full_run.out)
    a, b = (load_pretrained(out / "checkpoints" / "latest") for out in (run, full_run.out))
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.slow
def test_sigterm_stops_a_lora_fine_tune_and_resume_is_bit_identical(bases, tmp_path, capsys):
    """`griffin finetune` in a child process, stopped by SIGTERM (exit 143, its checkpoint written), resumed with
    `griffin finetune CKPT --resume`: the losses and adapters of a run straight through. A constant learning rate
    (min_lr_ratio 1): the schedule does not depend on max_steps."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    flags = [*RUN, *LORA, "--min-lr-ratio", "1", "--eval-interval", "1000", "--ckpt-interval", "1000"]
    command = [sys.executable, "-m", "griffin.cli", "finetune", str(bases.griffin), "--data", str(bases.data),
               "--out", str(run), *flags, "--max-steps", "100000"]
    code, _, stderr = signal_once_ready(command, lambda: (run / "log.jsonl").is_file() and
                                        max(losses(run), default=0) >= 2, signal.SIGTERM, poll=0.02)
    assert code == EXIT_TERMINATED, stderr
    (stop,) = records(run, "stop")
    final = stop["step"] + 2
    assert main(["finetune", str(bases.griffin), "--out", str(run), "--resume", "--max-steps", str(final),
                 "--threads", "1"]) == 0
    assert main(["finetune", str(bases.griffin), "--data", str(bases.data), "--out", str(ref), *flags,
                 "--max-steps", str(final)]) == 0
    assert losses(run) == losses(ref) and sorted(losses(ref)) == list(range(1, final + 1))
    got, want = (load_file(out / "checkpoints" / "latest" / "adapter_model.safetensors") for out in (run, ref))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# 3. The LoRA checkpoint: an adapter directory -------------------------------------------------------------------
def generated(capsys, *argv: str) -> str:
    assert main(["generate", *argv]) == 0
    return capsys.readouterr().out


def test_lora_checkpoint_is_an_adapter_that_generate_and_info_load(bases, lora_run, capsys):
    best = lora_run.out / "checkpoints" / "best"
    names = {p.name for p in best.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "config.json", "trainer.json"} <= names
    assert "model.safetensors" not in names
    adapter = json.loads((best / "adapter_config.json").read_text())
    assert (adapter["peft_type"], adapter["r"], adapter["lora_alpha"]) == ("LORA", 4, 16.0)
    assert adapter["base_model_name_or_path"] == str(bases.griffin.resolve())

    # The first held-out example, whose greedy reply the trainer showed at the best step.
    data = lora_run.out / "data"
    split = ExampleSplit(data, "val")
    tokens, mask = split.example(0)
    start, end = reply_span(mask, int(split.prompts[0]))
    prompt = bytes(tokens[:start].tolist()).decode()
    step = trainer_state(best)["step"]
    (shown,) = [r["sample"] for r in records(lora_run.out, "eval") if r["step"] == step]
    greedy = ["--prompt", prompt, "--max-new-tokens", str(end - start), "--temperature", "0"]
    tuned = generated(capsys, str(best), *greedy)
    assert tuned == generated(capsys, str(bases.griffin), "--adapter", str(best), *greedy)
    assert tuned == _printable(shown.split("  [reference: ")[0], final=True) + "\n"
    assert tuned != generated(capsys, str(bases.griffin), *greedy)  # the adapter is applied

    assert main(["info", str(best)]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == "format: adapter"
    assert f"parameters: {load_pretrained(bases.griffin).num_parameters():,} (float32)" in printed


# 4. Held-out exact match and sample -----------------------------------------------------------------------------
def test_exact_match_and_held_out_sample_are_logged_and_printed(lora_run, full_run):
    for run in (lora_run, full_run):
        evals = records(run.out, "eval")
        assert [r["step"] for r in evals] == [0, 3, 6]
        assert evals[0]["exact_match"] == 0.0  # before fine-tuning: the random base says no "ok"
        for r in evals[1:]:
            assert 0.0 <= r["exact_match"] <= 1.0 and r["sample"]
            assert f"held-out reply: {r['sample'][-300:]!r}" in run.printed
            assert f"step {r['step']:>6}: val loss {r['val_loss']:.4f}" in run.printed
            assert f"exact_match {r['exact_match']:.4f}" in run.printed
        assert (run.out / "sample.txt").read_text() == evals[-1]["sample"].encode("utf-8", "replace").decode()
        assert run.printed.rstrip("\n").endswith("sample:\n" + _printable(evals[-1]["sample"], final=True))
        for r in evals[1:]:  # a wrong reply is shown with the reference
            if r["exact_match"] == 1.0:
                assert r["sample"].endswith("?ok"), r
            elif r["exact_match"] == 0.0:
                assert r["sample"].endswith("  [reference: 'ok']"), r
    assert records(full_run.out, "eval")[-1]["exact_match"] == 1.0  # every held-out reply right after 6 steps


# 5. Refusals ----------------------------------------------------------------------------------------------------
def refused(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_refusals_before_anything_runs(bases, lora_run, tmp_path, capsys):
    out = tmp_path / "out"
    err = refused(capsys, ["finetune", str(bases.griffin), "--out", str(out), *RUN])
    assert err.startswith("griffin finetune: error: give the examples to fine-tune on: --data FILE.jsonl")
    err = refused(capsys, ["train", "--lora-rank", "4", "--data", str(bases.data), "--out", str(out), *RUN])
    assert err == "griffin train: error: lora_rank=4: LoRA adapts a pretrained model; give it with --init"
    err = refused(capsys, ["train", "--init", str(bases.griffin), "--model", "width=32", "--data", str(bases.data),
                           "--out", str(out), *RUN])
    assert err == ("griffin train: error: --model width: a fine-tune (--init) keeps the checkpoint's model config (it "
                   "may change only attention_window, which no weight depends on)")
    assert not out.exists()

    # Resuming with another run-defining setting: named with both values; the run is left as it was.
    checkpoints = list_checkpoints(lora_run.out / "checkpoints")
    err = refused(capsys, ["finetune", str(bases.hf), "--out", str(lora_run.out), "--resume"])
    assert f"--init '{bases.hf}' disagrees with the run's init='{bases.griffin}'" in err
    err = refused(capsys, ["train", "--out", str(lora_run.out), "--resume", "--lora-rank", "8"])
    assert "--lora-rank 8 disagrees with the run's lora_rank=4" in err
    err = refused(capsys, ["finetune", str(bases.griffin), "--out", str(lora_run.out), "--resume", "--lora-rank", "0"])
    assert "--lora-rank 0 disagrees with the run's lora_rank=4" in err
    assert list_checkpoints(lora_run.out / "checkpoints") == checkpoints


def test_refusals_of_the_data_and_the_checkpoint(bases, tmp_path, capsys):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "ok"}]}) + "\n")
    err = refused(capsys, ["finetune", str(bases.griffin), "--data", str(chats), "--out", str(tmp_path / "chat"),
                           *RUN, *LORA])
    assert f"{chats}:1: a chat needs a chat template, and the checkpoint has none" in err
    assert "pass --chat-template plain" in err
    assert not (tmp_path / "chat" / "checkpoints").exists()

    quantize_checkpoint(bases.griffin, tmp_path / "int8")
    err = refused(capsys, ["finetune", str(tmp_path / "int8"), "--data", str(bases.data), "--out",
                           str(tmp_path / "q"), *RUN, *LORA])
    assert err == (f"griffin finetune: error: --init {tmp_path / 'int8'} holds int8 weights: fine-tune the float "
                   "checkpoint it was quantised from")


def test_lora_with_dp_shard_is_refused_for_lora(bases, tmp_path, capsys):
    err = refused(capsys, ["finetune", str(bases.griffin), "--data", str(bases.data), "--out", str(tmp_path / "o"),
                           "--dp-shard", "2", *RUN, *LORA])
    assert "tp and dp_shard lay out a full fine-tune (--lora-rank 0)" in err


# 6. The Conv1D reset --------------------------------------------------------------------------------------------
def test_examples_from_an_hf_checkpoint_train_with_the_conv1d_reset_and_merge_to_its_config(bases, hf_lora_run,
                                                                                            lora_run, tmp_path,
                                                                                            capsys):
    base = load_pretrained(bases.hf)
    assert not base.config.conv1d_document_reset  # HF RecurrentGemma has none
    best = hf_lora_run.out / "checkpoints" / "best"
    assert json.loads((best / "config.json").read_text())["conv1d_document_reset"] is True
    # Trained with it: the losses of the griffin base, whose config has it (several examples share each row).
    assert losses(hf_lora_run.out) == losses(lora_run.out)
    assert json.loads((hf_lora_run.out / "data" / "meta.json").read_text())["splits"]["train"]["examples"] > 4 * STEPS

    merged = tmp_path / "merged"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "HF RecurrentGemma does not reset the Conv1D" warning: the base's config
        assert main(["merge", str(best), str(merged), "--to", "hf"]) == 0
    assert f"wrote hf checkpoint {merged}: {bases.hf.resolve()} with the adapter {best} merged" in \
        capsys.readouterr().out
    assert json.loads((merged / "config.json").read_text())["model_type"] == "recurrent_gemma"
    model = load_pretrained(merged)
    assert model.config == base.config
    adapted = load_pretrained(best)  # the adapter directory: its base with the adapter merged
    for (name, p), q in zip(model.named_parameters(), adapted.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(model.blocks[0].mlp_block.up_proj.weight, base.blocks[0].mlp_block.up_proj.weight)
