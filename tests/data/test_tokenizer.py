import random

import numpy as np
import pytest
import torch

from griffin.data.sources import valid_utf8
from griffin.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    encode_prompts,
    load_tokenizer,
    train_bpe,
)

CORPUS = ["the quick brown fox jumps over the lazy dog", "griffin mixes gated linear recurrences",
          "with local attention", "hawk is a pure recurrent model"] * 20


def test_byte_tokenizer_round_trips_anything():
    tok = load_tokenizer("bytes")
    for text in ["", "héllo wörld", "日本語 🙂", "\x00\n\t"]:
        assert tok.decode(tok.encode(text)) == text
    raw = bytes(range(256)) + b"\xff\xfe\xc3"  # invalid UTF-8 included
    assert tok.decode_bytes(tok.encode_bytes(raw)) == raw
    assert tok.encode(tok.decode(list(raw))) == list(raw)
    with pytest.raises(ValueError, match="token id 300"):
        tok.decode([300])
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, HFTokenizer) and loaded.bos_id == 1 and loaded.eos_id == 2
    ids = loaded.encode("the lazy griffin, unseen: 日本")
    assert len(ids) < len("the lazy griffin, unseen: 日本".encode())  # merges learnt from the corpus apply
    assert loaded.decode(ids) == "the lazy griffin, unseen: 日本"


def test_sentencepiece_model(tmp_path):
    import sentencepiece as spm

    (tmp_path / "corpus.txt").write_text("\n".join(CORPUS))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=40, minloglevel=2)
    tok = load_tokenizer(tmp_path / "sp.model")
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.decode(tok.encode("the lazy dog")) == "the lazy dog"
    assert tok.bos_id is not None and tok.vocab_size == 40


def test_bad_tokenizer_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="use 'bytes'"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "vocab.txt").write_text("x")
    with pytest.raises(ValueError, match="unrecognised tokenizer file"):
        load_tokenizer(tmp_path / "vocab.txt")
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor tokenizer.model"):
        load_tokenizer(tmp_path)


def test_auto_is_the_tokenizer_beside_the_checkpoint_else_bytes(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.pt").write_bytes(b"")
    assert isinstance(load_tokenizer("auto", beside=ckpt), ByteTokenizer)  # none stored: byte-level
    (ckpt / "corpus.txt").write_text("\n".join(CORPUS))
    train_bpe([ckpt / "corpus.txt"], ckpt / "tokenizer.json", vocab_size=300)
    for beside in (ckpt, ckpt / "model.pt"):  # a checkpoint directory, or a checkpoint file in it
        tok = load_tokenizer("auto", beside=beside)
        assert isinstance(tok, HFTokenizer) and tok.vocab_size == 300
    with pytest.raises(ValueError, match="tokenizer 'auto' means the tokenizer beside a checkpoint"):
        load_tokenizer("auto")


def test_encode_prompts_puts_bos_first_when_asked_and_there_is_one(tmp_path):
    (tmp_path / "corpus.txt").write_text("\n".join(CORPUS))
    bpe = load_tokenizer(train_bpe([tmp_path / "corpus.txt"], tmp_path / "tokenizer.json", vocab_size=300))
    assert encode_prompts(bpe, ["the fox", ""]) == [[bpe.bos_id, *bpe.encode("the fox")], [bpe.bos_id]]
    assert encode_prompts(bpe, ["the fox"], bos=False) == [bpe.encode("the fox")]
    assert encode_prompts(ByteTokenizer(), ["hi"]) == [[104, 105]]  # no BOS token to put


# code point ranges for random text: ASCII, Latin-1, combining marks, Greek, Cyrillic, Arabic, Devanagari, Hangul,
# CJK, emoji, zero-width joiner / variation selectors, supplementary-plane CJK
UNICODE_RANGES = [(0x00, 0x7F), (0xA0, 0xFF), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF), (0x600, 0x6FF),
                  (0x900, 0x97F), (0xAC00, 0xD7A3), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF), (0x200B, 0x200D),
                  (0xFE00, 0xFE0F), (0x20000, 0x2A6DF)]


