"""The hostile review of round 5 (protocol v5: one kPathConnect frame for every path's setup; a scope
on every error Status; per-peer LinkResults; report records bound from field tables). A raw peer
(tests/peers/hostile.py, tests/peers/round5.py) and a hostile server attack, working from
docs/security.md: path-connect frames on sealed links (tampered, unsealed, refused), before the
handshake and in place of ClientAuth, on the reverse channel, cut short and held, announced past a
path's bound with only the header sent, pipelined without reading the answers; a server's refusals
and answers carrying engine-scope codes and bytes that are not UTF-8. Each case asserts what the doc
promises; a hole is a strict xfail naming it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import rawwire
from conftest import Pair, only
from pdlink import LLMStatusCode
from peer import Peer
from peers import hostile, kv, native, round5
from review_kit import (
    DEVICE,
    PING,
    ROOT_INFO,
    UCX,
    after,
    attacker_links,
    channel_body,
    make_victim,
    pinned_by_a_direct_read,
    setup,
    ucx_body,
)
from verify import assert_same

S = LLMStatusCode
ENGINE_CODES = [S.LLM_ENGINE_FINALIZED, S.LLM_OUT_OF_MEMORY, S.LLM_DEVICE_OUT_OF_MEMORY]
NOT_UTF8 = b"refused \xff\xfe\xc3( \xed\xa0\x80 end"


@pytest.fixture
def victim(pair: Pair) -> Pair:
    return make_victim(pair)


# ------------------------------------------------------------------ scope and messages from a hostile server


@pytest.mark.parametrize("stage", ["ack", "auth"])
@pytest.mark.parametrize("code", ENGINE_CODES, ids=lambda c: c.name)
def test_a_servers_refusal_is_link_scope_whatever_code_it_names(peers: Callable[..., Peer], stage: str,
                                                                code: LLMStatusCode) -> None:
    """native_api.md, connect_each: "a refused or silent peer is LINK, and the other peers of the call
    are not affected by it". A server refusing the handshake with a code whose default scope is ENGINE
    (finalized, out of memory) must not make the victim report its own engine as the problem."""
    attacker, victim = peers("attacker"), peers("victim")
    port = attacker.call(round5.serve_words, stage, int(code), b"no")
    victim.call(native.start, 5)
    outcome = victim.call(round5.victim_connect_each, port)
    assert outcome[0] == "ok", outcome
    [(status, _message, scope)] = outcome[1]
    assert status != S.LLM_SUCCESS
    assert scope == "LINK", outcome


@pytest.mark.parametrize("code", ENGINE_CODES, ids=lambda c: c.name)
def test_a_servers_answer_to_a_read_is_not_engine_scope(peers: Callable[..., Peer], code: LLMStatusCode) -> None:
    """native_api.md, Errors: LINK covers a peer that "refused the request for its own state (its pool
    full)"; ENGINE means "this engine ... every call on it may fail alike". A server answering a read
    with an engine-scope code must not be reported as this engine's failure."""
    attacker, victim = peers("attacker"), peers("victim")
    port = attacker.call(round5.serve_words, "response", int(code), b"no")
    victim.call(native.start, 5)
    victim.call(native.register, "dst", 4, 64, None)
    peer = victim.call(native.connect, port, None, hostile.ATTACKER_IP)
    outcome = victim.call(round5.victim_read, peer, "dst", 0x10000)
    assert outcome[0] == "raised" and outcome[2] == int(code), outcome
    assert outcome[3] != "ENGINE", outcome


def reports_work(victim: Peer) -> None:
    """The victim's links(), stats() and notifications() answer (a peer's bytes in them do not break
    the management code that reads them)."""
    outcome = victim.call(round5.victim_reports)
    assert outcome[0] == "ok", outcome


@pytest.mark.parametrize("stage", ["ack", "auth", "response"])
def test_a_servers_words_that_are_not_utf8_come_back_as_a_status(peers: Callable[..., Peer], stage: str) -> None:
    """A server's refusal text (HelloAck, AuthResult) or error answer to a read carrying bytes that are
    not UTF-8: the victim's connect_each gives a LinkResult per peer and "raises for none of them"; a read
    raises the engine's error class with the server's code (security.md: "every answer is decoded by a
    bounded decoder"), not a decoding error of the binding; links() still reads."""
    attacker, victim = peers("attacker"), peers("victim")
    port = attacker.call(round5.serve_words, stage, int(S.LLM_LINK_FAILED), NOT_UTF8)
    victim.call(native.start, 5)
    if stage == "response":
        victim.call(native.register, "dst", 4, 64, None)
        peer = victim.call(native.connect, port, None, hostile.ATTACKER_IP)
        outcome = victim.call(round5.victim_read, peer, "dst", 0x10000)
        assert outcome[0] == "raised" and outcome[2] == S.LLM_LINK_FAILED, outcome
    else:
        outcome = victim.call(round5.victim_connect_each, port)
        assert outcome[0] == "ok", outcome
        assert outcome[1][0][0] == S.LLM_LINK_FAILED, outcome
        outcome = victim.call(round5.victim_connect, port)
        assert outcome[0] == "raised" and outcome[2] == S.LLM_LINK_FAILED, outcome
    reports_work(victim)


