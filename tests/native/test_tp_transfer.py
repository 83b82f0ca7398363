"""Prefill and decode with different TP and block sizes, in real processes on every backend and
data path: prefill ranks (one engine each) hold their blocks of a model's KV tensors; a decode
rank plans its reads (``pdlink.kv.tp_plan``), turns them into strided rows (``kv.plan_rows``) and
reads them with ``Engine.read``. The decode region must then equal, byte for byte, the reference
(tests/tp_reference.py: its blocks cut from the same model tensors) in the blocks read and be
unchanged everywhere else, guards included; the prefill regions must be unchanged."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import pdlink
from backend_env import Variant
from pdlink import InvalidArgument, LLMStatusCode, kv
from peer import Peer
from peers import native, tp
from tp_reference import rank_tensors
from verify import Snapshot, assert_same

PREFILL_RANKS = 4
BLOCKS = 6  # decode blocks per region; a prefill region holds block_ratio times as many
LOCAL_BLOCKS = [4, 0, 3]  # the decode blocks read, each from the remote blocks below
SEED = 40


def geometry(layout: str, heads: int, tp_size: int, rank: int, block_tokens: int) -> kv.KvGeometry:
    return kv.KvGeometry(layout, kv_heads=heads, head_size=16, dtype="bfloat16", block_tokens=block_tokens,
                         tp_size=tp_size, tp_rank=rank, layers=2, kv=1 if layout == "MLA" else 2)


# (layout, KV heads, prefill TP, decode TP, decode rank, prefill block tokens, decode block tokens, per_token,
#  how Engine.prepare_plan reads each rank: one piece per block on both sides -> native prepared transfers)
CASES = {
    "tp 2 -> 1": ("HND", 4, 2, 1, 0, 4, 4, False, "prepared"),
    "tp 1 -> 2": ("HND", 4, 1, 2, 1, 4, 4, False, "prepared"),
    "tp 4 -> 2, 2 kv heads": ("HND", 2, 4, 2, 1, 4, 4, False, "prepared"),
    "mla 4 -> 2": ("MLA", 1, 4, 2, 1, 4, 4, False, "prepared"),
    "16 -> 32 tokens, tp 2 -> 1": ("HND", 4, 2, 1, 0, 2, 4, False, "rows"),  # HND sub-blocks: a piece per head
    "nhd 16 -> 32 tokens, tp 2 -> 2": ("NHD", 4, 2, 2, 1, 2, 4, False, "prepared"),  # token-major: one piece
    "nhd tp 1 -> 2, per token": ("NHD", 4, 1, 2, 0, 4, 4, True, "rows"),
}


@pytest.mark.parametrize("via", ["rows", "prepared"])
def test_a_decode_rank_reads_its_plan_from_the_prefill_ranks(peers: Callable[..., Peer], variant: Variant,
                                                              via: str) -> None:
    """``via``: ``kv.plan_rows`` and one ``Engine.read`` per rank, or ``Engine.prepare_plan`` and
    its ``read`` (the ranks' reads at once; native prepared transfers with block views where each
    read is one piece per block, strided rows otherwise: the case says which), over regions
    registered with their geometries (so every view the plan prepares passes the geometry check of
    ``Engine.prepare``)."""
    prefill = [peers(f"prefill{r}", env=variant.env()) for r in range(PREFILL_RANKS)]
    ports = [p.call(native.start, 10 + r, listen=True) for r, p in enumerate(prefill)]
    decode = peers("decode", env=variant.env())
    decode.call(native.start, 2)
    for r, port in enumerate(ports):
        assert decode.call(native.connect, port, 10 + r) == 10 + r
    for key, (case, (layout, heads, p_tp, d_tp, d_rank, p_tokens, d_tokens, per_token, path)) in \
            enumerate(CASES.items(), 100):
        name = case.replace(" ", "_")
        ratio = d_tokens // p_tokens
        geometries = [geometry(layout, heads, p_tp, r, p_tokens) for r in range(p_tp)]
        local = geometry(layout, heads, d_tp, d_rank, d_tokens)
        plan = kv.tp_plan(local, geometries, per_token=per_token)
        ranks = {}
        for g in geometries:
            prefill[g.tp_rank].call(native.register, name, BLOCKS * ratio, g.block_bytes, seed=None,
                                    tensors=g.layers * g.kv, key=key, geometry=g if via == "prepared" else None)
            ranks[g.tp_rank] = (10 + g.tp_rank,
                                prefill[g.tp_rank].call(tp.fill, name, g, BLOCKS * ratio, SEED))
        decode.call(native.register, name, BLOCKS, local.block_bytes, seed=7, tensors=local.layers * local.kv,
                    geometry=local if via == "prepared" else None)
        # decode block LOCAL_BLOCKS[i] from prefill blocks ratio * b + j of b = BLOCKS - 1 - LOCAL_BLOCKS[i]
        remote_blocks = [ratio * (BLOCKS - 1 - b) + j for b in LOCAL_BLOCKS for j in range(ratio)]
        originals = {r: prefill[r].call(native.snapshot, name) for r in range(p_tp)}
        before = decode.call(native.snapshot, name)
        if via == "rows":
            assert decode.call(tp.read_plan, name, plan, ranks, LOCAL_BLOCKS, remote_blocks) == list(plan.ranks), case
        else:
            sources = {r: (10 + r, prefill[r].call(native.remote, name)) for r in plan.ranks}
            paths = decode.call(tp.read_prepared, name, plan, sources, LOCAL_BLOCKS, remote_blocks)
            assert paths == dict.fromkeys(plan.ranks, path), (case, paths)
        assert_same(decode.call(native.snapshot, name), expected(before, local), f"{case}: the decode region")
        for r, snap in originals.items():
            assert_same(prefill[r].call(native.snapshot, name), snap, f"{case}: prefill rank {r}'s region")


def expected(before: Snapshot, local: kv.KvGeometry) -> Snapshot:
    """``before`` with decode block b replaced by the model's tokens of decode-sized block
    ``BLOCKS - 1 - b`` (the prefill blocks it was read from) in every tensor."""
    want = rank_tensors(local, BLOCKS, SEED)  # the decode rank's blocks of the same model tensors
    out = before
    for t, tensor in enumerate(want):
        for b in LOCAL_BLOCKS:
            src = BLOCKS - 1 - b
            out = out.with_tensor_bytes(t, b * local.block_bytes,
                                        tensor[src * local.block_bytes:(src + 1) * local.block_bytes])
    return out


@pytest.mark.parametrize("bad", ["tensor addresses past the region", "a block past the region"])
def test_rows_past_a_prefill_region_are_refused_and_move_nothing(peers: Callable[..., Peer], variant: Variant,
                                                                 bad: str) -> None:
    """A plan's rows over a remote block index, or tensor addresses, far past the prefill's region
    (far: the region's tensors are allocations of their own, and a range just past one may be
    inside the next, which is registered; test_engine_api.py tries the edge): the prefill refuses
    the first request (InvalidArgument), and the decode region is unchanged."""
    prefill = peers("prefill", env=variant.env())
    port = prefill.call(native.start, 10, listen=True)
    decode = peers("decode", env=variant.env())
    decode.call(native.start, 2)
    decode.call(native.connect, port, 10)
    g = geometry("HND", 4, 1, 0, 4)
    local = geometry("HND", 4, 2, 1, 4)
    prefill.call(native.register, "kv", BLOCKS, g.block_bytes, seed=None, tensors=g.layers * g.kv)
    addresses = prefill.call(tp.fill, "kv", g, BLOCKS, SEED)
    decode.call(native.register, "kv", BLOCKS, local.block_bytes, seed=7, tensors=local.layers * local.kv)
    plan = kv.tp_plan(local, [g])
    remote_blocks = [1 << 20] if bad == "a block past the region" else [BLOCKS - 1]
    if bad == "tensor addresses past the region":
        addresses = [a + (1 << 30) for a in addresses]
    before = decode.call(native.snapshot, "kv")
    with pytest.raises(InvalidArgument) as e:
        decode.call(tp.read_plan, "kv", plan, {0: (10, addresses)}, [1], remote_blocks)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert_same(decode.call(native.snapshot, "kv"), before, "the decode region after a refused plan")
    assert np.array_equal(prefill.call(native.snapshot, "kv").tensor(0)[:g.block_bytes],
                          rank_tensors(g, BLOCKS, SEED)[0][:g.block_bytes])


def test_prepare_plan_checks_the_regions_against_the_plan_before_anything_is_sent() -> None:
    """In this process, no peer: a region of the wrong tensor count or block size, a rank with no
    source, a RemoteRegion without tensor addresses, and block indices past either region are
    refused with InvalidArgument (LLM_PARAM_INVALID); a good binding reports its block counts."""
    prefill = [geometry("HND", 4, 2, r, 4) for r in range(2)]
    local_g = geometry("HND", 4, 1, 0, 4)
    plan = kv.tp_plan(local_g, prefill)
    tensors = local_g.layers * local_g.kv
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=2)) as engine:
        keep = [np.zeros(BLOCKS * local_g.block_bytes, np.uint8) for _ in range(tensors)]
        local = engine.register(keep, block_size=local_g.block_bytes)
        wrong = engine.register(keep[:2], block_size=local_g.block_bytes)
        remote = pdlink.RemoteRegion(length=BLOCKS * prefill[0].block_bytes, block_size=prefill[0].block_bytes,
                                     address=1 << 30, tensors=tensors,
                                     addresses=tuple((1 << 30) + t * (1 << 20) for t in range(tensors)))
        good = {0: (10, remote), 1: (11, remote)}
        bad = [(wrong, good, "does not hold the plan's 4 tensors"),
               (local, {0: (10, remote)}, "no source was given for it"),
               (local, {0: (10, remote), 1: (11, dataclasses.replace(remote, addresses=()))}, "0 tensor addresses"),
               (local, {0: (10, remote), 1: (11, dataclasses.replace(remote, length=remote.length - 1))},
                "does not hold the plan's")]
        for region, sources, text in bad:
            with pytest.raises(InvalidArgument, match=text) as e:
                engine.prepare_plan(plan, region, sources)
            assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        prepared = engine.prepare_plan(plan, local, good)
        assert (prepared.local_blocks, prepared.remote_blocks) == (BLOCKS, BLOCKS)
        for lb, rb, text in (([BLOCKS], [0], "local block index"), ([0], [BLOCKS], "remote block index"),
                             ([-1], [0], "local block index"), ([0, 1], [0], "2 local blocks need 2 remote")):
            with pytest.raises(InvalidArgument, match=text) as e:
                prepared.read(lb, rb)
            assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def hnd(heads: int, tp_size: int, rank: int, block_tokens: int = 4, dtype: str = "bfloat16") -> kv.KvGeometry:
    return dataclasses.replace(geometry("HND", heads, tp_size, rank, block_tokens), dtype=dtype)


HEAD = 4 * 16 * 2  # bytes of one head of an HND block of hnd(): 4 tokens of 16 bfloat16
# local geometry, remote geometry, prepare's keywords -> the field named (None: accepted)
PREPARES: dict[str, tuple[kv.KvGeometry, kv.KvGeometry, dict[str, Any], str | None]] = {
    "tp 2 -> 1, whole blocks": (hnd(4, 1, 0), hnd(4, 2, 0), {}, "tp_size"),
    "tp 2 -> 1, the heads rank 0 holds": (hnd(4, 1, 0), hnd(4, 2, 0), {"local_view": (0, 2 * HEAD)}, None),
    "tp 2 -> 1, rank 1's heads from rank 0": (hnd(4, 1, 0), hnd(4, 2, 0), {"local_view": (2 * HEAD, 2 * HEAD)},
                                              "tp_size"),
    "tp 1 -> 2, the decode rank's heads": (hnd(4, 2, 1), hnd(4, 1, 0), {"remote_view": (2 * HEAD, 2 * HEAD)}, None),
    "tp 2, ranks 1 and 0": (hnd(4, 2, 1), hnd(4, 2, 0), {}, "tp_rank"),
    "a view of half a head": (hnd(4, 2, 1), hnd(4, 1, 0), {"remote_view": (2 * HEAD + 8, 2 * HEAD)}, "layout"),
    "dtypes": (hnd(4, 1, 0, dtype="float16"), hnd(4, 1, 0), {}, "dtype"),
    "tp 2 -> 2, 4 -> 8 tokens, whole HND blocks": (hnd(4, 2, 0, 8), hnd(4, 2, 0), {"block_ratio": 2}, "block_tokens"),
    "4 -> 8 tokens, no ratio": (hnd(4, 1, 0, 8), hnd(4, 1, 0), {}, "block_tokens"),
    "4 -> 8 tokens, one head's tokens": (hnd(4, 1, 0, 8), hnd(4, 1, 0),
                                         {"local_view": (2 * HEAD * 2 + HEAD, HEAD), "remote_view": (2 * HEAD, HEAD)},
                                         None),
    "nhd tp 1 -> 2, a token range": (dataclasses.replace(geometry("NHD", 4, 2, 0, 4)), geometry("NHD", 4, 1, 0, 4),
                                     {"remote_view": (0, 2 * 2 * 4 * 16 * 2 // 2)}, "layout"),
    "nhd 4 -> 8 tokens": (geometry("NHD", 4, 1, 0, 8), geometry("NHD", 4, 1, 0, 4), {"block_ratio": 2}, None),
    "mla 4 -> 2": (geometry("MLA", 1, 2, 1, 4), geometry("MLA", 1, 4, 3, 4), {}, None),
}


@pytest.mark.parametrize("case", PREPARES)
def test_prepare_checks_the_two_regions_geometries(case: str) -> None:
    """In this process (prepare sends nothing): between two regions that carry geometries,
    ``Engine.prepare`` refuses a pairing whose pieces would hold different heads, or bytes off the
    layout's units, with ``GeometryMismatch`` (LLM_PARAM_INVALID) naming the field; the pairings a
    TP plan makes are accepted."""
    local_g, remote_g, keywords, field = PREPARES[case]
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=2)) as engine:
        keep = [np.zeros(2 * local_g.block_bytes, np.uint8) for _ in range(local_g.layers * local_g.kv)]
        local = engine.register(keep, geometry=local_g)
        assert local.block_size == local_g.block_bytes and local.remote().geometry == local_g
        remote = pdlink.RemoteRegion(length=2 * remote_g.block_bytes, block_size=remote_g.block_bytes, key=5,
                                     tensors=local.tensors, geometry=remote_g)
        if field is None:
            engine.prepare(10, local, remote, **keywords)
            return
        with pytest.raises(kv.GeometryMismatch) as e:
            engine.prepare(10, local, remote, **keywords)
        assert (e.value.field, e.value.status_code) == (field, LLMStatusCode.LLM_PARAM_INVALID), e.value


def test_a_region_registered_with_a_geometry_must_have_its_tensors_and_blocks() -> None:
    g = hnd(4, 1, 0)
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=2)) as engine:
        keep = [np.zeros(2 * g.block_bytes, np.uint8) for _ in range(g.layers * g.kv)]
        for memory, block_size, field in ((keep[:3], None, "layers"), (keep, g.block_bytes // 2, "block_tokens")):
            with pytest.raises(kv.GeometryMismatch) as e:
                engine.register(memory, geometry=g, block_size=block_size)
            assert (e.value.field, e.value.status_code) == (field, LLMStatusCode.LLM_PARAM_INVALID)
        with pytest.raises(TypeError, match="KvGeometry"):
            engine.register(keep, geometry=dataclasses.asdict(g))  # type: ignore[arg-type]
        assert engine.local_memory().ranges == ()  # nothing was registered


def test_prepare_plan_checks_the_regions_geometries_against_the_plan() -> None:
    prefill = [hnd(4, 2, r) for r in range(2)]
    plan = kv.tp_plan(hnd(4, 1, 0), prefill)
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=2)) as engine:
        keep = [np.zeros(2 * plan.local.block_bytes, np.uint8) for _ in range(4)]
        other = engine.register(keep, geometry=dataclasses.replace(plan.local, dtype="float16"))
        sources = {r: (10 + r, pdlink.RemoteRegion(length=2 * g.block_bytes, block_size=g.block_bytes, key=5,
                                                   tensors=4, addresses=(1 << 30,) * 4, geometry=g))
                   for r, g in enumerate(prefill)}
        with pytest.raises(kv.GeometryMismatch) as e:
            engine.prepare_plan(plan, other, sources)
        assert e.value.field == "dtype"
        engine.deregister(other)
        local = engine.register(keep, geometry=plan.local)
        with pytest.raises(kv.GeometryMismatch) as e:
            engine.prepare_plan(plan, local, {0: sources[1], 1: sources[0]})
        assert (e.value.field, e.value.status_code) == ("tp_rank", LLMStatusCode.LLM_PARAM_INVALID)
        assert engine.prepare_plan(plan, local, sources).paths == {0: "prepared", 1: "prepared"}
