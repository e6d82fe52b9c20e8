"""A pipelined generation: a Generate with lanes (transport.protocol.Generate.lanes), run on
every rank.

Where the layers are on groups of the workers (a layer split), one decode step keeps one group
busy at a time: the first group's layers, then the next group's, each waiting for the one before
and, inside the step, for the last group's candidates. So the rows go in lanes, each a program of
its own over its rows of the caches (models.llama.TensorParallelLlama.lanes), taken in turn, and
a lane's candidates stay on the head's group: there one worker (the Generate's `reporter`)
chooses each lane's tokens, reports them, and sends every other rank the lane's tokens and
whether to stop. The others read that message only before the lane's next step, so while the last
group works on lane 0's step s the first group runs lane 1's step s, and then lane 0's step s + 1:
what vLLM's and llama.cpp's pipeline parallelism do with micro-batches. Every rank runs the same
lane steps: a lane ends where all of its sequences are done (every rank sees the same tokens) or
the steps are used up; a cancel the reporter sees before it sends the first message of a step
ends every lane after that step.

Lane k's step s runs as run `run + s * lanes + k`, so run ids rise in the order every rank takes
the lanes, and a lane's tokens travel under the id of the lane's step that reads them; a worker
may then be waiting in one run while a peer sends for a run up to a step of every lane ahead, so
the data plane keeps `lookahead` runs in flight meanwhile (workers/comm.py).

What the reporter does with the candidates is workers/generation.py's: the same rules,
generators (one shared, drawn from in sequence order step by step as there, or each sequence's
own), log-probabilities and reports; the coordinator takes the generators' states from its reply.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from split_state.errors import ProtocolError
from split_state.sampling import choose, generator_state, restore_generator
from transport import protocol as p
from transport.deadline import Deadline
from workers.generation import STOP_TAG, Reports, attached_board, choosers_of, log_probabilities

TOKENS_TAG = STOP_TAG  # the step tag of a lane's tokens message: no program has that many steps


@dataclass(frozen=True)
class Lane:
    """One lane of a pipelined Generate: its program, bindings and stored tensors, and the
    sequences it decodes (`first` .. `first + rows`)."""

    program: int
    inputs: list
    outputs: list
    tokens: int
    positions: int
    values: int
    indices: int
    sums: int
    first: int
    rows: int


def lanes_of(m: p.Generate, world_size: int) -> list[Lane]:
    """The Generate's lanes, lane 0 its own program; each checked against the sequences."""
    if len(m.lane_inputs) != len(m.lanes) or len(m.lane_outputs) != len(m.lanes):
        raise ProtocolError(
            f"generate: {len(m.lanes)} lanes with {len(m.lane_inputs)} inputs and {len(m.lane_outputs)} outputs"
        )
    if not 0 <= m.reporter < world_size:
        raise ProtocolError(f"generate: reporter {m.reporter} of {world_size} workers")
    count = len(m.sampling.done)
    for entry in m.lanes:
        if len(entry) != len(p.LANE_FIELDS) or entry[-1] < 1:
            raise ProtocolError(f"generate: a lane is {', '.join(p.LANE_FIELDS)} (1 row or more), got {entry}")
    first = count - sum(entry[-1] for entry in m.lanes)
    if first < 1:
        raise ProtocolError(f"generate: lanes of {count - first} rows for {count} sequences")
    out = [Lane(m.program, m.inputs, m.outputs, m.tokens, m.positions, m.values, m.indices, m.sums, 0, first)]
    for entry, inputs, outputs in zip(m.lanes, m.lane_inputs, m.lane_outputs):
        program, tokens, positions, values, indices, sums, rows = entry
        out.append(Lane(program, inputs, outputs, tokens, positions, values, indices, sums, first, rows))
        first += rows
    return out


