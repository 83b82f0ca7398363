"""The hostile review of round 4 (the engine split into LinkManager / RequestServer / Transfers; path
setup frames dispatched through the path table, since v5 one kPathConnect frame whose header names
the path): a raw peer (tests/peers/hostile.py) sends setup frames for paths its link was not admitted
to, sends them twice, oversized, undersized, with flags or a payload, racing its own unlink, naming
paths without a setup frame or none, with a cut header, v4's setup ops, and ops no table names. Each
case asserts what docs/security.md promises: the exact refusal with the link kept, or only that link
dropped; the victim's unregistered secret unchanged; the honest decoder still pulls byte-exact
afterwards."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest

import pdlink
import rawwire
from conftest import Pair, only
from pdlink import LLMStatusCode
from peer import Peer
from peers import hostile, kv, native
from poll import wait_until
from review_kit import (
    DEVICE,
    PING,
    ROOT_INFO,
    SHAPE,
    UCX,
    after,
    attacker_links,
    channel_body,
    make_victim,
    refused_kept,
    setup,
    ucx_body,
)
from verify import assert_same

S = LLMStatusCode
DEVICE_CHANNEL_BOUND = 8192  # security.md, Limits: "device-channel body 8 KiB"
UCX_HELLO_BOUND = 12 + 4096  # wire::kMaxUcxHelloBytes: token, message size, a worker address of 4 KiB


def raw_request(op: int, body: bytes, flags: int = 0, payload_len: int = 0, body_len: int | None = None) -> bytes:
    blen = len(body) if body_len is None else body_len
    return rawwire.request_header(op, blen, payload_len, flags) + body


@pytest.fixture
def victim(pair: Pair) -> Pair:
    return make_victim(pair)


# ------------------------------------------------------------------ device-channel setup frames


@only("cpu-tcp", "cpu-cma")
def test_a_device_channel_frame_on_a_cpu_engine_is_refused_twice_and_the_link_kept(peers: Callable[..., Peer],
                                                                                   victim: Pair) -> None:
    """A device channel's kPathConnect (a root info and the one-sided option) to an engine without
    device channels: answered LLM_FEATURE_NOT_ENABLED, the link kept; again; and at the body bound."""
    secret = victim.prefill.call(kv.secrets)
    a = attacker_links(peers, victim)
    for n in (ROOT_INFO + 1, ROOT_INFO + 1, DEVICE_CHANNEL_BOUND, 1, 0):
        refused_kept(a, setup(DEVICE, channel_body(n)), S.LLM_FEATURE_NOT_ENABLED)
    after(victim, secret)


@only("cpu-tcp", "cpu-cma", "ascend-fake")
@pytest.mark.parametrize("case", ["over_the_bound", "announced_4MiB", "flags", "payload"])
def test_a_device_channel_frame_out_of_its_shape_drops_only_that_link(peers: Callable[..., Peer], victim: Pair,
                                                                      case: str) -> None:
    """One byte past the 8 KiB bound, a body announced at the request bound (only the path's header
    sent), flags, or a payload length on a device channel's kPathConnect: the link is dropped before
    the setup body is read, on every backend; the victim serves its honest decoder during and after."""
    secret = victim.prefill.call(kv.secrets)
    a = attacker_links(peers, victim)
    frame = {
        "over_the_bound": setup(DEVICE, channel_body(DEVICE_CHANNEL_BOUND + 1)),
        "announced_4MiB": setup(DEVICE, b"", body_len=4 * 1024 * 1024),
        "flags": setup(DEVICE, channel_body(ROOT_INFO + 1), flags=rawwire.FLAG_DEVICE),
        "payload": setup(DEVICE, channel_body(ROOT_INFO + 1), payload_len=64),
    }[case]
    assert a.call(hostile.exchange, frame) == "closed"
    victim.pulled([2])
    a.call(hostile.close)
    after(victim, secret)


# ------------------------------------------------------------------ ucx setup frames on a non-ucx link


@only("cpu-tcp", "cpu-cma", "ascend-fake")
def test_a_ucx_connect_on_a_link_without_ucx_is_refused_and_the_link_kept(peers: Callable[..., Peer],
                                                                          victim: Pair) -> None:
    """The ucx path's kPathConnect on an engine without a ucx path (security.md: "answered LLM_FEATURE_NOT_ENABLED
    before anything of them is read ... the link kept"): a well-formed hello, one whose worker
    address would abort UCX, one whose message size is malformed, an empty body, twice each."""
    secret = victim.prefill.call(kv.secrets)
    a = attacker_links(peers, victim)
    for body in (ucx_body(76), ucx_body(UCX_HELLO_BOUND), struct.pack("<QI", 7, 3) + b"\xa5" * 64, b"", b"\x01"):
        for _ in range(2):
            refused_kept(a, setup(UCX, body), S.LLM_FEATURE_NOT_ENABLED)
    after(victim, secret)


@only("cpu-tcp", "cpu-cma")
@pytest.mark.parametrize("case", ["over_the_bound", "flags", "payload"])
def test_a_ucx_connect_out_of_its_shape_drops_only_that_link(peers: Callable[..., Peer], victim: Pair,
                                                             case: str) -> None:
    """Past the ucx hello's bound, with flags, with a payload: the headers alone drop the link (the
    ucx entry's bound is checked once the path's header is read, before the path is asked, even on a
    link that would refuse ucx: nothing of the setup body is read)."""
    secret = victim.prefill.call(kv.secrets)
    a = attacker_links(peers, victim)
    frame = {
        "over_the_bound": setup(UCX, ucx_body(UCX_HELLO_BOUND + 1)),
        "flags": setup(UCX, ucx_body(76), flags=rawwire.FLAG_UCX),
        "payload": setup(UCX, ucx_body(76), payload_len=8),
    }[case]
    assert a.call(hostile.exchange, frame) == "closed"
    a.call(hostile.close)
    after(victim, secret)


@only("cpu-tcp", "cpu-cma")
def test_ucx_flagged_accesses_without_a_ucx_path_are_refused_and_the_link_kept(peers: Callable[..., Peer],
                                                                               victim: Pair) -> None:
    """kFlagUcx reads and writes, before and after a (refused) ucx connect: LLM_FEATURE_NOT_ENABLED,
    no payload, the link kept, nothing written."""
    secret = victim.prefill.call(kv.secrets)
    before = victim.prefill.call(kv.snapshot, "kv")
    a = attacker_links(peers, victim)
    read = rawwire.request(rawwire.OP_READ, rawwire.blocks_body(runs=((0, 64),)), flags=rawwire.FLAG_UCX)
    write = rawwire.request(rawwire.OP_WRITE, rawwire.blocks_body(runs=((0, 64),)), flags=rawwire.FLAG_UCX)
    refused_kept(a, read, S.LLM_FEATURE_NOT_ENABLED)
    refused_kept(a, setup(UCX, ucx_body(76)), S.LLM_FEATURE_NOT_ENABLED)
    refused_kept(a, read, S.LLM_FEATURE_NOT_ENABLED)
    refused_kept(a, write, S.LLM_FEATURE_NOT_ENABLED)
    assert_same(victim.prefill.call(kv.snapshot, "kv"), before, "the victim's cache")
    after(victim, secret)


# ------------------------------------------------------------------ path-connect headers

# Ids a kPathConnect header may carry that name no path with a setup frame: the stream's, cma's, IPC's
# and one-sided's entries (no setup of their own: one-sided shares the device channel, named by the
# HCCL entry's id), the test build's path (not in this table), flag bytes no entry has.
NO_SETUP = {"stream": 0, "cma": 1, "ipc": 3, "one_sided": 6, "test_path": 16, "unknown_0x80": 0x80,
            "unknown_255": 255}


@only("cpu-tcp", "cpu-cma", "ascend-fake")
@pytest.mark.parametrize("path", sorted(NO_SETUP))
def test_a_path_connect_naming_no_setup_drops_only_that_link(peers: Callable[..., Peer], victim: Pair,
                                                             path: str) -> None:
    """A kPathConnect whose header names a path without a setup frame, or no path: the link is dropped
    (as for an op no one names), nothing of the setup body read; the victim serves its honest decoder
    during and after."""
    secret = victim.prefill.call(kv.secrets)
    a = attacker_links(peers, victim)
    assert a.call(hostile.exchange, PING) == (0, "", b"")
    assert a.call(hostile.exchange, setup(NO_SETUP[path], ucx_body(76))) == "closed"
    victim.pulled([2])
    a.call(hostile.close)
    after(victim, secret)


# The frames that drop the link at its headers: no room for the path's header, an announced body past
# every path's bound (only the path's header sent), v4's device-channel and ucx-connect frames with
# the bodies v4 took (unknown ops since v5), and one naming no path past every bound.
HEADER_CASES = {
    "no_header": raw_request(rawwire.OP_PATH_CONNECT, b""),
    "past_every_bound": setup(DEVICE, b"", body_len=1 + DEVICE_CHANNEL_BOUND + 1),
    "unknown_past_every_bound": setup(0x80, b"\xa5" * (DEVICE_CHANNEL_BOUND + 1)),
    "v4_device_channel": raw_request(rawwire.OLD_OP_DEVICE_CHANNEL, channel_body(ROOT_INFO + 1)),
    "v4_ucx_connect": raw_request(rawwire.OLD_OP_UCX_CONNECT, ucx_body(76)),
}


@only("cpu-tcp", "cpu-cma", "ascend-fake")
@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_a_path_connect_cut_short_oversized_or_in_v4s_shape_drops_only_that_link(peers: Callable[..., Peer],
                                                                                 victim: Pair, case: str) -> None:
    """Each frame drops the link it came on (security.md, "Limits"); the victim serves its honest
    decoder during and after, and a new link of the same peer is served (refusals answered, the link
    kept)."""
    secret = victim.prefill.call(kv.secrets)
    a = attacker_links(peers, victim)
    assert a.call(hostile.exchange, HEADER_CASES[case]) == "closed"
    victim.pulled([2])
    a.call(hostile.close)
    b = attacker_links(peers, victim, 10)
    assert b.call(hostile.exchange, PING) == (0, "", b"")
    b.call(hostile.close)
    after(victim, secret)


# ------------------------------------------------------------------ setup frames racing an unlink


@only("cpu-tcp", "cpu-cma", "ascend-fake")
@pytest.mark.parametrize("path", [DEVICE, UCX], ids=["device_channel", "ucx"])
def test_a_setup_frame_racing_its_links_unlink(peers: Callable[..., Peer], victim: Pair, path: int) -> None:
    """A setup frame, the link's unlink and another setup frame in one write: the first is answered
    (or the link dropped on a device backend whose join fails), the unlink ends the link, and the frame
    after it is never served; repeated on new links, the victim keeps serving and leaks no link."""
    secret = victim.prefill.call(kv.secrets)
    body = channel_body(ROOT_INFO + 1) if path == DEVICE else ucx_body(76)
    frame = setup(path, body)
    unlink = raw_request(rawwire.OP_UNLINK, b"")
    for i in range(4):
        a = attacker_links(peers, victim, 30 + i)
        a.call(hostile.send, frame + unlink + frame)
        a.call(hostile.close)
    after(victim, secret)

    seen: list[list[dict[str, object]]] = []

    def only_the_decoder() -> bool:
        seen.append(victim.prefill.call(kv.links))
        return all(link["broken"] for link in seen[-1] if link["peer_cluster_id"] != 2)

    try:
        wait_until(only_the_decoder, 20, "the attackers' links down at the victim")
    except AssertionError as e:
        raise AssertionError(f"{e}: {seen[-1]}") from None


# ------------------------------------------------------------------ control frames


@only("cpu-tcp", "cpu-cma")
def test_confirm_frames_out_of_shape_drop_the_link_and_an_unknown_nonce_is_denied(peers: Callable[..., Peer],
                                                                                  victim: Pair) -> None:
    """kConfirm: a nonce of the attacker's choosing from an end it names is denied (LLM_NOT_YET_LINK),
    the link kept; 15 bytes, or a nonce and 65 bytes of endpoint, drop the link."""
    secret = victim.prefill.call(kv.secrets)
    a = attacker_links(peers, victim)
    refused_kept(a, raw_request(rawwire.OP_CONFIRM, bytes(16) + b"127.0.0.1:1"), S.LLM_NOT_YET_LINK)
    refused_kept(a, raw_request(rawwire.OP_CONFIRM, b"\xff" * 16 + b"x" * 64), S.LLM_NOT_YET_LINK)
    assert a.call(hostile.exchange, raw_request(rawwire.OP_CONFIRM, bytes(15))) == "closed"
    a.call(hostile.close)
    b = attacker_links(peers, victim, 10)
    assert b.call(hostile.exchange, raw_request(rawwire.OP_CONFIRM, bytes(16 + 65))) == "closed"
    b.call(hostile.close)
    after(victim, secret)


@only("cpu-tcp", "cpu-cma")
@pytest.mark.parametrize("op", [0, rawwire.OLD_OP_DEVICE_CHANNEL, rawwire.OLD_OP_UCX_CONNECT, 13, 64, 255])
def test_an_op_no_one_names_drops_only_that_link(peers: Callable[..., Peer], victim: Pair, op: int) -> None:
    """An op outside the protocol (no control frame, not kPathConnect; 8 and 10 were v4's device-channel
    and ucx-connect frames): the link is dropped."""
    secret = victim.prefill.call(kv.secrets)
    a = attacker_links(peers, victim)
    assert a.call(hostile.exchange, raw_request(op, rawwire.blocks_body())) == "closed"
    a.call(hostile.close)
    after(victim, secret)


# ------------------------------------------------------------------ the ptrace grant and a raw link's life


def grant_is(victim: Pair, active: bool, what: str) -> None:
    wait_until(lambda: victim.prefill.call(kv.ptrace_grant_active) is active, 20, what)


@only("cpu-cma")
@pytest.mark.parametrize("end", ["malformed_frame", "unlink", "close"])
def test_the_ptrace_grant_ends_with_a_raw_same_host_link_whatever_setup_frames_it_sent(
        peers: Callable[..., Peer], pair: Pair, end: str) -> None:
    """A same-host raw peer (the only link of the victim) sends setup frames for paths its cma link
    does not serve (refused, the link kept, the grant held: it is a proven same-host link), then ends
    its link by a malformed frame, an unlink or closing its sockets: the victim withdraws the ptrace
    permission (security.md, "The ptrace permission": "withdraws it when the last one breaks or is
    unlinked"), and still links and serves an honest decoder afterwards."""
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=Pair.KEY)
    pair.prefill.call(kv.plant_secret)
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    secret = pair.prefill.call(kv.secrets)
    assert pair.prefill.call(kv.ptrace_grant_active) is False
    a = attacker_links(peers, pair)
    assert {link["transport"] for link in pair.prefill.call(kv.links)} == {"cma"}
    grant_is(pair, True, "the grant for the raw same-host link")
    refused_kept(a, setup(DEVICE, channel_body(ROOT_INFO + 1)), S.LLM_FEATURE_NOT_ENABLED)
    refused_kept(a, setup(UCX, ucx_body(76)), S.LLM_FEATURE_NOT_ENABLED)
    assert pair.prefill.call(kv.ptrace_grant_active) is True
    if end == "malformed_frame":
        assert a.call(hostile.exchange, setup(DEVICE, b"", body_len=1 << 20)) == "closed"
    elif end == "unlink":
        assert a.call(hostile.exchange, raw_request(rawwire.OP_UNLINK, b"")) == (0, "", b"")
    a.call(hostile.close)
    grant_is(pair, False, "the grant withdrawn once the raw link is down")
    pair.link()
    pair.pulled([1])
    assert pair.prefill.call(kv.secrets) == secret