def random_text(rng: random.Random, length: int) -> str:
    chars = []
    for _ in range(length):
        lo, hi = rng.choice(UNICODE_RANGES)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


def test_train_bpe(tmp_path, gen):
    (tmp_path / "a.txt").write_text("\n".join(CORPUS[:40]))
    (tmp_path / "b.jsonl").write_text("".join(f'{{"body": "{line}"}}\n' for line in CORPUS[40:]))
    path = train_bpe([tmp_path], tmp_path / "out", vocab_size=300, text_field="body")
    assert path == tmp_path / "out" / "tokenizer.json" and [p.name for p in path.parent.iterdir()] == [path.name]
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer) and tok.bos_id == 0 and tok.eos_id == 1 and 258 < tok.vocab_size <= 300
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # merges learnt
    rng = random.Random(int(torch.randint(2**31, (), generator=gen)))
    for length in (0, 1, 2, 7, 50, 300):
        for _ in range(10):
            text = random_text(rng, length)
            assert tok.decode(tok.encode(text)) == text, ascii(text)
    fixed = ["e\u0301\u0302 n\u0303", "👩\u200d👩\u200d👧 🏳️\u200d🌈 👍🏽", "日本語のテキスト 中文 한국어",
             "\x00\r\n\t  trailing  ", "  lead"]
    for text in fixed:
        assert tok.decode(tok.encode(text)) == text
    assert train_bpe([tmp_path / "a.txt"], tmp_path / "x.json", vocab_size=258) == tmp_path / "x.json"
    with pytest.raises(ValueError, match="vocab_size 257 is too small"):
        train_bpe([tmp_path / "a.txt"], tmp_path / "y.json", vocab_size=257)
    with pytest.raises(FileNotFoundError, match="nope"):
        train_bpe([tmp_path / "nope"], tmp_path / "y.json")
    assert not (tmp_path / "y.json").exists()


def test_encode_batch_matches_encode(tmp_path, gen):
    """Each tokenizer's batched encoding is its one-by-one ``encode`` (of the valid-UTF-8 text for the tokenizers
    that need it), "<eos>" written in a document included: text, not the control token."""
    import sentencepiece as spm

    rng = random.Random(int(torch.randint(2**31, (), generator=gen)))
    raw = b"caf\xc3\xa9 \xff\xfe end \xc3".decode("utf-8", "surrogateescape")  # undecodable bytes
    texts = [random_text(rng, rng.randint(0, 60)) for _ in range(30)]
    texts += ["", "a <eos> b", "<bos>x<eos>", raw, f"<eos>{raw}<eos>", "the lazy dog"]
    rng.shuffle(texts)
    (tmp_path / "corpus.txt").write_text("\n".join(CORPUS))
    bpe = load_tokenizer(train_bpe([tmp_path / "corpus.txt"], tmp_path / "bpe", vocab_size=300))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=40, minloglevel=2)
    byte, sp = load_tokenizer("bytes"), load_tokenizer(tmp_path / "sp.model")
    for tok, dtype in ((byte, np.uint8), (bpe, np.int64), (sp, np.int64)):
        batch = tok.encode_batch(texts)
        assert len(batch) == len(texts)
        for text, ids in zip(texts, batch, strict=True):
            assert isinstance(ids, np.ndarray) and ids.dtype == dtype and ids.ndim == 1
            assert ids.tolist() == tok.encode(text if tok is byte else valid_utf8(text)), ascii(text)
    assert tok.encode_batch([]) == []
    # undecodable bytes: the byte tokenizer keeps them, the others see U+FFFD
    assert bytes(byte.encode_batch([raw])[0]) == b"caf\xc3\xa9 \xff\xfe end \xc3"
    assert bpe.decode(bpe.encode_batch([raw])[0].tolist()) == valid_utf8(raw) != raw
    # "<eos>" in a document is text
    (ids,) = bpe.encode_batch(["a <eos> b"])
    assert bpe.eos_id not in ids.tolist() and bpe.decode(ids.tolist()) == "a <eos> b"
