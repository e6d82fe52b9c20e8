"""A worker's request handler: state (backend, store, programs) and one reply per message.

The same handler serves a real worker process and a simulated device, so both behave alike.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable

import numpy as np

from split_state.errors import ProtocolError, SplitError
from split_state.layout import local_shape
from transport import protocol as p
from transport.deadline import Deadline
from workers.executor import Executor
from workers.generation import run_generation
from workers.pipelined import run_pipelined
from workers.store import TensorStore

BUDGET_SHARE = 0.9  # of the device's memory, when the coordinator sets no budget
# A worker's kernels get ready (numba's loops loaded: workers/main.py) while the coordinator
# connects; weights past the first few MiB wait for them, once: loading the loops touches
# ~45 MiB of the compiler's code, handed back when they are loaded (numba_cpu.prepare), and
# weights stored meanwhile put both in the worker's peak resident set. SmolLM2-135M Q4_K_M on one
# worker, warm cache: its load ended inside the preparation, peak 306 MiB; waiting, 269.
# Tests' small tensors never wait; a cold cache (minutes of compiling) is waited for at most
# KERNELS_WAIT_S, then the weights go on arriving beside it.
KERNELS_BEFORE_BYTES = 8 << 20
KERNELS_WAIT_S = 60.0


class WorkerServer:
    def __init__(self, rank: int, backend, connect: Callable[[p.Configure], object], collective_timeout: float = 30.0):
        self.rank = rank
        self.backend = backend
        self.connect = connect  # builds the comm to the peers named in Configure
        total = backend.info().memory_total
        self.store = TensorStore(int(total * BUDGET_SHARE) if total else 1 << 40)
        self.executor = Executor(backend, self.store, collective_timeout)
        self.world_size = 0
        self.stopping = False
        self.refused = ""  # why the coordinator would not have this worker, once it said so
        self.runs = 0
        self.kernels_awaited = False  # whether a Put waited for the kernels (KERNELS_BEFORE_BYTES)
        # how a Generate reports tokens to the coordinator and learns of a Cancel between steps:
        # set by the process (its control socket) or the simulator (its queues)
        self.emit: Callable[[p.Message], None] = lambda message: None
        self.cancelled: Callable[[], bool] = lambda: False

    def handle(self, message: p.Message) -> p.Message:
        handler = HANDLERS.get(type(message))
        if handler is None:
            raise ProtocolError(f"a worker does not accept {type(message).__name__} messages")
        return handler(self, message)

    def _on_configure(self, m: p.Configure) -> p.Message:
        if m.world_size != len(m.peers) or not 0 <= self.rank < m.world_size:
            raise ProtocolError(f"configure: world size {m.world_size} with {len(m.peers)} peers, rank {self.rank}")
        self.world_size = m.world_size
        if m.memory_budget:
            self.store.budget = m.memory_budget
        comm = self.connect(m)
        self.executor.attach(comm)
        return p.Ok({"data_plane": comm.plane, "note": getattr(comm, "note", "")})

    def _on_put(self, m: p.Put) -> p.Message:
        self._require_configured()
        expected = local_shape(m.state, m.shape, self.world_size, self.rank)
        if tuple(m.array.shape) != expected:
            raise SplitError(
                f"tensor {m.tensor}: worker {self.rank} got a slice of shape {tuple(m.array.shape)}, "
                f"{m.state} of {tuple(m.shape)} on {self.world_size} devices needs {expected}"
            )
        if not self.kernels_awaited and self.store.used + m.array.nbytes >= KERNELS_BEFORE_BYTES:
            self.kernels_awaited = True
            self.executor.await_kernels(KERNELS_WAIT_S)
        keep = getattr(self.backend, "resident", None)  # (optional: workers/backends/__init__.py)
        self.store.put(m.tensor, keep(m.array) if keep else self.backend.to_device(np.array(m.array, copy=True)))
        return p.Ok()

    def _on_get(self, m: p.Get) -> p.Message:
        return p.Tensor(m.tensor, self.backend.to_host(self.store.get(m.tensor)))

    def _on_free(self, m: p.Free) -> p.Message:
        self.executor.free(m.tensors)
        return p.Ok()

    def _on_load_program(self, m: p.LoadProgram) -> p.Message:
        self.executor.load(m.program, m.steps, m.outputs)
        return p.Ok()

    def _on_unload(self, m: p.Unload) -> p.Message:
        for program in m.programs:
            self.executor.unload(program)
        return p.Ok()

    def _on_run_program(self, m: p.RunProgram) -> p.Message:
        return self._run_all(m, [(m.program, m.run, m.inputs, m.outputs, ())])

    def _on_run_chain(self, m: p.RunChain) -> p.Message:
        frees = m.frees or [()] * len(m.programs)
        # every worker goes through the chain's runs without waiting for the others between
        # them, so any of its runs may be under way elsewhere while this worker waits in one (a
        # layer group's next chunk or lane, while the next group's workers all-reduce among
        # themselves in this one): their data is kept for them, not dropped as stale
        with self.executor.comm.runs_in_flight(len(m.runs)):
            return self._run_all(m, list(zip(m.programs, m.runs, m.inputs, m.outputs, frees)))

    def _run_all(self, m: p.RunProgram | p.RunChain, runs: list[tuple]) -> p.Message:
        """The runs (program, run id, inputs, outputs, tensors freed after it) of a RunProgram
        (one) or a RunChain in order, after its releases and feeds; the reply carries the
        account (summed over the runs) and the values read."""
        start = time.perf_counter()
        self._require_configured()
        self.executor.comm.forget_aborts()
        self.executor.free(m.release)
        for feed in m.feeds:
            self.store.put(feed.tensor, self.backend.to_device(p.unpack_array(feed, m.feed_data)))
        if len(runs) != 1 and not set(m.read) <= {t for run in runs for _, t in run[3]}:
            raise ProtocolError(f"chain of runs {m.runs}: it reads tensors {sorted(set(m.read))}, not all its outputs")
        timings: dict = {}
        ran: set[int] = set()  # the chain's programs run so far: their next runs read the same data
        new_data = set(m.new_data) if isinstance(m, p.RunChain) else set()
        for at, (program, run, inputs, outputs, dropped) in enumerate(runs):
            if at in new_data:  # another chunk of a prompt: what kernels found from its data is found anew
                ran.clear()
            self.runs += 1
            read = m.read if len(runs) == 1 else [t for _, t in outputs if t in m.read]
            again = program in ran
            ran.add(program)
            got = self.executor.run(program, run, inputs, outputs, bool(m.profile), read=read, same_data=again)
            timings = got if not timings else {k: _summed(v, got.get(k)) for k, v in timings.items()}
            if dropped:
                self.executor.free(dropped)
        if not m.read:
            timings["handled_s"] = time.perf_counter() - start  # the program plus releases, feeds, storing
            return p.Ok(timings)
        values, data = p.pack_arrays({t: self.backend.to_host(self.store.get(t)) for t in m.read})
        timings["handled_s"] = time.perf_counter() - start  # and the values read back
        return p.Ran(timings, values, data)

    def _on_generate(self, m: p.Generate) -> p.Message:
        self._require_configured()
        self.executor.comm.forget_aborts()
        for feed in m.feeds:
            self.store.put(feed.tensor, self.backend.to_device(p.unpack_array(feed, m.feed_data)))
        self.runs += 1
        if m.lanes:
            return run_pipelined(self, m, self.emit, self.cancelled)
        return run_generation(self, m, self.emit, self.cancelled)

    def _on_resync(self, m: p.Resync) -> p.Message:
        self._require_configured()
        comm = self.executor.comm
        comm.forget_aborts()  # the failed run's aborts are not this exchange's
        comm.resync(m.run, Deadline(self.executor.collective_timeout))
        return p.Ok()

    def _on_nccl_id(self, m: p.NcclId) -> p.Message:
        from workers.planes.nccl.engine import make_unique_id

        return p.Ok({"nccl_id": make_unique_id().hex()})

    def _on_stats(self, m: p.Stats) -> p.Message:
        rss = _rss_kib()
        info = {
            "rank": self.rank,
            "tensors": len(self.store.tensors),
            "used": self.store.used,
            "in_flight": self.store.transient,
            "arena": self.store.arena,
            "budget": self.store.budget,
            "programs": len(self.executor.programs),
            "runs": self.runs,
            "graphs": self.executor.graph_counts(),
            # False while the loops still load or compile in the background (their thread holds
            # the GIL for seconds: timings taken meanwhile are not the worker's own)
            "kernels_prepared": self.executor.kernels_prepared,
            "data_plane": self.executor.comm.plane if self.world_size else "",
            "routes": self.executor.comm.routes() if self.world_size else {},
            "max_rss_kib": max(_peak_rss_kib(), rss),  # read apart: the peak may trail a page
            "rss_kib": rss,
        }
        memory = getattr(self.backend, "memory", None)
        if memory is not None:  # a GPU's: what the worker holds there
            info["device_memory"] = memory()
        return p.Ok(info)

    def _on_heartbeat(self, m: p.Heartbeat) -> p.Message:
        return p.Ok()

    def _on_shutdown(self, m: p.Shutdown) -> p.Message:
        self.stopping = True
        return p.Ok()

    def _on_refused(self, m: p.Error) -> p.Message:
        """The coordinator will not have this worker (a rank taken, a key for another rank):
        stop, keeping the reason for the exit line."""
        self.stopping, self.refused = True, m.message
        return p.Ok()

    def _require_configured(self) -> None:
        if not self.world_size:
            raise ProtocolError(f"worker {self.rank} is not configured yet (no Configure message)")


def _summed(a, b):
    """Two runs' account of one quantity: times add up, anything else is the first run's."""
    return a + b if type(a) is float and type(b) is float else a


def _rss_kib() -> int:
    """This process's resident set now (Linux), 0 where /proc is not there."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * (resource.getpagesize() // 1024)
    except OSError:
        return 0


