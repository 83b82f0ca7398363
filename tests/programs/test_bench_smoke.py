"""The benchmarks keep working: tiny runs of bench/bench_transfer.py, bench_auth.py, bench_small.py,
bench_pull_blocks.py, bench_hixl.py, bench_fleet.py (on loopback), bench_switch.py, bench_cancel.py,
bench_handoff.py, bench_hosts.py and bench_tp.py (no timing is asserted)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from hostbed import require_hosts
from where import REPO

ROOT = str(REPO)


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
    # the C-level TCP ceilings ran (bench/tcp_ceiling.c blocking and busy-polling, and iperf3 where it is
    # installed; one stream, what a tcp link uses, and two) and pdlink's tcp pull is held to the best one-stream one
    kinds = {(c["tool"], c["mode"], c["streams"]) for c in results["tcp_ceilings"]}
    expected = {("C", mode, n) for mode in ("block", "spin") for n in (1, 2)}
    if shutil.which("iperf3"):
        expected |= {("iperf3", "stream", 1), ("iperf3", "stream", 2)}
    else:
        assert "skipped iperf3: not installed" in r.stdout
    assert kinds == expected
    assert all(c["median"] > 0 and c["cpu_s_per_gb"] > 0 for c in results["tcp_ceilings"])
    text = (tmp_path / "results.txt").read_text()
    assert "pdlink benchmark" in text and "x the best 1-stream TCP ceiling" in text


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


def test_small_transfer_benchmark_smoke_runs_and_verifies(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_small.py"), "--smoke", "--no-peers",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads((tmp_path / "small.json").read_text())
    assert {run["transport"] for run in results["pdlink"]} in ({"cma", "tcp"}, {"tcp"})
    for run in results["pdlink"]:  # every kind of measurement produced a number (each verified its bytes)
        for key in ("prepared_256K", "descs_256K", "prepared_4K", "descs_4K"):
            assert run[key]["median"] > 0 and run[key]["us_per_desc"] > 0, key
        for key in ("prepared_lat_4k_us", "pull_blocks_lat_4k_us"):
            assert run[key]["p50"] > 0, key
    assert results["memcpy"]["blocks_4K"]["us_per_desc"] > 0 and results["import"]["pdlink"]["median"] > 0
    assert "pdlink small-transfer benchmark" in (tmp_path / "small.txt").read_text()


def test_head_sliced_pull_benchmark_smoke_runs_and_verifies(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_tp.py"), "--smoke", "--no-peers",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads((tmp_path / "tp.json").read_text())
    assert {run["transport"] for run in results["pdlink"]} in ({"cma", "tcp"}, {"tcp"})
    for run in results["pdlink"]:  # each kind produced a number (each verified its bytes first)
        for key in ("sliced_rows", "sliced_list", "whole", "sliced_prepared", "whole_prepared"):
            assert run[key]["median"] > 0, key
    assert "pdlink head-sliced pull benchmark" in (tmp_path / "tp.txt").read_text()


def test_pull_blocks_benchmark_runs_and_verifies():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_pull_blocks.py"), "smoke"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    rows = [line.split(" p50 ")[0] for line in lines if " p50 " in line]
    tcp = ["smoke tcp pull_blocks 4 KiB", "smoke tcp pull_cache 4 KiB"]
    cma = ["smoke cma pull_blocks 4 KiB", "smoke cma pull_cache 4 KiB", "smoke cma process_vm_readv 4 KiB"]
    assert rows in ([*cma, *tcp], tcp), r.stdout


def test_hixl_benchmark_runs_and_verifies(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_hixl.py"), "--smoke", "--no-peers",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads((tmp_path / "hixl.json").read_text())
    for run in results["hixl"]:
        assert run["lat_4k_us"]["p50"] > 0
        for label in ("256K", "4K"):
            assert run[f"read_{label}"]["median"] > 0 and run[f"read_{label}"]["us_per_desc"] > 0
    assert "pdlink hixl benchmark" in (tmp_path / "hixl.txt").read_text()


def test_fleet_benchmark_smoke_runs_on_loopback(tmp_path):
    """bench/bench_fleet.py end to end on loopback: 4 instances, 3 storms, a kill; its summary,
    report and plot are written, every storm converged and no pull found a wrong byte."""
    pytest.importorskip("trustme", reason="bench_fleet.py needs the test extra: pip install '.[test]'")
    pytest.importorskip("uvicorn", reason="bench_fleet.py needs the server extra: pip install '.[server]'")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_fleet.py"), "--loopback", "-n", "4",
                        "--hosts", "2", "--storms", "3", "--kill-storm", "1", "--out", str(tmp_path),
                        "--plot", str(tmp_path / "fleet.png")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["converged"] == s["storms"] == 3 and s["not_converged"] == []
    assert s["pulls"]["wrong_bytes_pulls"] == 0 and s["pulls"]["after_failed"] == 0 and s["pulls"]["after_ok"] > 0
    assert s["faults"]["kill"]["storm"] == 1
    assert "time to converge p50" in (tmp_path / "report.txt").read_text()
    assert (tmp_path / "fleet.png").exists() or "matplotlib is not installed" in r.stdout


def test_switch_benchmark_smoke_runs_and_verifies(tmp_path):
    """bench/bench_switch.py --smoke: every path that runs here switched idle and under load, every
    pull under the switches ended exact or refused with LLM_ROLE_SWITCHING, the final pulls were
    verified, and the prefill ended ready with no pins at epoch 2 x switches."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_switch.py"), "--smoke", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads((tmp_path / "switch.json").read_text())
    ran = {path: run for path, run in results["paths"].items() if "skipped" not in run}
    assert set(ran) in ({"cma", "tcp"}, {"tcp"}, {"cma", "tcp", "ucx"}, {"tcp", "ucx"}), results["paths"]
    switches = results["config"]["switches"]
    for run in ran.values():
        assert run["idle"]["stats"]["n"] == run["loaded"]["stats"]["n"] == switches
        assert (run["loaded"]["epoch"], run["loaded"]["phase"], run["loaded"]["pins"]) == (2 * switches, "ready", 0)
        assert run["pulls"]["pulls"] > 0 and run["pulls"]["exact_after"] and not run["pulls"]["errors"]
    assert "| path | idle p50 |" in (tmp_path / "switch.txt").read_text()


