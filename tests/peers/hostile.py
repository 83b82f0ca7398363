"""A hostile pdlink endpoint, run in its own peer process: a plain socket program that speaks the
wire protocol (tests/rawwire.py) as an attacker would.

Two roles:

* a hostile **server** (``serve``): it accepts a victim's link on 127.0.0.2 (TCP, and on request an
  AF_UNIX socket it redirects the victim to), completes or sabotages the handshake, then answers
  the victim's requests the way ``mode`` says (malformed, oversized, lying about addresses ...),
  or (``read_back``) sends a request of its own over the link the victim dialled;
* a hostile **client** (``attack``): it links to a victim as a raw peer from 127.0.0.2 and sends
  crafted frames, reporting what came back.

Everything the victim sends is recorded (``observed``) so tests can show what it did and did not
disclose.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import socket
import struct
import threading
from typing import Any

import rawwire

ATTACKER_IP = "127.0.0.2"


@dataclasses.dataclass
class _Server:
    mode: str
    sock: socket.socket
    unix: socket.socket | None
    unix_name: str
    observed: list[dict[str, Any]]
    conns: list[socket.socket]
    published: Any  # a buffer whose address this process publishes as its "generation words"
    params: dict[str, Any]
    thread: threading.Thread | None = None


_server: _Server | None = None


# Modes for a victim whose destination is DEVICE memory of a device backend: the server says its
# memory is host memory (turning every device path down), so the victim reads over the stream and
# stages into DEVICE memory; the plain read is then answered as the mode named here.
STAGED_MODES = {"staged_wrong_length": "read_wrong_length", "staged_huge_payload": "read_huge_payload",
                "staged_stall": "stall", "staged_exact": "read_exact"}


def serve(mode: str, redirect: bool = False, **params: Any) -> int:
    """Starts the hostile server; returns its TCP port on ATTACKER_IP."""
    global _server
    assert _server is None
    tcp = socket.socket()
    tcp.bind((ATTACKER_IP, 0))
    tcp.listen(16)
    unix = None
    name = ""
    if redirect:
        name = f"pdlink-hostile-{os.getpid()}"
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind("\0" + name)
        unix.listen(16)
    # generation, role word (epoch 0, no switch pending: Registry::Published) and pin epoch, readable by a prober
    words = (ctypes.c_uint64 * 3)(7, 0, 7)
    params.setdefault("data", (ctypes.c_uint8 * (1 << 20)).from_buffer_copy(b"\x5a" * (1 << 20)))
    _server = _Server(mode, tcp, unix, name, [], [], words, params)
    _server.thread = threading.Thread(target=_accept_loop, args=(_server,), daemon=True)
    _server.thread.start()
    return int(tcp.getsockname()[1])


def set_params(**params: Any) -> None:
    """Changes what the running server's scripted answers use (a victim's address, learnt later)."""
    assert _server is not None
    _server.params.update(params)


def observed() -> list[dict[str, Any]]:
    assert _server is not None
    return list(_server.observed)


def _accept_loop(srv: _Server) -> None:
    import select

    listeners = [srv.sock] + ([srv.unix] if srv.unix is not None else [])
    while True:
        ready, _, _ = select.select(listeners, [], [])
        for ls in ready:
            conn, _ = ls.accept()
            srv.conns.append(conn)
            threading.Thread(target=_handle, args=(srv, conn, ls is srv.unix), daemon=True).start()


def _handle(srv: _Server, conn: socket.socket, local: bool) -> None:
    try:
        _handshake_and_serve(srv, conn, local)
    except (ConnectionError, OSError, AssertionError, struct.error) as e:
        srv.observed.append({"event": "closed", "why": repr(e)})
    finally:
        conn.close()


def _handshake_and_serve(srv: _Server, conn: socket.socket, local: bool) -> None:
    mode = srv.mode
    head = rawwire.recv_exact(conn, rawwire.HELLO_BYTES)
    version, channel, flags, cluster, expected, nonce = rawwire.parse_hello(head)
    srv.observed.append({"event": "hello", "channel": channel, "flags": flags, "cluster": cluster, "local": local,
                         "nonce": nonce})
    if mode == "garbage_ack":
        conn.sendall(os.urandom(200))
        return
    if mode == "ack_huge_message":
        conn.sendall(struct.pack("<IHIQI", rawwire.ACK_MAGIC, 3, 0, 1, 0xFFFFFFFF) + bytes(48))
        return
    if mode == "ack_unknown_status":
        conn.sendall(rawwire.ack(status=12345))
        return
    if mode == "ack_wrong_cluster":
        conn.sendall(rawwire.ack(cluster=77))
        return
    if mode == "ack_other_version":
        conn.sendall(rawwire.ack(cluster=expected, version=srv.params.get("version", rawwire.VERSION + 1)))
        return
    if mode == "silent_after_hello":  # a handshake that never progresses
        _idle(conn)
        return
    ack_proof = os.urandom(32) if mode == "ack_random_proof" else bytes(32)  # a secret it does not know
    conn.sendall(rawwire.ack(cluster=expected if expected != rawwire.ANY else 1, challenge=os.urandom(16),
                             proof=ack_proof))  # whoever the victim dials
    auth = rawwire.recv_exact(conn, rawwire.CLIENT_AUTH_BYTES)
    boot, gen = auth[32:48], struct.unpack("<Q", auth[56:64])[0]
    srv.observed.append({"event": "client_auth", "channel": channel, "local": local, "hint": boot != bytes(16),
                         "gen_addr": gen})
    gen_addr = ctypes.addressof(srv.published) if local else 0
    if mode == "redirect_to":  # to an AF_UNIX name of the test's choosing
        conn.sendall(rawwire.auth_result(redirect=str(srv.params["name"]).encode()))
        return
    if mode == "auth_redirect_unoffered":
        conn.sendall(rawwire.auth_result(redirect=b"pdlink-nowhere"))
        return
    if not local and channel == 0 and srv.unix is not None:
        conn.sendall(rawwire.auth_result(redirect=srv.unix_name.encode()))
        return
    if mode == "auth_gen_on_tcp":
        conn.sendall(rawwire.auth_result(gen_addr=0x1000))
        return
    if mode == "auth_huge_redirect":
        conn.sendall(struct.pack("<IIIHQB", rawwire.AUTH_MAGIC, 0, 0, 0xFFFF, 0, 0) + bytes(rawwire.TAG_BYTES))
        return
    conn.sendall(rawwire.auth_result(gen_addr=gen_addr))
    if mode == "vanish" and local:
        _vanish(srv, conn, channel)
        return
    if channel == 0:
        _answer_requests(srv, conn)
        return
    if mode == "read_back":  # use the victim's own link to read its blocks cache (model 0)
        conn.sendall(rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=0, tensors=(0,), runs=((0, 64),))))
        status, message, payload = rawwire.read_response(conn)
        srv.observed.append({"event": "read_back", "status": status, "message": message, "payload": payload})
    _idle(conn)


# ---------------------------------------------------------------- a peer that outlives its pid
#
# The pid-reuse attack on a same-host link: the process the kernel named for the link's AF_UNIX
# channels (P) forks once both channels are up and exits, while its child (C) keeps the channels
# and answers the victim's direct reads and writes with addresses of the victim's own memory. The
# test then makes a thread of the victim get P's pid number: a victim that copies by pid number
# would copy inside itself. P runs in its own process (``serve_vanishing``) so that the attacker's
# peer process, which the test talks to, outlives it.

_vanishing: dict[str, Any] = {}


def serve_vanishing(**params: Any) -> tuple[int, int]:
    """Starts P (a fork of this process); returns its TCP port on ATTACKER_IP and its pid. P forks
    C and exits once the victim's link is up and ``vanish`` says so. ``params["log"]``: a file C
    appends one line per request it receives to."""
    ours, theirs = os.pipe()
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ours)
        os.close(go_write)
        _vanishing_main(theirs, dict(params, go=go_read))
    os.close(theirs)
    os.close(go_read)
    with os.fdopen(ours) as pipe:
        port = int(pipe.readline())
    _vanishing.update(pid=pid, go=go_write)
    return port, pid


def vanish() -> int:
    """Lets P fork and exit, waits until it did and reaps it (its pid number is then free); its
    exit status."""
    os.write(_vanishing["go"], b"x")
    _, status = os.waitpid(_vanishing["pid"], 0)
    return os.waitstatus_to_exitcode(status)


def _vanishing_main(pipe: int, params: dict[str, Any]) -> None:
    try:
        global _server
        _server = None
        os.write(pipe, f"{serve('vanish', True, **params)}\n".encode())
        os.close(pipe)
        threading.Event().wait(120)  # the serving threads do the rest; P ends in _vanish
    finally:
        os._exit(1)


def _vanish(srv: _Server, conn: socket.socket, channel: int) -> None:
    both = srv.params.setdefault("both_channels", threading.Event())
    if channel != 0:  # the reverse channel: its handshake is done, so the link is
        both.set()
        _idle(conn)
        return
    if not both.wait(30) or os.read(srv.params["go"], 1) != b"x":  # the test: the victim's link is up
        return
    if os.fork() != 0:
        os._exit(0)  # P: gone, its pid number free once reaped; C holds every descriptor
    import signal

    signal.alarm(120)  # C never outlives a test run
    try:
        log = open(srv.params["log"], "a", buffering=1)
        srv.mode = "direct_victim_addresses"
        while True:
            op, flags, body, plen = rawwire.read_request(conn)
            log.write(f"{op} {flags}\n")
            if op == rawwire.OP_WRITE and not flags:
                rawwire.recv_exact(conn, plen)
            if op in (rawwire.OP_COMMIT, rawwire.OP_RELEASE):
                continue
            if op in (rawwire.OP_PING, rawwire.OP_UNLINK):
                conn.sendall(rawwire.response())
            elif op in (rawwire.OP_READ, rawwire.OP_WRITE) and flags == rawwire.FLAG_DIRECT:
                _kind, tensors, runs = rawwire.parse_body(body)
                addrs = srv.params["addresses"]
                pieces = [(addrs[i % len(addrs)] + o, n) for i, _ in enumerate(tensors) for o, n in runs]
                conn.sendall(rawwire.response(payload=rawwire.direct_answer(7, _epoch_addr(srv), pieces)))
            else:
                conn.sendall(rawwire.response(status=0x5010B019, message=b"direct only"))
    except (ConnectionError, OSError, struct.error):
        pass
    finally:
        os._exit(0)


def _epoch_addr(srv: _Server) -> int:
    """Where this process keeps the pin epoch it answers (the third published word)."""
    return ctypes.addressof(srv.published) + 16


def _idle(conn: socket.socket) -> None:
    # the victim's serving side of this link: nothing is ever requested of it
    while conn.recv(4096):
        pass


def _answer_requests(srv: _Server, conn: socket.socket) -> None:
    mode, params = srv.mode, srv.params
    while True:
        op, flags, body, plen = rawwire.read_request(conn)
        rec: dict[str, Any] = {"event": "request", "op": op, "flags": flags, "payload_len": plen}
        if op in (rawwire.OP_READ, rawwire.OP_WRITE, rawwire.OP_DESCRIBE, rawwire.OP_COMMIT, rawwire.OP_RELEASE):
            kind, tensors, runs = rawwire.parse_body(body)
            rec.update(kind=kind, tensors=tensors, runs=runs)
        if op == rawwire.OP_PATH_CONNECT:
            rec.update(path=body[0] if body else None)  # the header: the path it sets up
        srv.observed.append(rec)
        if op in (rawwire.OP_COMMIT, rawwire.OP_RELEASE):
            continue
        if op == rawwire.OP_PING or op == rawwire.OP_UNLINK:
            conn.sendall(rawwire.response())
            continue
        if op == rawwire.OP_WRITE and not flags:
            rawwire.recv_exact(conn, plen)  # take the payload; what follows is the scripted answer
        pieces = len(rec.get("tensors", [])) * len(rec.get("runs", []))
        total = sum(n for _, n in rec.get("runs", [])) * len(rec.get("tensors", []))
        if mode in STAGED_MODES:  # answer a plain stream read only; turn every device request down
            if op != rawwire.OP_READ or flags:
                conn.sendall(rawwire.response(status=0x5010B019, message=b"host memory: not on a device path"))
                continue
            mode = STAGED_MODES[srv.mode]
        if mode == "stall":
            _idle(conn)
            return
        if mode == "resp_bad_magic":
            conn.sendall(b"\x00" * rawwire.RESPONSE_HEADER_BYTES)
        elif mode == "resp_unknown_status":
            conn.sendall(rawwire.response(status=424242))
        elif mode == "resp_huge_message":
            conn.sendall(struct.pack(rawwire.RESPONSE_FORMAT, rawwire.RESPONSE_MAGIC, rawwire.LINK_FAILED, 0x7FFFFFFF,
                                     0, 0, 0))
        elif mode == "resp_text_on_success":
            conn.sendall(rawwire.response(message=b"fine"))
        elif mode == "resp_payload_on_error":
            conn.sendall(rawwire.response(status=rawwire.LINK_FAILED, message=b"no", payload_len=1 << 40))
        elif mode == "read_wrong_length":
            conn.sendall(rawwire.response(payload=b"\x5a" * (total + 8)))
        elif mode == "read_huge_payload":
            conn.sendall(rawwire.response(payload_len=1 << 60))
        elif mode == "read_exact":  # an honest-looking server (control case): the bytes asked for
            conn.sendall(rawwire.response(payload=b"\x5a" * total))
        elif mode == "read_exact_tags":  # the bytes asked for, each answer with the next of params["tags"]
            tags, n = params["tags"], params.get("answered", 0)
            params["answered"] = n + 1
            conn.sendall(rawwire.response(payload=b"\x5a" * total, epoch_tag=tags[n % len(tags)]))
        elif op == rawwire.OP_DESCRIBE and rec["kind"] == rawwire.KIND_RAW and mode.startswith("table_"):
            conn.sendall(_memory_table(mode, params))
        elif op == rawwire.OP_DESCRIBE and mode == "describe_huge":
            conn.sendall(rawwire.response(payload_len=1 << 40))
        elif op == rawwire.OP_DESCRIBE and mode == "describe_bad_count":
            conn.sendall(rawwire.response(payload=struct.pack("<QQQI", 7, 4096, 64, 5000) + bytes(16)))
        elif op == rawwire.OP_DESCRIBE and mode in ("direct_victim_addresses", "describe_victim_addresses"):
            # a layout whose "tensors" are the victim's own memory (the addresses it is told about)
            addrs = params["addresses"]
            desc = struct.pack("<QQQI", 7, params["tensor_bytes"], params["stride"], len(addrs))
            conn.sendall(rawwire.response(payload=desc + b"".join(struct.pack("<Q", a) for a in addrs)))
        elif op == rawwire.OP_DESCRIBE:
            conn.sendall(rawwire.response(status=0x5010B019, message=b"no direct reads"))  # refuse: checked path
        elif mode == "direct_wrong_count":
            conn.sendall(rawwire.response(payload=rawwire.direct_answer(1, _epoch_addr(srv), [(0, 0)] * (pieces + 1))))
        elif mode == "direct_wrong_length":
            conn.sendall(rawwire.response(payload=rawwire.direct_answer(
                1, _epoch_addr(srv), [(0x1000, n + 1) for _ in rec["tensors"] for _, n in rec["runs"]])))
        elif mode in ("direct_own_memory", "direct_epoch_moved"):
            # addresses of this process's own buffer (readable by the victim), with the pin epoch
            # this process publishes, or one that has moved on since (a pin that expired)
            base = ctypes.addressof(params["data"])
            own, at = [], 0
            for _ in rec["tensors"]:
                for _o, n in rec["runs"]:
                    own.append((base + at, n))
                    at += n
            epoch = srv.published[2] - (1 if mode == "direct_epoch_moved" else 0)
            conn.sendall(rawwire.response(payload=rawwire.direct_answer(epoch, _epoch_addr(srv), own)))
        elif mode == "direct_victim_addresses":
            addrs = params["addresses"]
            victims = [(addrs[i % len(addrs)] + o, n) for i, _ in enumerate(rec["tensors"]) for o, n in rec["runs"]]
            conn.sendall(rawwire.response(payload=rawwire.direct_answer(7, _epoch_addr(srv), victims)))
        elif rec.get("path") == rawwire.PATH_UCX and mode.startswith("ucx_"):
            # a UcxHello (u64 token, u32 message size, worker address) with a message size out of
            # bounds or missing, or one too long to read; its "address" is bytes that would abort
            # UCX (docs/ucx.md, "Trust") if the victim got as far as making an endpoint of them
            size = {"ucx_size_too_small": 1, "ucx_size_not_power": 3 << 14, "ucx_no_size": 0}.get(mode, 1 << 14)
            hello = struct.pack("<QI", 7, size) + b"\xa5" * 64
            conn.sendall(rawwire.response(payload_len=1 << 40) if mode == "ucx_huge_answer"
                         else rawwire.response(payload=hello))
        elif rec.get("path") == rawwire.PATH_DEVICE_CHANNEL and mode == "devchan_unoffered_option":
            conn.sendall(rawwire.response(payload=b"\x01"))  # agrees to one-sided, which was not offered
        elif rec.get("path") == rawwire.PATH_DEVICE_CHANNEL and mode == "devchan_long_answer":
            conn.sendall(rawwire.response(payload=b"\x00" * 9))
        elif rec.get("path") == rawwire.PATH_DEVICE_CHANNEL:
            conn.sendall(rawwire.response(status=0x5010B019, message=b"no device channels"))
        elif mode == "ipc_wrong_span":
            key = b"attacker-key".ljust(64, b"\0")
            conn.sendall(rawwire.response(payload=b"".join(key + struct.pack("<Q", 1 << 30) for _ in rec["tensors"])))
        elif mode == "ipc_empty_key":
            span = max(o + n for o, n in rec["runs"]) - min(o for o, _ in rec["runs"])
            conn.sendall(rawwire.response(payload=b"".join(bytes(64) + struct.pack("<Q", span)
                                                          for _ in rec["tensors"])))
        elif mode == "ipc_wrong_size":
            conn.sendall(rawwire.response(payload=bytes(72 * len(rec["tensors"]) + 1)))
        else:
            conn.sendall(rawwire.response(status=0x5010B005, message=b"refused"))


def _memory_table(mode: str, params: dict[str, Any]) -> bytes:
    """The answer to a memory-table request (a raw describe): generation, count, (address, length)
    per range, sorted; each mode breaks one rule, or (table_victim_addresses) lists memory that is
    the victim's, not this process's."""
    def table(ranges: list[tuple[int, int]], count: int | None = None) -> bytes:
        body = struct.pack("<QI", 7, len(ranges) if count is None else count)
        return rawwire.response(payload=body + b"".join(struct.pack("<QQ", a, n) for a, n in ranges))

    if mode == "table_huge":
        return rawwire.response(payload_len=1 << 40)
    if mode == "table_bad_count":
        return table([(0x10000, 4096), (0x20000, 4096)], count=3)
    if mode == "table_too_many":  # more ranges than any request may address, each well formed
        return table([(0x10000 + 4096 * i, 4096) for i in range(65_537)])
    if mode == "table_unsorted":
        return table([(0x20000, 4096), (0x10000, 4096)])
    if mode == "table_empty_range":
        return table([(0x10000, 0)])
    if mode == "table_wrapping":
        return table([(2**64 - 4096, 8192)])
    assert mode == "table_victim_addresses", mode
    return table([(params["address"], params["length"])])


# --------------------------------------------------------------------------- hostile client


@dataclasses.dataclass
class _Client:
    fwd: socket.socket
    rev: socket.socket


_client: _Client | None = None
_answer = {"left": 0, "at": 0}  # the payload start_answer left in the socket
_words = (ctypes.c_uint64 * 2)(1, 0)  # this process's "published words" (generation, role), for a victim's probe


def link_raw(port: int, cluster: int = 9, secret: bytes = b"", unix: str | None = None,
             expected: int = rawwire.ANY, nonce: int | None = None) -> tuple[int, str]:
    """Links to the victim as a raw peer (both channels) from ATTACKER_IP, or over the AF_UNIX name
    `unix`, as cluster `cluster` to whatever cluster the victim is (or `expected`); returns
    (status, message) of the handshake."""
    global _client
    if nonce is None:
        nonce = int.from_bytes(os.urandom(16), "little")
    gen = ctypes.addressof(_words) if unix is not None else 0
    h = rawwire.handshake(port, cluster=cluster, expected=expected, nonce=nonce, secret=secret, unix=unix,
                          source=ATTACKER_IP, gen_addr=gen)
    if h.status != 0:
        return h.status, h.message
    r = rawwire.handshake(port, channel=1, cluster=cluster, expected=expected, nonce=nonce, secret=secret,
                          unix=unix, source=ATTACKER_IP, gen_addr=gen)
    if r.status != 0:
        return r.status, r.message
    h.sock.settimeout(10)
    _client = _Client(h.sock, r.sock)
    return 0, ""


def redirect_name(port: int, cluster: int = 9) -> str:
    """Asks an engine for a same-host redirect by claiming its host (the hint of this machine) and
    returns the AF_UNIX name it answers with ("" when it does not redirect)."""
    h = rawwire.handshake(port, cluster=cluster, expected=rawwire.ANY, flags=rawwire.HELLO_SAME_HOST,
                          hint=rawwire.host_hint(), source=ATTACKER_IP)
    h.sock.close()
    assert h.result is not None, h.message
    return h.result.redirect


def send(frame: bytes) -> None:
    assert _client is not None
    _client.fwd.sendall(frame)


def start_answer(frame: bytes) -> tuple[int, str, int]:
    """Sends one request frame and reads its response's header and message, leaving the payload in
    the socket (``read_answer`` reads it): (status, message, payload length)."""
    assert _client is not None
    _client.fwd.sendall(frame)
    status, mlen, plen, _tag = rawwire.response_header(rawwire.recv_exact(_client.fwd, rawwire.RESPONSE_HEADER_BYTES))
    _answer.update(left=plen, at=0)
    return status, rawwire.recv_exact(_client.fwd, mlen).decode(), plen


def read_answer(nbytes: int, unit: bytes) -> bool:
    """Reads the next ``nbytes`` of the payload ``start_answer`` left (all of what is left when
    ``nbytes`` is 0); whether every byte is ``unit``'s byte at that payload offset (the payload
    being ``unit`` repeated)."""
    assert _client is not None
    n = _answer["left"] if nbytes == 0 else nbytes
    same = True
    while n:
        got = rawwire.recv_exact(_client.fwd, min(n, len(unit) - _answer["at"] % len(unit)))
        start = _answer["at"] % len(unit)
        same = same and got == unit[start:start + len(got)]
        _answer["at"] += len(got)
        _answer["left"] -= len(got)
        n -= len(got)
    return same


def send_zeros(nbytes: int) -> None:
    """Sends ``nbytes`` zero bytes (a payload's rest), 1 MiB at a time."""
    assert _client is not None
    chunk = bytes(1 << 20)
    while nbytes:
        _client.fwd.sendall(chunk[:min(nbytes, len(chunk))])
        nbytes -= min(nbytes, len(chunk))


def read_response() -> tuple[int, str, bytes]:
    assert _client is not None
    return rawwire.read_response(_client.fwd)


def exchange(frame: bytes) -> tuple[int, str, bytes] | str:
    """Sends one request frame and returns the victim's response, or "closed" when it dropped the
    link instead."""
    assert _client is not None
    try:
        _client.fwd.sendall(frame)
        return rawwire.read_response(_client.fwd)
    except (ConnectionError, OSError):
        return "closed"


def exchange_header(frame: bytes) -> tuple[int, int] | str:
    """Sends one request frame that is answered without a payload; returns the response's status
    and epoch tag (a u32 since wire v8), or "closed"."""
    assert _client is not None
    try:
        _client.fwd.sendall(frame)
        head = rawwire.recv_exact(_client.fwd, rawwire.RESPONSE_HEADER_BYTES)
        status, mlen, plen, tag = rawwire.response_header(head)
        rawwire.recv_exact(_client.fwd, mlen + plen)
        return status, tag
    except (ConnectionError, OSError):
        return "closed"


def close() -> None:
    global _client
    if _client is not None:
        _client.fwd.close()
        _client.rev.close()
        _client = None


def flood_frames(port: int, count: int, frame: bytes) -> list[str]:
    """`count` raw links, each sending `frame` once; what each got back ("closed" or a status)."""
    global _client
    out: list[str] = []
    for i in range(count):
        status, msg = link_raw(port, cluster=100 + i)
        if status != 0:
            out.append(f"refused {status}: {msg}")
            continue
        r = exchange(frame)
        out.append(r if isinstance(r, str) else str(r[0]))
        close()
    return out


# --------------------------------------------------------------------------- floods and many links

_held: list[socket.socket] = []
_links: list[_Client] = []


def silent_connections(port: int, count: int, source: str = ATTACKER_IP) -> int:
    """Opens `count` connections that never say anything (each holds a handshake slot until it
    times out); returns how many connected."""
    for _ in range(count):
        try:
            _held.append(socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)))
        except OSError:
            break
    return len(_held)


