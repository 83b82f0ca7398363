"""Role epochs, phases, drain and rollback (``pdlink.Engine.switch_role`` / ``role_state``,
docs/architecture.md, "Roles"), between real processes on every backend and data path: a stale
``expected_epoch`` changes nothing; links survive a switch and move exact bytes after it; a prepared
transfer made against the old epoch is refused with ``LLM_STALE_EPOCH`` (destination untouched) and
works again once prepared again; while a switch drains, transfers are refused with
``LLM_ROLE_SWITCHING`` on both sides; the drain waits for a transfer in flight, and past its timeout
rolls back with ``LLM_TIMEOUT``, role and epoch unchanged. Every transfer checks the whole
destination and its guards (tests/verify.py)."""

from __future__ import annotations

import dataclasses
import functools
import socket
from collections.abc import Callable, Iterator

import pytest

import native_pair
import pdlink
from backend_env import Variant
from conftest import only
from native_pair import INITIATOR, ROW, ROWS, TARGET, copies
from pdlink import LLMException, LLMStatusCode
from peer import Peer
from peers import native
from poll import wait_until
from relay import DOWN, Relay
from verify import assert_same, check_transfer, rows

THIRD = 3  # a third engine, linked to the target, that a test freezes to hold a transfer in flight
SLOW_MS = 60000  # the target's transfer timeout where a frozen peer holds its transfer


class Two(native_pair.Two):
    def __init__(self, peers: Callable[..., Peer], variant: Variant):
        super().__init__(peers, variant.env(), variant.env())
        self.variant = variant
        self.peers = peers


@pytest.fixture
def two(peers: Callable[..., Peer], variant: Variant) -> Iterator[Two]:
    yield Two(peers, variant)


def _refused(code: LLMStatusCode, fn: Callable[..., object], *args: object) -> LLMException:
    with pytest.raises(LLMException) as e:
        fn(*args)
    assert e.value.status_code == code, str(e.value)
    return e.value


def _state(side: Peer) -> tuple[str, int, str]:
    s = side.call(native.role_state)
    return s["role"], s["epoch"], s["phase"]


def test_a_stale_expected_epoch_is_refused_and_changes_nothing(two: Two) -> None:
    assert _state(two.target) == ("MIX", 0, "ready")
    _refused(LLMStatusCode.LLM_STALE_EPOCH, two.target.call, native.switch_role, "PROMPT", True, 1)
    assert _state(two.target) == ("MIX", 0, "ready")
    after = two.target.call(native.switch_role, "PROMPT", True, 0)
    assert (after["role"], after["epoch"], after["phase"]) == ("PROMPT", 1, "ready")
    assert (after["transfers_in_flight"], after["served_in_flight"], after["pins"]) == (0, 0, 0)
    # the epoch it was at is stale now; the same role again is a switch too
    _refused(LLMStatusCode.LLM_STALE_EPOCH, two.target.call, native.switch_role, "DECODER", True, 0)
    assert _state(two.target) == ("PROMPT", 1, "ready")
    assert two.target.call(native.switch_role, "PROMPT", True, 1)["epoch"] == 2


def test_links_survive_a_switch_and_move_exact_bytes_after_it(two: Two) -> None:
    for role in ("PROMPT", "DECODER", "PROMPT"):
        two.target.call(native.switch_role, role)
        two.initiator.call(native.switch_role, "DECODER" if role == "PROMPT" else "PROMPT")
    assert _state(two.target) == ("PROMPT", 3, "ready")
    assert [link.peer_cluster_id for link in two.initiator.call(native.links)] == [TARGET]
    assert [link.peer_cluster_id for link in two.target.call(native.links)] == [INITIATOR]
    # a plain read by address, and a write, over the link made before the switches
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.batch, TARGET, [("dst", 100, 300)], [two.src + 40], "read"), copies([(40, 100, 300)]))
    two.initiator.call(native.prepare, "w", TARGET, "dst", two.target.call(native.remote, "sink"))
    check_transfer(two.read("dst"), two.read("sink"), lambda: two.initiator.call(
        native.post, "w", [0, 1], [5, 6], "write"), rows([(0, 5), (1, 6)]))
    # the target's own requests over the same link (links are symmetric)
    two.target.call(native.prepare, "back", INITIATOR, "sink", two.initiator.call(native.remote, "dst"))
    check_transfer(two.read("dst"), two.read("sink"), lambda: two.target.call(
        native.post, "back", [2], [7], "read"), rows([(7, 2)]))