def run_pipelined(
    server,
    m: p.Generate,
    emit: Callable[[p.Message], None],
    cancelled: Callable[[], bool],
) -> p.Message:
    """The loop of one pipelined Generate on this worker; the reply says how many steps ran."""
    executor, store, backend, comm = server.executor, server.store, server.backend, server.executor.comm
    lanes = lanes_of(m, server.world_size)
    count, width = len(m.sampling.done), len(lanes)
    sampling = m.sampling
    done, stop = list(sampling.done), set(sampling.stop)
    choosers = choosers_of(sampling, restore_generator(sampling.rng))
    recent = [collections.deque(r, maxlen=c.rule.penalized) for r, c in zip(sampling.recent or [()] * count, choosers)]
    wanted = sampling.logprobs
    reporting = server.rank == m.reporter
    others = [d for d in range(server.world_size) if d != m.reporter]
    timeout = executor.collective_timeout
    fed = []
    for lane in lanes:
        tokens, positions = store.get(lane.tokens), store.get(lane.positions)
        if tokens.shape[0] < lane.rows or positions.shape[0] < lane.rows:
            raise ProtocolError(f"generate: a lane of {lane.rows} sequences, but its fed tokens hold {tokens.shape[0]}")
        fed.append((tokens[: lane.rows, 0], positions[: lane.rows, 0], tokens.dtype))
    runners = [
        executor.repeated(lane.program, m.run + k, lane.inputs, lane.outputs, runs=m.steps)
        for k, lane in enumerate(lanes)
    ]
    board = attached_board(sampling.board, count) if reporting and not wanted else None
    report = Reports(emit, sampling.report_s, board, timeout)
    if board is not None:
        cancelled = board.is_cancelled
    timings = {"program_s": 0.0, "comm_s": 0.0, "wait_s": 0.0}
    latest = [0] * count  # each sequence's last token (a report's rows of a lane that ended)
    ended = [False] * width
    steps, cancel = 0, False
    try:
        with comm.runs_in_flight(2 * width):
            for step in range(m.steps):
                stopping = cancel  # the reporter's cancel of the step before ends every lane now
                asked = False  # whether the reporter has looked for a cancel in this step
                logprob_rows = []
                for k, lane in enumerate(lanes):
                    if ended[k]:
                        continue
                    rows = range(lane.first, lane.first + lane.rows)
                    run = m.run + step * width + k
                    if step:  # the lane's tokens of the step before: fed back, or the lane ends
                        if not reporting:  # (the flag in each of a step's messages is the same)
                            chosen, stopping = _receive(comm, m.reporter, run, lane.rows, timeout)
                            cancel = cancel or stopping
                            _record(chosen, rows, done, stop, latest)
                        if stopping or all(done[b] for b in rows):
                            ended[k] = True
                            continue
                        tokens, positions, dtype = fed[k]
                        tokens[...] = backend.to_device(np.asarray(latest[lane.first : lane.first + lane.rows], dtype))
                        positions += 1
                    t = runners[k](run)
                    for key in timings:
                        timings[key] += t.get(key, 0.0)
                    if not reporting:
                        continue
                    values, indices = backend.to_host(store.get(lane.values)), backend.to_host(store.get(lane.indices))
                    chosen = [
                        choose(values[j, 0, : c.pool], indices[j, 0, : c.pool], c.rule, c.rng, recent[b])
                        for j, (b, c) in enumerate(zip(rows, choosers[lane.first : lane.first + lane.rows]))
                    ]
                    for b, token in zip(rows, chosen):
                        recent[b].append(token)
                    if wanted:
                        mass = backend.to_host(store.get(lane.sums))
                        table = log_probabilities(values, indices, mass, chosen, wanted[rows.start : rows.stop])
                        logprob_rows.append((lane, table))
                    if not asked:  # before the step's first message, which says whether every lane stops after it
                        cancel, asked = cancel or cancelled(), True
                    _record(chosen, rows, done, stop, latest)
                    if step < m.steps - 1:  # under the run id of the lane's next step, which reads it
                        for d in others:
                            comm.send(d, run + width, TOKENS_TAG, np.array([*chosen, cancel], np.int32))
                        comm.flush(run, Deadline(timeout))
                if all(ended):
                    break
                steps += 1
                if reporting:
                    if wanted:
                        report.logprobs(_logprob_table(logprob_rows, wanted))
                    final = cancel or step == m.steps - 1 or all(done)
                    report.add(step, list(latest), final=final)
                if cancel:
                    break
    finally:
        if board is not None:
            board.close()
    info = {"steps": steps, "cancelled": cancel, "issued_ahead": 0, "lanes": width, **timings}
    if sampling.own and reporting:  # where each sequence's generator stands: its job goes on from there
        info["generators"] = [generator_state(c.rng) for c in choosers]
    return p.Ok(info)


def _record(chosen: list[int], rows: range, done: list[bool], stop: set[int], latest: list[int]) -> None:
    for b, token in zip(rows, chosen):
        latest[b] = token
        done[b] = done[b] or token in stop


def _receive(comm, reporter: int, run: int, rows: int, timeout: float) -> tuple[list[int], bool]:
    """A lane's tokens from the reporter for its step of run `run` (chosen in the step before:
    sent under this run's id, so every rank reads its messages in the order of their runs), and
    whether every lane stops after that step."""
    got = np.zeros(rows + 1, np.int32)

    def sink(at: int, fragment) -> None:
        got[at : at + len(fragment)] = fragment

    comm.receive(reporter, run, TOKENS_TAG, Deadline(timeout), (rows + 1,), np.dtype(np.int32), sink)
    return [int(t) for t in got[:rows]], bool(got[rows])


def _logprob_table(rows_by_lane: list[tuple[Lane, np.ndarray]], wanted: tuple[int, ...]) -> np.ndarray:
    """A step's log-probabilities as Tokens.logprobs holds them (one row a sequence), from each
    lane's rows (NaN for a lane that ended)."""
    out = np.full((len(wanted), 1 + 2 * max(0, *wanted)), np.nan)
    for lane, table in rows_by_lane:
        out[lane.first : lane.first + lane.rows, : table.shape[1]] = table
    return out