# ------------------------------------------------------------------ addresses as (ip, port) pairs

HOSTILE_PAIRS = {
    "port_negative": ("127.0.0.1", -1),
    "port_past_65535": ("127.0.0.1", 65536),
    "port_2_64": ("127.0.0.1", 2**64 + 1),
    "port_bool": ("127.0.0.1", True),
    "port_text": ("127.0.0.1", "1"),
    "port_float": ("127.0.0.1", 1.0),
    "port_none": ("127.0.0.1", None),
    "host_empty": ("", 1),
    "host_bytes": (b"127.0.0.1", 1),
    "host_int": (2130706433, 1),
    "three_items": ("127.0.0.1", 1, 2),
    "one_item": ("127.0.0.1",),
}


def test_hostile_address_pairs_are_refused_before_anything_is_dialled(peers: Callable[..., Peer]) -> None:
    """Engine.connect_each / add_listener with pairs a hostile caller (a REST body passed on) could
    build: each is refused with ValueError in Python, nothing dialled or bound, the engine unharmed."""
    victim, dialler = peers("victim"), peers("dialler")
    port = victim.call(native.start, 1, True)
    dialler.call(native.start, 2)
    for name, pair in HOSTILE_PAIRS.items():
        with pytest.raises(ValueError):
            dialler.call(native.connect_each, [(None, pair)])
        with pytest.raises(ValueError):
            dialler.call(native.add_listener, pair)
        assert dialler.call(native.links) == [], name
    assert dialler.call(native.connect_each, [(None, ("127.0.0.1", port))])[0][0] == 0


