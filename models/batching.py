"""Continuous batching: concurrent requests as the slots of one running batch (as vLLM and
llama-server run them).

    batcher = ContinuousBatcher(dev, GGUFModel(), slots=8, ctx=2048).start()
    ticket = batcher.submit(Job(prompt_ids, max_tokens=64, sampling=Sampling()))
    for event in ticket.stream(): ...        # Token(...), then one Finished(...)

The caches hold `slots` sequences (batch rows). One thread owns the device: between two decode
steps it admits queued jobs into the lowest free slots (or one whose caches hold a chunk more of
the prompt's beginning: `_place`) and prefills one chunk of PREFILL_CHUNK
prompt tokens (128) of the job admitted first whose prompt is not all in yet, into its own row
(`prefill(..., start, slot=...)`, the other rows untouched; chunks padded to a few lengths, each
a captured step serving every slot, the slot fed to it), with it the new prompts of the slots
after it that fit one step (`_joining`: requests that come together cost one pass over the
weights, not one each), then runs one captured decode step for
the first rows up to the highest slot that is decoding, rounded up to a power of two (1, 2, 4,
... slots: as vLLM pads a batch to its captured sizes), each row at its own position, and hands
each decoding slot its next token. So a long prompt joining (chunked prefill, as vLLM's) holds
the running streams up for one chunk at a time, not for its whole prefill, and a step's buffers
stay a chunk's size. One request alone costs a one-row step, not a step of every slot. A slot
whose job finished, was cancelled or whose client left is free for the next job at once. Rows
without a decoding job decode a dummy token where the next prompt (or chunk) placed there
overwrites it: past what a free row's caches hold, at the next chunk's first position of a row
still prefilling. A
row's tokens do not depend on the other rows: a greedy job gives the same tokens alone and in a
full batch.

Prompt caching (llama-server's cache_prompt, vLLM's prefix caching): a free row's caches keep
the prompt of the job that ran there, and a job whose prompt begins with it goes on from there
in whole chunks (net.kept_prefix): the rest goes in by the very chunks a whole prefill of it
takes, so its logits are the whole prefill's bit for bit, and a long conversation's next turn
costs at most a chunk more than its new tokens. Not the tokens fed back: a decode step's
attention sums in another order than a prefill's, and with 8-bit activations a prompt going on
from decoded positions moved logits by up to 0.2 (a greedy token changed in one of six turns);
nor a partial chunk (a step's attention path follows its length: from the cached prompt's end,
a 1-token rest moved them by 1e-5). A windowed layer's ring caches keep only what
net.reusable allows.

Between changes of the batch the workers drive the decode (`_drive`: MetaDevice.generate, as
LLM.generate's loop): they run the step, choose every running job's token with its own rule,
generator and pool, feed the tokens back and report them, the coordinator off the per-token
path; it hands each token to its job as it is reported, and cuts the workers' run short (after
the step under way) when a queued job can take a freed slot, every job has ended or the server
stops. Then each job's position, last token and generator go on from where the workers left
them, so a job gets the same tokens whichever side chose them. A job asking for
log-probabilities gets them from rank 0 beside its tokens (the step's third output, each row's
mass, Mirrored: workers/generation.py log_probabilities works them out as `_take` does, bit for
bit). A prompt going in by chunks takes the step-by-step path, the coordinator choosing. Where
the layers are on groups of the workers (a layer split), the rows decode in lanes, one a group,
each its own captured step, whose steps overlap (workers/pipelined.py): each group works on one
lane while the others work on theirs, as vLLM's pipeline parallelism runs micro-batches.

Every job draws from its own generator (its seed), so a sampled job is reproducible too. The
decode step proposes POOL candidates per row (one where every job in it is greedy); a job's
top_k cuts them further.
"""

from __future__ import annotations

