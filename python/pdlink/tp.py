"""KV geometry and the tensor-parallel plan: which prefill ranks a decode rank reads, and which
bytes of each block (docs/native_api.md, "Different TP and block sizes").

Pure Python and numpy: no engine, no native module. A ``KvGeometry`` describes one rank's KV cache (one
tensor per layer and K/V, each a run of equal blocks); ``check_pair`` says whether a decode rank's
geometry can be filled from a prefill rank's (a ``GeometryMismatch`` naming the field if not);
``tp_plan`` returns, for one decode rank, the reads that fill each of its blocks::

    from pdlink import kv
    prefill = [kv.KvGeometry("HND", kv_heads=8, head_size=128, dtype="bfloat16", block_tokens=16,
                             tp_size=2, tp_rank=r) for r in range(2)]
    decode = kv.KvGeometry("HND", kv_heads=8, head_size=128, dtype="bfloat16", block_tokens=16)
    plan = kv.tp_plan(decode, prefill)          # TP 2 -> 1: heads 0-3 from rank 0, 4-7 from rank 1
    for read in plan.reads:                     # per local block b, from remote block
        ...                                     # plan.block_ratio * b + read.sub_block

A read pairs a ``Row`` of the remote block with a ``Row`` of the local block, piece by piece: a row
is ``count`` pieces of ``length`` bytes, each ``stride`` bytes after the previous, at ``offset``
from the block's start (the strided descriptors of ``Engine.read``). The reads of a plan cover
every byte of a local block exactly once. The rules are vLLM's (NixlConnector): a decode rank at
least as wide as the prefill's reads one rank (``tp_rank * remote_tp // tp``); a narrower one reads
the ranks holding its heads, and where KV heads are fewer than the prefill's TP size (heads
replicated over ranks) it reads each head once and skips the duplicates; MLA caches (replicated
whole on every rank) are read from one rank; a head slice needs head-major (HND) blocks, since in
token-major (NHD) blocks it is one piece per token, which a caller must ask for (``per_token``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .status import InvalidArgument, LLMStatusCode

__all__ = ["GeometryMismatch", "KvGeometry", "LAYOUTS", "Row", "TpPlan", "TpRead", "check_pair", "check_views",
           "plan_rows", "tensor_parts", "tp_plan"]

# Block layouts: head-major blocks [heads, tokens, head_size]; token-major blocks [tokens, heads,
# head_size]; MLA blocks [tokens, head_size] (one latent head, the whole of it on every rank).
LAYOUTS = ("HND", "NHD", "MLA")

# Element sizes by dtype name (the names torch and numpy use; bfloat16 and the fp8 types are not
# numpy's, which is why this is a table and not numpy.dtype).
_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "int32": 4, "int16": 2,
}


class GeometryMismatch(InvalidArgument):
    """Two geometries that cannot be mapped onto each other (``LLM_PARAM_INVALID``); ``field`` names
    the ``KvGeometry`` field that differs."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"KV geometry mismatch in {field!r}: {detail}", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        self.field = field
        self.detail = detail

    def __reduce__(self) -> tuple[type[GeometryMismatch], tuple[str, str]]:
        return (GeometryMismatch, (self.field, self.detail))


def _invalid(field: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"KvGeometry.{field}: {message}", status_code=LLMStatusCode.LLM_PARAM_INVALID)