def test_notifications_whose_name_and_message_are_not_utf8(peers: Callable[..., Peer]) -> None:
    """A raw peer's notification whose name and message are not UTF-8 (both within their bounds): queued
    or refused, and the victim's notifications() and links() still answer."""
    victim, a = peers("victim"), peers("attacker")
    port = victim.call(native.start, 1, True)
    assert a.call(hostile.link_raw, port, 9) == (0, "")
    note = rawwire.request(rawwire.OP_NOTIFY, rawwire.notify_body(b"\xff\xfe\xc3(", NOT_UTF8))
    answer = a.call(hostile.exchange, note)
    assert isinstance(answer, tuple) and answer[0] in (0, S.LLM_PARAM_INVALID), answer
    assert a.call(hostile.exchange, PING) == (0, "", b"")
    reports_work(victim)


# ------------------------------------------------------------------ path-connect frames on a sealed link

SECRET = "round5-secret"


@pytest.fixture
def sealed_victim(make_pair: Callable[..., Pair]) -> Pair:
    env = {"PDLINK_LINK_SECRET": SECRET}
    return make_victim(make_pair(prefill_env=env, decode_env=env))


def sealed_attacker(peers: Callable[..., Peer], pair: Pair, cluster: int = 9) -> Peer:
    a = peers(f"sealed{cluster}")
    a.call(round5.link_sealed, pair.port, cluster, SECRET.encode())
    return a


def sealed_refused_kept(a: Peer, frame: bytes, code: int) -> str:
    answer = a.call(round5.sealed_exchange, frame)
    assert isinstance(answer, tuple) and answer[0] == code and answer[2] == 0, (answer, code)
    assert a.call(round5.sealed_exchange, PING) == (0, "", 0), "the link (or its sequence) was not kept"
    return answer[1]


@only("cpu-tcp")
def test_a_refused_path_connect_on_a_sealed_link_keeps_the_sequence(peers: Callable[..., Peer],
                                                                    sealed_victim: Pair) -> None:
    """On an authenticated link, each path's kPathConnect that this engine refuses is answered with a
    sealed LLM_FEATURE_NOT_ENABLED, the link kept, and the frames after it still check out both ways:
    a refusal that answered "before anything of them is read" would leave the body and its tag in the
    stream, and the next frame would fail its check."""
    secret = sealed_victim.prefill.call(kv.secrets)
    a = sealed_attacker(peers, sealed_victim)
    assert a.call(round5.sealed_exchange, PING) == (0, "", 0)
    for frame in (setup(DEVICE, channel_body(ROOT_INFO + 1)), setup(UCX, ucx_body(76)),
                  setup(UCX, ucx_body(12 + 4096)), setup(DEVICE, b""), setup(DEVICE, channel_body(8192))):
        sealed_refused_kept(a, frame, S.LLM_FEATURE_NOT_ENABLED)
    a.call(round5.close_sealed)
    after(sealed_victim, secret)


SEALED_DROPS = {
    # a refused path's frame with a broken tag: checked before it is acted on, so dropped, not refused
    "tampered_ucx": (setup(UCX, ucx_body(76)), True, True),
    "tampered_device": (setup(DEVICE, channel_body(ROOT_INFO + 1)), True, True),
    # the same frames without any tag: the next 16 bytes the victim reads are not a tag of them
    "unsealed_ucx": (setup(UCX, ucx_body(76)), False, False),
    # a frame naming no path, sealed correctly: dropped as an unknown path
    "sealed_no_path": (setup(0, ucx_body(76)), True, False),
    # v4's device-channel op, sealed correctly: an unknown op
    "sealed_v4_op": (rawwire.request(rawwire.OLD_OP_DEVICE_CHANNEL, channel_body(ROOT_INFO + 1)), True, False),
}


@only("cpu-tcp")
@pytest.mark.parametrize("case", sorted(SEALED_DROPS))
def test_a_path_connect_that_fails_its_tag_or_names_no_path_drops_a_sealed_link(
        peers: Callable[..., Peer], sealed_victim: Pair, case: str) -> None:
    """security.md, Authenticated sessions: "The receiver checks a frame's tag before it acts on any of
    it; a failure ... drops the link". A refused path answers nothing to a frame whose tag is broken
    (it would otherwise answer an injected frame); an unknown path or op drops the link too. The victim
    serves its honest decoder afterwards, its secret unchanged."""
    secret = sealed_victim.prefill.call(kv.secrets)
    a = sealed_attacker(peers, sealed_victim)
    frame, seal, tamper = SEALED_DROPS[case]
    if not seal:
        frame = frame + PING  # what follows the frame (a ping, unsealed) is read where its tag belongs
    assert a.call(round5.sealed_exchange, frame, tamper, seal) == "closed"
    a.call(round5.close_sealed)
    after(sealed_victim, secret)


