"""Peer-side functions for tests of pdlink's own engine API (``pdlink.Engine``): one engine per
peer process, its regions by name, in guarded memory (tests/peers/memory.py)::

    port = target.call(native.start, 1, listen=True)
    target.call(native.register, "src", rows=8, row_bytes=256, seed=1, key=7)
    initiator.call(native.start, 2)
    initiator.call(native.register, "dst", rows=8, row_bytes=256, seed=None)
    initiator.call(native.connect, port)
    initiator.call(native.prepared, "dst", target.call(native.remote, "src"), [0, 1], [5, 4], "read")
    snapshot = initiator.call(native.snapshot, "dst")      # tests/verify.py

The engine takes its backend, transport and one-sided setting from the peer's environment (the
matrix cell's, backend_env.Variant.env), as EngineOptions does when they are left at None. On a
device backend, regions are DEVICE memory.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

import pdlink
from pdlink import kv
from peers import addr
from peers.memory import GuardedTensors, device_memory_is_remote, direct_read, direct_write
from poll import wait_until
from verify import Snapshot, pattern


@dataclasses.dataclass
class _Named:
    memory: GuardedTensors
    region: pdlink.Region


_state: dict[str, Any] = {"engine": None, "regions": {}, "prepared": {}, "pending": {}, "caches": {}, "owned": {},
                          "litter": []}


def _engine() -> pdlink.Engine:
    engine = _state["engine"]
    assert engine is not None, "call native.start first"
    return engine


def start(cluster_id: int, listen: bool = False, timeout_ms: int = 3000, limits: dict[str, int] | None = None,
          secret: str | None = None, payload_integrity: bool = False, pool_bytes: int = 0, role: str = "MIX") -> int:
    """Starts this peer's engine (``limits``: ``pdlink.Limits`` fields; ``secret``,
    ``payload_integrity`` and ``role`` as ``EngineOptions``'; ``pool_bytes``: a host and a device
    pool of that size); returns its listen port (0 when not listening)."""
    pool = pdlink.MemoryPool(pool_bytes) if pool_bytes else None
    options = pdlink.EngineOptions(cluster_id=cluster_id, listen=addr.listen() if listen else None,
                                   timeout_ms=timeout_ms, limits=pdlink.Limits(**(limits or {})), secret=secret,
                                   payload_integrity=payload_integrity, host_pool=pool, device_pool=pool, role=role)
    _state["engine"] = pdlink.Engine(options)
    return _state["engine"].listen_port


def register(name: str, rows: int, row_bytes: int, seed: int | None, key: int | None = None,
             tensors: int = 1, host: bool = False, geometry: kv.KvGeometry | None = None) -> int:
    """A region of ``tensors`` tensors of ``rows`` blocks of ``row_bytes`` in guarded memory
    (filled with ``verify.pattern(.., seed)``, zeros for None), in DEVICE memory on a device
    backend unless ``host``, with the KV ``geometry`` if given; returns its (first tensor's)
    address."""
    device = device_memory_is_remote() and not host
    memory = GuardedTensors(tensors, rows * row_bytes, rows, seed, device)
    region = _engine().register(address=memory.addrs[0] if tensors == 1 else list(memory.addrs),
                                length=rows * row_bytes, placement="DEVICE" if device else "HOST",
                                block_size=row_bytes, key=key, geometry=geometry)
    _state["regions"][name] = _Named(memory, region)
    return region.address


def register_owned(name: str, rows: int, row_bytes: int, seed: int, key: int) -> int:
    """A region registered from a numpy array of ``verify.pattern(.., seed)`` bytes that nothing but
    the engine references once this returns (a weak reference tells when it is freed); returns its
    address."""
    array = pattern(rows * row_bytes, 0, seed).reshape(rows, row_bytes)
    region = _engine().register(array, block_size=row_bytes, key=key)
    _state["owned"][name] = (region, weakref.ref(array))
    del array
    gc.collect()
    return region.address


def owned_released(name: str) -> bool:
    """Whether region ``name``'s array was freed (after a collection)."""
    gc.collect()
    return _state["owned"][name][1]() is None


def deregister_owned(name: str) -> None:
    _engine().deregister(_state["owned"][name][0])


def remote_owned(name: str) -> pdlink.RemoteRegion:
    return _state["owned"][name][0].remote()


def litter(count: int, nbytes: int, fill: int) -> None:
    """Allocates ``count`` arrays of ``nbytes`` filled with ``fill`` and keeps them: what would take
    the place of freed memory of that size."""
    _state["litter"].extend(np.full(nbytes, fill, np.uint8) for _ in range(count))


def withdraw_and_reuse(name: str, fill: int) -> None:
    """Deregisters region ``name`` and at once writes ``fill`` over its memory, as an allocator
    reusing it would."""
    named = _state["regions"][name]
    _engine().deregister(named.region)
    direct_write(named.region.address, np.full(named.region.length, fill, np.uint8), False)


def withdraw_and_reuse_after(name: str, fill: int, delay_ms: float) -> None:
    """``withdraw_and_reuse`` in a thread of its own, ``delay_ms`` from now (a race's offset);
    ``withdrawn`` waits for it."""
    def run() -> None:
        time.sleep(delay_ms / 1000)
        withdraw_and_reuse(name, fill)

    thread = threading.Thread(target=run)
    thread.start()
    _state["withdrawer"] = thread


def withdrawn() -> None:
    _state["withdrawer"].join(60)


def withdrawing() -> bool:
    """Whether the thread of ``withdraw_and_reuse_after`` or ``deregister_owned_in_background`` is
    still in its deregistration."""
    return bool(_state["withdrawer"].is_alive())


def deregister_owned_in_background(name: str) -> None:
    """``deregister_owned`` in a thread of its own (``withdrawing``, ``withdrawn``)."""
    thread = threading.Thread(target=deregister_owned, args=(name,))
    thread.start()
    _state["withdrawer"] = thread


def regions() -> int:
    """How many regions this engine has registered (a deregistration under way counts none)."""
    return len(_engine().local_memory().ranges)


def reregister(name: str, fill: int) -> int:
    """Region ``name``'s memory filled with ``fill`` and registered again (same layout)."""
    named = _state["regions"][name]
    old = named.region
    direct_write(old.address, np.full(old.length, fill, np.uint8), False)
    named.region = _engine().register(address=old.address, length=old.length, block_size=old.block_size)
    return named.region.address


def start_read(peer: int, name: str, remote_address: int) -> None:
    """A read of the whole of region ``name`` from ``remote_address`` on ``peer``, by address, in a
    thread of its own; ``finish_read`` waits for it."""
    region = _state["regions"][name].region

    def run() -> None:
        try:
            _engine().read(peer, [(region.address, region.length)], [(remote_address, region.length)])
            _state["read"] = None
        except pdlink.LLMException as e:
            _state["read"] = e

    thread = threading.Thread(target=run)
    thread.start()
    _state["reader"] = thread


def finish_read(name: str, fill: int) -> tuple[bool, int]:
    """Whether the ``start_read`` read succeeded, and how many bytes of region ``name`` hold ``fill``."""
    _state["reader"].join(60)
    region = _state["regions"][name].region
    return _state["read"] is None, int(np.count_nonzero(direct_read(region.address, region.length, False) == fill))


def kv_register(name: str, rows: int, row_bytes: int, seed: int | None, model: int | None = None) -> int:
    """A cache of one tensor of ``rows`` blocks of ``row_bytes`` in guarded memory registered
    through ``Engine.kv`` (a blocks cache published under ``model`` when given); its cache id."""
    device = device_memory_is_remote()
    memory = GuardedTensors(1, rows * row_bytes, rows, seed, device)
    layout = kv.CacheLayout(1, rows * row_bytes, rows, True, kv.placement("DEVICE" if device else "HOST"))
    cache_id, _ = _engine().kv.register(layout, memory.addrs, [], model, True)
    _state["caches"][name] = (memory, cache_id)
    return int(cache_id)


def kv_pull_blocks(peer: int, name: str, model: int, local: Sequence[int], remote_blocks: Sequence[int]) -> None:
    """Blocks ``remote_blocks`` of the peer's blocks cache ``model`` into blocks ``local`` of
    cache ``name``, by ``Engine.kv.pull``."""
    spec = kv.TransferSpec(peer_cluster_id=peer, target=kv.Target(kind=kv.TargetKind.BLOCKS, model_id=model),
                           local_cache_id=_state["caches"][name][1], mode=kv.TransferMode.BLOCKS_TO_BLOCKS,
                           local_blocks=list(local), remote_blocks=list(remote_blocks))
    _engine().kv.pull(spec)


def kv_post_prepared(peer: int, name: str, model: int, local: Sequence[int], remote_blocks: Sequence[int],
                     push: bool) -> tuple[str, int, int]:
    """Blocks between cache ``name`` and the peer's blocks cache ``model`` by ``Engine.kv.prepare``
    and one post (``push``: local -> remote); the prepared object's type name, its block size and
    the remote side's block count."""
    spec = kv.TransferSpec(peer_cluster_id=peer, target=kv.Target(kind=kv.TargetKind.BLOCKS, model_id=model),
                           local_cache_id=_state["caches"][name][1])
    prepared = _engine().kv.prepare(spec)
    prepared.post(list(local), list(remote_blocks), push)
    return type(prepared).__qualname__, prepared.block_size, prepared.remote_blocks


def kv_snapshot(name: str) -> Snapshot:
    return _state["caches"][name][0].snapshot(name)


def kv_allocate(placement: str, rows: int, row_bytes: int, model: int | None = None) -> tuple[int, int]:
    """A blocks cache from the engine's pool of ``placement``: (cache id, the pool's bytes in use)."""
    layout = kv.CacheLayout(1, rows * row_bytes, rows, True, kv.placement(placement))
    cache_id, _ = _engine().kv.allocate(layout, [], model)
    return int(cache_id), _pool_used(placement)


def kv_deallocate(cache_id: int, placement: str) -> int:
    """Returns an allocated blocks cache; the pool's bytes in use after."""
    _engine().kv.deallocate(cache_id, True)
    return _pool_used(placement)


def _pool_used(placement: str) -> int:
    (pool,) = [p for p in _engine().kv.pools() if p["placement"].name == placement]
    return int(pool["used"])


def connect_each(peers: Sequence[tuple[int | None, str]]) -> list[tuple[int, str, int]]:
    return [(int(r.status), r.message, r.peer_cluster_id) for r in _engine().connect_each(peers, timeout_ms=3000)]


def disconnect_each(peers: Sequence[int]) -> list[int]:
    return [int(r.status) for r in _engine().disconnect_each(peers, timeout_ms=3000)]


def linked_since(mark: int) -> tuple[int, list[int]]:
    return _engine().linked_since(mark)


def listen_port() -> int:
    return _engine().listen_port


def add_listener(address: str) -> int:
    return _engine().add_listener(address)


def addresses(name: str) -> list[int]:
    """Region ``name``'s tensors' addresses."""
    return list(_state["regions"][name].region.addresses)


def deregister(name: str) -> None:
    _engine().deregister(_state["regions"][name].region)


def remote(name: str) -> pdlink.RemoteRegion:
    """What a peer needs to address region ``name`` (it pickles)."""
    return _state["regions"][name].region.remote()


def snapshot(name: str) -> Snapshot:
    return _state["regions"][name].memory.snapshot(name)


def connect(port: int, cluster_id: int | None = None, host: str | None = None) -> int:
    return _engine().connect(f"{addr.of(port) if host is None else host}:{port}", cluster_id=cluster_id)


def disconnect(peer: int) -> None:
    _engine().disconnect(peer)


def links() -> list[pdlink.LinkInfo]:
    return _engine().links()


def descriptors(peer: int, name: str, local: Sequence[tuple[int, ...]], remote: Sequence[tuple[int, ...]],
                op: str, tensor: int = 0) -> None:
    """``Engine.read`` / ``write`` of descriptor lists: ``local`` as (offset in tensor ``tensor``
    of region ``name``, length), ``remote`` as (absolute address, length); or either as strided
    rows, (offset or address, length, stride, count)."""
    base = _state["regions"][name].region.addresses[tensor]
    local_descs = [(base + d[0], *d[1:]) for d in local]
    getattr(_engine(), op)(peer, local_descs, list(remote))


def batch(peer: int, local: Sequence[tuple[str, int, int]], remote: Sequence[int], op: str) -> None:
    """``Engine.read_batch`` / ``write_batch``: ``local`` as (region, offset in its tensor 0, length),
    ``remote`` the absolute addresses, as three parallel lists."""
    addrs = [_state["regions"][name].region.addresses[0] + offset for name, offset, _ in local]
    getattr(_engine(), f"{op}_batch")(peer, addrs, list(remote), [n for _, _, n in local])


def batch_handle(peer: int, local: Sequence[tuple[str, int, int]], remote: Sequence[int], op: str,
                 timeout_ms: int = 0) -> None:
    """As ``batch``, through the peer's ``Engine.batch`` handle (kept per peer, as hixl keeps one
    per link)."""
    handles = _state.setdefault("batches", {})
    handle = handles.get(peer) or handles.setdefault(peer, _engine().batch(peer))
    addrs = [_state["regions"][name].region.addresses[0] + offset for name, offset, _ in local]
    getattr(handle, op)(addrs, list(remote), [n for _, _, n in local], timeout_ms)


def remote_memory(peer: int) -> pdlink.MemoryMap:
    return _engine().remote_memory(peer)


def local_memory() -> pdlink.MemoryMap:
    return _engine().local_memory()


def prepare(tag: str, peer: int, name: str, remote_region: pdlink.RemoteRegion, **mapping: Any) -> None:
    """Prepares a transfer between region ``name`` and the peer's region, kept under ``tag``;
    ``mapping``: ``Engine.prepare``'s ``local_view``, ``remote_view``, ``block_ratio``."""
    _state["prepared"][tag] = _engine().prepare(peer, _state["regions"][name].region, remote_region, **mapping)


def post(tag: str, local: Sequence[int], remote_blocks: Sequence[int], op: str) -> None:
    """Posts prepared transfer ``tag`` (``op``: "read" or "write") with numpy index arrays."""
    getattr(_state["prepared"][tag], op)(np.array(local, np.int64), np.array(remote_blocks, np.int64))


def post_async(tag: str, local: Sequence[int], remote_blocks: Sequence[int], op: str) -> None:
    _state["pending"][tag] = getattr(_state["prepared"][tag], op + "_async")(local, remote_blocks)


def wait(tag: str) -> tuple[str, str | None, int | None]:
    """Waits for async call ``tag``: its status, and its error's class name and code (if any)."""
    pending = _state["pending"].pop(tag)
    try:
        pending.wait(30)
    except pdlink.LLMException:
        pass
    error = pending.error()
    return pending.status(), type(error).__name__ if error else None, getattr(error, "status_code", None)


def notify(peer: int, message: bytes | str, name: bytes | str = b"") -> None:
    _engine().notify(peer, message, name=name)


def notifications() -> list[pdlink.Notification]:
    return _engine().notifications()


def stats() -> dict[str, Any]:
    return _engine().stats().as_dict()


def watch(name: str) -> None:
    """Starts a thread that takes notifications until one arrives and, at once, snapshots region
    ``name``: what was in place when the notification became visible (``watched``)."""
    def run() -> None:
        got = wait_until(_engine().notifications, 30, "a notification")
        _state["watched"] = (got, snapshot(name))

    _state["watched"] = None
    _state["watcher"] = threading.Thread(target=run, daemon=True)
    _state["watcher"].start()


def watched() -> tuple[list[pdlink.Notification], Snapshot]:
    _state["watcher"].join(40)
    assert _state["watched"] is not None, "the watcher saw no notification"
    return _state["watched"]


def role_state() -> dict[str, Any]:
    """``Engine.role_state()`` as a dict."""
    return _engine().role_state().as_dict()


def switch_role(role: str, keep_listener: bool = True, expected_epoch: int | None = None,
                drain_timeout_ms: int | None = None) -> dict[str, Any]:
    """``Engine.switch_role`` (listening on the same port when ``keep_listener`` and this engine
    listens, else stopping); returns the role state after it."""
    engine = _engine()
    listen = addr.listen(engine.listen_port) if keep_listener and engine.listen_port else None
    engine.switch_role(role, listen, expected_epoch=expected_epoch, drain_timeout_ms=drain_timeout_ms)
    return role_state()


def switch_role_async(role: str, **kwargs: Any) -> None:
    """``switch_role`` on a thread of its own; ``switch_result`` waits for it."""
    def run() -> None:
        try:
            _state["switch"] = ("ok", None, "", switch_role(role, **kwargs))
        except pdlink.LLMException as e:
            _state["switch"] = (type(e).__name__, int(e.status_code), str(e), role_state())

    _state["switch"] = None
    _state["switcher"] = threading.Thread(target=run, daemon=True)
    _state["switcher"].start()


def switch_result(timeout: float = 60) -> tuple[str, int | None, str, dict[str, Any]]:
    """What the switch of ``switch_role_async`` ended with: "ok" or the error's class name, its
    code, its message, and the role state after it."""
    _state["switcher"].join(timeout)
    assert _state["switch"] is not None, "the switch did not end"
    return _state["switch"]


def close() -> None:
    _engine().close()
