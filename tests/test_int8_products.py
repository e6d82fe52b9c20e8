"""The integer products (8-bit activations, workers/backends/cpu/int8_products.py) against an
independent NumPy model of llama.cpp's arithmetic: the activations rounded into Q8_0 / Q8_1 /
Q8_K as ggml's x86 code rounds them, each block's integer sums in int64, the scales applied in
float64. The model's unpacking of every format is itself held to gguf's dequantization.
"""

from __future__ import annotations

import numpy as np
import pytest

from split_state import Split
from split_state.quant import FORMATS

pytest.importorskip("numba")
gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.timeout(300)

INT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
PARTNER = {"q4_1": "q8_1", "q5_1": "q8_1", "q4_k": "q8_k", "q5_k": "q8_k", "q6_k": "q8_k"}  # else q8_0


# -- the model: each format unpacked from the file's bytes --------------------------------------


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., at : at + 2]).view("<f2")[..., 0].astype(np.float64)


def _nibbles(quants: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32) values: the low halves are values 0-15, the high 16-31."""
    return np.concatenate([quants & 15, quants >> 4], axis=-1).astype(np.int64)


def _fifth_bits(word_bytes: np.ndarray) -> np.ndarray:
    """(..., 4) bytes of a little-endian word -> (..., 32) bits, bit j for value j."""
    word = np.ascontiguousarray(word_bytes).view("<u4")[..., 0].astype(np.int64)
    return (word[..., None] >> np.arange(32)) & 1


def _k4_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 over the 12 scale bytes (..., 12) -> (..., 8) scales, minimums."""
    q = scales.astype(np.int64)
    sc, mn = np.empty(q.shape[:-1] + (8,), np.int64), np.empty(q.shape[:-1] + (8,), np.int64)
    for j in range(8):
        if j < 4:
            sc[..., j], mn[..., j] = q[..., j] & 63, q[..., j + 4] & 63
        else:
            sc[..., j] = (q[..., j + 4] & 0xF) | ((q[..., j - 4] >> 6) << 4)
            mn[..., j] = (q[..., j + 4] >> 4) | ((q[..., j] >> 6) << 4)
    return sc, mn


def unpack(name: str, blocks: np.ndarray) -> dict:
    """The file's blocks (rows, blocks, bytes) as integers and factors: t (rows, blocks, values)
    the quant each value is scaled by, sc (rows, blocks, sub-blocks) its integer scale (1 for the
    legacy formats), mn the integer minimums (K) and d, m / dmin (rows, blocks) float64."""
    b = blocks
    d = _half(b, 208 if name == "q6_k" else 0)
    out = {"d": d, "m": np.zeros_like(d), "sc": np.ones(b.shape[:2] + (1,), np.int64), "mn": None}
    if name == "q4_0":
        out["t"] = _nibbles(b[..., 2:18]) - 8
    elif name == "q4_1":
        out["t"], out["m"] = _nibbles(b[..., 4:20]), _half(b, 2)
    elif name == "q5_0":
        out["t"] = _nibbles(b[..., 6:22]) + 16 * _fifth_bits(b[..., 2:6]) - 16
    elif name == "q5_1":
        out["t"], out["m"] = _nibbles(b[..., 8:24]) + 16 * _fifth_bits(b[..., 4:8]), _half(b, 2)
    elif name == "q8_0":
        out["t"] = np.ascontiguousarray(b[..., 2:34]).view(np.int8).astype(np.int64)
    elif name in ("q4_k", "q5_k"):
        first = 48 if name == "q5_k" else 16
        chunks = [b[..., first + 32 * c : first + 32 * c + 32] for c in range(4)]  # low halves, then high
        t = np.concatenate([np.concatenate([c & 15, c >> 4], -1) for c in chunks], -1).astype(np.int64)
        if name == "q5_k":
            qh = b[..., 16:48].astype(np.int64)
            t = t + 16 * np.concatenate([(qh >> s) & 1 for s in range(8)], axis=-1)
        out["t"] = t
        out["sc"], out["mn"] = _k4_scales(b[..., 4:16])
        out["m"] = _half(b, 2)  # dmin
    elif name == "q6_k":
        ql, qh = b[..., 0:128].astype(np.int64), b[..., 128:192].astype(np.int64)
        t = np.empty(b.shape[:2] + (256,), np.int64)
        for h in range(2):
            lo, hi, top = (
                ql[..., 64 * h : 64 * h + 32],
                ql[..., 64 * h + 32 : 64 * h + 64],
                qh[..., 32 * h : 32 * h + 32],
            )
            t[..., 128 * h : 128 * h + 32] = (lo & 15) | ((top & 3) << 4)
            t[..., 128 * h + 32 : 128 * h + 64] = (hi & 15) | (((top >> 2) & 3) << 4)
            t[..., 128 * h + 64 : 128 * h + 96] = (lo >> 4) | (((top >> 4) & 3) << 4)
            t[..., 128 * h + 96 : 128 * h + 128] = (hi >> 4) | (((top >> 6) & 3) << 4)
        out["t"] = t - 32
        out["sc"] = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.int64)
    return out


