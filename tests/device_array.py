"""Test data in backend memory: a numpy-like array whose bytes live in ``pdlink.device.DeviceMemory``.

On the Ascend backend DEVICE caches must be NPU memory, which the host cannot touch (the fake
libraries map it ``PROT_NONE``, as hardware does). The end-to-end tests were written against numpy
arrays; ``DeviceArray`` lets the same test bodies run there: ``addr`` (and ``ctypes.data``) is the
device address to register, and every read or write goes through the backend's copies
(``aclrtMemcpy``), never through a host pointer.

Reads (``a[i]``, ``a.tobytes()``, ``a.copy()``, ``a.any()``, ``np.asarray(a)`` ...) return host
copies (plain numpy). Assignments (``a[i] = x``, ``a[:] = 0``) read the array, change the host copy
and write it back. Pickling (a peer's ``eval`` result) sends a host copy, so the test process gets
plain numpy arrays. The memory is freed when the array is garbage-collected, like numpy's.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from internals import DeviceMemory


class DeviceArray:
    """``shape``/``dtype`` bytes in backend DEVICE memory (host memory on the CPU backend)."""

    __slots__ = ("_mem", "shape", "dtype", "__weakref__")

    def __init__(self, shape: tuple[int, ...], dtype: Any = np.float16, device_id: int = 0):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self._mem: DeviceMemory = DeviceMemory(max(nbytes, 1), device_id=device_id)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_host(cls, host: np.ndarray, device_id: int = 0) -> DeviceArray:
        host = np.ascontiguousarray(host)
        a = cls(host.shape, host.dtype, device_id)
        a._write_all(host)
        return a

    @classmethod
    def zeros(cls, shape: tuple[int, ...], dtype: Any = np.float16, device_id: int = 0) -> DeviceArray:
        # device memory is not zeroed by the allocator (aclrtMalloc): write the zeros
        return cls.from_host(np.zeros(shape, dtype=dtype), device_id)

    # ------------------------------------------------------------------ memory

    @property
    def addr(self) -> int:
        """The device address (what ``register_cache`` takes)."""
        return self._mem.addr

    @property
    def ctypes(self) -> types.SimpleNamespace:
        # numpy spelling of the address (``a.ctypes.data``), for code written against numpy
        return types.SimpleNamespace(data=self._mem.addr)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numpy(self) -> np.ndarray:
        """A host copy (device -> host)."""
        if self.nbytes == 0:
            return np.zeros(self.shape, dtype=self.dtype)
        return self._mem.read(self.nbytes).view(self.dtype).reshape(self.shape)

    def _write_all(self, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host, dtype=self.dtype).reshape(self.shape)
        if host.nbytes:
            self._mem.write(host)

    def free(self) -> None:
        mem = getattr(self, "_mem", None)
        if mem is not None:
            mem.free()

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ------------------------------------------------------------------ numpy-like surface

    def __array__(self, dtype=None, copy=None):
        h = self.numpy()
        return h if dtype is None else h.astype(dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def __iter__(self):
        return iter(self.numpy())

    def __getitem__(self, idx):
        return self.numpy()[idx]  # a host copy

    def __setitem__(self, idx, value) -> None:
        h = self.numpy().copy()
        h[idx] = value
        self._write_all(h)

    def tobytes(self) -> bytes:
        return self.numpy().tobytes()

    def copy(self) -> np.ndarray:
        return self.numpy().copy()

    def __getattr__(self, name: str):
        # any other read-only ndarray method or attribute (any, sum, tolist, view, reshape, T ...)
        # works on a host copy
        if name.startswith("_") or name in ("shape", "dtype"):
            raise AttributeError(name)  # not set (a failed __init__): no recursion through numpy()
        return getattr(self.numpy(), name)

    def __eq__(self, other):
        return self.numpy() == np.asarray(other)

    def __ne__(self, other):
        return self.numpy() != np.asarray(other)

    __hash__ = None  # type: ignore[assignment]  # unhashable, like ndarray (== is elementwise)

    def __reduce__(self):
        # a peer's eval result arrives in the test process as a plain numpy array
        return self.numpy().__reduce__()

    def __repr__(self) -> str:
        where = f"{self._mem.addr:#x} ({self._mem.backend})" if self._mem is not None else "freed"
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, at {where})"
