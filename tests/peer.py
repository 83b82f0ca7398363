"""Real peer processes for cross-process tests.

A ``Peer`` is a separate Python process that inherits nothing but ``sys.path``, the environment
and the modules every peer imports. It is forked by multiprocessing's fork server, which imports
those modules (numpy, pdlink, the drop-ins, ``tests/peers/kv.py``) once per test process: a peer
then starts in milliseconds, where a fresh interpreter took 0.4 s of CPU importing them, times
thousands of peers a run. The fork server is a fresh interpreter itself, kept single-threaded (so
a fork copies no lock held by another thread), and never makes an engine or logs: what pdlink
reads from the environment it reads when an engine starts, in the peer, after the peer has taken
the environment it was given. A new interpreter ("spawn") starts a peer on an emulated host or in
a pid namespace of its own (through its wrapper), one given a variable that only a starting process
reads (``_START_VARIABLES``), and one asked ``fresh``. A test calls module-level functions in it::

    from peers import kv
    port = prefill.call(kv.start, "prompt", 1, listen=True)
    prefill.call_within(60, kv.pull_blocks, key, "kv", [0], [1])

The function travels by reference (its module and name), so it must live in an importable module:
peer-side code goes in ``tests/peers/*.py``, where ruff and mypy check it like the rest. Arguments and
results are pickled. An exception raised in the peer is raised again in the test, with its type
(``LLMException`` keeps ``status_code``) and the peer's traceback chained as its cause. Every call
is bounded (60 s by default, ``call_within`` for another bound): a hung peer fails the test, it never
hangs it; the peer is killed then, since its state is unknown. Teardown kills the peer by pid.

State that must outlive one call (the engine, caches, worker threads) lives in the peer module's
own globals (``tests/peers/kv.py`` keeps one engine per process).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.spawn
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from poll import wait_until

_SPAWN = mp.get_context("spawn")
_FORKSERVER = mp.get_context("forkserver")
# What every peer imports, imported once by the fork server (a module that fails to import there is
# left out, and imported by each peer that needs it, as before).
_PRELOAD = ["numpy", "pdlink", "llm_datadist", "hixl", "internals", "peers.kv"]
_FORKSERVER_STARTED: list[bool] = []
# Variables read when a process starts (the dynamic loader's, the interpreter's, the sanitizer
# runtimes', the allocator's): a fork would not take them, so a peer given one is spawned.
_START_VARIABLES = ("LD_", "PYTHON", "ASAN_", "TSAN_", "UBSAN_", "LSAN_", "MALLOC_", "GLIBC_TUNABLES", "OPENBLAS_")
# A hang guard, never a measure: a peer that does not answer a call within it is killed. 60 s, so
# that a call that fills hundreds of MiB still answers on a 2-core machine under other load (30 s did
# not, beside three other jobs).
DEFAULT_CALL_TIMEOUT = 60.0

R = TypeVar("R")


_SPAWN_LOCK = threading.Lock()  # guards multiprocessing's process-wide spawn executable
_NAMESPACE_WRAPPER: list[str] = []  # the wrapper script, once written


def pid_namespace_error() -> str | None:
    """Why a peer cannot run in a pid namespace of its own here (``Peer(pid_namespace=True)``);
    None when it can."""
    if shutil.which("unshare") is None:
        return "no unshare(1) (util-linux)"
    try:
        run = subprocess.run(["unshare", "--pid", "--kill-child", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare: {e}"
    return None if run.returncode == 0 else f"unshare --pid: {run.stderr.decode(errors='replace').strip()}"


def _namespace_wrapper() -> str:
    """An executable that runs the spawn interpreter as the first process of a new pid namespace
    (``unshare --kill-child``: killing the wrapper kills the peer)."""
    if not _NAMESPACE_WRAPPER:
        python = os.fsdecode(multiprocessing.spawn.get_executable())
        folder = tempfile.mkdtemp(prefix="pdlink-peer-")
        atexit.register(shutil.rmtree, folder, True)
        path = os.path.join(folder, "python-in-pid-namespace")
        with open(path, "w") as f:
            f.write(f'#!/bin/sh\nexec unshare --pid --kill-child -- "{python}" "$@"\n')
        os.chmod(path, stat.S_IRWXU)
        _NAMESPACE_WRAPPER.append(path)
    return _NAMESPACE_WRAPPER[0]


def _interpreter_below(wrapper: int) -> int:
    """The pid of the multiprocessing child started through ``wrapper`` (which may start the
    interpreter as a child of its own, e.g. to enter a pid namespace): the deepest process, from the
    wrapper down, whose command line is the spawn child's. Call it once the child has answered."""
    found, level = wrapper, [wrapper]
    while level:
        below: list[int] = []
        for pid in level:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"spawn_main" in f.read():
                        found = pid
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    below.extend(int(child) for child in f.read().split())
            except (FileNotFoundError, ProcessLookupError):
                continue
        level = below
    return found


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


# Peer modules that call llm_datadist: whatever they raise for a status must be exactly an
# LLMException, as CANN's library raises it (docs/compatibility.md, "Exceptions"); pdlink.Engine's
# subclasses (InvalidArgument, a ValueError too) would send a real program down another branch.
LLM_DATADIST_PEERS = frozenset({"peers.kv", "peers.v1", "peers.api_errors", "peers.transfer_async", "peers.connectors",
                                "peers.local_ops", "peers.ascend_e2e", "peers.vllm_ascend"})


