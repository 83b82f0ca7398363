"""Real llm_datadist programs run unchanged: the rules they depend on, and replays of the official
samples' call sequences across processes, byte-exact.

The rules (each as upstream's code has it; docs/compatibility.md names file and commit):

1. ``unlink_clusters`` needs the remote cluster id and, unless forced, one remote IP; no local IP.
2. ``query_register_mem_status`` stays OK once reached, also after the peer linked, pulled and
   unlinked between two polls.
3. ``llm.TransferBackend = "hixl"``: one-way links (only the side that linked reads and writes;
   both sides may link to each other), ``unlink_clusters`` ignores ``force`` and needs no IP, the
   rank-table API is ``LLM_FEATURE_NOT_ENABLED``, ``switch_role`` only relabels.
4. Cross-linking on the default backend keeps one usable link per pair, never a broken one.
5. A CacheManager used after its engine's ``finalize`` raises ``LLM_ENGINE_FINALIZED``.

The replays follow hicann/hixl ``examples/python/llm_datadist/`` (commit 9ed283b): the same
options (``LLMConfig`` then ``generate_options()``), keys, cluster infos, transfer arguments and
order of calls, with the samples' barriers as the order in which the test calls each process,
loopback addresses with free ports instead of fixed ones, and guarded test memory instead of
``torch_npu`` tensors (same cache descriptors).
"""

from __future__ import annotations

import functools
import socket
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from backend_env import Variant
from comm_util import free_port, rank_table, wait_ok
from conftest import moved, only
from llm_datadist import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex, DataType, LLMRole, RegisterMemStatus
from pdlink import LLMException, LLMStatusCode
from peer import Peer
from peers import hostile, kv
from poll import wait_until
from verify import assert_same, nothing, rows

S = LLMStatusCode
OK = (S.LLM_SUCCESS, [S.LLM_SUCCESS])
SAMPLE_SHAPE = (3, 10)  # the push/switch/hixl samples: CacheDesc(2, [3, 10], DT_FLOAT)
F32 = DataType.DT_FLOAT
# Replays and the link-rule cases run on every data path; the default run keeps one (the others are
# heavy: CI runs them), which keeps the default suite within its time budget.
replay_paths = every_path = only("cpu-tcp", "cpu-cma", "ascend-fake", heavy=("cpu-cma", "ascend-fake"))


def refused(code: LLMStatusCode, dst: tuple[Peer, str], action: Callable[[], object]) -> None:
    """``action`` fails with ``code`` and leaves the destination as it was."""
    before = dst[0].call(kv.snapshot, dst[1])
    with pytest.raises(LLMException) as e:
        action()
    assert e.value.status_code == code, e.value
    assert_same(dst[0].call(kv.snapshot, dst[1]), nothing(before, before), "destination after a refusal")


def program(peers: Callable[..., Peer], variant: Variant, name: str, role: str, cluster_id: int,
            **options: Any) -> tuple[Peer, int]:
    """A peer running an engine set up as the samples do (kv.start_program); with its listen port."""
    p = peers(name, env=variant.env())
    return p, p.call(kv.start_program, role, cluster_id, **options)


def push_programs(peers: Callable[..., Peer], variant: Variant, backend: str | None,
                  **options: Any) -> tuple[Peer, int, Peer, int]:
    """PROMPT cluster 0 and DECODER cluster 1, both listening (the push/transfer samples' pair)."""
    p, p_port = program(peers, variant, "prompt", "prompt", 0, listen_port=0, transfer_backend=backend, **options)
    d, d_port = program(peers, variant, "decoder", "decoder", 1, listen_port=0, transfer_backend=backend, **options)
    return p, p_port, d, d_port


def small_blocks(p: Peer, d: Peer) -> None:
    """Blocks caches of 4 blocks per tensor, keyed BlocksCacheKey(own id, 0): for the link rules."""
    p.call(kv.register_blocks, "kv", 2, (4, 16), F32, seed=1, key=BlocksCacheKey(0, 0))
    d.call(kv.register_blocks, "kv", 2, (4, 16), F32, seed=2, key=BlocksCacheKey(1, 0))


def both(*calls: Callable[[], Any]) -> list[Any]:
    """Runs the calls at the same time (two processes past the same barrier); their results."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def on_each(peers_: list[Peer], fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(*args)`` in each peer, all at the same time; their results."""
    return both(*[functools.partial(p.call, fn, *args) for p in peers_])


