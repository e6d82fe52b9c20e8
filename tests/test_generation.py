"""Generation driven by the workers (MetaDevice.generate, workers/generation.py): the tokens of
the coordinator's own loop for the same seed, cancellation between tokens with the workers
left usable, and a lost worker as a typed error within seconds."""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import time

import numpy as np
import pytest

from meta import MetaDevice
from models.llama import LlamaConfig, ReferenceDecoder, TensorParallelLlama, random_weights
from split_state import WorkerLost
from split_state.errors import TransportError
from split_state.sampling import Rule, choose, generator_state
from transport import protocol as p
from transport.shm import shm_root

pytestmark = pytest.mark.timeout(120)
CFG = LlamaConfig(hidden=48, layers=2, heads=6, kv_heads=2, ffn=40, vocab=64, rope_base=500.0)
POOL, STEPS, CTX = 8, 10, 64
# as many steps as the cache holds, for tests that act while the workers generate: the workers do
# not wait for the coordinator, and a generation of STEPS had sometimes ended before it read token 2
LONG = CTX - 6
PROMPT = np.array([[5, 9, 2, 33], [7, 1, 1, 60]])


def sample(values: np.ndarray, indices: np.ndarray, temperature: float, top_p: float, rng) -> int:
    """The sampling rule written again for the test: softmax of value / T over the candidates,
    the smallest prefix reaching top_p, one draw of the generator; the best at T = 0."""
    if temperature == 0:
        return int(indices[0])
    z = np.array(values, np.float64) / temperature
    w = np.exp(z - z.max())
    w = w / w.sum()
    if top_p < 1:
        keep = 1
        while w[:keep].sum() < top_p:
            keep += 1
        w = w[:keep] / w[:keep].sum()
    return int(indices[rng.choice(len(w), p=w)])


def start(dev: MetaDevice):
    """Prefill both prompts; capture the decode step (one run); first tokens and positions."""
    net = TensorParallelLlama(dev, CFG, random_weights(CFG, seed=4).__getitem__, CTX, batch=2)
    logits = net.step(PROMPT, np.tile(np.arange(4), (2, 1)))
    token = logits[:, 3:].argmax()
    dev.run(token, *net.caches())
    first = token.numpy().astype(np.int32)
    step, (values, indices, *_) = net.capture_decode(first, np.array([[4], [4]]), build=lambda lg: list(lg.top_k(POOL)))
    return net, step, values.numpy(), indices.numpy()


def coordinator_loop(dev, step, values, indices, temperature, top_p, seed):
    rng = np.random.default_rng(seed)
    tokens = [sample(values[b, 0], indices[b, 0], temperature, top_p, rng) for b in range(2)]
    out = [tokens]
    for pos in range(5, 5 + STEPS):
        v, i, *_ = step(np.array([[t] for t in tokens], np.int32), np.array([[pos], [pos]], np.int32))
        v, i = v.numpy(), i.numpy()
        tokens = [sample(v[b, 0], i[b, 0], temperature, top_p, rng) for b in range(2)]
        out.append(tokens)
    return out


