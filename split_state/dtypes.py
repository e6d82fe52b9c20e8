"""The dtypes the runtime stores, moves and computes with, by their wire names."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from split_state.errors import UnsupportedDtype

# bfloat16 comes from ml_dtypes on the host side: NumPy has no native bfloat16.
DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}
FLOAT_NAMES = frozenset({"float64", "float32", "float16", "bfloat16"})
INDEX_NAMES = frozenset({"int64", "int32", "int16", "int8", "uint8"})


_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: object) -> str:
    """The wire name of a dtype, or UnsupportedDtype naming the allowed set."""
    if isinstance(dtype, np.dtype) and dtype in _NAMES:  # the common case, on every message
        return _NAMES[dtype]
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise UnsupportedDtype(f"not a dtype: {dtype!r}; supported: {', '.join(DTYPES)}") from exc
    for name, known in DTYPES.items():
        if dt == known:
            return name
    raise UnsupportedDtype(f"dtype {dt} is not supported; supported: {', '.join(DTYPES)}")


def dtype_from_name(name: object) -> np.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise UnsupportedDtype(f"dtype {name!r} is not supported; supported: {', '.join(DTYPES)}")
    return DTYPES[name]