# ------------------------------------------------------------------ bounds checked on the headers alone


@only("cpu-tcp", "cpu-cma")
@pytest.mark.parametrize("case", ["ucx_4109", "ucx_8192", "device_8193"])
def test_a_setup_body_announced_past_its_paths_bound_drops_the_link_before_it_is_sent(
        peers: Callable[..., Peer], victim: Pair, case: str) -> None:
    """security.md, Path setup frames: "a setup body past the named path's own bound ... the link is
    dropped after the path's header", "with nothing of the setup body read before the last check
    passed". Only the request header and the path's header are sent, the announced body never is: the
    victim must close the link at once, not wait for a body it will refuse (a wait would show as
    "silent" for 5 s)."""
    secret = victim.prefill.call(kv.secrets)
    a = attacker_links(peers, victim)
    path, announced = {"ucx_4109": (UCX, 4109), "ucx_8192": (UCX, 8192), "device_8193": (DEVICE, 8193)}[case]
    frame = setup(path, b"", body_len=1 + announced)
    assert a.call(round5.send_and_watch, frame, 5.0) == "closed"
    a.call(hostile.close)
    after(victim, secret)


@only("cpu-tcp", "cpu-cma")
@pytest.mark.parametrize("path", [DEVICE, UCX], ids=["device_channel", "ucx"])
def test_a_setup_body_cut_short_and_held_does_not_hold_the_engine(peers: Callable[..., Peer], victim: Pair,
                                                                  path: int) -> None:
    """A kPathConnect within its path's bound whose body stops half way and is held (bodies are "read as
    their bytes arrive"): only that link's serving thread waits; the victim serves its honest decoder,
    answers the attacker's second link, and finalizes without waiting for the held body."""
    secret = victim.prefill.call(kv.secrets)
    a = attacker_links(peers, victim)
    body = channel_body(ROOT_INFO + 1) if path == DEVICE else ucx_body(76)
    frame = setup(path, body)
    assert a.call(round5.send_and_watch, frame[:rawwire.REQUEST_HEADER_BYTES + 1 + 10], 1.0) == "silent"
    after(victim, secret)
    b = attacker_links(peers, victim, 10)
    assert b.call(hostile.exchange, PING) == (0, "", b"")
    victim.prefill.call_within(30, kv.finalize)


# ------------------------------------------------------------------ answers never read


@only("cpu-tcp", "cpu-cma")
def test_path_connects_pipelined_without_reading_their_answers(peers: Callable[..., Peer], victim: Pair) -> None:
    """200,000 refused kPathConnect frames in one stream, no answer ever read: the victim answers until
    its writes block (its own link's thread), keeps no queue of answers (its memory grows by less than
    64 MiB), serves its honest decoder meanwhile, and finalizes without waiting for the stuck link."""
    secret = victim.prefill.call(kv.secrets)
    rss = victim.prefill.call(round5.rss_kib)
    a = attacker_links(peers, victim)
    frame = setup(DEVICE, b"")
    a.call(round5.pipeline_unread, frame, 200_000)
    from poll import wait_until

    sent: list[int] = []

    def stuck() -> bool:
        sent.append(a.call(round5.pipeline_sent))
        return len(sent) > 20 and sent[-1] == sent[-20]

    wait_until(stuck, 60, "the attacker's writes blocked (or all sent)")
    after(victim, secret)
    assert victim.prefill.call(round5.rss_kib) - rss < 64 * 1024
    victim.prefill.call_within(30, kv.finalize)


# ------------------------------------------------------------------ frames where they do not belong


@only("cpu-tcp", "cpu-cma")
def test_a_path_connect_on_the_reverse_channel_is_never_served(peers: Callable[..., Peer], victim: Pair) -> None:
    """A kPathConnect (and one naming no path) sent on the link's reverse channel, where the victim is
    the requester: nothing is answered or set up; the victim serves its honest decoder."""
    secret = victim.prefill.call(kv.secrets)
    a = attacker_links(peers, victim)
    out = a.call(round5.send_on_reverse, setup(DEVICE, channel_body(ROOT_INFO + 1)) + setup(0x80, b"x"))
    assert out in ("silent", "closed"), out
    after(victim, secret)


@only("cpu-tcp")
@pytest.mark.parametrize("where", ["hello", "client_auth"])
def test_a_path_connect_in_place_of_the_handshake(peers: Callable[..., Peer], victim: Pair, where: str) -> None:
    """A kPathConnect sent as the first bytes (where the Hello belongs: its magic is not "PDLK") or in
    place of ClientAuth: the connection is dropped or its half-made channel never serves it; no link
    is installed and the victim serves its honest decoder."""
    secret = victim.prefill.call(kv.secrets)
    a = peers("attacker")
    frame = setup(DEVICE, channel_body(ROOT_INFO + 1))
    if where == "hello":
        assert a.call(round5.instead_of_hello, victim.port, frame) == "closed"
    else:
        out = a.call(round5.instead_of_client_auth, victim.port, frame)
        assert out in ("closed", "auth 0") or out.startswith("auth "), out
    assert [link["peer_cluster_id"] for link in victim.prefill.call(kv.links) if not link["broken"]] == [2]
    after(victim, secret)


