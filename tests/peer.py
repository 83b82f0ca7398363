"""Real peer processes for cross-process tests.

A ``Peer`` is a separate Python process (multiprocessing "spawn", so nothing is inherited
but sys.path) holding its own namespace. Tests send it code to run and expressions to
evaluate; results and exceptions come back pickled (``LLMException`` keeps its
``status_code``). Every call is bounded by a timeout so that a hung peer fails the test
instead of hanging it.

The namespace starts with the ``llm_datadist`` names, numpy as ``np``, and the helpers
below (``tensors``, ``addrs``, ``options``). On a device backend (``PDLINK_BACKEND=ascend``)
``tensors``/``zeros`` return ``DeviceArray``s (tests/device_array.py) over device memory, and
``read_cache``/``write_cache`` copy through the backend; on the CPU backend they are numpy arrays.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import traceback
from typing import Any, Optional

_CTX = mp.get_context("spawn")

PRELUDE = """
import os
import numpy as np
from llm_datadist import *
from llm_datadist import LLMDataDist, LLMRole, LLMConfig, LLMClusterInfo, CacheDesc, CacheKey, \\
    CacheKeyByIdAndIndex, BlocksCacheKey, Cache, DataType, Placement, LLMException, LLMStatusCode

# On the Ascend backend DEVICE caches must be device memory, which the host cannot touch: test data
# then lives in DeviceArrays (tests/device_array.py), read and written through backend copies.
# PDLINK_TEST_DEVICE_ARRAYS=1 uses them on the CPU backend too (a check of the helpers themselves).
DEVICE_DATA = os.environ.get("PDLINK_BACKEND") == "ascend" or os.environ.get("PDLINK_TEST_DEVICE_ARRAYS") == "1"
if DEVICE_DATA:
    from device_array import DeviceArray

def _on_device(a, host):
    return DeviceArray.from_host(a) if DEVICE_DATA and not host else a

def tensors(n, shape, seed, dtype=np.float16, host=False):
    # n tensors with a deterministic, seed-dependent pattern; device memory on a device backend
    # unless host=True (for HOST-placement caches)
    out = []
    for i in range(n):
        a = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
        out.append(_on_device(((a * 31 + i * 7 + seed * 1009) % 2039).astype(dtype), host))
    return out

def zeros(n, shape, dtype=np.float16, host=False):
    if DEVICE_DATA and not host:
        return [DeviceArray.zeros(shape, dtype) for _ in range(n)]
    return [np.zeros(shape, dtype=dtype) for _ in range(n)]

def addrs(arrays):
    return [a.addr if DEVICE_DATA and isinstance(a, DeviceArray) else a.ctypes.data for a in arrays]

def options(listen=None, timeout=None, remote=True, pool=None, host_pool=None):
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    if remote:
        cfg.enable_remote_cache_accessible = True
    if listen:
        cfg.listen_ip_info = listen
    if timeout:
        cfg.sync_kv_timeout = timeout
    if pool:
        cfg.mem_pool_cfg = '{"memory_size": %d, "page_shift": 12}' % pool
    if host_pool:
        cfg.host_mem_pool_cfg = '{"memory_size": %d, "page_shift": 12}' % host_pool
    return cfg.generate_options()

def cluster(remote_id, port, ip="127.0.0.1"):
    c = LLMClusterInfo()
    c.remote_cluster_id = remote_id
    c.append_local_ip_info("127.0.0.1", 0)
    c.append_remote_ip_info(ip, port)
    return c

def _through_backend(cache):
    # DEVICE memory of a device backend is reached through backend copies, never a host pointer
    return DEVICE_DATA and int(cache.cache_desc.placement) == int(Placement.DEVICE)

