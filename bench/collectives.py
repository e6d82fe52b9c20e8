"""Collective latency and bandwidth on CPU workers, side by side with a raw pyzmq exchange and a
raw exchange over plain TCP sockets.

    python bench/collectives.py [--quick] [--json PATH] [--workers 2 4] [--data-plane zmq|tcp]
        [--transport ipc|tcp|curve]
    python bench/collectives.py --hosts [--json PATH]

Ours: a program of K all-reduces (Partial -> Mirrored) or all-gathers (even Split -> Mirrored) runs
on real worker processes; the time is the collective steps as the workers time them, divided by
K, so the coordinator's control round trip is not counted. It is taken on the worker that started
last, as after a barrier: the others' first step also waits for the coordinator to reach it. Raw: the
same number of processes, each PUSHing the same bytes to every peer over ipc and summing what
arrives (a direct all-reduce), K times; raw sockets: the same over one loopback TCP connection a
pair, non-blocking and read by a spinning process (the floor of the tcp plane). AR/raw compares
the all-reduce with the raw exchange of its own plane (sockets for tcp, pyzmq otherwise).
Bandwidth is algorithm bandwidth: tensor bytes / time.

--hosts: 2 hosts x 2 workers on the tcp plane, the hosts told apart by their loopback addresses
(127.0.0.1 and 127.0.0.2: the coordinator spawns ranks 0 and 1, ranks 2 and 3 join with
`launch.py worker --advertise 127.0.0.2`), the small all-reduce host by host with the step inside
each host through shared memory (the default), the same over TCP, and direct; beside its floor:
the raw socket exchange of one contribution (2 processes: what crosses between hosts each way
for a worker) plus the shared-memory all-reduce of 2 workers on the shm plane at twice the size
(a host's step: each worker's post holds its own contribution and the one it relays). All 4
workers share this machine's cores, which two real hosts would not.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import cli, free_port, human_bytes, reap, table  # noqa: E402
from meta import ClusterConfig, MetaDevice, ProcessCluster  # noqa: E402
from split_state import MIRRORED, PARTIAL, Split  # noqa: E402
from transport import protocol as p  # noqa: E402
from transport.environment import TCP_DIRECT_ENV, TCP_HOST_STEP_ENV  # noqa: E402
from transport.sockets import IpcDir  # noqa: E402


def timed(exchange, reps: int, trials: int) -> list[float]:
    """The time per call of `trials` loops of `reps` calls, after two to connect and warm up."""
    for _ in range(2):
        exchange()
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(reps):
            exchange()
        times.append((time.perf_counter() - start) / reps)
    return times


def raw_rank(rank: int, endpoints: list[str], nbytes: int, reps: int, trials: int, results: mp.Queue) -> None:
    """One raw process: every round, PUSH the buffer to each peer and sum one buffer from each;
    reports the time per round of each of `trials` loops of `reps` rounds."""
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(endpoints[rank])
    peers = {d: ctx.socket(zmq.PUSH) for d in range(len(endpoints)) if d != rank}
    for d, s in peers.items():
        s.connect(endpoints[d])
    data = np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32)
    pending: dict[int, list] = {d: [] for d in peers}  # per peer, in arrival order

    def exchange() -> None:
        for s in peers.values():
            s.send_multipart([bytes([rank]), data], copy=False)
        acc = data.copy()
        for d in sorted(peers):
            while not pending[d]:
                src, payload = inbox.recv_multipart(copy=False)
                pending[src.bytes[0]].append(payload)
            acc += np.frombuffer(pending[d].pop(0).buffer, dtype=np.float32)

    try:
        results.put((rank, timed(exchange, reps, trials)))
    finally:
        inbox.close(0)
        for s in peers.values():
            s.close(linger=5000)  # the last round may still be queued for a slower peer
        ctx.term()


def socket_rank(rank: int, ports: list[int], nbytes: int, reps: int, trials: int, results: mp.Queue) -> None:
    """One raw process over plain TCP: a connection to every peer (the higher rank dials), and
    every round each buffer sent to each peer and one summed from each, the sockets
    non-blocking and polled in a spin (sends and receives interleaved, so large buffers cannot
    deadlock). Reports as raw_rank does."""
    listener = socket.create_server(("127.0.0.1", ports[rank]))
    links: dict[int, socket.socket] = {}
    for d in range(rank):
        for _ in range(200):
            try:
                links[d] = socket.create_connection(("127.0.0.1", ports[d]))
                break
            except ConnectionRefusedError:
                time.sleep(0.05)
        links[d].sendall(bytes([rank]))
    while len(links) < len(ports) - 1:
        sock, _ = listener.accept()
        links[sock.recv(1)[0]] = sock
    listener.close()
    for sock in links.values():
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
    data = np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32)
    out = memoryview(data.view(np.uint8))
    inbound = {d: np.empty_like(data) for d in links}

    def exchange() -> None:
        sent = dict.fromkeys(links, 0)
        got = dict.fromkeys(links, 0)
        views = {d: memoryview(inbound[d].view(np.uint8)) for d in links}
        while any(v < nbytes for v in sent.values()) or any(v < nbytes for v in got.values()):
            for d, sock in links.items():
                try:
                    if sent[d] < nbytes:
                        sent[d] += sock.send(out[sent[d] :])
                except BlockingIOError:
                    pass
                try:
                    if got[d] < nbytes:
                        got[d] += sock.recv_into(views[d][got[d] :])
                except BlockingIOError:
                    pass
        acc = data.copy()
        for d in sorted(links):
            acc += inbound[d]

    try:
        results.put((rank, timed(exchange, reps, trials)))
    finally:
        for sock in links.values():
            sock.close()


def raw_all_reduce(n: int, nbytes: int, reps: int, trials: int = 1, tcp: bool = False, sockets: bool = False) -> float:
    """The median over `trials` loops of the time per direct exchange, on the slowest process
    (pyzmq over ipc, or with `tcp` over the loopback's tcp; with `sockets`, plain TCP sockets)."""
    ipc = IpcDir()
    if sockets:
        target, place = socket_rank, [free_port() for _ in range(n)]
    else:
        target = raw_rank
        place = [f"tcp://127.0.0.1:{free_port()}" if tcp else ipc.endpoint(f"raw{d}") for d in range(n)]
    results: mp.Queue = mp.get_context("spawn").Queue()
    procs = [
        mp.get_context("spawn").Process(target=target, args=(d, place, nbytes, reps, trials, results)) for d in range(n)
    ]
    for proc in procs:
        proc.start()
    try:
        try:
            per_rank = [results.get(timeout=120)[1] for _ in range(n)]
        except queue.Empty:
            raise TimeoutError(f"raw exchange of {nbytes} bytes on {n} processes did not finish") from None
        return float(np.median(np.max(per_rank, axis=0)))
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        ipc.close()


def wait_until_prepared(dev: MetaDevice, seconds: float = 600.0) -> None:
    """Until every worker has loaded (or compiled) its loops: the thread doing it holds the GIL
    for a second or more after a worker starts, and a collective timed meanwhile took 3-9x its
    time (4 KiB over zmq: 317-798 us, then 97-144)."""
    deadline = time.monotonic() + seconds
    while not all(s.get("kernels_prepared", True) for s in dev.stats().values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the workers' kernels were not ready within {seconds:.0f} s")
        time.sleep(0.1)


def ours(dev: MetaDevice, kind: str, nbytes: int, reps: int, trials: int) -> float:
    n, elems = dev.n, max(1, nbytes // 4)
    shape = (elems,)
    src = PARTIAL if kind == "all_reduce" else Split.even(0, elems, n)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    handle = dev.tensor(x, src)
    steps: list = []
    for k in range(reps):
        steps.append(p.MoveStep(0, k + 1, src, MIRRORED, shape, "float32"))
    program = 10_000 + hash((kind, nbytes)) % 10_000
    dev.cluster.call_all({d: p.LoadProgram(program, steps) for d in range(n)})
    best = []
    for trial in range(trials + 1):
        replies = dev.cluster.call_all(
            {
                d: p.RunProgram(program, 1_000_000 + trial * 1000 + program, [[0, handle.node.tensor]], [])
                for d in range(n)
            }
        )
        if trial:  # the worker that started last: the others' first step also waited for it to start
            best.append(min(r.info["comm_s"] for r in replies.values()) / reps)
    handle.free()
    return float(np.median(best))


# how the workers reach one another: (ClusterConfig's host and insecure, the raw exchange over tcp)
TRANSPORTS = {"ipc": ("", False, False), "tcp": ("127.0.0.1", True, True), "curve": ("127.0.0.1", False, True)}


def run(
    quick: bool, worker_counts: list[int], backend: str = "cpu", data_plane: str = "auto", transport: str = "ipc"
) -> list[dict]:
    """`transport`: ipc on this host; tcp over the loopback; curve: tcp with CURVE (the keys a
    tcp cluster makes for the workers it spawns)."""
    sizes = [4 << 10, 1 << 20, 4 << 20] if quick else [1 << 10, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    rows = []
    for n in worker_counts:
        host, insecure, raw_tcp = TRANSPORTS[transport]
        config = ClusterConfig(
            workers=n, backend=backend, devices=(0,) * n, data_plane=data_plane, host=host, insecure=insecure
        )
        with MetaDevice(ProcessCluster(config)) as dev:
            wait_until_prepared(dev)
            for nbytes in sizes:
                reps = 20 if nbytes <= 64 << 10 else 3 if nbytes <= (4 << 20) else 2
                trials = 3 if quick else 5
                row = {"workers": n, "bytes": nbytes}
                print(f"  {n} workers, {human_bytes(nbytes)} ...", file=sys.stderr, flush=True)
                for kind in ("all_reduce", "all_gather"):
                    seconds = ours(dev, kind, nbytes, reps, trials)
                    row[f"{kind}_us"] = seconds * 1e6
                    row[f"{kind}_GBps"] = nbytes / seconds / 1e9
                rows.append(row)
        for row in rows:
            if row["workers"] == n:
                reps = 200 if row["bytes"] <= 64 << 10 else 10
                seconds = raw_all_reduce(n, row["bytes"], reps, tcp=raw_tcp)
                row["raw_us"], row["raw_GBps"] = seconds * 1e6, row["bytes"] / seconds / 1e9
                seconds = raw_all_reduce(n, row["bytes"], reps, sockets=True)
                row["raw_sockets_us"], row["raw_sockets_GBps"] = seconds * 1e6, row["bytes"] / seconds / 1e9
                floor = "raw_sockets_GBps" if data_plane == "tcp" else "raw_GBps"
                row["ratio"] = row["all_reduce_GBps"] / row[floor]
    return rows


def _spin() -> None:
    while True:
        pass


def under_load(backend: str = "cpu", data_plane: str = "auto", nbytes: int = 4 << 10, runs: int = 7) -> list[dict]:
    """A small all-reduce, median of `runs` runs, ours and the raw exchange (plain sockets for
    the tcp plane, else pyzmq) in the same
    conditions: 2 workers on an idle machine, 2 workers beside a CPU-bound neighbour process,
    and twice as many workers as cores. Waits that spin would lose the core their peer needs."""
    cores = os.cpu_count() or 1
    cases = [
        ("idle", 2, False),
        ("busy neighbour", 2, True),
        (f"{2 * cores} workers on {cores} cores", 2 * cores, False),
    ]
    rows = []
    for name, n, neighbour in cases:
        print(f"  {human_bytes(nbytes)} all-reduce, {name} ...", file=sys.stderr, flush=True)
        spinner = mp.get_context("spawn").Process(target=_spin, daemon=True) if neighbour else None
        if spinner is not None:
            spinner.start()
        try:
            config = ClusterConfig(workers=n, backend=backend, devices=(0,) * n, data_plane=data_plane)
            with MetaDevice(ProcessCluster(config)) as dev:
                wait_until_prepared(dev)
                mine = ours(dev, "all_reduce", nbytes, 20, runs)
            raw = raw_all_reduce(n, nbytes, 200, runs, sockets=data_plane == "tcp")
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.join(5)
        rows.append(
            {
                "condition": name,
                "workers": n,
                "bytes": nbytes,
                "ours_us": mine * 1e6,
                "raw_us": raw * 1e6,
                "raw_over_ours": raw / mine,
            }
        )
    return rows


HOST_STEPS = {  # the small all-reduce across 2 hosts x 2: the workers' environment
    "host by host, shm inside": {},
    "host by host, tcp inside": {TCP_HOST_STEP_ENV: "tcp"},
    "direct": {TCP_DIRECT_ENV: "1"},
}


@contextlib.contextmanager
def two_hosts_of_two(env: dict[str, str]):
    """4 CPU workers on the tcp plane, ranks 2 and 3 at 127.0.0.2 (another host to the plane):
    the MetaDevice; every worker gone when it closes."""
    port = free_port()
    joiners = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "launch.py"), "worker", "--connect", f"tcp://127.0.0.1:{port}"]
            + ["--rank", str(rank), "--backend", "cpu", "--insecure", "-t", "1", "--advertise", "127.0.0.2"],
            env=dict(os.environ, **env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank in (2, 3)
    ]
    config = ClusterConfig(
        workers=4, data_plane="tcp", host="127.0.0.1", port=port, insecure=True, local_workers=2, env=env, bind="off"
    )
    try:
        with MetaDevice(ProcessCluster(config)) as dev:
            yield dev
    finally:
        reap(joiners, 10)


def across_hosts(sizes: tuple[int, ...] = (4 << 10, 16 << 10), runs: int = 7, rounds: int = 3) -> list[dict]:
    """The small all-reduce over 2 hosts x 2 workers, each way of HOST_STEPS, beside its floor:
    `rounds` alternating rounds of a fresh cluster each way (4 workers on 2 cores move a lot
    between clusters), each the median of `runs`; the median of the rounds."""
    times: dict = {(name, nbytes): [] for name in HOST_STEPS for nbytes in sizes}
    routes: dict[str, str] = {}
    for round_ in range(rounds):
        for name, env in HOST_STEPS.items():
            print(f"  round {round_ + 1}: 2 hosts x 2, {name} ...", file=sys.stderr, flush=True)
            with two_hosts_of_two(env) as dev:
                wait_until_prepared(dev)
                routes[name] = "/".join(sorted({way for s in dev.stats().values() for way in s["routes"].values()}))
                for nbytes in sizes:
                    times[name, nbytes].append(ours(dev, "all_reduce", nbytes, 20, runs) * 1e6)
    rows = [{"bytes": nbytes, "routes": routes} for nbytes in sizes]
    for row in rows:
        for name in HOST_STEPS:
            row[name] = float(np.median(times[name, row["bytes"]]))
            row[f"{name} rounds"] = times[name, row["bytes"]]
    with MetaDevice(ProcessCluster(ClusterConfig(workers=2, data_plane="shm"))) as dev:
        wait_until_prepared(dev)
        for row in rows:  # a host's step: posts of two contributions (a worker's own and the one it relays)
            row["shm_2_us"] = ours(dev, "all_reduce", 2 * row["bytes"], 20, runs) * 1e6
    for row in rows:  # between hosts: one contribution each way
        row["tcp_2_us"] = raw_all_reduce(2, row["bytes"], 200, runs, sockets=True) * 1e6
        row["floor_us"] = row["tcp_2_us"] + row["shm_2_us"]
        row["ratio"] = row["host by host, shm inside"] / row["floor_us"]
    return rows


def show_across_hosts(rows: list[dict]) -> None:
    print(
        table(
            "small all-reduce, 2 hosts x 2 workers on the tcp plane (us, median; floor = raw socket exchange "
            "of a contribution between 2 processes + shm all-reduce of 2 workers' posts of 2 contributions)",
            ["size", *HOST_STEPS, "raw tcp", "shm of 2 x 2", "floor", "shm inside / floor"],
            [
                [human_bytes(r["bytes"]), *(r[name] for name in HOST_STEPS)]
                + [r["tcp_2_us"], r["shm_2_us"], r["floor_us"], r["ratio"]]
                for r in rows
            ],
        )
    )


def show_under_load(rows: list[dict]) -> None:
    print(
        table(
            "small all-reduce under load (median of 7 runs; raw = direct exchange + sum on the plane's own "
            "transport; > 1: ours is faster)",
            ["condition", "workers", "size", "ours us", "raw us", "raw/ours"],
            [
                [r["condition"], r["workers"], human_bytes(r["bytes"]), r["ours_us"], r["raw_us"], r["raw_over_ours"]]
                for r in rows
            ],
        )
    )


def show(rows: list[dict]) -> None:
    cols = ["workers", "size", "all-reduce us", "GB/s", "all-gather us", "GB/s", "raw pyzmq us", "GB/s"]
    cols += ["raw sockets us", "GB/s", "AR/raw"]
    print(
        table(
            "collectives on CPU workers (time inside the workers; raw = direct exchange + sum over pyzmq, "
            "and over plain TCP sockets; AR/raw against the plane's own)",
            cols,
            [
                [
                    r["workers"],
                    human_bytes(r["bytes"]),
                    r["all_reduce_us"],
                    r["all_reduce_GBps"],
                    r["all_gather_us"],
                    r["all_gather_GBps"],
                    r["raw_us"],
                    r["raw_GBps"],
                    r["raw_sockets_us"],
                    r["raw_sockets_GBps"],
                    r["ratio"],
                ]
                for r in rows
            ],
        )
    )


def main(argv: list[str] | None = None) -> int:
    def measure(args) -> dict:
        if args.under_load:
            return {"under_load": under_load(data_plane=args.data_plane)}
        if args.hosts:
            return {"hosts": across_hosts()}
        return {"rows": run(args.quick, args.workers, data_plane=args.data_plane, transport=args.transport)}

    def show_any(results: dict) -> None:
        if "under_load" in results:
            show_under_load(results["under_load"])
        elif "hosts" in results:
            show_across_hosts(results["hosts"])
        else:
            show(results["rows"])

    return cli(__doc__, "collectives", measure, show_any, argv, _options)


def _options(ap) -> None:
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--data-plane", default="auto", choices=["auto", "shm", "zmq", "tcp"], help="between the workers")
    ap.add_argument(
        "--transport",
        default="ipc",
        choices=sorted(TRANSPORTS),
        help="the zmq plane's: ipc on this host, tcp over the loopback, or tcp with CURVE (default: %(default)s)",
    )
    ap.add_argument(
        "--hosts", action="store_true", help="only the small all-reduce over 2 hosts x 2 workers (loopback addresses)"
    )
    ap.add_argument(
        "--under-load",
        action="store_true",
        help="only the small all-reduce idle, beside a busy neighbour and with twice as many workers as cores",
    )


if __name__ == "__main__":
    sys.exit(main())
