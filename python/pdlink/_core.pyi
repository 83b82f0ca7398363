"""Type stubs for the native module ``pdlink._core`` (csrc/bindings/, one file per group of types).

The module mirrors the C++ engine and makes no policy decisions; use ``pdlink.Engine`` (or
``llm_datadist.LLMDataDist``).
Failures raise the exception class registered for their status code (``_register_errors``, which
``pdlink.native.core()`` calls with ``pdlink.status.native_errors()``: an ``LLMException`` subclass
with ``status_code`` set, the engine's message, and ``scope``, a ``Scope``; a transfer stopped at a
cancel point raises the class registered under key -1, ``pdlink.TransferCancelled``); every method that may
block releases the GIL. ``Engine.link`` and ``unlink`` return one ``LinkResult`` per peer instead.
"""

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from .status import LLMStatusCode

PROTOCOL_VERSION: int
ANY_CLUSTER: int  # a peer cluster id to be learned from the handshake
BACKENDS: tuple[str, ...]  # the names open_backend takes (csrc/backends/backend.h kBackendNames)
INVALID_ID: int  # an unset req_id / prefix_id / registration key (csrc/engine/registry.h kInvalidId)
LATEST_LINK_MARK: int  # Engine.linked_since(it) lists no peer, only the latest mark
LIMITS: dict[str, int]  # what one peer may make an engine spend (csrc/core/limits.h)
LATENCY_BOUNDS: tuple[float, ...]  # telemetry's histogram bucket bounds, seconds (csrc/engine/telemetry.h)
LLM_STALE_EPOCH: int  # pdlink's own status codes (csrc/core/status.h), which pdlink.LLMStatusCode names
LLM_ROLE_SWITCHING: int
LLM_OFFER_RELEASED: int
# the PDLINK_* variables the core reads (csrc/core/environment.h): name, meaning, default, empty_is_value
NATIVE_VARIABLES: tuple[tuple[str, str, str | None, bool], ...]

def ptrace_grant_active() -> bool: ...  # same-host peers may read this process now (proven links exist)
# whether every [addresses[i], +lengths[i]) lies in the ranges by the registry's rule (csrc/core/spans.h)
def covers(ranges: Sequence[tuple[int, int]], addresses: Sequence[int], lengths: Sequence[int]) -> bool: ...

# {status code: (exception class, status_code value)}: what a failed Status raises (csrc/bindings/status_bridge.h);
# key CANCELLED_ERROR_KEY: the class a transfer stopped at a cancel point raises, as cls(message)
def _register_errors(errors: Mapping[int, tuple[type[BaseException], object]]) -> None: ...
CANCELLED_ERROR_KEY: int

def _hmac_sha256(key: bytes, msg: bytes) -> bytes: ...  # the links' MAC, libcrypto's (tests)
def crypto_library() -> str: ...  # where libcrypto was loaded from; raises LLMException when it cannot be

_Key = tuple[int, int, int]  # (req_id, prefix_id, model_id)

def ascend_info() -> dict[str, object]: ...  # what the Ascend loader found: loaded, error, library_dir, features
def set_ucx_wheel_dir(dir: str) -> None: ...  # where the libucx package's libucp is (before ucx_info's first call)
def ucx_info() -> dict[str, object]: ...  # what the UCX loader found: loaded, error, library, version
def ucx_network_probe() -> dict[str, object]: ...  # a network worker's lanes, auto_between_hosts, error
def _map_vendor_code(lib: str, rc: int) -> int: ...  # "acl" or "hccl" return code -> LLMStatusCode value

class _Enum:
    """A bound C++ enum (pybind11): members by name, ``value`` its number."""

    __members__: dict[str, Any]
    def __init__(self, value: int) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class Role(_Enum):
    PROMPT: ClassVar[Role]
    DECODER: ClassVar[Role]
    MIX: ClassVar[Role]

