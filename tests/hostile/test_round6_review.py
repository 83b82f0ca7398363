"""The hostile review of round 6 (protocol v6: the tcp path's lanes, extra TCP streams of a tcp link,
and pipelined chunk requests), working from docs/security.md ("Limits": pdlink.TcpStreams,
pdlink.MaxTcpLanes, pdlink.TcpChunkBytes; "What an engine promises") and docs/architecture.md
("The tcp path's streams"). A raw attacker (tests/peers/round6.py) attaches lanes to links that are
not its own, from another source, past the bounds, racing for the last place, sends frames a lane
does not take, holds lanes silent or mid-frame while its link goes; a hostile server answers the
chunk reads a victim pulls on its lanes with wrong lengths, stray bytes, refusals or silence. Each
case proves the attack reached the victim and asserts what the docs promise; a hole is a strict
xfail naming it."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest

import rawwire
from backend_env import Variant
from conftest import DECODER_ID, PROMPT_ID, Pair, only
from llm_datadist import BlocksCacheKey, CacheKeyByIdAndIndex, DataType
from pdlink import LLMException, LLMStatusCode
from peer import Peer
from peers import hostile, kv, round6
from poll import hang_guard, wait_until
from review_kit import make_victim
from verify import Snapshot, assert_same, check_transfer, rows

S = LLMStatusCode
SECRET = "round6-secret"
NOBODY = 65534  # another local user


def victim_pair(make_pair: Callable[..., Pair], streams: int = 3, max_lanes: int = 64,
                extra: dict[str, str] | None = None, decode_env: dict[str, str] | None = None) -> Pair:
    """A prefill that takes lanes (pdlink.TcpStreams ``streams``, pdlink.MaxTcpLanes ``max_lanes``),
    its honest decoder linked and served."""
    return make_victim(make_pair(prefill_options={"pdlink.TcpStreams": str(streams),
                                                  "pdlink.MaxTcpLanes": str(max_lanes), **(extra or {})},
                                 decode_env=decode_env))


def link_of(victim: Pair, cluster: int) -> dict:
    (link,) = [entry for entry in victim.prefill.call(kv.links) if entry["peer_cluster_id"] == cluster]
    return link


def within(victim: Pair, fds: int, threads: int, what: str) -> None:
    wait_until(lambda: (lambda r: r[0] <= fds and r[1] <= threads)(victim.prefill.call(kv.resources)), 20,
               f"{what}: at most {fds} descriptors and {threads} threads "
               f"(now {victim.prefill.call(kv.resources)})")


# ------------------------------------------------------------------ a lane belongs to one link


@only("cpu-tcp")
def test_a_lane_attaches_only_to_its_own_live_link(peers: Callable[..., Peer], make_pair: Callable[..., Pair]) -> None:
    """architecture.md: the acceptor attaches a lane "only to the unbroken TCP link it accepted from
    that cluster with that nonce". Two raw links (9, 10) of one attacker: a lane of 9 with 10's
    nonce, of 10 with 9's, of 9 with its nonce one bit off, of the honest decoder's cluster (2) with
    a guess, and of 9 once its link is gone: each refused (LLM_LINK_FAILED), no lane anywhere."""
    victim = victim_pair(make_pair)
    a = peers("attacker")
    _, _, n9 = a.call(round6.link, victim.port, 9)
    _, _, n10 = a.call(round6.link, victim.port, 10)
    for cluster, nonce in ((9, n10), (10, n9), (9, n9 ^ 1), (DECODER_ID, n9),
                           (DECODER_ID, int.from_bytes(os.urandom(16), "little"))):
        status, message = a.call(round6.lane, victim.port, cluster, nonce)
        assert status == S.LLM_LINK_FAILED, (cluster, message)
        assert "for this lane" in message, message
    assert all(not any(lane.startswith("served") for lane in link["lanes"]) for link in victim.prefill.call(kv.links))
    a.call(round6.drop_link, 9)
    wait_until(lambda: link_of(victim, 9)["broken"], 20, "link 9 broken")
    status, message = a.call(round6.lane, victim.port, 9, n9)
    assert status == S.LLM_LINK_FAILED and "for this lane" in message, message
    # the attacker's own lane on its live link 10 is taken (the attack's control case)
    assert a.call(round6.lane, victim.port, 10, n10) == (0, "")
    assert list(link_of(victim, 10)["lanes"]) == ["served x2"]
    victim.pulled([1])


@only("cpu-tcp")
def test_a_lane_from_another_source_is_refused(peers: Callable[..., Peer], make_pair: Callable[..., Pair]) -> None:
    """A lane must come "from the same source" as its link (a remote address, or a local user:
    security.md, pdlink.MaxLinksPerSource). The nonce leaked to a process of another uid: its lane
    is refused; the same uid from another loopback address is the same source and is taken."""
    victim = victim_pair(make_pair)
    a = peers("attacker")
    _, _, nonce = a.call(round6.link, victim.port, 9)
    other = peers("other-user")
    other.call(hostile.become, NOBODY)
    status, message = other.call(round6.lane, victim.port, 9, nonce)
    assert status == S.LLM_LINK_FAILED, message
    assert "a lane must come from where its tcp link came from" in message
    assert a.call(round6.lane, victim.port, 9, nonce, b"", 0, "127.0.0.3") == (0, "")
    assert list(link_of(victim, 9)["lanes"]) == ["served x2"]
    victim.pulled([1])


# ------------------------------------------------------------------ bounds: per link, per engine, racing


@only("cpu-tcp")
@pytest.mark.parametrize("streams, max_lanes, taken", [(3, 64, 2), (6, 3, 3)], ids=["per-link", "engine"])
def test_lanes_racing_for_the_last_places_get_exactly_the_bound(peers: Callable[..., Peer],
                                                                make_pair: Callable[..., Pair], streams: int,
                                                                max_lanes: int, taken: int) -> None:
    """Eight lanes of one link, their hellos released at once: exactly min(TcpStreams - 1,
    MaxTcpLanes) are taken, the rest refused (LLM_LINK_FAILED); the victim holds one thread and one
    descriptor per lane taken and no more; once the attacker's link goes (its lanes still held open
    by the attacker) every lane is closed by the victim, the threads and descriptors are back and
    the engine's lanes are free again (a second link gets its full share)."""
    victim = victim_pair(make_pair, streams, max_lanes)
    fds0, threads0 = victim.prefill.call(kv.resources)
    a = peers("attacker")
    _, _, nonce = a.call(round6.link, victim.port, 9)
    results = a.call(round6.lane_race, victim.port, 9, nonce, 8)
    assert sorted(results) == [0] * taken + [S.LLM_LINK_FAILED] * (8 - taken), results
    assert list(link_of(victim, 9)["lanes"]) == [f"served x{taken + 1}"]
    # the link: a serving thread, two descriptors; each lane: one thread, one descriptor
    within(victim, fds0 + 2 + taken, threads0 + 1 + taken, "with the attacker's lanes")
    a.call(round6.drop_link, 9)
    assert all(a.call(round6.lane_closed_by_victim, i, 20) for i in range(taken))
    within(victim, fds0, threads0, "once the attacker's link went")
    _, _, nonce10 = a.call(round6.link, victim.port, 10)
    assert a.call(round6.lane_race, victim.port, 10, nonce10, taken) == [0] * taken
    victim.pulled([1])


