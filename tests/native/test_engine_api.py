"""pdlink's own engine API (``pdlink.Engine``, docs/native_api.md) between two processes, on every
backend and data path: descriptor lists, prepared transfers by key and by address, async calls,
notifications and their limits, and what happens when memory goes away under a prepared
transfer. Every transfer checks the whole destination (moved bytes equal the source, everything
else and the guards unchanged) and the source unchanged."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import internals
import native_pair
from backend_env import Variant
from conftest import only
from native_pair import INITIATOR, ROW, ROWS, TARGET, copies
from pdlink import (
    InvalidArgument,
    LinkError,
    LLMException,
    LLMStatusCode,
    NotFound,
    Notification,
    NotSupported,
    TransferTimeout,
)
from pdlink.engine import MAX_ROW_PIECES
from peer import Peer
from peers import addr, fake_ascend, native
from poll import hang_guard, wait_until
from verify import Copy, Snapshot, assert_same, check_transfer, differences, nothing, pattern, rows

TIMEOUT_MS = 3000  # both engines' transfer timeout (tests/peers/native.py start)
LIMITS = internals.core.LIMITS


class Two(native_pair.Two):
    """native_pair.Two, both engines with the matrix cell's environment; the link is checked to
    take the cell's host path."""

    def __init__(self, peers: Callable[..., Peer], variant: Variant):
        super().__init__(peers, variant.env(), variant.env())
        self.variant = variant
        link = self.link(self.initiator)
        assert (link.peer_cluster_id, link.transport, link.initiator) == (TARGET, variant.link_transport, True)


@pytest.fixture
def two(peers: Callable[..., Peer], variant: Variant) -> Iterator[Two]:
    yield Two(peers, variant)


def test_descriptor_lists_read_and_write_exact_bytes(two: Two) -> None:
    # three descriptors of different lengths, none at a block boundary, out of order
    descs = [(700, 5, 100), (0, 1500, 37), (1900, 64, 148)]  # (src offset, dst offset, length)
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.descriptors, TARGET, "dst", [(d, n) for _, d, n in descs], [(two.src + s, n) for s, _, n in descs],
        "read"), copies(descs))
    # and back into the target's empty region
    back = [(5, 33, 100), (1500, 2000, 37)]  # (dst offset in "dst", sink offset, length)
    check_transfer(two.read("dst"), two.read("sink"), lambda: two.initiator.call(
        native.descriptors, TARGET, "dst", [(s, n) for s, _, n in back], [(two.sink + d, n) for _, d, n in back],
        "write"), copies(back))


def pieces(rows_: list[tuple[int, int, int, int]]) -> list[tuple[int, int]]:
    """Strided rows (offset, length, stride, count) as their pieces (offset, length), in order."""
    return [(o + k * stride, n) for o, n, stride, count in rows_ for k in range(count)]


def test_strided_rows_read_and_write_exact_bytes(two: Two) -> None:
    """(N, 4) rows on either side pair piece by piece: one remote row of 6 pieces of 16 bytes (one
    every 96) lands as two local rows of 3 (dense, then one every 40); a remote stride of 0 reads
    the same bytes into three places; an (N, 2) list pairs with rows. And back with write."""
    local = [(100, 16, 16, 3), (900, 16, 40, 3)]
    remote = [(300, 16, 96, 6)]
    moved = [(s, d, n) for (s, n), (d, _) in zip(pieces(remote), pieces(local), strict=True)]
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.descriptors, TARGET, "dst", local, [(two.src + o, n, st, c) for o, n, st, c in remote], "read"),
        copies(moved))
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.descriptors, TARGET, "dst", [(1500, 8), (1600, 8), (1700, 8)], [(two.src + 40, 8, 0, 3)], "read"),
        copies([(40, 1500, 8), (40, 1600, 8), (40, 1700, 8)]))
    back = [(5, 24, 50, 4)]  # four pieces of "dst" into the sink, one every 300 from 33
    to = [(33, 24, 300, 4)]
    moved = [(s, d, n) for (s, n), (d, _) in zip(pieces(back), pieces(to), strict=True)]
    check_transfer(two.read("dst"), two.read("sink"), lambda: two.initiator.call(
        native.descriptors, TARGET, "dst", back, [(two.sink + o, n, st, c) for o, n, st, c in to], "write"),
        copies(moved))


# Rows refused before anything is sent (op, local rows, remote rows relative to the target's "src")
# and why; nothing moves on either side.
BAD_ROWS = {
    "a stride-0 local destination": ("read", [(0, 8, 0, 2)], [(0, 8, 8, 2)]),
    "overlapping local destination pieces": ("read", [(0, 16, 8, 2)], [(0, 16, 16, 2)]),
    "a stride-0 remote destination": ("write", [(0, 8, 8, 2)], [(0, 8, 0, 2)]),
    "a zero length": ("read", [(0, 0, 8, 2)], [(0, 0, 8, 2)]),
    "a zero count": ("read", [(0, 8, 8, 0)], [(0, 8, 8, 0)]),
    "a stride that wraps": ("read", [(0, 8, 8, 2)], [(0, 8, 2**63, 3)]),
    "pieces that differ in length": ("read", [(0, 8, 8, 2)], [(0, 16, 16, 1)]),
    "different piece counts": ("read", [(0, 8, 8, 2)], [(0, 8, 8, 3)]),
    "more pieces than MAX_ROW_PIECES": ("read", [(0, 1, 1, MAX_ROW_PIECES + 1)], [(0, 1, 1, MAX_ROW_PIECES + 1)]),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_strided_rows_are_refused_and_move_nothing(two: Two, case: str) -> None:
    op, local, remote = BAD_ROWS[case]
    with pytest.raises(InvalidArgument) as e:
        check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
            native.descriptors, TARGET, "dst", local, [(two.src + o, *rest) for o, *rest in remote], op), nothing)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_a_strided_row_running_past_the_peers_registration_is_refused_by_the_peer(two: Two) -> None:
    # 8 pieces of 64 bytes one block apart from offset 0: the 8th ends at 7 * 256 + 64, inside;
    # from offset 256 the 8th runs into the guard past the region: the target refuses it
    ok = [(0, 64, ROW, 8)]
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.descriptors, TARGET, "dst", [(0, 64, 64, 8)], [(two.src + o, *rest) for o, *rest in ok], "read"),
        copies([(k * ROW, k * 64, 64) for k in range(8)]))
    with pytest.raises(InvalidArgument) as e:
        check_transfer(two.read("dst"), two.read("dst"), lambda: two.initiator.call(
            native.descriptors, TARGET, "dst", [(0, 64, 64, 8)], [(two.src + ROW, 64, ROW, 8)], "read"), nothing)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_links_name_the_lanes_beneath_the_host_path(two: Two) -> None:
    """``LinkInfo.lanes``: on the ucx path, UCX's lanes once a transfer connected it (tcp alone
    under UCX_TLS=tcp; shared memory between these proven same-host peers under sm,tcp), and none
    on the target's side, which has not requested anything; on cma, on both sides, how the copies
    reach the peer (two engines of one user with the same capabilities: by pid number); none on
    every other path."""
    descs = [(64, 0, 200)]
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.descriptors, TARGET, "dst", [(d, n) for _, d, n in descs], [(two.src + s, n) for s, _, n in descs],
        "read"), copies(descs))
    (mine,) = two.initiator.call(native.links)
    (theirs,) = two.target.call(native.links)
    families = native_pair.lane_families(mine.lanes)
    if two.variant.kind in ("ucx", "ucx-hosts"):
        assert mine.lanes and families == {"tcp"}, mine.lanes
    elif two.variant.kind == "ucx-sm":
        assert families & {"posix", "sysv", "cma", "knem", "xpmem"}, mine.lanes
    elif mine.transport == "cma":  # fixed when the link is made, on both sides
        assert mine.lanes == theirs.lanes == ("process_vm",)
        return
    else:
        assert mine.lanes == ()
    assert theirs.lanes == ()


