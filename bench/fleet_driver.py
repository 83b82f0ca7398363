"""A fleet of ``pdlink serve`` instances and a controller that drives it with role storms.

Used by ``bench/bench_fleet.py`` (the 32-instance benchmark) and ``tests/fleet/test_fleet.py``
(the bounded CI test). Nothing here is timed against a target; it measures and records.

What runs:

* ``n`` real ``python -m pdlink serve`` processes, spread round-robin over ``h`` hosts: emulated
  hosts of ``pdlink.testing.hosts`` (each its own network namespace, joined by an emulated wire),
  or, with ``Loopback``, the machine's loopback with one address per "host" (``127.0.1.<h+1>``),
  no wire and no partitions. Every instance serves HTTPS with TLS 1.3 and **mutual TLS** on its
  management plane (one CA; the controller presents a client certificate), links its engines
  with a shared **link secret** (so every frame between engines is sealed), and has the test KV
  surface on (``POST /v1/pdlink/test/kv/pull``: the server pulls a peer's test cache and compares
  every byte with the pattern the peer fills it with; 500 ``Verification Failed`` when a byte
  differs). That test surface is the project's existing, documented way to move real KV between
  ``pdlink serve`` processes; nothing test-only was added for the fleet.
* Instance ``i`` (cluster id ``i + 1``) runs on host ``i % h``; the ``k``-th instance of a host
  uses management port ``mgmt_base + k`` (metrics on the same listener) and device id ``k``, so
  its KV port is ``kv_base + k`` on its host's address, as ``KvTransferConfig`` derives it.
* The controller is this process. It speaks to the management planes with
  ``pdlink.client.ManagementClient`` (MindIE's controller contract: a new TLS 1.3 connection per
  request, client certificate, no host-name check, ``result == "ok"``). With emulated hosts it
  sits on a host of its own (the last one, which runs no instance): the threads that talk to the
  fleet join that host's network namespace (``setns`` is per thread for network namespaces), so
  the controller's traffic crosses the emulated wire like everyone else's and a partition
  between two instance hosts does not cut it off.

A **storm** (``Fleet.storm``), as MindIE's controller switches roles (docs/server.md, "The client
and the CLI"; the spec's ``RoleSwitcher``): a new number of prefill instances is chosen (never the
previous one); only the difference switches role (``|P_new - P_old|`` instances, picked at
random from the side that shrinks); the switched instances get their new role first, then every
instance whose peer list changed gets the same role again with its new peers (every P has every D
as a peer and the other way round, as MindIE's controller assigns them, so with any switch every
instance is affected; one whose (role, peers) did not change is not posted). The controller then
polls ``GET /v1/status`` of every instance and, like MindIE's periodic synchronisation, posts the
expected role again to an instance that reports ``RoleUnknown`` (a restarted one), or that lists
an expected peer as ``failed : ...`` (at most once a second per instance). A storm has
**converged** when every instance is ``RoleReady`` with the expected ``currentRole`` and lists
exactly its expected peers, each ``"ok"``, and the storm's fault is over (a partition healed: links
across a silent partition read ``"ok"`` until traffic crosses them, so statuses alone would call a
storm converged while it is cut; ``Storm.looked_converged_in_fault_s`` records when they did);
the time to converge runs from the first post. What made the controller post again is counted by
reason (``Storm.repost_reasons``).

**Pulls**: during a storm, ``pullers`` threads keep asking random decode instances to pull from a
random one of their expected prefill peers; every answer is recorded with its HTTP status and
``error_type`` (``transport`` when no HTTP answer came, e.g. across a partition). After a storm
converges, every decode instance pulls from one of its prefill peers: those must all be 200.

**Faults**, in a chosen storm each: ``kill`` SIGKILLs one instance right after the storm's posts
and starts it again at once with the same configuration (the controller sees ``RoleUnknown`` and
posts its role; its peers see the link lost and are posted again); ``partition`` cuts two
instance hosts apart right after the posts and heals them ``partition_s`` seconds later; ``flap``
takes one instance host's link down and up every 0.5 s for ``partition_s`` seconds. A probe from
inside the host (a thread in its network namespace) records whether the other host was reachable
meanwhile (``Storm.probe``: "unreachable" proves the fault cut it).

**Resources**: a sampler reads ``/proc/<pid>`` of every instance (threads, open descriptors,
RSS) every ``sample_s`` seconds, and once more as each storm converges (``summary`` judges
flatness on those, see ``same_links_growth``).

**Bounds**: a status poll ``request_timeout`` seconds (no retry), a pull ``request_timeout`` plus
twice ``syncKvTimeoutMs``, a role post the client's 5 s per attempt with 3 retries (MindIE's), a
storm ``storm_timeout``, an instance's start ``start(timeout)``; ``stop`` SIGTERMs every instance
and SIGKILLs what is left after 15 s. Files (configuration, certificates, the link secret, logs)
go to ``workdir``, which every host must see (emulated hosts have a private ``/tmp``:
``workdir_under`` a folder of the repository).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pdlink.client import ClientError, ManagementClient, NodeSpec, role_body

CLONE_NEWNET = 0x40000000
TEST_KV = {"enabled": True, "numTensors": 2, "numBlocks": 32, "blockBytes": 16384}  # 1 MiB a pull


def hosts_module() -> tuple[Any, str | None]:
    """``(pdlink.testing.hosts, None)``, or ``(None, why)`` when emulated hosts cannot be made here
    (the module is missing, or its ``unavailable_reason()`` names a reason)."""
    try:
        from pdlink.testing import hosts as mod
    except ImportError as e:
        return None, f"pdlink.testing.hosts is not available ({e})"
    why = mod.unavailable_reason()
    return (None, why) if why else (mod, None)


# ------------------------------------------------------------------------------------------ hosts

class _LoopbackHost:
    def __init__(self, index: int):
        self.index = index
        self.ip = f"127.0.1.{index + 1}"

    def spawn(self, argv: list[str], **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(argv, **kw)


class Loopback:
    """``h`` "hosts" on this machine's loopback (addresses 127.0.1.1, 127.0.1.2, ...): the same
    placement and ports as emulated hosts, no wire, no partitions (``partition`` raises)."""

    profile = "none (loopback)"

    def __init__(self, h: int):
        self._hosts = [_LoopbackHost(i) for i in range(h)]

    def __enter__(self) -> Loopback:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def __len__(self) -> int:
        return len(self._hosts)

    def __getitem__(self, i: int) -> _LoopbackHost:
        return self._hosts[i]

    def partition(self, a: int, b: int) -> None:
        raise NotImplementedError("no partition on loopback")

    def heal(self) -> None:
        pass


def free_bases(ips: list[str], span: int) -> tuple[int, int]:
    """Two port bases (management, KV), each with ``span`` free ports on every address of ``ips``,
    in [20000, 30000) (below the ephemeral range): for loopback runs beside other work."""
    import socket

    rng = random.Random()
    found: list[int] = []
    for _ in range(1000):
        base = rng.randrange(20000, 30000 - span)
        if any(abs(base - b) < span for b in found):
            continue
        socks = []
        try:
            for ip in ips:
                for port in range(base, base + span):
                    s = socket.socket()
                    socks.append(s)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind((ip, port))
            found.append(base)
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        if len(found) == 2:
            return found[0], found[1]
    raise RuntimeError("no free port bases")


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (root namespace pids), parents first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _setns_net(path: str) -> None:
    """Move the calling thread into the network namespace at ``path`` (sockets it creates from now
    on live there; other threads are not affected)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------- the fleet