@only("cpu-tcp")
@pytest.mark.parametrize("how", ["closed", "unlinked", "lane-frame"])
def test_silent_and_half_sent_lanes_go_with_their_link(peers: Callable[..., Peer], make_pair: Callable[..., Pair],
                                                       how: str) -> None:
    """security.md, pdlink.MaxTcpLanes: "a peer that opens lanes and goes silent holds them only
    until its link is unlinked or broken". Two lanes: one silent after its handshake, one holding
    half a read request. The link goes (its channels closed; an unlink frame on its channel; a ping
    on the silent lane) while the attacker keeps the lanes open: the victim closes
    them, its threads and descriptors are back, and the engine's lane places are free."""
    victim = victim_pair(make_pair, 3, 2)
    fds0, threads0 = victim.prefill.call(kv.resources)
    a = peers("attacker")
    _, _, nonce = a.call(round6.link, victim.port, 9)
    assert [a.call(round6.lane, victim.port, 9, nonce) for _ in range(2)] == [(0, "")] * 2
    read = rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=0, tensors=(0,), runs=((0, 64),)))
    a.call(round6.lane_send, 1, read[:30])  # the header and part of the body
    if how == "closed":
        a.call(round6.drop_link, 9)
    elif how == "unlinked":
        assert a.call(round6.exchange, 9, rawwire.request(rawwire.OP_UNLINK, b""))[0] == 0
    else:
        assert a.call(round6.lane_exchange, 0, rawwire.request(rawwire.OP_PING, b"")) == "closed"
    assert a.call(round6.lane_closed_by_victim, 1, 20)
    assert a.call(round6.lane_closed_by_victim, 0, 20)
    if how != "closed":
        a.call(round6.drop_link, 9)
    within(victim, fds0, threads0, "once the attacker's link went")
    _, _, nonce10 = a.call(round6.link, victim.port, 10)
    assert [a.call(round6.lane, victim.port, 10, nonce10) for _ in range(2)] == [(0, "")] * 2
    victim.pulled([1])


