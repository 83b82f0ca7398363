"""No frame can crash the victim or steer its memory: a hostile peer (tests/peers/hostile.py, a plain
socket program on 127.0.0.2) links to a victim engine and sends what an attacker would.

Every case asserts the victim's exact answer (or that it dropped only that link), that nothing
unregistered was disclosed or written, that its resident memory stayed within a bound, and that an
honest decoder linked to it pulls byte-exact during and after the attack. Resource counts are
polled back to their level before the attack.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

import pytest

import internals
import rawwire
import ucx_addresses
from backend_env import Variant
from conftest import Pair, only
from llm_datadist import BlocksCacheKey, Placement
from pdlink import LLMStatusCode
from peer import Peer
from peers import hostile, kv
from poll import wait_until
from verify import assert_same

# The attackers are this test process, on no emulated host: the two-hosts cells are left out.
pytestmark = pytest.mark.one_host("the attacker is the test process")
KEY = Pair.KEY
SHAPE = (16, 4096)
TENSOR_BYTES = SHAPE[0] * SHAPE[1] * 2
RSS_BOUND_KIB = 64 * 1024
S = LLMStatusCode
LIMITS = internals.core.LIMITS  # the engine's own table, never re-typed here


@pytest.fixture
def victim(pair: Pair) -> Pair:
    """The prefill (the victim) with a blocks cache, an unregistered secret, and an honest decoder
    linked to it."""
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    pair.prefill.call(kv.plant_secret)
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    pair.link()
    pair.pulled([0])  # what a data path sets up once per process (the IPC exporter's thread) predates the counts
    return pair


def attacker_links(peers: Callable[..., Peer], pair: Pair) -> Peer:
    """An attacker with a raw link to the victim: over TCP, or, to a victim that only takes
    same-host links, over the AF_UNIX socket it redirects to once the attacker claims its host."""
    a = peers("attacker")
    unix = a.call(hostile.redirect_name, pair.port) if pair.variant.same_host else None
    assert a.call(hostile.link_raw, pair.port, 9, b"", unix) == (0, "")
    return a


def tensor_read(tensors: int, runs: int, flags: int = 0, run: tuple[int, int] = (0, 1)) -> bytes:
    body = rawwire.counted_body(tensors, runs, struct.pack("<I", 0) * tensors, struct.pack("<QQ", *run) * runs)
    return rawwire.request(rawwire.OP_READ, body, flags=flags)


# Frames whose counts exceed the per-request bounds (limits: 65536 tensors, 262144 pieces, a 4.2 MiB
# body): refused by the decoder before anything is allocated for them, and the link is dropped.
OVERSIZED = {
    # the frame that aborted v2: tensor 0 a million times, a one-byte run a quarter-million times
    "million_tensors_direct": lambda: rawwire.request(
        rawwire.OP_READ, rawwire.counted_body(1_000_000, 250_000), flags=rawwire.FLAG_DIRECT),
    "pieces_over_the_bound": lambda: tensor_read(1024, LIMITS["max_request_pieces"] // 1024 + 1, rawwire.FLAG_DIRECT),
    "tensors_over_the_bound": lambda: tensor_read(LIMITS["max_request_tensors"] + 1, 1),
    "counts_beyond_the_bytes": lambda: rawwire.request(rawwire.OP_READ, rawwire.counted_body(2**32 - 1, 2**32 - 1)),
}


@pytest.mark.parametrize("frame", sorted(OVERSIZED))
def test_a_frame_over_the_request_bounds_drops_only_that_link(peers: Callable[..., Peer], victim: Pair,
                                                              frame: str) -> None:
    base = victim.prefill.call(kv.resources)
    rss = victim.prefill.call(kv.rss_kib)
    a = attacker_links(peers, victim)
    assert a.call(hostile.exchange, OVERSIZED[frame]()) == "closed"
    victim.pulled([3])  # during: the attacker's process is still there
    a.call(hostile.close)
    assert victim.prefill.call(kv.rss_kib) - rss < RSS_BOUND_KIB
    # the link's serving thread is gone; the broken link entity keeps its two sockets (shut down,
    # not closed) until it is unlinked, so that switch_role still sees it
    fds, threads = base
    seen: list[tuple[int, int]] = []

    def settled() -> bool:
        seen.append(victim.prefill.call(kv.resources))
        return seen[-1][0] <= fds + 2 and seen[-1][1] <= threads

    try:
        wait_until(settled, 20, f"the victim's descriptors and threads back to {base} (+2 descriptors)")
    except AssertionError as e:
        raise AssertionError(f"{e}; last (descriptors, threads): {seen[-1]}, threads now: "
                             f"{victim.prefill.call(kv.thread_names)}") from None
    victim.pulled([4])


def test_a_request_at_the_bounds_is_served_within_them(peers: Callable[..., Peer], victim: Pair) -> None:
    """The most one request may name (max_request_tensors x 4 runs = max_request_pieces): admitted and
    served (on a same-host link as a direct answer of 4 MiB, on TCP as the bytes), within the memory
    bound; one tensor index past the cache is refused with the registry's answer, the link intact."""
    tensors = LIMITS["max_request_tensors"]
    runs = LIMITS["max_request_pieces"] // tensors
    assert runs == 4
    a = attacker_links(peers, victim)
    rss = victim.prefill.call(kv.rss_kib)
    indexes = b"".join(struct.pack("<I", t % 2) for t in range(tensors))
    body = rawwire.counted_body(tensors, runs, indexes, struct.pack("<QQ", 0, 64) * runs)
    direct = victim.variant.same_host
    answer = a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, body,
                                                      flags=rawwire.FLAG_DIRECT if direct else 0))
    if victim.variant.device_memory:  # a stream read of device memory is refused as such
        assert answer[:1] == (S.LLM_PARAM_INVALID,) and answer[2] == b"", answer[:2]
    else:
        assert answer[0] == 0, answer[:2]
        assert len(answer[2]) == (16 + 16 * tensors * runs if direct else 64 * tensors * runs)
        if direct:
            a.call(hostile.send, rawwire.request(rawwire.OP_RELEASE, rawwire.blocks_body()))
    assert victim.prefill.call(kv.rss_kib) - rss < RSS_BOUND_KIB
    past = rawwire.counted_body(tensors, runs, b"".join(struct.pack("<I", t) for t in range(tensors)),
                                struct.pack("<QQ", 0, 64) * runs)
    refused = a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, past))
    assert refused[:1] == (S.LLM_PARAM_INVALID,) and "tensor index 2 out of range" in refused[1], refused[:2]
    victim.pulled([5])