@dataclass
class Instance:
    index: int
    ident: int
    host: int
    ip: str
    port: int
    device: int
    config: str
    log: str
    proc: subprocess.Popen | None = None
    pid: int | None = None  # the pdlink serve process itself (root namespace pid)
    starts: int = 0


@dataclass
class Pull:
    t: float
    storm: int
    phase: str  # "during" (while a storm converges) or "after" (once it converged)
    decoder: int
    prefill: int
    status: int | str  # HTTP status, or "transport"
    error_type: str = ""
    nbytes: int = 0
    seconds: float = 0.0


@dataclass
class Storm:
    index: int
    t0: float
    prefills: int
    switched: list[int]
    posted: int
    fault: str = ""
    converged_s: float | None = None
    reposts: int = 0
    after_ok: int = 0
    after_failed: int = 0
    probe: str = ""  # partition: "unreachable" when host a could not open a connection to host b
    # partition: when every status first named the planned state while the partition still held
    # (a link across a silent partition reads "ok" until traffic crosses it); None if never
    looked_converged_in_fault_s: float | None = None
    repost_reasons: dict[str, int] = field(default_factory=dict)  # what made the controller post again


@dataclass
class Sample:
    t: float
    instance: int
    pid: int
    threads: int
    fds: int
    rss_kib: int
    peers: int = 0  # the instance's planned peers when sampled (a link costs descriptors and threads)
    role: str = ""  # the planned role when sampled (a prefill listens, a decode does not)
    converged: bool = False  # taken right after a storm converged: the instance holds exactly those links


@dataclass
class Timeline:
    """What happened, for the report and the plot (times relative to ``t0``)."""

    t0: float = field(default_factory=time.monotonic)
    roles: list[tuple[float, int, int]] = field(default_factory=list)  # (t, prefills, decodes) as planned
    events: list[tuple[float, str]] = field(default_factory=list)


