"""The CUDA backend's capturable products (workers/backends/cuda/cublas.py). On the host: the cuBLAS
call planned for every layout a program hands a product (a transposed weight, a column slice of
an output, leading axes, empty extents) is run by an emulation of cublasSgemm's column-major
contract on the arrays' own memory and must give NumPy's a @ b. On a GPU: the product itself,
eager and captured in a CUDA graph replayed with new operands, against NumPy."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from workers.backends.cuda import Backend as CudaBackend
from workers.backends.cuda.cublas import OP_N, Operand, plan_gemm, transposed


def stored(operand: Operand, rows: int, cols: int) -> np.ndarray:
    """op(M) where M is the column-major matrix cuBLAS reads at the operand's first element with
    its leading dimension: (rows, cols) is op(M)'s shape, as cublasSgemm states its operands."""
    shape = (rows, cols) if operand.op == OP_N else (cols, rows)
    size = operand.array.itemsize
    matrix = as_strided(operand.array, shape=shape, strides=(size, size * operand.ld), writeable=False)
    return matrix if operand.op == OP_N else matrix.T


def emulated_sgemm(a, b, out) -> bool:
    """cublasSgemm(opB, opA, n, m, k, 1, B, ldb, A, lda, 0, C, ldc) as cuBLAS defines it, on
    the host: C (n, m) column-major = op(B) (n, k) @ op(A) (k, m). False when no call was planned."""
    gemm = plan_gemm(a, b, out)
    if gemm is None:
        return False
    if not gemm.m or not gemm.n:
        return True
    if not gemm.k:  # no call: the caller writes the zeros (as CapturableGemm does)
        out.fill(0)
        return True
    left, right = stored(gemm.b, gemm.n, gemm.k), stored(gemm.a, gemm.k, gemm.m)
    size = out.itemsize
    c = as_strided(gemm.out.array, shape=(gemm.n, gemm.m), strides=(size, size * gemm.out.ld))
    c[...] = left.astype(np.float64) @ right.astype(np.float64)
    return True


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def layouts(rng, to=np.asarray):
    """(name, a, b, out) with the layouts a program hands the kernel, their arrays made by `to`
    from host arrays (np.asarray, cupy.asarray) before they are transposed or sliced."""

    def r(*shape):
        return to(rand(rng, *shape))

    def empty(*shape, fill=0.0):
        return to(np.full(shape, fill, np.float32))

    yield "row-major", r(5, 7), r(7, 3), empty(5, 3)
    yield "one row (decode)", r(1, 1, 7), r(7, 11), empty(1, 1, 11)
    yield "leading axes", r(2, 3, 7), r(7, 4), empty(2, 3, 4)
    yield "transposed weight", r(4, 6), r(9, 6).T, empty(4, 9)
    yield "transposed rows", r(6, 4).T, r(6, 5), empty(4, 5)
    yield "column slice of out (qmatmul's tiles)", r(3, 8), r(5, 8).T, empty(3, 10)[:, 2:7]
    yield "column slice of a weight", r(2, 6), r(6, 12)[:, 3:8], empty(2, 5)
    yield "one column", r(3, 6), r(6, 1), empty(3, 1)
    yield "head: vocab @ x.T", r(13, 6), r(1, 6).T, empty(13, 1)
    yield "no rows", r(0, 6), r(6, 4), empty(0, 4)
    yield "no columns (an empty slice)", r(3, 6), r(6, 0), empty(3, 0)
    yield "no inner extent", r(3, 0), r(0, 4), empty(3, 4, fill=7.0)


def expected(a, b) -> np.ndarray:
    return np.asarray(a, np.float64) @ np.asarray(b, np.float64)


@pytest.mark.parametrize("case", range(12))
def test_the_planned_call_computes_a_at_b_for_each_layout(case):
    name, a, b, out = list(layouts(np.random.default_rng(case)))[case]
    assert emulated_sgemm(a, b, out), name
    np.testing.assert_allclose(out, expected(a, b), rtol=1e-6, atol=1e-6, err_msg=name)


def test_operands_cublas_cannot_take_are_left_to_cupy():
    rng = np.random.default_rng(1)
    a, b = rand(rng, 4, 6), rand(rng, 6, 5)
    assert plan_gemm(a, rand(rng, 2, 6, 5), np.empty((2, 4, 5), np.float32)) is None  # batched
    assert plan_gemm(a, b, np.empty((4, 5), np.float64)) is None  # another dtype
    assert plan_gemm(a.astype(np.float16), b, np.empty((4, 5), np.float32)) is None
    assert plan_gemm(a, rand(rng, 12, 10)[::2, ::2], np.empty((4, 5), np.float32)) is None  # strided both ways
    assert plan_gemm(a, b, np.empty((5, 4), np.float32).T) is None  # out column-major
    assert plan_gemm(a, b, np.empty((4, 6), np.float32)) is None  # out of the wrong shape
    assert transposed(rand(rng, 6, 8)[:, ::2]) is None


