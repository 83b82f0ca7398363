"""Raw peers and victim-side probes of the round 9b hostile review (tests/hostile/test_round9b_review.py):
the round 9 fixes to KV handoffs (UTF-8 checks on kHandoff strings, per-source event shares,
remembered aborts keyed by link, checked commits, wire v9) attacked from the wire.

Attacker side: raw links kept in tests/peers/round9.py's list (so ``round9.exchange`` and
``round9.flood`` drive them), made here from a chosen loopback source address, plus a raw v8 hello.
Victim side: the Python API's handoff records, offers made with hostile request ids, and the
engine's link and offer counts.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from typing import Any

import rawwire
from peers import handoff, hostile, native, round9

# ---------------------------------------------------------------- attacker side


def try_link_from(port: int, cluster: int, source: str) -> int | tuple[int, str]:
    """One more raw link to the victim at ``port`` as ``cluster``, both channels over TCP from the
    loopback address ``source``: its index in round9's list, or the refusal (status, message)."""
    nonce = int.from_bytes(cluster.to_bytes(8, "little") + socket.inet_aton(source) * 2, "little")
    h = rawwire.handshake(port, cluster=cluster, expected=rawwire.ANY, nonce=nonce, source=source)
    if h.status != 0:
        return h.status, h.message
    r = rawwire.handshake(port, channel=1, cluster=cluster, expected=rawwire.ANY, nonce=nonce, source=source)
    if r.status != 0:
        return r.status, r.message
    h.sock.settimeout(10)
    round9._links.append(hostile._Client(h.sock, r.sock))
    return len(round9._links) - 1


def link_from(port: int, cluster: int, source: str) -> int:
    """``try_link_from`` that must link: the link's index."""
    i = try_link_from(port, cluster, source)
    assert isinstance(i, int), i
    return i


def old_hello(port: int, version: int) -> tuple[int, str]:
    """A hello of wire ``version`` to the victim: the (status, message) of its ack."""
    s = socket.create_connection(("127.0.0.1", port), source_address=(hostile.ATTACKER_IP, 0))
    s.settimeout(10)
    try:
        s.sendall(rawwire.hello(version=version, cluster=9, expected=rawwire.ANY))
        a = rawwire.read_ack(s)
        return a.status, a.message
    finally:
        s.close()


def reverse_bytes(i: int) -> bytes:
    """What the victim has sent on link ``i``'s reverse channel so far (not waiting)."""
    rev = round9._links[i].rev
    rev.setblocking(False)
    try:
        return rev.recv(1 << 16)
    except BlockingIOError:
        return b""
    finally:
        rev.setblocking(True)


_silent: list[socket.socket] = []


def silent_listener() -> int:
    """A TCP listener on ATTACKER_IP that accepts connections (a thread keeps them open) and never
    writes a byte; its port."""
    srv = socket.socket()
    srv.bind((hostile.ATTACKER_IP, 0))
    srv.listen(64)
    _silent.append(srv)

    def run() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            _silent.append(conn)

    threading.Thread(target=run, daemon=True).start()
    return int(srv.getsockname()[1])


def accepted() -> int:
    """How many connections the silent listener accepted."""
    return len(_silent) - 1


def forge(ticket: Any, cluster: int | None, address: str | None) -> Any:
    """``ticket`` with another cluster id and/or address."""
    changes: dict[str, Any] = {}
    if cluster is not None:
        changes["cluster_id"] = cluster
    if address is not None:
        changes["address"] = address
    return dataclasses.replace(ticket, **changes)


# ---------------------------------------------------------------- victim side


def offer_raw(tag: str, name: str, blocks: list[int], request_id: Any) -> Any:
    """``engine.offer`` with ``request_id`` as given (a str with lone surrogates, bytes, ...): its
    ticket, or "raised <type>"."""
    try:
        return handoff.offer(tag, name, blocks, request_id)
    except Exception as e:  # noqa: BLE001 - what reaches the application is the finding
        return f"raised {type(e).__name__}"


def abort_raw(request_id: Any, reason: Any = "") -> str:
    """``engine.abort(request_id, reason=reason)``: "ok" or "raised <type>"."""
    try:
        native._engine().abort(request_id, reason=reason)
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"raised {type(e).__name__}"


def released_records() -> Any:
    """``engine.released()`` as (peer, request id, reason) tuples, or "raised <type>: <message>"."""
    try:
        return [(e.peer, e.request_id, e.reason) for e in handoff.released()]
    except Exception as e:  # noqa: BLE001
        return f"raised {type(e).__name__}: {e}"


def link_clusters() -> list[tuple[int, bool]]:
    """(peer cluster id, this side dialled) of each link that is not broken, sorted."""
    return sorted((int(i.peer_cluster_id), bool(i.initiator)) for i in native.links() if not i.broken)


# ---------------------------------------------------------------- a program: exit after a release


def exit_after_a_release() -> None:
    """Makes an engine with one offer, aborts its request id (the offer released: the handoff
    thread wakes to report it) and returns, so the interpreter exits without ``engine.close()``."""
    import numpy as np

    import pdlink

    engine = pdlink.Engine(pdlink.EngineOptions(cluster_id=1))
    region = engine.register(np.zeros((8, 256), np.uint8), block_size=256, key=7)
    engine.offer(region, [1], request_id="req")
    engine.abort("req")


def claim_outcome(ticket: Any, name: str, blocks: list[int], timeout_ms: int) -> str:
    """``engine.claim``: "ok", or the exception's type and status code's name."""
    import pdlink

    try:
        handoff.claim(ticket, name, blocks, timeout_ms)
        return "ok"
    except pdlink.LLMException as e:
        return f"{type(e).__name__} {pdlink.LLMStatusCode(e.status_code).name}"
    except Exception as e:  # noqa: BLE001 - what reaches the application is the finding
        return f"{type(e).__name__}"


def claim_message(ticket: Any, name: str, blocks: list[int], timeout_ms: int) -> str:
    """The message of the exception ``engine.claim`` raises ("ok" when it does not)."""
    try:
        handoff.claim(ticket, name, blocks, timeout_ms)
        return "ok"
    except Exception as e:  # noqa: BLE001 - what reaches the application is the finding
        return str(e)


def start_dialler(cluster_id: int, connect_timeout_ms: int) -> None:
    """Starts this peer's engine (tests/peers/native.py's, not listening) with ``connect_timeout_ms``
    bounding each dial."""
    import pdlink

    native._state["engine"] = pdlink.Engine(pdlink.EngineOptions(cluster_id=cluster_id,
                                                                 connect_timeout_ms=connect_timeout_ms))


if __name__ == "__main__":  # python -m peers.round9b, from tests/ (test_round9b_review.py)
    exit_after_a_release()
