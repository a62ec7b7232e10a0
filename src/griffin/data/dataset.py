"""Tokenize documents into a prepared dataset: memory-mapped token shards and their meta.

``prepare`` turns text files, JSONL, parquet or the embedded default corpus (the Python standard library's own
source) into a dataset directory::

    out_dir/meta.json                   format, tokenizer, vocabulary, dtype, per split: tokens, documents, shards
    out_dir/train-00000.bin             raw little-endian uint16/uint32 token ids (np.memmap)
    out_dir/train-00000.idx.npy         int64 offsets of the document starts within that shard
    out_dir/val-00000.bin, ...
    out_dir/tokenizer.json              a copy of the tokenizer file, same name (none for the byte-level tokenizer)

Each split is one token stream: documents are concatenated (with ``bos``/``eos`` when the tokenizer has them) and
shards are cut every ``shard_tokens`` tokens, so a document may continue into the next shard.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from griffin.data.sources import default_corpus_files, expand_inputs, iter_file_documents, split_pieces
from griffin.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_file
from griffin.io import OutputExistsError, create_temp

FORMAT = "griffin-tokens"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
VAL_FRACTION = 0.02  # documents held out for validation, by default (prepare and train alike)
PIECE_CHARS = 1 << 14  # fewer than MIN_PIECES documents are cut into pieces of about this many characters,
MIN_PIECES, MIN_PIECE_CHARS = 50, 256  # or of fewer (not under 256) so that it gives at least 50 pieces

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def tokenizer_spec_file(spec: str | Path) -> Path | None:
    """The file behind a tokenizer spec (resolved like ``load_tokenizer``), None for ``bytes``."""
    if str(spec) == "bytes":
        return None
    path = Path(spec)
    return tokenizer_file(path) if path.is_dir() else path


def _resolve_dtype(dtype: str | None, vocab_size: int) -> str:
    if dtype is None:
        return "uint16" if vocab_size <= 1 << 16 else "uint32"
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported: use uint16 or uint32")
    if vocab_size > np.iinfo(DTYPES[name]).max + 1:
        raise ValueError(f"vocab_size {vocab_size} does not fit in dtype {name} (ids up to "
                         f"{np.iinfo(DTYPES[name]).max}); use uint32")
    return name


class _SplitWriter:
    """Appends documents to ``{split}-{i:05d}.bin`` shards of exactly ``shard_tokens`` tokens (the last one shorter),
    with the document starts of each shard in ``{split}-{i:05d}.idx.npy``."""

    def __init__(self, directory: Path, split: str, dtype: str, shard_tokens: int) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, DTYPES[dtype], shard_tokens
        self.shards: list[str] = []
        self.tokens = self.documents = 0
        self._file: Any = None
        self._fill = 0
        self._starts: list[int] = []

    def add(self, ids: np.ndarray) -> None:
        if len(ids) == 0:
            return
        self.documents += 1
        self.tokens += len(ids)
        ids = ids.astype(self.dtype, copy=False)
        first = True
        while len(ids):
            if self._file is None:
                self.shards.append(f"{self.split}-{len(self.shards):05d}.bin")
                self._file = open(self.directory / self.shards[-1], "wb")
            if first:
                self._starts.append(self._fill)
                first = False
            n = min(len(ids), self.shard_tokens - self._fill)
            self._file.write(ids[:n].tobytes())
            self._fill += n
            ids = ids[n:]
            if self._fill == self.shard_tokens:
                self._close()

    def _close(self) -> None:
        self._file.close()
        np.save(self.directory / self.shards[-1].replace(".bin", ".idx.npy"), np.asarray(self._starts, np.int64))
        self._file, self._fill, self._starts = None, 0, []

    def finish(self) -> dict:
        if self._file is not None:
            self._close()
        return {"tokens": self.tokens, "documents": self.documents, "shards": self.shards}

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()


def _batched(docs: Iterable[str], max_docs: int = 512, max_chars: int = 1 << 22) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def check_out_dir(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds something (then it must be an earlier dataset, which ``prepare`` replaces only
    with ``overwrite``)."""
    if not out_dir.exists():
        return False
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if not any(out_dir.iterdir()):
        return False
    if not (out_dir / "meta.json").exists():
        raise FileExistsError(f"{out_dir} exists and is not a prepared dataset; pick an empty or new directory")
    return True


