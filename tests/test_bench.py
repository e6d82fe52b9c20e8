"""The benchmark suite runs end to end in --quick mode and writes its JSON and plots."""

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(480)
def test_quick_suite_writes_json_and_plots(tmp_path):
    # 146 s on a quiet 2-core machine, 189 s while a build ran beside it: a bound with room
    out = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "bench", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=450,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "summary (cpu" in out.stdout and "where a step's time goes" in out.stdout
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["quick"] is True and results["memcpy_GBps"] > 0
    assert {r["transport"] for r in results["transport"]["throughput"]} == {"ipc", "tcp"}
    assert {r["workers"] for r in results["collectives"]} == {2, 4}
    assert set(results["tp_matmul"]) == {"1", "2", "4"}
    for tp in results["tp_matmul"].values():
        for row in tp["rows"]:
            assert row["ours_ms"] > 0 and row["numpy_ms"] > 0
            assert row["breakdown"]["compute_ms"] > 0
    decode = results["decode"]
    assert decode["plans"] == 1 and decode["ours_ms"] > 0 and decode["numpy_ms"] > 0
    for name in ("bandwidth_vs_size.png", "step_time_vs_workers.png", "tp_vs_single.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_peers_that_are_not_installed_are_reported_not_fatal(monkeypatch):
    from bench import peers

    monkeypatch.setitem(sys.modules, "torch", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    assert "pip install -e '.[peers]'" in peers.missing_torch()
    assert peers.mpirun() is None


@pytest.mark.timeout(60)
def test_peer_group_runs_commands_in_processes_that_stay_up():
    from bench import peers
    from bench.tp_matmul import numpy_child_server

    with peers.PeerGroup(numpy_child_server, 1, threads=1) as group:
        assert group.ask("load", 4, 8, 6) == [None]
        first, second = group.ask("mlp", 3), group.ask("mlp", 2)  # the same process, arrays kept
        assert len(first[0]) == 3 and len(second[0]) == 2 and all(t > 0 for t in first[0] + second[0])
    assert not any(proc.is_alive() for proc in group.procs)


def test_a_step_breakdown_measures_every_part_and_says_how_much_it_explains():
    from bench.tp_matmul import breakdown
    from meta.serialized import Clock

    timings = {
        0: {"compute_s": 0.010, "comm_s": 0.004, "wait_s": 0.001, "program_s": 0.015, "handled_s": 0.016},
        1: {"compute_s": 0.011, "comm_s": 0.002, "wait_s": 0.0, "program_s": 0.014, "handled_s": 0.015},
    }
    clock = Clock(inside_s=0.020, round_trip_s=0.018)
    b = breakdown(0.0215, timings, clock, graph_s=0.001)
    # worker 0 answered last: its parts, then round trip 18 - handled 16, coordinator 20 - 18, graph 1
    expected = {
        "compute_ms": 10,
        "transfer_ms": 3,
        "wait_ms": 1,
        "executor_ms": 1,
        "worker_other_ms": 1,
        "control_ms": 2,
        "coordinator_ms": 2,
        "graph_ms": 1,
    }
    for name, ms in expected.items():
        assert b[name] == pytest.approx(ms), name
    assert b["explained"] == pytest.approx(21 / 21.5)


def test_the_gpu_check_without_a_gpu_says_so_in_one_line_and_fails():
    from meta.backends import local_backends

    if local_backends()["cuda"].device_count:
        pytest.skip("a CUDA GPU is here: bench/gpu_check.py runs for real (see bench/README.md)")
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and done.stdout == ""
    said = "gpu_check: no CUDA GPU was found (the cuda backend sees no device here)"
    assert done.stderr.strip().splitlines() == [said]


@pytest.mark.parametrize("vocabulary", ["bytes", "packaged"])
def test_the_gpu_checks_prefill_prompt_is_its_token_count_in_the_files_own_vocabulary(tmp_path, vocabulary):
    """The decode table's prefill prompt: at most 128 tokens and most of them, whether the
    synthetic file took the packaged SmolLM2's vocabulary or a byte-level one (whose ~5x more
    tokens ran the old fixed text past the 512-position context on the first GPU run)."""
    from bench.gpu_check import PREFILL_TOKENS, long_prompt
    from models import synthetic as synth
    from models.gguf_model import GGUFModel

    path = tmp_path / "m.gguf"
    source = synth.default_vocabulary() if vocabulary == "packaged" else synth.BYTES
    synth.write(path, synth.Recipe(synth.SHAPES["tiny"], "q4_0", "q8_0"), vocabulary=source)
    count = len(GGUFModel(path).tokenizer.encode(long_prompt(path)))
    assert PREFILL_TOKENS * 3 // 4 <= count <= PREFILL_TOKENS


def test_the_gpu_check_keeps_what_failed_and_why():
    """A failed check's FAILED and assertion lines go in the JSON and under the table: on a GPU
    session's machine, gone after it, the count of failures alone says nothing."""
    from bench import gpu_check

    script = "print('..F'); print('E   AssertionError: refused'); print('FAILED t.py::x - boom'); raise SystemExit(1)"
    ok, last, _ = gpu_check._command([sys.executable, "-c", script], 60)
    assert not ok and last == "FAILED t.py::x - boom"
    ok_too, _, _ = gpu_check._command([sys.executable, "-c", "print('fine')"], 60)
    results = {"workers": 2, "checks": [{"check": "c", "ok": False, "seconds": 1.0, "detail": last}]}
    results["failures"], gpu_check._failures[:] = list(gpu_check._failures), []
    assert ok_too and [f["lines"] for f in results["failures"]] == [["E   AssertionError: refused", last]]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        gpu_check.show(results)
    assert "  E   AssertionError: refused" in out.getvalue()


def test_the_gpu_check_counts_what_a_decode_step_runs_outside_its_graphs_and_says_why():
    """bench/gpu_check.py's decode row from the workers' stats: the decode step is the program of
    the generation the workers drove (where none says: the one that replayed most, which a
    prefill's one-layer program can be); each op outside its graphs with how often a run calls it
    (a set said "attention" for one layer's or for every layer's); each failed capture's reason
    once, from the first worker that had it. On made stats, as `launch.py generate --stats`
    writes them."""
    from bench import gpu_check

    def stats(per_run, refused, driven=None):
        return {"graphs": {"replays": 9, "per_run": per_run, "refused": refused, "driven": driven}}

    # a prefill's one-layer program, run once a layer, replays more than the decode step
    prefill = {"graphs": 2, "outside": ["attention"] * 30, "replays": 96}
    decode = {"graphs": 4, "outside": ["cast", "attention", "set_rows", "attention", "qmatmul_add"], "replays": 90}
    workers = [
        stats({"7": prefill}, {"set_rows": "another worker's reason", "attention": "ValueError: read on the host"}),
        stats(
            {"7": prefill, "9": decode},
            {"set_rows": "CUDARuntimeError: operation not permitted when capturing"},
            driven="9",
        ),
    ]
    step = gpu_check.decode_step_graphs(workers)
    assert step == {
        "graphs": 4,
        "outside": {"cast": 1, "attention": 2, "set_rows": 1, "qmatmul_add": 1},
        "refused": {
            "set_rows": "another worker's reason",
            "attention": "ValueError: read on the host",
        },
    }
    row = {"file": "f", "weights": "native", "outside_counts": step["outside"], "refused": step["refused"]}
    assert gpu_check._outside(row) == "attention x2 cast qmatmul_add set_rows"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        gpu_check.show({"workers": 1, "checks": [], "decode": [row]})
    assert (
        "f native: attention runs outside the graphs, its capture failed: ValueError: read on the host"
        in out.getvalue()
    )
    assert gpu_check.decode_step_graphs([stats({}, {})]) == {"graphs": None, "outside": {}, "refused": {}}
    # stats without `driven` (a worker that drove no generation): the program that replayed most
    assert gpu_check.decode_step_graphs([stats({"7": prefill, "9": decode}, {})])["graphs"] == 2


def test_the_gpu_check_runs_only_the_steps_named(monkeypatch):
    """`bench/gpu_check.py --only decode hosts` runs those steps and no other (a device session's
    15 minutes rerun what failed): every other step's entry point here raises if called."""
    from bench import collectives, gpu_check, qgemv

    def never(*args, **kwargs):
        raise AssertionError("a step that was not named ran")

    for name in ("_command", "_generate", "threads_table"):
        monkeypatch.setattr(gpu_check, name, never)
    monkeypatch.setattr(collectives, "run", never)
    monkeypatch.setattr(gpu_check, "decode_table", lambda quick: [{"ok": True, "tokens_equal_cpu": True}])
    monkeypatch.setattr(collectives, "across_hosts", lambda rounds: [{"bytes": 4096, "ratio": 1.25}])

    def variant(product, ksplit, rows, gb_s):
        return {"product": product, "ksplit": ksplit, "rows": rows, "gb_s": gb_s, "sums_agree": True}

    made = [variant("wo", 16, 32, 100.0), variant("wo", 64, 16, 900.0), variant("wo", 8, 64, 50.0)]
    made += [variant("down", 16, 32, 300.0), variant("down", 32, 8, 200.0)]
    monkeypatch.setattr(qgemv, "measure", lambda args: {"rows": made})
    result = gpu_check.run(True, only=frozenset({"decode", "hosts", "qgemv"}))
    assert [c["check"] for c in result["checks"]] == [
        "decode table: runs, tokens == cpu tokens",
        "all-reduce, 2 hosts x 2 CPU workers (tcp + shm)",
        "qgemv thread blocks, 1.7B products (Q4_1)",
    ]
    assert result["ok"] and result["checks"][1]["detail"] == "4 KiB 1.25x the floor"
    # each product: the workers' thread block (the first row), then the fastest
    assert result["checks"][2]["detail"] == "wo 100 GB/s, 64x16 900, down 300 GB/s, 16x32 300"


def test_the_attention_bench_times_both_kernels_and_holds_them_to_each_other(monkeypatch, capsys):
    """bench/attention.py on the CuPy stand-in (the tiled kernels' twins, the shared kernel's
    NumPy products) at small chunks: a row a chunk with both times, the scores' scratch, and
    the results agreeing; a row whose results differ says NO. Then gpu_check's step reports it."""
    from bench import attention, gpu_check
    from tests.cupy_standin import install

    install(monkeypatch)
    monkeypatch.setattr(gpu_check, "gpus", lambda: 1)
    monkeypatch.setattr(attention, "CHUNK", 20)
    monkeypatch.setattr(attention, "CTX", 96)
    monkeypatch.setattr(attention, "ENDS", (12, 70, 96))
    found = attention.measure(type("Args", (), {"quick": True})())
    rows = found["rows"]
    assert [(r["tokens"], r["end"]) for r in rows] == [(12, 12), (20, 70)] and all(r["agree"] for r in rows), rows
    assert all(r["ours_us"] > 0 and r["shared_us"] > 0 for r in rows)
    # the shared kernel's scores over the used positions, a bucket's multiple (KV_BUCKET 32): 96
    assert rows[1]["scores_scratch_bytes"] == 2 * 32 * 20 * 96 * 4 and rows[1]["max_abs_diff"] < 1e-4
    attention.show(found)
    assert "ours vs shared" in capsys.readouterr().out
    rows[0]["agree"] = False
    monkeypatch.setattr(attention, "measure", lambda args: {"rows": rows})
    result = gpu_check.run(True, only=frozenset({"attention"}))
    (check,) = result["checks"]
    assert not check["ok"] and check["detail"].startswith("12 tokens to 12 ")


@pytest.mark.parametrize("script", ["qgemv.py", "attention.py"])
def test_a_gpu_kernel_bench_without_a_gpu_says_so_and_measures_nothing(script):
    from tests.cuda_on_host import real_gpu

    if real_gpu():
        pytest.skip(f"a CUDA GPU is here: bench/{script} measures for real")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and f"bench/{script} measures nothing here: no CUDA GPU" in done.stderr
    assert done.stdout.startswith("skipped: no CUDA GPU")


def dies_without_a_word(requests, replies) -> None:
    """A benchmark child that dies as a crashing library kills it (no reply, no exception)."""
    import os
    import signal

    requests.get()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(60)
def test_a_benchmark_child_that_dies_is_reported_at_once_not_waited_for():
    """A child that dies before it answers (llama-cpp-python built for another CPU dies of
    SIGILL at its first step) ends the question within seconds, naming how it died, instead of
    holding the benchmark until the child's 30-minute deadline."""
    import time

    from bench.report import ChildFailed, ThreadedChild

    with ThreadedChild(dies_without_a_word, (), 1, timeout=45, settle=0) as child:
        start = time.monotonic()
        with pytest.raises(ChildFailed, match="dies_without_a_word.*SIGKILL"):
            child.ask("prefill")
        assert time.monotonic() - start < 10


@pytest.mark.parametrize(
    "how, amx, hinted",
    [("SIGSEGV", True, True), ("SIGSEGV", False, False), ("SIGILL", True, False), ("status 1", True, False)],
)
def test_a_llama_cpp_crash_in_its_amx_kernels_says_how_to_build_without_them(capsys, how, amx, hinted):
    """llama.cpp's AMX kernels segfault on some machines (llama.cpp issue 20824): where its
    child died of SIGSEGV and the build has them, the bench says how to build llama-cpp-python
    without them; any other death (or a build without AMX) is said in the one line as before."""
    from bench.llm import llama_cpp_skipped
    from bench.report import ChildFailed

    line = "CPU : AVX2 = 1 | AVX512 = 1 | " + ("AMX_INT8 = 1 | " if amx else "") + "REPACK = 1 |"
    llama_cpp_skipped(ChildFailed(f"child llama_cpp_child died with {how} before it answered"), lambda: line)
    err = capsys.readouterr().err
    assert err.startswith(f"llama.cpp skipped: child llama_cpp_child died with {how}")
    assert ("-DGGML_NATIVE=OFF" in err and "issue 20824" in err) == hinted, err
    if hinted:  # the build it asks for: the AVX-512 sets those CPUs have, nothing of AMX
        flags = err.split("CMAKE_ARGS='")[1].split("'")[0]
        assert "-DGGML_AVX512_VNNI=ON" in flags and "AMX" not in flags, flags


def test_the_hosts_bench_holds_each_split_to_the_one_host_run_whose_arithmetic_it_repeats():
    """bench/hosts.py's judge: a row split's text against one host's row split of as many
    workers; a layer split of one-worker groups against one worker alone (its text differs from
    the two-worker row split's, and was shown as a mismatch); one of larger groups against one
    host's layer split of as many workers in groups as large (a group of two is not two workers'
    row split bit for bit: held to that, the 2 x 2 rows read NO over 128 tokens); the one-host
    runs the others are held to are shown as references; decode against one host's row split of
    as many workers."""
    from bench.hosts import judge

    def run(path, split, workers, group, text, tps):
        return {"path": path, "split": split, "workers": workers, "group": group, "text": text, "decode_tps": tps}

    rows = [
        run("one host, 1 worker", "row", 1, 1, "alone", 100.0),
        run("one host, shm", "row", 2, 2, "pair", 160.0),
        run("one host, shm", "layer", 2, 1, "alone", 95.0),
        run("one host, tcp", "row", 2, 2, "pair", 150.0),
        run("one host, 4 workers, shm", "row", 4, 4, "four", 200.0),
        run("one host, 4 workers in 2 groups, shm", "layer", 4, 2, "groups", 90.0),
        run("2 hosts, relay 0.2 ms", "row", 2, 2, "pair", 32.0),
        run("2 hosts, relay 0.2 ms", "layer", 2, 1, "alone", 80.0),
        run("2 hosts x 2, kernel forwards, direct", "layer", 4, 2, "groups", 50.0),
        run("2 hosts x 2, relay 0.2 ms, direct", "layer", 4, 2, "pair", 40.0),
        run("2 hosts x 2, kernel forwards, direct", "row", 4, 4, "other", 20.0),
    ]
    judge(rows)
    assert [r["same_text"] for r in rows] == [True, True, True, True, True, True, True, True, True, False, False]
    assert [r["text_of"] for r in rows] == [
        None,
        None,
        "1 by rows",
        "2 by rows",
        None,
        None,
        "2 by rows",
        "1 by rows",
        "4 by layers of 2",
        "4 by layers of 2",
        "4 by rows",
    ]
    assert [r["decode_vs_one_host"] for r in rows] == [
        1.0,
        1.0,
        95 / 160,
        150 / 160,
        1.0,
        90 / 200,
        32 / 160,
        80 / 160,
        50 / 200,
        40 / 200,
        0.1,
    ]


def test_a_prefill_ratio_is_the_median_of_its_pairs_ratios():
    """Each pair: the reference's prefill, then ours right after it. A neighbour that slowed one
    pair slows both sides of it: the ratio of the medians (1.11 here) mixes sides of different pairs."""
    from bench.report import paired_ratio

    reference = [1.0, 2.0, 3.0, 4.0]
    ours = [0.8, 2.5, 2.0, 5.0]  # ratios 1.25, 0.8, 1.5, 0.8
    assert paired_ratio(reference, ours) == pytest.approx((0.8 + 1.25) / 2)
    assert paired_ratio([], []) is None


def test_context_rows_alternate_their_order_and_say_a_slower_context_is_slower():
    """bench/llm.py's --contexts rows: rounds in alternating order, each context's ratio to the
    first the median of the rounds' ratios of tokens per second (under 1 where it is slower)."""
    from bench.llm import alternating_rounds, context_rows

    order = []
    seconds = {256: [0.05, 0.05, 0.10, 0.05], 8192: [0.10, 0.11, 0.20, 0.04]}  # per round, per context
    times = alternating_rounds((256, 8192), 4, lambda ctx: order.append(ctx) or seconds[ctx][order.count(ctx) - 1])
    assert order == [256, 8192, 8192, 256, 256, 8192, 8192, 256]
    first, long = context_rows(times)
    assert (first["ctx"], first["vs_first"], first["decode_tok_s"]) == (256, 1.0, pytest.approx(20.0))
    # rounds' ratios of tokens/s: 0.5, 0.4545, 0.5, 1.25; the ratio of the medians would be 0.476
    assert long["ctx"] == 8192 and long["vs_first"] == pytest.approx(0.5)
    assert long["decode_tok_s"] == pytest.approx(1 / 0.105)


@pytest.mark.timeout(180)
def test_the_head_split_bench_decodes_both_splits_side_by_side(monkeypatch):
    """bench/heads.py --quick on SmolLM2 and 2 workers: the chosen split (query heads 5 | 4) and
    whole KV groups (6 | 3) both decode, each with its ratio to whole groups (llama.cpp left out:
    the run compares our two splits)."""
    from bench import heads, llm
    from bench.llm import model_path

    monkeypatch.setattr(llm, "have_llama_cpp", lambda: False)
    results = heads.run(quick=True, workers=2, rounds=1, path=model_path())
    rows = {r["split"]: r for r in results["rows"]}
    assert rows["chosen"]["query_heads"] == "5 | 4" and rows["whole KV groups"]["query_heads"] == "6 | 3"
    assert all(r["decode_tok_s"] > 0 and r["vs_whole_groups"] > 0 for r in rows.values())
    assert rows["whole KV groups"]["vs_whole_groups"] == 1 and results["llama_cpp_decode_tok_s"] is None


@pytest.mark.timeout(180)
def test_the_fusion_bench_decodes_fused_and_unfused_side_by_side(monkeypatch):
    """bench/fusion.py --quick on SmolLM2 and 2 workers: every pattern fused and rope_set_rows left
    unfused (the second cluster's workers told by META_TP_UNFUSED), both decoding from the same
    first token, each with its ratio to the unfused one; --swap starts the unfused one first."""
    from bench import fusion, llm
    from bench.llm import model_path

    monkeypatch.setattr(llm, "have_llama_cpp", lambda: False)
    for swap in (False, True):
        results = fusion.run(quick=True, workers=2, rounds=1, path=model_path(), unfused="rope_set_rows", swap=swap)
        rows = {r["variant"]: r for r in results["rows"]}
        assert list(rows) == ["every pattern fused", "unfused: rope_set_rows"]
        assert all(r["decode_tok_s"] > 0 and r["vs_unfused"] > 0 for r in rows.values())
        assert rows["unfused: rope_set_rows"]["vs_unfused"] == 1 and results["same_first_token"]
        assert results["built_first"] == ("unfused: rope_set_rows" if swap else "every pattern fused")
    with pytest.raises(ValueError, match="no pattern"):
        fusion.run(quick=True, workers=2, rounds=1, path=model_path(), unfused="rope_set_row")


@pytest.mark.timeout(300)
def test_the_formats_bench_decodes_and_prefills_a_file_of_each_type(monkeypatch, tmp_path):
    """bench/formats.py --quick on tiny synthetic files, one per type (made into the folder given,
    named by shape, layers and types, and reused): each type's row has our decode and prefill
    (llama.cpp left out), and the file is of that type."""
    from bench import formats, threads
    from models.gguf_file import GGUFFile

    monkeypatch.setattr(threads, "have_llama_cpp", lambda: False)
    results = formats.run(True, ["q4_0", "q8_0"], [1], 1, "tiny", 1, folder=str(tmp_path))
    assert [r["type"] for r in results["rows"]] == ["q4_0", "q8_0"]
    assert all(r["ours_decode_tok_s"] > 0 and r["ours_prefill_tok_s"] > 0 for r in results["rows"])
    assert all(r["ours_decode_gb_s"] > 0 and r["plain_read_gb_s"] > 0 for r in results["rows"])
    assert "llama_cpp_decode_tok_s" not in results["rows"][0]
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made == ["synthetic-tiny-1l-q4_0-q4_0.gguf", "synthetic-tiny-1l-q8_0-q8_0.gguf"]
    tensors = GGUFFile(tmp_path / made[0]).tensors
    assert {tensors[name].tensor_type.name for name in ("blk.0.ffn_down.weight", "token_embd.weight")} == {"Q4_0"}


def test_a_streams_gaps_count_a_write_of_several_tokens_as_one_delivery():
    """bench/serve.py's stall figures: tokens 0.1 ms apart came in one write of the server's, so
    the median gap before is the one between writes (50 ms here), not the ~0 inside them; the
    longest gap after the start is the longest between any two tokens."""
    from bench.serve import _gaps

    writes = [0.0, 0.05, 0.10, 0.15, 0.20]  # three tokens a write, then a stall of 0.3 s
    times = [w + k * 1e-4 for w in writes for k in range(3)] + [0.5, 0.5001]
    longest, median = _gaps([times], start=0.21, end=1.0)
    assert longest == pytest.approx(0.5 - 0.2002)
    assert median == pytest.approx(0.05 - 0.0002)


def test_a_client_counts_row_is_its_rounds_medians_and_paired_ratios():
    """bench/serve.py's client table: each count's aggregate tokens/s and first-token waits are
    its rounds' medians, and "x one stream" the median of each round's ratio to the one-client
    round beside it (worked out by hand below)."""
    from bench.serve import client_row

    def round_of(wall, *ttfts):
        return {"wall_s": wall, "streams": [{"tokens": 64, "ttft_s": t} for t in ttfts]}

    alone = [round_of(0.5, 0.04), round_of(1.0, 0.05), round_of(0.4, 0.03)]  # 128, 64, 160 tok/s
    four = [round_of(1.0, 0.1, 0.2, 0.3, 0.4), round_of(1.28, *[0.5] * 4), round_of(0.64, 0.1, 0.1, 0.2, 0.2)]
    row = client_row(4, four, alone)  # 256, 200, 400 tok/s: ratios 2, 3.125, 2.5
    assert row["aggregate_tokens_per_s"] == pytest.approx(256)
    assert row["speedup_over_one"] == pytest.approx(2.5)  # not 256 / 128 (medians' ratio) = 2
    # the 12 waits pooled: 0.1 x3, 0.2 x3, 0.3, 0.4, 0.5 x4; the upper median (index 6)
    assert row["ttft_median_s"] == pytest.approx(0.3) and row["ttft_max_s"] == pytest.approx(0.5)
    assert row["tokens"] == 256 and row["rounds"] == 3
    assert client_row(1, alone, alone)["speedup_over_one"] == pytest.approx(1.0)
    assert client_row(4, four, None)["speedup_over_one"] is None


@pytest.mark.timeout(240)
def test_the_two_hosts_all_reduce_bench_runs_each_way_and_its_floor():
    """bench/collectives.py --hosts: 2 hosts x 2 workers told apart by loopback addresses, each
    way of the small all-reduce really taken (the routes its workers report), the floor's parts
    measured."""
    from bench import collectives

    (row,) = collectives.across_hosts(sizes=(1 << 10,), runs=1, rounds=1)
    assert row["routes"] == {
        "host by host, shm inside": "tcp/tcp+shm",
        "host by host, tcp inside": "tcp",
        "direct": "tcp",
    }
    for name in collectives.HOST_STEPS:
        assert row[name] > 0 and len(row[f"{name} rounds"]) == 1
    assert row["floor_us"] == row["tcp_2_us"] + row["shm_2_us"] > 0
    assert row["ratio"] == row["host by host, shm inside"] / row["floor_us"]
    collectives.show_across_hosts([row])


@pytest.mark.parametrize("output", [None, "q8_0"])
def test_a_decode_tokens_bytes_are_every_tensor_but_an_untied_files_embedding(tmp_path, output):
    """bench/read_speed.py's bytes a decode token reads, against the gguf library's own reading
    of the file: every tensor's bytes, less the token embedding's where the file has an output
    head of its own (a token reads one row of it); a tied embedding is the head, counted."""
    import gguf

    from bench.read_speed import token_bytes
    from models import synthetic as synth
    from models.gguf_model import GGUFModel

    path = tmp_path / "tiny.gguf"
    synth.write(path, synth.Recipe(synth.SHAPES["tiny"], "q4_0", "q8_0", output=output))
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    assert ("output.weight" in sizes) == (output is not None)
    expected = sum(sizes.values()) - (sizes["token_embd.weight"] if output else 0)
    assert token_bytes(GGUFModel(path)) == expected


def test_a_plain_read_touches_its_pages_and_times_each_thread_share(monkeypatch):
    """bench/read_speed.py's plain read: its buffer is at least LEAST_BYTES and written (an
    untouched page reads the shared zero page: no memory speed), split into one part a thread
    covering it once; and it times a read of every part."""
    from bench import read_speed

    monkeypatch.setattr(read_speed, "LEAST_BYTES", 1 << 20)
    read = read_speed.PlainRead(1000, 3)
    assert read.nbytes == 1 << 20
    assert np.all(read.buffer == 1)
    assert len(read.parts) == 3 and sum(p.nbytes for p in read.parts) == read.nbytes
    assert all(np.shares_memory(p, read.buffer) for p in read.parts)
    summed = []
    monkeypatch.setattr(read_speed, "read_through", lambda part: summed.append((part.ctypes.data, part.nbytes)))
    assert read.seconds() > 0
    assert sorted(summed) == sorted((p.ctypes.data, p.nbytes) for p in read.parts)
    assert read.gb_per_s(0.5) == pytest.approx(read.nbytes / 0.5 / 1e9)
