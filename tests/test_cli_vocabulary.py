"""One vocabulary for every ``griffin`` command (issue 35): each concept spelled one way (griffin.arguments.
VOCABULARY), options taken by their full names only, defaults shown one way, ``--out`` always a directory, and the
old spellings accepted for one release with a message that names the new one."""

from __future__ import annotations

import argparse
import re

import pytest

from griffin.arguments import VOCABULARY, _Renamed
from griffin.cli import build_parser, main


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser of the ``griffin`` command, by its command line (aliases of a sub-command counted once)."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                seen: set[int] = set()
                for sub_name, sub in action.choices.items():
                    if id(sub) not in seen:
                        seen.add(id(sub))
                        walk(sub, f"{name} {sub_name}")

    walk(build_parser(), "griffin")
    return found


PARSERS = parsers()
OPTIONS = [(name, action) for name, p in PARSERS.items() for action in p._actions
           if action.option_strings and not isinstance(action, argparse._HelpAction)]


def shown(action: argparse.Action) -> bool:
    return action.help != argparse.SUPPRESS


def test_the_walk_sees_every_command():
    assert {"griffin train", "griffin generate", "griffin serve", "griffin synth mqar", "griffin synth compare",
            "griffin eval harness", "griffin experiment", "griffin plan", "griffin prepare"} <= set(PARSERS)
    assert len(OPTIONS) > 200


def test_each_concept_has_one_spelling():
    for name, action in OPTIONS:
        if not shown(action):
            continue
        for concept, (flag, others) in VOCABULARY.items():
            clash = set(action.option_strings) & others
            assert not clash, f"{name}: {sorted(clash)} is the {concept}: spell it {flag}"


def test_old_spellings_are_hidden_aliases_of_the_new_ones(capsys):
    for name, action in OPTIONS:
        if isinstance(action, _Renamed):
            assert not shown(action), (name, action.option_strings)
            new = [a for a in PARSERS[name]._actions if action.new in a.option_strings]
            assert len(new) == 1 and new[0].dest == action.dest and shown(new[0]), (name, action.option_strings)
        elif not shown(action):
            assert action.option_strings == ["--debug"], f"{name}: hidden option {action.option_strings}"
    args = build_parser().parse_args(["synth", "mqar", "--out", "x", "--steps", "3", "--batch", "2"])
    assert (args.steps, args.batch_size) == (3, 2)
    err = capsys.readouterr().err
    assert "--steps is renamed --max-steps" in err and "--batch is renamed --batch-size" in err


def test_options_are_taken_by_their_full_names_only(capsys):
    assert all(not p.allow_abbrev for p in PARSERS.values())
    with pytest.raises(SystemExit) as stop:
        main(["train", "--batch", "2"])
    assert stop.value.code == 2 and "unrecognized arguments: --batch" in capsys.readouterr().err


def test_progress_is_one_switch_with_its_negation():
    for name, action in OPTIONS:
        if {"--progress", "--no-progress"} & set(action.option_strings):
            assert isinstance(action, argparse.BooleanOptionalAction), (name, action.option_strings)
            assert set(action.option_strings) == {"--progress", "--no-progress"}, name


def test_out_is_always_a_directory():
    outs = [(name, a) for name, a in OPTIONS if "--out" in a.option_strings]
    assert len(outs) >= 10
    for name, action in outs:
        assert "directory" in (action.help or ""), f"{name}: --out is '{action.help}'"


def test_defaults_are_shown_one_way():
    """``(default: X)`` from the formatter, or a sentence that says what the default is: never ``(default X)``."""
    for name, parser in PARSERS.items():
        text = parser.format_help()
        assert not re.search(r"\(default [^:]", text), (name, re.search(r"\(default [^:].{0,40}", text))
        assert "(default: None)" not in text and "default: )" not in text, name
        for line in re.findall(r".*default:.*default:.*", text):
            pytest.fail(f"{name}: two defaults on one line: {line}")
