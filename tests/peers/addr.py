"""Where a peer listens and whom it dials.

On loopback (most cells of the matrix) every address is 127.0.0.1. In a cell whose peers run on
emulated hosts (``backend_env.Variant.hosts``; ``pdlink.testing.hosts``), the test gives each peer
its host's address (``PDLINK_TEST_HOST_IP``) and which host owns which ports
(``PDLINK_TEST_PORT_MAP``: ``ip=low-high`` entries joined by ``;``, each host's ephemeral port
range, disjoint across hosts), so that a test that hands a peer only a port still dials the host
that listens on it.
"""

from __future__ import annotations

import os

HOST_IP_ENV = "PDLINK_TEST_HOST_IP"
PORT_MAP_ENV = "PDLINK_TEST_PORT_MAP"
LOOPBACK = "127.0.0.1"


def own() -> str:
    """This peer's address: where it listens, and its local address when it dials."""
    return os.environ.get(HOST_IP_ENV, LOOPBACK)


def listen(port: int = 0) -> str:
    """``ip:port`` to listen on (port 0: any free one)."""
    return f"{own()}:{port}"


def of(port: int) -> str:
    """The address of the peer listening on ``port``: the host whose port range holds it, or this
    peer's own address (loopback, or a port outside every range: one chosen on this host)."""
    for entry in filter(None, os.environ.get(PORT_MAP_ENV, "").split(";")):
        ip, _, span = entry.partition("=")
        low, _, high = span.partition("-")
        if int(low) <= port <= int(high):
            return ip
    return own()
