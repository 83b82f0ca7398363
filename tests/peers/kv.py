"""Peer-side functions for KV tests: one ``LLMDataDist`` per peer process, its caches by name.

A test calls these through ``Peer.call`` (tests/peer.py)::

    port = prefill.call(kv.start, "prompt", 1, listen=True)
    prefill.call(kv.register_blocks, "kv", 4, (8, 64), seed=1, key=BlocksCacheKey(1, 0))
    decode.call(kv.start, "decoder", 2)
    decode.call(kv.register_blocks, "kv", 4, (8, 64), seed=None)
    decode.call(kv.link, 1, port)
    decode.call(kv.pull_blocks, BlocksCacheKey(1, 0), "kv", [0, 1], [2, 3])
    snapshot = decode.call(kv.snapshot, "kv")      # tests/verify.py

Registered caches live in guarded memory (tests/peers/memory.py); allocated caches in the
engine's pool, whose whole extent their snapshot covers. DEVICE caches are device memory on a
device backend. Everything here runs only in a peer process; the process ends by SIGKILL, so no
function needs to clean up after the test.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import internals
from llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    TransferWithCacheKeyConfig,
)
from peers import addr
from peers.memory import GuardedTensors, device_memory_is_remote, fill_tensors, pool_snapshot
from verify import Snapshot

Shape = Sequence[int]
RemoteKey = BlocksCacheKey | CacheKey | CacheKeyByIdAndIndex
ROLES = {"prompt": LLMRole.PROMPT, "decoder": LLMRole.DECODER, "mix": LLMRole.MIX}


@dataclasses.dataclass
class _Named:
    cache: Cache
    memory: GuardedTensors | None  # None: pool-allocated
    rows: int
    addrs: list[int]  # the tensors' addresses (the Cache forgets them when deallocated)


@dataclasses.dataclass
class _State:
    dd: LLMDataDist | None = None
    caches: dict[str, _Named] = dataclasses.field(default_factory=dict)
    secrets: list[np.ndarray] = dataclasses.field(default_factory=list)
    threads: list[Any] = dataclasses.field(default_factory=list)


_S = _State()


def _dd() -> LLMDataDist:
    assert _S.dd is not None, "kv.start() has not run in this peer"
    return _S.dd


def engine() -> LLMDataDist:
    """This peer's LLMDataDist (for other peer modules, e.g. peers/connectors.py)."""
    return _dd()


def adopt(dd: LLMDataDist) -> None:
    """Makes an LLMDataDist initialised elsewhere (a connector's own set-up) this peer's engine."""
    assert _S.dd is None, "this peer already has an engine"
    _S.dd = dd


def _named(name: str) -> _Named:
    assert name in _S.caches, f"no cache named {name!r} in this peer (have: {sorted(_S.caches)})"
    return _S.caches[name]


def cache(name: str) -> Cache:
    return _named(name).cache


# ---------------------------------------------------------------------------- engine and links


def options(listen: str | None = None, timeout_ms: int | None = None, remote: bool = True,
            pool: int | None = None, host_pool: int | None = None,
            extra: dict[str, str] | None = None) -> dict[str, str]:
    """The init options of a CacheManager-mode engine on device 0."""
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    if remote:
        cfg.enable_remote_cache_accessible = True
    if listen:
        cfg.listen_ip_info = listen
    if timeout_ms:
        cfg.sync_kv_timeout = timeout_ms
    if pool:
        cfg.mem_pool_cfg = '{"memory_size": %d, "page_shift": 12}' % pool
    if host_pool:
        cfg.host_mem_pool_cfg = '{"memory_size": %d, "page_shift": 12}' % host_pool
    return {**cfg.generate_options(), **(extra or {})}


def start(role: str, cluster_id: int, *, listen: bool = False, timeout_ms: int | None = None,
          remote: bool = True, pool: int | None = None, host_pool: int | None = None,
          extra: dict[str, str] | None = None) -> int:
    """Creates and initialises this peer's engine; returns its listen port (0 when not listening)."""
    assert _S.dd is None, "kv.start() already ran in this peer"
    dd = LLMDataDist(ROLES[role], cluster_id)
    dd.init(options(addr.listen() if listen else None, timeout_ms, remote, pool, host_pool, extra))
    _S.dd = dd
    return int(dd.listen_port)


