import json

import pytest
import torch

from griffin import CausalLM, ModelConfig, generate, load_pretrained, save_pretrained
from griffin.cli import main
from tests.conftest import perturb_, seed_torch


def test_presets_table(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "griffin-14b" in out and "recurrentgemma-2b" in out and "2,682,862,080" in out


def test_convert_between_all_formats(tmp_path, gen, capsys):
    cfg = ModelConfig.from_preset("griffin-tiny", embed_scale=True, logits_soft_cap=30.0, gate_blocks=2,
                                  conv1d_document_reset=False)
    model = CausalLM(cfg)
    perturb_(model, gen)
    save_pretrained(model, tmp_path / "g")
    ids = torch.randint(0, 32, (1, 25), generator=gen)
    expected = model.eval()(ids)
    assert main(["convert", str(tmp_path / "g"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    # HF semantics (no Conv1D reset at document starts) cannot be expressed by the official model: refused, or lossy
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "o.pt"), "--to", "official"]) == 2
    assert "cannot be expressed as an official recurrentgemma model" in capsys.readouterr().err
    assert not (tmp_path / "o.pt").exists()
    with pytest.warns(UserWarning, match="lossy official checkpoint"):
        assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "o.pt"), "--to", "official", "--lossy"]) == 0
    assert main(["convert", str(tmp_path / "o.pt"), str(tmp_path / "back"), "--window", "5"]) == 0
    back = load_pretrained(tmp_path / "back")
    assert back.config.attention_window == 6  # official window 5 = 6 keys seen
    torch.testing.assert_close(load_pretrained(tmp_path / "hf")(ids), expected)
    assert main(["info", str(tmp_path / "hf")]) == 0
    assert "format: hf" in capsys.readouterr().out


def test_official_conversion_round_trips(tmp_path, gen):
    """griffin -> official -> griffin keeps every setting the weights do not hold (window, embedding scale, soft-cap:
    in the official GriffinConfig fields beside the .pt) and the logits."""
    cfg = ModelConfig.from_preset("griffin-tiny", gate_blocks=2, attention_window=9)  # no embed scale, no soft-cap
    model = CausalLM(cfg).eval()
    perturb_(model, gen)
    save_pretrained(model, tmp_path / "g")
    assert main(["convert", str(tmp_path / "g"), str(tmp_path / "o.pt"), "--to", "official"]) == 0
    assert json.loads((tmp_path / "o.json").read_text())["attention_window_size"] == 8
    assert main(["convert", str(tmp_path / "o.pt"), str(tmp_path / "back")]) == 0
    back = load_pretrained(tmp_path / "back")
    assert back.config.replace(name="") == cfg.replace(name="")
    ids = torch.randint(0, 32, (1, 25), generator=gen)
    torch.testing.assert_close(back(ids), model(ids))


def test_convert_reports_errors(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["convert"])


def test_generate_command(tmp_path, gen, capsys):
    seed_torch(gen)
    model = CausalLM(ModelConfig.from_preset("griffin-tiny", vocab_size=256))
    save_pretrained(model, tmp_path / "m")
    base = ["generate", str(tmp_path / "m"), "--tokenizer", "bytes", "--max-new-tokens", "6", "--temperature", "0"]
    assert main([*base, "--prompt", "hello"]) == 0
    out = capsys.readouterr().out
    expected = bytes(generate(model, [list(b"hello")], 6, temperature=0)[0]).decode("utf-8", "replace")
    assert out == "hello" + expected + "\n"
    # A snapshot after a prompt, continued later, gives the continuation of prompt + continuation.
    assert main([*base, "--prompt", "hel", "--max-new-tokens", "0", "--save-state", str(tmp_path / "s")]) == 0
    capsys.readouterr()
    assert main([*base, "--prompt", "lo", "--load-state", str(tmp_path / "s")]) == 0
    assert capsys.readouterr().out == "lo" + expected + "\n"
    (tmp_path / "prompts.txt").write_text("ab\ncd\n")
    assert main([*base, "--prompt-file", str(tmp_path / "prompts.txt")]) == 0
    assert capsys.readouterr().out.count("-" * 40) == 2
    assert main([*base, "--prompt", "x", "--top-p", "0"]) == 2
    assert "top_p=0.0" in capsys.readouterr().err


def test_generate_compiled_gives_the_same_greedy_text(tmp_path, gen, capsys):
    seed_torch(gen)
    save_pretrained(CausalLM(ModelConfig.from_preset("griffin-tiny", vocab_size=256)), tmp_path / "m")
    base = ["generate", str(tmp_path / "m"), "--tokenizer", "bytes", "--max-new-tokens", "12", "--temperature", "0",
            "--prompt", "hello"]
    assert main(base) == 0
    eager = capsys.readouterr().out
    assert main([*base, "--compile"]) == 0
    assert capsys.readouterr().out == eager


def test_tokenizer_and_prepare_commands(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(f"document {i}: " + "griffin hawk local attention " * (20 + i))
    (corpus / "more.jsonl").write_text('{"text": "a record"}\n{"text": "another record"}\n')
    assert main(["tokenizer", str(corpus), "--vocab-size", "300", "--out", str(tmp_path / "tok.json")]) == 0
    assert "tok.json" in capsys.readouterr().out
    assert main(["prepare", str(corpus), "--tokenizer", str(tmp_path / "tok.json"), "--out", str(tmp_path / "data"),
                 "--val-fraction", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "train:" in out and "val:" in out and "8 documents" not in out  # split 6 + 2 documents
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 8
    assert main(["prepare", str(tmp_path / "missing"), "--out", str(tmp_path / "d2")]) == 2
    assert "missing" in capsys.readouterr().err
