import pytest

from griffin.tokenizer import ByteTokenizer, HFTokenizer, SentencePieceTokenizer, load_tokenizer

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