def test_handoff_benchmark_smoke_runs_and_verifies(tmp_path):
    """bench/bench_handoff.py --smoke: on every path that runs here each cell (4 KiB and 256 KiB
    blocks, 1 and 16 per request) timed its bare pulls and its handoffs, every destination checked
    byte for byte by the bench (it fails otherwise), every offer released "claimed"."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_handoff.py"), "--smoke", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads((tmp_path / "handoff.json").read_text())
    ran = {path: run for path, run in results["paths"].items() if "skipped" not in run}
    assert set(ran) in ({"cma", "tcp"}, {"tcp"}, {"cma", "tcp", "ucx"}, {"tcp", "ucx"}), results["paths"]
    iters = results["config"]["iters"]
    for run in ran.values():
        assert set(run["cells"]) == {f"{s}x{c}" for s in (4096, 262144) for c in (1, 16)}
        for cell in run["cells"].values():
            assert len(cell["times"]["bare"]) == len(cell["times"]["handoff"]) == iters
            assert all(len(v) == iters for v in cell["parts"].values())
    assert "| path | block | blocks | bare | handoff | handoff / bare |" in (tmp_path / "handoff.txt").read_text()


def test_cancel_benchmark_smoke_runs_and_verifies(tmp_path):
    """bench/bench_cancel.py --smoke: on every path that runs here the sync and the async reads of
    each size completed byte-exact every rep, every cancel ended CANCELLED or DONE with each 1 MiB
    block of the destination old or new (the bench fails otherwise), and the link read exactly after."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_cancel.py"), "--smoke", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads((tmp_path / "cancel.json").read_text())
    ran = {path: run for path, run in results["paths"].items() if "skipped" not in run}
    assert set(ran) in ({"cma", "tcp"}, {"tcp"}, {"cma", "tcp", "ucx"}, {"tcp", "ucx"}), results["paths"]
    cfg = results["config"]
    for run in ran.values():
        assert set(run["slice_stats"]) == {str(size) for size in cfg["sizes"]}
        assert run["verified_exact"] == len(cfg["sizes"]) * 2 * cfg["reps"] + 1
        assert len(run["cancels"]) == cfg["cancels"]
        assert {c["status"] for c in run["cancels"]} <= {"CANCELLED", "DONE"}
    text = (tmp_path / "cancel.txt").read_text()
    assert "| path | size | sync GB/s |" in text
    assert "| path | p50 ms | p90 ms | p99 ms |" in text


def hosts_bench(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "hosts.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_hosts.py"), "--smoke", "--no-peers",
                        "--size-mib", "4", "--out", str(out), *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r, json.loads(out.read_text())


def check_hosts_row(r: subprocess.CompletedProcess, row: dict) -> None:
    """A row of bench/bench_hosts.py: pdlink's pull verified its bytes over tcp with each stream
    count, and iperf3 ran with the same number of streams (where it is installed)."""
    assert row["pdlink"]
    for streams, run in row["pdlink"].items():
        assert run["verified"] and run["read"]["median"] > 0
        assert {link["transport"] for link in run["links"]} == {"tcp"}
        assert run["rtt_ms"]["median"] > 0
        if shutil.which("iperf3"):
            assert row["iperf3"][streams]["median"] > 0
            assert row["ratios"][streams]["pdlink_over_iperf3_same_streams"] > 0
    if not shutil.which("iperf3"):
        assert "skipped iperf3: not installed" in r.stdout


def test_hosts_benchmark_smoke_runs_on_one_host(tmp_path):
    r, results = hosts_bench(tmp_path, "--same-host", "--streams", "1,2")
    row = results["profiles"]["same-host"]
    check_hosts_row(r, row)
    assert set(row["pdlink"]) in ({"1", "2"}, {"1"})  # {"1"}: a build without the streams option
    assert "| same-host |" in r.stdout


def test_hosts_benchmark_smoke_runs_across_two_hosts(tmp_path):
    require_hosts()  # skips with the reason, or fails under PDLINK_REQUIRE_HOSTS=1
    r, results = hosts_bench(tmp_path, "--profiles", "loopback")
    row = results["profiles"]["loopback"]
    check_hosts_row(r, row)
    for run in row["pdlink"].values():
        assert all(link["peer_address"].startswith("198.18.") for link in run["links"])
