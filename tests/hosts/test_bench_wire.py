"""bench/bench_wire.py keeps working: a smoke run (no timing asserted, only that every row came)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hostbed import require_hosts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_wire_smoke(tmp_path: object) -> None:
    require_hosts()
    out = os.path.join(str(tmp_path), "rows.json")
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "bench_wire.py"), "--smoke", "--json", out],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    with open(out) as f:
        rows = json.load(f)
    assert [r["config"] for r in rows] == ["veth", "relay", "dc"]
    assert all(r["iperf_p1_mbit"] > 0 and r["ping_n"] > 0 for r in rows)