def install_dataset(tmp: Path, out_dir: Path) -> None:
    """Move the finished ``tmp`` directory to ``out_dir``, replacing an earlier dataset there."""
    if not check_out_dir(out_dir):
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
        return
    old = create_temp(out_dir.parent, f".{out_dir.name}.old-", directory=True)
    os.replace(out_dir, old / "data")
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        os.replace(old / "data", out_dir)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def prepare(inputs: Sequence[str | Path] | None, out_dir: str | Path, tokenizer: str = "bytes", *,
            val_fraction: float = VAL_FRACTION, seed: int = 0, text_field: str = "text", shard_tokens: int = 1 << 27,
            dtype: str | None = None, progress: bool = True, piece_chars: int | None = None,
            overwrite: bool = False) -> dict:
    """Tokenize ``inputs`` (None: the default corpus, see ``default_corpus_files``) into a dataset in ``out_dir``
    and return its meta (also written to ``out_dir/meta.json``).

    Documents go to the val split by a permutation seeded with ``seed`` (``round(n * val_fraction)`` of them, at
    least one when ``val_fraction > 0`` and there are two or more, never all). ``piece_chars`` cuts every document
    into pieces of about that many characters (:func:`griffin.data.sources.split_pieces`); by default the documents
    are cut only when there are fewer than ``MIN_PIECES`` of them (a few text files: a book, nanoGPT's
    ``input.txt``), into pieces of ``PIECE_CHARS`` (smaller for a short text, so that there are at least
    ``MIN_PIECES``), so that the validation split holds a few pieces and not a whole file.
    The inputs are read twice (count, then tokenize), and the dataset is built in a temporary directory that
    replaces ``out_dir`` only once complete. An earlier dataset in ``out_dir`` is replaced only with ``overwrite``
    (else :class:`~griffin.io.OutputExistsError`); a non-empty directory that is not a dataset never is."""
    from tqdm import tqdm

    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    tok = load_tokenizer(tokenizer)
    dtype = _resolve_dtype(dtype, tok.vocab_size)
    out_dir = Path(out_dir)
    if check_out_dir(out_dir) and not overwrite:
        raise OutputExistsError(f"{out_dir} already holds a prepared dataset: pass --overwrite to replace it")
    default = inputs is None
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    files = default_corpus_files() if default else expand_inputs(inputs)
    sources = [sysconfig.get_paths()["stdlib"]] if default else [str(p) for p in inputs]

    def documents() -> Iterator[str]:
        docs = iter_file_documents(files, text_field, sources)
        return split_pieces(docs, piece_chars) if piece_chars else docs

    n_docs = n_chars = 0
    for text in documents():
        n_docs, n_chars = n_docs + 1, n_chars + len(text)
    if piece_chars is None and n_docs < MIN_PIECES:  # pieces of PIECE_CHARS, or smaller: MIN_PIECES in all
        piece_chars = max(MIN_PIECE_CHARS, min(PIECE_CHARS, n_chars // MIN_PIECES))
        n_docs = sum(1 for _ in documents())
    n_val = 0
    if val_fraction > 0 and n_docs >= 2:
        n_val = min(max(1, round(n_docs * val_fraction)), n_docs - 1)
    is_val = np.zeros(n_docs, bool)
    is_val[np.random.default_rng(seed).permutation(n_docs)[:n_val]] = True

    bos = np.asarray([tok.bos_id] if tok.bos_id is not None else [], np.int64)
    eos = np.asarray([tok.eos_id] if tok.eos_id is not None else [], np.int64)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = create_temp(out_dir.parent, f".{out_dir.name}.tmp-", directory=True)
    writers = {split: _SplitWriter(tmp, split, dtype, shard_tokens) for split in SPLITS}
    try:
        doc = 0
        with tqdm(total=n_docs, unit="doc", desc="prepare", disable=not progress, dynamic_ncols=True) as bar:
            n_bytes = n_tokens = 0
            for texts in _batched(documents()):
                for ids in tok.encode_batch(texts):
                    if len(ids) and int(ids.max()) >= tok.vocab_size:
                        raise ValueError(f"token id {int(ids.max())} outside the vocabulary ({tok.vocab_size})")
                    ids = np.concatenate([bos, ids, eos]) if len(bos) or len(eos) else ids
                    writers["val" if is_val[doc] else "train"].add(ids)
                    n_tokens += len(ids)
                    doc += 1
                n_bytes += sum(len(t.encode("utf-8", "surrogateescape")) for t in texts)
                bar.update(len(texts))
                bar.set_postfix(MB=f"{n_bytes / 1e6:.1f}", tokens=f"{n_tokens / 1e6:.1f}M", refresh=False)
        if doc != n_docs:
            raise RuntimeError(f"the inputs changed while reading them ({n_docs} documents, then {doc})")
        tok_file = tokenizer_spec_file(tokenizer)
        tok_name = "bytes" if tok_file is None else tok_file.name
        if tok_name == "meta.json" or tok_name.startswith(tuple(f"{split}-" for split in SPLITS)):
            tok_name = "tokenizer" + tok_file.suffix  # never clobber the dataset's own files
        if tok_file is not None:
            shutil.copyfile(tok_file, tmp / tok_name)
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "tokenizer": tok_name,
            "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "dtype": dtype,
            "splits": {split: w.finish() for split, w in writers.items()},
            "sources": sources,
            "default_corpus": default,
            "files": len(files),
            "text_field": text_field,
            "seed": seed,
            "val_fraction": val_fraction,
            "piece_chars": piece_chars,
            "shard_tokens": shard_tokens,
        }
        if default:
            meta["python"] = sys.version.split()[0]
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        install_dataset(tmp, out_dir)
    except BaseException:
        for w in writers.values():
            w.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def load_meta(data_dir: str | Path) -> dict:
    """The meta of a prepared dataset, checked (format, dtype, splits and their shard files)."""
    data_dir = Path(data_dir)
    path = data_dir / "meta.json"
    if not path.exists():
        what = "no such directory" if not data_dir.exists() else "no meta.json in"
        raise FileNotFoundError(f"{what} {data_dir}: prepare a dataset first with `griffin prepare` "
                                "(griffin.data.prepare)")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} is not a {FORMAT} v{FORMAT_VERSION} dataset "
                         f"(format {meta.get('format')!r}, version {meta.get('version')!r})")
    missing = [k for k in ("tokenizer", "vocab_size", "dtype", "splits") if k not in meta]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}")
    if meta["dtype"] not in DTYPES:
        raise ValueError(f"{path}: unknown dtype {meta['dtype']!r}")
    for split, info in meta["splits"].items():
        for shard in info["shards"]:
            for name in (shard, shard.replace(".bin", ".idx.npy")):
                if not (data_dir / name).exists():
                    raise FileNotFoundError(f"{data_dir / name} (split {split!r}) is missing")
    return meta


def load_dataset_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The tokenizer a dataset was prepared with (its copy inside ``data_dir``)."""
    spec = load_meta(data_dir)["tokenizer"]
    return load_tokenizer(spec if spec == "bytes" else Path(data_dir) / spec)
