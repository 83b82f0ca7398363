"""A requester that trusts no server: a victim engine dials a hostile endpoint (tests/peers/hostile.py,
a plain socket program on 127.0.0.2) that sabotages the handshake or answers the victim's requests
with malformed, oversized or lying replies, one reply kind per case.

Every case asserts the exact status the victim gets, that its destination memory is unchanged
(or holds only what the control case sends), that nothing of its unregistered memory moved, that
it stays within a memory bound, and that it then links to an honest prefill and pulls byte-exact.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

import pdlink
import rawwire
from backend_env import Variant
from conftest import DECODER_ID, PROMPT_ID, Pair, only
from llm_datadist import BlocksCacheKey
from pdlink import LLMException, LLMStatusCode
from peer import Peer
from peers import hostile, kv, native
from poll import hang_guard, wait_until
from verify import Copy, assert_same, check_transfer, rows

KEY = BlocksCacheKey(PROMPT_ID, 0)
SHAPE = (8, 64)
TIMEOUT_MS = 1000
VANISH_TRIES = 3  # set-ups of the pid-reuse attack before it is called impossible here
RSS_BOUND_KIB = 64 * 1024  # what one hostile exchange may add to the victim's resident memory, at most

# Handshake sabotage: the link fails, no link entity is left.
HANDSHAKE_MODES = ["garbage_ack", "ack_huge_message", "ack_unknown_status", "ack_wrong_cluster", "auth_gen_on_tcp",
                   "auth_huge_redirect"]
# Replies to a pull over TCP: the pull fails with this status and the link is poisoned.
REPLY_MODES = {
    "resp_bad_magic": LLMStatusCode.LLM_LINK_FAILED,
    "resp_unknown_status": LLMStatusCode.LLM_LINK_FAILED,
    "resp_huge_message": LLMStatusCode.LLM_LINK_FAILED,
    "resp_text_on_success": LLMStatusCode.LLM_LINK_FAILED,
    "resp_payload_on_error": LLMStatusCode.LLM_LINK_FAILED,
    "read_wrong_length": LLMStatusCode.LLM_LINK_FAILED,
    "read_huge_payload": LLMStatusCode.LLM_LINK_FAILED,
    "stall": LLMStatusCode.LLM_TIMEOUT,
}
# Replies on a same-host (AF_UNIX, proven) link that the victim reads directly.
DIRECT_MODES = {
    "describe_huge": LLMStatusCode.LLM_LINK_FAILED,
    "describe_bad_count": LLMStatusCode.LLM_LINK_FAILED,
    "direct_wrong_count": LLMStatusCode.LLM_LINK_FAILED,
    "direct_wrong_length": LLMStatusCode.LLM_LINK_FAILED,
}


@pytest.fixture
def victim(peers: Callable[..., Peer], variant: Variant) -> Peer:
    v = peers("victim", env=variant.env())
    v.call(kv.start, "decoder", DECODER_ID, timeout_ms=TIMEOUT_MS)
    v.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    return v


def start_attacker(peers: Callable[..., Peer], mode: str, redirect: bool = False, **params: object) -> tuple[Peer, int]:
    """The attacker is a fresh interpreter, not a fork like the victim: its address space is laid
    out as another program's, so the victim's addresses are not mapped in it (the same-host attacks
    that name them rely on that, as a real attacker's would)."""
    a = peers("attacker", fresh=True)
    return a, a.call(hostile.serve, mode, redirect, **params)


def asked(attacker: Peer, op: int, flags: int = 0, path: int | None = None) -> bool:
    """The attacker received a request of this kind (so its reply is what the victim refused);
    ``path``: a path connect's header names that path."""
    return any(o["event"] == "request" and o["op"] == op and o["flags"] == flags and o.get("path") == path
               for o in attacker.call(hostile.observed))


def link_attacker(victim: Peer, port: int) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
    return victim.call_within(hang_guard(3000), kv.link, PROMPT_ID, port, 3000, "127.0.0.2")


def honest_pull_works(peers: Callable[..., Peer], variant: Variant, victim: Peer) -> None:
    """After the attack the victim links to an honest prefill and pulls byte-exact."""
    honest = peers("honest", env=variant.env())
    port = honest.call(kv.start, "prompt", PROMPT_ID, listen=True)
    honest.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    assert victim.call(kv.link, PROMPT_ID, port)[0] == LLMStatusCode.LLM_SUCCESS
    check_transfer(lambda: honest.call(kv.snapshot, "kv"), lambda: victim.call(kv.snapshot, "kv"),
                   lambda: victim.call(kv.pull_blocks, KEY, "kv", [0, 3], [0, 3]), rows([(0, 0), (3, 3)]))


def failed_pull(victim: Peer) -> LLMException:
    with pytest.raises(LLMException) as e:
        victim.call_within(hang_guard(TIMEOUT_MS), kv.pull_blocks, KEY, "kv", [1, 2], [1, 2])
    return e.value


@pytest.mark.parametrize("mode", HANDSHAKE_MODES)
def test_a_sabotaged_handshake_fails_the_link_cleanly(peers: Callable[..., Peer], variant: Variant, victim: Peer,
                                                      mode: str) -> None:
    _, port = start_attacker(peers, mode)
    rss = victim.call(kv.rss_kib)
    assert link_attacker(victim, port) == (LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])
    assert victim.call(kv.links) == []
    assert victim.call(kv.rss_kib) - rss < RSS_BOUND_KIB
    honest_pull_works(peers, variant, victim)