def no_links(peer: Peer) -> bool:
    return bool(peer.call(kv.links) == [])


def links_of(peer: Peer) -> list[tuple[int, bool, bool]]:
    return sorted((lk["peer_cluster_id"], lk["initiator"], lk["broken"]) for lk in peer.call(kv.links))


# ---------------------------------------------------------------------------- 1. unlink rules


@only("cpu-tcp")
def test_unlink_needs_the_remote_id_and_one_remote_ip_but_no_local_ip(peers: Callable[..., Peer],
                                                                       variant: Variant) -> None:
    p, port = program(peers, variant, "prompt", "prompt", 0, listen_port=0)
    d, _ = program(peers, variant, "decoder", "decoder", 1)
    p.call(kv.register_blocks, "kv", 2, SAMPLE_SHAPE, F32, seed=1, key=BlocksCacheKey(0, 0))
    d.call(kv.register_blocks, "kv", 2, SAMPLE_SHAPE, F32, seed=2)
    assert d.call(kv.link_clusters, [(0, port, 0)]) == OK
    # no remote ip, not forced: that cluster's status (as upstream's engine), and the link stays
    assert d.call(kv.unlink_clusters, [(0, None, None)]) == (S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID])
    assert d.call(kv.unlink_clusters, [(0, None, 0)]) == (S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID])
    moved((p, "kv"), (d, "kv"), lambda: d.call(kv.pull_blocks, BlocksCacheKey(0, 0), "kv", [1], [2]),
          rows([(1, 2)]))
    # the push_cache and switch_role samples: the id and one remote ip, no local ip; both ends go
    assert d.call(kv.unlink_clusters, [(0, port, None)]) == OK
    assert d.call(kv.links) == []
    wait_until(lambda: p.call(kv.links) == [], 10, "the prompt's end gone")
    # forced: the id alone
    assert d.call(kv.link_clusters, [(0, port, 0)]) == OK
    assert d.call(kv.unlink_clusters, [(0, None, None)], force=True) == OK
    assert d.call(kv.links) == []


# ---------------------------------------------------------------------------- 2. sticky status


def comm_programs(peers: Callable[..., Peer], variant: Variant, pool: int | None = None) -> tuple[Peer, Peer]:
    """A PROMPT (cluster 1) and a DECODER (cluster 2) for the rank-table samples: CacheManager mode
    without a listen address, each rank's endpoint at PDLINK_LINK_PORT_BASE (comm.py)."""
    env = variant.env(PDLINK_LINK_PORT_BASE=str(free_port()))
    p, d = peers("prompt", env=env), peers("decoder", env=env)
    for peer, role, cid in ((p, "prompt", 1), (d, "decoder", 2)):
        peer.call(kv.start_program, role, cid, local_comm_res=False, cache_manager=True, pool=pool)
    return p, d


def comm_link(p: Peer, d: Peer) -> tuple[int, int]:
    table = rank_table()
    return p.call(kv.comm_link, "link", {1: 0, 2: 1}, table), d.call(kv.comm_link, "link", {1: 0, 2: 1}, table)


