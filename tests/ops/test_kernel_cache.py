"""griffin.ops.jit.kernel: a cached kernel is compiled again when any kernel source changes, not only its own file
(numba's own check), since griffin's kernels inline functions of other files."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from griffin.ops import jit

# A kernel in a file of its own, and the same function under plain numba caching, run in a fresh process with the
# kernel sources taken from the folder given as argv[1]: prints each one's cache hits and misses.
SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path

    import numba

    from griffin.ops import jit

    jit.PACKAGE = Path(sys.argv[1])

    @jit.kernel()
    def stamped(x):
        return x + 1

    @numba.njit(cache=True)
    def plain(x):
        return x + 1

    assert stamped(1) == plain(1) == 2
    print(*(sum(counts.values()) for f in (stamped, plain) for counts in (f.stats.cache_hits, f.stats.cache_misses)))
""")


def _sources(root: Path) -> None:
    for name in jit.KERNEL_SOURCES:
        (root / name).mkdir(parents=True, exist_ok=True)
    (root / "ops" / "a.py").write_text("x = 1\n")
    (root / "inference" / "cpu" / "b.py").write_text("y = 2\n")


def test_a_change_to_another_kernel_source_compiles_the_kernel_again(tmp_path: Path) -> None:
    sources, script = tmp_path / "griffin", tmp_path / "kernels.py"
    _sources(sources)
    script.write_text(SCRIPT)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def run() -> list[int]:
        out = subprocess.run([sys.executable, str(script), str(sources)], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        return [int(v) for v in out.stdout.split()]

    assert run() == [0, 1, 0, 1]  # an empty cache: both compile
    assert run() == [1, 0, 1, 0]  # nothing changed: both load
    (sources / "inference" / "cpu" / "b.py").write_text("y = 3\n")  # a file the kernel may inline from
    assert run() == [0, 1, 1, 0]  # numba alone would run the older compilation
    assert run() == [1, 0, 1, 0]


@pytest.mark.parametrize("change", ["edit", "rename", "add"])
def test_the_digest_covers_every_kernel_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    _sources(tmp_path)
    monkeypatch.setattr(jit, "PACKAGE", tmp_path)

    def digest() -> str:
        jit.kernel_sources_digest.cache_clear()
        return jit.kernel_sources_digest()

    before = digest()
    (tmp_path / "cli.py").write_text("z = 1\n")  # outside the kernel sources
    assert digest() == before
    a = tmp_path / "ops" / "a.py"
    {"edit": lambda: a.write_text("x = 2\n"), "rename": lambda: a.rename(a.with_name("c.py")),
     "add": lambda: (tmp_path / "inference" / "cpu" / "d.py").write_text("")}[change]()
    assert digest() != before
    jit.kernel_sources_digest.cache_clear()


def test_kernel_refuses_a_cache_option() -> None:
    with pytest.raises(TypeError, match="cache="):
        jit.kernel(cache=False)
