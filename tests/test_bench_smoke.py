"""The benchmark keeps working: a tiny run of bench/bench_transfer.py (no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_smoke_runs_and_verifies(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_transfer.py"), "--smoke",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["pdlink"]) == {"cma", "tcp"} or set(results["pdlink"]) == {"tcp"}
    for run in results["pdlink"].values():  # every kind of measurement produced a number
        for key in ("pull_bulk", "push_bulk", "pull_small", "lat_4k_us", "link_ms", "switch_role_ms", "sweep"):
            assert key in run, key
        assert run["pull_bulk"]["cpu_s_per_gb"] >= 0  # /proc tick resolution: tiny smoke runs may read 0
    # the C ceiling ran (one stream, what a tcp link uses, and two) and is reported beside pdlink's tcp pull
    assert {k: (c["streams"], c["median"] > 0, c["cpu_s_per_gb"] > 0) for k, c in results["c_tcp"].items()} == {
        "1": (1, True, True), "2": (2, True, True)}
    text = (tmp_path / "results.txt").read_text()
    assert "pdlink benchmark" in text and "x C TCP 1 stream" in text


def test_authentication_benchmark_smoke_runs_and_verifies(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_auth.py"), "--smoke", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads((tmp_path / "auth.json").read_text())
    assert "tcp" in results["runs"] and results["hmac"]["median"] > 0
    for modes in results["runs"].values():
        assert set(modes) == {"plain", "sealed", "integrity"}
        for run in modes.values():
            for key in ("pull", "push", "pull_4k_us", "link_ms"):
                assert key in run, key