def worker_loop(dev, step, values, indices, temperature, top_p, seed, stop=(), on=None, steps=STEPS, report_s=None):
    rng = np.random.default_rng(seed)
    tokens = [sample(values[b, 0], indices[b, 0], temperature, top_p, rng) for b in range(2)]
    out = [tokens]

    def on_tokens(k, chosen):
        out.append(chosen)
        return True if on is None else on(k, chosen)

    settings = p.GenerateSettings(
        Rule(temperature, top_p=top_p), tuple(generator_state(rng)), tuple(stop), (False, False)
    )
    if report_s is not None:
        settings = dataclasses.replace(settings, report_s=report_s)
    info = dev.generate(
        step, np.array([[t] for t in tokens], np.int32), np.array([[5], [5]], np.int32), steps, settings, on_tokens
    )
    return out, info


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (0.9, 1.0), (1.3, 0.8)])
@pytest.mark.parametrize("devname", ["procs2", "cuda2", "cuda_nccl2", "sim3"])
def test_workers_choose_the_tokens_the_coordinator_would(devname, temperature, top_p, request):
    dev = request.getfixturevalue("sim")(3) if devname == "sim3" else request.getfixturevalue(devname)
    _, step, v, i = start(dev)
    by_workers, info = worker_loop(dev, step, v, i, temperature, top_p, seed=11)
    _, step, v, i = start(dev)  # the same prompts again, from fresh caches
    assert by_workers == coordinator_loop(dev, step, v, i, temperature, top_p, seed=11)
    assert info["steps"] == STEPS and not info["cancelled"]
    if devname.startswith("cuda"):  # the decode step's kernels ran as replayed device graphs
        assert all(s["graphs"]["replays"] > STEPS for s in dev.stats().values())
    if temperature:  # the draw depends on the seed
        _, step, v, i = start(dev)
        assert worker_loop(dev, step, v, i, temperature, top_p, seed=12)[0] != by_workers


@pytest.mark.parametrize("devname, ahead", [("cuda1", STEPS - 1), ("cuda2", 0), ("procs2", 0)])
def test_one_gpu_worker_issues_each_step_before_it_reads_the_last_ones_tokens(devname, ahead, request):
    """With the sampler on the device and no peers, step s + 1 is issued before step s's tokens
    are read back (the stand-in runs the device's work late, on threads of its own: a token read
    before its copy landed would be garbage, a chosen-ids buffer overwritten before its copy a
    wrong token), and the tokens are still the coordinator's. With peers (whose stop flags
    come a step late) or on the CPU, each step waits for the last."""
    dev = request.getfixturevalue(devname)
    _, step, v, i = start(dev)
    by_workers, info = worker_loop(dev, step, v, i, 0.8, 0.9, seed=3)
    _, step, v, i = start(dev)
    assert by_workers == coordinator_loop(dev, step, v, i, 0.8, 0.9, seed=3)
    assert info["issued_ahead"] == ahead and info["steps"] == STEPS


@pytest.mark.parametrize(
    "rule",
    [
        Rule(0.0, repeat_penalty=3.0, repeat_last_n=2),
        Rule(0.8, top_k=5, top_p=0.9, min_p=0.05, repeat_penalty=1.8, repeat_last_n=3),
        Rule(1.2, min_p=0.1),
    ],
)
@pytest.mark.parametrize("devname", ["procs2", "cuda1", "cuda2"])
def test_the_tokens_chosen_by_the_workers_follow_every_rule_and_the_recent_window(devname, rule, request):
    """Penalty, top-k, top-p, min-p and a window of recent tokens that starts with the prompt's:
    the workers (on the CUDA backend the device sampler, workers/backends/cuda/kernels/sample.py, whose twin
    the stand-in runs; on the CPU the host) choose what the coordinator chooses by the same rule
    from the same candidates and seed, step by step."""
    dev = request.getfixturevalue(devname)
    window = rule.penalized
    _, step, v, i = start(dev)
    rng = np.random.default_rng(5)
    recent = [list(PROMPT[b, -window:]) if window else [] for b in range(2)]
    first = [choose(v[b, 0], i[b, 0], rule, rng, recent[b]) for b in range(2)]
    seen = tuple(tuple(r + [t]) for r, t in zip(recent, first))
    settings = p.GenerateSettings(rule, tuple(generator_state(rng)), (), (False, False), seen)
    driven = [first]
    dev.generate(
        step,
        np.array([[t] for t in first], np.int32),
        np.array([[5], [5]], np.int32),
        STEPS,
        settings,
        lambda k, chosen: driven.append(chosen) is None,
    )
    _, step, v, i = start(dev)  # again from fresh caches, chosen here
    rng = np.random.default_rng(5)
    seen = [collections.deque(r, maxlen=window) for r in recent]
    tokens = [choose(v[b, 0], i[b, 0], rule, rng, seen[b]) for b in range(2)]
    expected = [tokens]
    for pos in range(5, 5 + STEPS):
        for b in range(2):
            seen[b].append(tokens[b])
        v, i, *_ = step(np.array([[t] for t in tokens], np.int32), np.array([[pos], [pos]], np.int32))
        v, i = v.numpy(), i.numpy()
        tokens = [choose(v[b, 0], i[b, 0], rule, rng, seen[b]) for b in range(2)]
        expected.append(tokens)
    assert driven == expected