# ------------------------------------------------------------------ a server's message at and past its bound

MAX_MESSAGE = 65_536  # security.md, Limits: max_message_bytes, "error text in responses, acks and auth results"


@pytest.mark.parametrize("stage", ["ack", "auth", "response"])
@pytest.mark.parametrize("extra", [0, 1], ids=["at_the_bound", "past_the_bound"])
def test_a_servers_message_at_and_past_max_message_bytes(peers: Callable[..., Peer], stage: str, extra: int) -> None:
    """A refusal (HelloAck, AuthResult) or an error answer whose message is exactly max_message_bytes,
    or one byte more: a failure of that peer (LINK scope, its code or LLM_LINK_FAILED), never an
    exception of another kind, and the victim's reports still read."""
    attacker, victim = peers("attacker"), peers("victim")
    port = attacker.call(round5.serve_words, stage, int(S.LLM_LINK_FAILED), b"\xa5" * (MAX_MESSAGE + extra))
    victim.call(native.start, 5)
    if stage == "response":
        victim.call(native.register, "dst", 4, 64, None)
        peer = victim.call(native.connect, port, None, hostile.ATTACKER_IP)
        outcome = victim.call(round5.victim_read, peer, "dst", 0x10000)
        assert outcome[0] == "raised" and outcome[2] == S.LLM_LINK_FAILED and outcome[3] == "LINK", outcome
    else:
        outcome = victim.call(round5.victim_connect_each, port)
        assert outcome[0] == "ok", outcome
        [(status, _message, scope)] = outcome[1]
        assert status == S.LLM_LINK_FAILED and scope == "LINK", outcome
    reports_work(victim)


@only("ascend-fake")
@pytest.mark.parametrize("code", ENGINE_CODES, ids=lambda c: c.name)
def test_a_servers_answer_to_the_device_channel_setup_is_link_scope(peers: Callable[..., Peer], variant,
                                                                    code: LLMStatusCode) -> None:
    """A device-backend victim dials a server that refuses its device channel's kPathConnect with an
    engine-scope code: connect_each gives that peer a LINK-scope result (the peer's setup failed, not
    this engine), and the victim's reports still read."""
    attacker, victim = peers("attacker"), peers("victim", env=variant.env())
    port = attacker.call(round5.serve_words, "response", int(code), b"no device channel for you")
    victim.call(native.start, 5)
    outcome = victim.call(round5.victim_connect_each, port)
    assert outcome[0] == "ok", outcome
    [(status, message, scope)] = outcome[1]
    assert scope != "ENGINE", outcome
    reports_work(victim)


# ------------------------------------------------------------------ device channels set up for real by a raw peer


def live_comms(p: Peer) -> int:
    from peers import fake_ascend

    c = p.call(fake_ascend.call_counts, "HcclCommInitRootInfo", "HcclCommDestroy")
    return c["HcclCommInitRootInfo"] - c["HcclCommDestroy"]


@only("ascend-fake")
def test_device_channels_set_up_again_and_again_on_one_link_replace_each_other(
        peers: Callable[..., Peer], victim: Pair, variant) -> None:
    """A raw peer that holds the vendor library (here the fake HCCL) makes real root infos and joins
    each as rank 0, four times on one link, alternating the one-sided option: each kPathConnect is
    answered (one options byte, one-sided not agreed where the engine does not offer it), the link
    kept, and the victim holds one communicator for that link at a time (inits minus destroys: the
    decoder's and the latest one), none once the link is closed; its descriptors and threads settle."""
    secret = victim.prefill.call(kv.secrets)
    base = victim.prefill.call(kv.resources)
    comms = live_comms(victim.prefill)
    a = peers("attacker", env=variant.env())
    assert a.call(hostile.link_raw, victim.port, 9, b"", None) == (0, "")
    for i in range(4):
        root = a.call(round5.root_info)
        a.call(round5.join_root, root)
        assert a.call(hostile.exchange, setup(DEVICE, root + bytes([i % 2]))) == (0, "", b"\x00")
        assert a.call(hostile.exchange, PING) == (0, "", b"")
        assert live_comms(victim.prefill) == comms + 1
    assert a.call(round5.joins, 10.0) == [0, 0, 0, 0]
    a.call(hostile.close)
    from poll import wait_until

    wait_until(lambda: live_comms(victim.prefill) == comms, 20, "the attacker's communicator destroyed")
    wait_until(lambda: victim.prefill.call(kv.resources)[1] <= base[1], 20, "the victim's threads settled")
    after(victim, secret)


@pytest.fixture
def quick_join_victim(make_pair: Callable[..., Pair]) -> Pair:
    """The victim, its vendor join bounded at 2 s (HCCL_CONNECT_TIMEOUT, read by the fake HCCL)."""
    return make_victim(make_pair(prefill_env={"HCCL_CONNECT_TIMEOUT": "2"}))


