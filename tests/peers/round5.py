"""Attacker-side code of the round-5 hostile review (tests/hostile/test_round5_review.py): a hostile
server whose refusals and answers carry the status codes and message bytes a test picks (engine-scope
codes, bytes that are not UTF-8), and raw-client helpers on top of tests/peers/hostile.py's raw link
(sealed links, frames sent and then watched for a bounded time, frames pipelined without reading the
answers, frames on the reverse channel, frames in place of the handshake)."""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from typing import Any

import rawwire
from peers import flagsweep, hostile
from peers.hostile import ATTACKER_IP

# ------------------------------------------------------------------ a hostile server with chosen words

_srv: dict[str, Any] = {}


def serve_words(stage: str, status: int, message: bytes, host: str = ATTACKER_IP) -> int:
    """A server on ``host`` that refuses at ``stage`` ("ack": the HelloAck; "auth": the AuthResult)
    with ``status`` and ``message``, or ("response") completes the handshake and answers every request
    but pings and unlinks with that status and message ("ping": pings too). Returns its port."""
    ls = socket.socket()
    ls.bind((host, 0))
    ls.listen(16)
    _srv.update(sock=ls, conns=[])

    def handle(conn: socket.socket) -> None:
        try:
            head = rawwire.recv_exact(conn, rawwire.HELLO_BYTES)
            _v, channel, _f, _c, expected, _n = rawwire.parse_hello(head)
            cluster = expected if expected != rawwire.ANY else 1
            if stage == "ack":
                conn.sendall(rawwire.ack(status=status, cluster=cluster, message=message))
                conn.recv(1)
                return
            conn.sendall(rawwire.ack(cluster=cluster, challenge=os.urandom(16)))
            rawwire.recv_exact(conn, rawwire.CLIENT_AUTH_BYTES)
            if stage == "auth":
                conn.sendall(rawwire.auth_result(status=status, message=message))
                conn.recv(1)
                return
            conn.sendall(rawwire.auth_result())
            while True:
                op, _flags, _body, plen = rawwire.read_request(conn)
                if op in (rawwire.OP_COMMIT, rawwire.OP_RELEASE):
                    continue
                if op == rawwire.OP_UNLINK or (op == rawwire.OP_PING and stage != "ping"):
                    conn.sendall(rawwire.response())
                    continue
                if op == rawwire.OP_WRITE and plen:
                    rawwire.recv_exact(conn, plen)
                conn.sendall(rawwire.response(status=status, message=message))
        except (ConnectionError, OSError, AssertionError, struct.error):
            pass
        finally:
            conn.close()

    def loop() -> None:
        while True:
            try:
                conn, _ = ls.accept()
            except OSError:
                return
            _srv["conns"].append(conn)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return int(ls.getsockname()[1])


# ------------------------------------------------------------------ raw-client helpers


def send_and_watch(frame: bytes, wait_s: float) -> str:
    """Sends ``frame`` on the raw link's forward channel and says what the victim did within
    ``wait_s``: "closed", "silent" (nothing, the connection open) or "answered <first bytes>"."""
    c = hostile._client
    assert c is not None
    c.fwd.sendall(frame)
    c.fwd.settimeout(wait_s)
    try:
        data = c.fwd.recv(64)
    except TimeoutError:
        return "silent"
    except OSError:
        return "closed"
    finally:
        c.fwd.settimeout(10)
    return "closed" if data == b"" else f"answered {data[:24]!r}"


_pipeline: dict[str, Any] = {}


def pipeline_unread(frame: bytes, count: int) -> None:
    """From a thread, sends ``frame`` ``count`` times on the forward channel and never reads an
    answer (the victim's answers back up until it blocks writing them)."""
    c = hostile._client
    assert c is not None
    sent = [0]

    def run() -> None:
        try:
            for _ in range(count):
                c.fwd.sendall(frame)
                sent[0] += 1
        except OSError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    _pipeline.update(thread=t, sent=sent)


def pipeline_sent() -> int:
    return int(_pipeline["sent"][0])


def send_on_reverse(frame: bytes) -> str:
    """Sends ``frame`` on the raw link's reverse channel (where the victim is the requester and
    this peer the server) and says whether the victim closed it within 1 s."""
    c = hostile._client
    assert c is not None
    c.rev.sendall(frame)
    c.rev.settimeout(1)
    try:
        data = c.rev.recv(64)
    except TimeoutError:
        return "silent"
    except OSError:
        return "closed"
    return "closed" if data == b"" else f"answered {data[:24]!r}"


