"""Connection guards of ``pdlink serve``: uvicorn's h11 protocol with a head deadline and a per-client cap.

uvicorn (as of 0.55) bounds neither how long a connection may stay open before its request head
is complete (its keep-alive timeout starts only after a first response) nor how many connections
one client holds, while every open connection counts against ``limit_concurrency``
(``maxLinkNum``): one client holding ``maxLinkNum`` idle connections got every other request
answered 503, ``/health`` included, for as long as it kept them. This module adds, per listener:

* **a head deadline** (``headTimeoutMs``): a connection whose request head is not complete that
  long after it was accepted (after the TLS handshake, on HTTPS) is closed; if it had sent part of
  a head it is answered ``408`` in plain text first. A response always carries ``Connection:
  close`` (``app.py``), so every connection carries one request, and one that waits for a head is
  exactly an idle one;
* **a per-client cap** (``maxLinksPerClient``, below ``maxLinkNum``): a connection from a source
  address that already holds that many is closed at once, without an answer, and never counts
  against ``maxLinkNum``.

The body deadline (``bodyTimeoutMs``) is the app's (``app.py``), where a 408 can be answered in the
API's error format. Hand-written because uvicorn has no option for either (its ``h11`` limits
bound the size of a head, not the time it takes); the subclass hooks only ``connection_made``,
``data_received`` and ``connection_lost`` and leaves h11's parsing and uvicorn's request cycle as
they are. It pins the h11 protocol, whose behaviour the server tests document (uvicorn's "auto"
would switch to httptools wherever that happens to be installed).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["ClientSlots", "protocol_class", "HEAD_TIMEOUT_BODY"]

logger = logging.getLogger("pdlink.server")

HEAD_TIMEOUT_BODY = b"Request head not received in time."
_HEAD_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                 b"content-length: %d\r\nconnection: close\r\n\r\n" % len(HEAD_TIMEOUT_BODY)) + HEAD_TIMEOUT_BODY


class ClientSlots:
    """Open connections per source address on one listener, at most ``per_client`` each."""

    def __init__(self, per_client: int):
        self.per_client = per_client
        self.open: dict[str, int] = {}
        self._warned: set[str] = set()  # addresses refused since they last had no connection (one warning each)

    def take(self, host: str) -> bool:
        n = self.open.get(host, 0)
        if n >= self.per_client:
            if host not in self._warned:
                self._warned.add(host)
                logger.warning("refusing connections from %s: it holds %d, the maxLinksPerClient limit", host, n)
            return False
        self.open[host] = n + 1
        return True

    def give(self, host: str) -> None:
        n = self.open.get(host, 0) - 1
        if n > 0:
            self.open[host] = n
        else:
            self.open.pop(host, None)
            self._warned.discard(host)


def _host(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"  # AF_INET / AF_INET6: (host, port, ...)


def protocol_class(per_client: int, head_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's ``http`` protocol for one listener: h11 plus the guards of the module text."""
    slots = ClientSlots(per_client)

    class GuardedH11Protocol(H11Protocol):
        _refused = False  # closed at once by the per-client cap: none of uvicorn's state was set up
        _host = ""
        _head_timer: asyncio.TimerHandle | None = None
        _head_started = False  # some bytes of a head arrived

        def connection_made(self, transport: Any) -> None:
            host = _host(transport)
            if not slots.take(host):
                self._refused = True
                transport.close()
                return
            self._host = host
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timeout)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if data:
                self._head_started = True
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not None:  # the head is complete
                self._head_timer.cancel()
                self._head_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            slots.give(self._host)
            super().connection_lost(exc)

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.cycle is not None:
                return
            if self._head_started:
                # h11 can only answer a request it has parsed: the 408 is written as bytes, and the
                # connection closed right after it
                self.transport.write(_HEAD_TIMEOUT)
            logger.debug("closing a connection from %s: no request head within headTimeoutMs", self._host)
            self.transport.close()

    return GuardedH11Protocol
