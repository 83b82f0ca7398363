"""Real peer processes for cross-process tests.

A ``Peer`` is a separate Python process (multiprocessing "spawn": nothing is inherited but
``sys.path`` and the environment). A test calls module-level functions in it::

    from peers import kv
    port = prefill.call(kv.start, "prompt", 1, listen=True)
    prefill.call_within(60, kv.pull_blocks, key, "kv", [0], [1])

The function travels by reference (its module and name), so it must live in an importable module:
peer-side code goes in ``tests/peers/*.py``, where ruff and mypy check it like the rest. Arguments and
results are pickled. An exception raised in the peer is raised again in the test, with its type
(``LLMException`` keeps ``status_code``) and the peer's traceback chained as its cause. Every call
is bounded (30 s by default, ``call_within`` for another bound): a hung peer fails the test, it never
hangs it; the peer is killed then, since its state is unknown. Teardown kills the peer by pid.

State that must outlive one call (the engine, caches, worker threads) lives in the peer module's
own globals (``tests/peers/kv.py`` keeps one engine per process).

Legacy: ``exec``/``eval`` run source strings in a namespace prepared by ``PRELUDE``. Tests not yet
converted to functions use them; new tests must not (tests/README.md).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from poll import wait_until

_CTX = mp.get_context("spawn")
DEFAULT_CALL_TIMEOUT = 30.0

R = TypeVar("R")

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
        from internals import open_backend
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
            from internals import open_backend
            open_backend().copy(a, int(Placement.DEVICE), data.ctypes.data, int(Placement.HOST), size)
        else:
            np.frombuffer((ctypes.c_uint8 * size).from_address(a), dtype=np.uint8)[:] = data
"""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a peer (chained as the re-raised exception's cause)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n\n--- in the peer process ---\n{self.text}"


class RemoteError(Exception):
    """A peer's exception that could not be pickled: its type name and text."""


class PeerTimeout(AssertionError):
    """A peer did not answer within the call's bound, or died while answering."""


def _answer_error(conn: Any, e: BaseException) -> None:
    tb = traceback.format_exc()
    try:
        conn.send(("err", e, tb))
    except Exception:  # noqa: BLE001 - an unpicklable exception: ship its text
        conn.send(("err", RemoteError(f"{type(e).__name__}: {e}"), tb))


def _main(conn: Any) -> None:
    ns: dict[str, Any] = {}
    prelude_done = False
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:
            return
        try:
            if kind == "call":
                fn, args, kwargs = payload
                result = fn(*args, **kwargs)
            else:  # legacy source strings
                if not prelude_done:
                    exec(PRELUDE, ns)
                    prelude_done = True
                if kind == "exec":
                    exec(payload, ns)
                    result = None
                else:
                    result = eval(payload, ns)
        except BaseException as e:  # noqa: BLE001 - shipped back to the test
            _answer_error(conn, e)
            continue
        try:
            conn.send(("ok", result, ""))
        except Exception as e:  # noqa: BLE001 - an unpicklable result
            _answer_error(conn, e)


class Peer:
    """One peer process; ``close()`` (or the ``peers`` fixture's teardown) kills it."""

    def __init__(self, name: str = "peer", env: dict[str, str] | None = None):
        self.name = name
        parent, child = _CTX.Pipe()
        self._conn = parent
        self._broken: str | None = None
        saved: dict[str, str | None] = {}
        for k, v in (env or {}).items():  # spawn copies os.environ at start
            saved[k] = os.environ.get(k)
            os.environ[k] = v
        try:
            self.proc = _CTX.Process(target=_main, args=(child,), name=name, daemon=True)
            self.proc.start()
        finally:
            for k, old in saved.items():
                if old is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = old
        child.close()

    @property
    def pid(self) -> int:
        pid = self.proc.pid
        assert pid is not None
        return pid

    # ------------------------------------------------------------------ calls

    def call(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """``fn(*args, **kwargs)`` in the peer, bounded by 30 s; its result, or its exception."""
        return self.call_within(DEFAULT_CALL_TIMEOUT, fn, *args, **kwargs)

    def call_within(self, seconds: float, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """``call`` bounded by ``seconds`` instead (a hang guard: make it a generous multiple of the
        timeout the call itself is configured with, and assert on what the call returns)."""
        what = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        return self._request(("call", (fn, args, kwargs)), seconds, what)

    def _request(self, message: Any, timeout: float, what: str) -> Any:
        if self._broken:
            raise PeerTimeout(f"{self.name}: unusable since {self._broken}")
        self._conn.send(message)
        if not self._conn.poll(timeout):
            self._broken = f"no answer within {timeout} s to {what}"
            self.kill()
            raise PeerTimeout(f"{self.name}: {self._broken} (the peer was killed)")
        try:
            status, value, tb = self._conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            self._broken = f"it died (exit code {self.proc.exitcode}) while running {what}"
            raise PeerTimeout(f"{self.name}: {self._broken}") from None
        if status == "err":
            raise value from RemoteTraceback(tb)
        return value

    # legacy source-string interface (tests/README.md: not for new tests)

    def exec(self, code: str, timeout: float = DEFAULT_CALL_TIMEOUT) -> None:
        """Run statements in the peer's legacy namespace."""
        self._request(("exec", code), timeout, code.strip()[:200])

    def eval(self, expr: str, timeout: float = DEFAULT_CALL_TIMEOUT) -> Any:
        """Evaluate an expression in the peer's legacy namespace and return its (pickled) value."""
        return self._request(("eval", expr), timeout, expr.strip()[:200])

    # ------------------------------------------------------------------ process control

    def freeze(self) -> None:
        """SIGSTOP, returning once every thread of the peer has stopped (a group stop is not
        synchronous: threads run on until each reaches a stop point)."""
        os.kill(self.pid, signal.SIGSTOP)
        wait_until(lambda: all(state in ("T", "t") for state in self.thread_states()), 5.0,
                   f"every thread of {self.name} stopped")

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def signal(self, sig: int) -> None:
        """Legacy spelling: ``freeze()`` for SIGSTOP, else the signal as is."""
        if sig == signal.SIGSTOP:
            self.freeze()
        else:
            os.kill(self.pid, sig)

    def thread_states(self) -> list[str]:
        states = []
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except FileNotFoundError:
            return ["X"]  # gone
        for tid in tids:
            try:
                with open(f"/proc/{self.pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # the thread exited meanwhile
                pass
        return states

    def kill(self) -> None:
        """SIGKILL by pid and reap it."""
        if self.proc.pid is not None and self.proc.exitcode is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.join(10)

    def close(self) -> None:
        self.kill()
        self._conn.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for(fn: Callable[[], Any], timeout: float = 5.0) -> Any:
    """Legacy: poll ``fn`` until it returns a truthy value or ``timeout`` passes; returns the last
    value (new tests use ``poll.wait_until``, which fails with a message)."""
    try:
        return wait_until(fn, timeout, "condition")
    except AssertionError:
        return fn()
