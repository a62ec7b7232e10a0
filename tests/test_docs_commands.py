"""Every ``griffin`` command in README.md, docs/ and the parsers' examples parses as written, and the README's tour
runs as written, at tiny sizes (issue 35): a command that a doc gives and the code no longer takes fails here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from griffin.cli import EPILOG, EXAMPLES, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shell_blocks(text: str) -> list[str]:
    """The lines of the fenced code blocks of a Markdown text, backslash continuations joined."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line.removeprefix("$ "))  # a shell prompt before the command
    return re.sub(r"\\\n\s*", " ", "\n".join(lines)).splitlines()


def griffin_commands(line: str) -> list[list[str]]:
    """The ``griffin`` invocations of one shell line (after ``&&`` or ``;``, behind ``torchrun -m griffin.cli``),
    comments dropped, as argument lists without the program name."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # not shell (Python in the same block)
        return []
    found, current, start, previous = [], None, True, ""
    for word in [*words, "&&"]:
        if word in ("&&", ";", "||", "|", ">", ">>", "2>", "<"):
            if current is not None:
                found.append(current)
            current, start = None, True
        elif current is not None:
            current.append(word)
        elif (word == "griffin" and start) or (word == "griffin.cli" and previous == "-m"):
            current = []
        else:
            start = start and re.fullmatch(r"[A-Z_]+=\S*", word) is not None  # VAR=value griffin ...
        previous = word
    return [c for c in found if c and c[0] != "COMMAND"]


def documented() -> list[tuple[str, list[str]]]:
    commands = []
    for path in DOCS:
        for line in shell_blocks(path.read_text()):
            commands += [(f"{path.name}: {line.strip()}", c) for c in griffin_commands(line)]
    for text in [EPILOG, *EXAMPLES.values()]:
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("griffin "):
                commands += [(f"--help: {line}", c) for c in griffin_commands(re.split(r"\s{2,}", line)[0])]
    return commands


DOCUMENTED = documented()


def test_the_docs_give_commands():
    names = {c[0] for _, c in DOCUMENTED}
    assert len(DOCUMENTED) > 60 and {"train", "generate", "convert", "quantize", "serve", "eval", "synth",
                                      "experiment", "plan", "prepare", "tokenizer", "info", "presets"} <= names


@pytest.mark.parametrize("where,argv", DOCUMENTED, ids=[w[:90] for w, _ in DOCUMENTED])
def test_every_documented_command_parses(where, argv, capsys):
    try:
        build_parser().parse_args(argv)
    except SystemExit as stop:  # --help, --version
        assert stop.code == 0, (where, capsys.readouterr().err)
    err = capsys.readouterr().err
    assert "renamed" not in err, (where, err)  # no old spelling in the docs


@pytest.fixture
def readme_tour(tmp_path, monkeypatch):
    """A directory where the README's commands run as written: `griffin train`'s run at tiny sizes in its default
    `runs/griffin-cpu`, and the files the commands name."""
    monkeypatch.chdir(tmp_path)
    words = "the of and a to in is you that it he was for on are as with his they at be".split()
    (tmp_path / "input.txt").write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(9))
                                                  for i in range(600)) + "\n")
    (tmp_path / "book.txt").write_text("Chapter 1\n\nThe griffin flew.\nIt landed.\n")
    return tmp_path


TINY_TRAIN = ["--data", "input.txt", "--preset", "griffin-tiny", "--seq-len", "32", "--batch-size", "2",
              "--max-steps", "2", "--eval-batches", "1", "--eval-interval", "2", "--ckpt-interval", "2",
              "--sample-tokens", "4", "--no-progress", "--no-tensorboard"]
AT_TINY_SIZES = {  # what each command of the README's tour gets appended, to run in seconds
    "train": TINY_TRAIN,
    "eval phonebook": ["--seeds", "0", "--samples", "2"],
    "eval loss": ["--max-documents", "4", "--max-length", "64"],
}
NOT_RUN = {  # covered where they can run: their own tests
    "serve": "a server that runs until stopped (tests/serve)",
    "eval harness": "needs the exported task files (tests/evaluation)",
    "convert griffin.pt": "needs an official checkpoint file (tests/interop)",
    "convert path/to/hf-dir": "runs below, on the HF directory the README's previous command writes",
    "generate CKPT --tokenizer tokenizer.model": "needs a SentencePiece model (tests/data)",
}


def readme_tour_commands() -> list[list[str]]:
    placeholders = {"CKPT": "runs/griffin-cpu/checkpoints/best", "OUT": "int8-model", "griffin-dir":
                    "runs/griffin-cpu/checkpoints/best", "out-dir": "from-hf"}
    tour = []
    for _, argv in [d for d in DOCUMENTED if d[0].startswith("README.md")]:
        joined = " ".join(argv)
        if any(joined.startswith(k) for k in NOT_RUN):
            continue
        argv = [placeholders.get(a, a) for a in argv]
        key = next((k for k in AT_TINY_SIZES if " ".join(argv).startswith(k)), None)
        tour.append(argv + AT_TINY_SIZES.get(key, []))
    return tour


def test_the_readme_tour_runs_as_written(readme_tour, capsys):
    """The README's commands, in its order, at tiny sizes (a few flags appended, listed in AT_TINY_SIZES)."""
    tour = readme_tour_commands()
    assert tour[0][0] == "train" and any(a[:2] == ["eval", "phonebook"] for a in tour)
    for argv in tour:
        if argv[:1] == ["convert"] and argv[-2:] == ["--to", "hf"]:
            status = main(argv)
            assert status == 0, (argv, capsys.readouterr().err)
            assert main(["convert", argv[2], "from-hf"]) == 0  # the README's `griffin convert path/to/hf-dir out-dir`
            continue
        status = main(argv)
        assert status == 0, (argv, capsys.readouterr().err)
    assert Path("book.state").is_file() and Path("int8-model/config.json").is_file()
