"""Backend memory from Python: which backend is in use, and device memory to fill and check.

pdlink's engine takes cache memory as addresses (``register_cache``/``register_blocks_cache``),
as llm_datadist does. On the CPU backend any host buffer (a numpy array) will do; on the Ascend
backend DEVICE caches must be NPU memory, which the host cannot read or write directly. Serving
code gets that memory from its framework (torch_npu). This module gives the same to code without
one (tests, benchmarks, the demo): allocations and copies through the backend pdlink uses::

    from pdlink.device import DeviceMemory, backend_info
    print(backend_info())                      # {'name': 'ascend', 'device_transport': True, ...}
    with DeviceMemory(1 << 20) as mem:         # aclrtMalloc on Ascend, host memory on CPU
        mem.write(np.arange(1 << 18, dtype=np.float32))
        cache = cm.register_blocks_cache(desc, [mem.addr], key)
        ...
        data = mem.read()                      # a numpy uint8 copy (aclrtMemcpy device -> host)

The backend is chosen as ``LLMDataDist.init`` chooses it: ``backend`` argument, else the
``PDLINK_BACKEND`` environment variable, else ``"auto"``.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from . import environment
from .native import core, placement_of

__all__ = ["DeviceMemory", "backend_info", "open_backend"]


def open_backend(backend: str | None = None, device_id: int = 0) -> Any:
    """The process-wide native backend (``pdlink._core.Backend``) of that name and device.

    Raises ``LLMException(LLM_FEATURE_NOT_ENABLED)`` naming the reason when it cannot be used
    (e.g. the Ascend libraries are missing or lack a required symbol).
    """
    return core().open_backend(backend or environment.backend(), device_id)


def backend_info(backend: str | None = None, device_id: int = 0) -> dict[str, Any]:
    """What the backend of that name would be here, without raising.

    Keys: ``name`` (the backend picked, or None when unusable), ``error`` (why not: the status
    code's name and the engine's message, ``"LLM_FEATURE_NOT_ENABLED: ..."``), ``device_id``,
    ``device_memory``, ``device_transport``, ``features`` (optional vendor features present:
    ``ipc``, ``one_sided``, ``sync_timeout``, ``error_text``) and ``ascend`` (what the Ascend
    loader found: ``loaded``, ``library_dir``, ``missing_optional`` or ``error``).
    """
    from .status import LLMException, code_2_status

    info: dict[str, Any] = {"name": None, "error": "", "device_id": device_id}
    try:
        b = open_backend(backend, device_id)
    except LLMException as e:
        info["error"] = f"{code_2_status(e.status_code).name}: {e}"
    else:
        info["name"] = b.name
        info.update(b.capabilities())
    info["ascend"] = core().ascend_info()
    return info


class DeviceMemory:
    """``nbytes`` of backend memory (DEVICE placement by default), freed by ``free()``, ``with`` or
    garbage collection.

    ``addr`` is what the cache APIs take. ``write``/``read`` copy between it and host memory
    through the backend (blocking copies).
    """

    def __init__(self, nbytes: int, device_id: int = 0, backend: str | None = None,
                 placement: str | enum.Enum = "DEVICE"):
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        self._backend = open_backend(backend, device_id)
        self._placement = placement_of(placement)
        self._host = placement_of("HOST")
        self.nbytes = nbytes
        self.addr: int = self._backend.allocate(self._placement, nbytes)

    @property
    def backend(self) -> str:
        return self._backend.name

    def write(self, data: bytes | bytearray | memoryview | np.ndarray, offset: int = 0) -> None:
        """Copies ``data`` (its raw bytes) to ``addr + offset``."""
        src = np.ascontiguousarray(np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray)
                                   else data).view(np.uint8).reshape(-1)
        self._check(offset, src.nbytes)
        self._backend.copy(self.addr + offset, self._placement, src.ctypes.data, self._host, src.nbytes)

    def read(self, nbytes: int | None = None, offset: int = 0) -> np.ndarray:
        """A host copy of ``nbytes`` (default: the rest) from ``addr + offset``, as uint8."""
        n = self.nbytes - offset if nbytes is None else nbytes
        self._check(offset, n)
        out = np.empty(n, dtype=np.uint8)
        self._backend.copy(out.ctypes.data, self._host, self.addr + offset, self._placement, n)
        return out

    def _check(self, offset: int, n: int) -> None:
        if self.addr == 0:
            raise ValueError("this DeviceMemory was freed")
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise ValueError(f"range [{offset}, +{n}) is outside the {self.nbytes}-byte allocation")

    def free(self) -> None:
        """Returns the memory to the backend; idempotent."""
        if self.addr:
            self._backend.release(self._placement, self.addr, self.nbytes)
            self.addr = 0

    def __del__(self) -> None:  # like a numpy array: dropped memory goes back to the backend
        try:
            self.free()
        except Exception:  # noqa: BLE001 - interpreter shutdown; the process releases it anyway
            pass

    def __enter__(self) -> DeviceMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        return f"DeviceMemory({self.nbytes} bytes at {self.addr:#x}, backend={self.backend!r})"