@pytest.mark.xfail(strict=True, reason=(
    "an (ip, port) pair's host is checked only as a non-empty str (engine._split_address) and the native "
    "resolve() (csrc/transport/socket.cc) hands ip.c_str() to inet_pton/getaddrinfo: a host with an embedded "
    "NUL ('127.0.0.1\\x00.attacker.example') is cut at the NUL, so the engine dials 127.0.0.1 while the caller "
    "(and links()' peer_address, which keeps the whole string) names another host; the string form "
    "'127.0.0.1\\x00x:port' is taken the same way"))
def test_a_host_with_an_embedded_nul_is_refused(peers: Callable[..., Peer]) -> None:
    victim, dialler = peers("victim"), peers("dialler")
    port = victim.call(native.start, 1, True)
    dialler.call(native.start, 2)
    try:
        with pytest.raises(ValueError):
            dialler.call(native.connect_each, [(None, ("127.0.0.1\x00.attacker.example", port))])
    finally:
        linked = dialler.call(native.links)
    assert linked == []


# ------------------------------------------------------------------ notification shares and claimed ids


@pytest.mark.xfail(strict=True, reason=(
    "the per-link notification share is kept per peer cluster id (notify.cc, Inbox::per_peer[link.peer()]), "
    "not per link: a raw peer that links in claiming the cluster id of a peer this engine dialled (allowed: "
    "'a link this engine dialled is never displaced', and only accepted links are rivals) fills that share, "
    "and the genuine peer's notifications over its own link are refused LLM_LINK_BUSY; security.md, Limits: "
    "MaxNotificationsPerLink 'notifications received from one peer', MaxNotificationBytesPerLink 'of those, "
    "from one link'"))