def start_program(role: str, cluster_id: int, *, listen_port: int | None = None, local_comm_res: bool = True,
                  transfer_backend: str | None = None, cache_manager: bool = False, remote_access: bool = False,
                  pool: int | None = None, timeout_ms: int | None = None, link_total_time: int | None = None) -> int:
    """An engine set up the way the official llm_datadist samples do it (LLMConfig, then
    ``generate_options()``): ``local_comm_res = ""`` (which turns CacheManager mode and remote
    access on), or ``enable_cache_manager`` / ``enable_remote_cache_accessible`` themselves;
    ``listen_ip_info`` on loopback (port 0: any free one); ``transfer_backend`` as given. Returns
    the listen port (0: not listening)."""
    assert _S.dd is None, "kv.start() already ran in this peer"
    cfg = LLMConfig()
    cfg.device_id = 0
    if local_comm_res:
        cfg.local_comm_res = ""
    if cache_manager:
        cfg.enable_cache_manager = True
    if remote_access:
        cfg.enable_remote_cache_accessible = True
    if transfer_backend is not None:
        cfg.transfer_backend = transfer_backend
    if listen_port is not None:
        cfg.listen_ip_info = addr.listen(listen_port)
    if pool:
        cfg.mem_pool_cfg = '{"memory_size": %d, "page_shift": 12}' % pool
    if timeout_ms:
        cfg.sync_kv_timeout = timeout_ms
    if link_total_time is not None:
        cfg.link_total_time = link_total_time
    dd = LLMDataDist(ROLES[role], cluster_id)
    dd.init(cfg.generate_options())
    _S.dd = dd
    return int(dd.listen_port)


# A cluster as the samples describe it: (remote_cluster_id, remote port or None for no
# remote_ip_info, local port or None for no local_ip_info); addresses as peers.addr says.
ClusterSpec = tuple[int, int | None, int | None]


def _clusters(specs: Sequence[ClusterSpec]) -> list[LLMClusterInfo]:
    out = []
    for remote_id, remote_port, local_port in specs:
        c = LLMClusterInfo()
        c.remote_cluster_id = remote_id
        if local_port is not None:
            c.append_local_ip_info(addr.own(), local_port)
        if remote_port is not None:
            c.append_remote_ip_info(addr.of(remote_port), remote_port)
        out.append(c)
    return out


def link_clusters(specs: Sequence[ClusterSpec], timeout_ms: int = 5000) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
    status, per_cluster = _dd().link_clusters(_clusters(specs), timeout_ms)
    return status, list(per_cluster)


def unlink_clusters(specs: Sequence[ClusterSpec], timeout_ms: int = 5000,
                    force: bool = False) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
    status, per_cluster = _dd().unlink_clusters(_clusters(specs), timeout_ms, force=force)
    return status, list(per_cluster)


