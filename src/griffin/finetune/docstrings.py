"""Instruction pairs made from Python source files, for fine-tuning without a download (docs/finetuning.md): the
Python standard library's source by default (:func:`griffin.data.default_corpus_files`), as for ``griffin train``.

Every function (``def`` or ``async def``, methods and nested functions too) is parsed with :mod:`ast`; its source
(decorators included, dedented, its docstring removed, at most ``max_chars`` characters: longer functions are
skipped) is the prompt, after a question that depends on the kind of pair:

=============  ===========================================  ===============================================
kind           question                                     reply
=============  ===========================================  ===============================================
``docstring``  Write the docstring of this function:        the docstring's summary: its first paragraph on
                                                            one line (functions with a docstring only)
``name``       What is the name of this function?           the function's name
``params``     List the parameters of this function:        the parameter names in order, comma-separated
                                                            (``*args``, ``**kwargs`` with their stars;
                                                            ``(none)`` for none)
=============  ===========================================  ===============================================

The docstring kind is the real task (and a hard one for a small model); the name and the parameters are in the
prompt, to be found and copied, so that even a model of a million parameters learns them in minutes and exact match
moves. The docstring is removed from the prompt of every kind (a function whose docstring shares a line with other
code is skipped; one whose body is only its docstring gets ``...`` in its place).

Each pair is a chat, ``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}`` (``fmt="chat"``, rendered
by the model's chat template in fine-tuning), or ``{"prompt": ..., "completion": ...}`` (``fmt="pair"``), with a
``source`` key (``file:line``, which the fine-tuning data reader ignores). The output is deterministic: files in
sorted order, pairs whose prompt was seen before dropped, then shuffled by a ``random.Random(seed)`` and cut to
``limit``.

    python -m griffin.finetune.docstrings --out pairs.jsonl                       # docstring pairs, every function
    python -m griffin.finetune.docstrings --kind name,params --max-chars 400 --limit 4000 --out easy.jsonl
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import random
import re
import sys
import tokenize
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from griffin.io import atomic_write, check_new_output

KINDS = ("docstring", "name", "params")
FORMATS = ("chat", "pair")
QUESTIONS = {
    "docstring": "Write the docstring of this function:",
    "name": "What is the name of this function?",
    "params": "List the parameters of this function:",
}
MAX_CHARS = 1000
MAX_SUMMARY_CHARS = 200  # a docstring summary longer than this is no one-line summary: the function is skipped


@dataclass
class Function:
    """A function found in a file: its source without its docstring, its name, parameters and docstring summary
    (None: it has no docstring), and ``file:line``."""

    source: str
    name: str
    params: list[str]
    summary: str | None
    where: str


def read_source(path: Path) -> str | None:
    """The text of a Python file (its coding cookie honoured), None if it cannot be decoded."""
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (SyntaxError, UnicodeDecodeError):  # a bad coding cookie, bytes that are not text
        return None


def _summary(docstring: str) -> str:
    """A docstring's first paragraph on one line."""
    paragraph = inspect.cleandoc(docstring).strip().split("\n\n", 1)[0]
    return re.sub(r"\s+", " ", paragraph).strip()