@pytest.mark.parametrize("devname", ["sim2", "cuda1"])
def test_every_sequence_at_a_stop_token_ends_the_loop(devname, request):
    """On one CUDA worker the loop issues each step before the last one's tokens are read: the
    step issued past the stop runs, but none of its tokens is reported or counted."""
    dev = request.getfixturevalue("sim")(2) if devname == "sim2" else request.getfixturevalue(devname)
    _, step, v, i = start(dev)
    greedy, _ = worker_loop(dev, step, v, i, 0.0, 1.0, seed=0)
    stops = {greedy[3][0], greedy[3][1]}  # both sequences have met a stop token by step 3
    _, step, v, i = start(dev)
    out, info = worker_loop(dev, step, v, i, 0.0, 1.0, seed=0, stop=sorted(stops))
    assert out[: len(out)] == greedy[: len(out)]
    last = max(max(next(k for k, t in enumerate(greedy) if t[b] in stops) for b in range(2)), 1)
    assert len(out) == last + 1 and info["steps"] == last


def test_a_sequence_that_stopped_stays_stopped_and_the_loop_waits_for_every_sequence(sim):
    """Two sequences meeting their stop tokens at different steps: the loop ends after the later
    one (not at the first: any is not all), and the earlier one's later tokens, not stop tokens,
    do not make it unfinished again."""
    dev = sim(2)
    _, step, v, i = start(dev)
    greedy, _ = worker_loop(dev, step, v, i, 0.0, 1.0, seed=0)

    def first_hits(stops):
        return [next((k for k, t in enumerate(greedy) if t[b] in stops), None) for b in range(2)]

    # sequence 0 stops at step k0, sequence 1 later at k1, and sequence 0's token at k1 is no stop
    # token (so a sequence made unfinished again would keep the loop going)
    pairs = [(k0, k1) for k0 in range(1, len(greedy)) for k1 in range(k0 + 2, len(greedy) - 1)]
    found = [
        (k0, k1)
        for k0, k1 in pairs
        if first_hits({greedy[k0][0], greedy[k1][1]}) == [k0, k1]
        and greedy[k1][0] not in {greedy[k0][0], greedy[k1][1]}
    ]
    assert found, "no such pair of stop tokens in this greedy run"
    stops = {greedy[found[0][0]][0], greedy[found[0][1]][1]}
    hits = first_hits(stops)
    _, step, v, i = start(dev)
    out, info = worker_loop(dev, step, v, i, 0.0, 1.0, seed=0, stop=sorted(stops))
    assert len(out) == max(hits) + 1 and info["steps"] == max(hits)
    assert out == greedy[: len(out)]


@pytest.mark.parametrize("how", ["refuse", "interrupt"])
@pytest.mark.parametrize("devname", ["procs2", "procs3_zmq", "procs3_tcp", "cuda1"])
def test_a_cancel_stops_within_a_token_and_the_workers_stay_usable(devname, how, request):
    """Rank 0 tells its peers of the cancel in their stop words (one host, the shm plane) or in
    messages (over ZeroMQ or the tcp plane, as between hosts): either way every rank stops after
    the same step."""
    dev = request.getfixturevalue(devname)
    seen = []

    def on(k, chosen):
        seen.append(k)
        if k == 2:
            if how == "interrupt":
                raise KeyboardInterrupt  # Ctrl-C while a token is being shown
            return False
        return True

    _, step, v, i = start(dev)
    steps = LONG  # the workers must still be generating when the coordinator reads token 2
    if how == "interrupt":
        with pytest.raises(KeyboardInterrupt):
            worker_loop(dev, step, v, i, 0.0, 1.0, seed=0, on=on, steps=steps, report_s=0)
        assert seen == [0, 1, 2]  # nothing is shown after Ctrl-C
    else:
        # every step reported on its own: the Cancel leaves while the workers still generate
        out, info = worker_loop(dev, step, v, i, 0.0, 1.0, seed=0, on=on, steps=steps, report_s=0)
        # the workers stop at the first step after the Cancel reached rank 0; reports of steps
        # already under way are not shown
        assert info["cancelled"] and info["steps"] < steps and len(out) == 4
    _, step, v, i = start(dev)  # usable: the same generation again, to the end
    out, info = worker_loop(dev, step, v, i, 0.0, 1.0, seed=0)
    assert info["steps"] == STEPS and len(out) == STEPS + 1