def comm_link(name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
    """``LLMDataDist.link`` (the rank-table API); returns the comm id."""
    return int(_dd().link(name, cluster_rank_info, rank_table))


def comm_status(comm_id: int) -> RegisterMemStatus:
    return _dd().query_register_mem_status(comm_id)


def comm_unlink(comm_id: int) -> None:
    _dd().unlink(comm_id)


def finalize() -> None:
    _dd().finalize()


def cluster(remote_id: int, port: int, ip: str | None = None, local: bool = True) -> LLMClusterInfo:
    c = LLMClusterInfo()
    c.remote_cluster_id = remote_id
    if local:
        c.append_local_ip_info(addr.own(), 0)
    c.append_remote_ip_info(addr.of(port) if ip is None else ip, port)
    return c


def link(remote_id: int, port: int, timeout_ms: int = 5000,
         ip: str | None = None) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
    status, per_cluster = _dd().link_clusters([cluster(remote_id, port, ip)], timeout_ms)
    return status, list(per_cluster)


def link_logged(remote_id: int, port: int, timeout_ms: int = 5000,
                ip: str | None = None) -> tuple[LLMStatusCode, list[str]]:
    """Like ``link``, and what the library logged about it (the reason of a failed link)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("pdlink").addHandler(handler)
    try:
        status, _ = _dd().link_clusters([cluster(remote_id, port, ip)], timeout_ms)
    finally:
        logging.getLogger("pdlink").removeHandler(handler)
    return status, records


_BACKGROUND: list[Any] = []


def link_in_background(remote_id: int, port: int, timeout_ms: int, ip: str | None = None) -> None:
    """Starts ``link`` on a thread of this peer (``background_link`` returns its result)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    _BACKGROUND[:] = [pool, pool.submit(link, remote_id, port, timeout_ms, ip)]


def background_link(timeout_s: float) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
    pool, future = _BACKGROUND
    result = future.result(timeout_s)
    pool.shutdown()
    return result


def unlink(remote_id: int, port: int, force: bool = False, timeout_ms: int | None = None) -> LLMStatusCode:
    timeout = 3000 if timeout_ms is None else timeout_ms  # llm_datadist's default
    return _dd().unlink_clusters([cluster(remote_id, port)], timeout, force=force)[0]


def links() -> list[dict[str, Any]]:
    return list(_dd().links())


def switch_role(role: str, listen: str | None = None, *, here: bool = False) -> tuple[int, int]:
    """``switch_role``, with a listen address for a new PROMPT (``here``: this peer's own address,
    a free port, peers.addr); returns (role, listen port)."""
    opts = None
    if here:
        listen = addr.listen()
    if listen is not None:
        cfg = LLMConfig()
        cfg.listen_ip_info = listen
        opts = cfg.generate_options()
    _dd().switch_role(ROLES[role], opts)
    return role_and_port()


def role_and_port() -> tuple[int, int]:
    dd = _dd()
    return int(dd.role), int(dd.listen_port)


def listen_port() -> int:
    return int(_dd().listen_port)


def backend() -> str:
    return internals.backend_name(_dd())


def cache_count() -> int:
    return internals.cache_count(_dd())


def resources() -> tuple[int, int]:
    """(open file descriptors, threads) of this process, for leak checks."""
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def thread_names() -> list[str]:
    """The names of this process's threads (for a leak check's failure message)."""
    names = []
    for tid in sorted(os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # it ended meanwhile
            pass
    return names


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


def plant_secret(nbytes: int = 4096) -> tuple[int, bytes]:
    """Unregistered memory holding random bytes (what a hostile peer must never see or change):
    its address and contents."""
    buf = np.frombuffer(os.urandom(nbytes), dtype=np.uint8).copy()
    _S.secrets.append(buf)
    return int(buf.ctypes.data), buf.tobytes()


def secrets() -> list[bytes]:
    """The planted secrets as they are now."""
    return [b.tobytes() for b in _S.secrets]


def thread_with_id(tid: int, within_s: float = 30.0) -> str:
    """Starts a thread of this process whose thread id is ``tid`` (a pid number just freed), by
    setting the pid namespace's last pid (root only) before each try; it lives until
    ``end_threads``. "" once it has that id, else what held the number at the end (a task created
    between setting the last pid and the try takes it: the number is tried again once it is free)."""
    import threading

    def run(got: list[int], started: threading.Event, done: threading.Event) -> None:
        got.append(threading.get_native_id())
        started.set()
        done.wait()

    def holder() -> str:
        try:
            with open(f"/proc/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except FileNotFoundError:
            return ""
        return f"task {tid} of process {fields['Tgid'].strip()} ({fields['Name'].strip()}; this is {os.getpid()})"

    deadline, held = time.monotonic() + within_s, ""
    while time.monotonic() < deadline:
        held = holder()
        if held:
            time.sleep(0.01)  # polls for the number to be free again
            continue
        got: list[int] = []
        started, done = threading.Event(), threading.Event()
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(tid - 1))
        t = threading.Thread(target=run, args=(got, started, done), daemon=True)
        t.start()
        started.wait()
        if got[0] == tid:
            _S.threads.append((t, done))
            return ""
        done.set()
        t.join()
    return held or f"pid {tid} was free but never given to this process's threads"


def end_threads() -> None:
    for t, done in _S.threads:
        done.set()
        t.join()
    _S.threads.clear()


def tensor_addresses(name: str) -> list[int]:
    return list(_named(name).addrs)


def stats() -> dict[str, Any]:
    """What peers made the engine spend (live links, tombstones, handshakes, threads, ...)."""
    return internals.engine(_dd()).stats().as_dict()


def limit_descriptors(extra: int) -> int:
    """Lets this process open only `extra` more descriptors than it has now; returns the old limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + extra, hard))
    return soft


def restore_descriptors(soft: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def can_open_a_file() -> bool:
    try:
        with open("/proc/self/status"):
            return True
    except OSError:
        return False


def ptrace_grant_active() -> bool:
    return bool(internals.core.ptrace_grant_active())


# ---------------------------------------------------------------------------- caches


def _device(placement: Placement) -> bool:
    return placement == Placement.DEVICE and device_memory_is_remote()


def register_blocks(name: str, num: int, shape: Shape, dtype: DataType = DataType.DT_FLOAT16, *,
                    seed: int | None, key: BlocksCacheKey | None = None,
                    placement: Placement = Placement.DEVICE, remote_accessible: bool | None = None) -> int:
    """A blocks cache over guarded memory (``shape[0]`` blocks per tensor), filled with
    ``verify.pattern(.., seed)`` or zeros; returns its cache id."""
    desc = CacheDesc(num, list(shape), dtype, placement)
    mem = GuardedTensors(num, desc.size, shape[0], seed, _device(placement))
    c = _dd().cache_manager.register_blocks_cache(desc, mem.addrs, key, remote_accessible)
    _S.caches[name] = _Named(c, mem, shape[0], mem.addrs)
    return int(c.cache_id)


def register(name: str, num: int, shape: Shape, dtype: DataType = DataType.DT_FLOAT16, *, seed: int | None,
             keys: Sequence[CacheKey] = (), placement: Placement = Placement.DEVICE) -> int:
    """A plain cache over guarded memory (``shape[0]`` batch slots per tensor); returns its id."""
    desc = CacheDesc(num, list(shape), dtype, placement)
    mem = GuardedTensors(num, desc.size, shape[0], seed, _device(placement))
    c = _dd().cache_manager.register_cache(desc, mem.addrs, list(keys))
    _S.caches[name] = _Named(c, mem, shape[0], mem.addrs)
    return int(c.cache_id)


def allocate(name: str, num: int, shape: Shape, dtype: DataType = DataType.DT_FLOAT16, *,
             seed: int | None = None, keys: Sequence[CacheKey] = (), blocks: bool = False,
             placement: Placement = Placement.DEVICE) -> int:
    """A cache from the engine's pool (``allocate_cache``/``allocate_blocks_cache``), written with
    ``verify.pattern(.., seed)`` when a seed is given; returns its id."""
    desc = CacheDesc(num, list(shape), dtype, placement)
    cm = _dd().cache_manager
    if blocks:
        c = cm.allocate_blocks_cache(desc, keys[0] if keys else None)
    else:
        c = cm.allocate_cache(desc, list(keys))
    if seed is not None:
        fill_tensors(list(c.tensor_addrs), desc.size, seed, _device(placement))
    _S.caches[name] = _Named(c, None, shape[0], list(c.tensor_addrs))
    return int(c.cache_id)


def overwrite(name: str, seed: int | None) -> None:
    """New test data in cache ``name`` (``verify.pattern(.., seed)``, zeros for None); guards and
    the rest of a pool unchanged. The memory is written even after the cache was unregistered."""
    n = _named(name)
    desc = n.cache.cache_desc
    fill_tensors(n.addrs, desc.size, seed, _device(desc.placement))


def deallocate(name: str) -> None:
    _dd().cache_manager.deallocate_cache(_named(name).cache)


def unregister(name: str) -> None:
    _dd().cache_manager.unregister_cache(_named(name).cache.cache_id)


def remove_cache_key(key: CacheKey) -> None:
    _dd().cache_manager.remove_cache_key(key)


def snapshot(name: str) -> Snapshot:
    """Every byte around cache ``name``: its tensors and guards, or the whole pool it lives in."""
    n = _named(name)
    if n.memory is not None:
        return n.memory.snapshot(name)
    desc = n.cache.cache_desc
    placement = desc.placement.name
    pool = [p for p in internals.pools(_dd()) if p["placement"].name == placement]
    assert len(pool) == 1, f"no pool of placement {placement}"
    return pool_snapshot(name, pool[0]["base"], pool[0]["capacity"], n.addrs, desc.size, n.rows,
                         _device(desc.placement))


# ---------------------------------------------------------------------------- transfers


def pull_blocks(key: RemoteKey, name: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                **kwargs: Any) -> None:
    _dd().cache_manager.pull_blocks(key, cache(name), list(src_blocks), list(dst_blocks), **kwargs)


def push_blocks(key: BlocksCacheKey, name: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                **kwargs: Any) -> None:
    _dd().cache_manager.push_blocks(key, cache(name), list(src_blocks), list(dst_blocks), **kwargs)


def pull_cache(key: CacheKey | CacheKeyByIdAndIndex, name: str, batch_index: int = 0, **kwargs: Any) -> None:
    _dd().cache_manager.pull_cache(key, cache(name), batch_index, **kwargs)


def push_cache(key: CacheKeyByIdAndIndex, name: str, batch_index: int = 0, **kwargs: Any) -> None:
    _dd().cache_manager.push_cache(key, cache(name), batch_index, **kwargs)


def cpu_cache(name: str, num: int, shape: Shape, dtype: DataType = DataType.DT_FLOAT16, *,
              seed: int | None = None) -> None:
    """``Cache.create_cpu_cache`` over guarded host memory (not registered), for ``swap_blocks``."""
    desc = CacheDesc(num, list(shape), dtype, Placement.HOST)
    mem = GuardedTensors(num, desc.size, shape[0], seed, False)
    _S.caches[name] = _Named(Cache.create_cpu_cache(desc, mem.addrs), mem, shape[0], mem.addrs)


def swap_blocks(src: str, dst: str, src_to_dst: dict[int, int]) -> None:
    _dd().cache_manager.swap_blocks(cache(src), cache(dst), src_to_dst)


class _Ready(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


def transfer_layers(name: str, key: BlocksCacheKey, src_layers: range, dst_layers: range) -> list[LLMStatusCode]:
    """``transfer_cache_async`` of cache ``name`` to ``key`` with every layer ready at once (the
    transfer_cache_async sample); the task's per-config results."""
    task = _dd().cache_manager.transfer_cache_async(cache(name), _Ready(),
                                                     [TransferWithCacheKeyConfig(key, src_layers, dst_layers)])
    return list(task.get_results())


# ---------------------------------------------------------------------------- lifecycle

_STALE: list[Any] = []


def keep_manager() -> None:
    """Remembers this engine's current CacheManager and a cache of it (see ``stale_manager_calls``)."""
    _STALE[:] = [_dd().cache_manager, next(iter(_S.caches.values())).cache]


def stale_manager_calls() -> dict[str, int | str]:
    """Every CacheManager operation, on the manager ``keep_manager`` remembered: what each raised
    (an LLMException's status code; another exception's type name; "ok" when it returned)."""
    cm, c = _STALE
    desc = c.cache_desc
    key, bkey = CacheKey(1, 1), BlocksCacheKey(1, 0)
    calls: dict[str, Any] = {
        "allocate_cache": lambda: cm.allocate_cache(desc),
        "allocate_blocks_cache": lambda: cm.allocate_blocks_cache(desc),
        "register_cache": lambda: cm.register_cache(desc, list(c.tensor_addrs)),
        "register_blocks_cache": lambda: cm.register_blocks_cache(desc, list(c.tensor_addrs)),
        "deallocate_cache": lambda: cm.deallocate_cache(c),
        "deallocate_blocks_cache": lambda: cm.deallocate_blocks_cache(c),
        "copy_cache": lambda: cm.copy_cache(c, c),
        "copy_blocks": lambda: cm.copy_blocks(c, {0: [1]}),
        "pull_cache": lambda: cm.pull_cache(key, c),
        "pull_blocks": lambda: cm.pull_blocks(bkey, c, [0], [0]),
        "push_cache": lambda: cm.push_cache(CacheKeyByIdAndIndex(1, 1), c),
        "push_blocks": lambda: cm.push_blocks(bkey, c, [0], [0]),
        "unregister_cache": lambda: cm.unregister_cache(c.cache_id),
        "remove_cache_key": lambda: cm.remove_cache_key(key),
        "remap_registered_memory": lambda: cm.remap_registered_memory(MemInfo(Memtype.MEM_TYPE_DEVICE, 0, 0)),
        "swap_blocks": lambda: cm.swap_blocks(c, c, {0: 1}),
        "transfer_cache_async": lambda: cm.transfer_cache_async(c, _Ready(), [
            TransferWithCacheKeyConfig(bkey, range(0, 1), range(0, 1))]),
    }
    out: dict[str, int | str] = {}
    for op, call in calls.items():
        try:
            call()
            out[op] = "ok"
        except LLMException as e:
            out[op] = int(e.status_code)
        except Exception as e:  # noqa: BLE001 (the test wants to see whatever it was)
            out[op] = type(e).__name__
    return out


def reinit(role: str, cluster_id: int) -> None:
    """Finalizes this peer's engine and starts a new one (``start``'s defaults, with a pool)."""
    _dd().finalize()
    _S.dd = None
    _S.caches.clear()
    start(role, cluster_id, pool=1 << 20)
