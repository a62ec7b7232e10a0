"""Exactness against HF transformers' RecurrentGemma and the official recurrentgemma package."""

import json
import re
import warnings

import pytest
import torch
import transformers

from griffin import CausalLM, ModelConfig, load_pretrained, save_pretrained
from griffin.cli import main
from griffin.interop import CheckpointError, export_hf, to_official_state
from griffin.interop.hf import hf_problems
from griffin.training.config import parse_model_override
from tests.conftest import import_official_torch, perturb_, seed_torch

WINDOW = 8
T = 45  # longer than the window, crossing the local-attention chunking too


def hf_model(gen, **kw):
    cfg = transformers.RecurrentGemmaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=1, lru_width=48, attention_window_size=WINDOW, conv1d_width=4, logits_soft_cap=30.0,
        block_types=["recurrent", "recurrent", "attention"], **kw,
    )
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = transformers.RecurrentGemmaForCausalLM(cfg).eval()
    perturb_(model, gen)
    return model


def packed_positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])[None]


@torch.no_grad()
def test_hf_logits_match(gen, tmp_path):
    hf = hf_model(gen)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    assert ours.config.attention_window == WINDOW and not ours.config.conv1d_document_reset
    ids = torch.randint(0, 64, (2, T), generator=gen)
    diff = (hf(ids, use_cache=False).logits - ours(ids)).abs().max()
    assert diff <= 1e-4
    # Packed documents, with HF's semantics (attention isolated, Conv1D not reset).
    pos = packed_positions([17, T - 17]).expand(2, T)
    diff = (hf(ids, position_ids=pos, use_cache=False).logits - ours(ids, pos)).abs().max()
    assert diff <= 1e-4


@torch.no_grad()
def test_hf_export_round_trip(gen, tmp_path):
    hf = hf_model(gen)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    export_hf(ours, tmp_path / "exported")
    again = load_pretrained(tmp_path / "exported")
    hf_again = transformers.RecurrentGemmaForCausalLM.from_pretrained(tmp_path / "exported").eval()
    ids = torch.randint(0, 64, (2, T), generator=gen)
    reference = ours(ids)
    assert torch.equal(again(ids), reference)
    assert (hf_again(ids, use_cache=False).logits - reference).abs().max() <= 1e-4


# The small presets of the CPU demo and the tests do not use RecurrentGemma's settings (gate blocks = heads, embedding
# scaled by sqrt(D), logits soft-capped: they cost the CPU demo 4% of validation loss); the refusal to convert one
# names the `griffin train` settings that make it convert, and a model with them converts with the same logits.
# MQA's global attention has no HF counterpart.
HF_PRESETS = ["griffin-tiny", "griffin-cpu", "hawk-tiny", "hawk-cpu"]


