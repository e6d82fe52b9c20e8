"""Kernels of our own for the CUDA backend (workers/backends/cuda/kernels/device.py, qgemv.py), checked three
ways against gguf's dequantization (independent of ours):
- their CUDA C compiled for the CPU and run thread by thread (tests/cuda_on_host.py): the
  kernels' own arithmetic, in CI;
- the CUDA backend's qmatmul on the CuPy stand-in, which runs each kernel's NumPy twin: the
  launch, its arguments, and a device graph replaying it with new operands;
- on a GPU, each compiled kernel against its twin (skipped without one).
Plus: every source compiles with nvcc where it is installed, and a kernel that does not compile
stops the backend with an error naming it."""

from __future__ import annotations

import collections
import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest

from bench.qgemv import VARIANTS as QGEMV_VARIANTS
from split_state.errors import KernelCompileError
from split_state.quant import FORMATS, interleave
from split_state.sampling import Rule, pick
from tests import cuda_on_host
from tests.cupy_standin import install
from tests.cupy_standin import kernels as standin_kernels
from workers.backends.cuda.kernels import device, qgemv

pytestmark = pytest.mark.timeout(300)
gguf = pytest.importorskip("gguf")

QGEMV_SIGNATURE = (
    "const u8* w, const float* x, float* out, const float* addend, int add, int n, int lanes, int blocks, int xrows",
    "w, x, out, addend, add, n, lanes, blocks, xrows",
)


def random_blocks(fmt: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """(rows, blocks, block_bytes) of random quants with finite float16 factors near 1/16."""
    f = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, blocks, f.block_bytes), dtype=np.uint8)
    for at in f.factors:
        scale = rng.uniform(-1, 1, (rows, blocks)).astype(np.float16) / np.float16(16)
        data[..., at : at + 2] = scale[..., None].view(np.uint8).reshape(rows, blocks, 2)
    if fmt == "bf16":  # finite bfloat16s: the top half of float32s of a modest size
        bits = rng.standard_normal((rows, blocks)).astype(np.float32).view(np.uint32) >> 16
        data = bits.astype(np.uint16).view(np.uint8).reshape(rows, blocks, 2)
    return data


def gguf_values(fmt: str, blocks: np.ndarray) -> np.ndarray:
    """(rows, width) float64 by gguf's dequantization of the file-order blocks."""
    kind = gguf.GGMLQuantizationType[fmt.upper()]
    rows = blocks.shape[0]
    return gguf.quants.dequantize(blocks.reshape(rows, -1), kind).astype(np.float64).reshape(rows, -1)


# (format, output rows, lanes, blocks a row, x rows): uneven rows for a 32-row thread block, one
# lane (the file's order), blocks fewer and more than KSPLIT
CASES = [(fmt, 40, 8, 3, 1) for fmt in FORMATS] + [
    ("q4_1", 128, 64, 37, 2),
    ("q8_0", 7, 1, 5, 3),
    ("q6_k", 64, 64, 2, 1),
    ("q5_k", 24, 8, 1, 8),
]


def case_operands(fmt, rows, lanes, blocks, xrows, seed=0):
    file_blocks = random_blocks(fmt, rows, blocks, seed)
    w = np.ascontiguousarray(interleave(file_blocks, lanes))
    x = np.random.default_rng(seed + 1).standard_normal((xrows, blocks * FORMATS[fmt].block)).astype(np.float32)
    expected = x.astype(np.float64) @ gguf_values(fmt, file_blocks).T
    return w, x, expected


def tolerance(x: np.ndarray, fmt: str, w: np.ndarray) -> float:
    """float32 sums of `width` terms in another order than float64's: a few ulps of the largest
    partial sum, bounded by |x| . max|value| times the width."""
    return 1e-5 * float(np.abs(x).sum(axis=-1).max()) * 64 + 1e-6


def host_library(tmp_path_factory, source: str, names: dict):
    """A module's kernels compiled for the host (tests/cuda_on_host.py), or the test skipped."""
    if cuda_on_host.compiler() is None:
        pytest.skip("no C++ compiler to build the kernels for the host")
    return cuda_on_host.build(device.full_source(source), names, tmp_path_factory.mktemp("kernels"))


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    return host_library(tmp_path_factory, qgemv.SOURCE, {qgemv.kernel_name(fmt): QGEMV_SIGNATURE for fmt in FORMATS})


