"""Peer-side functions for the TP transfer tests (native/test_tp_transfer.py), on the engine and
regions of tests/peers/native.py: a prefill rank fills its region with its blocks of the model's
tensors; a decode rank reads them as a plan says (``pdlink.kv.plan_rows`` and ``Engine.read``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pdlink
from pdlink import kv
from peers import native
from peers.memory import device_memory_is_remote, direct_write
from tp_reference import rank_tensors


def fill(name: str, geometry: kv.KvGeometry, blocks: int, seed: int) -> list[int]:
    """Writes rank ``geometry``'s ``blocks`` blocks of the model's tensors (``rank_tensors``) over
    region ``name``'s tensors; their addresses."""
    region = native._state["regions"][name].region
    for address, data in zip(region.addresses, rank_tensors(geometry, blocks, seed), strict=True):
        direct_write(address, data, device_memory_is_remote())
    return list(region.addresses)


def read_plan(name: str, plan: kv.TpPlan, ranks: Mapping[int, tuple[int, Sequence[int]]], local_blocks: Sequence[int],
              remote_blocks: Sequence[int]) -> list[int]:
    """Reads ``plan`` into region ``name``: ``ranks[r]`` is (the cluster id, the tensor addresses)
    of prefill rank ``r``. One ``Engine.read`` of strided rows per rank read and tensor (each
    tensor is an allocation of its own: ``kv.tensor_parts``); the ranks read."""
    region = native._state["regions"][name].region
    rows = kv.plan_rows(plan, region.addresses, {r: addresses for r, (_, addresses) in ranks.items()}, local_blocks,
                        remote_blocks)
    for rank, (local_rows, remote_rows) in rows.items():
        for lp, rp in zip(kv.tensor_parts(local_rows, region.tensors), kv.tensor_parts(remote_rows, region.tensors),
                          strict=True):
            native._engine().read(ranks[rank][0], lp, rp)
    return sorted(rows)


def read_prepared(name: str, plan: kv.TpPlan, sources: Mapping[int, tuple[int, pdlink.RemoteRegion]],
                  local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> dict[int, str]:
    """Reads ``plan`` into region ``name`` through ``Engine.prepare_plan``: ``sources[r]`` is (the
    cluster id, the ``RemoteRegion``) of prefill rank ``r``. How each rank was read (``paths``)."""
    prepared = native._engine().prepare_plan(plan, native._state["regions"][name].region, sources)
    prepared.read(local_blocks, remote_blocks)
    return prepared.paths