@only("ascend-fake")
def test_a_device_channel_the_peer_never_joins_ends_with_the_join_timeout(
        peers: Callable[..., Peer], quick_join_victim: Pair, variant) -> None:
    """A real root info whose creator never joins: the kPathConnect is answered, the link's serving
    thread then waits in the vendor's join (nothing else of that link is served meanwhile), the victim
    serves its honest decoder during it, and the link is dropped once the join times out (its
    descriptors and threads released, the attacker's later frames never served)."""
    victim = quick_join_victim
    secret = victim.prefill.call(kv.secrets)
    fds, threads = victim.prefill.call(kv.resources)
    a = peers("attacker", env=variant.env())
    assert a.call(hostile.link_raw, victim.port, 9, b"", None) == (0, "")
    out = a.call(round5.send_and_watch, setup(DEVICE, a.call(round5.root_info) + b"\x00"), 5.0)
    assert out.startswith("answered b'PDLS\\x00\\x00\\x00\\x00"), out
    assert a.call(round5.send_and_watch, setup(DEVICE, a.call(round5.root_info) + b"\x00"), 1.0) == "silent"
    victim.pulled([2])
    from poll import wait_until

    def dropped() -> bool:
        return all(link["broken"] for link in victim.prefill.call(kv.links) if link["peer_cluster_id"] == 9)

    wait_until(dropped, 200, "the attacker's link dropped at the join timeout")
    # the broken link keeps its two sockets (shut down) until it is unlinked: test_hostile_peers.py
    wait_until(lambda: (lambda r: r[0] <= fds + 2 and r[1] <= threads)(victim.prefill.call(kv.resources)), 20,
               "the victim's descriptors and threads settled")
    after(victim, secret)


# ------------------------------------------------------------------ one-way links (hixl)


def test_path_connects_to_a_hixl_server_over_a_one_way_link(peers: Callable[..., Peer]) -> None:
    """hixl's links are one-way (an accepted link never carries the server's own transfers). A raw
    peer linked to a hixl server sends each path's kPathConnect (refused LLM_FEATURE_NOT_ENABLED on a
    CPU engine, the link kept), then one naming no path (the link dropped); the server still serves
    an honest hixl client's read byte-exact, and its memory is unchanged."""
    from peers import hixl_peer

    server, client, a = peers("server"), peers("client"), peers("attacker")
    ident = server.call(hixl_peer.start)
    src = server.call(hixl_peer.alloc, "src", 4096, seed=3)
    assert server.call(hixl_peer.register, "src")[0] == 0
    before = server.call(hixl_peer.snapshot, "src")
    port = int(ident.rsplit(":", 1)[1])
    assert a.call(hostile.link_raw, port, 9) == (0, "")
    for frame in (setup(DEVICE, channel_body(ROOT_INFO + 1)), setup(UCX, ucx_body(76)), setup(DEVICE, b"")):
        answer = a.call(hostile.exchange, frame)
        assert isinstance(answer, tuple) and answer[0] == S.LLM_FEATURE_NOT_ENABLED, answer
        assert a.call(hostile.exchange, PING) == (0, "", b"")
    assert a.call(hostile.exchange, setup(1, b"")) == "closed"
    client.call(hixl_peer.start, None, False)
    dst = client.call(hixl_peer.alloc, "dst", 4096)
    assert client.call(hixl_peer.register, "dst")[0] == 0
    assert client.call(hixl_peer.connect, ident) == 0
    assert client.call(hixl_peer.transfer_sync, ident, "READ", [(dst, src, 4096)]) == 0
    assert bytes(client.call(hixl_peer.snapshot, "dst").tensor(0)) == bytes(before.tensor(0))
    assert_same(server.call(hixl_peer.snapshot, "src"), before, "the hixl server's memory")


# ------------------------------------------------------------------ many links, each with setup frames


def test_many_links_each_sending_setup_frames_leave_nothing_behind(peers: Callable[..., Peer]) -> None:
    """40 raw links one after another, each sending a refused kPathConnect (kept) or one naming no path
    (dropped), with the victim's MaxLinks at 8: every link is served or dropped alike (none refused for
    the earlier ones), the victim's live links, threads and tombstones stay within MaxLinks (security.md:
    "as many tombstones of dead links are kept, the oldest forgotten past that"), and it still links."""
    victim, a = peers("victim"), peers("attacker")
    port = victim.call(native.start, 1, True, limits={"max_links": 8})
    kept = a.call(hostile.flood_frames, port, 20, setup(DEVICE, channel_body(ROOT_INFO + 1)))
    dropped = a.call(hostile.flood_frames, port, 20, setup(0x80, b""))
    assert kept == [str(int(S.LLM_FEATURE_NOT_ENABLED))] * 20, kept
    assert dropped == ["closed"] * 20, dropped
    from poll import wait_until

    seen: list[dict[str, int]] = []

    def settled() -> bool:
        seen.append(victim.call(native.stats))
        return seen[-1]["live_links"] == 0

    wait_until(settled, 20, "the attacker's links gone")
    assert seen[-1]["tombstones"] <= 8, seen[-1]
    honest = peers("honest")
    honest.call(native.start, 2)
    assert honest.call(native.connect, port) == 1


