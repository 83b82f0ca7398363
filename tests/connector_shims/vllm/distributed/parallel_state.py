"""vllm.distributed.parallel_state: one rank of world size 1 (TP 1, DP 1)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class GroupCoordinator:
    rank: int = 0
    local_rank: int = 0
    rank_in_group: int = 0
    world_size: int = 1


def get_world_group() -> GroupCoordinator:
    return GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    return GroupCoordinator()