class Fleet:
    """``n`` instances on ``hosts`` (an entered ``Hosts`` or ``Loopback``); the last host runs the
    controller when ``controller_host`` is true (emulated hosts), else the controller runs here.
    Bounds: see the module docstring."""

    def __init__(self, hosts: Any, n: int, workdir: str, *, controller_host: bool, seed: int = 1,
                 transport: str = "tcp", mgmt_base: int = 21000, kv_base: int = 26000, pullers: int = 2,
                 request_timeout: float = 3.0, storm_timeout: float = 60.0, sample_s: float = 1.0,
                 link_total_ms: int = 8000, link_retry_ms: int = 100, link_timeout_ms: int = 2000,
                 sync_kv_timeout_ms: int = 2000, pool: int = 16):
        self.hosts, self.n, self.workdir = hosts, n, workdir
        self.rng = random.Random(seed)
        self.pullers, self.request_timeout, self.storm_timeout = pullers, request_timeout, storm_timeout
        self.sample_s = sample_s
        h = len(hosts) - (1 if controller_host else 0)
        self.instance_hosts = h
        self._controller_host = hosts[h] if controller_host else None
        self._ns_holder: subprocess.Popen | None = None
        self.timeline = Timeline()
        self.pulls: list[Pull] = []
        self.storms: list[Storm] = []
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.storm_index = -1
        self.steady_t = float("inf")  # when the first storm converged (timeline time): resources count from here
        self.phase = "idle"
        self.roles: dict[int, str] = {}  # index -> role as planned
        os.makedirs(workdir, exist_ok=True)
        self._certs(workdir, [hosts[i].ip for i in range(len(hosts))])
        secret = os.path.join(workdir, "link.secret")
        with open(secret, "w") as f:
            f.write("pdlink-fleet-%d\n" % self.rng.getrandbits(64))
        os.chmod(secret, 0o600)
        self.instances: list[Instance] = []
        per_host: Counter[int] = Counter()
        for i in range(n):
            host = i % h
            k = per_host[host]
            per_host[host] += 1
            inst = Instance(i, i + 1, host, hosts[host].ip, mgmt_base + k, k,
                            os.path.join(workdir, f"instance{i}.json"), os.path.join(workdir, f"instance{i}.log"))
            server = {"ipAddress": inst.ip, "port": inst.port, "managementPort": inst.port, "metricsPort": inst.port,
                      "httpsEnabled": True, "tlsCaPath": workdir, "maxLinksPerClient": 64, "maxLinkNum": 256}
            for prefix, ca_key in (("tls", "tlsCaFile"), ("managementTls", "managementTlsCaFile"),
                                   ("metricsTls", "metricsTlsCaFile")):
                server.update({ca_key: ["ca.pem"], f"{prefix}Cert": self.server_cert, f"{prefix}Pk": self.server_key,
                               f"{prefix}CrlPath": workdir, f"{prefix}CrlFiles": []})
            kv = {"transport": transport, "deviceCount": 1, "listenPortBase": kv_base,
                  "linkTotalTimeMs": link_total_ms, "linkRetryIntervalMs": link_retry_ms,
                  "linkTimeoutMs": link_timeout_ms, "syncKvTimeoutMs": sync_kv_timeout_ms,
                  "linkSecretFile": secret, "testKv": TEST_KV}
            with open(inst.config, "w") as f:
                json.dump({"Version": "1.0.0", "ServerConfig": server, "KvTransferConfig": kv}, f)
            os.chmod(inst.config, 0o600)
            self.instances.append(inst)
        self.pull_bytes = TEST_KV["numTensors"] * TEST_KV["numBlocks"] * TEST_KV["blockBytes"]
        self._pool = ThreadPoolExecutor(pool, thread_name_prefix="controller", initializer=self._join_controller)
        self._post_clients = {i.index: self._client(i, timeout=5.0, retries=3) for i in self.instances}
        self._poll_clients = {i.index: self._client(i, timeout=request_timeout, retries=0) for i in self.instances}
        self._pull_clients = {i.index: self._client(i, timeout=request_timeout + 2 * sync_kv_timeout_ms / 1000,
                                                    retries=0) for i in self.instances}

    # ---------------------------------------------------------------- set-up

    def _certs(self, root: str, ips: list[str]) -> None:
        import trustme

        ca = trustme.CA()
        server = ca.issue_cert(*ips)  # the controller checks no host name, as MindIE's; named anyway
        client = ca.issue_cert("pdlink-fleet-controller")

        def write(name: str, data: bytes, mode: int) -> str:
            path = os.path.join(root, name)
            with open(path, "wb") as f:
                f.write(data)
            os.chmod(path, mode)
            return path

        self.ca = write("ca.pem", ca.cert_pem.bytes(), 0o644)
        self.server_cert = write("server.pem", b"".join(p.bytes() for p in server.cert_chain_pems), 0o644)
        self.server_key = write("server.key.pem", server.private_key_pem.bytes(), 0o600)
        self.client_cert = write("client.pem", b"".join(p.bytes() for p in client.cert_chain_pems), 0o644)
        self.client_key = write("client.key.pem", client.private_key_pem.bytes(), 0o600)

    def _client(self, inst: Instance, timeout: float, retries: int) -> ManagementClient:
        return ManagementClient(inst.ip, inst.port, ca=self.ca, cert=self.client_cert, key=self.client_key,
                                timeout=timeout, retries=retries, retry_wait=0.2)

    def _controller_ns(self) -> str | None:
        """The network namespace of the controller's host, as a path (None: stay here)."""
        if self._controller_host is None:
            return None
        anchor = getattr(self._controller_host, "anchor_pid", None)
        if anchor:
            return f"/proc/{anchor}/ns/net"
        if self._ns_holder is None:
            self._ns_holder = self._controller_host.spawn(["sleep", "100000"])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for pid in reversed(_descendants(self._ns_holder.pid)):
                if _cmdline(pid)[:1] == ["sleep"]:
                    return f"/proc/{pid}/ns/net"
            time.sleep(0.01)
        raise RuntimeError("the controller host's namespace holder did not start")

    def _join_controller(self) -> None:
        path = self._ns_path
        if path is not None:
            _setns_net(path)

    def start(self, timeout: float = 120.0) -> None:
        """Start every instance and wait until each answers ``/health``."""
        self._ns_path = self._controller_ns()
        for inst in self.instances:
            self._spawn(inst)
        self.wait_up(self.instances, timeout)
        self._start_thread(self._sampler)

    def _spawn(self, inst: Instance) -> None:
        argv = [sys.executable, "-m", "pdlink", "serve", "--config", inst.config]
        env = {k: v for k, v in os.environ.items()
               if k not in ("MIES_CONFIG_JSON_PATH", "MINDIE_LLM_HOME_PATH", "MIES_INSTALL_PATH",
                            "MIES_CONTAINER_IP", "MIES_CONTAINER_MANAGEMENT_IP", "PDLINK_LINK_SECRET")}
        with open(inst.log, "ab") as log:
            inst.proc = self.hosts[inst.host].spawn(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        inst.pid = None
        inst.starts += 1

    def _find_pid(self, inst: Instance) -> int | None:
        if inst.proc is None:
            return None
        for pid in _descendants(inst.proc.pid):
            cmd = _cmdline(pid)
            if cmd[1:4] == ["-m", "pdlink", "serve"] and inst.config in cmd:
                return pid
        return None

    def wait_up(self, insts: list[Instance], timeout: float) -> None:
        deadline = time.monotonic() + timeout

        def up(inst: Instance) -> bool:
            while time.monotonic() < deadline:
                if inst.proc is not None and inst.proc.poll() is not None:
                    raise RuntimeError(f"instance {inst.index} exited with {inst.proc.returncode}: "
                                       f"{self.log_tail(inst)}")
                try:
                    if self._poll_clients[inst.index].healthy():
                        inst.pid = self._find_pid(inst)
                        return True
                except ClientError:
                    pass
                time.sleep(0.1)
            raise RuntimeError(f"instance {inst.index} not up within {timeout} s: {self.log_tail(inst)}")

        list(self._pool.map(up, insts))

    def log_tail(self, inst: Instance, n: int = 2000) -> str:
        try:
            with open(inst.log, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def _start_thread(self, fn: Any) -> None:
        def run() -> None:
            self._join_controller()
            fn()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self._threads.append(t)

    # ---------------------------------------------------------------- plan

    def _spec(self, index: int) -> NodeSpec:
        inst = self.instances[index]
        return NodeSpec(inst.ident, inst.ip, [inst.device])

    def expected_peers(self, index: int, roles: dict[int, str] | None = None) -> list[int]:
        roles = roles or self.roles
        other = "decode" if roles[index] == "prefill" else "prefill"
        return sorted(i for i, r in roles.items() if r == other)

    def _body(self, index: int, roles: dict[int, str]) -> dict[str, Any]:
        return role_body(self._spec(index), [self._spec(p) for p in self.expected_peers(index, roles)])

    def _post(self, index: int, roles: dict[int, str]) -> int | str:
        try:
            return self._post_clients[index].request("POST", f"/v1/role/{roles[index]}",
                                                     self._body(index, roles)).status
        except ClientError:
            return "transport"

    def next_split(self) -> int:
        """A new number of prefill instances, in [n/4, 3n/4], never the current one."""
        lo, hi = max(1, self.n // 4), max(1, (3 * self.n) // 4)
        current = sum(1 for r in self.roles.values() if r == "prefill")
        choices = [p for p in range(lo, hi + 1) if p != current] or [p for p in range(1, self.n) if p != current]
        return self.rng.choice(choices)

    # ---------------------------------------------------------------- storms

    def storm(self, fault: str = "", partition_s: float = 3.0) -> Storm:
        """One storm (see the module docstring): returns its record; ``converged_s`` is None when
        it did not converge within ``storm_timeout``."""
        old = dict(self.roles)
        prefills = self.next_split()
        if not old:  # the first assignment: instances 0..prefills-1 start as prefill
            new = {i: ("prefill" if i < prefills else "decode") for i in range(self.n)}
            switched = list(range(self.n))
        else:
            new = dict(old)
            have = [i for i, r in old.items() if r == "prefill"]
            if prefills > len(have):
                switched = self.rng.sample([i for i, r in old.items() if r == "decode"], prefills - len(have))
                for i in switched:
                    new[i] = "prefill"
            else:
                switched = self.rng.sample(have, len(have) - prefills)
                for i in switched:
                    new[i] = "decode"
        affected = [i for i in range(self.n) if i not in switched
                    and self.expected_peers(i, new) != (self.expected_peers(i, old) if old else None)]
        with self._lock:
            self.storm_index += 1
            self.roles = new
            self.phase = "during"
            rec = Storm(self.storm_index, time.monotonic(), prefills, sorted(switched),
                        len(switched) + len(affected), fault)
            self.storms.append(rec)
            self.timeline.roles.append((rec.t0 - self.timeline.t0, prefills, self.n - prefills))
        if self.storm_index == 0:
            for _ in range(self.pullers):
                self._start_thread(self._puller)
        # the switched ones first, then every affected one, as MindIE's RoleSwitcher
        statuses = list(self._pool.map(lambda i: self._post(i, new), sorted(switched)))
        statuses += list(self._pool.map(lambda i: self._post(i, new), affected))
        bad = [s for s in statuses if s != 200]
        if bad:
            self.event(f"storm {rec.index}: posts answered {Counter(bad)}")
        healer = None
        fault_over = threading.Event()
        fault_over.set()
        if fault == "kill":
            self.kill_and_restart(self.rng.randrange(self.n))
        elif fault == "partition":
            a, b = self.rng.sample(range(self.instance_hosts), 2)
            fault_over.clear()
            self.hosts.partition(a, b)
            t_cut = time.monotonic()
            self.event(f"storm {rec.index}: hosts {a} and {b} partitioned for {partition_s} s")

            def heal() -> None:
                rec.probe = self._probe(a, b)
                time.sleep(max(0.0, partition_s - (time.monotonic() - t_cut)))
                self.hosts.heal()
                fault_over.set()
                self.event(f"storm {rec.index}: healed")

            healer = threading.Thread(target=heal, daemon=True)
            healer.start()
        elif fault == "flap":
            a = self.rng.randrange(self.instance_hosts)
            fault_over.clear()
            self.event(f"storm {rec.index}: host {a}'s link flaps (0.5 s down, 0.5 s up) for {partition_s} s")

            def flap() -> None:
                end = time.monotonic() + partition_s
                with self.hosts.flap(a, 0.5, 0.5):
                    while time.monotonic() < end and rec.probe != "unreachable":  # proof: a down phase cut it
                        rec.probe = self._probe(a, (a + 1) % self.instance_hosts)
                    time.sleep(max(0.0, end - time.monotonic()))
                fault_over.set()
                self.event(f"storm {rec.index}: the flapping stopped, the link is up")

            healer = threading.Thread(target=flap, daemon=True)
            healer.start()
        rec.converged_s, rec.reposts = self._converge(rec, new, fault_over)
        if healer is not None:
            healer.join()
        with self._lock:
            self.phase = "after"
        if rec.index == 0 and rec.converged_s is not None:
            self.steady_t = time.monotonic() - self.timeline.t0
        if rec.converged_s is not None:
            self.sample(converged=True)
        if rec.converged_s is not None:
            self._after_pulls(rec)
        return rec

    def _in_host(self, a: int, fn: Any) -> Any:
        """Run ``fn()`` on a thread inside host ``a``'s network namespace; its result, or the
        ``OSError`` entering failed with. Bounded: 15 s."""
        anchor = getattr(self.hosts[a], "anchor_pid", None)
        src = next((i for i in self.instances if i.host == a and i.pid), None)
        ns = f"/proc/{anchor}/ns/net" if anchor else (f"/proc/{src.pid}/ns/net" if src else None)
        out: list[Any] = []

        def body() -> None:
            try:
                if ns is not None:
                    _setns_net(ns)
            except OSError as e:
                out.append(e)
                return
            out.append(fn())

        t = threading.Thread(target=body, daemon=True)
        t.start()
        t.join(15)
        return out[0] if out else TimeoutError("hung")

    def _probe(self, a: int, b: int) -> str:
        """From inside host ``a``, try to open a TCP connection to an instance of host ``b`` for
        1 s: "unreachable" proves the partition holds."""
        dst = next(i for i in self.instances if i.host == b)

        def connect() -> str:
            import socket

            try:
                socket.create_connection((dst.ip, dst.port), timeout=1.0).close()
                return "reachable"
            except OSError:
                return "unreachable"

        r = self._in_host(a, connect)
        return r if isinstance(r, str) else f"cannot probe: {r}"

    def tcp_rtt_ms(self, a: int, b: int, count: int = 20) -> float | None:
        """The median time to open a TCP connection from host ``a`` to an instance of host ``b``
        (one round trip, SYN to SYN-ACK): what the wire adds, measured."""
        import socket
        import statistics

        dst = next(i for i in self.instances if i.host == b)

        def measure() -> float:
            times = []
            for _ in range(count):
                t = time.perf_counter()
                socket.create_connection((dst.ip, dst.port), timeout=2.0).close()
                times.append((time.perf_counter() - t) * 1000)
            return statistics.median(times)

        r = self._in_host(a, measure)
        return r if isinstance(r, float) else None

    def event(self, text: str) -> None:
        with self._lock:
            self.timeline.events.append((time.monotonic() - self.timeline.t0, text))

    def kill_and_restart(self, index: int) -> None:
        inst = self.instances[index]
        pid = inst.pid or self._find_pid(inst)
        if pid:
            os.kill(pid, signal.SIGKILL)
        assert inst.proc is not None
        inst.proc.wait(10)
        self.event(f"storm {self.storm_index}: instance {index} ({self.roles[index]}, host {inst.host}) "
                   "SIGKILLed and restarted")
        self._spawn(inst)

    def converged(self, index: int, status: dict[str, Any], roles: dict[int, str]) -> bool:
        service = status.get("service", {})
        if service.get("roleStatus") != "RoleReady" or service.get("currentRole") != roles[index]:
            return False
        links = {p.get("target"): p.get("link") for p in status.get("linkStatus", {}).get("peers", [])}
        want = {self.instances[p].ident for p in self.expected_peers(index, roles)}
        return set(links) == want and all(v == "ok" for v in links.values())

    def _needs_repost(self, index: int, status: dict[str, Any], roles: dict[int, str]) -> bool:
        service = status.get("service", {})
        if service.get("roleStatus") == "RoleUnknown":
            return True
        want = {self.instances[p].ident for p in self.expected_peers(index, roles)}
        return any(p.get("target") in want and str(p.get("link", "")).startswith("failed")
                   for p in status.get("linkStatus", {}).get("peers", []))

    def _repost_reasons(self, index: int, status: dict[str, Any], roles: dict[int, str]) -> list[str]:
        """Why ``_needs_repost`` said yes: "RoleUnknown", or each failed planned peer's reason with
        numbers and addresses cut off (so the reasons count together)."""
        import re

        if status.get("service", {}).get("roleStatus") == "RoleUnknown":
            return ["RoleUnknown"]
        want = {self.instances[p].ident for p in self.expected_peers(index, roles)}
        return [re.sub(r"[0-9][0-9.:]*", "N", str(p.get("link")))[:120]
                for p in status.get("linkStatus", {}).get("peers", [])
                if p.get("target") in want and str(p.get("link", "")).startswith("failed")]

    def status(self, index: int) -> dict[str, Any] | None:
        try:
            return self._poll_clients[index].status()
        except ClientError:
            return None

    def _converge(self, rec: Storm, roles: dict[int, str], fault_over: threading.Event
                  ) -> tuple[float | None, int]:
        """Poll until every instance names the planned state and the storm's fault is over (a
        partition healed); returns (seconds from the first post, re-posts), None on timeout."""
        done: set[int] = set()
        last_post = {i: rec.t0 for i in range(self.n)}
        inflight: dict[int, Any] = {}
        reposts = 0
        while time.monotonic() - rec.t0 < self.storm_timeout:
            todo = [i for i in range(self.n) if i not in done]
            for i, st in zip(todo, self._pool.map(self.status, todo)):
                if st is None:
                    continue
                if self.instances[i].pid is None:  # restarted: sample the new process from now on
                    self.instances[i].pid = self._find_pid(self.instances[i])
                if self.converged(i, st, roles):
                    done.add(i)
                    continue
                now = time.monotonic()
                fut = inflight.get(i)
                if self._needs_repost(i, st, roles) and now - last_post[i] >= 1.0 and (fut is None or fut.done()):
                    inflight[i] = self._pool.submit(self._post, i, roles)
                    last_post[i] = now
                    reposts += 1
                    for why in self._repost_reasons(i, st, roles):
                        rec.repost_reasons[why] = rec.repost_reasons.get(why, 0) + 1
            if len(done) == self.n:
                # a converged instance may have lost a link since (a kill, a partition): look once more
                if all(self.converged(i, st, roles) for i, st in
                       zip(range(self.n), self._pool.map(self.status, range(self.n))) if st is not None):
                    if fault_over.is_set():
                        return time.monotonic() - rec.t0, reposts
                    if rec.looked_converged_in_fault_s is None:
                        rec.looked_converged_in_fault_s = time.monotonic() - rec.t0
                done.clear()
            time.sleep(0.05)
        return None, reposts

    # ---------------------------------------------------------------- pulls

    def _pull(self, decoder: int, prefill: int, storm: int, phase: str) -> Pull:
        t = time.monotonic() - self.timeline.t0
        try:
            resp = self._pull_clients[decoder].request("POST", "/v1/pdlink/test/kv/pull",
                                                       {"target": self.instances[prefill].ident})
        except ClientError:
            return Pull(t, storm, phase, decoder, prefill, "transport")
        try:
            body = resp.json()
        except ValueError:
            body = {}
        if resp.status == 200 and body.get("verified") is True:
            return Pull(t, storm, phase, decoder, prefill, 200, "", int(body.get("bytes", 0)),
                        float(body.get("seconds", 0.0)))
        return Pull(t, storm, phase, decoder, prefill, resp.status, str(body.get("error_type", "")))

    def _record(self, p: Pull) -> None:
        with self._lock:
            self.pulls.append(p)

    def _puller(self) -> None:
        rng = random.Random(self.rng.getrandbits(32))
        while not self._stop.is_set():
            with self._lock:
                roles, storm, phase = dict(self.roles), self.storm_index, self.phase
            if phase != "during":
                time.sleep(0.02)
                continue
            decoders = [i for i, r in roles.items() if r == "decode"]
            d = rng.choice(decoders)
            peers = self.expected_peers(d, roles)
            self._record(self._pull(d, rng.choice(peers), storm, phase))

    def _after_pulls(self, rec: Storm) -> None:
        roles = dict(self.roles)
        decoders = [i for i, r in roles.items() if r == "decode"]
        pairs = [(d, self.rng.choice(self.expected_peers(d, roles))) for d in decoders]
        for p in self._pool.map(lambda dp: self._pull(dp[0], dp[1], rec.index, "after"), pairs):
            self._record(p)
            if p.status == 200:
                rec.after_ok += 1
            else:
                rec.after_failed += 1

    # ---------------------------------------------------------------- resources

    def _sampler(self) -> None:
        while not self._stop.wait(self.sample_s):
            self.sample()

    def sample(self, converged: bool = False) -> None:
        t = time.monotonic() - self.timeline.t0
        with self._lock:
            roles = dict(self.roles)
        for inst in self.instances:
            pid = inst.pid
            if pid is None:
                continue
            try:
                with open(f"/proc/{pid}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                fds = len(os.listdir(f"/proc/{pid}/fd"))
                s = Sample(t, inst.index, pid, int(fields["Threads"]), fds, int(fields["VmRSS"].split()[0]),
                           len(self.expected_peers(inst.index, roles)) if roles else 0,
                           roles.get(inst.index, ""), converged)
            except (OSError, KeyError, ValueError):
                continue
            with self._lock:
                self.samples.append(s)

    # ---------------------------------------------------------------- the end

    def final_states(self) -> dict[int, dict[str, Any]]:
        """Each instance's last status (``{}`` when it did not answer)."""
        return {i: (st or {}) for i, st in zip(range(self.n), self._pool.map(self.status, range(self.n)))}

    def stop(self) -> dict[int, int | None]:
        """Stop the pullers and sampler, SIGTERM every instance (SIGKILL after 15 s); returns each
        instance's exit code."""
        self._stop.set()
        for t in self._threads:
            t.join(30)
        codes: dict[int, int | None] = {}
        for inst in self.instances:
            if inst.proc is None:
                continue
            pid = inst.pid or self._find_pid(inst)
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(pid, signal.SIGTERM)  # type: ignore[arg-type]
        for inst in self.instances:
            if inst.proc is None:
                continue
            try:
                codes[inst.index] = inst.proc.wait(15)
            except subprocess.TimeoutExpired:
                for pid in reversed(_descendants(inst.proc.pid)):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                codes[inst.index] = inst.proc.wait(5)
        if self._ns_holder is not None:
            for pid in reversed(_descendants(self._ns_holder.pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self._ns_holder.wait(5)
        self._pool.shutdown(wait=True)
        return codes

    def processes_left(self) -> list[int]:
        """Instance processes (and their wrappers) still alive."""
        left = []
        for inst in self.instances:
            if inst.proc is not None and inst.proc.poll() is None:
                left.append(inst.proc.pid)
            if inst.pid is not None and os.path.exists(f"/proc/{inst.pid}") and _cmdline(inst.pid):
                left.append(inst.pid)
        return left


# --------------------------------------------------------------------------------------- summary

def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


RESOURCES = ("threads", "fds", "rss_kib")


def val(s: Sample, key: str) -> int:
    return int(getattr(s, key))


def same_links_growth(samples: list[Sample]) -> dict[str, Any]:
    """Threads and descriptors follow the links an instance holds (each link a socket or two, and
    a thread), so they go up and down with the P:D split. Flat means: an instance in the same role
    holding the same number of links later holds no more than it did earlier. Over the samples
    taken right after a storm converged, grouped by (process, role, planned peers): last minus first, max and
    median over the groups (with the span of time they cover)."""
    groups: dict[tuple[int, str, int], list[Sample]] = {}
    for s in samples:
        if s.converged:
            groups.setdefault((s.pid, s.role, s.peers), []).append(s)
    out: dict[str, Any] = {"groups": sum(1 for g in groups.values() if len(g) > 1)}
    spans = [g[-1].t - g[0].t for g in groups.values() if len(g) > 1]
    out["span_s_max"] = max(spans, default=None)
    for key in RESOURCES:
        d = [float(val(g[-1], key) - val(g[0], key)) for g in groups.values() if len(g) > 1]
        out[key] = {"max": max(d, default=None), "min": min(d, default=None), "median": percentile(d, 0.5)}
    # the resident set over the second half of each process's converged samples (a one-time step
    # early in a process's life, its first pulls and links, is not growth)
    per_pid: dict[int, list[Sample]] = {}
    for s in samples:
        if s.converged:
            per_pid.setdefault(s.pid, []).append(s)
    half = [float(ss[-1].rss_kib - ss[len(ss) // 2].rss_kib) for ss in per_pid.values() if len(ss) >= 10]
    out["rss_kib_second_half"] = {"max": max(half, default=None), "min": min(half, default=None),
                                  "median": percentile(half, 0.5), "processes": len(half)}
    return out


def summary(fleet: Fleet) -> dict[str, Any]:
    conv = [s.converged_s for s in fleet.storms if s.converged_s is not None]
    pulls = fleet.pulls
    failed: Counter[str] = Counter()
    for p in pulls:
        if p.status != 200:
            failed[f"{p.phase} {p.status} {p.error_type}".strip()] += 1
    ok = [p for p in pulls if p.status == 200]
    per_instance: dict[str, Any] = {}
    for inst in fleet.instances:
        # from the end of the first storm on (before it an instance has no engine yet)
        ss = [s for s in fleet.samples if s.instance == inst.index and s.t >= fleet.steady_t]
        if not ss:
            continue
        last_pid = ss[-1].pid
        run = [s for s in ss if s.pid == last_pid]  # since the last (re)start
        per_instance[str(inst.index)] = {
            key: {"first": val(run[0], key), "last": val(run[-1], key), "max": max(val(s, key) for s in run)}
            for key in RESOURCES}
        per_instance[str(inst.index)]["starts"] = inst.starts
    spread = {}
    for key in RESOURCES:
        grows = [v[key]["last"] - v[key]["first"] for v in per_instance.values()]
        spread[key] = {"first_min": min((v[key]["first"] for v in per_instance.values()), default=None),
                       "last_max": max((v[key]["last"] for v in per_instance.values()), default=None),
                       "max": max((v[key]["max"] for v in per_instance.values()), default=None),
                       "growth_first_to_last_max": max(grows, default=None),
                       "growth_first_to_last_median": percentile([float(g) for g in grows], 0.5)}
    return {
        "instances": fleet.n, "hosts": fleet.instance_hosts, "profile": getattr(fleet.hosts, "profile", None),
        "storms": len(fleet.storms), "converged": len(conv),
        "not_converged": [s.index for s in fleet.storms if s.converged_s is None],
        "converge_s": {"p50": percentile(conv, 0.5), "p99": percentile(conv, 0.99), "max": max(conv, default=None),
                       "min": min(conv, default=None)},
        "faults": {s.fault: {"storm": s.index, "converge_s": s.converged_s, "reposts": s.reposts,
                             **({"probe": s.probe, "looked_converged_in_fault_s": s.looked_converged_in_fault_s}
                                if s.fault in ("partition", "flap") else {})}
                   for s in fleet.storms if s.fault},
        "posts": sum(s.posted for s in fleet.storms), "reposts": sum(s.reposts for s in fleet.storms),
        "repost_reasons": dict(sum((Counter(s.repost_reasons) for s in fleet.storms), Counter())),
        "switched": sum(len(s.switched) for s in fleet.storms),
        "pulls": {"total": len(pulls), "ok": len(ok), "failed_by_code": dict(sorted(failed.items())),
                  "wrong_bytes_pulls": sum(1 for p in pulls if p.error_type == "Verification Failed"),
                  "after_ok": sum(s.after_ok for s in fleet.storms),
                  "after_failed": sum(s.after_failed for s in fleet.storms),
                  "bytes_ok": sum(p.nbytes for p in ok), "bytes_per_pull": fleet.pull_bytes},
        "resources": spread, "same_links_growth": same_links_growth(fleet.samples), "per_instance": per_instance,
        "events": [f"{t:.2f} s: {e}" for t, e in fleet.timeline.events],
    }


@contextlib.contextmanager
def workdir_under(root: str) -> Iterator[str]:
    """A fresh directory under ``root`` (every host sees it: emulated hosts have a private /tmp,
    not a private repository), removed afterwards."""
    path = os.path.join(root, f"fleet-{os.getpid()}-{time.monotonic_ns()}")
    os.makedirs(path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