class Phase(_Enum):  # where an engine stands with its role (csrc/engine/engine_types.h)
    READY: ClassVar[Phase]
    DRAINING: ClassVar[Phase]
    SWITCHING: ClassVar[Phase]
    ROLLING_BACK: ClassVar[Phase]
    FAILED: ClassVar[Phase]

class SwitchOptions:
    """How a role switch goes (Engine.switch_role)."""

    role: Role
    listen_ip: str  # empty: stop listening
    listen_port: int
    expected_epoch: int | None  # refused with LLM_STALE_EPOCH unless it is the engine's epoch
    drain_timeout_ms: int  # 0: EngineLimits.switch_drain_timeout_ms
    require_no_links: bool  # LLM_EXIST_LINK while a link exists (llm_datadist)
    def __init__(self) -> None: ...

class Placement(_Enum):
    HOST: ClassVar[Placement]
    DEVICE: ClassVar[Placement]

class Transport(_Enum):  # AUTO: direct memory access on one host, else TCP
    AUTO: ClassVar[Transport]
    TCP: ClassVar[Transport]
    CMA: ClassVar[Transport]
    UCX: ClassVar[Transport]

class TargetKind(_Enum):  # how the serving side finds the cache a transfer addresses
    REQUEST_KEY: ClassVar[TargetKind]
    PREFIX_KEY: ClassVar[TargetKind]
    ID_INDEX: ClassVar[TargetKind]
    BLOCKS: ClassVar[TargetKind]
    RAW: ClassVar[TargetKind]  # run offsets are absolute addresses inside one registered tensor
    OFFER: ClassVar[TargetKind]  # a KV handoff's offer: model_id = key, req_id = offer id, prefix_id = generation

class TransferMode(_Enum):
    SLOT_TO_SLOT: ClassVar[TransferMode]
    BLOCKS_TO_BLOCKS: ClassVar[TransferMode]
    SLOT_TO_BLOCKS: ClassVar[TransferMode]  # pull only
    EXPLICIT: ClassVar[TransferMode]  # local_runs[i] <-> remote_runs[i]

class Backend:
    """A process-wide backend: memory of a placement and copies between them."""

    @property
    def name(self) -> str: ...
    @property
    def device_id(self) -> int: ...
    def capabilities(self) -> dict[str, object]: ...  # device_memory, host_memory, device_transport, features
    def allocate(self, placement: Placement, nbytes: int) -> int: ...
    def release(self, placement: Placement, addr: int, nbytes: int) -> None: ...
    def copy(self, dst: int, dst_placement: Placement, src: int, src_placement: Placement, nbytes: int) -> None: ...

def open_backend(name: str, device_id: int = 0) -> Backend: ...  # "auto", "cpu" or "ascend"

class EngineLimits:
    """What peers may make an engine spend (csrc/engine/engine.h); defaults from C++."""

    max_links: int  # 512, or fewer where RLIMIT_NOFILE cannot hold that many
    max_links_per_source: int  # accepted links from one IP address, or one local uid
    max_handshakes: int
    max_handshakes_per_source: int
    hello_timeout_ms: int  # how long an incoming connection may stay silent before its hello
    pin_timeout_ms: int  # 0: max(2 x sync_timeout_ms, 5 s)
    handshake_timeout_ms: int  # an incoming connection's handshake, hello to authentication
    max_notifications_per_link: int  # unread notifications from one peer
    max_notification_bytes: int  # unread notification bytes (names and messages), from all peers
    max_notification_bytes_per_link: int  # of those, from one peer
    max_notification_bytes_per_source: int  # and from all the links of one IP address or local uid
    tcp_streams: int  # TCP streams of a tcp link this side dialled (its channel and lanes), 1..16
    max_tcp_lanes: int  # extra TCP streams (lanes) of all links together
    tcp_chunk_bytes: int  # the chunk a large tcp transfer is split into
    switch_drain_timeout_ms: int  # how long a role switch drains before it rolls back
    max_offers: int  # KV handoff offers held at once (engine/offers.h)
    max_lease_ms: int  # the longest lease an offer may ask for
    offer_lease_ms: int  # the lease of an offer that asks for none
    max_handoff_events: int  # entries of each handoff event queue
    max_metric_peers: int  # peers with metric series of their own; later ones count as "other"
    def __init__(self) -> None: ...

