"""What ``transport="auto"`` picks once the operator trusts the network (``ucx_trusted_network``):
the ucx path for links between hosts when UCX's network transports include one that
``PDLINK_UCX_AUTO_TRANSPORTS`` lists (unset: the RDMA families rc, dc, ud, srd), cma on one host,
the stream for a peer that serves no ucx (docs/ucx.md, "What auto picks").

"Another host" is a peer in a pid namespace of its own (``Peer(pid_namespace=True)``): the kernel
cannot name either process to the other, so pdlink cannot prove they share a host and links them
over TCP, as it would two hosts; UCX then connects the engines' network workers over loopback.
There is no RDMA device here, so the tests list ``tcp`` as a transport auto may pick; the rule for
the default list is checked in csrc/tests/ucx_test.cc. Every transfer checks the whole destination
and the source.

And what such an engine takes from a raw peer (tests/peers/hostile.py): ucx frames only on links it
puts on ucx itself, and there no worker address UCX would misread."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest

import rawwire
from conftest import CMA_AVAILABLE, UCX_WHY_NOT, require_for_ucx
from native_pair import TARGET, Two, copies, lane_families
from pdlink import LLMStatusCode
from peer import Peer, pid_namespace_error
from peers import hostile, native
from ucx_addresses import MISREAD, REAL_ADDRESS
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
        assert (two.link(side).transport, two.link(side).lanes) == ("cma", ("process_vm",))


def ucx_connect(address: bytes) -> bytes:
    """The ucx path's kPathConnect: the requester's token, message size 0 (the server picks it), ``address``."""
    return rawwire.path_connect(rawwire.PATH_UCX, struct.pack("<QI", 7, 0) + address)


UCX_READ = rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=7, runs=((0, 64),)), flags=rawwire.FLAG_UCX)
NOT_HERE = "this engine does not use ucx on this link (pdlink.Transport=ucx, or auto between hosts with " \
           "ucx_trusted_network)"


@pytest.mark.parametrize("link", ["tcp", "cma"])
def test_ucx_frames_are_refused_on_a_link_an_auto_engine_keeps_off_ucx(peers: Callable[..., Peer], link: str) -> None:
    """An auto engine with UCX and the trusted-network statement takes ucx frames only on links it
    would put on ucx itself: a raw peer's ucx kPathConnect and kFlagUcx read on a TCP link between
    "hosts" where no listed transport is there (PDLINK_UCX_AUTO_TRANSPORTS=""), or on a same-host
    link (cma, which auto never puts on ucx), are answered LLM_FEATURE_NOT_ENABLED before anything
    of the address is read; the link keeps serving, and an honest peer's transfers are byte-exact."""
    if link == "cma" and not CMA_AVAILABLE:
        pytest.skip("process_vm_readv between sibling processes is not permitted on this machine")
    env = {**AUTO, "PDLINK_UCX_AUTO_TRANSPORTS": "" if link == "tcp" else "tcp"}
    two = Two(peers, env, {"PDLINK_TRANSPORT": "tcp"})
    attacker = peers("attacker")
    port = two.target.call(native.listen_port)
    unix = attacker.call(hostile.redirect_name, port) if link == "cma" else None
    assert (unix is None) == (link == "tcp") and (unix != "" if unix is not None else True)
    assert attacker.call(hostile.link_raw, port, 9, b"", unix) == (0, "")
    links = {info.peer_cluster_id: info.transport for info in two.target.call(native.links)}
    assert links[9] == link, links
    for frame in (ucx_connect(REAL_ADDRESS), ucx_connect(b"\xa5" * 64), UCX_READ):
        assert attacker.call(hostile.exchange, frame) == (LLMStatusCode.LLM_FEATURE_NOT_ENABLED, NOT_HERE, b"")
    assert attacker.call(hostile.exchange, rawwire.request(rawwire.OP_PING, b"")) == (0, "", b"")
    read_and_write(two)


def test_a_malformed_worker_address_to_an_auto_engine_on_ucx_is_refused(peers: Callable[..., Peer]) -> None:
    """An auto engine that puts links between hosts on ucx (PDLINK_UCX_AUTO_TRANSPORTS=tcp) takes a
    raw peer's ucx kPathConnect on a TCP link, and checks its worker address before UCX sees it: bytes
    UCX aborts on, a real address cut short or lengthened, one whose tcp transport lacks its device
    address, one with endpoint addresses, are answered LLM_PARAM_INVALID and the link kept; a real
    address reaches UCX. The honest peer (over ucx, from a pid namespace of its own) moves
    byte-exact throughout."""
    require_for_ucx(pid_namespace_error())
    env = {**AUTO, "PDLINK_UCX_AUTO_TRANSPORTS": "tcp"}
    two = Two(peers, env, env, initiator_pid_namespace=True)
    read_and_write(two)
    assert two.link(two.initiator).transport == "ucx"
    attacker = peers("attacker")
    assert attacker.call(hostile.link_raw, two.target.call(native.listen_port), 9) == (0, "")
    for bad in MISREAD.values():
        answer = attacker.call(hostile.exchange, ucx_connect(bad))
        assert isinstance(answer, tuple) and answer[0] == LLMStatusCode.LLM_PARAM_INVALID and answer[2] == b"", answer
        assert answer[1].startswith("ucx: the peer's worker address was refused: malformed ucx worker address")
        read_and_write(two)
    # A real address passes the check and reaches UCX (whose endpoint to that long-gone worker fails
    # or not, as UCX finds it): an answer either way, the link kept.
    answer = attacker.call(hostile.exchange, ucx_connect(REAL_ADDRESS))
    assert isinstance(answer, tuple) and (answer[0] == 0 or answer[1].startswith(
        "ucx: connecting to the peer's worker")), answer
    read_and_write(two)
    assert two.link(two.initiator).transport == "ucx"