def values_of(name: str, u: dict) -> np.ndarray:
    """The weight's values from the unpacked parts (rows, columns): what gguf must agree with."""
    rows, blocks, count = u["t"].shape
    sub = count // u["sc"].shape[-1]
    scaled = u["t"] * np.repeat(u["sc"], sub, axis=-1)
    if u["mn"] is not None:  # K: d * sc * q - dmin * min
        v = u["d"][..., None] * scaled - u["m"][..., None] * np.repeat(u["mn"], sub, axis=-1)
    else:
        v = u["d"][..., None] * scaled + u["m"][..., None]
    return v.reshape(rows, blocks * count)


# -- the model: llama.cpp's activation types ----------------------------------------------------


def q8_0_model(x: np.ndarray) -> dict:
    """x (rows, width) float32 as Q8_0 / Q8_1 (ggml-cpu/arch/x86/quants.c): per 32 values."""
    xb = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(xb).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint((xb * inverse[..., None]).astype(np.float32)).astype(np.int64)
    sums = q.sum(-1)
    s = (d * sums.astype(np.float32)).astype(np.float32).astype(np.float16).astype(np.float64)
    return {"q": q, "d": d.astype(np.float16).astype(np.float64), "s": s, "sums": sums}


def q8_k_model(x: np.ndarray) -> dict:
    """x as Q8_K (ggml-quants.c quantize_row_q8_K_ref): per 256 values, sums per 16."""
    xb = x.reshape(x.shape[0], -1, 256).astype(np.float32)
    top = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)[..., 0]  # the first largest |x|
    zero = top == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(zero, np.float32(0), np.float32(-127) / top).astype(np.float32)
        d = np.where(zero, np.float32(0), np.float32(1) / iscale).astype(np.float64)
    q = np.minimum(127, np.rint((iscale[..., None] * xb).astype(np.float32))).astype(np.int64)
    return {"q": q, "d": d, "sums16": q.reshape(*q.shape[:2], 16, 16).sum(-1)}


