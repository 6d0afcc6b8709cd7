"""A strided buffer numpy cannot read, seen by numpy as unsigned integers.

MLX exports bf16 buffers with the format "bfloat16", which numpy refuses, and
a strided buffer cannot be cast to bytes by memoryview either. The encoder,
which cuts strided buffers into contiguous runs with numpy, needs only the
bytes: this reads the buffer's address, shape and strides through the buffer
protocol (no MLX operation, so nothing is evaluated on the calling thread,
which keeps MLX from starting a stream for it) and describes the same memory
to numpy as unsigned integers of the same size.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np


class _PyBuffer(ctypes.Structure):
    # CPython's Py_buffer (stable since 3.3).
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_ssize_t)),
        ("strides", ctypes.POINTER(ctypes.c_ssize_t)),
        ("suboffsets", ctypes.POINTER(ctypes.c_ssize_t)),
        ("internal", ctypes.c_void_p),
    ]


_PyBUF_RECORDS_RO = 0x0010 | 0x0008 | 0x0004  # strides, nd, format; read-only

_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


class _Interface:
    """Holds the exporter (so its memory stays alive as long as the numpy
    array made from this) and describes that memory to numpy."""

    def __init__(self, owner: Any, interface: dict[str, Any]) -> None:
        self.owner = owner
        self.__array_interface__ = interface


def as_unsigned(owner: Any) -> np.ndarray:
    """A read-only numpy view of ``owner``'s buffer (any layout, any
    format) as unsigned integers of its item size. Keeps ``owner`` alive."""
    view = _PyBuffer()
    _get_buffer(owner, ctypes.byref(view), _PyBUF_RECORDS_RO)  # raises if it fails
    try:
        ndim = view.ndim
        shape = tuple(view.shape[i] for i in range(ndim))
        strides = tuple(view.strides[i] for i in range(ndim)) if view.strides else None
        if view.itemsize not in (1, 2, 4, 8):
            raise ValueError(f"no unsigned type of {view.itemsize} bytes")
        interface = {
            "version": 3,
            "shape": shape,
            "strides": strides,
            "typestr": np.dtype(f"u{view.itemsize}").str,
            "data": (view.buf or 0, True),
        }
    finally:
        _release_buffer(ctypes.byref(view))
    # The address stays valid after the release: the exporter (an evaluated
    # MLX array) owns its memory for as long as it lives, and `owner` is kept.
    return np.asarray(_Interface(owner, interface))
