"""Tensor parallelism across hosts: two network namespaces on this machine, a router namespace
between them that delays every packet (and a token bucket that caps the rate), SmolLM2 decoded
by two workers, one in each, beside the same two workers on one host.

    python bench/hosts.py [--quick] [--json PATH] [--tokens 128] [--delays 0 0.05 0.2 1] [--rates 10 1]
        [--per-host 1 2] [--prompt-repeats 1] [--batch 1]

Hosts: namespace A holds the coordinator and worker 0 (spawned there), B worker 1 (`launch.py
worker --connect`); they reach each other only through namespace R, which forwards between its
two veth pairs. Delay: this kernel may lack `sch_netem`, so R routes every packet it forwards
into a TUN device that a relay of ours (this file, `--relay-delay-us`) reads and writes back
after the one-way delay; written back, the kernel forwards it on. Rate: `tc tbf` on R's two
egress links. Rows: one worker alone on one host (a layer split's ceiling: its groups take
turns), the same two workers on one host (shared memory; the tcp plane over the loopback), across
the namespaces forwarded by the kernel (no relay), and through the relay at each delay (0 ms: the
relay's own cost); and 2 workers in each namespace (4 on one host beside
them), their small all-reduces host by host (the tcp plane's default there) or direct. Each row
is `launch.py generate` (greedy, `--tokens` tokens of a fixed prompt of ~45 tokens, or of it
`--prompt-repeats` times over: a prompt of several 128-token chunks, whose prefill a layer split
pipelines, one thread a worker; `--batch N`: N sequences of it decoded together, a served batch's
work, and a layer split's rows then in lanes whose steps overlap, workers/pipelined.py, beside
the same split one step at a time, `--no-pipeline`) as a user runs it, its printed prefill and
decode rates (a batch's: all its tokens; every sequence runs to `--tokens`, EOS ignored). The
relay is a Python process on the same cores as the workers: it costs them CPU and adds its own
latency per packet (the 0 ms relay row shows how much); on a 2-core machine 2 x 2 workers take
turns on the cores, which no real pair of hosts would make them do. Every row runs twice:
split by rows (TP: two all-reduces a layer) and by layers (`--split layer`: the layers on one
host's workers each, split inside the host, one hand-over of the activation between hosts and
one of the chosen tokens back, a step). Texts are compared bit for bit with the one-host run whose
arithmetic a row repeats (`judge`): a row split's with one host's of as many workers, a layer
split of one-worker groups with one worker alone, one of larger groups with one host's layer split
of as many workers in groups as large (a group of two does not repeat two workers' row split bit
for bit: 1.8e-5 apart in float32 logits, and at 8-bit activations a greedy token moved after ~90).

Needs root (network namespaces) and iproute2 (ip, tc); without them it says why and exits 0.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import shutil
import struct
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import cli, reap, table  # noqa: E402
from transport.environment import TCP_DIRECT_ENV  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden press adapted from those used for "
    "wine. Within fifty years printing had spread to more than two hundred cities, and"
)
NET_A, NET_B = "10.66.1", "10.66.2"  # A's and B's links to the router R (.1 the host, .254 R)
TUN = "mtpdly"
TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000
SPLITS = ("row", "layer")  # models.loading.SPLITS: tensor parallel, and layers on each host's workers
# each row's split as `launch.py generate` takes it; with a batch, a layer split also runs its
# prompts in one step at a time, not pipelined in lanes (workers/pipelined.py)
SPLIT_ARGS = {
    "row": ["--split", "row"],
    "layer": ["--split", "layer"],
    "layer, one step": ["--split", "layer", "--no-pipeline"],
}
RATE = re.compile(r"prefill (\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s\), decode (\d+) tokens in [\d.]+ s \(([\d.]+)")


def why_not() -> str:
    """Why this machine cannot run the bench ("" if it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun for the delaying relay"
    return ""


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def in_ns(ns: str, *cmd: str) -> None:
    sh("ip", "netns", "exec", ns, *cmd)


class Hosts:
    """Namespaces A and B joined through router R; `link(delay_ms, rate_gbit)` sets the path."""

    def __init__(self) -> None:
        tag = f"mtph{os.getpid() % 10000}"
        self.a, self.b, self.r = f"{tag}a", f"{tag}b", f"{tag}r"
        self.relay: subprocess.Popen | None = None
        try:
            for ns in (self.a, self.b, self.r):
                sh("ip", "netns", "add", ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
            for ns, net, side in ((self.a, NET_A, "ra"), (self.b, NET_B, "rb")):
                sh("ip", "link", "add", f"{tag}{side}", "type", "veth", "peer", "name", f"{tag}h{side}")
                sh("ip", "link", "set", f"{tag}{side}", "netns", self.r)
                sh("ip", "link", "set", f"{tag}h{side}", "netns", ns)
                sh("ip", "-n", self.r, "link", "set", f"{tag}{side}", "name", side)
                sh("ip", "-n", ns, "link", "set", f"{tag}h{side}", "name", "eth0")
                sh("ip", "-n", self.r, "addr", "add", f"{net}.254/24", "dev", side)
                sh("ip", "-n", ns, "addr", "add", f"{net}.1/24", "dev", "eth0")
                sh("ip", "-n", self.r, "link", "set", side, "up")
                sh("ip", "-n", ns, "link", "set", "eth0", "up")
                sh("ip", "-n", ns, "route", "add", "default", "via", f"{net}.254")
            for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"):
                name, value = key.split("=")
                in_ns(self.r, "sh", "-c", f"echo {value} > /proc/sys/{name.replace('.', '/')}")
        except BaseException:
            self.close()
            raise

    def link(self, delay_ms: float | None, rate_gbit: float | None) -> None:
        """Route R's forwarding through the relay at `delay_ms` (None: the kernel forwards), and
        cap each direction at `rate_gbit` (None: no cap)."""
        self._stop_relay()
        for side in ("ra", "rb"):
            subprocess.run(
                ["ip", "netns", "exec", self.r, "tc", "qdisc", "del", "dev", side, "root"], capture_output=True
            )
            if rate_gbit is not None:
                burst = max(32_000, int(rate_gbit * 1e9 / 8 / 1000))  # a millisecond's bytes
                in_ns(self.r, "tc", "qdisc", "add", "dev", side, "root", "tbf", "rate", f"{rate_gbit}gbit",
                      "burst", str(burst), "latency", "20ms")  # fmt: skip
        if delay_ms is None:
            return
        cmd = ["ip", "netns", "exec", self.r, sys.executable, __file__, "--relay-delay-us", str(int(delay_ms * 1000))]
        self.relay = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.relay.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the relay did not start: {line}{self.relay.stderr.read()}")
        in_ns(self.r, "ip", "link", "set", TUN, "up")
        in_ns(self.r, "sh", "-c", f"echo 0 > /proc/sys/net/ipv4/conf/{TUN}/rp_filter")
        for side in ("ra", "rb"):  # what arrives from a host goes to the relay; what it writes back is routed on
            in_ns(self.r, "ip", "rule", "add", "iif", side, "lookup", "100")
        in_ns(self.r, "ip", "route", "add", "default", "dev", TUN, "table", "100")

    def _stop_relay(self) -> None:
        if self.relay is not None:
            self.relay.kill()
            self.relay.wait()
            self.relay = None
            for side in ("ra", "rb"):
                subprocess.run(["ip", "netns", "exec", self.r, "ip", "rule", "del", "iif", side, "lookup", "100"],
                               capture_output=True)  # fmt: skip

    def close(self) -> None:
        self._stop_relay()
        for ns in (self.a, self.b, self.r):
            done = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
            left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
            if done.returncode and ns in left:  # one made part way and not there is not a failure
                print(f"namespace {ns} is left: {done.stderr.strip()} (ip netns del {ns})", file=sys.stderr)


def relay(delay_us: int) -> int:
    """The delaying relay (run inside R): every packet read from the TUN device is written back
    `delay_us` microseconds later, in order. It runs at real-time priority and sleeps in a
    select until the next packet or the next one due: a network takes no CPU from the hosts, and
    on a machine whose cores the workers' spinning waits fill, an ordinary process forwarding
    for them would wait its turn behind them (each packet milliseconds late)."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", TUN.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except OSError as exc:
        print(f"the relay runs at normal priority ({exc}): its delays will be late", file=sys.stderr)
    print("ready", flush=True)
    delay, held = delay_us / 1e6, deque()
    while True:
        select.select([fd], [], [], max(0.0, held[0][0] - time.perf_counter()) if held else 1.0)
        while True:
            try:
                packet = os.read(fd, 65536)
            except BlockingIOError:
                break
            held.append((time.perf_counter() + delay, packet))
        now = time.perf_counter()
        while held and held[0][0] <= now:
            os.write(fd, held.popleft()[1])


def generate(
    ns_cmd: list[str], extra: list[str], tokens: int, prompt: str, workers=(), env=None, batch: int = 1
) -> dict:
    """One `launch.py generate` of `prompt` (`batch` times over: a batch of as many sequences;
    in a namespace where `ns_cmd` says), with remote workers started by the commands `workers`;
    its prefill and decode rates (a batch's: every sequence's tokens)."""
    args = [sys.executable, str(ROOT / "launch.py"), "generate", *[prompt] * batch]
    args += ["-n", str(tokens), "--temp", "0", "-t", "1", "--ignore-eos"]
    env = {**os.environ, **(env or {})}
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    coordinator = subprocess.Popen([*ns_cmd, *args, *extra], **popen)
    remote = [subprocess.Popen(cmd, **popen) for cmd in workers]
    try:
        out, err = coordinator.communicate(timeout=300)
    finally:
        reap(remote, 20)
    found = RATE.search(err) or RATE.search(out)
    if coordinator.returncode != 0 or found is None:
        raise RuntimeError(f"generate failed ({coordinator.returncode}): {err[-2000:]}")
    return {"prefill_tps": float(found.group(2)), "decode_tps": float(found.group(4)), "text": out.strip()}


def across(
    hosts: Hosts,
    tokens: int,
    prompt: str,
    port: int,
    per_host: int = 1,
    direct: bool = False,
    split: str = "row",
    batch: int = 1,
) -> dict:
    """`split` over the tcp plane with `per_host` workers in each namespace: A's spawned beside
    the coordinator, B's joining; `direct`: the small all-reduces exchange with every peer, not
    host by host."""
    listen = f"tcp://{NET_A}.1:{port}"
    coordinator = ["ip", "netns", "exec", hosts.a]
    extra = ["--listen", listen, "--spawn", str(per_host), "--workers", str(2 * per_host), "--insecure"]
    extra += ["--data-plane", "tcp", *SPLIT_ARGS[split]]
    workers = [
        [
            "ip",
            "netns",
            "exec",
            hosts.b,
            sys.executable,
            str(ROOT / "launch.py"),
            "worker",
            "--connect",
            listen,
            "--rank",
            str(rank),
            "--backend",
            "cpu",
            "--insecure",
            "-t",
            "1",
        ]  # fmt: skip
        for rank in range(per_host, 2 * per_host)
    ]
    env = {TCP_DIRECT_ENV: "1"} if direct else None
    return generate(coordinator, extra, tokens, prompt, workers, env, batch)


def measure(args) -> dict:
    reason = why_not()
    if reason:
        print(f"bench/hosts.py cannot run here: {reason}", file=sys.stderr)
        return {"skipped": reason}
    tokens = 16 if args.quick else args.tokens
    delays = [0.2] if args.quick else args.delays
    prompt = " ".join([PROMPT] * args.prompt_repeats)
    batch = args.batch
    rows = []

    def row(name: str, workers: int, delay, rate, run, per_group: int = 1, splits=SPLITS) -> None:
        """Both splits of one configuration, back to back (`run(split)` measures one); a layer
        split's groups of `per_group` workers each; with a batch, the layer split once more in
        one step at a time."""
        for split in [s for s in SPLIT_ARGS if s.split(",")[0] in splits and (batch > 1 or "," not in s)]:
            result = run(split)
            print(f"  {name}, {split}: decode {result['decode_tps']:.1f} tok/s", file=sys.stderr, flush=True)
            group = workers if split == "row" else per_group
            rows.append(
                {"path": name, "split": split, "workers": workers, "group": group, "delay_ms": delay, "rate_gbit": rate}
                | result
            )

    def one_host(workers: int, plane: str, groups: int = 0):
        extra = ["--workers", str(workers), "--data-plane", plane, *(["--layer-groups", str(groups)] if groups else [])]
        return lambda split: generate([], [*extra, *SPLIT_ARGS[split]], tokens, prompt, batch=batch)

    # one worker alone: the text a layer split of one-worker groups must give, and its speed ceiling
    row("one host, 1 worker", 1, 0, None, one_host(1, "shm"), splits=("row",))
    for plane in ("shm", "tcp"):
        row(f"one host, {plane}", 2, 0, None, one_host(2, plane))
    if 2 in args.per_host:
        row("one host, 4 workers, shm", 4, 0, None, one_host(4, "shm"))
        # the arithmetic of the 2 x 2 layer split: 2 groups of 2
        grouped = one_host(4, "shm", groups=2)
        row("one host, 4 workers in 2 groups, shm", 4, 0, None, grouped, per_group=2, splits=("layer",))
    hosts, port = Hosts(), 29700

    def crossing(per_host: int = 1, direct: bool = False):
        def run(split: str) -> dict:
            nonlocal port
            port += 3
            return across(hosts, tokens, prompt, port, per_host, direct, split, batch)

        return run

    try:
        if 1 in args.per_host:
            hosts.link(None, None)
            row("2 hosts, kernel forwards", 2, 0, None, crossing())
            for rate in [None, *args.rates] if not args.quick else [None]:
                for delay in delays if rate is None else [0.2]:
                    hosts.link(delay, rate)
                    name = f"2 hosts, relay {delay} ms" + (f", {rate:g} Gb/s" if rate else "")
                    row(name, 2, delay, rate, crossing())
        if 2 in args.per_host:
            for delay in (None, 0.2):
                hosts.link(delay, None)
                for direct in (False, True):
                    name = f"2 hosts x 2, {'kernel forwards' if delay is None else f'relay {delay} ms'}, "
                    name += "direct" if direct else "host by host"
                    row(name, 4, delay or 0, None, crossing(2, direct), per_group=2)
    finally:
        hosts.close()
    judge(rows)
    return {"tokens": tokens, "prompt_repeats": args.prompt_repeats, "batch": batch, "rows": rows}


def judge(rows: list[dict]) -> None:
    """Each row's decode against one host's row split of as many workers, and its text against
    the one-host run whose arithmetic it repeats: a row split's, one host's of as many workers; a
    layer split's of one-worker groups, one worker alone (each group runs its layers whole, as
    one worker does); a layer split's of larger groups, one host's layer split of as many workers
    in groups as large (that run is the reference of the others: `text_of` None)."""

    def one_host(split: str, workers: int, group: int) -> dict:
        return next(
            b
            for b in rows
            if b["path"].startswith("one host") and (b["split"], b["workers"], b["group"]) == (split, workers, group)
        )

    for r in rows:
        r["decode_vs_one_host"] = r["decode_tps"] / one_host("row", r["workers"], r["workers"])["decode_tps"]
        if r["split"].startswith("layer") and r["group"] > 1:  # in lanes or one step at a time: the same tokens
            oracle, r["text_of"] = (
                one_host("layer", r["workers"], r["group"]),
                f"{r['workers']} by layers of {r['group']}",
            )
        else:
            oracle, r["text_of"] = one_host("row", r["group"], r["group"]), f"{r['group']} by rows"
        if oracle is r:
            r["text_of"] = None
        r["same_text"] = r["text"] == oracle["text"]


def show(results: dict) -> None:
    if "skipped" in results:
        print(f"skipped: {results['skipped']}")
        return
    print(
        table(
            f"SmolLM2-135M Q4_1, CPU workers x 1 thread, {results['tokens']} greedy tokens after the prompt "
            f"{results.get('prompt_repeats', 1)} time(s) over, {results.get('batch', 1)} sequence(s) at a time "
            "(rates of all together); across hosts over "
            "the tcp plane; decode against one host's split by rows (shm) with as many workers, text against"
            " the one-host run of the same arithmetic",
            ["path", "split", "workers", "prefill tok/s", "decode tok/s", "decode / one host", "text as of workers"],
            [
                [
                    r["path"],
                    r["split"],
                    r["workers"],
                    r["prefill_tps"],
                    r["decode_tps"],
                    r["decode_vs_one_host"],
                    "(the reference)"
                    if r["text_of"] is None
                    else f"{r['text_of']}: {'yes' if r['same_text'] else 'NO'}",
                ]
                for r in results["rows"]
            ],
        )
    )


def _options(ap) -> None:
    # a generation's first steps cost more (its first decode step run by the coordinator, the
    # workers' first runs planned): on the Intel VM one host's layer split read 54.8 tok/s over
    # 32 tokens (12-04 17:04) and 104-111 over 300 (19:3x), one worker alone 92.3 and 115-126
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--delays", type=float, nargs="+", default=[0, 0.05, 0.2, 1], help="one-way, ms")
    ap.add_argument("--rates", type=float, nargs="+", default=[10, 1], help="Gb/s, each at 0.2 ms")
    ap.add_argument("--per-host", type=int, nargs="+", default=[1, 2], choices=[1, 2], help="workers in each namespace")
    ap.add_argument("--prompt-repeats", type=int, default=1, help="the prompt this many times over (10: ~450 tokens)")
    ap.add_argument(
        "--batch", type=int, default=1, help="sequences decoded together (the prompt as each; a served batch's work)"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--relay-delay-us":
        sys.exit(relay(int(sys.argv[2])))
    sys.exit(cli(__doc__, "hosts", measure, show, None, _options))
