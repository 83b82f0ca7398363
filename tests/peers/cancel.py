"""Async (and synchronous) transfers of ``pdlink.Engine`` started, cancelled and finished
(tests/native/test_cancel.py), on the engine and regions of tests/peers/native.py."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

import pdlink
from peers import native

_pending: dict[str, pdlink.Pending] = {}


def start(tag: str, kind: str, op: str, peer: int, name: str, remote_address: int, nbytes: int,
          remote_key_tag: str | None = None) -> None:
    """Starts one async transfer of ``nbytes`` between region ``name`` (from its start) and the
    peer's ``remote_address``, kept under ``tag``. ``kind``: "descriptors" (``read_async`` /
    ``write_async``), "batch" (``read_batch_async`` / ``write_batch_async``) or "prepared" (every
    block of prepared transfer ``remote_key_tag``, ``PreparedTransfer.read_async`` /
    ``write_async``); ``op``: "read" or "write"."""
    engine = native._engine()
    local = native._state["regions"][name].region.addresses[0]
    if kind == "descriptors":
        _pending[tag] = getattr(engine, f"{op}_async")(peer, [(local, nbytes)], [(remote_address, nbytes)])
    elif kind == "batch":
        _pending[tag] = getattr(engine, f"{op}_batch_async")(peer, [local], [remote_address], [nbytes])
    else:
        assert remote_key_tag is not None
        prepared = native._state["prepared"][remote_key_tag]
        blocks = np.arange(nbytes // prepared.block_size, dtype=np.int64)
        _pending[tag] = getattr(prepared, f"{op}_async")(blocks, blocks)


def start_and_cancel(tag: str, kind: str, op: str, peer: int, name: str, remote_address: int, nbytes: int,
                     remote_key_tag: str | None = None) -> tuple[bool, str]:
    """``start`` and, at once, ``cancel``."""
    start(tag, kind, op, peer, name, remote_address, nbytes, remote_key_tag)
    return cancel(tag)


def cancel(tag: str) -> tuple[bool, str]:
    """``Pending.cancel()`` and the status right after it."""
    pending = _pending[tag]
    won = pending.cancel()
    return won, pending.status()


def finish(tag: str, timeout: float = 60) -> tuple[str, str | None, bool]:
    """Waits for ``tag``: its status, the class name of what ``wait()`` raised (None: nothing), and
    whether that is a ``concurrent.futures.CancelledError``."""
    import concurrent.futures

    pending = _pending.pop(tag)
    raised: Any = None
    try:
        pending.wait(timeout)
    except (pdlink.LLMException, concurrent.futures.CancelledError) as e:
        raised = e
    return (pending.status(), type(raised).__name__ if raised is not None else None,
            isinstance(raised, concurrent.futures.CancelledError))


def status(tag: str) -> str:
    return _pending[tag].status()


_sync: dict[str, tuple[threading.Thread, list[Any]]] = {}


def start_sync(tag: str, op: str, peer: int, name: str, remote_address: int, nbytes: int) -> None:
    """A synchronous ``Engine.read`` / ``write`` (``op``) of ``nbytes`` between region ``name`` (from
    its start) and the peer's ``remote_address``, on a thread of its own, kept under ``tag``;
    ``finish_sync`` waits for it."""
    engine = native._engine()
    local = native._state["regions"][name].region.addresses[0]
    outcome: list[Any] = []

    def run() -> None:
        try:
            getattr(engine, op)(peer, [(local, nbytes)], [(remote_address, nbytes)])
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - what it raised is the result
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    _sync[tag] = (thread, outcome)


def finish_sync(tag: str, timeout: float = 60) -> tuple[str | None, int | None]:
    """Waits for ``tag`` of ``start_sync``: the class name of what the call raised (None: nothing)
    and its status code (None: none)."""
    thread, outcome = _sync.pop(tag)
    thread.join(timeout)
    assert outcome, "the synchronous transfer did not end"
    raised = outcome[0]
    if raised is None:
        return None, None
    code = getattr(raised, "status_code", None)
    return type(raised).__name__, int(code) if code is not None else None
