"""The instruction pairs of ``python -m griffin.finetune.docstrings`` (docs/finetuning.md): functions parsed from
Python files, their docstrings out of the prompts, records the fine-tuning reader takes, the same file every time."""

from __future__ import annotations

import ast
import json
import sysconfig
from pathlib import Path

import pytest

from griffin.data.chat import ChatTemplate
from griffin.data.examples import ExampleEncoder, read_records, record_kind
from griffin.data.tokenizer import load_tokenizer
from griffin.finetune.docstrings import QUESTIONS, functions_in, main, make_pairs

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FEW = [STDLIB / name for name in ("bisect.py", "colorsys.py", "json/decoder.py", "keyword.py", "operator.py")]

TRICKY = '''\
import functools


@functools.cache
def decorated(a, /, b, *args, c=1, **kwargs):
    """Add them up.

    More text that is not the summary.
    """
    return a + b + c


class Box:
    def method(self):
        """Only a docstring, café: nothing else."""

    async def fetch(self, key):
        \'\'\'Fetch a key
        over two lines.\'\'\'
        text = """
less indented text in a string
"""
        return text

    def one_line(self): "a docstring that shares the def's line"


def outer():
    """Outer's docstring."""
    def inner():
        """Inner's docstring."""
        return 1
    return inner


def nodoc():
    \f
    return 0
'''


def chat_parts(rec: dict) -> tuple[str, str]:
    user, assistant = rec["messages"]
    assert user["role"] == "user" and assistant["role"] == "assistant"
    return user["content"], assistant["content"]


