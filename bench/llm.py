"""SmolLM2-135M-Instruct from its GGUF file: prefill and decode tokens per second on 1, 2 and 4
workers against the single-process NumPy reference decoder with as many BLAS threads, in the
same run, with each decode step's time split into compute, collectives, executor and dispatch.

    python bench/llm.py [--quick] [--json results/llm.json] [--workers 1 2 4] [--rounds 3]
                        [--contexts 256 8192] [--rss-tokens 2000] [--cache-position 2048]
                        [--model FILE.gguf | --synthetic 1.7b]

Prefill: one 128-token prompt (32 with --quick) in one chain, as generation prefills (the
embedding, one layer's step per layer, the head: models/llama.py); "first" plans and loads it
(medians over 5 models loaded anew, or --rounds when more; 1 with --quick), "warmed" comes after
a warm-up at load, "again" replays it. Decode: greedy, generation driven by the workers (one
Generate, each token fed back on the workers); then the captured decode step replayed by the
coordinator token by token, its median step untimed on the workers, and the breakdown from as
many steps with every kernel timed (the table shows both, so what profiling costs is visible).
The reference stays up in its own process for the whole row, and the two alternate, --rounds
rounds of a prefill and of decoding each, so a busy neighbour slows both alike; the figures are
the rounds' medians. Where llama-cpp-python is installed (`pip install llama-cpp-python`, which
builds llama.cpp), llama.cpp itself runs on the same file with N threads after each worker
count's rows, and also decodes right after each of our decode rounds (not with --quick), and a
table compares its decode with ours both ways (the paired ratio is the median of the rounds').
--contexts: decode at the same positions with the KV cache preallocated to each length.
--rss-tokens: resident memory of the coordinator and the workers over that many decode tokens.
--cache-position: decode after a prompt that long, float32 against float16 KV caches (and
llama.cpp, whose cache is float16), 1 worker."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import ChildFailed, ThreadedChild, cli, paired_ratio, table  # noqa: E402
from bench.tp_matmul import breakdown  # noqa: E402
from meta import ClusterConfig, MetaDevice, ProcessCluster  # noqa: E402

TEXT = (
    "The history of tensor parallelism begins with the observation that the matrices of a large "
    "neural network can be cut into slices and multiplied on several devices at once. "
) * 8


def prompt_ids(model, length: int) -> np.ndarray:
    ids = model.tokenizer.encode(TEXT)
    ids = ids * (length // len(ids) + 1)  # a long prompt: the text again
    return np.array([ids[:length]], np.int64)


def reference_child(path: str, length: int, steps: int, requests, replies) -> None:
    """The NumPy reference in a process whose BLAS thread count was fixed at spawn, answering
    ("ready",): None once loaded, ("prefill",): the seconds of the prompt's prefill, and
    ("decode",): the seconds per token of a greedy decode of `steps` tokens after it (the run's
    time over its tokens, as ours is timed; the same positions every time)."""
    from models.gguf_model import GGUFModel
    from models.llama import ReferenceDecoder

    model = GGUFModel(path)
    cfg = model.config
    names = ["embed", "norm"] + [
        f"l{i}.{k}"
        for i in range(cfg.layers)
        for k in ("attn_norm", "ffn_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    ]
    ref = ReferenceDecoder(cfg, {n: model.weight(n) for n in names}, length + steps + 1)
    tokens = prompt_ids(model, length)
    first = 0
    while (request := requests.get()) is not None:
        if request[0] == "ready":
            replies.put(None)
            continue
        if request[0] == "prefill":
            start = time.perf_counter()
            logits = ref.forward(tokens, np.arange(length)[None], last=[length - 1])  # as ours: the last token's head
            replies.put(time.perf_counter() - start)
            first = int(np.argmax(logits[0, -1]))
            continue
        token, start = first, time.perf_counter()
        for pos in range(length, length + steps):
            token = int(np.argmax(ref.forward(np.array([[token]]), np.array([[pos]]))[0, -1]))
        replies.put((time.perf_counter() - start) / steps)


# llama.cpp's AMX kernels, built in where the compiling CPU has AMX (as GGML_NATIVE does), crash on
# some machines at a prompt's first product (llama.cpp issue 20824, a segfault in
# ggml_backend_amx_mul_mat: the 2-core Intel VM of 2026-12-04 with llama-cpp-python 0.3.36, 8 tokens
# enough): a build without them keeps every other instruction set those CPUs have.
WITHOUT_AMX = (
    "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    " -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON'"
    " pip install --force-reinstall --no-cache-dir --no-deps --no-binary llama-cpp-python llama-cpp-python"
)


def llama_cpp_skipped(exc: ChildFailed, features: Callable[[], str] | None = None) -> None:
    """Say on stderr that llama.cpp's rows are left out and why; where its child died of SIGSEGV
    and the build has llama.cpp's AMX kernels, how to build it without them."""
    print(f"llama.cpp skipped: {exc}", file=sys.stderr)
    if "SIGSEGV" in str(exc) and "AMX_INT8 = 1" in (features or llama_cpp_features)():
        print(
            "  this llama-cpp-python has llama.cpp's AMX kernels, which crash on some machines (llama.cpp"
            f" issue 20824); build it without them:\n  {WITHOUT_AMX}",
            file=sys.stderr,
        )


