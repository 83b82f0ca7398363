"""Peer-side functions of the hostile review of the drain-timeout cancel, the rollback and wire v8
(round 8, tests/hostile/test_round8_review.py): switches of this peer's ``pdlink.Engine``
(tests/peers/native.py) raced against each other and against its own rollback, and a read of this
engine left in flight at a server that never answers. Each runs in the victim's process, so the
race's timing is not spread over the test's RPCs."""

from __future__ import annotations

import threading
import time
from typing import Any

import pdlink
import rawwire
from peers import addr, native
from peers.hostile import ATTACKER_IP


def _switch(role: str, expected_epoch: int | None, drain_timeout_ms: int | None) -> tuple[int, str]:
    """One ``switch_role`` without a listener: (0 or the error's code, its message)."""
    try:
        native._engine().switch_role(role, None, expected_epoch=expected_epoch, drain_timeout_ms=drain_timeout_ms)
        return 0, ""
    except pdlink.LLMException as e:
        return int(e.status_code), str(e)


def racing_switches(count: int, role: str, expected_epoch: int | None) -> tuple[list[int], dict[str, Any]]:
    """``count`` threads call ``switch_role(role, expected_epoch=...)`` at once (released by one
    barrier); each one's code (0: committed), and the role state after all ended."""
    barrier = threading.Barrier(count)
    codes: list[int] = [-1] * count

    def run(i: int) -> None:
        barrier.wait()
        codes[i] = _switch(role, expected_epoch, 5000)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return codes, native._engine().role_state().as_dict()


def _pull_from_a_stalled_server(port: int, outcome: dict[str, Any]) -> threading.Thread:
    """Links to the hostile server on ``port`` (mode "stall": it takes each request and never
    answers) and starts a 4 KiB ``Engine.read`` from it on a thread; ``outcome["read"]``: the
    error's class name, or "ok"."""
    engine = native._engine()
    peer = engine.connect(f"{ATTACKER_IP}:{port}")
    local = native._state["regions"]["dst"].region.addresses[0]

    def run() -> None:
        try:
            engine.read(peer, [(local, 4096)], [(0x10000, 4096)])
            outcome["read"] = "ok"
        except pdlink.LLMException as e:
            outcome["read"] = type(e).__name__

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while engine.role_state().transfers_in_flight == 0:
        assert time.monotonic() < deadline, "the read was never admitted"
        time.sleep(0.001)
    return t


