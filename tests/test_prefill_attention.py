"""A prompt's attention on the GPU by tiles of queries (workers/backends/cuda/kernels/prefill_attend.py),
checked against softmax attention from its definition in float64 over the open positions only:
- its CUDA C compiled for the CPU, each thread of a block a thread of its own
  (tests/cuda_on_host.py), run by the backend's own launcher with NumPy as its array module: the
  kernels' arithmetic, the tile map, the skipped tiles, in CI;
- the CUDA backend's attention and gqa_attention on the CuPy stand-in (the kernels' twins),
  eagerly and captured in a device graph, replayed after the mask and the queries change;
- on a GPU, the compiled kernels (skipped without one).
The cache past the open positions holds NaN and inf, as a cache's unwritten rows may: a closed
position's key and value rows must never reach a result."""

from __future__ import annotations

import numpy as np
import pytest

from tests import cuda_on_host
from tests.test_device_kernels import GQA_MAP, captured_attention
from workers.backends.cuda.kernels import attend, device, prefill_attend

pytestmark = pytest.mark.timeout(300)

SIGNATURES = {
    "attend_open_tiles": (
        "const float* mask, u8* open, int tokens, int ctx, long mask_batch, int token_tiles, int key_tiles",
        "mask, open, tokens, ctx, mask_batch, token_tiles, key_tiles",
    ),
    "prefill_part_KIND": (
        "const float* q, const void* k, const void* v, const float* mask, const u8* open, float* out, int heads, "
        "int group, int tokens, int ctx, int dim, long mask_batch, float scale, int token_tiles, int key_tiles",
        "q, (const KT*)k, (const KT*)v, mask, open, out, heads, group, tokens, ctx, dim, mask_batch, scale, "
        "token_tiles, key_tiles",
    ),
    "prefill_map_KIND": (
        "const float* q, const void* k, const void* v, const float* mask, const u8* open, float* out, "
        "const int* kv_of, int heads, int kv_heads, int tokens, int ctx, int dim, long mask_batch, float scale, "
        "int token_tiles, int key_tiles",
        "q, (const KT*)k, (const KT*)v, mask, open, out, kv_of, heads, kv_heads, tokens, ctx, dim, mask_batch, "
        "scale, token_tiles, key_tiles",
    ),
}


@pytest.fixture(scope="module")
def host_prefill(tmp_path_factory):
    if cuda_on_host.compiler() is None:
        pytest.skip("no C++ compiler to build the kernels for the host")
    names = {"attend_open_tiles": SIGNATURES["attend_open_tiles"]}
    for layout in ("part", "map"):
        signature, args = SIGNATURES[f"prefill_{layout}_KIND"]
        for kind, kt in (("f32", "float"), ("f16", "unsigned short")):
            names[f"prefill_{layout}_{kind}"] = (signature, args.replace("KT", kt))
    source = device.full_source(prefill_attend.SOURCE)
    library = cuda_on_host.build(source, names, tmp_path_factory.mktemp("kernels"), barriers=True)
    return cuda_on_host.HostKernels(library)


def softmax_attention(q_rows, keys, values, mask_rows, scale):
    """float64 softmax(q . k * scale + mask) @ v of each row over its open positions (mask not
    -inf) only, from the definition; NaN for a row with none open."""
    out = np.full(q_rows.shape, np.nan)
    for r in range(q_rows.shape[0]):
        open_ = mask_rows[r] != -np.inf
        if not open_.any():
            continue
        scores = keys[r][open_].astype(np.float64) @ q_rows[r].astype(np.float64) * scale + mask_rows[r][open_]
        weights = np.exp(scores - scores.max())
        out[r] = weights @ values[r][open_].astype(np.float64) / weights.sum()
    return out