def read_cache(cache):
    # a copy of every tensor of a pdlink cache, as numpy uint8 arrays
    import ctypes
    size = cache.cache_desc.size
    if _through_backend(cache):
        from pdlink.device import open_backend
        backend, out = open_backend(), []
        for a in cache.tensor_addrs:
            buf = np.empty(size, dtype=np.uint8)
            backend.copy(buf.ctypes.data, int(Placement.HOST), a, int(Placement.DEVICE), size)
            out.append(buf)
        return out
    return [np.frombuffer((ctypes.c_uint8 * size).from_address(a), dtype=np.uint8).copy() for a in cache.tensor_addrs]

def resources():
    # (open file descriptors, threads) of this process: for leak checks
    import os
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))

def write_cache(cache, seed):
    import ctypes
    size = cache.cache_desc.size
    for i, a in enumerate(cache.tensor_addrs):
        data = ((np.arange(size, dtype=np.int64) * 13 + i * 5 + seed * 101) % 251).astype(np.uint8)
        if _through_backend(cache):
            from pdlink.device import open_backend
            open_backend().copy(a, int(Placement.DEVICE), data.ctypes.data, int(Placement.HOST), size)
        else:
            np.frombuffer((ctypes.c_uint8 * size).from_address(a), dtype=np.uint8)[:] = data
"""


def _main(conn) -> None:
    ns: dict = {}
    exec(PRELUDE, ns)
    while True:
        try:
            kind, code = conn.recv()
        except EOFError:
            return
        if kind == "quit":
            conn.send(("ok", None))
            return
        try:
            if kind == "exec":
                exec(code, ns)
                result = None
            else:
                result = eval(code, ns)
            conn.send(("ok", result))
        except BaseException as e:  # noqa: BLE001 - shipped back to the test
            try:
                conn.send(("err", e))
            except Exception:  # unpicklable exception
                conn.send(("err", RuntimeError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))


class PeerTimeout(AssertionError):
    pass


class Peer:
    """One peer process. Use as a context manager or call ``close()``."""

    def __init__(self, name: str = "peer", env: Optional[dict] = None):
        self.name = name
        parent, child = _CTX.Pipe()
        self._conn = parent
        saved = {}
        for k, v in (env or {}).items():  # spawn copies os.environ at start
            saved[k] = os.environ.get(k)
            os.environ[k] = v
        try:
            self.proc = _CTX.Process(target=_main, args=(child,), name=name, daemon=True)
            self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()

    def _call(self, kind: str, code: str, timeout: float) -> Any:
        self._conn.send((kind, code))
        if not self._conn.poll(timeout):
            raise PeerTimeout(f"{self.name}: no answer within {timeout}s to: {code.strip()[:200]}")
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            raise PeerTimeout(f"{self.name}: process died (exit code {self.proc.exitcode}) while running: "
                              f"{code.strip()[:200]}") from None
        if status == "err":
            raise value
        return value

    def exec(self, code: str, timeout: float = 30.0) -> None:
        """Run statements in the peer's namespace."""
        self._call("exec", code, timeout)

    def eval(self, expr: str, timeout: float = 30.0) -> Any:
        """Evaluate an expression in the peer's namespace and return its (pickled) value."""
        return self._call("eval", expr, timeout)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)
        if sig == signal.SIGSTOP:
            # A group stop is not synchronous: threads keep running until each reaches a stop
            # point, and a frozen-peer test must not race with that. Wait until it has stopped.
            import time

            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if all(state in ("T", "t") for state in self._thread_states()):
                    return
                time.sleep(0.001)
            raise PeerTimeout(f"{self.name} did not stop within 5 s of SIGSTOP")

    def _thread_states(self):
        states = []
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            try:
                with open(f"/proc/{self.proc.pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # the thread exited meanwhile
                pass
        return states

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGCONT)  # in case a test froze it
                self._call("quit", "", 20.0)
            except Exception:  # noqa: BLE001
                pass
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_for(fn, timeout: float = 5.0):
    """Poll ``fn`` until it returns a truthy value or ``timeout`` passes; returns the last value.

    For effects that are asynchronous by design, e.g. the peer releases a pulled request key when
    the puller's completion frame arrives, just after the pull has returned."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.02)