@only("cpu-tcp", "ascend-fake")
def test_register_mem_status_stays_ok_after_the_peer_linked_pulled_and_unlinked_between_polls(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """Mooncake's demos: the decoder links, pulls and unlinks within the prompt's polling gap."""
    p, d = comm_programs(peers, variant)
    p.call(kv.register_blocks, "kv", 1, (2, 1024), F32, seed=1, key=BlocksCacheKey(1, 0))
    d.call(kv.register_blocks, "kv", 1, (2, 1024), F32, seed=None)
    p_comm = p.call(kv.comm_link, "link", {1: 0, 2: 1}, rank_table())
    assert p.call(kv.comm_status, p_comm) == RegisterMemStatus.PREPARING  # D has not called link() yet
    d_comm = d.call(kv.comm_link, "link", {1: 0, 2: 1}, rank_table())
    wait_ok(d, d_comm)
    moved((p, "kv"), (d, "kv"), lambda: d.call(kv.pull_blocks, BlocksCacheKey(1, 0), "kv", [0, 1], [0, 1]),
          rows([(0, 0), (1, 1)]))
    d.call(kv.comm_unlink, d_comm)
    wait_until(lambda: p.call(kv.links) == [], 10, "the prompt's end of the link gone")
    # the prompt's first poll since: the link came and went, and the status is OK (and stays OK)
    assert p.call(kv.comm_status, p_comm) == RegisterMemStatus.OK
    assert p.call(kv.comm_status, p_comm) == RegisterMemStatus.OK
    # an unlinked comm id is LLM_NOT_YET_LINK, as upstream's CommLinkManager answers
    with pytest.raises(LLMException) as e:
        d.call(kv.comm_status, d_comm)
    assert e.value.status_code == S.LLM_NOT_YET_LINK
    p.call(kv.comm_unlink, p_comm)


# ---------------------------------------------------------------------------- 3. hixl backend


def test_hixl_backend_init_rules(peers: Callable[..., Peer]) -> None:
    """llm.TransferBackend: "hixl" only; CacheManager mode, a listen address and remote access."""
    p = peers("engine")
    for kw in ({"transfer_backend": "hixl"},  # no listen address
               {"transfer_backend": "other", "listen_port": 0},
               {"transfer_backend": "", "listen_port": 0},
               {"transfer_backend": "hixl", "listen_port": 0, "local_comm_res": False}):  # not CacheManager mode
        with pytest.raises(LLMException) as e:
            p.call(kv.start_program, "prompt", 0, **kw)
        assert e.value.status_code == S.LLM_PARAM_INVALID, (kw, e.value)
    with pytest.raises(LLMException) as e:
        p.call(kv.start, "prompt", 0, listen=True, remote=False,
               extra={"llm.TransferBackend": "hixl", "llm.EnableRemoteCacheAccessible": "0"})
    assert e.value.status_code == S.LLM_PARAM_INVALID
    assert p.call(kv.start_program, "prompt", 0, transfer_backend="hixl", listen_port=0) > 0


@every_path
def test_hixl_links_are_one_way_and_may_go_both_ways(peers: Callable[..., Peer], variant: Variant) -> None:
    p, p_port, d, d_port = push_programs(peers, variant, "hixl")
    small_blocks(p, d)
    assert d.call(kv.link_clusters, [(0, p_port, d_port)]) == OK
    assert d.call(kv.link_clusters, [(0, p_port, d_port)]) == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])
    # the side that linked reads and writes
    moved((p, "kv"), (d, "kv"), lambda: d.call(kv.pull_blocks, BlocksCacheKey(0, 0), "kv", [0, 3], [1, 2]),
          rows([(0, 1), (3, 2)]))
    moved((d, "kv"), (p, "kv"), lambda: d.call(kv.push_blocks, BlocksCacheKey(0, 0), "kv", [0], [3]),
          rows([(0, 3)]))
    # the other side has no link of its own
    refused(S.LLM_NOT_YET_LINK, (p, "kv"), lambda: p.call(kv.pull_blocks, BlocksCacheKey(1, 0), "kv", [0], [0]))
    refused(S.LLM_NOT_YET_LINK, (d, "kv"), lambda: p.call(kv.push_blocks, BlocksCacheKey(1, 0), "kv", [0], [0]))
    # the rank-table API is not there with this backend
    for call in (lambda: p.call(kv.comm_link, "c", {0: 0, 1: 1}, rank_table()),
                 lambda: p.call(kv.comm_status, 1), lambda: p.call(kv.comm_unlink, 1)):
        with pytest.raises(LLMException) as e:
            call()
        assert e.value.status_code == S.LLM_FEATURE_NOT_ENABLED
    # now the prompt links too: each side reads and writes over its own link
    assert p.call(kv.link_clusters, [(1, d_port, p_port)]) == OK
    moved((d, "kv"), (p, "kv"), lambda: p.call(kv.pull_blocks, BlocksCacheKey(1, 0), "kv", [1], [0]),
          rows([(1, 0)]))
    moved((p, "kv"), (d, "kv"), lambda: d.call(kv.pull_blocks, BlocksCacheKey(0, 0), "kv", [2], [3]),
          rows([(2, 3)]))
    assert all(not broken for _, _, broken in links_of(p) + links_of(d))
    # unlink: force ignored, no IP needed, only this side's own link goes (the peer is not told)
    assert d.call(kv.unlink_clusters, [(0, None, None)]) == OK
    refused(S.LLM_NOT_YET_LINK, (d, "kv"), lambda: d.call(kv.pull_blocks, BlocksCacheKey(0, 0), "kv", [0], [0]))
    moved((d, "kv"), (p, "kv"), lambda: p.call(kv.pull_blocks, BlocksCacheKey(1, 0), "kv", [3], [1]),
          rows([(3, 1)]))
    assert d.call(kv.unlink_clusters, [(0, None, None)], force=True) == OK  # nothing left: still SUCCESS
    # switch_role relabels; the links and the listener stay; another listen address is refused
    assert p.call(kv.switch_role, "decoder") == (int(LLMRole.DECODER), p_port)
    assert [(peer, initiator) for peer, initiator, _ in links_of(p)] == [(1, True)]
    with pytest.raises(LLMException) as e:
        p.call(kv.switch_role, "prompt", f"127.0.0.1:{free_port()}")
    assert e.value.status_code == S.LLM_FEATURE_NOT_ENABLED
    assert p.call(kv.switch_role, "prompt", f"127.0.0.1:{p_port}") == (int(LLMRole.PROMPT), p_port)
    assert p.call(kv.unlink_clusters, [(1, None, None)]) == OK
    assert p.call(kv.links) == []