import collections
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from meta.device import MetaDevice
from models.decode_steps import DecodeSteps
from models.errors import ModelError
from models.gguf_model import GGUFModel
from models.llama import PREFILL_CHUNK, padded_length
from models.loading import AUTO_CACHE, common_prefix, place_model
from models.requests import POOL, Sampling, Stopping, candidates, log_normalizer
from split_state.errors import ConsistencyError, MetaError, RemoteError, TransportError, WorkerLost
from split_state.sampling import Rule, choose, generator_state, mass_normalizer, restore_generator, scored
from transport.protocol import GenerateSettings, OwnChoice

TOKEN_SECONDS = 120.0  # a job waiting longer than this for its next token gives up (no hang)
# the most padded tokens of a prefill step taking several slots' new prompts: the running
# streams wait for the step, so it stays about two chunks (8 prompts of up to 24 tokens)
PREFILL_BATCH_TOKENS = 2 * PREFILL_CHUNK
# how often the coordinator looks for the tokens of steps the workers drive: a stream's tokens
# come at most this late, and a queued job's slot is seen free this soon
DRIVEN_REPORT_S = 0.02
# the least seconds between two wake-ups of a stream's reader while the workers drive the batch
# (its first token and its end wake it at once): a wake-up is a pass of the server's event loop,
# a chunk written and the client woken, ~0.7 ms of CPU between them; on a 2-core host whose cores
# the workers fill that time is theirs. Woken at each 20 ms report, the server and its client took
# 0.48-0.58 ms of CPU a token of one stream (~7 ms a token), 0.33-0.43 woken 20 times a second (as
# generate reports its tokens)
READER_WAKE_S = 0.05


# a free row of a step the workers drive: greedy over one candidate, its tokens nobody's
_DUMMY_ROW = OwnChoice(Rule(), tuple(generator_state(np.random.default_rng(0))), 1)


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling = Sampling()
    stop_strings: tuple[str, ...] = ()
    stop_at_eos: bool = True
    # None: no log-probabilities; else each token's, with this many of the likeliest alternatives'
    top_logprobs: int | None = None
    # whether its prompt may go on from what a free slot's caches hold (llama-server's
    # cache_prompt; the same bits either way, only the time differs)
    cache_prompt: bool = True


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
        self.cached_tokens = 0  # of its prompt, found in its slot's caches and not prefilled again
        self.woken_at = -math.inf  # time.monotonic() of the last wake-up call
        self._wake: Callable[[], None] | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, event: Token | Finished, wake: bool = True) -> None:
        """An event for the ticket's reader (from the batcher's thread), and its wake-up call
        unless `wake` is False (the caller wakes it later: `wake_reader`)."""
        self.events.put(event)
        if wake:
            self.wake_reader()

    def wake_reader(self) -> None:
        self.woken_at = time.monotonic()
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
    prompt_tokens: int = 0  # prefilled
    cached_prompt_tokens: int = 0  # found in a slot's caches (prompt caching), not prefilled
    generated_tokens: int = 0
    first_token_seconds: list[float] = field(default_factory=list)  # the last 1000
    decode_steps: int = 0
    decode_rows: int = 0  # summed over the steps: the rows each decoded (busy slots and padding)
    decode_seconds: float = 0.0
    prefill_steps: int = 0  # a step can take the prompts of several slots (_joining)