@only("cpu-tcp")
def test_a_second_link_attempt_while_one_is_in_progress_is_processing_link(peers: Callable[..., Peer],
                                                                           variant: Variant, victim: Peer) -> None:
    """While a link attempt to a cluster is in flight (the server took the hello and went silent),
    another one to the same cluster answers LLM_PROCESSING_LINK at once; the first fails with
    LLM_LINK_FAILED at its timeout and leaves nothing behind."""
    a, port = start_attacker(peers, "silent_after_hello")
    victim.call(kv.link_in_background, PROMPT_ID, port, 3000, "127.0.0.2")
    wait_until(lambda: any(o["event"] == "hello" for o in a.call(hostile.observed)), 20, "the first attempt's hello")
    busy = (LLMStatusCode.LLM_PROCESSING_LINK, [LLMStatusCode.LLM_PROCESSING_LINK])
    assert victim.call(kv.link, PROMPT_ID, port, 3000, "127.0.0.2") == busy
    failed = (LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])
    assert victim.call_within(2 * hang_guard(3000), kv.background_link, hang_guard(3000)) == failed
    assert victim.call(kv.links) == []
    honest_pull_works(peers, variant, victim)


@only("cpu-tcp")
def test_a_server_that_cannot_prove_the_secret_learns_nothing_more(peers: Callable[..., Peer],
                                                                    variant: Variant) -> None:
    """A victim with a link secret dials a server that answers its hello with a made-up proof: the
    victim refuses right there (LLM_LINK_FAILED, "link secret differs"), before it sends its own
    proof (which the server could use to try secrets offline) or anything about its host."""
    victim = peers("victim", env=variant.env(PDLINK_LINK_SECRET="the-victims-secret"))
    victim.call(kv.start, "decoder", DECODER_ID, timeout_ms=TIMEOUT_MS)
    a, port = start_attacker(peers, "ack_random_proof")
    status, logged = victim.call(kv.link_logged, PROMPT_ID, port, 3000, "127.0.0.2")
    assert status == LLMStatusCode.LLM_LINK_FAILED
    assert any("link secret differs" in line for line in logged), logged
    events = [o["event"] for o in a.call(hostile.observed)]
    assert "hello" in events and "client_auth" not in events, events


@only("cpu-tcp")
def test_a_redirect_the_dialler_did_not_offer_to_take_fails_the_link(peers: Callable[..., Peer], variant: Variant,
                                                                     victim: Peer) -> None:
    """A dialler forced to tcp asks for no same-host redirect; one that comes anyway is a protocol
    violation."""
    _, port = start_attacker(peers, "auth_redirect_unoffered")
    assert link_attacker(victim, port) == (LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])
    assert victim.call(kv.links) == []
    honest_pull_works(peers, variant, victim)


