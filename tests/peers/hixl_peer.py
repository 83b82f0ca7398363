"""Peer-side functions for tests/compat/hixl/test_hixl.py: one ``hixl.Hixl`` engine per peer process, and its
memory by name, in guarded memory (tests/peers/memory.py: host memory, or with ``device=True`` the
Ascend backend's DEVICE memory)::

    server_id = server.call(hixl_peer.start, {})                  # "<ip>:<port>", listening (peers.addr)
    src = server.call(hixl_peer.alloc, "src", 1 << 20, seed=1)    # the buffer's address
    server.call(hixl_peer.register, "src")                        # (ret, handle)
    client.call(hixl_peer.start, {}, listen=False)                # "<ip>:0", client only
    dst = client.call(hixl_peer.alloc, "dst", 1 << 20)            # zeros
    client.call(hixl_peer.register, "dst")
    client.call(hixl_peer.connect, server_id)                     # hixl.SUCCESS
    client.call(hixl_peer.transfer_sync, server_id, "READ", [(dst, src, 4096)])
    snapshot = client.call(hixl_peer.snapshot, "dst")             # tests/verify.py

Enums travel by name ("READ", "MEM_HOST"; transfer states come back as their names), descriptors as
``(local_addr, remote_addr, len)`` triples, notifications as ``(name, notify_msg)`` pairs. Every
function returns the engine's codes as they are; the ones that replay a caller's code (Ray, vllm-ascend
EPLB, Mooncake TENT: tests/compat/hixl/test_hixl.py) handle the codes the way that caller does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import hixl
import internals
import ports
from peers import addr
from peers.memory import GuardedTensors, device_memory_is_remote, direct_write
from verify import Snapshot

Desc = tuple[int, int, int]

_state: dict[str, Any] = {"engine": None, "id": None, "buffers": {}, "handles": {}}


def _engine() -> Any:
    engine = _state["engine"]
    assert engine is not None, "call hixl_peer.start first"
    return engine


def _free_port() -> int:
    return ports.free_port(addr.own())


def _descs(descs: Sequence[Desc]) -> list[Any]:
    return [hixl.TransferOpDesc(local, remote, length) for local, remote, length in descs]


def _op(op: str) -> Any:
    return getattr(hixl.TransferOp, op)


# ---------------------------------------------------------------------------- lifecycle


def start(options: dict[str, str] | None = None, listen: bool = True, client_id: str | None = None) -> str:
    """``Hixl()`` and ``initialize``: listening at ``<ip>:<a free port>`` (a server; ip: loopback,
    or this peer's host, peers.addr), or at ``client_id`` (client only: ``<ip>:0`` unless given,
    e.g. ``127.0.0.1``) when not ``listen``. Returns the
    engine id, the string peers pass as ``remote_engine``. A port taken between choosing and binding
    is retried with another."""
    engine = hixl.Hixl()
    if not listen:
        ident = addr.listen() if client_id is None else client_id
        ret = engine.initialize(ident, dict(options or {}))
        assert ret == hixl.SUCCESS, f"initialize({ident!r}) returned {ret}"
    else:
        ret = None
        for _ in range(20):
            ident = f"{addr.own()}:{_free_port()}"
            ret = engine.initialize(ident, dict(options or {}))
            if ret == hixl.SUCCESS:
                break
        assert ret == hixl.SUCCESS, f"initialize on a free port returned {ret}"
    _state["engine"], _state["id"] = engine, ident
    return ident


def start_at(ident: str, options: dict[str, str] | None = None) -> str:
    """``Hixl()`` and ``initialize(ident)``: an engine listening at a given id (a restarted one,
    say), retried while the port is still held (a killed engine's sockets close with its process)."""
    engine = hixl.Hixl()
    deadline = time.monotonic() + 10
    while (ret := engine.initialize(ident, dict(options or {}))) != hixl.SUCCESS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ret == hixl.SUCCESS, f"initialize({ident!r}) returned {ret}"
    _state["engine"], _state["id"] = engine, ident
    return ident


def transfer_many(remote: str, op: str, descs: Sequence[Desc], timeout_ms: int = 10000) -> list[int]:
    """One ``transfer_sync`` per descriptor, one after another; every code, in order."""
    return [transfer_sync(remote, op, [d], timeout_ms) for d in descs]


def initialize_again(options: dict[str, str] | None = None) -> int:
    """A second ``initialize`` of the running engine with its own id."""
    return int(_engine().initialize(_state["id"], dict(options or {})))


def finalize() -> Any:
    """``finalize()``; returns what it returned (None)."""
    return _engine().finalize()


def free_port() -> int:
    """A port nobody listens on (bound and closed at once)."""
    return _free_port()


# ---------------------------------------------------------------------------- memory


def alloc(name: str, nbytes: int, seed: int | None = None, fill: int | None = None, device: bool = False) -> int:
    """``nbytes`` of guarded memory kept under ``name`` (``verify.pattern(.., seed)``, or every byte
    ``fill``, or zeros): DEVICE memory of the Ascend backend (the fake ACL's) when ``device``, else
    host memory; returns its first byte's address. Not registered. Snapshots read it back directly
    (the fake's own view of device memory), never through hixl."""
    assert not device or device_memory_is_remote(), "device memory exists on the Ascend backend only"
    memory = GuardedTensors(1, nbytes, 1, seed, device)
    if fill is not None:
        direct_write(memory.addrs[0], np.full(nbytes, fill, np.uint8), device)
    _state["buffers"][name] = memory
    return int(memory.addrs[0])


def address(name: str) -> int:
    return int(_state["buffers"][name].addrs[0])


def snapshot(name: str) -> Snapshot:
    """Every byte of buffer ``name`` with its guards (read directly, not through hixl)."""
    return _state["buffers"][name].snapshot(name)


def register(name: str, mem_type: str = "MEM_HOST", offset: int = 0, length: int | None = None) -> tuple[int, int]:
    """``register_mem(MemDesc(addr + offset, length), MemType.<mem_type>)`` of buffer ``name``
    (default: all of it); returns ``(ret, handle)`` and keeps a non-zero handle under ``name``."""
    memory = _state["buffers"][name]
    n = memory.tensor_bytes - offset if length is None else length
    ret, handle = _engine().register_mem(hixl.MemDesc(memory.addrs[0] + offset, n), getattr(hixl.MemType, mem_type))
    if ret == hixl.SUCCESS:
        _state["handles"].setdefault(name, []).append(handle)
    return ret, handle


def deregister(handle: int) -> int:
    return int(_engine().deregister_mem(handle))


def deregister_all() -> list[int]:
    """``deregister_mem`` of every handle ``register`` kept, in registration order."""
    codes = [int(_engine().deregister_mem(h)) for hs in _state["handles"].values() for h in hs]
    _state["handles"] = {}
    return codes


# ---------------------------------------------------------------------------- links


def connect(remote: str, timeout_ms: int = 5000) -> int:
    return int(_engine().connect(remote, timeout_in_millis=timeout_ms))


def disconnect(remote: str, timeout_ms: int = 5000) -> int:
    return int(_engine().disconnect(remote, timeout_in_millis=timeout_ms))


def connect_async(remote: str, timeout_ms: int = 5000) -> int:
    return int(_engine().connect_async(remote, timeout_in_millis=timeout_ms))


def disconnect_async(remote: str, timeout_ms: int = 5000) -> int:
    return int(_engine().disconnect_async(remote, timeout_in_millis=timeout_ms))


def async_status(remote: str) -> tuple[int, str]:
    """``get_async_connect_status(remote)``: its code and the status's name."""
    ret, status = _engine().get_async_connect_status(remote)
    assert isinstance(status, hixl.AsyncConnectStatus), type(status)
    return int(ret), status.name


def all_async_status() -> tuple[int, dict[str, str]]:
    ret, statuses = _engine().get_all_async_connect_status()
    assert isinstance(statuses, dict), type(statuses)
    assert all(isinstance(k, str) and isinstance(v, hixl.AsyncConnectStatus) for k, v in statuses.items()), statuses
    return int(ret), {k: v.name for k, v in statuses.items()}


def wait_async_status(remote: str, final: Sequence[str], limit_s: float = 20.0) -> list[str]:
    """Polls ``get_async_connect_status(remote)`` (every ms) until its status is one of ``final``;
    returns every distinct status seen, in order. Each query must return SUCCESS."""
    seen: list[str] = []
    deadline = time.monotonic() + limit_s
    while True:
        ret, name = async_status(remote)
        assert ret == hixl.SUCCESS, ret
        if not seen or seen[-1] != name:
            seen.append(name)
        if name in final or time.monotonic() > deadline:
            return seen
        time.sleep(0.001)


# ---------------------------------------------------------------------------- transfers


def transfer_sync(remote: str, op: str, descs: Sequence[Desc], timeout_ms: int = 10000) -> int:
    return int(_engine().transfer_sync(remote, _op(op), _descs(descs), timeout_in_millis=timeout_ms))


def transfer_async(remote: str, op: str, descs: Sequence[Desc], user_data: int | None = None) -> tuple[int, int]:
    """``transfer_async``: ``(ret, req)``; with ``user_data``, in a ``TransferArgs`` carrying it."""
    if user_data is None:
        ret, req = _engine().transfer_async(remote, _op(op), _descs(descs))
    else:
        args = hixl.TransferArgs()
        args.user_data = user_data
        ret, req = _engine().transfer_async(remote, _op(op), _descs(descs), args)
    assert type(ret) is int and type(req) is int, (type(ret), type(req))
    return ret, req


def transfer_async_settled(remote: str, op: str, descs: Sequence[Desc],
                           limit_s: float = 10.0) -> tuple[int, int, tuple[int, str, int] | None]:
    """``transfer_async``, and when it gave a request, ``wait_done`` of it (so that whatever it
    does has been done when this returns): ``(ret, req, what wait_done returned or None)``."""
    ret, req = transfer_async(remote, op, descs)
    return ret, req, (wait_done(req, limit_s) if req != 0 else None)


def status(req: int) -> tuple[int, str]:
    """``get_transfer_status(req)``: its code and the TransferStatus's name."""
    ret, state = _engine().get_transfer_status(req)
    assert isinstance(state, hixl.TransferStatus), type(state)
    return int(ret), state.name


def wait_done(req: int, limit_s: float = 20.0) -> tuple[int, str, int]:
    """Polls ``get_transfer_status(req)`` every ms (as Ray does) until it returns anything but
    ``(SUCCESS, WAITING)``, or ``limit_s`` passes; returns that last answer and how many
    ``(SUCCESS, WAITING)`` answers came before it."""
    waiting = 0
    deadline = time.monotonic() + limit_s
    while True:
        ret, name = status(req)
        if ret != hixl.SUCCESS or name != "WAITING" or time.monotonic() > deadline:
            return ret, name, waiting
        waiting += 1
        time.sleep(0.001)


def all_status(max_query_count: int | None = None,
               skip_waiting: bool | None = None) -> tuple[int, list[tuple[int, int, str]]]:
    """``get_all_transfer_status`` (with a ``GetTransferStatusArgs`` when either field is given):
    its code and ``(req, user_data, status name)`` per result."""
    if max_query_count is None and skip_waiting is None:
        ret, results = _engine().get_all_transfer_status()
    else:
        args = hixl.GetTransferStatusArgs()
        if max_query_count is not None:
            args.max_query_count = max_query_count
        if skip_waiting is not None:
            args.skip_waiting = skip_waiting
        ret, results = _engine().get_all_transfer_status(args)
    assert isinstance(results, list), type(results)
    out = []
    for r in results:
        assert isinstance(r, hixl.TransferResult) and isinstance(r.status, hixl.TransferStatus), r
        out.append((int(r.req), int(r.user_data), r.status.name))
    return int(ret), out


def collect_finished(count: int, limit_s: float = 20.0) -> list[tuple[int, int, str]]:
    """Polls ``get_all_transfer_status(skip_waiting=True)`` until ``count`` finished results came
    (every query SUCCESS); returns them in the order they came."""
    got: list[tuple[int, int, str]] = []
    deadline = time.monotonic() + limit_s
    while len(got) < count and time.monotonic() <= deadline:
        ret, results = all_status(skip_waiting=True)
        assert ret == hixl.SUCCESS, ret
        assert all(name != "WAITING" for _, _, name in results), results
        got.extend(results)
        if len(got) < count:
            time.sleep(0.001)
    return got


def set_limit(name: str, value: int) -> int:
    """Sets this process's hixl module limit ``name`` (``MAX_PENDING_TRANSFERS``,
    ``ASYNC_TRANSFER_TIMEOUT_MS``: read at each call) to ``value``; returns the old value."""
    module = internals.hixl_module()
    old = getattr(module, name)
    setattr(module, name, value)
    return int(old)


def counts() -> dict[str, Any]:
    """What the engine keeps for async requests: ``requests`` (not yet reported), ``running`` (of
    those, the ones not ended), and, while it is initialized, ``in_flight`` (its pdlink engine's
    own transfers running) and ``links``."""
    h = _engine()
    engine = internals.hixl_engine(h)
    requests, running = internals.hixl_requests(h)
    out: dict[str, Any] = {"requests": requests, "running": running, "initialized": engine is not None}
    if engine is not None:
        out["in_flight"] = engine.role_state().transfers_in_flight
        out["links"] = len(engine.links())
    return out


def parallel_transfers(remote: str, op: str, batches: Sequence[Sequence[Desc]], timeout_ms: int = 10000) -> list[int]:
    """One thread per batch, all calling ``transfer_sync`` at once (released together); their codes."""
    codes: list[int | None] = [None] * len(batches)
    gate = threading.Barrier(len(batches))

    def run(i: int) -> None:
        gate.wait(10)
        codes[i] = transfer_sync(remote, op, batches[i], timeout_ms)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(c is not None for c in codes), codes
    return [int(c) for c in codes if c is not None]


# ---------------------------------------------------------------------------- notifications


def send_notify(remote: str, name: str, msg: str, timeout_ms: int = 5000) -> int:
    return int(_engine().send_notify(remote, hixl.NotifyDesc(name, msg), timeout_in_millis=timeout_ms))


def send_many(remote: str, count: int, timeout_ms: int = 5000) -> list[int]:
    """``count`` notifications ("n<i>", "m<i>"), one after another; every code, in order."""
    return [send_notify(remote, f"n{i}", f"m{i}", timeout_ms) for i in range(count)]


def notifies() -> tuple[int, list[tuple[str, str]]]:
    """``get_notifies()``: its code and ``(name, notify_msg)`` per notification."""
    ret, got = _engine().get_notifies()
    assert isinstance(got, list), type(got)
    assert all(isinstance(n, hixl.NotifyDesc) for n in got), got
    return int(ret), [(n.name, n.notify_msg) for n in got]


def wait_notifies(count: int, limit_s: float = 20.0) -> list[tuple[str, str]]:
    """Drains ``get_notifies()`` until ``count`` notifications came (or ``limit_s`` passed)."""
    got: list[tuple[str, str]] = []
    deadline = time.monotonic() + limit_s
    while len(got) < count and time.monotonic() <= deadline:
        ret, batch = notifies()
        assert ret == hixl.SUCCESS, ret
        got.extend(batch)
        if len(got) < count:
            time.sleep(0.001)
    return got


# ---------------------------------------------------------------------------- callers' code


def ray_read(remote: str, descs: Sequence[Desc], limit_s: float = 20.0) -> int:
    """Ray RDT ``HixlTensorTransport``'s receive (spec 11.3): ``connect`` (SUCCESS or
    ALREADY_CONNECTED, anything else raises), one ``transfer_async`` READ, then
    ``get_transfer_status`` every 1 ms: COMPLETED ends it, FAILED or TIMEOUT raise, a non-SUCCESS
    code raises, its own deadline raises TimeoutError. Returns connect's code."""
    engine = _engine()
    connected = int(engine.connect(remote, 5000))
    if connected not in (hixl.SUCCESS, hixl.ALREADY_CONNECTED):
        raise RuntimeError(f"connect returned {connected}")
    ret, req = engine.transfer_async(remote, hixl.TransferOp.READ, _descs(descs))
    if ret != hixl.SUCCESS:
        raise RuntimeError(f"transfer_async returned {ret}")
    deadline = time.monotonic() + limit_s
    while True:
        ret, state = engine.get_transfer_status(req)
        if ret != hixl.SUCCESS:
            raise RuntimeError(f"get_transfer_status returned {ret}")
        if state == hixl.TransferStatus.COMPLETED:
            return connected
        if state in (hixl.TransferStatus.FAILED, hixl.TransferStatus.TIMEOUT):
            raise RuntimeError(f"transfer {req} ended {state.name}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"transfer {req} still WAITING")
        time.sleep(0.001)


def ray_reconnect(remote: str) -> tuple[int, int]:
    """Ray after the remote's memory generation changed: ``disconnect`` then ``connect``."""
    return disconnect(remote), connect(remote)


def ray_shutdown() -> None:
    """Ray's shutdown: ``finalize()`` in try/except."""
    try:
        _engine().finalize()
    except Exception:  # noqa: BLE001 - Ray swallows it; the test checks the engine afterwards
        pass


def eplb_layer(transfers: Sequence[tuple[str, Sequence[Desc]]], limit_s: float = 30.0) -> list[str]:
    """One vllm-ascend EPLB layer (spec 11.4): one ``transfer_async`` READ per (source rank,
    descriptors), all outstanding together, then every request polled with
    ``get_transfer_status`` every 0.5 ms; anything but WAITING or COMPLETED (or a non-SUCCESS
    code) raises; its own deadline raises. Returns the final status of each request, in order."""
    engine = _engine()
    reqs = []
    for remote, descs in transfers:
        ret, req = engine.transfer_async(remote, hixl.TransferOp.READ, _descs(descs))
        if ret != hixl.SUCCESS or req == 0:
            raise RuntimeError(f"transfer_async to {remote} returned ({ret}, {req})")
        reqs.append(req)
    assert len(set(reqs)) == len(reqs), f"request ids repeat: {reqs}"
    final: dict[int, str] = {}
    deadline = time.monotonic() + limit_s
    while len(final) < len(reqs):
        for req in reqs:
            if req in final:
                continue
            ret, state = engine.get_transfer_status(req)
            if ret != hixl.SUCCESS or state not in (hixl.TransferStatus.WAITING, hixl.TransferStatus.COMPLETED):
                raise RuntimeError(f"get_transfer_status({req}) returned ({ret}, {state})")
            if state == hixl.TransferStatus.COMPLETED:
                final[req] = state.name
        if len(final) < len(reqs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(reqs) - len(final)} transfers still WAITING")
            time.sleep(0.0005)
    return [final[r] for r in reqs]


def eplb_close(remotes: Sequence[str]) -> dict[str, Any]:
    """EPLB's close: ``disconnect`` every peer (NOT_CONNECTED tolerated), ``deregister_mem`` every
    handle, ``finalize()`` (its result checked only if not None). Returns every code, and what
    finalize returned."""
    codes = [disconnect(r) for r in remotes]
    bad = [c for c in codes if c not in (hixl.SUCCESS, hixl.NOT_CONNECTED)]
    if bad:
        raise RuntimeError(f"disconnect returned {bad}")
    deregistered = deregister_all()
    result = _engine().finalize()
    if result is not None and result != hixl.SUCCESS:
        raise RuntimeError(f"finalize returned {result}")
    return {"disconnect": codes, "deregister": deregistered, "finalize": result}


def mooncake_transfer(remote: str, op: str, descs: Sequence[Desc], limit_s: float = 20.0) -> str:
    """Mooncake TENT's transfer (spec 11.5): ``transfer_async`` with no ``connect`` (AutoConnect),
    then ``get_transfer_status`` polled; on its own deadline it calls ``disconnect`` (NOT_CONNECTED
    tolerated). Returns the final state's name ("deadline" when it gave up)."""
    engine = _engine()
    ret, req = engine.transfer_async(remote, _op(op), _descs(descs))
    if ret != hixl.SUCCESS:
        raise RuntimeError(f"transfer_async returned ({ret}, {req})")
    deadline = time.monotonic() + limit_s
    while True:
        ret, state = engine.get_transfer_status(req)
        if ret != hixl.SUCCESS:
            raise RuntimeError(f"get_transfer_status returned ({ret}, {state})")
        if state != hixl.TransferStatus.WAITING:
            return str(state.name)
        if time.monotonic() > deadline:
            code = disconnect(remote, 1000)
            if code not in (hixl.SUCCESS, hixl.NOT_CONNECTED):
                raise RuntimeError(f"disconnect returned {code}")
            return "deadline"
        time.sleep(0.001)


def mooncake_teardown(remotes: Sequence[str]) -> dict[str, Any]:
    """Mooncake TENT's teardown: disconnect every remote first, then ``deregister_mem`` each handle,
    then ``finalize``. Returns every code."""
    codes = [disconnect(r, 1000) for r in remotes]
    deregistered = deregister_all()
    return {"disconnect": codes, "deregister": deregistered, "finalize": _engine().finalize()}