# ------------------------------------------------------------------ each announced-length bound, exactly

LIMITS = {"max_body_bytes": 4_456_512, "notify": 4 + 4096 + 65_536, "device_channel": 1 + 8192, "ucx": 1 + 4108}


def announced(case: str, blen: int) -> bytes:
    """A frame of ``case`` announcing a body of ``blen`` bytes of which only what names it is sent."""
    if case == "max_body_bytes":
        return rawwire.request_header(rawwire.OP_READ, blen)
    if case == "notify":
        return rawwire.request_header(rawwire.OP_NOTIFY, blen)
    return setup(DEVICE if case == "device_channel" else UCX, b"", body_len=blen)


@only("cpu-tcp")
@pytest.mark.parametrize("case", sorted(LIMITS))
@pytest.mark.parametrize("extra", [0, 1], ids=["at_the_bound", "past_the_bound"])
def test_each_announced_length_bound_is_where_the_doc_puts_it(peers: Callable[..., Peer], victim: Pair, case: str,
                                                              extra: int) -> None:
    """security.md, Limits / architecture.md, Request header: a request body (4,456,512), a notify body
    (≤ 69,636), a path connect (1 + the path's bound: 8 KiB for a device channel, 4,108 for ucx). A frame
    announcing exactly the bound, with its body not sent, is waited for (the victim reads as bytes
    arrive); one byte more drops the link on the headers alone, before any body byte arrives."""
    secret = victim.prefill.call(kv.secrets)
    a = attacker_links(peers, victim)
    out = a.call(round5.send_and_watch, announced(case, LIMITS[case] + extra), 3.0 if extra else 1.0)
    assert out == ("closed" if extra else "silent"), out
    a.call(hostile.close)
    after(victim, secret)


UCX_FRAMES = {
    "ucx_read": (rawwire.request(rawwire.OP_READ, rawwire.blocks_body(runs=((0, 64),)), flags=rawwire.FLAG_UCX),
                 rawwire.REQUEST_HEADER_BYTES),
    "ucx_write": (rawwire.request(rawwire.OP_WRITE, rawwire.blocks_body(runs=((0, 64),)), flags=rawwire.FLAG_UCX),
                 rawwire.REQUEST_HEADER_BYTES),
    "ucx_connect": (setup(UCX, ucx_body(76)), rawwire.REQUEST_HEADER_BYTES + 1),
}


@only("cpu-tcp")
@pytest.mark.parametrize("frame", sorted(UCX_FRAMES))
def test_ucx_frames_on_a_link_without_ucx_with_their_bodies_held_back(peers: Callable[..., Peer], victim: Pair,
                                                                       frame: str) -> None:
    """Only the headers of a ucx frame are sent (the path's header too for the connect), then, a second
    later, its body: nothing is answered while the body is held back (bounded, read as it arrives: the
    link's own thread waits), and once it arrives the frame is refused LLM_FEATURE_NOT_ENABLED, the link
    kept, nothing written."""
    secret = victim.prefill.call(kv.secrets)
    before = victim.prefill.call(kv.snapshot, "kv")
    a = attacker_links(peers, victim)
    full, head = UCX_FRAMES[frame]
    assert a.call(round5.send_and_watch, full[:head], 1.0) == "silent"
    answer = a.call(hostile.exchange, full[head:])
    assert isinstance(answer, tuple) and answer[0] == S.LLM_FEATURE_NOT_ENABLED and answer[2] == b"", answer
    assert a.call(hostile.exchange, PING) == (0, "", b"")
    a.call(hostile.close)
    assert_same(victim.prefill.call(kv.snapshot, "kv"), before, "the victim's cache")
    after(victim, secret)


# ------------------------------------------------------------------ what the doc says about bounds and records


def test_the_documented_per_request_limits_are_the_engines() -> None:
    """security.md, Limits: each named per-request bound of the table, as pdlink.LIMITS exposes it
    ("exposed once as pdlink.LIMITS"). The path-connect row has no name there and is not exposed."""
    import pdlink

    documented = {"max_request_tensors": 65_536, "max_request_pieces": 262_144, "max_raw_span": 64,
                  "max_request_span_steps": 1_048_576, "max_body_bytes": 4_456_512, "max_message_bytes": 65_536,
                  "read_chunk_bytes": 65_536, "max_notify_name_bytes": 4_096, "max_notify_message_bytes": 65_536}
    assert {k: pdlink.LIMITS[k] for k in documented} == documented


