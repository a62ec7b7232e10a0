"""Training data: read documents, tokenize them into pre-tokenized shards, and stream packed batches.

``prepare`` turns text files, JSONL, parquet or the embedded default corpus (the Python standard library's own
source) into a dataset directory::

    out_dir/meta.json                   format, tokenizer, vocabulary, dtype, per split: tokens, documents, shards
    out_dir/train-00000.bin             raw little-endian uint16/uint32 token ids (np.memmap)
    out_dir/train-00000.idx.npy         int64 offsets of the document starts within that shard
    out_dir/val-00000.bin, ...
    out_dir/tokenizer.json              a copy of the tokenizer file, same name (none for the byte-level tokenizer)

Each split is one token stream: documents are concatenated (with ``bos``/``eos`` when the tokenizer has them) and
shards are cut every ``shard_tokens`` tokens, so a document may continue into the next shard. ``PackedLoader`` cuts
the stream into windows of ``seq_len + 1`` tokens and yields ``Batch`` es with each token's position in its document
(0 at every document start) and targets masked (-100) where the next token starts a new document.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from griffin.ops.cross_entropy import IGNORE_INDEX

FORMAT = "griffin-tokens"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}

TEXT_SUFFIXES = frozenset({
    ".txt", ".text", ".md", ".markdown", ".rst", ".tex", ".org", ".html", ".htm", ".xml", ".csv", ".tsv",
    ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java", ".js", ".ts", ".sh",
    ".toml", ".yaml", ".yml", ".cfg", ".ini",
    ".jsonl", ".json", ".parquet",
})  # fmt: skip
JSON_SUFFIXES = (".jsonl", ".json")

# Directories of the standard library left out of the default corpus: installed packages, test suites, IDLE and the
# turtle demos, the build configuration, bytecode caches.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "turtledemo",
                               "__pycache__"})


# ----------------------------------------------------------------------------------------------------------------------
# reading documents


def _describe(inputs: Sequence[str | Path]) -> str:
    names = [str(p) for p in inputs]
    return ", ".join(names) if len(names) <= 3 else ", ".join(names[:3]) + f", ... ({len(names)} inputs)"


def _expand(inputs: Sequence[str | Path]) -> list[Path]:
    """The files named by ``inputs``: files as given, directories walked (sorted, hidden entries skipped, only
    ``TEXT_SUFFIXES``). Missing paths raise FileNotFoundError."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                found += [Path(root) / n for n in names
                          if not n.startswith(".") and Path(n).suffix.lower() in TEXT_SUFFIXES]
            files += sorted(found)
        else:
            raise FileNotFoundError(f"no such file or directory: {path}")
    return files


