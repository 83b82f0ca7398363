"""``pdlink serve`` against hostile HTTP clients: real server processes on 127.0.0.1, plain HTTP and
HTTPS without a client CA (anyone may complete the handshake), attacked with real sockets bound to
other loopback addresses (``127.0.1.N``, new ones for each test), so the honest client (127.0.0.1) is
another client for the per-client cap.

* Idle connections: one client keeps at most ``maxLinksPerClient`` (the others are closed at once,
  unanswered); ``/health``, the probes and role posts are answered while it holds them; clients
  together still share ``maxLinkNum``, exactly; ``headTimeoutMs`` closes idle connections and
  frees their slots. A metrics plane on a port of its own keeps the same per-client cap.
* Stalls: a head begun and not finished gets a plain 408 at ``headTimeoutMs``; a body begun and not
  finished a JSON 408 at ``bodyTimeoutMs`` (role posts and the test pull); nothing changes; the
  memory the stalled bodies took is given back (checked without sanitizers); while one client's
  connections stall, others are answered.
* Shape: a role body with more than ``maxJsonDepth`` levels of arrays and objects, or more than
  1,048,576 strings, arrays, objects and commas, is refused (422) before it is decoded: 38 MiB of
  ``[{},{},...]`` (13 million dictionaries, about 1 GiB, once decoded) leaves the resident memory
  of the server and of its decode worker within a bound; both bounds are exact. The count itself
  (``parsing.structure_error``, on the bytes) is checked against the decoded value of any JSON
  text, strings full of quotes, backslashes, brackets and commas included.

Every attack is followed by an honest role post that is applied. Nothing sleeps a fixed time:
conditions are polled, and every wait is bounded (``hang_guard``).
"""

from __future__ import annotations

import itertools
import json
import os
import select
import socket
import ssl
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from internals import ManagementClient, client_context, structure_error
from poll import hang_guard, wait_until
from server_util import LOCAL, Certs, Serve, decode_body, free_block, free_ports, write_config

LOCAL_ID, PEER_ID = 0, 1  # instance 0 dials only as decode, and nothing listens where it dials: no link comes up
MAX_LINKS, PER_CLIENT = 8, 3
# Under a sanitizer (.ci/sanitizers.sh sets PDLINK_SANITIZER) the server reads a 24 MiB body more
# slowly than a 2 s body deadline allows; resident memory means nothing there (ASan keeps freed
# memory in quarantine): its bounds are checked in plain runs only.
SANITIZED = bool(os.environ.get("PDLINK_SANITIZER"))
MEMORY_BOUNDS = not SANITIZED
HEAD_MS, BODY_MS = (4000, 8000) if SANITIZED else (1000, 2000)  # the strict server's deadlines
MAX_DEPTH, MAX_ITEMS = 32, 1 << 20  # the documented shape bounds (maxJsonDepth's default)
MIB = 1 << 20
RSS_BOUND_MIB = 160  # what one refused 38 MiB body may add to the peak memory of each process, at most

_addresses = itertools.count(0)


def new_address() -> str:
    """A loopback address no earlier connection of this run came from (127.0.1.1, 127.0.1.2, ...)."""
    n = next(_addresses)
    return f"127.0.{1 + n // 250}.{1 + n % 250}"


@pytest.fixture
def attacker() -> str:
    """A loopback address of its own for each test: the server's per-client count starts at 0."""
    return new_address()


def _server(root: Any, name: str, scheme: str, server: dict[str, Any], kv: dict[str, Any],
            own_metrics_port: bool = False) -> SimpleNamespace:
    """A server on ``port``, its metrics plane on the same port or (``own_metrics_port``) on
    ``metrics_port``, a listener of its own."""
    certs = Certs(str(root / f"certs-{name}")) if scheme == "https" else None
    port, other = free_ports(2)
    metrics_port = other if own_metrics_port else port
    base = free_block(2)
    tls = certs.server_config(ca=False) if certs else {"httpsEnabled": False}
    path = write_config(str(root / f"{name}.json"),
                        {"ipAddress": LOCAL, "port": port, "managementPort": port, "metricsPort": metrics_port,
                         "maxLinkNum": MAX_LINKS, "maxLinksPerClient": PER_CLIENT, **server, **tls},
                        kv={"listenPortBase": base, "linkTimeoutMs": 200, "linkTotalTimeMs": 300,
                            "linkRetryIntervalMs": 50, **kv})
    proc = Serve(path).wait_ready()
    client = ManagementClient(LOCAL, port, https=bool(certs), ca=certs.ca if certs else None, retries=0)
    ctx = client_context(certs.ca) if certs else None
    srv = SimpleNamespace(proc=proc, port=port, metrics_port=metrics_port, client=client, ctx=ctx, scheme=scheme,
                          base=base)
    try:
        assert client.post_role("decode", role_body()).status == 200  # fixes the identity (instance 0)
        wait_until(lambda: client.status()["service"]["currentRole"] == "decode", 20, "the first assignment")
    except BaseException:
        proc.stop()
        raise
    return srv


