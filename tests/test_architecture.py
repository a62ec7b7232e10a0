"""The package's structure (docs/architecture.md): the layers of pyproject.toml's import-linter contract (run by
`lint-imports` in CI, and here), and no module reaching into another module's private names."""

import ast
import subprocess
import sys
from pathlib import Path

import griffin

SRC = Path(griffin.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_imports_a_private_name_of_another():
    offences = []
    for path in sorted(SRC.rglob("*.py")):
        here = module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("griffin"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private and node.module != here:
                    offences.append(f"{here} imports {private} from {node.module}")
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                if isinstance(base, ast.Name) and base.id in {"griffin", "ops", "layers", "model", "cache"}:
                    offences.append(f"{here} uses {base.id}.{node.attr}")
    assert not offences, "\n".join(offences)


def test_import_layers_hold():
    lint = Path(sys.executable).parent / "lint-imports"  # import-linter's command, installed by the test extra
    run = subprocess.run([str(lint)], capture_output=True, text=True, cwd=SRC.parents[1])
    assert run.returncode == 0 and " kept, 0 broken" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
