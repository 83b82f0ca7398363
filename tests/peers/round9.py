"""Raw peers and victim-side probes of the round 9 hostile review (tests/hostile/test_round9_review.py):
KV handoffs (the kOffer target, the kHandoff frame, the commit that releases an offer) attacked from
the wire.

Attacker side: several raw links in one process (``link``), indexed by the order they were made,
each speaking tests/rawwire.py frames. Victim side (run in the victim's process, next to
tests/peers/native.py and tests/peers/handoff.py): what the Python API hands the application, and
the process's threads and descriptors.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import rawwire
from peers import handoff, hostile, native

_links: list[hostile._Client] = []


# ---------------------------------------------------------------- attacker side

def link(port: int, cluster: int, unix: str | None = None, secret: bytes = b"") -> int:
    """One more raw link to the victim at ``port`` as ``cluster`` (proving ``secret`` when given);
    its index."""
    status = hostile.link_raw(port, cluster, secret, unix)
    assert status == (0, ""), status
    assert hostile._client is not None
    _links.append(hostile._client)
    hostile._client = None
    return len(_links) - 1


def exchange(i: int, frame: bytes) -> tuple[int, str, bytes] | str:
    """Sends ``frame`` on link ``i``; the response, or "closed"."""
    try:
        _links[i].fwd.sendall(frame)
        return rawwire.read_response(_links[i].fwd)
    except (ConnectionError, OSError):
        return "closed"


def send(i: int, frame: bytes) -> None:
    _links[i].fwd.sendall(frame)


def flood(i: int, frames: list[bytes]) -> list[int | str]:
    """Sends ``frames`` on link ``i`` back to back (a thread writes while this one reads the
    answers); each answer's status, or "closed" from the first that did not come."""
    c = _links[i]
    writer = threading.Thread(target=lambda: _send_all(c, frames), daemon=True)
    writer.start()
    out: list[int | str] = []
    for _ in frames:
        try:
            out.append(rawwire.read_response(c.fwd)[0])
        except (ConnectionError, OSError):
            out.append("closed")
            break
    writer.join(30)
    return out


def _send_all(c: hostile._Client, frames: list[bytes]) -> None:
    try:
        for f in frames:
            c.fwd.sendall(f)
    except OSError:
        pass


def close(i: int) -> None:
    """Closes link ``i``'s sockets (as a killed peer's kernel would)."""
    _links[i].fwd.close()
    _links[i].rev.close()


# ---------------------------------------------------------------- victim side

def handoff_events() -> Any:
    """What ``engine.handoff_events()`` gives the application: a list of (kind, peer, request id,
    reason), or "raised <type>: <message>"."""
    try:
        return [(e.kind, e.peer, e.request_id, e.reason) for e in handoff.handoff_events()]
    except Exception as e:  # noqa: BLE001 - what reaches the application is the finding
        return f"raised {type(e).__name__}: {e}"


def wait(tag: str, timeout: float) -> bool:
    """``offer.wait(timeout)`` of offer ``tag``."""
    return bool(handoff._state["offers"][tag].wait(timeout))


def resources() -> tuple[int, int]:
    """(threads, open descriptors) of this process."""
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def live_offers() -> int:
    return native._engine().stats().offers_live
