"""A man in the middle, for the authenticated-session tests: a loopback TCP proxy between an honest
dialler and an honest acceptor that reads pdlink's handshake (it learns whether the link is
authenticated and has payload integrity) and the requests on FORWARD channels, and can rewrite,
inject, replay, hold back or cut them. It knows no secret.

The proxy runs in the test process (threads, real sockets, 127.0.0.1 only). A dialler links to
``proxy.port`` over TCP (a same-host redirect would route around it). Layouts: tests/rawwire.py.

    proxy = Proxy(acceptor_port, on_request=hold_commits)
    ...
    proxy.inject(frame)                 # sent to the acceptor; what it answers is kept, not forwarded
    wait_until(lambda: proxy.forward().closed.is_set(), ...)
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
from collections.abc import Callable

import rawwire
from internals import core
from poll import wait_until
from relay import Conn, shut_quietly

CHUNK = core.LIMITS["payload_chunk_bytes"]  # a sealed payload's chunk (csrc/core/limits.h)
TIMEOUT_S = 30.0  # no proxy thread waits longer for a byte


@dataclasses.dataclass
class Request:
    """One request on a FORWARD channel as it travelled: header, body, tag (authenticated links),
    payload (with its chunk tags under payload integrity)."""

    op: int
    flags: int
    body: bytes
    payload_len: int
    tag: bytes
    payload: bytes
    epoch_tag: int = 0  # the request's epoch fence (a prepared transfer's; a u32 since wire v8)

    @property
    def raw(self) -> bytes:
        header = rawwire.request_header(self.op, len(self.body), self.payload_len, self.flags, self.epoch_tag)
        return header + self.body + self.tag + self.payload

    def payload_bytes(self, integrity: bool) -> bytes:
        """The payload without its chunk tags."""
        if not integrity:
            return self.payload
        step = CHUNK + rawwire.TAG_BYTES
        return b"".join(self.payload[i:i + CHUNK] for i in range(0, len(self.payload), step))


def sealed_payload(data: bytes, tags: bytes, integrity: bool) -> bytes:
    """``data`` laid out as a payload: in chunks each followed by a tag (taken from ``tags`` in
    turn, so a forged payload can reuse honest tags) under payload integrity."""
    if not integrity:
        return data
    out = b""
    tag = rawwire.TAG_BYTES
    for k, i in enumerate(range(0, len(data), CHUNK)):
        out += data[i:i + CHUNK] + tags[k * tag:(k + 1) * tag].ljust(tag, b"\0")
    return out


class Channel:
    """One proxied connection: what the proxy learnt of it and what went through."""

    def __init__(self, proxy: Proxy, client: socket.socket, upstream: socket.socket):
        self.proxy = proxy
        self.client, self.upstream = client, upstream
        self.conn = Conn(client, upstream)  # closes both once _up and _down have ended
        self.kind = -1  # 0 FORWARD, 1 REVERSE (from its Hello)
        self.authenticated = False  # the verdict carried a tag
        self.integrity = False  # the verdict agreed to payload integrity
        self.verdict = threading.Event()
        self.requests: list[Request] = []
        self.capture = False  # once set, what the acceptor sends is kept in `captured`, not forwarded
        self.captured = bytearray()
        self.closed = threading.Event()  # the acceptor closed its end
        self._send_lock = threading.Lock()

    def send_upstream(self, data: bytes) -> None:
        with self._send_lock:
            self.upstream.sendall(data)

    def inject(self, data: bytes) -> None:
        """Sends ``data`` to the acceptor as if the dialler had; from now on the acceptor's answers
        are captured, not forwarded (the dialler would not expect them)."""
        self.capture = True
        self.send_upstream(data)

    # ------------------------------------------------------------------ threads

    def _up(self) -> None:  # dialler -> acceptor
        try:
            hello = rawwire.recv_exact(self.client, rawwire.HELLO_BYTES)
            self.kind = hello[6]
            self.send_upstream(self.proxy.on_hello(hello))
            self.send_upstream(rawwire.recv_exact(self.client, rawwire.CLIENT_AUTH_BYTES))
            if not self.verdict.wait(TIMEOUT_S):
                return
            if self.kind != 0:
                while data := self.client.recv(1 << 16):
                    self.send_upstream(data)
                return
            while True:
                req = self._read_request()
                self.requests.append(req)
                for data in self.proxy.on_request(self, req):
                    self.send_upstream(data)
        except (OSError, ConnectionError):
            pass

    def _read_request(self) -> Request:
        head = rawwire.recv_exact(self.client, rawwire.REQUEST_HEADER_BYTES)
        _magic, op, flags, _reserved, epoch_tag, blen, plen = struct.unpack(rawwire.REQUEST_FORMAT, head)
        body = rawwire.recv_exact(self.client, blen)
        tag = rawwire.recv_exact(self.client, rawwire.TAG_BYTES) if self.authenticated else b""
        chunks = -(-plen // CHUNK) if self.integrity else 0
        payload = rawwire.recv_exact(self.client, plen + chunks * rawwire.TAG_BYTES) if plen else b""
        return Request(op, flags, body, plen, tag, payload, epoch_tag)

    def _down(self) -> None:  # acceptor -> dialler
        try:
            fixed = rawwire.recv_exact(self.upstream, rawwire.ACK_FIXED)
            _m, _v, status, _c, mlen = struct.unpack("<IHIQI", fixed[:22])
            self.client.sendall(fixed + rawwire.recv_exact(self.upstream, mlen))
            if status == 0:
                fixed = rawwire.recv_exact(self.upstream, rawwire.AUTH_FIXED)
                _m, _s, mlen, rlen, _g, flags = struct.unpack("<IIIHQB", fixed[:23])
                self.authenticated = fixed[23:] != bytes(rawwire.TAG_BYTES)
                self.integrity = bool(flags & rawwire.AUTH_PAYLOAD_INTEGRITY)
                self.verdict.set()
                self.client.sendall(fixed + rawwire.recv_exact(self.upstream, mlen + rlen))
            while data := self.upstream.recv(1 << 16):
                if self.capture:
                    self.captured += data
                else:
                    self.client.sendall(data)
        except (OSError, ConnectionError):
            pass
        finally:
            self.verdict.set()
            self.closed.set()


class Proxy:
    """Listens on 127.0.0.1 and relays every connection to the acceptor at ``target_port``.

    ``on_hello(hello) -> hello``: the dialler's Hello as the acceptor will see it (both channels).
    ``on_request(channel, request) -> [bytes]``: what goes to the acceptor in place of a request
    (default: the request as it came)."""

    def __init__(self, target_port: int, on_hello: Callable[[bytes], bytes] | None = None,
                 on_request: Callable[[Channel, Request], list[bytes]] | None = None):
        self.target_port = target_port
        self.on_hello = on_hello or (lambda hello: hello)
        self.on_request = on_request or (lambda channel, req: [req.raw])
        self.channels: list[Channel] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # close() shut the listener down
                self._listener.close()
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=TIMEOUT_S)
            upstream.settimeout(None)
            ch = Channel(self, client, upstream)
            self.channels.append(ch)
            ch.conn.start(ch._up, ch._down)

    def forward(self) -> Channel:
        """The FORWARD channel of the (first) link made through the proxy."""
        return wait_until(lambda: next((c for c in self.channels if c.kind == 0), None), TIMEOUT_S,
                          "a FORWARD channel through the proxy")

    def close(self) -> None:
        shut_quietly(self._listener)
        self._acceptor.join(TIMEOUT_S)
        for ch in self.channels:
            ch.conn.close()
