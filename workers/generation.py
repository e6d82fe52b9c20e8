"""Generation driven by the workers: the decode loop of a Generate message, run on every rank.

Each step runs the captured decode program, which leaves the candidate (value, index) pairs
Mirrored (bitwise identical on every rank), and each sequence's next token is chosen by the same
rule (split_state/sampling.py) with the same seeded generator on every rank, so all ranks feed
back the same tokens with no message between them: one rule and generator for every sequence
(LLM.generate), or each sequence its own rule, generator and pool (`own`: a server's batch of
jobs), whose generators' states the reply gives back. On a backend with a device sampler (CUDA:
workers/backends/cuda/kernels/sample.py) the choice runs on the device, which writes the token and position
the next step reads, and the host reads only the chosen ids; elsewhere the host reads the
candidates, chooses, and writes the fed tokens back. With the device sampler and no peers the
loop issues step s + 1 before it waits for step s's ids (the reply's `issued_ahead` counts
them), so the host's work between tokens overlaps the device's. Rank 0 reports the tokens to the
coordinator (`Reports`): on the coordinator's token board (transport/board.py) where it can map
it, each step as it comes with no message, the first step also in a Tokens message at once (the
coordinator reads the board when it wakes); else in Tokens messages, the first at once, later
ones gathered for `report_s` seconds (by default transport.protocol.REPORT_SECONDS). Only the
decision to stop early (a Cancel seen by rank 0) must be shared: rank 0 tells its peers after
every step, and they read it one step later. So no rank waits for it (the step between has
all-reduces that bring its sender's data after it), and a cancel stops every rank after the step
following the one that saw it: within a token, as a cancel on one worker does. After the first
step it is a one-byte message over the data plane, which also says whether rank 0 can store into
the peer's memory (a peer on its host, the shm plane's inbox file: `Inbox.stop_word`); if so,
after later steps it is a store of 2 * run + cancel into that word, which the peer reads after
`run`: two word accesses a token instead of a message each way (~20 us on each side on a 2-core
machine).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from split_state.errors import ProtocolError, TransportError, WorkerLost
from split_state.sampling import Rule, choose, generator_state, mass_normalizer, restore_generator, scored
from transport import protocol as p
from transport.board import TokenBoard
from transport.deadline import Deadline

STOP_TAG = 1 << 30  # the step tag of rank 0's stop flag: no program has that many steps
WORD_SPIN = 1000  # reads of the stop word before a peer waits between reads (it is there at once)


def run_generation(
    server,
    m: p.Generate,
    emit: Callable[[p.Message], None],
    cancelled: Callable[[], bool],
) -> p.Message:
    """The loop of one Generate on this worker; the reply says how many steps ran."""
    executor, store, backend = server.executor, server.store, server.backend
    sampling = m.sampling  # checked as it was decoded (transport.protocol.GenerateSettings)
    done, stop, rule = list(sampling.done), set(sampling.stop), sampling.rule
    rng = restore_generator(sampling.rng)
    choosers = choosers_of(sampling, rng)
    recent = [
        collections.deque(r, maxlen=c.rule.penalized) for r, c in zip(sampling.recent or [()] * len(done), choosers)
    ]
    interval = sampling.report_s
    tokens, positions = store.get(m.tokens), store.get(m.positions)
    count = len(done)
    if tokens.shape[0] < count or positions.shape[0] < count:
        raise ProtocolError(f"generate: {count} sequences, but the fed tokens hold {tokens.shape[0]}")
    rank = server.rank
    peers = [d for d in range(server.world_size) if d != rank]
    stops = _StopFlags(executor.comm, rank, peers, executor.collective_timeout)
    timings = {"program_s": 0.0, "comm_s": 0.0, "wait_s": 0.0}
    steps = 0
    cancel = False
    run_step = executor.repeated(m.program, m.run, m.inputs, m.outputs, runs=m.steps)  # checked and bound once
    board = attached_board(sampling.board, count) if rank == 0 and not sampling.logprobs else None
    report = Reports(emit, interval, board, executor.collective_timeout)
    if board is not None:  # the coordinator writes the board's cancel word when it sends a Cancel
        cancelled = board.is_cancelled
    # the program reads these again each step: written in place (a host array moved to the device
    # explicitly: CuPy takes only a scalar or a device array on assignment)
    fed_tokens, fed_positions = tokens[:count, 0], positions[:count, 0]
    # on a GPU the tokens are chosen there and written where the next step reads them
    # (workers/backends/cuda/kernels/sample.py); the host reads only the chosen ids
    # (the device sampler takes one rule for every sequence: a server's batch, each job with a
    # rule of its own, chooses on the host)
    # (nor a generation reporting log-probabilities: they are worked out from the candidates on
    # the host)
    wanted = sampling.logprobs
    make_sampler = None if sampling.own or wanted else getattr(backend, "device_sampler", None)
    sampler = None
    # with the sampler on the device and no peers, step s + 1 is issued before step s's tokens
    # are waited for (its inputs are written on the device): the host's work between tokens
    # (reports, stop checks, the executor's issuing) overlaps the device's next step. A
    # generation that ends early has issued one step more, whose tokens nobody reads; with
    # peers every rank must run the same steps, which the stop flags decide a step late: no.
    ahead = None  # step s + 1's tokens, issued
    issued_ahead = 0  # steps issued before the tokens of the step before were read

    def issue(step: int, wait: bool):
        t = run_step(m.run + step, wait)
        timings["program_s"] += t["program_s"]
        timings["comm_s"] += t["comm_s"]
        timings["wait_s"] += t.get("wait_s", 0.0)
        return store.get(m.values), store.get(m.indices)  # fresh arrays each run

    try:
        for step in range(m.steps):
            run = m.run + step
            if ahead is not None:
                pending, ahead = ahead, None
            else:
                values, indices = issue(step, sampler is None)  # a sampler's tokens are waited for
                if step == 0 and make_sampler is not None:  # the step's results exist once it ran
                    sampler = make_sampler(rule, rng, m.steps, recent, values, indices, fed_tokens, fed_positions)
                pending = sampler.launch(step, values, indices) if sampler is not None else None
            if pending is not None:
                if not peers and not cancel and step + 1 < m.steps:
                    ahead = sampler.launch(step + 1, *issue(step + 1, False))
                    issued_ahead += 1
                waited = time.perf_counter()
                chosen = pending()
                timings["program_s"] += time.perf_counter() - waited
            else:
                values, indices = backend.to_host(values), backend.to_host(indices)
                chosen = [
                    choose(values[b, 0, : c.pool], indices[b, 0, : c.pool], c.rule, c.rng, recent[b])
                    for b, c in enumerate(choosers[:count])
                ]
                if wanted and rank == 0:
                    mass = backend.to_host(store.get(m.sums))
                    report.logprobs(log_probabilities(values, indices, mass, chosen, wanted))
                for b, token in enumerate(chosen):
                    recent[b].append(token)
            done = [d or token in stop for d, token in zip(done, chosen)]
            steps += 1
            finished = all(done) or step == m.steps - 1
            if rank == 0:
                report.add(step, chosen, final=cancel or finished)
                if cancel or finished:  # a cancel decided a step ago: the peers learn of it after this step
                    break
                cancel = cancelled()
                if cancel and not peers:  # nobody to tell: stop now
                    report.send()
                    break
                stops.tell(step, run, cancel)
            else:
                cancel = stops.heard(step, run)
                if finished or cancel:
                    break
            if sampler is None:
                fed_tokens[...] = backend.to_device(np.asarray(chosen, tokens.dtype))
                fed_positions += 1
        if ahead is not None:  # a step issued past the end: done before the reply
            backend.synchronize()
    finally:
        if board is not None:
            board.close()
    info = {"steps": steps, "cancelled": cancel, "issued_ahead": issued_ahead, **timings}
    if sampling.own:  # where each sequence's generator stands: its job goes on from there
        info["generators"] = [generator_state(c.rng) for c in choosers]
    return p.Ok(info)


@dataclass(frozen=True)
class _Chooser:
    rule: Rule
    rng: np.random.Generator
    pool: int | None  # the first `pool` candidates; None: all of them


def choosers_of(sampling: p.GenerateSettings, shared: np.random.Generator) -> list[_Chooser]:
    """Each sequence's rule, generator and pool: its own (`own`), or the shared rule over every
    candidate with the one generator, drawn from in sequence order."""
    if sampling.own:
        return [_Chooser(c.rule, restore_generator(c.rng), c.pool) for c in sampling.own]
    return [_Chooser(sampling.rule, shared, None)] * len(sampling.done)


def log_probabilities(values, indices, mass, chosen: list[int], wanted: tuple[int, ...]) -> np.ndarray:
    """A step's log-probabilities, as Tokens.logprobs holds them: per sequence b that asked
    (wanted[b] >= 0), its chosen token's and its best wanted[b] (token, log-probability) pairs,
    from the step's candidates (values, indices: best first) and its row's mass (the sum of
    exp(logit - best)), as the coordinator's own steps work them out (split_state.sampling)."""
    out = np.full((len(wanted), 1 + 2 * max(0, *wanted)), np.nan)
    for b, top in enumerate(wanted):
        if top >= 0:
            normalizer = mass_normalizer(values[b, 0, 0], mass[b, 0])
            out[b, 0], pairs = scored(values[b, 0], indices[b, 0], chosen[b], normalizer, top)
            out[b, 1 : 1 + 2 * top] = np.ravel(pairs)
    return out