@dataclass(frozen=True)
class KvGeometry:
    """One rank's KV cache. ``kv_heads`` is the model's number of KV heads in all (1 for MLA);
    ``head_size`` the elements per head (MLA: the latent width); ``dtype`` a name from
    ``_ITEMSIZE`` (``"bfloat16"``, ``"float16"``, ...); ``block_tokens`` the tokens per block;
    ``layers`` and ``kv`` (tensors per layer: 2 for K and V, 1 for MLA) count the block tensors.
    Invalid values raise ``InvalidArgument`` naming the field."""

    layout: str
    kv_heads: int
    head_size: int
    dtype: str
    block_tokens: int
    tp_size: int = 1
    tp_rank: int = 0
    layers: int = 1
    kv: int = 2

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise _invalid("layout", f"{self.layout!r} is not one of {LAYOUTS}")
        if self.dtype not in _ITEMSIZE:
            raise _invalid("dtype", f"{self.dtype!r} is not one of {sorted(_ITEMSIZE)}")
        for name in ("kv_heads", "head_size", "block_tokens", "tp_size", "layers", "kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _invalid(name, f"must be a positive int, not {value!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise _invalid("tp_rank", f"{self.tp_rank!r} is not in [0, tp_size={self.tp_size})")
        if self.layout == "MLA" and (self.kv_heads != 1 or self.kv != 1):
            raise _invalid("kv_heads", "an MLA cache has one latent head and one tensor per layer (kv_heads=1, kv=1)")
        if self.layout != "MLA" and self.kv_heads % self.tp_size and self.tp_size % self.kv_heads:
            raise _invalid("tp_size", f"{self.tp_size} ranks cannot share {self.kv_heads} KV heads evenly")

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def heads(self) -> int:
        """KV heads this rank holds (one, replicated, where the model has fewer than ``tp_size``)."""
        return 1 if self.layout == "MLA" else max(1, self.kv_heads // self.tp_size)

    @property
    def first_head(self) -> int:
        """The model's index of this rank's first head."""
        if self.layout == "MLA":
            return 0
        if self.kv_heads < self.tp_size:  # replicated: rank r holds head r * kv_heads // tp_size
            return self.tp_rank * self.kv_heads // self.tp_size
        return self.tp_rank * self.heads

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one (layer, K/V) tensor."""
        return self.block_tokens * self.heads * self.head_size * self.itemsize


@dataclass(frozen=True)
class Row:
    """``count`` pieces of ``length`` bytes, each ``stride`` bytes after the previous, the first at
    ``offset`` bytes from a block's start."""

    offset: int
    length: int
    stride: int
    count: int

    @property
    def nbytes(self) -> int:
        return self.length * self.count


class TpRead(NamedTuple):
    """One read of a plan, for each local block ``b``: heads ``[first_head, first_head + heads)``
    of remote rank ``remote_rank``'s block ``block_ratio * b + sub_block`` (``remote``, relative to
    that block) into local block ``b`` (``local``, relative to it), piece by piece."""

    remote_rank: int
    first_head: int
    heads: int
    sub_block: int
    remote: Row
    local: Row


@dataclass(frozen=True)
class TpPlan:
    """What one decode rank (``local``) reads: ``reads`` fill each of its blocks, every byte once;
    one local block spans ``block_ratio`` remote blocks; ``ranks`` are the remote ranks read and
    ``skipped`` those given that hold some of the local heads but are not read (each of those heads
    is read from another rank: the duplicates of replicated heads, and MLA's other ranks)."""

    local: KvGeometry
    block_ratio: int
    remote_block_bytes: int
    reads: tuple[TpRead, ...]
    skipped: tuple[int, ...]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r.remote_rank for r in self.reads}))

    @property
    def pieces_per_block(self) -> int:
        """Pieces one local block is moved in (a measure of the plan's cost per block)."""
        return sum(r.local.count for r in self.reads)


# The fields two geometries must agree on, whatever their TP and block sizes.
_SAME = ("layout", "layers", "kv", "kv_heads", "head_size", "dtype")


def check_pair(local: KvGeometry, remote: KvGeometry, *, sides: tuple[str, str] = ("decode", "prefill")) -> int:
    """Whether ``local`` (a decode rank) can be filled from ranks of ``remote``'s geometry; the block
    ratio (local block tokens over remote's). Raises ``GeometryMismatch`` naming the first field that
    cannot be mapped: a different layout (no HND/NHD permute), model shape or dtype; a local block
    that is not a whole number of remote blocks (different block sizes need the prefill's blocks
    smaller); TP sizes neither of which divides the other. ``sides`` names the two in messages."""
    for name in _SAME:
        mine, theirs = getattr(local, name), getattr(remote, name)
        if mine != theirs:
            raise GeometryMismatch(name, f"the {sides[0]} side has {mine!r}, the {sides[1]} side {theirs!r}")
    if local.block_tokens % remote.block_tokens:
        raise GeometryMismatch("block_tokens", f"a {sides[0]} block of {local.block_tokens} tokens is not a whole "
                                               f"number of {sides[1]} blocks of {remote.block_tokens}")
    if max(local.tp_size, remote.tp_size) % min(local.tp_size, remote.tp_size):
        raise GeometryMismatch("tp_size", f"TP {remote.tp_size} -> {local.tp_size}: neither size divides the other")
    return local.block_tokens // remote.block_tokens


