"""Run as a program by tests/hosts/test_hosts.py with an interpreter from a virtual environment
under /tmp: makes one host and prints what ``host.python`` runs there (its sys.executable and
sys.prefix), so the test sees that the host's private /tmp still shows the interpreter."""

from __future__ import annotations

import subprocess

from pdlink.testing.hosts import Hosts


def main() -> None:
    with Hosts(1) as hosts:
        run = subprocess.run(
            [hosts[0].python, "-c", "import sys; print(sys.executable, sys.prefix)"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if run.returncode != 0:
            raise SystemExit(f"host.python failed: {run.stderr}")
        print(run.stdout.strip())


if __name__ == "__main__":
    main()
