"""The benchmark suite runs end to end in --quick mode and writes its JSON and plots."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_quick_suite_writes_json_and_plots(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "bench", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=230,
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
