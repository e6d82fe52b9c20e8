"""Pipelined generation (workers/pipelined.py): a layer split's rows in lanes, one captured step
each, whose steps overlap across the groups. Held to the one-step generation of the same model
(workers/generation.py, itself held to the coordinator's steps and to NumPy elsewhere): the same
tokens, log-probabilities, stops and cancels, on simulated and on process workers."""

from __future__ import annotations

import numpy as np
import pytest

from models.llama import LayerGroups, LlamaConfig, TensorParallelLlama, random_weights
from models.requests import candidates
from split_state.errors import ProtocolError
from split_state.sampling import Rule, generator_state
from transport import protocol as p
from transport.deadline import Deadline
from workers.comm import QueueComm
from workers.pipelined import lanes_of

pytestmark = pytest.mark.timeout(300)

CFG = LlamaConfig(hidden=64, layers=4, heads=8, kv_heads=2, ffn=48, vocab=72, rope_base=30000.0)
GROUPS = {2: LayerGroups(((0,), (1,))), 3: LayerGroups(((0,), (1,), (2,))), 4: LayerGroups(((0, 1), (2, 3)))}
SAMPLED = Rule(temperature=0.9, top_k=20)
GREEDY = Rule()
LONG = 80  # steps: the workers must still be generating when a refusal reaches them


def _settings(rows: int, rule: Rule = GREEDY, own: bool = False, stop=(), logprobs=()) -> p.GenerateSettings:
    rng = np.random.default_rng(5)
    choices = ()
    if own:  # each sequence its own rule and generator
        choices = tuple(
            p.OwnChoice(SAMPLED if b % 2 else GREEDY, tuple(generator_state(np.random.default_rng(b))), 16)
            for b in range(rows)
        )
    return p.GenerateSettings(
        rule,
        tuple(generator_state(rng)),
        tuple(stop),
        (False,) * rows,
        (),
        report_s=0,  # every step reported on its own: a refusal reaches the workers while they generate
        own=choices,
        logprobs=tuple(logprobs),
    )


def _generate(dev, groups, rows, steps, settings, pipelined, refuse_at=None, mass=False, on_step=None):
    """A fresh model's decode from tokens at position 0 (the first step captured by the
    coordinator, the rest driven by the workers): (reported steps, log-probabilities, account)."""
    weights = random_weights(CFG, seed=21)
    net = TensorParallelLlama(dev, CFG, weights.__getitem__, LONG + 2, batch=rows, layer_groups=groups)
    tokens = (np.arange(rows, dtype=np.int32)[:, None] * 7 + 3) % CFG.vocab
    positions = np.zeros((rows, 1), np.int32)
    lanes = net.lanes(rows) if pipelined else [range(rows)]
    calls = []
    for lane in lanes:
        t, q = tokens[lane.start : lane.stop], positions[lane.start : lane.stop]
        build = candidates(16, mass, net.head_group if pipelined else None)
        step, _ = net.capture_decode(t, q, build=build, rows_from=lane.start, lane=pipelined)
        calls.append((step, t, q + 1))
    reported, rows_seen = [], {}

    def on_tokens(k, chosen):
        reported.append(list(chosen))
        if on_step is not None:
            on_step(k)
        return refuse_at is None or k < refuse_at

    info = dev.generate(
        *calls[0], steps, settings, on_tokens, every_step=True, on_logprobs=rows_seen.__setitem__, lanes=calls[1:]
    )
    return reported, rows_seen, info


def _live(reported, stop):
    """Each step's tokens of the sequences not done before it (a done one's are not its own)."""
    done, out = set(), []
    for chosen in reported:
        out.append({b: t for b, t in enumerate(chosen) if b not in done})
        done |= {b for b, t in enumerate(chosen) if t in stop}
    return out


@pytest.mark.parametrize(
    "n, rows, how",
    [(2, 4, "greedy"), (4, 5, "sampled"), (3, 3, "own"), (2, 3, "own"), (3, 7, "sampled")],
)
def test_lanes_give_the_one_step_generations_tokens(sim, n, rows, how):
    dev = sim(n)
    settings = _settings(rows, SAMPLED if how == "sampled" else GREEDY, own=how == "own")
    expected, _, one = _generate(dev, GROUPS[n], rows, 9, settings, pipelined=False)
    got, _, info = _generate(dev, GROUPS[n], rows, 9, settings, pipelined=True)
    assert info["lanes"] == min(len(GROUPS[n].groups), rows) and one.get("lanes") is None
    assert got == expected and len({t for s in got for t in s}) > 3
    assert info["steps"] == one["steps"] == 9
    if how == "own":  # the generators' states come back from the worker that chose
        assert info["generators"] == one["generators"]


