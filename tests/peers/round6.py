"""The attacker of the round-6 hostile review (tests/hostile/test_round6_review.py): the tcp path's
lanes (protocol v6, Hello channel 2), run in its own peer process, speaking the wire protocol with
tests/rawwire.py.

Two roles:

* a hostile **client** of a victim that accepts links: raw links (``link``), then LANE channels
  attached to them or to links that are not its own (``lane``, ``lane_race``), frames on those lanes
  (``lane_exchange``), lanes left silent or mid-frame, and the link's own channels dropped while the
  lanes stay open (``drop_link``);
* a hostile **server** a victim dials (``serve``): it accepts the link and the lanes the victim
  opens for a large pull, and answers the chunk reads on the lanes the way ``mode`` says (a wrong
  length, bytes past the answer, a refusal, silence), the link's channel answering honestly. What
  the victim sent is recorded (``observed``).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from typing import Any

import rawwire

ATTACKER_IP = "127.0.0.2"
FILL = 0x5A  # every payload byte the hostile server sends

# ------------------------------------------------------------------------------------ a hostile client

_links: dict[int, tuple[socket.socket, socket.socket, int]] = {}  # cluster -> (forward, reverse, nonce)
_lanes: list[socket.socket] = []
_keys: dict[object, bytes] = {}  # with a secret: each forward channel's (by cluster) and lane's (by socket) key


def link(port: int, cluster: int, secret: bytes = b"", flags: int = 0) -> tuple[int, str, int]:
    """A raw link (both channels) from ATTACKER_IP as ``cluster``; (status, message, its nonce)."""
    nonce = int.from_bytes(os.urandom(16), "little")
    out = []
    for channel in (0, 1):
        h = rawwire.handshake(port, channel=channel, cluster=cluster, expected=rawwire.ANY, nonce=nonce,
                              secret=secret, flags=flags, source=ATTACKER_IP)
        if h.status != 0:
            return h.status, h.message, nonce
        if channel == 0:
            _keys[cluster] = h.key
        out.append(h.sock)
    _links[cluster] = (out[0], out[1], nonce)
    return 0, "", nonce


def lane(port: int, cluster: int, nonce: int, secret: bytes = b"", flags: int = 0, source: str = ATTACKER_IP,
         send_proof: bytes | None = None) -> tuple[int, str]:
    """One LANE channel as ``cluster`` with ``nonce``; an accepted one is kept open (silent). The
    handshake's (status, message)."""
    h = rawwire.handshake(port, channel=2, cluster=cluster, expected=rawwire.ANY, nonce=nonce, secret=secret,
                          flags=flags, source=source, send_proof=send_proof)
    if h.status == 0:
        h.sock.settimeout(10)
        _lanes.append(h.sock)
        _keys[h.sock] = h.key
    else:
        h.sock.close()
    return h.status, h.message


def sealed_lane_exchange(index: int, frame: bytes, key_of_link: int | None = None) -> int | str:
    """Sends ``frame`` on lane ``index`` as the first frame sealed under the lane's own session key,
    or (``key_of_link``) under that link's forward channel key, as an on-path attacker replaying a
    frame of the channel would; the response's status, or "closed" when the victim dropped the lane."""
    s = _lanes[index]
    key = _keys[key_of_link] if key_of_link is not None else _keys[s]
    try:
        s.sendall(rawwire.Sealer(key, requester=True).seal(frame))
        status, mlen, _plen, _tag = rawwire.response_header(rawwire.recv_exact(s, rawwire.RESPONSE_HEADER_BYTES))
        rawwire.recv_exact(s, mlen + rawwire.TAG_BYTES)
        return int(status)
    except (ConnectionError, OSError, struct.error):
        return "closed"


def lane_race(port: int, cluster: int, nonce: int, count: int) -> list[int]:
    """``count`` lanes dialled at once (their hellos released together); the status of each."""
    socks = [socket.create_connection(("127.0.0.1", port), source_address=(ATTACKER_IP, 0)) for _ in range(count)]
    go = threading.Barrier(count)
    results: list[int] = [-1] * count

    def one(i: int) -> None:
        s = socks[i]
        frame = rawwire.hello(channel=2, cluster=cluster, expected=rawwire.ANY, nonce=nonce)
        go.wait()
        s.sendall(frame)
        a = rawwire.read_ack(s)
        if a.status != 0:
            results[i] = a.status
            return
        s.sendall(rawwire.client_auth(bytes(32)))
        results[i] = rawwire.read_auth(s).status

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, s in enumerate(socks):
        if results[i] == 0:
            s.settimeout(10)
            _lanes.append(s)
        else:
            s.close()
    return results


