"""Weights kept in their GGUF blocks: the kernels against `gguf`'s own quantization and
dequantization, and the tensor-parallel decoder on quantized weights against the float32
reference on the same (dequantized) values."""

from __future__ import annotations

import numpy as np
import pytest

from models.llama import (
    LlamaConfig,
    QuantizedWeight,
    ReferenceDecoder,
    TensorParallelLlama,
    qkv_fusable,
    random_weights,
)
from split_state import ShapeError, Split
from split_state.quant import FORMATS
from workers.backends.cpu import numba_cpu
from workers.kernels import kernels_for, quant

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.timeout(120)
TYPES = {name: getattr(gguf.GGMLQuantizationType, name.upper()) for name in FORMATS}
K_QUANTS = ("q4_k", "q5_k", "q6_k")  # gguf dequantizes them but cannot quantize: random blocks instead


def quantized(values: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(blocks as the file holds them, (rows, blocks, bytes), their values as gguf dequantizes
    them): gguf's quantization of `values`, or for the K-quants random blocks of that shape with
    scales that keep values near `values`' size."""
    if name in K_QUANTS:
        raw = k_blocks(np.random.default_rng(values.shape[1]), values.shape[0], values.shape[1], name)
    else:
        raw = gguf.quants.quantize(values.astype(np.float32), TYPES[name])
    raw = np.ascontiguousarray(raw)
    blocks = raw.view(np.uint8).reshape(values.shape[0], -1, FORMATS[name].block_bytes)
    return blocks, gguf.quants.dequantize(raw.reshape(values.shape[0], -1), TYPES[name]).astype(np.float64)


def k_blocks(rng: np.random.Generator, rows: int, cols: int, name: str) -> np.ndarray:
    """Random K-quant blocks (rows, cols / 256 * block bytes): every byte random but the float16
    factors, small enough that values stay under about 1 (q4_k: d, dmin; q6_k: d)."""
    fmt = FORMATS[name]
    w = rng.integers(0, 256, (rows, cols // fmt.block, fmt.block_bytes), dtype=np.uint8)
    top = 4e-5 if name == "q6_k" else 2e-4
    for at in fmt.factors:
        w[..., at : at + 2] = rng.uniform(top / 4, top, w.shape[:2] + (1,)).astype("<f2").view(np.uint8)
    return w.reshape(rows, -1)


def on_workers(blocks: np.ndarray, lanes: int) -> np.ndarray:
    """The file's blocks as the workers keep them: byte p of block b of row g * lanes + l at
    [g, b, p, l]."""
    rows, count, size = blocks.shape
    out = np.empty((rows // lanes, count, size, lanes), np.uint8)
    for r in range(rows):
        out[r // lanes, :, :, r % lanes] = blocks[r]
    return out


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("lanes", [1, 7])
def test_dequantizing_gives_ggufs_values(name, lanes):
    values = np.random.default_rng(1).standard_normal((7, 3 * FORMATS[name].block)) * 3
    blocks, expected = quantized(values, name)
    got = quant.dequantize(np, on_workers(blocks, lanes), FORMATS[name])
    np.testing.assert_array_equal(got, expected.astype(np.float32))


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("lanes", [1, 4, 16])
def test_products_with_quantized_weights_match_the_dequantized_product(name, rows, lanes, monkeypatch):
    rng = np.random.default_rng(rows)
    block = FORMATS[name].block
    width = 4 * block
    blocks, dequantized = quantized(rng.standard_normal((48, width)), name)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    expected = x.astype(np.float64) @ dequantized.T
    monkeypatch.setattr(quant, "TILE_BYTES", 5 * width * 4 * lanes)  # 5 groups a tile: the last one ragged
    params = {"format": name}
    for kernel in (quant.qmatmul, numba_cpu.qmatmul):
        got = kernel(np, [x.reshape(rows, 4, block), on_workers(blocks, lanes)], params)
        assert got.shape == (rows, 48 // lanes, lanes)
        np.testing.assert_allclose(
            got.reshape(rows, 48), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max(), err_msg=str(kernel)
        )


@pytest.mark.skipif(not numba_cpu.AVAILABLE, reason="needs numba")
@pytest.mark.parametrize("name", sorted(set(FORMATS) - set(numba_cpu.WIDENED)))
@pytest.mark.parametrize("rows", [1, 5])
def test_the_decode_loops_on_two_threads_give_one_threads_bits_and_ggufs_product(name, rows):
    """The row groups split over threads (numba's prange): each group's sums as on one thread,
    so the bits are the same (a scratch buffer shared between threads, or groups crossed, would
    not be), and within rounding of gguf's dequantized product."""
    rng = np.random.default_rng(7)
    block = FORMATS[name].block
    width = 8 * block
    blocks, dequantized = quantized(rng.standard_normal((512, width)), name)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    w = on_workers(blocks, 4)  # 128 groups of 4 lanes: the threads run side by side a while
    got = {}
    try:
        for threads in (1, 2):
            numba_cpu.set_threads(threads)
            for _ in range(10):  # a race shows in some runs only
                out = numba_cpu.qmatmul(np, [x.reshape(rows, 8, block), w], {"format": name}).reshape(rows, 512)
                np.testing.assert_array_equal(out, got.setdefault(1, out))
            got[threads] = out
    finally:
        numba_cpu.set_threads(1)
    np.testing.assert_array_equal(got[2], got[1])
    expected = x.astype(np.float64) @ dequantized.T
    np.testing.assert_allclose(got[2], expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.skipif(not numba_cpu.AVAILABLE, reason="needs numba")
@pytest.mark.parametrize("name", sorted(set(FORMATS) - set(numba_cpu.WIDENED)))
@pytest.mark.parametrize("rows", [2, 3, 8])
def test_a_batchs_rows_get_the_bits_each_row_gets_alone(name, rows):
    """A batch's decode step (the server's streams, one row each) runs its rows through the
    loops two at a time, each quant widened once for both: every row's product must be the bits
    that row gets alone (so a stream's tokens do not depend on its batch), the odd last row too,
    and within rounding of gguf's dequantized product."""
    rng = np.random.default_rng(rows)
    block = FORMATS[name].block
    width = 4 * block
    blocks, dequantized = quantized(rng.standard_normal((128, width)), name)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    x[-1] *= 100  # rows of other sizes: a row mixed into its pair's sums shows
    w = on_workers(blocks, 16)
    batch = numba_cpu.qmatmul(np, [x.reshape(rows, 4, block), w], {"format": name}).reshape(rows, 128)
    for r in range(rows):
        alone = numba_cpu.qmatmul(np, [x[r].reshape(1, 4, block), w], {"format": name}).reshape(128)
        np.testing.assert_array_equal(batch[r], alone, err_msg=f"row {r}")
        expected = x[r].astype(np.float64) @ dequantized.T
        tolerance = 1e-4 * np.abs(expected).max()
        np.testing.assert_allclose(batch[r], expected, rtol=1e-4, atol=tolerance, err_msg=f"row {r}")


# a worker's start-up (numba_cpu.prepare), then products of every format and row count: what
# each loop has compiled or loaded before and after
WARMED_CHECK = """
import numba, numpy as np
from split_state.quant import FORMATS
from workers.backends.cpu import numba_cpu, numba_loops

numba_cpu.prepare()
def loaded():
    return {n: len(d.signatures) for n, d in vars(numba_loops).items() if hasattr(d, "signatures")}
before = loaded()
for name, fmt in FORMATS.items():
    for rows in (1, 2, 3, 4, 5, numba_cpu.MAX_LOOP_ROWS, numba_cpu.MAX_LOOP_ROWS + 1):
        x = np.ones((rows, 2, fmt.block), np.float32)
        w = np.zeros((3, 2, fmt.block_bytes, 16), np.uint8)
        numba_cpu.qmatmul(np, [x, w], {"format": name}, np.empty((rows, 3, 16), np.float32))
after = loaded()
print(sorted(n for n in after if after[n] != before[n]))
"""


@pytest.mark.skipif(not numba_cpu.AVAILABLE, reason="needs numba")
def test_a_workers_start_loads_every_product_loop_a_decode_or_a_batch_runs():
    """A worker loads its loops before its weights arrive (numba_cpu.prepare), so no request
    waits on a compile (one loop is several seconds on 2 cores: a batch's first step stalled
    7 s when the paired loops were missing from the warm-up): products of every format and row
    count afterwards load nothing more."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", WARMED_CHECK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


# what the worker's environment holds when NumPy is first imported (python -m workers --help:
# the worker's whole start-up but serving)
POOLS_CHECK = """
import os, runpy, sys
seen = []


def hook(event, args):
    if event == "import" and args[0] == "numpy" and not seen:
        seen.append([os.environ.get("OPENBLAS_THREAD_TIMEOUT"), os.environ.get("GOMP_SPINCOUNT")])


sys.addaudithook(hook)
sys.argv = ["workers", "--help"]
try:
    runpy.run_module("workers", run_name="__main__")
except SystemExit:
    pass
print(*seen[0])
"""


INTEGER = {"META_TP_INTEGER_DECODE": "1"}  # transport.environment.INTEGER_DECODE_ENV


@pytest.mark.parametrize(
    "preset, expected",
    [
        ({}, ["4", "3000"]),
        ({"GOMP_SPINCOUNT": "77"}, ["4", "77"]),
        (INTEGER | {"OMP_NUM_THREADS": "2"}, ["4", "20000"]),  # a decode of integer products, 2 threads
        (INTEGER | {"OMP_NUM_THREADS": "1"}, ["4", "3000"]),  # one thread: no pool to keep awake
        (INTEGER | {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "77"}, ["4", "77"]),
    ],
)
def test_a_worker_bounds_its_pools_spinning_before_numpy_loads_blas(preset, expected):
    """OpenBLAS's threads spinning ~0.1 s after each call and numba's ~1 ms after each loop
    starve the other pool (float32 decode on 2 threads: 3.8 against 33 tok/s): a worker sets
    both bounds (workers/binding.py) before NumPy loads OpenBLAS, which reads its variable
    then; numba's spin is longer for a worker of two or more threads told its decode runs no
    BLAS; a user's own value stands."""
    import os
    import subprocess
    import sys

    left = ("GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT", "OMP_NUM_THREADS", *INTEGER)
    env = {k: v for k, v in os.environ.items() if k not in left}
    done = subprocess.run(
        [sys.executable, "-c", POOLS_CHECK], capture_output=True, text=True, timeout=120, env=env | preset
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].split() == expected


@pytest.mark.skipif(not numba_cpu.AVAILABLE, reason="needs numba")
def test_the_loops_read_every_float16_factor_as_numpy_widens_it():
    """The loops widen a block's float16 factors in the vector unit (or through a table where
    the CPU cannot): all 65,536 bit patterns, subnormals, infinities and NaNs among them, against
    NumPy's float16 -> float32, bit for bit (NaN as NaN)."""
    from workers.backends.cpu import numba_loops

    bits = np.arange(1 << 16, dtype=np.uint16)
    w = np.stack([bits & 0xFF, bits >> 8]).astype(np.uint8).reshape(1, 1, 2, 1 << 16)  # little-endian bytes
    got = np.empty(1 << 16, np.float32)
    numba_loops._lane_scales(numba_cpu._halves(), w, 0, 0, 0, got)
    expected = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_cuda_backends_kernels_on_the_cupy_standin_match_the_dequantized_product(name, monkeypatch):
    """The CUDA backend has no loops of its own: qmatmul dequantizes tiles of row groups for
    cuBLAS, qget_rows the rows it looks up, written once against `xp`; here on the stand-in."""
    from tests.cupy_standin import install

    install(monkeypatch)
    from workers.backends.cuda import Backend

    backend = Backend(0)
    kernels = kernels_for(backend)
    rng = np.random.default_rng(5)
    block = FORMATS[name].block
    blocks, dequantized = quantized(rng.standard_normal((32, 2 * block)), name)
    w = backend.to_device(on_workers(blocks, 8))
    monkeypatch.setattr(quant, "TILE_BYTES", 3 * 2 * block * 4 * 8)  # 3 groups a tile, the last ragged
    for rows in (1, 12):
        x = rng.standard_normal((rows, 2 * block)).astype(np.float32)
        got = kernels["qmatmul"](backend.xp, [backend.to_device(x.reshape(rows, 2, block)), w], {"format": name})
        expected = x.astype(np.float64) @ dequantized.T
        np.testing.assert_allclose(
            backend.to_host(got).reshape(rows, 32), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max()
        )
    ids = np.array([[31, 0, 9]])
    got = kernels["qget_rows"](backend.xp, [w, backend.to_device(ids)], {"rows": 32, "format": name})
    np.testing.assert_array_equal(backend.to_host(got), dequantized[ids].astype(np.float32))


@pytest.mark.skipif(not numba_cpu.AVAILABLE, reason="needs numba")
@pytest.mark.parametrize("name", sorted(numba_cpu.ROW_CODES))
@pytest.mark.parametrize("id_type", [np.int32, np.int64])
def test_the_cpu_loop_looks_up_rows_with_ggufs_bits(name, id_type, monkeypatch):
    """numba_cpu.qget_rows (one loop, no NumPy dequantization) gives each held row gguf's values
    bit for bit and zeros for rows another device holds: a table of 24 local rows in three groups
    of 8 lanes, holding global rows [3, 9) at local 0 and [12, 26) at local 6."""
    rng = np.random.default_rng(11)
    block = FORMATS[name].block
    blocks, dequantized = quantized(rng.standard_normal((24, 2 * block)), name)
    table = on_workers(blocks, 8)
    params = {"rows": 30, "format": name, "spans": [(3, 9, 0), (12, 26, 6)]}
    ids = np.array([[25, 3, 10], [12, 8, 0]], id_type)

    def shared(*args, **kwargs):
        raise AssertionError("the shared kernel ran")

    monkeypatch.setattr(quant, "qget_rows", shared)
    out = np.full((2, 3, 2 * block), np.nan, np.float32)
    got = numba_cpu.qget_rows(np, [table, ids], params, out)
    assert got is out
    expected = np.zeros((2, 3, 2 * block), np.float32)
    for at, row in np.ndenumerate(ids):
        local = row - 3 if 3 <= row < 9 else row - 12 + 6 if 12 <= row < 26 else None
        if local is not None:
            expected[at] = dequantized[local]
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    with pytest.raises(ShapeError, match=r"ids must lie in \[0, 30\), got \[-1, 12\]"):
        numba_cpu.qget_rows(np, [table, np.array([[12, -1]], id_type)], params, out[:1, :2].copy())


def test_looked_up_rows_are_dequantized_alone():
    blocks, dequantized = quantized(np.random.default_rng(2).standard_normal((10, 64)), "q8_0")
    ids = np.array([[9, 0, 4], [4, 4, 1]])
    blocks = on_workers(blocks, 2)
    got = quant.qget_rows(np, [blocks, ids], {"rows": 10, "format": "q8_0"})
    np.testing.assert_array_equal(got, dequantized[ids].astype(np.float32))
    with pytest.raises(ShapeError, match=r"ids must lie in \[0, 10\)"):
        quant.qget_rows(np, [blocks, np.array([10])], {"rows": 10, "format": "q8_0"})


CFG = LlamaConfig(hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, vocab=40, tied=True)


def quantized_model(cfg: LlamaConfig, formats: dict[str, str]):
    """(source of QuantizedWeight / float32 weights, the float32 weights gguf dequantizes them to)."""
    weights = random_weights(cfg, seed=4)
    source, values = {}, {}
    for key, w in weights.items():
        name = formats.get(key.split(".")[-1])
        if name is None or w.ndim != 2:
            source[key] = values[key] = w
            continue
        rows = w if key == "embed" else w.T  # GGUF's (out, in): rows are the outputs
        blocks, dequantized = quantized(rows, name)
        source[key] = QuantizedWeight(name, blocks)
        values[key] = (dequantized if key == "embed" else dequantized.T).astype(np.float32)
    return source, values


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_the_decoder_on_quantized_weights_equals_the_reference_on_their_values(sim, n):
    """Every matrix kept in blocks (q4_1 and q5 layers, a q8_0 tied embedding and head as in
    SmolLM2's file, q4_0 for the attention output), on 1-5 devices: splits of the FFN on block boundaries,
    uneven over 3 and 5 devices, and devices holding no KV head."""
    formats = {"wq": "q4_1", "wk": "q5_0", "wv": "q8_0", "wo": "q4_0", "w_gate": "q5_1", "w_up": "q5_1"}
    source, values = quantized_model(CFG, formats | {"w_down": "q4_1", "embed": "q8_0"})
    ctx, prompt = 12, np.array([[3, 17, 5, 29]])
    reference = ReferenceDecoder(CFG, values, ctx)
    expected = [reference.forward(prompt, np.arange(4)[None])[0, -1]]
    net = TensorParallelLlama(sim(n), CFG, source.__getitem__, ctx)
    assert len(net.formats) == 1 + 6 * CFG.layers  # every matrix stayed quantized
    got = [net.step(prompt, np.arange(4)[None])[:, 3:].numpy()[0, 0]]
    for pos, token in zip(range(4, 7), (11, 2, 38)):
        expected.append(reference.forward(np.array([[token]]), np.array([[pos]]))[0, -1])
        got.append(net.step(np.array([[token]]), np.array([[pos]])).numpy()[0, 0])
    np.testing.assert_allclose(np.stack(got), np.stack(expected), rtol=2e-4, atol=2e-4)


K_CFG = LlamaConfig(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=40, tied=True)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_decoder_on_k_quant_weights_equals_the_reference_on_their_values(sim, n):
    """Q4_K, Q5_K and Q6_K mixed with the legacy types as Q4_K_M / Q5_K_M files mix them (a
    Q6_K tied embedding and head), and a bf16 wv. w_down splits its inputs on 256-value blocks:
    the FFN goes 256 / 256 to 2 devices and 256 / 256 / 0 to 3. wo stays q4_0: its inputs
    (whole heads, 128 values a device on 2) do not fall on 256-value blocks."""
    formats = {"wq": "q4_k", "wk": "q6_k", "wv": "bf16", "wo": "q4_0", "w_gate": "q5_k", "w_up": "q5_k"}
    source, values = quantized_model(K_CFG, formats | {"w_down": "q6_k", "embed": "q6_k"})
    ctx, prompt = 8, np.array([[3, 17, 5]])
    reference = ReferenceDecoder(K_CFG, values, ctx)
    net = TensorParallelLlama(sim(n), K_CFG, source.__getitem__, ctx)
    assert len(net.formats) == 1 + 6 * K_CFG.layers
    assert net.ffn_extents == ((512,), (256, 256), (256, 256, 0))[n - 1]
    expected = [reference.forward(prompt, np.arange(3)[None])[0, -1]]
    got = [net.step(prompt, np.arange(3)[None])[:, 2:].numpy()[0, 0]]
    expected.append(reference.forward(np.array([[11]]), np.array([[3]]))[0, -1])
    got.append(net.step(np.array([[11]]), np.array([[3]])).numpy()[0, 0])
    np.testing.assert_allclose(np.stack(got), np.stack(expected), rtol=2e-4, atol=2e-4)


def test_a_row_parallel_split_off_the_block_boundaries_is_refused():
    weight = QuantizedWeight("q4_1", np.arange(8 * 3 * 20, dtype=np.uint8).reshape(8, 3, 20))  # 8 outputs of 96
    array, state = weight.placed(Split(0, ((64, 32),)), "l0.w_down", 2)
    assert state == Split(1, ((2, 1),)) and array.shape == (1, 3, 20, 8)  # blocks; rows not split: 8 lanes
    array, state = weight.placed(Split(1, ((6, 2),)), "l0.wq", 2)
    assert state == Split(0, ((3, 1),)) and array.shape == (4, 3, 20, 2)  # rows: whole groups of 2 lanes
    np.testing.assert_array_equal(array, on_workers(weight.blocks, 2))
    assert weight.placed(Split(1, ((5, 3),)), "l0.wq", 2)[1] == Split(0, ((5, 3),))  # any extents: 1 lane
    with pytest.raises(ShapeError, match=r"l0.w_down: a q4_1 weight splits its inputs on 32-value blocks"):
        weight.placed(Split(0, ((48, 48),)), "l0.w_down", 2)


QKV_CFG = LlamaConfig(hidden=96, layers=2, heads=6, kv_heads=3, ffn=96, vocab=40, tied=True, qkv_bias=True)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", None])
def test_q_k_and_v_as_one_weight_give_the_three_products_bits(sim, n, kind):
    """fuse_qkv (wq | wk | wv one weight of three segments, each split by its heads: 3 KV heads
    over 2 devices go 2|1, over 3 one each) against the three products it replaces, bit for
    bit, with Qwen2's biases, on blocks of one format and on float32; then against the
    reference decoder on the weights' values. qkv_fusable refuses a layer of mixed kinds."""
    formats = {} if kind is None else {"wq": kind, "wk": kind, "wv": kind, "wo": "q4_0"}
    source, values = quantized_model(QKV_CFG, formats)
    ctx, prompt = 10, np.array([[3, 17, 5, 29]])
    dev = sim(n)
    runs = []
    for fuse in (False, True):
        net = TensorParallelLlama(dev, QKV_CFG, source.__getitem__, ctx, fuse_qkv=fuse)
        assert ("l0.w_qkv" in net.w) == fuse and ("l0.wq" in net.w) != fuse
        got = [net.step(prompt, np.arange(4)[None])[:, 3:].numpy()[0, 0]]
        for pos, token in zip(range(4, 6), (11, 38)):
            got.append(net.step(np.array([[token]]), np.array([[pos]])).numpy()[0, 0])
        runs.append(np.stack(got))
    np.testing.assert_array_equal(runs[1], runs[0])
    reference = ReferenceDecoder(QKV_CFG, values, ctx)
    expected = [reference.forward(prompt, np.arange(4)[None])[0, -1]]
    for pos, token in zip(range(4, 6), (11, 38)):
        expected.append(reference.forward(np.array([[token]]), np.array([[pos]]))[0, -1])
    np.testing.assert_allclose(runs[1], np.stack(expected), rtol=2e-4, atol=2e-4)
    kinds = {"l1.wv": "q8_0"}
    assert not qkv_fusable(lambda name: kinds.get(name, kind), QKV_CFG) or kind == "q8_0"
    assert qkv_fusable(lambda name: kind, QKV_CFG)


@pytest.mark.skipif(not numba_cpu.AVAILABLE, reason="needs numba")
@pytest.mark.parametrize("name", sorted(set(FORMATS) - set(numba_cpu.WIDENED)))
@pytest.mark.parametrize("rows", [1, 12])  # the decode loops; a prefill's tiles
def test_a_planned_product_reads_each_runs_values_as_gguf_dequantizes_them(name, rows):
    """A plan (workers/straight.py) holds views of its arrays: run twice with new values written
    into x and the weight in between, it gives each time the product with gguf's values."""
    from workers.kernels import fused

    rng = np.random.default_rng(3)
    block = FORMATS[name].block
    width = 4 * block
    runs = [quantized(rng.standard_normal((32, width)), name) for _ in range(2)]
    x = np.empty((rows, 4, block), np.float32)
    w = np.empty_like(on_workers(runs[0][0], 8))
    out, addend, total = (
        np.empty((rows, 4, 8), np.float32),
        np.empty((rows, 32), np.float32),
        np.empty((rows, 32), np.float32),
    )
    product = numba_cpu.qmatmul.plan(np, (x, w), {"format": name}, out)
    params = {"qmatmul": {"format": name}, "shape": (rows, 4, 8), "out": (rows, 32)}
    summed = fused.qmatmul_add_with(numba_cpu.qmatmul).plan(np, (x, w, addend), params, total)
    for blocks, dequantized in runs:
        x[...] = rng.standard_normal(x.shape)
        w[...] = on_workers(blocks, 8)
        addend[...] = rng.standard_normal(addend.shape)
        expected = x.reshape(rows, width).astype(np.float64) @ dequantized.T
        tol = {"rtol": 1e-4, "atol": 1e-4 * np.abs(expected).max()}
        assert product() is out
        np.testing.assert_allclose(out.reshape(rows, 32), expected, **tol)
        assert summed() is total
        np.testing.assert_allclose(total, expected + addend, **tol)