def llama_cpp_features() -> str:
    """llama.cpp's own line of the instruction sets it was built with, read in a process of its
    own (loading it here would bring its OpenMP threads into the benchmark); '' where it cannot
    say."""
    script = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout


def warm_llama_cpp(path: str, length: int, steps: int, threads: int) -> ThreadedChild | None:
    """llama_cpp_child started, loaded and warm (one decode run), for rounds beside ours; None
    (said on stderr) where it could not start."""
    try:
        child = ThreadedChild(llama_cpp_child, (path, length, steps, threads), threads)
        child.ask("decode")  # loaded and warm
        return child
    except ChildFailed as exc:
        llama_cpp_skipped(exc)
        return None


def llama_cpp_child(path: str, length: int, steps: int, threads: int, requests, replies) -> None:
    """llama.cpp itself (llama-cpp-python), on the same GGUF file with `threads` threads,
    answering as reference_child: ("prefill",) the seconds of the prompt's prefill, ("decode",)
    the seconds per token of a greedy decode of `steps` tokens after it (choosing included)."""
    from llama_cpp import Llama

    from models.gguf_model import GGUFModel

    tokens = [int(t) for t in prompt_ids(GGUFModel(path), length)[0]]  # the file's vocabulary: the same ids
    llm = Llama(
        model_path=path,
        n_ctx=length + steps + 8,
        n_batch=length,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    vocabulary = llm.n_vocab()
    while (request := requests.get()) is not None:
        llm.reset()
        start = time.perf_counter()
        llm.eval(tokens)
        prefill = time.perf_counter() - start
        if request[0] == "prefill":
            replies.put(prefill)
            continue
        start = time.perf_counter()
        for _ in range(steps):
            # the last token's logits as llama.cpp left them (llm.scores holds them only with logits_all)
            token = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocabulary,))))
            llm.eval([token])
        replies.put((time.perf_counter() - start) / steps)


# prefill pairs (the reference's, then ours replayed) per round: a pair's ratio on 1 worker ranged
# 0.84-1.37 within one run of nine on a busy 2-core VM, and three pairs' median 0.97-1.09 from run to run
AGAIN_PAIRS = 3
DRIVEN_PER_STEP = 4  # our worker-driven decode rounds and llama.cpp's: tokens per --steps token of the reference
CONTEXT_ROUNDS = 8  # rounds of the --contexts rows (at least; ~24 tokens a context each)
FIRST_ROUNDS = 5  # models loaded anew for each kind of first prompt (at least; --rounds when more)
RSS_CTX = 1024  # the caches' positions in the main rows: the peak RSS column is then #27's condition


# what generate and serve run on quantized weights: 8-bit activations (models.generate.LLM's default)
ACTIVATIONS = "q8"


def default_caches(activations: str = ACTIVATIONS, weights: str = "native") -> tuple[str, ...]:
    """The KV caches' element types generate and serve give a model by default with these
    activations and weights (models.loading.cache_types_for: float16 with the file's blocks and
    8-bit activations, as llama.cpp's; float32 on the float32 paths)."""
    from models.loading import AUTO_CACHE, cache_types_for

    return cache_types_for((AUTO_CACHE, AUTO_CACHE), activations, weights)