@only("cpu-tcp")
@pytest.mark.parametrize("backend", [None, "hixl"], ids=["default-backend", "hixl-backend"])
def test_a_peer_cannot_use_the_link_this_side_dialled_one_way(peers: Callable[..., Peer], variant: Variant,
                                                               backend: str | None) -> None:
    """A raw peer (tests/peers/hostile.py) that the victim dialled sends a read of its own back over
    that link: served on the default backend (links are symmetric), refused with LLM_NOT_YET_LINK
    and no bytes with one-way links."""
    victim, _ = program(peers, variant, "victim", "decoder", 2, listen_port=0, transfer_backend=backend)
    victim.call(kv.register_blocks, "kv", 1, (4, 16), F32, seed=2, key=BlocksCacheKey(2, 0))
    attacker = peers("attacker")
    port = attacker.call(hostile.serve, "read_back")
    assert victim.call(kv.link, 1, port, 3000, "127.0.0.2") == OK

    def answer() -> dict[str, Any] | None:
        return next((o for o in attacker.call(hostile.observed) if o["event"] == "read_back"), None)

    got = wait_until(answer, 20, "the attacker's read answered")
    if backend == "hixl":
        assert (got["status"], got["payload"]) == (int(S.LLM_NOT_YET_LINK), b""), got
    else:
        assert (got["status"], got["payload"]) == (0, victim.call(kv.snapshot, "kv").tensor(0)[:64].tobytes())
    assert links_of(victim) == [(1, True, False)]  # the link itself is intact


@every_path
def test_hixl_both_sides_link_at_the_same_time(peers: Callable[..., Peer], variant: Variant) -> None:
    p, p_port, d, d_port = push_programs(peers, variant, "hixl")
    small_blocks(p, d)
    assert both(lambda: p.call(kv.link_clusters, [(1, d_port, p_port)]),
                lambda: d.call(kv.link_clusters, [(0, p_port, d_port)])) == [OK, OK]
    assert links_of(p) == [(1, False, False), (1, True, False)]  # its own link, and the peer's
    assert links_of(d) == [(0, False, False), (0, True, False)]
    moved((d, "kv"), (p, "kv"), lambda: p.call(kv.pull_blocks, BlocksCacheKey(1, 0), "kv", [0], [1]),
          rows([(0, 1)]))
    moved((p, "kv"), (d, "kv"), lambda: d.call(kv.pull_blocks, BlocksCacheKey(0, 0), "kv", [2], [3]),
          rows([(2, 3)]))


# ---------------------------------------------------------------------------- 4. cross-linking


@every_path
def test_linking_back_to_a_peer_that_linked_is_already_linked(peers: Callable[..., Peer], variant: Variant) -> None:
    """Default backend: B links to A, then A to B: one symmetric link, the second call
    LLM_ALREADY_LINK; both sides read and write over it."""
    a, a_port, b, b_port = push_programs(peers, variant, None)
    small_blocks(a, b)
    assert b.call(kv.link_clusters, [(0, a_port, b_port)]) == OK
    assert a.call(kv.link_clusters, [(1, b_port, a_port)]) == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])
    assert links_of(a) == [(1, False, False)] and links_of(b) == [(0, True, False)]
    moved((b, "kv"), (a, "kv"), lambda: a.call(kv.pull_blocks, BlocksCacheKey(1, 0), "kv", [0], [1]),
          rows([(0, 1)]))
    moved((a, "kv"), (b, "kv"), lambda: b.call(kv.pull_blocks, BlocksCacheKey(0, 0), "kv", [3], [2]),
          rows([(3, 2)]))


