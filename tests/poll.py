"""Polling instead of sleeping, and hang guards instead of duration assertions.

The rule (tests/README.md): a test never sleeps a fixed time to let something happen, and never
asserts on how long something took. It polls for the condition it needs (``wait_until``), and it
bounds a call that might hang by a generous multiple of the timeout the call is configured with
(``hang_guard``), asserting on the status the call returns, not on the clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_INTERVAL = 0.005  # seconds between two looks; short, since most conditions hold within ms


def wait_until(condition: Callable[[], T | None], timeout: float, what: str) -> T:
    """Call ``condition`` until it returns a truthy value and return that value; ``AssertionError``
    naming ``what`` (and the last value seen) if ``timeout`` seconds pass first. The condition is
    always evaluated at least once, and once more after the deadline, so a slow machine that
    starves the loop still gets a last look."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            value = condition()
            if value:
                return value
            raise AssertionError(f"not reached within {timeout} s: {what} (last value: {value!r})")
        time.sleep(POLL_INTERVAL)


def hang_guard(timeout_ms: float, factor: float = 10.0, floor_s: float = 20.0) -> float:
    """Seconds to bound a call configured with ``timeout_ms``: far beyond what the call may take on a
    loaded 2-core machine, so reaching it means a hang, not slowness."""
    return max(floor_s, factor * timeout_ms / 1000.0)