def prompt_case(cache, batch=2, heads=2, group=2, tokens=21, ctx=75, dim=40, seed=3):
    """Queries (batch, kv heads, group, tokens, dim) of a prompt; caches (batch, kv heads, ctx,
    dim) whose positions past each batch row's end hold NaN and inf; a causal mask per batch row
    (row 0's prompt from position 0, row 1's after 40 cached positions), a window cutting row 1's
    later tokens' first 20 positions, an additive bias, and token 3 of row 0 seeing nothing."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, group, tokens, dim)).astype(np.float32)
    keys = rng.standard_normal((batch, heads, ctx, dim)).astype(cache)
    values = rng.standard_normal((batch, heads, ctx, dim)).astype(cache)
    mask = np.full((batch, 1, 1, tokens, ctx), -np.inf, np.float32)
    starts = [0, 40][:batch] + [0] * max(0, batch - 2)
    for b in range(batch):
        for t in range(tokens):
            mask[b, 0, 0, t, : starts[b] + t + 1] = 0
        used = starts[b] + tokens
        keys[b, :, used:] = np.inf
        values[b, :, used:] = np.nan
    if batch > 1:
        mask[1, 0, 0, 10:, :20] = -np.inf
    mask[0, 0, 0, 5, 2] = -0.75
    mask[0, 0, 0, 3] = -np.inf
    return q, keys, values, mask


def decoder_oracle(q, keys, values, mask, scale):
    batch, heads, group, tokens, dim = q.shape
    rows = [(b, h, g, t) for b, h, g, t in np.ndindex(batch, heads, group, tokens)]
    q_rows = np.stack([q[b, h, g, t] for b, h, g, t in rows])
    k_rows = np.stack([keys[b, h] for b, h, _, _ in rows])
    v_rows = np.stack([values[b, h] for b, h, _, _ in rows])
    m_rows = np.stack([mask[min(b, mask.shape[0] - 1), 0, 0, t] for b, _, _, t in rows])
    return softmax_attention(q_rows, k_rows, v_rows, m_rows, scale).reshape(q.shape)


def mapped_case(cache, batch=2, tokens=21, ctx=75, dim=40, seed=4):
    """prompt_case's in the gqa_attention op's layout: 5 query heads over 3 KV heads by GQA_MAP."""
    q, keys, values, mask = prompt_case(cache, batch, 3, 2, tokens, ctx, dim, seed)
    q = np.ascontiguousarray(q.reshape(batch, 6, tokens, dim)[:, :5].transpose(0, 2, 1, 3))
    return q, keys, values, np.ascontiguousarray(mask[:, 0, 0])


def mapped_oracle(q, keys, values, mask, scale):
    batch, tokens, heads, dim = q.shape
    rows = list(np.ndindex(batch, tokens, heads))
    q_rows = np.stack([q[b, t, h] for b, t, h in rows])
    k_rows = np.stack([keys[b, GQA_MAP[h]] for b, _, h in rows])
    v_rows = np.stack([values[b, GQA_MAP[h]] for b, _, h in rows])
    m_rows = np.stack([mask[min(b, mask.shape[0] - 1), t] for b, t, _ in rows])
    return softmax_attention(q_rows, k_rows, v_rows, m_rows, scale).reshape(q.shape)


def _mask_batch(mask, tokens, ctx):
    return tokens * ctx if mask.shape[0] > 1 else 0


@pytest.mark.parametrize("cache", [np.float32, np.float16])
@pytest.mark.parametrize("shared_mask", [False, True])
def test_the_prompt_attention_cuda_c_run_on_the_host_equals_softmax_attention(host_prefill, cache, shared_mask):
    """Two tiles of query tokens (the second of 5), five tiles of positions (the last of 11),
    GQA's group of two, a mask of each batch row's own or one for the batch: softmax attention
    over the open positions from its definition, NaN where a row sees nothing."""
    q, keys, values, mask = prompt_case(cache)
    if shared_mask:
        mask = mask[:1].copy()
    scale = 1 / np.sqrt(q.shape[-1])
    out = np.full(q.shape, -7.0, np.float32)
    mask_batch = _mask_batch(mask, q.shape[3], keys.shape[2])
    prefill_attend.launch(np, host_prefill, q, keys, values, mask, mask_batch, scale, out)
    want = decoder_oracle(q, keys, values, mask, scale)
    assert np.isnan(want[0, :, :, 3]).all()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("cache", [np.float32, np.float16])
def test_the_mapped_prompt_attention_cuda_c_run_on_the_host_reads_each_heads_kv_head(host_prefill, cache):
    q, keys, values, mask = mapped_case(cache)
    scale = 1 / np.sqrt(q.shape[-1])
    out = np.full(q.shape, -7.0, np.float32)
    kv_of = np.array(GQA_MAP, np.int32)
    prefill_attend.launch_mapped(np, host_prefill, q, keys, values, mask, _mask_batch(mask, 21, 75), kv_of, scale, out)
    np.testing.assert_allclose(out, mapped_oracle(q, keys, values, mask, scale), rtol=1e-5, atol=2e-6)


def test_the_tile_map_marks_exactly_the_tile_pairs_with_an_open_entry(host_prefill):
    """The map a layer's blocks skip by: one byte for each (mask row, tile of query tokens,
    tile of positions), 1 where any entry of the pair is open, from its definition."""
    _, _, _, mask = prompt_case(np.float32)
    tokens, ctx = mask.shape[-2:]
    token_tiles, key_tiles = -(-tokens // prefill_attend.TOKENS), -(-ctx // prefill_attend.KEYS)
    got = np.full(2 * token_tiles * key_tiles, 9, np.uint8)
    args = (
        mask,
        got,
        np.int32(tokens),
        np.int32(ctx),
        np.int64(tokens * ctx),
        np.int32(token_tiles),
        np.int32(key_tiles),
    )
    host_prefill["attend_open_tiles"]((2 * token_tiles,), (prefill_attend.THREADS,), args)
    want = np.zeros((2, token_tiles, key_tiles), np.uint8)
    for b, t, j in zip(*np.nonzero(mask[:, 0, 0] != -np.inf)):
        want[b, t // prefill_attend.TOKENS, j // prefill_attend.KEYS] = 1
    np.testing.assert_array_equal(got.reshape(want.shape), want)
    assert 0 < want.sum() < want.size  # closed pairs to skip, and open ones


@pytest.mark.parametrize("op", ["attention", "gqa_attention"])
@pytest.mark.parametrize("cache", [np.float32, np.float16])
def test_a_captured_prompt_attention_reads_the_open_positions_on_the_device_at_each_replay(monkeypatch, cache, op):
    """On the stand-in (the kernels' twins): the backend's attention over the decoder's views, and
    its gqa_attention, are the prompt kernels, right at a first eager run and captured after it;
    a replay after the mask opens other positions and the queries change attends over those, as
    softmax attention from its definition."""
    if op == "attention":
        q, keys, values, mask = prompt_case(cache)
        oracle = lambda q, mask: decoder_oracle(q, keys, values, mask, 0.25)  # noqa: E731
    else:
        q, keys, values, mask = mapped_case(cache)
        oracle = lambda q, mask: mapped_oracle(q, keys, values, mask, 0.25)  # noqa: E731

    def changed(q, mask):
        mask = np.roll(mask, -3, axis=-1)  # 3 fewer of the cached positions each row
        mask[..., -3:] = -np.inf
        return (q * 2).astype(np.float32), mask

    first, replayed, launched = captured_attention(monkeypatch, prefill_attend, op, q, keys, values, mask, changed)
    assert launched == [1, 1]
    np.testing.assert_allclose(first, oracle(q, mask), rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(replayed, oracle(*changed(q, mask)), rtol=1e-5, atol=2e-6)


def test_the_cuda_attention_takes_a_decode_step_and_a_prompt_over_a_short_cache_in_the_graph():
    """A decode step's rows are kernels of our own (not eager) whatever its cache; a prompt's are
    where the cache is at most MAX_POSITIONS long (the fused step's params say how long), else
    the shared kernel's (eager), as is a head dim past MAX_DIM. The gqa_attention op's step does
    not say: its prompts run eagerly. A prompt's tiles want none of the score matrices' scratch
    the fused pattern plans; a decode step's partials and the shared kernel keep it."""
    from workers.backends import cuda

    def step(shape, positions=None):
        params = {} if positions is None else {"positions": positions}
        return type("Step", (), {"shape": shape, "params": params})

    short, long = prefill_attend.MAX_POSITIONS, prefill_attend.MAX_POSITIONS + 1
    for tokens in (1, attend.MAX_TOKENS):
        assert not cuda.attention.eager(step((1, 3, 2, tokens, 64), long))
        assert not cuda.gqa_attention.eager(step((1, tokens, 5, 64)))
    for tokens in (attend.MAX_TOKENS + 1, 128):
        assert not cuda.attention.eager(step((1, 3, 2, tokens, 64), short))
        assert cuda.attention.eager(step((1, 3, 2, tokens, 64), long))
        assert cuda.attention.eager(step((1, 3, 2, tokens, 64)))
        assert cuda.gqa_attention.eager(step((1, tokens, 5, 64)))
    assert cuda.attention.eager(step((1, 3, 2, 1, attend.MAX_DIM + 1), 40))
    assert cuda.attention.scratch_for(step((1, 3, 2, 1, 64), long), (1000,)) == (1000,)
    assert cuda.attention.scratch_for(step((1, 3, 2, 20, 64), short), (1000,)) is None
    assert cuda.attention.scratch_for(step((1, 3, 2, 20, 64), long), (1000,)) == (1000,)


@pytest.mark.filterwarnings("ignore:invalid value")  # the shared softmax of token 3's closed row: -inf - -inf
@pytest.mark.parametrize("op", ["attention", "gqa_attention"])
def test_a_prompt_over_a_longer_cache_takes_the_shared_kernel(monkeypatch, op):
    """Past MAX_POSITIONS cache positions the backend hands a prompt's attention to the shared
    kernel (cuBLAS's products and a softmax): no tile is launched, and the result is softmax
    attention's from its definition all the same."""
    monkeypatch.setattr(prefill_attend, "MAX_POSITIONS", 64)
    q, keys, values, mask = prompt_case(np.float32) if op == "attention" else mapped_case(np.float32)
    keys[np.isinf(keys)], values[np.isnan(values)] = 0, 0  # the shared kernel reads the used rows' bucket
    oracle = decoder_oracle if op == "attention" else mapped_oracle
    first, _, launched = captured_attention(monkeypatch, prefill_attend, op, q, keys, values, mask)
    assert launched == []
    np.testing.assert_allclose(first, oracle(q, keys, values, mask, 0.25), rtol=1e-5, atol=2e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_on_host.real_gpu(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("cache", [np.float32, np.float16])
def test_on_a_gpu_the_prompt_attention_equals_softmax_attention(cache):
    import cupy

    kernels = device.compile_all(cupy)
    q, keys, values, mask = prompt_case(cache)
    out = cupy.full(q.shape, np.nan, cupy.float32)
    operands = [cupy.asarray(a) for a in (q, keys, values, mask)]
    prefill_attend.launch(cupy, kernels, *operands, _mask_batch(mask, 21, 75), 0.2, out)
    np.testing.assert_allclose(cupy.asnumpy(out), decoder_oracle(q, keys, values, mask, 0.2), rtol=1e-5, atol=2e-6)
    q, keys, values, mask = mapped_case(cache)
    out = cupy.full(q.shape, np.nan, cupy.float32)
    kv_of = cupy.asarray(np.array(GQA_MAP, np.int32))
    operands = [cupy.asarray(a) for a in (q, keys, values, mask)]
    prefill_attend.launch_mapped(cupy, kernels, *operands, _mask_batch(mask, 21, 75), kv_of, 0.2, out)
    np.testing.assert_allclose(cupy.asnumpy(out), mapped_oracle(q, keys, values, mask, 0.2), rtol=1e-5, atol=2e-6)


def test_a_prompt_over_an_empty_cache_gives_nan_as_a_softmax_over_nothing(monkeypatch, host_prefill):
    """No cache positions at all (no tile to walk, the map empty): every row sees nothing, so
    NaN, as the softmax of no entries is; nothing fails on the way, in the twins (on the
    stand-in) or in the CUDA C run on the host."""
    q, keys, values, mask = prompt_case(np.float32, ctx=3)
    keys, values, mask = keys[:, :, :0], values[:, :, :0], np.ascontiguousarray(mask[..., :0])
    first, _, launched = captured_attention(monkeypatch, prefill_attend, "attention", q, keys, values, mask)
    assert launched == [1] and first.shape == q.shape and np.isnan(first).all()
    out = np.full(q.shape, -7.0, np.float32)
    prefill_attend.launch(np, host_prefill, q, keys, values, mask, _mask_batch(mask, 21, 0), 0.25, out)
    assert np.isnan(out).all()
