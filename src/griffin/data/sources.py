"""Reading documents: text files, JSONL, parquet and directories of them, and the embedded default corpus."""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

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


def _describe(inputs: Sequence[str | Path]) -> str:
    names = [str(p) for p in inputs]
    return ", ".join(names) if len(names) <= 3 else ", ".join(names[:3]) + f", ... ({len(names)} inputs)"


def expand_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    """The files named by ``inputs``: files as given, directories walked (sorted, hidden entries skipped, only
    ``TEXT_SUFFIXES``). Missing paths raise FileNotFoundError."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            if path.name == "meta.json" and any(path.parent.glob("*-00000.bin")):
                raise ValueError(f"{path} is the meta file of a dataset prepared by `griffin prepare`, not text: "
                                 f"give its directory, {path.parent}")
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
    """The non-empty documents of ``inputs`` (files or directories, see ``expand_inputs``), in a deterministic order.

    ``.jsonl``/``.json``: one JSON object per line, text in ``text_field``; ``.parquet``: column ``text_field``;
    any other file is one document, read as UTF-8 (undecodable bytes kept as surrogate escapes).
    Raises ValueError when there is not a single non-empty document."""
    yield from iter_file_documents(expand_inputs(inputs), text_field, inputs)


def iter_file_documents(files: Sequence[Path], text_field: str, inputs: Sequence[str | Path]) -> Iterator[str]:
    """The non-empty documents of already expanded ``files`` (see ``iter_documents``); ``inputs`` name them in the
    error raised when there is none."""
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


def valid_utf8(text: str) -> str:
    """``text`` with surrogate escapes (undecodable bytes) replaced by U+FFFD, for tokenizers that need valid UTF-8."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def split_pieces(texts: Iterable[str], piece_chars: int) -> Iterator[str]:
    """Each text cut into documents of at most about ``piece_chars`` characters: at the last blank line of a piece
    if it has one in its second half, else at its last line end, else where the piece ends (a single long text,
    such as a book in one file, becomes documents, so that a validation split can hold some of them)."""
    if piece_chars < 1:
        raise ValueError(f"piece_chars={piece_chars} must be positive")
    for text in texts:
        start = 0
        while len(text) - start > piece_chars:
            end = start + piece_chars
            blank = text.rfind("\n\n", start + piece_chars // 2, end - 1)
            line = text.rfind("\n", start + piece_chars // 2, end)
            end = blank + 2 if blank >= 0 else line + 1 if line >= 0 else end
            yield text[start:end]
            start = end
        if start < len(text):
            yield text[start:]