def check_views(local: KvGeometry, remote: KvGeometry, *, local_view: tuple[int, int] | None = None,
                remote_view: tuple[int, int] | None = None, block_ratio: int = 1) -> None:
    """The check ``Engine.prepare`` makes between two regions that both carry a geometry
    (docs/native_api.md, "Geometry at prepare"): that each piece its block views and ratio pair
    holds the same heads on both sides, in the same shape. ``local_view`` / ``remote_view``: the
    ``(offset, length)`` of each block (``None``: the whole block); local block ``b``'s view is cut
    in ``block_ratio`` equal pieces, each paired with one remote block's view. Raises
    ``GeometryMismatch``: a field ``check_pair`` refuses (the sides named local and remote); a view
    off the layout's units (``layout``: whole heads of an HND block, whole tokens of an NHD or MLA
    one, and a piece of an HND block with more tokens than the remote one is one head); a head
    slice of NHD blocks (``layout``: one piece per token, which ``tp_plan(..., per_token=True)``
    asks for); pieces that hold different heads (``tp_size``, or ``tp_rank`` under one TP size).
    Which tokens pair is the caller's choice of block indices, so it is not checked."""
    check_pair(local, remote, sides=("local", "remote"))
    lo, ll = local_view if local_view is not None else (0, local.block_bytes)
    ro, rl = remote_view if remote_view is not None else (0, remote.block_bytes)
    if block_ratio < 1:
        return  # the engine refuses it
    piece = ll // block_ratio
    if ll % block_ratio or piece != rl:
        field = ("block_tokens" if local.block_tokens != remote.block_tokens else
                 "tp_size" if local.tp_size != remote.tp_size else "layout")
        raise GeometryMismatch(field, f"local pieces of {ll / block_ratio:g} bytes (block_ratio {block_ratio}) would "
                                      f"pair with remote views of {rl}: local blocks of {local.heads} heads of "
                                      f"{local.block_tokens} tokens, remote ones of {remote.heads} heads of "
                                      f"{remote.block_tokens} tokens; give block views and the ratio that pair them")

    def heads(g: KvGeometry, offset: int, length: int, side: str) -> tuple[int, int]:
        """The model heads ``(first, count)`` of bytes ``[offset, +length)`` of a block of ``g``."""
        size = g.head_size * g.itemsize
        if g.layout == "HND":  # [heads, tokens, head_size]: whole heads, or a token run of one head
            row = g.block_tokens * size
            if offset % row == 0 and length % row == 0:
                return g.first_head + offset // row, length // row
            if offset % size == 0 and length % size == 0 and offset // row == (offset + length - 1) // row:
                return g.first_head + offset // row, 1
            raise GeometryMismatch("layout", f"{side} bytes [{offset}, +{length}) of an HND block are neither whole "
                                             f"heads ({row} bytes each) nor whole tokens of one head")
        token = g.heads * size  # NHD [tokens, heads, head_size], MLA [tokens, head_size]: whole tokens
        if offset % token or length % token:
            raise GeometryMismatch("layout", f"{side} bytes [{offset}, +{length}) of a token-major ({g.layout}) "
                                             f"block are not whole tokens ({token} bytes each)")
        return g.first_head, g.heads

    theirs = heads(remote, ro, rl, "remote")
    for j in range(block_ratio):
        mine = heads(local, lo + j * piece, piece, "local")
        if mine == theirs:
            continue
        if local.layout == "NHD":
            raise GeometryMismatch("layout", f"the local NHD blocks hold heads {_span(mine)}, the remote ones "
                                             f"{_span(theirs)}: a head slice of token-major blocks is one piece per "
                                             f"token, which a TP plan makes on request (tp_plan(..., per_token=True))")
        if local.layout == "HND" and local.block_tokens != remote.block_tokens and mine[1] != theirs[1]:
            raise GeometryMismatch("block_tokens", f"the remote pieces hold heads {_span(theirs)}; a piece of an HND "
                                                   f"block with more tokens is one head's run of tokens: prepare one "
                                                   f"head per view (as Engine.prepare_plan does)")
        field = "tp_size" if local.tp_size != remote.tp_size else "tp_rank"
        raise GeometryMismatch(field, f"a local piece holds heads {_span(mine)}, its remote one heads {_span(theirs)}: "
                                      f"give block views of the heads both hold, or use Engine.prepare_plan")


def _span(heads: tuple[int, int]) -> str:
    first, count = heads
    return f"{first}-{first + count - 1}" if count > 1 else str(first)