@pytest.mark.parametrize("op", ["read", "write"])
def test_a_transfer_prepared_before_a_commit_is_stale_after_it(two: Two, op: str) -> None:
    remote = two.target.call(native.remote, "src" if op == "read" else "sink")
    two.initiator.call(native.prepare, "p", TARGET, "dst", remote)
    source, dest = ("src", "dst") if op == "read" else ("dst", "sink")
    check_transfer(two.read(source), two.read(dest), lambda: two.initiator.call(
        native.post, "p", [0], [1], op), rows([(1, 0)] if op == "read" else [(0, 1)]))
    two.target.call(native.switch_role, "PROMPT")
    src0, dst0 = two.read(source)(), two.read(dest)()
    e = _refused(LLMStatusCode.LLM_STALE_EPOCH, two.initiator.call, native.post, "p", [2, 3], [4, 5], op)
    assert "prepare it again" in str(e)
    assert_same(two.read(dest)(), dst0, "destination after a stale post")
    assert_same(two.read(source)(), src0, "source after a stale post")
    assert [link.broken for link in two.initiator.call(native.links)] == [False]  # the link stays
    two.initiator.call(native.prepare, "p", TARGET, "dst", remote)
    check_transfer(two.read(source), two.read(dest), lambda: two.initiator.call(
        native.post, "p", [2, 3], [4, 5], op), rows([(4, 2), (5, 3)] if op == "read" else [(2, 4), (3, 5)]))


def test_a_transfer_prepared_after_another_cached_the_layout_is_fenced_too(two: Two) -> None:
    """On cma the first prepared read caches the target's layout; a second one, prepared after it,
    never asks the target (its posts read through the cached layout), so it binds its epoch from
    the target's published role word: after the target's commit both posts are refused with
    LLM_STALE_EPOCH, nothing changed. On the other paths every post asks the target. A plain read
    is not fenced: it sees the commit (the generation moved) and moves exact bytes."""
    remote = two.target.call(native.remote, "src")
    for tag, (lb, rb) in (("first", (0, 1)), ("second", (2, 3))):
        two.initiator.call(native.prepare, tag, TARGET, "dst", remote)
        check_transfer(two.read("src"), two.read("dst"),
                       functools.partial(two.initiator.call, native.post, tag, [lb], [rb], "read"), rows([(rb, lb)]))
    two.target.call(native.switch_role, "PROMPT")
    src0, dst0 = two.read("src")(), two.read("dst")()
    for tag in ("second", "first"):
        _refused(LLMStatusCode.LLM_STALE_EPOCH, two.initiator.call, native.post, tag, [4, 5], [6, 7], "read")
        assert_same(two.read("dst")(), dst0, f"destination after the stale post of {tag}")
    assert_same(two.read("src")(), src0, "source after the stale posts")
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.batch, TARGET, [("dst", 0, 64)], [two.src], "read"), copies([(0, 0, 64)]))
    two.initiator.call(native.prepare, "second", TARGET, "dst", remote)
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.post, "second", [4, 5], [6, 7], "read"), rows([(6, 4), (7, 5)]))