class Notification:
    """A received notification (Engine.take_notifications)."""

    @property
    def peer(self) -> int: ...
    @property
    def name(self) -> bytes: ...
    @property
    def message(self) -> bytes: ...

class Scope(_Enum):
    """What a failure concerns (csrc/core/status.h; pdlink.Scope)."""

    CALL: ClassVar[Scope]  # the call (a bad argument, an absent key): nothing else is affected
    LINK: ClassVar[Scope]  # one peer's link (failed, timed out, refused, busy): other peers are not
    ENGINE: ClassVar[Scope]  # this engine (not initialised, finalised, out of memory or links)

class LinkResult:
    """One peer's outcome of Engine.link / unlink (pdlink.LinkResult): read-only."""

    # scope None: the code's default scope (csrc/core/status.h defaultScope)
    def __init__(self, status: int, message: str, peer_cluster_id: int, scope: Scope | None = None) -> None: ...
    @property
    def status(self) -> LLMStatusCode: ...  # the registered code object (a plain int before _register_errors)
    @property
    def message(self) -> str: ...  # the engine's words; empty on success
    @property
    def scope(self) -> Scope: ...  # CALL on success
    @property
    def peer_cluster_id(self) -> int: ...  # ANY_CLUSTER when never learned
    @property
    def ok(self) -> bool: ...
    def check(self) -> None: ...  # raises the status's exception (as a failed call does) unless ok

# The engine's reports (LinkInfo, EngineStats, PoolInfo) are read-only records (csrc/bindings/record.h):
# no public constructor; they compare and hash by value, pickle, and as_dict() lists the fields in order.

class LinkInfo:
    """One link of an engine (Engine.links(); pdlink.LinkInfo)."""

    @property
    def peer_cluster_id(self) -> int: ...
    @property
    def peer_address(self) -> str: ...  # "ip:port"
    @property
    def initiator(self) -> bool: ...  # this side dialled
    @property
    def broken(self) -> bool: ...
    @property
    def broken_reason(self) -> str: ...
    @property
    def transport(self) -> str: ...  # "cma", "unix", "tcp" or "ucx"
    @property
    def authenticated(self) -> bool: ...  # every frame sealed under a session key
    @property
    def payload_integrity(self) -> bool: ...  # and every payload
    @property
    def device_paths(self) -> tuple[str, ...]: ...  # this side's DEVICE paths, in the order tried
    @property
    def lanes(self) -> tuple[str, ...]: ...  # what the host path moves bytes over ("tcp/lo", ...)
    @property
    def confirmed(self) -> bool: ...  # accepted, and the engine at the peer's address said it made it
    def as_dict(self) -> dict[str, Any]: ...  # the fields in order; device_paths and lanes as lists
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __getstate__(self) -> tuple[Any, ...]: ...
    def __setstate__(self, state: tuple[Any, ...]) -> None: ...

class CacheHandle:
    """A cache an engine registered or allocated (Engine.register_cache, allocate_cache): its id and
    one address per tensor; unpacks as ``cache_id, addresses = handle`` (addresses then a list)."""

    @property
    def cache_id(self) -> int: ...
    @property
    def addresses(self) -> tuple[int, ...]: ...
    def __iter__(self) -> Iterator[Any]: ...
    def __len__(self) -> int: ...

class HistogramCounts:
    """A latency histogram (telemetry): per bucket of LATENCY_BOUNDS and +Inf, not cumulative."""

    @property
    def buckets(self) -> tuple[int, ...]: ...
    @property
    def sum(self) -> float: ...  # seconds
    @property
    def count(self) -> int: ...
    def as_dict(self) -> dict[str, Any]: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __getstate__(self) -> tuple[Any, ...]: ...
    def __setstate__(self, state: tuple[Any, ...]) -> None: ...

