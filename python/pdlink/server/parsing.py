"""Decoding role bodies without stalling the event loop.

A role body may be as large as ``maxRequestLength`` (40 MB by default; MindIE's contract). Python's
JSON decoder holds the GIL for the whole document, so decoding one such body on the event loop, or in
a thread, stops every other request (``/health``, ``/v1/status``) until it is done. Small bodies (what
a controller sends: a few KiB) are decoded inline; larger ones in a one-worker process pool, started on
first use, while the event loop keeps serving. Decoding and validation (``validation.py``) run
together, so only the small ``RoleRequest`` comes back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import multiprocessing
import threading
from typing import Any

from .validation import BodyError, parse_role_request

INLINE_BYTES = 64 * 1024  # bodies up to this size are decoded on the event loop (well under 1 ms)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode(role: str, body: bytes) -> tuple[str, Any]:
    """("ok", RoleRequest), ("json", why the body is not JSON) or ("body", why it breaks a rule)."""
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return "json", str(e)[:200]
    try:
        return "ok", parse_role_request(role, data)
    except BodyError as e:
        return "body", str(e)
    except RecursionError:
        return "body", "the body nests too deeply"


class BodyDecoder:
    """Decodes role bodies: inline when small, else in a worker process (see the module text)."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    async def decode(self, role: str, body: bytes) -> tuple[str, Any]:
        if len(body) <= INLINE_BYTES:
            return decode(role, body)
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=1, mp_context=multiprocessing.get_context("spawn"))
            pool = self._pool
        return await asyncio.wrap_future(pool.submit(decode, role, body))

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