@pytest.fixture(scope="module", params=["http", "https"])
def patient(request, tmp_path_factory):
    """Long deadlines (idle connections stay until the test closes them); maxRequestLength 40 MB."""
    root = tmp_path_factory.mktemp("patient")
    srv = _server(root, "patient", request.param, {"headTimeoutMs": 60_000, "bodyTimeoutMs": 60_000}, {})
    yield srv
    assert srv.proc.stop() == 0
    assert "Traceback" not in srv.proc.output and "unhandled error" not in srv.proc.output, srv.proc.output


@pytest.fixture(scope="module", params=["http", "https"])
def strict(request, tmp_path_factory):
    """Short deadlines: heads 1 s, bodies 2 s; the test pull route exists (testKv)."""
    root = tmp_path_factory.mktemp("strict")
    srv = _server(root, "strict", request.param, {"headTimeoutMs": HEAD_MS, "bodyTimeoutMs": BODY_MS},
                  {"testKv": {"enabled": True, "numTensors": 1, "numBlocks": 2, "blockBytes": 64}})
    yield srv
    assert srv.proc.stop() == 0
    assert "Traceback" not in srv.proc.output and "unhandled error" not in srv.proc.output, srv.proc.output


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """Plain HTTP with the metrics plane on a port of its own (metricsPort != managementPort);
    long deadlines, as ``patient``."""
    root = tmp_path_factory.mktemp("split")
    srv = _server(root, "split", "http", {"headTimeoutMs": 60_000, "bodyTimeoutMs": 60_000}, {},
                  own_metrics_port=True)
    yield srv
    assert srv.proc.stop() == 0
    assert "Traceback" not in srv.proc.output and "unhandled error" not in srv.proc.output, srv.proc.output


# ------------------------------------------------------------------------------------- helpers

def role_body() -> dict[str, Any]:
    return decode_body(LOCAL_ID, [0], [(PEER_ID, [1])])


def state(srv: Any) -> tuple[str, int]:
    s = srv.client.status()
    return s["service"]["currentRole"], s["pdlink"]["generation"]


def honest_assignment(srv: Any, role: str) -> None:
    """An honest role post gets 200 and is applied."""
    resp = srv.client.request("POST", f"/v1/role/{role}", role_body())
    assert resp.status == 200, (resp.status, resp.body)
    generation = int(resp.headers["x-pdlink-generation"])

    def applied() -> bool:
        s = srv.client.status()
        return s["service"]["currentRole"] == role and s["pdlink"]["appliedGeneration"] == generation

    wait_until(applied, 20, f"the honest {role} assignment applied")
    assert srv.client.request("GET", "/health").status == 200