def _parameters(args: ast.arguments) -> list[str]:
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    if args.vararg is not None:
        names.append("*" + args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg is not None:
        names.append("**" + args.kwarg.arg)
    return names


def _strip_docstring(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str] | None:
    """The function's lines (0-based, the file's) with its docstring's lines removed (``...`` where it was the whole
    body); None if the docstring shares a line with other code."""
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
    body = list(range(start, node.end_lineno))
    if ast.get_docstring(node, clean=False) is None:
        return [lines[i] for i in body]
    doc = node.body[0]
    first, last = doc.lineno - 1, doc.end_lineno - 1
    if lines[first].encode()[:doc.col_offset].strip():
        return None  # code before the docstring on its line (def f(): "doc")
    rest = lines[last].encode()[doc.end_col_offset:].decode(errors="replace").strip()
    if rest and not rest.startswith("#"):
        return None  # code after it (a semicolon)
    kept = [lines[i] for i in body if not first <= i <= last]
    if len(node.body) == 1:  # the docstring was the whole body
        at = first - start
        kept.insert(at, lines[first][:doc.col_offset] + "...")
    return kept


def _dedent(lines: list[str], indent: int) -> str:
    """The lines without the ``def``'s indentation (lines with less, inside a multi-line string, are kept as they
    are)."""
    return "\n".join(line[indent:] if not line[:indent].strip() else line for line in lines).rstrip() + "\n"


def functions_in(path: str | Path, name: str | None = None) -> list[Function] | None:
    """The functions of the Python file ``path`` in the order of their ``def``s (``name``: how ``where`` names the
    file; default its path); None for a file that does not decode or parse as Python 3."""
    path = Path(path)
    text = read_source(path)
    if text is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarning: invalid escape sequences in old code
            tree = ast.parse(text, filename=str(path))
    except (SyntaxError, ValueError):  # not Python 3, or a NUL byte
        return None
    lines = text.split("\n")  # ast counts lines at \n only (str.splitlines would also split at \f, \x1c, ...)
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found = []
    for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
        kept = _strip_docstring(lines, node)
        if kept is None:
            continue
        indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
        source = _dedent(kept, indent)
        try:  # what is left must still be the function, without a docstring
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                parsed = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        if not parsed.body or ast.get_docstring(parsed.body[0]) is not None:
            continue
        docstring = ast.get_docstring(node, clean=False)
        summary = _summary(docstring) if docstring is not None else None
        found.append(Function(source, node.name, _parameters(node.args), summary or None,
                              f"{name or path}:{node.lineno}"))
    return found


def reply(function: Function, kind: str) -> str | None:
    """The reply of a pair of ``kind`` about ``function`` (None: the function makes no such pair)."""
    if kind == "docstring":
        if function.summary is None or len(function.summary) > MAX_SUMMARY_CHARS:
            return None
        return function.summary
    if kind == "name":
        return function.name
    if kind == "params":
        return ", ".join(function.params) or "(none)"
    raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")


def record(prompt: str, completion: str, fmt: str, source: str) -> dict[str, Any]:
    """One JSON line: a chat of a user turn and the assistant's reply, or a prompt/completion pair."""
    if fmt == "chat":
        return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
                "source": source}
    if fmt == "pair":
        return {"prompt": prompt + "\n", "completion": completion, "source": source}
    raise ValueError(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")


def python_files(inputs: Sequence[str | Path] | None) -> list[tuple[Path, str]]:
    """The ``.py`` files of ``inputs`` (files, or directories searched recursively), each with the name it goes by
    in ``source`` (relative to its directory), sorted; no inputs: the standard library's (the embedded corpus)."""
    from griffin.data import default_corpus_files

    if not inputs:
        files = default_corpus_files()
        root = Path(files[0]).parent
        while not all(root in f.parents for f in files):
            root = root.parent
        return [(f, f.relative_to(root).as_posix()) for f in files]
    found = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found += [(f, f.relative_to(path).as_posix()) for f in sorted(path.rglob("*.py")) if f.is_file()]
        elif path.is_file():
            found.append((path, path.name))
        else:
            raise FileNotFoundError(f"no file or directory at {path}")
    return sorted(found, key=lambda item: str(item[0]))


def make_pairs(inputs: Sequence[str | Path] | None = None, kinds: Sequence[str] = ("docstring",), *,
               max_chars: int = MAX_CHARS, limit: int | None = None, seed: int = 0,
               fmt: str = "chat") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The pairs of ``kinds`` from the functions of ``inputs`` (default: the standard library), and a summary
    (files read, functions seen, pairs per kind). Functions whose source is longer than ``max_chars`` characters
    are skipped; a prompt seen before is dropped (the same function in two files); the rest are shuffled by
    ``random.Random(seed)`` and the first ``limit`` kept (None: all)."""
    kinds = list(dict.fromkeys(kinds))
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    if not kinds:
        raise ValueError(f"no kind of pair given: one or more of {', '.join(KINDS)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")
    if max_chars < 1:
        raise ValueError(f"max_chars={max_chars} must be positive")
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit} must be >= 0")
    files = python_files(inputs)
    seen: set[tuple[str, str]] = set()
    pairs: list[tuple[str, dict[str, Any]]] = []
    functions = too_long = unread = 0
    for path, name in files:
        found = functions_in(path, name)
        if found is None:
            unread += 1
            continue
        for function in found:
            functions += 1
            if len(function.source) > max_chars:
                too_long += 1
                continue
            for kind in kinds:
                completion = reply(function, kind)
                if completion is None:
                    continue
                prompt = f"{QUESTIONS[kind]}\n{function.source.rstrip()}"
                if (kind, prompt) in seen:
                    continue
                seen.add((kind, prompt))
                pairs.append((kind, record(prompt, completion, fmt, function.where)))
    random.Random(seed).shuffle(pairs)
    if limit is not None:
        pairs = pairs[:limit]
    counts = Counter(kind for kind, _ in pairs)
    summary = {"files": len(files), "unreadable": unread, "functions": functions, "too_long": too_long,
               "pairs": len(pairs), "kinds": {kind: counts[kind] for kind in kinds}}
    return [r for _, r in pairs], summary


def write_jsonl(path: str | Path, records: Sequence[dict[str, Any]]) -> None:
    """One JSON object a line, UTF-8, written atomically."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m griffin.finetune.docstrings",
        description="Make instruction pairs (JSONL) from the functions of Python files, for griffin finetune: "
                    "a function's source without its docstring, and its docstring's summary, name or parameters.")
    p.add_argument("inputs", nargs="*", help=".py files or directories (none: the Python standard library's source)")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("--kind", action="append", default=None,
                   help=f"the pairs to make: {', '.join(KINDS)}, comma-separated or repeated (default: docstring)")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="chat",
                   help="chat: {\"messages\": [user, assistant]}; pair: {\"prompt\", \"completion\"} (default: chat)")
    p.add_argument("--max-chars", type=int, default=MAX_CHARS,
                   help=f"skip functions whose source (without the docstring) is longer (default: {MAX_CHARS})")
    p.add_argument("--limit", type=int, default=None, help="keep this many pairs, after the shuffle (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle (default: 0)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output (otherwise refused)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    kinds = [k.strip() for item in args.kind or ["docstring"] for k in item.split(",") if k.strip()]
    try:
        check_new_output(args.out, args.overwrite)
        records, summary = make_pairs(args.inputs, kinds, max_chars=args.max_chars, limit=args.limit,
                                      seed=args.seed, fmt=args.fmt)
        if not records:
            raise ValueError("no pair made: no function with what these kinds need (a docstring for 'docstring') "
                             f"within --max-chars {args.max_chars}")
        write_jsonl(args.out, records)
    except (ValueError, OSError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    per_kind = ", ".join(f"{kind} {n:,}" for kind, n in summary["kinds"].items())
    print(f"wrote {summary['pairs']:,} pairs ({per_kind}) to {args.out}: {summary['functions']:,} functions in "
          f"{summary['files']:,} files, {summary['too_long']:,} longer than {args.max_chars} characters skipped"
          + (f", {summary['unreadable']} files unreadable" if summary["unreadable"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