# (The attacker is on 127.0.0.2 and redirects no one here: a victim forced to cma cannot link to it,
# and a victim's DEVICE caches move over a device channel, which it refuses; those paths have
# their own cases below.)
@only("cpu-tcp")
@pytest.mark.parametrize("mode", sorted(REPLY_MODES))
def test_a_malformed_reply_fails_that_pull_and_nothing_else(peers: Callable[..., Peer], variant: Variant,
                                                            victim: Peer, mode: str) -> None:
    attacker, port = start_attacker(peers, mode)
    assert link_attacker(victim, port)[0] == LLMStatusCode.LLM_SUCCESS
    before = victim.call(kv.snapshot, "kv")
    rss = victim.call(kv.rss_kib)
    err = failed_pull(victim)
    assert err.status_code == REPLY_MODES[mode], err
    assert asked(attacker, rawwire.OP_READ)
    assert_same(victim.call(kv.snapshot, "kv"), before, "the victim's cache after a refused reply")
    assert victim.call(kv.rss_kib) - rss < RSS_BOUND_KIB
    # the link is poisoned, nothing else: unlink, then an honest prefill serves the victim
    assert victim.call(kv.unlink, PROMPT_ID, port, True) == LLMStatusCode.LLM_SUCCESS
    honest_pull_works(peers, variant, victim)


@only("cpu-ucx")
@pytest.mark.parametrize("mode", ["ucx_size_too_small", "ucx_size_not_power", "ucx_no_size", "ucx_huge_answer"])
def test_a_malformed_ucx_connect_answer_fails_that_pull_before_ucx_sees_it(peers: Callable[..., Peer],
                                                                          variant: Variant, victim: Peer,
                                                                          mode: str) -> None:
    """The answer to the victim's ucx connect: a message size out of bounds (or none), or a length
    past the bound. The pull fails with LLM_LINK_FAILED and nothing lands; the answer's address,
    bytes that abort UCX when it parses them, never reaches UCX (the victim lives on)."""
    attacker, port = start_attacker(peers, mode)
    assert link_attacker(victim, port)[0] == LLMStatusCode.LLM_SUCCESS
    before = victim.call(kv.snapshot, "kv")
    err = failed_pull(victim)
    assert err.status_code == LLMStatusCode.LLM_LINK_FAILED, err
    assert asked(attacker, rawwire.OP_PATH_CONNECT, path=rawwire.PATH_UCX)
    assert not asked(attacker, rawwire.OP_READ, rawwire.FLAG_UCX)
    assert_same(victim.call(kv.snapshot, "kv"), before, "the victim's cache after a refused ucx answer")
    assert victim.call(kv.unlink, PROMPT_ID, port, True) == LLMStatusCode.LLM_SUCCESS
    honest_pull_works(peers, variant, victim)


@only("cpu-tcp")
def test_the_control_case_a_well_formed_reply_is_taken(peers: Callable[..., Peer], variant: Variant,
                                                       victim: Peer) -> None:
    """The same attacker answering exactly what was asked: the victim stores exactly those bytes
    (so the failures above are the checks at work, not a broken harness)."""
    _, port = start_attacker(peers, "read_exact")
    assert link_attacker(victim, port)[0] == LLMStatusCode.LLM_SUCCESS
    before = victim.call(kv.snapshot, "kv")
    victim.call(kv.pull_blocks, KEY, "kv", [1, 2], [1, 2])
    expected = before.copy()
    for t in range(2):
        for block in (1, 2):
            expected.tensor(t)[block * before.row_bytes:(block + 1) * before.row_bytes] = 0x5A
    assert_same(victim.call(kv.snapshot, "kv"), expected, "the victim's cache")


@only("ascend-fake")
@pytest.mark.parametrize("mode, code", [("staged_wrong_length", LLMStatusCode.LLM_LINK_FAILED),
                                        ("staged_huge_payload", LLMStatusCode.LLM_LINK_FAILED),
                                        ("staged_stall", LLMStatusCode.LLM_TIMEOUT),
                                        ("staged_exact", LLMStatusCode.LLM_SUCCESS)])
