"""Error paths of the public API (llm_datadist_api.md §3, §6, §8, §10), cross-process wherever a peer is involved.

Every failure is checked by exception *type*, and ``LLMException`` by ``status_code``. A refused
transfer changes no byte of any cache on either side (tensors, guards, the rest of a pool); after
errors on a link, a correct transfer is run to show that the link is still usable, with the whole
destination checked. Calls with wrong arguments are made in the peer by ``peers/api_errors.py``,
which passes the test's arguments through unchanged (``Named("blk")`` stands for the peer's cache).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from conftest import DECODER_ID, PROMPT_ID, Pair, moved
from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMDataDist,
    LLMRole,
)
from pdlink import LLMException, LLMStatusCode
from peer import Peer
from peers import api_errors, kv
from peers.api_errors import Named
from poll import hang_guard, wait_until
from verify import Snapshot, assert_same, nothing, rows

S = LLMStatusCode
KEY = Pair.KEY  # BlocksCacheKey(1, 0): the prompt's blocks cache
DKEY = BlocksCacheKey(DECODER_ID, 0)  # the decoder's
SHAPE = (8, 64)  # 8 blocks of 64 float16 (128 B) per tensor
BLK, C = Named("blk"), Named("c")
CACHES = ("blk", "c")  # what setup_both registers on each side

# a call to make in a peer: function, positional and keyword arguments
Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def cm(method: str, *args: Any, **kwargs: Any) -> Call:
    """``cache_manager.<method>(...)`` in the peer, arguments as given (``Named``: a cache)."""
    return api_errors.manager, (method, *args), kwargs


def dd(method: str, *args: Any, **kwargs: Any) -> Call:
    """``LLMDataDist.<method>(...)`` on the peer's engine, arguments as given."""
    return api_errors.datadist, ("kv", method, *args), kwargs


def new(fn: Callable[..., Any], *args: Any) -> Call:
    """``fn(*args)`` (a constructor) in the peer."""
    return fn, args, {}


def run(peer: Peer, call: Call) -> Any:
    fn, args, kwargs = call
    return peer.call(fn, *args, **kwargs)


def describe(call: Call) -> str:
    fn, args, kwargs = call
    return f"{getattr(fn, '__name__', fn)}{args}{kwargs or ''}"


# pdlink.Engine's advice in its error messages, which llm_datadist's must never carry.
ENGINE_WORDS = ("; connect first", "disconnect, then connect again", "disconnect them first", "connect on that side",
                "disconnect on that side", "close the engine and open a new one")


@contextmanager
def llm_error(code: LLMStatusCode, op: str | None = None) -> Iterator[pytest.ExceptionInfo[LLMException]]:
    """Expect an ``LLMException`` of exactly that class with ``status_code == code`` (and, for native failures, a
    message that starts with ``"<op> failed, error code is <code>"``)."""
    with pytest.raises(LLMException) as info:
        yield info
    assert type(info.value) is LLMException, type(info.value)  # as CANN's: never a subclass (docs/compatibility.md)
    assert info.value.status_code == code, f"{info.value.status_code}: {info.value}"
    # llm_datadist's own words: no advice in pdlink.Engine's ("connect first")
    text = str(info.value)
    assert not any(words in text for words in ENGINE_WORDS), text
    if code == LLMStatusCode.LLM_NOT_YET_LINK and "no link to" in text:
        assert text.endswith("; call link_clusters first."), text
    if op is not None:
        assert str(info.value).startswith(f"{op} failed, error code is {code}"), str(info.value)


@contextmanager
def exactly(error: type[Exception]) -> Iterator[None]:
    """Expect an exception of exactly this class (not a subclass)."""
    with pytest.raises(error) as info:
        yield
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"


class Untouched:
    """Every byte of the named caches of these peers (each tensor with its guards, or the whole pool
    of a pool-allocated cache), as they are now. ``check`` asserts that a refused call changed none
    of it: ``verify.nothing``, for every cache on either side."""

    def __init__(self, caches: dict[Peer, Sequence[str]]):
        self.caches = caches
        self.before: dict[Peer, dict[str, Snapshot]] = {
            peer: peer.call(api_errors.snapshots, names) for peer, names in caches.items()}

    def check(self, what: str) -> None:
        for peer, names in self.caches.items():
            after = peer.call(api_errors.snapshots, names)
            for name in names:
                before = self.before[peer][name]  # a refused call's expectation: all of it as it was
                assert_same(after[name], nothing(dst0=before, src0=before), f"{peer.name}'s cache {name} after {what}")

    def refuses(self, peer: Peer, call: Call, error: type[Exception]) -> None:
        """``call`` in ``peer`` raises exactly ``error`` and changes nothing."""
        with exactly(error):
            run(peer, call)
        self.check(describe(call))

    def refuses_llm(self, peer: Peer, call: Call, code: LLMStatusCode, op: str | None = None) -> None:
        """``call`` in ``peer`` raises ``LLMException(code)`` (naming ``op``) and changes nothing."""
        with llm_error(code, op):
            run(peer, call)
        self.check(describe(call))


def both(pair: Pair, decode_extra: Sequence[str] = ()) -> Untouched:
    return Untouched({pair.prefill: CACHES, pair.decode: (*CACHES, *decode_extra)})


