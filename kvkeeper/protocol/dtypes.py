"""Tensor element types on the wire and on disk, named as safetensors names them.

The client always sends the dtype name explicitly (never inferred from a buffer
format); the daemon accepts only the names below and checks every declared
size against them.
"""

from __future__ import annotations

#: safetensors dtype name -> bytes per element
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}