def lane_at(host: str, port: int, cluster: int, nonce: int, source: str) -> tuple[int, str]:
    """A LANE channel (no secret) to ``host:port`` from ``source``; an accepted one is kept open."""
    s = socket.create_connection((host, port), source_address=(source, 0))
    s.sendall(rawwire.hello(channel=2, cluster=cluster, expected=rawwire.ANY, nonce=nonce))
    a = rawwire.read_ack(s)
    if a.status != 0:
        s.close()
        return a.status, a.message
    s.sendall(rawwire.client_auth(bytes(32)))
    r = rawwire.read_auth(s)
    if r.status != 0:
        s.close()
        return r.status, r.message
    s.settimeout(10)
    _lanes.append(s)
    return 0, ""


def confirmed_nonces() -> list[int]:
    """The nonces a victim sent this server in kConfirm frames (which this server confirmed)."""
    return [o["nonce"] for o in observed() if o["event"] == "request" and o["op"] == rawwire.OP_CONFIRM]


def lane_send(index: int, frame: bytes) -> None:
    _lanes[index].sendall(frame)


def lane_exchange(index: int, frame: bytes, payload: bytes = b"") -> tuple[int, str, bytes] | str:
    """Sends a request frame (and its payload) on lane ``index``; the response, or "closed" when the
    victim dropped the lane instead."""
    try:
        _lanes[index].sendall(frame + payload)
        return rawwire.read_response(_lanes[index])
    except (ConnectionError, OSError, struct.error):
        return "closed"


def lane_closed_by_victim(index: int, timeout_s: float) -> bool:
    """Whether the victim closed lane ``index`` (end of stream or reset) within ``timeout_s``."""
    s = _lanes[index]
    s.settimeout(timeout_s)
    try:
        while s.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except (ConnectionError, OSError):
        return True


def lane_count() -> int:
    return len(_lanes)


def exchange(cluster: int, frame: bytes) -> tuple[int, str, bytes] | str:
    """A request frame on the forward channel of our link as ``cluster``; the response or "closed"."""
    fwd = _links[cluster][0]
    try:
        fwd.settimeout(10)
        fwd.sendall(frame)
        return rawwire.read_response(fwd)
    except (ConnectionError, OSError, struct.error):
        return "closed"


def nonces() -> dict[int, int]:
    """The nonce of each of our live links, by cluster."""
    return {cluster: nonce for cluster, (_f, _r, nonce) in _links.items()}


def drop_link(cluster: int) -> None:
    """Closes our link's own two channels; the lanes stay open."""
    fwd, rev, _ = _links.pop(cluster)
    fwd.close()
    rev.close()


def close_all() -> None:
    while _lanes:
        _lanes.pop().close()
    for cluster in list(_links):
        drop_link(cluster)


# ------------------------------------------------------------------------------------ a hostile server


class _Server:
    def __init__(self, mode: str, sock: socket.socket) -> None:
        self.mode = mode
        self.sock = sock
        self.observed: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.lane_asked = threading.Event()  # a lane received a read

    def note(self, **event: Any) -> None:
        with self.lock:
            self.observed.append(event)


_server: _Server | None = None

# Lane verdicts that say what a lane's AuthResult may not: a same-host redirect (only a FORWARD
# channel whose hello offered same-host gets one), published words on a TCP channel, payload
# integrity agreed on a link without it (and without a secret).
LANE_VERDICTS: dict[str, dict[str, Any]] = {
    "lane_redirect": {"redirect": b"pdlink-nowhere"},
    "lane_words": {"gen_addr": 0x1000},
    "lane_integrity": {"flags": rawwire.AUTH_PAYLOAD_INTEGRITY},
}


def serve(mode: str) -> int:
    """Starts the hostile server on ATTACKER_IP; its port. Modes, for the reads asked on LANES (the
    link's channel always answers with exactly the bytes asked for, FILL each):

    * ``exact``: the same on the lanes (the control case);
    * ``lane_long`` / ``lane_short``: a success announcing 8 bytes more / fewer than the chunk asked;
    * ``lane_extra``: the first answer on each lane is preceded by 8 bytes that belong to no answer
      (before it, not after: stray bytes after a lane's last answer would wait unread in the socket,
      and the pull could end first);
    * ``lane_refuse``: every chunk on a lane refused (LLM_PARAM_INVALID);
    * ``lane_not_enabled``: the same, with LLM_FEATURE_NOT_ENABLED;
    * ``lane_stall``: the lane reads its requests and never answers;
    * ``no_lanes``: every lane handshake refused;
    * ``silent_lanes``: every lane's hello taken, then nothing said;
    * ``LANE_VERDICTS``: every lane's handshake answered with a verdict a lane may not have.

    The channel holds its first answer until a lane asked for a chunk (work sharing would otherwise
    let a fast channel take every chunk on a loaded machine)."""
    global _server
    assert _server is None
    tcp = socket.socket()
    tcp.bind((ATTACKER_IP, 0))
    tcp.listen(64)
    _server = _Server(mode, tcp)
    threading.Thread(target=_accept_loop, args=(_server,), daemon=True).start()
    return int(tcp.getsockname()[1])