def test_without_a_token_board_steps_gathered_in_few_messages_are_each_shown_in_order(procs2, monkeypatch):
    import meta.generation

    monkeypatch.setattr(meta.generation, "board_supported", lambda: False)  # as for a rank 0 on another host
    reports = []
    steps = meta.generation.Shown.steps
    monkeypatch.setattr(
        meta.generation.Shown, "steps", lambda s, k, t, **kw: reports.append(len(t)) or steps(s, k, t, **kw)
    )
    dev = procs2
    _, step, v, i = start(dev)
    one_by_one, _ = worker_loop(dev, step, v, i, 0.9, 1.0, seed=3, report_s=0)
    assert reports == [1] * STEPS
    reports.clear()
    _, step, v, i = start(dev)
    gathered, info = worker_loop(dev, step, v, i, 0.9, 1.0, seed=3, report_s=60)
    assert reports == [1, STEPS - 1]  # the first step at once, the rest when the generation ended
    assert gathered == one_by_one and info["steps"] == STEPS

    # refused in the middle of a report: the steps after it are not shown
    seen = []
    _, step, v, i = start(dev)
    out, _ = worker_loop(dev, step, v, i, 0.9, 1.0, seed=3, report_s=60, on=lambda k, t: seen.append(k) or k < 2)
    assert seen == [0, 1, 2] and out == one_by_one[:4]


@pytest.mark.parametrize("report_s", [0, 60])
@pytest.mark.parametrize("devname", ["procs2", "sim2"])
def test_the_token_board_carries_every_step_each_shown_once_in_order(devname, monkeypatch, report_s, request):
    import meta.generation

    dev = request.getfixturevalue("sim")(2) if devname == "sim2" else request.getfixturevalue(devname)
    _, step, v, i = start(dev)
    monkeypatch.setattr(meta.generation, "board_supported", lambda: False)
    by_messages, _ = worker_loop(dev, step, v, i, 0.9, 1.0, seed=3, report_s=report_s)
    monkeypatch.undo()
    on_board = []
    take = meta.generation.TokenBoard.take

    def taken(board):
        first, steps = take(board)
        on_board.extend(enumerate(steps, first))
        return first, steps

    monkeypatch.setattr(meta.generation.TokenBoard, "take", taken)
    boards = set(shm_root().glob("meta-tp-board-*"))
    named = []  # whether the board's file had a name as each step was shown
    _, step, v, i = start(dev)
    out, info = worker_loop(
        dev, step, v, i, 0.9, 1.0, seed=3, report_s=report_s, on=lambda k, t: named.append(_board_files(boards)) or True
    )
    assert out == by_messages and info["steps"] == STEPS
    assert on_board == list(enumerate(by_messages[1:]))  # every step came on the board, once
    # rank 0 removed the name once it had mapped the file (at the latest before its first step
    # was shown): a coordinator killed now would leave nothing behind
    assert not any(named) and not _board_files(boards)

    # refused on the board: the steps after it are not shown, the workers stop
    seen = []
    _, step, v, i = start(dev)
    refuse = lambda k, t: seen.append(k) or k < 2  # noqa: E731
    out, info = worker_loop(dev, step, v, i, 0.9, 1.0, seed=3, report_s=0, on=refuse, steps=LONG)
    assert seen == [0, 1, 2] and out == by_messages[:4]
    assert info["cancelled"] and info["steps"] < LONG  # the board's cancel word reached rank 0