def test_a_body_announced_but_never_sent_costs_no_memory(peers: Callable[..., Peer], victim: Pair) -> None:
    """Eight links each announce a 4 MiB body (the most a request may have) and send 1 byte of it: the
    victim's memory grows by what arrived, not by what was announced."""
    rss = victim.prefill.call(kv.rss_kib)
    attackers = []
    for i in range(8):
        a = peers(f"attacker{i}")
        unix = a.call(hostile.redirect_name, victim.port) if victim.variant.same_host else None
        assert a.call(hostile.link_raw, victim.port, 20 + i, b"", unix) == (0, "")
        a.call(hostile.send, rawwire.request_header(rawwire.OP_READ, 4 * 1024 * 1024) + b"\x04")
        attackers.append(a)
    victim.pulled([6])
    assert victim.prefill.call(kv.rss_kib) - rss < 16 * 1024  # 8 x 4 MiB announced
    for a in attackers:
        a.call(hostile.close)
    victim.pulled([7])


@only("cpu-tcp", "ascend-fake")
def test_flags_for_paths_the_link_did_not_negotiate_are_refused_without_addresses(peers: Callable[..., Peer],
                                                                                  victim: Pair) -> None:
    """On a TCP link: direct reads, describe, IPC and one-sided requests are refused (they would hand
    out absolute addresses); a device read without a device channel is refused. No answer carries a
    payload, and the link keeps serving."""
    a = attacker_links(peers, victim)
    blocks = rawwire.blocks_body(runs=((128, 64),))
    device = victim.variant.device_memory
    cases = [
        (rawwire.request(rawwire.OP_READ, blocks, flags=rawwire.FLAG_DIRECT), S.LLM_FEATURE_NOT_ENABLED),
        (rawwire.request(rawwire.OP_DESCRIBE, blocks), S.LLM_FEATURE_NOT_ENABLED),
        (rawwire.request(rawwire.OP_READ, blocks, flags=rawwire.FLAG_DEVICE | rawwire.FLAG_DIRECT),
         S.LLM_FEATURE_NOT_ENABLED),
        (rawwire.request(rawwire.OP_READ, blocks, flags=rawwire.FLAG_DEVICE | rawwire.FLAG_ONE_SIDED),
         S.LLM_FEATURE_NOT_ENABLED),
        # a device read: on the CPU backend the cache is host memory (refused as such); on Ascend the
        # raw peer never set up a device channel
        (rawwire.request(rawwire.OP_READ, blocks, flags=rawwire.FLAG_DEVICE),
         S.LLM_FAILED if device else S.LLM_PARAM_INVALID),
    ]
    for frame, code in cases:
        answer = a.call(hostile.exchange, frame)
        assert isinstance(answer, tuple) and answer[0] == code and answer[2] == b"", (answer, code)
    assert a.call(hostile.exchange, rawwire.request(rawwire.OP_PING, b"")) == (0, "", b"")
    victim.pulled([2])


