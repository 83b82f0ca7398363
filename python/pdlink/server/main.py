"""Run ``pdlink serve``: bind every plane, serve it with uvicorn, stop cleanly on SIGTERM/SIGINT.

The listening sockets are bound here (so a taken port is reported plainly before anything
starts), each plane gets its own uvicorn server in one asyncio loop, with its own TLS 1.3
context. On SIGTERM or SIGINT the servers stop accepting, in-flight requests finish, then the
node stops its link jobs, unlinks its peers and finalises its engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from .config import ConfigError, Settings

__all__ = ["serve"]

logger = logging.getLogger("pdlink.server")


def _bind(ip: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    # proto=IPPROTO_TCP (not 0): asyncio sets TCP_NODELAY only on sockets that say they are TCP;
    # without it a TLS response's second record waits for the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((ip, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {ip}:{port}: {e.strerror}") from None
    sock.set_inheritable(False)
    return sock


def serve(settings: Settings, out: TextIO | None = None) -> int:
    """Serve until a signal arrives; returns the process exit code."""
    out = out or sys.stderr
    try:
        import uvicorn

        from .app import build_apps
        from .guard import protocol_class
        from .metrics import Metrics
        from .parsing import BodyDecoder
    except ImportError as e:
        print(f"pdlink serve needs the server extra ({e.name} is missing): pip install 'pdlink[server]'", file=out)
        return 2
    from .node import Node
    from .tls import server_context

    contexts = [server_context(p.tls, p.name) if p.tls else None for p in settings.planes]
    sockets: list[socket.socket] = []
    try:
        for plane in settings.planes:
            sockets.append(_bind(plane.ip, plane.port, min(2 * settings.max_link_num, 4096)))
    except ConfigError:
        for s in sockets:
            s.close()
        raise

    class _Config(uvicorn.Config):
        """uvicorn's Config with a TLS context built by pdlink (TLS 1.3 only, mutual TLS)."""

        def __init__(self, app: Any, ssl_context: Any, **kw: Any):
            super().__init__(app, **kw)
            self._pdlink_ssl = ssl_context

        def load(self) -> None:
            super().load()
            self.ssl = self._pdlink_ssl

    class _Server(uvicorn.Server):
        """Signals are handled once for all planes (below), not by each server."""

        def install_signal_handlers(self) -> None:  # uvicorn < 0.29
            pass

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # uvicorn >= 0.29
            yield

    metrics = Metrics()
    node = Node(settings, metrics)
    metrics.attach(node.snapshot, node.engines_by_device)
    decoder = BodyDecoder(settings.max_json_depth)
    apps = build_apps(settings, node, metrics, decoder)
    # uvicorn answers 503 once the open connections, the requester's own included, reach
    # limit_concurrency: maxLinkNum + 1 serves exactly maxLinkNum at once. Every response closes its
    # connection (app.py), so the keep-alive timeout never runs; headTimeoutMs closes idle ones
    # (guard.py), one protocol class (and so one per-client count) per listener.
    servers = [
        _Server(_Config(app, ctx, lifespan="off", log_config=None, access_log=False, server_header=False,
                        proxy_headers=False, limit_concurrency=settings.max_link_num + 1, timeout_keep_alive=5,
                        http=protocol_class(settings.max_links_per_client, settings.head_timeout_ms / 1000)))
        for app, ctx in zip(apps, contexts)
    ]

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def stop() -> None:
            for s in servers:
                if s.should_exit:
                    s.force_exit = True
                s.should_exit = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        tasks = [asyncio.ensure_future(s.serve(sockets=[sock])) for s, sock in zip(servers, sockets)]
        while not all(s.started for s in servers):
            if any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.01)
        else:
            planes = ", ".join(
                f"{p.name} {'https' if p.tls else 'http'}://{p.ip if ':' not in p.ip else '[' + p.ip + ']'}:"
                f"{p.port}{' (mutual TLS)' if p.tls and p.tls.ca_files else ''}" for p in settings.planes)
            print(f"pdlink serve: ready: {planes}; config: {settings.source}", file=out, flush=True)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        stop()
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, (asyncio.CancelledError, SystemExit)):
                raise r

    try:
        asyncio.run(main())
    finally:
        for s in sockets:
            s.close()
        node.close()
        decoder.close()
    print("pdlink serve: stopped", file=out, flush=True)
    return 0