class TransferSeries:
    """Completed transfers of one (peer, path, op) (EngineStats.transfers)."""

    @property
    def peer(self) -> str: ...  # a cluster id, or "other" past max_metric_peers
    @property
    def path(self) -> str: ...
    @property
    def op(self) -> str: ...  # "pull" or "push"
    @property
    def transfers(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def descriptors(self) -> int: ...
    @property
    def queue(self) -> HistogramCounts: ...
    @property
    def wire(self) -> HistogramCounts: ...
    @property
    def total(self) -> HistogramCounts: ...
    def as_dict(self) -> dict[str, Any]: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __getstate__(self) -> tuple[Any, ...]: ...
    def __setstate__(self, state: tuple[Any, ...]) -> None: ...

class FailureSeries:
    """Failed transfers of one (peer, path, op, code, stage) (EngineStats.failures)."""

    @property
    def peer(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def op(self) -> str: ...
    @property
    def code(self) -> str: ...  # an LLMStatusCode name
    @property
    def stage(self) -> str: ...  # admission, request, served, payload or commit
    @property
    def count(self) -> int: ...
    def as_dict(self) -> dict[str, Any]: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __getstate__(self) -> tuple[Any, ...]: ...
    def __setstate__(self, state: tuple[Any, ...]) -> None: ...

class LinkEventSeries:
    """Link events of one (peer, event, reason) (EngineStats.link_events)."""

    @property
    def peer(self) -> str: ...
    @property
    def event(self) -> str: ...  # "up", "reconnect" or "down"
    @property
    def reason(self) -> str: ...  # a down's: failed, unlinked, peer_unlinked, replaced, finalized
    @property
    def count(self) -> int: ...
    def as_dict(self) -> dict[str, Any]: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __getstate__(self) -> tuple[Any, ...]: ...
    def __setstate__(self, state: tuple[Any, ...]) -> None: ...

class EngineStats:
    """A snapshot of an engine: what peers made it spend, and its telemetry (Engine.stats())."""

    @property
    def live_links(self) -> int: ...  # links with channels (dialled and accepted)
    @property
    def tombstones(self) -> int: ...  # dead links still reported until unlinked
    @property
    def handshakes(self) -> int: ...  # connections in a handshake now
    @property
    def threads(self) -> int: ...  # engine threads running (serving, handshakes)
    @property
    def handshakes_refused(self) -> int: ...  # connections dropped for want of a handshake slot
    @property
    def handshakes_evicted(self) -> int: ...  # silent connections dropped to make room for a newcomer
    @property
    def listener_backoffs(self) -> int: ...  # times a listener paused for want of descriptors
    @property
    def pins_expired(self) -> int: ...  # pins released before the peer's next frame
    @property
    def notifications(self) -> int: ...  # notifications received and not yet taken
    @property
    def notifications_refused(self) -> int: ...  # refused because a queue bound was reached
    @property
    def offers_live(self) -> int: ...  # KV handoff offers not yet released
    @property
    def offers_released(self) -> int: ...
    @property
    def offers_expired(self) -> int: ...
    @property
    def offers_aborted(self) -> int: ...
    @property
    def offer_bytes(self) -> int: ...  # bytes the live offers retain
    @property
    def handoff_events_dropped(self) -> int: ...  # dropped from a full handoff event queue
    @property
    def pinned_bytes(self) -> int: ...  # bytes pinned for peers' direct accesses now
    @property
    def role_epoch(self) -> int: ...
    @property
    def taken_at(self) -> float: ...  # seconds on the monotonic clock
    @property
    def transfers(self) -> tuple[TransferSeries, ...]: ...
    @property
    def failures(self) -> tuple[FailureSeries, ...]: ...
    @property
    def link_events(self) -> tuple[LinkEventSeries, ...]: ...
    @property
    def links_by_path(self) -> tuple[tuple[str, int], ...]: ...  # live links by host path
    def since(self, earlier: EngineStats) -> EngineStats: ...  # counts since `earlier`, gauges now
    def __sub__(self, earlier: EngineStats) -> EngineStats: ...
    def as_dict(self) -> dict[str, Any]: ...  # the fields in order
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __getstate__(self) -> tuple[Any, ...]: ...
    def __setstate__(self, state: tuple[Any, ...]) -> None: ...

class RoleState:
    """An engine's role, epoch, phase and what a switch drains (Engine.role_state())."""

    @property
    def role(self) -> Role: ...
    @property
    def epoch(self) -> int: ...  # +1 per committed switch, from 0
    @property
    def phase(self) -> Phase: ...
    @property
    def transfers_in_flight(self) -> int: ...  # this side's own transfers running
    @property
    def served_in_flight(self) -> int: ...  # peers' requests being served
    @property
    def pins(self) -> int: ...  # served links holding a peer's pin
    @property
    def offers(self) -> int: ...  # KV handoff offers not yet released
    def as_dict(self) -> dict[str, Any]: ...  # the fields in order
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __getstate__(self) -> tuple[Any, ...]: ...
    def __setstate__(self, state: tuple[Any, ...]) -> None: ...

class PoolInfo:
    """One memory pool of an engine (Engine.pools())."""

    @property
    def placement(self) -> Placement: ...
    @property
    def base(self) -> int: ...
    @property
    def capacity(self) -> int: ...  # bytes
    @property
    def used(self) -> int: ...  # bytes
    def as_dict(self) -> dict[str, Any]: ...  # placement, base, capacity, used
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __getstate__(self) -> tuple[Any, ...]: ...
    def __setstate__(self, state: tuple[Any, ...]) -> None: ...

class PoolConfig:
    bytes: int  # 0: no pool
    page_shift: int
    def __init__(self, bytes: int = 0, page_shift: int = 16) -> None: ...

class EngineConfig:
    """An engine's settings (csrc/engine/engine.h EngineConfig); defaults from C++."""

    cluster_id: int
    role: Role
    listen_ip: str  # empty: do not listen
    listen_port: int  # 0: a free port
    sync_timeout_ms: int  # bounds each pull and push
    device_pool: PoolConfig
    host_pool: PoolConfig
    transport: Transport
    link_secret: str  # non-empty: links must authenticate, every frame sealed (needs libcrypto)
    payload_integrity: bool  # with a link secret: payloads sealed too
    hccl_one_sided: bool  # Ascend: HcclBatchGet/Put when both ends enable it
    one_way_links: bool  # llm_datadist's "hixl" transfer backend: only the dialler uses a link
    ucx_trusted_network: bool
    limits: EngineLimits
    def __init__(self) -> None: ...

class CacheLayout:
    num_tensors: int
    tensor_size: int  # bytes per tensor
    num_slots: int  # shape[0]: batch slots, or blocks of a blocks cache
    is_blocks: bool
    placement: Placement
    def __init__(self, num_tensors: int, tensor_size: int, num_slots: int, is_blocks: bool,
                 placement: Placement) -> None: ...

class Target:
    """The remote cache a transfer addresses (resolved by the peer)."""

    kind: TargetKind
    model_id: int
    req_id: int
    prefix_id: int
    cache_id: int
    batch_index: int
    def __init__(self, *, kind: TargetKind = ..., model_id: int = 0, req_id: int = 0, prefix_id: int = 0,
                 cache_id: int = 0, batch_index: int = 0) -> None: ...

class BlockMapping:
    """A prepared transfer's block views and ratio (csrc/engine/engine_types.h BlockMapping)."""

    @property
    def remote_block_size(self) -> int: ...  # 0: the local block size
    @property
    def local_view_offset(self) -> int: ...
    @property
    def local_view_length(self) -> int: ...  # 0: the whole block
    @property
    def remote_view_offset(self) -> int: ...
    @property
    def remote_view_length(self) -> int: ...  # 0: the local view's length / block_ratio
    @property
    def block_ratio(self) -> int: ...
    def __init__(self, *, remote_block_size: int = 0, local_view_offset: int = 0, local_view_length: int = 0,
                 remote_view_offset: int = 0, remote_view_length: int = 0, block_ratio: int = 1) -> None: ...

class TransferSpec:
    """One pull or push; runs are (offset, length) pairs."""

    peer_cluster_id: int
    target: Target
    local_cache_id: int
    mode: TransferMode
    local_slot: int  # SLOT_TO_SLOT
    size: int  # SLOT_TO_SLOT: bytes per tensor, -1: the local slot size
    local_blocks: list[int]
    remote_blocks: list[int]
    local_tensors: list[int]  # local_tensors[i] <-> remote_tensors[i]; empty: every tensor
    remote_tensors: list[int]
    local_runs: list[tuple[int, int]]  # EXPLICIT
    remote_runs: list[tuple[int, int]]  # EXPLICIT
    local_absolute: bool  # EXPLICIT: local runs are absolute addresses in any registered cache
    timeout_ms: int  # bounds the transfer; 0: the engine's sync timeout
    def __init__(self, *, peer_cluster_id: int = 0, target: Target = ..., local_cache_id: int = 0,
                 mode: TransferMode = ..., local_slot: int = 0, size: int = -1, local_blocks: Sequence[int] = ...,
                 remote_blocks: Sequence[int] = ..., local_tensors: Sequence[int] = ...,
                 remote_tensors: Sequence[int] = ..., local_runs: Sequence[tuple[int, int]] = ...,
                 remote_runs: Sequence[tuple[int, int]] = ..., local_absolute: bool = False,
                 timeout_ms: int = 0) -> None: ...

_Indices = npt.NDArray[np.int64] | Sequence[int]
_U64Array = npt.NDArray[np.uint64] | Sequence[int]

class CancelToken:
    """A transfer's cancel token (csrc/core/cancel.h): running, then cancelled or finished, once."""
    def __init__(self) -> None: ...
    def cancel(self) -> bool: ...  # True: the transfer will end cancelled; False: it had finished
    def finish(self) -> bool: ...  # True: it finished before any cancel; False: it was cancelled
    @property
    def cancelled(self) -> bool: ...
    @property
    def finished(self) -> bool: ...

class PreparedTransfer:
    @property
    def block_size(self) -> int: ...
    @property
    def mapping(self) -> BlockMapping: ...  # resolved: every size set
    @property
    def local_blocks(self) -> int: ...
    @property
    def remote_blocks(self) -> int: ...
    @property
    def peer_cluster_id(self) -> int: ...
    def post(self, local: _Indices, remote: _Indices, push: bool, cancel: CancelToken | None = None) -> None: ...
    def read(self, local: _Indices, remote: _Indices, cancel: CancelToken | None = None) -> None: ...
    def write(self, local: _Indices, remote: _Indices, cancel: CancelToken | None = None) -> None: ...

class BatchTransfer:
    @property
    def peer_cluster_id(self) -> int: ...
    # timeout_ms 0: the engine's sync timeout; ValueError outside [0, 2**31)
    def read(
        self,
        local_addresses: _U64Array,
        remote_addresses: _U64Array,
        lengths: _U64Array,
        timeout_ms: int = 0,
        cancel: CancelToken | None = None,
    ) -> None: ...
    def write(
        self,
        local_addresses: _U64Array,
        remote_addresses: _U64Array,
        lengths: _U64Array,
        timeout_ms: int = 0,
        cancel: CancelToken | None = None,
    ) -> None: ...

class Engine:
    def __init__(self, backend: Backend | str = "cpu") -> None: ...
    def initialize(self, config: EngineConfig) -> None: ...  # ValueError for a limit that is not positive
    def finalize(self) -> None: ...
    @property
    def initialized(self) -> bool: ...
    @property
    def cluster_id(self) -> int: ...
    @property
    def role(self) -> Role: ...
    @property
    def listen_port(self) -> int: ...
    @property
    def backend(self) -> str: ...
    @property
    def backend_handle(self) -> Backend: ...
    @property
    def cache_count(self) -> int: ...
    def pools(self) -> list[PoolInfo]: ...
    def stats(self) -> EngineStats: ...
    def switch_role(self, options: SwitchOptions) -> None: ...  # blocks through the drain, without the GIL
    def role_state(self) -> RoleState: ...
    def link(
        self, peers: Sequence[tuple[int | None, str, int]], timeout_ms: int
    ) -> list[LinkResult]: ...  # one per peer (one in all for a call that failed as a whole)
    def ping(self, cluster_id: int, timeout_ms: int) -> None: ...
    def notify(self, cluster_id: int, name: str | bytes, message: str | bytes, timeout_ms: int) -> None: ...
    def take_notifications(self) -> list[Notification]: ...
    def start_comm_listener(self, ip: str, port: int) -> int: ...
    def unlink(self, cluster_ids: Sequence[int], timeout_ms: int, force: bool) -> list[LinkResult]: ...
    def linked_since(self, after: int) -> tuple[int, list[int]]:
        """(number of the latest link installed, peer ids of those numbered after ``after``)."""
    def links(self) -> list[LinkInfo]: ...
    def register_cache(
        self,
        layout: CacheLayout,
        addrs: Sequence[int],
        keys: Sequence[_Key],
        blocks_model: int | None,
        remote_accessible: bool,
    ) -> CacheHandle: ...
    def allocate_cache(self, layout: CacheLayout, keys: Sequence[_Key], blocks_model: int | None) -> CacheHandle: ...
    def deallocate_cache(self, cache_id: int, blocks: bool) -> None: ...
    def unregister_cache(self, cache_id: int) -> None: ...
    def remove_cache_key(self, req_id: int, prefix_id: int, model_id: int) -> None: ...
    def pull(self, spec: TransferSpec) -> None: ...
    def push(self, spec: TransferSpec) -> None: ...
    # A prepared block transfer (engine/engine.h PreparedTransfer); block_size 0: the local cache's.
    def prepare(
        self, spec: TransferSpec, block_size: int = 0, remote_base: int = 0, remote_bytes: int = 0,
        mapping: BlockMapping = ...
    ) -> PreparedTransfer: ...
    def describe_memory(self, cluster_id: int, timeout_ms: int) -> tuple[int, list[tuple[int, int]]]: ...
    # Descriptor lists to one peer: [local[i], +lengths[i]) <-> [remote[i], +lengths[i]), absolute addresses.
    def batch(self, peer: int) -> BatchTransfer: ...
    # KV handoffs (engine/offers.h): records are tuples, pdlink.Engine wraps them.
    def offer(
        self, cache_id: int, blocks: Sequence[int], request_id: str | bytes, lease_ms: int
    ) -> tuple[int, int, int]: ...  # (offer id, generation, lease_ms); request_id: UTF-8 (bytes: as they are)
    def release_offer(self, offer_id: int) -> None: ...
    def claim(
        self,
        peer: int,
        key: int,
        offer_id: int,
        generation: int,
        request_id: str | bytes,
        local_cache_id: int,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        timeout_ms: int,
        cancel: CancelToken | None = None,
    ) -> None: ...
    def abort(self, request_id: str | bytes, peer: int | None, reason: str | bytes, timeout_ms: int) -> None: ...
    def hold(self, peer: int, offers: Sequence[tuple[int, int]], timeout_ms: int) -> None: ...
    def take_released(self) -> list[tuple[int, str, str, int | None]]: ...  # (offer id, request id, reason, peer)
    def take_handoff_events(self) -> list[tuple[str, int, str, str]]: ...  # (kind, peer, request id, reason)
    def take_finalized_offers(self, timeout_ms: int) -> list[tuple[int, str]]: ...  # (offer id, reason)
    def wake_handoffs(self) -> None: ...
    def copy_local(
        self,
        dst: Sequence[int],
        dst_placement: Placement,
        src: Sequence[int],
        src_placement: Placement,
        runs: Sequence[tuple[int, int, int]],
    ) -> None: ...
