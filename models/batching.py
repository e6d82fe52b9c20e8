"""Continuous batching: concurrent requests as the slots of one running batch (as vLLM and
llama-server run them).

    batcher = ContinuousBatcher(dev, GGUFModel(), slots=8, ctx=2048).start()
    ticket = batcher.submit(Job(prompt_ids, max_tokens=64, sampling=Sampling()))
    for event in ticket.stream(): ...        # Token(...), then one Finished(...)

The caches hold `slots` sequences (batch rows). One thread owns the device: between two decode
steps it admits queued jobs into the lowest free slots and prefills one chunk of PREFILL_CHUNK
prompt tokens (128) of the job admitted first whose prompt is not all in yet, into its own row
(`prefill(..., start, slot=...)`, the other rows untouched; chunks padded to a few lengths, each
a captured step serving every slot, the slot fed to it), then runs one captured decode step for
the first rows up to the highest slot that is decoding, rounded up to a power of two (1, 2, 4,
... slots: as vLLM pads a batch to its captured sizes), each row at its own position, and hands
each decoding slot its next token. So a long prompt joining (chunked prefill, as vLLM's) holds
the running streams up for one chunk at a time, not for its whole prefill, and a step's buffers
stay a chunk's size. One request alone costs a one-row step, not a step of every slot. A slot
whose job finished, was cancelled or whose client left is free for the next job at once. Rows
without a decoding job decode a dummy token where the next prompt (or chunk) placed there
overwrites it: at position 0 of a free row, at the next chunk's first position of a row still
prefilling. A
row's tokens do not depend on the other rows: a greedy job gives the same tokens alone and in a
full batch.

Every job draws from its own generator (its seed), so a sampled job is reproducible too. The
decode step proposes POOL candidates per row; a job's top_k cuts them further.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from meta.device import MetaDevice
from models.errors import ModelError
from models.gguf_model import GGUFModel
from models.llama import PREFILL_CHUNK
from models.loading import place_model
from models.requests import POOL, Sampling, Stopping, candidates, log_normalizer
from split_state.errors import ConsistencyError, MetaError, TransportError, WorkerLost
from split_state.sampling import choose

TOKEN_SECONDS = 120.0  # a job waiting longer than this for its next token gives up (no hang)


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling = Sampling()
    stop_strings: tuple[str, ...] = ()
    stop_at_eos: bool = True
    # None: no log-probabilities; else each token's, with this many of the likeliest alternatives'
    top_logprobs: int | None = None


@dataclass(frozen=True)
class Token:
    token: int
    # with a job's top_logprobs: log p of the token under the model (its logits before
    # temperature and penalties, over the whole vocabulary), and the likeliest (token, log p)
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (end of generation or a stop string), "length", "cancelled" or "error"
    error: str = ""


class Ticket:
    """A submitted job: its events, and `cancel` (the slot is freed before the next token)."""

    def __init__(self, job: Job):
        self.job = job
        self.events: queue.Queue[Token | Finished] = queue.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.first_token_s: float | None = None
        self._wake: Callable[[], None] | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, event: Token | Finished) -> None:
        """An event for the ticket's reader (from the batcher's thread), and its wake-up call."""
        self.events.put(event)
        wake = self._wake
        if wake is not None:
            wake()

    def listen(self, wake: Callable[[], None] | None) -> None:
        """`wake()` called after each event is put (None: no more): an event loop's reader waits
        for it rather than a thread of its own blocked on the queue (the server's requests, all
        of them, queued ones too, polled on the event loop's few threads and held the running
        streams' events behind them)."""
        self._wake = wake

    def next(self, wait: float) -> Token | Finished | None:
        """The next event, or None when none came within `wait` seconds (the job goes on)."""
        try:
            return self.events.get(timeout=wait)
        except queue.Empty:
            return None

    def stream(self, timeout: float = TOKEN_SECONDS) -> Iterator[Token | Finished]:
        """The events as they come, ending with the Finished one; a silence longer than
        `timeout` ends it with an error (and cancels the job)."""
        while True:
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                self.cancel()
                yield Finished("error", f"no token within {timeout:.0f} s")
                return
            yield event
            if isinstance(event, Finished):
                return


@dataclass
class _Slot:
    ticket: Ticket
    rng: np.random.Generator
    position: int  # where the next token's keys and values go
    pending: list[int]  # the prompt's tokens not prefilled yet: none once it decodes
    admitted: int  # the order it was admitted in: chunks go to the earliest first
    stopping: Stopping  # when its job ends
    tokens: list[int] = field(default_factory=list)


@dataclass
class Counters:
    """What /metrics reports."""

    requests: int = 0
    finished: dict[str, int] = field(default_factory=lambda: collections.Counter())
    prompt_tokens: int = 0
    generated_tokens: int = 0
    first_token_seconds: list[float] = field(default_factory=list)  # the last 1000
    decode_steps: int = 0
    decode_rows: int = 0  # summed over the steps: the rows each decoded (busy slots and padding)
    decode_seconds: float = 0.0


class ContinuousBatcher:
    def __init__(
        self,
        dev: MetaDevice,
        model: GGUFModel,
        slots: int = 8,
        ctx: int = 2048,
        weights: str = "native",
        cache_types: tuple[str, str] = ("f32", "f32"),
        activations: str = "q8",
    ):
        if slots < 1:
            raise ModelError(f"--max-slots {slots}: at least one")
        self.dev, self.model, self.ctx = dev, model, ctx
        self.net = place_model(dev, model, ctx, slots, weights, cache_types, activations=activations)
        self.tokenizer = model.tokenizer
        self.stop_ids = frozenset(model.end_of_generation)
        self.slots: list[_Slot | None] = [None] * slots
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.counters = Counters()
        self.lost: str = ""  # why the cluster can no longer serve, once it cannot
        self._wake = threading.Condition()
        self._stopping = False
        # (rows, with the normalizer) -> the captured decode step of the first rows
        self._decodes: dict[tuple[int, bool], object] = {}
        self._admitted = 0  # jobs admitted so far
        self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)

    # -- the requests' side -------------------------------------------------------------------------

    def warm_up(self) -> int:
        """Load, without running, the steps requests run: the slots' prefill step of every
        padded prompt length up to a chunk (the slot is fed: one step serves them all), and the
        decode steps of 1, 2, 4, ... rows, so the first requests plan nothing (as vLLM captures its
        batch sizes at start). Before start(): the batcher's thread owns the device after it.
        Returns how many steps were loaded."""
        if self._thread.is_alive():
            raise RuntimeError("warm_up() goes before start(): the batcher's thread owns the device")
        loaded = self.net.warm_up(POOL, slots=True)
        rows = 1
        while True:
            if (rows, False) not in self._decodes:
                self._decodes[rows, False] = self.net.prepare_decode(rows, build=candidates(POOL))
                loaded += 1
            if rows >= len(self.slots):
                return loaded
            rows = min(len(self.slots), rows * 2)

    def start(self) -> ContinuousBatcher:
        self._thread.start()
        return self

    def submit(self, job: Job) -> Ticket:
        if self.lost:
            raise WorkerLost(f"the cluster is lost: {self.lost}")
        if not job.prompt:
            raise ModelError("an empty prompt: give at least one token of text")
        if job.max_tokens < 1:
            raise ModelError(f"max_tokens {job.max_tokens}: at least 1")
        if len(job.prompt) >= self.ctx:
            raise ModelError(f"a prompt of {len(job.prompt)} tokens does not fit the context of {self.ctx} tokens")
        vocab = self.model.config.vocab
        bad = next((t for t in job.prompt if type(t) is not int or not 0 <= t < vocab), None)
        if bad is not None:  # refused here: on the workers it would fail the prefill of a slot
            raise ModelError(f"token id {bad!r} is not in the vocabulary [0, {vocab})")
        ticket = Ticket(job)
        with self._wake:
            self.waiting.append(ticket)
            self.counters.requests += 1
            self._wake.notify()
        return ticket

    def active(self) -> int:
        return sum(s is not None for s in self.slots)

    def lose(self, why: str) -> None:
        """The cluster can no longer serve (a server's health check found it): every job waiting
        or running is told at once, later ones are refused."""
        with self._wake:
            self.lost = self.lost or why
            self._stopping = True
            self._wake.notify()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what waits or runs and stop the loop (the cluster stays open)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.ident is not None:  # never started: nothing to wait for
            self._thread.join(timeout)

    # -- the device's side ----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stopping and not self.waiting and not self.active():
                        self._wake.wait(1.0)
                    if self._stopping:
                        break
                self._admit()
                self._prefill_chunk()
                self._step()
        except Exception as exc:  # noqa: BLE001 - the cluster failed, or this loop did: every job is told,
            # later ones refused (a request's own error never comes here: _admit and _take fail that job alone)
            self.lost = f"{type(exc).__name__}: {exc}"
        finally:
            reason = ("error", self.lost) if self.lost else ("cancelled", "the server is stopping")
            for slot in self.slots:
                if slot is not None:
                    slot.ticket.put(Finished(*reason))
            with self._wake:
                while self.waiting:
                    self.waiting.popleft().put(Finished(*reason))
            self.slots = [None] * len(self.slots)

    def _admit(self) -> None:
        """Queued jobs into the free slots; their prompts go in by chunks (_prefill_chunk)."""
        for index, slot in enumerate(self.slots):
            if slot is not None:
                continue
            with self._wake:
                ticket = self.waiting.popleft() if self.waiting else None
            if ticket is None:
                return
            if ticket.cancelled.is_set():
                self._finish(index, ticket, "cancelled")
                continue
            job = ticket.job
            self._admitted += 1
            rng = np.random.default_rng(job.sampling.seed)
            ends = self.stop_ids if job.stop_at_eos else frozenset()
            stopping = Stopping(ends, tuple(job.stop_strings), job.max_tokens)
            self.slots[index] = _Slot(ticket, rng, 0, list(job.prompt), self._admitted, stopping)

    def _prefill_chunk(self) -> None:
        """One chunk of the prompt admitted first among those not all in; its last chunk gives
        the job its first token."""
        waiting = [(s.admitted, i) for i, s in enumerate(self.slots) if s is not None and s.pending]
        if not waiting:
            return
        index = min(waiting)[1]
        slot = self.slots[index]
        ticket = slot.ticket
        if ticket.cancelled.is_set():
            self._finish(index, ticket, "cancelled")
            return
        chunk = slot.pending[:PREFILL_CHUNK]
        # the last chunk of a job asking for log-probabilities brings the whole logits (for the
        # normalizer of its first token's)
        logits = ticket.job.top_logprobs is not None and len(chunk) == len(slot.pending)
        # POOL candidates whatever the job's sampling, cut to its pool when chosen (as a decode
        # step's are): one prefill step per length serves every slot and request
        try:
            values, indices, *whole = self.net.prefill([chunk], slot.position, POOL, logits=logits, slot=index)
        except (TransportError, ConsistencyError) as exc:  # the cluster's failure: the job is told now
            ticket.put(Finished("error", f"{type(exc).__name__}: {exc}"))
            raise
        except MetaError as exc:  # this prompt's own failure (a worker refused it): this job alone
            self._finish(index, ticket, "error", f"{type(exc).__name__}: {exc}")
            return
        self.counters.prompt_tokens += len(chunk)
        slot.position += len(chunk)
        del slot.pending[: len(chunk)]
        if not slot.pending:
            normalizer = log_normalizer(whole[0].numpy()[0, 0]) if logits else None
            self._take(index, values.numpy()[0, 0], indices.numpy()[0, 0], normalizer)

    def _decoding(self, slot: _Slot | None) -> bool:
        return slot is not None and not slot.pending

    def _step(self) -> None:
        if not any(self._decoding(s) for s in self.slots):
            return
        rows = self._rows()
        # a row without a decoding job decodes a dummy token (the module docstring says where)
        tokens, positions = np.zeros((rows, 1), np.int32), np.zeros((rows, 1), np.int32)
        for index, slot in enumerate(self.slots[:rows]):
            if slot is not None:
                tokens[index, 0] = slot.tokens[-1] if self._decoding(slot) else 0
                positions[index, 0] = slot.position
        # a step with a job asking for log-probabilities also sums each row's distribution
        mass = any(self._decoding(s) and s.ticket.job.top_logprobs is not None for s in self.slots[:rows])
        start = time.perf_counter()
        decode = self._decodes.get((rows, mass))
        if decode is None:
            build = candidates(POOL, mass)
            self._decodes[rows, mass], (values, indices, *rest) = self.net.capture_decode(
                tokens, positions, build=build
            )
        else:
            values, indices, *rest = decode(tokens, positions, read=(0, 1, 2)[: 2 + mass])  # back with the run
        v, i = values.numpy(), indices.numpy()
        sums = rest[0].numpy().astype(np.float64) if mass else None
        self.counters.decode_steps += 1
        self.counters.decode_rows += rows
        self.counters.decode_seconds += time.perf_counter() - start
        for index, slot in enumerate(self.slots[:rows]):
            if self._decoding(slot):
                slot.position += 1
                # log sum exp of the row's logits: its best, and the sum of exp(logit - best)
                normalizer = float(v[index, 0, 0]) + float(np.log(sums[index, 0])) if mass else None
                self._take(index, v[index, 0], i[index, 0], normalizer)

    def _rows(self) -> int:
        """The rows the next decode step runs: up to the highest decoding slot, rounded up to a
        power of two (at most every slot), so a handful of captured steps serve every mix of slots."""
        highest = max(index for index, slot in enumerate(self.slots) if self._decoding(slot))
        return min(len(self.slots), 1 << highest.bit_length())

    def _take(self, index: int, values: np.ndarray, indices: np.ndarray, normalizer: float | None) -> None:
        """Slot `index`'s next token from its POOL candidates (best first; its job's sampling
        chooses among the first `pool`), handed to its job; the slot is freed when the job is
        done. `normalizer`: the row's log sum exp, where the job asks for log-probabilities."""
        slot = self.slots[index]
        ticket, job = slot.ticket, slot.ticket.job
        if ticket.cancelled.is_set():
            self._finish(index, ticket, "cancelled")
            return
        s, n = job.sampling, job.sampling.penalized
        recent = [*job.prompt[-n:], *slot.tokens[-n:]][-n:] if n else ()
        try:
            token = choose(values[: s.pool], indices[: s.pool], s.rule, slot.rng, recent)
        except (ValueError, FloatingPointError) as exc:  # this job's sampling failed (its logits): it alone ends
            self._finish(index, ticket, "error", f"sampling failed: {exc}")
            return
        slot.tokens.append(token)
        if ticket.first_token_s is None:
            ticket.first_token_s = time.perf_counter() - ticket.submitted
            self.counters.first_token_seconds = self.counters.first_token_seconds[-999:] + [ticket.first_token_s]
        self.counters.generated_tokens += 1
        if job.top_logprobs is None or normalizer is None:
            ticket.put(Token(token))
        else:
            chosen = float(values[int(np.flatnonzero(indices == token)[0])]) - normalizer
            top = tuple((int(t), float(v) - normalizer) for v, t in zip(values[: job.top_logprobs], indices))
            ticket.put(Token(token, chosen, top))
        reason = slot.stopping.reason(slot.tokens, lambda: self._text(slot), room=slot.position < self.ctx)
        if reason is not None:
            self._finish(index, ticket, reason)

    def _text(self, slot) -> str:
        return self.tokenizer.decode(slot.tokens, continuation=True)  # a generation's: its first space kept

    def _finish(self, index: int, ticket: Ticket, reason: str, error: str = "") -> None:
        self.slots[index] = None
        self.counters.finished[reason] += 1
        ticket.put(Finished(reason, error))
