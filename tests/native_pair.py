"""Two linked engines of pdlink's own API (peers running tests/peers/native.py), the setup of
native/test_engine_api.py and paths/test_ucx_auto.py."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pdlink import LinkInfo
from peer import Peer
from peers import native
from verify import Copy, Snapshot

TARGET, INITIATOR = 1, 2
ROWS, ROW = 8, 256  # every region: 8 blocks of 256 bytes


class Two:
    """A listening target engine and an initiator engine, the target with region "src" (filled,
    published under key 7) and "sink" (zeros), the initiator with "dst" (filled with another
    pattern), linked. ``initiator_pid_namespace``: the initiator runs in a pid namespace of its own
    (``Peer``), so the link is one between "hosts"."""

    def __init__(self, peers: Callable[..., Peer], target_env: Mapping[str, str], initiator_env: Mapping[str, str],
                 initiator_pid_namespace: bool = False):
        self.target = peers("target", env=target_env)
        self.initiator = peers("initiator", env=initiator_env, pid_namespace=initiator_pid_namespace)
        port = self.target.call(native.start, TARGET, listen=True)
        self.src = self.target.call(native.register, "src", ROWS, ROW, seed=1, key=7)
        self.sink = self.target.call(native.register, "sink", ROWS, ROW, seed=None)
        self.initiator.call(native.start, INITIATOR)
        self.initiator.call(native.register, "dst", ROWS, ROW, seed=2)
        assert self.initiator.call(native.connect, port, TARGET) == TARGET

    def read(self, name: str) -> Callable[[], Snapshot]:
        side = self.initiator if name == "dst" else self.target
        return lambda: side.call(native.snapshot, name)

    def link(self, side: Peer) -> LinkInfo:
        """``side``'s one link."""
        (link,) = side.call(native.links)
        return link


def lane_families(lanes: tuple[str, ...]) -> set[str]:
    """The transport families of ``LinkInfo.lanes`` ("rc" of "rc_mlx5/mlx5_0:1", "tcp" of "tcp/lo")."""
    return {lane.split("/")[0].split("_")[0] for lane in lanes}


def copies(pairs: list[tuple[int, int, int]]) -> Callable[[Snapshot, Snapshot], Snapshot]:
    """``expect`` for byte ranges (src offset, dst offset, length) of the one tensor of a region."""
    return lambda dst0, src0: dst0.with_bytes(src0, [Copy(0, s, 0, d, n) for s, d, n in pairs])
