"""The operators under the models (Sections 2-5): references in plain PyTorch and the fast kernels beside them.

The numba kernels here and in the CPU decode engine (:mod:`griffin.inference.cpu`) are cached on disk; how a cached
kernel is kept from running older code is in :mod:`griffin.ops.jit`.
"""