def test_report_records_of_a_raw_peers_link_are_what_the_doc_says(peers: Callable[..., Peer]) -> None:
    """native_api.md, Peers: LinkInfo objects are "typed, read-only attributes, compared by value,
    hashable, picklable", with the fields it lists; stats() is the EngineStats record with the fields it
    lists (and docs/metrics.md's).
    Checked on the record of a raw peer's link after it sent a refused and an unknown kPathConnect."""
    victim, a = peers("victim"), peers("attacker")
    port = victim.call(native.start, 1, True)
    assert a.call(hostile.link_raw, port, 9) == (0, "")
    assert a.call(hostile.exchange, setup(DEVICE, b""))[0] == S.LLM_FEATURE_NOT_ENABLED
    assert a.call(hostile.exchange, setup(0x80, b"")) == "closed"
    seen = victim.call(round5.report_records)
    assert seen["stats"] == sorted(["live_links", "tombstones", "handshakes", "threads", "handshakes_refused",
                                    "handshakes_evicted", "listener_backoffs", "pins_expired", "notifications",
                                    "notifications_refused", "offers_live", "offers_released", "offers_expired",
                                    "offers_aborted", "offer_bytes", "handoff_events_dropped", "pinned_bytes",
                                    "role_epoch", "taken_at", "transfers", "failures", "link_events",
                                    "links_by_path"]), seen
    [link] = seen["links"]
    assert {"peer_cluster_id", "peer_address", "transport", "device_paths", "lanes", "authenticated",
            "broken", "broken_reason", "confirmed"} <= set(link["fields"]), link
    assert link["pickles_equal"] and link["hash_equal"] and not link["writable"] and link["cluster"] == 9, link


# ------------------------------------------------------------------ a raw peer's answers to the victim's own requests


def raw_peer_answering(peers: Callable[..., Peer], answer: str) -> Peer:
    """A victim (cluster 1, 1 s timeouts, a region "dst") linked by a raw peer (cluster 9) that answers
    the victim's requests on its reverse channel as ``answer`` says."""
    victim, a = peers("victim"), peers("attacker")
    port = victim.call(native.start, 1, True, 1000)
    victim.call(native.register, "dst", 4, 64, None)
    assert a.call(hostile.link_raw, port, 9) == (0, "")
    if answer == "not_utf8":
        a.call(round5.answer_on_reverse_with, int(S.LLM_LINK_FAILED), NOT_UTF8)
    elif answer != "silent":
        a.call(round5.answer_on_reverse_with, int(S.__members__[answer]), b"no")
    return victim


ANSWERS = ["silent", "not_utf8", *[c.name for c in ENGINE_CODES]]


@pytest.mark.parametrize("answer", ANSWERS)
def test_a_raw_peers_answers_on_the_reverse_channel_are_link_scope(peers: Callable[..., Peer], answer: str) -> None:
    """The victim's own requests to a raw peer that linked in (a notification, a memory-table describe,
    a read, a write, then its unlink), answered with an engine-scope code, with words that are not UTF-8,
    or not at all: each fails as that peer's failure (LINK scope; the engine's error class, never an
    exception of another kind), the unlink is not held hostage (the link is gone either way:
    security.md, Identities), and the victim's reports still read."""
    victim = raw_peer_answering(peers, answer)
    for call, outcome in victim.call(round5.victim_calls, 9, "dst").items():
        if call == "ping":
            continue  # test_a_raw_peers_answer_to_a_ping_is_link_scope
        assert outcome[0] == "raised" and outcome[3] == "LINK", (call, outcome)
    outcome = victim.call(round5.victim_disconnect_each, 9)
    assert outcome[0] == "ok", outcome
    [(status, _message, scope)] = outcome[1]
    assert status == S.LLM_SUCCESS or scope == "LINK", outcome
    assert all(link.broken or link.peer_cluster_id != 9 for link in victim.call(native.links))
    reports_work(victim)


@pytest.mark.parametrize("answer", ["silent", "not_utf8"])
def test_a_raw_peers_silent_or_garbled_answer_to_a_ping_is_link_scope(peers: Callable[..., Peer],
                                                                     answer: str) -> None:
    victim = raw_peer_answering(peers, answer)
    outcome = victim.call(round5.victim_ping, 9)
    assert outcome[0] == "raised" and outcome[3] == "LINK", outcome


@pytest.mark.parametrize("code", ENGINE_CODES, ids=lambda c: c.name)
def test_a_raw_peers_answer_to_a_ping_is_link_scope(peers: Callable[..., Peer], code: LLMStatusCode) -> None:
    """An engine answers every ping with success: a peer that answers the victim's ping with an engine
    code (which would read as this engine finalized or out of memory) is out of protocol: the victim's
    ping raises LLM_LINK_FAILED, scope LINK, naming the code it got, and the link is broken."""
    victim = raw_peer_answering(peers, code.name)
    outcome = victim.call(round5.victim_ping, 9)
    assert outcome[0] == "raised" and outcome[2] == int(S.LLM_LINK_FAILED), outcome
    assert outcome[3] == "LINK", outcome
    assert f"answered {code.name}" in outcome[4], outcome
    assert all(link.broken for link in victim.call(native.links) if link.peer_cluster_id == 9)


