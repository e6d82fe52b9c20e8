"""Generation driven by the workers: the decode loop of a Generate message, run on every rank.

Each step runs the captured decode program, reads the candidate (value, index) pairs it left
Mirrored (bitwise identical on every rank), and chooses each sequence's next token with the same
seeded generator on every rank, so all ranks feed back the same tokens with no message between
them. Only the decision to stop early (a Cancel seen by rank 0) must be shared: rank 0 sends it
to its peers every step over the data plane, a one-byte message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from split_state.errors import ProtocolError
from transport import protocol as p
from transport.deadline import Deadline

STOP_TAG = 1 << 30  # the step tag of rank 0's stop flag: no program has that many steps


def choose(values: np.ndarray, indices: np.ndarray, temperature: float, top_p: float, rng) -> int:
    """The next token from a sequence's candidates, best first: greedy at temperature 0, else a
    draw from their softmax at `temperature`, cut to the smallest prefix whose probability
    reaches `top_p`."""
    if temperature == 0:
        return int(indices[0])
    keep = values.astype(np.float64) / temperature
    probs = np.exp(keep - keep.max())
    probs /= probs.sum()
    if top_p < 1:
        cut = int(np.searchsorted(np.cumsum(probs), top_p)) + 1
        probs = probs[:cut] / probs[:cut].sum()
    return int(indices[rng.choice(len(probs), p=probs)])


def generator_state(rng: np.random.Generator) -> list[str]:
    """A PCG64 generator's exact state as strings (its counters exceed 64 bits)."""
    state = rng.bit_generator.state
    return [str(state["state"]["state"]), str(state["state"]["inc"]), str(state["has_uint32"]), str(state["uinteger"])]


def restore_generator(fields: Sequence[str]) -> np.random.Generator:
    try:
        bits = np.random.PCG64()
        bits.state = {
            "bit_generator": "PCG64",
            "state": {"state": int(fields[0]), "inc": int(fields[1])},
            "has_uint32": int(fields[2]),
            "uinteger": int(fields[3]),
        }
    except (ValueError, TypeError, IndexError) as exc:
        raise ProtocolError(f"generate: a malformed generator state ({exc})") from None
    return np.random.Generator(bits)


def run_generation(
    server,
    m: p.Generate,
    emit: Callable[[p.Message], None],
    cancelled: Callable[[], bool],
) -> p.Message:
    """The loop of one Generate on this worker; the reply says how many steps ran."""
    executor, store, backend = server.executor, server.store, server.backend
    sampling = m.sampling
    done = [bool(d) for d in sampling["done"]]
    stop = {int(t) for t in sampling["stop"]}
    temperature, top_p = float(sampling["temperature"]), float(sampling["top_p"])
    rng = restore_generator(sampling["rng"])
    tokens, positions = store.get(m.tokens), store.get(m.positions)
    count = len(done)
    if tokens.shape[0] < count or positions.shape[0] < count:
        raise ProtocolError(f"generate: {count} sequences, but the fed tokens hold {tokens.shape[0]}")
    comm, rank = executor.comm, server.rank
    peers = [d for d in range(server.world_size) if d != rank]
    timings = {"program_s": 0.0, "comm_s": 0.0}
    steps = 0
    cancel = False
    filled = executor.input_slots(m.program, m.inputs)  # the same arrays every step
    for step in range(m.steps):
        run = m.run + step
        t = executor.run(m.program, run, m.inputs, m.outputs, filled=filled)
        timings["program_s"] += t["program_s"]
        timings["comm_s"] += t["comm_s"]
        values = backend.to_host(store.get(m.values))
        indices = backend.to_host(store.get(m.indices))
        chosen = [choose(values[b, 0], indices[b, 0], temperature, top_p, rng) for b in range(count)]
        for b, token in enumerate(chosen):
            done[b] = done[b] or token in stop
        steps += 1
        finished = all(done) or step == m.steps - 1
        if rank == 0:
            cancel = not finished and cancelled()
            emit(p.Tokens(step, chosen))
            for d in peers:
                comm.send(d, run, STOP_TAG, np.array([finished or cancel], np.int8))
            if peers:
                comm.flush(run, Deadline(executor.collective_timeout))
        else:
            cancel = _stop_flag(comm, run, executor.collective_timeout) and not finished
        if finished or cancel:
            break
        tokens[:count, 0] = chosen  # the program reads these arrays again: written in place
        positions[:count, 0] += 1
    return p.Ok({"steps": steps, "cancelled": cancel, **timings})


def _stop_flag(comm, run: int, timeout: float) -> bool:
    flag = np.zeros(1, np.int8)

    def sink(at: int, fragment) -> None:
        flag[at : at + len(fragment)] = fragment

    comm.receive(0, run, STOP_TAG, Deadline(timeout), (1,), np.dtype(np.int8), sink)
    return bool(flag[0])