def test_a_product_on_another_array_module_never_reaches_a_devices_cublas(monkeypatch):
    """A process that made device 0's cuBLAS handle for one CuPy module (the real one) and then
    drives CuPy's stand-in (the GPU check runs both in one pytest): the stand-in's products go to
    its own handle. Keyed by device alone, cuBLAS was handed the stand-in's host arrays on a GPU
    and gave rows of garbage."""
    import types

    from tests.cupy_standin import install
    from workers.backends import cuda
    from workers.kernels import kernels_for

    install(monkeypatch)
    called = []
    elsewhere = types.ModuleType("cupy_elsewhere")
    monkeypatch.setitem(cuda._GEMMS, (id(elsewhere), 0), lambda a, b, out: called.append(1) or out)
    backend = CudaBackend(0)
    rng = np.random.default_rng(3)
    a, b = rand(rng, 4, 8), rand(rng, 8, 6)
    xp = backend.xp
    out = xp.empty((4, 6), xp.float32)
    got = kernels_for(backend)["matmul"](xp, [xp.asarray(a), xp.asarray(b)], {}, out)
    assert not called and not backend.uncaptured  # the stand-in's own handle took it
    np.testing.assert_allclose(backend.to_host(got), expected(a, b), rtol=1e-5, atol=1e-5)


def test_the_standin_cublas_refuses_a_leading_dimension_cublas_would(monkeypatch):
    """The stand-in's libcublas checks what cuBLAS checks: a leading dimension shorter than the
    rows it strides over is CUBLAS_STATUS_INVALID_VALUE (the backend raises on any status but 0)."""
    import ctypes

    from tests.cupy_standin import install
    from tests.cupy_standin.cublas import INVALID_VALUE
    from workers.backends.cuda.cublas import CapturableGemm

    cupy = install(monkeypatch)
    gemm = CapturableGemm(cupy)
    a, b, out = cupy.zeros((2, 3), cupy.float32), cupy.zeros((3, 4), cupy.float32), cupy.zeros((2, 4), cupy.float32)
    status = gemm.lib.cublasSgemm_v2(
        gemm.handle, OP_N, OP_N, 4, 2, 3, ctypes.byref(gemm.one), ctypes.c_void_p(b.data.ptr), 2,
        ctypes.c_void_p(a.data.ptr), 3, ctypes.byref(gemm.zero), ctypes.c_void_p(out.data.ptr), 4,
    )  # fmt: skip
    assert status == INVALID_VALUE  # b^T (4, 3) stored with ld 2 < 4
    assert gemm(a, b, out) is out  # the planned call passes the check


def test_the_standin_cublas_with_beta_zero_never_reads_c(monkeypatch):
    """cuBLAS reads C only when beta is not 0: with beta 0 and no inner extent, C becomes zeros
    whatever it held (NaN times 0 would stay NaN)."""
    import ctypes

    from tests.cupy_standin import install
    from tests.cupy_standin.cublas import Library

    cupy = install(monkeypatch)
    lib, handle = Library(), ctypes.c_void_p()
    assert lib.cublasCreate_v2(ctypes.byref(handle)) == 0
    out = cupy.full((2, 3), np.nan, cupy.float32)
    assert lib.cublasSetStream_v2(handle, ctypes.c_void_p(cupy.cuda.get_current_stream().ptr)) == 0
    one, zero, nowhere = ctypes.c_float(1.0), ctypes.c_float(0.0), ctypes.c_void_p(0)
    status = lib.cublasSgemm_v2(
        handle, OP_N, OP_N, 3, 2, 0, ctypes.byref(one), nowhere, 3, nowhere, 1, ctypes.byref(zero),
        ctypes.c_void_p(out.data.ptr), 3,
    )  # fmt: skip
    assert status == 0
    np.testing.assert_array_equal(cupy.asnumpy(out), np.zeros((2, 3), np.float32))


needs_gpu = pytest.mark.skipif(CudaBackend.device_count() == 0, reason="needs CuPy and a CUDA device")


@needs_gpu
def test_products_on_the_gpu_eager_and_replayed_from_a_graph():
    import cupy

    from workers.backends.cuda.cublas import CapturableGemm

    backend = CudaBackend(0)
    gemm = CapturableGemm(cupy)
    rng = np.random.default_rng(2)
    try:
        for name, a, b, out in layouts(rng, cupy.asarray):
            assert gemm(a, b, out) is out, name
            host = (cupy.asnumpy(x) for x in (a, b, out))
            ha, hb, hout = host
            np.testing.assert_allclose(hout, expected(ha, hb), rtol=1e-4, atol=1e-4, err_msg=name)
        # captured once on the backend's compute stream (current, as in a worker's executor), replayed
        # with new operands written in place
        with backend.compute:
            a, b = cupy.zeros((1, 64), cupy.float32), cupy.zeros((64, 96), cupy.float32)
            out = cupy.zeros((1, 96), cupy.float32)
            backend.begin_capture()
            gemm(a, b, out)
            graph = backend.end_capture()
            for round in range(3):
                ha, hb = rand(rng, 1, 64), rand(rng, 64, 96)
                a[...], b[...] = cupy.asarray(ha), cupy.asarray(hb)
                backend.launch(graph)
                backend.synchronize()
                got = cupy.asnumpy(out)
                np.testing.assert_allclose(got, expected(ha, hb), rtol=1e-4, atol=1e-4, err_msg=f"replay {round}")
    finally:
        gemm.close()
