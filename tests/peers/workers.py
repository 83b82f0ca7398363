"""Peer-side background work: threads that transfer while the test does something else (kills
the other peer, freezes it), and what they observed. Runs on the engine of ``peers.kv``."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from llm_datadist import BlocksCacheKey, LLMException, LLMStatusCode
from peers import kv


def concurrent_pulls(key: BlocksCacheKey, name: str, threads: int, iterations: int) -> list[str]:
    """``threads`` threads, thread i pulling block i into block i ``iterations`` times; returns the
    errors (empty when every pull succeeded)."""
    errors: list[str] = []

    def work(i: int) -> None:
        try:
            for _ in range(iterations):
                kv.pull_blocks(key, name, [i], [i])
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append(repr(e))

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return errors


# "ok", or the status code of the transfer that failed (LLMException.status_code: LLMStatusCode | int)
Outcome = str | LLMStatusCode | int


@dataclasses.dataclass
class _Loop:
    thread: threading.Thread
    done: int = 0  # transfers completed
    outcome: Outcome | None = None


_loop: _Loop | None = None


def start_transfer_loop(op: str, key: BlocksCacheKey, name: str, src_blocks: Sequence[int],
                        dst_blocks: Sequence[int], iterations: int) -> None:
    """Starts a thread that runs ``iterations`` pulls or pushes (``op``) back to back, stopping at
    the first failure. ``transfers_done`` and ``join_transfer_loop`` report on it."""
    global _loop
    assert _loop is None, "a transfer loop already ran in this peer"
    fn = kv.pull_blocks if op == "pull" else kv.push_blocks

    def run() -> None:
        assert _loop is not None
        try:
            for _ in range(iterations):
                fn(key, name, src_blocks, dst_blocks)
                _loop.done += 1
            _loop.outcome = "ok"
        except LLMException as e:
            _loop.outcome = e.status_code

    _loop = _Loop(threading.Thread(target=run, daemon=True))
    _loop.thread.start()


def transfers_done() -> int:
    assert _loop is not None
    return _loop.done


def join_transfer_loop(timeout_s: float) -> Outcome | None:
    """The loop's outcome, after waiting at most ``timeout_s`` for it to end (None: still running)."""
    assert _loop is not None
    _loop.thread.join(timeout_s)
    return _loop.outcome