@pytest.mark.parametrize("code", [S.LLM_NOT_YET_LINK, S.LLM_ENGINE_FINALIZED], ids=lambda c: c.name)
def test_a_confirm_answered_no_or_with_an_engine_code_keeps_only_the_dialled_link(peers: Callable[..., Peer],
                                                                                   code: LLMStatusCode) -> None:
    """security.md, Identities: a raw peer links in as cluster 1, then the victim (llm_datadist) links to
    a server claiming cluster 1, which answers the victim's kConfirm "no" (LLM_NOT_YET_LINK) or with an
    engine-scope code: the accepted link is dropped as an impostor's, the dialled link kept, and
    link_clusters succeeds (an error answer is no "yes")."""
    attacker, victim = peers("attacker"), peers("victim")
    server_port = attacker.call(round5.serve_words, "response", int(code), b"no")
    victim_port = victim.call(kv.start, "prompt", 5, listen=True)
    assert attacker.call(hostile.link_raw, victim_port, 1) == (0, "")
    assert victim.call(kv.link, 1, server_port, 3000, hostile.ATTACKER_IP) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert [(link["peer_cluster_id"], link["initiator"]) for link in victim.call(kv.links)
            if not link["broken"]] == [(1, True)]


def test_a_prompts_answer_to_check_link_status_cannot_name_the_decoders_engine_finalized(
        peers: Callable[..., Peer]) -> None:
    from peers import v1

    attacker, victim = peers("attacker"), peers("victim")
    port = attacker.call(round5.serve_words, "ping", int(S.LLM_ENGINE_FINALIZED), b"your engine is finalized",
                         "127.0.0.1")
    victim.call(v1.start, "decoder", 2)
    assert victim.call(v1.link, 1, [port]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    with pytest.raises(Exception) as err:
        victim.call(v1.check_link_status, 1)
    assert getattr(err.value, "status_code", None) in (S.LLM_LINK_FAILED, S.LLM_TIMEOUT), err.value


# ------------------------------------------------------------------ pins held across a half-sent setup frame


def pin_then_half_frame(peers: Callable[..., Peer], variant, how: str, timeout_ms: int | None = None) -> Peer:
    """A prompt (PinTimeoutMs 500, a 768 KiB cache in a 1 MiB pool) that a same-host raw peer read
    directly (the pieces pinned "until the next frame"); the peer then starts a kPathConnect and holds it
    half sent ("held") or trickles its 8 KiB body a byte every 100 ms ("trickled"); the owner deallocates
    the cache, so only the peer's pin keeps the memory. Returns the prompt."""
    from llm_datadist import CacheKey

    p, a = pinned_by_a_direct_read(peers, variant, timeout_ms=timeout_ms)
    frame = setup(DEVICE, channel_body(8192))
    if how == "held":
        a.call(hostile.send, frame[:30])
    else:
        a.call(round5.trickle, frame, 0.1)
    p.call(kv.deallocate, "big")
    p.call(kv.remove_cache_key, CacheKey(1, 7))  # no reference is left but the attacker's pin
    return p


def memory_freed(p: Peer, what: str) -> None:
    from llm_datadist import DataType
    from poll import hang_guard, wait_until

    def freed() -> bool:
        try:
            p.call(kv.allocate, "again", 1, (1, 768 * 1024), DataType.DT_INT8)
            return True
        except Exception:  # noqa: BLE001 (LLM_OUT_OF_MEMORY while the pin holds the memory)
            return False

    wait_until(freed, hang_guard(500), what)


@only("cpu-cma")
def test_a_half_sent_path_connect_after_a_direct_read_frees_the_memory_in_the_end(peers: Callable[..., Peer],
                                                                                  variant) -> None:
    """With the default frame deadline (max(2 x sync_kv_timeout, 5 s)), a peer that holds a setup frame
    half sent after a direct read holds no pin (it ended with the frame's first byte): the deallocated
    memory returns to the pool."""
    p = pin_then_half_frame(peers, variant, "held")
    memory_freed(p, "the memory freed once the half-sent frame's deadline passed")


@only("cpu-cma")
@pytest.mark.parametrize("how", ["held", "trickled"])
def test_a_half_sent_path_connect_does_not_keep_a_pin_past_pin_timeout(peers: Callable[..., Peer], variant,
                                                                       how: str) -> None:
    """security.md, Limits: PinTimeoutMs bounds a pin while the peer sends nothing, and a pin lasts until
    the next frame. A same-host peer that reads directly, then starts a kPathConnect and holds it (or
    trickles it a byte every 100 ms) under a 60 s frame deadline: its pin ended with the frame's first
    byte, so the deallocated memory is back in the pool well within PinTimeoutMs (500 ms)."""
    p = pin_then_half_frame(peers, variant, how, timeout_ms=30_000)
    memory_freed(p, "the memory freed within the pin bound while the peer was sending a setup frame")