def test_an_impostors_notifications_do_not_use_up_the_share_of_the_link_this_engine_dialled(
        peers: Callable[..., Peer]) -> None:
    victim, honest, a = peers("victim"), peers("honest"), peers("attacker")
    port = victim.call(native.start, 1, True, limits={"max_notifications_per_link": 4})
    honest_port = honest.call(native.start, 2, True)
    assert victim.call(native.connect, honest_port, 2) == 2  # the victim dials the honest peer (cluster 2)
    assert a.call(hostile.link_raw, port, 2) == (0, "")  # an impostor links in claiming cluster 2
    note = raw_request(rawwire.OP_NOTIFY, rawwire.notify_body(b"", b"x"))
    assert [a.call(hostile.exchange, note) for _ in range(4)] == [(0, "", b"")] * 4  # its own link's share
    honest.call(native.notify, 1, b"from the genuine cluster 2")  # its own link: a share of its own


@pytest.mark.xfail(strict=True, reason=(
    "LinkTable::forRequests (csrc/engine/link_table.cc) falls back from the link this engine dialled to an "
    "accepted link of the same cluster id once the dialled one is broken; without a secret an accepted link's "
    "cluster id is only a claim, and a newcomer claiming the id of a peer this engine dialled is admitted (only "
    "accepted links are rivals, handshake.cc acceptReverse). So once the dialled peer's link breaks, the "
    "engine's requests to that cluster (here a notification; equally reads and writes of its caches) go to the "
    "impostor: security.md, 'A dialler gets the engine at the address it dialled'"))
