"""Peer-side code of the role-switch tests under load (paths/test_switch_under_load.py), on the
engine of ``peers.native`` (``native.start`` first).

On the decoder: pulling threads (``start_pullers``), each with a destination region of its own in
guarded memory (device memory on a device backend), pulling from the prefill's region "src" (filled
with ``verify.pattern(.., seed)``) until ``stop_pullers``. Before every pull a thread writes a fresh
fill over its whole destination (bypassing pdlink), and after it reads the destination back whole,
guards included, and checks it:

* a pull that returned: exactly the pulled rows hold the source's rows, every other byte and both
  guards hold what was there before;
* a pull that raised ``LLMException`` with a code from the thread's allowed set: the guards and every
  row it did not name are unchanged, and each row it named holds either its old bytes or the
  source's (the pull may have moved some before it was refused; counted as ``partial``);
* anything else (wrong bytes, another code, another exception) is an error: the thread records it
  and stops.

Kinds of puller: "read" (``Engine.read`` of descriptor lists: no epoch, the plain pull) and
"prepared" (``Engine.prepare`` once, then ``PreparedTransfer.read`` posts; on ``LLM_STALE_EPOCH``
the thread prepares again, as a caller must after the peer's committed switch).

On the prefill: ``switch`` (``Engine.switch_role``, listening on where it listens now),
``role_state``, ``race`` (two threads calling ``switch_role`` at once with the same expected epoch).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import pdlink
from peers import addr, native
from peers.memory import GuardedTensors, device_memory_is_remote, direct_read, direct_write
from verify import GUARD_BYTES, guard_pattern, pattern

# "ok", or the status code an LLMException carried, or "other: <repr>" for any other exception
Outcome = str | int


@dataclasses.dataclass
class _Puller:
    kind: str
    allowed: frozenset[int]
    memory: GuardedTensors
    region: pdlink.Region
    thread: threading.Thread | None = None
    ok: int = 0  # pulls that returned, destination exact
    codes: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)  # allowed refusals
    partial: int = 0  # refused pulls that had already moved some of their rows
    prepares: int = 0
    steps: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)  # "<step> <code>"
    error: str | None = None  # the first thing that was not allowed; the thread stopped there


_state: dict[str, Any] = {"pullers": [], "stop": threading.Event()}


def _engine() -> pdlink.Engine:
    return native._engine()


# ------------------------------------------------------------------ decoder: pulling threads


def start_pullers(peer: int, remote: pdlink.RemoteRegion, seed: int, kinds: Sequence[str],
                  allowed: dict[str, Sequence[int]], rows: int, row_bytes: int) -> None:
    """One thread per entry of ``kinds`` ("read" or "prepared"), pulling from ``remote`` (the peer's
    region of ``rows`` blocks of ``row_bytes``, filled with ``pattern(.., 0, seed)``) until
    ``stop_pullers``; ``allowed[kind]``: the status codes a pull of that kind may fail with."""
    assert not _state["pullers"], "pullers are already running"
    _state["stop"] = threading.Event()
    device = device_memory_is_remote()
    source = pattern(rows * row_bytes, 0, seed).reshape(rows, row_bytes)
    for i, kind in enumerate(kinds):
        memory = GuardedTensors(1, rows * row_bytes, rows, None, device)
        region = _engine().register(address=memory.addrs[0], length=rows * row_bytes,
                                    placement="DEVICE" if device else "HOST", block_size=row_bytes)
        puller = _Puller(kind, frozenset(int(c) for c in allowed.get(kind, ())), memory, region)
        puller.thread = threading.Thread(target=_pull_loop, args=(puller, i, peer, remote, source, device),
                                         name=f"puller-{i}-{kind}", daemon=True)
        _state["pullers"].append(puller)
    for puller in _state["pullers"]:
        assert puller.thread is not None
        puller.thread.start()


def _pull_loop(p: _Puller, index: int, peer: int, remote: pdlink.RemoteRegion, source: np.ndarray,
               device: bool) -> None:
    rows, row_bytes = source.shape
    rng = random.Random(index)
    base = p.memory.bases[0]
    span = GUARD_BYTES + rows * row_bytes + GUARD_BYTES
    prepared = None
    n = 0
    while not _state["stop"].is_set():
        n += 1
        step = "read"
        count = rng.randint(1, rows)
        src_rows = rng.sample(range(rows), count)
        dst_rows = rng.sample(range(rows), count)
        # row r of the fill is one byte value repeated, new with every pull: never a source row (whose
        # bytes all differ from their neighbours), never what the last pull left
        fill = np.repeat(((np.arange(rows) + n) % 255 + 1).astype(np.uint8), row_bytes).reshape(rows, row_bytes)
        direct_write(base + GUARD_BYTES, fill, device)
        try:
            if p.kind == "read":
                _engine().read(peer, [(p.region.address + d * row_bytes, row_bytes) for d in dst_rows],
                               [(remote.address + s * row_bytes, row_bytes) for s in src_rows])
            else:
                if prepared is None:
                    step = "prepare"
                    prepared = _engine().prepare(peer, p.region, remote)
                    p.prepares += 1
                step = "post"
                prepared.read(np.array(dst_rows, np.int64), np.array(src_rows, np.int64))
            outcome: Outcome = "ok"
        except pdlink.LLMException as e:
            outcome = int(e.status_code)
        except Exception as e:  # noqa: BLE001 - reported to the test
            p.error = f"pull {n}: {e!r}"
            return
        after = direct_read(base, span, device)
        guards_ok = (np.array_equal(after[:GUARD_BYTES], guard_pattern())
                     and np.array_equal(after[GUARD_BYTES + rows * row_bytes:], guard_pattern()))
        got = after[GUARD_BYTES:GUARD_BYTES + rows * row_bytes].reshape(rows, row_bytes)
        named = dict(zip(dst_rows, src_rows))
        if outcome == "ok":
            expect = fill.copy()
            for d, s in named.items():
                expect[d] = source[s]
            if not guards_ok or not np.array_equal(got, expect):
                p.error = f"pull {n} ({p.kind}) returned but the destination is wrong: {_where(got, expect, guards_ok)}"
                return
            p.ok += 1
            continue
        if outcome not in p.allowed:
            p.error = f"pull {n} ({p.kind}) failed with status {outcome}, not one of {sorted(p.allowed)}"
            return
        untouched = [r for r in range(rows) if r not in named]
        moved = [d for d, s in named.items() if np.array_equal(got[d], source[s])]
        if (not guards_ok or not np.array_equal(got[untouched], fill[untouched])
                or any(not np.array_equal(got[d], fill[d]) for d in named if d not in moved)):
            p.error = (f"pull {n} ({p.kind}) failed with status {outcome} and changed memory outside the rows it "
                       f"named, or a named row to neither its old nor the source's bytes: "
                       f"{_where(got, fill, guards_ok)}")
            return
        p.codes[int(outcome)] += 1
        p.steps[f"{step} {outcome}"] += 1
        p.partial += bool(moved)
        if outcome == int(pdlink.LLMStatusCode.LLM_STALE_EPOCH):
            prepared = None  # prepared against the peer's old epoch: prepare again


def _where(got: np.ndarray, expect: np.ndarray, guards_ok: bool) -> str:
    if not guards_ok:
        return "a guard byte changed"
    bad = np.argwhere(got != expect)
    return f"row {bad[0][0]}, byte {bad[0][1]} ({len(bad)} bytes differ)" if len(bad) else "no difference"


def progress() -> list[int]:
    """Each puller's count of exact pulls so far (0 for one that stopped on an error, once it did)."""
    return [p.ok if p.error is None else -1 for p in _state["pullers"]]


