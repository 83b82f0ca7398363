"""``hixl.Hixl`` on ``pdlink.Engine`` (docs/hixl.md; the reference is hixl_api.md §7-8).

Every runtime outcome is a status code, never an exception; argument-type mistakes raise
``TypeError`` as pybind11 would (``types.py``). The personality is hixl_cs's, the strict one: a
descriptor outside registered memory, on either side, gives PARAM_INVALID and moves nothing.

Threading: a ``Hixl`` may be used from several threads; ``initialize`` and ``finalize`` exclude
each other and everything else, and every blocking call runs without the GIL (in pdlink's engine).
"""

from __future__ import annotations

import collections
import secrets
import threading
import types
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ...engine import BatchTransfer, Engine, EngineOptions, MemoryMap, Pending, Region
from ...status import LLMException, LLMStatusCode
from .options import Identity, OptionError, Options, parse_identity, parse_options
from .types import (
    ALREADY_CONNECTED,
    FAILED,
    FEATURE_NOT_SUPPORTED,
    FEATURE_SUPPORTED,
    NOT_CONNECTED,
    PARAM_INVALID,
    RESOURCE_EXHAUSTED,
    SUCCESS,
    TIMEOUT,
    AsyncConnectStatus,
    FeatureType,
    GetTransferStatusArgs,
    MemDesc,
    MemType,
    NotifyDesc,
    TransferArgs,
    TransferOp,
    TransferOpDesc,
    TransferResult,
    TransferStatus,
    int32,
    member,
    text,
    transfer_result,
    uint,
)

MAX_NOTIFY_CHARS = 1024  # name and notify_msg, each
MAX_REGIONS = 65536  # registered regions per engine (CANN recommends at most about 4K)
MAX_PENDING_TRANSFERS = 65536  # async requests not yet reported finished, per engine
ASYNC_TRANSFER_TIMEOUT_MS = 120_000  # bounds each async transfer (it then reports FAILED)
AUTO_CONNECT_TIMEOUT_MS = 3000  # the implicit connect of transfer_async (CANN's value)

_NO_OPTIONS: Mapping[str, str] = types.MappingProxyType({})  # initialize's default: no options
_S = LLMStatusCode
_CODES = {_S.LLM_PARAM_INVALID: PARAM_INVALID, _S.LLM_TIMEOUT: TIMEOUT, _S.LLM_WAIT_PROCESS_TIMEOUT: TIMEOUT,
          _S.LLM_NOT_YET_LINK: NOT_CONNECTED, _S.LLM_ALREADY_LINK: ALREADY_CONNECTED,
          _S.LLM_LINK_BUSY: RESOURCE_EXHAUSTED, _S.LLM_CLUSTER_NUM_EXCEED_LIMIT: RESOURCE_EXHAUSTED}


def _code(e: Exception) -> int:
    """The hixl code of a pdlink error."""
    if isinstance(e, LLMException):
        return _CODES.get(e.status_code, FAILED)  # type: ignore[call-overload]
    return PARAM_INVALID if isinstance(e, ValueError) else FAILED


def get_capability(feature_type: FeatureType, /) -> tuple[int, int]:
    """Whether this hixl has ``feature_type``: ``(SUCCESS, FEATURE_SUPPORTED)`` for AUTO_CONNECT and
    CLIENT_SERVER_COMM, ``FEATURE_NOT_SUPPORTED`` for another, ``(PARAM_INVALID, 0)`` if negative."""
    member(feature_type, FeatureType, "feature_type")
    if feature_type < 0:
        return PARAM_INVALID, 0
    known = feature_type in (FeatureType.AUTO_CONNECT, FeatureType.CLIENT_SERVER_COMM)
    return SUCCESS, FEATURE_SUPPORTED if known else FEATURE_NOT_SUPPORTED


@dataclass
class _Mem:
    addr: int
    length: int
    mem_type: MemType
    region: Region


@dataclass
class _Request:
    remote: str
    peer: int
    pending: Pending
    user_data: int


def _descs(op_descs: Any) -> list[TransferOpDesc]:
    if not isinstance(op_descs, (list, tuple)) or not all(isinstance(d, TransferOpDesc) for d in op_descs):
        raise TypeError("incompatible function arguments: op_descs must be a list of hixl.TransferOpDesc")
    return list(op_descs)