@pytest.mark.parametrize("preset", HF_PRESETS)
@torch.no_grad()
def test_small_presets_convert_to_hf_with_the_settings_the_refusal_names(gen, tmp_path, capsys, preset):
    save_pretrained(CausalLM(ModelConfig.from_preset(preset)), tmp_path / "plain")
    assert main(["convert", str(tmp_path / "plain"), str(tmp_path / "refused"), "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert "cannot be expressed as HF RecurrentGemma" in err and not (tmp_path / "refused" / "config.json").exists()
    command = re.search(r"`griffin train (.*?)`", err)[1].split()
    assert command[:2] == ["--preset", preset] and set(command[2::2]) == {"--model"}
    cfg = ModelConfig.from_preset(preset, **dict(parse_model_override(kv) for kv in command[3::2]))
    assert hf_problems(cfg) == []
    seed_torch(gen)
    ours = CausalLM(cfg).eval()
    perturb_(ours, gen)
    save_pretrained(ours, tmp_path / "g")
    with pytest.warns(UserWarning, match="Conv1D"):  # packed documents only: one document per row here
        assert main(["convert", str(tmp_path / "g"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    hf = transformers.RecurrentGemmaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.attention_window + 20), generator=gen)  # across the window
    torch.testing.assert_close(hf(ids, use_cache=False).logits, ours(ids), rtol=0, atol=1e-5)
    back = load_pretrained(tmp_path / "hf")
    torch.testing.assert_close(back(ids), ours(ids), rtol=0, atol=1e-5)


@torch.no_grad()
def test_griffin_model_exports_to_hf(gen, tmp_path):
    cfg = ModelConfig.from_preset("griffin-tiny", embed_scale=True, logits_soft_cap=30.0, gate_blocks=2,
                                  conv1d_document_reset=False)
    seed_torch(gen)
    ours = CausalLM(cfg)
    perturb_(ours, gen)
    export_hf(ours, tmp_path)
    hf = transformers.RecurrentGemmaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 32, (2, 30), generator=gen)
    assert (hf(ids, use_cache=False).logits - ours(ids)).abs().max() <= 1e-4


def test_export_refuses_what_hf_cannot_express(tmp_path):
    for preset in ("mqa-tiny", "mqa-cpu"):
        with pytest.raises(CheckpointError, match="global attention") as err:
            export_hf(CausalLM(ModelConfig.from_preset(preset)), tmp_path)
        assert "griffin train" not in str(err.value)  # no setting makes global attention local
        assert "gate_blocks" not in str(err.value)  # MQA has no RG-LRU
    model = CausalLM(ModelConfig.from_preset("griffin-tiny", embed_scale=True, logits_soft_cap=30.0, gate_blocks=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_hf(model, tmp_path)
    assert any("Conv1D" in str(w.message) for w in caught)
    # The refusal names every problem and the settings to train with instead (the preset's, if it is one).
    plain = ModelConfig.from_preset("griffin-cpu", rg_lru_c=4.0)
    with pytest.raises(CheckpointError) as err:
        export_hf(CausalLM(plain), tmp_path)
    message = str(err.value)
    for problem in ("gate_blocks=4 != num_heads=2", "embed_scale=False", "no logits_soft_cap", "rg_lru_c=4.0"):
        assert problem in message
    assert ("`griffin train --preset griffin-cpu --model gate_blocks=2 --model embed_scale=true --model "
            "logits_soft_cap=30.0 --model rg_lru_c=8.0`") in message
    assert hf_problems(plain.replace(gate_blocks=2, embed_scale=True, logits_soft_cap=30.0, rg_lru_c=8.0)) == []
    assert "--preset" not in str(pytest.raises(CheckpointError, export_hf, CausalLM(plain.replace(name="")),
                                               tmp_path).value)
    # Hawk has no attention: HF's heads only set its gate blocks, so any gate blocks dividing the width do.
    hawk = ModelConfig.from_preset("hawk-cpu", embed_scale=True, logits_soft_cap=30.0)
    assert hawk.gate_blocks != hawk.num_heads and hf_problems(hawk) == []
    assert hf_problems(hawk.replace(rnn_width=120, gate_blocks=3)) == ["width=128 is not divisible by gate_blocks=3 "
                                                                       "(HF's head count, which sets its gate blocks)"]
    # HF truncates the rotated fraction of a head where griffin rounds.
    odd = ModelConfig.from_preset("griffin-tiny", embed_scale=True, logits_soft_cap=30.0, gate_blocks=2, width=28,
                                  head_dim=14, rope_fraction=0.25)
    assert hf_problems(odd) == ["rope_fraction=0.25 of head_dim=14 (HF would rotate 3 dims, griffin 4)"]


@pytest.mark.parametrize("to", ["hf", "griffin"])
def test_lossy_is_refused_where_it_does_nothing(tmp_path, capsys, to):
    save_pretrained(CausalLM(ModelConfig.from_preset("griffin-tiny")), tmp_path / "g")
    assert main(["convert", str(tmp_path / "g"), str(tmp_path / "out"), "--to", to, "--lossy"]) == 2
    assert "--lossy applies to --to official only" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_hf_missing_and_unexpected_tensors_are_named(gen, tmp_path):
    from safetensors.torch import load_file, save_file

    hf_model(gen).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.temporal_block.rg_lru.recurrent_param"]
    state["model.layers.0.extra"] = torch.zeros(1)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_pretrained(tmp_path)
    assert "missing: model.layers.1.temporal_block.rg_lru.recurrent_param" in str(err.value)
    assert "unexpected: model.layers.0.extra" in str(err.value)


def official_model(gen, rg, block_types):
    from recurrentgemma import common

    kinds = {"r": common.TemporalBlockType.RECURRENT, "a": common.TemporalBlockType.ATTENTION}
    cfg = rg.GriffinConfig(
        vocab_size=64, width=32, mlp_expanded_width=96, num_heads=4, lru_width=48,
        block_types=tuple(kinds[k] for k in block_types), embeddings_scale_by_sqrt_dim=True,
        attention_window_size=WINDOW, logits_soft_cap=30.0,
    )
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = rg.Griffin(cfg).eval()
    perturb_(model, gen)
    return model


@pytest.mark.parametrize("block_types", ["rrarr", "rrrr"])
@torch.no_grad()
def test_official_logits_match(gen, tmp_path, block_types):
    rg = import_official_torch()
    official = official_model(gen, rg, block_types)
    torch.save(official.state_dict(), tmp_path / "griffin.pt")
    ours = load_pretrained(tmp_path / "griffin.pt", attention_window_size=WINDOW)
    assert ours.config.attention_window == WINDOW + 1  # the official mask admits window_size + 1 keys
    ids = torch.randint(0, 64, (2, T), generator=gen)
    for lengths in ([T], [17, 1, T - 18]):
        pos = packed_positions(lengths).expand(2, T)
        expected, _ = official(ids, pos, return_cache=False)
        assert (expected - ours(ids, pos)).abs().max() <= 1e-4


@torch.no_grad()
def test_official_state_round_trip(gen, tmp_path):
    rg = import_official_torch()
    official = official_model(gen, rg, "rrarr")
    torch.save(official.state_dict(), tmp_path / "griffin.pt")
    ours = load_pretrained(tmp_path / "griffin.pt", attention_window_size=WINDOW)
    state = to_official_state(ours)
    for name, tensor in official.state_dict().items():
        assert torch.equal(state[name], tensor), name
    assert set(state) == set(official.state_dict())


def test_official_file_is_loaded_without_unpickling_objects(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"embedder.input_embedding": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        load_pretrained(tmp_path / "evil.pt")


def test_griffin_format_round_trip(gen, tmp_path):
    seed_torch(gen)
    model = CausalLM(ModelConfig.from_preset("griffin-tiny", complex_lru=True))
    perturb_(model, gen)
    save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_pretrained(tmp_path)
    ids = torch.randint(0, 32, (2, 20), generator=gen)
    assert torch.equal(loaded(ids), model.eval()(ids))
    assert loaded.config == model.config


def test_griffin_format_shape_mismatch_is_named(tmp_path):
    save_pretrained(CausalLM(ModelConfig.from_preset("griffin-tiny")), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rnn_width"] = 32
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        load_pretrained(tmp_path)
    assert "shape mismatch: blocks.0.temporal_block.linear_x.weight is (24, 16)" in str(err.value)


def test_unrecognised_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_pretrained(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="neither a griffin nor an HF"):
        load_pretrained(tmp_path)