def test_a_lane_whose_sequences_are_done_ends_and_the_others_go_on(sim):
    dev = sim(2)
    free = _settings(4)
    reported, _, _ = _generate(dev, GROUPS[2], 4, 12, free, pipelined=False)
    stop = {reported[1][0], reported[2][1]}  # rows 0 and 1 (lane 0) end early
    settings = _settings(4, stop=sorted(stop))
    expected, _, one = _generate(dev, GROUPS[2], 4, 12, settings, pipelined=False)
    got, _, info = _generate(dev, GROUPS[2], 4, 12, settings, pipelined=True)
    assert _live(got, stop) == _live(expected, stop)
    assert info["steps"] == one["steps"]
    assert not _live(got, stop)[-1].keys() & {0, 1}, "lane 0 was to be done before the end"


def test_log_probabilities_come_from_the_worker_that_chooses(sim):
    dev = sim(4)
    settings = _settings(3, SAMPLED, logprobs=(2, -1, 4))
    tokens, expected, _ = _generate(dev, GROUPS[4], 3, 5, settings, pipelined=False, mass=True)
    got_tokens, got, _ = _generate(dev, GROUPS[4], 3, 5, settings, pipelined=True, mass=True)
    assert got_tokens == tokens and sorted(got) == sorted(expected) == list(range(5))
    for k in expected:  # float32 products over a lane's rows may round apart from those over all rows
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-6)
    assert np.isnan(got[0][1]).all() and not np.isnan(got[0][2][:9]).any()


@pytest.mark.parametrize("refuse_at", [0, 3])
def test_a_refusal_stops_every_lane_after_the_same_step_and_the_device_goes_on(sim, refuse_at):
    dev = sim(3)
    settings = _settings(3, SAMPLED)
    expected, _, _ = _generate(dev, GROUPS[3], 3, LONG, settings, pipelined=False)
    got, _, info = _generate(dev, GROUPS[3], 3, LONG, settings, pipelined=True, refuse_at=refuse_at)
    assert info["cancelled"] and refuse_at < info["steps"] < LONG
    assert got == expected[: info["steps"]]  # every step the workers ran, each with every lane's tokens
    again, _, _ = _generate(dev, GROUPS[3], 3, LONG, settings, pipelined=True)  # nothing left over from the cancel
    assert again == expected


def test_lanes_on_worker_processes_over_tcp(procs3_tcp):
    settings = _settings(4, SAMPLED)
    expected, _, _ = _generate(procs3_tcp, GROUPS[3], 4, 8, settings, pipelined=False)
    got, _, info = _generate(procs3_tcp, GROUPS[3], 4, 8, settings, pipelined=True)
    assert got == expected and info["lanes"] == 3


@pytest.mark.parametrize("fixture", ["cuda2", "cuda_nccl2"])
def test_lanes_on_cuda_workers(request, fixture):
    """Two CUDA workers (the CuPy stand-in, or GPUs), a group each, over CUDA IPC or NCCL: the
    reporter reads each lane's candidates back from the device, and the lanes' sampled tokens
    are the one-step generation's."""
    dev = request.getfixturevalue(fixture)
    settings = _settings(4, SAMPLED)
    expected, _, _ = _generate(dev, GROUPS[2], 4, 6, settings, pipelined=False)
    got, _, info = _generate(dev, GROUPS[2], 4, 6, settings, pipelined=True)
    assert got == expected and info["lanes"] == 2


@pytest.mark.parametrize("plane", ["shm", "zmq"])
def test_groups_of_two_processes_all_reduce_among_themselves_between_interleaved_runs(fresh_cluster, plane):
    """2 groups of 2 worker processes: inside a group the small all-reduces go through shared
    memory's postboxes (shm) or messages (zmq) while the lanes' runs interleave and a peer may
    be a run or two ahead."""
    from meta import MetaDevice

    dev = MetaDevice(fresh_cluster(4, data_plane=plane))
    settings = _settings(5, SAMPLED)
    expected, _, _ = _generate(dev, GROUPS[4], 5, 12, settings, pipelined=False)
    got, _, info = _generate(dev, GROUPS[4], 5, 12, settings, pipelined=True)
    assert got == expected and info["lanes"] == 2


