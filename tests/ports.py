"""Free ports for servers a test starts later (a process that binds them a second or more after
they were chosen).

A port the kernel hands to ``bind(0)`` is the worst choice for that: the kernel hands the same
neighbourhood to every other ``bind(0)`` and ``connect()`` of the machine (the parallel test
workers make thousands), so one of them may take the port before the server binds it. Where the
ephemeral range leaves room (32768-60999 by default) ports are drawn at random below it, where no
outgoing connection ever lands; where it covers almost everything (some CI containers use
1024-65535) they are drawn at random from the whole range, which makes a collision unlikely
rather than impossible.
"""

from __future__ import annotations

import os
import random
import socket

_rng = random.Random()
# A peer forked from a process that imported this module must not draw its parent's ports.
os.register_at_fork(after_in_child=_rng.seed)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _candidates(n: int) -> tuple[int, int]:
    """[lo, hi): where a block of ``n`` ports is drawn from."""
    lo_eph, _ = _ephemeral_range()
    if lo_eph > 20000 + n:
        return 20000, lo_eph - n
    return 1024, 65535 - n


def free_block(n: int, host: str = "127.0.0.1") -> int:
    """The first port of ``n`` consecutive free ports on ``host``, probed with SO_REUSEADDR as the
    servers bind."""
    lo, hi = _candidates(n)
    for _ in range(500):
        base = _rng.randrange(lo, hi)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports on {host}")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports on ``host`` (each probed as ``free_block(1)``)."""
    ports: list[int] = []
    while len(ports) < n:
        p = free_block(1, host)
        if p not in ports:
            ports.append(p)
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One free port on ``host``."""
    return free_block(1, host)