def unused_port() -> tuple[socket.socket, int]:
    """A port bound (so nobody else gets it) but not listening: connecting is refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s, s.getsockname()[1]


def setup_both(pair: Pair, link: bool = True) -> None:
    """Prompt: blocks cache id 1 (key (1, 0), seed 1) + contiguous cache id 2 (batch 2, seed 3).
    Decoder: blocks cache id 1 (key (2, 0), seed 2) + contiguous cache id 2 (batch 3, seed 4).
    Blocks are 128 B, contiguous slots 64 B."""
    for side, seeds, batch, key in ((pair.prefill, (1, 3), 2, KEY), (pair.decode, (2, 4), 3, DKEY)):
        ids = (side.call(kv.register_blocks, "blk", 4, SHAPE, seed=seeds[0], key=key),
               side.call(kv.register, "c", 2, (batch, 32), seed=seeds[1]))
        assert ids == (1, 2), (side.name, ids)
    if link:
        pair.link()


def assert_good_pull(pair: Pair) -> None:
    """A correct pull over the link moves exact bytes (the link is still usable)."""
    moved((pair.prefill, "blk"), (pair.decode, "blk"),
          lambda: pair.decode.call(kv.pull_blocks, KEY, "blk", [6], [7]), rows([(6, 7)]))


# ---------------------------------------------------------------------------- before init / lifecycle


def test_calls_before_init_raise_plain_runtime_error() -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 1)  # never initialised: no engine in this process
    calls: list[Callable[[], object]] = [
        lambda: dd.cache_manager,
        lambda: dd.listen_port,
        lambda: dd.links(),
        lambda: dd.link_clusters([], 1000),
        lambda: dd.unlink_clusters([], 1000),
        lambda: dd.switch_role(LLMRole.DECODER),
        lambda: dd.kv_cache_manager,
    ]
    for call in calls:
        with pytest.raises(RuntimeError) as e:
            call()
        assert type(e.value) is RuntimeError, type(e.value)  # not an LLMException
        assert str(e.value) == "llm datadist is not initialized"
    dd.finalize()  # a no-op when not initialised
    dd.finalize()
    assert LLMDataDist.llm_engine_instance is None


def test_constructor_type_and_range_errors() -> None:
    with pytest.raises(TypeError):
        LLMDataDist(LLMRole.PROMPT, "1")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        LLMDataDist(1, 1)  # type: ignore[arg-type]  # a plain int is not an LLMRole
    with pytest.raises(TypeError):
        LLMDataDist(LLMRole.PROMPT, True)
    with pytest.raises(ValueError):
        LLMDataDist(LLMRole.PROMPT, -1)
    with pytest.raises(ValueError):
        LLMDataDist(LLMRole.PROMPT, 2**64)
    assert LLMDataDist(LLMRole.DECODER, 2**64 - 1).cluster_id == 2**64 - 1


def test_init_lifecycle_single_instance_per_process(peers: Callable[..., Peer]) -> None:
    p = peers("life")
    p.call(api_errors.create, "first", "prompt", 1)
    p.call(api_errors.datadist, "first", "init", kv.options("127.0.0.1:0", pool=1 << 20))
    port = p.call(api_errors.attribute, "first", "listen_port")
    assert port > 0
    # init again on the same object: a no-op (same listener, same cache manager)
    p.call(api_errors.keep_manager, "first")
    p.call(api_errors.datadist, "first", "init", kv.options("127.0.0.1:0", pool=1 << 20))
    assert p.call(api_errors.attribute, "first", "listen_port") == port
    assert p.call(api_errors.manager_is_kept, "first")
    # a second engine in the same process is refused, whatever its options
    p.call(api_errors.create, "second", "decoder", 2)
    with llm_error(S.LLM_FAILED):
        p.call(api_errors.datadist, "second", "init", kv.options(pool=1 << 20))
    with pytest.raises(RuntimeError, match="not initialized"):
        p.call(api_errors.attribute, "second", "cache_manager")
    assert p.call(api_errors.instance) == "first"
    # finalize twice is a no-op; afterwards every call raises RuntimeError, and the old manager
    # LLM_ENGINE_FINALIZED (test_lifecycle.py has every operation)
    p.call(api_errors.datadist, "first", "finalize")
    p.call(api_errors.datadist, "first", "finalize")
    assert p.call(api_errors.instance) is None
    for attr in ("listen_port", "cache_manager"):
        with pytest.raises(RuntimeError) as e:
            p.call(api_errors.attribute, "first", attr)
        assert type(e.value) is RuntimeError and str(e.value) == "llm datadist is not initialized", e.value
    with llm_error(S.LLM_ENGINE_FINALIZED):
        p.call(api_errors.allocate_in_kept, "first")
    # now the second instance may start, and the first one's listener is gone
    p.call(api_errors.datadist, "second", "init", kv.options(pool=1 << 20))
    ret = p.call(api_errors.datadist, "second", "link_clusters", [kv.cluster(PROMPT_ID, port)], 500)
    assert ret == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert p.call(api_errors.allocate_in, "second") == 1


def test_bad_init_options(peers: Callable[..., Peer]) -> None:
    p = peers("opts")
    p.call(api_errors.create, "fresh", "prompt", 1)
    base = kv.options(pool=1 << 20)

    def init(options: Any) -> None:
        p.call(api_errors.datadist, "fresh", "init", options)

    invalid: list[dict[str, str]] = [
        {"llm.EnableCacheManager": "true"},
        {"llm.EnableRemoteCacheAccessible": "yes"},
        {"llm.EnableSwitchRole": "2"},
        {"llm.SyncKvCacheWaitTime": "0"},
        {"llm.SyncKvCacheWaitTime": "-5"},
        {"llm.SyncKvCacheWaitTime": "1.5"},
        {"llm.SyncKvCacheWaitTime": "abc"},
        {"llm.SyncKvCacheWaitTime": str(2**31)},
        {"llm.listenIpInfo": "127.0.0.1"},
        {"llm.listenIpInfo": "127.0.0.1:"},
        {"llm.listenIpInfo": "localhost:80"},
        {"llm.listenIpInfo": "256.0.0.1:80"},
        {"llm.listenIpInfo": "127.0.0.1:65536"},
        {"llm.listenIpInfo": "127.0.0.1:-1"},
        {"llm.MemPoolConfig": "{"},
        {"llm.MemPoolConfig": "[4096]"},
        {"llm.MemPoolConfig": '{"memory_size": 0}'},
        {"llm.MemPoolConfig": '{"memory_size": "4096"}'},
        {"llm.MemPoolConfig": '{"page_shift": 12}'},
        {"llm.MemPoolConfig": '{"memory_size": 4096, "page_shift": 5}'},
        {"llm.HostMemPoolConfig": "not json"},
        {"llm.HostMemPoolConfig": '{"memory_size": %d}' % (21 * 1024**3)},
        {"ge.flowGraphMemMaxSize": "12MB"},
    ]
    # KvCacheManager (v1) mode: a PROMPT needs llm.listenIpInfo, one per device, and a device id
    v1_invalid: list[dict[str, str]] = [
        {"llm.EnableCacheManager": "0"},
        {"llm.EnableCacheManager": "0", "llm.listenIpInfo": "127.0.0.1:0;127.0.0.1:0"},
        {"llm.EnableCacheManager": "0", "llm.listenIpInfo": "127.0.0.1:0", "ge.exec.deviceId": "x"},
        {"llm.EnableCacheManager": "0", "llm.listenIpInfo": "127.0.0.1:0", "ge.exec.deviceId": ""},
        {"llm.EnableCacheManager": "0", "llm.listenIpInfo": "127.0.0.1:0", "ge.flowGraphMemMaxSize": "0"},
    ]
    for bad in invalid + v1_invalid:
        with llm_error(S.LLM_PARAM_INVALID):
            init({**base, **bad})
        assert p.call(api_errors.instance) is None, bad
    with exactly(TypeError):
        init([("llm.EnableCacheManager", "1")])
    with exactly(TypeError):
        init({**base, "llm.SyncKvCacheWaitTime": 1000})  # values must be str
    with exactly(TypeError):
        init({1: "1"})
    with pytest.raises(RuntimeError, match="not initialized"):
        p.call(api_errors.attribute, "fresh", "cache_manager")
    # none of the failures left a half-initialised engine behind: a correct init works
    init({**base, "llm.SyncKvCacheWaitTime": "250", "llm.listenIpInfo": "127.0.0.1:0"})
    assert p.call(api_errors.attribute, "fresh", "listen_port") > 0


# ---------------------------------------------------------------------------- argument checking

F16, I8 = DataType.DT_FLOAT16, DataType.DT_INT8
CONTIG_DESC = CacheDesc(2, [3, 32], F16)  # the decoder's contiguous cache
BLOCKS_DESC = CacheDesc(4, [8, 64], F16)  # either side's blocks cache
SMALL = CacheDesc(1, [1, 16], I8)


def test_wrong_types_and_ranges_raise_type_and_value_errors(pair: Pair) -> None:
    setup_both(pair, link=False)
    d = pair.decode
    ct, blk = d.call(kv.tensor_addresses, "c"), d.call(kv.tensor_addresses, "blk")
    type_errors = [
        cm("register_cache", "desc", ct),
        cm("register_cache", CONTIG_DESC, [str(a) for a in ct]),
        cm("register_cache", CONTIG_DESC, ct[0]),
        cm("register_cache", CONTIG_DESC, ct, [5]),
        cm("register_cache", CONTIG_DESC, ct, remote_accessible=1),
        cm("register_blocks_cache", BLOCKS_DESC, blk, CacheKey(1, 0)),
        cm("allocate_cache", None),
        cm("allocate_cache", SMALL, [CacheKeyByIdAndIndex(1, 1)]),
        cm("allocate_blocks_cache", SMALL, CacheKey(1, 0)),
        cm("pull_blocks", KEY, BLK, ["0"], [1]),
        cm("pull_blocks", KEY, BLK, [0], [1.0]),
        cm("pull_blocks", KEY, BLK, [True], [1]),
        cm("pull_blocks", KEY, BLK, 0, 1),
        cm("pull_blocks", KEY, "blk", [0], [1]),
        cm("pull_blocks", (1, 0), BLK, [0], [1]),
        cm("pull_blocks", KEY, BLK, [0], [1], src_layer_range=[0, 1]),
        cm("pull_blocks", KEY, BLK, [0], [1], tensor_num_per_layer="2"),
        cm("pull_cache", CacheKey(1, 0), C, 0),  # remote-accessible mode takes CacheKeyByIdAndIndex only
        cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 0), C, "0"),
        cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 0), C, 0, size=1.0),
        cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 0), None, 0),
        cm("push_blocks", CacheKeyByIdAndIndex(1, 1, 0), BLK, [0], [0]),
        cm("push_cache", KEY, C, 0),
        cm("push_cache", CacheKeyByIdAndIndex(1, 2, 0), C, None),
        cm("copy_blocks", BLK, {0: 1}),
        cm("copy_blocks", BLK, {"0": [1]}),
        cm("copy_cache", C, C, "1"),
        cm("remove_cache_key", KEY),
        cm("deallocate_cache", 1),
        cm("unregister_cache", "1"),
        new(CacheKeyByIdAndIndex, "1", 1, 0),
        new(CacheKey, 1, "7"),
        new(BlocksCacheKey, 1, "0"),
        dd("link_clusters", kv.cluster(1, 1), 1000),
        dd("link_clusters", [LLMClusterInfo()], 1000),  # remote_cluster_id is None
        dd("link_clusters", [kv.cluster(1, 1)], "1000"),
        dd("link_clusters", [kv.cluster(1, 1), "x"], 1000),
        dd("unlink_clusters", [kv.cluster(1, 1)], 1000, force="yes"),
        dd("unlink_clusters", [LLMClusterInfo()], 1000, force=True),
        new(api_errors.set_remote_cluster_id, "1"),
    ]
    value_errors = [
        cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 0), C, 2**32),
        cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 0), C, -1),
        cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 0), C, 0, size=2**63),
        cm("pull_blocks", KEY, BLK, [0], [1], tensor_num_per_layer=-1),
        cm("pull_blocks", KEY, BLK, [0], [1], tensor_num_per_layer=2**32),
        cm("push_cache", CacheKeyByIdAndIndex(1, 2, 0), C, 2**32),
        cm("copy_cache", C, C, 0, 2**32),
        cm("unregister_cache", 2**63),
        cm("register_cache", CONTIG_DESC, [-1, 1]),
        new(CacheKeyByIdAndIndex, 1, 1, 2**32),
        new(CacheKeyByIdAndIndex, -1, 1, 0),
        new(CacheKey, 1, 2**64),
        new(CacheDesc, -1, [1], I8),
        dd("link_clusters", [kv.cluster(1, 1)], 2**31),
        new(api_errors.set_remote_cluster_id, -1),  # the cluster id setter range-checks too
    ]
    # none of this touches a cache, on either side
    untouched = both(pair)
    for call in type_errors:
        untouched.refuses(d, call, TypeError)
    for call in value_errors:
        untouched.refuses(d, call, ValueError)


def test_semantic_errors_raise_param_invalid_and_leave_the_link_usable(pair: Pair) -> None:
    setup_both(pair)
    d = pair.decode
    ct = d.call(kv.tensor_addresses, "c")
    python_checks = [
        # layer ranges
        cm("pull_blocks", KEY, BLK, [0], [1], src_layer_range=range(0, 2, 2)),
        cm("pull_blocks", KEY, BLK, [0], [1], dst_layer_range=range(1, 1)),
        cm("pull_blocks", KEY, BLK, [0], [1], src_layer_range=range(2, 1)),
        cm("pull_blocks", KEY, BLK, [0], [1], src_layer_range=range(0, 2), dst_layer_range=range(0, 1)),
        cm("push_blocks", KEY, BLK, [0], [1], src_layer_range=range(0, 3, 2)),
        cm("push_cache", CacheKeyByIdAndIndex(1, 2, 0), C, 0, src_layer_range=range(-1, 1)),
        # tensor_num_per_layer
        cm("pull_blocks", KEY, BLK, [0], [1], tensor_num_per_layer=0),
        cm("push_blocks", KEY, BLK, [0], [1], tensor_num_per_layer=0),
        cm("pull_blocks", KEY, BLK, [0], [1], src_layer_range=range(0, 1), dst_layer_range=range(0, 1),
           tensor_num_per_layer=3),
        cm("push_blocks", KEY, BLK, [0], [1], range(0, 1), range(0, 1), tensor_num_per_layer=3),
        # block lists
        cm("pull_blocks", KEY, BLK, [], []),
        cm("pull_blocks", KEY, BLK, [0], []),
        cm("pull_blocks", KEY, BLK, [0, 1], [2]),
        cm("pull_blocks", KEY, BLK, [], [2]),  # a BlocksCacheKey source needs src_blocks
        cm("pull_blocks", CacheKeyByIdAndIndex(1, 2, 0), BLK, [0], [1]),  # contiguous source: src_blocks empty
        cm("push_blocks", KEY, BLK, [0], []),
        cm("push_blocks", KEY, BLK, [0, 1], [1]),
        # cache kinds
        cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 0), BLK, 0),
        cm("pull_blocks", KEY, C, [0], [1]),
        cm("push_cache", CacheKeyByIdAndIndex(1, 2, 0), BLK, 0),
        cm("push_blocks", KEY, C, [0], [1]),
        # addresses
        cm("register_cache", CONTIG_DESC, ct[:1]),
        cm("register_cache", CONTIG_DESC, [ct[0], 0]),
        cm("register_blocks_cache", BLOCKS_DESC, []),
        # sizes and keywords
        cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 0), C, 0, size=0),
        cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 0), C, 0, size=-2),
        cm("push_cache", CacheKeyByIdAndIndex(1, 2, 0), C, 0, size=16),
        cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 0), C, 0, layer_range=range(0, 1)),
        dd("link_clusters", [kv.cluster(1, 1)], 0),
        dd("unlink_clusters", [kv.cluster(1, 1)], -5),
    ]
    native_checks = [
        ("pull_cache", cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 0), C, 3)),  # local batch size is 3
        ("pull_cache", cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 0), C, 2**32 - 1)),
        ("pull_cache", cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 0), C, 0, size=32 * 2 + 1)),  # > stride
        ("pull_blocks", cm("pull_blocks", KEY, BLK, [0], [8])),  # local block out of range
        ("pull_blocks", cm("pull_blocks", KEY, BLK, [0, 1], [1, 2**40])),
        ("push_blocks", cm("push_blocks", KEY, BLK, [8], [0])),
        ("push_cache", cm("push_cache", CacheKeyByIdAndIndex(1, 2, 0), C, 3)),
    ]
    untouched = both(pair)
    for call in python_checks:
        untouched.refuses_llm(d, call, S.LLM_PARAM_INVALID)
    for op, call in native_checks:
        untouched.refuses_llm(d, call, S.LLM_PARAM_INVALID, op)
    assert_good_pull(pair)


def test_non_remote_mode_key_rules_and_push_refused(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(remote=False)
    pair.prefill.call(kv.allocate, "src", 1, (2, 64), I8, seed=2, keys=[CacheKey(1, 5), CacheKey(1, 2**64 - 1, 0, 9)])
    pair.decode.call(kv.allocate, "dst", 1, (2, 64), I8)
    pair.decode.call(kv.register_blocks, "blk", 2, (4, 64), I8, seed=1, key=DKEY)
    pair.link()
    d, dst = pair.decode, Named("dst")
    untouched = Untouched({pair.prefill: ["src"], d: ["dst", "blk"]})
    for call in [
        cm("pull_cache", CacheKey(1, 5, 0, 9), dst, 0),  # both req_id and prefix_id valid
        cm("pull_cache", CacheKey(1, 2**64 - 1), dst, 0),  # neither
        cm("pull_blocks", CacheKey(1, 5, 0, 9), BLK, [], [0]),
        cm("pull_blocks", CacheKey(1, 2**64 - 1), BLK, [], [0]),
        # push needs enable_remote_cache_accessible
        cm("push_blocks", KEY, BLK, [0], [0]),
        cm("push_cache", CacheKeyByIdAndIndex(1, 1, 0), dst, 0),
    ]:
        untouched.refuses_llm(d, call, S.LLM_PARAM_INVALID)
    # request keys are CacheKey / CacheKeyByIdAndIndex only
    untouched.refuses(d, cm("pull_cache", KEY, dst, 0), TypeError)
    # an unknown request key, then the real one: the errors consumed nothing
    untouched.refuses_llm(d, cm("pull_cache", CacheKey(1, 6), dst, 0), S.LLM_KV_CACHE_NOT_EXIST, "pull_cache")
    untouched.refuses_llm(d, cm("pull_cache", CacheKey(1, 5, model_id=1), dst, 0),  # model_id is part of the key
                          S.LLM_KV_CACHE_NOT_EXIST, "pull_cache")
    # key i names slot i of the source: slot 0 into slot 1, then slot 1 into slot 0
    moved((pair.prefill, "src"), (d, "dst"), lambda: d.call(kv.pull_cache, CacheKey(1, 5), "dst", 1), rows([(0, 1)]))
    moved((pair.prefill, "src"), (d, "dst"), lambda: d.call(kv.pull_cache, CacheKey(1, 2**64 - 1, 0, 9), "dst", 0),
          rows([(1, 0)]))


def test_duplicate_cache_keys_are_rejected(peers: Callable[..., Peer]) -> None:
    p = peers("dup")
    p.call(kv.start, "prompt", 1, pool=1 << 20)
    desc, blocks_desc = CacheDesc(1, [2, 64], I8), CacheDesc(1, [4, 64], I8)
    p.call(kv.allocate, "a", 1, (2, 64), I8, keys=[CacheKey(1, 5)])
    buf = p.call(api_errors.buffer, "buf", 1, 2 * 64, 2)  # memory not registered yet
    p.call(kv.register_blocks, "r", 1, (4, 64), I8, seed=None, key=BlocksCacheKey(1, 3))
    r = p.call(kv.tensor_addresses, "r")
    for call in [
        cm("allocate_cache", desc, [CacheKey(1, 7), CacheKey(1, 7)]),  # duplicated in the call
        cm("allocate_cache", desc, [CacheKey(1, 5)]),  # already bound to cache a
        cm("allocate_cache", desc, [CacheKey(9, 5)]),  # cluster_id is not part of the key
        cm("allocate_cache", desc, [CacheKey(1, 8), CacheKey(1, 9), CacheKey(1, 10)]),  # more keys than slots
        cm("allocate_cache", desc, [CacheKey(1, 2**64 - 1, 0, 4), CacheKey(1, 11, 0, 4)]),  # same prefix
        cm("register_cache", desc, buf, [CacheKey(1, 5)]),
        cm("register_cache", desc, buf, [CacheKey(1, 12), CacheKey(1, 12)]),
        cm("register_blocks_cache", blocks_desc, r, BlocksCacheKey(1, 3)),
        cm("allocate_blocks_cache", blocks_desc, BlocksCacheKey(7, 3)),
    ]:
        with llm_error(S.LLM_PARAM_INVALID):
            run(p, call)
    # the rejected keys were not half-registered: they can be used now
    p.call(kv.allocate, "b", 1, (2, 64), I8, keys=[CacheKey(1, 7), CacheKey(1, 8)])
    run(p, cm("register_cache", desc, buf, [CacheKey(1, 12)]))
    # a different model_id is a different key
    p.call(kv.allocate, "m", 1, (2, 64), I8, keys=[CacheKey(1, 5, 1)])
    p.call(kv.allocate, "m2", 1, (4, 64), I8, keys=[BlocksCacheKey(1, 4)], blocks=True)
    # after removing a key it can be bound again
    p.call(kv.remove_cache_key, CacheKey(1, 5))
    p.call(kv.allocate, "c", 1, (2, 64), I8, keys=[CacheKey(1, 5)])


# ---------------------------------------------------------------------------- remote lookups


def test_unknown_remote_keys_give_kv_cache_not_exist(pair: Pair) -> None:
    setup_both(pair)
    d, p = pair.decode, pair.prefill
    untouched = both(pair)
    for op, call in [
        ("pull_blocks", cm("pull_blocks", BlocksCacheKey(1, 9), BLK, [0], [1])),
        ("pull_blocks", cm("pull_blocks", CacheKeyByIdAndIndex(1, 99, 0), BLK, [], [1])),
        ("pull_cache", cm("pull_cache", CacheKeyByIdAndIndex(1, 99, 0), C, 0)),
        ("pull_cache", cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 2), C, 0)),  # remote batch is 2
        ("pull_cache", cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 2**32 - 1), C, 0)),
        ("push_blocks", cm("push_blocks", BlocksCacheKey(1, 9), BLK, [0], [1])),
        ("push_cache", cm("push_cache", CacheKeyByIdAndIndex(1, 99, 0), C, 0)),
        ("push_cache", cm("push_cache", CacheKeyByIdAndIndex(1, 2, 2), C, 0)),
    ]:
        untouched.refuses_llm(d, call, S.LLM_KV_CACHE_NOT_EXIST, op)
    # the message names the op and the code, as llm_datadist formats it
    with pytest.raises(LLMException) as e:
        d.call(kv.pull_blocks, BlocksCacheKey(1, 9), "blk", [0], [1])
    assert str(e.value).startswith("pull_blocks failed, error code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST")
    untouched.check("pull_blocks of an unknown key")
    # the link survived: the correct calls work, in both directions
    assert_good_pull(pair)
    moved((p, "c"), (d, "c"), lambda: d.call(kv.pull_cache, CacheKeyByIdAndIndex(1, 2, 1), "c", 2), rows([(1, 2)]))
    moved((p, "blk"), (d, "blk"), lambda: p.call(kv.push_blocks, DKEY, "blk", [3], [0]), rows([(3, 0)]))


def test_remote_out_of_range_accesses_are_refused(pair: Pair) -> None:
    setup_both(pair)
    d, p = pair.decode, pair.prefill
    # the decoder also gets a contiguous cache whose slot (128 B) is larger than the prompt's (64 B)
    d.call(kv.register, "wide", 2, (2, 64), seed=None)
    wide = Named("wide")
    untouched = both(pair, decode_extra=["wide"])
    for op, call in [
        ("pull_blocks", cm("pull_blocks", KEY, BLK, [10_000], [1])),
        ("pull_blocks", cm("pull_blocks", KEY, BLK, [8], [1])),
        ("pull_blocks", cm("pull_blocks", KEY, BLK, [-1], [1])),
        ("pull_blocks", cm("pull_blocks", KEY, BLK, [2, 10_000], [1, 3])),
        ("push_blocks", cm("push_blocks", KEY, BLK, [1], [10_000])),
        ("push_blocks", cm("push_blocks", KEY, BLK, [1, 2], [3, -1])),
        # the remote slot is smaller than what is asked for
        ("pull_cache", cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 1), wide, 0)),
        ("pull_cache", cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 1), wide, 1, size=65)),
        ("push_cache", cm("push_cache", CacheKeyByIdAndIndex(1, 2, 0), wide, 0)),
        # a remote slot of 64 B cannot fill one 128 B block
        ("pull_blocks", cm("pull_blocks", CacheKeyByIdAndIndex(1, 2, 0), BLK, [], [0], src_layer_range=range(0, 1))),
        ("pull_blocks", cm("pull_blocks", CacheKeyByIdAndIndex(1, 2, 0), BLK, [], [0])),  # 4 tensors here, 2 there
    ]:
        untouched.refuses_llm(d, call, S.LLM_PARAM_INVALID, op)
    assert_good_pull(pair)
    # exactly the remote slot: its 64 B into the first half of the 128 B slot 1
    moved((p, "c"), (d, "wide"), lambda: d.call(kv.pull_cache, CacheKeyByIdAndIndex(1, 2, 1), "wide", 1, size=64),
          rows([(1, 1)], nbytes=64))


# ---------------------------------------------------------------------------- links


def test_transfers_need_a_link(pair: Pair) -> None:
    setup_both(pair, link=False)
    d, p = pair.decode, pair.prefill
    untouched = both(pair)
    for who, op, call in [
        (d, "pull_blocks", cm("pull_blocks", KEY, BLK, [0], [1])),
        (d, "pull_cache", cm("pull_cache", CacheKeyByIdAndIndex(1, 2, 0), C, 0)),
        (d, "push_blocks", cm("push_blocks", KEY, BLK, [0], [1])),
        (p, "push_cache", cm("push_cache", CacheKeyByIdAndIndex(2, 2, 0), C, 0)),
    ]:
        untouched.refuses_llm(who, call, S.LLM_NOT_YET_LINK, op)
    pair.link()
    # linked, but to cluster 1 only
    untouched.refuses_llm(d, cm("pull_blocks", BlocksCacheKey(3, 0), BLK, [0], [1]), S.LLM_NOT_YET_LINK, "pull_blocks")
    assert_good_pull(pair)
    assert d.call(kv.unlink_clusters, [(PROMPT_ID, pair.port, 0)], 2000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    untouched = both(pair)
    untouched.refuses_llm(d, cm("pull_blocks", KEY, BLK, [0], [1]), S.LLM_NOT_YET_LINK, "pull_blocks")
    # the non-forced unlink removed the far end too
    untouched.refuses_llm(p, cm("push_blocks", DKEY, BLK, [0], [1]), S.LLM_NOT_YET_LINK, "push_blocks")
    pair.link()  # and a fresh link works again
    assert_good_pull(pair)


def peer_ids(peer: Peer) -> list[int]:
    return [link["peer_cluster_id"] for link in peer.call(kv.links)]


def test_link_clusters_failure_codes(pair: Pair) -> None:
    d, p = pair.decode, pair.prefill
    sock, dead = unused_port()
    try:
        ret = d.call_within(hang_guard(1000), kv.link, PROMPT_ID, dead, 1000)
        assert ret == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    finally:
        sock.close()
    # a listener that accepts but never answers the handshake: bounded by the call's timeout
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(4)
    try:
        ret = d.call_within(hang_guard(300), kv.link, PROMPT_ID, mute.getsockname()[1], 300)
        assert ret == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    finally:
        mute.close()
    # the listener is cluster 1: asking it for cluster 5 fails, and leaves no link on either side
    assert d.call(kv.link, 5, pair.port, 2000) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert d.call(kv.links) == [] and p.call(kv.links) == []
    d.call(kv.allocate, "b", 1, (1, 64), I8, blocks=True)
    untouched = Untouched({d: ["b"]})  # the prompt has no cache here
    for cid in (5, 1):
        untouched.refuses_llm(d, cm("pull_blocks", BlocksCacheKey(cid, 0), Named("b"), [0], [0]),
                              S.LLM_NOT_YET_LINK, "pull_blocks")
    pair.link()
    assert peer_ids(d) == [1] and peer_ids(p) == [2]
    # re-linking an existing peer: a per-cluster code, not an exception
    assert d.call(kv.link, PROMPT_ID, pair.port, 2000) == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])
    # mixed results: overall is the last failing cluster's code
    sock, dead = unused_port()
    try:
        ret = d.call(kv.link_clusters, [(PROMPT_ID, pair.port, 0), (7, dead, 0)], 1000)
    finally:
        sock.close()
    assert ret == (S.LLM_LINK_FAILED, [S.LLM_ALREADY_LINK, S.LLM_LINK_FAILED])
    # more than 16 clusters in one call
    many = [(100 + i, pair.port, 0) for i in range(17)]
    assert d.call(kv.link_clusters, many, 1000) == (S.LLM_CLUSTER_NUM_EXCEED_LIMIT, [])
    assert d.call(kv.unlink_clusters, many, 1000) == (S.LLM_CLUSTER_NUM_EXCEED_LIMIT, [])
    # a remote ip is required (exactly one) for a link (raised) and a non-forced unlink (the
    # cluster's status, as upstream's engine answers it)
    with llm_error(S.LLM_PARAM_INVALID):
        d.call(kv.link_clusters, [(PROMPT_ID, None, 0)], 1000)
    two_ips = kv.cluster(PROMPT_ID, pair.port)
    two_ips.append_remote_ip_info("127.0.0.1", pair.port)
    assert run(d, dd("unlink_clusters", [two_ips], 1000)) == (S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID])
    assert peer_ids(d) == [1]  # the link is untouched


def test_unlink_clusters(pair: Pair) -> None:
    setup_both(pair, link=False)
    d, p = pair.decode, pair.prefill
    assert d.call(kv.unlink_clusters, [(7, pair.port, 0)], 1000) == (S.LLM_NOT_YET_LINK, [S.LLM_NOT_YET_LINK])
    pair.link()
    links = d.call(kv.links)
    assert len(links) == 1 and links[0]["peer_cluster_id"] == 1 and links[0]["initiator"] is True
    links = p.call(kv.links)
    assert len(links) == 1 and links[0]["peer_cluster_id"] == 2 and links[0]["initiator"] is False
    # non-forced: both ends go
    ret = d.call(kv.unlink_clusters, [(PROMPT_ID, pair.port, 0), (7, pair.port, 0)], 2000)
    assert ret == (S.LLM_NOT_YET_LINK, [S.LLM_SUCCESS, S.LLM_NOT_YET_LINK])
    assert d.call(kv.links) == []
    assert p.call(kv.links) == []  # the peer dropped its end before acknowledging
    assert d.call(kv.unlink_clusters, [(PROMPT_ID, pair.port, 0)], 1000) == (S.LLM_NOT_YET_LINK, [S.LLM_NOT_YET_LINK])
    # forced: only the local end goes; a forced unlink needs no remote ip (nor a local one)
    pair.link()
    assert d.call(kv.unlink_clusters, [(PROMPT_ID, None, None)], 1000, force=True) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert d.call(kv.links) == []
    # the peer was not told: its end sees the channels close and stays, broken, until replaced
    wait_until(lambda: [(lk["peer_cluster_id"], lk["broken"]) for lk in p.call(kv.links)] == [(2, True)], 20,
               "the prompt's end broken, still listed")
    both(pair).refuses_llm(d, cm("pull_blocks", KEY, BLK, [0], [1]), S.LLM_NOT_YET_LINK, "pull_blocks")
    # the client re-links: the server replaces its stale end, and transfers work again
    pair.link()
    assert peer_ids(p) == [2]
    assert_good_pull(pair)
    moved((p, "blk"), (d, "blk"), lambda: p.call(kv.push_blocks, DKEY, "blk", [5], [6]), rows([(5, 6)]))
    # the server side may unlink too (non-forced): both ends go
    assert p.call(kv.unlink_clusters, [(DECODER_ID, 1, 0)], 2000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert p.call(kv.links) == []
    assert d.call(kv.links) == []


# ---------------------------------------------------------------------------- switch_role

LISTEN_ANY = {"llm.listenIpInfo": "127.0.0.1:0"}


def test_switch_role(pair: Pair) -> None:
    setup_both(pair)
    d, p = pair.decode, pair.prefill
    for who, role in ((d, LLMRole.PROMPT), (p, LLMRole.DECODER)):
        with llm_error(S.LLM_EXIST_LINK, "switch_role"):
            run(who, dd("switch_role", role, LISTEN_ANY))
        with llm_error(S.LLM_EXIST_LINK, "switch_role"):
            run(who, dd("switch_role", role))
    assert d.call(kv.role_and_port) == (LLMRole.DECODER, 0)
    assert p.call(kv.role_and_port) == (LLMRole.PROMPT, pair.port)
    assert_good_pull(pair)  # the refused switches did not disturb the link
    assert d.call(kv.unlink_clusters, [(PROMPT_ID, pair.port, 0)], 2000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert p.call(kv.links) == []
    # argument errors
    for call in [
        dd("switch_role", 0),
        dd("switch_role", "PROMPT"),
        dd("switch_role", LLMRole.PROMPT, {"llm.listenIpInfo": 1}),
        dd("switch_role", LLMRole.PROMPT, [("llm.listenIpInfo", "127.0.0.1:0")]),
    ]:
        with exactly(TypeError):
            run(d, call)
    for bad in ("127.0.0.1", "127.0.0.1:99999", "host:80"):
        with llm_error(S.LLM_PARAM_INVALID):
            run(d, dd("switch_role", LLMRole.PROMPT, {"llm.listenIpInfo": bad}))
    assert d.call(kv.role_and_port) == (LLMRole.DECODER, 0)
    # swap roles: the decoder starts a listener (on its own address: another host's in a two-hosts
    # cell), the prompt stops its own
    d.call(kv.switch_role, "prompt", here=True)
    run(p, dd("switch_role", LLMRole.DECODER))
    new_role, new_port = d.call(kv.role_and_port)
    assert new_role == LLMRole.PROMPT and new_port > 0
    assert p.call(kv.role_and_port) == (LLMRole.DECODER, 0)
    # nobody listens on the old port any more; the new listener accepts
    assert d.call(kv.link, PROMPT_ID, pair.port, 1000) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert p.call(kv.link, DECODER_ID, new_port, 2000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    # the caches survived the switch
    moved((d, "blk"), (p, "blk"), lambda: p.call(kv.pull_blocks, DKEY, "blk", [4], [2]), rows([(4, 2)]))


def test_dead_peer_breaks_the_link_until_unlinked(pair: Pair, peers: Callable[..., Peer]) -> None:
    setup_both(pair)
    p = pair.prefill
    pair.decode.kill()
    wait_until(lambda: all(lk["broken"] for lk in p.call(kv.links)), 20, "the prompt saw the link break")
    links = p.call(kv.links)
    assert len(links) == 1 and links[0]["peer_cluster_id"] == 2 and links[0]["broken"] is True
    # a known-broken link fails at once (LINK_FAILED, never the TIMEOUT a wait for the dead peer
    # would end in), under a hang guard; the source is left as it was
    untouched = Untouched({p: CACHES})
    with llm_error(S.LLM_LINK_FAILED, "push_blocks"):
        p.call_within(hang_guard(1000), kv.push_blocks, DKEY, "blk", [0], [0])
    untouched.check("a push over the broken link")
    # the survivor unlinks (the peer is gone, the local end is freed anyway), then a new decoder links
    assert p.call(kv.unlink_clusters, [(DECODER_ID, 1, 0)], 1000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert p.call(kv.links) == []
    q = peers("decode2", env=pair.variant.env())
    q.call(kv.start, "decoder", DECODER_ID, pool=1 << 20)
    q.call(kv.register_blocks, "blk", 4, SHAPE, seed=None)
    assert q.call(kv.link, PROMPT_ID, pair.port, 2000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    moved((p, "blk"), (q, "blk"), lambda: q.call(kv.pull_blocks, KEY, "blk", [3], [3]), rows([(3, 3)]))


@pytest.mark.one_host("the test process holds the port the switch must fail to listen on")
def test_failed_switch_role_keeps_the_old_listener(pair: Pair) -> None:
    p = pair.prefill
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        # the port is taken: "cannot listen on 127.0.0.1:<port>: Address already in use"
        with llm_error(S.LLM_FAILED, "switch_role"):
            run(p, dd("switch_role", LLMRole.DECODER, {"llm.listenIpInfo": f"127.0.0.1:{busy.getsockname()[1]}"}))
    finally:
        busy.close()
    assert p.call(kv.role_and_port) == (LLMRole.PROMPT, pair.port)  # the failed call changed nothing, so
    pair.link()  # the old listener is still there
