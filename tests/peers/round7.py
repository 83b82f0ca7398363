"""Raw peers of the hostile review of role epochs and the drain (round 7,
tests/hostile/test_round7_review.py): a peer that keeps linking while a victim drains. It speaks the
wire protocol through tests/rawwire.py from 127.0.0.2, as tests/peers/hostile.py does."""

from __future__ import annotations

import os
import threading

import rawwire
from peers.hostile import ATTACKER_IP

_linking = threading.Event()
_link_results: list[int] = []


def start_link_loop(port: int, first_cluster: int = 200, most: int = 40) -> None:
    """Dials new links (forward channel only, each closed at once) as clusters ``first_cluster``,
    ``first_cluster`` + 1 ... from a thread, at most ``most`` of them, until ``stop_link_loop``."""
    _linking.set()
    _link_results.clear()

    def run() -> None:
        for i in range(most):
            if not _linking.is_set():
                return
            nonce = int.from_bytes(os.urandom(16), "little")
            h = rawwire.handshake(port, cluster=first_cluster + i, expected=rawwire.ANY, nonce=nonce,
                                  source=ATTACKER_IP)
            _link_results.append(h.status)
            h.sock.close()

    threading.Thread(target=run, daemon=True).start()


def stop_link_loop() -> list[int]:
    """Stops the loop once it has dialled at least once; each handshake's status (0: accepted)."""
    while not _link_results:
        threading.Event().wait(0.01)
    _linking.clear()
    return list(_link_results)


def link_statuses() -> list[int]:
    """The statuses the link loop got so far."""
    return list(_link_results)


def switch_many(count: int, role: str = "PROMPT") -> dict[str, object]:
    """``count`` committed switches of this peer's ``pdlink.Engine`` (tests/peers/native.py), each
    without a listener; the role state after the last."""
    from peers import native

    engine = native._engine()
    for _ in range(count):
        engine.switch_role(role, None)
    return engine.role_state().as_dict()


def switch_to(role: str, listen: str | None) -> tuple[int, str, dict[str, object]]:
    """``switch_role(role, listen)`` of this peer's ``pdlink.Engine``: (0 or the error's code, its
    message, the role state after it)."""
    import pdlink
    from peers import native

    engine = native._engine()
    try:
        engine.switch_role(role, listen)
        return 0, "", engine.role_state().as_dict()
    except pdlink.LLMException as e:
        return int(e.status_code), str(e), engine.role_state().as_dict()