def have_llama_cpp() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def ours(
    path: str,
    workers: int,
    length: int,
    steps: int,
    weights: str = "f32",
    reference=None,
    rounds: int = 1,
    llama=None,
) -> dict:
    """Prefill (a first prompt is timed by fresh_models), greedy decode through the captured step
    replayed by the coordinator, untimed on the workers, then as many steps with every kernel
    timed (profiling) for the breakdown; then `rounds` rounds of AGAIN_PAIRS prefills and of
    worker-driven decode, each right after the same on `reference` (a ThreadedChild running
    reference_child) when given, and each round's decode right before llama.cpp's (`llama`, a
    warm_llama_cpp child) when given. Medians, and each ratio the median of its pairs'."""
    from models.gguf_model import GGUFModel
    from models.llama import TensorParallelLlama
    from models.loading import decode_pool_env, fuses_qkv

    model = GGUFModel(path)
    source = model.native if weights == "native" else model.weight
    pools = decode_pool_env(model, weights, ACTIVATIONS, os.environ)  # as generate starts its workers
    with MetaDevice(ProcessCluster(ClusterConfig(workers=workers, blas_threads=1, env=pools))) as dev:
        needed = length + (6 + 4 * rounds) * steps + 8
        net = TensorParallelLlama(
            dev,
            model.config,
            source,
            max(RSS_CTX, needed),
            cache_types=default_caches(weights=weights),
            fuse_qkv=fuses_qkv(model, weights),
            activations=ACTIVATIONS,
        )
        tokens = [list(prompt_ids(model, length)[0])]
        _, best = net.prefill(tokens, 0, pool=1)  # as generate prefills: the candidates travel
        first = best.numpy().astype(np.int32).reshape(1, 1)
        decode, (out, *_) = net.capture_decode(first, np.array([[length]]))
        token = out.numpy().astype(np.int32)
        pos = length + 1
        walls: dict[bool, list[float]] = {False: [], True: []}
        parts = []
        for profile in (False, True):
            dev.profile = profile
            for _ in range(steps):
                start = time.perf_counter()
                dev.clock.reset()
                out, *_ = decode(token, np.array([[pos]], np.int32), read=(0,))
                token = out.numpy().astype(np.int32)
                walls[profile].append(time.perf_counter() - start)
                pos += 1
                if profile:
                    # the replayed step runs outside the device's timed methods: all of its wall
                    # time is the coordinator's, round trips included
                    dev.clock.inside_s = walls[True][-1]
                    parts.append(breakdown(walls[True][-1], dev.last_timings, dev.clock))
        median = int(np.argsort(walls[True])[len(walls[True]) // 2])
        dev.profile = False
        timed = {"ref_prefill": [], "prefill_again": [], "ref_decode": [], "driven": [], "around": [], "llama": []}
        # each round decodes the positions llama.cpp's rounds beside it decode (the prompt's
        # length on): going on from round to round, ours read up to 3.5x as many cached rows
        driven = worker_driven(dev, net, first, length, again=True)
        for _ in range(rounds):
            for _ in range(AGAIN_PAIRS):
                if reference is not None:
                    timed["ref_prefill"].append(reference.ask("prefill"))
                start = time.perf_counter()
                net.prefill(tokens, 0, pool=1)[1].numpy()  # a second prompt of the same length: replayed
                timed["prefill_again"].append(time.perf_counter() - start)
            if reference is not None:
                timed["ref_decode"].append(reference.ask("decode"))
            step_s, around_s = driven(DRIVEN_PER_STEP * steps)
            timed["driven"].append(step_s)
            timed["around"].append(around_s)
            if llama is not None:
                timed["llama"].append(llama.ask("decode"))
        stats = dev.stats().values()
        medians = {k: float(np.median(v)) if v else None for k, v in timed.items()}
        return {
            "stored_mib": max(st["used"] for st in stats) / 2**20,
            "peak_rss_mib": max(st["max_rss_kib"] for st in stats) / 1024,
            "rounds": len(timed["driven"]),
            "prefill_again_s": medians["prefill_again"],
            "again_ratio": paired_ratio(timed["ref_prefill"], timed["prefill_again"]),
            "reference_prefill_s": medians["ref_prefill"],
            "reference_decode_step_s": medians["ref_decode"],
            "driven_step_s": medians["driven"],
            "decode_ratio": paired_ratio(timed["ref_decode"], timed["driven"]),
            "llama_cpp_paired_decode_s": medians["llama"],
            "vs_llama_cpp_paired": paired_ratio(timed["llama"], timed["driven"]),
            "decode_tokens": (steps, DRIVEN_PER_STEP * steps),  # the reference's run, ours (and llama.cpp's)
            "driven_outside_program_s": medians["around"],
            "decode_step_s": float(np.median(walls[False])),
            "profiled_step_s": float(np.median(walls[True])),
            "breakdown": parts[median],
            "plans": len(dev.plans),
        }


def fresh_models(path: str, workers: int, length: int, weights: str, reference=None, rounds: int = 1) -> dict:
    """First prompts of models loaded anew, each right after the reference's prefill when given:
    `rounds` models prefilling at once (the prompt's steps planned, compiled and loaded then:
    "first"), and `rounds` more warmed up first (TensorParallelLlama.warm_up: every padded prompt
    length's prefill steps loaded, not run, as `generate -i` does at start; the warm-up's seconds
    too: "warmed"). Medians, alternating the two kinds, and each kind's ratio the median of its
    pairs' (the reference's prefill over ours right after it): a single pair's ratio varied from
    0.97 to 1.53 within one run on a busy 2-core VM, and the medians of three pairs had the first
    prompt on 1 worker 0.79-1.32x from run to run."""
    from models.gguf_model import GGUFModel
    from models.llama import TensorParallelLlama
    from models.loading import decode_pool_env, fuses_qkv

    model = GGUFModel(path)
    source = model.native if weights == "native" else model.weight
    pools = decode_pool_env(model, weights, ACTIVATIONS, os.environ)  # as generate starts its workers
    tokens = [list(prompt_ids(model, length)[0])]
    seen: dict[str, list] = {k: [] for k in ("warm_up_s", "warmed_prefill_s", "warmed_reference_s")}
    seen |= {"first_prefill_s": [], "first_reference_s": []}
    for warmed in [False, True] * rounds:
        kind = "warmed" if warmed else "first"
        with MetaDevice(ProcessCluster(ClusterConfig(workers=workers, blas_threads=1, env=pools))) as dev:
            fuse = fuses_qkv(model, weights)
            net = TensorParallelLlama(
                dev,
                model.config,
                source,
                RSS_CTX,
                cache_types=default_caches(weights=weights),
                fuse_qkv=fuse,
                activations=ACTIVATIONS,
            )
            if warmed:
                start = time.perf_counter()
                net.warm_up(pool=1)
                seen["warm_up_s"].append(time.perf_counter() - start)
            if reference is not None:
                seen[f"{kind}_reference_s"].append(reference.ask("prefill"))
            start = time.perf_counter()
            net.prefill(tokens, 0, pool=1)[1].numpy()
            seen[f"{kind}_prefill_s"].append(time.perf_counter() - start)
    medians = {k: float(np.median(v)) if v else None for k, v in seen.items()}
    medians["first_rounds"] = len(seen["first_prefill_s"])
    for kind in ("first", "warmed"):
        medians[f"{kind}_ratio"] = paired_ratio(seen[f"{kind}_reference_s"], seen[f"{kind}_prefill_s"])
    return medians


def side_by_side(path: str, workers: int, variants: dict, rounds: int, quick: bool, describe=None) -> dict:
    """One GGUF file's native weights decoded by several variants loaded side by side (variants:
    name -> (the workers' environment, TensorParallelLlama's keyword arguments), one cluster of
    `workers` workers each, started in that order) and llama.cpp with as many threads beside them,
    in alternating rounds of greedy tokens driven by the workers (alternate). Returns the seconds
    per token by name (llama.cpp's too), each variant's prefill token (`first`), what
    describe(net) says of each (`described`), and the tokens a round (`steps`)."""
    from models.gguf_model import GGUFModel
    from models.llama import TensorParallelLlama
    from models.loading import fuses_qkv

    length, steps = (16, 8) if quick else (32, 64)
    model = GGUFModel(path)
    ctx = length + (rounds + 1) * steps + 8
    devices, decoders, first, described = [], {}, {}, {}
    llama = None
    try:
        for name, (env, options) in variants.items():
            dev = MetaDevice(ProcessCluster(ClusterConfig(workers=workers, blas_threads=1, env=env)))
            devices.append(dev)
            fuse = fuses_qkv(model, "native")
            net = TensorParallelLlama(
                dev,
                model.config,
                model.native,
                ctx,
                fuse_qkv=fuse,
                activations=ACTIVATIONS,
                **({"cache_types": default_caches()} | options),
            )
            _, best = net.prefill([list(prompt_ids(model, length)[0])], 0, pool=1)
            first[name] = int(best.numpy().reshape(-1)[0])
            decoders[name] = worker_driven(dev, net, best.numpy().astype(np.int32).reshape(1, 1), length)
            decoders[name](2)  # captured and warm
            described[name] = describe(net) if describe else ""
        model.release_pages()
        if have_llama_cpp():
            llama = warm_llama_cpp(path, length, steps, workers)
        seconds = alternate(decoders, llama, rounds, steps)
    finally:
        if llama is not None:
            llama.close()
        for dev in devices:
            dev.close()
    return {"seconds": seconds, "first": first, "described": described, "steps": steps}


def alternate(decoders: dict, llama, rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds per token of each of `decoders` (name -> worker_driven's run) and of llama.cpp's
    warm child (or None) over `rounds` rounds of `steps` tokens, ours in an order that turns every
    round, llama.cpp last in each: the side-by-side benchmarks' loop (bench/heads.py,
    bench/fusion.py), whose pairs paired_ratio compares."""
    seconds: dict[str, list[float]] = {name: [] for name in [*decoders, "llama.cpp"]}
    for r in range(rounds):
        order = list(decoders)
        for name in order[r % len(order) :] + order[: r % len(order)]:
            seconds[name].append(decoders[name](steps)[0])
        if llama is not None:
            seconds["llama.cpp"].append(llama.ask("decode"))
    return seconds


def greedy_settings():
    """A worker-driven generation's settings for one greedy sequence that never stops early."""
    from split_state.sampling import Rule, generator_state
    from transport.protocol import GenerateSettings

    return GenerateSettings(Rule(), tuple(generator_state(np.random.default_rng(0))), (), (False,))


def worker_driven(dev, net, token: np.ndarray, pos: int, again: bool = False):
    """A function of `steps` giving the seconds per token of greedy generation driven by the
    workers (as `generate` runs it): one Generate for `steps` tokens, the workers feeding each
    token back themselves; and of those, the time outside the program. Positions go on from
    `pos`, one run after the other; `again`: every run decodes from `pos` + 1."""
    step, _ = net.capture_decode(token, np.array([[pos]]), build=lambda logits: list(logits.top_k(1)))
    at = [pos + 1]

    def run(steps: int) -> tuple[float, float]:
        settings = greedy_settings()
        start = time.perf_counter()
        info = dev.generate(step, token, np.array([at], np.int32), steps, settings, lambda k, t: True)
        wall = (time.perf_counter() - start) / info["steps"]
        at[0] += 0 if again else info["steps"]
        return wall, wall - info["program_s"] / info["steps"]

    return run


def cache_types_at(path: str, position: int, steps: int) -> list[dict]:
    """Decode tokens/s after a `position`-token prompt, 1 worker, Q4_1 weights kept, with float32
    and with float16 KV caches, and llama.cpp (whose cache is float16) on the same file and
    prompt with 1 thread: where attention reads more of the cache than of the weights."""
    from models.gguf_model import GGUFModel
    from models.llama import TensorParallelLlama
    from models.loading import fuses_qkv

    model = GGUFModel(path)
    rows = []
    for types in (("f32", "f32"), ("f16", "f16")):
        with MetaDevice(ProcessCluster(ClusterConfig(workers=1, blas_threads=1))) as dev:
            fuse = fuses_qkv(model, "native")
            ctx = position + 8 * steps
            net = TensorParallelLlama(
                dev, model.config, model.native, ctx, cache_types=types, fuse_qkv=fuse, activations=ACTIVATIONS
            )
            _, best = net.prefill([list(prompt_ids(model, position)[0])], 0, pool=1)
            token = best.numpy().astype(np.int32).reshape(1, 1)
            driven = worker_driven(dev, net, token, position)
            step_s = float(np.median([driven(2 * steps)[0] for _ in range(2)]))
        rows.append({"cache": "/".join(types), "position": position, "decode_tok_s": 1 / step_s})
    if have_llama_cpp() and (llama := llama_cpp(path, position, steps, 1, 1)):
        rows.append({"cache": "llama.cpp (f16)", "position": position, "decode_tok_s": llama["decode_tok_s"]})
    return rows


def long_context(path: str, contexts: tuple[int, ...], length: int, steps: int, rounds: int = 3) -> list[dict]:
    """Decode at the same positions with caches preallocated to each context (one worker, float32
    weights): a model per context, all loaded at once, decoding `steps` tokens driven by the
    workers in turn for `rounds` rounds, every other round in reverse order (medians; each
    ratio to the first context the median of the rounds' ratios). One context after the other,
    a busy neighbour had made the second row 0.83-0.88x in runs whose rounds in turn gave 1.00x;
    the medians of three rounds in turn still gave 0.85-1.06x."""
    from models.gguf_model import GGUFModel
    from models.llama import TensorParallelLlama
    from models.loading import fuses_qkv

    model = GGUFModel(path)
    tokens = [list(prompt_ids(model, length)[0])]
    steps = max(1, min(steps, (min(contexts) - length - 2) // rounds))  # every round's positions fit
    with contextlib.ExitStack() as stack:
        driven = {}
        for ctx in contexts:
            dev = stack.enter_context(MetaDevice(ProcessCluster(ClusterConfig(workers=1, blas_threads=1))))
            net = TensorParallelLlama(dev, model.config, model.weight, ctx, fuse_qkv=fuses_qkv(model, "f32"))
            _, best = net.prefill(tokens, 0, pool=1)
            driven[ctx] = worker_driven(dev, net, best.numpy().astype(np.int32).reshape(1, 1), length)
        times = alternating_rounds(contexts, rounds, lambda ctx: driven[ctx](steps)[0])
    return context_rows(times)


def alternating_rounds(kinds: tuple, rounds: int, timed) -> dict:
    """{kind: [seconds of each round]}: `timed(kind)` for every kind in each of `rounds` rounds,
    every other round in reverse order (a neighbour's slow spell then lands on each side alike)."""
    times: dict = {kind: [] for kind in kinds}
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            times[kind].append(timed(kind))
    return times


def context_rows(times: dict[int, list[float]]) -> list[dict]:
    """The --contexts rows from {ctx: seconds per token of each round}, the first context first:
    tokens/s (the rounds' median) and the ratio to the first context's (the median of the
    rounds' ratios: below 1 where a context decodes slower)."""
    first = next(iter(times.values()))
    return [
        {"ctx": ctx, "decode_tok_s": 1 / float(np.median(t)), "vs_first": paired_ratio(first, t)}
        for ctx, t in times.items()
    ]


def resident_memory(path: str, workers: int, tokens: int) -> dict:
    """Coordinator and worker resident set sizes over `tokens` greedy tokens generated by the
    workers: after the first hundred and at the end (a leak shows as growth)."""
    from models.gguf_model import GGUFModel
    from models.llama import TensorParallelLlama
    from models.loading import fuses_qkv

    def rss() -> dict[str, float]:
        out = {"coordinator": _rss_kib() / 1024}
        for rank, s in dev.stats().items():
            out[f"worker {rank}"] = s["rss_kib"] / 1024
        return out

    model = GGUFModel(path)
    with MetaDevice(ProcessCluster(ClusterConfig(workers=workers, blas_threads=1))) as dev:
        net = TensorParallelLlama(dev, model.config, model.weight, tokens + 16, fuse_qkv=fuses_qkv(model, "f32"))
        step, (_, indices, *_) = net.capture_decode(
            np.array([[1]], np.int32), np.array([[0]]), build=lambda logits: list(logits.top_k(1))
        )
        token = indices.numpy().astype(np.int32).reshape(1, 1)
        settings = greedy_settings()
        samples, pos, last = {}, 1, []
        for upto in (100, tokens - 1):  # generation driven by the workers, in two runs
            dev.generate(
                step, token, np.array([[pos]], np.int32), upto - pos, settings, lambda k, t: last.append(t) or True
            )
            token, pos = np.array([[last[-1][0]]], np.int32), upto
            samples[upto] = rss()
        first, last = samples[100], samples[tokens - 1]
        return {
            "tokens": tokens,
            "at_100_mib": first,
            "at_end_mib": last,
            "growth": {k: last[k] / first[k] - 1 for k in first},
        }


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def model_path(model: str = "", synthetic: str = "", folder: str = "results") -> str | None:
    """The GGUF file to measure: `model`, or a synthetic file of shape `synthetic` (Q4_1 layers,
    Q8_0 embedding, SmolLM2's vocabulary or one made here; made once into `folder` and reused),
    or the packaged SmolLM2; None (said on stderr) where none is to be had."""
    from models.gguf_model import ModelMissing, default_model_path

    if model:
        return model
    try:
        if synthetic:
            return synthetic_path(synthetic, folder=folder)
        return str(default_model_path())
    except ModelMissing as exc:
        print(f"llm benchmark skipped: {exc}", file=sys.stderr)
        return None


def synthetic_path(
    shape: str, weights: str = "q4_1", embedding: str = "q8_0", layers: int | None = None, folder: str = "results"
) -> str:
    """A synthetic GGUF file (models/synthetic.py) of `shape` (`layers` of them where given),
    its matrices `weights`, its tied embedding `embedding`, SmolLM2's vocabulary or one made
    here: made once into `folder`, reused after."""
    from dataclasses import replace

    from models import synthetic as synth

    cut = f"-{layers}l" if layers else ""
    kinds = weights if (weights, embedding) == ("q4_1", "q8_0") else f"{weights}-{embedding}"
    target = Path(folder) / f"synthetic-{shape}{cut}-{kinds}.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        sizes = synth.SHAPES[shape] if not layers else replace(synth.SHAPES[shape], layers=layers)
        vocabulary = synth.default_vocabulary() or synth.BYTES
        made = synth.write(target, synth.Recipe(sizes, weights, embedding), vocabulary)
        print(f"made {target} ({made.bytes / 2**20:.0f} MiB in {made.seconds:.1f} s)", file=sys.stderr)
    return str(target)


def run(
    quick: bool,
    counts: list[int],
    contexts: list[int],
    rss_tokens: int,
    weights: tuple[str, ...] = ("f32",),
    rounds: int = 3,
    cache_position: int = 0,
    path: str | None = None,
) -> dict | None:
    path = path or model_path()
    if path is None:
        return None
    length, steps = (32, 8) if quick else (128, 24)
    rows = []
    for n in counts:
        # llama.cpp warm beside ours for the decode rounds (paired), loaded before ours starts
        paired = warm_llama_cpp(path, length, DRIVEN_PER_STEP * steps, n) if have_llama_cpp() and not quick else None
        with ThreadedChild(reference_child, (path, length, steps), n) as reference, contextlib.ExitStack() as stack:
            if paired is not None:
                stack.callback(paired.close)
            # loaded before ours starts: its loading would slow our first prompt on a small machine
            reference.ask("ready")
            for kind in weights:
                mine = ours(path, n, length, steps, weights=kind, reference=reference, rounds=rounds, llama=paired)
                mine |= fresh_models(path, n, length, kind, reference, rounds if quick else max(rounds, FIRST_ROUNDS))
                rows.append(_row(n, kind, length, mine))
        if have_llama_cpp():  # the goal of quantized decode: llama.cpp on the same file and threads
            llama = llama_cpp(path, length, DRIVEN_PER_STEP * steps, n, rounds)
            for row in rows[-len(weights) :] if llama else ():
                row |= {f"llama_cpp_{k}": v for k, v in llama.items()}
                row["vs_llama_cpp"] = row["ours_decode_tok_s"] / llama["decode_tok_s"]
    results = {"model": Path(path).name, "rows": rows}
    if cache_position:
        results["cache_types"] = cache_types_at(path, cache_position, steps)
    if contexts:
        # 32: a short prompt fits every cache
        results["contexts"] = long_context(path, tuple(contexts), 32, steps, max(rounds, CONTEXT_ROUNDS))
    if rss_tokens:
        results["memory"] = resident_memory(path, max(counts), rss_tokens)
    return results


def llama_cpp(path: str, length: int, steps: int, threads: int, rounds: int) -> dict | None:
    """llama.cpp's prefill and decode tokens per second on `threads` threads: medians of `rounds`
    rounds, right after our rows of as many workers (not interleaved with them). None, said on
    stderr, when its child fails (a llama-cpp-python build that does not run on this CPU dies of
    SIGILL at its first step): our rows stand without it."""
    try:
        with ThreadedChild(llama_cpp_child, (path, length, steps, threads), 1) as child:
            prefill = [child.ask("prefill") for _ in range(rounds)]
            decode = [child.ask("decode") for _ in range(rounds)]
    except ChildFailed as exc:
        llama_cpp_skipped(exc)
        return None
    return {"prefill_tok_s": length / float(np.median(prefill)), "decode_tok_s": 1 / float(np.median(decode))}


def _row(n: int, weights: str, length: int, mine: dict) -> dict:
    b = mine["breakdown"]
    base = {"prefill_s": mine["reference_prefill_s"], "decode_step_s": mine["reference_decode_step_s"]}
    return {
        "workers": n,
        "weights": weights,
        "rounds": mine["rounds"],
        "stored_mib": mine["stored_mib"],
        "peak_rss_mib": mine["peak_rss_mib"],
        "prompt_tokens": length,
        "numpy_prefill_tok_s": length / base["prefill_s"],
        "ours_prefill_tok_s": length / mine["first_prefill_s"],
        "numpy_decode_tok_s": 1 / base["decode_step_s"],
        "ours_decode_tok_s": 1 / mine["driven_step_s"],
        "decode_ratio": mine["decode_ratio"] or base["decode_step_s"] / mine["driven_step_s"],
        "decode_tokens": mine["decode_tokens"],
        "replayed_decode_tok_s": 1 / mine["decode_step_s"],
        "driven_outside_program_ms": mine["driven_outside_program_s"] * 1e3,
        "first_rounds": mine["first_rounds"],
        "prefill_ratio": mine["first_ratio"] or base["prefill_s"] / mine["first_prefill_s"],
        "warm_up_s": mine["warm_up_s"],
        "ours_prefill_warmed_tok_s": length / mine["warmed_prefill_s"],
        "prefill_warmed_ratio": mine["warmed_ratio"] or base["prefill_s"] / mine["warmed_prefill_s"],
        "ours_prefill_again_tok_s": length / mine["prefill_again_s"],
        "prefill_again_ratio": mine["again_ratio"] or base["prefill_s"] / mine["prefill_again_s"],
        "step_ms": mine["decode_step_s"] * 1e3,
        "profiled_step_ms": mine["profiled_step_s"] * 1e3,
        "profiling_cost_ms": (mine["profiled_step_s"] - mine["decode_step_s"]) * 1e3,
        "compute_ms": b["compute_ms"],
        "collectives_ms": b["transfer_ms"] + b["wait_ms"],
        "executor_ms": b["executor_ms"],
        "dispatch_ms": b["dispatch_ms"],
        "breakdown": b,
        "plans": mine["plans"],
        "llama_cpp_paired_decode_tok_s": 1 / paired if (paired := mine["llama_cpp_paired_decode_s"]) else None,
        "vs_llama_cpp_paired": mine["vs_llama_cpp_paired"],
    }


def show(results: dict | None) -> None:
    if results is None:
        return
    cols = [
        "workers",
        "weights",
        "stored MiB",
        "peak RSS MiB",
        "prefill tok/s numpy",
        "ours",
        "ratio",
        "warmed",
        "ratio",
        "warm-up s",
        "again",
        "ratio",
    ]
    cols += ["decode tok/s numpy", "ours", "ratio", "outside ms"]
    cols += ["replayed", "step ms", "profiled", "compute", "collectives", "executor", "dispatch"]
    rows = [
        [
            r["workers"],
            r["weights"],
            r["stored_mib"],
            r["peak_rss_mib"],
            r["numpy_prefill_tok_s"],
            r["ours_prefill_tok_s"],
            r["prefill_ratio"],
            r["ours_prefill_warmed_tok_s"],
            r["prefill_warmed_ratio"],
            r["warm_up_s"],
            r["ours_prefill_again_tok_s"],
            r["prefill_again_ratio"],
            r["numpy_decode_tok_s"],
            r["ours_decode_tok_s"],
            r["decode_ratio"],
            r["driven_outside_program_ms"],
            r["replayed_decode_tok_s"],
            r["step_ms"],
            r["profiled_step_ms"],
            r["compute_ms"],
            r["collectives_ms"],
            r["executor_ms"],
            r["dispatch_ms"],
        ]
        for r in results["rows"]
    ]
    title = f"{results['model']}: {results['rows'][0]['prompt_tokens']}-token prefill and greedy decode, "
    print(table(title + "N workers (1 BLAS thread each) vs NumPy reference with N threads", cols, rows))
    print(
        f"  stored and peak RSS: the busiest worker's, its KV caches preallocated to {RSS_CTX} positions"
        " (the quantized weights' target: the file's size / N + 200 MiB)"
    )
    print(
        "  prefill ours: the first prompt of a model loaded anew (its embedding's, one layer's and the head's"
        " graphs, plans, program loads and first chain included); warmed: the first prompt of a model loaded"
        " anew and warmed up (every prompt length's programs loaded, not run; warm-up s: its time, at load);"
        " both against the reference's prefill just before it, the medians of each pair's ratio over"
        f" {results['rows'][0]['first_rounds']} models of each kind; again: a second prompt of the same"
        " length, its chain replayed, the median of its ratio to the reference's prefill just before it"
        f" over {results['rows'][0]['rounds']} alternating rounds of {AGAIN_PAIRS} pairs (numpy: their median)"
    )
    numpy_tokens, our_tokens = results["rows"][0]["decode_tokens"]
    print(
        f"  decode: tokens over the seconds of a run of them, numpy's {numpy_tokens}, then ours {our_tokens}"
        " driven by the workers (one Generate, each token fed back on the workers), in each round, every round"
        f" from the prompt's end (as llama.cpp's {our_tokens}); the ratio"
        " the median of the rounds' (numpy's run over ours right after it);"
        " outside ms: of each of its tokens, the time outside the program (choosing, reporting, the stop flag);"
        " replayed:"
        " tok/s of the coordinator replaying the captured step token by token (one round trip per token, the"
        " token read back with it), whose median step ms follows, untimed on the workers; profiled: every kernel"
        " timed, for the breakdown after it"
    )
    if any("vs_llama_cpp" in r for r in results["rows"]):
        rows = [
            [r["workers"], r["weights"], r["llama_cpp_prefill_tok_s"], r["llama_cpp_decode_tok_s"]]
            + [r["ours_decode_tok_s"], r["vs_llama_cpp"]]
            + [r.get("llama_cpp_paired_decode_tok_s") or "-", r.get("vs_llama_cpp_paired") or "-"]
            for r in results["rows"]
            if "vs_llama_cpp" in r
        ]
        cols = ["workers", "weights", "llama.cpp prefill tok/s", "llama.cpp decode tok/s", "ours decode", "ratio"]
        cols += ["paired: llama.cpp decode", "ratio"]
        print(table("llama.cpp (llama-cpp-python) on the same file, N threads", cols, rows))
        print(
            "  llama.cpp decode and ratio: its rounds after ours (medians); paired: its decode right after each of our"
            " decode rounds, its median and the median of the rounds' ratios (a busy neighbour slows a pair alike)"
        )
    if "cache_types" in results:
        rows = [[r["cache"], r["position"], r["decode_tok_s"]] for r in results["cache_types"]]
        title = "decode after a long prompt, 1 worker (Q4_1 kept) / llama.cpp 1 thread, by KV cache type"
        print(table(title, ["cache K/V", "position", "tok/s"], rows))
    if "contexts" in results:
        rows = [[r["ctx"], r["decode_tok_s"], r["vs_first"]] for r in results["contexts"]]
        print(
            table(
                "decode at the same positions, cache preallocated to --ctx (1 worker)", ["ctx", "tok/s", "ratio"], rows
            )
        )
    if "memory" in results:
        m = results["memory"]
        rows = [[k, m["at_100_mib"][k], m["at_end_mib"][k], m["growth"][k]] for k in m["at_100_mib"]]
        title = f"resident memory over {m['tokens']} decode tokens"
        print(table(title, ["process", "MiB at 100", "MiB at end", "growth"], rows))


def main(argv: list[str] | None = None) -> int:
    def measure(args):
        rounds = 1 if args.quick else args.rounds
        path = model_path(args.model, args.synthetic)
        if path is None:
            return None
        return run(
            args.quick,
            args.workers,
            args.contexts,
            args.rss_tokens,
            tuple(args.weights),
            rounds,
            args.cache_position,
            path,
        )

    return cli(__doc__, "llm", measure, show, argv, options)


def options(ap) -> None:
    from models.synthetic import SHAPES

    ap.add_argument("--model", default="", help="a GGUF file (default: the packaged SmolLM2)")
    ap.add_argument(
        "--synthetic",
        default="",
        choices=["", *SHAPES],
        help="a synthetic file of this shape instead (Q4_1 layers; made once under results/)",
    )
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds with the reference (1 with --quick)")
    ap.add_argument("--contexts", type=int, nargs="*", default=[256, 8192], help="decode rows per cache length")
    ap.add_argument("--rss-tokens", type=int, default=0, help="decode this many tokens watching resident memory")
    ap.add_argument(
        "--cache-position",
        type=int,
        default=2048,
        help="decode after a prompt this long with float32 and float16 KV caches (0: skip)",
    )
    ap.add_argument(
        "--weights",
        nargs="+",
        choices=("f32", "native"),
        default=["f32", "native"],
        help="rows per weight kind: float32, or the types split_state/quant.py knows kept in the file's blocks",
    )


if __name__ == "__main__":
    sys.exit(main())
