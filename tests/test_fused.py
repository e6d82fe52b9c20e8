"""Fused decoder patterns (workers/kernels/fused.py): each kernel against a NumPy oracle written
from the formula, the matcher finds each pattern in a decoder's program, and a fused program
gives the tokens (and, reading the whole cache, the bits) of the unfused one."""

from __future__ import annotations

import numpy as np
import pytest

from meta import MetaDevice
from models import reference as ref
from models.llama import LlamaConfig, TensorParallelLlama, random_weights
from workers.kernels import KERNELS
from workers.kernels.fused import FUSED_KERNELS, KV_BUCKET, used_positions
from workers.simulator import SimulatedCluster

pytestmark = pytest.mark.timeout(120)
rng = np.random.default_rng(7)


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_rms_norm_mul_is_the_normalised_row_times_the_weight():
    x, w = f32(2, 3, 40), f32(40)
    expected = ref.rms_norm(x.astype(np.float64), -1, 1e-5) * w
    out = np.empty_like(x)
    got = FUSED_KERNELS["rms_norm_mul"](np, (x, w), {"axis": 2, "eps": 1e-5}, out)
    assert got is out
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-6)


def test_swiglu_is_silu_of_the_gate_times_the_up_half():
    both = f32(1, 2, 16)  # gate | up along the last axis
    expected = ref.silu(both[..., :8].astype(np.float64)) * both[..., 8:]
    got = FUSED_KERNELS["swiglu"](np, (both,), {"gate": (0, 8), "up": (8, 16)}, np.empty((1, 2, 8), np.float32))
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-6)


def attention_oracle(q, k, mask, v, scale):
    s = q.astype(np.float64) @ k.astype(np.float64) * scale + mask
    return ref.softmax(s, -1) @ v.astype(np.float64)


@pytest.mark.parametrize("ctx, position", [(40, 39), (700, 5), (700, 300), (700, 699), (1024, 511)])
def test_attention_reads_the_used_cache_and_equals_the_whole_softmax(ctx, position):
    b, kv, g, t, hd = 1, 2, 3, 1, 8
    q, k, v = f32(b, kv, g, t, hd), f32(b, kv, 1, hd, ctx), f32(b, kv, 1, ctx, hd)
    mask = np.where(np.arange(ctx) <= position, 0.0, -np.inf).astype(np.float32).reshape(1, 1, 1, 1, ctx)
    # what lies past the used positions must not matter: poison it
    unused = used_positions(np, mask, KV_BUCKET)
    k[..., unused:], v[..., unused:, :] = np.nan, np.nan
    out = np.empty((b, kv, g, t, hd), np.float32)
    scratch = np.empty(2 * b * kv * g * t * ctx + q.size, np.float32)
    got = FUSED_KERNELS["attention"](np, (q, k, mask, v), {"scale": 0.3, "bucket": KV_BUCKET}, out, scratch=scratch)
    k[..., unused:], v[..., unused:, :] = 0, 0
    np.testing.assert_allclose(got, attention_oracle(q, k, mask, v, 0.3), rtol=1e-5, atol=1e-6)


def key_row_case(batch, tokens, ctx, last_positions, cached=np.float32):
    """The decoder's layout: keys cached as rows (b, kv, ctx, hd), handed to attention as a
    transposed view (b, kv, 1, hd, ctx); a causal mask per sequence (b, 1, 1, t, ctx) whose
    token j of sequence s sees positions up to last_positions[s] - (tokens - 1 - j); what lies
    past the used positions is NaN and must not matter."""
    kv, g, hd = 2, 3, 8
    q = f32(batch, tokens, kv * g, hd).reshape(batch, tokens, kv, g, hd).transpose(0, 2, 3, 1, 4)  # a view, as decoded
    key_rows, v = f32(batch, kv, 1, ctx, hd).astype(cached), f32(batch, kv, 1, ctx, hd).astype(cached)
    mask = np.full((batch, 1, 1, tokens, ctx), -np.inf, np.float32)
    for s, last in enumerate(last_positions):
        for j in range(tokens):
            mask[s, 0, 0, j, : last - (tokens - 1 - j) + 1] = 0.0
    unused = used_positions(np, mask, KV_BUCKET)
    key_rows[..., unused:, :], v[..., unused:, :] = np.nan, np.nan
    expected = attention_oracle(  # the oracle sums every position: zeros past the used ones
        q, np.nan_to_num(key_rows).astype(np.float64).swapaxes(-1, -2), mask, np.nan_to_num(v).astype(np.float64), 0.3
    )
    return (q, key_rows.swapaxes(-1, -2), mask, v), expected


def attention_kernels():
    kernels = {"numpy": FUSED_KERNELS["attention"]}
    from workers.backends.cpu import numba_cpu

    if numba_cpu.AVAILABLE:
        kernels["numba softmax"] = numba_cpu.OVERRIDES["attention"]
    return kernels


@pytest.mark.parametrize("cached", [np.float32, np.float16])
@pytest.mark.parametrize("kernel", ["numpy", "numba softmax"])
@pytest.mark.parametrize(
    "batch, tokens, ctx, last_positions",
    [(1, 1, 40, [39]), (1, 1, 700, [300]), (2, 1, 1024, [5, 700]), (2, 3, 600, [2, 550]), (1, 4, 64, [3])],
)
def test_attention_over_cached_key_rows_equals_the_whole_softmax(kernel, batch, tokens, ctx, last_positions, cached):
    """float16 caches (llama.cpp's --cache-type-k / -v f16): against the oracle on the float16
    values, each widened exactly; a few tokens' query rows take the numba loop over the bits
    (test_decode_attention_is_one_threaded_loop_...), more the widened rows and BLAS."""
    kernels = attention_kernels()
    if kernel not in kernels:
        pytest.skip("numba is not installed")
    inputs, expected = key_row_case(batch, tokens, ctx, last_positions, cached)
    q = inputs[0]
    out = np.empty(q.shape, np.float32)
    scratch = np.empty(2 * q[..., 0].size * ctx + q.size, np.float32)  # as a program sizes it
    got = kernels[kernel](np, inputs, {"scale": 0.3, "bucket": KV_BUCKET}, out, scratch=scratch, memo={})
    assert got is out
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cached", [np.float32, np.float16])
@pytest.mark.parametrize(
    "batch, tokens, ctx, last_positions",
    [(1, 1, 40, [39]), (2, 1, 1024, [5, 700]), (2, 3, 600, [2, 550]), (1, 8, 64, [10]), (3, 2, 97, [96, 1, 50])],
)
def test_decode_attention_is_one_threaded_loop_equal_to_the_whole_softmax(
    monkeypatch, threads, cached, batch, tokens, ctx, last_positions
):
    """Up to MAX_LOOP_QUERIES tokens a decoder's attention is one numba loop over the query rows
    (numba_loops.decode_attention), split over the worker's threads: it runs (counted), and
    gives the oracle's result whatever the thread count, position counts not a multiple of the
    loop's four-row passes included."""
    from workers.backends.cpu import numba_cpu

    if not numba_cpu.AVAILABLE:
        pytest.skip("numba is not installed")
    loops, calls = numba_cpu._loops(), []
    loop = loops.decode_attention
    monkeypatch.setattr(loops, "decode_attention", lambda *a: (calls.append(a[5]), loop(*a))[1])
    monkeypatch.setattr(numba_cpu, "_THREADS", [threads])  # each thread's numba count follows it
    inputs, expected = key_row_case(batch, tokens, ctx, last_positions, cached)
    q = inputs[0]
    out = np.empty(q.shape, np.float32)
    scratch = np.empty(2 * q[..., 0].size * ctx + q.size, np.float32)  # as a program sizes it
    got = numba_cpu.OVERRIDES["attention"](np, inputs, {"scale": 0.3, "bucket": 1}, out, scratch=scratch, memo={})
    assert calls == [max(last_positions) + 1]  # bucket 1: exactly the used positions, rarely a multiple of 4
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cached", [np.float32, np.float16])
@pytest.mark.parametrize(
    "batch, tokens, kv_of_head, last_positions",
    [(1, 1, [0, 0, 0, 1, 1], [39]), (2, 1, [0, 1, 1, 1], [5, 61]), (2, 3, [0, 0, 1, 2], [2, 50]), (1, 1, [2, 2], [9])],
)
def test_gqa_attention_reads_each_query_heads_own_kv_head(
    monkeypatch, threads, cached, batch, tokens, kv_of_head, last_positions
):
    """The gqa_attention op (query heads mapped to KV heads one by one, as a split that cuts a
    KV group leaves them): up to MAX_LOOP_QUERIES tokens every head in the one threaded loop
    (counted), on the CPU backend's kernels and the shared ones; each equals the float64 oracle
    (models/reference.py, head by head), float16 caches and KV heads nobody reads included."""
    from workers.backends.cpu import numba_cpu

    rng = np.random.default_rng(7)
    kv, ctx, hd = 3, 64, 8
    q = rng.standard_normal((batch, tokens, len(kv_of_head), hd)).astype(np.float32)
    keys, values = (rng.standard_normal((batch, kv, ctx, hd)).astype(cached) for _ in range(2))
    mask = np.full((batch, tokens, ctx), -np.inf, np.float32)
    for s, last in enumerate(last_positions):
        for j in range(tokens):
            mask[s, j, : last - (tokens - 1 - j) + 1] = 0.0
    params = {"scale": 0.3, "kv_of_head": kv_of_head}
    expected = ref.reference("gqa_attention", [q, keys, values, mask], params)
    kernels = {"shared": KERNELS["gqa_attention"]}
    calls = []
    if numba_cpu.AVAILABLE:
        kernels["cpu"] = numba_cpu.OVERRIDES["gqa_attention"]
        loops = numba_cpu._loops()
        loop = loops.decode_attention
        monkeypatch.setattr(loops, "decode_attention", lambda *a: (calls.append(a[1].tolist()), loop(*a))[1])
        monkeypatch.setattr(numba_cpu, "_THREADS", [threads])
    for name, kernel in kernels.items():
        out = np.empty(q.shape, np.float32)
        got = kernel(np, (q, keys, values, mask), params, out, memo={})
        assert got is out
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=name)
    if numba_cpu.AVAILABLE:  # a decode step or a short prompt: one call with the map
        assert calls == [kv_of_head]


