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