def test_a_lying_reply_to_a_staged_read_lands_nothing(peers: Callable[..., Peer], variant: Variant, mode: str,
                                                      code: LLMStatusCode) -> None:
    """A victim reads by address into DEVICE memory from a server that says its memory is host
    memory, so the bytes come over the stream and are staged into DEVICE memory. A reply of the
    wrong length, a huge announced payload or silence fails that read (LLM_LINK_FAILED or
    LLM_TIMEOUT), nothing of the victim's memory changes and it stays within the memory bound; the
    control case, the bytes asked for, lands exactly those. Then an honest peer serves the victim."""
    victim = peers("victim", env=variant.env())
    victim.call(native.start, DECODER_ID, timeout_ms=TIMEOUT_MS)
    victim.call(native.register, "dst", 8, 4096, seed=2)  # DEVICE memory
    attacker, port = start_attacker(peers, mode)
    assert victim.call_within(hang_guard(3000), native.connect, port, PROMPT_ID, hostile.ATTACKER_IP) == PROMPT_ID
    descs = [(0, 1000), (9000, 300)]  # (victim offset, length) read from the attacker's address 0x10000
    before, rss = victim.call(native.snapshot, "dst"), victim.call(kv.rss_kib)
    read = lambda: victim.call_within(hang_guard(TIMEOUT_MS), native.batch, PROMPT_ID,  # noqa: E731
                                      [("dst", o, n) for o, n in descs], [0x10000 + o for o, n in descs], "read")
    if code == LLMStatusCode.LLM_SUCCESS:
        read()
        expected = before.copy()
        for o, n in descs:
            expected.tensor(0)[o:o + n] = 0x5A
        assert_same(victim.call(native.snapshot, "dst"), expected, "the victim's memory after an exact reply")
        return
    with pytest.raises(LLMException) as e:
        read()
    assert e.value.status_code == code, e.value
    assert asked(attacker, rawwire.OP_READ)  # the plain read was asked, and its answer refused
    assert_same(victim.call(native.snapshot, "dst"), before, "the victim's memory after a lying reply")
    assert victim.call(kv.rss_kib) - rss < RSS_BOUND_KIB
    # the link is broken, nothing else: an honest peer then serves the victim byte-exact
    victim.call(native.disconnect, PROMPT_ID)
    honest = peers("honest", env=variant.env())
    honest_port = honest.call(native.start, PROMPT_ID, listen=True)
    src = honest.call(native.register, "src", 8, 4096, seed=1)
    assert victim.call(native.connect, honest_port, PROMPT_ID) == PROMPT_ID
    check_transfer(lambda: honest.call(native.snapshot, "src"), lambda: victim.call(native.snapshot, "dst"),
                   lambda: victim.call(native.batch, PROMPT_ID, [("dst", o, n) for o, n in descs],
                                       [src + o for o, n in descs], "read"),
                   lambda dst0, src0: dst0.with_bytes(src0, [Copy(0, o, 0, o, n) for o, n in descs]))


@only("cpu-cma")
@pytest.mark.parametrize("mode", sorted(DIRECT_MODES))
def test_a_lying_same_host_reply_is_refused(peers: Callable[..., Peer], variant: Variant, victim: Peer,
                                            mode: str) -> None:
    attacker, port = start_attacker(peers, mode, redirect=True)
    assert link_attacker(victim, port)[0] == LLMStatusCode.LLM_SUCCESS
    assert {link["transport"] for link in victim.call(kv.links)} == {"cma"}
    before = victim.call(kv.snapshot, "kv")
    rss = victim.call(kv.rss_kib)
    err = failed_pull(victim)
    assert err.status_code == DIRECT_MODES[mode], err
    assert asked(attacker, rawwire.OP_DESCRIBE) if mode.startswith("describe") else asked(
        attacker, rawwire.OP_READ, rawwire.FLAG_DIRECT)
    assert_same(victim.call(kv.snapshot, "kv"), before, "the victim's cache after a lying reply")
    assert victim.call(kv.rss_kib) - rss < RSS_BOUND_KIB
    assert victim.call(kv.unlink, PROMPT_ID, port, True) == LLMStatusCode.LLM_SUCCESS
    honest_pull_works(peers, variant, victim)


@only("cpu-cma")
@pytest.mark.parametrize("mode, op", [("describe_victim_addresses", "pull"), ("direct_victim_addresses", "pull"),
                                      ("direct_victim_addresses", "push")])
