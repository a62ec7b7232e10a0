"""Tokenizers: byte-level (no files), HF ``tokenizers`` JSON files and SentencePiece models.

Every tokenizer has ``encode(text) -> list[int]``, ``encode_batch(texts) -> list[np.ndarray]``,
``decode(ids) -> str``, ``vocab_size``, ``bos_id`` and ``eos_id`` (None when it has none). Text is text: a control
token's name written in it (``"<eos>"``) is encoded as the characters it is. The RecurrentGemma tokenizer is a
SentencePiece model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from griffin.data.sources import iter_documents, valid_utf8
from griffin.io import atomic_write, check_new_output


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte (vocabulary 256, no special tokens). Any string round-trips, including ones
    holding undecodable bytes as surrogate escapes (``bytes.decode("utf-8", "surrogateescape")``)."""

    vocab_size = 256
    bos_id = None
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", "surrogateescape"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The UTF-8 bytes of each text (surrogate escapes back to the bytes they stand for) as uint8 arrays."""
        return [np.frombuffer(t.encode("utf-8", "surrogateescape"), np.uint8) for t in texts]

    def encode_bytes(self, data: bytes) -> list[int]:
        return list(data)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ValueError(f"token id {bad[0]} is not a byte (0..255)")
        return bytes(ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", "surrogateescape")


class HFTokenizer:
    """A ``tokenizer.json`` file of the HF ``tokenizers`` library (BPE, WordPiece, ...). Special tokens written in the
    text (``"<eos>"``) are encoded as text, not as the control tokens."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self.tok = _Tokenizer.from_file(str(path))
        except Exception as err:  # the library raises a bare Exception for a malformed file
            raise ValueError(f"{path} is not a tokenizer.json of the HF tokenizers library: {err}") from None
        self.tok.encode_special_tokens = True
        self.vocab_size = self.tok.get_vocab_size()
        self.bos_id = self._special(("<bos>", "<s>", "<|bos|>", "[BOS]"))
        self.eos_id = self._special(("<eos>", "</s>", "<|endoftext|>", "<|eos|>", "[EOS]"))

    def _special(self, names: Sequence[str]) -> int | None:
        for name in names:
            idx = self.tok.token_to_id(name)
            if idx is not None:
                return idx
        return None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of each text (undecodable bytes as U+FFFD) as int64 arrays, in one batched call."""
        encode_batch = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [np.asarray(e.ids, np.int64)
                for e in encode_batch([valid_utf8(t) for t in texts], add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` file (the RecurrentGemma tokenizer is one)."""

    def __init__(self, path: str | Path) -> None:
        import sentencepiece as spm

        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as err:
            raise ValueError(f"{path} is not a SentencePiece model: {err}") from None
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of each text (undecodable bytes as U+FFFD) as int64 arrays."""
        return [np.asarray(self.sp.encode(valid_utf8(t)), np.int64) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode(list(ids))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # the names a tokenizer has in a directory, first found wins
AUTO = "auto"  # the tokenizer stored with a checkpoint, else the byte-level one


def tokenizer_file(directory: str | Path) -> Path | None:
    """The tokenizer file ``directory`` holds (:data:`TOKENIZER_FILES`, ``tokenizer.json`` first), or None."""
    directory = Path(directory)
    return next((directory / n for n in TOKENIZER_FILES if (directory / n).is_file()), None)


def load_tokenizer(spec: str | Path, beside: str | Path | None = None) -> Tokenizer:
    """``bytes`` for the byte-level tokenizer, a ``.json`` file for HF tokenizers, a ``.model`` file for
    SentencePiece, or a directory holding ``tokenizer.json`` or ``tokenizer.model``.

    ``auto`` (with ``beside``, a checkpoint directory or file): the tokenizer stored with the checkpoint, in its
    directory or, for a checkpoint file, in the directory holding it (``griffin train`` copies it there); the
    byte-level tokenizer when there is none."""
    if str(spec) == AUTO:
        if beside is None:
            raise ValueError("tokenizer 'auto' means the tokenizer beside a checkpoint: name the checkpoint "
                             "(beside=) or the tokenizer")
        directory = Path(beside)
        found = tokenizer_file(directory if directory.is_dir() else directory.parent)
        return load_tokenizer(found) if found is not None else ByteTokenizer()
    if str(spec) == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        found = tokenizer_file(path)
        if found is None:
            raise FileNotFoundError(f"{path} holds neither tokenizer.json nor tokenizer.model")
        return load_tokenizer(found)
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer at {path} (use 'bytes' for the byte-level tokenizer)")
    if path.suffix == ".json":
        return HFTokenizer(path)
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    raise ValueError(f"unrecognised tokenizer file {path}: expected .json (HF tokenizers) or .model (SentencePiece)")


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[str], bos: bool = True) -> list[list[int]]:
    """The token ids of each prompt, after the tokenizer's BOS token when ``bos`` and it has one (a prompt that
    starts a document; not one that continues a saved state)."""
    first = [tokenizer.bos_id] if bos and tokenizer.bos_id is not None else []
    return [first + tokenizer.encode(p) for p in prompts]


BPE_SPECIAL_TOKENS = ("<bos>", "<eos>")


def train_bpe(files: Sequence[str | Path], out_path: str | Path, vocab_size: int = 8192, *,
              text_field: str = "text", overwrite: bool = False) -> Path:
    """Train a byte-level BPE tokenizer (HF ``tokenizers``) on local files and save it as ``tokenizer.json``.

    ``files`` are read with ``griffin.data.sources.iter_documents`` (text, JSONL, parquet; directories walked). The
    vocabulary holds ``<bos>`` (id 0), ``<eos>`` (id 1), the 256 bytes and the learnt merges, so any string
    round-trips (no normaliser, byte-level pre-tokenizer and decoder). ``out_path`` is the file to write, or a
    directory to write ``tokenizer.json`` into (a path without a ``.json`` suffix counts as a directory); the file
    is written atomically, and an existing one is replaced only with ``overwrite`` (else
    :class:`~griffin.io.OutputExistsError`, before any training). Returns its path."""
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(BPE_SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is too small: byte-level BPE needs at least "
                         f"{256 + len(BPE_SPECIAL_TOKENS)} (256 bytes + {', '.join(BPE_SPECIAL_TOKENS)})")
    out_path = Path(out_path)
    if out_path.is_dir() or out_path.suffix != ".json":
        out_path = out_path / "tokenizer.json"
    check_new_output(out_path, overwrite)
    tok = _Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BPE_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((valid_utf8(t) for t in iter_documents(files, text_field=text_field)), trainer)
    atomic_write(out_path, lambda tmp: tok.save(tmp))
    return out_path