def _peak_rss_kib() -> int:
    """This process's peak resident set. Linux's VmHWM, not getrusage's ru_maxrss: that one
    survives exec, so a worker spawned by a coordinator holding 400 MiB reported a 400 MiB peak
    before it had loaded anything (bench/llm.py's peak column showed the coordinator's size)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# The messages a worker serves on its control socket, and the handler of each.
HANDLERS: dict[type, Callable[[WorkerServer, p.Message], p.Message]] = {
    p.Configure: WorkerServer._on_configure,
    p.Put: WorkerServer._on_put,
    p.Get: WorkerServer._on_get,
    p.Free: WorkerServer._on_free,
    p.LoadProgram: WorkerServer._on_load_program,
    p.RunProgram: WorkerServer._on_run_program,
    p.RunChain: WorkerServer._on_run_chain,
    p.Generate: WorkerServer._on_generate,
    p.Cancel: lambda server, m: p.Ok(),  # came after its Generate ended: nothing to stop
    p.Unload: WorkerServer._on_unload,
    p.Stats: WorkerServer._on_stats,
    p.NcclId: WorkerServer._on_nccl_id,
    p.Resync: WorkerServer._on_resync,
    p.Heartbeat: WorkerServer._on_heartbeat,
    p.Shutdown: WorkerServer._on_shutdown,
    p.Error: WorkerServer._on_refused,
}