def test_addresses_of_the_victims_own_memory_are_never_applied_to_it(peers: Callable[..., Peer], variant: Variant,
                                                                     victim: Peer, mode: str, op: str) -> None:
    """The v2 attack: a same-host peer answers with addresses inside the victim's own process (an
    unregistered secret, here). The victim copies only to and from the pid the kernel reported for
    the other end, the attacker's, so its own memory is neither read nor written."""
    addr, secret = victim.call(kv.plant_secret, 8 * 64 * 2)
    attacker, port = start_attacker(peers, mode, redirect=True, addresses=[addr, addr], tensor_bytes=8 * 64 * 2,
                                    stride=64 * 2)
    assert link_attacker(victim, port)[0] == LLMStatusCode.LLM_SUCCESS
    before = victim.call(kv.snapshot, "kv")
    call = kv.pull_blocks if op == "pull" else kv.push_blocks
    with pytest.raises(LLMException) as e:  # the addresses are not mapped in the attacker
        victim.call_within(hang_guard(TIMEOUT_MS), call, KEY, "kv", [1, 2], [1, 2])
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID, e.value
    if mode == "direct_victim_addresses":  # the victim did ask, and was answered with its own addresses
        assert asked(attacker, rawwire.OP_READ if op == "pull" else rawwire.OP_WRITE, rawwire.FLAG_DIRECT)
    else:
        assert asked(attacker, rawwire.OP_DESCRIBE)
    assert victim.call(kv.secrets) == [secret]  # not written
    after = victim.call(kv.snapshot, "kv")
    assert_same(after, before, "the victim's cache")
    assert all(secret[i:i + 16] not in after.regions[r].tobytes() for r in range(2) for i in range(0, len(secret), 256))


@only("cpu-cma")
@pytest.mark.parametrize("op", ["pull", "push"])
@pytest.mark.parametrize("attacker_uid, copies", [(0, "process_vm"), (65534, "proc_mem")])
def test_a_peer_that_outlives_its_pid_never_makes_the_victim_copy_inside_itself(
        peers: Callable[..., Peer], variant: Variant, victim: Peer, op: str, attacker_uid: int, copies: str) -> None:
    """The pid-reuse attack (docs/security.md, "Same-host is proven by the kernel"): the process the
    kernel named for a same-host link forks, and exits while its child keeps both channels and
    answers the victim's direct accesses with addresses of the victim's own memory; then a thread of
    the victim gets the freed pid number. Copies by number would read the victim's secret into its
    cache, or write its cache over the secret. The victim (root) holds the process, not the number:
    by /proc/<pid>/mem for a peer of another uid, by number with the pidfd and thread checks for a
    peer as powerful as itself. The access fails with LLM_LINK_FAILED, the link breaks, neither
    memory changes."""
    if os.geteuid() != 0:
        pytest.skip("making a thread take a chosen pid number needs root (ns_last_pid)")
    addr, secret = victim.call(kv.plant_secret, 8 * 64 * 2)
    logs = Path(tempfile.mkdtemp(prefix="pdlink-vanish-"))
    try:
        logs.chmod(0o777)  # the attacker's child may be another user
        # A task of another process (pytest-xdist runs other tests beside this one) created between
        # the victim setting the last pid and its thread's start takes the number; then the attack
        # is set up again, with another P.
        held: list[str] = []
        for attempt in range(VANISH_TRIES):
            log = logs / f"requests{attempt}"
            attacker = peers("attacker")
            if attacker_uid:
                attacker.call(hostile.become, attacker_uid)
            port, pid = attacker.call(hostile.serve_vanishing, addresses=[addr, addr], log=str(log))
            assert link_attacker(victim, port)[0] == LLMStatusCode.LLM_SUCCESS
            assert [(link["transport"], link["lanes"]) for link in victim.call(kv.links)] == [("cma", [copies])]
            assert attacker.call(hostile.vanish) == 0  # P is gone and reaped; its child holds the link
            held.append(victim.call(kv.thread_with_id, pid, within_s=5.0))
            if held[-1] == "":  # the reuse happened
                break
            assert victim.call(kv.unlink, PROMPT_ID, port, True) == LLMStatusCode.LLM_SUCCESS
            attacker.close()
        assert held[-1] == "", f"no thread of the victim got P's pid in {VANISH_TRIES} tries: {held}"
        before = victim.call(kv.snapshot, "kv")
        call = kv.pull_blocks if op == "pull" else kv.push_blocks
        with pytest.raises(LLMException) as e:
            victim.call_within(hang_guard(TIMEOUT_MS), call, KEY, "kv", [1, 2], [1, 2])
        assert e.value.status_code == LLMStatusCode.LLM_LINK_FAILED, e.value
        # The child did answer with the victim's addresses: it was the copy that was refused.
        access = f"{rawwire.OP_READ if op == 'pull' else rawwire.OP_WRITE} {rawwire.FLAG_DIRECT}"
        wait_until(lambda: log.exists() and access in log.read_text().split("\n"), 10,
                   "the child to receive the direct access")
        assert victim.call(kv.secrets) == [secret]
        assert_same(victim.call(kv.snapshot, "kv"), before, "the victim's cache")
        assert [link["broken"] for link in victim.call(kv.links)] == [True]
        victim.call(kv.end_threads)
        assert victim.call(kv.unlink, PROMPT_ID, port, True) == LLMStatusCode.LLM_SUCCESS
        honest_pull_works(peers, variant, victim)
    finally:
        shutil.rmtree(logs, ignore_errors=True)