@every_path
def test_cross_linking_at_the_same_time_breaks_no_link(peers: Callable[..., Peer], variant: Variant) -> None:
    """A links to B while B links to A: each call SUCCESS or LLM_ALREADY_LINK, no link broken,
    transfers both ways byte-exact; one unlink takes everything down on both sides."""
    a, a_port, b, b_port = push_programs(peers, variant, None)
    small_blocks(a, b)
    results = both(lambda: a.call(kv.link_clusters, [(1, b_port, a_port)]),
                   lambda: b.call(kv.link_clusters, [(0, a_port, b_port)]))
    assert all(r in (OK, (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])) for r in results), results
    assert OK in results
    for side in (a, b):
        assert side.call(kv.links) and all(not broken for _, _, broken in links_of(side)), links_of(side)
    for _ in range(2):
        moved((b, "kv"), (a, "kv"), lambda: a.call(kv.pull_blocks, BlocksCacheKey(1, 0), "kv", [0], [1]),
              rows([(0, 1)]))
        moved((a, "kv"), (b, "kv"), lambda: a.call(kv.push_blocks, BlocksCacheKey(1, 0), "kv", [2], [3]),
              rows([(2, 3)]))
    assert a.call(kv.unlink_clusters, [(1, b_port, None)]) == OK
    assert a.call(kv.links) == []
    wait_until(lambda: b.call(kv.links) == [], 10, "b's ends gone too")


# ---------------------------------------------------------------------------- 5. after finalize

CACHE_MANAGER_OPERATIONS = 17  # upstream's tests/python/test_cache_manager_lifecycle.py


def test_a_cache_manager_after_finalize_raises_engine_finalized(peers: Callable[..., Peer]) -> None:
    p = peers("engine")
    p.call(kv.start, "prompt", 1, pool=1 << 20)
    p.call(kv.allocate, "kv", 1, (4, 16), F32, blocks=True)
    p.call(kv.keep_manager)
    p.call(kv.finalize)
    finalized = int(S.LLM_ENGINE_FINALIZED)
    after = p.call(kv.stale_manager_calls)
    assert len(after) == CACHE_MANAGER_OPERATIONS and set(after.values()) == {finalized}, after
    p.call(kv.finalize)  # again: a no-op, the manager stays expired
    assert set(p.call(kv.stale_manager_calls).values()) == {finalized}
    # a new engine in the same process: the old manager stays expired, the new one works
    p.call(kv.reinit, "prompt", 1)
    assert set(p.call(kv.stale_manager_calls).values()) == {finalized}
    assert p.call(kv.allocate, "fresh", 1, (4, 16), F32, blocks=True) == 1


# ---------------------------------------------------------------------------- replays


@replay_paths
def test_sample_pull_blocks(peers: Callable[..., Peer], variant: Variant) -> None:
    """pull_blocks_sample.py: link() by rank table, poll, pull blocks 0-1, swap out to a CPU cache
    and back, unlink(), finalize."""
    p, d = comm_programs(peers, variant)
    shape = (2, 16 * 1024)  # the sample: CacheDesc(1, [2, 1024 * 1024], DT_FLOAT)
    p.call(kv.register_blocks, "kv", 1, shape, F32, seed=1, key=BlocksCacheKey(1, 0))
    d.call(kv.register_blocks, "kv", 1, shape, F32, seed=2)
    p_comm, d_comm = comm_link(p, d)
    wait_ok(p, p_comm)
    wait_ok(d, d_comm)
    moved((p, "kv"), (d, "kv"), lambda: d.call(kv.pull_blocks, BlocksCacheKey(1, 0), "kv", [0, 1], [0, 1]),
          rows([(0, 0), (1, 1)]))
    d.call(kv.cpu_cache, "host", 1, shape, F32, seed=3)
    moved((d, "kv"), (d, "host"), lambda: d.call(kv.swap_blocks, "kv", "host", {0: 0, 1: 1}), rows([(0, 0), (1, 1)]))
    moved((d, "host"), (d, "kv"), lambda: d.call(kv.swap_blocks, "host", "kv", {0: 0, 1: 1}), rows([(0, 0), (1, 1)]))
    d.call(kv.comm_unlink, d_comm)
    p.call(kv.comm_unlink, p_comm)
    for side in (p, d):
        assert side.call(kv.links) == []
        side.call(kv.finalize)


