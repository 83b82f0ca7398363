"""Decoding role bodies without stalling the event loop, and without building what a body should not hold.

A role body may be as large as ``maxRequestLength`` (40 MB by default; MindIE's contract). Python's
JSON decoder holds the GIL for the whole document, so decoding one such body on the event loop, or in
a thread, stops every other request (``/health``, ``/v1/status``) until it is done. Small bodies (what
a controller sends: a few KiB) are decoded inline; larger ones in a one-worker process pool, started on
first use, while the event loop keeps serving. Decoding and validation (``validation.py``) run
together, so only the small ``RoleRequest`` comes back.

Before anything is decoded, the body's shape is counted on its bytes (``structure_error``): at most
``maxJsonDepth`` levels of nested arrays and objects, and at most ``MAX_JSON_ITEMS`` strings, arrays,
objects and commas outside strings. A body past either bound is refused (422) without building a
single Python object for it: 40 MB of ``[{},{},...]`` is 13 million dictionaries (about 1 GiB) once
decoded, while a role body within the rules (256 peers of 64 devices) holds about 270,000 items.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import multiprocessing
import threading
from typing import Any

from .validation import BodyError, parse_role_request

__all__ = ["BodyDecoder", "decode", "structure_error", "INLINE_BYTES", "MAX_JSON_ITEMS", "DEFAULT_MAX_JSON_DEPTH"]

INLINE_BYTES = 64 * 1024  # bodies up to this size are decoded on the event loop (well under 1 ms)
MAX_JSON_ITEMS = 1 << 20  # strings + arrays + objects + commas outside strings: about 4x the largest valid body
DEFAULT_MAX_JSON_DEPTH = 32  # ServerConfig.maxJsonDepth; a valid body nests 5 (body, peers, peer, device list, device)

_MARKS = b'"[]{},'
_NOT_MARKS = bytes(c for c in range(256) if c not in _MARKS)
_SQUARE = bytes.maketrans(b"{}", b"[]")


def structure_error(body: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH,
                    max_items: int = MAX_JSON_ITEMS) -> str | None:
    """Why the shape of ``body`` is refused, or None: more than ``max_items`` strings, arrays,
    objects and commas (outside strings), or arrays and objects nested more than ``max_depth``
    levels (the body itself is level 1). Whether the body is valid JSON is not checked here: the
    decoder says so afterwards, and brackets that do not match are left to it.

    Hand-written, because Python's ``json`` has no limits and no streaming mode. Only whole-buffer
    bytes operations run here (replace, translate, count, split: C loops, a few passes over the
    body, no Python work per value), so 40 MB is counted in a fraction of a second and the copies
    made are at most the size of the body."""
    # Escaped backslashes go first, then escaped quotes: afterwards every '"' opens or closes a string.
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = text.translate(None, _NOT_MARKS)  # quotes, brackets and commas, in order
    del text
    strings = (marks.count(b'"') + 1) // 2
    if strings > max_items:
        return f"the body holds more than {max_items} strings"
    # Two adjacent quotes are a string without a bracket or comma in it, or the end of one string and
    # the start of the next with none between them: dropping them changes nothing outside strings.
    # Split at the remaining quotes, the even pieces are outside strings.
    outside = b"".join(marks.replace(b'""', b"").split(b'"')[::2])
    del marks
    items = strings + outside.count(b",") + outside.count(b"[") + outside.count(b"{")
    if items > max_items:
        return f"the body holds more than {max_items} strings, arrays, objects and commas"
    # Depth: each pass removes the innermost pairs ("[]" once braces are brackets too), so a pair
    # still there after max_depth passes has max_depth levels inside it.
    nest = outside.translate(_SQUARE, b",")
    for _ in range(max_depth):
        if not nest:
            return None
        inner = nest.replace(b"[]", b"")
        if len(inner) == len(nest):  # brackets that do not match: not JSON, the decoder says why
            return None
        nest = inner
    if b"[]" in nest:
        return f"the body nests arrays and objects deeper than maxJsonDepth ({max_depth} levels)"
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode(role: str, body: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> tuple[str, Any]:
    """("ok", RoleRequest), ("json", why the body is not JSON) or ("body", why it breaks a rule)."""
    shape = structure_error(body, max_depth)  # before anything is decoded
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return "json", str(e)[:200]
    if shape is not None:
        return "body", shape
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        return "json", str(e)[:200]
    try:
        return "ok", parse_role_request(role, data)
    except BodyError as e:
        return "body", str(e)
    except RecursionError:
        return "body", "the body nests too deeply"


class BodyDecoder:
    """Decodes role bodies: inline when small, else in a worker process (see the module text)."""

    def __init__(self, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> None:
        self.max_depth = max_depth
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    async def decode(self, role: str, body: bytes) -> tuple[str, Any]:
        if len(body) <= INLINE_BYTES:
            return decode(role, body, self.max_depth)
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=1, mp_context=multiprocessing.get_context("spawn"))
            pool = self._pool
        return await asyncio.wrap_future(pool.submit(decode, role, body, self.max_depth))

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