def stalled_handshakes(port: int, count: int, source: str = ATTACKER_IP) -> int:
    """Opens `count` connections that send a hello at once and then nothing (each holds a handshake
    slot that no newcomer can take, until the handshake timeout); returns how many were answered
    with the engine's ack (the rest were dropped)."""
    answered = 0
    for i in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
        s.sendall(rawwire.hello(cluster=1000 + i, expected=rawwire.ANY, nonce=int.from_bytes(os.urandom(16), "little")))
        _held.append(s)
        try:
            answered += 1 if s.recv(1) else 0
        except OSError:
            pass
    return answered


def closed_by_the_engine(timeout_s: float) -> int:
    """How many of the held connections the engine closed, waiting up to `timeout_s` for each."""
    closed = 0
    for s in _held:
        s.settimeout(timeout_s)
        try:
            closed += 1 if s.recv(4096) == b"" else 0
        except ConnectionResetError:
            closed += 1
        except OSError:
            pass
    return closed


def become(uid: int) -> None:
    """Runs this peer process as another user from now on (a local attacker of another uid). What
    it will need later is imported first: the new user may not read this interpreter's files."""
    import encodings.idna  # noqa: F401  (socket.create_connection encodes host names)
    import logging  # noqa: F401
    import traceback  # noqa: F401

    from pdlink import LLMException  # noqa: F401  (tests/peer.py checks what a call raised)

    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def many_links(port: int, count: int, first_cluster: int = 100, unix: str | None = None) -> list[tuple[int, str]]:
    """`count` raw links held open, cluster ids from `first_cluster`; the handshake result of each."""
    global _client
    out = []
    for i in range(count):
        status = link_raw(port, cluster=first_cluster + i, unix=unix)
        out.append(status)
        if status[0] == 0:
            assert _client is not None
            _links.append(_client)
            _client = None
    return out