class Reports:
    """Rank 0's reports of the chosen tokens. On a token board, every step as it comes (a store
    to shared memory), and the first step also in a Tokens message, so the coordinator shows it
    at once. Else in Tokens messages: the first step's at once, later steps gathered until
    `interval` seconds have passed since the last message (or the generation ends). A message
    costs the worker ~0.1-0.3 ms on a 2-core machine (waking ZeroMQ's threads and the
    coordinator's), a tenth of a decode step there; reports of 20 a second read as smoothly as
    one per token."""

    def __init__(self, emit: Callable[[p.Message], None], interval: float, board: TokenBoard | None, timeout: float):
        self.emit, self.interval, self.board, self.timeout = emit, interval, board, timeout
        self.first, self.steps = 0, []
        self.rows: list[np.ndarray] = []  # the steps' log-probabilities, where asked for (no board then)
        self.sent_at = -math.inf

    def logprobs(self, rows: np.ndarray) -> None:
        """The log-probabilities of the step whose tokens `add` takes next."""
        self.rows.append(rows)

    def add(self, step: int, chosen: list[int], final: bool) -> None:
        if self.board is not None:
            self.board.publish(chosen, self.timeout)
            if step == 0:
                self.emit(p.Tokens(0, [chosen]))
            return
        if not self.steps:
            self.first = step
        self.steps.append(chosen)
        if final or time.monotonic() - self.sent_at >= self.interval:
            self.send()

    def send(self) -> None:
        if self.steps:
            if self.rows:
                self.emit(p.Tokens(self.first, self.steps, np.stack(self.rows)))
            else:
                self.emit(p.Tokens(self.first, self.steps))
            self.steps, self.rows = [], []
            self.sent_at = time.monotonic()


