"""Peer-side functions for KvCacheManager (v1, legacy) mode tests (tests/compat/llm_datadist/test_v1_mode.py).

One or more v1 ``LLMDataDist`` engines per peer process, by name (``start`` makes one and makes it
the current one; ``use`` switches), and caches by name (``allocate``, ``allocate_blocks``,
``cpu_cache``), across all engines of the process::

    ports = prefill.call(v1.start, "prompt", 1, listen=1, pool=v1.POOL)
    prefill.call(v1.allocate, "c", 2, (2, 64), keys=[CacheKey(1, 42)], seed=5)
    decode.call(v1.start, "decoder", 2, pool=v1.POOL)
    decode.call(v1.allocate, "dst", 2, (2, 64), seed=None)
    decode.call(v1.link, 1, ports)
    decode.call(v1.pull_cache, CacheKey(1, 42), "dst", 1)
    decode.call(v1.snapshot, "dst")              # tests/verify.py: the whole device pool

Caches come from the engine's device pool; a snapshot covers that whole pool (of one device), so
"every other byte unchanged" covers every other cache in it. Test data is written and read around
pdlink (peers/memory.py ``direct_write``/``direct_read``: fake ACL peek/poke on the Ascend backend).
HOST handles for ``swap_blocks`` (``cpu_cache``) live in guarded memory. Transfer and call
arguments are passed to pdlink as given (no conversion), so a test can pass wrong types.

``python -m peers.v1 exit-single|exit-two-devices`` (tests/ on ``sys.path``) leaves live handles
and an initialised engine at interpreter exit, for the clean-exit check.

Everything here runs only in a peer process, which ends by SIGKILL: nothing cleans up.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import internals
import pdlink
from llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCache,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from peers import addr
from peers.memory import GuardedTensors, device_memory_is_remote, direct_read, direct_write, fill_tensors, pool_snapshot
from verify import Snapshot

Shape = Sequence[int]
ROLES = {"prompt": LLMRole.PROMPT, "decoder": LLMRole.DECODER}
POOL = 1 << 18  # the device pool of a test engine: small, so a snapshot of all of it is cheap


@dataclasses.dataclass
class _Engine:
    dd: LLMDataDist | None  # None: a bare KvCacheManager over pdlink engines (``bare_start``)
    km: Any  # its KvCacheManager (CacheManager for ``start_cache_manager_mode``), kept after finalize
    engines: list[Any]  # the pdlink.Engine of each device


@dataclasses.dataclass
class _Named:
    cache: Any  # KvCache; None once ``drop`` let go of the handle
    desc: CacheDesc
    rows: int
    addrs: list[list[int]]  # per device (the handle forgets them when deallocated)
    engines: list[Any]  # the engines whose device pools hold it ([] for a HOST handle)
    memory: list[GuardedTensors] | None = None  # HOST handles: guarded memory per device


@dataclasses.dataclass
class _State:
    engines: dict[str, _Engine] = dataclasses.field(default_factory=dict)
    current: str = ""
    caches: dict[str, _Named] = dataclasses.field(default_factory=dict)
    tensors: list[Any] = dataclasses.field(default_factory=list)  # from get_cache_tensors
    view: Any = None
    held: Any = None
    tasks: dict[str, Any] = dataclasses.field(default_factory=dict)
    gate: threading.Event = dataclasses.field(default_factory=threading.Event)
    unraisable: list[str] = dataclasses.field(default_factory=list)
    keep: list[Any] = dataclasses.field(default_factory=list)


_S = _State()


def _engine() -> _Engine:
    assert _S.current in _S.engines, "v1.start() has not run in this peer"
    return _S.engines[_S.current]


def _dd() -> LLMDataDist:
    dd = _engine().dd
    assert dd is not None, "a bare manager has no LLMDataDist"
    return dd


def _km() -> Any:
    return _engine().km


def _named(name: str) -> _Named:
    assert name in _S.caches, f"no cache named {name!r} in this peer (have: {sorted(_S.caches)})"
    return _S.caches[name]


def _cache(name: str | None) -> Any:
    return None if name is None else _named(name).cache


# ---------------------------------------------------------------------------- engines and links


def options(listen: str | None = None, devices: int | list[int] = 0, timeout_ms: int | None = None,
            switch: bool = False, mem_max: int | None = None, pool: int | None = None) -> dict[str, str]:
    """The init options of a v1 (KvCacheManager mode) engine."""
    cfg = LLMConfig()
    cfg.device_id = devices
    if listen:
        cfg.listen_ip_info = listen
    if timeout_ms:
        cfg.sync_kv_timeout = timeout_ms
    if switch:
        cfg.enable_switch_role = True
    if mem_max:
        cfg.ge_options = {"ge.flowGraphMemMaxSize": str(mem_max)}
    if pool:
        cfg.mem_pool_cfg = '{"memory_size": %d, "page_shift": 12}' % pool
    return dict(cfg.generate_options())


def start(role: str, cluster_id: int, *, name: str = "dd", listen: int = 0, devices: int | list[int] = 0,
          timeout_ms: int | None = None, switch: bool = False, mem_max: int | None = None,
          pool: int | None = None) -> list[int]:
    """A v1 engine on ``devices`` (an id, or a list for multi-device mode) listening on ``listen``
    loopback addresses (one per device for a PROMPT), made the current engine; its listen ports."""
    dd = LLMDataDist(ROLES[role], cluster_id)
    dd.init(options(";".join([addr.listen()] * listen) or None, devices, timeout_ms, switch, mem_max, pool))
    _S.engines[name] = _Engine(dd, dd.kv_cache_manager, internals.engines(dd))
    _S.current = name
    return [int(p) for p in dd.listen_ports] if listen else []


def start_cache_manager_mode(role: str, cluster_id: int, *, name: str, pool: int) -> None:
    """A CacheManager-mode engine (its ``cache_manager`` as the manager), made the current engine."""
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.mem_pool_cfg = '{"memory_size": %d, "page_shift": 12}' % pool
    dd = LLMDataDist(ROLES[role], cluster_id)
    dd.init(cfg.generate_options())
    _S.engines[name] = _Engine(dd, dd.cache_manager, [internals.engine(dd)])
    _S.current = name


def use(name: str) -> None:
    assert name in _S.engines, f"no engine named {name!r}"
    _S.current = name


def finalize() -> None:
    _dd().finalize()


def listen_port() -> int:
    return int(_dd().listen_port)


def roles() -> tuple[int, int, int]:
    """(the LLMDataDist's role, the role its KvCacheManager enforces, its listen port)."""
    dd = _dd()
    return int(dd.role), internals.manager_role(_km()), int(dd.listen_port)


def num_devices() -> int:
    return int(_km().num_devices)


def _cluster(remote_id: int, ports: Sequence[int]) -> LLMClusterInfo:
    c = LLMClusterInfo()
    c.remote_cluster_id = remote_id
    c.append_local_ip_info(addr.own(), 0)
    for port in ports:
        c.append_remote_ip_info(addr.of(port), port)
    return c


def link_clusters(specs: Sequence[tuple[int, Sequence[int]]],
                  timeout_ms: int = 5000) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
    """``link_clusters`` of (remote cluster id, remote ports: one per device) clusters."""
    status, per = _dd().link_clusters([_cluster(i, ports) for i, ports in specs], timeout_ms)
    return status, list(per)


def link(remote_id: int, ports: Sequence[int], timeout_ms: int = 5000) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
    return link_clusters([(remote_id, ports)], timeout_ms)


def link_clusters_as_given(clusters: Any, timeout_ms: int) -> Any:
    """``link_clusters`` with ``clusters`` exactly as given (argument type checks)."""
    return _dd().link_clusters(clusters, timeout_ms)


def unlink(remote_id: int, ports: Sequence[int], timeout_ms: int = 5000) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
    status, per = _dd().unlink_clusters([_cluster(remote_id, ports)], timeout_ms)
    return status, list(per)


def links() -> list[dict[str, Any]]:
    return list(_dd().links())


def check_link_status(remote_id: Any) -> None:
    _dd().check_link_status(remote_id)


def switch_role(*args: Any) -> None:
    """``switch_role`` with the arguments as given."""
    _dd().switch_role(*args)


def kv_cache_manager() -> None:
    """Reads ``LLMDataDist.kv_cache_manager`` (what it raises is the point)."""
    _dd().kv_cache_manager  # noqa: B018


def cache_manager() -> None:
    """Reads ``LLMDataDist.cache_manager`` (what it raises is the point)."""
    _dd().cache_manager  # noqa: B018


def comm_link(name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
    return int(_dd().link(name, cluster_rank_info, rank_table))


def query_register_mem_status(comm_id: int) -> Any:
    return _dd().query_register_mem_status(comm_id)


def is_initialized() -> bool:
    return bool(_km().is_initialized())


def cache_count() -> int:
    """Caches the current engine (device 0) holds."""
    return _engine().engines[0].kv.count


def cache_counts() -> list[int]:
    """Caches each device's engine holds."""
    return [e.kv.count for e in _engine().engines]


def exception_class() -> tuple[str, bool]:
    """(the module of llm_datadist's LLMException, whether it is a RuntimeError)."""
    return LLMException.__module__, issubclass(LLMException, RuntimeError)


# ---------------------------------------------------------------------------- caches


def _keep(name: str, cache: Any, desc: CacheDesc) -> _Named:
    n = _Named(cache, desc, desc.shape[0] if desc.shape else 1, [list(a) for a in cache.per_device_tensor_addrs],
               _engine().engines)
    _S.caches[name] = n
    return n


def _device(n: _Named) -> bool:
    return n.memory is None and device_memory_is_remote()


def allocate(name: str, num: int, shape: Shape, dtype: DataType = DataType.DT_INT8, *, keys: Sequence[CacheKey] = (),
             seed: int | None = None, placement: Placement = Placement.DEVICE, **desc_kw: Any) -> int:
    """``allocate_cache`` of ``num`` tensors of ``shape`` (``desc_kw``: more CacheDesc fields),
    written with ``verify.pattern(.., seed)`` on every device when a seed is given; its cache id."""
    desc = CacheDesc(num, list(shape), dtype, placement, **desc_kw)
    n = _keep(name, _km().allocate_cache(desc, list(keys)), desc)
    if seed is not None:
        for dev in range(len(n.addrs)):
            write(name, seed, dev)
    return int(n.cache.cache_id)


def allocate_blocks(name: str, num: int, shape: Shape, dtype: DataType = DataType.DT_INT8, *,
                    key: BlocksCacheKey | None = None, seed: int | None = None) -> int:
    """``allocate_blocks_cache`` (``shape[0]`` blocks per tensor); like ``allocate``."""
    desc = CacheDesc(num, list(shape), dtype)
    n = _keep(name, _km().allocate_blocks_cache(desc, key), desc)
    if seed is not None:
        for dev in range(len(n.addrs)):
            write(name, seed, dev)
    return int(n.cache.cache_id)


def allocate_as_given(desc: Any, keys: Any = ()) -> None:
    """``allocate_cache`` with the arguments exactly as given (what it raises is the point)."""
    _km().allocate_cache(desc, keys)


def allocate_blocks_as_given(desc: Any, key: Any = None) -> None:
    _km().allocate_blocks_cache(desc, key)


def cache_id(name: str) -> int:
    return int(_named(name).cache.cache_id)


def device_addrs(name: str) -> list[list[int]]:
    """The handle's ``per_device_tensor_addrs`` as it reports them now."""
    return [list(a) for a in _named(name).cache.per_device_tensor_addrs]


def write(name: str, seed: int | None, dev: int = 0) -> None:
    """``verify.pattern(.., seed)`` (zeros for None) into every tensor of the cache on device ``dev``."""
    n = _named(name)
    fill_tensors(n.addrs[dev], n.desc.size, seed, _device(n))


def zero(name: str) -> None:
    """Zeros into every tensor, on every device."""
    for dev in range(len(_named(name).addrs)):
        write(name, None, dev)


def poke(name: str, tensor: int, offset: int, data: bytes, dev: int = 0) -> None:
    """``data`` into tensor ``tensor`` at byte ``offset`` (device ``dev``), around pdlink."""
    n = _named(name)
    direct_write(n.addrs[dev][tensor] + offset, np.frombuffer(data, dtype=np.uint8), _device(n))


def read(name: str, dev: int = 0) -> list[np.ndarray]:
    """A copy of every tensor (uint8) on device ``dev``, read around pdlink."""
    n = _named(name)
    return [direct_read(a, n.desc.size, _device(n)) for a in n.addrs[dev]]


def snapshot(name: str, dev: int = 0) -> Snapshot:
    """Every byte around cache ``name`` on device ``dev``: the whole device pool holding it, or, for
    a HOST handle, its tensors and their guards."""
    n = _named(name)
    if n.memory is not None:
        return n.memory[dev].snapshot(name)
    pools = [p for p in n.engines[dev].kv.pools() if p["placement"].name == Placement.DEVICE.name]
    assert len(pools) == 1, "no device pool"
    return pool_snapshot(f"{name} (device {dev})", pools[0]["base"], pools[0]["capacity"], n.addrs[dev],
                         n.desc.size, n.rows, _device(n))


def cpu_cache(name: str, num: int, shape: Shape, dtype: DataType = DataType.DT_INT8, *, devices: int = 1,
              seed: int | None = None, flat: bool = False) -> None:
    """``KvCache.create_cpu_cache`` over guarded host memory, one set of tensors per device (zeros, or
    ``verify.pattern(.., seed)``). ``flat``: the addresses of device 0 as one flat list, the
    single-device form."""
    desc = CacheDesc(num, list(shape), dtype, Placement.HOST)
    mems = [GuardedTensors(num, desc.size, shape[0], seed, False) for _ in range(devices)]
    addrs: Any = mems[0].addrs if flat else [m.addrs for m in mems]
    _S.caches[name] = _Named(KvCache.create_cpu_cache(desc, addrs), desc, shape[0], [m.addrs for m in mems], [],
                             mems)


def deallocate(name: str) -> None:
    _km().deallocate_cache(_named(name).cache)


def deallocate_as_given(cache: Any) -> None:
    _km().deallocate_cache(cache)


def deallocate_cpu_handle() -> None:
    """``deallocate_cache`` of a ``create_cpu_cache`` handle (over address 1: never touched)."""
    _km().deallocate_cache(KvCache.create_cpu_cache(CacheDesc(1, [2], DataType.DT_INT8, Placement.HOST), [1]))


def deallocate_forged(like: str) -> None:
    """``deallocate_cache`` of a new handle with the id, desc and addresses of cache ``like``."""
    c = _named(like).cache
    _km().deallocate_cache(KvCache(c.cache_id, c.cache_desc, c.per_device_tensor_addrs, _km()))


def deallocate_v2_handle() -> None:
    """``deallocate_cache`` of a CacheManager-mode ``Cache`` handle."""
    _km().deallocate_cache(Cache(1, CacheDesc(1, [1, 64], DataType.DT_INT8), [1]))


def drop(name: str) -> None:
    """Lets go of the handle (the test's ``del c``) and collects garbage."""
    _named(name).cache = None
    gc.collect()


def remove_cache_key(key: CacheKey) -> None:
    _km().remove_cache_key(key)


# ---------------------------------------------------------------------------- transfers and copies


def pull_cache(key: CacheKey | CacheKeyByIdAndIndex, name: str | None, *args: Any, **kwargs: Any) -> None:
    _km().pull_cache(key, _cache(name), *args, **kwargs)


def pull_blocks(key: Any, name: str | None, src_blocks: Any, dst_blocks: Any, **kwargs: Any) -> None:
    """``pull_blocks`` with the block lists as given (a tuple stays a tuple)."""
    _km().pull_blocks(key, _cache(name), src_blocks, dst_blocks, **kwargs)


def copy_cache(dst: str, src: str, *args: Any, **kwargs: Any) -> None:
    _km().copy_cache(_cache(dst), _cache(src), *args, **kwargs)


def copy_blocks(name: str, copy_block_info: Any) -> None:
    _km().copy_blocks(_cache(name), copy_block_info)


def swap_blocks(src: str | None, dst: str, src_to_dst: Any) -> None:
    _km().swap_blocks(_cache(src), _cache(dst), src_to_dst)


class _Ready(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


class _Gated(LayerSynchronizer):
    """Every layer waits (up to 10 s) for ``open_gate``."""

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return _S.gate.wait(10)


def transfer_cache_async(task: str, name: str, cluster_id: int, dst_addrs: list[int], gated: bool = False) -> None:
    """``transfer_cache_async`` of cache ``name`` into raw addresses of cluster ``cluster_id``
    (TransferConfig), every layer ready at once or (``gated``) only after ``open_gate``; the task
    is kept as ``task``."""
    sync = _Gated() if gated else _Ready()
    _S.tasks[task] = _km().transfer_cache_async(_cache(name), sync, [TransferConfig(cluster_id, dst_addrs)])


def transfer_with_cache_key_config(name: str, key: BlocksCacheKey) -> None:
    """``transfer_cache_async`` with a CacheManager-mode (keyed) config."""
    _km().transfer_cache_async(_cache(name), _Ready(), [TransferWithCacheKeyConfig(key, range(0, 1), range(0, 1))])


def transfer_without_configs(name: str) -> None:
    _km().transfer_cache_async(_cache(name), _Ready(), [])


def synchronize(task: str, timeout_ms: int) -> LLMStatusCode:
    return LLMStatusCode(_S.tasks[task].synchronize(timeout_ms))


def task_results(task: str) -> list[LLMStatusCode]:
    return list(_S.tasks[task].get_results())


def open_gate() -> None:
    _S.gate.set()


# ---------------------------------------------------------------------------- tensors


def cache_tensors(name: str, *args: Any) -> int:
    """``get_cache_tensors`` with the arguments as given; the tensors are kept (``view``); their count."""
    _S.tensors = list(_km().get_cache_tensors(_cache(name), *args))
    return len(_S.tensors)


def tensor_bytes(name: str, tensor_index: int) -> list[bytes]:
    """What ``numpy()`` of each device's tensor ``tensor_index`` holds."""
    return [t.numpy().tobytes() for t in _km().get_cache_tensors(_cache(name), tensor_index)]


def tensor_values(name: str) -> list[Any]:
    """``get_cache_tensors(cache)`` (tensor 0 by default): device 0's values."""
    return list(_km().get_cache_tensors(_cache(name))[0].numpy().tolist())


def view() -> tuple[bool, bool, tuple[int, ...], str, list[int]]:
    """Takes ``numpy()`` of the first kept tensor as the view: (the tensor is a llm_datadist
    Tensor, the manager a KvCacheManager, the view's shape, its dtype, the tensor desc's shape)."""
    from llm_datadist import KvCacheManager, Tensor

    t = _S.tensors[0]
    _S.view = t.numpy()
    return (type(t) is Tensor, type(_km()) is KvCacheManager, tuple(_S.view.shape), str(_S.view.dtype),
            list(t.tensor_desc.shape))


def view_set(i: int, j: int, value: float) -> None:
    _S.view[i, j] = value


def view_get(i: int, j: int) -> float:
    return float(_S.view[i, j])


def kept_tensor_numpy() -> None:
    """``numpy()`` of the first kept tensor again (what it raises is the point)."""
    _S.tensors[0].numpy()


def copy_of_kept_tensor_set(i: int, j: int, value: float) -> None:
    """``numpy(copy=True)`` of the first kept tensor, and a write into that copy."""
    copy = _S.tensors[0].numpy(copy=True)
    copy[i, j] = value


def hold_tensor_of_unreferenced_cache(num: int, shape: Shape, dtype: DataType) -> None:
    """A tensor of a cache whose handle nobody keeps."""
    _S.held = _km().get_cache_tensors(_km().allocate_cache(CacheDesc(num, list(shape), dtype)))[0]
    gc.collect()


def write_held_tensor_and_drop(value: int) -> None:
    _S.held.numpy()[:] = value
    _S.held = None
    gc.collect()


def user_tensor() -> tuple[int, DataType, list[list[int]], str]:
    """A Tensor over a numpy array, written through: (the array's first value after ``9`` was
    written through the tensor, the tensor's dtype, a Tensor copied from it, str of a TensorDesc)."""
    from llm_datadist import Tensor, TensorDesc

    arr = np.arange(6, dtype=np.int32).reshape(2, 3)
    ut = Tensor(arr)
    ut.numpy()[0, 0] = 9
    return (int(arr[0, 0]), ut.tensor_desc.dtype, Tensor(ut).numpy().tolist(),
            str(TensorDesc(DataType.DT_FLOAT, (1, 2))))


def _tensor_cases() -> dict[str, Callable[[], object]]:
    from llm_datadist import Tensor, TensorDesc

    arr = np.arange(6, dtype=np.int32).reshape(2, 3)
    ut = Tensor(arr)
    return {
        "transposed array": lambda: Tensor(arr.T),
        "desc of another shape": lambda: Tensor(arr, TensorDesc(DataType.DT_INT32, [3, 2])),
        "desc of another dtype": lambda: Tensor(arr, TensorDesc(DataType.DT_FLOAT, [2, 3])),
        "a list": lambda: Tensor([1, 2]),
        "a str desc": lambda: Tensor(arr, "desc"),
        "a str dtype": lambda: TensorDesc("float", [1]),
        "a str dim": lambda: TensorDesc(DataType.DT_FLOAT, ["1"]),
        "numpy(1)": lambda: ut.numpy(1),
    }


TENSOR_CASES = ("transposed array", "desc of another shape", "desc of another dtype", "a list", "a str desc",
                "a str dtype", "a str dim", "numpy(1)")


def bad_tensor(case: str) -> None:
    """One of ``TENSOR_CASES``: a Tensor or TensorDesc made wrongly (what it raises is the point)."""
    _tensor_cases()[case]()


# ---------------------------------------------------------------------------- handle lifetime


def catch_unraisable() -> None:
    """Collects what would be printed as 'Exception ignored' (a failing ``__del__``)."""
    sys.unraisablehook = lambda info: _S.unraisable.append(repr(info.exc_value))


def unraisable() -> list[str]:
    return list(_S.unraisable)


def deallocate_then_drop(num: int, shape: Shape) -> None:
    """A handle deallocated explicitly, then let go of."""
    c = _km().allocate_cache(CacheDesc(num, list(shape), DataType.DT_INT8))
    _km().deallocate_cache(c)
    del c
    gc.collect()


def drop_cycle(num: int, shape: Shape) -> None:
    """A handle that refers to itself, let go of."""
    cyc = _km().allocate_cache(CacheDesc(num, list(shape), DataType.DT_INT8))
    cyc.me = cyc
    del cyc
    gc.collect()


def finalize_with_live_handles(count: int, shape: Shape) -> bool:
    """``count`` live handles across ``finalize``, let go of afterwards; whether the old manager
    still says it is initialised."""
    km = _km()
    _S.keep = [km.allocate_cache(CacheDesc(1, list(shape), DataType.DT_INT8)) for _ in range(count)]
    finalize()
    initialized = bool(km.is_initialized())
    _S.keep = []
    gc.collect()
    return initialized


def rss_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


# ---------------------------------------------------------------------------- a bare multi-device manager


def bare_start(pools: Sequence[int], cluster_id: int = 9, backend: str = "cpu") -> None:
    """A KvCacheManager over one native engine per entry of ``pools`` (that many device-pool
    bytes each), without an LLMDataDist, made the current engine."""
    from llm_datadist import CacheManager, KvCacheManager

    engines = [pdlink.Engine(pdlink.EngineOptions(
        cluster_id=cluster_id, role=LLMRole.PROMPT, backend=backend, device_pool=pdlink.MemoryPool(pool, 12),
        limits=pdlink.Limits(handshake_timeout_ms=1000))) for pool in pools]
    km = KvCacheManager(None, [CacheManager(None, e, False, {Placement.DEVICE: True}) for e in engines],
                        LLMRole.PROMPT)
    _S.engines["bare"] = _Engine(None, km, engines)
    _S.current = "bare"


def device_cache_ids(name: str) -> list[int]:
    """The ids of the per-device caches behind a KvCache."""
    c = _named(name).cache
    return internals.device_cache_ids(_km(), c)


def bare_close() -> None:
    internals.invalidate(_km())
    for e in _engine().engines:
        e.close()


# ---------------------------------------------------------------------------- interpreter exit


def _exit_single() -> None:
    start("prompt", 1, listen=1)
    km = _km()
    _S.keep = [km.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_INT8), [CacheKey(1, i)]) for i in range(3)]
    _S.keep.append(km.allocate_blocks_cache(CacheDesc(1, [2, 64], DataType.DT_INT8)))
    cyc = km.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_INT8))
    cyc.me = cyc


def _exit_two_devices() -> None:
    bare_start([1 << 20, 1 << 20])
    km = _km()
    _S.keep = [km.allocate_cache(CacheDesc(1, [64], DataType.DT_INT8), [CacheKey(9, 5)])]
    cyc = km.allocate_cache(CacheDesc(1, [64], DataType.DT_INT8))
    cyc.me = cyc


EXITS = {"exit-single": _exit_single, "exit-two-devices": _exit_two_devices}


if __name__ == "__main__":
    # live handles (kept, keyed, in a reference cycle) and an initialised engine at interpreter exit
    EXITS[sys.argv[1]]()