def close_all() -> None:
    """Closes every connection and link this process holds."""
    for s in _held:
        s.close()
    _held.clear()
    for c in _links:
        c.fwd.close()
        c.rev.close()
    _links.clear()
    close()


_looping = threading.Event()
_loop_results: list[object] = []


def start_request_loop(frame: bytes) -> None:
    """Sends `frame` on the raw link again and again from a thread (reading each answer) until
    stop_request_loop."""
    assert _client is not None
    _looping.set()

    def run() -> None:
        while _looping.is_set():
            _loop_results.append(exchange(frame))

    threading.Thread(target=run, daemon=True).start()


def stop_request_loop() -> list[object]:
    """Stops the loop once it has sent at least one frame; the status of every answer."""
    while not _loop_results:
        threading.Event().wait(0.01)
    _looping.clear()
    return [r[0] if isinstance(r, tuple) else r for r in _loop_results]



_reverse_seen: list[tuple[int, bytes]] = []


def answer_on_reverse() -> None:
    """From a thread: reads each request the victim sends over the raw link's reverse channel (where
    the victim is the requester), answers it with success, and records its (op, body) for
    ``reverse_seen``."""
    assert _client is not None
    rev = _client.rev

    def run() -> None:
        try:
            while True:
                op, _flags, body, _plen = rawwire.read_request(rev)
                _reverse_seen.append((op, body))
                rev.sendall(rawwire.response())
        except (ConnectionError, OSError, AssertionError, struct.error):
            pass

    threading.Thread(target=run, daemon=True).start()