def _paired(remote: Row, local: Row) -> tuple[Row, Row]:
    """The pair as one piece each where both rows' pieces are back to back (they pair piece by
    piece, so neither is merged alone)."""
    if remote.stride == remote.length and local.stride == local.length:
        return (Row(remote.offset, remote.nbytes, remote.nbytes, 1), Row(local.offset, local.nbytes, local.nbytes, 1))
    return remote, local


def _rows(local: KvGeometry, remote: KvGeometry, sub: int, head: int, n: int) -> tuple[Row, Row]:
    """The (remote, local) rows that move heads ``[head, head + n)`` of remote sub-block ``sub``."""
    size, tokens = local.head_size * local.itemsize, remote.block_tokens
    hr, hl = head - remote.first_head, head - local.first_head
    if local.layout == "NHD":  # [tokens, heads, head_size]: one piece per token
        return _paired(Row(hr * size, n * size, remote.heads * size, tokens),
                       Row((sub * tokens * local.heads + hl) * size, n * size, local.heads * size, tokens))
    # HND [heads, tokens, head_size] and MLA [tokens, head_size] (one head): one piece per head
    span = tokens * size
    return _paired(Row(hr * span, span, span, n),
                   Row(hl * local.block_tokens * size + sub * span, span, local.block_tokens * size, n))