@only("ascend-fake")
@pytest.mark.parametrize("mode", ["devchan_unoffered_option", "devchan_long_answer"])
def test_a_malformed_device_channel_answer_fails_the_link(peers: Callable[..., Peer], variant: Variant,
                                                          victim: Peer, mode: str) -> None:
    attacker, port = start_attacker(peers, mode)
    assert link_attacker(victim, port) == (LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])
    assert asked(attacker, rawwire.OP_PATH_CONNECT, path=rawwire.PATH_DEVICE_CHANNEL)
    assert victim.call(kv.links) == []
    honest_pull_works(peers, variant, victim)


@only("ascend-fake")
@pytest.mark.parametrize("mode", ["ipc_wrong_span", "ipc_empty_key", "ipc_wrong_size"])
def test_a_malformed_ipc_answer_is_refused_before_any_mapping(peers: Callable[..., Peer], variant: Variant,
                                                              mode: str) -> None:
    """IPC (same-host device memory): the span the server states must be the one the victim computes
    from its own request, keys must be keys; offsets are never taken from the server."""
    v = peers("victim", env=variant.env(PDLINK_TRANSPORT="auto"))  # IPC needs the same-host link
    v.call(kv.start, "decoder", DECODER_ID, timeout_ms=TIMEOUT_MS)
    v.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    attacker, port = start_attacker(peers, mode, redirect=True)
    assert link_attacker(v, port)[0] == LLMStatusCode.LLM_SUCCESS
    before = v.call(kv.snapshot, "kv")
    err = failed_pull(v)
    assert err.status_code == LLMStatusCode.LLM_LINK_FAILED, err
    assert asked(attacker, rawwire.OP_READ, rawwire.FLAG_DEVICE | rawwire.FLAG_DIRECT)
    assert_same(v.call(kv.snapshot, "kv"), before, "the victim's device cache")


@only("cpu-cma")
def test_a_redirect_to_the_victims_own_socket_is_refused(peers: Callable[..., Peer], make_pair: Callable[..., Pair],
                                                         variant: Variant) -> None:
    """A hostile acceptor that sends the victim to the victim's own AF_UNIX socket (its name is no
    secret: /proc/net/unix lists it): the victim's own acceptor refuses, since it is not the cluster
    the victim dials; no link to itself is made, and the victim keeps serving its decoder."""
    pair = make_pair()
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    own = peers("spy").call(hostile.redirect_name, pair.port, 9)  # the prefill's own AF_UNIX name
    assert own.startswith("pdlink-")
    _, port = start_attacker(peers, "redirect_to", name=own)
    victim = pair.prefill
    assert victim.call_within(hang_guard(3000), kv.link, 9, port, 3000, "127.0.0.2") == (
        LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])
    assert victim.call(kv.links) == []
    pair.link()
    check_transfer(lambda: pair.prefill.call(kv.snapshot, "kv"), lambda: pair.decode.call(kv.snapshot, "kv"),
                   lambda: pair.decode.call(kv.pull_blocks, KEY, "kv", [4], [4]), rows([(4, 4)]))


@only("cpu-cma")
def test_a_redirect_to_a_third_engine_links_that_engine_or_nothing(peers: Callable[..., Peer],
                                                                   variant: Variant, victim: Peer) -> None:
    """A hostile acceptor that sends the victim to another engine's AF_UNIX socket: that engine
    refuses unless it is the cluster the victim dials; when it is, the victim has linked the engine
    it asked for (the kernel names it), and pulls its bytes."""
    other = peers("other", env=variant.env())
    port = other.call(kv.start, "prompt", 9, listen=True)
    other.call(kv.register_blocks, "kv", 2, SHAPE, seed=5, key=BlocksCacheKey(9, 0))
    name = peers("spy").call(hostile.redirect_name, port, 3)
    _, attacker_port = start_attacker(peers, "redirect_to", name=name)
    # dialling cluster 1 there: engine 9 refuses
    assert link_attacker(victim, attacker_port) == (LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])
    # dialling cluster 9 there: the victim is linked to engine 9 itself, over its AF_UNIX socket
    assert victim.call(kv.link, 9, attacker_port, 3000, "127.0.0.2")[0] == LLMStatusCode.LLM_SUCCESS
    assert [(link["peer_cluster_id"], link["transport"]) for link in victim.call(kv.links)] == [(9, "cma")]
    check_transfer(lambda: other.call(kv.snapshot, "kv"), lambda: victim.call(kv.snapshot, "kv"),
                   lambda: victim.call(kv.pull_blocks, BlocksCacheKey(9, 0), "kv", [2], [2]), rows([(2, 2)]))