def reverse_seen() -> list[tuple[int, bytes]]:
    return list(_reverse_seen)


def forward_only(port: int, cluster: int, unix: str | None, frames: bytes, wait_s: float) -> str:
    """Completes only the forward channel's handshake (never the reverse one), sends `frames` on it at
    once, and says what the victim did within `wait_s`: "closed", or "answered <bytes>"/"silent"."""
    gen = ctypes.addressof(_words) if unix is not None else 0
    h = rawwire.handshake(port, cluster=cluster, expected=rawwire.ANY, nonce=int.from_bytes(os.urandom(16), "little"),
                          unix=unix, source=ATTACKER_IP, gen_addr=gen)
    if h.status != 0:
        return f"refused {h.status}: {h.message}"
    h.sock.sendall(frames)
    h.sock.settimeout(wait_s)
    try:
        data = h.sock.recv(4096)
    except TimeoutError:
        return "silent"
    except OSError:
        return "closed"
    finally:
        h.sock.close()
    return "closed" if data == b"" else f"answered {data!r}"


# --------------------------------------------------------------------------- lanes (tcp path streams)

_lanes: list[socket.socket] = []


def open_lanes(port: int, cluster: int, nonce: int, count: int) -> list[tuple[int, str]]:
    """Dials `count` LANE channels (transport/wire.h, channel 2) as cluster `cluster` with `nonce`
    from ATTACKER_IP, one after the other; keeps the accepted ones open (silent). (status, message)
    of each handshake."""
    out: list[tuple[int, str]] = []
    for _ in range(count):
        h = rawwire.handshake(port, channel=2, cluster=cluster, expected=rawwire.ANY, nonce=nonce, source=ATTACKER_IP)
        out.append((h.status, h.message))
        if h.status == 0:
            h.sock.settimeout(10)
            _lanes.append(h.sock)
        else:
            h.sock.close()
    return out


def lane_exchange(index: int, frame: bytes) -> tuple[int, str, bytes] | str:
    """Sends one request frame on lane `index` and returns the response, or "closed" when the victim
    dropped the lane instead."""
    try:
        _lanes[index].sendall(frame)
        return rawwire.read_response(_lanes[index])
    except (ConnectionError, OSError):
        return "closed"


def close_lanes() -> None:
    while _lanes:
        _lanes.pop().close()
