"""`griffin eval loss | harness | phonebook`: results written as JSON and plots; bad input refused with a clear
error and nothing written."""

from __future__ import annotations

import json

import pytest

from griffin import CausalLM, ModelConfig
from griffin.cli import main
from griffin.interop import save_pretrained
from tests.conftest import seed_torch


@pytest.fixture
def checkpoint(tmp_path, gen):
    seed_torch(gen)
    path = tmp_path / "ckpt"
    save_pretrained(CausalLM(ModelConfig.from_preset("hawk-tiny", vocab_size=256)), path)
    return str(path)


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "docs.jsonl"
    docs = ["def f(x):\n    return x * 2\n" * 3, "import os\nprint(os.getcwd())\n", "short"]
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    return str(path)


def test_eval_loss_and_per_position_write_json_and_plot(checkpoint, text, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["eval", "loss", checkpoint, "--data", text, "--out", str(out), "--chunk-size", "7"]) == 0
    result = json.loads((out / "loss.json").read_text())["results"]["hawk-tiny"]
    assert result["documents"] == 3 and result["bits_per_byte"] > 0
    assert main(["eval", "loss", checkpoint, checkpoint, "--label", "a", "--label", "b", "--data", text, "--out",
                 str(out), "--per-position", "--max-length", "40", "--buckets", "4"]) == 0
    per = json.loads((out / "per_position.json").read_text())
    assert set(per["results"]) == {"a", "b"} and per["results"]["a"]["short_documents"] == 2
    assert (out / "per_position.png").stat().st_size > 0
    assert "2 shorter, left out" in capsys.readouterr().out


def test_eval_phonebook_writes_json_and_plot(checkpoint, tmp_path):
    out = tmp_path / "pb"
    assert main(["eval", "phonebook", checkpoint, "--entries", "3,6", "--seeds", "0,1", "--samples", "2",
                 "--out", str(out)]) == 0
    r = json.loads((out / "phonebook.json").read_text())["results"]["hawk-tiny"]
    assert r["entries"] == [3, 6] and len(r["accuracy"]) == 2 and len(r["accuracy"][0]) == 2
    assert (out / "phonebook.png").is_file()


def test_bad_input_is_refused_and_nothing_is_written(checkpoint, text, tmp_path, capsys, gen):
    out = tmp_path / "never"

    def fails(argv, message):
        assert main(argv) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()

    fails(["eval", "loss", str(tmp_path / "nope"), "--data", text, "--out", str(out)], "no checkpoint at")
    fails(["eval", "loss", checkpoint, "--data", str(tmp_path / "missing.txt"), "--out", str(out)],
          "no such file or directory")
    fails(["eval", "loss", checkpoint, "--data", text, "--out", str(out), "--per-position", "--max-length",
           "100000"], "no document of")
    seed_torch(gen)
    small = tmp_path / "small"
    save_pretrained(CausalLM(ModelConfig.from_preset("hawk-tiny")), small)  # a 32-token vocabulary
    fails(["eval", "loss", str(small), "--data", text, "--out", str(out)],
          "the tokenizer has 256 tokens but the checkpoint's vocabulary only 32")
    fails(["eval", "harness", checkpoint, "--tasks", "hellaswag,nosuchtask", "--out", str(out)],
          "unknown task 'nosuchtask'")
    fails(["eval", "harness", checkpoint, "--tasks", "hellaswag", "--task-data", str(tmp_path),
           "--out", str(out)], "missing task data")
    fails(["eval", "harness", checkpoint, "--tasks", "piqa", "--task-data", str(tmp_path),
           "--out", str(out)], "griffin eval export-tasks --out DIR --tasks piqa")


def test_data_prepared_with_another_tokenizer_is_refused(checkpoint, tmp_path, capsys, gen):
    """A prepared dataset tokenized by a BPE tokenizer, evaluated with a byte-level checkpoint: refused before any
    scoring, naming both vocabularies; nothing written."""
    from griffin.data.tokenizer import train_bpe

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def griffin(x):\n    return x + 1\n\n" * 50 + "class Hawk:\n    pass\n\n" * 50)
    bpe = train_bpe([corpus], tmp_path / "bpe" / "tokenizer.json", vocab_size=300)
    data = tmp_path / "data"
    assert main(["prepare", str(corpus), "--out", str(data), "--tokenizer", str(bpe), "--val-fraction", "0.5"]) == 0
    capsys.readouterr()
    out = tmp_path / "never"
    assert main(["eval", "loss", checkpoint, "--data", str(data), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "was tokenized with another tokenizer" in err and "vocabulary 256" in err, err
    assert not out.exists()