class Hixl:
    """One hixl engine: ``initialize(local_engine, options)``, then register memory, connect and
    transfer; ``finalize()`` ends it (also when the object is collected)."""

    def __init__(self) -> None:
        self._state = threading.Condition()  # guards everything below; initialize/finalize hold it
        self._engine: Engine | None = None
        self._finalized = False
        self._identity = Identity("", 0)
        self._options = Options()
        self._mems: dict[int, _Mem] = {}  # handle -> registration
        self._next_handle = 1
        self._links: dict[str, int] = {}  # remote engine id -> its cluster id
        self._batches: dict[str, BatchTransfer] = {}  # remote engine id -> its link's descriptor lists
        self._remote_memory: dict[str, MemoryMap] = {}  # remote engine id -> its registered memory
        self._requests: collections.OrderedDict[int, _Request] = collections.OrderedDict()
        self._next_req = 1
        self._connect_pool: ThreadPoolExecutor | None = None
        self._connect_queue: dict[str, collections.deque[Callable[[], None]]] = {}  # per remote, in order
        self._queued = 0
        self._connect_status: dict[str, tuple[AsyncConnectStatus, int]] = {}  # remote -> (status, task seq)
        self._next_task = 1

    def __del__(self) -> None:
        try:
            self.finalize()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to report to
            pass

    # ------------------------------------------------------------------ lifetime

    def initialize(self, local_engine: str, options: Mapping[str, str] = _NO_OPTIONS) -> int:
        """Starts the engine: ``local_engine`` is ``"ip:port"`` (listens there when port > 0) or
        ``"ip"`` (dials only). SUCCESS again when already initialized."""
        engine_id = text(local_engine, "local_engine")
        if not isinstance(options, dict) and options is not _NO_OPTIONS:
            raise TypeError("incompatible function arguments: options must be a dict of str to str")
        opts = {text(k, "an option key"): text(v, "an option value") for k, v in options.items()}
        with self._state:
            if self._engine is not None:
                return SUCCESS
            if self._finalized:
                return FAILED
            try:
                identity, parsed = parse_identity(engine_id), parse_options(opts)
            except OptionError as e:
                return e.code
            listen = identity.address if identity.port > 0 else None
            try:
                # Links are keyed by cluster id in pdlink; hixl engines have none, so each takes a
                # random one (a client-only id such as "127.0.0.1:0" is not unique). As in CANN, a
                # link belongs to the engine that opened it: C->S and S->C are two links, and a
                # disconnect ends only its own (one_way_links).
                self._engine = Engine(EngineOptions(cluster_id=secrets.randbits(62), listen=listen, one_way_links=True))
            except Exception as e:  # noqa: BLE001 - a code, as hixl reports it (port in use, say)
                return _code(e) if _code(e) != PARAM_INVALID else FAILED
            self._identity, self._options = identity, parsed
            return SUCCESS

    def finalize(self) -> None:
        """Disconnects every link, releases all memory and the engine. Idempotent. Async requests
        still running are cancelled first (as CANN's finalize aborts them) and have stopped when
        this returns; they are forgotten (every later call is FAILED)."""
        with self._state:
            engine, self._engine = self._engine, None
            if engine is None:
                return
            self._finalized = True
            pool, self._connect_pool = self._connect_pool, None
            self._links.clear()
            self._batches.clear()
            self._remote_memory.clear()
            stopped = self._cancel_requests(None)
            busy = {r.peer for r in stopped}  # links with a request still running
            self._mems.clear()
            self._connect_queue.clear()
            self._connect_status.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for peer in busy:  # a cancelled request waits for nothing more once its link is gone
            self._drop(engine, peer, AUTO_CONNECT_TIMEOUT_MS)
        self._wait_stopped(stopped)
        engine.close()  # tells the other peers, as before

    def _live(self) -> Engine | None:
        with self._state:
            return self._engine

    # ------------------------------------------------------------------ memory

    def register_mem(self, mem_desc: MemDesc, mem_type: MemType, /) -> tuple[int, int]:
        """Registers ``mem_desc``; ``(SUCCESS, handle)``, the same handle for the same range again,
        ``(PARAM_INVALID, 0)`` for a null, empty, wrapping or partly overlapping range."""
        if not isinstance(mem_desc, MemDesc):
            raise TypeError("incompatible function arguments: mem_desc must be hixl.MemDesc")
        member(mem_type, MemType, "mem_type")
        addr, length = mem_desc.addr, mem_desc.len
        with self._state:
            engine = self._engine
            if engine is None:
                return FAILED, 0
            if addr == 0 or length == 0 or addr + length > 1 << 64:
                return PARAM_INVALID, 0
            for handle, m in self._mems.items():
                if m.mem_type != mem_type or addr >= m.addr + m.length or m.addr >= addr + length:
                    continue
                return (SUCCESS, handle) if (m.addr, m.length) == (addr, length) else (PARAM_INVALID, 0)
            if len(self._mems) >= MAX_REGIONS:
                return RESOURCE_EXHAUSTED, 0
            device = mem_type == MemType.MEM_DEVICE and engine.capabilities()["device_memory"]
            try:
                region = engine.register(address=addr, length=length, placement="DEVICE" if device else "HOST",
                                         remote_writable=not mem_desc.local_only)
            except Exception as e:  # noqa: BLE001 - reported as a code
                return _code(e), 0
            handle, self._next_handle = self._next_handle, self._next_handle + 1
            self._mems[handle] = _Mem(addr, length, mem_type, region)
            return SUCCESS, handle

    def deregister_mem(self, mem_handle: int, /) -> int:
        """Releases a registration (transfers in flight finish first). A handle never returned, or
        released already: SUCCESS. Handle 0: PARAM_INVALID."""
        handle = uint(mem_handle, 64, "mem_handle")
        with self._state:
            engine = self._engine
            if engine is None:
                return FAILED
            if handle == 0:
                return PARAM_INVALID
            m = self._mems.pop(handle, None)
        if m is not None:
            engine.deregister(m.region)
        return SUCCESS

    # ------------------------------------------------------------------ links

    def _check_remote(self, remote_engine: Any, timeout: Any) -> tuple[str, int]:
        return text(remote_engine, "remote_engine"), int32(timeout, "timeout_in_millis")

    def _dial(self, engine: Engine, remote: str, timeout: int) -> int:
        """Links to ``remote`` (SUCCESS, ALREADY_CONNECTED or the failure's code)."""
        try:
            identity = parse_identity(remote)
        except OptionError as e:
            return e.code
        if identity.port == 0 or identity == self._identity:
            return PARAM_INVALID  # a client-only engine, or this one
        with self._state:
            if remote in self._links:
                return ALREADY_CONNECTED
        try:
            peer = engine.connect(identity.address, timeout_ms=timeout)
        except Exception as e:  # noqa: BLE001 - reported as a code
            code = _code(e)
            return FAILED if code == PARAM_INVALID else code
        try:
            # as hixl_cs: the remote's memory list is fetched when the link is made, so an async
            # submission checks its ranges without a round trip (and fetches again on a miss)
            memory: MemoryMap | None = engine.remote_memory(peer, timeout_ms=timeout)
        except Exception:  # noqa: BLE001 - fetched on first use instead
            memory = None
        with self._state:
            if self._engine is not engine:
                return FAILED  # finalized meanwhile (the engine's close dropped the link)
            if remote in self._links:  # a concurrent connect won
                return ALREADY_CONNECTED
            self._links[remote] = peer
            self._batches[remote] = engine.batch(peer)
            if memory is not None:
                self._remote_memory[remote] = memory
        return SUCCESS

    def connect(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        """Links this engine to the listening engine ``remote_engine``: SUCCESS, ALREADY_CONNECTED,
        PARAM_INVALID (timeout <= 0, a malformed id, this engine), else TIMEOUT or FAILED."""
        remote, timeout = self._check_remote(remote_engine, timeout_in_millis)
        engine = self._live()
        if engine is None:
            return FAILED
        if timeout <= 0:
            return PARAM_INVALID
        return self._dial(engine, remote, timeout)

    def disconnect(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        """Drops the link to ``remote_engine`` (SUCCESS also when the peer is gone: it is dropped
        here); NOT_CONNECTED without one. Its outstanding async requests are forgotten (a later
        query is PARAM_INVALID) and those still running are cancelled: they have stopped when this
        returns (docs/hixl.md, "Async requests")."""
        remote, timeout = self._check_remote(remote_engine, timeout_in_millis)
        engine = self._live()
        if engine is None:
            return FAILED
        if timeout <= 0:
            return PARAM_INVALID
        try:
            parse_identity(remote)
        except OptionError as e:
            return e.code
        with self._state:
            peer = self._links.pop(remote, None)
            self._batches.pop(remote, None)
            self._remote_memory.pop(remote, None)
            if peer is None:
                return NOT_CONNECTED
            stopped = self._cancel_requests(remote)
        code = self._drop(engine, peer, timeout)
        self._wait_stopped(stopped)
        return code

    def _cancel_requests(self, remote: str | None) -> list[_Request]:
        """Forgets the async requests to ``remote`` (None: all) and cancels each still running
        (``Pending.cancel``: it stops at its next cancel point); returns those. Called
        with ``_state`` held: a cancel waits for nothing. CANN's disconnect and finalize do the same:
        the client's requests leave its index (``ClientManager::EraseReqIndexByClient``, then a
        query is PARAM_INVALID) and its transfers are aborted (``HixlCSClient::Destroy``)."""
        gone = [rid for rid, r in self._requests.items() if remote is None or r.remote == remote]
        stopped = []
        for rid in gone:
            request = self._requests.pop(rid)
            if request.pending.cancel():  # False: it had ended already
                stopped.append(request)
        return stopped

    @staticmethod
    def _wait_stopped(stopped: list[_Request]) -> None:
        """Waits until each cancelled request has stopped (after its link was dropped, at once: the
        request it had in flight fails with the link), so that nothing lands in, or is read from,
        memory the caller frees next. Each is bounded by ASYNC_TRANSFER_TIMEOUT_MS anyway."""
        for request in stopped:
            try:
                request.pending.wait(ASYNC_TRANSFER_TIMEOUT_MS / 1000)
            except Exception:  # noqa: BLE001 - cancelled or failed: stopped either way
                pass

    @staticmethod
    def _drop(engine: Engine, peer: int, timeout: int) -> int:
        try:
            engine.disconnect(peer, timeout_ms=timeout, force=True)
        except Exception as e:  # noqa: BLE001 - reported as a code
            code = _code(e)
            return SUCCESS if code == NOT_CONNECTED else code
        return SUCCESS

    def _tear_down(self, engine: Engine, remote: str) -> None:
        """AutoConnect: after an error the link goes, and the next transfer makes a new one."""
        with self._state:
            peer = self._links.pop(remote, None)
            self._batches.pop(remote, None)
            self._remote_memory.pop(remote, None)
            stopped = self._cancel_requests(remote) if peer is not None else []
        if peer is not None:
            self._drop(engine, peer, AUTO_CONNECT_TIMEOUT_MS)
            self._wait_stopped(stopped)

    # ------------------------------------------------------------------ async connect

    def _submit_connect(self, remote_engine: Any, timeout_in_millis: Any, connect: bool) -> int:
        remote, timeout = self._check_remote(remote_engine, timeout_in_millis)
        with self._state:
            engine = self._engine
            if engine is None:
                return FAILED
            if timeout <= 0:
                return PARAM_INVALID
            if self._queued >= self._options.connect_queue:
                return RESOURCE_EXHAUSTED
            seq, self._next_task = self._next_task, self._next_task + 1
            pending = AsyncConnectStatus.CONNECT_PENDING if connect else AsyncConnectStatus.DISCONNECT_PENDING
            self._connect_status[remote] = (pending, seq)
            self._queued += 1
            queue = self._connect_queue.setdefault(remote, collections.deque())
            queue.append(lambda: self._run_connect(engine, remote, timeout, connect, seq))
            if len(queue) == 1:  # nothing of this remote runs: start its chain
                if self._connect_pool is None:
                    self._connect_pool = ThreadPoolExecutor(self._options.connect_threads,
                                                            thread_name_prefix="hixl-connect")
                self._connect_pool.submit(self._drain, remote)
        return SUCCESS

    def _drain(self, remote: str) -> None:
        # One remote's tasks run one at a time, in submission order; other remotes' run in parallel.
        while True:
            with self._state:
                queue = self._connect_queue.get(remote)
                if not queue:
                    return
                task = queue[0]
            task()
            with self._state:
                self._queued -= 1
                queue.popleft()
                if not queue:
                    self._connect_queue.pop(remote, None)
                    return

    def _set_status(self, remote: str, seq: int, status: AsyncConnectStatus | None) -> None:
        """The status of ``remote``, unless a newer task was submitted since ``seq`` (None: removed)."""
        with self._state:
            current = self._connect_status.get(remote)
            if current is None or current[1] != seq:
                return
            if status is None:
                del self._connect_status[remote]
            else:
                self._connect_status[remote] = (status, seq)

    def _run_connect(self, engine: Engine, remote: str, timeout: int, connect: bool, seq: int) -> None:
        if connect:
            self._set_status(remote, seq, AsyncConnectStatus.CONNECTING)
            ok = self._dial(engine, remote, timeout) in (SUCCESS, ALREADY_CONNECTED)
            self._set_status(remote, seq, AsyncConnectStatus.CONNECTED if ok else AsyncConnectStatus.CONNECT_FAILED)
        else:
            self._set_status(remote, seq, AsyncConnectStatus.DISCONNECTING)
            self.disconnect(remote, timeout)
            self._set_status(remote, seq, None)

    def connect_async(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        """Queues a connect (SUCCESS), RESOURCE_EXHAUSTED when the task queue is full; follow it
        with ``get_async_connect_status``."""
        return self._submit_connect(remote_engine, timeout_in_millis, True)

    def disconnect_async(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        return self._submit_connect(remote_engine, timeout_in_millis, False)

    def get_async_connect_status(self, remote_engine: str, /) -> tuple[int, AsyncConnectStatus]:
        remote = text(remote_engine, "remote_engine")
        with self._state:
            if self._engine is None:
                return FAILED, AsyncConnectStatus.NOT_CONNECT
            return SUCCESS, self._connect_status.get(remote, (AsyncConnectStatus.NOT_CONNECT, 0))[0]

    def get_all_async_connect_status(self) -> tuple[int, dict[str, AsyncConnectStatus]]:
        with self._state:
            if self._engine is None:
                return FAILED, {}
            return SUCCESS, {r: s for r, (s, _) in self._connect_status.items()}

    # ------------------------------------------------------------------ transfers

    def _prepare(self, remote_engine: Any, op: Any, op_descs: Any, connect_timeout: int | None
                 ) -> tuple[int, Engine | None, int, list[int], list[int], list[int]]:
        """The checks of a transfer, in hixl_cs's order: ``(code, engine, peer, local addresses,
        remote addresses, lengths)``. The checks of every range (inside registered memory, not
        empty, not wrapping) are the engine's and the peer's, on the whole list before a byte
        moves."""
        if type(remote_engine) is not str:
            remote_engine = text(remote_engine, "remote_engine")
        if type(op) is not TransferOp:
            member(op, TransferOp, "op")
        if type(op_descs) is not list and type(op_descs) is not tuple:
            raise TypeError("incompatible function arguments: op_descs must be a list of hixl.TransferOpDesc")
        if len(op_descs) == 1:  # the small transfer whose latency counts: no comprehension machinery
            d = op_descs[0]
            if type(d) is not TransferOpDesc:
                raise TypeError("incompatible function arguments: op_descs must hold hixl.TransferOpDesc only")
            local, remote, lengths = [d.local_addr], [d.remote_addr], [d.len]
        else:
            for d in op_descs:
                if type(d) is not TransferOpDesc:
                    raise TypeError("incompatible function arguments: op_descs must hold hixl.TransferOpDesc only")
            local = [d.local_addr for d in op_descs]
            remote = [d.remote_addr for d in op_descs]
            lengths = [d.len for d in op_descs]
        engine = self._engine
        if engine is None:
            return FAILED, None, 0, [], [], []
        if connect_timeout is not None and connect_timeout <= 0:
            return PARAM_INVALID, None, 0, [], [], []
        if 0 in local or 0 in remote:
            return PARAM_INVALID, None, 0, [], [], []
        peer = self._links.get(remote_engine)
        if peer is None:
            if not self._options.auto_connect:
                return NOT_CONNECTED, None, 0, [], [], []
            code = self._dial(engine, remote_engine, connect_timeout or AUTO_CONNECT_TIMEOUT_MS)
            peer = self._links.get(remote_engine)
            if peer is None:
                return code, None, 0, [], [], []
        if not op_descs:
            return PARAM_INVALID, None, 0, [], [], []
        return SUCCESS, engine, peer, local, remote, lengths

    def transfer_sync(self, remote_engine: str, op: TransferOp, op_descs: list[TransferOpDesc],
                      timeout_in_millis: int = 1000) -> int:
        """Moves every descriptor (READ: remote -> local, WRITE: local -> remote) and returns when
        done: SUCCESS; PARAM_INVALID (nothing moved) for a bad descriptor, one outside registered
        memory here or at the peer, or a timeout <= 0; NOT_CONNECTED; TIMEOUT; FAILED."""
        # The common small call (one descriptor of the right types with non-null addresses, a
        # positive int timeout, a remote this engine is linked to) passes every check of the general
        # path below: it goes to the link's batch handle at once, the latency that counts.
        batch = self._batches.get(remote_engine) if type(remote_engine) is str else None
        if (batch is not None and type(op) is TransferOp and type(op_descs) is list and len(op_descs) == 1
                and type(timeout_in_millis) is int and 0 < timeout_in_millis < 2**31):
            d = op_descs[0]
            if type(d) is TransferOpDesc and d.local_addr and d.remote_addr:
                try:
                    (batch.write if op is TransferOp.WRITE else batch.read)(
                        [d.local_addr], [d.remote_addr], [d.len], timeout_in_millis)
                except Exception as e:  # noqa: BLE001 - reported as a code
                    return self._failed(e, remote_engine)
                return SUCCESS
        timeout = timeout_in_millis if type(timeout_in_millis) is int else int32(timeout_in_millis, "timeout")
        if not -2**31 <= timeout < 2**31:
            int32(timeout, "timeout_in_millis")
        code, engine, peer, local, remote, lengths = self._prepare(remote_engine, op, op_descs, timeout)
        if code != SUCCESS or engine is None:
            return code
        move = engine.write_batch if op is TransferOp.WRITE else engine.read_batch
        try:
            move(peer, local, remote, lengths, timeout_ms=timeout)
        except Exception as e:  # noqa: BLE001 - reported as a code
            return self._failed(e, text(remote_engine, "remote_engine"))
        return SUCCESS

    def _failed(self, error: Exception, remote: str) -> int:
        """A transfer's error as its code; with AutoConnect the link goes too (hixl_cs)."""
        engine = self._engine
        if self._options.auto_connect and engine is not None:
            self._tear_down(engine, remote)
        return _code(error)

    def transfer_async(self, remote_engine: str, op: TransferOp, op_descs: list[TransferOpDesc],
                       args: TransferArgs | None = None) -> tuple[int, int]:
        """Starts the transfer and returns ``(SUCCESS, req)`` (req non-zero), or ``(code, 0)`` as
        ``transfer_sync`` would refuse it (a local range outside registered memory included). A
        remote range the peer refuses makes the request FAILED."""
        extra = TransferArgs() if args is None else args
        if not isinstance(extra, TransferArgs):
            raise TypeError("incompatible function arguments: args must be hixl.TransferArgs")
        remote_id = text(remote_engine, "remote_engine")
        code, engine, peer, local, remote, lengths = self._prepare(remote_id, op, op_descs, None)
        if code != SUCCESS or engine is None:
            return code, 0
        if 0 in lengths or not engine.local_memory().covers(local, lengths):
            return PARAM_INVALID, 0
        code = self._check_remote_ranges(engine, remote_id, peer, remote, lengths)
        if code != SUCCESS:
            return code, 0
        with self._state:
            if len(self._requests) >= MAX_PENDING_TRANSFERS:
                return RESOURCE_EXHAUSTED, 0
            req, self._next_req = self._next_req, self._next_req + 1
            submit = engine.write_batch_async if op == TransferOp.WRITE else engine.read_batch_async
            pending = submit(peer, local, remote, lengths, timeout_ms=ASYNC_TRANSFER_TIMEOUT_MS)
            self._requests[req] = _Request(remote_id, peer, pending, extra.user_data)
        return SUCCESS, req

    def _check_remote_ranges(self, engine: Engine, remote: str, peer: int, addresses: list[int],
                             lengths: list[int]) -> int:
        """hixl_cs checks an async batch against the remote's registered memory at submission: so
        does this, against the peer's memory map, fetched once per link and again on a miss (the
        peer may have registered more since). The peer checks every transfer again itself."""
        for attempt in range(2):
            with self._state:
                known = self._remote_memory.get(remote)
            if known is None or attempt:
                try:
                    known = engine.remote_memory(peer, timeout_ms=AUTO_CONNECT_TIMEOUT_MS)
                except Exception as e:  # noqa: BLE001 - reported as a code
                    return _code(e)
                with self._state:
                    self._remote_memory[remote] = known
            if known.covers(addresses, lengths):
                return SUCCESS
        return PARAM_INVALID

    def _finish(self, req: int, r: _Request) -> TransferStatus:
        """A request's status; a finished one is forgotten (reported once)."""
        if not r.pending.done():
            return TransferStatus.WAITING
        del self._requests[req]
        failed = r.pending.error() is not None
        if failed and self._options.auto_connect and self._engine is not None:
            engine = self._engine
            threading.Thread(target=self._tear_down, args=(engine, r.remote), daemon=True).start()
        return TransferStatus.FAILED if failed else TransferStatus.COMPLETED

    def get_transfer_status(self, req: int, /) -> tuple[int, TransferStatus]:
        """``(SUCCESS, WAITING | COMPLETED | FAILED)``; a request reported finished once, or never
        made, is ``(PARAM_INVALID, FAILED)``; req 0 is ``(FAILED, FAILED)``."""
        rid = uint(req, 64, "req")
        with self._state:
            if self._engine is None or rid == 0:
                return FAILED, TransferStatus.FAILED
            r = self._requests.get(rid)
            if r is None:
                return PARAM_INVALID, TransferStatus.FAILED
            return SUCCESS, self._finish(rid, r)

    def get_all_transfer_status(self, args: GetTransferStatusArgs | None = None) -> tuple[int, list[TransferResult]]:
        """The outstanding requests in submission order, each finished one reported once."""
        query = GetTransferStatusArgs() if args is None else args
        if not isinstance(query, GetTransferStatusArgs):
            raise TypeError("incompatible function arguments: args must be hixl.GetTransferStatusArgs")
        out: list[TransferResult] = []
        with self._state:
            if self._engine is None:
                return FAILED, []
            for rid, r in list(self._requests.items()):
                if len(out) >= query.max_query_count:
                    break
                status = self._finish(rid, r)
                if status == TransferStatus.WAITING and query.skip_waiting:
                    continue
                out.append(transfer_result(rid, r.user_data, status))
        return SUCCESS, out

    # ------------------------------------------------------------------ notifications

    def send_notify(self, remote_engine: str, notify: NotifyDesc, timeout_in_millis: int = 1000) -> int:
        """Sends ``notify`` over this engine's link to ``remote_engine`` and waits until the peer
        queued it: SUCCESS, PARAM_INVALID (timeout <= 0, a field over 1024 characters),
        NOT_CONNECTED (no link: this does not auto-connect), TIMEOUT, RESOURCE_EXHAUSTED (the
        peer's queue for this link is full)."""
        remote, timeout = self._check_remote(remote_engine, timeout_in_millis)
        if not isinstance(notify, NotifyDesc):
            raise TypeError("incompatible function arguments: notify must be hixl.NotifyDesc")
        engine = self._live()
        if engine is None:
            return FAILED
        if timeout <= 0 or len(notify.name) > MAX_NOTIFY_CHARS or len(notify.notify_msg) > MAX_NOTIFY_CHARS:
            return PARAM_INVALID
        with self._state:
            peer = self._links.get(remote)
        if peer is None:
            return NOT_CONNECTED
        try:
            engine.notify(peer, notify.notify_msg.encode("utf-8", errors="surrogateescape"),
                          name=notify.name.encode("utf-8", errors="surrogateescape"), timeout_ms=timeout)
        except Exception as e:  # noqa: BLE001 - reported as a code
            return _code(e)
        return SUCCESS

    def get_notifies(self) -> tuple[int, list[NotifyDesc]]:
        """Takes every notification peers sent over the links they opened to this engine."""
        engine = self._live()
        if engine is None:
            return FAILED, []
        got = engine.notifications()
        return SUCCESS, [NotifyDesc(n.name.decode("utf-8", errors="surrogateescape"),
                                    n.message.decode("utf-8", errors="surrogateescape")) for n in got]


__all__ = ["Hixl", "get_capability"]
