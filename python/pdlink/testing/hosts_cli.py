"""``pdlink hosts``: emulated hosts (pdlink.testing.hosts) for people, kept between commands.

``pdlink hosts up N --profile dc`` starts a detached holder process that makes the set and keeps
it (its namespaces die with the holder, as with any owner); ``run I -- CMD`` runs a command inside
host I (its exit status is the command's); ``wire`` changes the wire or makes and heals faults;
``down`` stops the holder (the kernel then removes everything) and removes stale sets; ``list``
says what runs; ``check`` says whether hosts can be made here. Several sets live side by side under
``--name`` (default ``default``). A holder's record (``<state root>/cli/NAME.json``) and control
socket (``NAME.sock``, one JSON request a connection) sit next to the sets' state directories.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from pdlink.testing import hosts as hostsmod

UP_TIMEOUT_S = 120.0  # how long `up` waits for the holder to say ready


def _cli_dir() -> str:
    return os.path.join(hostsmod.state_root(), "cli")


def _record_path(name: str) -> str:
    return os.path.join(_cli_dir(), f"{name}.json")


def _read_record(name: str) -> dict[str, Any] | None:
    """The live holder's record for ``name``; a record whose holder is dead is removed (None)."""
    try:
        with open(_record_path(name)) as f:
            record: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return None
    if hostsmod._start_time(record["holder"]) != record["holder_start"]:
        _remove_record(name)
        return None
    return record


def _remove_record(name: str) -> None:
    for suffix in (".json", ".sock", ".log"):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(_cli_dir(), name + suffix))


def add_parser(sub: Any) -> None:
    hosts = sub.add_parser(
        "hosts",
        help="emulated hosts on this machine for reproducing cross-host failures by hand (docs/hosts.md)",
        description="Emulated hosts: network, pid and mount namespaces joined by one switch, with an emulated "
        "wire (docs/hosts.md). Needs root.",
    )
    hsub = hosts.add_subparsers(dest="hosts_command", required=True)
    up = hsub.add_parser("up", help="make N hosts, kept by a detached holder; prints each host and its address")
    up.add_argument("n", type=int)
    up.add_argument("--profile", default="loopback", choices=list(hostsmod.PROFILES))
    up.add_argument("--name", default="default", help="name of the set (several sets live side by side)")
    run = hsub.add_parser("run", help="run a command inside host I; its exit status is the command's")
    run.add_argument("index", type=int)
    run.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    run.add_argument("--name", default="default")
    wire = hsub.add_parser("wire", help="change the wire, or make or heal a fault, while the set runs")
    what = wire.add_mutually_exclusive_group(required=True)
    what.add_argument("--profile", choices=list(hostsmod.PROFILES))
    what.add_argument("--partition", nargs=2, type=int, metavar=("A", "B"))
    what.add_argument("--isolate", type=int, metavar="I")
    what.add_argument("--link-down", type=int, metavar="I")
    what.add_argument("--link-up", type=int, metavar="I")
    what.add_argument("--heal", action="store_true")
    wire.add_argument("--hosts", type=int, nargs="+", help="with --profile: only these hosts' links")
    wire.add_argument("--name", default="default")
    down = hsub.add_parser("down", help="tear the set down (and remove stale sets)")
    down.add_argument("--name", default="default")
    hsub.add_parser("list", help="the sets kept by holders")
    hsub.add_parser("check", help="whether hosts can be made here, and if not why")


def main(args: argparse.Namespace) -> int:
    command = args.hosts_command
    if command == "check":
        why = hostsmod.unavailable_reason()
        print("hosts can be made here" if why is None else f"hosts cannot be made here: {why}")
        return 0 if why is None else 1
    if command == "up":
        return _up(args.n, args.profile, args.name)
    if command == "run":
        return _run(args.name, args.index, args.argv)
    if command == "wire":
        request: dict[str, Any]
        if args.profile:
            request = {"op": "set_wire", "profile": args.profile, "hosts": args.hosts}
        elif args.partition:
            request = {"op": "partition", "a": args.partition[0], "b": args.partition[1]}
        elif args.isolate is not None:
            request = {"op": "isolate", "i": args.isolate}
        elif args.link_down is not None:
            request = {"op": "link_down", "i": args.link_down}
        elif args.link_up is not None:
            request = {"op": "link_up", "i": args.link_up}
        else:
            request = {"op": "heal"}
        return _control(args.name, request)
    if command == "down":
        return _down(args.name)
    if command == "list":
        return _list()
    raise AssertionError(command)


def _up(n: int, profile: str, name: str) -> int:
    why = hostsmod.unavailable_reason()
    if why is not None:
        print(f"pdlink hosts: cannot make hosts here: {why}", file=sys.stderr)
        return 1
    if _read_record(name) is not None:
        print(f"pdlink hosts: a set named {name!r} is up already (pdlink hosts down --name {name})", file=sys.stderr)
        return 1
    os.makedirs(_cli_dir(), exist_ok=True)
    log = os.path.join(_cli_dir(), f"{name}.log")
    with open(log, "w") as log_file:
        holder = subprocess.Popen(
            [sys.executable, "-m", "pdlink.testing.hosts_cli", "hold", str(n), profile, name],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            start_new_session=True,
        )
    assert holder.stdout is not None
    line = holder.stdout.readline().strip()
    holder.stdout.close()
    if line != "ready":
        holder.wait(UP_TIMEOUT_S)
        with open(log) as f:
            print(f"pdlink hosts: the holder failed: {f.read().strip()}", file=sys.stderr)
        return 1
    record = _read_record(name)
    assert record is not None
    print(f"{name}: {n} hosts, profile {profile}, held by pid {record['holder']} (pdlink hosts down --name {name})")
    for h in record["hosts"]:
        print(f"  host {h['index']}  {h['ip']}  pdlink hosts run {h['index']} -- CMD   (or: {h['enter']} CMD)")
    return 0