@pytest.mark.parametrize("fmt, rows, lanes, blocks, xrows", CASES)
def test_the_cuda_c_run_on_the_host_equals_gguf_dequantization(host_kernels, fmt, rows, lanes, blocks, xrows):
    """The product, and the product with an addend added as the sums are written (the
    qmatmul_add pattern's residual): the first plus the addend, bit for bit."""
    w, x, expected = case_operands(fmt, rows, lanes, blocks, xrows)
    out = np.full((xrows, rows), np.nan, np.float32)
    launch = getattr(host_kernels, f"host_{qgemv.kernel_name(fmt)}")
    grid = (-(-rows // qgemv.ROWS_PER_BLOCK), xrows)
    pointer = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    ints = [ctypes.c_int(v) for v in (*grid, qgemv.ROWS_PER_BLOCK, qgemv.KSPLIT)]
    sizes = [ctypes.c_int(v) for v in (rows, lanes, blocks, xrows)]
    unread = np.full(1, np.nan, np.float32)  # no addend: a NaN behind the pointer must not be read
    launch(*ints, pointer(w), pointer(x), pointer(out), pointer(unread), ctypes.c_int(0), *sizes)
    np.testing.assert_allclose(out, expected, rtol=0, atol=tolerance(x, fmt, w))
    addend = np.random.default_rng(2).standard_normal(out.shape).astype(np.float32) * 100
    summed = np.full_like(out, np.nan)
    launch(*ints, pointer(w), pointer(x), pointer(summed), pointer(addend), ctypes.c_int(1), *sizes)
    assert summed.tobytes() == (addend + out).tobytes()


@pytest.mark.parametrize("ksplit, block_rows", QGEMV_VARIANTS)
def test_every_thread_block_shape_bench_qgemv_times_computes_the_product(tmp_path_factory, ksplit, block_rows):
    """bench/qgemv.py times the kernel built for other thread blocks (rows x ksplit): each such
    build, run on the host, gives the product gguf's dequantization gives (uneven rows for the
    block, blocks fewer and more than ksplit, two x rows), so the fastest is a kernel the workers
    could take."""
    names = {qgemv.kernel_name(fmt): QGEMV_SIGNATURE for fmt in ("q4_1", "q8_0", "q4_k")}
    library = host_library(tmp_path_factory, qgemv.source_for(ksplit, block_rows), names)
    for fmt, rows, lanes, blocks, xrows in [("q4_1", 136, 8, 37, 2), ("q8_0", 7, 1, 5, 1), ("q4_k", 40, 8, 3, 1)]:
        w, x, expected = case_operands(fmt, rows, lanes, blocks, xrows)
        out = np.full((xrows, rows), np.nan, np.float32)
        pointer = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
        ints = [ctypes.c_int(v) for v in (-(-rows // block_rows), xrows, block_rows, ksplit)]
        sizes = [ctypes.c_int(v) for v in (rows, lanes, blocks, xrows)]
        unread = np.full(1, np.nan, np.float32)
        getattr(library, f"host_{qgemv.kernel_name(fmt)}")(
            *ints, pointer(w), pointer(x), pointer(out), pointer(unread), ctypes.c_int(0), *sizes
        )
        np.testing.assert_allclose(out, expected, rtol=0, atol=tolerance(x, fmt, w), err_msg=fmt)


@pytest.mark.parametrize("fmt, rows, lanes, blocks, xrows", CASES)
def test_the_backends_qmatmul_runs_the_kernel_on_the_standin(monkeypatch, fmt, rows, lanes, blocks, xrows):
    cp = install(monkeypatch)
    from workers.backends import cuda

    backend = cuda.Backend(0)
    w, x, expected = case_operands(fmt, rows, lanes, blocks, xrows)
    launched = []
    monkeypatch.setattr(qgemv, "launch", _spy(qgemv.launch, launched))
    xb = cp.asarray(x.reshape(xrows, blocks, FORMATS[fmt].block))
    out = cp.empty((xrows, rows // lanes, lanes), cp.float32)
    cuda.KERNELS["qmatmul"](cp, (xb, cp.asarray(w)), {"format": fmt}, out)
    got = backend.to_host(out).reshape(xrows, rows)
    assert launched == [fmt]
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance(x, fmt, w))


@pytest.mark.parametrize("fmt", ["q4_1", "q6_k"])
def test_the_backends_qmatmul_add_adds_the_residual_in_the_kernel_on_the_standin(monkeypatch, fmt):
    """The qmatmul_add pattern on the CUDA backend: a decode step's product and residual are one
    qgemv launch whose sums get the addend as they are written, the bits of the product then
    the add; an addend the kernel does not take (a bias broadcast over the rows) is the product,
    then the add."""
    cp = install(monkeypatch)
    from workers.backends import cuda

    cuda.Backend(0)
    rows, lanes, blocks, xrows = 64, 32, 2 if fmt == "q4_1" else 1, 2
    w, x, expected = case_operands(fmt, rows, lanes, blocks, xrows)
    launched = []
    monkeypatch.setattr(qgemv, "launch", _spy(qgemv.launch, launched))
    xb = cp.asarray(x.reshape(xrows, blocks, FORMATS[fmt].block))
    params = {"qmatmul": {"format": fmt}, "shape": (xrows, rows // lanes, lanes), "out": (xrows, rows)}
    product = cp.empty(params["shape"], cp.float32)
    cuda.KERNELS["qmatmul"](cp, (xb, cp.asarray(w)), params["qmatmul"], product)
    residual = np.random.default_rng(3).standard_normal((xrows, rows)).astype(np.float32) * 50
    out = cp.empty((xrows, rows), cp.float32)
    cuda.KERNELS["qmatmul_add"](cp, (xb, cp.asarray(w), cp.asarray(residual)), params, out)
    assert launched == [fmt, fmt]
    plain = residual + cp.asnumpy(product).reshape(xrows, rows)
    assert cp.asnumpy(out).tobytes() == plain.tobytes()
    np.testing.assert_allclose(cp.asnumpy(out), expected + residual, rtol=0, atol=tolerance(x, fmt, w))
    bias = residual[0]
    got = cuda.KERNELS["qmatmul_add"](cp, (xb, cp.asarray(w), cp.asarray(bias)), params, out)
    assert cp.asnumpy(got).tobytes() == (cp.asnumpy(product).reshape(xrows, rows) + bias).tobytes()


@pytest.fixture(scope="module")
def host_dequant(tmp_path_factory):
    from workers.backends.cuda.kernels import dequant

    signature = (
        "const u8* weight, float* out, int groups, int blocks, int lanes",
        "weight, out, groups, blocks, lanes",
    )
    return host_library(tmp_path_factory, dequant.SOURCE, {f"dequant_{n}": signature for n in dequant.FORMAT_NAMES})


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("rows, lanes, blocks", [(40, 8, 3), (7, 1, 5), (64, 32, 2)])
def test_the_dequantization_cuda_c_run_on_the_host_gives_gguf_values_bit_for_bit(
    host_dequant, fmt, rows, lanes, blocks
):
    """A prefill's tile dequantized by the kernel: gguf's own dequantization of the file's blocks,
    row g * lanes + l of the interleaved weight at row g * lanes + l, bit for bit (each value
    is one or two exactly rounded operations on exact operands)."""
    file_blocks = random_blocks(fmt, rows, blocks, 4)
    w = np.ascontiguousarray(interleave(file_blocks, lanes))
    out = np.full((rows, blocks * FORMATS[fmt].block), np.nan, np.float32)
    grid = [ctypes.c_int(v) for v in (-(-out.size // 256), 1, 256, 1)]
    sizes = [ctypes.c_int(v) for v in (w.shape[0], blocks, lanes)]
    pointer = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    getattr(host_dequant, f"host_dequant_{fmt}")(*grid, pointer(w), pointer(out), *sizes)
    assert out.tobytes() == gguf_values(fmt, file_blocks).astype(np.float32).tobytes()


@pytest.mark.parametrize("fmt", ["q4_1", "q5_0", "q6_k", "bf16"])
def test_a_prefills_product_dequantizes_its_tiles_with_the_kernel_on_the_standin(monkeypatch, fmt):
    """More rows of x than the decode kernels take: the weight dequantized a tile at a time (by
    the kernel for the formats it has, CuPy's expressions for bf16) and multiplied."""
    from workers.backends.cuda.kernels import dequant
    from workers.kernels import quant

    cp = install(monkeypatch)
    from workers.backends import cuda

    cuda.Backend(0)
    launched = []
    real = dequant.launch
    monkeypatch.setattr(dequant, "launch", lambda *a: launched.append(a[2]) or real(*a))
    several = quant.qmatmul_with(cuda._tile_product, cuda._dequantized, 4096)  # several tiles
    monkeypatch.setattr(cuda, "_tiled_qmatmul", several)
    rows, lanes, blocks, xrows = 64, 8, 8 if FORMATS[fmt].block == 32 else 1, qgemv.MAX_ROWS + 4
    w, x, expected = case_operands(fmt, rows, lanes, blocks, xrows)
    xb = cp.asarray(x.reshape(xrows, blocks, FORMATS[fmt].block))
    out = cp.empty((xrows, rows // lanes, lanes), cp.float32)
    cuda.KERNELS["qmatmul"](cp, (xb, cp.asarray(w)), {"format": fmt}, out)
    tiles = -(-(rows // lanes) // max(1, 4096 // (4 * blocks * FORMATS[fmt].block * lanes)))
    assert launched == ([fmt] * tiles if fmt in dequant.FORMAT_NAMES else [])
    got = cp.asnumpy(out).reshape(xrows, rows)
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance(x, fmt, w))


def _spy(fn, seen):
    def spy(xp, kernels, fmt, *args):
        seen.append(fmt)
        return fn(xp, kernels, fmt, *args)

    return spy


def test_more_rows_than_the_kernels_take_go_through_dequantized_tiles(monkeypatch):
    cp = install(monkeypatch)
    from workers.backends import cuda

    backend = cuda.Backend(0)
    xrows = qgemv.MAX_ROWS + 1
    w, x, expected = case_operands("q4_0", 64, 64, 4, xrows)
    launched = []
    monkeypatch.setattr(qgemv, "launch", _spy(qgemv.launch, launched))
    out = cp.empty((xrows, 1, 64), cp.float32)
    cuda.KERNELS["qmatmul"](cp, (cp.asarray(x.reshape(xrows, 4, 32)), cp.asarray(w)), {"format": "q4_0"}, out)
    assert launched == []
    np.testing.assert_allclose(backend.to_host(out).reshape(xrows, 64), expected, atol=tolerance(x, "q4_0", w))


def test_a_captured_product_replays_with_new_operands(monkeypatch):
    cp = install(monkeypatch)
    from workers.backends import cuda

    backend = cuda.Backend(0)
    w, x, _ = case_operands("q4_k", 64, 64, 2, 1)
    w2, x2, expected2 = case_operands("q4_k", 64, 64, 2, 1, seed=5)
    w_dev, x_dev = cp.asarray(w), cp.asarray(x.reshape(1, 2, 256))
    out = cp.empty((1, 1, 64), cp.float32)
    backend.begin_capture()
    cuda.KERNELS["qmatmul"](cp, (x_dev, w_dev), {"format": "q4_k"}, out)
    graph = backend.end_capture()
    w_dev.set(w2)
    x_dev.set(x2.reshape(1, 2, 256))
    backend.launch(graph)
    np.testing.assert_allclose(backend.to_host(out).reshape(1, 64), expected2, atol=tolerance(x2, "q4_k", w2))


def test_the_standin_refuses_a_strided_argument_and_a_kernel_it_does_not_know(monkeypatch):
    cp = install(monkeypatch)
    module = cp.RawModule(code=device.full_source(qgemv.SOURCE), options=device.OPTIONS)
    kernel = module.get_function("qgemv_q8_0")
    w = cp.zeros((2, 1, 34, 8), cp.uint8)
    x = cp.zeros((1, 64), cp.float32)[:, ::2]  # a strided view
    with pytest.raises(ValueError, match="C-contiguous"):
        kernel((1, 1), (32, 16), (w, x, cp.zeros(16, cp.float32), np.int32(16), np.int32(8), np.int32(1), np.int32(1)))
    with pytest.raises(standin_kernels.CompileException, match="qgemv_q9_9"):
        module.get_function("qgemv_q9_9")


def test_a_kernel_that_does_not_compile_stops_the_backend_naming_it(monkeypatch):
    cp = install(monkeypatch)
    from workers.backends import cuda

    def refuse(code, options=()):  # as CuPy's NVRTC run refuses a source
        raise standin_kernels.CompileException('kern.cu(301): error: identifier "acc2" is undefined')

    monkeypatch.setattr(cp, "RawModule", refuse)
    with pytest.raises(KernelCompileError, match=r"qgemv_q4_0, .*qgemv_bf16 did not compile: .*acc2") as caught:
        cuda.Backend(0)
    assert "\n" not in str(caught.value)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_every_kernel_source_compiles_with_nvcc(tmp_path):
    sources = {k.source for k in device.table().values()}
    for i, source in enumerate(sorted(sources)):
        path = tmp_path / f"module{i}.cu"
        path.write_text(device.full_source(source))
        done = subprocess.run(
            ["nvcc", "-ptx", "-arch=sm_80", *device.OPTIONS, "-o", str(tmp_path / "out.ptx"), str(path)],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "warning" not in done.stderr.lower(), done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_on_host.real_gpu(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"])
def test_on_a_gpu_the_dequantization_kernels_give_gguf_values_bit_for_bit(fmt):
    import cupy

    from workers.backends.cuda.kernels import dequant

    kernels = device.compile_all(cupy)
    file_blocks = random_blocks(fmt, 96, 5, 4)
    w = cupy.asarray(np.ascontiguousarray(interleave(file_blocks, 32)))
    got = cupy.asnumpy(dequant.launch(cupy, kernels, fmt, w))
    assert got.tobytes() == gguf_values(fmt, file_blocks).astype(np.float32).tobytes()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_on_host.real_gpu(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("fmt, rows, lanes, blocks, xrows", CASES)
def test_on_a_gpu_each_kernel_equals_its_twin(fmt, rows, lanes, blocks, xrows):
    import cupy

    kernels = device.compile_all(cupy)
    w, x, expected = case_operands(fmt, rows, lanes, blocks, xrows)
    out = cupy.full((xrows, rows), np.nan, cupy.float32)
    qgemv.launch(cupy, kernels, fmt, cupy.asarray(x), cupy.asarray(w), out)
    twin_out = np.full(xrows * rows, np.nan, np.float32)
    qgemv.qgemv_twin(fmt)(w.reshape(-1), x.reshape(-1), twin_out, twin_out, 0, rows, lanes, blocks, xrows)
    got = cupy.asnumpy(out)
    np.testing.assert_allclose(got, twin_out.reshape(xrows, rows), rtol=0, atol=tolerance(x, fmt, w))
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance(x, fmt, w))


SET_ROWS_SIGNATURE = (
    "void* dst, const float* value, const int* ids, const int* start, int fed, int batches, int heads, int ctx, "
    "int dim, int rows, int tokens",
    "(OUT*)dst, value, ids, start, fed, batches, heads, ctx, dim, rows, tokens",
)


@pytest.fixture(scope="module")
def host_set_rows(tmp_path_factory):
    from workers.backends.cuda.kernels import set_rows

    signature, args = SET_ROWS_SIGNATURE
    names = {
        f"set_rows_{kind}": (signature, args.replace("OUT", out))
        for kind, out in (("f32", "float"), ("f16", "unsigned short"))
    }
    return host_library(tmp_path_factory, set_rows.SOURCE, names)


@pytest.mark.parametrize("cache", [np.float32, np.float16])
@pytest.mark.parametrize("fed", [None, 1])
def test_the_set_rows_cuda_c_writes_each_row_at_its_position_and_skips_the_rest(host_set_rows, cache, fed):
    """Rows of the value at their positions of batch rows start + j (start fed, else 0 whatever
    the start pointer holds), float16 rounded as NumPy rounds (nearest even); positions outside
    the cache and batch rows past it are not written."""
    start = fed or 0
    rng = np.random.default_rng(3)
    batches, heads, ctx, dim, rows, tokens = 3, 2, 10, 5, 2, 3
    dst = rng.standard_normal((batches, heads, ctx, dim)).astype(cache)
    value = (rng.standard_normal((rows, heads, tokens, dim)) * 1e3).astype(np.float32)
    value[0, 0, 0, :3] = [1e-7, 65520.0, -3.0000001]  # a subnormal, one that rounds to inf, a tie
    ids = np.array([[4, 9, 10], [-1, 0, 7]], np.int32)
    expected = dst.copy()
    for j in range(rows):
        if start + j < batches:
            for t in range(tokens):
                if 0 <= ids[j, t] < ctx:
                    expected[start + j, :, ids[j, t], :] = value[j, :, t, :].astype(cache)
    kind = "f32" if cache == np.float32 else "f16"
    launch = getattr(host_set_rows, f"host_set_rows_{kind}")
    total = rows * heads * tokens * dim
    pointer = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    first = np.array([1 if fed is None else fed], np.int32)  # not fed: a 1 there must not be read
    ints = [ctypes.c_int(v) for v in (-(-total // 256), 1, 256, 1)]
    sizes = [ctypes.c_int(v) for v in (fed is not None, batches, heads, ctx, dim, rows, tokens)]
    launch(*ints, pointer(dst), pointer(value), pointer(ids), pointer(first), *sizes)
    np.testing.assert_array_equal(dst.view(np.uint8), expected.view(np.uint8))  # bit for bit, NaN-free


def test_a_captured_kv_write_reads_its_positions_on_the_device_at_each_replay(monkeypatch):
    """On the stand-in: the backend's set_rows, captured, is the kernel (its twin), and each
    replay writes at the positions the device holds then; run eagerly it is the shared kernel,
    which refuses a position outside the cache."""
    from split_state.errors import ShapeError
    from workers.backends.cuda.kernels import set_rows

    cp = install(monkeypatch)
    from workers.backends import cuda

    backend = cuda.Backend(0)
    launched = []
    real = set_rows.launch
    monkeypatch.setattr(set_rows, "launch", lambda *a: launched.append(1) or real(*a))
    cache = cp.zeros((1, 2, 8, 4), cp.float32)
    ids = cp.asarray(np.array([[3]], np.int32))
    value = cp.asarray(np.ones((1, 2, 1, 4), np.float32))
    params = {"axis": 2, "spans": [(0, 8, 0)], "rows": 8}
    backend.begin_capture()
    cuda.KERNELS["set_rows"](cp, (cache, ids, value), params)
    graph = backend.end_capture()
    backend.launch(graph)
    ids += 1
    value += 1
    backend.launch(graph)
    got = backend.to_host(cache)[0, :, :, 0]
    assert launched == [1]
    np.testing.assert_array_equal(got, [[0, 0, 0, 1, 2, 0, 0, 0]] * 2)
    with pytest.raises(ShapeError, match="ids must lie"):
        cuda.KERNELS["set_rows"](cp, (cache, cp.asarray(np.array([[8]], np.int32)), value), params)


ROWS_SIGNATURES = {
    "rows_f32": (
        "const float* table, const int* ids, float* out, int count, int width, int start, int stop, int local, "
        "int held",
        "table, ids, out, count, width, start, stop, local, held",
    ),
    "rows_q8_0": (
        "const u8* table, const int* ids, float* out, int count, int blocks, int lanes, int start, int stop, "
        "int local, int held",
        "table, ids, out, count, blocks, lanes, start, stop, local, held",
    ),
}


@pytest.fixture(scope="module")
def host_rows(tmp_path_factory):
    from workers.backends.cuda.kernels import get_rows

    return host_library(tmp_path_factory, get_rows.SOURCE, ROWS_SIGNATURES)


def _host_launch(library, name, *args):
    pointer = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    arrays, ints = args[:3], args[3:]
    total = arrays[2].size
    grid = [ctypes.c_int(v) for v in (-(-total // 256), 1, 256, 1)]
    getattr(library, f"host_{name}")(*grid, *(pointer(a) for a in arrays), *(ctypes.c_int(int(v)) for v in ints))


def test_the_lookup_cuda_c_reads_the_rows_this_device_holds_and_zeros_the_rest(host_rows):
    """This device holds table rows 100..139 (local rows 0..39); ids elsewhere, or past the
    table, look up zeros. Q8_0 against gguf's dequantization of the same blocks."""
    rng = np.random.default_rng(4)
    ids = np.array([100, 139, 5, 140, 120, -1], np.int32)
    held = 40
    table = rng.standard_normal((held, 64)).astype(np.float32)
    out = np.full((len(ids), 64), np.nan, np.float32)
    _host_launch(host_rows, "rows_f32", table, ids, out, len(ids), 64, 100, 140, 0, held)
    expected = np.zeros_like(out)
    for t, i in enumerate(ids):
        if 100 <= i < 140:
            expected[t] = table[i - 100]
    np.testing.assert_array_equal(out, expected)
    blocks = random_blocks("q8_0", held, 2, seed=9)
    values = gguf_values("q8_0", blocks).astype(np.float32)
    interleaved = np.ascontiguousarray(interleave(blocks, 8))
    out = np.full((len(ids), 64), np.nan, np.float32)
    _host_launch(host_rows, "rows_q8_0", interleaved, ids, out, len(ids), 2, 8, 100, 140, 0, held)
    expected = np.zeros_like(out)
    for t, i in enumerate(ids):
        if 100 <= i < 140:
            expected[t] = values[i - 100]
    np.testing.assert_array_equal(out, expected)


def test_a_captured_lookup_reads_its_ids_on_the_device_at_each_replay(monkeypatch):
    from split_state.errors import ShapeError

    cp = install(monkeypatch)
    from workers.backends import cuda

    backend = cuda.Backend(0)
    table = cp.asarray(np.arange(40, dtype=np.float32).reshape(10, 4))
    ids = cp.asarray(np.array([[3]], np.int32))
    out = cp.empty((1, 1, 4), cp.float32)
    params = {"rows": 10, "spans": [(0, 10, 0)]}
    backend.begin_capture()
    cuda.KERNELS["get_rows"](cp, (table, ids), params, out)
    graph = backend.end_capture()
    backend.launch(graph)
    ids += 4
    backend.launch(graph)
    np.testing.assert_array_equal(backend.to_host(out).reshape(4), [28, 29, 30, 31])
    with pytest.raises(ShapeError, match="ids must lie"):  # eagerly: checked on the host
        cuda.KERNELS["get_rows"](cp, (table, cp.asarray(np.array([[10]], np.int32))), params, out)


ATTEND_SIGNATURES = {
    "attend_part_KIND": (
        "const float* q, const void* k, const void* v, const float* mask, float* part, int heads, int group, "
        "int tokens, int ctx, int dim, long mask_batch, float scale, int chunks",
        "q, (const KT*)k, (const KT*)v, mask, part, heads, group, tokens, ctx, dim, mask_batch, scale, chunks",
    ),
    "attend_map_KIND": (
        "const float* q, const void* k, const void* v, const float* mask, float* part, const int* kv_of, int heads, "
        "int kv_heads, int tokens, int ctx, int dim, long mask_batch, float scale, int chunks",
        "q, (const KT*)k, (const KT*)v, mask, part, kv_of, heads, kv_heads, tokens, ctx, dim, mask_batch, scale, "
        "chunks",
    ),
    "attend_combine": ("const float* part, float* out, int chunks, int dim", "part, out, chunks, dim"),
}


def _built_with_barriers(tmp_path_factory, source: str, names: dict):
    """A kernel module built for the host with real barriers (tests/cuda_on_host.py), or the test
    skipped where no C++ compiler is at hand."""
    if cuda_on_host.compiler() is None:
        pytest.skip("no C++ compiler to build the kernels for the host")
    return cuda_on_host.build(device.full_source(source), names, tmp_path_factory.mktemp("kernels"), barriers=True)


@pytest.fixture(scope="module")
def host_attend(tmp_path_factory):
    from workers.backends.cuda.kernels import attend

    names = {"attend_combine": ATTEND_SIGNATURES["attend_combine"]}
    for layout in ("part", "map"):
        signature, args = ATTEND_SIGNATURES[f"attend_{layout}_KIND"]
        for kind, kt in (("f32", "float"), ("f16", "unsigned short")):
            names[f"attend_{layout}_{kind}"] = (signature, args.replace("KT", kt))
    return _built_with_barriers(tmp_path_factory, attend.SOURCE, names)


def attention_oracle(q, keys, values, mask, scale):
    """float64 softmax(q . k * scale + mask) @ v for each (b, h, g, t) row, from the definition."""
    batch, heads, group, tokens, dim = q.shape
    out = np.empty(q.shape, np.float64)
    for b, h, g, t in np.ndindex(batch, heads, group, tokens):
        scores = keys[b, h].astype(np.float64) @ q[b, h, g, t] * scale + mask[min(b, mask.shape[0] - 1), 0, 0, t]
        with np.errstate(invalid="ignore"):
            weights = np.exp(scores - scores.max())
            out[b, h, g, t] = weights @ values[b, h].astype(np.float64) / weights.sum()
    return out


def attention_case(cache, batch=2, heads=2, group=2, tokens=2, ctx=600, dim=40, seed=6):
    """Queries, caches and a mask opening each row's first positions (row-dependent, across the
    chunk boundaries, one batch row past the first chunk only) and, for token 1 of batch row 1,
    a hole in the middle."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, group, tokens, dim)).astype(np.float32)
    keys = rng.standard_normal((batch, heads, ctx, dim)).astype(cache)
    values = rng.standard_normal((batch, heads, ctx, dim)).astype(cache)
    mask = np.full((batch, 1, 1, tokens, ctx), -np.inf, np.float32)
    for b, t in np.ndindex(batch, tokens):
        mask[b, 0, 0, t, : [[5, 6], [300, 513]][b % 2][t] + 1] = 0
    if tokens > 1:
        mask[1, 0, 0, 1, 100:200] = -np.inf
    mask[0, 0, 0, 0, 3] = -0.5  # an additive bias, not only 0 and -inf
    return q, keys, values, mask


def _run_attend_on_host(library, q, keys, values, mask, scale, kv_of_head=None):
    """The decoder's layout's kernels (attend_part_*), or with `kv_of_head` the mapped ones
    (attend_map_*, q in the gqa_attention op's layout), then attend_combine."""
    from workers.backends.cuda.kernels import attend

    ctx, dim = keys.shape[2], q.shape[-1]
    if kv_of_head is None:
        layout, (_, heads, group, tokens, _) = "part", q.shape
        extra, sizes = [], (heads, group)
    else:
        layout, (_, tokens, heads, _) = "map", q.shape
        extra, sizes = [np.array(kv_of_head, np.int32)], (heads, keys.shape[1])
    rows, chunks = q.size // dim, -(-ctx // attend.CHUNK)
    part = np.full(rows * chunks * (dim + 2), np.nan, np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    kind = "f32" if keys.dtype == np.float32 else "f16"
    pointer = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    ints = [ctypes.c_int(v) for v in (rows, chunks, attend.THREADS, 1)]
    sizes = [ctypes.c_int(v) for v in (*sizes, tokens, ctx, dim)]
    mask_batch = ctypes.c_long(tokens * ctx if mask.shape[0] > 1 else 0)
    operands = [pointer(a) for a in (q, keys, values, mask, part, *extra)]
    last = (mask_batch, ctypes.c_float(scale), ctypes.c_int(chunks))
    getattr(library, f"host_attend_{layout}_{kind}")(*ints, *operands, *sizes, *last)
    grid = [ctypes.c_int(v) for v in (rows, 1, min(attend.THREADS, dim), 1)]
    library.host_attend_combine(*grid, pointer(part), pointer(out), ctypes.c_int(chunks), ctypes.c_int(dim))
    return out


@pytest.mark.parametrize("cache", [np.float32, np.float16])
def test_the_attention_cuda_c_run_on_the_host_equals_softmax_attention(host_attend, cache):
    """The two passes over three chunks of 256 positions (one of them closed for some rows), a
    float32 or float16 cache, GQA's group of two, two query tokens with masks of their own, the
    mask's batch rows: softmax attention from its definition in float64."""
    q, keys, values, mask = attention_case(cache)
    scale = 1 / np.sqrt(q.shape[-1])
    got = _run_attend_on_host(host_attend, q, keys, values, mask, scale)
    np.testing.assert_allclose(got, attention_oracle(q, keys, values, mask, scale), rtol=1e-5, atol=2e-6)


def test_the_attention_cuda_c_gives_nan_for_a_row_that_sees_nothing(host_attend):
    """As the softmax of a row of -inf: 0 / 0. A mask shared by the batch (its one row)."""
    q, keys, values, mask = attention_case(np.float32, batch=2, tokens=1, ctx=40)
    mask = mask[:1].copy()
    mask[0, 0, 0, 0, :] = -np.inf
    got = _run_attend_on_host(host_attend, q, keys, values, mask, 0.5)
    assert np.isnan(got).all()


def gqa_oracle(q, keys, values, mask, kv_of_head, scale):
    """float64 softmax(q . k * scale + mask) @ v for each (b, t, h) row of the gqa_attention
    op's layout, query head h reading KV head kv_of_head[h], from the definition."""
    batch, tokens, heads, dim = q.shape
    out = np.empty(q.shape, np.float64)
    for b, t, h in np.ndindex(batch, tokens, heads):
        kv = kv_of_head[h]
        scores = keys[b, kv].astype(np.float64) @ q[b, t, h] * scale + mask[min(b, mask.shape[0] - 1), t]
        with np.errstate(invalid="ignore"):
            weights = np.exp(scores - scores.max())
            out[b, t, h] = weights @ values[b, kv].astype(np.float64) / weights.sum()
    return out


# 5 query heads over 3 KV heads as a device holding cut groups at both ends sees them (HeadSplit):
# head 0 reads KV head 0, heads 1-3 KV head 1, head 4 KV head 2; no h // group gives that map
GQA_MAP = (0, 1, 1, 1, 2)


def gqa_case(cache, batch=2, tokens=2, ctx=600, dim=40, seed=7):
    """attention_case's queries, caches and mask in the gqa_attention op's layout."""
    q, keys, values, mask = attention_case(cache, batch, 3, 2, tokens, ctx, dim, seed)
    q = np.ascontiguousarray(q.reshape(batch, 6, tokens, dim)[:, :5].transpose(0, 2, 1, 3))
    return q, keys, values, np.ascontiguousarray(mask[:, 0, 0])


@pytest.mark.parametrize("cache", [np.float32, np.float16])
def test_the_mapped_attention_cuda_c_run_on_the_host_reads_each_heads_kv_head(host_attend, cache):
    """The gqa_attention op's layout: 5 query heads over 3 KV heads by a map no group size gives,
    two batch rows with masks of their own, two tokens, three chunks: softmax attention from its
    definition in float64."""
    q, keys, values, mask = gqa_case(cache)
    scale = 1 / np.sqrt(q.shape[-1])
    got = _run_attend_on_host(host_attend, q, keys, values, mask, scale, GQA_MAP)
    np.testing.assert_allclose(got, gqa_oracle(q, keys, values, mask, GQA_MAP, scale), rtol=1e-5, atol=2e-6)


TOP_K_SIGNATURE = (
    "int source, const float* floats, const double* doubles, const int* ints, long row_stride, int n, int start, "
    "int keep, double* kept_v, int* kept_i, double* pairs, int k, int width, int last",
    "source, floats, doubles, ints, row_stride, n, start, keep, kept_v, kept_i, pairs, k, width, last",
)


@pytest.fixture(scope="module")
def host_top_k(tmp_path_factory):
    from workers.backends.cuda.kernels import top_k

    return _built_with_barriers(tmp_path_factory, top_k.SOURCE, {"top_k_tile": TOP_K_SIGNATURE})


def best_k_oracle(values, index, k, width):
    """(width, 2): the k best (value, index) pairs by sorted() on (-value, index, -1 last), NaN as
    -inf, then (-inf, -1) padding."""
    values = [(-np.inf if np.isnan(v) else float(v), int(i)) for v, i in zip(values, index)]
    ranked = sorted(values, key=lambda e: (-e[0], e[1] < 0, e[1]))[:k]
    ranked += [(-np.inf, -1)] * (width - len(ranked))
    return np.array(ranked, np.float64)


@pytest.mark.parametrize("n, k, width", [(5000, 40, 40), (300, 1, 2), (2048, 256, 256), (4500, 256, 300), (3, 8, 8)])
def test_the_top_k_cuda_c_run_on_the_host_picks_the_best_k(host_top_k, monkeypatch, n, k, width):
    """Over one pass (a row within a tile) and several (tiles of tiles), k from greedy's 1 to
    the sampling pool's 256, fewer entries than k: ties broken by the lower index, NaN ranked
    and given as -inf, a row of its own each; then the devices' candidates as pairs. Blocks of
    64 threads (the kernel strides by its block's width; an OS thread each costs here)."""
    from workers.backends.cuda.kernels import top_k

    monkeypatch.setattr(top_k, "THREADS", 64)

    rng = np.random.default_rng(n + k)
    x = rng.integers(-50, 50, (2, n)).astype(np.float32)  # many ties
    x[0, :: max(1, n // 7)] = np.nan
    x[1, -1] = 1e9
    out = np.full((2, width, 2), np.nan)
    top_k.select(np, cuda_on_host.HostKernels(host_top_k), top_k.FROM_FLOATS, x, n, 1000, k, width, out)
    for r in range(2):
        np.testing.assert_array_equal(out[r], best_k_oracle(x[r], np.arange(1000, 1000 + n), k, width))
    pairs = np.stack([x.astype(np.float64), np.tile(np.arange(n, dtype=np.float64)[::-1], (2, 1))], axis=-1)
    pairs[:, ::3] = (-np.inf, -1)  # padding entries of devices with fewer than k
    merged = np.full((2, k, 2), np.nan)
    top_k.select(np, cuda_on_host.HostKernels(host_top_k), top_k.FROM_PAIRS, pairs, n, 0, k, k, merged)
    for r in range(2):
        np.testing.assert_array_equal(merged[r], best_k_oracle(pairs[r, :, 0], pairs[r, :, 1], k, k))


def captured_attention(monkeypatch, module, op, q, keys, values, mask, changed=None):
    """The CUDA backend's `op` on the stand-in (the kernels' twins) over q, keys and values and
    the mask (for attention the decoder's views: the keys transposed, as the decoder multiplies by
    them; for gqa_attention the op's layout, heads mapped by GQA_MAP), scale 0.25: a step's first
    run (eager), its capture, then `changed(q, mask) -> (q, mask)` set on the device and the
    graph replayed (`changed` None: no capture). Returns (the first run's result, the replay's,
    the calls of `module`'s launcher for the op)."""
    cp = install(monkeypatch)
    from workers.backends import cuda

    backend = cuda.Backend(0)
    launched = []
    launcher = "launch" if op == "attention" else "launch_mapped"
    real = getattr(module, launcher)
    monkeypatch.setattr(module, launcher, lambda *a, **k: launched.append(1) or real(*a, **k))
    q_dev, mask_dev = cp.asarray(q), cp.asarray(mask)
    if op == "attention":
        batch, heads, _, _, dim = q.shape
        ctx = keys.shape[2]
        k_view = cp.asarray(keys).reshape(batch, heads, 1, ctx, dim).transpose(0, 1, 2, 4, 3)
        v_view = cp.asarray(values).reshape(batch, heads, 1, ctx, dim)
        operands, params = (q_dev, k_view, mask_dev, v_view), {"scale": 0.25, "bucket": 32}
    else:
        operands = (q_dev, cp.asarray(keys), cp.asarray(values), mask_dev)
        params = {"scale": 0.25, "kv_of_head": list(GQA_MAP)}
    out = cp.empty(q.shape, cp.float32)
    cuda.KERNELS[op](cp, operands, params, out)  # a step's first run: eager
    backend.synchronize()  # a twin that failed says so (the stand-in's failures are per stream)
    first = backend.to_host(out).copy()
    if changed is None:
        return first, None, launched
    backend.begin_capture()
    cuda.KERNELS[op](cp, operands, params, out)
    graph = backend.end_capture()
    q2, mask2 = changed(q, mask)
    mask_dev.set(mask2)
    q_dev.set(q2)
    backend.launch(graph)
    return first, backend.to_host(out), launched


@pytest.mark.parametrize("op", ["attention", "gqa_attention"])
@pytest.mark.parametrize("cache", [np.float32, np.float16])
def test_a_captured_attention_reads_the_open_positions_on_the_device_at_each_replay(monkeypatch, cache, op):
    """On the stand-in (the kernels' twins): the backend's attention over the decoder's views, and
    its gqa_attention (each query head over its own KV head), are the kernels, captured once
    after a first eager run; a replay after the mask opens more positions and the query changes
    attends over the new positions, as softmax attention from its definition."""
    from workers.backends.cuda.kernels import attend

    if op == "attention":
        q, keys, values, mask = attention_case(cache, tokens=1, ctx=300)
        oracle = lambda q, mask: attention_oracle(q, keys, values, mask, 0.25)  # noqa: E731
    else:
        q, keys, values, mask = gqa_case(cache, tokens=1, ctx=300)
        oracle = lambda q, mask: gqa_oracle(q, keys, values, mask, GQA_MAP, 0.25)  # noqa: E731

    def changed(q, mask):
        mask = mask.copy()
        mask[..., :290] = 0  # the next steps' positions, past the first chunk
        return (q * 2).astype(np.float32), mask

    _, replayed, launched = captured_attention(monkeypatch, attend, op, q, keys, values, mask, changed)
    assert launched == [1, 1]
    np.testing.assert_allclose(replayed, oracle(*changed(q, mask)), rtol=1e-5, atol=2e-6)


def test_a_device_holding_no_heads_runs_an_empty_gqa_attention_in_its_graph(monkeypatch):
    """More devices than query heads (HeadSplit.even_queries gives the last none): the step is
    still the mapped kernels' (captured, nothing launched), its output empty."""
    cp = install(monkeypatch)
    from workers.backends import cuda

    backend = cuda.Backend(0)
    q, cache = cp.empty((1, 1, 0, 64), cp.float32), cp.empty((1, 0, 40, 64), cp.float32)
    mask = cp.zeros((1, 1, 40), cp.float32)
    out = cp.empty((1, 1, 0, 64), cp.float32)
    params = {"scale": 0.125, "kv_of_head": []}
    cuda.KERNELS["gqa_attention"](cp, (q, cache, cache, mask), params, out)
    backend.begin_capture()
    got = cuda.KERNELS["gqa_attention"](cp, (q, cache, cache, mask), params, out)
    backend.launch(backend.end_capture())
    assert got is out and backend.to_host(out).shape == (1, 1, 0, 64)


def test_a_captured_top_k_picks_on_the_device_at_each_replay(monkeypatch):
    """On the stand-in: the backend's top_k_candidates (this device's span of the vocabulary)
    and top_k_combine (the devices' candidates) are the kernels, captured once and replayed on
    new logits, against the order from its definition."""
    cp = install(monkeypatch)
    from workers.backends import cuda

    backend = cuda.Backend(0)
    rng = np.random.default_rng(8)
    logits = cp.asarray(rng.standard_normal((1, 1, 3000)).astype(np.float32))
    candidates = cp.empty((1, 1, 40, 2), cp.float64)
    best = cp.empty((1, 1, 20, 2), cp.float64)
    params = {"k": 20, "width": 40, "spans": [(5000, 2500, 100)], "devices": 2}
    backend.begin_capture()
    cuda.KERNELS["top_k_candidates"](cp, (logits,), params, candidates)
    cuda.KERNELS["top_k_combine"](cp, (candidates,), {"k": 20}, best)
    graph = backend.end_capture()
    new = rng.integers(-5, 5, (1, 1, 3000)).astype(np.float32)  # ties
    logits.set(new)
    backend.launch(graph)
    span = new[0, 0, 100:2600]
    want = best_k_oracle(span, np.arange(5000, 7500), 20, 40)
    np.testing.assert_array_equal(backend.to_host(candidates)[0, 0], want)
    np.testing.assert_array_equal(backend.to_host(best)[0, 0], want[:20])


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_on_host.real_gpu(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("cache", [np.float32, np.float16])
def test_on_a_gpu_attention_and_top_k_equal_their_twins(cache):
    """The compiled attention, in both layouts, against its definition (as its twin is held to it
    above) and the compiled top k against the order's definition, bit for bit."""
    import cupy

    from workers.backends.cuda.kernels import attend, top_k

    kernels = device.compile_all(cupy)
    q, keys, values, mask = attention_case(cache)
    out = cupy.full(q.shape, np.nan, cupy.float32)
    mask_batch = q.shape[3] * keys.shape[2]
    operands = (cupy.asarray(a) for a in (q, keys, values, mask))
    attend.launch(cupy, kernels, *operands, mask_batch, 0.2, out)
    expected = attention_oracle(q, keys, values, mask, 0.2)
    np.testing.assert_allclose(cupy.asnumpy(out), expected, rtol=1e-5, atol=2e-6)
    q, keys, values, mask = gqa_case(cache)
    out = cupy.full(q.shape, np.nan, cupy.float32)
    kv_of = cupy.asarray(np.array(GQA_MAP, np.int32))
    operands = [cupy.asarray(a) for a in (q, keys, values, mask)]
    attend.launch_mapped(cupy, kernels, *operands, q.shape[1] * keys.shape[2], kv_of, 0.2, out)
    expected = gqa_oracle(q, keys, values, mask, GQA_MAP, 0.2)
    np.testing.assert_allclose(cupy.asnumpy(out), expected, rtol=1e-5, atol=2e-6)
    x = np.random.default_rng(2).integers(-50, 50, (2, 9000)).astype(np.float32)
    pairs = cupy.full((2, 300, 2), np.nan, cupy.float64)
    top_k.select(cupy, kernels, top_k.FROM_FLOATS, cupy.asarray(x), 9000, 7, 256, 300, pairs)
    for r in range(2):
        np.testing.assert_array_equal(cupy.asnumpy(pairs)[r], best_k_oracle(x[r], np.arange(7, 9007), 256, 300))


SAMPLE_SIGNATURE = (
    "const float* values, const long long* indices, int k, int top_k, double temperature, double top_p, "
    "double min_p, double penalty, int* recent, int window, int* cursor, const double* uniforms, int draw, "
    "int* tokens, int* positions, int* chosen",
    "values, indices, k, top_k, temperature, top_p, min_p, penalty, recent, window, cursor, uniforms, draw, "
    "tokens, positions, chosen",
)


@pytest.fixture(scope="module")
def host_sample(tmp_path_factory):
    from workers.backends.cuda.kernels import sample

    return _built_with_barriers(tmp_path_factory, sample.SOURCE, {"sample_next": SAMPLE_SIGNATURE})


SAMPLE_RULES = [
    Rule(),
    Rule(0.0, repeat_penalty=2.0, repeat_last_n=4),
    Rule(0.7),
    Rule(1.0, top_k=6),
    Rule(0.9, top_p=0.8),
    Rule(1.3, min_p=0.2),
    Rule(0.8, top_k=9, top_p=0.95, min_p=0.05, repeat_penalty=1.7, repeat_last_n=5),
    Rule(2.0, repeat_penalty=0.5, repeat_last_n=3),  # a penalty below 1 raises the seen ones
]


@pytest.mark.parametrize("rule", SAMPLE_RULES, ids=range(len(SAMPLE_RULES)))
def test_the_sampler_cuda_c_run_on_the_host_chooses_what_the_host_rule_chooses(host_sample, monkeypatch, rule):
    """The device sampler's CUDA C (three sequences a launch, over several draws) against the
    host's rule (split_state/sampling.py pick, itself held to the definitions in
    tests/test_sampling.py): the same token for each sequence, each draw; the fed token and
    position written, the ring of recent tokens moved on as a deque of the window would be."""
    from workers.backends.cuda.kernels import sample

    monkeypatch.setattr(sample, "THREADS", 16)  # the kernel strides by its block; an OS thread each here
    rows, k, draws = 3, 24, 6
    rng = np.random.default_rng(hash(rule) % 1000)
    window = rule.penalized
    ring = np.full((rows, max(window, 1)), -1, np.int32)
    cursor = np.zeros(rows, np.int32)
    seen = [collections.deque(maxlen=window) for _ in range(rows)]
    uniforms = rng.random((draws, rows))
    tokens, positions = np.zeros(rows, np.int32), np.arange(rows, dtype=np.int32) * 10
    chosen = np.full(rows, -7, np.int32)
    for draw in range(draws):
        # candidates best first as top_k gives them: value descending, ties to the lower index
        values = np.sort(rng.integers(-6, 6, (rows, 1, k)).astype(np.float32) / 2, axis=-1)[..., ::-1].copy()
        indices = np.stack([np.sort(rng.choice(40, k, replace=False)) for _ in range(rows)])[:, None].astype(np.int64)
        values[2, 0, -3:] = -np.inf  # a device short of k candidates: padding last
        indices[2, 0, -3:] = -1
        want = [
            pick(values[r, 0], indices[r, 0], rule, None if rule.greedy else uniforms[draw, r], list(seen[r]))
            for r in range(rows)
        ]
        args = (
            values,
            indices,
            np.int32(k),
            np.int32(rule.top_k),
            np.float64(rule.temperature),
            np.float64(rule.top_p),
            np.float64(rule.min_p),
            np.float64(rule.repeat_penalty),
            ring,
            np.int32(window),
            cursor,
            uniforms,
            np.int32(draw),
            tokens,
            positions,
            chosen,
        )
        cuda_on_host.launch(host_sample, "sample_next", (rows,), (sample.THREADS,), args)
        assert chosen.tolist() == want and tokens.tolist() == want, draw
        for r in range(rows):
            seen[r].append(want[r])
            if window:  # the ring holds the window's tokens, whatever their order
                assert sorted(t for t in ring[r] if t >= 0) == sorted(seen[r])
    np.testing.assert_array_equal(positions, np.arange(rows) * 10 + draws)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_on_host.real_gpu(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("rule", SAMPLE_RULES, ids=range(len(SAMPLE_RULES)))
def test_on_a_gpu_the_sampler_chooses_what_the_host_rule_chooses(rule):
    """The compiled sampler against the host's rule: the same tokens (the device's exp may round
    apart from NumPy's by an ulp; no draw here falls inside such a gap)."""
    import cupy

    from workers.backends.cuda.kernels import sample

    kernel = device.compile_all(cupy)["sample_next"]
    rows, k = 4, 200
    rng = np.random.default_rng(3)
    values = np.sort(rng.normal(size=(rows, 1, k)).astype(np.float32), axis=-1)[..., ::-1].copy()
    indices = np.stack([rng.permutation(5000)[:k] for _ in range(rows)])[:, None].astype(np.int64)
    recent = [list(indices[r, 0, ::7][: rule.penalized]) for r in range(rows)]
    tokens, positions = cupy.zeros(rows, cupy.int32), cupy.zeros(rows, cupy.int32)

    def read_later(array):
        return lambda: cupy.asnumpy(array)

    sampler = sample.DeviceSampler(
        cupy, kernel, read_later, rule, np.random.default_rng(9), 1, recent, values, tokens, positions
    )
    got = sampler.launch(0, cupy.asarray(values), cupy.asarray(indices))()
    draws = np.random.default_rng(9).random((1, rows))
    want = [
        pick(values[r, 0], indices[r, 0], rule, None if rule.greedy else draws[0, r], recent[r]) for r in range(rows)
    ]
    assert got == want and cupy.asnumpy(tokens).tolist() == want


def test_the_device_samplers_ring_before_it_is_full_penalizes_only_what_was_seen():
    """A generation of one token so far, a repeat window of 4: the ring holds it (and -1 for the
    slots not yet written) with the next write after it. Greedy with a harsh penalty over fixed
    candidates, the twin must choose as a deque of the window would: 7, 9, 11, 13, then 5 again
    once 5 has left the window (a ring that wrote over its first token would choose 5 at once)."""
    from workers.backends.cuda.kernels import sample

    rule = Rule(0.0, repeat_penalty=10.0, repeat_last_n=4)
    values = np.array([[[2.0, 1.5, 1.0, 0.5, 0.25, 0.125]]], np.float32)
    indices = np.array([[[5, 7, 9, 11, 13, 15]]], np.int64)
    tokens, positions = np.zeros(1, np.int32), np.zeros(1, np.int32)

    def twin(grid, block, args):
        sample._sample_next(*[a.reshape(-1) if isinstance(a, np.ndarray) else a for a in args])

    sampler = sample.DeviceSampler(
        np, twin, lambda a: lambda: a.copy(), rule, None, 5, [[5]], values, tokens, positions
    )
    assert sampler.ring.tolist() == [[5, -1, -1, -1]] and sampler.cursor.tolist() == [1]
    seen = collections.deque([5], maxlen=4)
    for step in range(5):
        (got,) = sampler.launch(step, values, indices)()
        assert got == pick(values[0, 0], indices[0, 0], rule, None, list(seen)), step
        seen.append(got)
    assert list(seen) == [9, 11, 13, 5]


@pytest.mark.parametrize("cache", [np.float32, np.float16])
def test_the_set_rows_twin_skips_a_negative_position_as_the_kernel_does(cache):
    """A position outside [0, ctx) (-1: a row with nothing to write) is skipped by the kernel's
    bounds check; NumPy would write it at ctx - 1."""
    from workers.backends.cuda.kernels import set_rows

    batches, heads, ctx, dim, rows, tokens = 2, 1, 4, 2, 2, 2
    dst = np.zeros((batches, heads, ctx, dim), cache)
    value = np.arange(1, 1 + rows * heads * tokens * dim, dtype=np.float32)
    ids = np.array([[-1, 1], [2, ctx]], np.int32)  # -1 and ctx: outside
    twin = set_rows.twin(cache)
    flat = dst.reshape(-1).view(np.uint16) if cache == np.float16 else dst.reshape(-1)
    twin(
        flat,
        value,
        ids.reshape(-1),
        ids.reshape(-1),
        np.int32(0),
        *(np.int32(v) for v in (batches, heads, ctx, dim, rows, tokens)),
    )
    expected = np.zeros_like(dst)
    expected[0, 0, 1] = [3, 4]  # row 0's second token
    expected[1, 0, 2] = [5, 6]  # row 1's first token
    np.testing.assert_array_equal(dst, expected)


# the C library's constants a kernel might use: NVRTC (CuPy's compiler) has no math.h, so each
# must come from the prelude where the source compiles for a device
LIBRARY_MACROS = ("INFINITY", "NAN", "HUGE_VALF", "HUGE_VAL", "FLT_MAX", "M_PI")


@pytest.mark.skipif(cuda_on_host.compiler() is None, reason="no C++ compiler to preprocess the kernels with")
def test_every_kernel_source_preprocessed_as_nvrtc_sees_it_uses_no_math_h_constant():
    """Each kernel module's full source through the C preprocessor as NVRTC compiles it
    (__CUDACC_RTC__ defined, no headers): no constant of math.h is left undefined. CUDA 13's
    NVRTC on an H200 refused the attention and top-k kernels' INFINITY, and every CUDA worker
    with them."""
    preprocessor = cuda_on_host.compiler()
    for source in {kernel.source for kernel in device.table().values()}:
        done = subprocess.run(
            [preprocessor, "-E", "-P", "-x", "c++", "-nostdinc", "-D__CUDACC_RTC__", "-"],
            input=device.full_source(source),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        words = set(re.findall(r"[A-Za-z_]\w*", done.stdout))
        assert not words & set(LIBRARY_MACROS), sorted(words & set(LIBRARY_MACROS))
