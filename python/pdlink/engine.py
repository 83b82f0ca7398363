"""pdlink's own engine API: register memory, connect to peers, move descriptor lists or prepared
block transfers, sync or async.

::

    import numpy as np
    import pdlink

    kv = np.zeros((256, 4096), np.uint8)
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=2)) as engine:
        region = engine.register(kv, block_size=4096)
        peer = engine.connect("127.0.0.1:26000")                 # the peer's cluster id
        remote = pdlink.RemoteRegion(key=7, length=1 << 20, block_size=4096)  # what the peer told us
        job = engine.prepare(peer, region, remote)
        job.read(np.array([0, 1, 2]), np.array([9, 8, 7]))      # remote block 9 -> local block 0, ...
        engine.read(peer, [(kv.ctypes.data, 4096)], [(remote_address, 4096)])  # descriptor lists

Errors are ``pdlink.LLMException`` subclasses carrying the status code (``pdlink.InvalidArgument``,
``pdlink.LinkError``, ...; docs/native_api.md, "Errors"). The
memory a peer may read or write is exactly what was registered: a peer that names anything else
is refused by this engine, whatever it sends.

Threading: an ``Engine`` may be used from several threads; transfers on one link run one at a time,
transfers to different peers in parallel. Every blocking call releases the GIL. The async calls
run on a pool of ``EngineOptions.async_workers`` threads per engine (created on first use).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import enum
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from . import environment
from .kv import KvCaches
from .native import core, open_engine, placement_of, role_of
from .status import InvalidArgument, LLMStatusCode
from .tp import GeometryMismatch, KvGeometry, TpPlan, check_pair, check_views, plan_rows, tensor_parts

if TYPE_CHECKING:  # what the module __getattr__ below returns
    from ._core import EngineStats, FailureSeries, LinkEventSeries, LinkInfo, LinkResult, Scope, TransferSeries

__all__ = [
    "BatchTransfer", "Engine", "EngineOptions", "EngineStats", "FailureSeries", "HandoffEvent", "Limits",
    "LinkEventSeries", "LinkInfo", "LinkResult", "MemoryMap", "TransferSeries",
    "MemoryPool", "Notification", "Offer", "Pending", "PreparedPlan", "PreparedTransfer", "Region", "RemoteRegion",
    "RoleState", "Scope", "Ticket", "TransferCancelled",
]

T = TypeVar("T")

Descriptors = np.ndarray | Sequence[tuple[int, int]] | Sequence[tuple[int, int, int, int]]
Indices = np.ndarray | Sequence[int]
Addresses = np.ndarray | list[int]
#: Where an engine listens or is dialled: ``"ip:port"``, or the pair ``(ip, port)`` (passed on as it is).
Address = str | tuple[str, int]


def __getattr__(name: str) -> Any:
    # LinkInfo: one link of an engine (``Engine.links()``), the native module's bound class, read
    # from it on first use so that importing this module does not load it. Read-only attributes
    # ``peer_cluster_id``, ``peer_address``, ``initiator``, ``broken``, ``broken_reason``,
    # ``transport``, ``authenticated``, ``payload_integrity``, ``device_paths`` (a tuple),
    # ``confirmed`` (an accepted link whose peer this engine confirmed by dialling it), and
    # ``lanes``: what the host path moves bytes over beneath ``transport``, where it has a choice
    # (for ``ucx``, UCX's lanes as ``"transport/device"``: ``"tcp/lo"``, ``"cma/memory"``,
    # ``"rc_mlx5/mlx5_0:1"``, once the link's first transfer connected them; for ``cma``, how the
    # copies reach the peer's process: ``"process_vm"`` or ``"proc_mem"``, docs/security.md; for
    # ``tcp`` with extra streams, ``"tcp xN"`` on the side that dialled, once its first large transfer
    # opened them, and ``"served xN"`` on the other; else empty); ``as_dict()`` gives them as a dict.
    # Compares by value, hashes, pickles.
    #
    # LinkResult: one peer's outcome of ``Engine.connect_each`` / ``disconnect_each``, the native
    # module's bound class. Read-only ``status`` (an ``LLMStatusCode``), ``message`` (the engine's
    # words; empty on success), ``scope`` (a ``Scope``), ``peer_cluster_id`` and ``ok``;
    # ``check()`` raises what the engine raises for that status (``error_class``; nothing when ok).
    # ``LinkResult(status, message, peer_cluster_id, scope=None)`` makes one (scope None: the
    # code's own, as the engine gives it).
    #
    # Scope: what a failure concerns (csrc/core/status.h): ``CALL`` (the call: a bad argument),
    # ``LINK`` (that peer's link: others are unaffected) or ``ENGINE`` (this engine: not
    # initialised, finalised, out of resources). Exceptions the engine raises carry it as ``.scope``.
    #
    # EngineStats: a snapshot of an engine (``Engine.stats()``; docs/metrics.md), the native
    # module's bound record, with TransferSeries (``peer``, ``path``, ``op``, ``transfers``,
    # ``bytes``, ``descriptors`` and the ``queue``, ``wire`` and ``total`` histograms: ``buckets``
    # per bound of ``pdlink.LATENCY_BOUNDS`` and +Inf, ``sum`` in seconds, ``count``),
    # FailureSeries (``peer``, ``path``, ``op``, ``code``: an LLMStatusCode name, ``stage``,
    # ``count``) and LinkEventSeries (``peer``, ``event``, ``reason``, ``count``).
    if name in ("EngineStats", "FailureSeries", "LinkEventSeries", "LinkInfo", "LinkResult", "Scope",
                "TransferSeries"):
        return getattr(core(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Limits:
    """What peers may make the engine spend. ``None`` keeps the engine's default (the defaults live
    in C++, ``pdlink._core.EngineLimits``; docs/security.md, "Limits")."""

    max_links: int | None = None
    max_links_per_source: int | None = None
    max_handshakes: int | None = None
    max_handshakes_per_source: int | None = None
    hello_timeout_ms: int | None = None
    pin_timeout_ms: int | None = None
    handshake_timeout_ms: int | None = None
    max_notifications_per_link: int | None = None
    max_notification_bytes: int | None = None
    max_notification_bytes_per_link: int | None = None
    max_notification_bytes_per_source: int | None = None
    tcp_streams: int | None = None
    max_tcp_lanes: int | None = None
    tcp_chunk_bytes: int | None = None
    # How long ``Engine.switch_role`` waits for what is in flight before it rolls back (30000).
    switch_drain_timeout_ms: int | None = None
    # KV handoffs (``Engine.offer``, docs/native_api.md, "Handoffs"): offers held at once (65536;
    # past it ``offer`` raises ``OutOfMemory``), the longest lease (3600000 ms), the lease of an offer
    # that names none (60000 ms), and the entries of each handoff event queue (4096; the oldest
    # dropped when full, one peer's aborts at most a quarter of them, one source's at most a quarter).
    max_offers: int | None = None
    max_lease_ms: int | None = None
    offer_lease_ms: int | None = None
    max_handoff_events: int | None = None
    # Telemetry (docs/metrics.md): the peers whose transfers and links get metric series of their
    # own (64, at most LIMITS["max_metric_peers"]); later peers are counted together as "other".
    max_metric_peers: int | None = None

    def overrides(self) -> dict[str, int]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class RoleState:
    """Where an engine stands with its role (``Engine.role_state()``), a read-only snapshot.

    ``role``: ``"PROMPT"``, ``"DECODER"`` or ``"MIX"``. ``epoch``: 0 at start, +1 per committed
    switch. ``phase``: ``"ready"``, ``"draining"``, ``"switching"``, ``"rolling_back"`` or
    ``"failed"`` (docs/architecture.md, "Roles"). ``transfers_in_flight``: this side's own pulls,
    pushes, posts and describes running; ``served_in_flight``: the peers' requests being served
    now; ``pins``: the links whose peer holds a pin (a direct, IPC or one-sided access awaiting the
    peer's next frame); ``offers``: this engine's KV handoff offers not yet released (``Engine.offer``).
    A switch drains until the four counts are 0."""

    role: str
    epoch: int
    phase: str
    transfers_in_flight: int
    served_in_flight: int
    pins: int
    offers: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class MemoryPool:
    """Memory the engine owns and allocates caches from (``Engine.kv.allocate``): ``size`` bytes
    of one placement, handed out in pages of ``2**page_shift`` bytes (``None``: the engine's
    default, ``pdlink._core.PoolConfig().page_shift``)."""

    size: int
    page_shift: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 0:
            raise ValueError(f"MemoryPool.size must be an int >= 0, got {self.size!r}")
        if self.page_shift is not None and (not isinstance(self.page_shift, int) or not 0 <= self.page_shift < 64):
            raise ValueError(f"MemoryPool.page_shift must be an int in [0, 64), got {self.page_shift!r}")


@dataclass(frozen=True)
class EngineOptions:
    """How an engine starts.

    ``listen``: ``"ip:port"`` or ``(ip, port)`` to accept links (port 0: any free port), ``None``
    to only dial.
    ``transport``: ``"auto"`` (direct memory access between processes of one host; else, with
    ``ucx_trusted_network`` and UCX finding an RDMA transport, ucx; else TCP),
    ``"tcp"``, ``"cma"`` or ``"ucx"`` (host memory as UCX messages: docs/ucx.md; needs
    ``ucx_trusted_network``). ``secret``: links must prove they know it, and frames are sealed.
    ``backend``: ``"auto"``, ``"cpu"`` or ``"ascend"``. ``hccl_one_sided``: DEVICE transfers use
    HCCL's one-sided access where both ends have it. ``timeout_ms`` bounds every transfer,
    ``connect_timeout_ms`` every connect and disconnect. ``device_pool`` / ``host_pool``: memory
    the engine allocates caches from (``Engine.kv``; none by default). ``one_way_links``: only the
    side that connected transfers over a link (llm_datadist's ``llm.TransferBackend = "hixl"``).

    ``ucx_trusted_network``: the statement that every process that can reach this one over the
    network is trusted, which UCX assumes (docs/ucx.md, "Trust"); transport ``"ucx"`` needs it,
    and ``"auto"`` considers ucx only with it (docs/ucx.md, "What auto picks").

    Left at None, ``transport``, ``secret``, ``backend``, ``hccl_one_sided`` and
    ``ucx_trusted_network`` come from the environment variables llm_datadist reads too
    (``PDLINK_TRANSPORT``, ``PDLINK_LINK_SECRET``, ``PDLINK_BACKEND``, ``PDLINK_HCCL_ONE_SIDED``,
    ``PDLINK_UCX_TRUSTED_NETWORK``), else ``"auto"``, no secret, ``"auto"``, off, off.
    """

    cluster_id: int
    role: str | enum.Enum = "MIX"
    listen: Address | None = None
    transport: str | None = None
    secret: str | None = None
    payload_integrity: bool = False
    backend: str | None = None
    device_id: int = 0
    hccl_one_sided: bool | None = None
    timeout_ms: int = 1000
    connect_timeout_ms: int = 5000
    async_workers: int = 4
    limits: Limits = field(default_factory=Limits)
    device_pool: MemoryPool | None = None
    host_pool: MemoryPool | None = None
    one_way_links: bool = False
    ucx_trusted_network: bool | None = None

    def __post_init__(self) -> None:
        for name in ("timeout_ms", "connect_timeout_ms", "async_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"EngineOptions.{name} must be a positive int, got {value!r}")
        if not isinstance(self.cluster_id, int) or not 0 <= self.cluster_id < core().ANY_CLUSTER:
            raise ValueError(f"EngineOptions.cluster_id must be an int in [0, 2**64 - 1), got {self.cluster_id!r}")
        role_of(self.role)  # raises ValueError for an unknown role

    def resolved(self) -> EngineOptions:
        """These options with every None that the environment fills, filled (what the engine uses)."""
        one_sided, trusted = self.hccl_one_sided, self.ucx_trusted_network
        if one_sided is None:
            one_sided = _env_flag(environment.HCCL_ONE_SIDED)
        if trusted is None:
            trusted = _env_flag(environment.UCX_TRUSTED_NETWORK)
        return dataclasses.replace(
            self, transport=self.transport or environment.transport(),
            secret=self.secret if self.secret is not None else environment.link_secret(),
            backend=self.backend or environment.backend(), hccl_one_sided=one_sided,
            ucx_trusted_network=trusted)


def _span_of(obj: Any) -> tuple[int, int] | None:
    """``(address, nbytes)`` of an object's whole memory, None when it is not C-contiguous: a
    tensor's ``data_ptr()`` (torch: no copy to the host), else the object's own buffer (the buffer
    protocol, ``__array_interface__``). Anything else (a list of numbers) is refused: numpy would
    register a copy, not the caller's memory."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size") and not isinstance(obj, np.ndarray):
        return (int(obj.data_ptr()), int(obj.numel()) * int(obj.element_size())) if obj.is_contiguous() else None
    if isinstance(obj, np.ndarray):
        array = obj
    elif hasattr(obj, "__array_interface__"):
        array = np.asarray(obj)
    else:
        try:
            array = np.asarray(memoryview(obj))
        except TypeError:
            raise ValueError(f"cannot register a {type(obj).__name__}: give an array, a buffer or a tensor") from None
    return (int(array.ctypes.data), int(array.nbytes)) if array.flags.c_contiguous else None


def _check_geometry(geometry: KvGeometry, tensors: int, block_size: int | None) -> None:
    """A region registered with ``geometry`` has one tensor per (layer, K/V) and its blocks."""
    if not isinstance(geometry, KvGeometry):
        raise TypeError(f"geometry must be a pdlink.kv.KvGeometry, not {type(geometry).__name__}")
    if tensors != geometry.layers * geometry.kv:
        raise GeometryMismatch("layers", f"{tensors} tensors given; the geometry has {geometry.layers} layers of "
                                         f"{geometry.kv} (layers * kv tensors)")
    if block_size is not None and block_size != geometry.block_bytes:
        raise GeometryMismatch("block_tokens", f"block_size {block_size} given; the geometry's blocks are "
                                               f"{geometry.block_bytes} bytes")


def _same_geometry(given: KvGeometry, expected: KvGeometry, what: str) -> None:
    for f in dataclasses.fields(KvGeometry):
        if getattr(given, f.name) != getattr(expected, f.name):
            raise GeometryMismatch(f.name, f"{what} has {getattr(given, f.name)!r}, the plan "
                                           f"{getattr(expected, f.name)!r}")


@dataclass(frozen=True)
class Region:
    """Memory this engine registered: one tensor, or several (the layers of a KV cache, say) of
    ``length`` bytes each, at ``addresses``. ``block_size`` divides each tensor into blocks for
    prepared transfers, where block ``i`` means bytes ``[i * block_size, +block_size)`` of every
    tensor. ``key``, when set, publishes the region to peers under that number
    (``RemoteRegion(key=...)``), which lets same-host peers read it with one copy. ``geometry``,
    when set, is the KV geometry of its blocks (``pdlink.kv.KvGeometry``), which ``Engine.prepare``
    and ``Engine.prepare_plan`` check against the peer's."""

    addresses: tuple[int, ...]
    length: int
    placement: str
    block_size: int
    key: int | None
    cache_id: int
    geometry: KvGeometry | None = None

    @property
    def address(self) -> int:
        """The first tensor's address."""
        return self.addresses[0]

    @property
    def tensors(self) -> int:
        return len(self.addresses)

    def remote(self) -> RemoteRegion:
        """What a peer needs to address this region (send it out of band; it pickles)."""
        return RemoteRegion(address=self.address, length=self.length, block_size=self.block_size, key=self.key,
                            tensors=self.tensors, addresses=self.addresses, geometry=self.geometry)


@dataclass(frozen=True)
class RemoteRegion:
    """A peer's registered memory, as the peer described it (``Region.remote()``): by ``key`` when
    it published one, else by ``address`` and ``length`` (one tensor). ``tensors``: how many tensors
    of ``length`` bytes the region has; ``addresses``: each tensor's address, where the peer gave
    them (``Region.remote()`` does; a TP plan's reads need them: ``Engine.prepare_plan``);
    ``geometry``: the KV geometry the peer registered the region with, if any."""

    length: int
    block_size: int
    address: int = 0
    key: int | None = None
    tensors: int = 1
    addresses: tuple[int, ...] = ()
    geometry: KvGeometry | None = None


@dataclass(frozen=True)
class MemoryMap:
    """Registered memory as sorted ``(address, length)`` ranges: a peer's (``Engine.remote_memory``,
    with its registry ``generation``: a later release there changes it, a registration only adds
    ranges) or this engine's own (``Engine.local_memory``, generation 0)."""

    generation: int
    ranges: tuple[tuple[int, int], ...]

    def covers(self, addresses: Addresses, lengths: Addresses) -> bool:
        """Whether every ``[addresses[i], +lengths[i])`` (non-empty) lies in this memory: inside
        one range, or across at most ``LIMITS["max_raw_span"]`` ranges that follow each other
        exactly. The engine's own check (csrc/core/spans.h), so a list it accepts is one the peer
        accepts. ``ValueError`` when the two sequences differ in length."""
        return bool(core().covers(self.ranges, [int(a) for a in addresses], [int(n) for n in lengths]))


@dataclass(frozen=True)
class Notification:
    """A notification a peer sent with ``Engine.notify``: its cluster id, then the name and the
    message exactly as sent (bytes)."""

    peer: int
    name: bytes
    message: bytes


class TransferCancelled(concurrent.futures.CancelledError):
    """What ``Pending.wait()`` raises for a call that ``Pending.cancel()`` cancelled: a
    ``concurrent.futures.CancelledError``, raised once the call has stopped (nothing more lands in
    its destination after it). A transfer that a role switch's drain timeout stopped raises it too,
    synchronous ones included (``Engine.switch_role``)."""


class Pending:
    """An async call in flight: ``status()`` is ``"PENDING"``, ``"DONE"``, ``"FAILED"`` or
    ``"CANCELLED"``; ``wait()`` returns the call's result or raises its error.

    ``cancel()`` (docs/native_api.md, "Cancel"): an async transfer (``read_async``,
    ``write_async``, ``read_batch_async``, ``write_batch_async``, ``PreparedTransfer.read_async`` /
    ``write_async``) stops at its next cancel point; any other async call is cancelled only before
    it started."""

    def __init__(self, future: concurrent.futures.Future, token: Any = None) -> None:
        self._future = future
        self._token = token  # the transfer's pdlink._core.CancelToken; None: not a transfer

    def done(self) -> bool:
        """Whether the call has stopped (a cancelled transfer: once its requests in flight ended)."""
        return self._future.done()

    def cancel(self) -> bool:
        """Cancels the call without blocking (one atomic exchange; it waits for nothing). True: it
        will end ``CANCELLED`` (``status()`` says so at once; ``wait()`` raises
        ``pdlink.TransferCancelled`` once it has stopped, after at most the requests it had in
        flight: docs/architecture.md, "Cancel points"); False: it had already completed or failed,
        and its result stands. A cancelled transfer leaves each block of its destination with its
        old or its new bytes (docs/native_api.md) and the link usable."""
        if self._token is None:
            return self._future.cancel()
        won = bool(self._token.cancel())
        if won:
            self._future.cancel()  # not started yet: it never will
        return won

    def status(self) -> str:
        if self._future.cancelled() or (self._token is not None and self._token.cancelled):
            return "CANCELLED"
        if not self._future.done():
            return "PENDING"
        return "FAILED" if self._future.exception() is not None else "DONE"

    def wait(self, timeout: float | None = None) -> Any:
        """The result; raises the call's exception, ``pdlink.TransferCancelled`` when it was
        cancelled, or ``TimeoutError`` when ``timeout`` seconds pass first (the call itself goes on
        and ends within the engine's own timeout)."""
        try:
            return self._future.result(timeout)
        except TransferCancelled:
            raise
        except concurrent.futures.CancelledError:
            raise TransferCancelled("the call was cancelled before it started") from None
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the call did not finish within {timeout} s") from None

    def error(self) -> BaseException | None:
        """The call's exception once done (None when it succeeded or is still running)."""
        if self._future.cancelled():
            return TransferCancelled("the call was cancelled before it started")
        return self._future.exception() if self._future.done() else None


def _cancellable(token: Any, fn: Callable[..., Any], *args: Any) -> None:
    """Runs the transfer ``fn(*args, token)``; its outcome is CANCELLED when a cancel came before
    it finished (``CancelToken.finish``), whatever the engine returned."""
    try:
        fn(*args, token)
    except Exception:
        if token.finish():
            raise
        raise TransferCancelled("the transfer was cancelled") from None
    if not token.finish():
        raise TransferCancelled("the transfer was cancelled")


def _timeout_kw(timeout_ms: int | None = None) -> int | None:
    return timeout_ms


class PreparedTransfer:
    """Local and remote memory described once (``Engine.prepare``); each ``read`` / ``write``
    moves blocks by index: ``local[i]`` <-> ``remote[i]``. Index arrays (numpy int64, or
    anything numpy converts) go to C++ without one Python object per element.

    Not a pin: deregistering either side's memory makes the next post fail with
    ``LLM_PARAM_INVALID`` (here) or the peer's code, and move nothing."""

    def __init__(self, engine: Engine, native: Any) -> None:
        self._engine = engine
        self._native = native
        self.block_size: int = native.block_size

    def read(self, local: Indices, remote: Indices) -> None:
        """Remote blocks ``remote[i]`` -> local blocks ``local[i]``."""
        self._native.read(local, remote)

    def write(self, local: Indices, remote: Indices) -> None:
        """Local blocks ``local[i]`` -> remote blocks ``remote[i]``."""
        self._native.write(local, remote)

    def read_async(self, local: Indices, remote: Indices) -> Pending:
        """``read`` on the engine's async pool; ``Pending.cancel()`` stops it."""
        return self._engine._submit_transfer(self._native.read, np.array(local, np.int64),
                                             np.array(remote, np.int64))

    def write_async(self, local: Indices, remote: Indices) -> Pending:
        """``write`` on the engine's async pool; ``Pending.cancel()`` stops it."""
        return self._engine._submit_transfer(self._native.write, np.array(local, np.int64),
                                             np.array(remote, np.int64))


class PreparedPlan:
    """A TP plan bound to a local region and the prefill ranks' regions (``Engine.prepare_plan``):
    ``read(local_blocks, remote_blocks)`` moves every slice the plan needs into local blocks
    ``local_blocks[i]`` from remote blocks ``remote_blocks[block_ratio * i + j]``, every rank's
    reads at once on the engine's async pool, and waits for all of them.

    How a rank is read (``paths``): ``"prepared"`` where each of its reads is one piece per block
    on both sides (head slices of HND blocks, whole token-major blocks under a block ratio) and its
    region is reached by key with the plan's block size: one native prepared transfer per read,
    with block views (``Engine.prepare``), which costs no more per block than a whole-block one;
    else ``"rows"``: strided rows (``pdlink.kv.plan_rows``, ``Engine.read``). Each posted request
    is all or nothing; when one fails, others may have landed, and the call raises the first
    failure. Not a pin, like ``PreparedTransfer``."""

    def __init__(self, engine: Engine, plan: TpPlan, local: Region, sources: Mapping[int, tuple[int, RemoteRegion]]):
        self._engine, self.plan, self._local = engine, plan, local
        self._peers = {rank: sources[rank][0] for rank in plan.ranks}
        self._remote = {rank: sources[rank][1].addresses for rank in plan.ranks}
        self.local_blocks = local.length // plan.local.block_bytes
        self.remote_blocks = min(sources[rank][1].length // plan.remote_block_bytes for rank in plan.ranks)
        # rank -> [(sub-block, native prepared transfer)] where every read of the rank can be one
        self._prepared: dict[int, list[tuple[int, PreparedTransfer]]] = {}
        for rank in plan.ranks:
            remote = sources[rank][1]
            reads = [r for r in plan.reads if r.remote_rank == rank]
            if (remote.key is not None and remote.tensors == local.tensors
                    and remote.block_size == plan.remote_block_bytes and local.block_size == plan.local.block_bytes
                    and all(r.local.count == 1 and r.remote.count == 1 for r in reads)):
                self._prepared[rank] = [
                    (r.sub_block, engine.prepare(self._peers[rank], local, remote,
                                                 local_view=(r.local.offset, r.local.length),
                                                 remote_view=(r.remote.offset, r.remote.length)))
                    for r in reads]

    @property
    def paths(self) -> dict[int, str]:
        """How each prefill rank is read: ``"prepared"`` or ``"rows"`` (the class docstring)."""
        return {rank: "prepared" if rank in self._prepared else "rows" for rank in self.plan.ranks}

    def read(self, local_blocks: Indices, remote_blocks: Indices) -> None:
        """Reads the plan's slices of ``remote_blocks`` into ``local_blocks`` (numpy int64 arrays or
        lists of ints), bounded by the engine's timeout. A block index out of either region's range,
        or a remote list that is not ``block_ratio`` times the local one, is ``InvalidArgument``
        before anything is sent."""
        lb, rb = np.asarray(local_blocks, np.int64).reshape(-1), np.asarray(remote_blocks, np.int64).reshape(-1)
        if len(rb) != self.plan.block_ratio * len(lb) or not len(lb):
            raise InvalidArgument(f"{len(lb)} local blocks need {self.plan.block_ratio * len(lb)} remote blocks "
                                  f"(block_ratio {self.plan.block_ratio}), got {len(rb)}",
                                  status_code=LLMStatusCode.LLM_PARAM_INVALID)
        for what, idx, n in (("local", lb, self.local_blocks), ("remote", rb, self.remote_blocks)):
            if idx.min() < 0 or idx.max() >= n:
                raise InvalidArgument(f"a {what} block index is outside [0, {n})",
                                      status_code=LLMStatusCode.LLM_PARAM_INVALID)
        pending = [prepared.read_async(lb, rb[sub::self.plan.block_ratio])
                   for posts in self._prepared.values() for sub, prepared in posts]
        rest = {rank: addresses for rank, addresses in self._remote.items() if rank not in self._prepared}
        if rest:  # one request per rank and tensor: each stays inside one allocation (tensor_parts)
            rows = plan_rows(self.plan, self._local.addresses, rest, lb, rb, ranks=sorted(rest))
            tensors = self._local.tensors
            pending += [self._engine.read_async(self._peers[rank], lp, rp) for rank, (lr, rr) in rows.items()
                        for lp, rp in zip(tensor_parts(lr, tensors), tensor_parts(rr, tensors), strict=True)]
        errors = []
        for p in pending:
            try:
                p.wait()
            except BaseException as e:  # noqa: BLE001 - every request is waited for; the first error is raised
                errors.append(e)
        if errors:
            raise errors[0]


class BatchTransfer:
    """Descriptor lists to one peer (``Engine.batch``): ``read(local_addresses, remote_addresses,
    lengths, timeout_ms=0)`` copies ``lengths[i]`` bytes from the peer's ``remote_addresses[i]`` to
    ``local_addresses[i]``, ``write(...)`` the other way; lists of ints or uint64 arrays, each call
    one all-or-nothing request as ``Engine.read_batch``'s. ``timeout_ms`` 0 is
    ``EngineOptions.timeout_ms``; ``ValueError`` outside ``[0, 2**31)``. Both are the native
    methods themselves: a call costs no Python frame."""

    read: Callable[..., None]
    write: Callable[..., None]

    def __init__(self, native: Any) -> None:
        self.peer: int = native.peer_cluster_id
        self.read = native.read
        self.write = native.write


@dataclass(frozen=True)
class Ticket:
    """What a decoder needs to claim an offer (``Engine.offer`` -> ``Offer.ticket``; send it to the
    decoder, it pickles small): the prefill's ``cluster_id`` and ``address`` (``"ip:port"`` it listens
    on; ``""`` when it does not listen: the decoder must be linked already), the offered region's
    ``key``, ``tensors``, ``block_size`` and ``length`` (per tensor), the offered ``blocks``, and the
    offer's ``offer_id``, ``generation`` (a ticket of another engine incarnation, or a guessed one,
    matches nothing), ``request_id`` and ``lease_ms``."""

    cluster_id: int
    address: str
    key: int
    tensors: int
    block_size: int
    length: int
    blocks: tuple[int, ...]
    offer_id: int
    generation: int
    request_id: str
    lease_ms: int


@dataclass(frozen=True)
class HandoffEvent:
    """A handoff event. From ``Engine.released()``: ``kind`` ``"released"``, an offer of this engine
    was released (``offer_id``, ``request_id``, ``reason``: ``"claimed"``, ``"expired"``,
    ``"aborted"``, ``"peer_aborted"``, ``"link_down"`` or ``"released"``; ``peer``: the cluster id
    of the link it was bound to, None when it was never bound). From ``Engine.handoff_events()``:
    ``kind`` ``"aborted"``, peer ``peer`` aborted ``request_id`` with ``reason`` (``offer_id``
    None)."""

    kind: str
    peer: int | None
    request_id: str
    reason: str
    offer_id: int | None = None


class Offer:
    """One KV handoff offer of this engine (``Engine.offer``): its blocks stay retained for
    ``ticket.request_id`` until the offer is released.

    ``released``: True once the offer is released AND no read of it is being served: from then the
    blocks may be reused (a late claim fails with ``pdlink.OfferReleased`` and lands nothing).
    ``reason``: None while live, then ``"claimed"``, ``"expired"``, ``"aborted"``, ``"peer_aborted"``,
    ``"link_down"`` or ``"released"``. ``release()`` gives it up (reason ``"released"``; a no-op once
    released); ``wait(timeout)`` waits until ``released`` (True) or the timeout (False). The
    ``on_release(offer)`` given to ``Engine.offer`` runs once, on the engine's handoff thread, after
    ``released`` became True."""

    def __init__(self, engine: Engine, ticket: Ticket, on_release: Callable[[Offer], object] | None) -> None:
        self.ticket = ticket
        self._engine = engine
        self._on_release = on_release
        self._done = threading.Event()
        self._reason: str | None = None

    @property
    def released(self) -> bool:
        return self._done.is_set()

    @property
    def reason(self) -> str | None:
        return self._reason

    def release(self) -> None:
        self._engine._native.release_offer(self.ticket.offer_id)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def _finish(self, reason: str) -> None:
        self._reason = reason
        self._done.set()
        if self._on_release is not None:
            try:
                self._on_release(self)
            except Exception:  # noqa: BLE001 - a callback's error must not stop the other offers' callbacks
                logging.getLogger("pdlink").exception("an offer's on_release callback raised")

    def __repr__(self) -> str:
        return (f"Offer(offer_id={self.ticket.offer_id}, request_id={self.ticket.request_id!r}, "
                f"released={self.released}, reason={self._reason!r})")


#: The most pieces one ``read``/``write`` call's strided rows may expand to on either side (each
#: piece costs 16 bytes of this process's memory per side while the call runs).
MAX_ROW_PIECES = 1 << 22
_U64_MAX = np.uint64(2**64 - 1)


def _descriptors(descs: Descriptors, what: str, destination: bool = False) -> np.ndarray:
    """``descs`` as an (M, 2) uint64 array of (address, length) pieces: (N, 2) pairs as they are,
    (N, 4) strided rows ``(address, length, stride, count)`` expanded piece by piece. A row needs
    ``length`` and ``count`` >= 1 and must not wrap past 2**64; on a ``destination`` side its
    pieces must not overlap (``stride >= length`` where ``count > 1``)."""
    arr = np.asarray(descs, dtype=np.uint64)
    if arr.ndim != 2 or arr.shape[1] not in (2, 4) or arr.shape[0] == 0:
        raise ValueError(f"{what} must be a non-empty list of (address, length) pairs or (address, length, stride, "
                         f"count) rows, got shape {arr.shape}")
    if arr.shape[1] == 2:
        return arr
    address, length, stride, count = arr.T

    def refuse(bad: np.ndarray, why: str) -> None:
        if bad.any():
            i = int(np.argmax(bad))
            raise InvalidArgument(f"{what} row {i} {tuple(int(v) for v in arr[i])}: {why}",
                                  status_code=LLMStatusCode.LLM_PARAM_INVALID)

    refuse((length == 0) | (count == 0), "length and count must be at least 1")
    # the last piece's end, address + stride * (count - 1) + length, must not pass 2**64
    room = _U64_MAX - address
    refuse(length > room, "wraps past the end of the address space")
    steps = count - np.uint64(1)
    room = room - length
    refuse((steps > 0) & (stride > room // np.maximum(steps, np.uint64(1))), "wraps past the end of the address space")
    if destination:
        refuse((count > 1) & (stride < length), "its pieces overlap (stride below length), which a destination refuses")
    total = int(count.sum(dtype=np.uint64)) if count.max() < MAX_ROW_PIECES else MAX_ROW_PIECES + 1
    if total > MAX_ROW_PIECES:
        raise InvalidArgument(f"{what} rows expand to more than {MAX_ROW_PIECES} pieces; split the call",
                              status_code=LLMStatusCode.LLM_PARAM_INVALID)
    row = np.repeat(np.arange(arr.shape[0]), count.astype(np.int64))
    first = np.cumsum(count.astype(np.int64)) - count.astype(np.int64)
    k = (np.arange(total, dtype=np.int64) - first[row]).astype(np.uint64)
    return np.stack([address[row] + k * stride[row], length[row]], axis=1)


class Engine:
    """One pdlink engine (a cluster id, its links, its registered memory).

    ``Engine(EngineOptions(...))`` starts it; ``close()`` (or leaving a ``with`` block) unlinks
    every peer and frees it. Raises ``LLMException`` subclasses (docs/native_api.md, "Errors")."""

    def __init__(self, options: EngineOptions) -> None:
        if not isinstance(options, EngineOptions):
            raise TypeError(f"options must be EngineOptions, got {type(options).__name__}")
        self.options = options = options.resolved()
        if environment.read(environment.METRICS):  # PDLINK_METRICS: the process's metrics endpoint, first
            from .metrics import Metrics

            Metrics.from_environment()
        ip, port = "", 0
        if options.listen is not None:
            ip, port = _split_address(options.listen)
        self._native = open_engine(
            backend=str(options.backend), device_id=options.device_id, cluster_id=options.cluster_id,
            role=options.role, listen_ip=ip, listen_port=port, sync_timeout_ms=options.timeout_ms,
            transport=str(options.transport), link_secret=options.secret or "",
            payload_integrity=options.payload_integrity, hccl_one_sided=bool(options.hccl_one_sided),
            limits=options.limits.overrides(), device_pool=_pool(options.device_pool),
            host_pool=_pool(options.host_pool), one_way_links=options.one_way_links,
            ucx_trusted_network=bool(options.ucx_trusted_network))
        self.kv = KvCaches(self._native)
        self._regions: dict[int, Region] = {}
        self._owners: dict[int, tuple[Any, ...]] = {}  # cache id -> the objects its memory belongs to
        self._batches: dict[int, BatchTransfer] = {}  # peer -> its descriptor transfers (read_batch)
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # KV handoffs: the live offers by id, and the thread that reports their releases (started by
        # the first offer; _handoff_lock orders an offer's insertion before its release's report).
        self._offers: dict[int, Offer] = {}
        self._handoff_lock = threading.Lock()
        self._handoff_thread: threading.Thread | None = None
        self._handoff_stop = False
        self._claim_dialled: dict[int, str] = {}  # cluster id -> the ticket address a claim dialled it at
        with _OPEN_LOCK:
            _OPEN[id(self)] = weakref.ref(self)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Unlinks every peer (telling it when reachable), waits for async calls, frees the engine.
        Idempotent."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with _OPEN_LOCK:
            _OPEN.pop(id(self), None)
        self._native.finalize()  # releases every offer (reason "released")
        self._stop_handoffs()
        with self._lock:  # peers can reach nothing now
            self._regions.clear()
            self._owners.clear()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def cluster_id(self) -> int:
        return int(self._native.cluster_id)

    @property
    def role(self) -> str:
        """``"PROMPT"``, ``"DECODER"`` or ``"MIX"``."""
        return str(self._native.role.name)

    def switch_role(self, role: str | enum.Enum, listen: Address | None = None, *, expected_epoch: int | None = None,
                    drain_timeout_ms: int | None = None, require_no_links: bool = False) -> None:
        """Switches the role while the engine runs; links survive it. ``listen``: ``"ip:port"`` or
        ``(ip, port)`` to listen there (moving the listener if it is elsewhere), ``None`` to stop
        listening. Blocks (without the GIL) until the switch committed or was refused:

        * ``expected_epoch`` given and not ``role_state().epoch``: ``LLM_STALE_EPOCH``, nothing changed;
        * another switch pending (phase ``draining``, ``switching``, ``rolling_back``):
          ``LLM_ROLE_SWITCHING``, nothing changed;
        * ``require_no_links`` and a link exists: ``LLM_EXIST_LINK`` (llm_datadist's contract);
        * phase ``draining``: new links and new transfers are refused with ``LLM_ROLE_SWITCHING``,
          here and as the server of peers' reads, writes and describes; it waits until nothing is in
          flight (``RoleState``'s three counts), at most ``drain_timeout_ms`` (default:
          ``Limits.switch_drain_timeout_ms``, 30000); past it the switch rolls back (phase
          ``rolling_back``): this engine's transfers in flight are cancelled at their next cancel
          point (async: ``CANCELLED``; sync: ``TransferCancelled`` raised), the peers' split pulls
          open here have their later chunks refused (``LLM_ROLE_SWITCHING``), pins are left to
          their bound; it waits at most min(1 s, the drain timeout) for the cancelled transfers,
          then phase ``ready``, role and epoch unchanged, and raises ``LLM_TIMEOUT`` saying what
          was in flight, how many were cancelled and how many were still ending;
        * phase ``switching``: the listener moves; a failure with the old listener still held rolls
          back (its error raised); one after the old listener was given up leaves phase
          ``failed`` (role and epoch unchanged) until the next ``switch_role``;
        * commit: the new role, epoch + 1, phase ``ready`` (the same role is a switch too). A
          prepared transfer made against the old epoch then fails with ``LLM_STALE_EPOCH`` (nothing
          moved): prepare it again.

        With ``one_way_links`` only the role label and the epoch change (a new listen address:
        ``LLM_FEATURE_NOT_ENABLED``)."""
        for name, value in (("expected_epoch", expected_epoch), ("drain_timeout_ms", drain_timeout_ms)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")
        if drain_timeout_ms == 0:
            raise ValueError("drain_timeout_ms must be positive (None: the engine's default)")
        options = core().SwitchOptions()
        options.role = role_of(role)
        if listen is not None:
            options.listen_ip, options.listen_port = _split_address(listen)
        options.expected_epoch = expected_epoch
        options.drain_timeout_ms = drain_timeout_ms or 0
        options.require_no_links = bool(require_no_links)
        self._native.switch_role(options)

    def role_state(self) -> RoleState:
        """This engine's role, role epoch, phase and what a switch would wait for (``RoleState``)."""
        r = self._native.role_state()
        return RoleState(role=str(r.role.name), epoch=int(r.epoch), phase=str(r.phase.name).lower(),
                         transfers_in_flight=int(r.transfers_in_flight), served_in_flight=int(r.served_in_flight),
                         pins=int(r.pins), offers=int(r.offers))

    @property
    def listen_port(self) -> int:
        """The bound listen port (0: not listening)."""
        return int(self._native.listen_port)

    @property
    def backend(self) -> str:
        return str(self._native.backend)

    def capabilities(self) -> dict[str, Any]:
        """What this engine's backend can do: ``device_memory``, ``host_memory``,
        ``device_transport`` and optional ``features``."""
        caps: dict[str, Any] = self._native.backend_handle.capabilities()
        return caps

    def links(self) -> list[LinkInfo]:
        """This engine's links, one ``LinkInfo`` each (``pdlink.LinkInfo``: the engine's own record,
        typed and read-only)."""
        return self._native.links()

    def stats(self) -> EngineStats:
        """A snapshot of what this engine did and what peers made it spend (``pdlink.EngineStats``,
        typed and read-only; docs/metrics.md): its resource counts (live links, handshakes, threads,
        refusals, offers, pinned bytes, role epoch), and its transfers, failures and link events by
        peer, path and op. ``later - earlier`` (or ``later.since(earlier)``) is what changed between
        two snapshots. Cheap (C++ only, the GIL released): a collector may take one per scrape."""
        stats: EngineStats = self._native.stats()
        return stats

    # ------------------------------------------------------------------ memory

    def register(self, memory: Any = None, *, address: int | Sequence[int] | None = None, length: int | None = None,
                 placement: str | enum.Enum = "HOST", block_size: int | None = None, key: int | None = None,
                 remote_writable: bool = True, geometry: KvGeometry | None = None) -> Region:
        """Registers memory for transfers: an object with the buffer protocol or
        ``__array_interface__`` (a numpy array; its whole contiguous buffer), a tensor with
        ``data_ptr()`` (torch), or a list of them of equal size (a region of several tensors); or
        ``address`` (an int, or a list of them) and ``length`` per tensor (DEVICE memory of the
        backend, say). ``block_size`` (default: ``length``) must divide the length. ``key``
        publishes the region to peers under that number (unique per engine).
        ``remote_writable=False`` refuses peers' writes. ``geometry`` (a ``pdlink.kv.KvGeometry``):
        the KV geometry of the region's blocks, carried by ``Region.remote()`` and checked by
        ``prepare`` and ``prepare_plan`` against the peer's; the region must then have its
        ``layers * kv`` tensors, and its blocks (``block_size``, which defaults to the geometry's
        block) the geometry's bytes (``GeometryMismatch`` naming the field if not).

        Ownership: the engine holds a reference to every object given as ``memory`` until the
        region is deregistered or the engine closes, so peers never reach memory that was freed
        and reused. Memory given by ``address`` is the caller's: it must stay allocated until
        ``deregister`` (or ``close``) returns."""
        owners: tuple[Any, ...] = ()
        if memory is not None:
            if address is not None or length is not None:
                raise ValueError("give memory, or address and length, not both")
            owners = tuple(memory) if isinstance(memory, (list, tuple)) else (memory,)
            spans = [span for span in map(_span_of, owners) if span is not None]
            if not owners or len(spans) != len(owners):
                raise ValueError("memory must be C-contiguous (an array, or a non-empty list of arrays)")
            if len({n for _, n in spans}) != 1:
                raise ValueError(f"the tensors of a region must have one size, got {[n for _, n in spans]}")
            addresses, length = [a for a, _ in spans], spans[0][1]
        else:
            addresses = list(address) if isinstance(address, (list, tuple)) else [address]  # type: ignore[list-item]
        if (not addresses or any(not isinstance(a, int) or a <= 0 for a in addresses) or not isinstance(length, int)
                or length <= 0):
            raise ValueError(f"addresses and length must be positive ints, got {address!r}, {length!r}")
        if geometry is not None:
            _check_geometry(geometry, len(addresses), block_size)
        block = (length if geometry is None else geometry.block_bytes) if block_size is None else block_size
        if not isinstance(block, int) or block <= 0 or length % block:
            raise ValueError(f"block_size must be a positive divisor of the length {length}, got {block_size!r}")
        if key is not None and (not isinstance(key, int) or not 0 <= key < core().INVALID_ID):
            raise ValueError(f"key must be an int in [0, 2**64 - 1), got {key!r}")
        where = placement_of(placement)
        layout = core().CacheLayout(len(addresses), length, length // block, True, where)
        cache_id, _ = self._native.register_cache(layout, addresses, [], key, remote_writable)
        region = Region(tuple(addresses), length, where.name, block, key, int(cache_id), geometry)
        with self._lock:
            self._regions[region.cache_id] = region
            if owners:
                self._owners[region.cache_id] = owners
        return region

    def deregister(self, region: Region) -> None:
        """Withdraws a region: peers can no longer reach it, prepared transfers over it fail on
        their next post, and its live offers are released (``"released"``). Returns once nothing
        uses its memory (docs/native_api.md, "Memory"): transfers being served or made over it
        finish first, a peer's pin of it ends at the peer's next frame or after ``PinTimeoutMs``.
        Raises ``LLMException`` (``LLM_TIMEOUT``) if something still uses it after twice the
        longest of those bounds; the engine then keeps the registered object."""
        with self._lock:
            if self._regions.pop(region.cache_id, None) is None:
                raise ValueError(f"region {region.cache_id} is not registered here")
        self._native.unregister_cache(region.cache_id)
        with self._lock:  # only now: a transfer still running over the region finished first
            self._owners.pop(region.cache_id, None)

    def copy(self, dst: int, src: int, nbytes: int, *, dst_placement: str | enum.Enum = "HOST",
             src_placement: str | enum.Enum = "HOST") -> None:
        """A blocking local copy of ``nbytes`` through the engine's backend: DEVICE memory the
        host cannot address (Ascend), read or written from host memory, say."""
        self._native.backend_handle.copy(dst, placement_of(dst_placement), src, placement_of(src_placement), nbytes)

    def local_memory(self) -> MemoryMap:
        """This engine's registered memory (every tensor of every region)."""
        with self._lock:
            ranges = sorted((a, r.length) for r in self._regions.values() for a in r.addresses)
        return MemoryMap(0, tuple(ranges))

    # ------------------------------------------------------------------ peers

    def connect(self, address: Address, *, cluster_id: int | None = None, timeout_ms: int | None = None) -> int:
        """Links to the engine listening at ``"ip:port"`` (or ``(ip, port)``); returns its cluster id (checked when
        ``cluster_id`` is given). Raises ``LinkError`` (a ``ConnectionError``) when it cannot."""
        ip, port = _split_address(address)
        timeout = self.options.connect_timeout_ms if timeout_ms is None else timeout_ms
        (result,) = self._native.link([(cluster_id, ip, port)], timeout)
        result.check()
        return int(result.peer_cluster_id)

    def disconnect(self, peer: int, *, timeout_ms: int | None = None, force: bool = False) -> None:
        """Drops the link to ``peer`` (telling it; ``force``: even when it cannot be told)."""
        timeout = self.options.connect_timeout_ms if timeout_ms is None else timeout_ms
        (result,) = self._native.unlink([peer], timeout, force)
        result.check()

    def remote_memory(self, peer: int, *, timeout_ms: int | None = None) -> MemoryMap:
        """The memory ``peer`` registered, as it checks descriptors against it (one round trip): to
        refuse a descriptor list before sending it, say. ``InvalidArgument`` when the peer has more
        than ``LIMITS["max_request_tensors"]`` tensors registered."""
        timeout = self.options.timeout_ms if timeout_ms is None else timeout_ms
        generation, ranges = self._native.describe_memory(peer, timeout)
        return MemoryMap(int(generation), tuple((int(a), int(n)) for a, n in ranges))

    def ping(self, peer: int, *, timeout_ms: int | None = None) -> None:
        """One round trip to ``peer``; raises when it does not answer in time."""
        self._native.ping(peer, self.options.timeout_ms if timeout_ms is None else timeout_ms)

    def notify(self, peer: int, message: bytes | str, *, name: bytes | str = b"",
               timeout_ms: int | None = None) -> None:
        """Sends ``message`` (and ``name``; bytes, or text sent as UTF-8) to ``peer`` and returns
        once the peer queued it. It follows every transfer this engine completed on the link, so a
        notification sent after ``write`` returned reaches the peer after the written bytes.

        Raises ``InvalidArgument`` for a name over ``LIMITS["max_notify_name_bytes"]`` or a message
        over ``LIMITS["max_notify_message_bytes"]``; ``LinkError`` with ``LLM_LINK_BUSY`` when the
        peer holds as many unread notifications as its limits allow (``Limits.
        max_notifications_per_link``, ``max_notification_bytes``: retry after it took them);
        otherwise as ``ping``."""
        self._native.notify(peer, _notify_bytes(name, "name"), _notify_bytes(message, "message"),
                            self.options.timeout_ms if timeout_ms is None else timeout_ms)

    def notify_async(self, peer: int, message: bytes | str, **kwargs: Any) -> Pending:
        return self._submit(self.notify, peer, message, **kwargs)

    def notifications(self) -> list[Notification]:
        """Takes every notification peers sent to this engine and nobody took yet, in arrival order
        (each peer's in the order it sent them); a second call returns only newer ones."""
        return [Notification(n.peer, n.name, n.message) for n in self._native.take_notifications()]

    def add_listener(self, address: Address) -> int:
        """Also accepts links at ``"ip:port"`` or ``(ip, port)`` (a second listener beside ``EngineOptions.listen``:
        the rendezvous of llm_datadist's ``link()``); returns the bound port. Idempotent for the
        same address."""
        ip, port = _split_address(address)
        return int(self._native.start_comm_listener(ip, port))

    def connect_each(self, peers: Sequence[tuple[int | None, Address]], *,
                     timeout_ms: int | None = None) -> list[LinkResult]:
        """Links to several peers at once, each ``(cluster_id or None, "ip:port" or (ip, port))``: one
        ``pdlink.LinkResult`` per peer, in order (``status``, ``message``, ``scope``, the peer's
        ``peer_cluster_id``), without raising for a peer that failed (``LLM_ALREADY_LINK``: linked
        before). A peer that failed does not fail the others: its ``scope`` is ``Scope.LINK``
        (``CALL`` for a bad address, ``ENGINE`` when this engine cannot link at all). A call that fails
        as a whole (more than 16 peers: ``LLM_CLUSTER_NUM_EXCEED_LIMIT``; an engine not initialised)
        gives one result, whatever the number of peers. ``timeout_ms`` bounds the whole call."""
        addresses = [(cid, *_split_address(address)) for cid, address in peers]
        timeout = self.options.connect_timeout_ms if timeout_ms is None else timeout_ms
        return list(self._native.link(addresses, timeout))

    def disconnect_each(self, peers: Sequence[int], *, timeout_ms: int | None = None,
                        force: bool = False) -> list[LinkResult]:
        """``disconnect`` for several peers: one ``pdlink.LinkResult`` per peer, in order, its
        ``peer_cluster_id`` the id asked for, without raising (``LLM_NOT_YET_LINK``: no link to that
        peer). More than 16 peers: one ``LLM_CLUSTER_NUM_EXCEED_LIMIT`` result."""
        timeout = self.options.connect_timeout_ms if timeout_ms is None else timeout_ms
        return list(self._native.unlink(list(peers), timeout, force))

    def linked_since(self, mark: int) -> tuple[int, list[int]]:
        """The mark to pass next time, and the peers whose links came up after ``mark`` (a mark
        this call returned; 0: since the start; ``pdlink.LATEST_LINK_MARK``: none, only the current mark).
        Links that came and went between two calls are listed too."""
        latest, peers = self._native.linked_since(mark)
        return int(latest), [int(p) for p in peers]

    def connect_async(self, address: Address, **kwargs: Any) -> Pending:
        return self._submit(self.connect, address, **kwargs)

    def disconnect_async(self, peer: int, **kwargs: Any) -> Pending:
        return self._submit(self.disconnect, peer, **kwargs)

    # ------------------------------------------------------------------ transfers

    def read(self, peer: int, local: Descriptors, remote: Descriptors, *, timeout_ms: int | None = None) -> None:
        """Copies each remote ``(address, length)`` into the local one at the same index. Local
        descriptors lie in this engine's regions, remote ones in the peer's; one outside them
        (here or at the peer) fails the call with ``InvalidArgument`` and nothing moves.
        Either list may instead be ``(N, 4)`` strided rows ``(address, length, stride, count)``:
        ``count`` pieces of ``length`` bytes, each ``stride`` after the previous; the two lists then
        pair piece by piece (docs/native_api.md, "Strided rows").
        ``timeout_ms`` (default ``EngineOptions.timeout_ms``) bounds the whole call."""
        self._transfer(peer, local, remote, False, timeout_ms)

    def write(self, peer: int, local: Descriptors, remote: Descriptors, *, timeout_ms: int | None = None) -> None:
        """Copies each local ``(address, length)`` into the remote one at the same index."""
        self._transfer(peer, local, remote, True, timeout_ms)

    def read_async(self, peer: int, local: Descriptors, remote: Descriptors, **kwargs: Any) -> Pending:
        """``read`` on the engine's async pool; ``Pending.cancel()`` stops it."""
        lo, ro = _descriptors(local, "local", True), _descriptors(remote, "remote")
        return self._submit_transfer(lambda token: self._transfer(peer, lo, ro, False, _timeout_kw(**kwargs), token))

    def write_async(self, peer: int, local: Descriptors, remote: Descriptors, **kwargs: Any) -> Pending:
        """``write`` on the engine's async pool; ``Pending.cancel()`` stops it."""
        lo, ro = _descriptors(local, "local"), _descriptors(remote, "remote", True)
        return self._submit_transfer(lambda token: self._transfer(peer, lo, ro, True, _timeout_kw(**kwargs), token))

    def read_batch(self, peer: int, local_addresses: Addresses, remote_addresses: Addresses, lengths: Addresses, *,
                   timeout_ms: int | None = None) -> None:
        """``read`` with the descriptors as three parallel lists (or uint64 arrays), as transfer
        engines take them: ``lengths[i]`` bytes from ``remote_addresses[i]`` to
        ``local_addresses[i]``. Lists of ints go to C++ without a numpy conversion, which makes
        this the cheapest call for a few descriptors."""
        self._batch(peer, local_addresses, remote_addresses, lengths, False, timeout_ms)

    def write_batch(self, peer: int, local_addresses: Addresses, remote_addresses: Addresses, lengths: Addresses, *,
                    timeout_ms: int | None = None) -> None:
        """``write`` with the descriptors as three parallel lists (``read_batch``)."""
        self._batch(peer, local_addresses, remote_addresses, lengths, True, timeout_ms)

    def read_batch_async(self, peer: int, local_addresses: Addresses, remote_addresses: Addresses,
                         lengths: Addresses, **kwargs: Any) -> Pending:
        """``read_batch`` on the engine's async pool; ``Pending.cancel()`` stops it. The lists must not
        change until it is done."""
        return self._submit_transfer(lambda token: self._batch(peer, local_addresses, remote_addresses, lengths,
                                                               False, _timeout_kw(**kwargs), token))

    def write_batch_async(self, peer: int, local_addresses: Addresses, remote_addresses: Addresses,
                          lengths: Addresses, **kwargs: Any) -> Pending:
        """``write_batch`` on the engine's async pool; ``Pending.cancel()`` stops it."""
        return self._submit_transfer(lambda token: self._batch(peer, local_addresses, remote_addresses, lengths,
                                                               True, _timeout_kw(**kwargs), token))

    def prepare(self, peer: int, local: Region, remote: RemoteRegion, *, block_size: int | None = None,
                local_view: tuple[int, int] | None = None, remote_view: tuple[int, int] | None = None,
                block_ratio: int = 1) -> PreparedTransfer:
        """A prepared block transfer between ``local`` and the peer's ``remote`` region, in blocks
        of ``block_size`` (default: the local region's). Nothing is sent to the peer until a post.

        Block views and ratios (docs/native_api.md, "Block views and ratios"): ``local_view`` and
        ``remote_view`` are ``(offset, length)`` byte ranges of every block of each side (a head
        slice of a head-major block); ``block_ratio`` r maps one local block to r remote blocks
        (``read(local, remote)`` then takes r remote indices per local one, local block
        ``local[i]``'s view in r equal pieces from remote blocks ``remote[r * i + j]``). With any
        of them each side's blocks are its own region's ``block_size``. A mapping that does not fit
        the blocks raises ``InvalidArgument`` here. Where both regions carry a geometry
        (``register(geometry=...)``), each piece must hold the same heads on both sides
        (``pdlink.kv.check_views``): ``GeometryMismatch`` naming the field if not."""
        if local.cache_id not in self._regions:
            raise ValueError(f"region {local.cache_id} is not registered here")
        if local.geometry is not None and remote.geometry is not None:
            check_views(local.geometry, remote.geometry, local_view=local_view, remote_view=remote_view,
                        block_ratio=block_ratio)
        if local.tensors != remote.tensors:
            raise ValueError(f"the local region has {local.tensors} tensors, the remote one {remote.tensors}")
        if remote.key is None and remote.tensors > 1:
            raise ValueError("a region of several tensors is reached by its key (register it with key=...)")
        block = local.block_size if block_size is None else block_size
        c = core()
        if remote.key is not None:
            target = c.Target(kind=c.TargetKind.BLOCKS, model_id=remote.key)
        else:
            target = c.Target(kind=c.TargetKind.RAW)
        spec = c.TransferSpec(peer_cluster_id=peer, target=target, local_cache_id=local.cache_id)
        mapped = local_view is not None or remote_view is not None or block_ratio != 1
        lv, rv = local_view or (0, 0), remote_view or (0, 0)
        mapping = c.BlockMapping(remote_block_size=remote.block_size if mapped else block, local_view_offset=lv[0],
                                 local_view_length=lv[1], remote_view_offset=rv[0], remote_view_length=rv[1],
                                 block_ratio=block_ratio)
        native = self._native.prepare(spec, block, remote.address, remote.length, mapping)
        return PreparedTransfer(self, native)

    def prepare_plan(self, plan: TpPlan, local: Region, sources: Mapping[int, tuple[int, RemoteRegion]]
                     ) -> PreparedPlan:
        """Binds a TP plan (``pdlink.kv.tp_plan``) to this engine's ``local`` region and, for each
        prefill rank the plan reads, ``sources[rank] = (peer, remote_region)`` (the peer's
        ``Region.remote()``, with its tensor addresses). Checked here, never per read
        (``InvalidArgument``): each region has the plan's ``layers * kv`` tensors, holds a whole
        number of its blocks (the plan's block bytes on each side), and a source for every rank
        read; where a region carries a geometry (``register(geometry=...)``), it is the plan's:
        the local one its ``plan.local``, each source's one the plan can read as that rank
        (``GeometryMismatch`` naming the field). Nothing is sent until a read."""
        tensors = plan.local.layers * plan.local.kv
        if local.geometry is not None:
            _same_geometry(local.geometry, plan.local, "the local region")
        if local.tensors != tensors or local.length % plan.local.block_bytes:
            raise InvalidArgument(f"the local region ({local.tensors} tensors of {local.length} bytes) does not hold "
                                  f"the plan's {tensors} tensors of {plan.local.block_bytes}-byte blocks",
                                  status_code=LLMStatusCode.LLM_PARAM_INVALID)
        for rank in plan.ranks:
            if rank not in sources:
                raise InvalidArgument(f"the plan reads prefill rank {rank}, and no source was given for it",
                                      status_code=LLMStatusCode.LLM_PARAM_INVALID)
            remote = sources[rank][1]
            if remote.geometry is not None:
                if remote.geometry.tp_rank != rank:
                    raise GeometryMismatch("tp_rank", f"the source given for prefill rank {rank} is rank "
                                                      f"{remote.geometry.tp_rank}'s region")
                if check_pair(plan.local, remote.geometry) != plan.block_ratio or \
                        remote.geometry.block_bytes != plan.remote_block_bytes:
                    raise GeometryMismatch("block_tokens", f"prefill rank {rank}'s blocks are "
                                                           f"{remote.geometry.block_bytes} bytes; the plan reads "
                                                           f"{plan.remote_block_bytes}-byte blocks")
            if len(remote.addresses) != tensors or remote.length % plan.remote_block_bytes or \
                    remote.length < plan.remote_block_bytes:
                raise InvalidArgument(f"prefill rank {rank}'s region ({len(remote.addresses)} tensor addresses, "
                                      f"{remote.length} bytes each) does not hold the plan's {tensors} tensors of "
                                      f"{plan.remote_block_bytes}-byte blocks (a RemoteRegion from Region.remote() "
                                      f"carries its tensor addresses)", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        return PreparedPlan(self, plan, local, sources)

    def _transfer(self, peer: int, local: Descriptors, remote: Descriptors, push: bool,
                  timeout_ms: int | None, cancel: Any = None) -> None:
        lo, ro = _descriptors(local, "local", not push), _descriptors(remote, "remote", push)
        if lo.shape != ro.shape:
            raise InvalidArgument(f"local and remote descriptor lists differ in length ({len(lo)} vs {len(ro)} pieces)",
                                  status_code=LLMStatusCode.LLM_PARAM_INVALID)
        if not np.array_equal(lo[:, 1], ro[:, 1]):
            raise InvalidArgument("a local piece and its remote one differ in length",
                                  status_code=LLMStatusCode.LLM_PARAM_INVALID)
        self._batch(peer, lo[:, 0], ro[:, 0], lo[:, 1], push, timeout_ms, cancel)

    def batch(self, peer: int) -> BatchTransfer:
        """``read_batch`` and ``write_batch`` to one linked ``peer`` without their per-call lookup:
        for callers that move many small lists to the same peer (pdlink's hixl keeps one per link).
        The handle does not hold the link: after a disconnect its calls fail as ``read_batch``'s
        would."""
        return BatchTransfer(self._native.batch(peer))

    def _batch(self, peer: int, local: Addresses, remote: Addresses, lengths: Addresses, push: bool,
               timeout_ms: int | None, cancel: Any = None) -> None:
        if timeout_ms is not None and (type(timeout_ms) is not int or not 0 < timeout_ms < 2**31):
            raise ValueError(f"timeout_ms must be a positive int, got {timeout_ms!r}")
        # One request for the whole list, wherever in this engine's regions the local descriptors
        # lie (the engine checks each against them): a refused descriptor, here or at the peer,
        # moves none.
        batch = self._batches.get(peer)
        if batch is None:
            if len(self._batches) >= 1024:  # one per peer; peers come and go
                self._batches.clear()
            batch = self._batches[peer] = self.batch(peer)
        (batch.write if push else batch.read)(local, remote, lengths, timeout_ms or 0, cancel)

    # ------------------------------------------------------------------ KV handoffs

    def offer(self, region: Region, blocks: Indices, *, request_id: str, lease_ms: int | None = None,
              on_release: Callable[[Offer], object] | None = None) -> Offer:
        """Retains ``blocks`` (block indices of ``region``, a region registered here with a ``key``)
        for ``request_id`` (at most 256 bytes UTF-8) until a decoder claims them
        (``Engine.claim(offer.ticket, ...)``), the lease passes (``lease_ms``, default
        ``Limits.offer_lease_ms``, at most ``Limits.max_lease_ms``; a hold or a claim's read extends
        it), either side aborts the request, the decoder's link goes down, or ``Offer.release()``
        (docs/native_api.md, "Handoffs"). Raises ``InvalidArgument``, ``OutOfMemory`` past
        ``Limits.max_offers``, ``LLM_ROLE_SWITCHING`` while a role switch is pending."""
        if region.key is None:
            raise ValueError("an offer is read through a region registered with a key (register(key=...))")
        with self._lock:
            if region.cache_id not in self._regions:
                raise ValueError(f"region {region.cache_id} is not registered here")
        if lease_ms is not None and (type(lease_ms) is not int or lease_ms <= 0):
            raise ValueError(f"lease_ms must be a positive int, got {lease_ms!r}")
        block_list = [int(b) for b in np.asarray(blocks, np.int64).reshape(-1)]
        with self._handoff_lock:
            if self._handoff_stop:
                raise ValueError("the engine is closed")
            offer_id, generation, lease = self._native.offer(region.cache_id, block_list, _utf8(request_id),
                                                             lease_ms or 0)
            ticket = Ticket(cluster_id=self.cluster_id, address=self._address(), key=int(region.key),
                            tensors=region.tensors, block_size=region.block_size, length=region.length,
                            blocks=tuple(sorted(set(block_list))), offer_id=int(offer_id),
                            generation=int(generation), request_id=str(request_id), lease_ms=int(lease))
            offer = self._offers[ticket.offer_id] = Offer(self, ticket, on_release)
            if self._handoff_thread is None:
                self._handoff_thread = threading.Thread(target=self._report_releases, name="pdlink-handoffs",
                                                        daemon=True)
                self._handoff_thread.start()
                _handoff_engines.add(self)
        return offer

    def claim(self, ticket: Ticket, local_region: Region, local_blocks: Indices, *,
              timeout_ms: int | None = None) -> None:
        """Pulls the ticket's blocks into ``local_blocks`` of ``local_region`` (same count, same
        tensors and block size), linking to the ticket's engine first (``ticket.address``) unless a
        link this engine dialled, one a link secret authenticated, or one confirmed (a genuine
        accepted link, after its first such dial) reaches its cluster id; once
        every byte landed, the offer is released on the prefill side by the pull's own closing frame
        (no extra round trip). Raises ``pdlink.OfferReleased`` when the offer is over (claimed,
        expired, aborted, its link down, another decoder's) or the prefill aborted the request (over
        the link this claim uses) before this returned; a pull's errors otherwise."""
        self._claim(ticket, local_region, local_blocks, timeout_ms)

    def claim_async(self, ticket: Ticket, local_region: Region, local_blocks: Indices, *,
                    timeout_ms: int | None = None) -> Pending:
        """``claim`` on the engine's async pool; ``Pending.cancel()`` stops it at its next cancel
        point: the offer then stays live (it is released only by a claim that landed every byte) and
        this engine may claim it again."""
        local = np.array(local_blocks, np.int64)
        return self._submit_transfer(lambda token: self._claim(ticket, local_region, local, timeout_ms, token))

    def _claim(self, ticket: Ticket, local: Region, local_blocks: Indices, timeout_ms: int | None,
               cancel: Any = None) -> None:
        if not isinstance(ticket, Ticket):
            raise TypeError(f"ticket must be a pdlink.Ticket, got {type(ticket).__name__}")
        if local.cache_id not in self._regions:
            raise ValueError(f"region {local.cache_id} is not registered here")
        if local.tensors != ticket.tensors or local.block_size != ticket.block_size:
            raise ValueError(f"the local region has {local.tensors} tensors of {local.block_size}-byte blocks, the "
                             f"offer {ticket.tensors} of {ticket.block_size}-byte blocks")
        blocks = [int(b) for b in np.asarray(local_blocks, np.int64).reshape(-1)]
        if len(blocks) != len(ticket.blocks):
            raise ValueError(f"the ticket offers {len(ticket.blocks)} blocks, got {len(blocks)} local ones")
        if timeout_ms is not None and (type(timeout_ms) is not int or not 0 < timeout_ms < 2**31):
            raise ValueError(f"timeout_ms must be a positive int, got {timeout_ms!r}")
        if ticket.address:
            self._link_for_claim(ticket)
        self._native.claim(ticket.cluster_id, ticket.key, ticket.offer_id, ticket.generation, _utf8(ticket.request_id),
                           local.cache_id, blocks, list(ticket.blocks), timeout_ms or 0, cancel)

    def _link_for_claim(self, ticket: Ticket) -> None:
        """Makes sure a link that proves it reaches the ticket's engine is there (docs/security.md,
        "KV handoffs": a ticket is the application's data, and a claim reads from the engine at the
        address it names)."""
        links = [link for link in self.links() if link.peer_cluster_id == ticket.cluster_id and not link.broken]
        proven = [link for link in links if link.initiator or link.authenticated or link.confirmed]
        with self._lock:
            dialled_at = self._claim_dialled.get(ticket.cluster_id)
        if proven and dialled_at not in (None, ticket.address) and not any(link.authenticated for link in proven):
            # The link was dialled by a claim of a ticket that put this cluster id at another
            # address: without a link secret a cluster id is only what the engine there said, so
            # one of the two tickets is not that engine's. Use the address this ticket names.
            logging.getLogger("pdlink").warning(
                "cluster %d: the link a claim dialled at %s is dropped for this ticket's address %s",
                ticket.cluster_id, dialled_at, ticket.address)
            self._native.unlink([ticket.cluster_id], self.options.connect_timeout_ms, True)
            proven = []
        if proven:
            return
        # No link that proves it is the ticket's engine (one this engine dialled, one a link secret
        # authenticated, one confirmed): an accepted link's cluster id is only a claim
        # (docs/security.md, "Identities"), so dial the ticket's address. The engine there confirms
        # a genuine accepted link (LLM_ALREADY_LINK: kept, and confirmed from then on) or the
        # accepted one is an impostor's and is dropped for the dialled one.
        ip, port = _split_address(ticket.address)
        (result,) = self._native.link([(ticket.cluster_id, ip, port)], self.options.connect_timeout_ms)
        if int(result.status) == LLMStatusCode.LLM_ALREADY_LINK:
            return
        result.check()
        live = {link.peer_cluster_id for link in self.links() if link.initiator and not link.broken}
        with self._lock:  # one entry per link this engine has, of those a claim dialled
            self._claim_dialled = {c: a for c, a in self._claim_dialled.items() if c in live}
            self._claim_dialled[ticket.cluster_id] = ticket.address

    def abort(self, request_id: str, *, peer: int | None = None, reason: str = "",
              timeout_ms: int | None = None) -> None:
        """Aborts ``request_id``: this engine's offers of it are released (reason ``"aborted"``), and
        ``peer`` (or every linked peer, skipping those it cannot reach) is told: its offers of it
        are released (``"peer_aborted"``), it queues a ``HandoffEvent`` (``handoff_events()``), and
        its claims of it from this engine fail with ``pdlink.OfferReleased``. ``reason``: at most
        256 bytes UTF-8. With ``peer``, that peer's failure raises."""
        timeout = self.options.timeout_ms if timeout_ms is None else timeout_ms
        self._native.abort(_utf8(request_id), peer, _utf8(reason), timeout)

    def hold(self, tickets: Sequence[Ticket], *, timeout_ms: int | None = None) -> None:
        """A decoder's heartbeat: each ticket's offer gets its lease extended by its ``lease_ms`` and
        is bound to this engine's link (from then, that link's death releases it, reason
        ``"link_down"``). One frame per prefill engine; offers that are over are skipped."""
        timeout = self.options.timeout_ms if timeout_ms is None else timeout_ms
        by_peer: dict[int, list[tuple[int, int]]] = {}
        for t in tickets:
            by_peer.setdefault(t.cluster_id, []).append((t.offer_id, t.generation))
        for peer, offers in by_peer.items():
            self._native.hold(peer, offers, timeout)

    def released(self) -> list[HandoffEvent]:
        """Takes the records of this engine's offers released since the last call, oldest first
        (at most ``Limits.max_handoff_events`` kept: the oldest are dropped past it)."""
        return [HandoffEvent("released", None if peer is None else int(peer), rid, reason, int(oid))
                for oid, rid, reason, peer in self._native.take_released()]

    def handoff_events(self) -> list[HandoffEvent]:
        """Takes what peers told this engine of their handoffs (``kind`` ``"aborted"``), oldest first."""
        return [HandoffEvent(kind, int(peer), rid, reason) for kind, peer, rid, reason in
                self._native.take_handoff_events()]

    def _address(self) -> str:
        if self.options.listen is None:
            return ""
        ip, _ = _split_address(self.options.listen)
        return f"{ip}:{self.listen_port}"

    def _stop_handoffs(self) -> None:
        """Stops the handoff thread (no offer is reported after it) and waits for it."""
        with self._handoff_lock:
            thread, self._handoff_thread = self._handoff_thread, None
            self._handoff_stop = True
        if thread is not None:
            self._native.wake_handoffs()
            if thread is not threading.current_thread():
                thread.join()

    def _report_releases(self) -> None:
        """The handoff thread: reports each released offer to its ``Offer`` (``released``, ``wait``,
        ``on_release``), until the engine closed and nothing is left to report."""
        while True:
            done = self._native.take_finalized_offers(200)
            finished = []
            with self._handoff_lock:
                for offer_id, reason in done:
                    offer = self._offers.pop(int(offer_id), None)
                    if offer is not None:
                        finished.append((offer, str(reason)))
                stop = self._handoff_stop and not done
            for offer, reason in finished:
                offer._finish(reason)
            if stop:
                return

    def _submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Pending:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.options.async_workers,
                                                                   thread_name_prefix="pdlink-async")
            return Pending(self._pool.submit(fn, *args, **kwargs))

    def _submit_transfer(self, fn: Callable[..., Any], *args: Any) -> Pending:
        """``fn(*args, token)`` on the async pool, cancellable through its ``CancelToken``."""
        token = core().CancelToken()
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.options.async_workers,
                                                                   thread_name_prefix="pdlink-async")
            return Pending(self._pool.submit(_cancellable, token, fn, *args), token)


def _env_flag(variable: environment.Variable) -> bool:
    flag = environment.read(variable)
    if flag not in ("0", "1"):
        raise ValueError(f"{variable.name} must be '0' or '1', got {flag!r}")
    return flag == "1"


def _pool(pool: MemoryPool | None) -> tuple[int, int | None]:
    return (0, None) if pool is None else (pool.size, pool.page_shift)


def _notify_bytes(value: bytes | str, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"a notification's {what} must be bytes or str, got {type(value).__name__}")


# The engines whose handoff thread runs. That thread is a daemon that waits in a native call without
# the GIL; one that came back from it while the interpreter finalizes would be ended by pthread_exit,
# whose unwinding through the C++ frames terminates the process (SIGABRT). So at exit, before
# finalizing, every such thread is stopped (atexit runs before daemon threads are cut off). An engine
# joins the set when it starts the thread; one closed meanwhile has stopped its own.
_handoff_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _stop_handoffs_at_exit() -> None:
    for engine in list(_handoff_engines):
        engine._stop_handoffs()


def _utf8(text: object) -> bytes:
    """``str(text)`` as UTF-8, a lone surrogate kept as the bytes that encode it, which are not
    UTF-8: the engine then refuses them with ``InvalidArgument`` like any other such bytes."""
    return str(text).encode("utf-8", "surrogatepass")


# The engines of this process not yet closed (open_engines), by id: what the process's metrics
# endpoint (pdlink.Metrics) serves.
_OPEN: dict[int, weakref.ref[Engine]] = {}
_OPEN_LOCK = threading.Lock()


def open_engines() -> list[Engine]:
    """Every ``Engine`` of this process not yet closed, oldest first."""
    with _OPEN_LOCK:
        refs = list(_OPEN.values())
    return [e for e in (r() for r in refs) if e is not None]


def _split_address(address: Address) -> tuple[str, int]:
    """``(ip, port)`` of an address: a pair is checked and passed on as it is, a string split at its
    last colon."""
    if isinstance(address, tuple):
        if len(address) != 2:
            raise ValueError(f"address must be 'ip:port' or (ip, port), got {address!r}")
        host, number = address
        if (isinstance(host, str) and host and isinstance(number, int) and not isinstance(number, bool)
                and 0 <= number <= 65535):
            return host, number
        # what the string would have been refused with: a pair is the string, not yet joined
        raise ValueError(f"address must be 'ip:port', got {f'{host}:{number}'!r}")
    ip, sep, port = str(address).rpartition(":")
    if not sep or not ip or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address must be 'ip:port', got {address!r}")
    return ip, int(port)