def connect(srv: Any, source: str, timeout: float = 30.0) -> socket.socket:
    """A connection from ``source`` (TLS handshake done on HTTPS); it sends nothing yet."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.bind((source, 0))
        sock.connect((LOCAL, srv.port))
        if srv.ctx is not None:
            sock = srv.ctx.wrap_socket(sock)
    except BaseException:
        sock.close()
        raise
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; its socket timeout bounds each read."""
    out = []
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, ssl.SSLEOFError, ssl.SSLZeroReturnError):
            break
        if not chunk:
            break
        out.append(chunk)
    return b"".join(out)


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed this connection without sending a byte (False: still open)."""
    timeout = sock.gettimeout()
    sock.settimeout(0)
    try:
        if not isinstance(sock, ssl.SSLSocket) and not select.select([sock], [], [], 0)[0]:
            return False
        data = sock.recv(1)
    except (BlockingIOError, ssl.SSLWantReadError):
        return False
    except (ConnectionResetError, ssl.SSLEOFError, ssl.SSLZeroReturnError):
        return True
    finally:
        sock.settimeout(timeout)
    assert data == b"", f"the server sent {data!r} on a connection that sent nothing"
    return True


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer[9:12])


def answer_of(srv: Any, data: bytes, source: str = LOCAL) -> bytes:
    sock = connect(srv, source)
    try:
        sock.sendall(data)
        return read_to_end(sock)
    finally:
        sock.close()


def post_head(length: int, path: str = "/v1/role/prefill") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {LOCAL}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def error_doc(answer: bytes) -> dict[str, Any]:
    doc = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert set(doc) == {"error", "error_type"}, doc
    return doc


def memory_mib(pid: int) -> dict[int, tuple[int, int]]:
    """VmRSS and VmHWM (MiB) of ``pid`` and of each of its children (the decode worker)."""
    pids = [pid]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    out = {}
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except OSError:
            continue
        out[p] = (int(fields["VmRSS"].split()[0]) // 1024, int(fields["VmHWM"].split()[0]) // 1024)
    return out


# ------------------------------------------------------------------------------------- idle connections

def test_one_client_keeps_at_most_max_links_per_client_and_health_is_answered(patient, attacker):
    """As many idle connections as maxLinkNum from one client: it keeps PER_CLIENT, the others are
    closed at once, unanswered; a fresh connection from another client gets /health (200), the
    probes (200) and a role post applied, while the PER_CLIENT connections are still open."""
    idle = [connect(patient, attacker) for _ in range(MAX_LINKS)]
    try:
        def refused() -> list[socket.socket] | None:
            closed = [s for s in idle if closed_by_server(s)]
            return closed if len(closed) == MAX_LINKS - PER_CLIENT else None

        held = [s for s in idle if s not in wait_until(refused, hang_guard(1000),
                                                        "the connections past maxLinksPerClient closed")]
        for path in ("/health", "/v2/health/live", "/v2/health/ready"):
            assert patient.client.request("GET", path).status == 200
        honest_assignment(patient, "prefill")
        honest_assignment(patient, "decode")
        assert not any(closed_by_server(s) for s in held)  # all the while, the client held its connections
        # a connection of its own past the cap is closed at once again, unanswered
        extra = connect(patient, attacker)
        idle.append(extra)
        wait_until(lambda: closed_by_server(extra), hang_guard(1000), "a connection past the cap closed")
    finally:
        for s in idle:
            s.close()
    honest_assignment(patient, "prefill")


def test_clients_together_share_max_link_num_exactly(patient, attacker):
    """maxLinkNum connections are served at once, whoever holds them; one more gets uvicorn's plain 503
    until one of them closes."""
    others = [attacker, new_address(), new_address()]
    held: list[socket.socket] = []
    try:
        for source, n in zip(others, (PER_CLIENT, PER_CLIENT, MAX_LINKS - 1 - 2 * PER_CLIENT)):
            held += [connect(patient, source) for _ in range(n)]
        # the maxLinkNum-th connection (polled: the server may still be closing an earlier test's)
        wait_until(lambda: patient.client.request("GET", "/health").status == 200, hang_guard(1000),
                   "/health on the maxLinkNum-th connection")
        held.append(connect(patient, others[2]))
        answer = answer_of(patient, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # one past maxLinkNum
        assert status_of(answer) == 503 and answer.endswith(b"\r\n\r\nService Unavailable"), answer
        assert not any(closed_by_server(s) for s in held)
        held.pop().close()
        wait_until(lambda: patient.client.request("GET", "/health").status == 200, hang_guard(1000),
                   "/health served again once a connection closed")
    finally:
        for s in held:
            s.close()
    honest_assignment(patient, "decode")


def test_what_counts_as_a_clients_connection(patient, attacker):
    """maxLinkNum TCP connections from one client that send nothing. Plain HTTP: they are idle
    connections; PER_CLIENT stay, the others are closed at once. HTTPS: they never start their TLS
    handshake, so they are not HTTP connections yet and count neither against maxLinksPerClient nor
    against maxLinkNum (docs/server.md, "Not bounded here"): the same client still gets /health."""
    raw = []
    try:
        for _ in range(MAX_LINKS):
            raw.append(socket.create_connection((LOCAL, patient.port), 30, source_address=(attacker, 0)))
        if patient.scheme == "http":
            wait_until(lambda: all(closed_by_server(s) for s in raw[PER_CLIENT:]), hang_guard(1000),
                       "the connections past maxLinksPerClient closed at once")  # accepted in order
            assert not any(closed_by_server(s) for s in raw[:PER_CLIENT])
        else:
            answer = answer_of(patient, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", attacker)
            assert status_of(answer) == 200, answer
            assert not any(closed_by_server(s) for s in raw)
    finally:
        for s in raw:
            s.close()
    honest_assignment(patient, "decode")


def test_a_metrics_port_of_its_own_keeps_the_same_per_client_cap(split, attacker):
    """The metrics plane on its own listener is guarded as the management plane is: of maxLinkNum
    idle connections from one client it keeps PER_CLIENT and closes the others at once, unanswered;
    another client's scrape is answered (200, the engine's families) and so is the management plane,
    while they are held."""
    plane = SimpleNamespace(port=split.metrics_port, ctx=None)
    idle = [connect(plane, attacker) for _ in range(MAX_LINKS)]
    try:
        wait_until(lambda: sum(closed_by_server(s) for s in idle) == MAX_LINKS - PER_CLIENT, hang_guard(1000),
                   "the metrics connections past maxLinksPerClient closed")
        answer = answer_of(plane, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(answer) == 200 and b"\npdlink_role_epoch{" in answer, answer[:400]
        assert split.client.request("GET", "/health").status == 200
        assert sum(closed_by_server(s) for s in idle) == MAX_LINKS - PER_CLIENT  # the kept ones still wait
    finally:
        for s in idle:
            s.close()
    honest_assignment(split, "prefill")


def test_idle_connections_are_closed_at_the_head_deadline(strict, attacker):
    """Idle connections (nothing sent) are closed, unanswered, at headTimeoutMs; their slots are free
    again: the same client is served afterwards."""
    idle = [connect(strict, attacker) for _ in range(PER_CLIENT)]
    try:
        assert strict.client.request("GET", "/health").status == 200
        wait_until(lambda: all(closed_by_server(s) for s in idle), hang_guard(HEAD_MS),
                   "idle connections closed at headTimeoutMs")
    finally:
        for s in idle:
            s.close()
    for _ in range(PER_CLIENT + 1):  # one more than the cap, one after another: the slots were given back
        assert status_of(answer_of(strict, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", attacker)) == 200
    honest_assignment(strict, "prefill")


# ------------------------------------------------------------------------------------- stalls

def test_stalled_connections_do_not_hold_up_others(patient, attacker):
    """One client with PER_CLIENT stalled connections (a head begun, two bodies begun) and one more
    (closed at once): /health, the probes and a role post from another client are answered while
    the stalled ones wait, unanswered."""
    stalled = [connect(patient, attacker) for _ in range(PER_CLIENT)]
    try:
        stalled[0].sendall(b"POST /v1/role/flex HTTP/1.1\r\nHost: x\r\n")
        for sock in stalled[1:]:
            sock.sendall(post_head(39 * MIB) + b" " * MIB)
        extra = connect(patient, attacker)
        stalled.append(extra)
        wait_until(lambda: closed_by_server(extra), hang_guard(1000), "a connection past the cap closed")
        for path in ("/health", "/v2/health/live", "/v2/health/ready"):
            assert patient.client.request("GET", path).status == 200
        honest_assignment(patient, "prefill")
        assert not any(closed_by_server(s) for s in stalled[:-1])  # still waiting, unanswered
    finally:
        for sock in stalled:
            sock.close()
    honest_assignment(patient, "decode")


def test_a_stalled_head_gets_408_and_nothing_changes(strict, attacker):
    before = state(strict)
    sock = connect(strict, attacker, timeout=hang_guard(HEAD_MS))
    try:
        sock.sendall(b"POST /v1/role/flex HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")  # no end
        answer = read_to_end(sock)
    finally:
        sock.close()
    assert status_of(answer) == 408, answer
    assert answer.endswith(b"\r\n\r\nRequest head not received in time.") and b"connection: close" in answer
    assert state(strict) == before
    honest_assignment(strict, "decode")


def test_stalled_bodies_get_408_nothing_changes_and_their_memory_is_freed(strict, attacker):
    """Three stalled role bodies from one client: a complete flex body under a Content-Length 10
    bytes longer, and two 24 MiB bodies of 39 MiB announced; and, from another client, a stalled
    test pull body. Each gets the JSON 408 at bodyTimeoutMs, the role stays, and the server's
    resident memory comes back down."""
    before = state(strict)
    rss0 = memory_mib(strict.proc.proc.pid)[strict.proc.proc.pid][0]
    flex = json.dumps(dict(role_body(), local=dict(role_body()["local"], p_percentage=50))).encode()
    stalled = [connect(strict, attacker, timeout=hang_guard(BODY_MS)) for _ in range(PER_CLIENT)]
    stalled.append(connect(strict, new_address(), timeout=hang_guard(BODY_MS)))
    try:
        stalled[0].sendall(post_head(len(flex) + 10, "/v1/role/flex") + flex)
        for sock in stalled[1:3]:
            sock.sendall(post_head(39 * MIB) + b" " * (24 * MIB))
        stalled[3].sendall(post_head(100, "/v1/pdlink/test/kv/pull") + b'{"target": 1')
        answers = [read_to_end(sock) for sock in stalled]
    finally:
        for sock in stalled:
            sock.close()
    for answer in answers:
        assert status_of(answer) == 408, answer[:300]
        doc = error_doc(answer)
        assert doc["error_type"] == "Request Timeout" and f"bodyTimeoutMs ({BODY_MS} ms)" in doc["error"], doc
    assert state(strict) == before
    if MEMORY_BOUNDS:
        wait_until(lambda: memory_mib(strict.proc.proc.pid)[strict.proc.proc.pid][0] <= rss0 + 24, hang_guard(1000),
                   "the stalled bodies' memory given back")
    honest_assignment(strict, "flex")
    honest_assignment(strict, "decode")


# ------------------------------------------------------------------------------------- shape

def test_a_huge_element_count_is_refused_before_decoding(patient, attacker):
    """38 MiB of [{},{},...] (under maxRequestLength): 422 before decoding, and neither the server
    nor its decode worker grows by more than RSS_BOUND_MIB (decoded, it would be about 1 GiB)."""
    pid = patient.proc.proc.pid
    padded = dict(role_body(), padding="x" * (100 * 1024))  # over 64 KiB: decoded in the worker, started now
    assert patient.client.request("POST", "/v1/role/decode", padded).status == 200
    before = memory_mib(pid)
    assert len(before) >= 2, before  # the server and its decode worker
    body = b"[" + b"{}," * 13_300_000 + b"{}]"
    answer = answer_of(patient, post_head(len(body), "/v1/role/decode") + body, attacker)
    assert status_of(answer) == 422, answer[:300]
    doc = error_doc(answer)
    assert doc["error_type"] == "Input validation error", doc
    assert f"more than {MAX_ITEMS} strings, arrays, objects and commas" in doc["error"], doc
    after = memory_mib(pid)
    for p, (_, hwm) in before.items():
        assert not MEMORY_BOUNDS or after[p][1] - hwm <= RSS_BOUND_MIB, (p, before, after)
    honest_assignment(patient, "prefill")


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 100_000])
def test_deep_nesting_is_refused_before_decoding(patient, attacker, depth):
    before = state(patient)
    extra = depth - 1  # inside the body's own object
    body = b'{"local": {}, "x": ' + b"[" * extra + b"]" * extra + b"}"
    answer = answer_of(patient, post_head(len(body), "/v1/role/decode") + body, attacker)
    assert status_of(answer) == 422, answer[:300]
    assert f"deeper than maxJsonDepth ({MAX_DEPTH} levels)" in error_doc(answer)["error"]
    assert state(patient) == before
    honest_assignment(patient, "decode")


def _items(text: str) -> int:
    """Strings, arrays, objects and commas of JSON text whose strings hold no quote, bracket or comma."""
    return text.count('"') // 2 + text.count(",") + text.count("[") + text.count("{")


def test_the_shape_bounds_are_exact(patient):
    """A valid body at maxJsonDepth levels and at MAX_ITEMS items is accepted; one level or one item
    more is refused (422)."""
    def nested(levels: int) -> bytes:  # the body (1), local (2), device list (3), device (4), then arrays
        b = role_body()
        b["local"]["device"][0]["x"] = json.loads("[" * (levels - 4) + "]" * (levels - 4))
        return json.dumps(b).encode()

    def counted(items: int) -> bytes:
        text = json.dumps(role_body())[:-1] + ', "pad": ['  # one comma, one string, one array
        zeros = items - _items(text + "]}")
        return (text + ",".join(["0"] * (zeros + 1)) + "]}").encode()  # zeros + 1 elements: zeros commas

    assert [_items(counted(n).decode()) for n in (MAX_ITEMS, MAX_ITEMS + 1)] == [MAX_ITEMS, MAX_ITEMS + 1]
    deep = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH  # inside the body's object: MAX_DEPTH + 1 levels
    for data, status in ((nested(MAX_DEPTH), 200), (nested(MAX_DEPTH + 1), 422),
                         (counted(MAX_ITEMS), 200), (counted(MAX_ITEMS + 1), 422),
                         (b'{"x": ' + deep + b"} trailing garbage", 422),  # counted whether or not it is JSON
                         (b'{"x": ' + deep + b', "y": "\xff"}', 400)):  # not UTF-8: 400 first
        resp = patient.client.request("POST", "/v1/role/decode", data)
        assert resp.status == status, (status, resp.status, resp.body[:300])
    honest_assignment(patient, "prefill")


def test_the_largest_valid_body_passes_the_shape_count(patient):
    """256 peers of 64 devices each, every controller field set: about 270,000 items, within the
    bound; past the shape count, the server refuses it only because this instance has one device."""
    def node(ident: int) -> dict[str, Any]:
        return {"id": ident, "host_ip": LOCAL, "server_ip": LOCAL, "super_pod_id": "7", "instance_idx_in_pod": 0,
                "num_instances_per_pod": 1, "is_single_container": True,
                "device": [{"device_id": str(i), "device_ip": LOCAL, "device_logical_id": str(i), "rank_id": str(i),
                            "super_device_id": str(i)} for i in range(64)]}

    body = {"local": dict(node(LOCAL_ID), p_percentage=50), "peers": [node(i) for i in range(1, 257)]}
    assert 250_000 < _items(json.dumps(body)) < 300_000
    before = state(patient)
    resp = patient.client.request("POST", "/v1/role/decode", body)
    assert resp.status == 503, (resp.status, resp.body[:300])
    assert "64" in error_doc(b"\r\n\r\n" + resp.body)["error"]
    assert state(patient) == before


# strings rich in what the count must see through: quotes, backslashes, brackets, commas
_TEXT = st.text(st.sampled_from('"\\[]{},:ab\u00e9\U0001f600 ') | st.characters(), max_size=12)
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TEXT,
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_TEXT, kids, max_size=4),
                     max_leaves=30)


def _shape(v: Any) -> tuple[int, int]:
    """(levels of arrays and objects, strings + arrays + objects + commas) of a decoded JSON value."""
    if isinstance(v, str):
        return 0, 1
    if isinstance(v, (list, dict)):
        values = list(v.values()) if isinstance(v, dict) else v
        kids = [_shape(x) for x in values]
        keys = len(v) if isinstance(v, dict) else 0
        return 1 + max((d for d, _ in kids), default=0), 1 + max(len(v) - 1, 0) + keys + sum(n for _, n in kids)
    return 0, 0


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(value=_JSON, ascii_only=st.booleans(), spaced=st.booleans())
def test_the_shape_count_matches_the_decoded_value(value, ascii_only, spaced):
    data = json.dumps(value, ensure_ascii=ascii_only, separators=(", ", ": ") if spaced else (",", ":"))
    body = data.encode("utf-8", "surrogatepass")
    depth, items = _shape(value)
    assert structure_error(body, max(depth, 1), items) is None
    if items:
        assert "more than" in (structure_error(body, max(depth, 1), items - 1) or ""), (data, items)
    if depth >= 2:
        assert "deeper than" in (structure_error(body, depth - 1, items) or ""), (data, depth)