def product_model(name: str, blocks: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(rows of x, rows of the weight) float64: llama.cpp's vec_dot of each pair."""
    u = unpack(name, blocks)
    rows, nb, count = u["t"].shape
    if PARTNER.get(name) == "q8_k":
        a = q8_k_model(x)
        subs = u["sc"].shape[-1]
        qx = a["q"].reshape(x.shape[0], nb, subs, count // subs)
        t = u["t"].reshape(rows, nb, subs, count // subs)
        isum = np.einsum("bnsj,rnsj->brns", qx, t)  # int64
        main = (isum * u["sc"][None]).sum(-1)  # (x rows, w rows, blocks)
        out = (u["d"][None] * a["d"][:, None] * main).sum(-1)
        if u["mn"] is not None:
            xsub = qx.sum(-1)  # (x rows, blocks, 8)
            mins = np.einsum("bns,rns->brn", xsub, u["mn"])
            out -= (u["m"][None] * a["d"][:, None] * mins).sum(-1)
        return out
    a = q8_0_model(x)
    isum = np.einsum("bnj,rnj->brn", a["q"], u["t"])
    out = (u["d"][None] * a["d"][:, None] * isum).sum(-1)
    if name in ("q4_1", "q5_1"):
        out += (u["m"][None] * a["s"][:, None]).sum(-1)
    return out


# -- weights ----------------------------------------------------------------------------------


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, cols / block, bytes): every byte random but the float16 factors, which keep the
    values near 1 (gguf cannot quantize the K types, so random blocks serve every type alike)."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, (rows, cols // fmt.block, fmt.block_bytes), dtype=np.uint8)
    top = {"q6_k": 4e-3, "q8_0": 1e-2}.get(name, 2e-2 if name.endswith("_k") else 0.1)
    for at in fmt.factors:
        w[..., at : at + 2] = rng.uniform(top / 4, top, w.shape[:2] + (1,)).astype("<f2").view(np.uint8)
    return w


def interleaved(blocks: np.ndarray, lanes: int = 64) -> np.ndarray:
    """The workers' layout: byte p of block b of row g * lanes + l at [g, b, p, l]."""
    rows, count, size = blocks.shape
    out = np.empty((rows // lanes, count, size, lanes), np.uint8)
    for r in range(rows):
        out[r // lanes, :, :, r % lanes] = blocks[r]
    return out


def as_products_read(name: str, w: np.ndarray, isa: int | None = None) -> np.ndarray:
    """w (interleaved) as the integer products on `isa` (the host's by default) read it: where
    they read it packed (int8_products.packs), each four of the format's packed rows (formats.
    Packed) from its first as lane 0's four bytes, then lane 1's, ... (packing.py's layout, made
    here byte by byte)."""
    from workers.backends.cpu import int8_products, vector_ir
    from workers.backends.cpu.formats import INT_FORMATS

    if not int8_products.packs(name, vector_ir.ISA if isa is None else isa):
        return w
    spec = INT_FORMATS[name].packed
    out = w.copy()
    flat = out.reshape(out.shape[0], out.shape[1], -1)
    for p in range(spec.first, spec.end):
        four, k = divmod(p - spec.first, 4)
        for lane in range(w.shape[3]):
            flat[:, :, (spec.first + 4 * four) * w.shape[3] + 4 * lane + k] = w[:, :, p, lane]
    return out


# -- the tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", INT_TYPES)
def test_the_models_unpacking_gives_ggufs_values(name):
    blocks = random_blocks(name, 4, 512, seed=1)
    ours = values_of(name, unpack(name, blocks))
    theirs = gguf.quants.dequantize(blocks.reshape(4, -1), getattr(gguf.GGMLQuantizationType, name.upper()))
    np.testing.assert_allclose(ours, theirs.astype(np.float64), rtol=1e-6, atol=1e-9)


def test_round_half_is_ieees_float16_rounding():
    from workers.backends.cpu.activations import round_halves

    rng = np.random.default_rng(2)
    exponents = rng.integers(-30, 6, 20000).astype(np.float32)
    values = (rng.standard_normal(20000) * np.float32(10) ** exponents).astype(np.float32)
    edges = [0.0, -0.0, 65504, 65519.99, 65520, 1e6, 2**-14, 2**-24, 2**-25, 3 * 2**-25, 1e-30, np.inf, -np.inf]
    values = np.concatenate([values, np.array(edges, np.float32), -np.array(edges, np.float32)])
    out = np.empty_like(values)
    round_halves(values, out)
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("partner", ["q8_0", "q8_1", "q8_k"])
@pytest.mark.parametrize("threaded", [False, True], ids=["one thread", "rows over threads"])
def test_the_activations_round_as_ggml_rounds_them(partner, threaded):
    """The one-thread quantizers and their twins over a prefill's rows (row_threads.py)."""
    from workers.backends.cpu import activations

    twin = "_parallel" if threaded else ""
    quantize_q8_0 = getattr(activations, "quantize_q8_0" + twin)
    quantize_q8_k = getattr(activations, "quantize_q8_k" + twin)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 512)) * 3).astype(np.float32)
    x[1, :256] = 0  # a zero block: d 0, quants 0
    x[2, 7] = -x[2, :256].__abs__().max() * 2  # a negative largest value (Q8_K's sign)
    x[2, 300] = 40.5 / 127 * np.abs(x[2, 256:288]).max()  # halves to round
    q = np.empty(x.shape, np.int8)
    if partner == "q8_k":
        d, sums = np.empty((3, 2), np.float32), np.empty((3, 32), np.int32)
        quantize_q8_k(x, q, d, sums)
        model = q8_k_model(x)
        np.testing.assert_array_equal(sums, model["sums16"].reshape(3, 32))
    else:
        d, sums, s = np.empty((3, 16), np.float32), np.empty((3, 16), np.int32), np.zeros((3, 16), np.float32)
        quantize_q8_0(x, q, d, sums, s, partner == "q8_1")
        model = q8_0_model(x)
        np.testing.assert_array_equal(sums, model["sums"])
        if partner == "q8_1":
            np.testing.assert_array_equal(s, model["s"])
    np.testing.assert_array_equal(q.astype(np.int64), model["q"].reshape(3, 512))
    np.testing.assert_array_equal(d.astype(np.float64), model["d"])


def _close_to_model(out: np.ndarray, expected: np.ndarray, magnitude: np.ndarray) -> None:
    """Equal to the model to float32 rounding of the per-block sums: within 1e-5 of each output's
    sum of |terms| (`magnitude`, |x| times |the weight's values|)."""
    assert out.shape == expected.shape
    excess = np.abs(out - expected) - 1e-5 * magnitude
    assert excess.max() <= 0, f"{np.abs(out - expected).max()} off at most, {excess.max()} past the bound"


def test_a_format_whose_passes_miss_a_sub_block_is_refused():
    """A format's passes over shared byte rows, and its classes of sub-blocks made by one code,
    must take each sub-block once: one left out would silently add nothing to the products."""
    from dataclasses import replace

    from workers.backends.cpu.formats import INT_FORMATS, Transposed

    q6_k = INT_FORMATS["q6_k"]
    passes = q6_k.transposed.passes
    with pytest.raises(ValueError, match="q6_k"):
        replace(q6_k, transposed=Transposed(q6_k.transposed.sources, q6_k.transposed.value, passes[1:]))
    with pytest.raises(ValueError, match="q6_k"):
        replace(q6_k, transposed=Transposed(q6_k.transposed.sources, q6_k.transposed.value, passes + passes[:1]))
    assert replace(q6_k, transposed=Transposed(q6_k.transposed.sources, q6_k.transposed.value, passes[::-1]))
    classes = q6_k.repeated.classes
    with pytest.raises(ValueError, match="q6_k: the classes"):
        replace(q6_k, repeated=replace(q6_k.repeated, classes=classes[1:]))
    with pytest.raises(ValueError, match="q6_k: the classes"):
        replace(q6_k, repeated=replace(q6_k.repeated, classes=classes + ((0,),)))


@pytest.mark.parametrize("name", INT_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_each_format_equals_the_model_of_llama_cpps_arithmetic(name, rows):
    """One, two, five and nine activation rows (four at a time from the weight, then one by one;
    from eight rows each block unpacked once for the fours): every output the model's, for
    weights of 128 rows (two 64-lane groups) and 512 values."""
    from workers.backends.cpu import int8_products

    blocks = random_blocks(name, 128, 512, seed=rows)
    x = (np.random.default_rng(rows).standard_normal((rows, 512)) * 2).astype(np.float32)
    out = np.full((rows, 128), np.nan, np.float32)
    int8_products.product(name, rows, 512)(x, as_products_read(name, interleaved(blocks)), out)
    expected = product_model(name, blocks, x)
    _close_to_model(out, expected, np.abs(x) @ np.abs(values_of(name, unpack(name, blocks))).T)


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q4_k"])
def test_a_product_over_two_threads_quantizes_its_rows_by_the_twin_with_the_same_bits(name, monkeypatch):
    """A product made for two threads and as many values as row_threads wants threaded
    (here every size) quantizes its rows with the twin over the threads: the bits of the
    product made for one thread, and the model's values."""
    from workers.backends.cpu import activations, int8_products, row_threads

    blocks = random_blocks(name, 128, 512, seed=5)
    w = as_products_read(name, interleaved(blocks))
    x = (np.random.default_rng(5).standard_normal((9, 512)) * 2).astype(np.float32)
    alone = np.full((9, 128), np.nan, np.float32)
    int8_products.product(name, 9, 512, threads=1)(x, w, alone)
    twin = "quantize_q8_k_parallel" if name == "q4_k" else "quantize_q8_0_parallel"
    ran, original = [], getattr(activations, twin)
    monkeypatch.setattr(activations, twin, lambda *a: ran.append(1) or original(*a))
    monkeypatch.setattr(row_threads, "PARALLEL_VALUES", 1)
    threaded = np.full((9, 128), np.nan, np.float32)
    int8_products.product(name, 9, 512, threads=2)(x, w, threaded)
    assert ran, "the quantizer's twin did not run"
    assert threaded.tobytes() == alone.tobytes()
    expected = product_model(name, blocks, x)
    _close_to_model(threaded, expected, np.abs(x) @ np.abs(values_of(name, unpack(name, blocks))).T)


@pytest.mark.parametrize("name", INT_TYPES)
@pytest.mark.parametrize("rows, threads", [(1, 1), (5, 2), (9, 1)])  # one row, fours + one, unpacked
def test_the_residual_added_as_each_row_group_is_written_is_numpys_add(name, rows, threads, monkeypatch):
    """qmatmul_add with 8-bit activations (a decode step's residual): the loops add the addend
    as they write each row group, bit for bit NumPy's add of the product they write alone,
    through the pattern's planned kernel too; an addend broadcast over the rows goes the product
    then NumPy's add (the same sums)."""
    from workers.backends.cpu import int8_products, numba_cpu

    monkeypatch.setattr(numba_cpu, "_THREADS", [threads])
    blocks = random_blocks(name, 128, 512, seed=rows)
    sent = interleaved(blocks)
    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, 512)) * 2).astype(np.float32)
    addend = (rng.standard_normal((rows, 128)) * np.logspace(-3, 3, 128)).astype(np.float32)
    alone = np.full((rows, 128), np.nan, np.float32)
    w = as_products_read(name, sent)
    int8_products.product(name, rows, 512, threads)(x, w, alone)
    summed = np.full((rows, 128), np.nan, np.float32)
    int8_products.product(name, rows, 512, threads)(x, w, summed, addend)
    assert summed.tobytes() == (alone + addend).tobytes()

    block = FORMATS[name].block
    xb, weight = x.reshape(rows, 512 // block, block), sent.copy()
    params = {"qmatmul": {"format": name, "activations": "q8"}, "shape": (rows, 2, 64), "out": (rows, 128)}
    kernel = numba_cpu.OVERRIDES["qmatmul_add"]
    for residual in (addend, addend[:1]):  # its own rows; one row broadcast
        out = np.full((rows, 128), np.nan, np.float32)
        run = kernel.plan(np, (xb, weight, residual), params, out)
        assert run() is out
        assert out.tobytes() == (alone + residual).tobytes()


@pytest.mark.parametrize("isa", ["generic", "avx2", "vnni"])
@pytest.mark.parametrize("rows", [1, 4])
def test_every_instruction_set_gives_the_models_integer_sums(isa, rows):
    """The generated block code of each instruction set (vector_ir.py) on one block of every
    format, read from the weight and from the block unpacked once: its int32 sums are the
    model's exactly, on random blocks and on the extremes (every quant at its largest, every
    activation at 127: AVX2's int16 pair sums, added over several fours before they widen, at
    their largest; q8_0's -128 by AVX2's sign trick); one row's also class by class
    (formats.Repeated). (AVX2 and VNNI only where the CPU has them.)"""
    import numba
    from llvmlite import binding

    from workers.backends.cpu import int8_products, vector_ir
    from workers.backends.cpu.activations import quantize_q8_0, quantize_q8_k
    from workers.backends.cpu.formats import INT_FORMATS

    code = {"generic": vector_ir.GENERIC, "avx2": vector_ir.AVX2, "vnni": vector_ir.VNNI}[isa]
    if code == vector_ir.VNNI and vector_ir.host_isa() != vector_ir.VNNI:
        pytest.skip("this CPU has no AVX-512 VNNI")
    if code == vector_ir.AVX2 and not binding.get_host_cpu_features().get("avx2"):
        pytest.skip("this CPU has no AVX2")

    def runner(sums_of_block):
        @numba.njit
        def run(code, w, x8, sums, out):
            sums_of_block(code, w, 0, 16384, x8, 0, x8.shape[1], sums, 0, sums.shape[1], out)

        return run

    def unpacked_runner(unpack_block, sums_of_unpacked):  # the block unpacked once, then its sums
        @numba.njit
        def run(code, w, x8, sums, out):
            scratch = np.empty(int8_products.SCRATCH_BYTES, np.uint8)
            unpack_block(code, w, 0, 16384, scratch)
            sums_of_unpacked(code, scratch, x8, 0, x8.shape[1], sums, 0, sums.shape[1], out)

        return run

    def classes_runner(by_classes):  # one row, the sub-blocks class by class (formats.Repeated)
        @numba.njit
        def run(code, w, x8, sums, out):
            by_classes(code, w, 0, 16384, x8, 0, x8.shape[1], sums, 0, sums.shape[1], out)

        return run

    run_by_classes = classes_runner(int8_products.one_row_by_classes(code)) if rows == 1 else None
    for family in (int8_products.LEGACY, int8_products.K_QUANTS):
        run = runner(int8_products.block_sums(family, rows, isa=code))
        unpack_block = int8_products.block_unpack(family, isa=code)
        run_unpacked = unpacked_runner(unpack_block, int8_products.block_sums(family, rows, isa=code, unpacked=True))

        for name, extreme in ((name, extreme) for name in family for extreme in (False, True)):
            spec, block = INT_FORMATS[name], FORMATS[name].block
            blocks = random_blocks(name, 64, 256, seed=7)[:, : 256 // block]
            x = (np.random.default_rng(8).standard_normal((rows, 256)) * 2).astype(np.float32)
            if extreme:  # (the float16 factors, which the integer sums do not read, become NaN)
                largest = 0x80 if name == "q8_0" else 0xFF  # q8_0's -128
                blocks, x = np.full_like(blocks, largest), np.full_like(x, 3.0)
            q = np.empty(x.shape, np.int8)
            if PARTNER.get(name) == "q8_k":
                sums = np.empty((rows, 16), np.int32)
                quantize_q8_k(x, q, np.empty((rows, 1), np.float32), sums)
            else:
                sums = np.empty((rows, 8), np.int32)
                quantize_q8_0(x, q, np.empty((rows, 8), np.float32), sums, np.empty((rows, 8), np.float32), False)
            w = as_products_read(name, interleaved(blocks[:, :1]), code)  # the first block
            out = np.zeros((rows, 2, 64), np.int32)
            run(spec.code, w, q, sums, out)
            again = np.zeros((rows, 2, 64), np.int32)
            run_unpacked(spec.code, w, q, sums, again)
            np.testing.assert_array_equal(again, out, err_msg=f"{name} unpacked, extreme {extreme}")
            if run_by_classes is not None and name in int8_products.K_REPEATED:
                by_classes = np.zeros((rows, 2, 64), np.int32)  # (no minimums, q6_k: left as they are)
                by_classes[:, 0] = -1  # the sums of the block before
                run_by_classes(spec.code, w, q, sums, by_classes)
                np.testing.assert_array_equal(by_classes, out, err_msg=f"{name} by classes, extreme {extreme}")
            u = unpack(name, blocks[:, :1])
            qx = q.astype(np.int64)[:, : u["t"].shape[-1]]
            subs = u["sc"].shape[-1]
            per_sub = np.einsum("bsj,rsj->brs", qx.reshape(rows, subs, -1), u["t"][:, 0].reshape(64, subs, -1))
            expected = (per_sub * u["sc"][:, 0][None]).sum(-1)
            np.testing.assert_array_equal(out[:, 0], expected, err_msg=f"{name}, extreme {extreme}")
            if u["mn"] is not None:
                xsub = qx.reshape(rows, subs, -1).sum(-1)
                np.testing.assert_array_equal(out[:, 1], xsub @ u["mn"][:, 0].T, err_msg=name)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_products_split_over_workers_equal_the_model(sim, n):
    """qmatmul with q8 activations on the simulator: the weight's rows (192, three 64-lane groups)
    split 2|1 or 1|1|1 groups, and its values split on block boundaries (Partial), unevenly; each
    device's part is the model's of its slice, so the whole is the model's."""
    from meta.tensor import qmatmul

    name = "q4_0"
    blocks = random_blocks(name, 192, 256, seed=n)
    x = (np.random.default_rng(n).standard_normal((2, 256))).astype(np.float32)
    expected = product_model(name, blocks, x)
    magnitude = np.abs(x) @ np.abs(values_of(name, unpack(name, blocks))).T
    dev = sim(n)
    w = interleaved(blocks)
    groups = {1: (3,), 2: (2, 1), 3: (1, 1, 1)}[n]
    by_rows = dev.tensor(w, Split(0, (groups,)))
    got = qmatmul(dev.tensor(x), by_rows, name, "q8").numpy()
    _close_to_model(got, expected, magnitude)
    extents = {1: (8,), 2: (5, 3), 3: (4, 0, 4)}[n]  # blocks of 32 values each device
    by_values = dev.tensor(w, Split(1, (extents,)))
    got = qmatmul(dev.tensor(x), by_values, name, "q8").numpy()
    _close_to_model(got, expected, magnitude)


# -- weights packed at load (workers/backends/cpu/packing.py) ----------------------------------


@pytest.mark.parametrize("name", INT_TYPES)
def test_a_weight_is_packed_once_and_every_kernel_reads_it(name):
    """The first integer product of a weight packs it in place (the layout as_products_read
    makes byte by byte), later ones find it packed (the same bits); the table lookup reads the
    packed rows where they lie (the shared kernel's rows of the bytes as sent); a host copy is
    the bytes as sent; the float32 products unpack it first (the bits of a weight never packed),
    and the next integer product packs it again."""
    from workers.backends.cpu import Backend, int8_products, numba_cpu, packing
    from workers.kernels import quant

    if not int8_products.packs(name):
        pytest.skip("the generic code reads weights as they are sent")
    block = FORMATS[name].block
    blocks = random_blocks(name, 128, 512, seed=3)
    sent = interleaved(blocks)
    w = sent.copy()
    x = (np.random.default_rng(3).standard_normal((2, 512)) * 2).astype(np.float32).reshape(2, -1, block)
    q8 = {"format": name, "activations": "q8"}
    first = numba_cpu.qmatmul(np, [x, w], q8).reshape(2, 128)
    assert packing.layout_of(w) == name
    np.testing.assert_array_equal(w, as_products_read(name, sent))
    _close_to_model(
        first,
        product_model(name, blocks, x.reshape(2, 512)),
        np.abs(x.reshape(2, 512)) @ np.abs(values_of(name, unpack(name, blocks))).T,
    )
    again = numba_cpu.qmatmul(np, [x, w], q8).reshape(2, 128)
    assert again.tobytes() == first.tobytes()

    ids = np.array([[0, 127, 64], [5, 5, 70]])
    lookup = {"format": name, "rows": 128}
    rows = numba_cpu.qget_rows(np, [w, ids], lookup, np.empty((2, 3, 512), np.float32))
    np.testing.assert_array_equal(rows, quant.qget_rows(np, [sent, ids], lookup))
    np.testing.assert_array_equal(Backend().to_host(w), sent)
    assert packing.layout_of(w) == name

    exact = numba_cpu.qmatmul(np, [x, w], {"format": name})
    assert packing.layout_of(w) is None
    np.testing.assert_array_equal(w, sent)
    assert exact.tobytes() == numba_cpu.qmatmul(np, [x, sent.copy()], {"format": name}).tobytes()
    assert numba_cpu.qmatmul(np, [x, w], q8).reshape(2, 128).tobytes() == first.tobytes()


@pytest.mark.parametrize("name", ["q4_k", "q4_0"])
def test_a_planned_lookup_reads_the_tables_layout_each_run(name):
    """qget_rows planned (a decode step's embedding) on a table a tied head's products pack in
    place after the plan was made, and unpack again: each run reads the layout the table has
    then, at the ids written in place since (the shared NumPy kernel's rows of the bytes as sent)."""
    from workers.backends.cpu import int8_products, numba_cpu, packing
    from workers.kernels import quant

    if not int8_products.packs(name):
        pytest.skip("the generic code reads weights as they are sent")
    block = FORMATS[name].block
    sent = interleaved(random_blocks(name, 128, 512, seed=5))
    w, ids, lookup = sent.copy(), np.array([[3, 100]]), {"format": name, "rows": 128}
    out = np.full((1, 2, 512), np.nan, np.float32)
    run = numba_cpu.qget_rows.plan(np, [w, ids], lookup, out)
    x = np.random.default_rng(5).standard_normal((1, 512)).astype(np.float32).reshape(1, -1, block)
    for ran_before, chosen in [(None, [3, 100]), ({"activations": "q8"}, [127, 0]), ({}, [64, 64])]:
        if ran_before is not None:  # an integer product packs w, a float32 one unpacks it
            numba_cpu.qmatmul(np, [x, w], {"format": name, **ran_before})
        ids[0] = chosen
        assert run() is out
        assert packing.layout_of(w) == (name if ran_before else None)
        np.testing.assert_array_equal(out, quant.qget_rows(np, [sent, ids], lookup))


def test_a_view_across_a_packed_weight_is_refused_and_read_only_memory_stays_as_sent():
    """A view that overlaps a packed weight without being it would read bytes in the wrong
    layout: ShapeError. Memory that cannot be packed (read-only) takes the float32 products."""
    from split_state.errors import ShapeError
    from workers.backends.cpu import int8_products, numba_cpu, packing

    name = "q4_0"
    if not int8_products.packs(name):
        pytest.skip("the generic code reads weights as they are sent")
    w = interleaved(random_blocks(name, 128, 256, seed=4))
    x = np.random.default_rng(4).standard_normal((1, 8, 32)).astype(np.float32)
    numba_cpu.qmatmul(np, [x, w], {"format": name, "activations": "q8"})
    with pytest.raises(ShapeError, match="overlap a q4_0 weight packed"):
        packing.layout_of(w[:1])
    sent = interleaved(random_blocks(name, 128, 256, seed=5))
    frozen = sent.copy()
    frozen.flags.writeable = False
    got = numba_cpu.qmatmul(np, [x, frozen], {"format": name, "activations": "q8"})
    np.testing.assert_array_equal(frozen, sent)
    assert got.tobytes() == numba_cpu.qmatmul(np, [x, sent], {"format": name}).tobytes()
