"""The weight matmuls of a decode step, ``x W^T + b`` for a few rows of x (Section 5), and weight-only int8.

:func:`matvec_ref` (:mod:`griffin.ops.matvec.reference`) is the plain computation; :mod:`griffin.ops.matvec.cpu`
the numba kernel that reads each weight once at memory bandwidth (float32, bfloat16 or int8 weights; several
matrices sharing one input in one call).
"""

from griffin.ops.matvec.reference import (
    MIN_GROUP,
    QMAX,
    check_group_size,
    dequantize_blocks_int8,
    dequantize_int8,
    groups_of,
    matvec_ref,
    quantize_blocks_int8,
    quantize_int8,
)

__all__ = ["MIN_GROUP", "QMAX", "check_group_size", "dequantize_blocks_int8", "dequantize_int8", "groups_of",
           "matvec_ref", "quantize_blocks_int8", "quantize_int8"]