@only("cpu-cma")
@pytest.mark.parametrize("op", ["pull", "push"])
def test_a_pin_that_lapsed_during_a_direct_copy_fails_it(peers: Callable[..., Peer], variant: Variant,
                                                         victim: Peer, op: str) -> None:
    """A checked direct access is pinned only until its pin expires; the server's pin epoch, read
    again after the copy, tells the requester. Here the server's epoch has moved on since its
    answer: the copy is refused (LLM_FAILED, retryable), not taken as good. The control: the same
    server with an unchanged epoch, whose bytes then land exactly."""
    call = kv.pull_blocks if op == "pull" else kv.push_blocks
    attacker, port = start_attacker(peers, "direct_epoch_moved", redirect=True)
    assert link_attacker(victim, port)[0] == LLMStatusCode.LLM_SUCCESS
    with pytest.raises(LLMException) as e:
        victim.call_within(hang_guard(TIMEOUT_MS), call, KEY, "kv", [1, 2], [1, 2])
    assert e.value.status_code == LLMStatusCode.LLM_FAILED and "pin expired" in str(e.value), e.value
    assert asked(attacker, rawwire.OP_READ if op == "pull" else rawwire.OP_WRITE, rawwire.FLAG_DIRECT)
    # the link is fine: a refusal of one copy
    assert victim.call(kv.links)[0]["broken"] is False

    control = peers("control")
    port2 = control.call(hostile.serve, "direct_own_memory", True)
    assert victim.call(kv.unlink, PROMPT_ID, port, True) == LLMStatusCode.LLM_SUCCESS
    assert link_attacker(victim, port2)[0] == LLMStatusCode.LLM_SUCCESS
    before = victim.call(kv.snapshot, "kv")
    victim.call(call, KEY, "kv", [1, 2], [1, 2])
    if op == "pull":  # the server's 0x5a bytes, exactly where asked
        expected = before.copy()
        for t in range(2):
            expected.tensor(t)[1 * before.row_bytes:3 * before.row_bytes] = 0x5A
        assert_same(victim.call(kv.snapshot, "kv"), expected, "the victim's cache")
    else:
        assert_same(victim.call(kv.snapshot, "kv"), before, "the pushing victim's cache")


# Answers to a notification: a payload on success, text on success, a payload on an error, none.
NOTIFY_MODES = {
    "read_wrong_length": LLMStatusCode.LLM_LINK_FAILED,  # success, with 8 payload bytes
    "resp_text_on_success": LLMStatusCode.LLM_LINK_FAILED,
    "resp_payload_on_error": LLMStatusCode.LLM_LINK_FAILED,
    "stall": LLMStatusCode.LLM_TIMEOUT,
}


@only("cpu-tcp")
@pytest.mark.parametrize("mode", sorted(NOTIFY_MODES))
def test_a_lying_answer_to_a_notification_fails_it_and_breaks_the_link(peers: Callable[..., Peer], variant: Variant,
                                                                       mode: str) -> None:
    """pdlink.Engine.notify against a server that answers it wrongly (or not at all): the exact
    status within the timeout, the link marked broken, and the engine then notifies an honest peer."""
    a, port = start_attacker(peers, mode)
    v = peers("victim", env=variant.env())
    v.call(native.start, DECODER_ID, timeout_ms=TIMEOUT_MS)
    assert v.call(native.connect, port, None, "127.0.0.2") == PROMPT_ID
    with pytest.raises(LLMException) as e:
        v.call_within(hang_guard(TIMEOUT_MS), native.notify, PROMPT_ID, b"hello")
    assert e.value.status_code == NOTIFY_MODES[mode]
    assert asked(a, rawwire.OP_NOTIFY)
    assert [link.broken for link in v.call(native.links)] == [True]
    v.call(native.disconnect, PROMPT_ID)
    honest = peers("honest", env=variant.env())
    honest_port = honest.call(native.start, PROMPT_ID, listen=True)
    v.call(native.connect, honest_port, PROMPT_ID)
    v.call(native.notify, PROMPT_ID, b"hello")
    assert honest.call(native.notifications) == [pdlink.Notification(DECODER_ID, b"", b"hello")]


