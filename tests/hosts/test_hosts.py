"""pdlink.testing.hosts: what a host is (its own network, pid and mount namespaces, a private /tmp),
what runs in it (functions and commands), and that a set leaves nothing behind (close, exception,
SIGKILL of its owner). The wire's shaping and faults: test_wire.py."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid

import pytest

from hostbed import require_hosts
from pdlink.testing.hosts import PROFILES, Hosts, HostsUnavailable, Wire, unavailable_reason
from peer import Peer
from peers import hosts as hp
from poll import wait_until


def machine_network() -> dict[str, str]:
    """What the machine's own network namespace shows (interfaces, routes, named namespaces)."""
    out = {}
    for name, argv in {"links": ["ip", "-o", "link"], "routes": ["ip", "route"], "netns": ["ip", "netns"]}.items():
        run = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        out[name] = run.stdout
    return out


def same_network(before: dict[str, str], after: dict[str, str]) -> bool:
    """Whether the machine's namespace shows what it showed (the assertion names what changed)."""
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    assert not changed, changed
    return True


def gone(pids: list[int]) -> bool:
    return all(not os.path.exists(f"/proc/{p}") or _zombie(p) for p in pids)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_profiles_and_wire_validation() -> None:
    assert PROFILES["loopback"] == Wire()
    assert PROFILES["rack"] == Wire(rate_mbit=1000, delay_us=50)
    assert PROFILES["dc"] == Wire(rate_mbit=500, delay_us=200, loss=1e-5)
    assert PROFILES["wan"] == Wire(rate_mbit=100, delay_us=10_000, loss=1e-3)
    assert PROFILES["dc"].replace(loss=0.0) == Wire(rate_mbit=500, delay_us=200)
    with pytest.raises(ValueError):
        Wire(loss=1.0)
    with pytest.raises(ValueError):
        Wire(mtu=100)


def test_addresses_routes_and_interfaces(two_hosts: Hosts) -> None:
    assert [h.ip for h in two_hosts] == ["198.18.0.1", "198.18.0.2"]
    assert len(two_hosts) == 2 and two_hosts[-1] is two_hosts[1]
    for h in two_hosts:
        links = h.run(["ip", "-o", "link"], text=True)
        assert links.returncode == 0, links.stderr
        names = sorted(line.split(":")[1].strip().split("@")[0] for line in links.stdout.splitlines())
        assert names == ["eth0", "lo"]
        assert "state UP" in links.stdout.splitlines()[0] or "LOOPBACK,UP" in links.stdout
        routes = h.run(["ip", "route"], text=True).stdout
        assert "default" not in routes
        assert routes.split()[:3] == ["198.18.0.0/15", "dev", "eth0"]


def test_hosts_reach_each_other_by_ip(two_hosts: Hosts) -> None:
    port = 7001
    server = two_hosts[1].spawn(hp.listen_once, two_hosts[1].ip, port, 30.0)
    wait_until(
        lambda: two_hosts[1].run(["ss", "-ltn", f"sport = :{port}"], text=True).stdout.count("LISTEN"), 30, "listening"
    )
    assert two_hosts[0].run(hp.exchange, two_hosts[1].ip, port) == b"hi"
    assert server.result(30) == "accepted"


def test_host_cannot_reach_the_machines_or_another_hosts_loopback(two_hosts: Hosts) -> None:
    with socket.socket() as machine:  # a service of the test process on the machine's loopback
        machine.bind(("127.0.0.1", 0))
        machine.listen(1)
        port = machine.getsockname()[1]
        assert hp.connect_error("127.0.0.1", port) is None  # the machine itself reaches it
        assert two_hosts[0].run(hp.connect_error, "127.0.0.1", port) == "ConnectionRefusedError"
    # host 1 listens on its own loopback: host 1 reaches it, host 0 does not (by 127.0.0.1 or host 1's ip)
    server = two_hosts[1].spawn(hp.listen_once, "127.0.0.1", 7002, 30.0)
    wait_until(lambda: "LISTEN" in two_hosts[1].run(["ss", "-ltn", "sport = :7002"], text=True).stdout, 30, "listening")
    assert two_hosts[0].run(hp.connect_error, "127.0.0.1", 7002) == "ConnectionRefusedError"
    assert two_hosts[0].run(hp.connect_error, two_hosts[1].ip, 7002) == "ConnectionRefusedError"
    assert two_hosts[1].run(hp.exchange, "127.0.0.1", 7002) == b"hi"
    assert server.result(30) == "accepted"
    # nothing beyond the subnet is routable from a host
    assert two_hosts[0].run(hp.connect_error, "10.0.0.1", 80, 2.0) == "OSError"