class ContinuousBatcher:
    def __init__(
        self,
        dev: MetaDevice,
        model: GGUFModel,
        slots: int = 8,
        ctx: int = 2048,
        weights: str = "native",
        cache_types: tuple[str, str] = (AUTO_CACHE, AUTO_CACHE),
        activations: str = "q8",
        drive_on_workers: bool = True,
        split: str = "row",
        layer_groups: int = 0,
        pipelined: bool = True,
    ):
        """`pipelined`: where the layers are on groups, the running rows decode in lanes, one a
        group, whose steps overlap (workers/pipelined.py); False: one step of every row."""
        if slots < 1:
            raise ModelError(f"--max-slots {slots}: at least one")
        self.dev, self.model, self.ctx = dev, model, ctx
        # whether running slots decode on the workers between changes of the batch (`_drive`),
        # else one step from here per token
        self.drive_on_workers = drive_on_workers
        self.net = place_model(
            dev,
            model,
            ctx,
            slots,
            weights,
            cache_types,
            activations=activations,
            split=split,
            layer_groups=layer_groups,
        )
        self.tokenizer = model.tokenizer
        self.stop_ids = frozenset(model.end_of_generation)
        self.slots: list[_Slot | None] = [None] * slots
        # the prompt a free row's caches hold (positions 0, 1, ...), kept for the next prompt that
        # begins with it (a conversation's next turn: _place); and one past the last position any
        # step wrote in each row (net.reusable)
        self.held: list[list[int]] = [[] for _ in range(slots)]
        self.reach = [0] * slots
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.counters = Counters()
        self.lost: str = ""  # why the cluster can no longer serve, once it cannot
        self._wake = threading.Condition()
        self._stopping = False
        self.pipelined = pipelined
        # each lane's decode step (`_lanes`: the first rows where there is one lane), by its kind:
        # (with the normalizer, candidates)
        self._decodes = DecodeSteps(self.net)
        self._admitted = 0  # jobs admitted so far
        # tickets given tokens of a report of the workers' steps not yet all delivered, their
        # readers woken once it is (None: outside a driven run, every event wakes its reader)
        self._unwoken: dict[Ticket, bool] | None = None  # tickets given events, not woken: whether ended
        self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)

    # -- the requests' side -------------------------------------------------------------------------

    def warm_up(self) -> int:
        """Load, without running, the steps requests run: the slots' prefill step of every
        padded prompt length up to a chunk, from position 0 and from further on (a later chunk,
        the rest of a prompt a slot's caches hold part of; the slot is fed: one step serves
        them all), and the decode steps of 1, 2, 4, ... rows (of POOL candidates, and of one
        for greedy batches), so the first requests plan nothing (as vLLM captures its batch
        sizes at start). Before
        start(): the batcher's thread owns the device after it. Returns how many steps were
        loaded."""
        if self._thread.is_alive():
            raise RuntimeError("warm_up() goes before start(): the batcher's thread owns the device")
        loaded = self.net.warm_up(POOL, slots=True)
        rows = 1
        while True:
            for pool in (POOL, 1):
                lanes = self._lanes(rows)
                build = self._candidates(pool, False, lanes)
                for lane in lanes:
                    loaded += self._decodes.prepare(lane, len(lanes), (False, pool), build)
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
        stops = job.stop_strings
        if not isinstance(stops, (tuple, list)) or not all(isinstance(t, str) and t for t in stops):
            # refused here: admitted, it would fail the batcher's loop and so every job
            raise ModelError(f"stop strings {stops!r}: give a sequence of non-empty strings")
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
                if not self._drive():
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
        """Queued jobs into the free slots (_place); their prompts go in by chunks (_prefill_chunk)."""
        while None in self.slots:
            with self._wake:
                ticket = self.waiting.popleft() if self.waiting else None
            if ticket is None:
                return
            if ticket.cancelled.is_set():
                self._finish(self.slots.index(None), ticket, "cancelled")
                continue
            job = ticket.job
            index, start = self._place(job)
            self._admitted += 1
            rng = np.random.default_rng(job.sampling.seed)
            ends = self.stop_ids if job.stop_at_eos else frozenset()
            stopping = Stopping(ends, tuple(job.stop_strings), job.max_tokens)
            self.slots[index] = _Slot(ticket, rng, start, list(job.prompt[start:]), self._admitted, stopping)
            self.held[index] = []  # the slot's job says what the row holds while it runs
            ticket.cached_tokens = start
            self.counters.cached_prompt_tokens += start

    def _place(self, job: Job) -> tuple[int, int]:
        """The free slot a job goes into and the position its prompt goes in from: the one
        whose caches hold the most of its prompt (as llama-server picks the slot of the longest
        common prefix), the lowest of those where none holds more. What is kept comes in whole
        chunks (_reusable), so a higher slot is taken for at least a chunk more: a decode step
        runs the rows up to the highest decoding slot (_rows), and a stream in a high slot costs
        its every step more rows, where a chunk of prompt costs one prefill step."""
        free = [i for i, slot in enumerate(self.slots) if slot is None]
        reused = {i: self._reusable(i, job) for i in free}
        index = max(free, key=lambda i: (reused[i], -i))
        return index, reused[index]

    def _reusable(self, index: int, job: Job) -> int:
        """How many of the job's first prompt tokens free row `index`'s caches hold and may be
        kept (net.kept_prefix: whole chunks, so its logits are a whole prefill's bit for bit);
        none where the job asks for a prefill of its whole prompt (cache_prompt false)."""
        if not job.cache_prompt:
            return 0
        common = common_prefix(self.held[index], job.prompt)
        return self.net.kept_prefix(common, len(job.prompt), self.reach[index])

    def _idle_at(self, index: int, steps: int) -> int:
        """Where free row `index`'s dummy tokens go in the next `steps` decode steps: past what
        its caches hold, so a next prompt may still go on from it (within the context: what
        they write over is no longer held)."""
        at = min(len(self.held[index]), self.ctx - steps)
        del self.held[index][at:]
        self.reach[index] = max(self.reach[index], at + steps)
        return at

    def _prefill_chunk(self) -> None:
        """One chunk of the prompt admitted first among those not all in, with the new prompts
        of the slots after it that go in the same step (`_joining`); a prompt's last chunk gives
        its job its first token. Prompts the workers refuse together go again one by one: only
        the one at fault fails."""
        waiting = [(s.admitted, i) for i, s in enumerate(self.slots) if s is not None and s.pending]
        if not waiting:
            return
        index = min(waiting)[1]
        slot = self.slots[index]
        if slot.ticket.cancelled.is_set():
            self._finish(index, slot.ticket, "cancelled")
            return
        group = self._joining(index)
        if not self._prefill(group):
            for i in group:
                self._prefill([i])

    def _prefill(self, group: list[int]) -> bool:
        """The next chunk of each slot of `group` (its first slot's prompt, or new prompts from
        position 0 in consecutive slots) in one prefill step; False where the workers refused the
        prompts of several slots (nothing is told then), a refused prompt alone fails its job."""
        slot = self.slots[group[0]]
        chunks = [self.slots[i].pending[:PREFILL_CHUNK] for i in group]
        # the last chunk of a job asking for log-probabilities brings the whole logits (for the
        # normalizer of its first token's); such a job goes in alone (_joining)
        logits = slot.ticket.job.top_logprobs is not None and len(chunks[0]) == len(slot.pending)
        # POOL candidates whatever the job's sampling, cut to its pool when chosen (as a decode
        # step's are): one prefill step per length (and slots) serves every slot and request
        lanes = self.pipelined and not logits and self.net.prefills_in_lanes(chunks, slot.position)
        reach = self.net.prefill_reach([len(chunk) for chunk in chunks], slot.position)  # padding included
        for i in group:
            self.reach[i] = max(self.reach[i], reach)
        try:
            if lanes:  # several new prompts on layer groups: in lanes, as they decode
                values, indices = self.net.prefill_in_lanes(chunks, POOL, first_row=group[0], slots=True)
            else:
                values, indices, *whole = self.net.prefill(chunks, slot.position, POOL, logits=logits, slot=group[0])
                values, indices = values.numpy(), indices.numpy()
        except (TransportError, ConsistencyError) as exc:  # the cluster's failure: the jobs are told now
            for i in group:
                self.slots[i].ticket.put(Finished("error", f"{type(exc).__name__}: {exc}"))
            raise
        except MetaError as exc:  # a prompt's own failure (a worker refused it): that job alone
            if len(group) > 1:
                return False
            self._finish(group[0], slot.ticket, "error", f"{type(exc).__name__}: {exc}")
            return True
        self.counters.prefill_steps += 1
        for row, (i, chunk) in enumerate(zip(group, chunks)):
            joined = self.slots[i]
            self.counters.prompt_tokens += len(chunk)
            joined.position += len(chunk)
            del joined.pending[: len(chunk)]
            if not joined.pending:
                normalizer = log_normalizer(whole[0].numpy()[row, 0]) if logits else None
                self._take(i, values[row, 0], indices[row, 0], normalizer)
        return True

    def _joining(self, index: int) -> list[int]:
        """Slot `index` and the slots after it whose new prompts go into the caches with its own
        in one prefill step: each a whole prompt from position 0 within a chunk, padded to the
        same length (a row's sums and attention are then those it gets alone, bit for bit: the
        products' and attention's paths follow the rows and tokens a step has), no
        log-probabilities asked, not cancelled; as many as keep the step within
        PREFILL_BATCH_TOKENS padded tokens (the running streams wait for it). Requests that
        come together (a burst, a client's parallel calls) then cost one pass over the weights,
        not one each with a decode step between (as vLLM batches its prefills)."""

        def fresh(slot: _Slot | None) -> bool:
            return (
                slot is not None
                and 0 < len(slot.pending) <= PREFILL_CHUNK
                and slot.position == 0
                and slot.ticket.job.top_logprobs is None
                and not slot.ticket.cancelled.is_set()
            )

        group, first = [index], self.slots[index]
        if not fresh(first):
            return group
        padded = padded_length(len(first.pending), self.ctx)
        for i in range(index + 1, len(self.slots)):
            slot = self.slots[i]
            if not fresh(slot) or padded_length(len(slot.pending), self.ctx) != padded:
                break
            if (len(group) + 1) * padded > PREFILL_BATCH_TOKENS:
                break
            group.append(i)
        return group

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
                self.reach[index] = max(self.reach[index], slot.position + 1)
            else:
                positions[index, 0] = self._idle_at(index, 1)
        # a step with a job asking for log-probabilities also sums each row's distribution
        mass = any(self._decoding(s) and s.ticket.job.top_logprobs is not None for s in self.slots[:rows])
        pool = self._pool(rows, mass)
        start = time.perf_counter()
        lanes = self._lanes(rows)
        got = []
        build, read = self._candidates(pool, mass, lanes), (0, 1, 2)[: 2 + mass]  # read: back with the run
        for lane in lanes:
            t, p = tokens[lane.start : lane.stop], positions[lane.start : lane.stop]
            values, indices, *rest = self._decodes.run(lane, len(lanes), (mass, pool), build, t, p, read)
            got.append((values.numpy(), indices.numpy(), rest[0].numpy() if mass else None))
        v, i = (np.concatenate([g[k] for g in got]) for k in (0, 1))
        sums = np.concatenate([g[2] for g in got]) if mass else None
        self.counters.decode_steps += 1
        self.counters.decode_rows += rows
        self.counters.decode_seconds += time.perf_counter() - start
        for index, slot in enumerate(self.slots[:rows]):
            if self._decoding(slot):
                slot.position += 1
                # log sum exp of the row's logits: its best, and the sum of exp(logit - best)
                normalizer = mass_normalizer(v[index, 0, 0], sums[index, 0]) if mass else None
                self._take(index, v[index, 0], i[index, 0], normalizer)

    def _drive(self) -> bool:
        """Decode the running slots on the workers (MetaDevice.generate: they choose each
        slot's token with its job's rule and generator, feed it back and report it) until the
        batch must change: a queued job can take a freed slot, every job has ended, the server
        stops. False where the batch cannot be left to the workers now (a prompt still going in
        by chunks, a decode step not captured yet): then the coordinator runs one step (`_step`).
        A job's tokens are those `_step` gives it; a job asking for log-probabilities gets them
        from the workers too (worked out as `_take` does)."""
        if not self.drive_on_workers or any(s is not None and s.pending for s in self.slots):
            return False
        decoding = [i for i, s in enumerate(self.slots) if self._decoding(s)]
        if not decoding or self._regroup():
            return False
        rows = self._rows()
        tops = [self.slots[i].ticket.job.top_logprobs if i in decoding else None for i in range(rows)]
        mass = any(top is not None for top in tops)
        lanes = self._lanes(rows)
        steps_of_lanes = self._steps(lanes, mass, self._pool(rows, mass))
        if None in steps_of_lanes:
            return False
        running = {i: self.slots[i] for i in decoding}
        # as many steps as the longest job wants, and the context of every row can take
        steps = min(
            min(self.ctx - s.position for s in running.values()),
            max(s.stopping.max_tokens - len(s.tokens) for s in running.values()),
        )
        tokens, positions = np.zeros((rows, 1), np.int32), np.zeros((rows, 1), np.int32)
        own = [_DUMMY_ROW] * rows  # a free row decodes a dummy token (the module docstring says where)
        recent: list[tuple[int, ...]] = [()] * rows
        for index in range(rows):
            if index not in running:
                positions[index, 0] = self._idle_at(index, steps)
        for index, slot in running.items():
            tokens[index, 0], positions[index, 0] = slot.tokens[-1], slot.position
            self.reach[index] = max(self.reach[index], slot.position + steps)  # its row goes on past its end
            s = slot.ticket.job.sampling
            own[index] = OwnChoice(s.rule, tuple(generator_state(slot.rng)), s.pool)
            recent[index] = self._recent(slot)
        ends = all(s.ticket.job.stop_at_eos for s in running.values())
        settings = GenerateSettings(
            Rule(),
            _DUMMY_ROW.rng,
            tuple(sorted(self.stop_ids)) if ends else (),
            tuple(i not in running for i in range(rows)),
            tuple(recent),
            DRIVEN_REPORT_S,
            own=tuple(own),
            logprobs=tuple(-1 if top is None else top for top in tops) if mass else (),
        )
        ran = 0
        reported: dict[int, np.ndarray] = {}  # a step's log-probabilities, until its tokens come

        def on_tokens(k: int, chosen: list[int]) -> bool:
            nonlocal ran
            ran += 1
            rows_of_step = reported.pop(k, None)
            for index, slot in running.items():
                if self.slots[index] is slot:  # else its job ended: the row's tokens are not its
                    slot.position += 1
                    top = tops[index]
                    if top is None or rows_of_step is None:
                        self._deliver(index, chosen[index])
                    else:
                        row = rows_of_step[index]
                        pairs = tuple((int(row[1 + 2 * j]), float(row[2 + 2 * j])) for j in range(top))
                        self._deliver(index, chosen[index], float(row[0]), pairs)
            return not self._regroup()

        start = time.perf_counter()
        self._unwoken = {}
        try:
            calls = [
                (step, tokens[lane.start : lane.stop], positions[lane.start : lane.stop])
                for step, lane in zip(steps_of_lanes, lanes)
            ]
            info = self.dev.generate(
                *calls[0],
                steps,
                settings,
                on_tokens,
                every_step=True,
                on_logprobs=reported.__setitem__,
                on_report=self._wake_readers,
                lanes=calls[1:],
            )
        except RemoteError:
            # a worker's own failure in a step (a job's logits not finite): the steps shown are
            # taken; the coordinator runs the next one, where the job it belongs to fails alone
            return False
        finally:
            self._wake_readers(every=True)
            self._unwoken = None
            self.counters.decode_steps += ran
            self.counters.decode_rows += rows * ran
            self.counters.decode_seconds += time.perf_counter() - start
        if ran != info["steps"]:
            raise ConsistencyError(f"the workers ran {info['steps']} decode steps, {ran} were reported")
        for index, slot in running.items():
            if self.slots[index] is slot:
                slot.rng = restore_generator(info["generators"][index])
        return True

    def _lanes(self, rows: int) -> list[range]:
        """The lanes a step of the first `rows` rows runs in: one where it is not pipelined."""
        return self.net.lanes(rows) if self.pipelined else [range(rows)]

    def _steps(self, lanes: list[range], mass: bool, pool: int) -> list:
        """Each lane's captured decode step, None where it is not captured yet."""
        return [self._decodes.get(lane, len(lanes), (mass, pool)) for lane in lanes]

    def _candidates(self, pool: int, mass: bool, lanes: list[range]):
        """A decode step's results: on every worker, or a lane's on the head's group."""
        return candidates(pool, mass, self.net.head_group if len(lanes) > 1 else None)

    def _pool(self, rows: int, mass: bool) -> int:
        """Candidates a decode step of the first `rows` proposes: one where every job decoding
        there takes the best (greedy, no penalty: `Sampling.pool`; ties go to the lower index
        either way, so its tokens are the same), else POOL."""
        pools = [s.ticket.job.sampling.pool for s in self.slots[:rows] if self._decoding(s)]
        return 1 if not mass and max(pools, default=1) == 1 else POOL

    def _regroup(self) -> bool:
        """Whether the running batch must change before its next step: the server stops, a
        queued job can take a free slot, or no slot decodes any more."""
        if self._stopping or not any(self._decoding(s) for s in self.slots):
            return True
        return bool(self.waiting) and any(s is None for s in self.slots)

    def _recent(self, slot: _Slot) -> tuple[int, ...]:
        """The tokens its job's repeat penalty lowers: the last repeat_last_n of its prompt and
        its tokens together, as llama.cpp's and the CLI's."""
        n = slot.ticket.job.sampling.penalized
        return tuple([*slot.ticket.job.prompt[-n:], *slot.tokens[-n:]][-n:]) if n else ()

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
        s = job.sampling
        try:
            token = choose(values[: s.pool], indices[: s.pool], s.rule, slot.rng, self._recent(slot))
        except (ValueError, FloatingPointError) as exc:  # this job's sampling failed (its logits): it alone ends
            self._finish(index, ticket, "error", f"sampling failed: {exc}")
            return
        if job.top_logprobs is None or normalizer is None:
            self._deliver(index, token)
        else:
            self._deliver(index, token, *scored(values, indices, token, normalizer, job.top_logprobs))

    def _deliver(self, index: int, token: int, logprob: float | None = None, top: tuple = ()) -> None:
        """Slot `index`'s next token (chosen here or by the workers) to its job; the slot is freed
        when the job is done."""
        slot = self.slots[index]
        ticket = slot.ticket
        if ticket.cancelled.is_set():
            self._finish(index, ticket, "cancelled")
            return
        slot.tokens.append(token)
        if ticket.first_token_s is None:
            ticket.first_token_s = time.perf_counter() - ticket.submitted
            self.counters.first_token_seconds = self.counters.first_token_seconds[-999:] + [ticket.first_token_s]
        self.counters.generated_tokens += 1
        self._put(ticket, Token(token, logprob, top))
        reason = slot.stopping.reason(slot.tokens, lambda: self._text(slot), room=slot.position < self.ctx)
        if reason is not None:
            self._finish(index, ticket, reason)

    def _text(self, slot) -> str:
        return self.tokenizer.decode(slot.tokens, continuation=True)  # a generation's: its first space kept

    def _finish(self, index: int, ticket: Ticket, reason: str, error: str = "") -> None:
        slot = self.slots[index]
        if slot is not None:  # the prompt its row's caches hold, as far as it went in (module docstring)
            self.held[index] = list(slot.ticket.job.prompt[: slot.position])
        self.slots[index] = None
        self.counters.finished[reason] += 1
        self._put(ticket, Finished(reason, error))

    def _put(self, ticket: Ticket, event: Token | Finished) -> None:
        """An event to its job; within a report of several steps its reader is woken at the
        report's end (`_wake_readers`): a wake-up a token raced the reader, which took one token
        a write while the rest were still coming, and on a host whose cores the workers fill
        each wake-up and write preempts one of them. A job's end wakes it at that report's end
        whenever its last wake-up was."""
        if self._unwoken is None:
            ticket.put(event)
        else:
            ticket.put(event, wake=False)
            self._unwoken[ticket] = self._unwoken.get(ticket, False) or isinstance(event, Finished)

    def _wake_readers(self, every: bool = False) -> None:
        """Wake the readers of the tickets given events since their last wake-up: each one's
        first token, end, or `every`, at once; the others READER_WAKE_S after their last one
        (the rest wait in the ticket for a later report)."""
        unwoken, self._unwoken = self._unwoken or {}, {}
        now = time.monotonic()
        for ticket, ended in unwoken.items():
            if every or ended or now - ticket.woken_at >= READER_WAKE_S:
                ticket.wake_reader()
            else:
                self._unwoken[ticket] = False