def switch_during_the_rollback(port: int, drain_timeout_ms: int, racers: int) -> dict[str, Any]:
    """A read of this engine stays in flight at the stalled server on ``port``; a switch to PROMPT
    with ``drain_timeout_ms`` times out and rolls back, and its rollback waits (``rolling_back``)
    for the read, which is past its last cancel point. As soon as the phase reads ``rolling_back``,
    ``racers`` threads call ``switch_role("DECODER")`` at once. Returns the phases seen, the
    racers' codes, the first switch's (code, message), the state after it and the read's end."""
    engine = native._engine()
    outcome: dict[str, Any] = {}
    reader = _pull_from_a_stalled_server(port, outcome)
    first: dict[str, Any] = {}

    def run_first() -> None:
        first["result"] = _switch("PROMPT", None, drain_timeout_ms)

    switcher = threading.Thread(target=run_first, daemon=True)
    switcher.start()
    phases: list[str] = []
    deadline = time.monotonic() + 30
    while engine.role_state().phase != "rolling_back":
        phase = engine.role_state().phase
        if not phases or phases[-1] != phase:
            phases.append(phase)
        assert time.monotonic() < deadline and switcher.is_alive(), (phases, first)
        time.sleep(0.0005)
    phases.append("rolling_back")
    barrier = threading.Barrier(racers)
    codes: list[int] = [-1] * racers
    during: list[dict[str, Any]] = []

    def race(i: int) -> None:
        barrier.wait()
        codes[i] = _switch("DECODER", None, 5000)[0]

    threads = [threading.Thread(target=race, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    during.append(engine.role_state().as_dict())
    switcher.join(30)
    reader.join(30)
    return {"phases": phases, "racers": codes, "first": first.get("result"), "during": during[0],
            "after": engine.role_state().as_dict(), "read": outcome.get("read")}


def cancel_during_the_rollback(port: int, drain_timeout_ms: int) -> dict[str, Any]:
    """An async 4 KiB ``read_async`` of this engine stays in flight at the stalled server on
    ``port``; a switch with ``drain_timeout_ms`` times out, and the moment its phase reads
    ``rolling_back`` (the rollback's abort having moved) the caller cancels the same transfer.
    Returns what ``cancel()`` said, the transfer's status then and at its end, what its ``wait()``
    raised, the switch's (code, message) and the role state after it."""
    engine = native._engine()
    peer = engine.connect(f"{ATTACKER_IP}:{port}")
    local = native._state["regions"]["dst"].region.addresses[0]
    pending = engine.read_async(peer, [(local, 4096)], [(0x10000, 4096)])
    deadline = time.monotonic() + 10
    while engine.role_state().transfers_in_flight == 0:
        assert time.monotonic() < deadline, "the read was never admitted"
        time.sleep(0.001)
    first: dict[str, Any] = {}

    def run_first() -> None:
        first["result"] = _switch("PROMPT", None, drain_timeout_ms)

    switcher = threading.Thread(target=run_first, daemon=True)
    switcher.start()
    while engine.role_state().phase != "rolling_back":
        assert time.monotonic() < deadline + 30 and switcher.is_alive(), first
        time.sleep(0.0005)
    won = pending.cancel()
    status_then = pending.status()
    raised = None
    try:
        pending.wait(30)
    except BaseException as e:  # noqa: BLE001 - what it raised is the finding
        raised = type(e).__name__
    switcher.join(30)
    return {"won": won, "status_then": status_then, "status_end": pending.status(), "raised": raised,
            "first": first.get("result"), "after": engine.role_state().as_dict()}


def split_pull_during_the_rollback(port: int, drain_timeout_ms: int, chunk: bytes, read: bytes, end: bytes,
                                   ping: bytes) -> dict[str, Any]:
    """This engine links to its own listener as a raw peer (tests/peers/hostile.py, cluster 9),
    then, as in ``switch_during_the_rollback``, a read of its own stays in flight at the stalled
    server on ``port`` and a switch to PROMPT rolls back. While the phase reads ``rolling_back`` the
    raw peer sends ``chunk`` (a split pull's first chunk) and ``read`` (a plain read): their
    (status, tag) answers and the phase right after them; then it floods both, alternately, until
    the switch returned (each answer with the phase after it), sends ``end`` and ``ping``. Returns
    those, the switch's (code, message), the count in flight once settled and the role state."""
    from peers import hostile

    engine = native._engine()
    assert hostile.link_raw(engine.listen_port, 9) == (0, "")
    outcome: dict[str, Any] = {}
    reader = _pull_from_a_stalled_server(port, outcome)
    first: dict[str, Any] = {}

    def run_first() -> None:
        first["result"] = _switch("PROMPT", None, drain_timeout_ms)

    switcher = threading.Thread(target=run_first, daemon=True)
    switcher.start()
    deadline = time.monotonic() + 30
    while engine.role_state().phase != "rolling_back":
        assert time.monotonic() < deadline and switcher.is_alive(), first
        time.sleep(0.0005)
    answers = [hostile.exchange_header(chunk), hostile.exchange_header(read)]
    phase_after = engine.role_state().phase
    # then a flood for as long as the rollback lasts: each answer with the phase right after it
    flood: list[tuple[Any, str]] = []
    while switcher.is_alive() and len(flood) < 100_000:
        answer = hostile.exchange_header(chunk if len(flood) % 2 else read)
        flood.append((answer, engine.role_state().phase))
    switcher.join(30)
    reader.join(30)
    hostile.send(end)  # closes a pull a chunk opened after the rollback, if one did
    assert hostile.exchange_header(ping)[0] == 0
    deadline = time.monotonic() + 10
    while engine.role_state().served_in_flight and time.monotonic() < deadline:
        time.sleep(0.001)
    served = engine.role_state().served_in_flight
    hostile.close()
    return {"answers": answers, "phase_after": phase_after, "first": first.get("result"), "flood": flood,
            "served_after": served, "after": engine.role_state().as_dict()}


def pull_cut_by_a_rollback(port: int, remote_address: int, nbytes: int, drain_timeout_ms: int) -> dict[str, Any]:
    """Links to the engine on ``port`` (once), starts a ``read_async`` of ``nbytes`` from
    ``remote_address`` into region "dst" and at once a switch to PROMPT (no listener) with
    ``drain_timeout_ms``, racing the rollback's cancel against the pull. Returns the pull's end
    ("ok" or its error's class name), its status, the switch's (code, message) and the role state."""
    engine = native._engine()
    peer = native._state.get("round8_peer")
    if peer is None:
        peer = native._state["round8_peer"] = engine.connect(f"{addr.of(port)}:{port}")
    local = native._state["regions"]["dst"].region.addresses[0]
    pending = engine.read_async(peer, [(local, nbytes)], [(remote_address, nbytes)])
    switch = _switch("PROMPT", None, drain_timeout_ms)
    try:
        pending.wait(30)
        end = "ok"
    except BaseException as e:  # noqa: BLE001 - what it raised is the finding
        end = type(e).__name__
    return {"end": end, "status": pending.status(), "switch": switch, "state": engine.role_state().as_dict(),
            "peer": peer}


def pull_whole(port: int, remote_address: int, nbytes: int) -> None:
    """A plain ``read`` of ``nbytes`` from ``remote_address`` into region "dst" over the link of
    ``pull_cut_by_a_rollback``."""
    engine = native._engine()
    local = native._state["regions"]["dst"].region.addresses[0]
    engine.read(native._state["round8_peer"], [(local, nbytes)], [(remote_address, nbytes)])


def prepared_reads_from(port: int, rows: int, row_bytes: int, posts: int) -> list[str]:
    """Links to the hostile server on ``port`` and prepares a block transfer from its region keyed
    7 into region "dst" (``rows`` blocks of ``row_bytes``), then posts a read of every block
    ``posts`` times; each post's end: "ok" or its error's class name and code."""
    engine = native._engine()
    peer = engine.connect(f"{ATTACKER_IP}:{port}")
    remote = pdlink.RemoteRegion(length=rows * row_bytes, block_size=row_bytes, key=7)
    prepared = engine.prepare(peer, native._state["regions"]["dst"].region, remote)
    ends = []
    for _ in range(posts):
        try:
            prepared.read(list(range(rows)), list(range(rows)))
            ends.append("ok")
        except pdlink.LLMException as e:
            ends.append(f"{type(e).__name__} {int(e.status_code)}")
    return ends


# --------------------------------------------------------------------------- round 8b: the split word

def end_frame_at(frame: bytes, delay_s: float) -> None:
    """Sends ``frame`` on the raw link of tests/peers/hostile.py once ``delay_s`` seconds have passed
    from the call (a busy wait on the monotonic clock, so the frame races a victim's drain timeout
    at a chosen moment); not answered."""
    from peers import hostile

    at = time.monotonic() + delay_s
    while time.monotonic() < at:
        pass
    hostile.send(frame)


def chunks_for(seconds: float, chunk: bytes) -> list[tuple[str, int, int]]:
    """For ``seconds``, sends ``chunk`` alternately on the raw link's channel and its first lane
    (tests/peers/hostile.py ``open_lanes``), each answered before the next: (stream, status, payload
    bytes) of each answer, ("channel" | "lane", -1, 0) when the stream was dropped."""
    from peers import hostile

    out: list[tuple[str, int, int]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        stream = "lane" if len(out) % 2 else "channel"
        r = hostile.lane_exchange(0, chunk) if stream == "lane" else hostile.exchange(chunk)
        if isinstance(r, str):
            out.append((stream, -1, 0))
            break
        out.append((stream, r[0], len(r[2])))
    return out


def close_at(delay_s: float) -> None:
    """Closes the raw link of tests/peers/hostile.py once ``delay_s`` seconds have passed from the
    call (a busy wait, as in ``end_frame_at``)."""
    from peers import hostile

    at = time.monotonic() + delay_s
    while time.monotonic() < at:
        pass
    hostile.close()


def end_and_lane_chunk(end: bytes, chunk: bytes, end_first: bool) -> tuple[int, int] | str:
    """Sends the split end frame on the raw link's channel and a split chunk on its first lane back to
    back (in the order ``end_first`` says), so the victim's two serving threads handle them at about
    the same moment; the lane's answer: (status, payload bytes), or "closed"."""
    from peers import hostile

    if end_first:
        hostile.send(end)
        hostile._lanes[0].sendall(chunk)
    else:
        hostile._lanes[0].sendall(chunk)
        hostile.send(end)
    r = rawwire.read_response(hostile._lanes[0])
    return r if isinstance(r, str) else (r[0], len(r[2]))