def test_the_test_paths_flag_drops_only_that_link(peers: Callable[..., Peer], victim: Pair) -> None:
    """kFlagTestPath names a path only a C++ test build registers (csrc/tests/pipe_path.h): an engine
    drops the link as malformed, as for any flags no path of its table names, and serves the rest."""
    a = attacker_links(peers, victim)
    assert a.call(hostile.exchange, tensor_read(1, 1, rawwire.FLAG_TEST_PATH)) == "closed"
    victim.pulled([3])
    a.call(hostile.close)
    victim.pulled([4])


def ucx_hello(size: int, address: bytes = b"\xa5" * 64) -> bytes:
    """The ucx path's kPathConnect frame: its header, then u64 token, u32 message size, the worker
    address (here bytes that abort UCX when it parses them: docs/ucx.md, "Trust")."""
    return rawwire.path_connect(rawwire.PATH_UCX, struct.pack("<QI", 7, size) + address)


# ucx connect requests the decoder refuses before UCX sees the address: the link is dropped
MALFORMED_UCX_CONNECT = {
    "size_too_small": lambda: ucx_hello(1),
    "size_not_power_of_two": lambda: ucx_hello(3 << 14),
    "size_too_large": lambda: ucx_hello(2 << 20),
    "no_address": lambda: ucx_hello(0, b""),
    "address_over_the_bound": lambda: ucx_hello(0, b"\xa5" * 4097),
}


@only("cpu-ucx")
@pytest.mark.parametrize("frame", sorted(MALFORMED_UCX_CONNECT))
def test_a_malformed_ucx_connect_drops_only_that_link(peers: Callable[..., Peer], victim: Pair, frame: str) -> None:
    """Each is refused before the victim makes an endpoint of the address (which would abort it):
    the victim drops that link and keeps serving its honest decoder."""
    a = attacker_links(peers, victim)
    assert a.call(hostile.exchange, MALFORMED_UCX_CONNECT[frame]()) == "closed"
    victim.pulled([3])
    a.call(hostile.close)
    victim.pulled([4])


@only("cpu-ucx")
@pytest.mark.parametrize("address", sorted(ucx_addresses.MISREAD))
def test_a_worker_address_ucx_would_misread_is_refused_and_the_link_kept(peers: Callable[..., Peer], victim: Pair,
                                                                          address: str) -> None:
    """A well-formed ucx connect request whose worker address UCX cannot parse (its version, its
    lengths, a transport's missing address): answered LLM_PARAM_INVALID, nothing handed to UCX, the
    link kept; the honest decoder's pulls over ucx stay byte-exact."""
    a = attacker_links(peers, victim)
    victim.pulled([2])
    answer = a.call(hostile.exchange, ucx_hello(0, ucx_addresses.MISREAD[address]))
    assert isinstance(answer, tuple) and answer[0] == S.LLM_PARAM_INVALID and answer[2] == b"", answer
    assert answer[1].startswith("ucx: the peer's worker address was refused: malformed ucx worker address"), answer
    assert a.call(hostile.exchange, rawwire.request(rawwire.OP_PING, b"")) == (0, "", b"")
    victim.pulled([3])
    a.call(hostile.close)
    victim.pulled([4])


@only("cpu-tcp", "ascend-fake")
def test_a_tcp_link_stays_tcp_whatever_the_peer_claims(peers: Callable[..., Peer], victim: Pair) -> None:
    """A peer that claims the victim's host (its hint) gets no redirect from an engine forced to tcp,
    and its link never copies memory directly; no same-host permission is granted either."""
    a = peers("attacker")
    assert a.call(hostile.redirect_name, victim.port) == ""
    assert a.call(hostile.link_raw, victim.port) == (0, "")
    assert {link["transport"] for link in victim.prefill.call(kv.links)} == {"tcp"}
    assert victim.prefill.call(kv.ptrace_grant_active) is False