def attached_board(path, count: int) -> TokenBoard | None:
    """The coordinator's token board, or None: none offered, or not one this worker can map (its
    coordinator on another host): then the tokens go in Tokens messages."""
    if not path:
        return None
    try:
        board = TokenBoard.attach(str(path), count)
    except TransportError:
        return None
    # both sides have it mapped now: the name goes, so a coordinator killed before its close
    # leaves no file behind
    board.path.unlink(missing_ok=True)
    return board


class _StopFlags:
    """Rank 0's decision to stop early, told to its peers a step late (the module docstring): a
    one-byte message after the first step, which also says whether rank 0 can store into the
    peer's stop word; then a store of 2 * run + cancel into that word after each step, or
    another message where it cannot."""

    def __init__(self, comm, rank: int, peers: list[int], timeout: float):
        self.comm, self.rank, self.peers, self.timeout = comm, rank, peers, timeout
        # rank 0: the peers' stop words it stores into (None: it sends messages); a peer: its
        # own, cleared before the first step. Where every step exchanges data with rank 0 (a
        # decoder's all-reduces), rank 0 has stored a run's word before the peer reads it, so a
        # word left by an earlier MetaDevice (whose run ids also began at 1) is never read; the
        # clear keeps it so for a step without an exchange. It cannot erase this generation's
        # first store: rank 0 makes it after the second step, which it finishes only with the
        # peer's data, sent after the clear.
        self.words = {d: comm.stop_word(d) for d in peers} if rank == 0 else {}
        self.own_word = comm.own_stop_word() if rank else None
        if self.own_word is not None:
            self.own_word[0] = 0
        self.use_word = False  # a peer: whether rank 0 said it stores into own_word after the first step

    def tell(self, step: int, run: int, cancel: bool) -> None:
        """Rank 0, after `step` (run id `run`): the word for the step after it, under that step's
        run id (the inbox keeps the next run's messages). A peer reads it after that step, by
        when it has long arrived, so no rank waits on it."""
        sent = False
        for d in self.peers:
            word = self.words[d]
            if step and word is not None:
                word[0] = 2 * (run + 1) + cancel
            else:  # the first step's word also says whether words follow
                self.comm.send(d, run + 1, STOP_TAG, np.array([cancel, word is not None], np.int8))
                sent = True
        if sent:
            self.comm.flush(run, Deadline(self.timeout))

    def heard(self, step: int, run: int) -> bool:
        """A peer, after `step` (run id `run`): whether rank 0 decided to stop after the step
        before (nothing is told before the first step's end)."""
        if step == 1 or (step and not self.use_word):
            cancel, said = self._message(run)
            if step == 1:
                self.use_word = said and self.own_word is not None
            return cancel
        return self._word(run) if step else False

    def _message(self, run: int) -> tuple[bool, bool]:
        """Rank 0's message after the step before `run`: (cancel, whether words follow)."""
        flag = np.zeros(2, np.int8)

        def sink(at: int, fragment) -> None:
            flag[at : at + len(fragment)] = fragment

        self.comm.receive(0, run, STOP_TAG, Deadline(self.timeout), (2,), np.dtype(np.int8), sink)
        return bool(flag[0]), bool(flag[1])

    def _word(self, run: int) -> bool:
        """Whether rank 0 stored a cancel for `run` into this peer's stop word; it waits until
        rank 0 has stored for `run` (at once, in practice: rank 0 stored it before the step just
        run, whose all-reduces needed its data). A later run's word means rank 0 went on: no
        cancel."""
        deadline = None
        reads = 0
        while True:
            value = self.own_word[0]
            if value >> 1 >= run:
                return value >> 1 == run and bool(value & 1)
            reads += 1
            if reads > WORD_SPIN:
                deadline = deadline or Deadline(self.timeout)
                if deadline.expired():
                    raise WorkerLost(
                        f"worker {self.rank}: no stop word from worker 0 for run {run} within {self.timeout:.1f} s",
                        rank=0,
                    )
                time.sleep(50e-6)