def function_of(prompt: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The function a prompt shows, parsed (the question is its first line)."""
    body = ast.parse(prompt.split("\n", 1)[1]).body
    assert len(body) == 1 and isinstance(body[0], (ast.FunctionDef, ast.AsyncFunctionDef))
    return body[0]


@pytest.fixture
def tricky(tmp_path) -> Path:
    path = tmp_path / "tricky.py"
    path.write_text(TRICKY, encoding="utf-8")
    return path


def test_functions_of_a_file(tricky):
    found = {f.name: f for f in functions_in(tricky, "tricky.py")}
    assert "one_line" not in found  # its docstring shares the def's line: no prompt without it
    assert set(found) == {"decorated", "method", "fetch", "outer", "inner", "nodoc"}
    assert found["decorated"].params == ["a", "b", "*args", "c", "**kwargs"]
    assert found["decorated"].source.startswith("@functools.cache\ndef decorated(")
    assert found["decorated"].summary == "Add them up."
    assert found["fetch"].summary == "Fetch a key over two lines."
    assert found["method"].source == "def method(self):\n    ...\n"  # the docstring was the whole body
    assert found["method"].summary == "Only a docstring, café: nothing else."
    assert "\nless indented text in a string\n" in found["fetch"].source  # the string's own lines as they were
    line = TRICKY.split("\n").index("def nodoc():") + 1
    assert found["nodoc"].summary is None and found["nodoc"].where == f"tricky.py:{line}"
    assert "Inner's docstring" in found["outer"].source  # a nested function keeps its own docstring
    assert "Outer's docstring" not in found["outer"].source
    for function in found.values():
        tree = ast.parse(function.source)
        assert ast.get_docstring(tree.body[0]) is None


def test_pairs_of_each_kind(tricky):
    records, summary = make_pairs([tricky], ["docstring", "name", "params"])
    by_kind = {kind: {} for kind in QUESTIONS}
    for rec in records:
        prompt, reply = chat_parts(rec)
        kind = next(k for k, q in QUESTIONS.items() if prompt.startswith(q + "\n"))
        by_kind[kind][function_of(prompt).name] = reply
    assert by_kind["docstring"] == {"decorated": "Add them up.", "method": "Only a docstring, café: nothing else.",
                                    "fetch": "Fetch a key over two lines.", "outer": "Outer's docstring.",
                                    "inner": "Inner's docstring."}
    assert by_kind["name"] == {name: name for name in ("decorated", "method", "fetch", "outer", "inner", "nodoc")}
    assert by_kind["params"]["decorated"] == "a, b, *args, c, **kwargs"
    assert by_kind["params"]["nodoc"] == "(none)" and by_kind["params"]["fetch"] == "self, key"
    assert summary["kinds"] == {"docstring": 5, "name": 6, "params": 6} and summary["files"] == 1


def test_stdlib_records_are_well_formed_and_hold_no_docstring(tmp_path):
    records, summary = make_pairs(FEW, ["docstring", "name", "params"], max_chars=1000)
    assert summary["files"] == len(FEW) and summary["unreadable"] == 0
    assert summary["kinds"]["docstring"] >= 20 and summary["kinds"]["name"] > summary["kinds"]["docstring"]
    prompts = set()
    for rec in records:
        assert record_kind(rec, rec["source"]) == "chat"
        prompt, reply = chat_parts(rec)
        assert reply and "\n" not in reply and prompt not in prompts
        prompts.add(prompt)
        function = function_of(prompt)
        assert ast.get_docstring(function) is None
        assert len(prompt.split("\n", 1)[1]) <= 1000
        if prompt.startswith(QUESTIONS["docstring"]):
            assert reply not in prompt  # the summary is nowhere in what the model is shown
    # each docstring pair against the file it came from: the function had that docstring
    for rec in records[:40]:
        prompt, reply = chat_parts(rec)
        if not prompt.startswith(QUESTIONS["docstring"]):
            continue
        file, line = rec["source"].rsplit(":", 1)
        tree = ast.parse((STDLIB / file).read_text(encoding="utf-8"))
        node = next(n for n in ast.walk(tree) if getattr(n, "lineno", None) == int(line)
                    and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        assert node.name == function_of(prompt).name and ast.get_docstring(node).startswith(reply.split(" ")[0])
    # the fine-tuning reader takes them, with the loss on the replies only (the plain chat template, bytes)
    tokenizer = load_tokenizer("bytes")
    encode = ExampleEncoder(tokenizer, ChatTemplate(tokenizer))
    prompt, reply = chat_parts(records[0])
    example = encode(records[0], "here")
    assert bytes(i for i, m in zip(example.ids, example.mask, strict=True) if m).decode() == reply + "<|end|>\n"


def test_deterministic_limits_and_formats():
    a, _ = make_pairs(FEW, ["name"], seed=3)
    b, _ = make_pairs(FEW, ["name"], seed=3)
    c, _ = make_pairs(FEW, ["name"], seed=4)
    assert a == b and a != c and sorted(map(json.dumps, a)) == sorted(map(json.dumps, c))
    short, summary = make_pairs(FEW, ["name"], seed=3, max_chars=200, limit=5)
    assert len(short) == 5 and summary["too_long"] > 0
    assert all(len(chat_parts(r)[0]) <= 200 + len(QUESTIONS["name"]) + 1 for r in short)
    pairs, _ = make_pairs(FEW, ["params"], fmt="pair", limit=3)
    for rec in pairs:
        assert record_kind(rec, "here") == "completion" and rec["prompt"].endswith("\n")
    with pytest.raises(ValueError, match="unknown kind 'names'"):
        make_pairs(FEW, ["names"])


def test_command_line(tmp_path, capsys):
    out = tmp_path / "pairs.jsonl"
    assert main([str(STDLIB / "bisect.py"), str(STDLIB / "colorsys.py"), "--kind", "name,params", "--kind",
                 "docstring", "--limit", "12", "--out", str(out)]) == 0
    assert "wrote 12 pairs" in capsys.readouterr().out
    records = [r for _, r in read_records(out)]
    assert len(records) == 12 and {r["messages"][0]["content"].split("\n")[0] for r in records} <= set(
        QUESTIONS.values())
    first = out.read_bytes()
    assert main([str(STDLIB / "bisect.py"), "--out", str(out)]) == 2  # an existing output is kept
    assert "--overwrite" in capsys.readouterr().err and out.read_bytes() == first
    assert main([str(STDLIB / "bisect.py"), str(STDLIB / "colorsys.py"), "--kind", "name,params", "--kind",
                 "docstring", "--limit", "12", "--out", str(out), "--overwrite"]) == 0
    assert out.read_bytes() == first  # the same pairs again
    assert main([str(tmp_path / "missing.py"), "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "no file or directory" in capsys.readouterr().err
