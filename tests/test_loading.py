"""``griffin.load_for_use``: every checkpoint format with or without a tokenizer beside it, cast and quantised on
loading, giving the logits of ``load_pretrained`` (+ the same quantisation by hand); bad options refused by name
before the checkpoint is read."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from griffin import CausalLM, ModelConfig, load_for_use, load_pretrained, save_pretrained
from griffin.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe
from griffin.interop import export_hf, save_official
from griffin.quantize import quantization_of, quantize_int8
from tests.conftest import perturb_, seed_torch

VOCAB = 270
CORPUS = "the quick brown fox jumps over the lazy dog; griffin mixes gated linear recurrences with local attention\n"


def tiny(gen: torch.Generator) -> CausalLM:
    """A tiny Griffin (recurrent and local-attention blocks) that the HF and official formats can both express."""
    seed_torch(gen)
    cfg = ModelConfig.from_preset("griffin-tiny", vocab_size=VOCAB, gate_blocks=2, embed_scale=True,
                                  logits_soft_cap=30.0, conv1d_document_reset=False)
    model = CausalLM(cfg).eval()
    perturb_(model, gen)
    return model


def checkpoint(fmt: str, model: CausalLM, root: Path) -> Path:
    """``model`` written in ``fmt`` under ``root``: the path to load (a directory; official: the .pt file)."""
    if fmt == "griffin":
        save_pretrained(model, root / "ckpt")
        return root / "ckpt"
    if fmt == "hf":
        export_hf(model, root / "ckpt")
        return root / "ckpt"
    (root / "ckpt").mkdir()
    with pytest.warns(UserWarning, match="lossy"):  # the official model resets the Conv1D at document starts
        save_official(model, root / "ckpt" / "model.pt", lossy=True)
    return root / "ckpt" / "model.pt"


def bpe_beside(directory: Path, vocab_size: int = 260) -> Path:
    """A byte-level BPE ``tokenizer.json`` trained into ``directory`` (where ``griffin train`` puts it)."""
    (directory / "corpus.txt").write_text(CORPUS * 20)
    path = train_bpe([directory / "corpus.txt"], directory / "tokenizer.json", vocab_size=vocab_size)
    (directory / "corpus.txt").unlink()
    return path


@torch.no_grad()
def logits(model: CausalLM) -> torch.Tensor:
    return model(torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("fmt", ["griffin", "hf", "official"])
def test_each_format_loads_as_load_pretrained_with_the_tokenizer_beside_it(fmt, gen, tmp_path):
    path = checkpoint(fmt, tiny(gen), tmp_path)
    loaded = load_for_use(path)  # no tokenizer beside it: bytes
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    assert loaded.path == path.resolve() and loaded.name == ("model" if fmt == "official" else "ckpt")
    link = tmp_path / ("best.pt" if fmt == "official" else "best")
    link.symlink_to(path)  # as `griffin train` links checkpoints/best: named after the link, not its target
    best = load_for_use(link, tokenizer=None)
    assert best.path == path.resolve() and best.name == "best"
    assert not loaded.model.training and not any(p.requires_grad for p in loaded.model.parameters())
    assert torch.equal(logits(loaded.model), logits(load_pretrained(path)))

    bpe_beside(tmp_path / "ckpt")  # in the directory, or beside the official file
    tok = load_for_use(path).tokenizer
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 260
    assert load_for_use(path, tokenizer=None).tokenizer is None
    assert isinstance(load_for_use(path, tokenizer="bytes").tokenizer, ByteTokenizer)
    mine = ByteTokenizer()
    assert load_for_use(path, tokenizer=mine).tokenizer is mine  # a tokenizer object is used as it is


@pytest.mark.parametrize("fmt", ["griffin", "official"])
def test_dtype_and_int8_on_loading_equal_the_same_by_hand(fmt, gen, tmp_path):
    path = checkpoint(fmt, tiny(gen), tmp_path)
    for dtype in (torch.bfloat16, "bfloat16", "torch.bfloat16"):
        loaded = load_for_use(path, dtype=dtype, tokenizer=None)
        assert loaded.model.dtype == torch.bfloat16
        assert torch.equal(logits(loaded.model), logits(load_pretrained(path, dtype=torch.bfloat16)))
    assert load_for_use(path, dtype="auto").model.dtype == load_pretrained(path).dtype  # lm-eval's dtype=auto

    for group_size in (0, 8):
        loaded = load_for_use(path, quantize="int8", group_size=group_size)
        assert quantization_of(loaded.model) == {"method": "int8", "group_size": group_size}
        by_hand = quantize_int8(load_pretrained(path), group_size)
        assert torch.equal(logits(loaded.model), logits(by_hand))
    loaded = load_for_use(path, quantize="int8", group_size=8, dtype="bfloat16")
    assert torch.equal(logits(loaded.model),
                       logits(quantize_int8(load_pretrained(path, dtype=torch.bfloat16), 8)))


def test_an_int8_checkpoint_is_used_as_it_is(gen, tmp_path):
    model = quantize_int8(tiny(gen), 8)
    save_pretrained(model, tmp_path / "int8")
    for quantize in (None, "int8"):  # --quantize int8 on an int8 checkpoint: nothing to do
        loaded = load_for_use(tmp_path / "int8", quantize=quantize)
        assert quantization_of(loaded.model) == {"method": "int8", "group_size": 8}
        assert torch.equal(logits(loaded.model), logits(model))


def test_bad_options_are_refused_by_name_before_the_checkpoint_is_read(gen, tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {missing}"):
        load_for_use(missing)
    for kwargs, message in [
        (dict(dtype="bfloat61"), "dtype='bfloat61' is not one of"),
        (dict(dtype=torch.int32), "dtype=torch.int32 is not one of"),
        (dict(quantize="int4"), "quantize='int4' is not supported"),
        (dict(quantize="int8", group_size=12), "group_size=12 is not supported"),
        (dict(quantize="int8", group_size=-8), "group_size=-8 is not supported"),
        (dict(group_size=8), "group_size=8 applies to quantize='int8' only"),
        (dict(device="gpu0"), "device='gpu0' is not a torch device"),
        (dict(quantize="int8", device="meta"), "int8 weights decode with the CPU kernel only, not on device 'meta'"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            load_for_use(missing, **kwargs)  # refused before the (missing) checkpoint is looked for

    path = checkpoint("griffin", tiny(gen), tmp_path)
    with pytest.raises(FileNotFoundError, match=f"no tokenizer at {tmp_path / 'nope.json'}"):
        load_for_use(path, tokenizer=tmp_path / "nope.json")
    with pytest.raises(ValueError, match="group_size=32 does not divide the 16 inputs"):  # widths: known on loading
        load_for_use(path, quantize="int8", group_size=32)
    big = load_tokenizer(shutil.copy(bpe_beside(tmp_path, vocab_size=VOCAB + 30), path / "tokenizer.json"))
    assert big.vocab_size > VOCAB
    with pytest.raises(ValueError, match=f"the tokenizer has {big.vocab_size} tokens but the checkpoint's vocabulary "
                                         f"only {VOCAB}"):
        load_for_use(path)
    save_pretrained(quantize_int8(tiny(gen)), tmp_path / "int8")
    with pytest.raises(ValueError, match="holds int8 weights, which decode with the CPU kernel only, not on device "
                                         "'meta'"):
        load_for_use(tmp_path / "int8", device="meta")
    assert isinstance(load_tokenizer("auto", beside=tmp_path / "int8"), ByteTokenizer)
