"""Peer-side ``transfer_cache_async`` (tests/compat/llm_datadist/test_transfer_async.py): a recording layer
synchronizer, the task of the last call, and memory the engine never registered.

Runs on the engine and caches of ``peers.kv``. Arguments name the peer's objects: a ``str`` source
is the name of a ``peers.kv`` cache and the synchronizer ``SYNC`` is this module's current
recording synchronizer (``new_sync``); any other value goes to ``transfer_cache_async`` as it is,
so a test can hand it a wrong type.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import internals
from llm_datadist import LayerSynchronizer, LLMStatusCode
from peers import kv
from peers.memory import GuardedTensors, device_memory_is_remote
from verify import Snapshot

SYNC = "sync"  # stands for the current recording synchronizer

GATE_WAIT_S = 20.0  # how long a gated synchronizer waits for ``open_gate`` before answering False

Calls = list[tuple[int, int | None]]


class Recorder(LayerSynchronizer):
    """Records each ``synchronize_layer`` call; waits for the gate (if any) first; answers False at
    layer ``fail_at``."""

    def __init__(self, fail_at: int | None = None, gate: threading.Event | None = None,
                 gate_from: int = 0) -> None:
        self.calls: Calls = []
        self.fail_at = fail_at
        self.gate = gate
        self.gate_from = gate_from  # the gate holds this layer and the later ones

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.calls.append((layer_index, timeout_in_millis))
        if self.gate is not None and layer_index >= self.gate_from and not self.gate.wait(GATE_WAIT_S):
            return False
        return layer_index != self.fail_at


@dataclasses.dataclass
class _State:
    sync: Recorder = dataclasses.field(default_factory=Recorder)
    task: Any = None  # the CacheTask of the last ``transfer``
    unregistered: dict[str, GuardedTensors] = dataclasses.field(default_factory=dict)
    manager: tuple[Any, Any] | None = None  # (engine, its cache manager) as first used


_S = _State()


def new_sync(fail_at: int | None = None, gated: bool = False, gate_from: int = 0) -> None:
    """A fresh recording synchronizer for the next transfers; ``gated``: every layer from
    ``gate_from`` on waits for ``open_gate``."""
    _S.sync = Recorder(fail_at, threading.Event() if gated else None, gate_from)


def sync_waiting(layer: int) -> bool:
    """Whether the synchronizer was called for ``layer`` (a gated one waits there)."""
    return any(i == layer for i, _ in _S.sync.calls)


def running_tasks() -> int:
    """How many transfer_cache_async jobs the cache manager holds (running ones)."""
    return internals.async_tasks(_manager())


def open_gate() -> None:
    assert _S.sync.gate is not None, "the synchronizer has no gate"
    _S.sync.gate.set()


def sync_calls() -> Calls:
    return list(_S.sync.calls)


def _manager() -> Any:
    """The engine's cache manager, taken once and kept, as a caller keeps it: after ``finalize``
    it is the manager of a finalized engine (``dd.cache_manager`` itself is refused then)."""
    dd = kv.engine()
    if _S.manager is None or _S.manager[0] is not dd:
        _S.manager = (dd, dd.cache_manager)
    return _S.manager[1]


def transfer(src: Any, sync: Any, configs: Any, *rest: Any) -> None:
    """``cache_manager.transfer_cache_async(src, sync, configs, *rest)``; keeps the task. Raises
    what the call raises (its argument checks)."""
    src_cache = kv.cache(src) if isinstance(src, str) else src
    synchronizer = _S.sync if sync == SYNC else sync
    _S.task = _manager().transfer_cache_async(src_cache, synchronizer, configs, *rest)


def synchronize(*timeout: Any) -> LLMStatusCode:
    """The last task's ``synchronize(*timeout)``."""
    assert _S.task is not None, "no transfer_cache_async ran in this peer"
    return LLMStatusCode(_S.task.synchronize(*timeout))


def get_results(*timeout: Any) -> list[LLMStatusCode | None]:
    """The last task's ``get_results(*timeout)``."""
    assert _S.task is not None, "no transfer_cache_async ran in this peer"
    return list(_S.task.get_results(*timeout))


def outcome() -> tuple[LLMStatusCode, list[LLMStatusCode | None], Calls]:
    """Waits for the last task: (``synchronize()``, ``get_results()``, the synchronizer's calls)."""
    return synchronize(), get_results(), sync_calls()


def run(src: str, configs: Any, *rest: Any,
        fail_at: int | None = None) -> tuple[LLMStatusCode, list[LLMStatusCode | None], Calls]:
    """``transfer`` with a fresh synchronizer (answering False at ``fail_at``), then ``outcome``."""
    new_sync(fail_at)
    transfer(src, SYNC, configs, *rest)
    return outcome()


def active_threads() -> int:
    return threading.active_count()


# ---------------------------------------------------------------------------- memory nobody registered


def unregistered(name: str, num: int, nbytes: int, rows: int, seed: int) -> list[int]:
    """``num`` guarded tensors of ``nbytes`` filled with ``verify.pattern(.., seed)``, never
    registered with the engine (device memory on a device backend); returns their addresses."""
    mem = GuardedTensors(num, nbytes, rows, seed, device_memory_is_remote())
    _S.unregistered[name] = mem
    return mem.addrs


def unregistered_snapshot(name: str) -> Snapshot:
    return _S.unregistered[name].snapshot(name)
