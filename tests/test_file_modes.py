"""Outputs on a shared machine (issue 35): files and directories get the user's umask (not tempfile's 0600/0700), and
an existing output is replaced only with ``overwrite``."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
import torch

from griffin.config import ModelConfig
from griffin.data import load_meta, prepare
from griffin.data.tokenizer import load_tokenizer, train_bpe
from griffin.interop import export_hf, quantize_checkpoint, save_official, save_pretrained
from griffin.interop.official import sidecar_path
from griffin.io import OutputExistsError, atomic_write, create_temp, write_json
from griffin.model import CausalLM

pytestmark = pytest.mark.filterwarnings("ignore:HF RecurrentGemma does not reset the Conv1D:UserWarning")
CORPUS = "the quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture(params=[0o022, 0o002], ids=["umask022", "umask002"])
def umask(request) -> int:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def tiny(**overrides) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(ModelConfig.from_preset("griffin-tiny", **overrides)).eval()


def hf_expressible() -> CausalLM:
    return tiny(gate_blocks=2, embed_scale=True, logits_soft_cap=30.0)


def assert_modes(root: Path, umask: int) -> None:
    """``root`` and everything under it (symbolic links aside) have the modes an ordinary open/mkdir would give."""
    paths = [root, *sorted(root.rglob("*"))] if root.is_dir() else [root]
    for path in paths:
        if path.is_symlink():
            continue
        want = (0o777 if path.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == want, f"{path}: {oct(path.stat().st_mode)}, want {oct(want)}"
        assert path == root or not path.name.startswith(".") or path.name == ".metadata", f"left over: {path}"


def write_corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(CORPUS)
    return path


# File modes -----------------------------------------------------------------------------------------------------
def test_atomic_write_and_create_temp_follow_the_umask(tmp_path, umask):
    atomic_write(tmp_path / "a" / "b.txt", lambda tmp: Path(tmp).write_text("hi"))
    write_json(tmp_path / "a" / "c.json", {"x": 1})
    assert_modes(tmp_path / "a", umask)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b.txt", "c.json"]
    made = [create_temp(tmp_path, ".x-", ".tmp"), create_temp(tmp_path, ".y-", directory=True)]
    for path in made:
        assert stat.S_IMODE(path.stat().st_mode) == (0o777 if path.is_dir() else 0o666) & ~umask
    assert os.umask(umask) == umask  # read, never changed


def test_atomic_write_replaces_a_private_file_with_a_shareable_one(tmp_path, umask):
    path = tmp_path / "old.txt"
    path.write_text("old")
    path.chmod(0o600)  # as griffin wrote it before
    atomic_write(path, lambda tmp: Path(tmp).write_text("new"))
    assert path.read_text() == "new"
    assert_modes(path, umask)


def test_saved_checkpoints_follow_the_umask(tmp_path, umask):
    model = hf_expressible()
    save_pretrained(model, tmp_path / "griffin")
    export_hf(model, tmp_path / "hf")
    save_official(model, tmp_path / "official" / "model.pt")
    for name in ("griffin", "hf", "official"):
        assert_modes(tmp_path / name, umask)


def test_prepared_dataset_follows_the_umask(tmp_path, umask):
    prepare([write_corpus(tmp_path)], tmp_path / "ds", "bytes", shard_tokens=500, progress=False)
    assert_modes(tmp_path / "ds", umask)
    assert len(list((tmp_path / "ds").iterdir())) > 3
    prepare([tmp_path / "corpus.txt"], tmp_path / "ds", "bytes", seed=1, progress=False, overwrite=True)
    assert_modes(tmp_path / "ds", umask)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_tokenizer_and_quantised_checkpoint_follow_the_umask(tmp_path, umask):
    tok = train_bpe([write_corpus(tmp_path)], tmp_path / "tok" / "tokenizer.json", vocab_size=270)
    assert_modes(tmp_path / "tok", umask)
    save_pretrained(tiny(), tmp_path / "float")
    quantize_checkpoint(tmp_path / "float", tmp_path / "int8")
    assert_modes(tmp_path / "int8", umask)
    assert load_tokenizer(tok).vocab_size == 270


def test_trainer_checkpoints_follow_the_umask(tmp_path, umask):
    from griffin.parallel.checkpoint import load_sharded, save_sharded
    from griffin.training.checkpoint import save_checkpoint, verify_checkpoint

    model = tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()
    private = tmp_path / "tokenizer.json"
    private.write_text("{}")
    private.chmod(0o600)  # copied in with the umask's mode, not its own
    root = tmp_path / "run" / "checkpoints"
    path = save_checkpoint(root, 1, model, optimizer, {"seen": 1}, extra_files={"tokenizer.json": private})
    assert_modes(root, umask)
    assert verify_checkpoint(path)["step"] == 1 and (root / "latest").resolve() == path.resolve()
    sharded = save_sharded(tmp_path / "sharded" / "step_00000001", model, optimizer, {"step": 1},
                           extra_files={"tokenizer.json": private})
    assert_modes(tmp_path / "sharded", umask)
    assert load_sharded(sharded, tiny())["step"] == 1


# Overwrite -------------------------------------------------------------------------------------------------------
def refused(path: Path):
    return pytest.raises(OutputExistsError, match=re.escape(str(path)) + r".*pass --overwrite to replace it")


def test_the_refusal_is_a_user_error():
    err = OutputExistsError("x")
    assert isinstance(err, FileExistsError) and isinstance(err, ValueError)


def test_prepare_refuses_an_existing_dataset(tmp_path):
    corpus = write_corpus(tmp_path)
    first = prepare([corpus], tmp_path / "ds", progress=False)
    with refused(tmp_path / "ds"):
        prepare([corpus], tmp_path / "ds", seed=5, progress=False)
    assert load_meta(tmp_path / "ds") == first
    assert prepare([corpus], tmp_path / "ds", seed=5, progress=False, overwrite=True)["seed"] == 5
    assert load_meta(tmp_path / "ds")["seed"] == 5
    (tmp_path / "empty").mkdir()
    prepare([corpus], tmp_path / "empty", progress=False)  # an empty directory is no output yet
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "ds", "empty"]


def test_train_bpe_refuses_an_existing_tokenizer(tmp_path):
    corpus = write_corpus(tmp_path)
    path = train_bpe([corpus], tmp_path / "tok.json", vocab_size=270)
    with refused(path):
        train_bpe([corpus], path, vocab_size=280)
    assert load_tokenizer(path).vocab_size == 270
    assert load_tokenizer(train_bpe([corpus], path, vocab_size=280, overwrite=True)).vocab_size == 280
    train_bpe([corpus], tmp_path / "dir", vocab_size=270)
    with refused(tmp_path / "dir" / "tokenizer.json"):  # the directory form: the file it would write
        train_bpe([corpus], tmp_path / "dir", vocab_size=270)


def test_quantize_checkpoint_refuses_an_existing_output(tmp_path):
    save_pretrained(tiny(), tmp_path / "float")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with refused(tmp_path / "out"):
        quantize_checkpoint(tmp_path / "float", tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]
    with pytest.raises(ValueError, match="overwrite its source"):  # refused even with overwrite
        quantize_checkpoint(tmp_path / "float", tmp_path / "float", overwrite=True)
    quantize_checkpoint(tmp_path / "float", tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_convert_writers_refuse_an_existing_output_when_asked(tmp_path):
    model = hf_expressible()
    for name, write in (("griffin", save_pretrained), ("hf", export_hf)):
        out = tmp_path / name
        write(model, out, overwrite=False)  # new: written
        with refused(out):
            write(model, out, overwrite=False)
        write(model, out, overwrite=True)
        write(model, out)  # the library default replaces (training checkpoints, notebooks)
    pt = tmp_path / "official" / "model.pt"
    save_official(model, pt, overwrite=False)
    with refused(pt):
        save_official(model, pt, overwrite=False)
    pt.unlink()
    with refused(sidecar_path(pt)):  # its config beside it would be replaced too
        save_official(model, pt, overwrite=False)
    save_official(model, pt, overwrite=True)
    assert pt.is_file()
