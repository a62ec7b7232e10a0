"""The project's growing list of bad inputs: each gets a clear error that names the offending value or file, raised
before any work, and leaves models and files as they were. Add to it whenever a user finds a new one."""

from __future__ import annotations

import math

import pytest
import torch

from griffin import Cache, CausalLM, ModelConfig, generate, load_pretrained, prefill, save_pretrained
from griffin.interop.official import save_official
from tests.conftest import seed_torch


@pytest.fixture
def model(gen):
    seed_torch(gen)
    return CausalLM(ModelConfig.from_preset("griffin-tiny")).eval()


# Generation ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompts, kwargs, error, needle", [
    ("def ", {}, TypeError, "got text 'def '"),
    ([[1.7, 2.2]], {}, TypeError, "prompt 0 has 1.7, which is not a token id"),
    ([[1, True]], {}, TypeError, "prompt 0 has True"),
    (torch.tensor([[1.0, 2.0]]), {}, TypeError, "must be integers"),
    ([[1, 2]], {"stop_tokens": 1}, ValueError, "stop_tokens=1 must be a list"),
    ([[1, 2]], {"stop_tokens": [99]}, ValueError, "stop token 99 is not a token id"),
    ([[1, 2]], {"seed": "7"}, ValueError, "seed='7'"),
    ([[1, 2]], {"chunk_size": 0}, ValueError, "chunk_size=0"),
    ([[1, 2]], {"max_length": -1}, ValueError, "max_length=-1"),
    ([[1, 2]], {"temperature": math.inf}, ValueError, "temperature=inf"),
    ([[1, 2]], {"max_new_tokens": 2.5}, ValueError, "max_new_tokens=2.5"),
    ([[1, 2]], {"top_k": 1.5}, ValueError, "top_k=1.5"),
    ({"a": 1}, {}, TypeError, "got dict"),
])
def test_generation_refuses_before_any_work(model, prompts, kwargs, error, needle, monkeypatch):
    calls = []
    monkeypatch.setattr(CausalLM, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(error, match=needle):
        generate(model, prompts, **{"max_new_tokens": 3, **kwargs})
    assert not calls  # nothing ran


@pytest.mark.parametrize("shape", [(2, 0), (0, 5)])
def test_empty_inputs(model, shape):
    with pytest.raises(ValueError, match=rf"at least one token, got \({shape[0]}, {shape[1]}\)"):
        model(torch.zeros(shape, dtype=torch.long))


# Files -----------------------------------------------------------------------------------------------------------
def test_unknown_dtype_name(model, tmp_path):
    save_pretrained(model, tmp_path / "m")
    assert load_pretrained(tmp_path / "m", dtype="float16").dtype == torch.float16
    with pytest.raises(ValueError, match="dtype='fp16' is not one of"):
        load_pretrained(tmp_path / "m", dtype="fp16")


def test_broken_checkpoint_files_are_named(model, tmp_path):
    save_pretrained(model, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        load_pretrained(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        load_pretrained(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text('{"family": "griffin", "width": "wide"}')
    with pytest.raises(ValueError, match=r"config.json: invalid ModelConfig: width='wide'"):
        load_pretrained(tmp_path / "m")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "recurrent_gemma", "hidden_size": 16}')
    with pytest.raises(ValueError, match=r"config.json lacks the field 'num_hidden_layers'"):
        load_pretrained(tmp_path / "hf")
    (tmp_path / "garbage.pt").write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match=r"garbage.pt is not a PyTorch state dict"):
        load_pretrained(tmp_path / "garbage.pt")


def test_broken_snapshot_is_named(model, tmp_path):
    _, cache = prefill(model, [[1, 2, 3]])
    cache.save(tmp_path / "s.safetensors")
    data = (tmp_path / "s.safetensors").read_bytes()
    (tmp_path / "s.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"s.safetensors is not a readable safetensors file"):
        Cache.load(tmp_path / "s.safetensors", model.config)


def test_lossy_conversion_is_refused_and_writes_nothing(gen, tmp_path):
    seed_torch(gen)
    untied = CausalLM(ModelConfig.from_preset("griffin-tiny", tie_embeddings=False, gate_blocks=2))
    with pytest.raises(ValueError, match="cannot be expressed as an official recurrentgemma model: untied"):
        save_official(untied, tmp_path / "o.pt")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name, content, needle", [
    ("tokenizer.json", b"garbage", "is not a tokenizer.json of the HF tokenizers library"),
    ("tokenizer.model", b"garbage", "is not a SentencePiece model"),
])
def test_garbage_tokenizer_files_are_named(tmp_path, name, content, needle):
    from griffin.data.tokenizer import load_tokenizer

    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=needle):
        load_tokenizer(tmp_path / name)



