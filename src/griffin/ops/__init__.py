"""The operators under the models (Sections 2-5): references in plain PyTorch and the fast kernels beside them.

Many CPU kernels here are numba functions cached on disk (``cache=True``, in each module's ``__pycache__``). numba
checks a cached kernel against the file that defines it only; a kernel that inlines a function of another file (the
decode step's kernels inline the matvec kernel's tasks) would keep running the older code after that file changed.
So on import, :func:`drop_stale_kernels` empties the cache of every kernel here whenever any source file here changed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

MARKER = "griffin-kernels.sha256"  # in this package's __pycache__: the digest of the sources the cache was built from


def drop_stale_kernels(root: Path) -> bool:
    """Delete numba's cached kernels (``*.nbi``, ``*.nbc``) in every ``__pycache__`` under ``root`` if the ``.py``
    files under it differ from those the cache was built from (the digest in ``root/__pycache__/`` :data:`MARKER`),
    and record the new digest. Returns whether it deleted. A read-only install is left as it is."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    marker = root / "__pycache__" / MARKER
    try:
        if marker.is_file() and marker.read_text() == digest.hexdigest():
            return False
        for cached in [*root.rglob("__pycache__/*.nbi"), *root.rglob("__pycache__/*.nbc")]:
            cached.unlink(missing_ok=True)
        marker.parent.mkdir(exist_ok=True)
        marker.write_text(digest.hexdigest())
    except OSError:
        return False
    return True


drop_stale_kernels(Path(__file__).parent)