@only("cpu-cma")
def test_a_same_host_peer_is_told_only_registered_addresses(peers: Callable[..., Peer], victim: Pair) -> None:
    """A same-host attacker (the kernel reports its pid) may read what is registered, nothing else:
    the addresses it is answered with all lie inside registered tensors; a raw-address read of the
    victim's unregistered secret, and a write into a cache that is not remote accessible, are
    refused. The same-host permission lasts exactly as long as such links exist."""
    victim.prefill.call(kv.register_blocks, "host", 1, (4, 16), seed=3, key=BlocksCacheKey(1, 1),
                        placement=Placement.HOST)  # HOST: not remote accessible
    a = attacker_links(peers, victim)
    assert victim.prefill.call(kv.ptrace_grant_active) is True
    answer = a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, rawwire.blocks_body(
        tensors=(0, 1), runs=((0, 64), (4096, 128))), flags=rawwire.FLAG_DIRECT))
    assert isinstance(answer, tuple) and answer[0] == 0, answer
    _epoch, _epoch_addr, *flat = struct.unpack(f"<QQ{len(answer[2]) // 8 - 2}Q", answer[2])
    tensors = victim.prefill.call(kv.tensor_addresses, "kv")
    for addr, length in zip(flat[::2], flat[1::2]):
        assert any(t <= addr and addr + length <= t + TENSOR_BYTES for t in tensors), hex(addr)
    a.call(hostile.send, rawwire.request(rawwire.OP_RELEASE, rawwire.blocks_body()))
    secret_addr = victim.prefill.call(kv.plant_secret, 64)[0]
    raw = a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, rawwire.blocks_body(
        kind=rawwire.KIND_RAW, runs=((secret_addr, 64),)), flags=rawwire.FLAG_DIRECT))
    assert raw[:1] == (S.LLM_PARAM_INVALID,) and raw[2] == b"", raw
    write = a.call(hostile.exchange, rawwire.request(rawwire.OP_WRITE, rawwire.blocks_body(
        model=1, runs=((0, 32),)), flags=rawwire.FLAG_DIRECT))
    assert write[:1] == (S.LLM_PARAM_INVALID,) and "not remote accessible" in write[1], write
    victim.pulled([1])
    a.call(hostile.close)
    assert victim.unlink() == S.LLM_SUCCESS
    wait_until(lambda: victim.prefill.call(kv.ptrace_grant_active) is False, 20,
               "the same-host permission withdrawn once no same-host link is left")


def test_writes_are_checked_like_reads(peers: Callable[..., Peer], victim: Pair) -> None:
    """Writes outside the registered tensors, into unregistered memory, or with a payload length that
    disagrees with their descriptor: refused or dropped, and the victim's memory is what it was."""
    a = attacker_links(peers, victim)
    before = victim.prefill.call(kv.snapshot, "kv")
    outside = rawwire.blocks_body(runs=((TENSOR_BYTES - 8, 64),))
    answer = a.call(hostile.exchange, rawwire.request(rawwire.OP_WRITE, outside, payload_len=64) + b"\xee" * 64)
    assert answer[:1] == (S.LLM_PARAM_INVALID,), answer
    assert a.call(hostile.exchange, rawwire.request(rawwire.OP_WRITE, rawwire.blocks_body(), payload_len=65)
                  + b"\xee" * 65) == "closed"
    assert_same(victim.prefill.call(kv.snapshot, "kv"), before, "the victim's cache")
    victim.pulled([8])


@only("cpu-cma")
def test_nothing_about_the_engine_goes_out_before_the_proof(peers: Callable[..., Peer], variant: Variant) -> None:
    """With a link secret, a peer that claims the engine's host but cannot prove the secret gets the
    acceptor's challenge and proof only: no redirect (the same-host socket's name), no address; a
    peer that can prove it gets both."""
    p = peers("prefill", env=variant.env())
    port = p.call(kv.start, "prompt", 1, listen=True, extra={"pdlink.LinkSecret": "s3cret"})
    hint = rawwire.host_hint()
    wrong = rawwire.handshake(port, flags=rawwire.HELLO_SAME_HOST, hint=hint, send_proof=os.urandom(32))  # a guess
    assert (wrong.stage, wrong.status) == ("auth", S.LLM_LINK_FAILED) and "authentication failed" in wrong.message
    assert wrong.result is not None and wrong.result.redirect == "" and wrong.result.gen_addr == 0
    right = rawwire.handshake(port, flags=rawwire.HELLO_SAME_HOST, hint=hint, secret=b"s3cret")
    assert right.status == 0 and right.result is not None and right.result.redirect.startswith("pdlink-")