@pytest.mark.parametrize("tokens", [1, 3, 8, 12])
def test_a_rows_gqa_attention_is_the_bits_it_gets_alone_in_a_batch(tokens):
    """A server prefills the prompts that join together in one step (models/batching.py
    _joining): a row's attention must be the bits it gets alone. Three rows of float16 keys and
    values, causal masks (a fresh prompt's, its padding included): each row of the batch's
    result equals the same row run alone, bit for bit, on the CPU kernels (a batch of several
    rows went to BLAS where one row took the loop, up to MAX_LOOP_QUERIES tokens), and the
    float64 oracle within rounding."""
    from workers.backends.cpu import numba_cpu

    if not numba_cpu.AVAILABLE:
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(3)
    batch, kv, hd, kv_of_head = 3, 2, 64, [0, 0, 0, 1, 1]
    q = rng.standard_normal((batch, tokens, len(kv_of_head), hd)).astype(np.float32)
    keys, values = (rng.standard_normal((batch, kv, tokens, hd)).astype(np.float16) for _ in range(2))
    mask = np.full((batch, tokens, tokens), -np.inf, np.float32)
    for j in range(tokens):
        mask[:, j, : j + 1] = 0.0
    params = {"scale": 0.125, "kv_of_head": kv_of_head}
    kernel = numba_cpu.OVERRIDES["gqa_attention"]
    together = kernel(np, (q, keys, values, mask), params, np.empty(q.shape, np.float32), memo={})
    np.testing.assert_allclose(
        together, ref.reference("gqa_attention", [q, keys, values, mask], params), rtol=1e-5, atol=1e-6
    )
    for b in range(batch):
        alone = kernel(
            np, tuple(a[b : b + 1].copy() for a in (q, keys, values, mask)), params, np.empty(q[:1].shape, np.float32),
            memo={},
        )  # fmt: skip
        np.testing.assert_array_equal(together[b : b + 1].view(np.uint32), alone.view(np.uint32), err_msg=f"row {b}")


@pytest.mark.parametrize("kernel", ["numpy", "numba softmax"])
def test_a_prefills_attention_copies_its_query_rows_into_the_scratch_not_into_new_memory(kernel):
    """Several tokens' queries are a transposed view: their rows are copied once per layer
    into the scratch a program gives the kernel, never into memory of their own: the kernel
    allocates no more for them (what numpy allocates, tracemalloc sees) than for the same
    queries laid out as rows already. Without room in the scratch it still works, on a copy."""
    import tracemalloc

    kernels = attention_kernels()
    if kernel not in kernels:
        pytest.skip("numba is not installed")
    inputs, expected = key_row_case(1, 64, 96, [90])
    q = inputs[0]
    out = np.empty(q.shape, np.float32)
    params = {"scale": 0.3, "bucket": KV_BUCKET}

    def allocated(queries) -> int:
        scratch = np.empty(2 * q[..., 0].size * 96 + q.size, np.float32)  # as a program sizes it
        kernels[kernel](np, (queries, *inputs[1:]), params, out, scratch=scratch, memo={})  # numba loaded
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            kernels[kernel](np, (queries, *inputs[1:]), params, out, scratch=scratch, memo={})
            return tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()

    as_rows = allocated(np.ascontiguousarray(q))  # merging (group, tokens) is a view of it
    transposed = allocated(q)
    assert transposed - as_rows < q.nbytes // 2, f"{transposed} bytes against {as_rows}: the rows are {q.nbytes}"
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    small = np.empty(2 * q[..., 0].size * 96, np.float32)  # the scores only
    got = kernels[kernel](np, inputs, params, out, scratch=small, memo={})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_the_numba_softmax_gives_masked_positions_exactly_zero_weight():
    from workers.backends.cpu import numba_cpu

    if not numba_cpu.AVAILABLE:
        pytest.skip("numba is not installed")
    n, rows, group = 300, 6, 3  # two tokens per group member
    scores = f32(2, 2, n, rows) * 20  # key-major, wide enough to reach exp's far ends
    mask = np.zeros((2, 1, 1, 2, n + 7), np.float32)
    mask[0, ..., 0, 100:] = -np.inf
    mask[1, ..., 1, 3:] = -np.inf
    out = np.empty((2, 2, rows, n), np.float32)
    numba_cpu._softmax_columns(np, scores, mask, group, 0.5, out)
    x = scores.swapaxes(-1, -2).astype(np.float64).reshape(2, 2, group, 2, n) * 0.5 + mask[..., :n]
    expected = ref.softmax(x, -1).reshape(2, 2, rows, n)
    np.testing.assert_allclose(out, expected, rtol=2e-6, atol=1e-9)
    assert np.array_equal(out == 0, expected == 0)  # a masked position weighs nothing, not ~1e-38
    assert (out[0, :, 0::2, 100:] == 0).all() and (out[1, :, 1::2, 3:] == 0).all()


def test_the_vectorised_exponential_is_within_three_ulp_and_zero_below_its_range():
    from workers.backends.cpu import numba_cpu

    if not numba_cpu.AVAILABLE:
        pytest.skip("numba is not installed")
    from workers.backends.cpu.numba_loops import _exp, exact_limits

    @exact_limits
    def each(x, out):
        for i in range(x.size):
            out[i] = _exp(x[i])

    x = np.concatenate([np.linspace(-87, 88, 200_001, dtype=np.float32), [-87.5, -1e4, -np.inf, 0.0]])
    got = np.empty_like(x)
    each(x, got)
    want = np.exp(x.astype(np.float64))
    inside = x >= -87
    np.testing.assert_allclose(got[inside], want[inside], rtol=3 * np.finfo(np.float32).eps, atol=0)
    assert (got[~inside] == 0).all() and got[-1] == 1.0


def _cpu_used_positions(xp, mask, bucket):
    from workers.backends.cpu import numba_cpu

    cpu_overrides()
    return numba_cpu._used_positions(xp, mask, bucket)


@pytest.mark.parametrize("used", [used_positions, _cpu_used_positions], ids=["numpy", "cpu"])
def test_used_positions_round_up_to_the_bucket_and_never_pass_the_cache(used):
    def mask(ctx, open_columns, shape=(2, 1, 1, 1)):
        m = np.full(shape + (ctx,), -np.inf, np.float32)
        for row, last in enumerate(open_columns):
            m[row, ..., : last + 1] = 0.0
        return m

    assert used(np, mask(200, [3, 5]), 256) == 200  # a cache no larger than a bucket
    assert used(np, mask(1000, [3, 5]), 256) == 256
    assert used(np, mask(1000, [3, 300]), 256) == 512  # the row that sees furthest decides
    assert used(np, mask(1000, [255, 0]), 256) == 256
    assert used(np, mask(1000, [256, 0]), 256) == 512
    assert used(np, mask(1000, [999, 0]), 256) == 1000
    assert used(np, mask(1000, [], (1, 1)), 256) == 1000  # nothing open: the whole cache
    assert used(np, mask(1000, [40], (1, 1)), 32) == 64  # a decode step's (1, 1, ctx)
    window = np.full((1, 1, 1000), -np.inf, np.float32)
    window[..., 500:530] = 0.0  # a sliding window: only the last open column counts
    assert used(np, window, 32) == 544
    window[..., 700] = np.nan  # NaN is not -inf: open
    assert used(np, window, 32) == 704
    assert used(np, mask(1000, [300, 20]).astype(np.float16), 256) == 512  # (another dtype)