@replay_paths
def test_sample_pull_cache(peers: Callable[..., Peer], variant: Variant) -> None:
    """pull_cache_sample.py: link() first, the prompt allocates two keyed batch slots, the decoder
    pulls each into its own slot; remove_cache_key after the pulls is a no-op; deallocate."""
    p, d = comm_programs(peers, variant, pool=1 << 22)  # the sample's pool: 64 MiB
    p_comm, d_comm = comm_link(p, d)
    wait_ok(p, p_comm)
    wait_ok(d, d_comm)
    desc = (4, (2, 16 * 1024), DataType.DT_FLOAT16)
    keys = [CacheKey(prompt_cluster_id=1, req_id=0, model_id=0), CacheKey(prompt_cluster_id=1, req_id=1, model_id=0)]
    p.call(kv.allocate, "kv", *desc, seed=1, keys=keys)
    d.call(kv.allocate, "kv", *desc, seed=2)
    for slot in (0, 1):
        moved((p, "kv"), (d, "kv"), functools.partial(d.call, kv.pull_cache, keys[slot], "kv", slot),
              rows([(slot, slot)]))
    for key in keys:  # consumed by the pulls already
        p.call(kv.remove_cache_key, key)
    d.call(kv.comm_unlink, d_comm)
    p.call(kv.comm_unlink, p_comm)
    for side in (p, d):
        side.call(kv.deallocate, "kv")
        side.call(kv.finalize)


@replay_paths
def test_sample_pull_from_cache_to_blocks(peers: Callable[..., Peer], variant: Variant) -> None:
    """pull_from_cache_to_blocks.py: the decoder registers blocks before link(), pulls the prompt's
    keyed (non-blocks) cache into block 0 with an empty src_blocks."""
    p, d = comm_programs(peers, variant, pool=1 << 22)
    desc = (4, (2, 16 * 1024), DataType.DT_FLOAT16)
    key = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    d.call(kv.register_blocks, "kv", *desc, seed=2)
    p_comm, d_comm = comm_link(p, d)
    wait_ok(p, p_comm)
    wait_ok(d, d_comm)
    p.call(kv.allocate, "kv", *desc, seed=1, keys=[key])
    moved((p, "kv"), (d, "kv"), lambda: d.call(kv.pull_blocks, key, "kv", [], [0]), rows([(0, 0)]))
    d.call(kv.comm_unlink, d_comm)
    p.call(kv.comm_unlink, p_comm)
    p.call(kv.remove_cache_key, key)
    p.call(kv.deallocate, "kv")
    for side in (p, d):
        side.call(kv.finalize)


def sample_blocks(p: Peer, d: Peer) -> None:
    """The samples' caches: CacheDesc(2, [3, 10], DT_FLOAT), keyed BlocksCacheKey(own id, 0)."""
    p.call(kv.register_blocks, "kv", 2, SAMPLE_SHAPE, F32, seed=1, key=BlocksCacheKey(0, 0))
    d.call(kv.register_blocks, "kv", 2, SAMPLE_SHAPE, F32, seed=2, key=BlocksCacheKey(1, 0))


def end(*sides: Peer) -> None:
    """The samples' teardown: unregister_cache, then finalize."""
    for side in sides:
        side.call(kv.unregister, "kv")
        side.call(kv.finalize)


backends = pytest.mark.parametrize("backend", [None, "hixl"], ids=["default-backend", "hixl-backend"])


@replay_paths
@backends
def test_sample_push_blocks(peers: Callable[..., Peer], variant: Variant, backend: str | None) -> None:
    """push_blocks_sample.py: the decoder links, pushes blocks [0, 1] to [0, 2]; both force-unlink by id."""
    p, p_port, d, d_port = push_programs(peers, variant, backend)
    sample_blocks(p, d)
    assert d.call(kv.link_clusters, [(0, p_port, d_port)], 5000) == OK
    moved((d, "kv"), (p, "kv"), lambda: d.call(kv.push_blocks, BlocksCacheKey(0, 0), "kv", [0, 1], [0, 2]),
          rows([(0, 0), (1, 2)]))
    assert d.call(kv.unlink_clusters, [(0, None, None)], 5000, force=True) == OK
    assert p.call(kv.unlink_clusters, [(1, None, None)], 5000, force=True) == OK
    end(p, d)


