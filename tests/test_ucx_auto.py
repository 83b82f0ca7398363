"""What ``transport="auto"`` picks once the operator trusts the network (``ucx_trusted_network``):
the ucx path for links between hosts when UCX's network transports include one that
``PDLINK_UCX_AUTO_TRANSPORTS`` lists (unset: the RDMA families rc, dc, ud, srd), cma on one host,
the stream for a peer that serves no ucx (docs/ucx.md, "What auto picks").

"Another host" is a peer in a pid namespace of its own (``Peer(pid_namespace=True)``): the kernel
cannot name either process to the other, so pdlink cannot prove they share a host and links them
over TCP, as it would two hosts; UCX then connects the engines' network workers over loopback.
There is no RDMA device here, so the tests list ``tcp`` as a transport auto may pick; the rule for
the default list is checked in csrc/tests/ucx_test.cc. Every transfer checks the whole destination
and the source."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from conftest import CMA_AVAILABLE, UCX_WHY_NOT, require_for_ucx
from native_pair import TARGET, Two, copies, lane_families
from peer import Peer, pid_namespace_error
from peers import native
from verify import check_transfer

# auto with the trusted-network statement, over UCX's tcp transport
AUTO = {"PDLINK_TRANSPORT": "auto", "PDLINK_UCX_TRUSTED_NETWORK": "1", "UCX_TLS": "tcp"}


@pytest.fixture(autouse=True)
def _ucx() -> None:
    require_for_ucx(UCX_WHY_NOT)


def read_and_write(two: Two) -> None:
    """A read of two ranges into "dst", then a write of one back into "sink", byte-exact."""
    reads = [(700, 5, 100), (0, 1500, 37)]  # (src offset, dst offset, length)
    local, remote = [(d, n) for _, d, n in reads], [(two.src + s, n) for s, _, n in reads]
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.descriptors, TARGET, "dst", local, remote, "read"), copies(reads))
    check_transfer(two.read("dst"), two.read("sink"), lambda: two.initiator.call(
        native.descriptors, TARGET, "dst", [(5, 100)], [(two.sink + 33, 100)], "write"), copies([(5, 33, 100)]))


def test_auto_picks_ucx_between_hosts_over_a_listed_transport(peers: Callable[..., Peer]) -> None:
    require_for_ucx(pid_namespace_error())
    env = {**AUTO, "PDLINK_UCX_AUTO_TRANSPORTS": "tcp"}
    two = Two(peers, env, env, initiator_pid_namespace=True)
    for side in (two.initiator, two.target):
        assert (two.link(side).transport, two.link(side).lanes) == ("ucx", ())  # not connected yet
    read_and_write(two)
    lanes = two.link(two.initiator).lanes
    assert lanes and lane_families(lanes) == {"tcp"}, lanes  # the network worker: never shared memory
    assert two.link(two.initiator).transport == "ucx"


def test_auto_keeps_tcp_between_hosts_when_no_listed_transport_is_there(peers: Callable[..., Peer]) -> None:
    """An empty PDLINK_UCX_AUTO_TRANSPORTS lists none (as the RDMA default does on a host without
    an RDMA device): the stream, though both engines have UCX."""
    require_for_ucx(pid_namespace_error())
    env = {**AUTO, "PDLINK_UCX_AUTO_TRANSPORTS": ""}
    two = Two(peers, env, env, initiator_pid_namespace=True)
    read_and_write(two)
    for side in (two.initiator, two.target):
        assert (two.link(side).transport, two.link(side).lanes) == ("tcp", ())


def test_auto_turns_a_link_over_to_tcp_when_the_peer_serves_no_ucx(peers: Callable[..., Peer]) -> None:
    """A target forced to tcp (no UCX of its own, no same-host redirect: a TCP link) refuses the
    initiator's ucx connect; the initiator's first transfer moves over the stream instead, and so
    does every later one."""
    two = Two(peers, {"PDLINK_TRANSPORT": "tcp"}, {**AUTO, "PDLINK_UCX_AUTO_TRANSPORTS": "tcp"})
    assert two.link(two.initiator).transport == "ucx"
    read_and_write(two)
    assert (two.link(two.initiator).transport, two.link(two.initiator).lanes) == ("tcp", ())
    read_and_write(two)


def test_auto_with_ucx_keeps_cma_on_one_host(peers: Callable[..., Peer]) -> None:
    """Two engines the kernel proves to share this host copy directly, UCX or not."""
    if not CMA_AVAILABLE:
        pytest.skip("process_vm_readv between sibling processes is not permitted on this machine")
    env = {**AUTO, "PDLINK_UCX_AUTO_TRANSPORTS": "tcp"}
    two = Two(peers, env, env)
    read_and_write(two)
    for side in (two.initiator, two.target):
        assert (two.link(side).transport, two.link(side).lanes) == ("cma", ())