class Held:
    """The target (cluster 1) with a transfer of its own held in flight: a third engine, linked to
    it, is frozen while the target's first read from it waits for the answer."""

    def __init__(self, two: Two):
        self.two = two
        self.third = two.peers("third", env=two.variant.env())
        self.third.call(native.start, THIRD, listen=True)
        self.third_src = self.third.call(native.register, "far", ROWS, ROW, seed=5, key=9)
        # the target, restarted with a long transfer timeout (the hold must outlast the drain)
        two.initiator.call(native.close)
        two.target.call(native.close)
        self.port = port = two.target.call(native.start, TARGET, listen=True, timeout_ms=SLOW_MS)
        two.src = two.target.call(native.register, "src", ROWS, ROW, seed=1, key=7)
        two.target.call(native.register, "sink", ROWS, ROW, seed=None)
        two.initiator.call(native.start, INITIATOR)
        two.initiator.call(native.register, "dst", ROWS, ROW, seed=2)
        assert two.initiator.call(native.connect, port, TARGET) == TARGET
        assert two.target.call(native.connect, self.third.call(native.listen_port), THIRD) == THIRD
        two.target.call(native.prepare, "far", THIRD, "sink", self.third.call(native.remote, "far"))

    def start(self) -> None:
        self.sink0 = self.two.read("sink")()
        self.far0 = self.third.call(native.snapshot, "far")
        self.third.freeze()
        self.two.target.call(native.post_async, "far", [0, 1], [6, 7], "read")
        wait_until(lambda: self.two.target.call(native.role_state)["transfers_in_flight"] == 1, 30,
                   "the target's read from the frozen engine in flight")

    def release(self) -> None:
        self.third.thaw()
        assert self.two.target.call(native.wait, "far") == ("DONE", None, None)
        assert_same(self.two.read("sink")(), rows([(6, 0), (7, 1)])(self.sink0, self.far0),
                    "the held read's destination")


def test_a_switch_drains_what_is_in_flight_and_refuses_new_transfers_on_both_sides(two: Two) -> None:
    held = Held(two)
    # a prepared read of the initiator, posted once (on the same-host path its layout is cached)
    two.initiator.call(native.prepare, "p", TARGET, "dst", two.target.call(native.remote, "src"))
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.post, "p", [0], [0], "read"), rows([(0, 0)]))
    held.start()
    two.target.call(native.switch_role_async, "PROMPT", drain_timeout_ms=SLOW_MS)
    wait_until(lambda: _state(two.target)[2] == "draining", 30, "the target draining")
    assert _state(two.target) == ("MIX", 0, "draining")
    dst0, src0 = two.read("dst")(), two.read("src")()
    # as the server: the initiator's prepared read (the cached layout too) and a plain read
    _refused(LLMStatusCode.LLM_ROLE_SWITCHING, two.initiator.call, native.post, "p", [1], [1], "read")
    _refused(LLMStatusCode.LLM_ROLE_SWITCHING, two.initiator.call, native.batch, TARGET, [("dst", 0, 64)],
             [two.src], "read")
    # as the requester: the target's own transfers
    two.target.call(native.prepare, "back", INITIATOR, "sink", two.initiator.call(native.remote, "dst"))
    _refused(LLMStatusCode.LLM_ROLE_SWITCHING, two.target.call, native.post, "back", [2], [2], "read")
    # another switch while this one is pending
    _refused(LLMStatusCode.LLM_ROLE_SWITCHING, two.target.call, native.switch_role, "DECODER")
    # new links, both ways: the target's dial, and a newcomer's (refused with the reason)
    late = two.peers("late", env=two.variant.env())
    late_port = late.call(native.start, 4, listen=True)
    _refused(LLMStatusCode.LLM_ROLE_SWITCHING, two.target.call, native.connect, late_port, 4)
    e = _refused(LLMStatusCode.LLM_LINK_FAILED, late.call, native.connect, held.port, TARGET)
    assert "switching its role" in str(e), str(e)
    assert_same(two.read("dst")(), dst0, "the initiator's destination while refused")
    assert_same(two.read("src")(), src0, "the target's source while refused")
    assert _state(two.target) == ("MIX", 0, "draining")  # the held read is what it waits for
    held.release()
    outcome, _, _, after = two.target.call(native.switch_result)
    assert (outcome, after["role"], after["epoch"], after["phase"]) == ("ok", "PROMPT", 1, "ready")
    # the same links, after the commit: plain reads move exact bytes; the old prepared read is stale
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.batch, TARGET, [("dst", 0, 64)], [two.src], "read"), copies([(0, 0, 64)]))
    _refused(LLMStatusCode.LLM_STALE_EPOCH, two.initiator.call, native.post, "p", [1], [1], "read")