def test_private_tmp_over_the_machines(two_hosts: Hosts) -> None:
    token = uuid.uuid4().hex
    with tempfile.NamedTemporaryFile("w", dir="/tmp", prefix=f"pdl-{token}-", suffix=".txt") as machine_file:
        machine_file.write("from the machine")
        machine_file.flush()
        listing = two_hosts[0].run(hp.write_tmp, f"host0-{token}", "mine")
        assert f"host0-{token}" in listing
        assert os.path.basename(machine_file.name) in listing  # the machine's /tmp shows through
        assert two_hosts[0].run(hp.read_file, machine_file.name) == "from the machine"
    assert not os.path.exists(f"/tmp/host0-{token}")  # the machine never sees it
    assert two_hosts[1].run(hp.read_file, f"/tmp/host0-{token}") is None  # nor does another host
    assert two_hosts[0].run(hp.read_file, f"/tmp/host0-{token}") == "mine"


def test_pid_namespace_shared_within_a_host_separate_across(two_hosts: Hosts) -> None:
    a, b = two_hosts[0].run(hp.identity), two_hosts[0].run(hp.identity)
    c = two_hosts[1].run(hp.identity)
    me = hp.identity()
    assert a["pid_ns"] == b["pid_ns"] and a["net_ns"] == b["net_ns"] and a["mnt_ns"] == b["mnt_ns"]
    assert len({a["pid_ns"], c["pid_ns"], me["pid_ns"]}) == 3
    assert len({a["net_ns"], c["net_ns"], me["net_ns"]}) == 3
    token = f"pdl-sleeper-{uuid.uuid4().hex}"
    sleeper = two_hosts[0].spawn([sys.executable, "-c", "import time; time.sleep(60)", token])
    try:
        seen = wait_until(lambda: two_hosts[0].run(hp.processes_with, token), 30, "host 0 sees its sleeper")
        assert len(seen) == 1
        assert two_hosts[1].run(hp.processes_with, token) == []
    finally:
        sleeper.kill()
        sleeper.wait(30)


def test_run_and_spawn_functions_and_commands(two_hosts: Hosts) -> None:
    h = two_hosts[0]
    assert h.run(hp.add, 2, b=3) == 5
    with pytest.raises(ValueError, match="from the host"):
        h.run(hp.fail, "from the host")
    proc = h.spawn(hp.sleep, 0.2)
    proc.join(30)
    assert proc.exitcode == 0 and not proc.is_alive()
    assert proc.result(1) == 0.2
    failed = h.spawn(hp.fail, "spawned")
    failed.join(30)
    assert failed.exitcode == 1
    with pytest.raises(ValueError, match="spawned"):
        failed.result(1)
    done = h.run(["sh", "-c", "echo out; echo err >&2; exit 7"], text=True)
    assert (done.returncode, done.stdout, done.stderr) == (7, "out\n", "err\n")
    popen = h.spawn(["sh", "-c", "exit 3"])
    assert popen.wait(30) == 3
    assert h.run(["cat"], input=b"through stdin").stdout == b"through stdin"
    with pytest.raises(TimeoutError):
        h.run(hp.sleep, 30.0, timeout=0.5)