def stale_counts() -> list[int]:
    """Each puller's count of LLM_STALE_EPOCH refusals so far."""
    return [p.codes[int(pdlink.LLMStatusCode.LLM_STALE_EPOCH)] for p in _state["pullers"]]


def stop_pullers(timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Stops and joins the pullers, deregisters their regions; one dict per puller: ``kind``,
    ``ok``, ``codes`` (status code -> count), ``partial``, ``prepares``, ``error``, ``alive``
    (still running after ``timeout_s``: a hang)."""
    _state["stop"].set()
    out = []
    for p in _state["pullers"]:
        assert p.thread is not None
        p.thread.join(timeout_s)
        out.append({"kind": p.kind, "ok": p.ok, "codes": dict(p.codes), "partial": p.partial,
                    "prepares": p.prepares, "steps": dict(p.steps), "error": p.error, "alive": p.thread.is_alive()})
    for p, report in zip(_state["pullers"], out):
        if not report["alive"]:
            _engine().deregister(p.region)
    _state["pullers"] = []
    return out


def fill(name: str, value: int) -> None:
    """Writes ``value`` over every byte of ``peers.native``'s region ``name`` (not through pdlink)."""
    named = native._state["regions"][name]
    for a in named.memory.addrs:
        direct_write(a, np.full(named.memory.tensor_bytes, value, np.uint8), named.memory.device)


def _start(key: str, work: Callable[[], Outcome]) -> None:
    """Runs ``work`` on a thread of its own; ``_outcome(key, ..)`` waits for what it returns."""
    def run() -> None:
        _state[key] = work()

    _state[key] = None
    _state[key + "_thread"] = threading.Thread(target=run, daemon=True)
    _state[key + "_thread"].start()


def _outcome(key: str, timeout_s: float) -> Outcome | None:
    """What the ``_start(key, ..)`` work returned, after waiting at most ``timeout_s`` for it (None:
    still running)."""
    _state[key + "_thread"].join(timeout_s)
    outcome: Outcome | None = _state[key]
    return outcome


def start_transfer(op: str, peer: int, name: str, remote_address: int) -> None:
    """``Engine.read`` or ``write`` (``op``) of the whole of ``peers.native``'s region ``name``
    from / to ``remote_address`` on ``peer``, on a thread of its own; ``finish_transfer`` waits."""
    region = native._state["regions"][name].region

    def run() -> Outcome:
        try:
            getattr(_engine(), op)(peer, [(region.address, region.length)], [(remote_address, region.length)])
            return "ok"
        except pdlink.TransferCancelled:  # stopped at a cancel point (a drain timeout of this engine)
            return "cancelled"
        except pdlink.LLMException as e:
            return int(e.status_code)

    _start("transfer", run)


def finish_transfer(timeout_s: float) -> Outcome | None:
    """The ``start_transfer`` transfer's outcome ("ok", "cancelled" or its status code), after
    waiting at most ``timeout_s`` for it (None: still running)."""
    return _outcome("transfer", timeout_s)


# ------------------------------------------------------------------ switches


def role_state() -> dict[str, Any]:
    """``Engine.role_state()`` as a dict (role, epoch, phase, in-flight counts, pins)."""
    state: dict[str, Any] = _engine().role_state().as_dict()
    return state


def switch(role: str, expected_epoch: int | None = None, drain_timeout_ms: int | None = None) -> dict[str, Any]:
    """``Engine.switch_role(role)``, listening where the engine listens now (not listening if it
    does not); the role state after."""
    port = _engine().listen_port
    _engine().switch_role(role, addr.listen(port) if port else None, expected_epoch=expected_epoch,
                          drain_timeout_ms=drain_timeout_ms)
    return role_state()


def race(role: str, expected_epoch: int, drain_timeout_ms: int | None = None) -> list[Outcome]:
    """Two threads call ``switch(role, expected_epoch)`` at the same moment (a barrier); each one's
    outcome: "ok" or the status code it raised."""
    barrier = threading.Barrier(2)
    outcomes: list[Outcome] = ["", ""]

    def controller(i: int) -> None:
        barrier.wait(30)
        try:
            switch(role, expected_epoch, drain_timeout_ms)
            outcomes[i] = "ok"
        except pdlink.LLMException as e:
            outcomes[i] = int(e.status_code)
        except Exception as e:  # noqa: BLE001 - reported to the test
            outcomes[i] = f"other: {e!r}"

    threads = [threading.Thread(target=controller, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcomes


def start_switch(role: str, expected_epoch: int | None = None, drain_timeout_ms: int | None = None) -> None:
    """``switch`` on a thread of its own; ``switch_outcome`` waits for it."""
    _start("switched", lambda: try_switch(role, expected_epoch, drain_timeout_ms))


def switch_outcome(timeout_s: float) -> Outcome | None:
    """The ``start_switch`` switch's outcome ("ok" or its status code), after waiting at most
    ``timeout_s`` for it (None: still pending)."""
    return _outcome("switched", timeout_s)


def try_switch(role: str, expected_epoch: int | None = None, drain_timeout_ms: int | None = None) -> Outcome:
    """``switch``'s outcome: "ok" or the status code it raised (the role state is read apart)."""
    try:
        switch(role, expected_epoch, drain_timeout_ms)
        return "ok"
    except pdlink.LLMException as e:
        return int(e.status_code)


def resources() -> tuple[int, int]:
    """(open file descriptors, threads) of this process, for leak checks."""
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))