@pytest.mark.parametrize("by", ["key", "address"])
def test_prepared_transfers_move_blocks_by_index(two: Two, by: str) -> None:
    remote = two.target.call(native.remote, "src")
    if by == "address":
        remote = type(remote)(length=remote.length, block_size=remote.block_size, address=remote.address)
    two.initiator.call(native.prepare, "p", TARGET, "dst", remote)
    moves = [(7, 0), (6, 1), (0, 5), (1, 6)]  # (remote block, local block): not all coalesce
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.post, "p", [d for _, d in moves], [s for s, _ in moves], "read"), rows(moves))
    # posted again with other blocks: the same prepared transfer
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.post, "p", [3], [2], "read"), rows([(2, 3)]))
    sink = two.target.call(native.remote, "sink")
    two.initiator.call(native.prepare, "w", TARGET, "dst", sink)
    check_transfer(two.read("dst"), two.read("sink"), lambda: two.initiator.call(
        native.post, "w", [0, 1, 2], [4, 5, 6], "write"), rows([(0, 4), (1, 5), (2, 6)]))


@pytest.mark.parametrize("by", ["key", "address"])
def test_prepared_block_views_and_ratios_move_exact_bytes(two: Two, by: str) -> None:
    """A head slice (the second half of each remote block into the first half of each local one),
    both ways; a block ratio of 2 (a local block of 256 bytes from two remote blocks of 128, the
    target's region "small"); and both at once (the middle half of each local block in two pieces
    of 64, each the second quarter of a remote block)."""
    two.target.call(native.register, "small", 2 * ROWS, ROW // 2, seed=3, key=8)
    src, small, sink = (two.target.call(native.remote, name) for name in ("src", "small", "sink"))
    if by == "address":
        src, small, sink = (type(r)(length=r.length, block_size=r.block_size, address=r.address)
                            for r in (src, small, sink))
    half = ROW // 2
    two.initiator.call(native.prepare, "slice", TARGET, "dst", src, local_view=(0, half), remote_view=(half, half))
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.post, "slice", [2, 5, 6], [1, 6, 7], "read"),
        copies([(1 * ROW + half, 2 * ROW, half), (6 * ROW + half, 5 * ROW, half), (7 * ROW + half, 6 * ROW, half)]))
    two.initiator.call(native.prepare, "slice-w", TARGET, "dst", sink, local_view=(half, half), remote_view=(0, half))
    check_transfer(two.read("dst"), two.read("sink"), lambda: two.initiator.call(
        native.post, "slice-w", [0, 3], [4, 1], "write"), copies([(half, 4 * ROW, half), (3 * ROW + half, ROW, half)]))
    # a ratio: the target's "small" blocks are 128 bytes
    two.initiator.call(native.prepare, "ratio", TARGET, "dst", small, block_ratio=2)
    src_small = lambda: two.target.call(native.snapshot, "small")  # noqa: E731
    check_transfer(src_small, two.read("dst"), lambda: two.initiator.call(
        native.post, "ratio", [3, 0], [5, 0, 15, 14], "read"),
        copies([(5 * half, 3 * ROW, half), (0, 3 * ROW + half, half), (15 * half, 0, half), (14 * half, half, half)]))
    q = ROW // 4
    two.initiator.call(native.prepare, "both", TARGET, "dst", small, block_ratio=2, local_view=(q, half),
                       remote_view=(q // 2, q))
    check_transfer(src_small, two.read("dst"), lambda: two.initiator.call(
        native.post, "both", [7], [9, 2], "read"),
        copies([(9 * half + q // 2, 7 * ROW + q, q), (2 * half + q // 2, 7 * ROW + 2 * q, q)]))


# Mappings refused at prepare (InvalidArgument, nothing sent): (Engine.prepare's keywords, the message).
BAD_MAPPINGS: dict[str, tuple[dict[str, Any], str]] = {
    "a local view past the block": ({"local_view": (ROW // 2, ROW // 2 + 1)}, "is not inside a local block"),
    "a remote view past the block": ({"remote_view": (ROW - 8, 16), "local_view": (0, 16)},
                                     "is not inside a remote block"),
    "a remote view of another length": ({"remote_view": (0, 16), "local_view": (0, 32)}, "is not the local view's"),
    "a view that does not divide by the ratio": ({"local_view": (0, 101), "block_ratio": 2}, "equal pieces"),
    "a ratio of 0": ({"block_ratio": 0}, "block_ratio must be at least 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_MAPPINGS))
def test_a_mapping_that_does_not_fit_the_blocks_is_refused_at_prepare(two: Two, case: str) -> None:
    kwargs, text = BAD_MAPPINGS[case]
    with pytest.raises(InvalidArgument, match=text) as e:
        two.initiator.call(native.prepare, "bad", TARGET, "dst", two.target.call(native.remote, "src"), **kwargs)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_a_ratio_post_needs_ratio_remote_indices_per_local_one(two: Two) -> None:
    two.target.call(native.register, "small", 2 * ROWS, ROW // 2, seed=3, key=8)
    two.initiator.call(native.prepare, "ratio", TARGET, "dst", two.target.call(native.remote, "small"), block_ratio=2)
    with pytest.raises(ValueError, match="2 local blocks need 4 remote blocks, got 3"):
        check_transfer(lambda: two.target.call(native.snapshot, "small"), two.read("dst"), lambda: two.initiator.call(
            native.post, "ratio", [0, 1], [0, 1, 2], "read"), nothing)
    with pytest.raises(InvalidArgument, match="remote block index 16 out of range") as e:  # the raw bound: 16 blocks
        two.initiator.call(native.prepare, "raw", TARGET, "dst", type(two.target.call(native.remote, "small"))(
            length=2 * ROWS * (ROW // 2), block_size=ROW // 2, address=two.target.call(native.addresses, "small")[0]),
            block_ratio=2)
        check_transfer(lambda: two.target.call(native.snapshot, "small"), two.read("dst"), lambda: two.initiator.call(
            native.post, "raw", [0], [15, 16], "read"), nothing)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_regions_of_several_tensors_move_every_tensors_blocks(two: Two) -> None:
    """A region of 3 tensors (a KV cache's layers) published by key: a prepared post moves the
    indexed blocks of every tensor; a descriptor into one tensor moves only there."""
    two.target.call(native.register, "layers", ROWS, ROW, seed=3, key=9, tensors=3)
    layers = two.target.call(native.addresses, "layers")
    two.initiator.call(native.register, "mine", ROWS, ROW, seed=4, tensors=3)
    remote = two.target.call(native.remote, "layers")
    assert (remote.tensors, remote.key) == (3, 9)
    two.initiator.call(native.prepare, "p", TARGET, "mine", remote)
    moves = [(2, 0), (3, 1), (7, 4)]  # (remote block, local block)
    check_transfer(lambda: two.target.call(native.snapshot, "layers"),
                   lambda: two.initiator.call(native.snapshot, "mine"),
                   lambda: two.initiator.call(native.post, "p", [d for _, d in moves], [s for s, _ in moves], "read"),
                   rows(moves))
    # 100 bytes from the target's tensor 2 into the initiator's tensor 1 only
    check_transfer(lambda: two.target.call(native.snapshot, "layers"),
                   lambda: two.initiator.call(native.snapshot, "mine"),
                   lambda: two.initiator.call(native.descriptors, TARGET, "mine", [(300, 100)],
                                              [(layers[2] + 40, 100)], "read", 1),
                   lambda dst0, src0: dst0.with_bytes(src0, [Copy(2, 40, 1, 300, 100)]))
    with pytest.raises(ValueError, match="has 3 tensors, the remote one 1"):
        two.initiator.call(native.prepare, "q", TARGET, "mine", two.target.call(native.remote, "src"))
    by_address = type(remote)(length=remote.length, block_size=remote.block_size, address=remote.address, tensors=3)
    with pytest.raises(ValueError, match="reached by its key"):
        two.initiator.call(native.prepare, "q", TARGET, "mine", by_address)


def test_async_posts_report_done_and_failed(two: Two) -> None:
    two.initiator.call(native.prepare, "p", TARGET, "dst", two.target.call(native.remote, "src"))

    def action() -> tuple[str, str | None, int | None]:
        two.initiator.call(native.post_async, "p", [2, 3], [4, 5], "read")
        return two.initiator.call(native.wait, "p")
    assert check_transfer(two.read("src"), two.read("dst"), action, rows([(4, 2), (5, 3)])) == ("DONE", None, None)

    # a remote block past the region: refused here before anything moves
    def refused() -> tuple[str, str | None, int | None]:
        two.initiator.call(native.post_async, "p", [0], [ROWS], "read")
        return two.initiator.call(native.wait, "p")

    assert check_transfer(two.read("src"), two.read("dst"), refused, nothing) == (
        "FAILED", "InvalidArgument", LLMStatusCode.LLM_PARAM_INVALID)


def test_a_prepared_transfer_is_not_a_pin(two: Two) -> None:
    """The target withdraws its region under a prepared transfer: the next post fails with the
    peer's code and moves nothing; republished under the same key, a post by key reaches the new
    memory (re-prepared through the registry's generation), and a transfer whose local region is
    gone fails here."""
    two.initiator.call(native.prepare, "p", TARGET, "dst", two.target.call(native.remote, "src"))
    two.initiator.call(native.post, "p", [0], [0], "read")  # the same-host path now holds the layout
    two.target.call(native.deregister, "src")
    with pytest.raises(NotFound) as e:
        check_transfer(two.read("dst"), two.read("dst"),
                       lambda: two.initiator.call(native.post, "p", [1], [1], "read"), nothing)
    assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    two.target.call(native.register, "src2", ROWS, ROW, seed=3, key=7)
    check_transfer(two.read("src2"), two.read("dst"), lambda: two.initiator.call(
        native.post, "p", [1, 2], [6, 7], "read"), rows([(6, 1), (7, 2)]))
    two.initiator.call(native.deregister, "dst")
    with pytest.raises(InvalidArgument, match="no longer registered; prepare it again") as e2:
        two.initiator.call(native.post, "p", [1], [1], "read")
    assert e2.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_outside_the_peers_registered_memory_is_refused(two: Two) -> None:
    # one byte past the target's region "src" (the guard bytes): refused by the target, nothing moves
    with pytest.raises(InvalidArgument) as e:
        check_transfer(two.read("dst"), two.read("dst"), lambda: two.initiator.call(
            native.descriptors, TARGET, "dst", [(0, 64)], [(two.src + ROWS * ROW - 63, 64)], "read"), nothing)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    # a local descriptor outside the initiator's own region: refused before anything is sent
    with pytest.raises(InvalidArgument) as e:
        check_transfer(two.read("src"), two.read("src"), lambda: two.initiator.call(
            native.descriptors, TARGET, "dst", [(ROWS * ROW - 8, 64)], [(two.src, 64)], "write"), nothing)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_a_descriptor_list_is_all_or_nothing(two: Two) -> None:
    """Descriptors into two local regions, as three parallel lists (read_batch): one request. One
    remote range past the target's region, or one local range past its region, and neither region
    changes; the same list without it moves every byte."""
    two.initiator.call(native.register, "dst2", ROWS, ROW, seed=5)
    dst2 = lambda: two.initiator.call(native.snapshot, "dst2")  # noqa: E731
    good = [("dst", 10, 100), ("dst2", 300, 64)]
    remote = [two.src + 700, two.src + 1200]
    for local, rem in (
            (good + [("dst2", 0, 64)], remote + [two.src + ROWS * ROW - 63]),  # remote one byte past
            (good + [("dst2", ROWS * ROW - 8, 64)], remote + [two.src]),  # local past "dst2"
    ):
        before, before2 = two.read("dst")(), dst2()
        with pytest.raises(InvalidArgument) as e:
            two.initiator.call(native.batch, TARGET, local, rem, "read")
        assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert_same(two.read("dst")(), before, "dst after a refused list")
        assert_same(dst2(), before2, "dst2 after a refused list")
    src0, d0, d20 = two.read("src")(), two.read("dst")(), dst2()
    two.initiator.call(native.batch, TARGET, good, remote, "read")
    assert_same(two.read("dst")(), d0.with_bytes(src0, [Copy(0, 700, 0, 10, 100)]), "dst")
    assert_same(dst2(), d20.with_bytes(src0, [Copy(0, 1200, 0, 300, 64)]), "dst2")
    assert_same(two.read("src")(), src0, "the source")


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_a_descriptor_list_may_mix_host_and_device_memory(peers: Callable[..., Peer], variant: Variant,
                                                          sealed: bool) -> None:
    """One list whose ranges lie in HOST and DEVICE memory on both sides, read and written (hixl's
    D2RD, D2RH, H2RD and H2RH in one batch), ranges longer than a staging chunk and crossing chunk
    boundaries, on a plain link and on one with a secret and payload integrity (every chunk sealed):
    every byte lands, nothing else changes. On a device backend the DEVICE ranges pass through host
    staging on the stream path (docs/native_api.md); on the CPU backend every region is host memory."""
    rows, row = 64, 16384  # 1 MiB regions: staging moves 256 KiB chunks
    secret = dict(secret="mixed-lists", payload_integrity=True) if sealed else {}
    target, initiator = peers("target", env=variant.env()), peers("initiator", env=variant.env())
    port = target.call(native.start, TARGET, listen=True, **secret)
    initiator.call(native.start, INITIATOR, **secret)
    names = {target: {"dsrc": False, "hsrc": True, "dsink": False, "hsink": True},
             initiator: {"ddst": False, "hdst": True}}
    base = {name: side.call(native.register, name, rows, row, seed=None if "sink" in name else k, host=host)
            for k, (side, regions) in enumerate(names.items()) for name, host in regions.items()}
    assert initiator.call(native.connect, port, TARGET) == TARGET

    def snapshots() -> dict[str, Snapshot]:
        return {n: side.call(native.snapshot, n) for side, regions in names.items() for n in regions}

    # (local region, offset, remote region, offset, length), out of order, unaligned
    reads = [("ddst", 100, "dsrc", 700, 300_000), ("hdst", 0, "dsrc", 5, 64),
             ("ddst", 400_000, "hsrc", 33, 500_000), ("hdst", 1000, "hsrc", 900_000, 148),
             ("ddst", 1, "dsrc", 2000, 48), ("hdst", 2048, "dsrc", 262_100, 270_000)]
    writes = [("ddst", 3, "dsink", 900, 700_000), ("hdst", 10, "dsink", 800_000, 90),
              ("ddst", 1800, "hsink", 1, 200), ("hdst", 400, "hsink", 1024, 1_000_000)]
    for op, moves in (("read", reads), ("write", writes)):
        before = snapshots()
        initiator.call(native.batch, TARGET, [(ln, lo, n) for ln, lo, _, _, n in moves],
                       [base[rn] + ro for _, _, rn, ro, n in moves], op)
        expected = dict(before)
        for ln, lo, rn, ro, n in moves:
            src, s_off, dst, d_off = (rn, ro, ln, lo) if op == "read" else (ln, lo, rn, ro)
            expected[dst] = expected[dst].with_bytes(before[src], [Copy(0, s_off, 0, d_off, n)])
        after = snapshots()
        for name in after:
            assert_same(after[name], expected[name], f"{name} after a mixed {op}")


ACL_ERROR_RT_INTERNAL_ERROR = 507000


@only("ascend-fake")
@pytest.mark.parametrize("side", ["target", "initiator"])
def test_a_failed_staging_copy_fails_the_list_and_drops_the_link(peers: Callable[..., Peer], variant: Variant,
                                                                  side: str) -> None:
    """A read between DEVICE and HOST memory is staged on the side with the DEVICE range; when that
    side's copy (aclrtMemcpy) fails, the call fails with LLM_LINK_FAILED (the stream is out of
    step), the link is broken, nothing lands, the source is unchanged, and after a new connect the
    same read moves every byte."""
    target, initiator = peers("target", env=variant.env()), peers("initiator", env=variant.env())
    port = target.call(native.start, TARGET, listen=True)
    initiator.call(native.start, INITIATOR)
    # the target stages DEVICE -> HOST for a host destination; the initiator HOST -> DEVICE for a
    # device one (after its device paths turn the host source down)
    staging = target if side == "target" else initiator
    src = target.call(native.register, "src", ROWS, ROW, seed=1, host=side == "initiator")
    initiator.call(native.register, "dst", ROWS, ROW, seed=2, host=side == "target")
    assert initiator.call(native.connect, port, TARGET) == TARGET
    descs = [(100, 0, 1000), (0, 1500, 300)]  # (src offset, dst offset, length)
    read = lambda: initiator.call_within(hang_guard(TIMEOUT_MS), native.batch, TARGET,  # noqa: E731
                                         [("dst", d, n) for _, d, n in descs], [src + s for s, _, n in descs], "read")
    copies_before = staging.call(fake_ascend.calls, "aclrtMemcpy")
    staging.call(fake_ascend.inject, "aclrtMemcpy", ACL_ERROR_RT_INTERNAL_ERROR)  # the next one fails
    with pytest.raises(LinkError) as e:
        check_transfer(lambda: target.call(native.snapshot, "src"), lambda: initiator.call(native.snapshot, "dst"),
                       read, nothing)
    assert e.value.status_code == LLMStatusCode.LLM_LINK_FAILED, e.value
    assert staging.call(fake_ascend.calls, "aclrtMemcpy") == copies_before + 1  # the injected failure, only
    assert [link.broken for link in initiator.call(native.links)] == [True]
    initiator.call(native.disconnect, TARGET)
    assert initiator.call(native.connect, port, TARGET) == TARGET
    check_transfer(lambda: target.call(native.snapshot, "src"), lambda: initiator.call(native.snapshot, "dst"),
                   read, copies(descs))


@only("ascend-fake")
def test_a_device_engine_moves_lists_with_a_cpu_engine(peers: Callable[..., Peer], variant: Variant) -> None:
    """An Ascend engine and a CPU-backend engine (no device channels): descriptor lists between the
    Ascend side's DEVICE memory and the CPU side's host memory go staged over the stream, both ways,
    every byte exact; a prepared transfer of DEVICE blocks, which needs a device path, is refused
    with LLM_FEATURE_NOT_ENABLED and moves nothing."""
    target = peers("target", env=variant.env(PDLINK_BACKEND="cpu"))
    initiator = peers("initiator", env=variant.env())
    port = target.call(native.start, TARGET, listen=True)
    initiator.call(native.start, INITIATOR)
    src = target.call(native.register, "src", ROWS, ROW, seed=1, key=7)  # host memory (CPU backend)
    initiator.call(native.register, "dst", ROWS, ROW, seed=2)  # DEVICE memory
    assert initiator.call(native.connect, port, TARGET) == TARGET
    descs = [(700, 5, 100), (0, 1500, 37), (1900, 64, 148)]  # (target offset, initiator offset, length)
    target_src, initiator_dst = (lambda: target.call(native.snapshot, "src")), (
        lambda: initiator.call(native.snapshot, "dst"))
    check_transfer(target_src, initiator_dst, lambda: initiator.call(
        native.batch, TARGET, [("dst", d, n) for _, d, n in descs], [src + s for s, _, n in descs], "read"),
        copies([(s, d, n) for s, d, n in descs]))
    check_transfer(initiator_dst, target_src, lambda: initiator.call(
        native.batch, TARGET, [("dst", d, n) for _, d, n in descs], [src + s for s, _, n in descs], "write"),
        copies([(d, s, n) for s, d, n in descs]))
    initiator.call(native.prepare, "p", TARGET, "dst", target.call(native.remote, "src"))
    dst0 = initiator_dst()
    with pytest.raises(NotSupported) as e:
        initiator.call(native.post, "p", [0], [1], "read")
    assert e.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED, e.value
    assert_same(initiator_dst(), dst0, "the initiator's memory after a refused prepared read")


@only("ascend-fake")
@pytest.mark.parametrize("op", ["read", "write"])
def test_a_frozen_peer_mid_staged_list_gives_a_timeout(peers: Callable[..., Peer], variant: Variant, op: str) -> None:
    """A list between DEVICE and HOST memory takes the staged stream path (the target stages its
    DEVICE range through host memory); a target frozen before it answers makes the call
    LLM_TIMEOUT (a TimeoutError) within the engine's timeout and breaks the link. A timed-out read
    lands nothing. A timed-out write had its request and bytes on the wire: the target applies them
    when it resumes, exactly those bytes (a writer treats a timed-out write's destination as
    unknown: docs/reliability.md). After the thaw a new connect moves every byte."""
    target, initiator = peers("target", env=variant.env()), peers("initiator", env=variant.env())
    port = target.call(native.start, TARGET, listen=True)
    initiator.call(native.start, INITIATOR)
    src = target.call(native.register, "src", ROWS, ROW, seed=1)  # DEVICE memory on the target
    initiator.call(native.register, "dst", ROWS, ROW, seed=2, host=True)
    assert initiator.call(native.connect, port, TARGET) == TARGET
    descs = [(100, 0, 1000), (0, 1500, 300)]  # (target offset, initiator offset, length)
    move = lambda: initiator.call_within(hang_guard(TIMEOUT_MS), native.batch, TARGET,  # noqa: E731
                                         [("dst", d, n) for _, d, n in descs], [src + s for s, _, n in descs], op)
    dst0, src0 = initiator.call(native.snapshot, "dst"), target.call(native.snapshot, "src")
    target.freeze()
    try:
        with pytest.raises(TransferTimeout) as e:
            move()
    finally:
        target.thaw()
    assert e.value.status_code == LLMStatusCode.LLM_TIMEOUT, e.value
    assert_same(initiator.call(native.snapshot, "dst"), dst0, "the initiator's memory after the timeout")
    if op == "read":
        assert_same(target.call(native.snapshot, "src"), src0, "the target's memory after the timeout")
    else:
        written = copies([(d, s, n) for s, d, n in descs])(src0, dst0)
        wait_until(lambda: not differences(target.call(native.snapshot, "src"), written), 10,
                   "the timed-out write applied by the thawed target")
    assert [link.broken for link in initiator.call(native.links)] == [True]
    initiator.call(native.disconnect, TARGET)
    assert initiator.call(native.connect, port, TARGET) == TARGET
    if op == "read":
        check_transfer(lambda: target.call(native.snapshot, "src"), lambda: initiator.call(native.snapshot, "dst"),
                       move, copies(descs))
    else:
        check_transfer(lambda: initiator.call(native.snapshot, "dst"), lambda: target.call(native.snapshot, "src"),
                       move, copies([(d, s, n) for s, d, n in descs]))


def test_registered_memory_stays_alive_until_deregistered(two: Two) -> None:
    """An array registered with nothing else referencing it is not freed while the engine publishes
    it: after a collection and many allocations of its size, the peer still reads its bytes. Once
    deregistered it is freed, and the same read is refused and moves nothing."""
    nbytes = ROWS * ROW
    two.initiator.call(native.register, "hdst", ROWS, ROW, seed=2, host=True)  # numpy memory is host memory
    two.target.call(native.register_owned, "owned", ROWS, ROW, seed=9, key=11)
    two.target.call(native.litter, 64, nbytes, 0xEE)  # would land where the array was, had it been freed
    assert not two.target.call(native.owned_released, "owned")
    remote = two.target.call(native.remote_owned, "owned")
    two.initiator.call(native.prepare, "owned", TARGET, "hdst", remote)
    src = Snapshot("the owned array", "bare", [pattern(nbytes, 0, 9)], [(0, 0)], nbytes, ROWS)
    check_transfer(lambda: src, lambda: two.initiator.call(native.snapshot, "hdst"), lambda: two.initiator.call(
        native.post, "owned", [0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0], "read"),
        rows([(7 - i, i) for i in range(ROWS)]))
    two.target.call(native.deregister_owned, "owned")
    wait_until(lambda: two.target.call(native.owned_released, "owned"), 10, "the array freed once deregistered")
    dst0 = two.initiator.call(native.snapshot, "hdst")
    with pytest.raises(LLMException) as e:
        two.initiator.call(native.post, "owned", [0], [0], "read")
    assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, e.value
    assert_same(two.initiator.call(native.snapshot, "hdst"), dst0, "the destination after a refused read")


@pytest.mark.heavy
@only("cpu-cma", "cpu-tcp")
@pytest.mark.parametrize("mib", [1, 64], ids=["bounced", "split"])
def test_a_read_racing_a_deregistration_never_returns_reused_bytes(two: Two, mib: int) -> None:
    """A read by address while the target deregisters the region and overwrites it as soon as that
    returns (at offsets of 0 to 4 ms into the read): the read either fails or returns only bytes
    that were registered. Same-host, from the cached memory table (1 MiB: one copy through the
    bounce buffer; 64 MiB: a copy split between two threads, where the generation word must still
    be read after all the data); over tcp, served by the target, whose deregistration waits for the
    answer (before round 10 of the hostile review it did not, and 17 of 20 reads returned success
    with bytes written after it)."""
    nbytes = mib << 20
    two.target.call(native.register, "big", 1, nbytes, seed=None)
    two.target.call(native.withdraw_and_reuse, "big", 0)  # each trial registers it anew
    two.initiator.call(native.register, "bigdst", 1, nbytes, seed=None, host=True)
    outcomes = {True: 0, False: 0}
    for trial in range(20):
        addr = two.target.call(native.reregister, "big", 0x11)
        two.initiator.call(native.start_read, TARGET, "bigdst", addr)  # warm: the table is cached
        assert two.initiator.call(native.finish_read, "bigdst", 0x11) == (True, nbytes)
        two.target.call(native.withdraw_and_reuse_after, "big", 0x22, (trial % 5) ** 2 / 4)
        two.initiator.call(native.start_read, TARGET, "bigdst", addr)
        ok, reused = two.initiator.call(native.finish_read, "bigdst", 0x22)
        two.target.call(native.withdrawn)
        assert not (ok and reused), f"an OK read returned {reused} bytes written after the deregistration"
        outcomes[ok] += 1
    assert outcomes[True] + outcomes[False] == 20


def test_reads_by_address_follow_the_peers_registrations(two: Two) -> None:
    """A read by address (on a same-host link served from the peer's cached memory table): once the
    target withdraws the region the same read is refused and moves nothing; a region registered
    afterwards is read at once (the table is fetched again)."""
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.batch, TARGET, [("dst", 0, 256)], [two.src + 256], "read"), copies([(256, 0, 256)]))
    two.target.call(native.deregister, "src")
    with pytest.raises(InvalidArgument) as e:
        check_transfer(two.read("dst"), two.read("dst"), lambda: two.initiator.call(
            native.batch, TARGET, [("dst", 0, 256)], [two.src + 256], "read"), nothing)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    src3 = two.target.call(native.register, "src3", ROWS, ROW, seed=6)
    check_transfer(two.read("src3"), two.read("dst"), lambda: two.initiator.call(
        native.batch, TARGET, [("dst", 512, 300)], [src3 + 40], "read"), copies([(40, 512, 300)]))


def test_memory_maps_list_what_is_registered(two: Two) -> None:
    """remote_memory: the target's regions as (address, length), sorted, and what covers() accepts;
    a registration adds a range, a release changes the generation. local_memory: this engine's own."""
    m = two.initiator.call(native.remote_memory, TARGET)
    assert m.ranges == tuple(sorted([(two.src, ROWS * ROW), (two.sink, ROWS * ROW)]))
    assert m.covers([two.src, two.sink + 8], [ROWS * ROW, 64])
    assert not m.covers([two.src + ROWS * ROW - 8], [16]) and not m.covers([two.src], [0])
    more = two.target.call(native.register, "more", ROWS, ROW, seed=None)
    m2 = two.initiator.call(native.remote_memory, TARGET)
    assert (more, ROWS * ROW) in m2.ranges and len(m2.ranges) == 3
    two.target.call(native.deregister, "more")
    m3 = two.initiator.call(native.remote_memory, TARGET)
    assert m3.generation > m2.generation and m3.ranges == m.ranges
    mine = two.initiator.call(native.local_memory)
    assert mine.ranges == ((two.initiator.call(native.addresses, "dst")[0], ROWS * ROW),)


def test_a_batch_handle_moves_lists_as_read_batch_does(two: Two) -> None:
    """``Engine.batch(peer)``: the same all-or-nothing requests as ``read_batch`` / ``write_batch``,
    by its own timeout or the engine's; a list with one range past the peer's region moves none."""
    reads = [(700, 5, 100), (0, 1500, 37), (1900, 64, 148)]  # (src offset, dst offset, length)
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.batch_handle, TARGET, [("dst", d, n) for _, d, n in reads], [two.src + s for s, _, n in reads],
        "read"), copies(reads))
    writes = [(5, 33, 100), (1500, 2000, 37)]  # (offset in "dst", sink offset, length)
    check_transfer(two.read("dst"), two.read("sink"), lambda: two.initiator.call(
        native.batch_handle, TARGET, [("dst", s, n) for s, _, n in writes], [two.sink + d for _, d, n in writes],
        "write", 2000), copies(writes))
    with pytest.raises(InvalidArgument) as e:
        check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
            native.batch_handle, TARGET, [("dst", 0, 64), ("dst", 100, 64)], [two.src, two.src + ROWS * ROW - 63],
            "read"), nothing)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    for timeout in (-1, 2**31):
        with pytest.raises(ValueError, match="timeout_ms"):
            two.initiator.call(native.batch_handle, TARGET, [("dst", 0, 64)], [two.src], "read", timeout)


def test_after_disconnect_transfers_need_a_link(two: Two) -> None:
    two.initiator.call(native.prepare, "p", TARGET, "dst", two.target.call(native.remote, "src"))
    two.initiator.call(native.batch_handle, TARGET, [("dst", 0, 64)], [two.src], "read")  # a handle, made linked
    two.initiator.call(native.disconnect, TARGET)
    assert two.initiator.call(native.links) == []
    for after in (lambda: two.initiator.call(native.post, "p", [0], [0], "read"),
                  lambda: two.initiator.call(native.batch_handle, TARGET, [("dst", 0, 64)], [two.src], "read")):
        with pytest.raises(LinkError) as e:
            check_transfer(two.read("src"), two.read("dst"), after, nothing)
        assert e.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
        assert isinstance(e.value, ConnectionError)


def test_a_frozen_peer_gives_a_timeout(two: Two) -> None:
    """Through the peer's serving thread, a frozen peer is a timeout and nothing moves. On the
    same-host path a prepared read by key, and a read by address, is one kernel copy with no round
    trip: the frozen peer's bytes arrive all the same (docs/architecture.md, "Data paths")."""
    two.initiator.call(native.prepare, "p", TARGET, "dst", two.target.call(native.remote, "src"))
    if not two.variant.serving_loop:
        two.initiator.call(native.post, "p", [0], [0], "read")  # the layout is fetched once
        src0, dst0 = two.target.call(native.snapshot, "src"), two.initiator.call(native.snapshot, "dst")
        two.target.freeze()
        two.initiator.call_within(hang_guard(TIMEOUT_MS), native.post, "p", [1, 2], [6, 7], "read")
        two.target.thaw()
        assert_same(two.initiator.call(native.snapshot, "dst"), rows([(6, 1), (7, 2)])(dst0, src0), "destination")
        assert_same(two.target.call(native.snapshot, "src"), src0, "source")
        # a read by address, from the peer's memory table fetched by a first read, likewise
        two.initiator.call(native.batch, TARGET, [("dst", 0, 8)], [two.src], "read")
        dst1 = two.initiator.call(native.snapshot, "dst")
        two.target.freeze()
        two.initiator.call_within(hang_guard(TIMEOUT_MS), native.batch, TARGET, [("dst", 1000, 300)], [two.src + 77],
                                  "read")
        two.target.thaw()
        assert_same(two.initiator.call(native.snapshot, "dst"), copies([(77, 1000, 300)])(dst1, src0), "destination")
        return
    dst0 = two.initiator.call(native.snapshot, "dst")
    two.target.freeze()
    with pytest.raises(LLMException) as e:
        two.initiator.call_within(hang_guard(TIMEOUT_MS), native.post, "p", [0], [0], "read")
    assert e.value.status_code == LLMStatusCode.LLM_TIMEOUT
    assert isinstance(e.value, TimeoutError)
    assert_same(two.initiator.call(native.snapshot, "dst"), dst0, "destination after a timed-out read")


def test_a_notification_sent_after_a_write_finds_the_bytes_in_place(two: Two) -> None:
    """The target watches for a notification and snapshots its region the moment one is visible:
    the initiator's write, completed before it notified, is all there (on every data path)."""
    sink0, dst0 = two.target.call(native.snapshot, "sink"), two.initiator.call(native.snapshot, "dst")
    two.target.call(native.watch, "sink")
    descs = [(0, 256, 512), (1024, 1792, 256)]  # (dst offset, sink offset, length)
    two.initiator.call(native.descriptors, TARGET, "dst", [(d, n) for d, _, n in descs],
                       [(two.sink + t, n) for _, t, n in descs], "write")
    two.initiator.call(native.notify, TARGET, b"kv ready\x00\xff", "req-17")
    got, seen = two.target.call(native.watched)
    assert got == [Notification(INITIATOR, b"req-17", b"kv ready\x00\xff")]
    assert_same(seen, copies(descs)(sink0, dst0), "the target's region when the notification arrived")
    assert two.target.call(native.notifications) == []  # taken: a second call gets only newer ones
    # the other way too (links are symmetric), several in order, text sent as UTF-8
    for i in range(3):
        two.target.call(native.notify, INITIATOR, f"décodé {i}")
    assert two.initiator.call(native.notifications) == [
        Notification(TARGET, b"", f"décodé {i}".encode()) for i in range(3)]


def test_notifications_past_the_receivers_limits_are_refused_and_nothing_is_dropped(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """Limits.max_notifications_per_link (2 here) unread from one peer, then LLM_LINK_BUSY; once the
    receiver took them, more are accepted. max_notification_bytes (40 here) bounds the bytes
    unread. Oversized fields are the caller's error and cost nothing."""
    target, initiator = peers("target", env=variant.env()), peers("initiator", env=variant.env())
    port = target.call(native.start, TARGET, listen=True,
                       limits={"max_notifications_per_link": 2, "max_notification_bytes": 40})
    initiator.call(native.start, INITIATOR)
    initiator.call(native.connect, port, TARGET)
    initiator.call(native.notify, TARGET, b"one")
    initiator.call(native.notify, TARGET, b"two")
    with pytest.raises(LinkError) as e:
        initiator.call(native.notify, TARGET, b"three")
    assert e.value.status_code == LLMStatusCode.LLM_LINK_BUSY
    assert "retry after it took them" in str(e.value)
    assert target.call(native.stats)["notifications_refused"] == 1
    assert [n.message for n in target.call(native.notifications)] == [b"one", b"two"]
    initiator.call(native.notify, TARGET, b"three")  # the link survived the refusal
    with pytest.raises(LinkError) as e:  # 5 + 36 bytes > 40
        initiator.call(native.notify, TARGET, b"x" * 32, b"four")
    assert e.value.status_code == LLMStatusCode.LLM_LINK_BUSY
    assert [n.message for n in target.call(native.notifications)] == [b"three"]
    for name, message in [(b"n" * (LIMITS["max_notify_name_bytes"] + 1), b""),
                          (b"", b"m" * (LIMITS["max_notify_message_bytes"] + 1))]:
        with pytest.raises(InvalidArgument) as bad:
            initiator.call(native.notify, TARGET, message, name)
        assert bad.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        initiator.call(native.notify, TARGET, 17)
    with pytest.raises(LinkError) as e:
        initiator.call(native.notify, 99, b"nobody")
    assert e.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    assert target.call(native.stats)["notifications"] == 0
    initiator.call(native.notify, TARGET, b"m" * 40)  # at the byte limit: accepted
    assert [len(n.message) for n in target.call(native.notifications)] == [40]


def test_a_frozen_peer_gives_a_notification_timeout(two: Two) -> None:
    two.target.freeze()
    with pytest.raises(TransferTimeout) as e:
        two.initiator.call_within(hang_guard(TIMEOUT_MS), native.notify, TARGET, b"anyone?")
    two.target.thaw()
    assert e.value.status_code == LLMStatusCode.LLM_TIMEOUT
    assert isinstance(e.value, TimeoutError)


def test_kv_caches_pull_blocks_of_a_published_cache_by_key(two: Two) -> None:
    two.target.call(native.kv_register, "kv_src", ROWS, ROW, 3, 11)  # published as model 11
    two.initiator.call(native.kv_register, "kv_dst", ROWS, ROW, 4)
    src, dst = (lambda: two.target.call(native.kv_snapshot, "kv_src")), (
        lambda: two.initiator.call(native.kv_snapshot, "kv_dst"))
    moves = [(7, 0), (2, 5), (3, 6)]  # (remote block, local block)
    check_transfer(src, dst, lambda: two.initiator.call(
        native.kv_pull_blocks, TARGET, "kv_dst", 11, [d for _, d in moves], [s for s, _ in moves]), rows(moves))
    # a model nobody published: refused, nothing moves
    dst0 = dst()
    with pytest.raises(NotFound) as e:
        two.initiator.call(native.kv_pull_blocks, TARGET, "kv_dst", 12, [0], [0])
    assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert_same(dst(), dst0, "destination")


def test_kv_caches_prepared_blocks_move_both_ways(two: Two) -> None:
    """``Engine.kv.prepare`` gives a ``pdlink.kv.PreparedBlocks`` whose posts pull and push blocks
    by index; a post naming a block past the remote cache is refused by its owner and moves nothing."""
    two.target.call(native.kv_register, "kv_src", ROWS, ROW, 3, 11)  # published as model 11
    two.initiator.call(native.kv_register, "kv_dst", ROWS, ROW, 4)
    remote = lambda: two.target.call(native.kv_snapshot, "kv_src")  # noqa: E731
    local = lambda: two.initiator.call(native.kv_snapshot, "kv_dst")  # noqa: E731
    pulled = [(6, 1), (0, 4)]  # (remote block, local block)
    got = check_transfer(remote, local, lambda: two.initiator.call(
        native.kv_post_prepared, TARGET, "kv_dst", 11, [d for _, d in pulled], [s for s, _ in pulled], False),
        rows(pulled))
    assert got == ("PreparedBlocks", ROW, 0)  # the keyed cache's owner checks remote indices
    pushed = [(2, 5), (7, 3)]  # (local block, remote block)
    check_transfer(local, remote, lambda: two.initiator.call(
        native.kv_post_prepared, TARGET, "kv_dst", 11, [s for s, _ in pushed], [d for _, d in pushed], True),
        rows(pushed))
    with pytest.raises(LLMException) as e:
        check_transfer(remote, local, lambda: two.initiator.call(
            native.kv_post_prepared, TARGET, "kv_dst", 11, [0], [ROWS], False), rows([]))
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


@pytest.mark.parametrize("placement", ["HOST", "DEVICE"])
def test_kv_caches_come_from_the_options_pools(peers: Callable[..., Peer], variant: Variant, placement: str) -> None:
    lone = peers("lone", env=variant.env())
    lone.call(native.start, INITIATOR, pool_bytes=1 << 20)
    cache_id, used = lone.call(native.kv_allocate, placement, ROWS, ROW)
    assert cache_id > 0 and used >= ROWS * ROW
    assert lone.call(native.kv_deallocate, cache_id, placement) == 0
    with pytest.raises(LLMException) as e:  # more than the pool holds
        lone.call(native.kv_allocate, placement, 1 << 12, 1 << 10)
    assert e.value.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY


def test_links_by_the_batch_report_each_peer(two: Two) -> None:
    ip = two.target.call(addr.own)  # loopback, or the target's host in a two-hosts cell
    port = two.target.call(native.add_listener, f"{ip}:0")  # a second listener
    assert port not in (0, two.target.call(native.listen_port))
    mark, _ = two.target.call(native.linked_since, internals.core.LATEST_LINK_MARK)
    assert two.initiator.call(native.disconnect_each, [TARGET, 99]) == [LLMStatusCode.LLM_SUCCESS,
                                                                         LLMStatusCode.LLM_NOT_YET_LINK]
    dead = two.target.call(_free_port)
    results = two.initiator.call(native.connect_each, [(TARGET, f"{ip}:{port}"), (None, f"{ip}:{dead}")])
    assert [(code, peer) for code, _, peer in results][0] == (LLMStatusCode.LLM_SUCCESS, TARGET)
    assert results[1][0] == LLMStatusCode.LLM_LINK_FAILED
    assert two.initiator.call(native.connect_each, [(TARGET, f"{ip}:{port}")])[0][0] == \
        LLMStatusCode.LLM_ALREADY_LINK
    wait_until(lambda: INITIATOR in two.target.call(native.linked_since, mark)[1], 10, "the new link listed")
    check_transfer(two.read("src"), two.read("dst"), lambda: two.initiator.call(
        native.descriptors, TARGET, "dst", [(0, 64)], [(two.src + 64, 64)], "read"), copies([(64, 0, 64)]))


def test_the_ucx_transport_needs_the_trusted_network_statement(monkeypatch: pytest.MonkeyPatch,
                                                              peers: Callable[..., Peer], tmp_path: Any) -> None:
    """transport "ucx" without ucx_trusted_network is refused before UCX is loaded
    (LLM_FEATURE_NOT_ENABLED, naming the setting); with it, an engine that cannot load UCX (a
    PDLINK_UCX_LIB_DIR without libucp, in a process of its own) says why."""
    import pdlink

    monkeypatch.delenv("PDLINK_UCX_TRUSTED_NETWORK", raising=False)
    with pytest.raises(NotSupported) as e:
        pdlink.Engine(pdlink.EngineOptions(cluster_id=5, transport="ucx"))
    assert e.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    assert "PDLINK_UCX_TRUSTED_NETWORK=1" in str(e.value)
    monkeypatch.setenv("PDLINK_UCX_TRUSTED_NETWORK", "yes")
    with pytest.raises(ValueError, match="PDLINK_UCX_TRUSTED_NETWORK must be '0' or '1'"):
        pdlink.EngineOptions(cluster_id=5, transport="ucx").resolved()
    lone = peers("lone", env={"PDLINK_BACKEND": "cpu", "PDLINK_TRANSPORT": "ucx", "PDLINK_UCX_TRUSTED_NETWORK": "1",
                              "PDLINK_UCX_LIB_DIR": str(tmp_path)})
    with pytest.raises(NotSupported) as e:
        lone.call(native.start, 5)
    assert e.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    assert f"PDLINK_UCX_LIB_DIR={tmp_path} has no libucp.so.0" in str(e.value)


def test_llm_datadist_takes_the_ucx_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """pdlink.Transport=ucx and pdlink.UcxTrustedNetwork (or PDLINK_UCX_TRUSTED_NETWORK) reach the
    engine's settings; a value other than '0' or '1' is LLM_PARAM_INVALID."""
    monkeypatch.delenv("PDLINK_UCX_TRUSTED_NETWORK", raising=False)
    cfg = internals.parse_engine_options({"pdlink.Transport": "ucx"})
    assert (cfg["transport"], cfg["ucx_trusted_network"]) == ("ucx", False)
    assert internals.parse_engine_options({"pdlink.UcxTrustedNetwork": "1"})["ucx_trusted_network"] is True
    monkeypatch.setenv("PDLINK_UCX_TRUSTED_NETWORK", "1")
    assert internals.parse_engine_options({})["ucx_trusted_network"] is True
    with pytest.raises(LLMException) as e:
        internals.parse_engine_options({"pdlink.UcxTrustedNetwork": "yes"})
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert "pdlink.UcxTrustedNetwork (or PDLINK_UCX_TRUSTED_NETWORK) must be '0' or '1'" in str(e.value)


def test_connect_to_nothing_is_a_connection_error(peers: Callable[..., Peer], variant: Variant) -> None:
    lone = peers("lone", env=variant.env())
    lone.call(native.start, INITIATOR)
    port = lone.call(_free_port)
    with pytest.raises(LinkError) as e:
        lone.call(native.connect, port)
    assert e.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    assert isinstance(e.value, ConnectionError)


def _free_port() -> Any:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