def test_killing_the_entry_pid_kills_what_it_started(two_hosts: Hosts) -> None:
    """SIGKILL of a host.python pid (what multiprocessing and Peer see) kills the interpreter inside."""
    token = f"pdl-python-{uuid.uuid4().hex}"
    popen = subprocess.Popen([two_hosts[0].python, "-c", "import time; time.sleep(60)", token])
    wait_until(lambda: two_hosts[0].run(hp.processes_with, token), 30, "the interpreter runs in host 0")
    popen.send_signal(signal.SIGKILL)
    assert popen.wait(30) == -signal.SIGKILL
    wait_until(lambda: two_hosts[0].run(hp.processes_with, token) == [], 30, "the interpreter died with its entry pid")
    # an exit status and a signal come back as the program's own
    assert subprocess.run([two_hosts[0].python, "-c", "raise SystemExit(5)"]).returncode == 5
    term = subprocess.run([two_hosts[0].python, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"])
    assert term.returncode == -signal.SIGTERM


def test_machine_namespace_unchanged_and_teardown_on_exception() -> None:
    require_hosts()
    before = machine_network()
    with pytest.raises(ZeroDivisionError):
        with Hosts(3) as hosts:
            anchors = hosts.anchor_pids()
            state_dir = hosts.state_dir
            assert hosts[2].run(["true"]).returncode == 0
            assert same_network(before, machine_network())  # nothing in the machine's namespace while it runs
            1 / 0  # noqa: B018
    assert gone(anchors)
    assert not os.path.exists(state_dir)
    assert same_network(before, machine_network())


def test_teardown_on_sigkill_of_the_owner() -> None:
    require_hosts()
    before = machine_network()
    owner = Peer("hosts-owner")
    try:
        made = owner.call(hp.make_hosts, 2, "loopback")
        assert os.path.isdir(made["state_dir"])
        assert not gone(made["anchors"])
    finally:
        owner.kill()
    wait_until(lambda: gone(made["anchors"]), 30, "the kernel ends every anchor with the owner")
    assert same_network(before, machine_network())
    with Hosts(1):  # the next set made removes the stale state directory
        assert not os.path.exists(made["state_dir"])


def test_a_private_tmp_does_not_hide_an_interpreter_under_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """CI clones and makes its virtual environment under /tmp: a set made by an interpreter there
    still runs that interpreter in its hosts."""
    require_hosts()
    base = tempfile.mkdtemp(prefix="pdl-venv-", dir="/tmp")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", base], check=True, timeout=120)
        venv_python = os.path.join(base, "bin", "python")
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p) + os.pathsep + here)
        run = subprocess.run(
            [venv_python, os.path.join(here, "peers", "hosts_owner.py")],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == f"{base}/bin/python {base}"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_unavailable_says_why_without_the_capabilities() -> None:
    """Without CAP_SYS_ADMIN and CAP_NET_ADMIN (what root has) the bed says why; run through setpriv
    with both dropped from the bounding set (uid 0 kept, so the interpreter stays reachable)."""
    require_hosts()
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to drop capabilities")
    import pdlink.testing.hosts as module

    run = subprocess.run(
        ["setpriv", "--inh-caps=-all", "--bounding-set=-sys_admin,-net_admin", sys.executable, module.__file__],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1, (run.stdout, run.stderr)
    assert "needs root: no CAP_SYS_ADMIN and CAP_NET_ADMIN" in run.stdout
    assert unavailable_reason() is None
    assert isinstance(HostsUnavailable("x"), RuntimeError)


def test_multiprocessing_spawns_into_a_host_through_host_python(two_hosts: Hosts) -> None:
    """What tests/peer.py does to place a peer on a host: multiprocessing's spawn executable set to
    host.python (process-wide, so it is put back at once)."""
    import multiprocessing as mp
    import multiprocessing.spawn

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    previous = multiprocessing.spawn.get_executable()
    multiprocessing.spawn.set_executable(two_hosts[1].python)
    try:
        proc = ctx.Process(target=hp.report_identity, args=(queue,))
        proc.start()
    finally:
        multiprocessing.spawn.set_executable(previous)
    try:
        seen = queue.get(timeout=60)
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        proc.kill()
        proc.join(10)
    assert seen["net_ns"] == two_hosts[1].run(hp.identity)["net_ns"]
    assert seen["pid_ns"] == two_hosts[1].run(hp.identity)["pid_ns"]
    assert seen["pid_ns"] != hp.identity()["pid_ns"]
