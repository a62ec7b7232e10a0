"""Held-out documents as token arrays: from text, JSONL or parquet files (tokenized here) or from a dataset prepared by
``griffin prepare`` (its shards read as they are), each document framed as in training (BOS/EOS if the tokenizer
has them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from griffin.data import iter_documents, load_dataset_tokenizer, load_meta
from griffin.data.dataset import DTYPES
from griffin.data.tokenizer import Tokenizer

PROBE = "def griffin(x):\n    return x  # Hawk, Griffin, \u00fc \u6f22\n"


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a dataset directory written by ``griffin prepare``."""
    return (Path(path) / "meta.json").is_file()


def check_same_tokenizer(data: Tokenizer, model: Tokenizer, where: str) -> None:
    """Refuse data tokenized by another tokenizer than the model's (vocabulary, special tokens, a probe text)."""
    ours = (model.vocab_size, model.bos_id, model.eos_id, list(model.encode(PROBE)))
    theirs = (data.vocab_size, data.bos_id, data.eos_id, list(data.encode(PROBE)))
    if ours != theirs:
        raise ValueError(f"{where} was tokenized with another tokenizer (vocabulary {data.vocab_size}, bos "
                         f"{data.bos_id}, eos {data.eos_id}) than the checkpoint's (vocabulary {model.vocab_size}, "
                         f"bos {model.bos_id}, eos {model.eos_id}): evaluate with the matching one (--tokenizer)")


def prepared_documents(data_dir: str | Path, split: str = "val") -> Iterator[np.ndarray]:
    """The documents of a prepared split, in order, as int64 arrays (a document may span shards)."""
    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    if split not in meta["splits"]:
        raise ValueError(f"{data_dir} has no split {split!r} (splits: {', '.join(meta['splits'])})")
    dtype = DTYPES[meta["dtype"]]
    pending: list[np.ndarray] = []
    for shard in meta["splits"][split]["shards"]:
        tokens = np.memmap(data_dir / shard, dtype=dtype, mode="r")
        starts = np.load(data_dir / shard.replace(".bin", ".idx.npy"), allow_pickle=False)
        bounds = [int(s) for s in starts] + [len(tokens)]
        if bounds[0] > 0:  # the previous shard's last document continues here
            pending.append(np.asarray(tokens[: bounds[0]], np.int64))
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            if pending:
                yield np.concatenate(pending)
                pending = []
            pending.append(np.asarray(tokens[a:b], np.int64))
    if pending:
        yield np.concatenate(pending)


def text_documents(paths: list[str | Path], tokenizer: Tokenizer, text_field: str = "text") -> Iterator[np.ndarray]:
    """The documents of text/JSONL/parquet files (see ``griffin.data.iter_documents``), tokenized and framed with
    the tokenizer's BOS/EOS as ``griffin prepare`` does."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    for text in iter_documents(paths, text_field=text_field):
        yield np.asarray(bos + list(tokenizer.encode(text)) + eos, np.int64)


def load_documents(paths: str | Path | list[str | Path], tokenizer: Tokenizer, *, split: str = "val",
                   text_field: str = "text") -> Iterator[np.ndarray]:
    """Documents from a prepared dataset directory (its ``split``; checked to share the model's tokenizer) or from
    text/JSONL/parquet files and directories."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise ValueError("no data given")
    for p in paths:
        if not Path(p).exists():
            raise FileNotFoundError(f"no such file or directory: {p}")
    if len(paths) == 1 and is_prepared(paths[0]):
        check_same_tokenizer(load_dataset_tokenizer(paths[0]), tokenizer, f"the dataset {paths[0]}")
        return prepared_documents(paths[0], split)
    if any(is_prepared(p) for p in paths):
        raise ValueError("give a prepared dataset directory alone, not mixed with other inputs")
    return text_documents(paths, tokenizer, text_field)