def _subclass_escaped(fn: Any, e: BaseException) -> AssertionError | None:
    from pdlink import LLMException

    if isinstance(e, LLMException) and type(e) is not LLMException and \
            getattr(fn, "__module__", None) in LLM_DATADIST_PEERS:
        return AssertionError(f"llm_datadist raised {type(e).__name__}, not LLMException itself: {e}")
    return None


def _start_forkserver() -> None:
    """Starts this process's fork server once, with the peers' modules imported and OpenBLAS (which
    numpy loads) held to the calling thread: a fork server with a second thread would copy its
    state half-way (and ThreadSanitizer refuses threads in a child of a multi-threaded fork)."""
    if _FORKSERVER_STARTED:
        return
    _FORKSERVER.set_forkserver_preload(_PRELOAD)
    saved = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # the fork server's own environment, copied at its start
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["OPENBLAS_NUM_THREADS"]
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = saved
    _FORKSERVER_STARTED.append(True)


def _main(conn: Any, environ: dict[str, str] | None = None) -> None:
    """A peer's loop: calls until the pipe closes. ``environ``: the environment to take first (a
    forked peer's: the fork server's own is that of the test process when it started)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    while True:
        try:
            fn, args, kwargs = conn.recv()
        except EOFError:
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - shipped back to the test
            escaped = _subclass_escaped(fn, e)
            if escaped is not None:
                escaped.__cause__ = e
            _answer_error(conn, e if escaped is None else escaped)
            continue
        try:
            conn.send(("ok", result, ""))
        except Exception as e:  # noqa: BLE001 - an unpicklable result
            _answer_error(conn, e)


class Peer:
    """One peer process; ``close()`` (or the ``peers`` fixture's teardown) kills it."""

    def __init__(self, name: str = "peer", env: Mapping[str, str | None] | None = None, pid_namespace: bool = False,
                 executable: str | None = None, fresh: bool = False):
        """``env``: variables the peer gets on top of this process's environment; a value of None
        leaves that variable out of the peer's environment. ``pid_namespace``: the peer runs in a
        pid namespace of its own (needs ``pid_namespace_error() is None``): the kernel cannot
        name its processes to ours and back, so pdlink links to it as to another host, over TCP.
        ``pid`` is then that of the wrapper, whose death kills the peer. ``executable``: runs the
        interpreter through that wrapper instead (``pdlink.testing.hosts.Host.python``: the peer
        runs on an emulated host); ``pid`` is then the interpreter's own, found below the wrapper,
        and killing the wrapper kills it. ``fresh``: a new interpreter (spawn) rather than a fork of
        the fork server, for a peer whose address space must be laid out unlike the others' (an
        attacker whose memory must not map the victim's addresses); a peer given a variable that
        takes effect only when a process starts (``_START_VARIABLES``) is started fresh too."""
        self.name = name
        parent, child = _SPAWN.Pipe()
        self._conn = parent
        self._broken: str | None = None
        self._wrapped = executable is not None
        self._interpreter: int | None = None
        if not (fresh or pid_namespace or executable or any(k.startswith(_START_VARIABLES) for k in env or {})):
            environ = dict(os.environ)
            for k, v in (env or {}).items():
                if v is None:
                    environ.pop(k, None)
                else:
                    environ[k] = v
            with _SPAWN_LOCK:
                _start_forkserver()
            self.proc: Any = _FORKSERVER.Process(target=_main, args=(child, environ), name=name, daemon=True)
            self.proc.start()
            child.close()
            return
        saved: dict[str, str | None] = {}
        for k, v in (env or {}).items():  # spawn copies os.environ at start
            saved[k] = os.environ.get(k)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            self.proc = _SPAWN.Process(target=_main, args=(child,), name=name, daemon=True)
            with _SPAWN_LOCK:
                spawn_exe = multiprocessing.spawn.get_executable()
                if pid_namespace or executable:
                    # multiprocessing starts its resource tracker with the executable set when it is
                    # first needed: start it here first, so that it never runs through the wrapper
                    multiprocessing.resource_tracker.ensure_running()
                    multiprocessing.spawn.set_executable(executable or _namespace_wrapper())
                try:
                    self.proc.start()
                finally:
                    multiprocessing.spawn.set_executable(spawn_exe)
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
        if not self._wrapped:
            return pid
        if self._interpreter is None:
            self.call(os.getpid)  # it answers: the interpreter runs, below the wrapper or as it
            self._interpreter = _interpreter_below(pid)
        return self._interpreter

    # ------------------------------------------------------------------ calls

    def call(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """``fn(*args, **kwargs)`` in the peer, bounded by DEFAULT_CALL_TIMEOUT (60 s); its result, or its exception."""
        return self.call_within(DEFAULT_CALL_TIMEOUT, fn, *args, **kwargs)

    def call_within(self, seconds: float, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """``call`` bounded by ``seconds`` instead (a hang guard: make it a generous multiple of the
        timeout the call itself is configured with, and assert on what the call returns)."""
        what = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        return self._request((fn, args, kwargs), seconds, what)

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

    # ------------------------------------------------------------------ process control

    def freeze(self) -> None:
        """SIGSTOP, returning once every thread of the peer has stopped (a group stop is not
        synchronous: threads run on until each reaches a stop point)."""
        os.kill(self.pid, signal.SIGSTOP)
        wait_until(lambda: all(state in ("T", "t") for state in self.thread_states()), 5.0,
                   f"every thread of {self.name} stopped")

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

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