@only("cpu-tcp")
def test_one_source_may_hold_every_lane_of_the_engine(peers: Callable[..., Peer],
                                                      make_pair: Callable[..., Pair]) -> None:
    """pdlink.MaxTcpLanes has no per-source share (unlike links and handshakes): one attacker link
    takes all the engine's lanes (3 here), and the honest decoder's first large pull, which opens its
    link's lanes, gets none. What the docs promise holds: the pull completes byte-exact on the
    channel alone ("its link keeps fewer streams"). Lanes are tried once per link, so that link stays
    on one stream after the attacker left (found by this review: a performance lock-out, listed
    in the report, not a documented bound that is broken)."""
    victim = victim_pair(make_pair, 4, 3, decode_env={"PDLINK_TCP_CHUNK_BYTES": str(64 << 10)})
    a = peers("attacker")
    _, _, nonce = a.call(round6.link, victim.port, 9)
    assert [a.call(round6.lane, victim.port, 9, nonce) for _ in range(3)] == [(0, "")] * 3
    victim.pulled(list(range(16)))  # 256 KiB: four chunks of 64 KiB, so the decoder asks for lanes
    (dlink,) = victim.decode.call(kv.links)
    assert (list(dlink["lanes"]), list(link_of(victim, DECODER_ID)["lanes"])) == ([], [])
    a.call(round6.close_all)
    wait_until(lambda: link_of(victim, 9)["broken"], 20, "the attacker's link broken")
    victim.pulled(list(range(16)), list(range(15, -1, -1)))
    (dlink,) = victim.decode.call(kv.links)
    assert list(dlink["lanes"]) == []


@only("cpu-tcp")
def test_finalize_does_not_wait_for_silent_or_half_sent_lanes(peers: Callable[..., Peer],
                                                             make_pair: Callable[..., Pair]) -> None:
    """A victim finalizes while an attacker holds two lanes of its link open (one silent, one with
    half a request): finalize returns (no serving thread waits on a lane), and the victim closes
    both lanes."""
    victim = victim_pair(make_pair)
    a = peers("attacker")
    _, _, nonce = a.call(round6.link, victim.port, 9)
    assert [a.call(round6.lane, victim.port, 9, nonce) for _ in range(2)] == [(0, "")] * 2
    read = rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=0, tensors=(0,), runs=((0, 64),)))
    a.call(round6.lane_send, 1, read[:30])
    victim.prefill.call_within(hang_guard(5000), kv.finalize)
    assert a.call(round6.lane_closed_by_victim, 0, 20) and a.call(round6.lane_closed_by_victim, 1, 20)


