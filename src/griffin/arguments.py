"""The command line's vocabulary: one spelling per concept in every ``griffin`` command, and the old spellings kept
for one release as hidden aliases that say what replaced them.

:data:`VOCABULARY` maps each concept to its flag and the spellings it must not take; ``tests/test_cli_vocabulary.py``
walks every sub-command's parser against it. This module imports neither torch nor the model.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

VOCABULARY: dict[str, tuple[str, frozenset[str]]] = {
    # concept: (the flag, spellings that mean the same and must not be shown)
    "optimizer steps": ("--max-steps", frozenset({"--steps", "--num-steps", "--train-steps", "--iters"})),
    "rows per step": ("--batch-size", frozenset({"--batch", "--bs", "--micro-batch", "--global-batch",
                                                  "--eval-batch", "--max-batch"})),
    "evaluation interval": ("--eval-interval", frozenset({"--eval-every", "--eval-steps", "--eval-freq"})),
    "prefill chunk": ("--chunk-size", frozenset({"--prefill-chunk", "--chunk", "--prefill-chunk-size"})),
    "progress bar": ("--progress", frozenset({"--no-progress-bar", "--quiet-progress"})),
    "device": ("--device", frozenset({"--devices", "--gpu-id", "--cuda"})),
    "weight dtype": ("--dtype", frozenset({"--weights-dtype", "--torch-dtype"})),
    "output directory": ("--out", frozenset({"--output", "--output-dir", "--out-dir", "--outdir", "--save-dir"})),
    "replace outputs": ("--overwrite", frozenset({"--force", "--replace", "--clobber"})),
}
"""The flags of the ``griffin`` commands, concept by concept. A flag named ``--X-batch-size`` (``--eval-batch-size``,
``--max-batch-size``) is the batch size of another part of the same command."""


class _Renamed(argparse.Action):
    """An old spelling of an option: stores into the new option's destination, and says on stderr that it was
    renamed (it goes in the next release)."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        name = option_string or self.dest
        print(f"{parser.prog}: {name} is renamed {self.new}; the old spelling goes in the next release",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def renamed(parser: argparse.ArgumentParser | argparse._ArgumentGroup, old: str, new: argparse.Action) -> None:
    """Accept ``old`` as a hidden alias of the option ``new`` (what :meth:`add_argument` returned) for one release.
    ``new``'s metavar follows its own spelling where its destination keeps the old name."""
    if new.metavar is None and new.nargs != 0:
        new.metavar = new.option_strings[0].lstrip("-").upper().replace("-", "_")
    parser.add_argument(old, action=_Renamed, new=new.option_strings[0], dest=new.dest, type=new.type,
                        nargs=new.nargs, choices=new.choices,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS, metavar=new.metavar)