def observed() -> list[dict[str, Any]]:
    assert _server is not None
    with _server.lock:
        return list(_server.observed)


def _accept_loop(srv: _Server) -> None:
    while True:
        conn, _ = srv.sock.accept()
        threading.Thread(target=_handle, args=(srv, conn), daemon=True).start()


def _handle(srv: _Server, conn: socket.socket) -> None:
    try:
        head = rawwire.recv_exact(conn, rawwire.HELLO_BYTES)
        _version, channel, _flags, _cluster, expected, nonce = rawwire.parse_hello(head)
        srv.note(event="hello", channel=channel, nonce=nonce)
        cluster = expected if expected != rawwire.ANY else 1
        if channel == 2 and srv.mode == "silent_lanes":  # takes the lane's hello, then says nothing
            while conn.recv(4096):
                pass
            return
        if channel == 2 and srv.mode == "no_lanes":
            conn.sendall(rawwire.ack(status=rawwire.LINK_FAILED, cluster=cluster, message=b"no lanes here"))
            return
        conn.sendall(rawwire.ack(cluster=cluster, challenge=os.urandom(16)))
        rawwire.recv_exact(conn, rawwire.CLIENT_AUTH_BYTES)
        if channel == 2 and srv.mode in LANE_VERDICTS:
            conn.sendall(rawwire.auth_result(**LANE_VERDICTS[srv.mode]))
            while conn.recv(4096):
                pass
            return
        conn.sendall(rawwire.auth_result())
        if channel == 1:
            while conn.recv(4096):
                pass
            return
        _answer(srv, conn, lane=channel == 2)
    except (ConnectionError, OSError, AssertionError, struct.error) as e:
        srv.note(event="closed", why=repr(e))
    finally:
        conn.close()


def _answer(srv: _Server, conn: socket.socket, lane: bool) -> None:
    mode = srv.mode if lane else "exact"
    first = True
    while True:
        op, flags, body, plen = rawwire.read_request(conn)
        split, flags = bool(flags & rawwire.MARK_SPLIT), flags & ~rawwire.MARK_SPLIT  # a split pull's chunk or end
        rec: dict[str, Any] = {"event": "request", "lane": lane, "op": op, "flags": flags, "split": split}
        if op in (rawwire.OP_READ, rawwire.OP_WRITE, rawwire.OP_COMMIT, rawwire.OP_RELEASE, rawwire.OP_DESCRIBE):
            _kind, tensors, runs = rawwire.parse_body(body)
            rec.update(tensors=tensors, runs=runs)
        if op == rawwire.OP_CONFIRM:  # "did you dial the link to me whose hello had this nonce?": yes
            rec.update(nonce=int.from_bytes(body[:16], "little"))
            srv.note(**rec)
            conn.sendall(rawwire.response())
            continue
        srv.note(**rec)
        if op in (rawwire.OP_COMMIT, rawwire.OP_RELEASE):
            continue
        if op in (rawwire.OP_PING, rawwire.OP_UNLINK):
            conn.sendall(rawwire.response())
            continue
        if op == rawwire.OP_WRITE and not flags:
            rawwire.recv_exact(conn, plen)
        if op != rawwire.OP_READ or flags:  # describes and device paths: not here, the stream it is
            conn.sendall(rawwire.response(status=0x5010B019, message=b"stream only"))
            continue
        total = sum(n for _, n in rec["runs"]) * len(rec["tensors"])
        if lane:
            srv.lane_asked.set()
        elif first and srv.mode not in ("no_lanes", "silent_lanes", *LANE_VERDICTS):
            # The channel's first answer waits for a lane's first request (for at most 10 s), so that
            # the lanes take part in the pull however the victim's threads are scheduled.
            srv.lane_asked.wait(10)
        if mode == "lane_stall":
            while conn.recv(4096):
                pass
            return
        if mode == "lane_refuse":
            conn.sendall(rawwire.response(status=0x5010B005, message=b"refused"))
        elif mode == "lane_not_enabled":
            conn.sendall(rawwire.response(status=0x5010B019, message=b"not on this path"))
        elif mode == "lane_long":
            conn.sendall(rawwire.response(payload=bytes([FILL]) * (total + 8)))
        elif mode == "lane_short":
            conn.sendall(rawwire.response(payload=bytes([FILL]) * (total - 8)))
        elif mode == "lane_extra" and first:
            conn.sendall(bytes([FILL]) * 8 + rawwire.response(payload=bytes([FILL]) * total))
        else:
            conn.sendall(rawwire.response(payload=bytes([FILL]) * total))
        first = False