def tp_plan(local: KvGeometry, remotes: Iterable[KvGeometry] | Mapping[Any, KvGeometry], *,
            per_token: bool = False) -> TpPlan:
    """The plan for decode rank ``local`` over the prefill ranks ``remotes`` (their geometries, each
    with its ``tp_rank``; a mapping's keys are ignored). Every remote is checked against ``local``
    (``check_pair``); they must share one TP size and have distinct ranks. Each head the local rank
    holds is read from the preferred rank (``tp_rank * remote_tp // tp``) where it holds it, else
    from the lowest given rank that does. Raises ``GeometryMismatch``: a field that cannot be
    mapped; ``tp_rank`` when no given rank holds a needed head; ``layout`` for a head slice of NHD
    blocks unless ``per_token`` (one piece per token per head run)."""
    given = list(remotes.values()) if isinstance(remotes, Mapping) else list(remotes)
    if not given:
        raise GeometryMismatch("tp_rank", "no prefill rank was given")
    ratio = check_pair(local, given[0])
    by_rank: dict[int, KvGeometry] = {}
    for g in given:
        if check_pair(local, g) != ratio or g.block_tokens != given[0].block_tokens:
            raise GeometryMismatch("block_tokens", "the prefill ranks have different block sizes")
        if g.tp_size != given[0].tp_size:
            raise GeometryMismatch("tp_size", f"the prefill ranks disagree on their TP size "
                                              f"({g.tp_size} and {given[0].tp_size})")
        if g.tp_rank in by_rank:
            raise GeometryMismatch("tp_rank", f"prefill rank {g.tp_rank} was given twice")
        by_rank[g.tp_rank] = g
    remote_tp = given[0].tp_size
    preferred = local.tp_rank * remote_tp // local.tp_size

    def holds(g: KvGeometry, head: int) -> bool:
        return g.first_head <= head < g.first_head + g.heads

    # each local head's source rank, then runs of consecutive heads from one rank
    sources = []
    for head in range(local.first_head, local.first_head + local.heads):
        ranks = sorted(r for r, g in by_rank.items() if holds(g, head))
        if not ranks:
            raise GeometryMismatch("tp_rank", f"head {head} of decode rank {local.tp_rank} is on none of the "
                                              f"prefill ranks given ({sorted(by_rank)})")
        sources.append(preferred if preferred in ranks else ranks[0])
    runs: list[tuple[int, int, int]] = []  # (rank, first head, heads)
    for k, rank in enumerate(sources):
        head = local.first_head + k
        if runs and runs[-1][0] == rank and runs[-1][1] + runs[-1][2] == head:
            runs[-1] = (rank, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((rank, head, 1))
    reads = []
    for sub in range(ratio):
        for rank, head, n in runs:
            remote_row, local_row = _rows(local, by_rank[rank], sub, head, n)
            if local_row.count > 1 and local.layout == "NHD" and not per_token:
                raise GeometryMismatch("layout", f"heads {head}-{head + n - 1} of NHD (token-major) blocks are "
                                                 f"{local_row.count} pieces per block, one per token; use HND blocks, "
                                                 f"or pass per_token=True to accept that")
            reads.append(TpRead(rank, head, n, sub, remote_row, local_row))
    used = {r for r, _, _ in runs}
    holding = {r for r, g in by_rank.items()
               if any(holds(g, h) for h in range(local.first_head, local.first_head + local.heads))}
    return TpPlan(local, ratio, given[0].block_bytes, tuple(reads), tuple(sorted(holding - used)))


def plan_rows(plan: TpPlan, local_tensors: Sequence[int], remote_tensors: Mapping[int, Sequence[int]],
              local_blocks: Sequence[int] | np.ndarray, remote_blocks: Sequence[int] | np.ndarray,
              ranks: Sequence[int] | None = None) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The strided rows that carry out ``plan`` for some blocks, per remote rank read: ``{rank:
    (local_rows, remote_rows)}``, (N, 4) uint64 arrays of ``(address, length, stride, count)`` that
    pair piece by piece, for ``Engine.read(peer_of_rank, local_rows, remote_rows)``.
    ``local_tensors`` are the base addresses of the local (layer, K/V) tensors, ``layers * kv`` of
    them in the order both sides use; ``remote_tensors[rank]`` the same for each rank read.
    ``local_blocks[i]`` is filled from remote blocks ``remote_blocks[block_ratio * i + j]``,
    ``j < block_ratio``. ``ranks``: only these of the plan's ranks (default: all it reads).
    Each array holds ``layers * kv`` equal parts, one per tensor in order (``np.split(rows,
    tensors)``): on the ascend-ipc path a request must stay inside one device allocation, so
    tensors allocated apart are read one part at a time (``tensor_parts``).
    Raises ``InvalidArgument`` for lists of the wrong sizes."""
    tensors = plan.local.layers * plan.local.kv
    local_b = np.asarray(local_blocks, dtype=np.uint64).reshape(-1)
    remote_b = np.asarray(remote_blocks, dtype=np.uint64).reshape(-1)
    if len(remote_b) != plan.block_ratio * len(local_b):
        raise InvalidArgument(f"{len(local_b)} local blocks need {plan.block_ratio * len(local_b)} remote blocks "
                              f"(block_ratio {plan.block_ratio}), not {len(remote_b)}",
                              status_code=LLMStatusCode.LLM_PARAM_INVALID)
    if len(local_tensors) != tensors:
        raise InvalidArgument(f"{len(local_tensors)} local tensors given; the geometry has {tensors} (layers * kv)",
                              status_code=LLMStatusCode.LLM_PARAM_INVALID)
    lt = np.asarray(local_tensors, dtype=np.uint64)
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for rank in plan.ranks if ranks is None else ranks:
        if len(remote_tensors.get(rank, ())) != tensors:
            raise InvalidArgument(f"rank {rank} needs {tensors} remote tensor addresses (layers * kv)",
                                  status_code=LLMStatusCode.LLM_PARAM_INVALID)
        rt = np.asarray(remote_tensors[rank], dtype=np.uint64)
        reads = [r for r in plan.reads if r.remote_rank == rank]
        # [tensor, read, block] -> one row each side
        lbase = lt[:, None] + local_b[None, :] * np.uint64(plan.local.block_bytes)
        local_rows, remote_rows = [], []
        for r in reads:
            rblocks = remote_b[r.sub_block::plan.block_ratio]
            rbase = rt[:, None] + rblocks[None, :] * np.uint64(plan.remote_block_bytes)
            local_rows.append(_row_array(lbase + np.uint64(r.local.offset), r.local))
            remote_rows.append(_row_array(rbase + np.uint64(r.remote.offset), r.remote))
        out[rank] = (np.concatenate(local_rows, axis=1).reshape(-1, 4),
                     np.concatenate(remote_rows, axis=1).reshape(-1, 4))
    return out


def tensor_parts(rows: np.ndarray, tensors: int) -> list[np.ndarray]:
    """``plan_rows``' array cut into its ``tensors`` parts, one per tensor."""
    return np.split(rows, tensors)


def _row_array(addresses: np.ndarray, row: Row) -> np.ndarray:
    """[tensor, block, 4]: one row per address of the [tensor, block] array ``addresses``."""
    shape = addresses.shape
    return np.stack([addresses, np.full(shape, row.length, np.uint64), np.full(shape, row.stride, np.uint64),
                     np.full(shape, row.count, np.uint64)], axis=-1)
