"""The completion server's error paths on its app alone (models/openai_server.py build_app), over
a stand-in batcher whose tickets play out a script: a lost cluster, the silence timer, the body
bound of a chunked body, a crowd of waiting requests beside a running one. And the cluster's
health check, which the server's watcher reads."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import types

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from models import batching, openai_server, openai_serving  # noqa: E402
from models.batching import Finished, Token  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class ScriptedTicket:
    """A ticket whose events are `script`'s items in turn; None is a wait with nothing (the full
    timeout), as the batcher's ticket gives while no token comes."""

    def __init__(self, script, job):
        self.script, self.cancelled = list(script), False
        self.job, self.cached_tokens = job, 0

    def next(self, timeout: float):
        return self.script.pop(0) if self.script else None

    def listen(self, wake):  # never woken: each None is a wait of the whole poll
        pass

    def cancel(self):
        self.cancelled = True


class StandInBatcher:
    def __init__(self, script=(), lost: str = ""):
        self.ctx, self.lost, self.slots, self.waiting = 8, lost, [None], []
        self.script, self.tickets = script, []
        self.model = types.SimpleNamespace(config=types.SimpleNamespace(vocab=100), longest_token_bytes=1)
        self.tokenizer = types.SimpleNamespace(decode=lambda ids, **_: "x" * len(ids))  # a character a token

    def active(self) -> int:
        return 0

    def submit(self, job):
        self.tickets.append(ScriptedTicket(self.script, job))
        return self.tickets[-1]


def app_over(batcher, health=lambda: ""):
    return TestClient(openai_server.build_app(batcher, "m", health=health))


def test_a_lost_cluster_answers_503_with_an_openai_body_and_says_why_on_health():
    why = "worker 1 (pid 42) exited with code 0"
    client = app_over(StandInBatcher(), health=lambda: why)
    reply = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_error"
    assert why in reply.json()["error"]["message"]
    health = client.get("/health")
    assert health.status_code == 503 and health.json() == {"status": "error", "error": why}


def test_the_silence_timer_starts_again_at_each_token(monkeypatch):
    """A generation may pause between tokens (other slots' prefill); only a silence of the whole
    bound in a row fails it: here tokens come after 2 empty waits each, 5 times, the bound being
    3 waits: it must finish, though its pauses add up to more than the bound."""
    monkeypatch.setattr(openai_serving, "EVENT_POLL_SECONDS", 0.02)
    monkeypatch.setattr(batching, "TOKEN_SECONDS", 0.06)
    script = [None, None, Token(5)] * 5 + [Finished("length")]
    reply = app_over(StandInBatcher(script)).post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 5})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == "xxxxx"
    silent = [None] * 4 + [Token(5), Finished("length")]
    reply = app_over(StandInBatcher(silent)).post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 5})
    assert reply.status_code == 503 and "no token within" in reply.json()["error"]["message"]


class StillThere:
    """A request whose client stays."""

    async def is_disconnected(self) -> bool:
        return False


def test_a_crowd_of_waiting_requests_does_not_hold_back_a_running_streams_token():
    """40 requests waiting for a slot (their tickets silent) and one running: a token the batcher
    puts on the running one's ticket reaches its reader at once. (Each waiting request's reader
    once held one of the event loop's few worker threads for a poll of 0.25 s, and the running
    stream's token waited behind them: up to seconds with 56 queued.)"""
    serving = openai_serving.CompletionServing(StandInBatcher(), "m", None)

    async def scenario() -> tuple[Token, float]:
        crowd = [asyncio.ensure_future(anext(serving._events(batching.Ticket(None), StillThere()))) for _ in range(40)]
        running = batching.Ticket(None)
        first = asyncio.ensure_future(anext(serving._events(running, StillThere())))
        await asyncio.sleep(0.6)  # every reader in its wait, twice over
        start = time.monotonic()
        threading.Thread(target=running.put, args=(Token(7),)).start()  # as the batcher's thread puts it
        event = await asyncio.wait_for(first, 5)
        took = time.monotonic() - start
        for reader in crowd:
            reader.cancel()
        await asyncio.gather(*crowd, return_exceptions=True)
        return event, took

    event, took = asyncio.run(scenario())
    assert event == Token(7)
    assert took < 0.1, f"the running stream's token took {took:.3f} s to reach its reader"


def test_a_chunked_body_is_cut_at_the_bound_as_a_declared_one_is():
    """No Content-Length (chunked): the bound (what 8 tokens of at most 1 byte could be, as JSON,
    plus the other fields' room) is counted as the body arrives, and the request refused there."""
    bound = 6 * 8 * 1 + (64 << 10)

    def chunks():
        yield b'{"prompt": "'
        for _ in range(bound // 1000 + 2):
            yield b"a" * 1000
        yield b'"}'

    reply = app_over(StandInBatcher()).post("/v1/completions", content=chunks())
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "the prompt is longer than a context of 8 tokens could hold"


def test_health_sees_a_worker_that_exited_with_code_0(fresh_cluster):
    """An orderly exit is a lost worker all the same: the cluster cannot serve without it."""
    cluster = fresh_cluster(2)
    assert cluster.health() == ""
    worker = cluster.processes[1]
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(30)
    cluster.processes[1] = done
    try:
        assert cluster.health() == f"worker 1 (pid {done.pid}) exited with code 0"
    finally:
        cluster.processes[1] = worker