@pytest.mark.parametrize("plane", ["shm", "tcp", "zmq"])
def test_groups_of_two_processes_prefill_in_lanes_and_a_long_prompts_chunks_in_one_chain(
    fresh_cluster, plane, monkeypatch
):
    """2 groups of 2 worker processes: several new prompts prefill in lanes, and a 40-token
    prompt's three chunks go in one chain, so the first group runs ahead to the next lane or
    chunk while the second all-reduces inside itself; what a worker gets early for a later run
    of the chain is kept for it (workers/server.py), not dropped as stale (which left the
    second group waiting on the hand-over until its deadline). The lanes' candidates are those
    of one step of every row (to float32 rounding), the long prompt's logits the NumPy
    reference's."""
    import models.llama as llama
    from meta import MetaDevice
    from models.llama import ReferenceDecoder

    monkeypatch.setattr(llama, "PREFILL_CHUNK", 16)
    dev = MetaDevice(fresh_cluster(4, data_plane=plane, collective_timeout=20))
    weights = random_weights(CFG, seed=6)
    net = TensorParallelLlama(dev, CFG, weights.__getitem__, 48, batch=4, layer_groups=GROUPS[4])
    prompts = [[3, 5, 7], [9, 11], [13, 15, 17, 19], [2]]
    assert net.prefills_in_lanes(prompts, 0)
    values, indices = net.prefill_in_lanes(prompts, 8)
    want_values, want_indices = (t.numpy() for t in net.prefill(prompts, 0, 8))
    np.testing.assert_array_equal(indices, want_indices)
    np.testing.assert_allclose(values, want_values, rtol=1e-6)
    chains = []
    real_chain = dev.chain
    monkeypatch.setattr(dev, "chain", lambda calls, *a, **k: chains.append(len(calls)) or real_chain(calls, *a, **k))
    prompt = np.random.default_rng(2).integers(0, CFG.vocab, 40)
    _, _, logits = net.prefill([list(prompt)], 0, pool=1, logits=True)
    assert chains == [3 * (1 + CFG.layers) + 1]  # every chunk's embedding and layers, one head
    want = ReferenceDecoder(CFG, weights, 48).forward(prompt[None], np.arange(40)[None])[0, -1]
    np.testing.assert_allclose(logits.numpy()[0, 0], want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("killed", [0, 1])
def test_a_worker_lost_in_a_pipelined_generation_is_a_typed_error_within_seconds(fresh_cluster, killed):
    """Worker 1 chooses (the head's group), worker 0 waits for its tokens: either lost, the
    coordinator says which within the liveness bound, and nothing is left running (the fixture)."""
    import os
    import signal
    import time

    from meta import MetaDevice
    from split_state.errors import WorkerLost

    cluster = fresh_cluster(2, liveness=2.0, heartbeat=0.2)
    dev = MetaDevice(cluster)
    at = {}

    def kill(k):
        if k == 0:
            os.kill(cluster.pids[killed], signal.SIGKILL)
            at["killed"] = time.monotonic()

    with pytest.raises(WorkerLost, match=f"worker {killed}"):
        _generate(dev, GROUPS[2], 2, LONG, _settings(2), pipelined=True, on_step=kill)
    assert time.monotonic() - at["killed"] < 5.0


def test_lanes_that_leave_the_first_no_sequence_are_refused_before_anything_runs(sim):
    from split_state.errors import ShapeError

    dev = sim(2)
    net = TensorParallelLlama(dev, CFG, random_weights(CFG, seed=2).__getitem__, 8, batch=2, layer_groups=GROUPS[2])
    t, q = np.array([[3], [4]], np.int32), np.zeros((2, 1), np.int32)
    steps = [
        net.capture_decode(t[k : k + 1], q[k : k + 1], candidates(4, on=net.head_group), rows_from=k, lane=True)[0]
        for k in range(2)
    ]
    with pytest.raises(ShapeError, match="lanes of 2 rows after the first, for 2 sequences"):
        dev.generate(steps[0], t[:1], q[:1], 3, _settings(2), lambda k, c: True, lanes=[(steps[1], t, q)])
    got, _, _ = _generate(dev, GROUPS[2], 2, 3, _settings(2), pipelined=True)  # the device goes on
    assert len(got) == 3


@pytest.mark.parametrize("n, first_row, slots", [(2, 0, False), (3, 0, False), (2, 0, True), (3, 1, True)])
def test_prompts_prefilled_in_lanes_give_the_one_steps_candidates_and_caches(sim, n, first_row, slots):
    """prefill_in_lanes against the step it replaces: every row's (`prefill` of the batch, its
    caches written and read back) or slots' first chunks (one slotted step, each row attending
    to its own keys and values); the candidates, and a decode step after reads the same caches
    (float32 products over a lane's rows may round apart from those over all rows: to 1e-6;
    tests/test_layer_split.py holds the SmolLM2 file's integer products to them bit for bit)."""
    prompts = [[3, 5, 7], [9, 11], [13, 15, 17, 19], [2]]
    got, weights = [], random_weights(CFG, seed=6)
    batch = 4 if not slots else 5
    for lanes in (False, True):
        dev = sim(n)
        net = TensorParallelLlama(
            dev, CFG, weights.__getitem__, 32, batch=batch, layer_groups=GROUPS[n], cache_types=("f16", "f16")
        )
        if lanes:
            assert net.prefills_in_lanes(prompts, 0) and not net.prefills_in_lanes(prompts, 1)
            values, indices = net.prefill_in_lanes(prompts, 8, first_row=first_row, slots=slots)
        else:
            values, indices = (t.numpy() for t in net.prefill(prompts, 0, 8, slot=first_row if slots else None))
        rows = slice(first_row, first_row + 4)
        tokens, positions = np.zeros((batch, 1), np.int32), np.zeros((batch, 1), np.int32)
        tokens[rows, 0], positions[rows, 0] = [1, 2, 3, 4], [3, 2, 4, 1]
        got.append((values, indices, net.step(tokens, positions).numpy()[rows]))
    (v0, i0, after0), (v1, i1, after1) = got
    assert v1.shape == (4, 1, 8)
    np.testing.assert_array_equal(i1, i0)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    np.testing.assert_allclose(after1, after0, rtol=1e-5, atol=1e-6)


def test_lanes_split_the_rows_one_a_group():
    class Net:
        lanes = TensorParallelLlama.lanes

        def __init__(self, groups):
            self.layer_groups = groups

    assert Net(GROUPS[2]).lanes(5) == [range(0, 3), range(3, 5)]
    assert Net(GROUPS[3]).lanes(2) == [range(0, 1), range(1, 2)]
    assert Net(GROUPS[3]).lanes(7) == [range(0, 3), range(3, 5), range(5, 7)]
    assert Net(GROUPS[3]).lanes(4) == [range(0, 2), range(2, 3), range(3, 4)]
    assert Net(GROUPS[3]).lanes(1) == [range(0, 1)] and Net(None).lanes(6) == [range(0, 6)]


def _message(**changes) -> p.Generate:
    pairs = np.zeros((0, 2), np.int64)
    fields = dict(
        program=1,
        run=10,
        steps=4,
        inputs=pairs,
        outputs=pairs,
        tokens=1,
        positions=2,
        values=3,
        indices=4,
        sampling=_settings(5),
        lanes=[[2, 5, 6, 7, 8, -1, 2]],
        lane_inputs=[pairs],
        lane_outputs=[pairs],
        reporter=1,
    )
    return p.Generate(**{**fields, **changes})


def test_a_generates_lanes_travel_and_are_checked():
    message = _message()
    back, _ = p.decode(p.encode(message))
    assert back.lanes == message.lanes and back.reporter == 1 and len(back.lane_inputs) == 1
    lanes = lanes_of(back, 2)
    assert [(lane.program, lane.first, lane.rows, lane.values) for lane in lanes] == [(1, 0, 3, 3), (2, 3, 2, 7)]
    for bad, says in [
        (dict(lanes=[[2, 5, 6, 7, 8, -1]]), "a lane is"),
        (dict(lanes=[[2, 5, 6, 7, 8, -1, 0]]), "a lane is"),
        (dict(lanes=[[2, 5, 6, 7, 8, -1, 5]]), "lanes of 5 rows for 5"),
        (dict(lane_inputs=[]), "1 lanes with 0 inputs"),
        (dict(reporter=2), "reporter 2 of 2"),
    ]:
        with pytest.raises(ProtocolError, match=says):
            lanes_of(_message(**bad), 2)


def test_the_inbox_keeps_runs_up_to_its_lookahead():
    import queue

    queues = [queue.Queue(), queue.Queue()]
    sender, receiver = QueueComm(0, queues), QueueComm(1, queues)
    sender.send(1, 12, 0, np.ones(2))  # two runs past the one awaited
    sender.send(1, 10, 0, np.zeros(2))
    receiver.lookahead = 2
    assert receiver.recv(0, 10, 0, Deadline(5)).tolist() == [0, 0]
    assert receiver.recv(0, 12, 0, Deadline(5)).tolist() == [1, 1]
    sender.send(1, 22, 0, np.ones(2))
    sender.send(1, 20, 0, np.zeros(2))
    receiver.lookahead = 1  # one run only: the later message is stale
    receiver.recv(0, 20, 0, Deadline(5))
    with pytest.raises(Exception, match="no data"):
        receiver.recv(0, 22, 0, Deadline(0.2))