# The command line --------------------------------------------------------------------------------------------------
def _tree(path):
    """Every file under ``path`` with its bytes (to check that a refused command changed nothing)."""
    from pathlib import Path

    root = Path(path)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def files(model, tmp_path):
    """A saved model, a plain file, a garbage tokenizer and a config file with a string for a number."""
    save_pretrained(model, tmp_path / "m")
    (tmp_path / "file").write_text("hello\n")
    (tmp_path / "garbage.json").write_text("garbage")
    (tmp_path / "bad.toml").write_text('lr = "fast"\n')
    (tmp_path / "model.toml").write_text('[model]\nembed_scale = "false"\n')
    return tmp_path


@pytest.mark.parametrize("argv, needle", [
    (["train", "--device", "gpu0"], "device='gpu0' is not a device"),
    (["train", "--lr", "inf"], "lr=inf must be a finite number"),
    (["train", "--lr", "nan"], "lr=nan must be a finite number"),
    (["train", "--weight-decay=-inf"], "weight_decay=-inf must be a finite number"),
    (["train", "--model", "width=wide"], "width='wide' must be a positive integer"),
    (["train", "--model", "a_init_range=1"], "a_init_range=1 must be a pair"),
    (["train", "--model", "widht=64"], "unknown model key 'widht'; did you mean ['width']"),
    (["train", "--model", "width"], "--model expects KEY=VALUE, got 'width'"),
    (["train", "--config", "{d}/bad.toml"], "lr='fast' must be of type float"),
    (["train", "--config", "{d}/model.toml"], "embed_scale='false' must be true or false"),
    (["train", "--config", "{d}/missing.toml"], "no training config at {d}/missing.toml"),
    (["train", "--config", "{d}/m/model.safetensors"], "model.safetensors: not"),
    (["convert", "{d}/m", "{d}/file"], "{d}/file already exists: pass --overwrite to replace it"),
    (["convert", "{d}/m", "{d}/out", "--window", "4"], "--window applies to official checkpoints only, not to {d}/m"),
    (["convert", "{d}/m", "{d}/out", "--to", "official", "--window", "0"], "--window 0 must be a positive"),
    (["generate", "{d}/m", "--tokenizer", "{d}/garbage.json", "--prompt", "x"], "garbage.json is not a tokenizer"),
    (["generate", "{d}/missing", "--prompt", "x"], "{d}/missing"),
    (["generate", "{d}/m", "--tokenizer", "bytes"], "give a prompt: --prompt TEXT, --prompt-file FILE"),
    (["prepare", "{d}/file", "--out", "{d}/file"], "{d}/file exists and is not a directory"),
    (["prepare", "{d}/missing", "--out", "{d}/data"], "{d}/missing"),
    (["info", "griffin-tny"], "did you mean griffin-tiny"),
    (["quantize", "{d}/m", "{d}/q"], "choose the quantisation: --int8"),
])
def test_cli_refuses_with_one_line_naming_the_value(files, argv, needle, capsys):
    from griffin.cli import main

    before = _tree(files)
    assert main([a.format(d=files) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"griffin {argv[0]}: error: ") and err.count("\n") == 1, err
    assert needle.format(d=files) in err
    assert _tree(files) == before  # nothing written, nothing changed


def test_cli_process_exit_status_and_no_traceback(tmp_path):
    """Through a real process: a user error is one line and exit status 2; a closed output pipe is silent (141)."""
    import os
    import subprocess
    import sys

    bad = subprocess.run([sys.executable, "-m", "griffin.cli", "train", "--device", "gpu0", "--out",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == "griffin train: error: device='gpu0' is not a device: use 'auto', 'cpu', 'cuda', 'cuda:N' " \
                         "or another torch device name\n"
    assert not (tmp_path / "run").exists()
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written: like `griffin presets | head -0`
    try:
        closed = subprocess.run([sys.executable, "-m", "griffin.cli", "presets"], stdout=write, stderr=subprocess.PIPE,
                                text=True, timeout=300)
    finally:
        os.close(write)
    assert closed.returncode == 141 and closed.stderr == ""