def host_address() -> str | None:
    """This host's first non-loopback IPv4 address (None when it has none)."""
    import socket as _socket

    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        s.connect(("198.51.100.1", 9))  # no packet is sent: this picks the outgoing interface
        address = str(s.getsockname()[0])
    except OSError:
        return None
    finally:
        s.close()
    return None if address.startswith("127.") else address


@only("cpu-tcp")
@pytest.mark.xfail(strict=True, reason=(
    "round-6 finding: a lane is attached by cluster id, nonce and source, and the nonce is not the two "
    "ends' own: the acceptor sends it in kConfirm to whatever address it dials claiming that peer's id; "
    "another user behind the peer's address then attaches a lane to the peer's link and breaks it"))
def test_a_nonce_disclosed_by_a_confirm_does_not_give_another_user_a_lane(peers: Callable[..., Peer],
                                                                           variant: Variant) -> None:
    """architecture.md: a lane carries "the link's own nonce, which only both ends know". The honest
    decoder links to the victim over this host's non-loopback address (its source: that address,
    security.md "Known gaps"). The victim then dials an attacker's server claiming the decoder's
    cluster id and sends it the decoder's link nonce in kConfirm (the server says yes, so the victim
    keeps the decoder's link). A process of another user, from the same address, opens a lane of
    the decoder's link with that nonce: it must be refused, and the decoder's link kept."""
    address = host_address()
    if address is None:
        pytest.skip("no non-loopback address on this host")
    victim = peers("prefill", env=variant.env())
    port = victim.call(kv.start, "prompt", PROMPT_ID, listen=True, extra={"llm.listenIpInfo": f"{address}:0"})
    victim.call(kv.register_blocks, "kv", 2, (16, 4096), seed=1, key=BlocksCacheKey(PROMPT_ID, 0))
    decode = peers("decode", env=variant.env())
    decode.call(kv.start, "decoder", DECODER_ID)
    assert decode.call(kv.link, PROMPT_ID, port, 5000, address)[0] == S.LLM_SUCCESS
    a = peers("attacker")
    server = a.call(round6.serve, "exact")
    victim.call(kv.link, DECODER_ID, server, 3000, round6.ATTACKER_IP)
    (nonce,) = a.call(round6.confirmed_nonces)
    other = peers("other-user")
    other.call(hostile.become, NOBODY)
    status, message = other.call(round6.lane_at, address, port, DECODER_ID, nonce, address)
    if status == 0:  # the attack's effect: one frame a lane does not take breaks the decoder's link
        other.call(round6.lane_exchange, 0, rawwire.request(rawwire.OP_PING, b""))
        wait_until(lambda: all(link["broken"] for link in decode.call(kv.links)), 20, "the decoder's link broken")
    assert status == S.LLM_LINK_FAILED, message


# ------------------------------------------------------------------ what a lane serves


LANE_DROPS = {
    "commit": rawwire.request(rawwire.OP_COMMIT, rawwire.blocks_body()),
    "describe": rawwire.request(rawwire.OP_DESCRIBE, rawwire.blocks_body()),
    "notify": rawwire.request(rawwire.OP_NOTIFY, rawwire.notify_body(b"n", b"m")),
    "unlink": rawwire.request(rawwire.OP_UNLINK, b""),
    "confirm": rawwire.request(rawwire.OP_CONFIRM, bytes(16) + b"127.0.0.1:1"),
    "direct-read": rawwire.request(rawwire.OP_READ, rawwire.blocks_body(), flags=rawwire.FLAG_DIRECT),
    "path-connect": rawwire.path_connect(rawwire.PATH_UCX, b"\0" * 12),
    "garbage": b"\xff" * 20,
}


