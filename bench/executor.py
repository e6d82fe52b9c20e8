"""The executor's own work per decode token: SmolLM2-135M's captured decode step on simulated
devices (in this process), rank 0's program run with every kernel and collective replaced by a
stub that hands back its output buffer, so what is timed is the executor alone: the bound calls
one after the other (workers/program.py) against the same steps written out as one function
(workers/straight.py), on the same slots, in turn.

    python bench/executor.py [--quick] [--json results/executor.json] [--devices 1 2] [--runs 2000]

Also: the program's steps and calls, and what writing it out costs (CPython's compile).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import cli, table  # noqa: E402


def _stub(xp, inputs, params, out, **extra):
    return out if out is not None else inputs[0]


def _memo_stub(xp, inputs, params, out, **extra):
    return out if out is not None else inputs[0]


_memo_stub.memo = True  # bound with the run's memo, as the kernel it stands for


def decode_program(devices: int):
    """(rank 0's compiled decode program, the slots of one real run of it, its backend, the
    device to close): the model loaded, a prompt prefilled, the decode step captured and run."""
    from bench.llm import prompt_ids
    from meta import MetaDevice
    from models.gguf_model import GGUFModel, default_model_path
    from models.llama import TensorParallelLlama
    from workers.program import CompiledProgram
    from workers.simulator import SimulatedCluster

    model = GGUFModel(str(default_model_path()))
    cluster = SimulatedCluster(devices)
    dev = MetaDevice(cluster)
    net = TensorParallelLlama(dev, model.config, model.weight, 256)
    _, best = net.prefill([list(prompt_ids(model, 16)[0])], 0, pool=1)
    token = best.numpy().astype(np.int32).reshape(1, 1)
    step, _ = net.capture_decode(token, np.array([[16]]), build=lambda logits: list(logits.top_k(1)))
    executor = cluster.servers[0].executor
    seen: dict = {}
    run = CompiledProgram.run

    def keeping(program, slots, *args, **kwargs):  # every slot of rank 0's run, kept
        kwargs["keep"] = True
        timings = run(program, slots, *args, **kwargs)
        if executor.programs.get(program.program) is program:
            seen[program.program] = (program, list(slots))
        return timings

    CompiledProgram.run = keeping
    try:
        step(token, np.array([[17]], np.int32))
    finally:
        CompiledProgram.run = run
    program, slots = seen[step.compiled.program]
    return program, slots, cluster.servers[0].backend, dev


def measure_devices(devices: int, runs: int) -> dict:
    from workers import straight

    program, slots, backend, dev = decode_program(devices)
    try:
        real_kernels, real_move = program.kernels, program._move_call
        # stubs: a kernel hands back its buffer (a view op stays: its result is made once, at bind)
        from workers.kernels import VIEW_OPS

        program.kernels = {
            op: k if op in VIEW_OPS else _memo_stub if getattr(k, "memo", False) else _stub
            for op, k in real_kernels.items()
        }

        def moved(placed, collectives, timeout, out=None):
            a, o = placed.step.input, placed.step.output

            def call(s):
                s[o] = s[a]

            return call

        program._move_call = moved
        program.bind(program.arena, object(), backend, 30.0)
        calls, lines = list(program.calls), program.lines
        start = time.perf_counter()
        written = straight.write_out(lines, backend.xp, "bench")
        compile_s = time.perf_counter() - start
        times = {"calls": [], "written": []}
        for _ in range(5):  # in turn, each timed over `runs` runs
            start = time.perf_counter()
            for _ in range(runs):
                s = list(slots)
                for call in calls:
                    call(s)
            times["calls"].append((time.perf_counter() - start) / runs)
            start = time.perf_counter()
            for _ in range(runs):
                s = list(slots)
                written(s)
            times["written"].append((time.perf_counter() - start) / runs)
        program.kernels, program._move_call = real_kernels, real_move
        return {
            "devices": devices,
            "steps": len(program.placed),
            "calls": len(calls),
            "calls_us": float(np.median(times["calls"])) * 1e6,
            "written_us": float(np.median(times["written"])) * 1e6,
            "write_out_ms": compile_s * 1e3,
        }
    finally:
        dev.close()


def run(quick: bool, devices: list[int], runs: int) -> dict | None:
    from models.gguf_model import ModelMissing, default_model_path

    try:
        default_model_path()
    except ModelMissing as exc:
        print(f"executor benchmark skipped: {exc}", file=sys.stderr)
        return None
    runs = 200 if quick else runs
    return {"rows": [measure_devices(n, runs) for n in devices]}


def show(results: dict | None) -> None:
    if not results:
        return
    rows = [
        [r["devices"], r["steps"], r["calls"], r["calls_us"], r["written_us"], r["calls_us"] / r["written_us"]]
        + [r["write_out_ms"]]
        for r in results["rows"]
    ]
    columns = ["devices", "steps", "calls", "bound calls us", "written out us", "ratio", "write-out ms"]
    print(table("executor's own work per decode token (rank 0, kernels stubbed)", columns, rows))


def main(argv: list[str] | None = None) -> int:
    def measure(args):
        return run(args.quick, args.devices, args.runs)

    def options(ap) -> None:
        ap.add_argument("--devices", type=int, nargs="+", default=[1, 2])
        ap.add_argument("--runs", type=int, default=2000, help="runs per timing (200 with --quick)")

    return cli(__doc__, "executor", measure, show, argv, options)


if __name__ == "__main__":
    sys.exit(main())