def _board_files(before: set) -> list:
    return sorted(set(shm_root().glob("meta-tp-board-*")) - before)


def test_a_rank_0_that_cannot_map_the_board_reports_in_messages(sim, monkeypatch):
    from transport.board import TokenBoard

    dev = sim(2)
    _, step, v, i = start(dev)
    expected, _ = worker_loop(dev, step, v, i, 0.9, 1.0, seed=5)

    def elsewhere(path, per_step):
        raise TransportError(f"{path}: a board of host b'other', not this one")

    monkeypatch.setattr(TokenBoard, "attach", elsewhere)
    _, step, v, i = start(dev)
    out, info = worker_loop(dev, step, v, i, 0.9, 1.0, seed=5)
    assert out == expected and info["steps"] == STEPS


@pytest.mark.parametrize("plane", ["shm", "nccl"])
def test_a_worker_lost_during_generation_is_a_typed_error_within_seconds(fresh_cluster, plane):
    """Over NCCL the decode step's collectives replay inside its device graph: the survivor
    waits for the graph with the collective deadline and the abort watch, not forever."""
    from tests.conftest import _standin_env

    nccl = {"backend": "cuda", "devices": (0, 1), "env": {**_standin_env(), "CUPY_STANDIN_DEVICES": "2"}}
    cluster = fresh_cluster(2, liveness=2.0, heartbeat=0.2, **(nccl if plane == "nccl" else {}))
    dev = MetaDevice(cluster)
    _, step, v, i = start(dev)
    killed = {}

    def on(k, chosen):
        if k == 0:  # over NCCL the step's graph was captured at step 0: later steps replay it
            os.kill(cluster.pids[1], signal.SIGKILL)
            killed["at"] = time.monotonic()
        return True

    with pytest.raises(WorkerLost, match="worker 1"):
        worker_loop(dev, step, v, i, 0.0, 1.0, seed=0, on=on, steps=LONG)
    assert time.monotonic() - killed["at"] < 5.0


# 8 query heads over 2 KV heads, as tests/test_decode.py's GQA_CFG: the decode path as a model runs it
REF_CFG = LlamaConfig(hidden=64, layers=2, heads=8, kv_heads=2, ffn=48, vocab=72, rope_base=30000.0)


