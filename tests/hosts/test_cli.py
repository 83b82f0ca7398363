"""``pdlink hosts``: up (a detached holder keeps the set between commands), run (the command's exit
status comes back), wire (faults and profiles while the set runs), list, down (everything gone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hostbed import require_hosts
from pdlink.testing import hosts as hostsmod
from poll import wait_until


def pdlink(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdlink", "hosts", *args], capture_output=True, text=True, timeout=120)


def test_up_run_wire_down() -> None:
    require_hosts()
    name = f"test{os.getpid()}"
    up = pdlink("up", "2", "--profile", "rack", "--name", name)
    assert up.returncode == 0, up.stderr
    try:
        assert "198.18.0.1" in up.stdout and "198.18.0.2" in up.stdout
        with open(os.path.join(hostsmod.state_root(), "cli", f"{name}.json")) as f:
            record = json.load(f)
        state_dir = os.path.join(hostsmod.state_root(), record["set"])
        with open(os.path.join(state_dir, "state.json")) as f:
            anchors = [pid for pid, _ in json.load(f)["anchors"]]
        assert name in pdlink("list").stdout
        addr = pdlink("run", "1", "--name", name, "--", "ip", "-o", "addr", "show", "eth0")
        assert addr.returncode == 0 and "198.18.0.2/15" in addr.stdout, addr.stderr
        assert pdlink("run", "--name", name, "0", "--", "sh", "-c", "exit 7").returncode == 7
        assert pdlink("up", "2", "--name", name).returncode == 1  # one set per name
        for wire in (["--partition", "0", "1"], ["--heal"], ["--profile", "wan", "--hosts", "1"], ["--link-down", "0"]):
            done = pdlink("wire", "--name", name, *wire)
            assert done.returncode == 0, (wire, done.stderr)
        bad = pdlink("wire", "--name", name, "--isolate", "5")
        assert bad.returncode == 1 and "out of range" in bad.stderr
    finally:
        down = pdlink("down", "--name", name)
    assert down.returncode == 0, down.stderr
    wait_until(lambda: all(hostsmod._start_time(p) is None for p in anchors), 30, "every anchor gone")
    assert not os.path.exists(state_dir)
    assert pdlink("run", "0", "--name", name, "--", "true").returncode == 1
    assert name not in pdlink("list").stdout