@only("cpu-tcp")
@pytest.mark.parametrize("frame", list(LANE_DROPS), ids=list(LANE_DROPS))
def test_a_frame_other_than_a_plain_read_or_write_on_a_lane_drops_the_link(peers: Callable[..., Peer],
                                                                          make_pair: Callable[..., Pair],
                                                                          frame: str) -> None:
    """architecture.md: a lane serves "plain reads and writes only (... any other frame ... breaks
    the link)". Before it, a plain read and a plain write on the lane are served (the lane works),
    and a read past the cache is refused (LLM_PARAM_INVALID) with the link kept."""
    victim = victim_pair(make_pair)
    secret = victim.prefill.call(kv.secrets)
    a = peers("attacker")
    _, _, nonce = a.call(round6.link, victim.port, 9)
    assert a.call(round6.lane, victim.port, 9, nonce) == (0, "")
    before = victim.prefill.call(kv.snapshot, "kv")
    served = a.call(round6.lane_exchange, 0, rawwire.request(
        rawwire.OP_READ, rawwire.blocks_body(model=0, tensors=(0,), runs=((0, 64),))))
    assert served == (0, "", bytes(before.tensor(0)[:64]))
    refused = a.call(round6.lane_exchange, 0, rawwire.request(
        rawwire.OP_READ, rawwire.blocks_body(model=0, tensors=(0,), runs=((1 << 40, 64),))))
    assert not isinstance(refused, str) and refused[0] == S.LLM_PARAM_INVALID, refused
    body = rawwire.blocks_body(model=0, tensors=(1,), runs=((8, 16),))
    assert a.call(round6.lane_exchange, 0, rawwire.request(rawwire.OP_WRITE, body, 16), b"\xa5" * 16)[0] == 0
    expected = before.copy()
    expected.tensor(1)[8:24] = 0xA5
    assert_same(victim.prefill.call(kv.snapshot, "kv"), expected, "the cache after a write on a lane")
    assert a.call(round6.lane_exchange, 0, LANE_DROPS[frame]) == "closed"
    wait_until(lambda: link_of(victim, 9)["broken"], 20, "the link whose lane broke the protocol is broken")
    assert victim.prefill.call(kv.secrets) == secret
    victim.pulled([1])


# ------------------------------------------------------------------ lanes of a secret link


@only("cpu-tcp")
def test_a_secret_links_lane_needs_the_secret_and_the_links_payload_integrity(peers: Callable[..., Peer],
                                                                             make_pair: Callable[..., Pair]) -> None:
    """With a link secret, a lane is a channel of its own with its own proofs: one that knows the
    link's nonce (leaked) but not the secret is refused (LLM_LINK_FAILED) whatever proof it sends;
    one that knows both but disagrees with its link about payload integrity (either way) is refused;
    one that agrees is taken, and an unsealed frame on it drops the link."""
    victim = victim_pair(make_pair, extra={"pdlink.LinkSecret": SECRET},
                         decode_env={"PDLINK_LINK_SECRET": SECRET})
    a = peers("attacker")
    key = SECRET.encode()
    assert a.call(round6.link, victim.port, 9, key)[0] == 0
    assert a.call(round6.link, victim.port, 10, key, rawwire.HELLO_PAYLOAD_INTEGRITY)[0] == 0
    links = {link["peer_cluster_id"]: link for link in victim.prefill.call(kv.links)}
    assert (links[9]["payload_integrity"], links[10]["payload_integrity"]) == (False, True)
    nonces = a.call(round6.nonces)
    for proof in (bytes(32), os.urandom(32)):
        status, message = a.call(round6.lane, victim.port, 9, nonces[9], b"", 0, hostile.ATTACKER_IP, proof)
        assert status == S.LLM_LINK_FAILED, message
        assert "link secret" in message, message
    status, message = a.call(round6.lane, victim.port, 9, nonces[9], key, rawwire.HELLO_PAYLOAD_INTEGRITY)
    assert status == S.LLM_LINK_FAILED and "payload integrity" in message, message
    status, message = a.call(round6.lane, victim.port, 10, nonces[10], key, 0)
    assert status == S.LLM_LINK_FAILED and "payload integrity" in message, message
    assert a.call(round6.lane, victim.port, 9, nonces[9], key) == (0, "")
    assert list(link_of(victim, 9)["lanes"]) == ["served x2"]
    unsealed = rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=0, tensors=(0,), runs=((0, 64),)))
    forged_tag = bytes(rawwire.TAG_BYTES)
    assert a.call(round6.lane_exchange, 0, unsealed, forged_tag) == "closed"
    wait_until(lambda: link_of(victim, 9)["broken"], 20, "the link whose lane sent an unsealed frame is broken")
    victim.pulled([1])


