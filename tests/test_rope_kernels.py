"""Rope's kernels of our own for the CUDA backend (workers/backends/cuda/kernels/rope.py): the rotation and the
keys' rotation fused with their KV-cache write, checked against the reference decoder's rope
(models/reference.py, float64) and a cache written by hand:
- their CUDA C compiled for the CPU and run thread by thread (tests/cuda_on_host.py), in CI;
- the CUDA backend's kernels on the CuPy stand-in (which runs the twins): the launch, the
  arithmetic of the shared kernel bit for bit, a captured write reading its positions on the
  device at each replay, an eager one refusing a position outside the cache;
- on a GPU, the compiled kernels against their twins (skipped without one)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from models import reference as ref
from tests import cuda_on_host
from tests.cupy_standin import install
from workers.backends.cuda.kernels import device, rope
from workers.kernels import basic

pytestmark = pytest.mark.timeout(120)

ROPE_SIGNATURE = (
    "float* out, const float* x, const int* positions, const double* inverse, int count, int heads, int dim, int neox",
    "out, x, positions, inverse, count, heads, dim, neox",
)
WRITE_SIGNATURE = (
    "void* dst, const float* x, const int* positions, const double* inverse, const int* ids, const int* start, "
    "int fed, int batches, int heads, int ctx, int dim, int rows, int tokens, int neox",
    "(OUT*)dst, x, positions, inverse, ids, start, fed, batches, heads, ctx, dim, rows, tokens, neox",
)
BASE = 500.0


def inverse(dim: int, freqs=None) -> np.ndarray:
    """base^(-2i / dim) * freqs[i], written out."""
    out = np.array([BASE ** (-2 * i / dim) for i in range(dim // 2)])
    return out if freqs is None else out * np.asarray(freqs)


def pointer(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def grid(total: int) -> list:
    return [ctypes.c_int(v) for v in (-(-total // rope.THREADS), 1, rope.THREADS, 1)]


@pytest.fixture(scope="module")
def host_rope(tmp_path_factory):
    if cuda_on_host.compiler() is None:
        pytest.skip("no C++ compiler to build the kernels for the host")
    signature, args = WRITE_SIGNATURE
    names = {"rope_f32": ROPE_SIGNATURE}
    names.update(
        {
            f"rope_write_{k}": (signature, args.replace("OUT", t))
            for k, t in (("f32", "float"), ("f16", "unsigned short"))
        }
    )
    return cuda_on_host.build(device.full_source(rope.SOURCE), names, tmp_path_factory.mktemp("rope"))


@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_the_rope_cuda_c_turns_each_pair_by_its_positions_angle(host_rope, mode):
    rng = np.random.default_rng(1)
    count, heads, dim = 5, 3, 16
    x = rng.standard_normal((count, heads, dim)).astype(np.float32)
    positions = np.array([0, 1, 7, 300, 2047], np.int32)
    out = np.full_like(x, np.nan)
    args = (ctypes.c_int(count), ctypes.c_int(heads), ctypes.c_int(dim), ctypes.c_int(mode == "neox"))
    host_rope.host_rope_f32(
        *grid(count * heads * dim // 2), pointer(out), pointer(x), pointer(positions), pointer(inverse(dim)), *args
    )
    expected = ref.rope(x[None].astype(np.float64), positions[None], BASE, mode)[0]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("cache", [np.float32, np.float16])
@pytest.mark.parametrize("fed", [None, 1])
def test_the_rope_write_cuda_c_writes_the_turned_keys_at_their_positions_and_skips_the_rest(host_rope, cache, fed):
    """Rows j of the keys turned at positions[j, t] and written at ids[j, t] of batch row start + j
    (start fed, else 0 whatever the start pointer holds); ids outside the cache and batch rows
    past it are not written; Llama 3's frequency factors."""
    start = fed or 0
    rng = np.random.default_rng(3)
    batches, heads, ctx, dim, rows, tokens = 3, 2, 10, 8, 2, 3
    freqs = [1.0, 0.5, 0.25, 0.125]
    dst = rng.standard_normal((batches, heads, ctx, dim)).astype(cache)
    x = rng.standard_normal((rows, tokens, heads, dim)).astype(np.float32)
    positions = np.array([[4, 9, 10], [100, 0, 7]], np.int32)  # angles: other than the ids, to tell them apart
    ids = np.array([[4, 9, 10], [-1, 0, 7]], np.int32)
    turned = ref.rope(x.astype(np.float64), positions, BASE, "normal", freqs)
    expected = dst.astype(np.float64)
    for j in range(rows):
        for t in range(tokens):
            if start + j < batches and 0 <= ids[j, t] < ctx:
                expected[start + j, :, ids[j, t], :] = turned[j, t]
    kind = "f32" if cache == np.float32 else "f16"
    sizes = [ctypes.c_int(v) for v in (fed is not None, batches, heads, ctx, dim, rows, tokens, 0)]
    first = np.array([1 if fed is None else fed], np.int32)  # not fed: a 1 there must not be read
    launch = getattr(host_rope, f"host_rope_write_{kind}")
    launch(
        *grid(rows * tokens * heads * dim // 2),
        pointer(dst),
        pointer(x),
        pointer(positions),
        pointer(inverse(dim, freqs)),
        pointer(ids),
        pointer(first),
        *sizes,
    )
    tolerance = 1e-5 if cache == np.float32 else 1e-3
    np.testing.assert_allclose(dst.astype(np.float64), expected, rtol=tolerance, atol=tolerance)


def standin_backend(monkeypatch):
    cp = install(monkeypatch)
    monkeypatch.setattr(basic, "_FREQUENCIES", {})  # this stand-in's own device arrays, gone with it
    from workers.backends import cuda

    return cp, cuda, cuda.Backend(0)


@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_the_backends_rope_is_the_kernel_with_the_shared_kernels_bits(monkeypatch, mode):
    cp, cuda, _ = standin_backend(monkeypatch)
    launched = []
    real = rope.launch
    monkeypatch.setattr(rope, "launch", lambda *a: launched.append(1) or real(*a))
    x = np.random.default_rng(4).standard_normal((1, 2, 3, 8)).astype(np.float32)
    positions = np.array([[5, 77]], np.int32)
    params = {"base": BASE, "mode": mode, "freqs": [1.0, 0.5, 2.0, 1.0]}
    got = cuda.KERNELS["rope"](cp, (cp.asarray(x), cp.asarray(positions)), params)
    shared = basic.KERNELS["rope"](np, (x, positions), params)
    assert launched == [1]
    assert cp.asnumpy(got).tobytes() == shared.tobytes()


def test_a_captured_rope_write_reads_its_positions_on_the_device_at_each_replay(monkeypatch):
    """As a program runs a step: first eagerly (rope, then the shared set_rows, which refuses a
    position outside the cache), then captured, where the backend's rope_set_rows is one kernel
    (its twin on the stand-in) and each replay turns and writes at the positions the device holds
    then; every way gives the bits of the two steps unfused."""
    from split_state.errors import ShapeError

    cp, cuda, backend = standin_backend(monkeypatch)
    launched = []
    real = rope.launch_write
    monkeypatch.setattr(rope, "launch_write", lambda *a: launched.append(1) or real(*a))
    cache = cp.zeros((1, 2, 8, 4), cp.float32)
    ids = cp.asarray(np.array([[2]], np.int32))
    keys = cp.asarray(np.arange(8, dtype=np.float32).reshape(1, 1, 2, 4))
    spec = {"axis": 2, "spans": [(0, 8, 0)], "rows": 8}
    params = {"set_rows": spec, "rope": {"base": BASE, "mode": "normal"}, "axes": (0, 2, 1, 3)}
    fused = cuda.KERNELS["rope_set_rows"]
    fused(cp, (cache, ids, keys, ids), params)  # eagerly
    assert launched == []
    with pytest.raises(ShapeError, match="ids must lie"):
        bad = cp.asarray(np.array([[8]], np.int32))
        fused(cp, (cache, bad, keys, bad), params)
    ids += 1
    backend.begin_capture()
    fused(cp, (cache, ids, keys, ids), params)
    graph = backend.end_capture()
    backend.launch(graph)
    ids += 1
    backend.launch(graph)
    assert launched == [1]
    host_keys = np.arange(8, dtype=np.float32).reshape(1, 1, 2, 4)
    expected = np.zeros((1, 2, 8, 4), np.float32)
    for position in (2, 3, 4):
        turned = basic.KERNELS["rope"](np, (host_keys, np.array([[position]])), params["rope"])
        basic.KERNELS["set_rows"](np, [expected, np.array([[position]]), turned.transpose(0, 2, 1, 3)], spec, None)
    assert backend.to_host(cache).tobytes() == expected.tobytes()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_on_host.real_gpu(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("cache", [np.float32, np.float16])
def test_on_a_gpu_the_rope_kernels_equal_their_twins(cache):
    """Compiled, against the twins: within an ulp of float (the GPU's double cosine may round
    apart from NumPy's by one ulp of double, which can move the float by one)."""
    import cupy

    kernels = device.compile_all(cupy)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 4, 64)).astype(np.float32)
    positions = rng.integers(0, 4096, (2, 3)).astype(np.int32)
    inv = inverse(64)
    out = cupy.empty(x.shape, cupy.float32)
    rope.launch(cupy, kernels, cupy.asarray(x), cupy.asarray(positions), cupy.asarray(inv), False, out)
    twin = np.empty(x.size, np.float32)
    device.table()["rope_f32"].twin(twin, x.reshape(-1), positions.reshape(-1), inv, 6, 4, 64, 0)
    np.testing.assert_allclose(cupy.asnumpy(out).reshape(-1), twin, rtol=3e-7, atol=1e-7)
    dst = cupy.zeros((2, 4, 5000, 64), cache)
    ids = positions.copy()
    rope.launch_write(
        cupy, kernels, dst, cupy.asarray(x), cupy.asarray(positions), cupy.asarray(inv), cupy.asarray(ids), None, True
    )
    mine = np.zeros((2, 4, 5000, 64), cache)
    kind = "f32" if cache == np.float32 else "f16"
    bits = mine.view(np.uint16) if cache == np.float16 else mine
    device.table()[f"rope_write_{kind}"].twin(
        bits.reshape(-1),
        x.reshape(-1),
        positions.reshape(-1),
        inv,
        ids.reshape(-1),
        ids.reshape(-1),  # no batch start fed: the ids stand in for its pointer (set_rows.cache_operands)
        np.int32(0),
        2,
        4,
        5000,
        64,
        2,
        3,
        1,
    )
    np.testing.assert_allclose(
        cupy.asnumpy(dst).astype(np.float64), mine.astype(np.float64), rtol=1e-3 if kind == "f16" else 3e-7, atol=1e-6
    )


