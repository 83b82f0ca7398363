"""Peer-side functions for tests/compat/llm_datadist/test_api_errors.py: public API calls made with whatever arguments
the test passes (wrong types and out-of-range values included), so that the error a call raises
comes from pdlink in the peer, exactly as a program calling it there would see it.

``manager("pull_blocks", key, Named("blk"), [0], [1])`` is ``cache_manager.pull_blocks(key,
<cache blk>, [0], [1])`` on this peer's ``peers.kv`` engine: a ``Named`` argument stands for one of
its caches by name (a ``Cache`` does not travel between processes); every other argument is passed
as it arrives. ``datadist(label, method, ...)`` calls an ``LLMDataDist`` method the same way, on the
kv engine (label ``"kv"``) or on an engine of this module (``create``), for the tests of init,
finalize and more than one instance per process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from llm_datadist import CacheDesc, DataType, LLMClusterInfo, LLMDataDist
from peers import kv
from peers.memory import GuardedTensors, device_memory_is_remote
from verify import Snapshot


@dataclasses.dataclass(frozen=True)
class Named:
    """In the arguments of ``manager``: this peer's kv cache ``name`` (``kv.cache(name)``)."""

    name: str


def _resolve(value: Any) -> Any:
    return kv.cache(value.name) if isinstance(value, Named) else value


def manager(method: str, *args: Any, **kwargs: Any) -> None:
    """``cache_manager.<method>(*args, **kwargs)`` on the kv engine, ``Named`` arguments replaced by
    the caches they name. Returns nothing: a test calls it for the error it raises (the bytes of a
    call that succeeds are checked with ``kv.snapshot``)."""
    cm = kv.engine().cache_manager
    getattr(cm, method)(*[_resolve(a) for a in args], **{k: _resolve(v) for k, v in kwargs.items()})


def snapshots(names: Sequence[str]) -> dict[str, Snapshot]:
    """``kv.snapshot`` of each of these caches."""
    return {name: kv.snapshot(name) for name in names}


def set_remote_cluster_id(value: Any) -> None:
    """``LLMClusterInfo().remote_cluster_id = value`` (the setter checks type and range)."""
    LLMClusterInfo().remote_cluster_id = value


_BUFFERS: dict[str, GuardedTensors] = {}


def buffer(name: str, count: int, tensor_bytes: int, rows: int) -> list[int]:
    """Guarded memory that is not registered (zeros; device memory on a device backend), kept by
    name; returns its tensor addresses, for register calls the test makes with ``manager``."""
    _BUFFERS[name] = GuardedTensors(count, tensor_bytes, rows, None, device_memory_is_remote())
    return _BUFFERS[name].addrs


# ---------------------------------------------------------------------------- engines by label

_ENGINES: dict[str, LLMDataDist] = {}
_KEPT: dict[str, Any] = {}  # cache managers kept across a finalize, by engine label


def _engine(label: str) -> LLMDataDist:
    return kv.engine() if label == "kv" else _ENGINES[label]


def create(label: str, role: str, cluster_id: int) -> None:
    """A new ``LLMDataDist`` (not initialised), known by ``label``."""
    _ENGINES[label] = LLMDataDist(kv.ROLES[role], cluster_id)


def datadist(label: str, method: str, *args: Any, **kwargs: Any) -> Any:
    """``<engine label>.<method>(*args, **kwargs)``; a (status, per-cluster) result comes back with
    its per-cluster codes as a list."""
    result = getattr(_engine(label), method)(*args, **kwargs)
    if isinstance(result, tuple) and len(result) == 2:
        return result[0], list(result[1])
    return result


def attribute(label: str, name: str) -> Any:
    """The engine's attribute ``name`` (reading it may raise); a value that is not a plain int or
    str comes back as its type's name."""
    value = getattr(_engine(label), name)
    return value if isinstance(value, (int, str)) else type(value).__name__


def instance() -> str | None:
    """Which engine ``LLMDataDist.llm_engine_instance`` is: its label, ``"other"``, or None."""
    current = LLMDataDist.llm_engine_instance
    if current is None:
        return None
    return next((label for label, dd in _ENGINES.items() if dd is current), "other")


def keep_manager(label: str) -> None:
    """Remembers the engine's current cache manager (``manager_is_kept``, ``allocate_in_kept``)."""
    _KEPT[label] = _engine(label).cache_manager


def manager_is_kept(label: str) -> bool:
    """The engine's cache manager is still the one ``keep_manager`` remembered."""
    return _engine(label).cache_manager is _KEPT[label]


def _small() -> CacheDesc:
    return CacheDesc(1, [1, 16], DataType.DT_INT8)


def allocate_in_kept(label: str) -> int:
    """``allocate_cache`` of one small cache on the remembered manager; its cache id."""
    return int(_KEPT[label].allocate_cache(_small()).cache_id)


def allocate_in(label: str) -> int:
    """``allocate_cache`` of one small cache on the engine's current manager; its cache id."""
    return int(_engine(label).cache_manager.allocate_cache(_small()).cache_id)