CFG = LlamaConfig(hidden=48, layers=2, heads=6, kv_heads=2, ffn=40, vocab=64, rope_base=500.0)


def decode_tokens(n: int, ctx: int, fused: bool, steps: int = 6):
    """Greedy tokens of a small decoder on n simulated devices, and the ops its decode step ran."""
    cluster = SimulatedCluster(n)
    if not fused:  # every step its own NumPy kernel: no pattern, no backend override
        from workers.kernels import KERNELS

        for server in cluster.servers:
            server.executor.patterns, server.executor.kernels = (), dict(KERNELS)
    with MetaDevice(cluster) as dev:
        net = TensorParallelLlama(dev, CFG, random_weights(CFG, seed=3).__getitem__, ctx)
        prompt = np.array([[5, 9, 2, 33]])
        logits = net.step(prompt, np.arange(4)[None])
        token = logits[:, 3:].argmax()
        dev.run(token, *net.caches())
        first = token.numpy().astype(np.int32)
        tokens = [int(first[0, 0])]
        step, (out, *_) = net.capture_decode(first, np.array([[4]]))
        programs = [s.executor.programs for s in cluster.servers]
        for pos in range(5, 5 + steps):
            tokens.append(int(out.numpy()[0, 0]))
            out, *_ = step(np.array([[tokens[-1]]], np.int32), np.array([[pos]], np.int32))
        ops: dict[str, set[str]] = {}  # each op run: where its results were placed
        for program in programs[0].values():
            for pl in program.placed:
                if hasattr(pl.step, "op"):
                    ops.setdefault(pl.step.op, set()).add(pl.out)
        return tokens, ops


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_fused_decoder_gives_the_tokens_of_the_unfused_one(n):
    fused, ops = decode_tokens(n, 32, fused=True)
    plain, plain_ops = decode_tokens(n, 32, fused=False)
    # CFG's 2 KV heads over 3 CPU devices: query heads split evenly, attention the gqa_attention op
    attention = "gqa_attention" if n == 3 else "attention"
    assert {attention, "swiglu", "rms_norm_mul", "rope_set_rows"} <= ops.keys()
    assert not {"attention", "swiglu", "rms_norm_mul", "rope_set_rows"} & plain_ops.keys()
    assert ops["rope_set_rows"] == ops["set_rows"] == {"alias"}  # the caches written in place, no buffer
    assert fused == plain


def test_a_long_cache_gives_the_tokens_of_a_short_one():
    """Reading the used positions only: a 600-position cache decodes like a 32-position one."""
    assert decode_tokens(2, 600, fused=True)[0] == decode_tokens(2, 32, fused=True)[0]


# -- the CPU backend's numba loops (workers/backends/cpu/numba_cpu.py) ------------------------------


def cpu_overrides():
    from workers.backends.cpu import numba_cpu

    if not numba_cpu.AVAILABLE:
        pytest.skip("numba is not installed: the NumPy kernels serve the CPU backend")
    return numba_cpu.OVERRIDES


@pytest.mark.parametrize("shape, weight", [((2, 3, 40), (40,)), ((1, 1, 576), (576,)), ((4, 8), (4, 8))])
def test_numba_rms_norm_mul_against_the_formula(shape, weight):
    x, w = f32(*shape), f32(*weight)
    got = cpu_overrides()["rms_norm_mul"](np, (x, w), {"axis": len(shape) - 1, "eps": 1e-5})
    np.testing.assert_allclose(got, ref.rms_norm(x.astype(np.float64), -1, 1e-5) * w, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_numba_rope_against_complex_rotation(mode):
    x, positions = f32(2, 3, 4, 16), np.array([[0, 5, 900], [7, 7, 1]], np.int32)
    got = cpu_overrides()["rope"](np, (x, positions), {"base": 10000.0, "mode": mode})
    np.testing.assert_allclose(got, ref.rope(x, positions, 10000.0, mode), rtol=1e-5, atol=2e-6)


def test_numba_kernels_hand_other_layouts_to_numpy():
    kernels = cpu_overrides()
    x = f32(3, 8)[:, ::2]  # not contiguous
    got = kernels["rms_norm_mul"](np, (x, np.ones(4, np.float32)), {"axis": 1, "eps": 1e-5})
    np.testing.assert_allclose(got, ref.rms_norm(x.astype(np.float64), -1, 1e-5), rtol=2e-6)
    x16, w16 = f32(3, 8).astype(np.float16), f32(8).astype(np.float16)
    got = kernels["rms_norm_mul"](np, (x16, w16), {"axis": 1, "eps": 1e-5})
    assert got.dtype == np.float16
    expected = ref.rms_norm(x16.astype(np.float64), -1, 1e-5) * w16
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=5e-3, atol=5e-3)
    h = f32(1, 2, 2, 8).astype(np.float16)
    got = kernels["rope"](np, (h, np.array([[1, 2]], np.int32)), {"base": 100.0, "mode": "normal"})
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, ref.rope(h, np.array([[1, 2]]), 100.0, "normal"), rtol=2e-3, atol=2e-3)


def test_numba_swiglu_against_the_formula_over_the_exponentials_range():
    both = f32(3, 2, 40) * 4  # gate | up along the last axis, with a gap: gate 2..18, up 22..38
    both[0, 0, 2:9] = [-200, -88, -87.5, 0, 20, 87.5, 200]  # both ends of _exp's range
    out = np.full((3, 2, 16), np.nan, np.float32)
    got = cpu_overrides()["swiglu"](np, (both,), {"gate": (2, 18), "up": (22, 38)}, out)
    assert got is out
    g = both[..., 2:18].astype(np.float64)
    expected = g / (1 + np.exp(-g)) * both[..., 22:38]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-30)
    odd = f32(3, 2, 32)[..., ::2]  # not contiguous: NumPy's passes
    want = FUSED_KERNELS["swiglu"](np, (odd,), {"gate": (0, 8), "up": (8, 16)}, np.empty((3, 2, 8), np.float32))
    got = cpu_overrides()["swiglu"](np, (odd,), {"gate": (0, 8), "up": (8, 16)}, np.empty((3, 2, 8), np.float32))
    np.testing.assert_array_equal(got, want)


def _first_best(values, indices):
    """The top_k order's best entry, found by sorting the entries: NaN as -inf, value
    descending, then index ascending with -1 (padding) after every real index."""
    clean = [(-np.inf if np.isnan(v) else float(v), int(i)) for v, i in zip(values, indices)]
    return min(clean, key=lambda e: (-e[0], np.inf if e[1] < 0 else e[1]))


def test_greedy_candidates_take_the_first_best_of_the_span_nan_as_minus_infinity():
    x = rng.integers(-3, 3, size=(5, 2, 30)).astype(np.float32)  # ties on purpose
    x[0, 0, 7] = np.nan
    x[1, 1, :] = -np.inf  # nothing better than -inf: the span's first index
    x[2, 0, :] = np.nan
    x[2, 0, 20] = -np.inf
    x[3, 1, 12:14] = 9  # a tie at the top: the lower index
    x[4, 0, 25] = np.inf
    local, length, start = 4, 19, 1000  # the span x[..., 4:23] holds global indices 1000..1018
    params = {"k": 1, "width": 1, "spans": ((start, length, local),), "devices": 2}
    out = np.full((5, 2, 1, 2), 7.0)
    got = cpu_overrides()["top_k_candidates"](np, (x,), params, out)
    assert got is out
    for r in range(5):
        for c in range(2):
            span = x[r, c, local : local + length]
            assert tuple(got[r, c, 0]) == _first_best(span, range(start, start + length))