@only("cpu-tcp")
def test_a_frame_sealed_for_the_links_channel_is_not_taken_on_its_lane(peers: Callable[..., Peer],
                                                                      make_pair: Callable[..., Pair]) -> None:
    """security.md, "Authenticated sessions": each channel has its own session key, so a frame
    sealed on the link's channel and replayed on one of its lanes (an on-path attacker's injection)
    fails its check and drops the link; the same frame sealed under the lane's own key is served
    (a read out of range: refused, LLM_PARAM_INVALID, the link kept)."""
    victim = victim_pair(make_pair, extra={"pdlink.LinkSecret": SECRET}, decode_env={"PDLINK_LINK_SECRET": SECRET})
    a = peers("attacker")
    key = SECRET.encode()
    assert a.call(round6.link, victim.port, 9, key)[0] == 0
    nonce = a.call(round6.nonces)[9]
    assert [a.call(round6.lane, victim.port, 9, nonce, key) for _ in range(2)] == [(0, "")] * 2
    out_of_range = rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=0, tensors=(0,), runs=((1 << 40, 64),)))
    assert a.call(round6.sealed_lane_exchange, 0, out_of_range) == S.LLM_PARAM_INVALID
    assert not link_of(victim, 9)["broken"]
    assert a.call(round6.sealed_lane_exchange, 1, out_of_range, 9) == "closed"
    wait_until(lambda: link_of(victim, 9)["broken"], 20, "the link whose lane got a replayed frame is broken")
    victim.pulled([1])


# ------------------------------------------------------------------ a hostile server answering on lanes


CHUNK = 64 << 10
BIG = (16, CHUNK)  # 16 blocks of one chunk per tensor
PULLED = list(range(12))  # 24 chunks over the victim's 4 streams; blocks 12..15 stay as they were
TIMEOUT_MS = 2000
BIG_KEY = BlocksCacheKey(PROMPT_ID, 1)
# A cache by id and slot: a pull of it commits (the peer's request keys of it are released) once complete.
REQUEST_KEY = CacheKeyByIdAndIndex(PROMPT_ID, 1, 0)
KEYED = (1, 12 * CHUNK)  # a plain cache of one 768 KiB slot per tensor: 24 chunks

SERVER_MODES = {
    "lane_long": S.LLM_LINK_FAILED,
    "lane_short": S.LLM_LINK_FAILED,
    "lane_extra": S.LLM_LINK_FAILED,
    "lane_refuse": S.LLM_PARAM_INVALID,
    "lane_not_enabled": S.LLM_FEATURE_NOT_ENABLED,
    "lane_stall": S.LLM_TIMEOUT,
}


def requester(peers: Callable[..., Peer], variant: Variant) -> Peer:
    v = peers("victim", env=variant.env(PDLINK_TCP_STREAMS="4", PDLINK_TCP_CHUNK_BYTES=str(CHUNK)))
    v.call(kv.start, "decoder", DECODER_ID, timeout_ms=TIMEOUT_MS)
    v.call(kv.register_blocks, "big", 2, BIG, DataType.DT_UINT8, seed=2)
    v.call(kv.register, "keyed", 2, KEYED, DataType.DT_UINT8, seed=3)
    return v


