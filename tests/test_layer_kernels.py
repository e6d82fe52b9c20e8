"""The CUDA backend's kernels of our own for a layer's small steps (workers/backends/cuda/kernels/rms_norm.py,
workers/backends/cuda/kernels/swiglu.py), checked against their definitions in float64:
- their CUDA C compiled for the CPU and run thread by thread (tests/cuda_on_host.py; real
  barriers for the norm's block sum), in CI; the norm's C and twin also bit for bit, as the twin
  states the kernel's order of sums;
- the backend's rms_norm_mul and swiglu on the CuPy stand-in (the twins): captured in a device
  graph and replayed on new inputs, other layouts left to the shared kernels;
- on a GPU, the compiled kernels against their twins (skipped without one)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from tests import cuda_on_host
from tests.cupy_standin import install
from workers.backends.cuda.kernels import device, rms_norm, swiglu

pytestmark = pytest.mark.timeout(120)

NORM_SIGNATURE = ("const float* x, const float* weight, float* out, int width, float eps", "x, weight, out, width, eps")
SWIGLU_SIGNATURE = (
    "const float* both, float* out, int width, int gate, int up, int columns, long count",
    "both, out, width, gate, up, columns, count",
)
EPS = 1e-5


def pointer(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def norm_oracle(x, weight, eps):
    """x / sqrt(mean(x * x) + eps) * weight along the last axis, float64, from the definition."""
    w = x.astype(np.float64)
    return w / np.sqrt((w * w).mean(axis=-1, keepdims=True) + eps) * weight.astype(np.float64)


def swiglu_oracle(both, gate, up):
    """silu(g) * u = g / (1 + exp(-g)) * u for the gate's and up's columns, float64."""
    w = both.astype(np.float64)
    g, u = w[..., slice(*gate)], w[..., slice(*up)]
    return g / (1 + np.exp(-g)) * u


def rows(width: int, count: int = 3, seed: int = 4) -> np.ndarray:
    """Rows of `width` values, one of them scaled far up and one far down (the sum of squares
    over many orders of magnitude)."""
    x = np.random.default_rng(seed).standard_normal((count, width)).astype(np.float32)
    x[0] *= 1e3
    x[-1] *= 1e-3
    return x


@pytest.fixture(scope="module")
def host_layer(tmp_path_factory):
    if cuda_on_host.compiler() is None:
        pytest.skip("no C++ compiler to build the kernels for the host")
    folder = tmp_path_factory.mktemp("kernels")
    norm = cuda_on_host.build(
        device.full_source(rms_norm.SOURCE), {"rms_norm_mul": NORM_SIGNATURE}, folder, barriers=True
    )
    return norm, cuda_on_host.build(device.full_source(swiglu.SOURCE), {"swiglu": SWIGLU_SIGNATURE}, folder)


def host_norm(library, x, weight, eps=EPS):
    out = np.full(x.shape, np.nan, np.float32)
    count, width = x.size // x.shape[-1], x.shape[-1]
    grid = [ctypes.c_int(v) for v in (count, 1, rms_norm.THREADS, 1)]
    library.host_rms_norm_mul(
        *grid, pointer(x), pointer(weight), pointer(out), ctypes.c_int(width), ctypes.c_float(eps)
    )
    return out


@pytest.mark.parametrize("width", [576, 100, 2048, 300])
def test_the_norm_cuda_c_run_on_the_host_is_the_definition_and_its_twins_bits(host_layer, width):
    """Widths under, over and at multiples of the block (each thread summing one to eight
    values), three rows a block each, one scaled up a thousandfold and one down."""
    x, weight = rows(width), np.random.default_rng(5).standard_normal(width).astype(np.float32)
    got = host_norm(host_layer[0], x, weight)
    np.testing.assert_allclose(got, norm_oracle(x, weight, EPS), rtol=2e-6, atol=1e-7)
    twin = np.full(x.size, np.nan, np.float32)
    rms_norm.DEVICE_KERNELS[0].twin(x.reshape(-1), weight, twin, np.int32(width), np.float32(EPS))
    assert twin.tobytes() == got.tobytes()


def test_the_swiglu_cuda_c_run_on_the_host_is_the_definition(host_layer):
    """Two rows of gate|up with the up columns first in one of the layouts a split leaves (any two
    equal column ranges of a row), large values of either sign (exp's overflow to inf: silu 0)."""
    both = np.random.default_rng(6).standard_normal((2, 3, 40)).astype(np.float32) * 8
    both[0, 0, :4] = [-200.0, 200.0, 0.0, -0.0]
    for gate, up in (((0, 20), (20, 40)), ((25, 35), (5, 15))):
        columns = gate[1] - gate[0]
        out = np.full((2, 3, columns), np.nan, np.float32)
        grid = [ctypes.c_int(v) for v in (-(-out.size // swiglu.THREADS), 1, swiglu.THREADS, 1)]
        sizes = [ctypes.c_int(v) for v in (40, gate[0], up[0], columns)]
        host_layer[1].host_swiglu(*grid, pointer(both), pointer(out), *sizes, ctypes.c_long(out.size))
        np.testing.assert_allclose(out, swiglu_oracle(both, gate, up), rtol=2e-6, atol=1e-30)
        twin = np.full(out.size, np.nan, np.float32)
        swiglu.DEVICE_KERNELS[0].twin(both.reshape(-1), twin, 40, gate[0], up[0], columns, out.size)
        np.testing.assert_allclose(twin.reshape(out.shape), swiglu_oracle(both, gate, up), rtol=2e-6, atol=1e-30)


def test_captured_norm_and_swiglu_are_the_kernels_replayed_on_new_inputs(monkeypatch):
    """On the stand-in: the backend's rms_norm_mul and swiglu run the kernels (their twins) eagerly
    and in a graph, which replays them on the inputs the device holds then; a layout the kernels
    do not take (a norm along another axis, a strided gate|up) is the shared kernels'."""
    cp = install(monkeypatch)
    from workers.backends import cuda

    backend = cuda.Backend(0)
    launched = []
    for module in (rms_norm, swiglu):
        real = module.launch
        monkeypatch.setattr(
            module, "launch", lambda *a, real=real, name=module.__name__: launched.append(name) or real(*a)
        )
    x, weight = rows(576, 2), np.random.default_rng(5).standard_normal(576).astype(np.float32)
    both = np.random.default_rng(6).standard_normal((1, 2, 64)).astype(np.float32)
    norm_params, glu_params = {"axis": -1, "eps": EPS}, {"gate": (0, 32), "up": (32, 64)}
    x_dev, both_dev = cp.asarray(x), cp.asarray(both)
    normed, glu = cp.empty(x.shape, cp.float32), cp.empty((1, 2, 32), cp.float32)
    inputs = ((x_dev, cp.asarray(weight)), (both_dev,))

    def step():
        cuda.KERNELS["rms_norm_mul"](cp, inputs[0], norm_params, normed)
        cuda.KERNELS["swiglu"](cp, inputs[1], glu_params, glu)

    step()
    backend.begin_capture()
    step()
    graph = backend.end_capture()
    x2, both2 = x[::-1] * 3, both * -2
    x_dev.set(np.ascontiguousarray(x2))
    both_dev.set(both2)
    backend.launch(graph)
    assert launched == ["workers.backends.cuda.kernels.rms_norm", "workers.backends.cuda.kernels.swiglu"] * 2
    np.testing.assert_allclose(backend.to_host(normed), norm_oracle(x2, weight, EPS), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(backend.to_host(glu), swiglu_oracle(both2, (0, 32), (32, 64)), rtol=2e-6, atol=1e-30)
    # layouts the kernels do not take: the shared kernels, eagerly
    square = cp.asarray(rows(8, 8))
    along_rows = cuda.KERNELS["rms_norm_mul"](cp, (square, cp.asarray(weight[:8, None])), {"axis": 0, "eps": EPS}, None)
    want = norm_oracle(rows(8, 8).T, weight[:8], EPS).T
    np.testing.assert_allclose(backend.to_host(along_rows), want, rtol=2e-6, atol=1e-7)
    strided = cp.asarray(np.random.default_rng(7).standard_normal((2, 128)).astype(np.float32))[:, ::2]
    out = cuda.KERNELS["swiglu"](cp, (strided,), glu_params, None)
    want = swiglu_oracle(backend.to_host(strided), (0, 32), (32, 64))
    np.testing.assert_allclose(backend.to_host(out), want, rtol=2e-6, atol=1e-30)
    assert len(launched) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_on_host.real_gpu(), reason="needs CuPy and a CUDA GPU")
def test_on_a_gpu_the_norm_and_swiglu_kernels_equal_their_twins():
    """Compiled: the norm bit for bit its twin (the same sums in the same order, each rounded on
    its own); swiglu within the device's expf against NumPy's exp (a few ulps)."""
    import cupy

    kernels = device.compile_all(cupy)
    for width in (576, 2048, 300):
        x, weight = rows(width), np.random.default_rng(5).standard_normal(width).astype(np.float32)
        out = cupy.full(x.shape, np.nan, cupy.float32)
        rms_norm.launch(cupy, kernels, cupy.asarray(x), cupy.asarray(weight), EPS, out)
        twin = np.full(x.size, np.nan, np.float32)
        rms_norm.DEVICE_KERNELS[0].twin(x.reshape(-1), weight, twin, np.int32(width), np.float32(EPS))
        assert cupy.asnumpy(out).tobytes() == twin.tobytes()
    both = np.random.default_rng(6).standard_normal((4, 16384)).astype(np.float32) * 4
    params = {"gate": (0, 8192), "up": (8192, 16384)}
    out = cupy.full((4, 8192), np.nan, cupy.float32)
    swiglu.launch(cupy, kernels, cupy.asarray(both), params, out)
    np.testing.assert_allclose(cupy.asnumpy(out), swiglu_oracle(both, (0, 8192), (8192, 16384)), rtol=2e-6, atol=1e-30)
