"""The instance a ``pdlink serve`` process manages: one native engine per local device, the
role-assignment worker, per-peer link jobs, and the status MindIE's controller polls.

Flow of a role assignment (``POST /v1/role/{role}``):

1. ``Node.accept`` (in the request, serialised by the caller): checks what only this instance can
   judge (``Unavailable``, answered 503, leaves the state untouched), records the request as the
   desired state, sets ``RoleSwitching`` and wakes the worker. The reply (200) follows at once.
2. The worker thread (one, so assignments are applied in order; when several posts queue up only
   the latest is applied, which is equivalent because every application diffs against the live
   engines) applies it:

   * first assignment: create the engines (cluster id from ``local``, see
     ``validation.cluster_id``), register the test KV caches when enabled;
   * unlink the peers that are no longer listed, or whose addresses changed;
   * when the role or the local listen addresses change: stop every link job, unlink every
     peer (``switch_role(..., require_no_links=True)`` refuses while links exist), then ``switch_role`` each engine; a
     ``prefill`` or ``flex`` engine listens at ``<listen ip>:<listenPortBase + device id>``, a
     ``decode`` engine does not listen;
   * start a link job for every listed peer that is not linked on every device.

3. A link job links device ``i`` to the peer's device ``i``. Exactly one side dials: a node that
   does not listen (decode) dials; a listening node dials only peers with a lower cluster id and
   otherwise waits for the peer to link in. ``LLM_ALREADY_LINK`` (the peer linked in) counts as
   linked. Attempts repeat every ``linkRetryIntervalMs`` until every device is linked or
   ``linkTotalTimeMs`` passes; then the peer is reported ``failed : <reason>`` (not fatal).

Status: a peer is ``ok`` while every device holds a live (not broken) link to it, computed from
the engines at each read. ``RoleReady`` is reached when the latest assignment is applied, no job
is running and there is no peer or at least one ``ok`` peer; it then stays until the next post
(as MindIE). If applying fails (e.g. a listen port is taken) the role status is ``RoleUnknown``
and ``pdlink.lastError`` says why, so a controller posts again.

Role epoch and phase (issue 34; the routes are in ``app.py``, the table in docs/server.md):

* ``epoch`` starts at 0 and grows by 1 each time the engines' role changes and the change is
  committed (the first role counts: ``none`` -> ``decode`` is epoch 1), whichever route asked for
  it. A post that only changes peers, a post that is coalesced away, a post that fails and one
  that is rolled back leave it as it was. ``generation`` counts accepted posts, so
  ``epoch <= appliedGeneration <= generation``.
* ``phase`` is ``ready`` (nothing pending), ``draining`` (a fenced switch waits for the node's
  own transfers, admitting none), ``switching`` (the worker applies a role change), ``rolling_back``
  (the drain timed out: the old role and epoch are restored; admission opens again once the
  transfers the drain waited for have ended, each bounded by ``syncKvTimeoutMs``) or ``failed``
  (applying failed part way: the role is uncertain and stays so until the next post, of any
  shape, is applied).
* A **fenced** switch is one that names the epoch it expects (``expected_epoch`` in MindIE's
  body, vLLM's ``POST /v1/pd_role``, or SGLang's ``POST /pd_role_switch``, which is fenced at the
  epoch it found). It is accepted only when nothing else is pending and the epoch matches
  (``Conflict`` otherwise, nothing changed), so of two controllers with the same expected epoch
  exactly one wins. It is never coalesced: until it has committed or rolled back, every other
  post is refused (a fenced one with ``Conflict``, MindIE's unfenced one with ``Unavailable``).
  It drains first: no new test pull is admitted, the ones in flight finish, for at most its
  drain timeout (``KvTransferConfig.roleDrainTimeoutMs`` unless the post names one); past it the
  switch rolls back. The worker runs it whether or not the caller is still there.
* MindIE's unfenced post works as it always did (no drain, coalescing); its application of a
  role change is shown as ``switching`` and counts in the epoch like any other.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from ..engine import Engine, EngineOptions, Region, RemoteRegion
from ..status import LLMException, LLMStatusCode
from .config import Settings
from .roles import ROLES
from .validation import NodeInfo, RoleRequest

__all__ = ["Node", "Unavailable", "Conflict", "NotEnabled", "Fenced", "PHASES", "kv_pattern"]

logger = logging.getLogger("pdlink.server")

_SWITCH_ATTEMPTS = 5


class Unavailable(Exception):
    """The assignment cannot be applied by this instance (HTTP 503); nothing was changed."""


class Conflict(Exception):
    """A fenced switch refused (HTTP 409; SGLang's route: 400): ``reason`` is ``"stale_epoch"``
    (the expected epoch is not the instance's), ``"in_progress"`` (another switch is pending) or
    ``"no_role"`` (a route that names only a role, before any assignment). Nothing was changed."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class NotEnabled(Exception):
    """Runtime role switching is off: ``ServerConfig.inferMode`` is ``standard`` (HTTP 404, as
    vLLM answers when its switching is not enabled)."""


class Fenced(Exception):
    """A test pull refused while a role switch is draining, switching or rolling back (HTTP 409)."""


PHASES = ("ready", "draining", "switching", "rolling_back", "failed")
_FENCED_PHASES = ("draining", "switching", "rolling_back")  # no new transfer is admitted


def kv_pattern(np: Any, cluster: int, device: int, num_tensors: int, num_blocks: int, block_bytes: int) -> list[Any]:
    """The known content of the test KV cache of ``cluster``'s device ``device``: one
    ``(num_blocks, block_bytes)`` uint8 array per tensor."""
    base = np.arange(num_blocks * block_bytes, dtype=np.uint64).reshape(num_blocks, block_bytes)
    salt = (cluster % 1_000_003) * 7919 + device * 104729
    return [(((base * 2654435761 + t * 97 + salt) >> 7) & 0xFF).astype(np.uint8) for t in range(num_tensors)]


def _address(listen: tuple[tuple[str, int], ...], i: int) -> tuple[str, int] | None:
    """Device ``i``'s ``(ip, port)`` in ``listen``, None when it does not listen."""
    return (listen[i][0], listen[i][1]) if listen else None


def _disconnect(engine: Engine, cid: int, timeout_ms: int, force: bool) -> None:
    """Drops the link to ``cid`` if there is one; other failures are logged (the link is gone
    locally either way)."""
    try:
        engine.disconnect(cid, timeout_ms=timeout_ms, force=force)
    except LLMException as e:
        if e.status_code != LLMStatusCode.LLM_NOT_YET_LINK:
            logger.info("unlinking %d: %s", cid, e)


class _NullMetrics:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


@dataclass(frozen=True)
class _TestKv:
    """One device's test KV cache: the pattern it serves and the arrays pulls land in."""

    src: list[Any]
    dst: list[Any]
    src_region: Region
    dst_region: Region


@dataclass(frozen=True)
class _PeerPlan:
    cluster_id: int
    server_ip: str
    addresses: tuple[tuple[str, int], ...]  # the peer's listen address per device


@dataclass(frozen=True)
class _Plan:
    role: str
    cluster_id: int
    listen: tuple[tuple[str, int], ...]  # this node's listen address per device (used when the role listens)
    device_ids: tuple[str, ...]
    peers: dict[int, _PeerPlan]
    p_percentage: int | None


@dataclass
class _Fence:
    """One fenced switch, from its acceptance until it commits, fails or has rolled back."""

    gen: int  # the generation it was accepted as
    expected_epoch: int
    drain_s: float
    target_role: str
    old_role: str | None  # what a rollback restores
    old_p_percentage: int | None
    old_desired: _Plan | None
    old_role_status: str
    outcome: str | None = None  # "committed" | "failed" | "rolled_back"
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


class _LinkJob:
    """Links one peer on every device (see the module docstring); runs on its own thread."""

    def __init__(self, node: Node, peer: _PeerPlan, dial: bool):
        self.node, self.peer, self.dial = node, peer, dial
        self.cancel = threading.Event()
        self.state = "linking"  # -> "ok" | "failed" | "cancelled"
        self.reason = ""
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"pdlink-link-{peer.cluster_id}")

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            self._link()
        except Exception as e:  # noqa: BLE001 - e.g. the engines were finalised under us
            self.reason = f"{type(e).__name__}: {e}"
            self.state = "failed"
            logger.warning("peer %d: link job failed: %s", self.peer.cluster_id, self.reason)
        try:
            self.node._evaluate()
        except Exception:  # noqa: BLE001 - shutting down
            pass

    def _link(self) -> None:
        node, cid = self.node, self.peer.cluster_id
        kv = node.settings.kv
        engines = node._engines
        deadline = time.monotonic() + kv.link_total_time_ms / 1000.0
        linked = [False] * len(engines)
        last = [""] * len(engines)
        last_code = "LLM_LINK_FAILED"
        while not self.cancel.is_set():
            for i, engine in enumerate(engines):
                if linked[i] or self.cancel.is_set():
                    continue
                live, broken = _link_state(engine, cid)
                if live:
                    linked[i] = True
                    continue
                if broken:  # a dead entity from earlier: drop it locally before linking again
                    _disconnect(engine, cid, kv.link_timeout_ms, True)
                if not self.dial:
                    last[i] = "the peer did not link in (a listening node waits for peers that dial it)"
                    continue
                ip, port = self.peer.addresses[i]
                try:
                    engine.connect((ip, port), cluster_id=cid, timeout_ms=kv.link_timeout_ms)
                    linked[i] = True
                except LLMException as e:
                    code = cast(LLMStatusCode, e.status_code)
                    if code == LLMStatusCode.LLM_ALREADY_LINK:  # the peer linked in meanwhile
                        linked[i] = True
                    elif code != LLMStatusCode.LLM_PROCESSING_LINK:
                        last_code = code.name
                        last[i] = f"{last_code}: {e}"
            if all(linked):
                self.state = "ok"
                with node._lock:
                    node._ever_ok.add(cid)
                break
            if time.monotonic() >= deadline:
                self.reason = "; ".join(
                    (f"device {i}: {r}" if len(engines) > 1 else r) for i, r in enumerate(last) if not linked[i])
                self.state = "failed"
                node._metrics.link_failed(last_code if self.dial else "LLM_NOT_YET_LINK")
                logger.warning("peer %d: link failed: %s", cid, self.reason)
                break
            self.cancel.wait(kv.link_retry_interval_ms / 1000.0)
        else:
            self.state = "cancelled"
        if self.state == "ok":
            logger.info("peer %d linked on %d device(s)", cid, len(engines))


def _link_state(engine: Engine, cid: int) -> tuple[bool, bool]:
    """(a live link to ``cid`` exists, a broken one exists)."""
    live = broken = False
    for link in engine.links():
        if link.peer_cluster_id == cid:
            if link.broken:
                broken = True
            else:
                live = True
    return live, broken


class Node:
    """State of one managed instance; thread-safe. ``metrics`` (optional) receives events."""

    def __init__(self, settings: Settings, metrics: Any = None):
        self.settings = settings
        self._metrics = metrics if metrics is not None else _NullMetrics()
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._engines: list[Engine] = []
        self._cluster_id: int | None = None  # of the engines, once created
        self._identity: int | None = None  # cluster id of the accepted posts
        self._role: str | None = None  # the latest accepted role
        self._p_percentage: int | None = None
        self._role_status = "RoleUnknown" if settings.infer_mode == "dmi" else "RoleReady"
        self._generation = 0
        self._applied = 0
        self._desired: _Plan | None = None
        self._engine_role: str | None = None  # applied on the engines
        self._listening: tuple[tuple[str, int], ...] = ()  # applied listen addresses (empty: not listening)
        self._device_ids: tuple[str, ...] = ()
        self._peers: dict[int, _PeerPlan] = {}  # the applied peer list
        self._jobs: dict[int, _LinkJob] = {}
        self._ever_ok: set = set()
        self._last_error: str | None = None
        self._stopping = False
        self._kv_lock = threading.Lock()
        self._test_kv: list[_TestKv] = []
        self._epoch = 0
        self._phase = "ready"
        self._phase_error: str | None = None  # why the last transition failed or rolled back
        self._target_role: str | None = None  # of the latest transition
        self._transition_started: float | None = None
        self._transition_seconds: float | None = None
        self._fence: _Fence | None = None
        self._good_plan: _Plan | None = None  # the latest plan applied without an error
        self._busy = 0  # test pulls admitted and not yet ended
        self._idle = threading.Condition(self._lock)  # notified when _busy drops
        self._handoff_counts = {"released": 0, "aborted": 0}  # handoff events taken from the engines
        self._handoff_stop = threading.Event()
        self._worker = threading.Thread(target=self._run, daemon=True, name="pdlink-role-worker")
        self._worker.start()
        self._handoff_reader = threading.Thread(target=self._read_handoffs, daemon=True, name="pdlink-serve-handoffs")
        self._handoff_reader.start()

    # ------------------------------------------------------------------ accepting a post

    def _listen_ip(self, node: NodeInfo, device_index: int, who: str) -> str:
        source = self.settings.kv.listen_ip_source
        if source == "server_ip":
            ip = node.server_ip
        elif source == "device_ip":
            ip = node.devices[device_index].device_ip
        else:
            if node.host_ip is None:
                raise Unavailable(f"KvTransferConfig.listenIpSource is host_ip but {who}.host_ip is missing")
            ip = node.host_ip
        if ipaddress.ip_address(ip).version != 4:
            raise Unavailable(f"{who}: pdlink's KV transport needs an IPv4 listen address, got {ip} "
                              f"(KvTransferConfig.listenIpSource = {source})")
        return ip

    def _addresses(self, node: NodeInfo, who: str) -> tuple[tuple[str, int], ...]:
        base = self.settings.kv.listen_port_base
        out = []
        for i, dev in enumerate(node.devices):
            port = base + dev.port_id
            if port > 65535:
                raise Unavailable(f"{who}.device[{i}]: listen port {base} + {dev.port_id} exceeds 65535 "
                                  "(KvTransferConfig.listenPortBase)")
            out.append((self._listen_ip(node, i, who), port))
        return tuple(out)

    def _plan(self, req: RoleRequest) -> _Plan:
        peers = {}
        for i, p in enumerate(req.peers):
            peers[p.cluster_id] = _PeerPlan(p.cluster_id, p.server_ip, self._addresses(p, f"peers[{i}]"))
        return _Plan(req.role, req.local.cluster_id, self._addresses(req.local, "local"),
                     tuple(d.device_id if d.device_id is not None else d.device_logical_id for d in req.local.devices),
                     peers, req.p_percentage)

    def accept(self, req: RoleRequest) -> int:
        """Check and record an assignment; returns its generation (1, 2, ...). Raises
        ``Unavailable`` without changing anything when this instance cannot apply it."""
        kv = self.settings.kv
        with self._lock:
            if self._stopping:
                raise Unavailable("the server is shutting down")
            if self.settings.infer_mode != "dmi":
                raise Unavailable("ServerConfig.inferMode is 'standard' (PD mixed): role assignment needs 'dmi'")
            if len(req.local.devices) != kv.device_count:
                raise Unavailable(f"local lists {len(req.local.devices)} device(s) but this server hosts "
                                  f"{kv.device_count} (KvTransferConfig.deviceCount)")
            cid = req.local.cluster_id
            identity = self._cluster_id if self._cluster_id is not None else self._identity
            if identity is not None and cid != identity:
                raise Unavailable(f"local identifies instance {cid}, but this server runs as instance {identity}; "
                                  "restart the server to change its identity")
            if self._role is None and not req.peers and not (
                    ROLES[req.role].takes_p_percentage and req.p_percentage is not None and 0 < req.p_percentage < 100):
                raise Unavailable("the first role assignment must list peers (only flex with 0 < p_percentage < 100 "
                                  "may start without)")
            plan = self._plan(req)
            if req.expected_epoch is not None:
                self._check_fence(req.expected_epoch)
                self._identity = cid
                return self._start_fence(plan, req.expected_epoch, self.settings.kv.role_drain_timeout_ms / 1000)
            if self._fence is not None:
                raise Unavailable(f"a fenced role switch to {self._fence.target_role} is in progress (phase "
                                  f"{self._phase}); post again when GET /v1/pd_role reports phase ready")
            self._identity = cid
            self._generation += 1
            self._desired = plan
            self._role = req.role
            self._p_percentage = req.p_percentage
            self._role_status = "RoleSwitching"
            self._wake.notify_all()
            logger.info("role %s accepted (generation %d, %d peer(s))", req.role, self._generation, len(plan.peers))
            return self._generation

    def _check_fence(self, expected_epoch: int) -> None:
        """(Under the lock.) ``Conflict`` unless a fenced switch expecting ``expected_epoch`` may start."""
        if self._fence is not None or self._phase in _FENCED_PHASES or self._applied < self._generation:
            raise Conflict(f"a role switch is in progress (phase {self._phase})", "in_progress")
        if expected_epoch != self._epoch:
            raise Conflict(f"stale role epoch: expected {expected_epoch}, the instance is at epoch {self._epoch}",
                           "stale_epoch")

    def _start_fence(self, plan: _Plan, expected_epoch: int, drain_s: float) -> int:
        """(Under the lock, after ``_check_fence``.) Accept ``plan`` as a fenced switch: admission
        closes now; returns its generation."""
        fence = _Fence(self._generation + 1, expected_epoch, drain_s, plan.role, self._role, self._p_percentage,
                       self._desired, self._role_status)
        self._generation = fence.gen
        self._desired = plan
        self._role = plan.role
        self._p_percentage = plan.p_percentage
        self._role_status = "RoleSwitching"
        self._fence = fence
        self._phase = "draining"
        self._phase_error = None
        self._target_role = plan.role
        self._transition_started = time.monotonic()
        self._transition_seconds = None
        self._wake.notify_all()
        logger.info("fenced switch to %s accepted (generation %d, epoch %d, drain timeout %.3f s)", plan.role,
                    fence.gen, expected_epoch, drain_s)
        return fence.gen

    def _switch_plan(self, role: str) -> _Plan:
        """(Under the lock.) The latest good plan with ``role`` instead of its own (a route that
        names only a role keeps the peers and addresses). ``Conflict`` when there is none yet."""
        base = self._good_plan if self._good_plan is not None else self._desired
        if base is None or self._cluster_id is None:
            raise Conflict("no role has been assigned yet: the first assignment, with its peers, is "
                           "POST /v1/role/{role}", "no_role")
        p = base.p_percentage if ROLES[role].takes_p_percentage and base.role == role else None
        return replace(base, role=role, p_percentage=p)

    def pd_role(self) -> dict[str, Any]:
        """The body of vLLM's ``GET /v1/pd_role`` (its field names; ``role`` is ours: ``prefill``,
        ``decode``, ``flex`` or None before the first assignment is applied; ``active_requests``
        counts the node's own transfers in flight, the test pulls)."""
        with self._lock:
            return {"role": self._engine_role, "epoch": self._epoch, "phase": self._phase,
                    "target_role": self._target_role, "active_requests": self._busy, "error": self._phase_error,
                    "transition_seconds": self._transition_seconds}

    def pd_switch(self, role: str, expected_epoch: int, drain_s: float) -> tuple[bool, dict[str, Any]]:
        """vLLM's ``POST /v1/pd_role``: start a fenced switch to ``role``; returns (started, the
        ``pd_role`` document as it was when the post was accepted). The role it already has, at
        its epoch, is accepted and changes nothing. Unlike vLLM's code: a post one epoch behind is
        stale even when it names the role the instance now has (vLLM accepts it as a retry; then
        two controllers racing for the same role would both win), and a ``failed`` instance
        accepts a post at its epoch (that is how it is resolved; vLLM's stays failed until
        restarted).
        Raises ``NotEnabled``, ``Conflict`` or ``Unavailable``; nothing changes then."""
        with self._lock:
            if self._stopping:
                raise Unavailable("the server is shutting down")
            if self.settings.infer_mode != "dmi":
                raise NotEnabled("Runtime P/D role switching is not enabled (ServerConfig.inferMode is 'standard')")
            if self._fence is not None or self._phase in _FENCED_PHASES or self._applied < self._generation:
                raise Conflict(f"A role transition is already in progress (phase {self._phase})", "in_progress")
            if self._phase == "ready" and self._engine_role == role and expected_epoch == self._epoch:
                started = False
            else:
                self._check_fence(expected_epoch)
                self._start_fence(self._switch_plan(role), expected_epoch, drain_s)
                started = True
            # taken under the lock: the document the post was accepted with, not a later one (a
            # quick switch may commit before the caller reads it)
            return started, self.pd_role()

    def sgl_switch(self, new_role: str, wait_s: float | None = None) -> tuple[int, dict[str, Any]]:
        """SGLang's ``POST /pd_role_switch``: switch to ``new_role`` and answer when it is done:
        (HTTP status, ``{"success", "message", "old_role", "new_role"}``). 200 when switched, or
        "already in target role"; 400 refused (not a PD role, not in PD mode, a switch in
        progress, not idle) or failed (rolled back, or failed: then the next post resolves it).
        Fenced at the epoch it finds; waits at most the drain timeout plus ``wait_s``
        (default: 10 x ``linkTimeoutMs`` + 10 s) for the switch, then answers 400 "still switching"."""
        kv = self.settings.kv
        drain_s = kv.role_drain_timeout_ms / 1000
        with self._lock:
            old = self._engine_role

            def answer(code: int, ok: bool, message: str) -> tuple[int, dict[str, Any]]:
                return code, {"success": ok, "message": message, "old_role": old, "new_role": new_role}

            if new_role not in ("prefill", "decode"):
                return answer(400, False, f"invalid new_role {new_role!r}: must be 'prefill' or 'decode'")
            if self._stopping:
                return answer(400, False, "the server is shutting down")
            if self.settings.infer_mode != "dmi" or self._cluster_id is None:
                return answer(400, False, "not running in PD disaggregation mode: ServerConfig.inferMode must be "
                                          "'dmi' and a first role assigned with POST /v1/role/{role}")
            if self._fence is not None or self._phase in _FENCED_PHASES or self._applied < self._generation:
                return answer(400, False, f"a role switch is in progress (phase {self._phase})")
            if self._phase == "ready" and old == new_role:
                return answer(200, True, "already in target role")
            if self._busy:
                return answer(400, False, f"not idle: {self._busy} transfer(s) in flight")
            self._start_fence(self._switch_plan(new_role), self._epoch, drain_s)
            fence = self._fence
            assert fence is not None
        bound = drain_s + (wait_s if wait_s is not None else 10 * kv.link_timeout_ms / 1000 + 10)
        if not fence.done.wait(bound):
            return answer(400, False, "still switching; GET /v1/pd_role reports the phase")
        if fence.outcome == "committed":
            return answer(200, True, "ok")
        if fence.outcome == "rolled_back":
            return answer(400, False, f"rolled back, nothing changed: {fence.error}")
        return answer(400, False, f"switch failed, the role is uncertain until the next post: {fence.error}")

    # ------------------------------------------------------------------ applying (worker thread)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and self._applied >= self._generation:
                    self._wake.wait()
                if self._stopping:
                    return
                plan, gen = self._desired, self._generation
                assert plan is not None  # accept() sets it with every generation
                fence = self._fence if self._fence is not None and self._fence.gen == gen else None
                if fence is None and plan.role != self._engine_role:
                    self._phase = "switching"
                    self._target_role = plan.role
                    self._transition_started = time.monotonic()
            if fence is not None:
                drained = self._drain(fence)
                if self._stopping:
                    return
                if not drained:
                    self._roll_back(fence)
                    self._evaluate()
                    continue
            before = self._engine_role
            error = None
            try:
                self._apply(plan)
            except Exception as e:  # noqa: BLE001 - reported in the status
                error = str(e) or type(e).__name__
                logger.error("applying role %s (generation %d) failed: %s", plan.role, gen, error)
            with self._lock:
                self._applied = gen
                self._last_error = error
                if error is not None and gen == self._generation:
                    self._role_status = "RoleUnknown"
                    if self._cluster_id is None:
                        self._identity = None  # no engine was made: a later post may name another instance
                if self._engine_role != before:
                    self._epoch += 1
                if error is None:
                    self._good_plan = plan
                if error is not None or self._phase != "ready" or fence is not None:
                    self._phase = "failed" if error is not None else "ready"
                    self._phase_error = error
                    if self._transition_started is not None:
                        self._transition_seconds = time.monotonic() - self._transition_started
                if fence is not None:
                    fence.outcome, fence.error = ("failed" if error is not None else "committed"), error
                    self._fence = None
                    fence.done.set()
                    logger.info("fenced switch to %s %s (epoch %d)", plan.role, fence.outcome, self._epoch)
            self._evaluate()

    def _drain(self, fence: _Fence) -> bool:
        """Wait until no test pull is in flight (admission is closed), at most ``fence.drain_s``;
        False when some are still running then."""
        deadline = time.monotonic() + fence.drain_s
        with self._lock:
            while self._busy and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
            if not self._stopping:
                self._phase = "switching"
            return True

    def _roll_back(self, fence: _Fence) -> None:
        """The drain timed out: restore the old role (nothing was applied), then wait until the
        transfers that held the drain have ended (each is bounded by ``syncKvTimeoutMs``; none can
        be cancelled from here) and reopen admission."""
        with self._lock:
            busy = self._busy
            self._phase = "rolling_back"
            self._phase_error = (f"drain timeout: {busy} transfer(s) still in flight after {fence.drain_s:g} s; "
                                 f"rolled back to {fence.old_role} at epoch {self._epoch}")
            self._role, self._p_percentage = fence.old_role, fence.old_p_percentage
            self._desired = fence.old_desired
            self._role_status = fence.old_role_status
            self._applied = fence.gen
            logger.warning("fenced switch to %s: %s", fence.target_role, self._phase_error)
            while self._busy and not self._stopping:
                self._idle.wait()
            self._phase = "ready"
            if self._transition_started is not None:
                self._transition_seconds = time.monotonic() - self._transition_started
            fence.outcome, fence.error = "rolled_back", self._phase_error
            self._fence = None
            fence.done.set()

    def _listen_for(self, plan: _Plan) -> tuple[tuple[str, int], ...]:
        return plan.listen if ROLES[plan.role].listens else ()

    def _create_engines(self, plan: _Plan) -> None:
        kv = self.settings.kv
        listen = self._listen_for(plan)
        engines: list[Engine] = []
        try:
            for i in range(kv.device_count):
                # The role post's device ids (logical, as strings) pick the NPU on Ascend.
                dev = plan.device_ids[i] if i < len(plan.device_ids) else str(i)
                # Every setting comes from the server's configuration, none from the environment.
                engines.append(Engine(EngineOptions(
                    cluster_id=plan.cluster_id, role=ROLES[plan.role].engine_role, listen=_address(listen, i),
                    transport=kv.transport, secret=kv.link_secret,
                    payload_integrity=bool(kv.link_secret) and kv.payload_integrity, backend=kv.backend,
                    device_id=int(dev) if dev.isdigit() else i, hccl_one_sided=False,
                    ucx_trusted_network=kv.ucx_trusted_network,
                    timeout_ms=kv.sync_kv_timeout_ms, connect_timeout_ms=kv.link_timeout_ms)))
        except BaseException:
            for engine in engines:
                engine.close()
            raise
        with self._lock:
            self._engines = engines
            self._cluster_id = plan.cluster_id
            self._engine_role, self._listening, self._device_ids = plan.role, listen, plan.device_ids
        self._metrics.role_switch(plan.role)
        if kv.test_kv.enabled:
            self._register_test_kv(plan.cluster_id)
        logger.info("instance %d: %d engine(s) as %s, listening on %s", plan.cluster_id, len(engines), plan.role,
                    [f"{ip}:{p}" for ip, p in listen] or "nothing")

    def _unlink(self, cids: Sequence[int], engines: Sequence[Any] | None = None) -> None:
        """Non-force unlink (the peer drops its end too) on ``engines`` (default: all)."""
        if not cids:
            return
        timeout = self.settings.kv.link_timeout_ms
        for engine in self._engines if engines is None else engines:
            for cid in cids:
                _disconnect(engine, cid, timeout, False)

    def _stop_jobs(self, cids: Sequence[int]) -> None:
        with self._lock:
            jobs = [self._jobs.pop(c) for c in cids if c in self._jobs]
        for job in jobs:
            job.cancel.set()
        for job in jobs:
            job.thread.join()

    def _switch(self, plan: _Plan) -> None:
        """Unlink everything, then switch every engine's role and listener."""
        listen = self._listen_for(plan)
        self._stop_jobs(list(self._jobs))
        switched: list[int] = []
        try:
            for i, engine in enumerate(self._engines):
                for attempt in range(_SWITCH_ATTEMPTS):
                    self._unlink([link.peer_cluster_id for link in engine.links()], [engine])
                    try:
                        engine.switch_role(ROLES[plan.role].engine_role, _address(listen, i), require_no_links=True)
                        break
                    except LLMException as e:  # a peer linked in between: unlink again
                        if e.status_code != LLMStatusCode.LLM_EXIST_LINK or attempt == _SWITCH_ATTEMPTS - 1:
                            raise
                switched.append(i)
        except BaseException:
            old = self._listening
            for i in switched:  # best effort: put the switched engines back
                assert self._engine_role is not None  # set when the engines were created
                try:
                    self._unlink([link.peer_cluster_id for link in self._engines[i].links()], [self._engines[i]])
                    self._engines[i].switch_role(ROLES[self._engine_role].engine_role, _address(old, i),
                                                  require_no_links=True)
                except LLMException as e:
                    logger.error("device %d: could not restore role %s: %s", i, self._engine_role, e)
            with self._lock:
                self._peers = {}
            raise
        changed = plan.role != self._engine_role
        with self._lock:
            self._engine_role, self._listening, self._device_ids = plan.role, listen, plan.device_ids
            self._peers = {}
        if changed:
            self._metrics.role_switch(plan.role)
        logger.info("switched to %s, listening on %s", plan.role, [f"{ip}:{p}" for ip, p in listen] or "nothing")

    def _apply(self, plan: _Plan) -> None:
        if not self._engines:
            self._create_engines(plan)
        else:
            gone = [cid for cid, old in self._peers.items()
                    if cid not in plan.peers or plan.peers[cid].addresses != old.addresses]
            self._stop_jobs(gone)
            self._unlink(gone)
            with self._lock:
                for cid in gone:
                    self._peers.pop(cid, None)
                    self._ever_ok.discard(cid)
            if plan.role != self._engine_role or self._listen_for(plan) != self._listening:
                self._switch(plan)
        listening = bool(self._listening)
        with self._lock:
            self._peers = dict(plan.peers)
            self._ever_ok &= set(plan.peers)
            self._device_ids = plan.device_ids
        for cid, peer in plan.peers.items():
            if self._stopping:
                return
            job = self._jobs.get(cid)
            if job is not None and (job.state == "linking" or (job.state == "ok" and self._peer_live(cid))):
                continue
            job = _LinkJob(self, peer, dial=not listening or cid < plan.cluster_id)
            with self._lock:
                self._jobs[cid] = job
            job.start()

    # ------------------------------------------------------------------ status

    def _peer_live(self, cid: int) -> bool:
        return bool(self._engines) and all(_link_state(e, cid)[0] for e in self._engines)

    def _peer_views(self) -> list[dict[str, Any]]:
        with self._lock:
            peers = list(self._peers.values())
            jobs = dict(self._jobs)
            engines = list(self._engines)
        links = [e.links() for e in engines]
        views = []
        for peer in peers:
            cid = peer.cluster_id
            per_device = []
            for dev_links in links:
                mine = [link for link in dev_links if link.peer_cluster_id == cid]
                per_device.append(next((link for link in mine if not link.broken), mine[0] if mine else None))
            live = bool(links) and all(link is not None and not link.broken for link in per_device)
            job = jobs.get(cid)
            if live:
                state, reason = "ok", ""
                with self._lock:
                    self._ever_ok.add(cid)
            elif job is not None and job.state == "linking":
                state, reason = "linking", ""
            elif job is not None and job.state == "failed":
                state, reason = "failed", job.reason
            else:
                broken = [link.broken_reason for link in per_device if link is not None and link.broken]
                state = "failed"
                reason = f"link lost: {broken[0]}" if broken else "link lost: the peer unlinked or is gone"
            views.append({"target": cid, "state": state, "reason": reason, "server_ip": peer.server_ip,
                          "addresses": [f"{ip}:{port}" for ip, port in peer.addresses],
                          "dials": bool(job.dial) if job is not None else None})
        return views

    def _evaluate(self, views: list[dict[str, Any]] | None = None) -> None:
        """Reach RoleReady when the latest assignment is applied and linking is over."""
        with self._lock:
            if self._role_status != "RoleSwitching" or self._applied < self._generation:
                return
            gen = self._generation
        views = self._peer_views() if views is None else views
        if any(v["state"] == "linking" for v in views):
            return
        if views and not any(v["state"] == "ok" for v in views):
            return
        with self._lock:
            if self._generation == gen and self._applied >= gen and self._role_status == "RoleSwitching":
                self._role_status = "RoleReady"
                logger.info("role %s ready (generation %d)", self._role, gen)

    def healthy(self) -> bool:
        """False when a link that was up is lost and no peer is linked (MindIE's DMI health rule)."""
        views = self._peer_views()
        with self._lock:
            ever = set(self._ever_ok)
        lost = any(v["state"] != "ok" and v["target"] in ever for v in views)
        return not (lost and not any(v["state"] == "ok" for v in views))

    def status(self) -> dict[str, Any]:
        """The body of ``GET /v1/status``."""
        views = self._peer_views()
        self._evaluate(views)
        kv, model = self.settings.kv, self.settings.model
        with self._lock:
            service: dict[str, Any] = {"roleStatus": self._role_status, "currentRole": self._role or "none"}
            if self._role is not None and ROLES[self._role].takes_p_percentage and self._p_percentage is not None:
                service["p_percentage"] = self._p_percentage
            blocks = kv.test_kv.num_blocks * len(self._test_kv)
            engines = list(self._engines)
            ext: dict[str, Any] = {
                "clusterId": self._cluster_id, "generation": self._generation, "appliedGeneration": self._applied,
                "epoch": self._epoch, "phase": self._phase,
                "lastError": self._last_error, "engineRole": self._engine_role, "peers": views,
                "devices": [{"index": i, "deviceId": self._device_ids[i] if i < len(self._device_ids) else None,
                             "listen": f"{self._listening[i][0]}:{self._listening[i][1]}" if self._listening
                             else None} for i in range(len(engines))],
                "testKv": kv.test_kv.enabled,
            }
        live = stranded = dropped = 0
        for i, engine in enumerate(engines):
            ext["devices"][i]["links"] = [
                {"target": link.peer_cluster_id, "address": link.peer_address, "initiator": link.initiator,
                 "broken": link.broken, "transport": link.transport} for link in engine.links()]
            stats = engine.stats()
            ext["devices"][i]["offersLive"] = stats.offers_live
            ext["devices"][i]["strandedBytes"] = stats.offer_bytes
            live += stats.offers_live
            stranded += stats.offer_bytes
            dropped += stats.handoff_events_dropped
        # KV handoffs (docs/native_api.md, "Handoffs"): offers not yet released, the bytes they retain,
        # and the events taken from the engines (released offers, peers' aborts) or dropped unread
        with self._lock:
            counts = dict(self._handoff_counts)
        ext["handoffs"] = {"offersLive": live, "strandedBytes": stranded, "released": counts.get("released", 0),
                           "aborted": counts.get("aborted", 0), "eventsDropped": dropped}
        resource = {
            "availSlotsNum": model.max_batch_size, "availBlockNum": blocks, "waitingRequestNum": 0,
            "runningRequestNum": 0, "swappedRequestNum": 0, "freeNpuBlockNums": blocks, "freeCpuBlockNums": 0,
            "totalNpuBlockNums": blocks, "totalCpuBlockNums": 0,
        }
        link_peers = [{"target": v["target"], "link": "ok" if v["state"] == "ok" else f"failed : {v['reason']}"}
                      for v in views if v["state"] != "linking"]
        return {"service": service, "resource": resource, "linkStatus": {"peers": link_peers}, "pdlink": ext}

    # KV handoffs: the engines queue what peers told them (aborts) and their released offers, at most
    # Limits.max_handoff_events each; nothing else in this process reads them, so the server takes
    # them every HANDOFF_READ_S, counts them (status, metrics) and logs them (debug).
    HANDOFF_READ_S = 1.0

    def _read_handoffs(self) -> None:
        while not self._handoff_stop.wait(self.HANDOFF_READ_S):
            self.take_handoff_events()

    def take_handoff_events(self) -> None:
        """Takes the engines' handoff events now (the reader thread does every ``HANDOFF_READ_S``)."""
        with self._lock:
            engines = list(self._engines)
        for engine in engines:
            try:
                events = engine.released() + engine.handoff_events()
            except LLMException:  # an engine closed by a role change meanwhile: nothing more to take
                continue
            for event in events:
                logger.debug("handoff %s: request %r from cluster %d (%r)", event.kind, event.request_id, event.peer,
                             event.reason)
                self._metrics.handoff_event(event.kind)
            with self._lock:
                for event in events:
                    self._handoff_counts[event.kind] = self._handoff_counts.get(event.kind, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        """Cheap numbers for the metrics collector."""
        with self._lock:
            return {"role": self._role, "role_status": self._role_status, "generation": self._generation,
                    "peers": len(self._peers)}

    def engines_by_device(self) -> dict[str, Engine]:
        """The engines of the current assignment by device index (the metrics' ``device`` label)."""
        with self._lock:
            return {str(i): e for i, e in enumerate(self._engines)}

    # ------------------------------------------------------------------ test KV surface

    def _register_test_kv(self, cid: int) -> None:
        import numpy as np

        t = self.settings.kv.test_kv
        entries = []
        for i, engine in enumerate(self._engines):
            src = kv_pattern(np, cid, i, t.num_tensors, t.num_blocks, t.block_bytes)
            dst = [np.zeros((t.num_blocks, t.block_bytes), dtype=np.uint8) for _ in range(t.num_tensors)]
            # published under key 0: what an llm_datadist peer names BlocksCacheKey(cid, 0)
            entries.append(_TestKv(src, dst, engine.register(src, block_size=t.block_bytes, key=0),
                                   engine.register(dst, block_size=t.block_bytes)))
        self._test_kv = entries

    def test_pull(self, target: int) -> dict[str, Any]:
        """Pull every block of ``target``'s test KV cache on every device (in reverse block order)
        and compare each byte with the pattern ``target`` fills it with. Raises ``LLMException``
        when a pull fails, ``Unavailable`` when there is nothing to pull with, ``ValueError`` (with
        the first mismatch) when the bytes differ, ``Fenced`` while a role switch is draining,
        switching or rolling back (a pull admitted before it counts in the drain)."""
        t = self.settings.kv.test_kv
        if not t.enabled:
            raise Unavailable("KvTransferConfig.testKv is not enabled")
        with self._lock:
            if self._phase in _FENCED_PHASES:
                raise Fenced(f"a role switch is in progress (phase {self._phase}): no new transfer is admitted")
            self._busy += 1
        try:
            return self._test_pull(target, t)
        finally:
            with self._lock:
                self._busy -= 1
                self._idle.notify_all()

    def _test_pull(self, target: int, t: Any) -> dict[str, Any]:
        import numpy as np

        with self._kv_lock:
            with self._lock:
                entries, engines = list(self._test_kv), list(self._engines)
            if not entries:
                raise Unavailable("no engine yet: assign a role first")
            src_blocks = np.arange(t.num_blocks - 1, -1, -1, dtype=np.int64)
            dst_blocks = np.arange(t.num_blocks, dtype=np.int64)
            nbytes = t.num_tensors * t.num_blocks * t.block_bytes
            remote = RemoteRegion(length=t.num_blocks * t.block_bytes, block_size=t.block_bytes, key=0,
                                  tensors=t.num_tensors)
            seconds = 0.0
            for engine, entry in zip(engines, entries):
                for a in entry.dst:
                    a[:] = 0
                job = engine.prepare(target, entry.dst_region, remote)
                t0 = time.perf_counter()  # the engines count it too (pdlink_transfer_*{device=...})
                job.read(dst_blocks, src_blocks)
                seconds += time.perf_counter() - t0
            for i, entry in enumerate(entries):
                expected = kv_pattern(np, target, i, t.num_tensors, t.num_blocks, t.block_bytes)
                for k, (got, want) in enumerate(zip(entry.dst, expected)):
                    if not np.array_equal(got, want[src_blocks]):
                        raise ValueError(f"device {i} tensor {k}: pulled bytes differ from instance {target}'s "
                                         "test pattern")
        return {"result": "ok", "target": target, "devices": len(entries), "bytes": len(entries) * nbytes,
                "seconds": seconds, "verified": True}

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop the worker and every link job, unlink every peer and finalise the engines."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._wake.notify_all()
            self._idle.notify_all()
            fence = self._fence
        self._handoff_stop.set()
        self._handoff_reader.join(30)
        self._worker.join(30)
        if fence is not None:  # an SGLang caller may wait on it
            fence.outcome, fence.error = fence.outcome or "failed", fence.error or "the server is shutting down"
            fence.done.set()
        self._stop_jobs(list(self._jobs))
        for engine in self._engines:
            try:
                engine.close()
            except LLMException as e:
                logger.error("closing an engine: %s", e)