def test_a_drain_past_its_timeout_rolls_back(two: Two) -> None:
    held = Held(two)
    held.start()
    two.target.call(native.switch_role_async, "PROMPT", drain_timeout_ms=300)
    outcome, code, message, after = two.target.call(native.switch_result)
    assert (outcome, code) == ("TransferTimeout", LLMStatusCode.LLM_TIMEOUT), message
    assert "1 transfers" in message and "rolled back" in message
    # The held read is one request, sent before the switch: past its last cancel point, so the
    # rollback's cancel cannot stop it and its bounded wait (min(1 s, 300 ms)) ends with it running.
    assert "1 transfers cancelled (1 still ending after 300 ms)" in message, message
    assert (after["role"], after["epoch"], after["phase"]) == ("MIX", 0, "ready")
    assert after["transfers_in_flight"] == 1
    held.release()  # it completes and its result stands: no cancel point of its saw the rollback
    # ready again: transfers are admitted, and the next switch commits
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.batch, TARGET, [("dst", 0, 64)], [two.src], "read"), copies([(0, 0, 64)]))
    assert two.target.call(native.switch_role, "PROMPT", True, 0)["epoch"] == 1


def _occupied(ip: str, port: int = 0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((ip, port))
    s.listen(1)
    return s


def test_a_listener_that_cannot_be_bound_rolls_back_while_the_old_one_is_held() -> None:
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=1, listen="127.0.0.1:0", backend="cpu")) as e, \
            _occupied("127.0.0.1") as taken:
        port = e.listen_port
        with pytest.raises(LLMException) as err:
            e.switch_role("PROMPT", ("127.0.0.1", taken.getsockname()[1]))
        assert err.value.status_code == LLMStatusCode.LLM_FAILED, str(err.value)
        assert "rolled back" in str(err.value)
        assert (e.role_state().as_dict(), e.listen_port) == (
            {"role": "MIX", "epoch": 0, "phase": "ready", "transfers_in_flight": 0, "served_in_flight": 0,
             "pins": 0, "offers": 0}, port)
        with pdlink.Engine(pdlink.EngineOptions(cluster_id=2, backend="cpu")) as d:
            assert d.connect(f"127.0.0.1:{port}") == 1  # still listening where it was


def test_a_listener_lost_in_the_move_leaves_the_phase_failed_until_the_next_switch() -> None:
    """A move to the same port on another address gives the old listener up first; when the new
    address cannot be bound the engine is in neither role: phase "failed", role and epoch unchanged,
    until a later switch resolves it."""
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=1, listen="127.0.0.1:0", backend="cpu")) as e:
        port = e.listen_port
        with _occupied("127.0.0.2", port):
            with pytest.raises(LLMException) as err:
                e.switch_role("PROMPT", ("127.0.0.2", port))
            assert "phase failed" in str(err.value), str(err.value)
            state = e.role_state()
            assert (state.role, state.epoch, state.phase, e.listen_port) == ("MIX", 0, "failed", 0)
            with pytest.raises(LLMException) as stale:  # the checks still apply
                e.switch_role("PROMPT", "127.0.0.1:0", expected_epoch=1)
            assert stale.value.status_code == LLMStatusCode.LLM_STALE_EPOCH
        e.switch_role("PROMPT", "127.0.0.1:0", expected_epoch=0)
        state = e.role_state()
        assert (state.role, state.epoch, state.phase, e.listen_port > 0) == ("PROMPT", 1, "ready", True)


def test_one_way_links_switch_the_label_and_the_epoch() -> None:
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=1, listen="127.0.0.1:0", backend="cpu",
                                            one_way_links=True)) as e:
        port = e.listen_port
        with pytest.raises(LLMException) as stale:
            e.switch_role("DECODER", expected_epoch=3)
        assert stale.value.status_code == LLMStatusCode.LLM_STALE_EPOCH
        e.switch_role("DECODER", expected_epoch=0)
        assert (e.role_state().role, e.role_state().epoch, e.listen_port) == ("DECODER", 1, port)
        with pytest.raises(LLMException) as moved:
            e.switch_role("PROMPT", "127.0.0.1:1")
        assert moved.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        assert e.role_state().epoch == 1