def test_greedy_candidates_over_spans_of_many_search_chunks():
    """Spans longer than numba_loops' search chunk (256 values), not a whole number of them,
    from an offset: the greatest in a late chunk, ties across chunks, -0 beside +0, NaN and
    -inf rows."""
    x = rng.integers(-50, 50, size=(6, 1400)).astype(np.float32)
    x[0, 1300] = 60  # the greatest in the span's last, partial chunk
    x[1, [300, 700, 1301]] = 70  # a tie across chunks: the lowest index
    x[2, :] = -5
    x[2, [5, 600]] = [-0.0, 0.0]  # -0 first: it is the first best (-0 == +0)
    x[3, :] = np.nan
    x[3, 900] = -np.inf
    x[4, :] = -np.inf
    x[5, ::3] = np.nan
    x[5, 1000] = np.inf
    local, length, start = 3, 1299, 5000
    params = {"k": 1, "width": 2, "spans": ((start, length, local),), "devices": 1}
    got = cpu_overrides()["top_k_candidates"](np, (x,), params, np.full((6, 2, 2), 7.0))
    for r in range(6):
        span = x[r, local : local + length]
        best = _first_best(span, range(start, start + length))
        assert tuple(got[r, 0]) == best and tuple(got[r, 1]) == (-np.inf, -1.0)
        chosen = span[int(best[1]) - start]
        assert np.isnan(chosen) or np.signbit(got[r, 0, 0]) == np.signbit(chosen)  # the value's own bits
    assert got[2, 0, 1] == start + 5 - local and got[1, 0, 1] == start + 300 - local


def test_greedy_combine_takes_the_best_pair_and_padding_after_a_real_index():
    pairs = np.array(
        [
            [[1.0, 40], [3.0, 9], [3.0, 2], [-np.inf, -1]],
            [[-np.inf, -1], [-np.inf, 17], [-np.inf, 3], [-np.inf, -1]],  # padding after real indices
            [[np.nan, 5], [-np.inf, -1], [-2.0, 8], [-2.0, 6]],
            [[5.0, -1], [5.0, 30], [0.0, 1], [5.0, 31]],
        ]
    )
    out = np.empty((4, 1, 2))
    got = cpu_overrides()["top_k_combine"](np, (pairs,), {"k": 1}, out)
    assert got is out
    for r in range(4):
        assert tuple(got[r, 0]) == _first_best(pairs[r, :, 0], pairs[r, :, 1])
    assert tuple(got[1, 0]) == (-np.inf, 3.0)


def _sorted_best(values, indices, k, width):
    """The top_k order's first k entries padded to `width` with (-inf, -1), found by sorting
    every entry (Python's sort of (-value, rank) keys): NaN as -inf, value descending, index
    ascending with -1 after every real index."""
    clean = [(-np.inf if np.isnan(v) else float(v), int(i)) for v, i in zip(values, indices)]
    clean.sort(key=lambda e: (-e[0], np.inf if e[1] < 0 else e[1]))
    return clean[:k] + [(-np.inf, -1)] * (width - min(k, len(clean)))


@pytest.mark.parametrize("k, width", [(2, 2), (5, 7), (19, 19), (25, 30)])
def test_sampling_candidates_are_the_best_k_of_the_span_in_the_top_k_order(k, width):
    x = rng.integers(-4, 4, size=(4, 3, 30)).astype(np.float32)  # many ties on purpose
    x[0, 0, 3:9] = np.nan
    x[1, 1, :] = -np.inf
    x[1, 2, ::3] = np.nan
    x[2, 0, :] = np.nan  # nothing but NaN: -inf in index order
    x[2, 1, 10:] = np.arange(20, dtype=np.float32)  # ascending: every entry displaces the worst
    x[3, 0, ::2] = np.inf
    local, length, start = 4, 19, 1000  # the span x[..., 4:23] holds global indices 1000..1018
    params = {"k": k, "width": width, "spans": ((start, length, local),), "devices": 2}
    out = np.full((4, 3, width, 2), 7.0)
    got = cpu_overrides()["top_k_candidates"](np, (x,), params, out)
    assert got is out
    for r in range(4):
        for c in range(3):
            span = x[r, c, local : local + length]
            expected = _sorted_best(span, range(start, start + length), k, width)
            assert [tuple(e) for e in got[r, c]] == expected, (r, c)


@pytest.mark.parametrize("k", [2, 4, 6])
def test_sampling_combine_keeps_the_best_k_pairs_padding_last(k):
    pairs = np.array(
        [
            [[1.0, 40], [3.0, 9], [3.0, 2], [-np.inf, -1], [0.5, 7], [3.0, 1]],
            [[-np.inf, -1], [-np.inf, 17], [-np.inf, 3], [-np.inf, -1], [-np.inf, 4], [-np.inf, -1]],
            [[np.nan, 5], [-np.inf, -1], [-2.0, 8], [-2.0, 6], [np.nan, 2], [-3.0, 1]],
            [[5.0, -1], [5.0, 30], [0.0, 1], [5.0, 31], [6.0, 99], [5.0, 29]],
        ]
    )
    out = np.empty((4, k, 2))
    got = cpu_overrides()["top_k_combine"](np, (pairs,), {"k": k}, out)
    assert got is out
    for r in range(4):
        assert [tuple(e) for e in got[r]] == _sorted_best(pairs[r, :, 0], pairs[r, :, 1], k, k), r


def test_the_candidate_loops_hand_several_spans_to_the_shared_kernel_and_agree_with_it():
    from workers.kernels import basic

    kernels = cpu_overrides()
    x = f32(2, 40)
    for params in (
        {"k": 3, "width": 3, "spans": ((0, 40, 0),)},
        {"k": 9, "width": 12, "spans": ((100, 30, 5),)},
        {"k": 1, "width": 1, "spans": ((0, 5, 0), (20, 7, 5))},
        {"k": 4, "width": 4, "spans": ((0, 5, 0), (20, 7, 5))},
    ):
        expected = basic.KERNELS["top_k_candidates"](np, (x,), params, None)
        got = kernels["top_k_candidates"](np, (x,), params, np.empty_like(expected))
        np.testing.assert_array_equal(got, expected)
    pairs = np.stack([x.astype(np.float64), np.broadcast_to(np.arange(40.0), x.shape)], axis=-1)
    expected = basic.KERNELS["top_k_combine"](np, (pairs,), {"k": 6}, None)
    np.testing.assert_array_equal(kernels["top_k_combine"](np, (pairs,), {"k": 6}, np.empty_like(expected)), expected)


def test_the_cpu_backend_runs_the_numba_loops_and_numpy_the_rest():
    from workers.backends import make_backend
    from workers.kernels import kernels_for

    overrides = cpu_overrides()
    table = kernels_for(make_backend("cpu"))
    assert table["rope"] is overrides["rope"] and table["rms_norm_mul"] is overrides["rms_norm_mul"]
    assert table["swiglu"] is overrides["swiglu"] and table["top_k_combine"] is overrides["top_k_combine"]
    assert table["softmax_ext"] is KERNELS["softmax_ext"] and "softmax_ext" not in overrides


def test_the_layers_of_a_run_find_the_used_positions_once_and_each_run_again(monkeypatch):
    """Every layer's attention reads the same mask: the first of a run finds how much of the
    cache is in use, the others reuse it, and the next run (a longer sequence) finds it again."""
    from transport import protocol as p
    from workers.arena import Arena
    from workers.backends.cpu import Backend, numba_cpu
    from workers.kernels import fused, kernels_for
    from workers.program import CompiledProgram
    from workers.store import TensorStore

    calls = []
    counted = fused.used_positions
    monkeypatch.setattr(fused, "used_positions", lambda *a: calls.append(1) or counted(*a))
    if numba_cpu.AVAILABLE:  # the CPU backend's twin: its loop
        loops = numba_cpu._loops()
        scan = loops.last_open_column
        monkeypatch.setattr(loops, "last_open_column", lambda *a: calls.append(1) or scan(*a))
    ctx, hd, params = 700, 8, {"scale": 0.3, "bucket": KV_BUCKET}
    steps = [  # two layers' attention over one mask: q (2, 1, hd), k (2, hd, ctx), v (2, ctx, hd)
        p.OpStep("attention", (0, 1, 2, 3), 4, params, (2, 1, hd), "float32"),
        p.OpStep("attention", (4, 1, 2, 3), 5, params, (2, 1, hd), "float32"),
    ]
    backend = Backend(0)
    program = CompiledProgram(1, steps, [5], kernels_for(backend))
    arena = Arena(np, TensorStore(1 << 24))
    arena.resize(program.arena_bytes)
    program.bind(arena, None, backend, 5.0)
    q, k, v = f32(2, 1, hd), f32(2, hd, ctx), f32(2, ctx, hd)
    mask = np.empty((1, ctx), np.float32)  # written in place each run, as a generation's inputs are
    for run, position in enumerate([100, 300, 600]):  # n: 256, then 512, then 700
        mask[...] = np.where(np.arange(ctx) <= position, 0.0, -np.inf)
        slots = [q, k, mask, v] + [None] * (program.nslots - 4)
        calls.clear()
        program.run(slots, run + 1, backend, profile=False)
        first = attention_oracle(q, k, mask, v, 0.3)
        np.testing.assert_allclose(slots[5], attention_oracle(first, k, mask, v, 0.3), rtol=1e-5, atol=1e-6)
        assert len(calls) == 1


