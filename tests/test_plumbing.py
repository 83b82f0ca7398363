"""The test plumbing itself (tests/README.md): peers that run functions, whole-memory snapshots,
polling. If these helpers lied, every test built on them would."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest

from conftest import Pair
from pdlink import LLMException, LLMStatusCode
from peer import Peer, PeerTimeout, RemoteError, RemoteTraceback
from peers import kv, selftest
from poll import hang_guard, wait_until
from verify import PATTERN_PERIOD, assert_same, pattern, pattern_formula


def test_a_call_runs_in_the_peer_and_returns_its_result(peers: Callable[..., Peer]) -> None:
    p = peers("p")
    args, kwargs, pid = p.call(selftest.echo, 1, [2, 3], key=b"\x00\xff")
    assert (args, kwargs) == ((1, [2, 3]), {"key": b"\x00\xff"})
    assert pid == p.pid != os.getpid()


def test_peers_are_forks_of_one_fork_server_with_their_own_environment_unless_asked_fresh(
        peers: Callable[..., Peer]) -> None:
    names = ["PDL_SELFTEST", "HOME"]
    a = peers("a", env={"PDL_SELFTEST": "a", "HOME": None})
    b = peers("b")
    c = peers("c", fresh=True)
    ia, ib, ic = (p.call(selftest.identity, names) for p in (a, b, c))
    # a fork takes the environment it is given (set, or left out by None), as a new interpreter does
    assert ia["env"] == {"PDL_SELFTEST": "a", "HOME": None}
    assert ib["env"] == {"PDL_SELFTEST": None, "HOME": os.environ.get("HOME")} == ic["env"]
    # forks of one fork server (not of this process), with its modules where it put them; the
    # fresh peer is this process's own child
    assert ia["ppid"] == ib["ppid"] != os.getpid() and ic["ppid"] == os.getpid()
    assert ia["numpy_at"] == ib["numpy_at"]
    # each fork draws its own ports (tests/ports.py reseeds its generator in a fork)
    assert len({tuple(ia["ports"]), tuple(ib["ports"]), tuple(ic["ports"])}) == 3


def test_a_peer_exception_keeps_its_type_code_and_traceback(peers: Callable[..., Peer]) -> None:
    p = peers("p")
    with pytest.raises(LLMException) as e:
        p.call(selftest.fail_with, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, "no such key")
    assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST and "no such key" in str(e.value)
    cause = e.value.__cause__
    assert isinstance(cause, RemoteTraceback) and "in fail_with" in cause.text
    # an unpicklable result comes back as an error naming it, and the peer keeps serving
    with pytest.raises((RemoteError, TypeError)) as u:
        p.call(selftest.unpicklable)
    assert "lock" in str(u.value).lower()
    assert p.call(selftest.echo)[0] == ()


def test_a_call_past_its_bound_fails_and_kills_the_peer(peers: Callable[..., Peer]) -> None:
    p = peers("p")
    with pytest.raises(PeerTimeout, match="no answer within 0.5 s"):
        p.call_within(0.5, selftest.block)
    assert p.proc.exitcode is not None  # killed, not left running
    with pytest.raises(PeerTimeout, match="unusable"):
        p.call(selftest.echo)


def test_a_peer_that_dies_during_a_call_is_reported(peers: Callable[..., Peer]) -> None:
    p = peers("p")
    with pytest.raises(PeerTimeout, match="exit code 3"):
        p.call(selftest.die, 3)


def test_freeze_stops_every_thread_until_thaw(pair: Pair) -> None:
    pair.prefill.freeze()
    assert all(state in ("T", "t") for state in pair.prefill.thread_states())
    with pytest.raises(PeerTimeout):
        pair.prefill.call_within(0.3, kv.listen_port)
    # the frozen peer was killed by the bound above; the other is untouched
    assert pair.decode.call(kv.role_and_port)[0] == 2


def test_wait_until_returns_the_value_or_names_what_it_waited_for() -> None:
    values = iter([0, None, "", 7])
    assert wait_until(lambda: next(values), 5, "a value") == 7
    with pytest.raises(AssertionError, match="not reached within 0.05 s: the impossible"):
        wait_until(lambda: False, 0.05, "the impossible")
    assert hang_guard(500) == 20 and hang_guard(10_000) == 100


def test_test_data_and_guards_are_what_verify_says(pair: Pair) -> None:
    """Registered data is ``verify.pattern``, zeros when unseeded, read back directly (on the Ascend
    backend from the fake's memory, not through pdlink), and a difference anywhere is named."""
    pair.prefill.call(kv.register_blocks, "kv", 2, (4, 16), seed=7)
    pair.decode.call(kv.register_blocks, "kv", 2, (4, 16), seed=None)
    snap = pair.prefill.call(kv.snapshot, "kv")
    for t in range(2):
        assert snap.tensor(t).tobytes() == pattern(4 * 16 * 2, t, 7).tobytes()
    assert not pair.decode.call(kv.snapshot, "kv").tensor(1).any()
    changed = snap.with_tensor_bytes(1, 70, np.array([0], np.uint8))
    with pytest.raises(AssertionError, match="tensor 1, row 2, byte 6"):
        assert_same(changed, snap, "check")
    for offset, where in [(3, "the guard before tensor 0"), (64 + 128 + 5, "the guard after tensor 0")]:
        guard = snap.copy()
        guard.regions[0][offset] ^= 0xFF
        with pytest.raises(AssertionError, match=where):
            assert_same(guard, snap, "check")


@pytest.mark.parametrize("tensor, seed", [(0, 1), (3, 7), (1, -2)])
def test_the_pattern_is_its_formula_repeated(tensor: int, seed: int) -> None:
    """``verify.pattern`` (one period repeated) is byte for byte ``pattern_formula`` at every size
    around the period's edges and over several periods; each call returns a new, writable array."""
    for nbytes in [0, 1, 255, 256, PATTERN_PERIOD - 1, PATTERN_PERIOD, PATTERN_PERIOD + 1, 3 * PATTERN_PERIOD + 17]:
        assert pattern(nbytes, tensor, seed).tobytes() == pattern_formula(nbytes, tensor, seed).tobytes(), nbytes
    a = pattern(PATTERN_PERIOD + 1, tensor, seed)
    a[0] ^= 0xFF
    assert pattern(1, tensor, seed)[0] == pattern_formula(1, tensor, seed)[0] != a[0]


def test_pool_snapshots_cover_the_whole_pool(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(pool=1 << 20)
    pair.prefill.call(kv.allocate, "a", 2, (2, 64), seed=3)
    pair.prefill.call(kv.allocate, "b", 1, (1, 64), seed=4)
    a, b = pair.prefill.call(kv.snapshot, "a"), pair.prefill.call(kv.snapshot, "b")
    assert a.kind == "pool" and len(a.regions[0]) == 1 << 20
    assert a.tensor(1).tobytes() == pattern(256, 1, 3).tobytes()
    # a change to another cache of the same pool shows in this cache's snapshot
    pair.prefill.call(kv.overwrite, "b", 5)
    with pytest.raises(AssertionError, match="outside every tensor of this cache"):
        assert_same(pair.prefill.call(kv.snapshot, "a"), a, "pool")
    assert b.tensor(0).tobytes() == pattern(128, 0, 4).tobytes()