@replay_paths
@backends
def test_sample_push_cache(peers: Callable[..., Peer], variant: Variant, backend: str | None) -> None:
    """push_cache_sample.py: unkeyed caches (the prompt's is cache id 1); the decoder pushes batch 0
    by CacheKeyByIdAndIndex, then unlinks with the id and the remote ip only (no force)."""
    p, p_port, d, d_port = push_programs(peers, variant, backend)
    assert p.call(kv.register, "kv", 2, SAMPLE_SHAPE, F32, seed=1) == 1
    d.call(kv.register, "kv", 2, SAMPLE_SHAPE, F32, seed=2)
    assert d.call(kv.link_clusters, [(0, p_port, d_port)], 5000) == OK
    moved((d, "kv"), (p, "kv"),
          lambda: d.call(kv.push_cache, CacheKeyByIdAndIndex(cluster_id=0, cache_id=1, batch_index=0), "kv", 0),
          rows([(0, 0)]))
    assert d.call(kv.unlink_clusters, [(0, p_port, None)], 5000) == OK
    end(p, d)


@replay_paths
def test_sample_switch_role(peers: Callable[..., Peer], variant: Variant) -> None:
    """switch_role_sample.py: the decoder (not listening) links and pulls, unlinks with id + remote
    ip; the prompt becomes a DECODER, the decoder a listening PROMPT; the new decoder links back and
    the new prompt pushes three blocks with layer ranges (one tensor per layer)."""
    p, p_port = program(peers, variant, "prompt", "prompt", 0, listen_port=0)
    d, _ = program(peers, variant, "decoder", "decoder", 1)
    sample_blocks(p, d)
    assert d.call(kv.link_clusters, [(0, p_port, p_port)], 5000) == OK
    moved((p, "kv"), (d, "kv"), lambda: d.call(kv.pull_blocks, BlocksCacheKey(0, 0), "kv", [0, 1], [0, 2]),
          rows([(0, 0), (1, 2)]))
    assert d.call(kv.unlink_clusters, [(0, p_port, None)], 5000) == OK
    assert p.call(kv.switch_role, "decoder") == (int(LLMRole.DECODER), 0)
    role, d_port = d.call(kv.switch_role, "prompt", "127.0.0.1:0")
    assert role == int(LLMRole.PROMPT) and d_port > 0
    assert p.call(kv.link_clusters, [(1, d_port, p_port)], 5000) == OK
    moved((d, "kv"), (p, "kv"),
          lambda: d.call(kv.push_blocks, BlocksCacheKey(0, 0), "kv", [0, 1, 2], [0, 1, 2], src_layer_range=range(0, 2),
                         dst_layer_range=range(0, 2), tensor_num_per_layer=1),
          rows([(0, 0), (1, 1), (2, 2)]))
    assert d.call(kv.unlink_clusters, [(0, None, None)], 5000, force=True) == OK
    assert p.call(kv.unlink_clusters, [(1, None, None)], 5000, force=True) == OK
    end(p, d)


@replay_paths
@backends
def test_sample_transfer_cache_async(peers: Callable[..., Peer], variant: Variant, backend: str | None) -> None:
    """transfer_cache_async_sample.py: both listen (the flags, not local_comm_res); the prompt links
    and pushes layer 0 (two tensors) by BlocksCacheKey; without block indices a blocks source moves
    block 0; both force-unlink by id (the decoder never linked)."""
    p, p_port, d, d_port = push_programs(peers, variant, backend, local_comm_res=False, cache_manager=True,
                                         remote_access=True)
    sample_blocks(p, d)
    assert p.call(kv.link_clusters, [(1, d_port, p_port)], 5000) == OK
    results = moved((p, "kv"), (d, "kv"),
                    lambda: p.call(kv.transfer_layers, "kv", BlocksCacheKey(1, 0), range(0, 1), range(0, 1)),
                    rows([(0, 0)]))
    assert results == [S.LLM_SUCCESS]
    assert p.call(kv.unlink_clusters, [(1, None, None)], 5000, force=True) == OK
    assert d.call(kv.unlink_clusters, [(0, None, None)], 5000, force=True) == OK
    end(p, d)


