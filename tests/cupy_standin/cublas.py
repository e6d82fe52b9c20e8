"""libcublas as the CUDA backend calls it through ctypes (workers/backends/cuda/cublas.py), over the
stand-in's memory and streams, so the backend's own products run under the stand-in as on a GPU.

`cublasSgemm_v2` reads its operands at the device addresses it is given, column-major with the
leading dimensions given (a wrong one reads the wrong elements), checks them as cuBLAS does
(CUBLAS_STATUS_INVALID_VALUE), and runs as a kernel on the stream its handle was set to: ordered
after the kernels before it, recorded by a capture and replayed with its graph, seen by the race
detector. Nothing here refuses a capture: CuPy's refusal is CuPy's own (array.py's CUBLAS).
"""

from __future__ import annotations

import itertools

import numpy as np
from numpy.lib.stride_tricks import as_strided

from tests.cupy_standin import runtime as rt

OP_N, OP_T = 0, 1
SUCCESS, NOT_INITIALIZED, INVALID_VALUE = 0, 1, 7


def _value(arg):
    """The value a ctypes argument carries: c_void_p, c_size_t, byref(c_float), or a plain int."""
    held = getattr(arg, "_obj", arg)  # ctypes.byref(x) holds x
    return getattr(held, "value", held)


def _stored(ptr: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """The float32 column-major (rows, cols) matrix at device address `ptr`, leading dimension `ld`."""
    count = (cols - 1) * ld + rows
    flat = rt.array_at(ptr, count, np.float32)
    return as_strided(flat, shape=(rows, cols), strides=(4, 4 * ld))


class Library:
    """The handful of libcublas entry points the backend calls, with their C signatures' meaning."""

    def __init__(self) -> None:
        self._streams: dict[int, int] = {}  # handle -> the stream it is set to (0: the null stream)
        self._ids = itertools.count(0x5A000)

    def cublasCreate_v2(self, handle_out) -> int:
        handle = next(self._ids)
        self._streams[handle] = 0
        handle_out._obj.value = handle
        return SUCCESS

    def cublasDestroy_v2(self, handle) -> int:
        return SUCCESS if self._streams.pop(_value(handle), None) is not None else NOT_INITIALIZED

    def cublasSetWorkspace_v2(self, handle, workspace, size) -> int:
        return SUCCESS if _value(handle) in self._streams else NOT_INITIALIZED

    def cublasSetStream_v2(self, handle, stream) -> int:
        if _value(handle) not in self._streams:
            return NOT_INITIALIZED
        self._streams[_value(handle)] = _value(stream) or 0
        return SUCCESS

    def cublasSgemm_v2(self, handle, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) -> int:
        """C (m, n) = alpha op(A) (m, k) @ op(B) (k, n) + beta C, all column-major."""
        stream = self._streams.get(_value(handle))
        if stream is None:
            return NOT_INITIALIZED
        a_rows, b_rows = (m if transa == OP_N else k), (k if transb == OP_N else n)
        if min(m, n, k) < 0 or lda < max(1, a_rows) or ldb < max(1, b_rows) or ldc < max(1, m):
            return INVALID_VALUE
        if not m or not n:
            return SUCCESS
        out = _stored(_value(c), m, n, ldc)
        scale, keep = float(_value(alpha)), float(_value(beta))
        if not k:  # alpha times an empty sum: beta C; with beta 0, zeros, C not read (a NaN there goes)

            def scaled() -> None:
                out[...] = out * np.float32(keep) if keep else 0

            rt.stream_at(stream).issue(scaled, writes=[out], what="cublasSgemm")
            return SUCCESS
        a_cols, b_cols = (k if transa == OP_N else m), (n if transb == OP_N else k)
        op_a = _stored(_value(a), a_rows, a_cols, lda)
        op_b = _stored(_value(b), b_rows, b_cols, ldb)
        op_a, op_b = (op_a if transa == OP_N else op_a.T), (op_b if transb == OP_N else op_b.T)

        def run() -> None:
            # C^T = op(B)^T @ op(A)^T: the row-major product the caller asked for, NumPy's float32 bits
            product = (op_b.T @ op_a.T).T
            out[...] = product * np.float32(scale) + (out * np.float32(keep) if keep else 0)

        rt.stream_at(stream).issue(run, reads=[op_a, op_b], writes=[out], what="cublasSgemm")
        return SUCCESS
