"""float32 products through cuBLAS called directly, so a device graph can capture them.

CuPy refuses every cuBLAS call while a stream captures (its `cublas.setStream` raises "calling
cuBLAS API during stream capture is currently unsupported", cupy/cupy#6290), though cuBLAS
itself supports capture: its routines are captured like any kernel when the handle's workspace
is the caller's (cuBLAS docs, "CUDA Graphs support"; PyTorch sets one per handle for the same
reason). So a CUDA worker opens the cuBLAS library CuPy already loaded, with a handle of its own
and a fixed workspace, and calls `cublasSgemm_v2` through ctypes; the scalars are host values (1
and 0), which a capture records. A product whose operands cuBLAS cannot take as they lie (a
batched product, a view strided in both axes, another dtype) returns None: the caller runs
CuPy's product, which a capture refuses (the worker's stats then name the step in
`graphs.refused`).

Not a backend: the name starts with an underscore (workers/backends/__init__.py lists the others).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from math import prod

OP_N, OP_T = 0, 1  # cublasOperation_t
WORKSPACE_BYTES = 32 << 20  # cuBLAS's recommendation for Hopper (4 MiB before it)


@dataclass(frozen=True)
class Operand:
    """A row-major matrix as cuBLAS takes its transpose: `op` of the column-major matrix at
    `array`'s first element with leading dimension `ld`."""

    array: object
    op: int
    ld: int


def transposed(x) -> Operand | None:
    """X (r, c), a 2-D array, as X^T (c, r) for cuBLAS, without a copy; None when its strides
    allow neither reading (unit column stride: X^T is column-major as it lies) nor (unit row
    stride: X itself is column-major, so X^T is its transpose)."""
    rows, cols = x.shape
    s0, s1 = (s // x.itemsize for s in x.strides)
    if any(s * x.itemsize != t for s, t in zip((s0, s1), x.strides)):
        return None  # not whole elements apart
    if (s1 == 1 or cols <= 1) and (s0 >= max(1, cols) or rows <= 1):
        return Operand(x, OP_N, max(1, cols) if rows <= 1 else s0)
    if (s0 == 1 or rows <= 1) and (s1 >= max(1, rows) or cols <= 1):
        return Operand(x, OP_T, max(1, rows) if cols <= 1 else s1)
    return None


@dataclass(frozen=True)
class Gemm:
    """cublasSgemm's arguments for out (m, n) = a (m, k) @ b (k, n), all row-major: in cuBLAS's
    column-major terms out^T (n, m) = b^T (n, k) @ a^T (k, m)."""

    b: Operand
    a: Operand
    out: Operand
    m: int
    n: int
    k: int


def plan_gemm(a, b, out) -> Gemm | None:
    """The cuBLAS call writing a (..., m, k) @ b (k, n) into out (..., m, n), float32 all, or
    None when cuBLAS cannot take the operands as they lie. `a`'s leading axes fold into its
    rows (a reshape, a view wherever a's strides allow)."""
    if b.ndim != 2 or a.ndim < 2 or out.ndim != a.ndim:
        return None
    if not all(x.dtype.kind == "f" and x.dtype.itemsize == 4 for x in (a, b, out)):
        return None
    k, n = b.shape
    if a.shape[-1] != k or out.shape != a.shape[:-1] + (n,):
        return None
    m = prod(a.shape[:-1])
    a2, out2 = a.reshape(m, k), out.reshape(m, n)
    if not _shares(out2, out):
        return None  # out must be written in place
    if not (m and n and k):  # nothing to read: no call (the caller fills out with zeros when k is 0)
        return Gemm(Operand(b, OP_N, 1), Operand(a2, OP_N, 1), Operand(out2, OP_N, 1), m, n, k)
    b_op, a_op, out_op = transposed(b), transposed(a2), transposed(out2)
    if b_op is None or a_op is None or out_op is None or out_op.op != OP_N:
        return None
    return Gemm(b_op, a_op, out_op, m, n, k)


def _shares(view, base) -> bool:
    """Whether a reshape of `base` is a view of it (not a copy)."""
    return view.size == 0 or address(view) == address(base)


def address(x) -> int:
    """The address of an array's first element: a CuPy array's MemoryPointer (its
    __cuda_array_interface__, a dict built at each call, failed with AttributeError in a GPU
    worker), a NumPy array's interface on the host."""
    pointer = getattr(x.data, "ptr", None)
    return int(pointer) if pointer is not None else int(x.__array_interface__["data"][0])


class CapturableGemm:
    """cuBLAS on the current device with a handle and workspace of its own (see the module
    docstring). `__call__(a, b, out)` writes a @ b into out on the current stream and returns
    it, or returns None for operands cuBLAS cannot take (plan_gemm)."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.lib = _library(cupy)
        handle = ctypes.c_void_p()
        _check(self.lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate_v2")
        self.handle = handle
        self.workspace = cupy.empty(WORKSPACE_BYTES, cupy.uint8)
        ws = ctypes.c_void_p(self.workspace.data.ptr)
        _check(self.lib.cublasSetWorkspace_v2(handle, ws, ctypes.c_size_t(WORKSPACE_BYTES)), "cublasSetWorkspace_v2")
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.stream = None  # the stream the handle is set to

    def __call__(self, a, b, out):
        gemm = plan_gemm(a, b, out)
        if gemm is None:
            return None
        if not gemm.m or not gemm.n:
            return out
        if not gemm.k:
            out.fill(0)
            return out
        stream = self.cupy.cuda.get_current_stream().ptr
        if stream != self.stream:
            _check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream)), "cublasSetStream_v2")
            self.stream = stream
        status = self.lib.cublasSgemm_v2(
            self.handle,
            gemm.b.op,
            gemm.a.op,
            gemm.n,
            gemm.m,
            gemm.k,
            ctypes.byref(self.one),
            ctypes.c_void_p(address(gemm.b.array)),
            gemm.b.ld,
            ctypes.c_void_p(address(gemm.a.array)),
            gemm.a.ld,
            ctypes.byref(self.zero),
            ctypes.c_void_p(address(gemm.out.array)),
            gemm.out.ld,
        )
        _check(status, "cublasSgemm_v2")
        return out

    def close(self) -> None:
        if self.handle:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = None


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with cuBLAS status {status}")


def _library(cupy):
    """The libcublas CuPy loaded (its cuBLAS module links it), found in this process's maps."""
    import cupy_backends.cuda.libs.cublas  # noqa: F401  loads libcublas

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcublas.so" in line and "libcublasLt" not in line}
    if not paths:
        raise OSError("libcublas is not loaded in this process")
    lib = ctypes.CDLL(sorted(paths)[0])
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cublasDestroy_v2.argtypes = [ctypes.c_void_p]
    lib.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cublasSetWorkspace_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    f, i, p = ctypes.POINTER(ctypes.c_float), ctypes.c_int, ctypes.c_void_p
    lib.cublasSgemm_v2.argtypes = [p, i, i, i, i, i, f, p, i, p, i, f, p, i]
    return lib