def only_server_bytes_in_pulled_rows(before: Snapshot, after: Snapshot, nbytes: int) -> None:
    """Outside the first ``nbytes`` of each tensor nothing changed (guards included); inside, a byte
    is either what it was or the server's."""
    expected = before.copy()
    for t in range(len(before.tensors)):
        old, new = before.tensor(t)[:nbytes], after.tensor(t)[:nbytes]
        assert np.all((new == old) | (new == round6.FILL)), f"tensor {t}: a byte neither the old one nor the server's"
        expected.tensor(t)[:nbytes] = new
    assert_same(after, expected, "the destination outside the pulled ranges")


def commits(seen: list[dict]) -> int:
    return sum(o["event"] == "request" and o["op"] == rawwire.OP_COMMIT for o in seen)


@only("cpu-tcp")
@pytest.mark.parametrize("mode", list(SERVER_MODES))
def test_a_hostile_servers_chunk_answers_on_lanes_fail_the_pull_within_the_plan(
        peers: Callable[..., Peer], variant: Variant, mode: str) -> None:
    """security.md, "A requester trusts no server": a server that answers the chunk reads on the
    lanes with a success of the wrong length, bytes that belong to no answer, a refusal, or silence
    (the channel answering honestly) fails the pull with the status the docs give
    (architecture.md: LLM_LINK_FAILED for a stream's transport failure, LLM_TIMEOUT at the deadline,
    the server's refusal as it is); bytes land only in the pulled ranges; the pull is not
    committed; then the victim links to an honest prefill and pulls byte-exact over its lanes."""
    a = peers("attacker")
    port = a.call(round6.serve, mode)
    v = requester(peers, variant)
    assert v.call(kv.link, PROMPT_ID, port, 3000, round6.ATTACKER_IP)[0] == S.LLM_SUCCESS
    before = v.call(kv.snapshot, "keyed")
    with pytest.raises(LLMException) as e:
        v.call_within(hang_guard(TIMEOUT_MS), kv.pull_cache, REQUEST_KEY, "keyed")
    assert e.value.status_code == SERVER_MODES[mode], e.value
    seen = a.call(round6.observed)
    assert any(o["event"] == "request" and o["lane"] and o["op"] == rawwire.OP_READ for o in seen), seen
    assert commits(seen) == 0, seen
    only_server_bytes_in_pulled_rows(before, v.call(kv.snapshot, "keyed"), KEYED[1])
    honest = peers("honest", env=variant.env())
    honest_port = honest.call(kv.start, "prompt", PROMPT_ID, listen=True)
    honest_key = CacheKeyByIdAndIndex(PROMPT_ID, honest.call(kv.register, "keyed", 2, KEYED, DataType.DT_UINT8,
                                                             seed=1), 0)
    assert v.call(kv.unlink, PROMPT_ID, port, True) == S.LLM_SUCCESS
    assert v.call(kv.link, PROMPT_ID, honest_port)[0] == S.LLM_SUCCESS
    check_transfer(lambda: honest.call(kv.snapshot, "keyed"), lambda: v.call(kv.snapshot, "keyed"),
                   lambda: v.call_within(hang_guard(TIMEOUT_MS), kv.pull_cache, honest_key, "keyed"),
                   rows([(0, 0)]))
    (link,) = v.call(kv.links)
    assert list(link["lanes"]) == ["tcp x4"]


