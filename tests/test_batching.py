"""Continuous batching under faults (models/batching.py), on a tiny synthetic model with
SmolLM2's vocabulary over simulated devices: a request's own failure ends that request alone, a
failure of the loop or the cluster tells every waiting and running request at once (none waits
out a timer), and what submit refuses."""

from __future__ import annotations

import time

import pytest

from meta import MetaDevice
from models import synthetic
from models.batching import ContinuousBatcher, Finished, Job, Token
from models.generate import Sampling
from models.gguf_model import GGUFModel, ModelError
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
    ],
)
def test_submit_refuses_what_cannot_run(batcher, job, says):
    with pytest.raises(ModelError, match=says):
        batcher.submit(job)


def test_the_repeat_penalty_window_takes_the_prompts_end_with_the_tokens(batcher, monkeypatch):
    """A slot's penalized tokens are the last repeat_last_n of its prompt and its tokens
    together, as llama.cpp's and the CLI's are (worked out here from the job)."""
    import models.batching as batching

    windows = []
    real = batching.choose

    def choose(values, indices, rule, rng, recent=()):
        windows.append(list(recent))
        return real(values, indices, rule, rng, recent)

    monkeypatch.setattr(batching, "choose", choose)
    batcher.start()
    job = Job(PROMPT, 4, Sampling(repeat_penalty=1.3, repeat_last_n=7), stop_at_eos=False)
    tokens = [e.token for e in events_of(batcher.submit(job)) if isinstance(e, Token)]
    assert len(windows) == 4
    for step, window in enumerate(windows):
        assert window == [*PROMPT, *tokens[:step]][-7:]


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