def test_a_device_holding_no_heads_turns_nothing(monkeypatch):
    cp, cuda, _ = standin_backend(monkeypatch)
    x = cp.asarray(np.zeros((1, 1, 0, 8), np.float32))
    got = cuda.KERNELS["rope"](cp, (x, cp.asarray(np.array([[3]], np.int32))), {"base": BASE, "mode": "normal"})
    assert got.shape == (1, 1, 0, 8)


@pytest.mark.parametrize("op", ["set_rows", "rope_set_rows"])
def test_a_captured_cache_write_goes_to_the_fed_batch_row(monkeypatch, op):
    """A server's slot: the batch row comes fed (on the device) and each replay writes the row it
    holds then, the kernel (set_rows.py's or rope.py's) reading it as the eager run would."""
    cp, cuda, backend = standin_backend(monkeypatch)
    cache = cp.zeros((3, 2, 8, 4), cp.float32)
    ids = cp.asarray(np.array([[5]], np.int32))
    start = cp.asarray(np.array(2, np.int32))
    keys = np.arange(8, dtype=np.float32).reshape(1, 1, 2, 4)
    spec = {"axis": 2, "spans": [(0, 8, 0)], "rows": 8, "batch": 3, "held": [(0, 3, 0)]}
    rotation = {"base": BASE, "mode": "normal"}
    if op == "set_rows":
        inputs, params, row = (cache, ids, cp.asarray(keys.transpose(0, 2, 1, 3)), start), spec, keys[0, 0]
    else:
        inputs = (cache, ids, cp.asarray(keys), ids, start)
        params = {"set_rows": spec, "rope": rotation, "axes": (0, 2, 1, 3)}
        row = basic.KERNELS["rope"](np, (keys, np.array([[5]])), rotation)[0, 0]
    cuda.KERNELS[op](cp, inputs, params)  # eagerly first, as a program's first run
    backend.begin_capture()
    cuda.KERNELS[op](cp, inputs, params)
    graph = backend.end_capture()
    start[...] = 1
    backend.launch(graph)
    got = backend.to_host(cache)
    expected = np.zeros((3, 2, 8, 4), np.float32)
    expected[2, :, 5], expected[1, :, 5] = row, row  # the eager run's row 2, the replay's row 1
    assert got.tobytes() == expected.tobytes()
