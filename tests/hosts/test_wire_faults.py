"""Faults of the emulated wire (pdlink.testing.hosts): a partition cuts only its pair, isolation
cuts one host from all, link down/up and a flapping link, and heal undoes them all. Reachability is
a TCP connect to a closed port: refused means the frames pass, a timeout means they do not."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hostbed import require_hosts
from pdlink.testing.hosts import Hosts
from peers import hosts as hp
from poll import wait_until

CLOSED_PORT = 9  # nothing listens there: an answer is a refusal
PROBE_S = 1.0  # how long a connect waits before the path counts as cut


def reach(hosts: Hosts, a: int, b: int) -> bool:
    """Whether host a's frames reach host b and back (a refused connect), or not (a timeout)."""
    error = hosts[a].run(hp.connect_error, hosts[b].ip, CLOSED_PORT, PROBE_S)
    assert error in ("ConnectionRefusedError", "timeout", "OSError"), error
    return error == "ConnectionRefusedError"


def matrix(hosts: Hosts) -> set[tuple[int, int]]:
    """The ordered pairs (a, b) whose frames pass (every pair probed at once)."""
    n = len(hosts)
    pairs = [(a, b) for a in range(n) for b in range(n) if a != b]
    probes = {(a, b): hosts[a].spawn(hp.connect_error, hosts[b].ip, CLOSED_PORT, PROBE_S) for a, b in pairs}
    passed = set()
    for pair, probe in probes.items():
        error = probe.result(60)
        assert error in ("ConnectionRefusedError", "timeout", "OSError"), error
        if error == "ConnectionRefusedError":
            passed.add(pair)
    return passed


ALL3 = {(a, b) for a in range(3) for b in range(3) if a != b}


@pytest.fixture
def three() -> Iterator[Hosts]:
    require_hosts()
    with Hosts(3) as hosts:
        yield hosts


@pytest.mark.parametrize("profile", ["loopback", "dc"])
def test_partition_cuts_only_its_pair_and_heal_restores(profile: str) -> None:
    """On plain veth and behind the relay (dc): the partition is the kernel's either way."""
    require_hosts()
    with Hosts(3, profile) as three:
        assert matrix(three) == ALL3
        three.partition(0, 1)
        assert matrix(three) == ALL3 - {(0, 1), (1, 0)}
        three.link_down(2)
        assert matrix(three) == set()
        three.heal()
        assert matrix(three) == ALL3


def test_isolate_cuts_one_host_from_all(three: Hosts) -> None:
    three.isolate(2)
    assert matrix(three) == {(0, 1), (1, 0)}
    three.heal()
    assert matrix(three) == ALL3


def test_link_down_and_up(three: Hosts) -> None:
    three.link_down(1)
    assert matrix(three) == {(0, 2), (2, 0)}
    three.link_up(1)
    wait_until(lambda: reach(three, 0, 1) and reach(three, 1, 2), 30, "host 1 reachable again")
    three.link_down(0)
    three.heal()
    wait_until(lambda: matrix(three) == ALL3, 30, "every pair reachable after heal")


def test_flap_toggles_the_link_and_leaves_it_up(three: Hosts) -> None:
    seen: set[bool] = set()

    def both_seen() -> bool:
        seen.add(reach(three, 0, 1))
        return seen == {True, False}

    with three.flap(1, down_s=0.3, up_s=0.3):
        wait_until(both_seen, 60, "host 1 seen both cut and reachable while it flaps")
    wait_until(lambda: reach(three, 0, 1), 30, "the link is up after the flap")