@only("cpu-tcp")
@pytest.mark.parametrize("mode", ["exact", "no_lanes", "silent_lanes", *round6.LANE_VERDICTS])
def test_a_server_that_refuses_lanes_or_answers_them_exactly_gets_a_complete_pull(
        peers: Callable[..., Peer], variant: Variant, mode: str) -> None:
    """The control case of the one above (the server's bytes land in exactly the pulled rows), a
    server that refuses every lane, one that takes the lanes' hellos and never answers (the victim
    gives the lanes half the pull's time), and one whose lane verdicts carry what no lane may (a
    same-host redirect, published words on TCP, payload integrity the link does not have): no lane
    is taken, the link keeps its channel and the pull completes on it. Once the victim unlinks, its
    threads and descriptors are back."""
    a = peers("attacker")
    port = a.call(round6.serve, mode)
    v = requester(peers, variant)
    fds0, threads0 = v.call(kv.resources)
    assert v.call(kv.link, PROMPT_ID, port, 3000, round6.ATTACKER_IP)[0] == S.LLM_SUCCESS
    before = v.call(kv.snapshot, "big")
    v.call_within(hang_guard(TIMEOUT_MS), kv.pull_blocks, BIG_KEY, "big", PULLED, PULLED)
    expected = before.copy()
    for t in range(2):
        expected.tensor(t)[:len(PULLED) * CHUNK] = round6.FILL
    assert_same(v.call(kv.snapshot, "big"), expected, "destination")
    seen = a.call(round6.observed)
    lane_hellos = sum(o["event"] == "hello" and o["channel"] == 2 for o in seen)
    on_lanes = any(o["event"] == "request" and o["lane"] for o in seen)
    (link,) = v.call(kv.links)
    expect = (3, True, ["tcp x4"]) if mode == "exact" else (3, False, [])
    assert (lane_hellos, on_lanes, list(link["lanes"])) == expect
    # a pull of a cache by id: committed once, after its last chunk
    v.call_within(hang_guard(TIMEOUT_MS), kv.pull_cache, REQUEST_KEY, "keyed")
    wait_until(lambda: commits(a.call(round6.observed)) == 1, 20, "the pull's one commit")
    assert v.call(kv.unlink, PROMPT_ID, port, True) == S.LLM_SUCCESS
    wait_until(lambda: (lambda r: r[0] <= fds0 and r[1] <= threads0)(v.call(kv.resources)), 20,
               f"the victim's descriptors and threads back to {fds0}, {threads0}")


# ------------------------------------------------------------------ a refused split write


@only("cpu-tcp")
@pytest.mark.parametrize("streams", [1, 4])  # 4: the round-6 finding, fixed (a push is never split)
def test_a_refused_split_push_stores_nothing(peers: Callable[..., Peer], variant: Variant, streams: int) -> None:
    """security.md, promise 4: "a refused write stores nothing". An honest decoder pushes 32 blocks
    into a prefill cache of 16 blocks: the peer refuses the write (LLM_PARAM_INVALID) and its cache
    must be as it was, with one stream (the whole request refused) as with four (cut into chunks,
    each admitted by the peer "exactly like a whole request")."""
    env = variant.env(PDLINK_TCP_STREAMS=str(streams), PDLINK_TCP_CHUNK_BYTES=str(CHUNK))
    p = peers("prefill", env=env)
    port = p.call(kv.start, "prompt", PROMPT_ID, listen=True, timeout_ms=TIMEOUT_MS)
    p.call(kv.register_blocks, "big", 2, BIG, DataType.DT_UINT8, seed=1, key=BIG_KEY)
    d = peers("decode", env=env)
    d.call(kv.start, "decoder", DECODER_ID, timeout_ms=TIMEOUT_MS)
    d.call(kv.register_blocks, "big", 2, (32, CHUNK), DataType.DT_UINT8, seed=2)
    assert d.call(kv.link, PROMPT_ID, port)[0] == S.LLM_SUCCESS
    blocks = list(range(32))
    before = p.call(kv.snapshot, "big")
    with pytest.raises(LLMException) as e:
        d.call_within(hang_guard(TIMEOUT_MS), kv.push_blocks, BIG_KEY, "big", blocks, blocks)
    assert e.value.status_code == S.LLM_PARAM_INVALID, e.value
    (link,) = d.call(kv.links)
    assert not link["broken"]
    assert_same(p.call(kv.snapshot, "big"), before, "the prefill's cache after a refused push")