def test_role_state_is_read_only_and_drain_timeouts_are_checked() -> None:
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=1, backend="cpu")) as e:
        state = e.role_state()
        with pytest.raises(dataclasses.FrozenInstanceError):
            state.epoch = 5  # type: ignore[misc]
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError):
                e.switch_role("PROMPT", drain_timeout_ms=bad)  # type: ignore[arg-type]
        assert e.role_state() == state


SPLIT_ROWS, SPLIT_ROW = 256, 256 * 1024  # 64 MiB: several chunks on each of the link's streams
HELD_AFTER = 1 << 20  # what the relay lets through of the pull's answers before it holds them


@only("cpu-tcp")
@pytest.mark.one_host("the initiator links through a relay in the test process")
def test_a_split_pull_begun_before_the_drain_finishes_whole(peers: Callable[..., Peer], variant: Variant) -> None:
    """On tcp a large pull is a series of chunk requests over the link's streams (channel and
    lanes). One begun before the switch is held at a relay after its first MiB of answers (so most
    of its chunks are not even requested yet) when the target is told to switch: the drain counts
    the pull in flight until its last chunk (served_in_flight, though no chunk is being served
    once the relay lets go), admits its later chunks, and the pull completes byte-exact; only then
    does the switch commit. A plain read begun while it drains is refused."""
    target, initiator = peers("target", env=variant.env()), peers("initiator", env=variant.env())
    port = target.call(native.start, TARGET, listen=True, timeout_ms=SLOW_MS)
    src = target.call(native.register, "big", SPLIT_ROWS, SPLIT_ROW, seed=3, key=7)
    initiator.call(native.start, INITIATOR, timeout_ms=SLOW_MS)
    initiator.call(native.register, "big", SPLIT_ROWS, SPLIT_ROW, seed=4)
    with Relay(port) as relay:
        assert initiator.call(native.connect, relay.port, TARGET) == TARGET
        initiator.call(native.start_read, TARGET, "big", src)  # a whole-region pull opens the lanes
        assert initiator.call_within(90, native.finish_read, "big", 0x5A)[0]
        assert relay.connections() == 5  # the link's two channels and 3 lanes (Limits.tcp_streams: 4 streams)
        initiator.call(native.reregister, "big", 0x5A)  # what the first pull moved, replaced
        src0, dst0 = target.call(native.snapshot, "big"), initiator.call(native.snapshot, "big")
        forwarded0 = relay.forwarded[DOWN]
        relay.hold_after(DOWN, HELD_AFTER)
        initiator.call(native.start_read, TARGET, "big", src)
        assert relay.wait_held(DOWN) >= forwarded0 + HELD_AFTER
        target.call(native.switch_role_async, "PROMPT", drain_timeout_ms=SLOW_MS)
        wait_until(lambda: _state(target)[2] == "draining", 30, "the target draining")
        assert relay.forwarded[DOWN] - forwarded0 < SPLIT_ROWS * SPLIT_ROW  # the pull cannot have completed
        assert target.call(native.role_state)["served_in_flight"] >= 1
        relay.release()
        ok, _ = initiator.call_within(90, native.finish_read, "big", 0x5A)
        assert ok, "the pull begun before the drain failed"
        outcome, _, message, after = target.call_within(90, native.switch_result)
        assert (outcome, after["role"], after["epoch"], after["phase"]) == ("ok", "PROMPT", 1, "ready"), message
        assert (after["served_in_flight"], after["transfers_in_flight"]) == (0, 0)
    assert_same(initiator.call(native.snapshot, "big"), dst0.with_rows(src0, [(b, b) for b in range(SPLIT_ROWS)]),
                "the destination of the pull begun before the drain")