@pytest.mark.parametrize("devname", ["procs2", "cuda1", "cuda2", "cuda_nccl2", "cuda3_shm"])
def test_prepared_decode_replayed_and_driven_gives_the_reference_tokens(devname, request):
    """The decode path as `generate` runs it (warm-up, a prefill, the prepared decode step
    replayed by the coordinator, then driven by the workers) against the NumPy reference decoder,
    step by step. On CUDA a replayed step's kernels run eagerly, are captured, then replay as
    device graphs, with fed positions and tokens copied into the graphs' buffers: a graph writing
    memory another one reads (a cache position coming back as a float's bits) shows here."""
    dev = request.getfixturevalue(devname)
    weights = random_weights(REF_CFG, seed=31)
    ctx, pool, prompt = 40, 4, [3, 70, 15, 8, 41]
    net = TensorParallelLlama(dev, REF_CFG, weights.__getitem__, ctx)
    assert net.heads.shared == (dev.n == 3)  # 2 KV heads on 3 workers: the gqa_attention op
    net.warm_up(pool)
    decode = net.prepare_decode(1, build=lambda logits: list(logits.top_k(pool)))

    def prefill_and_reference():
        ref = ReferenceDecoder(REF_CFG, weights, ctx)
        want = ref.forward(np.array([prompt]), np.arange(len(prompt))[None])[0, -1]
        got = net.prefill([prompt], 0, pool=pool)[1].numpy()[0, 0]
        np.testing.assert_array_equal(got, np.argsort(-want, kind="stable")[:pool])
        return ref, int(got[0])

    ref, token = prefill_and_reference()
    expected = [token]
    for pos in range(len(prompt), len(prompt) + STEPS):  # replayed by the coordinator
        values, indices = (
            t.numpy()[0, 0] for t in decode(np.array([[token]], np.int32), np.array([[pos]], np.int32))[:2]
        )
        want = ref.forward(np.array([[token]]), np.array([[pos]]))[0, -1]
        np.testing.assert_array_equal(indices, np.argsort(-want, kind="stable")[:pool], err_msg=f"position {pos}")
        np.testing.assert_allclose(values, np.sort(want)[::-1][:pool], rtol=1e-4, atol=1e-5)
        token = int(indices[0])
        expected.append(token)
    _, token = prefill_and_reference()  # again, from position 0: the workers choose from here on
    driven = [token]
    settings = p.GenerateSettings(Rule(), tuple(generator_state(np.random.default_rng(0))), (), (False,))
    info = dev.generate(
        decode,
        np.array([[token]], np.int32),
        np.array([[len(prompt)]], np.int32),
        STEPS,
        settings,
        lambda k, chosen: driven.append(chosen[0]) is None,
    )
    assert info["steps"] == STEPS and driven == expected
    if devname.startswith("cuda"):  # no step reads on the host: every capture holds
        for rank, stats in dev.stats().items():
            graph = stats["graphs"]
            assert graph["replays"] > STEPS and not graph["refused"], (rank, graph["refused"])
            # one worker: the decode step is one graph; outside it only the casts of its results
            # (fresh arrays each run, no host read: a read inside a segment fails its capture)
            run = graph["per_run"][str(decode.compiled.program)]
            assert graph["driven"] == str(decode.compiled.program)  # what bench/gpu_check.py reads
            if devname in ("cuda1", "cuda_nccl2"):  # NCCL's collectives are captured too
                assert run["graphs"] == 1 and set(run["outside"]) == {"cast"}, run
            else:  # the collectives and what they send or return stay outside (fresh memory)
                inside = ("attention", "gqa_attention", "top_k_combine")
                assert not set(inside) & set(run["outside"]), run
                assert "redistribute" in run["outside"], run
            # each captured segment's own pool holds its temporaries: 20-47 KiB here in all
            assert 0 < graph["pool_bytes"] < 1 << 20, graph["pool_bytes"]


def test_log_probabilities_from_candidates_and_mass_equal_a_log_softmax():
    """Rank 0's log-probabilities (workers/generation.py) from a step's outputs, the candidates
    (best first) and each row's mass sum(exp(logit - best)), against NumPy's log-softmax of the
    whole rows (float64): the chosen token's, the best N pairs, NaN where a row asked for fewer,
    a row that asked for none all NaN."""
    from workers.generation import log_probabilities

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 50)).astype(np.float32) * 3
    order = np.argsort(-logits, axis=1, kind="stable")[:, :8]
    values = np.take_along_axis(logits, order, 1)[:, None, :]
    indices = order[:, None, :].astype(np.int64)
    mass = np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)
    chosen = [int(order[0, 2]), int(order[1, 0]), int(order[2, 5])]
    got = log_probabilities(values, indices, mass, chosen, (3, -1, 1))
    wide = logits.astype(np.float64)
    log_p = (
        wide - wide.max(axis=1, keepdims=True) - np.log(np.exp(wide - wide.max(axis=1, keepdims=True)).sum(1))[:, None]
    )
    assert got.shape == (3, 7)
    np.testing.assert_allclose(got[0, 0], log_p[0, chosen[0]], atol=1e-6)
    np.testing.assert_array_equal(got[0, 1::2], order[0, :3])
    np.testing.assert_allclose(got[0, 2::2], log_p[0, order[0, :3]], atol=1e-6)
    assert np.isnan(got[1]).all()
    np.testing.assert_allclose(got[2, :3], [log_p[2, chosen[2]], order[2, 0], log_p[2, order[2, 0]]], atol=1e-6)
    assert np.isnan(got[2, 3:]).all()