def instead_of_hello(port: int, frame: bytes) -> str:
    """Connects and sends ``frame`` as the first bytes (where the Hello belongs); what came back."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(ATTACKER_IP, 0))
    try:
        s.sendall(frame)
        data = s.recv(4096)
        return "closed" if data == b"" else f"answered {data[:8]!r}"
    except TimeoutError:
        return "silent"
    except OSError:
        return "closed"
    finally:
        s.close()


def instead_of_client_auth(port: int, frame: bytes) -> str:
    """Sends a Hello, takes the HelloAck, then sends ``frame`` where ClientAuth (64 bytes) belongs:
    what came back ("closed", "refused <status>", or "auth ok" when the engine took the frame's first
    64 bytes as a ClientAuth; then the rest of the frame is the first request of a half-made link)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(ATTACKER_IP, 0))
    try:
        s.sendall(rawwire.hello(cluster=77, expected=rawwire.ANY, nonce=int.from_bytes(os.urandom(16), "little")))
        a = rawwire.read_ack(s)
        if a.status != 0:
            return f"refused {a.status}"
        s.sendall(frame)
        r = rawwire.read_auth(s)
        return f"auth {r.status}"
    except (ConnectionError, OSError, AssertionError):
        return "closed"
    finally:
        s.close()


_sealed: dict[str, Any] = {}


def link_sealed(port: int, cluster: int, secret: bytes, unix: str | None = None) -> None:
    """A raw link that proves ``secret``; its forward channel's frames are sealed (rawwire.Sealer)."""
    fwd, rev, sealer = flagsweep.raw_link(port, cluster, secret, unix)
    _sealed.update(fwd=fwd, rev=rev, sealer=sealer)


def sealed_exchange(frame: bytes, tamper: bool = False, seal: bool = True) -> tuple[int, str, int] | str:
    """Sends ``frame`` sealed (its tag broken when ``tamper``; no tag when not ``seal``), reads the
    sealed response: (status, message, payload_len), "closed", or "bad tag" when the response's tag
    does not check out."""
    s, sealer = _sealed["fwd"], _sealed["sealer"]
    if seal:
        data = sealer.seal(frame)
        if tamper:
            data = data[:-1] + bytes([data[-1] ^ 1])
    else:
        data = frame
    try:
        s.sendall(data)
        head = rawwire.recv_exact(s, rawwire.RESPONSE_HEADER_BYTES)
        status, mlen, plen, _tag = rawwire.response_header(head)
        message = rawwire.recv_exact(s, mlen)
        tag = rawwire.recv_exact(s, rawwire.TAG_BYTES)
        if not sealer.check(head + message, tag):
            return "bad tag"
        return status, message.decode(), plen
    except (ConnectionError, OSError):
        return "closed"


def close_sealed() -> None:
    for k in ("fwd", "rev"):
        if k in _sealed:
            _sealed.pop(k).close()


# ------------------------------------------------------------------ the victim's side


def _outcome(fn: Any, *args: Any) -> tuple[Any, ...]:
    """("ok", result) or ("raised", exception type name, status code or None, scope name or None,
    message) of ``fn(*args)``: an error of any type comes back as data, so a test sees what a
    caller of the engine would have to catch."""
    try:
        return ("ok", fn(*args))
    except Exception as e:  # noqa: BLE001 (what the victim's caller would see, whatever it is)
        scope = getattr(e, "scope", None)
        code = getattr(e, "status_code", None)
        return ("raised", type(e).__name__, None if code is None else int(code),
                None if scope is None else scope.name, str(e)[:300])


def victim_connect_each(port: int) -> tuple[Any, ...]:
    """The victim's connect_each to ATTACKER_IP:port: each LinkResult's (status, message, scope),
    or how the call raised."""
    from peers.native import _engine

    def run() -> list[tuple[int, str, str | None]]:
        return [(int(r.status), r.message, None if r.scope is None else r.scope.name)
                for r in _engine().connect_each([(None, (ATTACKER_IP, port))], timeout_ms=3000)]

    return _outcome(run)


def victim_connect(port: int) -> tuple[Any, ...]:
    from peers.native import _engine

    return _outcome(lambda: _engine().connect((ATTACKER_IP, port), timeout_ms=3000))


def victim_read(peer: int, name: str, remote_address: int, op: str = "read") -> tuple[Any, ...]:
    """The victim's Engine.read (or write) of 64 bytes at ``remote_address`` of ``peer`` into the
    start of its region ``name``."""
    from peers.native import _engine, _state

    base = _state["regions"][name].region.addresses[0]
    return _outcome(lambda: getattr(_engine(), op)(peer, [(base, 64)], [(remote_address, 64)]))


def victim_reports() -> tuple[Any, ...]:
    """links() as dicts, stats(), notifications(): what the victim's management code reads; an
    exception here is one a hostile peer put in the engine's own reports."""
    from peers.native import _engine

    e = _engine()
    return _outcome(lambda: ([link.as_dict() for link in e.links()], e.stats(),
                             [(n.name, n.message) if hasattr(n, "name") else repr(n) for n in e.notifications()]))