def _hold(n: int, profile: str, name: str) -> None:
    """The holder: make the set, publish its record, answer control requests until told to stop."""
    stop = False

    def on_term(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with hostsmod.Hosts(n, profile) as hosts:
        sock_path = os.path.join(_cli_dir(), f"{name}.sock")
        with contextlib.suppress(OSError):
            os.unlink(sock_path)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(sock_path)
        server.listen(8)
        server.settimeout(0.2)
        record = {
            "holder": os.getpid(),
            "holder_start": hostsmod._start_time(os.getpid()),
            "set": hosts.name,
            "profile": profile,
            "socket": sock_path,
            "hosts": [{"index": h.index, "ip": h.ip, "enter": h.enter, "python": h.python} for h in hosts],
        }
        tmp = _record_path(name) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, _record_path(name))
        print("ready", flush=True)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        try:
            while not stop:
                try:
                    conn, _ = server.accept()
                except (TimeoutError, InterruptedError):
                    continue
                with conn:
                    _serve_one(hosts, conn)
        finally:
            server.close()
            _remove_record(name)


def _read_line(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    """One newline-ended JSON message from ``sock`` (the CLI and the holder speak one per request),
    or what came before the peer closed; at most ``limit`` bytes."""
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def _serve_one(hosts: hostsmod.Hosts, conn: socket.socket) -> None:
    conn.settimeout(30)
    data = _read_line(conn)
    try:
        request = json.loads(data)
        op = request["op"]
        if op == "set_wire":
            hosts.set_wire(request["profile"], request.get("hosts"))
        elif op == "partition":
            hosts.partition(request["a"], request["b"])
        elif op == "isolate":
            hosts.isolate(request["i"])
        elif op == "link_down":
            hosts.link_down(request["i"])
        elif op == "link_up":
            hosts.link_up(request["i"])
        elif op == "heal":
            hosts.heal()
        else:
            raise ValueError(f"unknown request {op!r}")
        answer: dict[str, Any] = {"ok": True}
    except Exception as e:  # noqa: BLE001 - the answer carries it to the command
        answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    conn.sendall(json.dumps(answer).encode() + b"\n")


def _control(name: str, request: dict[str, Any]) -> int:
    record = _read_record(name)
    if record is None:
        print(f"pdlink hosts: no set named {name!r} is up (pdlink hosts up N)", file=sys.stderr)
        return 1
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(120)
        s.connect(record["socket"])
        s.sendall(json.dumps(request).encode() + b"\n")
        data = _read_line(s)
    answer = json.loads(data or b'{"ok": false, "error": "the holder closed the connection"}')
    if not answer["ok"]:
        print(f"pdlink hosts: {answer['error']}", file=sys.stderr)
        return 1
    return 0


def _run(name: str, index: int, argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "--name":  # `run I --name X -- CMD`: the name given after I
        name, argv = argv[1], argv[2:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("pdlink hosts run: no command (pdlink hosts run I -- CMD [ARGS...])", file=sys.stderr)
        return 2
    record = _read_record(name)
    if record is None:
        print(f"pdlink hosts: no set named {name!r} is up (pdlink hosts up N)", file=sys.stderr)
        return 1
    if not 0 <= index < len(record["hosts"]):
        print(f"pdlink hosts: no host {index} (the set has {len(record['hosts'])})", file=sys.stderr)
        return 1
    enter = record["hosts"][index]["enter"]
    sys.stdout.flush()
    os.execv(enter, [enter, *argv])  # the command's exit status and signals are ours


def _down(name: str) -> int:
    record = _read_record(name)
    code = 0
    if record is None:
        print(f"no set named {name!r} is up")
    else:
        with contextlib.suppress(ProcessLookupError):
            os.kill(record["holder"], signal.SIGTERM)
        deadline = time.monotonic() + 60
        while hostsmod._start_time(record["holder"]) == record["holder_start"]:
            if time.monotonic() > deadline:
                os.kill(record["holder"], signal.SIGKILL)
                code = 1
                break
            time.sleep(0.02)
        _remove_record(name)
        print(f"{name}: down")
    stale = hostsmod.remove_stale()
    if stale:
        print(f"removed stale sets: {', '.join(stale)}")
    return code


def _list() -> int:
    try:
        names = sorted(f[:-5] for f in os.listdir(_cli_dir()) if f.endswith(".json"))
    except OSError:
        names = []
    for name in names:
        record = _read_record(name)
        if record is not None:
            ips = ", ".join(h["ip"] for h in record["hosts"])
            print(
                f"{name}: {len(record['hosts'])} hosts ({ips}), profile {record['profile']}, holder {record['holder']}"
            )
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "hold":
        _hold(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        raise SystemExit("usage: python -m pdlink.testing.hosts_cli hold N PROFILE NAME (pdlink hosts up starts it)")