# -- the KV-cache write: rope_set_rows (the rotated keys into the cache) and set_rows -------------


def cache_write_case(rows=2, tokens=1, heads=3, d=8, ctx=12, batch=3, cached=np.float32):
    """A cache (batch, heads, ctx, d) of random rows, keys x (rows, tokens, heads, d), positions."""
    cache = f32(batch, heads, ctx, d).astype(cached)
    x = f32(rows, tokens, heads, d)
    positions = np.array([[4 + j + 2 * t for t in range(tokens)] for j in range(rows)], np.int32)
    return cache, x, positions, {"axis": 2, "rows": ctx, "spans": ((0, ctx, 0),)}


def written_oracle(cache, values, positions):
    """cache[j, h, positions[j, t]] = values[j, t, h], by hand."""
    expected = cache.astype(np.float64)
    for j in range(values.shape[0]):
        for t in range(values.shape[1]):
            expected[j, :, positions[j, t], :] = values[j, t]
    return expected


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("rows, tokens", [(1, 1), (2, 1), (2, 3)])
@pytest.mark.parametrize("ids", [np.int32, np.int64])
def test_rope_set_rows_writes_the_rotated_keys_and_nothing_else(mode, rows, tokens, ids):
    cache, x, positions, spec = cache_write_case(rows, tokens)
    positions = positions.astype(ids)
    rotation = {"base": 500.0, "mode": mode}
    expected = written_oracle(cache, ref.rope(x.astype(np.float64), positions, 500.0, mode), positions)
    params = {"set_rows": spec, "rope": rotation, "axes": (0, 2, 1, 3)}
    got = cpu_overrides()["rope_set_rows"](np, [cache, positions, x, positions], params, None, memo={})
    assert got is cache  # in place
    np.testing.assert_allclose(cache, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("cached", [np.float32, np.float16])
def test_rope_set_rows_gives_the_bits_of_its_two_steps(cached):
    kernels = cpu_overrides()
    cache, x, positions, spec = cache_write_case(2, 1, cached=cached)
    rotation = {"base": 10000.0, "mode": "normal", "freqs": [1.0, 0.5, 0.25, 0.125]}
    two = cache.copy()
    roped = kernels["rope"](np, (x, positions), rotation)
    basic_set_rows = KERNELS["set_rows"]
    basic_set_rows(np, [two, positions, roped.transpose(0, 2, 1, 3)], spec, None, memo={})
    params = {"set_rows": spec, "rope": rotation, "axes": (0, 2, 1, 3)}
    kernels["rope_set_rows"](np, [cache, positions, x, positions], params, None, memo={})
    assert cache.tobytes() == two.tobytes()


@pytest.mark.parametrize("cached", [np.float32, np.float16])
def test_the_cache_write_loop_writes_the_values_as_they_are(cached):
    """float16 caches (llama.cpp's -ctk / -ctv f16): the values rounded to nearest even, as
    NumPy's astype, at the edges too (the largest half, overflow to infinity, halfway cases,
    subnormals, signed zero); the loop takes them where the CPU converts halves."""
    from workers.backends.cpu import numba_loops

    cache, x, positions, spec = cache_write_case(2, 1, cached=cached)
    edges = [65504.0, 65520.0, -70000.0, 1 + 2**-11, 1 + 3 * 2**-11, 2**-24, 2**-25, 3 * 2**-26, 1e-7, -0.0]
    x.reshape(-1)[: len(edges) + 2] = [*edges, np.inf, -np.inf]
    expected = written_oracle(cache, x, positions).astype(cached)
    inputs = [cache, positions, x.transpose(0, 2, 1, 3)]
    planned = cpu_overrides()["set_rows"].plan(np, inputs, spec, None, memo={})
    assert (planned is not None) == (cached is np.float32 or numba_loops.NATIVE_HALVES)
    got = cpu_overrides()["set_rows"](np, inputs, spec, None, memo={})
    assert got is cache
    assert cache.tobytes() == expected.tobytes()


@pytest.mark.parametrize("kernel", ["set_rows", "rope_set_rows"])
@pytest.mark.parametrize("pairs", [[(0, 1), (1, 2)], [(0, 0), (1, 1)], [(0, 2), (1, 0)], [(0, 3)]])
def test_rows_written_to_some_of_the_caches_batch_go_there_and_nowhere_else(kernel, pairs):
    """A server's step of its first slots writes rows fewer than the cache's batch (`batches`:
    row j to element b): each to its element, the others untouched, in-order runs from an offset
    through the loop and any other mapping through the shared kernel alike."""
    rows = len(pairs)
    cache, x, positions, spec = cache_write_case(rows, 1, batch=4)
    spec = dict(spec, batches=pairs)
    rotation = {"base": 500.0, "mode": "normal"}
    values = ref.rope(x.astype(np.float64), positions, 500.0, "normal") if kernel == "rope_set_rows" else x
    expected = cache.astype(np.float64)
    for j, b in pairs:
        expected[b, :, positions[j, 0], :] = values[j, 0]
    if kernel == "set_rows":
        inputs, params = [cache, positions, x.transpose(0, 2, 1, 3)], spec
    else:
        inputs, params = [cache, positions, x, positions], {"set_rows": spec, "rope": rotation, "axes": (0, 2, 1, 3)}
    in_order = all(b == pairs[0][1] + j for j, b in pairs)
    assert (cpu_overrides()[kernel].plan(np, inputs, params, None, memo={}) is not None) == in_order  # the loop's
    got = cpu_overrides()[kernel](np, inputs, params, None, memo={})
    assert got is cache
    np.testing.assert_allclose(cache, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("kernel", ["set_rows", "rope_set_rows"])
@pytest.mark.parametrize("bad", [-1, 12, 2**31 - 1])
def test_a_position_outside_the_cache_is_refused_and_nothing_is_written(kernel, bad):
    from split_state.errors import ShapeError

    cache, x, positions, spec = cache_write_case(2, 1)
    positions[1, 0] = bad  # the second row's: the first must not have been written either
    before = cache.copy()
    if kernel == "set_rows":
        inputs, params = [cache, positions, x.transpose(0, 2, 1, 3)], spec
    else:
        inputs, params = (
            [cache, positions, x, positions],
            {"set_rows": spec, "rope": {"base": 9.0, "mode": "normal"}, "axes": (0, 2, 1, 3)},
        )
    with pytest.raises(ShapeError, match=rf"set_rows: ids must lie in \[0, 12\), got \[4, {bad}\]|got \[{bad}, 4\]"):
        cpu_overrides()[kernel](np, inputs, params, None, memo={})
    assert cache.tobytes() == before.tobytes()


@pytest.mark.parametrize("kernel", ["set_rows", "rope_set_rows"])
@pytest.mark.parametrize("cached", [np.float32, np.float16])
@pytest.mark.parametrize("held", [((0, 4, 0),), ((2, 4, 0),)], ids=["whole batch", "elements 2-3"])
@pytest.mark.parametrize("rows", [1, 2])
def test_rows_from_a_fed_batch_start_go_to_that_element_on(kernel, cached, held, rows, monkeypatch):
    """A server's prompt written from its slot (a fed batch start, read at each run): rows j to
    element start + j where this device holds it (`held`: global span -> local), through the
    loop where they are consecutive ones it holds (the shared kernel otherwise), the rest
    untouched."""
    from workers.kernels import basic

    kernels, rotation = cpu_overrides(), {"base": 500.0, "mode": "normal"}
    shared, calls = basic.KERNELS["set_rows"], []
    monkeypatch.setitem(basic.KERNELS, "set_rows", lambda *a, **k: calls.append(1) or shared(*a, **k))
    low, high, _ = held[0]
    for start in range(4 - rows + 1):
        cache, x, positions, spec = cache_write_case(rows, 3, batch=high - low, cached=cached)
        spec = dict(spec, batch=4, held=held, batch_fed=True)
        before = cache.copy()
        if kernel == "set_rows":
            values = x.astype(np.float64)
            inputs, params = [cache, positions, x.transpose(0, 2, 1, 3), np.array(start)], spec
        else:
            values = ref.rope(x.astype(np.float64), positions, 500.0, "normal")
            inputs, params = [cache, positions, x, positions, np.array(start)], {"set_rows": spec, "rope": rotation}
            params["axes"] = (0, 2, 1, 3)
        expected = before.astype(np.float64)
        for j in range(rows):
            if low <= start + j < high:
                for t in range(3):
                    expected[start + j - low, :, positions[j, t], :] = values[j, t]
        plan = kernels[kernel].plan(np, inputs, params, None, memo={})
        assert plan is not None
        calls.clear()
        got = kernels[kernel](np, inputs, params, None, memo={})
        assert got is cache
        assert bool(calls) == (not low <= start <= high - rows)  # the loop's rows, or the shared kernel's
        tolerance = 1e-3 if cached is np.float16 else 2e-6
        np.testing.assert_allclose(cache.astype(np.float64), expected, rtol=tolerance, atol=tolerance)
        untouched = expected == before.astype(np.float64)
        assert cache[untouched].tobytes() == before[untouched].tobytes()


def test_a_fed_batch_start_past_the_batch_is_refused_by_the_loop():
    from split_state.errors import ShapeError

    cache, x, positions, spec = cache_write_case(2, 1, batch=4)
    spec = dict(spec, batch=4, held=((0, 4, 0),), batch_fed=True)
    before = cache.copy()
    with pytest.raises(ShapeError, match="do not fit a batch of 4"):
        cpu_overrides()["set_rows"](np, [cache, positions, x.transpose(0, 2, 1, 3), np.array(3)], spec, None, memo={})
    assert cache.tobytes() == before.tobytes()


def _halves_cases():
    rng = np.random.default_rng(7)
    special = np.array(
        [0.0, -0.0, 1.0, -2.5, 6.1e-5, 6.0e-8, 2.9e-8, 3.0e-8, 1e-9, 65504.0, 65519.0, 65520.0, 1e6, np.inf, -np.inf],
        np.float32,
    )
    wide = (rng.standard_normal(4 * 3 * 5 * 8) * np.exp(rng.uniform(-20, 12, 4 * 3 * 5 * 8))).astype(np.float32)
    wide[: special.size] = special
    whole = wide.reshape(4, 3, 5, 8)
    return [whole, whole.transpose(0, 2, 1, 3), whole[1], whole[:, 1, ::2, 3], whole.reshape(-1), whole[0, 0, :, 1:]]


@pytest.mark.parametrize("case", range(6))
def test_the_float16_cast_has_numpys_bits(case):
    """The cast a float16 cache's new keys take (models/llama.py _as_cached) through the loop,
    contiguous or strided, 1 to 4 axes: NumPy's astype bit for bit, NaN a NaN."""
    from workers.backends.cpu import numba_loops

    x = _halves_cases()[case]
    kernel, params = cpu_overrides()["cast"], {"dtype": "float16"}
    out = np.empty(x.shape, np.float16)
    assert (kernel.plan(np, [x], params, out) is not None) == numba_loops.NATIVE_HALVES
    assert kernel(np, [x], params, out) is out
    assert out.tobytes() == x.astype(np.float16).tobytes()
    with_nan = x.copy()
    with_nan.reshape(-1)[::7] = np.nan
    assert np.isnan(kernel(np, [with_nan], params, out)).reshape(-1)[::7].all()
    other = np.empty(x.shape, np.float32)  # a cast to another type: the shared kernel's
    assert kernel.plan(np, [x], {"dtype": "float32"}, other) is None


def test_the_cache_write_hands_other_layouts_to_the_shared_kernel():
    """A float16 cache, a fed batch start (a server's slot), keys that are not contiguous and a
    cache split over devices: each written as the shared kernel writes it."""
    kernels = cpu_overrides()
    cache, x, positions, spec = cache_write_case(1, 2)
    rotation = {"base": 500.0, "mode": "normal"}
    roped = ref.rope(x.astype(np.float64), positions, 500.0, "normal").astype(np.float32)
    cases = [
        (cache.astype(np.float16), positions, x, spec, ()),  # float16 cache
        (cache.copy(), positions, x, {**spec, "batch": 3, "held": ((0, 3, 0),)}, (np.array(2),)),  # fed start: row 2
        (cache.copy(), positions, np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3), spec, ()),
        (cache[:, :, :6].copy(), positions, x, {"axis": 2, "rows": 12, "spans": ((0, 6, 0),)}, ()),  # rows 0-5 here
    ]
    for dst, ids, keys, wanted, fed in cases:
        assert not keys.flags.c_contiguous or keys is x
        expected = dst.copy()
        KERNELS["set_rows"](np, [expected, ids, roped.transpose(0, 2, 1, 3), *fed], wanted, None, memo={})
        params = {"set_rows": wanted, "rope": rotation, "axes": (0, 2, 1, 3)}
        kernels["rope_set_rows"](np, [dst, ids, keys, ids, *fed], params, None, memo={})
        np.testing.assert_allclose(dst.astype(np.float64), expected.astype(np.float64), rtol=2e-3, atol=2e-3)
        plain = expected.copy()
        kernels["set_rows"](np, [plain, ids, roped.transpose(0, 2, 1, 3), *fed], wanted, None, memo={})
        np.testing.assert_array_equal(plain, expected)


def test_a_pattern_whose_kernel_a_backend_lacks_is_not_fused_there():
    from workers.kernels.fused import PATTERNS, for_kernels

    shared = {**KERNELS, **FUSED_KERNELS}  # a backend with no override (numba missing)
    names = {pattern.name for pattern in for_kernels(PATTERNS, shared)}
    assert not {"rope_set_rows", "qmatmul_add"} & names and {"attention", "swiglu", "rms_norm_mul"} <= names
    with_numba = {pattern.name for pattern in for_kernels(PATTERNS, {**shared, **cpu_overrides()})}
    assert {"rope_set_rows", "qmatmul_add"} <= with_numba


def test_the_rotation_found_once_a_run_is_each_positions_own():
    """rope keeps each positions array's rotation in the run's memo (every layer ropes at the
    same positions): another array, or other rope parameters, in the same run get their own."""
    rope, memo = cpu_overrides()["rope"], {}
    x = f32(1, 2, 3, 8)
    for positions, base in [([[1, 2]], 100.0), ([[7, 9]], 100.0), ([[7, 9]], 40.0), ([[1, 2]], 100.0)]:
        at = np.array(positions, np.int32)
        got = rope(np, (x, at), {"base": base, "mode": "normal"}, memo=memo)
        np.testing.assert_allclose(got, ref.rope(x, at, base, "normal"), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_one_positions_rotation_is_the_bits_of_its_angles_alone(dtype):
    """basic.rotation takes one host position (a decode step's) from a table made a block of
    positions at a time: each row the bits of that position's cos and sin computed alone, at
    either side of a block's edge, with frequency multipliers, in the shape of the positions."""
    from workers.kernels.basic import ROTATION_BLOCK, rotation

    d, base, freqs = 16, 500000.0, [1.0, 0.5, 0.25, 0.125, 1.0, 1.0, 0.5, 2.0]
    inverse = np.power(base, -np.arange(0, d, 2, dtype=np.float64) / d) * np.asarray(freqs)
    for p in (0, 1, ROTATION_BLOCK - 1, ROTATION_BLOCK, 3 * ROTATION_BLOCK + 17, 70000):
        for shape in ((1,), (1, 1)):
            cos, sin = rotation(np, np.full(shape, p, dtype), d, {"base": base, "freqs": freqs}, np.float32)
            assert cos.shape == sin.shape == shape + (1, d // 2) and cos.dtype == sin.dtype == np.float32
            angles = np.float64(p) * inverse
            np.testing.assert_array_equal(cos.reshape(-1), np.cos(angles).astype(np.float32))
            np.testing.assert_array_equal(sin.reshape(-1), np.sin(angles).astype(np.float32))


def test_the_unfused_switch_names_patterns_and_refuses_others(monkeypatch):
    """META_TP_UNFUSED: the named patterns left unfused on the workers (their steps run apart:
    the same tokens), "all" for none fused, a name no pattern has refused in one line."""
    from workers.kernels.fused import PATTERNS, UNFUSED_ENV, left_fused

    assert [p.name for p in left_fused("")] == [p.name for p in PATTERNS]
    assert [p.name for p in left_fused(" swiglu , rope_set_rows")] == [
        "attention",
        "geglu",
        "rms_norm_mul",
        "qmatmul_add",
    ]
    assert left_fused("all") == ()
    with pytest.raises(ValueError, match=r"no pattern \['rope'\]; the patterns: .*rope_set_rows.*, or all"):
        left_fused("rope,swiglu")
    fused, _ = decode_tokens(2, 32, fused=True)
    monkeypatch.setenv(UNFUSED_ENV, "rope_set_rows,swiglu")
    tokens, ops = decode_tokens(2, 32, fused=True)
    assert "rope_set_rows" not in ops and "swiglu" not in ops and "rms_norm_mul" in ops
    assert tokens == fused


@pytest.mark.timeout(60)
def test_a_worker_told_an_unknown_pattern_stops_at_once_in_one_line(monkeypatch):
    import subprocess
    import sys

    env = {**__import__("os").environ, "META_TP_UNFUSED": "rope_set_row"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "workers",
            "--connect",
            "ipc:///nonexistent/x",
            "--rank",
            "3",
            "--beat",
            "ipc:///nonexistent/b",
            "--beat-in",
            "ipc:///nonexistent/c",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "worker 3: META_TP_UNFUSED: no pattern ['rope_set_row']; the patterns: "
        "['attention', 'geglu', 'qmatmul_add', 'rms_norm_mul', 'rope_set_rows', 'swiglu'], or all"
    ]


@pytest.mark.parametrize("n", [1, 2])
def test_the_residual_added_as_the_product_is_written_gives_the_unfused_bits(tmp_path, n):
    """Quantized weights (the qmatmul_add pattern): each layer's two residual adds take the
    product they add (wo's, w_down's) into one call, on several devices too (the residual is
    Partial there: each adds its own partial product before the all-reduce), and the logits are
    the unfused program's bit for bit (a + b is b + a)."""
    from models import synthetic
    from models.gguf_model import GGUFModel
    from workers.kernels.fused import left_fused

    shape = synthetic.Shape(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=96, context=64)
    model = GGUFModel(synthetic.write(tmp_path / "m.gguf", synthetic.Recipe(shape, weights="q4_1")).path)
    runs = {}
    for fused in (True, False):
        cluster = SimulatedCluster(n)
        if not fused:
            for server in cluster.servers:
                server.executor.patterns = left_fused("qmatmul_add")
        with MetaDevice(cluster) as dev:
            net = TensorParallelLlama(dev, model.config, model.native, 16)
            logits = [net.step(np.array([[5, 9, 2, 33]]), np.arange(4)[None]).numpy()]
            for pos, token in zip(range(4, 8), (7, 61, 3, 40)):
                logits.append(net.step(np.array([[token]]), np.array([[pos]])).numpy())
            ops = {
                pl.step.op
                for p in cluster.servers[0].executor.programs.values()
                for pl in p.placed
                if hasattr(pl.step, "op")
            }
        runs[fused] = (logits, ops)
    (fused_logits, fused_ops), (plain_logits, plain_ops) = runs[True], runs[False]
    assert "qmatmul_add" in fused_ops and "qmatmul_add" not in plain_ops
    for got, want in zip(fused_logits, plain_logits):
        assert got.tobytes() == want.tobytes()


def _planned_case(name):
    """(kernel inputs, params, out, extra, refill(): new values written into the inputs in place,
    oracle(): the expected result from the inputs' current values) for each planned CPU kernel."""
    if name == "rms_norm_mul":
        x, w = f32(2, 1, 40), f32(40)
        return (
            (x, w),
            {"axis": 2, "eps": 1e-5},
            np.empty_like(x),
            {},
            [x, w],
            lambda: ref.rms_norm(x.astype(np.float64), -1, 1e-5) * w,
        )
    if name == "rope":
        x, positions = f32(2, 1, 3, 16), np.array([[3], [70]], np.int32)
        oracle = lambda: ref.rope(x.astype(np.float64), positions, 500.0, "neox")  # noqa: E731
        return (x, positions), {"base": 500.0, "mode": "neox"}, np.empty_like(x), {}, [x, positions], oracle
    if name == "swiglu":
        both = f32(2, 1, 32)
        oracle = lambda: ref.silu(both[..., :16].astype(np.float64)) * both[..., 16:]  # noqa: E731
        return (both,), {"gate": (0, 16), "up": (16, 32)}, np.empty((2, 1, 16), np.float32), {}, [both], oracle
    if name == "geglu":
        both = f32(2, 1, 32) * 4
        oracle = lambda: ref.gelu_f16(both[..., :16]) * both[..., 16:]  # noqa: E731
        return (both,), {"gate": (0, 16), "up": (16, 32)}, np.empty((2, 1, 16), np.float32), {}, [both], oracle
    if name in ("set_rows", "rope_set_rows"):
        cache, x, positions, spec = cache_write_case(2, 1)
        if name == "set_rows":
            values = x.transpose(0, 2, 1, 3)  # as the decoder hands it: (rows, heads, tokens, d)
            inputs, params = [cache, positions, values], spec
            oracle = lambda: written_oracle(cache, x, positions)  # noqa: E731
        else:
            inputs, params = (
                [cache, positions, x, positions],
                {"set_rows": spec, "rope": {"base": 500.0, "mode": "normal"}, "axes": (0, 2, 1, 3)},
            )
            oracle = lambda: written_oracle(
                cache, ref.rope(x.astype(np.float64), positions, 500.0, "normal"), positions
            )  # noqa: E731
        return inputs, params, cache, {}, [x, positions], oracle
    if name == "attention":
        (q, k, mask, v), _ = key_row_case(2, 1, 70, [20, 45])
        key_rows = k.swapaxes(-1, -2)

        def oracle():
            s = q.astype(np.float64) @ np.nan_to_num(k).astype(np.float64) * 0.3 + mask  # NaN past the used positions
            return ref.softmax(s, -1) @ np.nan_to_num(v).astype(np.float64)

        scratch = np.empty(2 * q[..., 0].size * 70 + q.size, np.float32)
        return (
            (q, k, mask, v),
            {"scale": 0.3, "bucket": 1},
            np.empty(q.shape, np.float32),
            {"scratch": scratch},
            [q, key_rows, v, mask, lambda: _open_next(mask)],
            oracle,
        )
    q, keys, values = f32(2, 1, 5, 8), f32(2, 3, 50, 8), f32(2, 3, 50, 8)
    mask = np.full((2, 1, 50), -np.inf, np.float32)
    mask[0, 0, :9], mask[1, 0, :32] = 0.0, 0.0  # the next position crosses a bucket (KV_BUCKET)
    params = {"scale": 0.3, "kv_of_head": [0, 1, 1, 1, 2]}
    oracle = lambda: ref.reference("gqa_attention", [q, keys, values, mask], params)  # noqa: E731
    return (
        (q, keys, values, mask),
        params,
        np.empty(q.shape, np.float32),
        {},
        [q, keys, values, lambda: _open_next(mask)],
        oracle,
    )


def _open_next(mask):
    """Each query row of the mask sees one more position."""
    flat = mask.reshape(-1, mask.shape[-1])
    for row in flat:
        row[int(np.argmin(np.isfinite(row)))] = 0.0


PLANNED = ["rms_norm_mul", "rope", "swiglu", "geglu", "set_rows", "rope_set_rows", "attention", "gqa_attention"]


@pytest.mark.parametrize("name", PLANNED)
def test_a_cpu_kernels_plan_reads_each_runs_values(name):
    """A plan (workers/straight.py) holds views of its arrays: run again after new values are
    written into them in place (the run's memo cleared, as a program clears it), it gives the
    oracle's result for those values, not the first run's."""
    kernel = cpu_overrides()[name]
    inputs, params, out, extra, refilled, oracle = _planned_case(name)
    memo: dict = {}
    if getattr(kernel, "memo", False):
        extra = extra | {"memo": memo}
    run = kernel.plan(np, inputs, params, out, **extra)
    assert run is not None
    for turn in range(3):
        if turn:
            memo.clear()
            for a in refilled:
                if callable(a):  # the used positions grow
                    a()
                elif a.dtype.kind == "f":
                    finite = np.isfinite(a)
                    a[finite] = rng.standard_normal(int(finite.sum())).astype(a.dtype)
                else:
                    a += 1  # positions one further
        expected = oracle()
        assert run() is out
        np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-6, err_msg=f"run {turn}")


ROW_WISE = {"rms_norm_mul": "rms_norm_mul_rows", "rope": "rope_rows", "swiglu": "swiglu_rows", "geglu": "geglu_rows"}


@pytest.mark.parametrize("name", sorted(ROW_WISE))
def test_a_prefills_rows_go_over_the_threads_each_with_its_one_thread_bits(name, monkeypatch):
    """From row_threads.PARALLEL_VALUES values (here every size) on a worker of two threads, a
    row-wise loop runs its twin over the threads: the oracle's values, and each row's bits those
    of the one-thread loop (a greedy request's tokens must not depend on its batch)."""
    from workers.backends.cpu import numba_cpu, numba_loops, row_threads

    kernel = cpu_overrides()[name]
    if name == "geglu" and not numba_loops.NATIVE_HALVES:
        pytest.skip("the CPU does not narrow float32 to float16: geglu has no loop")
    inputs, params, out, extra, _, oracle = _planned_case(name)
    memo = {"memo": {}} if getattr(kernel, "memo", False) else {}
    alone = kernel.plan(np, inputs, params, np.empty_like(out), **extra, **memo)()
    twin = getattr(numba_loops, ROW_WISE[name] + "_parallel")
    ran = []
    monkeypatch.setattr(numba_loops, ROW_WISE[name] + "_parallel", lambda *a: ran.append(1) or twin(*a))
    monkeypatch.setattr(row_threads, "PARALLEL_VALUES", 1)
    monkeypatch.setattr(numba_cpu, "_THREADS", [2])
    got = kernel.plan(np, inputs, params, out, **extra, **memo)()
    assert ran, "the twin over threads did not run"
    np.testing.assert_allclose(got, oracle(), rtol=2e-5, atol=2e-6)
    assert got.tobytes() == alone.tobytes()


@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_rope_and_the_cache_writes_read_a_fused_products_rows_where_they_lie(mode):
    """A prefill's queries, keys and values are views of one product's rows (q | k | v, tokens
    apart by the three's width): the loops take them as they lie, no copy (a plan made once sees
    each run's values) and no NumPy fallback."""
    kernels = cpu_overrides()
    heads, kv, d, tokens = 4, 2, 16, 5
    qkv = f32(1, tokens, (heads + 2 * kv) * d)
    q = qkv[..., : heads * d].reshape(1, tokens, heads, d)
    k = qkv[..., heads * d : (heads + kv) * d].reshape(1, tokens, kv, d)
    v = qkv[..., (heads + kv) * d :].reshape(1, tokens, kv, d)
    positions = np.arange(3, 3 + tokens, dtype=np.int32)[None]
    rotation = {"base": 500.0, "mode": mode}
    cache, _, _, spec = cache_write_case(1, tokens, heads=kv, d=d, ctx=12, batch=1)
    values = np.zeros_like(cache)
    turned = np.empty(q.shape, np.float32)
    plans = [
        kernels["rope"].plan(np, (q, positions), rotation, turned, memo={}),
        kernels["rope_set_rows"].plan(
            np,
            [cache, positions, k, positions],
            {"set_rows": spec, "rope": rotation, "axes": (0, 2, 1, 3)},
            None,
            memo={},
        ),
        kernels["set_rows"].plan(np, [values, positions, v.transpose(0, 2, 1, 3)], spec, None, memo={}),
    ]
    assert None not in plans, "a view of the fused rows fell back to NumPy"
    for _ in range(2):
        qkv[...] = f32(*qkv.shape)  # the next run's values, in place
        for run in plans:
            run()
        np.testing.assert_allclose(turned, ref.rope(q.astype(np.float64), positions, 500.0, mode), rtol=2e-5, atol=2e-6)
        keys = ref.rope(k.astype(np.float64), positions, 500.0, mode)
        np.testing.assert_allclose(cache, written_oracle(cache, keys, positions), rtol=2e-5, atol=2e-6)
        np.testing.assert_array_equal(values, written_oracle(values, v, positions))


def test_a_plan_is_refused_where_the_loop_does_not_take_the_arrays():
    kernels = cpu_overrides()
    x = f32(3, 8)[:, ::2]  # not contiguous
    assert (
        kernels["rms_norm_mul"].plan(
            np, (x, np.ones(4, np.float32)), {"axis": 1, "eps": 1e-5}, np.empty((3, 4), np.float32)
        )
        is None
    )
    (q, k, mask, v), _ = key_row_case(1, 2, 40, [30])  # two query tokens: not the planned one-token loop
    assert (
        kernels["attention"].plan(np, (q, k, mask, v), {"scale": 0.3, "bucket": 1}, np.empty(q.shape, np.float32))
        is None
    )


# -- the matchers as matchers: steps written by hand, the fusion each finds or refuses ------------


def op(name, inputs, output, shape, **params):
    from transport import protocol as p

    return p.OpStep(name, tuple(inputs), output, params, tuple(shape), "float32")


def matched(match, steps, outputs=()):
    from workers.kernels.fused import ProgramView

    return match(ProgramView(steps, outputs=frozenset(outputs)), len(steps) - 1)


def test_rms_norm_mul_fuses_a_norm_only_nothing_else_needs():
    """Slots 0 (x) and 1 (the weight) are inputs. The norm is absorbed where only the product reads
    it; not where the program returns it (it must still exist) or another step reads it too."""
    from workers.kernels.fused import _match_rms_norm_mul

    norm = op("rms_norm", [0], 2, (4, 8), axis=-1, eps=1e-5)
    steps = [norm, op("mul", [2, 1], 3, (4, 8))]
    fusion = matched(_match_rms_norm_mul, steps)
    assert fusion.inputs == (0, 1) and fusion.absorbed == (0,) and fusion.params == {"axis": -1, "eps": 1e-5}
    assert matched(_match_rms_norm_mul, [norm, op("mul", [1, 2], 3, (4, 8))]).inputs == (0, 1)  # either side
    assert matched(_match_rms_norm_mul, steps, outputs=[2]) is None
    assert matched(_match_rms_norm_mul, [norm, op("neg", [2], 4, (4, 8)), op("mul", [2, 1], 3, (4, 8))]) is None


def test_rms_norm_mul_leaves_a_product_that_broadcasts_the_norm():
    """A norm of one row times a weight of four: the product's shape is not the norm's, which the
    fused kernel (writing the norm's shape) would get wrong."""
    from workers.kernels.fused import _match_rms_norm_mul

    steps = [op("rms_norm", [0], 2, (1, 8), axis=-1, eps=1e-5), op("mul", [2, 1], 3, (4, 8))]
    assert matched(_match_rms_norm_mul, steps) is None


def swiglu_steps(gate_of: int, up_of: int):
    """silu(slice of `gate_of`) * slice of `up_of`, the halves of a (2, 16) tensor's last axis."""
    return [
        op("slice", [gate_of], 10, (2, 8), axis=1, start=0, stop=8),
        op("silu", [10], 11, (2, 8)),
        op("slice", [up_of], 12, (2, 8), axis=1, start=8, stop=16),
        op("mul", [11, 12], 13, (2, 8)),
    ]


def test_geglu_fuses_the_float16_table_gelu_of_the_gate_times_up():
    from workers.kernels.fused import _match_geglu, _match_swiglu

    steps = swiglu_steps(0, 0)
    steps[1] = op("gelu_f16", [10], 11, (2, 8))
    fusion = matched(_match_geglu, steps)
    assert fusion.params == {"gate": (0, 8), "up": (8, 16)} and sorted(fusion.absorbed) == [0, 1, 2]
    assert matched(_match_swiglu, steps) is None and matched(_match_geglu, swiglu_steps(0, 0)) is None


def test_geglu_kernels_give_the_tables_gelu_times_up_bit_for_bit_at_every_float16():
    """Every float16 value (and values past +-10, and between float16s) as a gate: NumPy's fused
    kernel and the CPU's one-pass loop both give models.reference.gelu_f16(gate) * up's bits."""
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    gates = np.concatenate([every[np.isfinite(every)], f32(4096) * 12, [10, -10, 9.999, -9.999, 1e30, -1e30]])
    gates = gates.astype(np.float32)
    gates = np.concatenate([gates, np.nextafter(gates, np.float32(np.inf))])  # just past each float16
    n = len(gates)
    both = np.concatenate([gates, f32(n)])[None]
    want = (ref.gelu_f16(gates) * both[0, n:]).view(np.uint32)
    params = {"gate": (0, n), "up": (n, 2 * n)}
    for kernel in (FUSED_KERNELS["geglu"], cpu_overrides()["geglu"]):
        got = kernel(np, (both,), params, np.empty((1, n), np.float32))
        assert np.array_equal(got[0].view(np.uint32), want)


def test_swiglu_fuses_gate_and_up_from_one_tensor_only():
    from workers.kernels.fused import _match_swiglu

    fusion = matched(_match_swiglu, swiglu_steps(0, 0))
    assert fusion.inputs == (0,) and fusion.params == {"gate": (0, 8), "up": (8, 16)}
    assert sorted(fusion.absorbed) == [0, 1, 2]
    assert matched(_match_swiglu, swiglu_steps(0, 1)) is None  # gate and up of two tensors
    assert matched(_match_swiglu, swiglu_steps(0, 0), outputs=[11]) is None  # silu returned
