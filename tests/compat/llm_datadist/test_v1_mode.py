"""KvCacheManager (v1, legacy) mode across real processes: roles, pulls, switch_role, handles,
single-process multi-device mode (llm_datadist_api.md §4.2, §6.1, §6.5, §6.6, §7.6, §7.12, §9, §10.4, §10.7, §11.2).

Peers run ``tests/peers/v1.py``. Tests taking the ``backend`` fixture (directly or through ``v1``)
run on the CPU backend and on the Ascend backend over the fake libraries, where caches are device
memory. Caches come from the engine's device pool, so a snapshot (tests/verify.py) covers that
whole pool: every transfer checks that the destination pool holds exactly its old bytes with the
moved ranges replaced by the source's, and that the source pool is unchanged; every refused call
checks that nothing changed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from backend_env import peer_env
from llm_datadist import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex, DataType, LLMRole, Placement
from pdlink import LLMException
from pdlink import LLMStatusCode as S
from peer import Peer
from peers import v1
from poll import hang_guard, wait_until
from verify import Copy, Snapshot, assert_same, check_transfer, rows
from where import TESTS

PROMPT_ID, DECODER_ID = 1, 2
LISTEN = {"llm.listenIpInfo": "127.0.0.1:0"}

Expect = Callable[[Snapshot, Snapshot], Snapshot]
Side = tuple[Peer, str] | tuple[Peer, str, int]  # (peer, cache name[, device])


class raises:
    """``with raises(cls, code, match=..., message=...):`` expects an exception of exactly class
    ``cls`` (``LLMException`` itself, never a subclass, as CANN raises it), whose text
    contains ``match`` / is ``message``."""

    def __init__(self, cls: type[BaseException], code: S | None = None, match: str | None = None,
                 message: str | None = None):
        self.cls, self.code, self.match, self.message = cls, code, match, message

    def __enter__(self) -> raises:
        return self

    def __exit__(self, tp: type[BaseException] | None, value: BaseException | None, tb: object) -> bool:
        assert tp is not None and value is not None, f"expected {self.cls.__name__}({self.code}), nothing was raised"
        assert tp is self.cls, f"expected {self.cls.__name__}, got {tp.__name__}: {value}"
        if self.code is not None:
            assert isinstance(value, LLMException) and value.status_code == self.code, f"{value!r}: {value}"
        if self.match is not None:
            assert self.match in str(value), str(value)
        if self.message is not None:
            assert str(value) == self.message, str(value)
        return True


def llm_error(code: S, match: str | None = None) -> raises:
    """An ``LLMException`` (exactly that class) with that status code."""
    return raises(LLMException, code, match)


def snap(side: Side) -> Snapshot:
    peer, name, *dev = side
    return peer.call(v1.snapshot, name, *dev)


@contextlib.contextmanager
def unchanged(*sides: Side) -> Iterator[None]:
    """Every byte around these caches (whole pools, guards) is the same after the block."""
    before = [snap(s) for s in sides]
    yield
    for side, old in zip(sides, before):
        assert_same(snap(side), old, "memory a refused call must not change")


def moved(src: Side, dst: Side, action: Callable[[], object], expect: Expect) -> None:
    """``action`` moves bytes from ``src`` to ``dst``: the whole destination is what ``expect``
    says, the source unchanged (verify.check_transfer)."""
    check_transfer(lambda: snap(src), lambda: snap(dst), action, expect)


def moved_on_devices(src: tuple[Peer, str], dst: tuple[Peer, str], action: Callable[[], object], expect: Expect,
                     devices: Sequence[int] = (0, 1)) -> None:
    """``moved`` for one action that moves bytes on every device (multi-device mode): on each device
    the destination is what ``expect`` says and the source is unchanged."""
    before = [(snap((*src, dev)), snap((*dst, dev))) for dev in devices]
    action()
    for dev, (src0, dst0) in zip(devices, before):
        assert_same(snap((*dst, dev)), expect(dst0, src0), f"destination, device {dev}")
        assert_same(snap((*src, dev)), src0, f"source, device {dev}")


def moved_within(peer: Peer, src: str, dst: str, action: Callable[[], object], expect: Expect) -> None:
    """A local copy between two caches of one pool: the pool (``dst``'s snapshot, which holds
    ``src`` too) is its old bytes with exactly the copied ranges replaced, so the source is unchanged."""
    src0, dst0 = peer.call(v1.snapshot, src), peer.call(v1.snapshot, dst)
    action()
    assert_same(peer.call(v1.snapshot, dst), expect(dst0, src0), "the pool after a local copy")


def byte_ranges(ranges: Sequence[tuple[int, int, int]], tensors: int = 2) -> Expect:
    """``expect`` for (src_offset, dst_offset, nbytes) ranges moved within every tensor i -> i."""
    return lambda dst0, src0: dst0.with_bytes(src0, [Copy(t, so, t, do, n) for t in range(tensors)
                                                     for so, do, n in ranges])


class V1:
    """A PROMPT (cluster 1, listening) and a DECODER (cluster 2) in KvCacheManager mode, each with a
    small device pool (``v1.POOL``) per device; ``ports`` are the prompt's listen ports (one per
    device)."""

    def __init__(self, peers: Callable[..., Peer], backend: str = "cpu", devices: int | list[int] = 0,
                 switch: bool = False, timeout: int | None = None):
        self.backend = backend
        self.prefill = p = peers("v1-prefill", env=peer_env(backend))
        self.decode = d = peers("v1-decode", env=peer_env(backend))
        n = len(devices) if isinstance(devices, list) else 1
        self.ports = p.call(v1.start, "prompt", PROMPT_ID, listen=n, devices=devices, timeout_ms=timeout,
                            switch=switch, pool=v1.POOL)
        d.call(v1.start, "decoder", DECODER_ID, devices=devices, timeout_ms=timeout, switch=switch, pool=v1.POOL)
        assert len(self.ports) == n and all(port > 0 for port in self.ports)

    def link(self) -> None:
        ret = self.decode.call(v1.link, PROMPT_ID, self.ports)
        assert ret == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), ret

    def unlink(self) -> None:
        ret = self.decode.call(v1.unlink, PROMPT_ID, self.ports)
        assert ret == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), ret
        wait_until(lambda: self.prefill.call(v1.links) == [], 5.0, "the prompt dropped its end of the link")


@pytest.fixture
def pair_v1(peers: Callable[..., Peer], backend: str) -> V1:
    return V1(peers, backend)


# ---------------------------------------------------------------------------- serving flows


def test_vllm_v0_connector_flow(peers: Callable[..., Peer], backend: str) -> None:
    """Spec 11.2: P allocates four keyed caches (ids 1..4), D pulls them by id, unlinks at close."""
    pd = V1(peers, backend)
    p, d = pd.prefill, pd.decode
    pd.link()
    shape = (1, 8, 2, 4)  # 3 layers of (batch 1, seq 8, 2 heads, dim 4) float16
    ids = [p.call(v1.allocate, f"c{model_id}", 3, shape, DataType.DT_FLOAT16, keys=[CacheKey(PROMPT_ID, 0, model_id)],
                  seq_len_dim_index=1) for model_id in (1, 2, 3, 4)]
    assert ids == [1, 2, 3, 4]
    for cache_id in ids:
        p.call(v1.write, f"c{cache_id}", cache_id)
        assert len(p.call(v1.device_addrs, f"c{cache_id}")) == 1
    for i in range(4):
        d.call(v1.allocate, f"b{i}", 3, shape, DataType.DT_FLOAT16, seq_len_dim_index=1)
        d.call(v1.zero, f"b{i}")
    for i in range(4):
        moved((p, f"c{i + 1}"), (d, f"b{i}"),
              functools.partial(d.call, v1.pull_cache,
                                CacheKeyByIdAndIndex(PROMPT_ID, cache_id=i + 1, batch_index=0), f"b{i}", 0),
              rows([(0, 0)]))
    # the pulls released the keys: once P drops its handles, every cache is freed
    for cache_id in ids:
        p.call(v1.deallocate, f"c{cache_id}")
    wait_until(lambda: p.call(v1.cache_count) == 0, 5.0, "every prompt cache freed")
    # close: D unlinks; P's end goes too, and pulls now fail with NOT_YET_LINK
    pd.unlink()
    with unchanged((p, "c1"), (d, "b0")), llm_error(S.LLM_NOT_YET_LINK):
        d.call(v1.pull_cache, CacheKeyByIdAndIndex(PROMPT_ID, 1, 0), "b0")


def test_pull_by_cache_key_releases_the_key(pair_v1: V1) -> None:
    p, d = pair_v1.prefill, pair_v1.decode
    p.call(v1.allocate, "c", 2, (2, 64), keys=[CacheKey(PROMPT_ID, 42), CacheKey(PROMPT_ID, 43)], seed=5)
    p.call(v1.deallocate, "c")  # only the two keys keep it alive now
    d.call(v1.allocate, "dst", 2, (2, 64))
    d.call(v1.zero, "dst")
    pair_v1.link()
    # key 42 = slot 0 -> local slot 1
    moved((p, "c"), (d, "dst"), lambda: d.call(v1.pull_cache, CacheKey(PROMPT_ID, 42), "dst", 1), rows([(0, 1)]))
    with unchanged((p, "c"), (d, "dst")), llm_error(S.LLM_KV_CACHE_NOT_EXIST):
        d.call(v1.pull_cache, CacheKey(PROMPT_ID, 42), "dst", 0)
    assert p.call(v1.cache_count) == 1  # key 43 still holds it
    # key 43 = slot 1 -> local slot 0
    moved((p, "c"), (d, "dst"),
          lambda: d.call(v1.pull_cache, CacheKey(prompt_cluster_id=PROMPT_ID, req_id=43), "dst", 0), rows([(1, 0)]))
    wait_until(lambda: p.call(v1.cache_count) == 0, 5.0, "the cache freed once its last key was pulled")
    # a removed key cannot be pulled; removing an absent key is a no-op
    p.call(v1.allocate, "c2", 1, (1, 64), keys=[CacheKey(PROMPT_ID, 44)])
    p.call(v1.remove_cache_key, CacheKey(PROMPT_ID, 44))
    p.call(v1.remove_cache_key, CacheKey(PROMPT_ID, 44))
    with unchanged((p, "c2"), (d, "dst")), llm_error(S.LLM_KV_CACHE_NOT_EXIST):
        d.call(v1.pull_cache, CacheKey(PROMPT_ID, 44), "dst", 0)
    # exactly one of req_id / prefix_id must be valid in a pull key
    for key in (CacheKey(PROMPT_ID, 2**64 - 1), CacheKey(PROMPT_ID, 1, 0, 5)):
        with unchanged((p, "c2"), (d, "dst")), llm_error(S.LLM_PARAM_INVALID):
            d.call(v1.pull_cache, key, "dst", 0)


def test_pull_cache_with_src_and_dst_offsets(pair_v1: V1) -> None:
    p, d = pair_v1.prefill, pair_v1.decode
    # P: two caches with the same bytes, batch 2, 64 bytes per slot: id 1 unkeyed, id 2 keyed in slot 1
    # (a pull by id would release a key bound to the slot it reads)
    p.call(v1.allocate, "c", 2, (2, 64), seed=3)
    p.call(v1.allocate, "ck", 2, (2, 64), keys=[CacheKey(PROMPT_ID, 2**64 - 1), CacheKey(PROMPT_ID, 9)], seed=3)
    d.call(v1.allocate, "dst", 2, (2, 64))
    d.call(v1.zero, "dst")
    pair_v1.link()
    # by id: 24 bytes from offset 16 of remote slot 1 into offset 8 of local slot 1
    moved((p, "c"), (d, "dst"),
          lambda: d.call(v1.pull_cache, CacheKeyByIdAndIndex(PROMPT_ID, 1, 1), "dst", 1, 24,
                         src_cache_offset=16, dst_cache_offset=8),
          byte_ranges([(64 + 16, 64 + 8, 24)]))
    # size -1 with only a dst offset: the rest of the local slot, from the start of the remote slot
    d.call(v1.zero, "dst")
    moved((p, "c"), (d, "dst"),
          lambda: d.call(v1.pull_cache, CacheKeyByIdAndIndex(PROMPT_ID, 1, 0), "dst", 0, dst_cache_offset=48),
          byte_ranges([(0, 48, 16)]))
    # by request key: offsets are relative to the keyed slot (remote slot 1)
    d.call(v1.zero, "dst")
    moved((p, "ck"), (d, "dst"),
          lambda: d.call(v1.pull_cache, CacheKey(PROMPT_ID, 9), "dst", 0, 8, src_cache_offset=4, dst_cache_offset=-1),
          byte_ranges([(64 + 4, 0, 8)]))
    # ... and the successful pull consumed the key
    with unchanged((p, "ck"), (d, "dst")), llm_error(S.LLM_KV_CACHE_NOT_EXIST):
        d.call(v1.pull_cache, CacheKey(PROMPT_ID, 9), "dst", 0, 8, src_cache_offset=0)
    bad: list[dict[str, Any]] = [
        dict(dst_cache_offset=60, size=8),  # past the local slot
        dict(src_cache_offset=60, size=8),  # past the remote slot (checked by the peer)
        dict(src_cache_offset=-2),
        dict(dst_cache_offset=64),  # nothing left of the slot
        dict(src_cache_offset=0, batch_index=2),
        dict(src_cache_offset=0, bogus=1),
    ]
    for kwargs in bad:
        with unchanged((p, "c"), (d, "dst")), llm_error(S.LLM_PARAM_INVALID):
            d.call(v1.pull_cache, CacheKeyByIdAndIndex(PROMPT_ID, 1, 0), "dst", **kwargs)
    with unchanged((p, "c"), (d, "dst")), raises(TypeError):
        d.call(v1.pull_cache, CacheKeyByIdAndIndex(PROMPT_ID, 1, 0), "dst", src_cache_offset="1")
    with unchanged((p, "c"), (d, "dst")), raises(ValueError):
        d.call(v1.pull_cache, CacheKeyByIdAndIndex(PROMPT_ID, 1, 0), "dst", dst_cache_offset=2**63)


def test_pull_blocks_list_rules_and_bytes(pair_v1: V1) -> None:
    p, d = pair_v1.prefill, pair_v1.decode
    key = BlocksCacheKey(PROMPT_ID, 0)
    p.call(v1.allocate_blocks, "blk", 2, (8, 32), key=key, seed=7)
    d.call(v1.allocate_blocks, "blk", 2, (8, 32))
    d.call(v1.zero, "blk")
    d.call(v1.allocate, "contig", 2, (8, 32))
    pair_v1.link()
    moved((p, "blk"), (d, "blk"), lambda: d.call(v1.pull_blocks, key, "blk", [0, 3, 4], [5, 6, 7]),
          rows([(0, 5), (3, 6), (4, 7)]))
    # layer ranges: tensor 1 only (one tensor per layer)
    d.call(v1.zero, "blk")
    moved((p, "blk"), (d, "blk"),
          lambda: d.call(v1.pull_blocks, key, "blk", [2], [2], src_layer_range=range(1, 2),
                         dst_layer_range=range(1, 2), tensor_num_per_layer=1),
          rows([(2, 2)], tensors=[(1, 1)]))
    type_errors: list[tuple[Any, str | None, Any, Any]] = [
        (key, "blk", (0,), [1]),  # both lists must be list objects
        (key, "blk", [0], (1,)),
        (key, "blk", [0], ["1"]),
        (CacheKey(PROMPT_ID, 1), "blk", [0], [1]),  # v1: BlocksCacheKey only
        (key, None, [0], [1]),
    ]
    for args in type_errors:
        with unchanged((p, "blk"), (d, "blk")), raises(TypeError):
            d.call(v1.pull_blocks, *args)
    invalid: list[tuple[str, list[int], list[int], dict[str, int]]] = [
        ("blk", [], [], {}),
        ("blk", [0], [], {}),
        ("blk", [0, 1], [1], {}),
        ("blk", [0], [8], {}),  # outside the local cache
        ("contig", [0], [1], {}),  # not a blocks cache
        ("blk", [0], [1], {"bogus": 1}),
    ]
    for name, src, dst, kwargs in invalid:
        with unchanged((p, "blk"), (d, "blk")), llm_error(S.LLM_PARAM_INVALID):
            d.call(v1.pull_blocks, key, name, src, dst, **kwargs)
    with unchanged((p, "blk"), (d, "blk")), llm_error(S.LLM_KV_CACHE_NOT_EXIST):
        # no blocks cache under model 1 on the prompt
        d.call(v1.pull_blocks, BlocksCacheKey(PROMPT_ID, 1), "blk", [0], [1])


# ---------------------------------------------------------------------------- role rules


def test_role_rules(pair_v1: V1) -> None:
    p, d = pair_v1.prefill, pair_v1.decode
    shape = (2, 16)
    p.call(v1.allocate, "pc", 1, shape, keys=[CacheKey(PROMPT_ID, 1)])
    p.call(v1.allocate_blocks, "pb", 1, shape, key=BlocksCacheKey(PROMPT_ID, 0))
    d.call(v1.allocate, "dc", 1, shape)
    d.call(v1.allocate_blocks, "db", 1, shape)
    pair_v1.link()
    # PROMPT may not pull, link or check links
    with unchanged((p, "pc"), (d, "dc")), llm_error(S.LLM_PARAM_INVALID, match="LLMRole.DECODER"):
        p.call(v1.pull_cache, CacheKeyByIdAndIndex(DECODER_ID, 1, 0), "pc")
    with unchanged((p, "pb"), (d, "db")), llm_error(S.LLM_PARAM_INVALID, match="LLMRole.DECODER"):
        p.call(v1.pull_blocks, BlocksCacheKey(DECODER_ID, 0), "pb", [0], [0])
    with llm_error(S.LLM_PARAM_INVALID, match="LLMRole.DECODER"):
        p.call(v1.check_link_status, DECODER_ID)
    assert p.call(v1.link_clusters, [(DECODER_ID, [1])], 1000) == (S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID])
    assert p.call(v1.link_clusters, [(DECODER_ID, [1]), (3, [1])], 1000) == (
        S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID] * 2)
    with raises(TypeError):  # argument types are still checked first
        p.call(v1.link_clusters_as_given, ["x"], 1000)
    # DECODER may not publish keys
    with llm_error(S.LLM_PARAM_INVALID, match="LLMRole.PROMPT"):
        d.call(v1.allocate, "x", 1, shape, keys=[CacheKey(DECODER_ID, 1)])
    with llm_error(S.LLM_PARAM_INVALID, match="LLMRole.PROMPT"):
        d.call(v1.allocate_blocks, "x", 1, shape, key=BlocksCacheKey(DECODER_ID, 0))
    with llm_error(S.LLM_PARAM_INVALID, match="LLMRole.PROMPT"):
        d.call(v1.remove_cache_key, CacheKey(DECODER_ID, 1))
    assert d.call(v1.cache_count) == 2  # the refused allocations left nothing behind
    # device pool only; num_tensors > 0; the HOST handle of create_cpu_cache cannot be freed here
    for who in (p, d):
        with llm_error(S.LLM_PARAM_INVALID):
            who.call(v1.allocate, "x", 1, shape, placement=Placement.HOST)
        with llm_error(S.LLM_PARAM_INVALID):
            who.call(v1.allocate_blocks, "x", 0, shape)
        with llm_error(S.LLM_PARAM_INVALID):
            who.call(v1.deallocate_cpu_handle)
        with raises(TypeError):
            who.call(v1.allocate_as_given, "desc")
        with raises(TypeError):
            who.call(v1.deallocate_as_given, None)
    # deallocate: both kinds, either role; a second time is KV_CACHE_NOT_EXIST
    d.call(v1.deallocate, "dc")
    d.call(v1.deallocate, "db")
    assert (d.call(v1.device_addrs, "dc"), d.call(v1.cache_count)) == ([], 0)
    with llm_error(S.LLM_KV_CACHE_NOT_EXIST):
        d.call(v1.deallocate, "dc")
    # the prompt may unlink (cleanup after a dead decoder); the decoder sees the link gone
    assert p.call(v1.unlink, DECODER_ID, [], 2000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    wait_until(lambda: d.call(v1.links) == [], 5.0, "the decoder saw the link gone")
    # one LLMException class in both modes, a subclass of RuntimeError
    assert p.call(v1.exception_class) == ("pdlink.status", True)


def test_check_link_status(peers: Callable[..., Peer], backend: str) -> None:
    pd = V1(peers, backend, timeout=300)
    d = pd.decode
    with llm_error(S.LLM_NOT_YET_LINK):
        d.call(v1.check_link_status, PROMPT_ID)
    with raises(TypeError):
        d.call(v1.check_link_status, str(PROMPT_ID))
    with raises(ValueError):
        d.call(v1.check_link_status, -1)
    pd.link()
    assert d.call(v1.check_link_status, PROMPT_ID) is None
    with llm_error(S.LLM_NOT_YET_LINK):
        d.call(v1.check_link_status, 77)
    # a frozen peer: bounded by llm.SyncKvCacheWaitTime (300 ms)
    pd.prefill.freeze()
    try:
        with llm_error(S.LLM_TIMEOUT):  # the peer cannot answer: only the timeout ends the call
            d.call_within(hang_guard(300), v1.check_link_status, PROMPT_ID)
    finally:
        pd.prefill.thaw()
    pd.prefill.kill()
    with llm_error(S.LLM_LINK_FAILED):  # the dead peer's sockets are closed: no waiting
        d.call(v1.check_link_status, PROMPT_ID)
    # the dead peer's link is cleaned up by unlinking, after which it is simply not linked
    assert d.call(v1.unlink, PROMPT_ID, pd.ports, 1000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    with llm_error(S.LLM_NOT_YET_LINK):
        d.call(v1.check_link_status, PROMPT_ID)


# ---------------------------------------------------------------------------- switch_role


def test_switch_role_error_codes(peers: Callable[..., Peer], backend: str) -> None:
    pd = V1(peers, backend, switch=True)
    p, d = pd.prefill, pd.decode
    for args in [(2,), ("PROMPT",), (LLMRole.PROMPT, "x"), (LLMRole.PROMPT, {"llm.listenIpInfo": 1}), (None,)]:
        with raises(TypeError):
            d.call(v1.switch_role, *args)
    with llm_error(S.LLM_PARAM_INVALID):  # same role
        d.call(v1.switch_role, LLMRole.DECODER)
    with llm_error(S.LLM_PARAM_INVALID):
        p.call(v1.switch_role, LLMRole.PROMPT, LISTEN)
    for opts in (None, {}, {"llm.SyncKvCacheWaitTime": "1000"}, {"llm.listenIpInfo": "127.0.0.1"},
                 {"llm.listenIpInfo": ""}):
        with llm_error(S.LLM_PARAM_INVALID):  # to PROMPT without a valid listen address
            d.call(v1.switch_role, LLMRole.PROMPT, opts)
    pd.link()
    with llm_error(S.LLM_EXIST_LINK):
        d.call(v1.switch_role, LLMRole.PROMPT, LISTEN)
    with llm_error(S.LLM_EXIST_LINK):  # the prompt holds the passive end of the link
        p.call(v1.switch_role, LLMRole.DECODER)
    assert d.call(v1.roles)[:2] == (2, 2) and p.call(v1.listen_port) == pd.ports[0]
    # without llm.EnableSwitchRole: FEATURE_NOT_ENABLED (after the Python-side checks)
    d.call(v1.unlink, PROMPT_ID, pd.ports, 2000)
    d.call(v1.finalize)
    d.call(v1.start, "decoder", DECODER_ID)
    with llm_error(S.LLM_PARAM_INVALID):
        d.call(v1.switch_role, LLMRole.DECODER)
    with llm_error(S.LLM_PARAM_INVALID):
        d.call(v1.switch_role, LLMRole.PROMPT)
    with llm_error(S.LLM_FEATURE_NOT_ENABLED, match="enable_switch_role"):
        d.call(v1.switch_role, LLMRole.PROMPT, LISTEN)
    assert d.call(v1.roles) == (2, 2, 0)  # (role, the manager's role, listen port): unchanged


def test_switch_role_swaps_and_pulls_the_other_way(peers: Callable[..., Peer], backend: str) -> None:
    pd = V1(peers, backend, switch=True)
    p, d = pd.prefill, pd.decode
    p.call(v1.allocate_blocks, "pblk", 2, (4, 32), key=BlocksCacheKey(PROMPT_ID, 0), seed=1)
    d.call(v1.allocate_blocks, "dblk", 2, (4, 32))
    d.call(v1.zero, "dblk")
    pd.link()
    moved((p, "pblk"), (d, "dblk"),
          lambda: d.call(v1.pull_blocks, BlocksCacheKey(PROMPT_ID, 0), "dblk", [1], [1]), rows([(1, 1)]))
    pulled_before = d.call(v1.read, "dblk")
    pd.unlink()
    # swap: old prompt stops listening, old decoder listens
    p.call(v1.switch_role, LLMRole.DECODER)
    assert p.call(v1.roles) == (2, 2, 0)
    d.call(v1.switch_role, LLMRole.PROMPT, LISTEN)
    role, manager_role, new_port = d.call(v1.roles)
    assert new_port > 0 and (role, manager_role) == (1, 1)
    # role rules follow the new roles
    with unchanged((p, "pblk"), (d, "dblk")), llm_error(S.LLM_PARAM_INVALID):
        d.call(v1.pull_blocks, BlocksCacheKey(PROMPT_ID, 0), "dblk", [0], [0])
    with llm_error(S.LLM_PARAM_INVALID):
        p.call(v1.allocate, "x", 1, (1, 8), keys=[CacheKey(PROMPT_ID, 1)])
    # the new prompt publishes; the new decoder links and pulls into its old (still valid) cache
    d.call(v1.allocate_blocks, "nblk", 2, (4, 32), key=BlocksCacheKey(DECODER_ID, 0), seed=9)
    assert p.call(v1.link, DECODER_ID, [new_port]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    # remote blocks 2, 3 -> local 0, 1; every other byte (local blocks 2, 3 among them) unchanged
    moved((d, "nblk"), (p, "pblk"),
          lambda: p.call(v1.pull_blocks, BlocksCacheKey(DECODER_ID, 0), "pblk", [2, 3], [0, 1]),
          rows([(2, 0), (3, 1)]))
    # the old decoder's cache also survived the switch: it still holds the block pulled before
    assert [t.tobytes() for t in d.call(v1.read, "dblk")] == [t.tobytes() for t in pulled_before]
    assert p.call(v1.check_link_status, DECODER_ID) is None


# ---------------------------------------------------------------------------- handles and tensors


def test_get_cache_tensors_view_semantics(peers: Callable[..., Peer]) -> None:
    import numpy as np

    p = peers("v1-tensors")
    p.call(v1.start, "decoder", DECODER_ID)
    p.call(v1.allocate, "c", 2, (2, 4), DataType.DT_FLOAT16)
    p.call(v1.zero, "c")
    assert p.call(v1.cache_tensors, "c", 1) == 1
    # (a llm_datadist Tensor, the manager a KvCacheManager, the view's shape and dtype, the desc's shape)
    assert p.call(v1.view) == (True, True, (2, 4), "float16", [2, 4])
    # writes through the view land in the cache; writes to the cache show through the view
    p.call(v1.view_set, 1, 2, 3.5)
    raw = p.call(v1.read, "c")
    assert not raw[0].any()
    assert raw[1].view(np.float16).reshape(2, 4)[1, 2] == 3.5 and raw[1].view(np.float16).sum() == 3.5
    p.call(v1.poke, "c", 1, 0, np.array([7.0], dtype=np.float16).tobytes())
    assert p.call(v1.view_get, 0, 0) == 7.0
    assert p.call(v1.tensor_values, "c")[0][0] == 0.0  # tensor_index defaults to 0
    p.call(v1.copy_of_kept_tensor_set, 0, 0, 1.0)
    assert p.call(v1.view_get, 0, 0) == 7.0
    with llm_error(S.LLM_PARAM_INVALID):
        p.call(v1.cache_tensors, "c", 2)
    with raises(TypeError):
        p.call(v1.cache_tensors, "c", "0")
    # BF16 comes back as float32 values (numpy has no bfloat16), as in llm_datadist
    p.call(v1.allocate, "b", 1, (3,), DataType.DT_BF16)
    p.call(v1.poke, "b", 0, 0, np.array([0x3F80, 0x4040, 0xBF00], dtype=np.uint16).tobytes())
    assert p.call(v1.tensor_values, "b") == [1.0, 3.0, -0.5]
    # after deallocation the tensors refuse to expose the memory
    p.call(v1.deallocate, "c")
    with llm_error(S.LLM_PARAM_INVALID):
        p.call(v1.kept_tensor_numpy)
    with llm_error(S.LLM_PARAM_INVALID):
        p.call(v1.cache_tensors, "c")
    # a tensor keeps an otherwise unreferenced handle alive; dropping it frees the cache
    p.call(v1.hold_tensor_of_unreferenced_cache, 1, (4,), DataType.DT_INT32)
    assert p.call(v1.cache_count) == 2  # b and the one behind the tensor
    p.call(v1.write_held_tensor_and_drop, 5)
    assert p.call(v1.cache_count) == 1
    # user tensors over numpy arrays
    assert p.call(v1.user_tensor) == (9, DataType.DT_INT32, [[9, 1, 2], [3, 4, 5]],
                                      "TensorDesc(dtype=DataType.DT_FLOAT, shape=[1, 2])")
    expected = {"transposed array": RuntimeError, "desc of another shape": RuntimeError,
                "desc of another dtype": RuntimeError, "a list": TypeError, "a str desc": TypeError,
                "a str dtype": TypeError, "a str dim": TypeError, "numpy(1)": TypeError}
    assert set(expected) == set(v1.TENSOR_CASES)
    for case, exc in expected.items():
        with raises(exc):
            p.call(v1.bad_tensor, case)


def _exit_cleanly(kind: str, backend: str) -> None:
    """``python -m peers.v1 <kind>``: live handles at interpreter exit give no error output."""
    import pdlink

    tests = str(TESTS)
    package = os.path.dirname(os.path.dirname(os.path.abspath(pdlink.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package, tests]), **peer_env(backend))
    r = subprocess.run([sys.executable, "-m", "peers.v1", kind], capture_output=True, text=True, timeout=60, env=env,
                       cwd=tests)
    assert r.returncode == 0 and "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_kv_cache_del_deallocates(pair_v1: V1, backend: str) -> None:
    p, d = pair_v1.prefill, pair_v1.decode
    p.call(v1.catch_unraisable)
    p.call(v1.allocate, "c", 1, (1, 64))
    assert p.call(v1.cache_count) == 1
    p.call(v1.drop, "c")
    assert p.call(v1.cache_count) == 0
    # a keyed cache: the finalizer drops only the id reference; the key keeps it until pulled
    p.call(v1.allocate, "c", 1, (1, 64), keys=[CacheKey(PROMPT_ID, 5)], seed=4)
    p.call(v1.drop, "c")
    assert p.call(v1.cache_count) == 1
    d.call(v1.allocate, "dst", 1, (1, 64))
    pair_v1.link()
    moved((p, "c"), (d, "dst"), lambda: d.call(v1.pull_cache, CacheKey(PROMPT_ID, 5), "dst"), rows([(0, 0)]))
    wait_until(lambda: p.call(v1.cache_count) == 0, 5.0, "the cache freed once its key was pulled")
    # an explicitly freed handle, a handle in a reference cycle, and handles that outlive finalize
    p.call(v1.deallocate_then_drop, 1, (1, 64))
    p.call(v1.drop_cycle, 1, (1, 64))
    assert p.call(v1.cache_count) == 0
    assert p.call(v1.finalize_with_live_handles, 3, (1, 64)) is False  # the old manager is not initialised
    assert p.call(v1.unraisable) == []
    # interpreter exit with live handles and an initialised engine: no error output, exit code 0
    _exit_cleanly("exit-single", backend)
    # same with a two-device manager that is still initialised when the interpreter exits
    _exit_cleanly("exit-two-devices", backend)


def test_wrong_manager_access(peers: Callable[..., Peer]) -> None:
    p = peers("v1-managers")
    p.call(v1.start, "decoder", DECODER_ID, name="dd1")
    p.call(v1.allocate, "old", 1, (1, 64))
    with llm_error(S.LLM_PARAM_INVALID, match="kv_cache_manager"):
        p.call(v1.cache_manager)
    with llm_error(S.LLM_PARAM_INVALID):
        p.call(v1.comm_link, "c", {1: 0, 2: 1}, "{}")
    with llm_error(S.LLM_PARAM_INVALID):
        p.call(v1.query_register_mem_status, 1)
    p.call(v1.finalize)
    assert p.call(v1.is_initialized) is False
    not_initialized = "llm datadist is not initialized"
    with raises(RuntimeError, message=not_initialized):
        p.call(v1.allocate, "x", 1, (1, 64))
    with raises(RuntimeError, message=not_initialized):
        p.call(v1.deallocate, "old")
    with raises(RuntimeError, message=not_initialized):
        p.call(v1.kv_cache_manager)
    with raises(RuntimeError, message=not_initialized):
        p.call(v1.check_link_status, 1)
    # a new instance reuses cache id 1; the old handle (also id 1) must not reach the new cache
    p.call(v1.start, "decoder", DECODER_ID, name="dd2")
    p.call(v1.allocate, "new", 1, (1, 64))
    assert (p.call(v1.cache_id, "old"), p.call(v1.cache_id, "new"), p.call(v1.is_initialized)) == (1, 1, True)
    with llm_error(S.LLM_KV_CACHE_NOT_EXIST):
        p.call(v1.deallocate, "old")
    with llm_error(S.LLM_PARAM_INVALID):
        p.call(v1.copy_cache, "new", "old")
    with llm_error(S.LLM_PARAM_INVALID):
        p.call(v1.cache_tensors, "old")
    with llm_error(S.LLM_PARAM_INVALID):
        p.call(v1.pull_cache, CacheKeyByIdAndIndex(1, 1, 0), "old")
    # a forged handle with the live id is refused too
    with llm_error(S.LLM_KV_CACHE_NOT_EXIST):
        p.call(v1.deallocate_forged, "new")
    assert (p.call(v1.cache_count), p.call(v1.device_addrs, "new") != []) == (1, True)
    # v2 handles are not v1 handles and vice versa
    with raises(TypeError):
        p.call(v1.deallocate_v2_handle)
    p.call(v1.finalize)
    p.call(v1.start_cache_manager_mode, "decoder", DECODER_ID, name="dd3", pool=1 << 20)
    with raises(TypeError):
        p.call(v1.deallocate, "new")  # the CacheManager's deallocate_cache, given a KvCache
    with llm_error(S.LLM_PARAM_INVALID):
        p.call(v1.kv_cache_manager)
    with llm_error(S.LLM_PARAM_INVALID):
        p.call(v1.check_link_status, 1)


def test_local_copies_and_swaps(peers: Callable[..., Peer], backend: str) -> None:
    p = peers("v1-local", env=peer_env(backend))
    p.call(v1.start, "decoder", DECODER_ID, pool=v1.POOL)
    p.call(v1.allocate, "a", 2, (2, 32), seed=1)
    p.call(v1.allocate, "b", 2, (3, 32))
    p.call(v1.zero, "b")
    # slot 1 of a, from byte 8, 16 bytes -> slot 2 of b, from byte 8
    moved_within(p, "a", "b", lambda: p.call(v1.copy_cache, "b", "a", 2, 1, 8, 16),
                 byte_ranges([(32 + 8, 64 + 8, 16)]))
    with unchanged((p, "b")), raises(ValueError):
        p.call(v1.copy_cache, "b", "a", offset=-1)
    with unchanged((p, "b")), llm_error(S.LLM_PARAM_INVALID):
        p.call(v1.copy_cache, "b", "a", size=0)
    p.call(v1.allocate_blocks, "blk", 1, (4, 16), seed=2)
    moved_within(p, "blk", "blk", lambda: p.call(v1.copy_blocks, "blk", {0: [2, 3]}), rows([(0, 2), (0, 3)]))
    with unchanged((p, "blk")), raises(TypeError):
        p.call(v1.copy_blocks, "blk", {0: (2,)})
    # swap out to host memory and back in (create_cpu_cache handles, over guarded host memory)
    p.call(v1.cpu_cache, "hc", 1, (4, 16))
    moved((p, "blk"), (p, "hc"), lambda: p.call(v1.swap_blocks, "blk", "hc", {1: 3}), rows([(1, 3)]))
    p.call(v1.poke, "hc", 0, 0, bytes([42] * 16))
    moved((p, "hc"), (p, "blk"), lambda: p.call(v1.swap_blocks, "hc", "blk", {0: 1}), rows([(0, 1)]))
    assert p.call(v1.read, "blk")[0][16:32].tolist() == [42] * 16
    with unchanged((p, "blk"), (p, "hc")), llm_error(S.LLM_PARAM_INVALID):
        p.call(v1.swap_blocks, "blk", "blk", {0: 1})  # DEVICE -> DEVICE
    with unchanged((p, "blk"), (p, "hc")), llm_error(S.LLM_PARAM_INVALID):
        p.call(v1.swap_blocks, "blk", "hc", {4: 0})
    with unchanged((p, "blk"), (p, "hc")), raises(AttributeError):
        p.call(v1.swap_blocks, None, "hc", {0: 0})


def test_pool_sizing(peers: Callable[..., Peer]) -> None:
    p = peers("v1-pool")
    before = p.call(v1.rss_mib)
    p.call(v1.start, "prompt", PROMPT_ID, listen=1)
    p.call(v1.allocate, "big", 1, (900, 1 << 20))
    grown = p.call(v1.rss_mib) - before
    # the default pool is 1 GiB and mapped lazily: 900 MiB fit, but cost (almost) nothing until touched
    assert grown < 64, grown
    with llm_error(S.LLM_OUT_OF_MEMORY):
        p.call(v1.allocate, "x", 1, (200, 1 << 20))
    for opts, fits, too_big in [({"mem_max": 1 << 20}, 1 << 19, 2 << 20), ({"pool": 4 << 20}, 3 << 20, 2 << 20)]:
        p.call(v1.finalize)
        p.call(v1.start, "prompt", PROMPT_ID, listen=1, **opts)
        p.call(v1.allocate, "ok", 1, (fits,))
        with llm_error(S.LLM_OUT_OF_MEMORY):
            p.call(v1.allocate, "x", 1, (too_big,))
        # a failed allocation consumes no cache id
        assert p.call(v1.allocate, "small", 1, (16,)) == 2


# ---------------------------------------------------------------------------- multi-device


def test_multi_device_allocation_and_pull(peers: Callable[..., Peer], backend: str) -> None:
    pd = V1(peers, backend, devices=[0, 1], switch=True)
    p, d = pd.prefill, pd.decode
    assert len(set(pd.ports)) == 2
    assert (p.call(v1.listen_port), p.call(v1.num_devices)) == (pd.ports[0], 2)
    with llm_error(S.LLM_PARAM_INVALID):  # one remote_ip_info per device
        d.call(v1.link, PROMPT_ID, [pd.ports[0]], 2000)
    # device 1 cannot reach its peer: the cluster is linked on no device (device 0's link is undone)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    assert d.call(v1.link, PROMPT_ID, [pd.ports[0], closed_port], 2000) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert d.call(v1.links) == []
    wait_until(lambda: p.call(v1.links) == [], 5.0, "the prompt dropped device 0's undone link")
    pd.link()
    assert sorted(link["device_index"] for link in d.call(v1.links)) == [0, 1]
    assert d.call(v1.check_link_status, PROMPT_ID) is None
    p.call(v1.allocate, "c", 2, (2, 64), keys=[CacheKey(PROMPT_ID, 2**64 - 1), CacheKey(PROMPT_ID, 7)])
    p.call(v1.allocate_blocks, "blk", 2, (4, 32), key=BlocksCacheKey(PROMPT_ID, 0))
    for dev in (0, 1):
        p.call(v1.write, "c", 10 + dev, dev)
        p.call(v1.write, "blk", 20 + dev, dev)
    assert (p.call(v1.cache_id, "c"), p.call(v1.cache_id, "blk"), p.call(v1.cache_counts)) == (1, 2, [2, 2])
    addrs = p.call(v1.device_addrs, "c")
    assert len(addrs) == 2 and len(addrs[0]) == len(addrs[1]) == 2 and set(addrs[0]).isdisjoint(addrs[1])
    d.call(v1.allocate, "dst", 2, (1, 64))
    d.call(v1.zero, "dst")
    d.call(v1.allocate_blocks, "dblk", 2, (4, 32))
    d.call(v1.zero, "dblk")
    # device i pulls from the prompt's device i (each device's source holds its own seed)
    moved_on_devices((p, "c"), (d, "dst"), lambda: d.call(v1.pull_cache, CacheKey(PROMPT_ID, 7), "dst", 0),
                     rows([(1, 0)]))
    moved_on_devices((p, "blk"), (d, "dblk"),
                     lambda: d.call(v1.pull_blocks, BlocksCacheKey(PROMPT_ID, 0), "dblk", [3], [0]), rows([(3, 0)]))
    # the key was consumed on both devices
    with unchanged((p, "c", 0), (p, "c", 1), (d, "dst", 0), (d, "dst", 1)), llm_error(S.LLM_KV_CACHE_NOT_EXIST):
        d.call(v1.pull_cache, CacheKey(PROMPT_ID, 7), "dst", 0)
    # get_cache_tensors gives one tensor per device, each over its own device's memory
    # (on Ascend numpy() reads the device memory through the backend, as a copy)
    sources = [snap((p, "c", dev)) for dev in (0, 1)]
    assert d.call(v1.tensor_bytes, "dst", 1) == [src.tensor(1)[64:].tobytes() for src in sources]
    # switch_role is not available in multi-device mode, even with enable_switch_role
    pd.unlink()
    with llm_error(S.LLM_FEATURE_NOT_ENABLED, match="multi-device"):
        d.call(v1.switch_role, LLMRole.PROMPT, LISTEN)
    with llm_error(S.LLM_FEATURE_NOT_ENABLED):
        p.call(v1.switch_role, LLMRole.DECODER)
    # deallocation fans out to every device
    p.call(v1.deallocate, "c")
    p.call(v1.deallocate, "blk")
    wait_until(lambda: p.call(v1.cache_counts) == [0, 0], 5.0, "every device's caches freed")
    # a swap needs host addresses for every device
    d.call(v1.cpu_cache, "one-device", 2, (4, 32), flat=True)
    with unchanged((d, "dblk", 0), (d, "dblk", 1), (d, "one-device")), llm_error(S.LLM_PARAM_INVALID):
        d.call(v1.swap_blocks, "dblk", "one-device", {0: 0})
    d.call(v1.cpu_cache, "host", 2, (4, 32), devices=2)
    moved_on_devices((d, "dblk"), (d, "host"), lambda: d.call(v1.swap_blocks, "dblk", "host", {0: 1}), rows([(0, 1)]))


def test_multi_device_partial_allocation_failure_rolls_back(peers: Callable[..., Peer]) -> None:
    """Device 1's pool is smaller: an allocation that fits only device 0 fails with OUT_OF_MEMORY,
    leaves nothing (and no key) behind, and cache ids stay equal across devices."""
    p = peers("v1-rollback")
    p.call(v1.bare_start, [1 << 22, 1 << 20])
    with llm_error(S.LLM_OUT_OF_MEMORY):
        p.call(v1.allocate, "x", 1, (2 << 20,), keys=[CacheKey(9, 5)])
    assert p.call(v1.cache_counts) == [0, 0]
    p.call(v1.allocate, "kv", 1, (64,), keys=[CacheKey(9, 5)])  # the key is free again
    assert (p.call(v1.cache_id, "kv"), p.call(v1.device_cache_ids, "kv")) == (2, [2, 2])
    p.call(v1.deallocate, "kv")
    p.call(v1.remove_cache_key, CacheKey(9, 5))
    assert p.call(v1.cache_counts) == [0, 0]
    p.call(v1.bare_close)


def _linked_src_and_dst(pair: V1) -> tuple[Peer, Peer, Any]:
    """The pair linked, a seeded 4-block cache "src" on the prefill, a zeroed one "dst" on the decoder;
    returns (prefill, decoder, dst's device addresses)."""
    p, d = pair.prefill, pair.decode
    p.call(v1.allocate, "src", 4, (1, 256), seed=7)
    d.call(v1.allocate, "dst", 4, (1, 256))
    d.call(v1.zero, "dst")
    pair.link()
    return p, d, d.call(v1.device_addrs, "dst")[0]


def test_v1_finalize_stops_a_transfer_cache_async_task(pair_v1: V1) -> None:
    """A v1 task whose layer 0 waits at its synchronizer when the prefill is finalized ends with
    LLM_PARAM_INVALID (the original's code for a push after finalize) once the layer is released,
    and nothing moves."""
    p, d, dst_addrs = _linked_src_and_dst(pair_v1)
    with unchanged((d, "dst")):
        p.call(v1.transfer_cache_async, "held", "src", DECODER_ID, dst_addrs, gated=True)
        p.call(v1.finalize)
        p.call(v1.open_gate)
        assert p.call_within(hang_guard(5000), v1.synchronize, "held", 5000) == S.LLM_PARAM_INVALID
        assert p.call(v1.task_results, "held") == [S.LLM_PARAM_INVALID]


def test_v1_transfer_cache_async_into_raw_decoder_addresses(pair_v1: V1) -> None:
    """v1 transfer_cache_async: PROMPT only, TransferConfig only, WAIT_PROCESS_TIMEOUT on timeout."""
    p, d, dst_addrs = _linked_src_and_dst(pair_v1)

    def transfer() -> None:
        p.call(v1.transfer_cache_async, "task", "src", DECODER_ID, dst_addrs)
        assert p.call_within(hang_guard(5000), v1.synchronize, "task", 5000) == S.LLM_SUCCESS
        assert p.call(v1.task_results, "task") == [S.LLM_SUCCESS]

    moved((p, "src"), (d, "dst"), transfer, rows([(0, 0)]))
    # a keyed config is a CacheManager-mode feature: TypeError here
    with unchanged((p, "src"), (d, "dst")), raises(TypeError):
        p.call(v1.transfer_with_cache_key_config, "src", BlocksCacheKey(DECODER_ID, 0))
    # the timeout code of v1 tasks: every layer waits for the gate
    d.call(v1.zero, "dst")
    p.call(v1.transfer_cache_async, "slow", "src", DECODER_ID, dst_addrs, gated=True)
    assert p.call_within(hang_guard(100), v1.synchronize, "slow", 100) == S.LLM_WAIT_PROCESS_TIMEOUT

    def open_and_wait() -> None:
        p.call(v1.open_gate)
        assert p.call_within(hang_guard(5000), v1.synchronize, "slow", 5000) == S.LLM_SUCCESS

    moved((p, "src"), (d, "dst"), open_and_wait, rows([(0, 0)]))
    # DECODER may not call it
    with unchanged((d, "dst")), llm_error(S.LLM_PARAM_INVALID):
        d.call(v1.transfer_without_configs, "dst")
