"""Turn caller buffers (bytes, bytearray, memoryview, numpy arrays, CPU torch tensors) into flat
uint8 numpy views without copying."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload.errors import InvalidArgumentError

__all__ = ["Bytes", "as_readable", "as_writable"]

Bytes = npt.NDArray[np.uint8]


def _from_torch(obj: Any) -> Bytes:
    if obj.device.type != "cpu":
        raise InvalidArgumentError(
            f"expected a CPU tensor, got one on {obj.device}; stage device tensors through a "
            "host buffer (the connectors do this)"
        )
    if not obj.is_contiguous():
        raise InvalidArgumentError("tensor must be contiguous; call .contiguous() first")
    torch = sys.modules["torch"]
    # .view(torch.uint8) reinterprets any dtype (bf16 included, which numpy cannot represent).
    array: Bytes = obj.detach().reshape(-1).view(torch.uint8).numpy()
    return array


def _flat(obj: object) -> Bytes:
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidArgumentError("numpy array must be C-contiguous")
        return obj.reshape(-1).view(np.uint8)
    if type(obj).__module__ == "torch" and hasattr(obj, "untyped_storage"):
        return _from_torch(obj)
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(
            f"expected a bytes-like object, numpy array or CPU tensor, got {type(obj).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgumentError("buffer must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return np.frombuffer(view, dtype=np.uint8)


def as_readable(obj: object) -> Bytes:
    """A flat uint8 view of `obj`'s bytes.

    Raises:
        InvalidArgumentError: `obj` has no contiguous CPU buffer.
    """
    return _flat(obj)


def as_writable(obj: object) -> Bytes:
    """A flat, writable uint8 view of `obj`'s bytes.

    Raises:
        InvalidArgumentError: `obj` is read-only (bytes, a read-only view) or not contiguous.
    """
    array = _flat(obj)
    if not array.flags.writeable:
        raise InvalidArgumentError(
            f"{type(obj).__name__} is read-only; pass a bytearray, numpy array or tensor"
        )
    return array