def _read_json_lines(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not a JSON object ({e.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(f"{path}:{line_no}: no field {text_field!r} (use text_field= to pick another)")
            text = record[text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise ValueError(f"{path}:{line_no}: field {text_field!r} is {type(text).__name__}, not a string")
            yield text


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
    file = pq.ParquetFile(path)
    if text_field not in file.schema_arrow.names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {', '.join(file.schema_arrow.names)})")
    for batch in file.iter_batches(columns=[text_field], batch_size=1024):
        yield from (t for t in batch.column(0).to_pylist() if t is not None)


def _read_file(path: Path, text_field: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        yield from _read_json_lines(path, text_field)
    elif suffix == ".parquet":
        yield from _read_parquet(path, text_field)
    else:
        yield path.read_bytes().decode("utf-8", "surrogateescape")


def iter_documents(inputs: Sequence[str | Path], *, text_field: str = "text") -> Iterator[str]:
    """The non-empty documents of ``inputs`` (files or directories, see ``_expand``), in a deterministic order.

    ``.jsonl``/``.json``: one JSON object per line, text in ``text_field``; ``.parquet``: column ``text_field``;
    any other file is one document, read as UTF-8 (undecodable bytes kept as surrogate escapes).
    Raises ValueError when there is not a single non-empty document."""
    yield from _documents(_expand(inputs), text_field, inputs)


def _documents(files: Sequence[Path], text_field: str, inputs: Sequence[str | Path]) -> Iterator[str]:
    found = False
    for path in files:
        for text in _read_file(path, text_field):
            if text:
                found = True
                yield text
    if not found:
        raise ValueError(f"no documents (or only empty ones) in {_describe(inputs)}")


def default_corpus_files() -> list[Path]:
    """The embedded default corpus: every ``.py`` file of the standard library of the running interpreter
    (``sysconfig.get_paths()["stdlib"]``), sorted, so it exists on any machine without a download.

    Left out: installed packages (``site-packages``, ``dist-packages``), test suites (``test``, ``tests``,
    ``idle_test`` directories, e.g. ``lib2to3/tests``), ``idlelib``, ``turtledemo``, the build configuration
    (``config-*``), the machine-generated ``_sysconfigdata*`` files and hidden entries. Everything else (``os.py``,
    ``asyncio/``, ``email/``, ``encodings/``, ...) is in: about 650 files, 11 MB, for CPython 3.11."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _STDLIB_SKIP_DIRS and not d.startswith((".", "config-"))]
        files += [Path(dirpath) / n for n in names if n.endswith(".py") and not n.startswith((".", "_sysconfigdata"))]
    if not files:
        raise FileNotFoundError(f"no .py sources in the standard library at {root} (this Python ships compiled "
                                "files only); pass input files to prepare instead")
    return sorted(files)


def _valid_utf8(text: str) -> str:
    """``text`` with surrogate escapes (undecodable bytes) replaced by U+FFFD, for tokenizers that need valid UTF-8."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


# ----------------------------------------------------------------------------------------------------------------------
# prepare: tokenize into shards


def _tokenizer_file(spec: str | Path) -> Path | None:
    """The file behind a tokenizer spec (resolved like ``load_tokenizer``), None for ``bytes``."""
    if str(spec) == "bytes":
        return None
    path = Path(spec)
    if path.is_dir():
        path = next(p for p in (path / "tokenizer.json", path / "tokenizer.model") if p.exists())
    return path


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


def _encoder(tok: Any):
    """A function from a list of texts to a list of int arrays, batched where the tokenizer allows it."""
    from griffin.data.tokenizer import ByteTokenizer, HFTokenizer

    if isinstance(tok, ByteTokenizer):
        return lambda texts: [np.frombuffer(t.encode("utf-8", "surrogateescape"), np.uint8) for t in texts]
    if isinstance(tok, HFTokenizer):
        tok.tok.encode_special_tokens = True  # "<eos>" written in a document is text, not the control token
        encode_batch = getattr(tok.tok, "encode_batch_fast", tok.tok.encode_batch)
        return lambda texts: [np.asarray(e.ids, np.int64)
                              for e in encode_batch([_valid_utf8(t) for t in texts], add_special_tokens=False)]
    return lambda texts: [np.asarray(tok.encode(_valid_utf8(t)), np.int64) for t in texts]


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


def _check_out_dir(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds something (then it must be an earlier dataset, which ``prepare`` replaces)."""
    if not out_dir.exists():
        return False
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if not any(out_dir.iterdir()):
        return False
    if not (out_dir / "meta.json").exists():
        raise FileExistsError(f"{out_dir} exists and is not a prepared dataset; pick an empty or new directory")
    return True


def _install(tmp: Path, out_dir: Path) -> None:
    """Move the finished ``tmp`` directory to ``out_dir``, replacing an earlier dataset there."""
    if not _check_out_dir(out_dir):
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.replace(out_dir, old / "data")
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        os.replace(old / "data", out_dir)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def prepare(inputs: Sequence[str | Path] | None, out_dir: str | Path, tokenizer: str = "bytes", *,
            val_fraction: float = 0.01, seed: int = 0, text_field: str = "text", shard_tokens: int = 1 << 27,
            dtype: str | None = None, progress: bool = True) -> dict:
    """Tokenize ``inputs`` (None: the default corpus, see ``default_corpus_files``) into a dataset in ``out_dir``
    and return its meta (also written to ``out_dir/meta.json``).

    Documents go to the val split by a permutation seeded with ``seed`` (``round(n * val_fraction)`` of them, at
    least one when ``val_fraction > 0`` and there are two or more, never all). The inputs are read twice (count, then
    tokenize), and the dataset is built in a temporary directory that replaces ``out_dir`` only once complete."""
    from tqdm import tqdm

    from griffin.data.tokenizer import load_tokenizer

    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    tok = load_tokenizer(tokenizer)
    dtype = _resolve_dtype(dtype, tok.vocab_size)
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    default = inputs is None
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    files = default_corpus_files() if default else _expand(inputs)
    sources = [sysconfig.get_paths()["stdlib"]] if default else [str(p) for p in inputs]

    n_docs = sum(1 for _ in _documents(files, text_field, sources))
    n_val = 0
    if val_fraction > 0 and n_docs >= 2:
        n_val = min(max(1, round(n_docs * val_fraction)), n_docs - 1)
    is_val = np.zeros(n_docs, bool)
    is_val[np.random.default_rng(seed).permutation(n_docs)[:n_val]] = True

    bos = np.asarray([tok.bos_id] if tok.bos_id is not None else [], np.int64)
    eos = np.asarray([tok.eos_id] if tok.eos_id is not None else [], np.int64)
    encode = _encoder(tok)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    writers = {split: _SplitWriter(tmp, split, dtype, shard_tokens) for split in SPLITS}
    try:
        doc = 0
        with tqdm(total=n_docs, unit="doc", desc="prepare", disable=not progress, dynamic_ncols=True) as bar:
            n_bytes = n_tokens = 0
            for texts in _batched(_documents(files, text_field, sources)):
                for ids in encode(texts):
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
        tok_file = _tokenizer_file(tokenizer)
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
            "shard_tokens": shard_tokens,
        }
        if default:
            meta["python"] = sys.version.split()[0]
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        _install(tmp, out_dir)
    except BaseException:
        for w in writers.values():
            w.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


# ----------------------------------------------------------------------------------------------------------------------
# reading a prepared dataset


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


def load_dataset_tokenizer(data_dir: str | Path):
    """The tokenizer a dataset was prepared with (its copy inside ``data_dir``)."""
    from griffin.data.tokenizer import load_tokenizer

    spec = load_meta(data_dir)["tokenizer"]
    return load_tokenizer(spec if spec == "bytes" else Path(data_dir) / spec)


class _SplitTokens:
    """A split's shards as one memory-mapped token stream, with the global document starts."""

    def __init__(self, data_dir: str | Path, meta: dict, split: str) -> None:
        data_dir = Path(data_dir)
        if split not in meta["splits"]:
            raise ValueError(f"{data_dir} has no split {split!r} (splits: {', '.join(meta['splits'])})")
        info = meta["splits"][split]
        dtype = DTYPES[meta["dtype"]]
        self.shards = [np.memmap(data_dir / s, dtype=dtype, mode="r") for s in info["shards"]]
        self.shard_idx = [np.load(data_dir / s.replace(".bin", ".idx.npy"), allow_pickle=False) for s in info["shards"]]
        sizes = np.array([len(s) for s in self.shards], np.int64)
        self.shard_starts = np.cumsum(sizes) - sizes
        self.num_tokens = int(sizes.sum())
        self.doc_starts = np.concatenate([np.zeros(0, np.int64)]
                                         + [i + s for i, s in zip(self.shard_idx, self.shard_starts, strict=True)])
        if self.num_tokens != info["tokens"] or len(self.doc_starts) != info["documents"]:
            raise ValueError(f"split {split!r} of {data_dir}: {self.num_tokens} tokens and {len(self.doc_starts)} "
                             f"documents on disk, meta.json says {info['tokens']} and {info['documents']}")

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64, across shard boundaries."""
        out = np.empty(length, np.int64)
        i = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            offset = start + filled - int(self.shard_starts[i])
            n = min(length - filled, len(self.shards[i]) - offset)
            out[filled:filled + n] = self.shards[i][offset:offset + n]
            filled += n
            i += 1
        return out

    def positions(self, index: np.ndarray) -> np.ndarray:
        """Each token's position in its document, for an array of token indices."""
        doc = np.searchsorted(self.doc_starts, index, side="right") - 1
        return index - self.doc_starts[doc]


class Batch(NamedTuple):
    """Token ids, positions in their documents and next-token targets (-100: not scored), each (batch, seq_len)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor


class PackedLoader:
    """Endless batches of packed windows from a prepared split.

    The split is one token stream cut into ``num_windows = (tokens - 1) // seq_len`` windows of ``seq_len + 1``
    tokens at stride ``seq_len``. Every epoch visits each window once, in an order shuffled by
    ``np.random.default_rng([seed, epoch])`` (in order when ``shuffle=False``); rank ``r`` of ``world_size`` takes
    windows ``r, r + world_size, ...`` of that order, all ranks the same number (``num_windows // world_size``; the
    few windows left over differ each epoch when shuffling). Batches run on across epoch boundaries.

    The state (``state_dict``) is the same on every rank, so one rank's state resumes all of them."""

    def __init__(self, data_dir: str | Path, split: str, seq_len: int, batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, rank: int = 0, world_size: int = 1) -> None:
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.data_dir, self.split = Path(data_dir), split
        self.seq_len, self.batch_size, self.seed, self.shuffle = seq_len, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.meta = load_meta(data_dir)
        self.data = _SplitTokens(data_dir, self.meta, split)
        n = self.data.num_tokens
        if n < seq_len + 1:
            raise ValueError(f"split {split!r} of {data_dir} has {n} tokens; seq_len {seq_len} needs at least "
                             f"{seq_len + 1} (seq_len + 1)")
        self.num_windows = (n - 1) // seq_len
        if self.num_windows < world_size:
            raise ValueError(f"split {split!r} of {data_dir} has {n} tokens, {self.num_windows} windows of "
                             f"seq_len {seq_len}; world_size {world_size} needs at least {world_size * seq_len + 1} "
                             "tokens")
        self.windows_per_rank = self.num_windows // world_size
        self._epoch = 0
        self._index = 0  # next window of this epoch's order
        self._order_epoch = -1
        self._order = np.zeros(0, np.int64)

    @property
    def tokens_per_epoch(self) -> int:
        """Input tokens of one epoch, summed over all ranks."""
        return self.windows_per_rank * self.world_size * self.seq_len

    @property
    def epoch(self) -> float:
        """Progress in epochs: the epoch number plus the fraction of it already done."""
        return self._epoch + self._index / self.windows_per_rank

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            else:
                order = np.arange(self.num_windows)
            self._order = order[: self.windows_per_rank * self.world_size][self.rank :: self.world_size]
            self._order_epoch = epoch
        return self._order

    def next_windows(self) -> np.ndarray:
        """The indices of the next ``batch_size`` windows (advancing the loader)."""
        out = []
        need = self.batch_size
        while need:
            take = min(need, self.windows_per_rank - self._index)
            out.append(self._epoch_order(self._epoch)[self._index : self._index + take])
            self._index += take
            need -= take
            if self._index == self.windows_per_rank:
                self._epoch, self._index = self._epoch + 1, 0
        return np.concatenate(out)

    def gather(self, windows: np.ndarray) -> Batch:
        """The batch of the given windows."""
        starts = np.asarray(windows, np.int64) * self.seq_len
        tokens = np.stack([self.data.read(int(s), self.seq_len + 1) for s in starts])
        positions = self.data.positions(starts[:, None] + np.arange(self.seq_len + 1))
        targets = np.where(positions[:, 1:] == 0, IGNORE_INDEX, tokens[:, 1:])
        return Batch(torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])),
                     torch.from_numpy(np.ascontiguousarray(positions[:, :-1])),
                     torch.from_numpy(np.ascontiguousarray(targets)))

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> Batch:
        return self.gather(self.next_windows())

    def _fingerprint(self) -> dict:
        return {"tokens": self.data.num_tokens, "documents": len(self.data.doc_starts),
                "vocab_size": self.meta["vocab_size"]}

    def state_dict(self) -> dict:
        """Where the loader is, as plain JSON-serialisable values."""
        return {"split": self.split, "epoch": self._epoch, "index": self._index, "seed": self.seed,
                "seq_len": self.seq_len, "batch_size": self.batch_size, "shuffle": self.shuffle,
                "world_size": self.world_size, "dataset": self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``: the next batches are those the saved loader would have produced."""
        mine = self.state_dict()
        keys = ("split", "seed", "seq_len", "batch_size", "shuffle", "world_size", "dataset")
        diff = [f"{k}: {state.get(k)!r} in the state, {mine[k]!r} here" for k in keys if state.get(k) != mine[k]]
        if diff:
            raise ValueError("loader state does not match this loader: " + "; ".join(diff))
        if not 0 <= state["index"] < self.windows_per_rank or state["epoch"] < 0:
            raise ValueError(f"loader state at epoch {state['epoch']}, window {state['index']} is out of range "
                             f"({self.windows_per_rank} windows per epoch)")
        self._epoch, self._index = int(state["epoch"]), int(state["index"])


def eval_batches(data_dir: str | Path, split: str, seq_len: int, batch_size: int,
                 max_batches: int | None = None) -> list[Batch]:
    """Fixed batches of the split's windows in order (the last one may be smaller), at most ``max_batches``."""
    loader = PackedLoader(data_dir, split, seq_len, batch_size, shuffle=False)
    n_batches = math.ceil(loader.num_windows / batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    windows = np.arange(loader.num_windows)
    return [loader.gather(windows[i * batch_size : (i + 1) * batch_size]) for i in range(n_batches)]


def _target_counts(data: _SplitTokens, vocab_size: int, chunk: int = 1 << 24) -> np.ndarray:
    """Counts of each token id over the split's targets: every token that does not start a document."""
    counts = np.zeros(vocab_size, np.int64)
    for shard, idx in zip(data.shards, data.shard_idx, strict=True):
        for i in range(0, len(shard), chunk):
            counts += np.bincount(shard[i : i + chunk], minlength=vocab_size)[:vocab_size]
        counts -= np.bincount(shard[idx], minlength=vocab_size)[:vocab_size]
    return counts


def unigram_loss(data_dir: str | Path) -> float:
    """The unigram baseline in nats/token: cross-entropy of the val targets under the train targets' frequencies,
    add-one smoothed over the vocabulary. Targets are the tokens the loader scores: all but document starts."""
    meta = load_meta(data_dir)
    vocab_size = meta["vocab_size"]
    train = _target_counts(_SplitTokens(data_dir, meta, "train"), vocab_size)
    val = _target_counts(_SplitTokens(data_dir, meta, "val"), vocab_size)
    if val.sum() == 0:
        raise ValueError(f"the val split of {data_dir} has no targets (prepare with val_fraction > 0)")
    log_p = np.log(train + 1.0) - np.log(train.sum() + vocab_size)
    return float(-(val * log_p).sum() / val.sum())
