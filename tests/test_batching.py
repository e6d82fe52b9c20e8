"""Continuous batching under faults (models/batching.py), on a tiny synthetic model with
SmolLM2's vocabulary over simulated devices: a request's own failure ends that request alone, a
failure of the loop or the cluster tells every waiting and running request at once (none waits
out a timer), and what submit refuses."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from meta import MetaDevice
from models import synthetic
from models.batching import ContinuousBatcher, Finished, Job, Token
from models.gguf_model import GGUFModel, ModelError
from models.requests import Sampling
from split_state.errors import RemoteError, WorkerLost
from workers.simulator import SimulatedCluster

pytestmark = pytest.mark.timeout(120)
SHAPE = synthetic.Shape(layers=1, hidden=64, ffn=128, heads=2, kv_heads=1, context=64)
PROMPT = (504, 3575, 282, 4649, 314)
TOLD_WITHIN = 5.0  # seconds a request may wait to hear its end, far under the batcher's 120 s timer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    return GGUFModel(synthetic.write(path, synthetic.Recipe(SHAPE, weights="q8_0"), model.path).path)


@pytest.fixture
def batcher(tiny):
    dev = MetaDevice(SimulatedCluster(2))
    made = ContinuousBatcher(dev, tiny, slots=2, ctx=32, weights="f32")
    try:
        yield made
    finally:
        made.stop()
        dev.close()


def events_of(ticket, timeout: float = TOLD_WITHIN) -> list:
    start = time.monotonic()
    out = list(ticket.stream(timeout=timeout))
    assert time.monotonic() - start < timeout, "the request waited out its timer"
    return out


def greedy(n: int = 4) -> Job:
    return Job(PROMPT, n, Sampling(), stop_at_eos=False)


def test_a_prompt_the_workers_refuse_fails_alone_and_the_next_is_served(batcher, monkeypatch):
    real = batcher.net.prefill

    def prefill(prompts, *args, **kwargs):
        if prompts[0][0] == 7:
            raise RemoteError("ShapeError: get_rows: ids must lie in [0, 49152)", rank=1)
        return real(prompts, *args, **kwargs)

    monkeypatch.setattr(batcher.net, "prefill", prefill)
    batcher.start()
    bad = events_of(batcher.submit(Job((7, 8), 4, Sampling())))
    assert bad[-1].reason == "error" and "ids must lie" in bad[-1].error
    good = events_of(batcher.submit(greedy()))
    assert [type(e) for e in good] == [Token] * 4 + [Finished] and good[-1].reason == "length"
    assert batcher.lost == ""


def test_a_refused_prompt_among_prompts_that_came_together_fails_alone(tiny, monkeypatch):
    """Three jobs queued before the loop starts go in one prefill step; the workers refuse it
    (the middle prompt's fault): the prompts go again one by one, the middle job fails with the
    workers' error, the others get the NumPy reference's greedy tokens."""
    ctx = 32
    dev = MetaDevice(SimulatedCluster(2))
    made = ContinuousBatcher(dev, tiny, slots=3, ctx=ctx, weights="f32")
    real, steps = made.net.prefill, []

    def prefill(prompts, *args, **kwargs):
        steps.append(len(prompts))
        if any(p[0] == 7 for p in prompts):
            raise RemoteError("ShapeError: get_rows: ids must lie in [0, 49152)", rank=1)
        return real(prompts, *args, **kwargs)

    monkeypatch.setattr(made.net, "prefill", prefill)
    prompts = [PROMPT, (7, 8, 9), PROMPT[:3]]
    try:
        tickets = [made.submit(Job(p, 3, Sampling(), stop_at_eos=False)) for p in prompts]
        made.start()
        seen = [events_of(t, 60) for t in tickets]
    finally:
        made.stop()
        dev.close()
    assert steps == [3, 1, 1, 1] and made.lost == ""
    assert seen[1][-1].reason == "error" and "ids must lie" in seen[1][-1].error
    for i in (0, 2):
        assert [e.token for e in seen[i] if isinstance(e, Token)] == reference_greedy(tiny, list(prompts[i]), 3, ctx)


def test_a_cluster_lost_while_admitting_tells_that_request_at_once(batcher, monkeypatch):
    def prefill(*args, **kwargs):
        raise WorkerLost("worker 1 exited with code -9", rank=1)

    monkeypatch.setattr(batcher.net, "prefill", prefill)
    batcher.start()
    first, second = batcher.submit(greedy()), batcher.submit(greedy())
    for ticket in (first, second):
        told = events_of(ticket)
        assert told[-1].reason == "error" and "worker 1" in told[-1].error
    assert "worker 1" in batcher.lost
    with pytest.raises(WorkerLost):
        batcher.submit(greedy())


def test_an_unexpected_error_in_the_loop_is_the_loss_of_the_cluster_told_to_everyone(batcher, monkeypatch):
    """Any exception, not only the cluster's own (a NaN sampling failure killed the thread and
    left /health at "ok" while requests queued for 120 s each)."""

    def step():
        raise OverflowError("cannot convert float infinity to integer")

    monkeypatch.setattr(batcher, "_step", step)
    batcher.start()
    running, waiting = batcher.submit(greedy()), batcher.submit(greedy())
    for ticket in (running, waiting):
        assert events_of(ticket)[-1].reason == "error"
    assert batcher.lost.startswith("OverflowError")


def test_a_sampling_failure_ends_that_request_alone(batcher, monkeypatch):
    import models.batching as batching

    real = batching.choose

    def choose(values, indices, rule, rng, recent=()):
        if rule.temperature == 0.5:
            raise ValueError("probabilities contain NaN")
        return real(values, indices, rule, rng, recent)

    monkeypatch.setattr(batching, "choose", choose)
    batcher.start()
    bad = batcher.submit(Job(PROMPT, 4, Sampling(temperature=0.5, seed=1)))
    good = batcher.submit(greedy())
    assert events_of(bad)[-1] == Finished("error", "sampling failed: probabilities contain NaN")
    assert events_of(good)[-1].reason == "length" and batcher.lost == ""


def test_lose_tells_every_waiting_request_at_once(batcher):
    batcher.start()
    tickets = [batcher.submit(greedy(20)) for _ in range(4)]  # 2 slots: two run, two wait
    batcher.lose("worker 0 silent for 6.0 s")
    for ticket in tickets:
        assert events_of(ticket)[-1].reason in ("error", "length")
    assert batcher.lost == "worker 0 silent for 6.0 s"


@pytest.mark.parametrize(
    "job, says",
    [
        (Job((), 4), "empty prompt"),
        (Job(PROMPT, 0), "max_tokens 0"),
        (Job((504, -1), 4), "token id -1"),
        (Job((49152,), 4), "token id 49152"),
        (Job((2**64,), 4), "token id 18446744073709551616"),
        (Job(tuple(range(40)), 4), "does not fit the context"),
        (Job(PROMPT, 4, Sampling(), False), "stop strings False"),
        (Job(PROMPT, 4, Sampling(), ("",)), "non-empty strings"),
    ],
)
def test_submit_refuses_what_cannot_run(batcher, job, says):
    with pytest.raises(ModelError, match=says):
        batcher.submit(job)


@pytest.mark.parametrize("on_workers", [False, True], ids=["stepwise", "driven"])
def test_the_repeat_penalty_window_takes_the_prompts_end_with_the_tokens(batcher, monkeypatch, on_workers):
    """A slot's penalized tokens are the last repeat_last_n of its prompt and its tokens
    together, as llama.cpp's and the CLI's are (worked out here from the job), whether the
    coordinator chooses each token or the workers do (both ranks' choices recorded)."""
    import models.batching as batching
    import workers.generation as generation

    windows = []
    real = batching.choose

    def choose(values, indices, rule, rng, recent=()):
        windows.append(tuple(recent))
        return real(values, indices, rule, rng, recent)

    monkeypatch.setattr(batching, "choose", choose)
    monkeypatch.setattr(generation, "choose", choose)
    batcher.drive_on_workers = on_workers
    batcher.start()
    job = Job(PROMPT, 6, Sampling(repeat_penalty=1.3, repeat_last_n=7), stop_at_eos=False)
    tokens = [e.token for e in events_of(batcher.submit(job)) if isinstance(e, Token)]
    assert len(tokens) == 6
    expected = 6 if not on_workers else 2 + 2 * 4  # prefill and a captured step here, then both ranks
    deadline = time.monotonic() + TOLD_WITHIN  # rank 1's last step may end after rank 0's token came
    while len(windows) < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(windows) == {tuple([*PROMPT, *tokens[:step]][-7:]) for step in range(6)}
    assert len(windows) == expected


def test_health_is_answered_while_a_call_holds_the_device(batcher):
    """A server's /health asks the cluster while the batcher's thread holds the device for a step
    (seconds, for a long prompt): it must not wait for the device's lock."""
    import threading

    dev = batcher.dev
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with dev._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        answered = []
        asker = threading.Thread(target=lambda: answered.append(dev.health()))
        asker.start()
        asker.join(2)
        assert answered == [""], "health waited for the device's lock"
    finally:
        release.set()
        holder.join(10)


def reference_greedy(model: GGUFModel, prompt, steps: int, ctx: int) -> list[int]:
    """The NumPy reference decoder's greedy tokens after `prompt` (the model's float32 weights)."""
    from models.llama import ReferenceDecoder

    weights = {name: model.weight(name) for name in model.expected_shapes()}
    ref = ReferenceDecoder(model.config, weights, ctx)
    logits = ref.forward(np.array([prompt]), np.arange(len(prompt))[None])[0, -1]
    out = [int(np.argmax(logits))]
    for pos in range(len(prompt), len(prompt) + steps - 1):
        logits = ref.forward(np.array([[out[-1]]]), np.array([[pos]]))[0, -1]
        out.append(int(np.argmax(logits)))
    return out


def test_a_long_prompt_joins_in_chunks_between_the_streams_tokens(tiny, monkeypatch):
    """Chunked prefill: a 40-token prompt joining a running stream goes in chunks of 8 (the
    chunk made small here), each followed by a decode step of the stream, which thus keeps
    getting tokens while the prompt goes in (not one long stall); both give the NumPy reference
    decoder's greedy tokens, the long prompt's read across its chunks' cache."""
    import models.batching as batching
    import models.llama as llama

    monkeypatch.setattr(batching, "PREFILL_CHUNK", 8)
    monkeypatch.setattr(llama, "PREFILL_CHUNK", 8)
    ctx, long_prompt = 64, [int(t) for t in np.random.default_rng(5).integers(0, 49152, 40)]
    dev = MetaDevice(SimulatedCluster(2))
    made = ContinuousBatcher(dev, tiny, slots=2, ctx=ctx, weights="f32")
    try:
        produced = []  # the slot of each token and "chunk" for each prefill chunk, in the batcher's order
        real_take, real_chunk = made._take, made._prefill_chunk
        monkeypatch.setattr(made, "_take", lambda index, *a: produced.append(index) or real_take(index, *a))

        def chunk():  # marked before it runs (its last chunk hands out a token), unmarked if none ran
            before, at = made.counters.prompt_tokens, len(produced)
            produced.append("chunk")
            real_chunk()
            if made.counters.prompt_tokens == before:
                del produced[at]

        monkeypatch.setattr(made, "_prefill_chunk", chunk)
        made.start()
        stream = made.submit(Job(PROMPT, 24, Sampling(), stop_at_eos=False))
        first = stream.next(TOLD_WITHIN)
        assert isinstance(first, Token)
        joining = made.submit(Job(tuple(long_prompt), 4, Sampling(), stop_at_eos=False))
        streamed = [first.token] + [e.token for e in events_of(stream, 60) if isinstance(e, Token)]
        joined = [e.token for e in events_of(joining, 60) if isinstance(e, Token)]
        # 40 tokens in chunks of 8: 5 chunks, a decode step of the stream after each of the first
        # 4; so 4 of the stream's tokens at least between the joining job's admission and its first
        stream_slot, join_slot = 0, 1
        joining_chunks = produced[produced.index("chunk", 1) :]  # the stream's own prompt was the first
        until_first = joining_chunks[: joining_chunks.index(join_slot) + 1]
        assert until_first == ["chunk", stream_slot] * 4 + ["chunk", join_slot]
        assert joined == reference_greedy(tiny, long_prompt, 4, ctx)
        assert streamed == reference_greedy(tiny, list(PROMPT), 24, ctx)
        assert made.counters.prompt_tokens == len(PROMPT) + len(long_prompt)
    finally:
        made.stop()
        dev.close()


def test_joining_prompts_go_in_by_admission_whatever_their_slots(tiny, monkeypatch):
    """The batcher's loop driven by hand (admit, one prefill chunk, one decode step), chunks of 8:
    a stream in slot 0, another in slot 1, a 40-token prompt P1 admitted into slot 2; the stream
    in slot 1 is cancelled and a 16-token prompt P2 (an exact multiple of the chunk, asking for
    log-probabilities) takes slot 1, below P1. P1's chunks go on first (it was admitted first),
    then P2's; each gives the reference decoder's greedy tokens, and P2's first token its
    log-probability under the reference's logits (the last chunk brings the whole row)."""
    import models.batching as batching
    import models.llama as llama
    from models.llama import ReferenceDecoder

    monkeypatch.setattr(batching, "PREFILL_CHUNK", 8)
    monkeypatch.setattr(llama, "PREFILL_CHUNK", 8)
    ctx = 64
    rng = np.random.default_rng(7)
    p1, p2 = (tuple(int(t) for t in rng.integers(0, 49152, n)) for n in (40, 16))
    dev = MetaDevice(SimulatedCluster(2))
    made = ContinuousBatcher(dev, tiny, slots=3, ctx=ctx, weights="f32")
    try:
        order = []  # the slot each prefill chunk went to

        def cycle():
            made._admit()
            pending = [len(s.pending) if s is not None else 0 for s in made.slots]
            made._prefill_chunk()
            after = [len(s.pending) if s is not None else 0 for s in made.slots]
            order.extend(i for i, (a, b) in enumerate(zip(pending, after)) if b < a)
            made._step()

        stream = made.submit(Job(PROMPT, 40, Sampling(), stop_at_eos=False))
        other = made.submit(Job(PROMPT[:3], 40, Sampling(), stop_at_eos=False))
        first = made.submit(Job(p1, 4, Sampling(), stop_at_eos=False))
        for _ in range(4):  # both streams' prompts (in one step: _joining), then three of P1's chunks
            cycle()
        assert order == [0, 1, 2, 2, 2] and [s.ticket for s in made.slots] == [stream, other, first]
        other.cancel()
        cycle()  # slot 1 is freed at its next token; P1's fourth chunk
        second = made.submit(Job(p2, 3, Sampling(), stop_at_eos=False, top_logprobs=1))
        for _ in range(12):
            cycle()
        assert made.slots[0].ticket is stream
        assert order == [0, 1, 2, 2, 2, 2, 2, 1, 1], order  # P1 to its end, then P2 (slot 1)
        got = {t: [e for e in events_of(t) if isinstance(e, Token)] for t in (first, second)}
        assert [e.token for e in got[first]] == reference_greedy(tiny, list(p1), 4, ctx)
        assert [e.token for e in got[second]] == reference_greedy(tiny, list(p2), 3, ctx)
        weights = {name: tiny.weight(name) for name in tiny.expected_shapes()}
        logits = ReferenceDecoder(tiny.config, weights, ctx).forward(np.array([p2]), np.arange(16)[None])[0, -1]
        log_p = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        token = got[second][0]
        assert token.logprob is not None and abs(token.logprob - log_p[token.token]) < 1e-3
    finally:
        made.stop()
        dev.close()


def test_prompts_that_come_together_go_in_one_step_and_get_the_references_tokens(tiny, monkeypatch):
    """Nine jobs queued before the loop starts, one a slot, their prompts' lengths 3, 9, 10, 5,
    7, 6, 2, 8 and 4 tokens (padded to 8 or 16), the step's budget made 32 padded tokens: slot
    0 goes alone (slot 1's prompt pads to 16), slots 1-2 together, 3-6 together (32 tokens),
    7 alone (past the budget), 8 alone (its job asks for log-probabilities: its prompt brings
    the whole logits). Every job gets the NumPy reference's greedy tokens."""
    import models.batching as batching

    monkeypatch.setattr(batching, "PREFILL_BATCH_TOKENS", 32)
    ctx, rng = 32, np.random.default_rng(4)
    prompts = [tuple(int(t) for t in rng.integers(0, 49152, n)) for n in (3, 9, 10, 5, 7, 6, 2, 8, 4)]
    dev = MetaDevice(SimulatedCluster(2))
    made = ContinuousBatcher(dev, tiny, slots=9, ctx=ctx, weights="f32")
    steps, prefill = [], made.net.prefill
    monkeypatch.setattr(
        made.net, "prefill", lambda p, *a, **k: (steps.append((k["slot"], len(p))), prefill(p, *a, **k))[1]
    )
    try:
        tickets = [
            made.submit(Job(prompt, 3, Sampling(), stop_at_eos=False, top_logprobs=1 if i == 8 else None))
            for i, prompt in enumerate(prompts)
        ]
        made.start()
        got = [[e.token for e in events_of(t, 60) if isinstance(e, Token)] for t in tickets]
        assert steps == [(0, 1), (1, 2), (3, 4), (7, 1), (8, 1)]  # (first slot, slots) of each step
        assert made.counters.prefill_steps == 5 and made.counters.prompt_tokens == sum(map(len, prompts))
    finally:
        made.stop()
        dev.close()
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference_greedy(tiny, list(prompt), 3, ctx)


# jobs of every kind of choice: greedy, sampled with seeds, a top_k pool, the repeat penalty,
# top_p and min_p, an end at EOS
MIXED_JOBS = (
    Job(PROMPT, 14, Sampling(), stop_at_eos=False),
    Job(PROMPT[:3], 12, Sampling(temperature=0.8, seed=3), stop_at_eos=False),
    Job(
        PROMPT[1:],
        10,
        Sampling(temperature=1.1, top_k=5, seed=11, repeat_penalty=1.3, repeat_last_n=6),
        stop_at_eos=False,
    ),
    Job(PROMPT[::-1], 11, Sampling(temperature=0.9, top_p=0.8, min_p=0.05, seed=4)),
)


def _tokens(ticket) -> list[int]:
    events = events_of(ticket, 60)
    assert isinstance(events[-1], Finished) and events[-1].reason in ("stop", "length"), events[-1]
    return [e.token for e in events if isinstance(e, Token)]


def test_jobs_decoded_on_the_workers_get_the_tokens_they_get_alone_from_the_coordinator(tiny):
    """The oracle: each job alone, every token chosen by the coordinator (one step per token).
    Then the four together, decoded on the workers (each with its own rule, seed and pool),
    joining one after another while the others run, so the workers' runs are cut short at
    each join and resume with every job's generator where it stood: the same tokens."""

    def batcher(on_workers: bool) -> ContinuousBatcher:
        return ContinuousBatcher(
            MetaDevice(SimulatedCluster(2)), tiny, slots=4, ctx=48, weights="f32", drive_on_workers=on_workers
        )

    alone = batcher(False).start()
    try:
        expected = [_tokens(alone.submit(job)) for job in MIXED_JOBS]
    finally:
        alone.stop()
        alone.dev.close()
    together = batcher(True)
    together.warm_up()
    runs, generate = [], together.dev.generate

    def counted(*args, **kw):
        info = generate(*args, **kw)
        runs.append(info["steps"])
        return info

    together.dev.generate = counted
    together.start()
    try:
        tickets = []
        for job in MIXED_JOBS:
            tickets.append(together.submit(job))
            first = tickets[-1].events.get(timeout=TOLD_WITHIN)  # it runs: the next one joins a running batch
            tickets[-1].events.queue.appendleft(first)
        got = [_tokens(t) for t in tickets]
    finally:
        together.stop()
        together.dev.close()
    assert got == expected
    assert len(runs) >= 4 and sum(runs) >= max(len(t) for t in expected) - 2  # cut at joins, most steps there


LOGPROB_JOBS = (  # one length, so every step of either path runs the same rows
    Job(PROMPT, 9, Sampling(), stop_at_eos=False, top_logprobs=3),
    Job(PROMPT[:3], 9, Sampling(temperature=0.8, seed=3), stop_at_eos=False, top_logprobs=0),
    Job(PROMPT[1:], 9, Sampling(temperature=1.1, top_k=5, seed=11), stop_at_eos=False),
    Job(PROMPT[::-1], 9, Sampling(temperature=0.9, top_p=0.8, seed=4), stop_at_eos=False, top_logprobs=5),
)


def test_log_probabilities_from_the_workers_equal_the_coordinators_own(tiny):
    """Jobs asking for log-probabilities decode on the workers too (their tokens chosen there,
    each row's log-probabilities worked out there from the step's candidates and mass): the same
    tokens, and the same log-probabilities bit for bit, as when the coordinator runs every step
    (models/batching.py _take, the oracle; its values against the NumPy reference decoder's:
    the chunked-prefill test above), beside a job that asks for none."""

    def run(on_workers: bool):
        made = ContinuousBatcher(
            MetaDevice(SimulatedCluster(2)), tiny, slots=4, ctx=48, weights="f32", drive_on_workers=on_workers
        )
        driven, generate = [], made.dev.generate

        def counted(*args, **kw):
            driven.append(args[4].logprobs)
            return generate(*args, **kw)

        made.dev.generate = counted
        tickets = [made.submit(job) for job in LOGPROB_JOBS]  # all admitted at the first turn
        made.start()
        try:
            return [[e for e in events_of(t, 60) if isinstance(e, Token)] for t in tickets], driven
        finally:
            made.stop()
            made.dev.close()

    expected, none = run(False)
    got, driven = run(True)
    assert none == [] and driven and all(lp == (3, 0, -1, 5) for lp in driven), driven
    assert [[e.token for e in job] for job in got] == [[e.token for e in job] for job in expected]
    assert got == expected  # logprob and top, exactly
    assert all(e.logprob is None for e in got[2]) and all(len(e.top) == 5 for e in got[3])
    assert all(e.top == () and e.logprob <= 0 for e in got[1])


def test_a_queued_job_takes_the_first_slot_freed_while_the_workers_decode(tiny):
    """Two slots decoding on the workers, a long job A and a short one B, and a job C queued
    behind them: when B ends its slot is free, so the workers' run is cut short there and C
    runs (its tokens the reference's) while A goes on: C ends before A. A fourth job D queued
    behind C is cancelled while it waits: told at once, never run."""
    dev = MetaDevice(SimulatedCluster(2))
    made = ContinuousBatcher(dev, tiny, slots=2, ctx=64, weights="f32")
    made.warm_up()
    told = []  # (job, event) in the order the batcher's thread put them

    def submit(name: str, job: Job):
        ticket = made.submit(job)
        put = ticket.put
        ticket.put = lambda event, **kw: told.append((name, type(event).__name__)) or put(event, **kw)
        return ticket

    made.start()
    try:
        a = submit("A", Job(PROMPT, 40, Sampling(), stop_at_eos=False))
        b = submit("B", Job(PROMPT[:2], 6, Sampling(), stop_at_eos=False))
        assert isinstance(b.events.get(timeout=TOLD_WITHIN), Token)  # both run
        c = submit("C", Job(PROMPT[:4], 3, Sampling(), stop_at_eos=False))
        d = submit("D", Job(PROMPT[:4], 3, Sampling(), stop_at_eos=False))
        d.cancel()
        assert _tokens(c) == reference_greedy(tiny, list(PROMPT[:4]), 3, 64)
        assert list(d.stream(TOLD_WITHIN)) == [Finished("cancelled")]
        assert len(_tokens(a)) == 40
        assert told.index(("C", "Finished")) < told.index(("A", "Finished"))
    finally:
        made.stop()
        dev.close()


def _counted(ticket) -> list:
    """A list that grows by one as each event is put into `ticket`'s queue."""
    put, seen = ticket.events.put, []
    ticket.events.put = lambda event: put(event) or seen.append(None)
    return seen


def _wake_ups(tiny, tokens: int, ctx: int) -> tuple[list, list[int]]:
    """A job of `tokens` greedy tokens alone on a batcher of its own: its events, and at each
    wake-up of its reader how many events had been put by then."""
    dev = MetaDevice(SimulatedCluster(2))
    made = ContinuousBatcher(dev, tiny, slots=2, ctx=ctx, weights="f32")
    made.warm_up()
    ticket = made.submit(greedy(tokens))
    seen, woken = _counted(ticket), []
    ticket.listen(lambda: woken.append(len(seen)))
    made.start()
    try:
        events = events_of(ticket, 60)
    finally:
        made.stop()
        dev.close()
    assert len(events) == tokens + 1 and isinstance(events[-1], Finished)
    return events, woken


def test_a_reader_is_woken_once_a_report_with_all_of_its_tokens(tiny, monkeypatch):
    """The workers report their steps a few at a time; the job's reader (the server's stream) is
    woken once a report, when all of its tokens are in the queue, not once a token (a wake-up a
    token raced the reader, which then wrote one token at a time). Reports of a second: the 16
    tokens come in a report or two besides the first (chosen at the prefill)."""
    from models import batching

    monkeypatch.setattr(batching, "DRIVEN_REPORT_S", 1.0)
    monkeypatch.setattr(batching, "READER_WAKE_S", 0.0)
    _, woken = _wake_ups(tiny, 16, 32)
    assert 2 <= len(woken) <= 4, woken
    assert woken[0] == 1 and woken[-1] == 17, woken  # each wake-up after its report's last event


def test_a_readers_wake_ups_come_no_closer_than_the_bound_but_its_end_at_once(tiny, monkeypatch):
    """Reports every 5 ms, a reader woken at most once in READER_WAKE_S (here longer than the
    whole generation): woken for its first token (chosen at the prefill) and at its end, with
    every event in the queue by then, and not at the reports between. With no bound, woken at
    every report (the same run otherwise)."""
    from models import batching

    monkeypatch.setattr(batching, "DRIVEN_REPORT_S", 0.005)
    monkeypatch.setattr(batching, "READER_WAKE_S", 60.0)
    assert _wake_ups(tiny, 24, 48)[1] == [1, 25]
    monkeypatch.setattr(batching, "READER_WAKE_S", 0.0)
    assert len(_wake_ups(tiny, 24, 48)[1]) > 2


def test_a_job_that_ends_wakes_its_reader_while_the_others_go_on(tiny, monkeypatch):
    """Two jobs driven together, reader wake-ups bounded to one a minute: the 4-token job's end
    wakes its reader at the report that brings it, with all of its events, while the 40-token
    job still runs (its reader not woken since its first token)."""
    from models import batching

    monkeypatch.setattr(batching, "DRIVEN_REPORT_S", 0.005)
    monkeypatch.setattr(batching, "READER_WAKE_S", 60.0)
    dev = MetaDevice(SimulatedCluster(2))
    made = ContinuousBatcher(dev, tiny, slots=2, ctx=64, weights="f32")
    made.warm_up()
    long, short = made.submit(greedy(40)), made.submit(greedy(4))
    counts = {"long": _counted(long), "short": _counted(short)}
    woken_short: list[tuple[int, int]] = []  # (its events, the long job's) at each wake-up
    short.listen(lambda: woken_short.append((len(counts["short"]), len(counts["long"]))))
    made.start()
    try:
        assert len(events_of(short, 60)) == 5
        assert len(events_of(long, 60)) == 41
    finally:
        made.stop()
        dev.close()
    assert woken_short[-1][0] == 5 and woken_short[-1][1] < 41, woken_short


def test_a_gemma3_server_with_rings_gives_the_references_tokens_past_them(model, tmp_path, monkeypatch):
    """Gemma 3 with a window of 4 on layers 0 and 2, prefill steps of 16 tokens: those layers'
    caches are rings of 20 positions. A 30-token prompt goes in by chunks into slot 1 while a
    stream decodes in slot 0, then both decode on the workers to position 50: each job gets
    the NumPy reference's greedy tokens (its caches the whole context)."""
    import models.batching as batching
    import models.llama as llama

    monkeypatch.setattr(batching, "PREFILL_CHUNK", 16)
    monkeypatch.setattr(llama, "PREFILL_CHUNK", 16)
    shape = synthetic.Shape(layers=3, hidden=64, ffn=128, heads=2, kv_heads=1, context=64, head_size=32)
    recipe = synthetic.Recipe(shape, weights="f32", embedding="f32", seed=6, architecture="gemma3", window=4)
    recipe = dataclasses.replace(recipe, window_pattern=2)
    gemma = GGUFModel(synthetic.write(tmp_path / "g.gguf", recipe, model.path).path)
    ctx, long_prompt = 64, tuple(int(t) for t in np.random.default_rng(8).integers(0, 49152, 30))
    dev = MetaDevice(SimulatedCluster(2))
    made = ContinuousBatcher(dev, gemma, slots=2, ctx=ctx, weights="f32")
    try:
        assert [k.shape[2] for k in made.net.k] == [20, ctx, 20]
        made.warm_up()
        made.start()
        stream = made.submit(Job(PROMPT, 40, Sampling(), stop_at_eos=False))
        first = stream.next(TOLD_WITHIN)
        assert isinstance(first, Token)
        joining = made.submit(Job(long_prompt, 20, Sampling(), stop_at_eos=False))
        joined = [e.token for e in events_of(joining, 60) if isinstance(e, Token)]
        streamed = [first.token] + [e.token for e in events_of(stream, 60) if isinstance(e, Token)]
    finally:
        made.stop()
        dev.close()
    assert joined == reference_greedy(gemma, list(long_prompt), 20, ctx)
    assert streamed == reference_greedy(gemma, list(PROMPT), 40, ctx)