# Memory tables (the answer to a raw describe: Engine.remote_memory, and a same-host read by address
# that caches the table): each breaks one rule of the decoder, which refuses it before allocating.
TABLE_MODES = ["table_huge", "table_bad_count", "table_too_many", "table_unsorted", "table_empty_range",
               "table_wrapping"]


def native_victim(peers: Callable[..., Peer], variant: Variant, attacker_port: int) -> Peer:
    """A pdlink.Engine with region "dst" (a pattern), linked to the attacker on a same-host link."""
    v = peers("victim", env=variant.env())
    v.call(native.start, DECODER_ID, timeout_ms=TIMEOUT_MS)
    v.call(native.register, "dst", 8, 256, seed=2)
    assert v.call_within(hang_guard(3000), native.connect, attacker_port, PROMPT_ID, "127.0.0.2") == PROMPT_ID
    assert {link.transport for link in v.call(native.links)} == {"cma"}
    return v


@only("cpu-cma")
@pytest.mark.parametrize("call", ["remote_memory", "read"])
@pytest.mark.parametrize("mode", TABLE_MODES)
def test_a_malformed_memory_table_fails_the_call_and_breaks_the_link(peers: Callable[..., Peer], variant: Variant,
                                                                     mode: str, call: str) -> None:
    attacker, port = start_attacker(peers, mode, redirect=True)
    victim = native_victim(peers, variant, port)
    before = victim.call(native.snapshot, "dst")
    rss = victim.call(kv.rss_kib)
    with pytest.raises(LLMException) as e:
        if call == "remote_memory":
            victim.call_within(hang_guard(TIMEOUT_MS), native.remote_memory, PROMPT_ID)
        else:  # a read by address fetches the table first, to read without a round trip
            victim.call_within(hang_guard(TIMEOUT_MS), native.batch, PROMPT_ID, [("dst", 0, 256)], [0x10000], "read")
    assert e.value.status_code == LLMStatusCode.LLM_LINK_FAILED, e.value
    assert asked(attacker, rawwire.OP_DESCRIBE, 0 if call == "remote_memory" else rawwire.FLAG_DIRECT)
    assert_same(victim.call(native.snapshot, "dst"), before, "the victim's region after a malformed table")
    assert victim.call(kv.rss_kib) - rss < RSS_BOUND_KIB
    assert [link.broken for link in victim.call(native.links)] == [True]  # a broken link takes no more calls


@only("cpu-cma")
@pytest.mark.parametrize("op", ["read", "write"])
def test_a_memory_table_listing_the_victims_memory_is_never_applied_to_it(peers: Callable[..., Peer],
                                                                         variant: Variant, op: str) -> None:
    """A same-host server's table says the victim's own (unregistered, secret) memory is its
    registered memory. The victim reads by address only from the pid the kernel reported for the
    other end, where nothing is mapped there (the cached read fails and is checked the slow way,
    which the attacker cannot answer with the victim's bytes); writes never use the table. The
    secret is neither read into the victim's region nor written, and the call fails."""
    secret_len = 4096
    attacker, port = start_attacker(peers, "table_victim_addresses", redirect=True, address=0, length=secret_len)
    victim = native_victim(peers, variant, port)
    addr, secret = victim.call(kv.plant_secret, secret_len)
    attacker.call(hostile.set_params, address=addr, length=secret_len)
    before = victim.call(native.snapshot, "dst")
    with pytest.raises(LLMException) as e:
        victim.call_within(hang_guard(TIMEOUT_MS), native.batch, PROMPT_ID, [("dst", 0, 256)], [addr], op)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID, e.value
    assert asked(attacker, rawwire.OP_READ if op == "read" else rawwire.OP_WRITE, rawwire.FLAG_DIRECT)
    if op == "read":
        assert asked(attacker, rawwire.OP_DESCRIBE, rawwire.FLAG_DIRECT)  # the table was taken, then failed
    assert victim.call(kv.secrets) == [secret]
    after = victim.call(native.snapshot, "dst")
    assert_same(after, before, "the victim's region")
    assert secret[:64] not in after.regions[0].tobytes()
