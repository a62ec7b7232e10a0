"""griffin.ops.drop_stale_kernels: numba's cache checks only a kernel's own file, so a change to any kernel source
empties the cache of all of them."""

from pathlib import Path

from griffin.ops import MARKER, drop_stale_kernels


def test_a_changed_source_drops_every_cached_kernel(tmp_path: Path) -> None:
    (tmp_path / "sub" / "__pycache__").mkdir(parents=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    cached = [tmp_path / "sub" / "__pycache__" / name for name in ("b.kernel-3.py311.nbi", "b.kernel-3.py311.1.nbc")]
    other = tmp_path / "sub" / "__pycache__" / "b.cpython-311.pyc"

    def fill() -> None:
        for path in (*cached, other):
            path.write_bytes(b"cached")

    fill()
    assert drop_stale_kernels(tmp_path)  # no digest yet: the cache cannot be trusted
    assert not any(p.exists() for p in cached) and other.exists()  # only numba's files
    assert (tmp_path / "__pycache__" / MARKER).is_file()
    fill()
    assert not drop_stale_kernels(tmp_path) and all(p.exists() for p in cached)  # nothing changed
    (tmp_path / "a.py").write_text("x = 3\n")  # a file the kernels of another file may inline
    assert drop_stale_kernels(tmp_path) and not any(p.exists() for p in cached)
    fill()
    (tmp_path / "sub" / "b.py").rename(tmp_path / "sub" / "c.py")  # a rename counts too
    assert drop_stale_kernels(tmp_path) and not any(p.exists() for p in cached)


def test_an_unwritable_cache_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "__pycache__").write_text("not a directory")  # the marker cannot be written
    assert not drop_stale_kernels(tmp_path)