def rss_kib() -> int:
    """This process's resident set (KiB), for a growth check."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


# ------------------------------------------------------------------ a device channel the attacker sets up for real

_hccl: dict[str, Any] = {}


def _hccl_lib() -> Any:
    if "lib" not in _hccl:
        from peers import fake_ascend

        acl = fake_ascend.lib()  # the ACL the HCCL fake needs, loaded first
        acl.aclInit(None)
        _hccl["acl"] = acl
        lib = ctypes.CDLL(os.path.join(os.environ["PDLINK_ASCEND_LIB_DIR"], "libhccl.so"))
        lib.HcclGetRootInfo.argtypes = [ctypes.c_void_p]
        lib.HcclCommInitRootInfo.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p]
        _hccl["lib"] = lib
        _hccl["joins"] = []
    return _hccl["lib"]


def _device() -> None:
    _hccl_lib()
    assert _hccl["acl"].aclrtSetDevice(0) == 0  # per thread


def root_info() -> bytes:
    """A root info made by the fake HCCL in this process (rank 0 of its communicator, not joined yet)."""
    buf = ctypes.create_string_buffer(4108)
    _device()
    rc = _hccl_lib().HcclGetRootInfo(buf)
    assert rc == 0, rc
    return buf.raw


def join_root(root: bytes) -> None:
    """Joins the root info as rank 0 from a thread (its result kept for ``joins``)."""
    lib = _hccl_lib()
    buf = ctypes.create_string_buffer(root, 4108)
    comm = ctypes.c_void_p()

    def run() -> None:
        _device()
        _hccl["joins"].append(lib.HcclCommInitRootInfo(2, buf, 0, ctypes.byref(comm)))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    _hccl.setdefault("threads", []).append((t, buf, comm))


def joins(wait_s: float) -> list[int]:
    for t, _b, _c in _hccl.get("threads", []):
        t.join(wait_s)
    return list(_hccl.get("joins", []))


def report_records() -> dict[str, Any]:
    """What the victim's report records say about themselves: each LinkInfo's fields, whether it
    survives pickling equal and hashes alike, whether an attribute can be overwritten; stats() keys;
    each pool's PoolInfo fields where the engine has pools."""
    import pickle

    from peers.native import _engine

    e = _engine()
    out: dict[str, Any] = {"links": [], "stats": sorted(e.stats().as_dict())}
    for link in e.links():
        copy = pickle.loads(pickle.dumps(link))
        try:
            link.peer_cluster_id = 12345  # type: ignore[misc]
            writable = True
        except (AttributeError, TypeError):
            writable = False
        out["links"].append({"fields": sorted(link.as_dict()), "pickles_equal": copy == link,
                             "hash_equal": hash(copy) == hash(link), "writable": writable,
                             "cluster": link.peer_cluster_id})
    return out


def answer_on_reverse_with(status: int, message: bytes) -> None:
    """From a thread: answers each request the victim sends over the raw link's reverse channel with
    ``status`` and ``message``."""
    c = hostile._client
    assert c is not None
    rev = c.rev

    def run() -> None:
        try:
            while True:
                op, _flags, _body, plen = rawwire.read_request(rev)
                if op == rawwire.OP_WRITE and plen:
                    rawwire.recv_exact(rev, plen)
                if op in (rawwire.OP_COMMIT, rawwire.OP_RELEASE):
                    continue
                rev.sendall(rawwire.response(status=status, message=message))
        except (ConnectionError, OSError, AssertionError, struct.error):
            pass

    threading.Thread(target=run, daemon=True).start()


def victim_disconnect_each(peer: int) -> tuple[Any, ...]:
    from peers.native import _engine

    def run() -> list[tuple[int, str, str | None]]:
        return [(int(r.status), r.message, None if r.scope is None else r.scope.name)
                for r in _engine().disconnect_each([peer], timeout_ms=2000)]

    return _outcome(run)


def victim_notify(peer: int) -> tuple[Any, ...]:
    from peers.native import _engine

    return _outcome(lambda: _engine().notify(peer, b"hello", name=b"n"))


def victim_ping(peer: int) -> tuple[Any, ...]:
    from peers.native import _engine

    return _outcome(lambda: _engine().ping(peer))


def victim_remote_memory(peer: int) -> tuple[Any, ...]:
    from peers.native import _engine

    return _outcome(lambda: _engine().remote_memory(peer))


def victim_calls(peer: int, name: str | None) -> dict[str, tuple[Any, ...]]:
    """Every request this engine makes of ``peer`` that a test can start from the API: its outcome."""
    out = {"notify": victim_notify(peer), "ping": victim_ping(peer), "remote_memory": victim_remote_memory(peer)}
    if name is not None:
        out["read"] = victim_read(peer, name, 0x10000)
        out["write"] = victim_read(peer, name, 0x10000, "write")
    return out


def trickle(frame: bytes, interval_s: float) -> None:
    """From a thread, sends ``frame`` one byte every ``interval_s`` on the forward channel (until it
    is sent or the connection fails)."""
    c = hostile._client
    assert c is not None

    def run() -> None:
        try:
            for i in range(len(frame)):
                c.fwd.sendall(frame[i:i + 1])
                threading.Event().wait(interval_s)
        except OSError:
            pass

    threading.Thread(target=run, daemon=True).start()
