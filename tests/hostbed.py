"""Emulated hosts (``pdlink.testing.hosts``; docs/hosts.md) in tests.

``require_hosts()`` skips a test that needs them with the reason they cannot be made here, or fails
it when PDLINK_REQUIRE_HOSTS=1 (CI sets it, so a machine that lost the ability never passes by
skipping). ``bed(n, profile)`` makes n hosts for one test and gives each host its own ephemeral port
range, disjoint across hosts, so that the port a listening peer reports names its host
(tests/peers/addr.py). ``place(peers, hosts, i, name)`` starts a ``Peer`` on host i with the
environment peers.addr reads. The two-hosts cells of the matrix (``Variant.hosts``,
tests/backend_env.py) use one bed of four hosts per test worker (conftest's ``test_hosts``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pdlink.testing.hosts import Hosts, unavailable_reason
from peer import Peer


def require_hosts() -> None:
    """Skip (or, under PDLINK_REQUIRE_HOSTS=1, fail) when hosts cannot be made here."""
    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("PDLINK_REQUIRE_HOSTS") == "1":
        pytest.fail(f"PDLINK_REQUIRE_HOSTS=1 but hosts cannot be made: {reason}", pytrace=False)
    pytest.skip(f"needs emulated hosts: {reason}")


PORTS_PER_HOST = 10000
FIRST_PORT = 20000


def _ports(i: int) -> tuple[int, int]:
    low = FIRST_PORT + i * PORTS_PER_HOST
    return low, low + PORTS_PER_HOST - 1


@contextlib.contextmanager
def bed(n: int, profile: Any = "loopback") -> Iterator[Hosts]:
    """``n`` emulated hosts on a wire of ``profile``, each with its own port range; torn down after."""
    require_hosts()
    assert FIRST_PORT + n * PORTS_PER_HOST <= 65536, n
    with Hosts(n, profile=profile) as hosts:
        for i, host in enumerate(hosts):
            low, high = _ports(i)
            host.run(["sysctl", "-q", "-w", f"net.ipv4.ip_local_port_range={low} {high}"],
                     timeout=30).check_returncode()
        yield hosts


def env(hosts: Any, i: int) -> dict[str, str]:
    """The environment of a peer on host ``i`` (tests/peers/addr.py): its address, every host's ports."""
    ports = ";".join(f"{h.ip}={'-'.join(map(str, _ports(j)))}" for j, h in enumerate(hosts))
    return {"PDLINK_TEST_HOST_IP": hosts[i].ip, "PDLINK_TEST_PORT_MAP": ports}


def place(peers: Callable[..., Peer], hosts: Any, i: int, name: str, **kw: Any) -> Peer:
    """A peer (from the ``peers`` factory) on host ``i``; ``kw`` as ``Peer`` takes them."""
    return peers(name, executable=hosts[i].python, env={**(kw.pop("env", None) or {}), **env(hosts, i)}, **kw)