@replay_paths
def test_sample_hixl_transfer_backend(peers: Callable[..., Peer], variant: Variant) -> None:
    """hixl_transfer_backend_sample.py: both link to each other at once; the prompt pulls block 2
    from the decoder while the decoder pushes blocks 0-1 to it; the prompt ends with the decoder's
    bytes in all three rows (the sample's all-zeros check); both unlink by id, no force."""
    p, p_port, d, d_port = push_programs(peers, variant, "hixl")
    sample_blocks(p, d)
    assert both(lambda: p.call(kv.link_clusters, [(1, d_port, p_port)], 5000),
                lambda: d.call(kv.link_clusters, [(0, p_port, d_port)], 5000)) == [OK, OK]
    source, before = d.call(kv.snapshot, "kv"), p.call(kv.snapshot, "kv")
    both(lambda: p.call(kv.pull_blocks, BlocksCacheKey(1, 0), "kv", [2], [2]),
         lambda: d.call(kv.push_blocks, BlocksCacheKey(0, 0), "kv", [0, 1], [0, 1]))
    assert_same(p.call(kv.snapshot, "kv"), before.with_rows(source, [(0, 0), (1, 1), (2, 2)]), "the prompt's cache")
    assert_same(d.call(kv.snapshot, "kv"), source, "the decoder's cache")
    assert both(lambda: d.call(kv.unlink_clusters, [(0, None, None)], 5000),
                lambda: p.call(kv.unlink_clusters, [(1, None, None)], 5000)) == [OK, OK]
    end(p, d)


def ip_port_to_int(port: int) -> int:
    """The xpyd sample's cluster id: the IPv4 address, shifted, with the port."""
    return int(struct.unpack("!I", socket.inet_aton("127.0.0.1"))[0]) << 16 | port


@replay_paths
def test_sample_pull_blocks_xpyd(peers: Callable[..., Peer], variant: Variant) -> None:
    """pull_blocks_xpyd_sample.py: two prompts (listening; ids from ip:port) and two decoders (not
    listening); each decoder links to both prompts in one call (local port 0), pulls blocks [0, 1]
    to [0, 2] from each in turn, both decoders at once, then unlinks (no force)."""
    prompts = []
    for i in range(2):
        port = free_port()
        p, bound = program(peers, variant, f"prompt{i}", "prompt", ip_port_to_int(port), listen_port=port)
        assert bound == port
        p.call(kv.register_blocks, "kv", 1, SAMPLE_SHAPE, F32, seed=10 + i, key=BlocksCacheKey(ip_port_to_int(port), 0))
        prompts.append((p, port))
    decoders = []
    for i in range(2):
        d, _ = program(peers, variant, f"decoder{i}", "decoder", ip_port_to_int(free_port()))
        d.call(kv.register_blocks, "kv", 1, SAMPLE_SHAPE, F32, seed=None)
        decoders.append(d)
    specs = [(ip_port_to_int(port), port, 0) for _, port in prompts]
    assert on_each(decoders, kv.link_clusters, specs, 5000) == [(S.LLM_SUCCESS, [S.LLM_SUCCESS, S.LLM_SUCCESS])] * 2
    sources = [p.call(kv.snapshot, "kv") for p, _ in prompts]
    for (_, port), source in zip(prompts, sources):
        before = [d.call(kv.snapshot, "kv") for d in decoders]
        key = BlocksCacheKey(ip_port_to_int(port), 0)
        on_each(decoders, kv.pull_blocks, key, "kv", [0, 1], [0, 2])
        for d, b in zip(decoders, before):
            assert_same(d.call(kv.snapshot, "kv"), b.with_rows(source, [(0, 0), (1, 2)]), "a decoder's cache")
    for (p, _), source in zip(prompts, sources):
        assert_same(p.call(kv.snapshot, "kv"), source, "a prompt's cache")
    assert on_each(decoders, kv.unlink_clusters, specs, 5000) == [(S.LLM_SUCCESS, [S.LLM_SUCCESS, S.LLM_SUCCESS])] * 2
    for p, _ in prompts:
        wait_until(functools.partial(no_links, p), 10, "a prompt's links gone")
    end(*[p for p, _ in prompts], *decoders)
