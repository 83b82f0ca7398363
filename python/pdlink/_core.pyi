"""Type stubs for the native module ``pdlink._core`` (csrc/bindings/module.cc).

The module mirrors the C++ engine and makes no policy decisions; use ``pdlink.LLMDataDist``.
Failures raise ``pdlink.status.LLMException`` with ``status_code`` set; every method that may
block releases the GIL.
"""

from collections.abc import Sequence

PROTOCOL_VERSION: int
ANY_CLUSTER: int  # a peer cluster id to be learned from the handshake
LIMITS: dict[str, int]  # what one peer may make an engine spend (csrc/core/limits.h)

def ptrace_grant_active() -> bool: ...  # same-host peers may read this process now (proven links exist)

def _hmac_sha256(key: bytes, msg: bytes) -> bytes: ...  # the links' MAC, libcrypto's (tests)
def crypto_library() -> str: ...  # where libcrypto was loaded from; raises LLMException when it cannot be

_Key = tuple[int, int, int]  # (req_id, prefix_id, model_id)
_Handle = tuple[int, list[int]]  # (cache_id, tensor addresses)

def ascend_info() -> dict[str, object]: ...  # what the Ascend loader found: loaded, error, library_dir, features
def _map_vendor_code(lib: str, rc: int) -> int: ...  # "acl" or "hccl" return code -> LLMStatusCode value

class Backend:
    """A process-wide backend: memory of a placement (0 HOST, 1 DEVICE) and copies between them."""

    @property
    def name(self) -> str: ...
    @property
    def device_id(self) -> int: ...
    def capabilities(self) -> dict[str, object]: ...  # device_memory, host_memory, device_transport, features
    def allocate(self, placement: int, nbytes: int) -> int: ...
    def release(self, placement: int, addr: int, nbytes: int) -> None: ...
    def copy(self, dst: int, dst_placement: int, src: int, src_placement: int, nbytes: int) -> None: ...

def open_backend(name: str, device_id: int = 0) -> Backend: ...  # "auto", "cpu" or "ascend"

class EngineLimits:
    """What peers may make an engine spend (csrc/engine/engine.h); defaults from C++."""

    max_links: int
    max_handshakes: int
    max_handshakes_per_source: int
    pin_timeout_ms: int  # 0: max(2 x sync_timeout_ms, 5 s)
    handshake_timeout_ms: int  # an incoming connection's handshake, hello to authentication
    def __init__(self) -> None: ...

class Engine:
    def __init__(self, backend: Backend | str = "cpu") -> None: ...
    def initialize(
        self,
        cluster_id: int,
        role: int,
        listen_ip: str,
        listen_port: int,
        sync_timeout_ms: int,
        device_pool_bytes: int,
        device_page_shift: int,
        host_pool_bytes: int,
        host_page_shift: int,
        transport: int = 0,  # 0 auto (direct memory access on one host, else TCP), 1 tcp, 2 cma
        link_secret: str = "",  # non-empty: links must authenticate, every frame sealed (needs libcrypto)
        hccl_one_sided: bool = False,  # Ascend: HcclBatchGet/Put when both ends enable it
        limits: EngineLimits = ...,
        payload_integrity: bool = False,  # with a link secret: payloads sealed too
        one_way_links: bool = False,  # llm_datadist's "hixl" transfer backend: only the dialler uses a link
    ) -> None: ...
    def finalize(self) -> None: ...
    @property
    def initialized(self) -> bool: ...
    @property
    def cluster_id(self) -> int: ...
    @property
    def role(self) -> int: ...
    @property
    def listen_port(self) -> int: ...
    @property
    def backend(self) -> str: ...
    @property
    def backend_handle(self) -> Backend: ...
    @property
    def cache_count(self) -> int: ...
    def pools(self) -> list[dict[str, int]]: ...
    # live_links, tombstones, handshakes, threads, handshakes_refused, listener_backoffs, pins_expired
    def stats(self) -> dict[str, int]: ...  # placement, base, capacity, used per memory pool
    def switch_role(self, role: int, listen_ip: str, listen_port: int) -> None: ...
    def link(
        self, peers: Sequence[tuple[int | None, str, int]], timeout_ms: int
    ) -> list[tuple[int, str, int]]: ...  # (status code, message, peer cluster id) per peer
    def ping(self, cluster_id: int, timeout_ms: int, op: str) -> None: ...
    def start_comm_listener(self, ip: str, port: int) -> int: ...
    def unlink(self, cluster_ids: Sequence[int], timeout_ms: int, force: bool) -> list[tuple[int, str]]: ...
    def linked_since(self, after: int) -> tuple[int, list[int]]:
        """(number of the latest link installed, peer ids of those numbered after ``after``)."""
    def links(self) -> list[dict[str, int | str | bool | list[str]]]: ...
    def register_cache(
        self,
        num_tensors: int,
        tensor_size: int,
        num_slots: int,
        is_blocks: bool,
        placement: int,
        addrs: Sequence[int],
        keys: Sequence[_Key],
        blocks_model: int | None,
        remote_accessible: bool,
        op: str,
    ) -> _Handle: ...
    def allocate_cache(
        self,
        num_tensors: int,
        tensor_size: int,
        num_slots: int,
        is_blocks: bool,
        placement: int,
        keys: Sequence[_Key],
        blocks_model: int | None,
        op: str,
    ) -> _Handle: ...
    def deallocate_cache(self, cache_id: int, blocks: bool, op: str) -> None: ...
    def unregister_cache(self, cache_id: int) -> None: ...
    def remove_cache_key(self, req_id: int, prefix_id: int, model_id: int) -> None: ...
    def transfer(
        self,
        is_push: bool,
        op: str,
        peer: int,
        target_kind: int,
        model_id: int,
        req_id: int,
        prefix_id: int,
        cache_id: int,
        batch_index: int,
        local_cache_id: int,
        mode: int,
        local_slot: int,
        size: int,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        local_tensors: Sequence[int],
        remote_tensors: Sequence[int],
        local_runs: Sequence[tuple[int, int]],
        remote_runs: Sequence[tuple[int, int]],
    ) -> None: ...
    def copy_local(
        self,
        dst: Sequence[int],
        dst_placement: int,
        src: Sequence[int],
        src_placement: int,
        runs: Sequence[tuple[int, int, int]],
        op: str,
    ) -> None: ...