def test_requests_to_a_dialled_peer_never_go_to_an_impostor_that_claimed_its_id(peers: Callable[..., Peer]) -> None:
    victim, honest, a = peers("victim"), peers("honest"), peers("attacker")
    port = victim.call(native.start, 1, True)
    honest_port = honest.call(native.start, 2, True)
    assert victim.call(native.connect, honest_port, 2) == 2  # the victim dials the honest peer (cluster 2)
    assert a.call(hostile.link_raw, port, 2) == (0, "")  # an impostor links in claiming cluster 2
    a.call(hostile.answer_on_reverse)
    honest.kill()  # the dialled link breaks
    seen: list[list[pdlink.LinkInfo]] = []

    def dialled_broken() -> bool:
        seen.append(victim.call(native.links))
        return not any(link.initiator and not link.broken for link in seen[-1])

    try:
        wait_until(dialled_broken, 20, "the victim sees its dialled link broken")
    except AssertionError as e:
        raise AssertionError(f"{e}: {seen[-1]}") from None
    try:
        victim.call(native.notify, 2, b"meant for the engine at the dialled address")
    except Exception:  # noqa: BLE001 (refused or failed: what the test wants)
        pass
    assert a.call(hostile.reverse_seen) == [], "the impostor received the victim's request"


@only("cpu-tcp", "cpu-cma")
def test_setup_frames_before_the_reverse_channel_are_never_served(peers: Callable[..., Peer], victim: Pair) -> None:
    """A peer completes only its forward channel and sends setup frames (a device channel, a ucx connect,
    an unlink) at once, never opening the reverse channel: nothing is answered, the connection is dropped
    at the handshake timeout (5 s), no link is installed, and on a same-host link the ptrace grant it held
    while pending is not left behind beyond the decoder's own link."""
    secret = victim.prefill.call(kv.secrets)
    a = peers("attacker")
    unix = a.call(hostile.redirect_name, victim.port, 40) if victim.variant.same_host else None
    frames = (setup(DEVICE, channel_body(ROOT_INFO + 1)) + setup(UCX, ucx_body(76)) +
              raw_request(rawwire.OP_UNLINK, b""))
    assert a.call_within(30, hostile.forward_only, victim.port, 40, unix, frames, 15.0) == "closed"
    assert [link["peer_cluster_id"] for link in victim.prefill.call(kv.links)] == [2]
    after(victim, secret)
