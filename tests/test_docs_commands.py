"""Every ``griffin`` command in README.md, docs/ and the parsers' examples parses as written, and the README's tour
runs as written, at tiny sizes (issue 35): a command that a doc gives and the code no longer takes fails here."""

from __future__ import annotations

import json
import random
import re
import shlex
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
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
def tour_dir(tmp_path, monkeypatch):
    """A directory where the docs' commands run as written: the files they name, and the configs they read."""
    monkeypatch.chdir(tmp_path)
    words = "the of and a to in is you that it he was for on are as with his they at be".split()
    rng = random.Random(0)  # varied text: a BPE vocabulary does not swallow it whole
    lines = [" ".join(rng.choice(words) + rng.choice(("", "s", "ed", "ing")) for _ in range(9)) for _ in range(600)]
    (tmp_path / "input.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "book.txt").write_text("Chapter 1\n\nThe griffin flew.\nIt landed.\n")
    (tmp_path / "corpus").mkdir()
    for i in range(3):
        (tmp_path / "corpus" / f"{i}.txt").write_text("\n".join(lines[i * 150:(i + 1) * 150]) + "\n")
    paragraphs = ["\n".join(lines[i:i + 10]) for i in range(0, 600, 10)]
    (tmp_path / "more.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs[45:52]))
    (tmp_path / "notes.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs[52:]))
    pq.write_table(pa.table({"text": paragraphs[:4]}), tmp_path / "pages.parquet")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    return tmp_path


TINY_TRAIN = ["--data", "input.txt", "--preset", "griffin-tiny", "--seq-len", "32", "--batch-size", "2",
              "--max-steps", "2", "--eval-batches", "1", "--eval-interval", "2", "--ckpt-interval", "2",
              "--sample-tokens", "4", "--no-progress", "--no-tensorboard"]
AT_TINY_SIZES = {  # what the docs' commands get appended, to run in seconds (the last of a repeated flag counts)
    "train": TINY_TRAIN,
    "eval phonebook": ["--seeds", "0", "--samples", "2"],
    "eval loss": ["--max-documents", "4", "--max-length", "64"],
}
NOT_RUN = {  # covered where they can run: their own tests
    "serve": "a server that runs until stopped (tests/serve)",
    "eval harness": "needs the exported task files (tests/evaluation)",
    "eval export-tasks": "downloads the tasks (tests/evaluation)",
    "convert griffin.pt": "needs an official checkpoint file (tests/interop)",
    "convert path/to/hf-dir": "runs in the README's tour, on the HF directory its next command writes",
    "generate CKPT --tokenizer tokenizer.model": "needs a SentencePiece model (tests/data)",
}
PLACEHOLDERS = {"CKPT": "runs/griffin-cpu/checkpoints/best", "OUT": "int8-model", "out-dir": "from-hf",
                "A": "runs/griffin-cpu/checkpoints/best", "B": "runs/bigger/checkpoints/best",
                "C": "runs/job/checkpoints/best", "DATA": "runs/griffin-cpu/data"}


def tour(*docs: str) -> list[list[str]]:
    """The commands of ``docs`` in their order, placeholders filled in and tiny sizes appended (a command that names
    its own --data keeps it)."""
    commands = []
    for _, argv in [d for doc in docs for d in DOCUMENTED if d[0].split(":")[0] == doc]:
        if any(" ".join(argv).startswith(k) for k in NOT_RUN) or "--help" in argv:
            continue
        argv = [PLACEHOLDERS.get(a, a) for a in argv]
        key = next((k for k in AT_TINY_SIZES if " ".join(argv).startswith(k)), None)
        extra = list(AT_TINY_SIZES.get(key, []))
        if "--data" in argv and "--data" in extra:
            del extra[extra.index("--data"):extra.index("--data") + 2]
        commands.append(argv + extra)
    return commands


def run_tour(commands: list[list[str]], capsys) -> None:
    for argv in commands:
        status = main(argv)
        assert status == 0, (argv, capsys.readouterr().err)
        if argv[:1] == ["convert"] and argv[-2:] == ["--to", "hf"]:  # the README's `convert path/to/hf-dir out-dir`
            assert main(["convert", argv[2], "from-hf"]) == 0, capsys.readouterr().err


def test_the_readme_tour_runs_as_written(tour_dir, capsys):
    """The README's commands, in its order, at tiny sizes (a few flags appended, listed in AT_TINY_SIZES)."""
    commands = tour("README.md")
    assert commands[0][0] == "train" and any(a[:2] == ["eval", "phonebook"] for a in commands)
    run_tour(commands, capsys)
    assert Path("book.state").is_file() and Path("int8-model/config.json").is_file()
    assert Path("from-hf/config.json").is_file()


@pytest.mark.slow
def test_the_training_and_evaluation_docs_run_as_written(tour_dir, capsys):
    """docs/training.md (demo, configs, bigger model, resume, requeued job, tokenizer, prepare of text, JSONL and
    parquet, training on it), then docs/evaluation.md's loss and phonebook commands on those runs."""
    commands = tour("training.md", "evaluation.md")
    assert sum(a[0] == "train" for a in commands) >= 5 and any(a[:2] == ["eval", "phonebook"] for a in commands)
    run_tour(commands, capsys)
    assert Path("tok/tokenizer.json").is_file() and Path("data/mine/meta.json").is_file()
    assert (Path("runs/job/checkpoints/best/config.json")).is_file()


FINETUNE_TINY = ["--max-steps", "2", "--eval-interval", "2", "--eval-examples", "2", "--eval-batches", "1",
                 "--batch-size", "2", "--no-progress", "--no-tensorboard"]


def doc_section(path: Path, heading: str) -> str:
    """The text of a Markdown file from the ``## heading`` to the next ``## `` heading."""
    text = path.read_text()
    start = text.index(f"\n## {heading}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


@pytest.mark.slow
def test_the_finetuning_worked_example_runs_as_written(tour_dir, capsys):
    """docs/finetuning.md's worked example, its commands in its order at tiny sizes: the base model (the training
    tour's sizes: griffin-tiny), the pairs (`python -m griffin.finetune.docstrings` on a few standard-library files),
    the LoRA (rank 4: griffin-tiny's key projection has 8 outputs) and full fine-tunes, the prompt file, generate from
    the adapter directory and with --adapter, info, merge, the HF export, and its Python (PEFT on the export)."""
    import subprocess
    import sysconfig

    from griffin.finetune.docstrings import main as make_pairs

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    few = [str(stdlib / name) for name in ("bisect.py", "colorsys.py", "json/decoder.py", "operator.py")]
    section = doc_section(ROOT / "docs" / "finetuning.md", "A worked example on a CPU")
    ran = []
    for line in shell_blocks(section):
        line = line.strip()
        if line.startswith("python -m griffin.finetune.docstrings"):
            args = shlex.split(line, comments=True)[3:]
            if "--help" not in args:
                assert make_pairs([*few, *args]) == 0, capsys.readouterr().err
                ran.append("pairs")
            continue
        if line.startswith("printf "):
            subprocess.run(["bash", "-c", line], check=True)
            continue
        for argv in griffin_commands(line):
            if any(" ".join(argv).startswith(k) for k in NOT_RUN):
                continue
            if argv[0] == "train":
                argv = argv + TINY_TRAIN
            elif argv[0] == "finetune":
                argv = argv + FINETUNE_TINY + ([] if "--lora-rank" in argv else ["--lora-rank", "4"])
            assert main(argv) == 0, (argv, capsys.readouterr().err)
            ran.append(argv[0])
    assert ran == ["train", "pairs", "pairs", "finetune", "finetune", "generate", "generate", "info", "merge",
                   "convert"], ran
    assert Path("runs/lora/checkpoints/best/adapter_config.json").is_file()
    assert Path("runs/full/checkpoints/best/model.safetensors").is_file()
    assert Path("merged/config.json").is_file() and Path("hf-base/config.json").is_file()
    python = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(python) == 1
    exec(compile(python[0], "docs/finetuning.md", "exec"), {})  # PEFT loads the adapter onto the HF export
