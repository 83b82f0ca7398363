"""Soak of KV handoffs (issue #35): N offer / claim / release cycles between a prefill engine (this
process) and a decoder engine (a child process), with random aborts from both sides and the decoder
killed (SIGKILL) and started again every ``--kill-every`` cycles.

Each cycle the prefill takes 1 to 4 free blocks of its region (4 KiB blocks, key 1), writes a
value of that cycle over them, offers them and sends the ticket to the decoder, which claims them
into its own region and checks every byte it got. What happens around the claim is drawn at random
(seeded; ``--seed``):

  * plain (the rest): the decoder claims; the claim must land and the offer end ``"claimed"``;
  * decoder abort (5%): the decoder aborts the request at the prefill (``abort(peer=...)``) and then
    claims: the claim must fail ``LLM_OFFER_RELEASED``, the offer end ``"peer_aborted"``;
  * prefill abort first (5%): the prefill aborts before sending: the claim fails ``LLM_OFFER_RELEASED``,
    the offer ends ``"aborted"``;
  * prefill release first (3%): ``Offer.release()`` before sending: the claim fails, ``"released"``;
  * prefill abort racing (5%): the prefill aborts right after sending, racing the claim: the claim
    lands (offer ``"claimed"``), or fails ``LLM_OFFER_RELEASED`` (offer ``"aborted"``), or lands
    while the abort released the offer first (offer ``"aborted"``: the claim returned before the
    abort reached the decoder); a claim that landed must have landed the cycle's bytes.

The prefill waits for each offer to be released (``Offer.wait``) before the next cycle, then reuses
its blocks: a stale read would show another cycle's value at the decoder. Every ``--kill-every``
cycles three more offers are made: one the decoder holds (bound to its link), one it claims
asynchronously, one never sent; the decoder is killed 0 to ``--kill-delay-ms`` (3) ms after the
claim was sent (so the kill lands before, during or after it), and a new one started. The held
one must end ``"link_down"`` (the prefill waits for it before starting the next decoder; the time
from the SIGKILL until ``Offer.released`` is printed); the one in flight ends ``"claimed"`` when
the claim finished before the kill, ``"link_down"`` when its first read was served, and
``"expired"`` otherwise; the third ``"expired"`` at its lease (``--lease-ms``, 3000 ms): those two
are reaped while the cycles go on.

At the end (the decoder of the last restart alive and linked): the prefill's ``stats()`` must reach
``offers_live == 0`` (polled: leases and link deaths do their work), every offer made must have
ended with a reason (``Offer.reason``), ``Engine.released()`` must have reported each offer once
and the same counts per reason, ``stats().offers_released`` must equal the offers made, and no
handoff event dropped (both engines take theirs; the prefill's must be one ``"aborted"`` per
abort of a decoder). The prefill's RSS, open fds and threads are sampled after warm-up (at cycle
``--warmup``, default half a kill period after the first kill, once the offers of the kills so far
have ended: the soak pauses for at most a lease there) and at the end; growth beyond
``--max-rss-mib`` (16), ``--max-fds`` (2) or ``--max-threads`` (2) fails the run. Exit status 0 only
when every check held; the summary is printed (and, with ``--out``, saved as ``soak_handoff.{json,txt}``).

    python bench/soak_handoff.py                                # 100,000 cycles, a kill every 1,000
    python bench/soak_handoff.py --cycles 2000 --kill-every 1000  # what the heavy test runs
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import signal
import statistics
import sys
import time
from collections import Counter
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

PREFILL_ID, DECODER_ID = 41, 42
BLOCK = 4096
BLOCKS = 512  # the prefill's region; the decoder's has as many
KEY = 1
TIMEOUT_MS = 10000

# what a cycle does around its claim, and how often (the rest is "plain")
ACTIONS = (("decoder_abort", 0.05), ("abort_first", 0.05), ("release_first", 0.03), ("abort_racing", 0.05))
# (claim result, offer reason) each action may end with. A prefill abort racing a claim may also
# lose the claim but win the release: the claim landed every byte (checked) and returned before the
# abort reached the decoder, and the prefill's abort released the offer before the claim's commit
# arrived ("ok" with "aborted"; docs/native_api.md: the first reason wins); or the other way round:
# the claim's commit released the offer ("claimed") but the abort reached the decoder before its
# claim returned, which fails that claim (``LLM_OFFER_RELEASED`` with "claimed"; its bytes landed).
EXPECTED = {"plain": {("ok", "claimed")}, "decoder_abort": {("LLM_OFFER_RELEASED", "peer_aborted")},
            "abort_first": {("LLM_OFFER_RELEASED", "aborted")}, "release_first": {("LLM_OFFER_RELEASED", "released")},
            "abort_racing": {("ok", "claimed"), ("LLM_OFFER_RELEASED", "aborted"), ("ok", "aborted"),
                             ("LLM_OFFER_RELEASED", "claimed")}}


# ---------------------------------------------------------------- the decoder (a child process)


def decoder_main(conn: Any, transport: str) -> None:
    """The decoder: links to nothing until the first ticket (``claim`` links by the ticket's
    address), then serves the parent's commands until told to stop or killed."""
    import pdlink
    from bench_transfer import set_transport

    set_transport(transport)
    engine = pdlink.Engine(pdlink.EngineOptions(cluster_id=DECODER_ID, timeout_ms=TIMEOUT_MS))
    dest = np.zeros(BLOCKS * BLOCK, np.uint8)
    region = engine.register(dest, block_size=BLOCK)
    pending = []
    conn.send("ready")
    while True:
        cmd = conn.recv()
        op = cmd[0]
        if op == "stop":
            break
        if op == "claim":
            engine.handoff_events()  # the prefill's aborts told to this engine: taken, so none is dropped
            _, ticket, value, abort_first = cmd
            local = list(range(len(ticket.blocks)))
            dest[: len(local) * BLOCK] = 0
            if abort_first:
                if not any(link.peer_cluster_id == ticket.cluster_id and not link.broken for link in engine.links()):
                    engine.connect(ticket.address, cluster_id=ticket.cluster_id)
                engine.abort(ticket.request_id, peer=ticket.cluster_id, reason="soak")
            try:
                engine.claim(ticket, region, local)
                code = "ok"
            except pdlink.LLMException as e:
                code = pdlink.LLMStatusCode(e.status_code).name
            conn.send((code, landed(dest[: len(local) * BLOCK].reshape(-1, BLOCK), value)))
        elif op == "hold":
            engine.hold(list(cmd[1]))
            conn.send("held")
        elif op == "claim_nowait":  # the kill comes next
            pending.append(engine.claim_async(cmd[1], region, list(range(len(cmd[1].blocks)))))
    engine.close()
    conn.send("stopped")


def landed(got: np.ndarray, value: int) -> str:
    """What a claim left in its destination blocks (zeroed before it): ``"all"`` (every block holds
    the cycle's value), ``"none"`` (every block zero), ``"some"`` (each block all zero or all the
    value) or ``"wrong"`` (a block holds anything else: a stale or torn read)."""
    new = np.all(got == value, axis=1)
    old = ~got.any(axis=1)
    if new.all():
        return "all"
    if old.all():
        return "none"
    return "some" if (new | old).all() else "wrong"


class Decoder:
    """One decoder process and its pipe."""

    def __init__(self, transport: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=decoder_main, args=(child, transport), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(120) or self.conn.recv() != "ready":
            raise RuntimeError("the decoder did not start")

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(120):
            raise RuntimeError(f"the decoder did not answer {cmd[0]}")
        return self.conn.recv()

    def kill(self) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(30)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.call("stop")
        finally:
            self.proc.join(30)
            self.conn.close()


# ---------------------------------------------------------------- the prefill's resources


def resources() -> dict[str, int]:
    """This process's RSS (bytes), open fds and threads, from /proc."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return {"rss": int(fields["VmRSS"][0]) * 1024, "fds": len(os.listdir("/proc/self/fd")),
            "threads": int(fields["Threads"][0])}


# ---------------------------------------------------------------- the soak


def soak(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs the soak described in the module docstring; returns its summary (``failures`` lists
    every check that did not hold; empty means the run passed)."""
    import pdlink
    from bench_transfer import set_transport

    set_transport(cfg["transport"])
    rng = random.Random(cfg["seed"])
    engine = pdlink.Engine(pdlink.EngineOptions(cluster_id=PREFILL_ID, listen="127.0.0.1:0", timeout_ms=TIMEOUT_MS))
    source = np.zeros(BLOCKS * BLOCK, np.uint8)
    region = engine.register(source, block_size=BLOCK, key=KEY)
    free = list(range(BLOCKS))
    outstanding: dict[int, tuple[Any, list[int]]] = {}  # offer id -> (Offer, its blocks)
    reasons: Counter[str] = Counter()  # Offer.reason of every offer that ended
    events: Counter[str] = Counter()  # Engine.released()'s reasons
    event_ids: set[int] = set()  # offer ids released() reported, while their offer is outstanding
    duplicate_events = 0
    told: Counter[str] = Counter()  # Engine.handoff_events() by kind
    kill_reasons: Counter[str] = Counter()  # "held|flying|unsent/reason" of the offers made at the kills
    held_release_s: list[float] = []  # from a SIGKILL to its held offer released
    outcomes: Counter[str] = Counter()  # "action/claim code/offer reason"
    landed_on_failure: Counter[str] = Counter()  # failed claims that landed blocks anyway ("some", "all")
    failures: list[str] = []
    made = 0
    kills = 0
    decoder_aborts = 0
    warm: dict[str, int] | None = None
    warm_at = None

    def reap() -> None:
        nonlocal duplicate_events
        for ev in engine.handoff_events():  # the decoders' aborts, told to this engine
            told[ev.kind] += 1
        for ev in engine.released():
            events[ev.reason] += 1
            assert ev.offer_id is not None  # a released offer's record names it
            if ev.offer_id in event_ids:
                duplicate_events += 1
            event_ids.add(ev.offer_id)
        for oid in [oid for oid, (o, _) in outstanding.items() if o.released]:
            offer, blocks = outstanding.pop(oid)
            reasons[offer.reason] += 1
            kind = offer.ticket.request_id.split("-")[0]
            if kind != "req":
                kill_reasons[f"{kind}/{offer.reason}"] += 1
            free.extend(blocks)
        # ids of ended offers that released() reported: forget them (flat memory), keep the rest
        event_ids.intersection_update(outstanding)

    def settled(condition: Any) -> bool:
        reap()
        return bool(condition())

    def make(blocks: list[int], value: int, rid: str) -> Any:
        nonlocal made
        source.reshape(BLOCKS, BLOCK)[blocks] = value
        offer = engine.offer(region, blocks, request_id=rid, lease_ms=cfg["lease_ms"])
        outstanding[offer.ticket.offer_id] = (offer, blocks)
        made += 1
        return offer

    def take(n: int) -> list[int]:
        if len(free) < n:
            wait_for(lambda: settled(lambda: len(free) >= n), cfg["lease_ms"] / 1000 + 30, "free blocks")
        rng.shuffle(free)
        return [free.pop() for _ in range(n)]

    decoder = Decoder(cfg["transport"])
    t0 = time.monotonic()
    try:
        for cycle in range(cfg["cycles"]):
            value = cycle % 251 + 1
            rid = f"req-{cycle}"
            r = rng.random()
            action = "plain"
            for name, p in ACTIONS:
                if r < p:
                    action = name
                    break
                r -= p
            offer = make(take(rng.randint(1, 4)), value, rid)
            if action == "abort_first":
                engine.abort(rid, reason="soak")
            elif action == "release_first":
                offer.release()
            if action == "abort_racing":
                decoder.conn.send(("claim", offer.ticket, value, False))
                engine.abort(rid, reason="soak")
                if not decoder.conn.poll(120):
                    raise RuntimeError("the decoder did not answer a claim")
                code, got = decoder.conn.recv()
            else:
                code, got = decoder.call("claim", offer.ticket, value, action == "decoder_abort")
            if not offer.wait(30):
                failures.append(f"cycle {cycle} ({action}): the offer was not released within 30 s")
                break
            outcome = f"{action}/{code}/{offer.reason}"
            outcomes[outcome] += 1
            # a claim that landed holds every byte of the cycle; one refused because the offer was over
            # before it began lands nothing; one an abort cut while it ran leaves each block old or new
            allowed = {"all"} if code == "ok" else {"none", "some", "all"} if action == "abort_racing" else {"none"}
            if code != "ok" and got != "none":
                landed_on_failure[got] += 1
            if action == "decoder_abort":
                decoder_aborts += 1
            if (code, offer.reason) not in EXPECTED[action] or got not in allowed:
                failures.append(f"cycle {cycle}: {outcome}, landed {got}")
                if len(failures) > 20:
                    break
            reap()
            if warm is None and cycle >= cfg["warmup"]:
                # the warm-up sample: once the offers of the kills so far ended (at most a lease)
                wait_for(lambda: settled(lambda: not outstanding), cfg["lease_ms"] / 1000 + 30, "warm-up: no offer")
                warm, warm_at = resources(), cycle
            if (cycle + 1) % cfg["kill_every"] == 0:
                held = make(take(1), 0xAA, f"held-{kills}")
                flying = make(take(4), 0xBB, f"flying-{kills}")
                make(take(1), 0xCC, f"unsent-{kills}")
                decoder.call("hold", [held.ticket])
                decoder.conn.send(("claim_nowait", flying.ticket))
                time.sleep(rng.uniform(0, cfg["kill_delay_ms"]) / 1000)  # the kill lands before, in or after the claim
                t_kill = time.monotonic()
                decoder.kill()
                held.wait(cfg["lease_ms"] / 1000 + 10)  # its link's death releases it, not its lease
                held_release_s.append(time.monotonic() - t_kill)
                kills += 1
                decoder = Decoder(cfg["transport"])
            if cfg["progress"] and (cycle + 1) % cfg["progress"] == 0:
                print(f"  {cycle + 1} cycles, {time.monotonic() - t0:.0f} s, {len(outstanding)} outstanding, "
                      f"rss {resources()['rss'] / 2**20:.1f} MiB", flush=True)
        duration = time.monotonic() - t0
        # the end: every offer released (leases and link deaths did their work), the link settled
        end_wait = cfg["lease_ms"] / 1000 + 30
        try:
            wait_for(lambda: settled(lambda: not outstanding and engine.stats().offers_live == 0), end_wait,
                     "no live offer")
        except AssertionError as e:
            failures.append(f"stranded: {e}; outstanding {len(outstanding)}, stats {engine.stats()}")
        decoder.call("hold", [])  # the decoder is alive and answers
        link_transports = sorted({link.transport for link in engine.links()})
        end = resources()
        if warm is not None:
            try:  # the killed decoders' sockets may still be closing: give them a moment
                wait_for(lambda: (end.update(resources()), end["fds"] - warm["fds"] <= cfg["max_fds"]
                                  and end["threads"] - warm["threads"] <= cfg["max_threads"])[1], 10, "fds and threads")
            except AssertionError:
                pass
        stats = engine.stats().as_dict()
    finally:
        try:
            decoder.stop()
        except Exception:  # noqa: BLE001 - a dead decoder: nothing to stop
            pass
        engine.close()

    total = made
    if sum(reasons.values()) != total:
        failures.append(f"{total} offers made, {sum(reasons.values())} ended with a reason")
    if events != reasons:
        failures.append(f"released() reported {dict(events)}, the offers ended {dict(reasons)}")
    cut = ("flying/claimed", "flying/link_down", "flying/expired")
    if any(k.startswith("flying/") and k not in cut for k in kill_reasons):
        failures.append(f"an offer whose claim a kill cut ended otherwise than claimed, link_down or expired: "
                        f"{dict(kill_reasons)}")
    if any(k.startswith("held/") and k != "held/link_down" for k in kill_reasons):
        failures.append(f"an offer held by a killed decoder ended otherwise than link_down: {dict(kill_reasons)}")
    if told != Counter({"aborted": decoder_aborts}) and (told or decoder_aborts):
        failures.append(f"the decoders aborted {decoder_aborts} requests, handoff_events() told {dict(told)}")
    if duplicate_events:
        failures.append(f"released() reported {duplicate_events} offers twice")
    if stats["offers_live"] or stats["offer_bytes"]:
        failures.append(f"offers_live {stats['offers_live']}, offer_bytes {stats['offer_bytes']} at the end")
    if stats["handoff_events_dropped"]:
        failures.append(f"{stats['handoff_events_dropped']} handoff events dropped")
    if stats["offers_released"] != total:
        failures.append(f"stats offers_released {stats['offers_released']} != {total} made")
    growth = None
    if warm is None:
        failures.append(f"no warm-up sample (no cycle past {cfg['warmup']} with nothing outstanding)")
    else:
        growth = {k: end[k] - warm[k] for k in warm}
        if growth["rss"] > cfg["max_rss_mib"] * 2**20:
            failures.append(f"RSS grew {growth['rss'] / 2**20:.1f} MiB (bound {cfg['max_rss_mib']})")
        if growth["fds"] > cfg["max_fds"]:
            failures.append(f"fds grew {growth['fds']} (bound {cfg['max_fds']})")
        if growth["threads"] > cfg["max_threads"]:
            failures.append(f"threads grew {growth['threads']} (bound {cfg['max_threads']})")
    return {"config": cfg, "link_transports": link_transports, "cycles_done": sum(outcomes.values()),
            "offers_made": total, "kills": kills,
            "duration_s": duration, "reasons": dict(reasons), "outcomes": dict(sorted(outcomes.items())),
            "failed_claims_that_landed": dict(landed_on_failure),
            "kill_offers": dict(sorted(kill_reasons.items())),
            "held_release_ms": {"median": statistics.median(held_release_s) * 1e3 if held_release_s else None,
                                "max": max(held_release_s) * 1e3 if held_release_s else None},
            "decoder_aborts": decoder_aborts, "handoff_events": dict(told),
            "warm": warm, "warm_at_cycle": warm_at, "end": end, "growth": growth,
            "stats": {k: stats[k] for k in ("offers_live", "offers_released", "offers_expired", "offers_aborted",
                                            "offer_bytes", "handoff_events_dropped")},
            "failures": failures}


def wait_for(condition: Any, timeout: float, what: str) -> None:
    """Polls ``condition`` until it is true; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:.0f} s: {what}")
        time.sleep(0.01)


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def report(s: dict[str, Any]) -> list[str]:
    cfg = s["config"]
    lines = [f"soak: {s['cycles_done']} cycles ({cfg['transport']}: links {', '.join(s['link_transports'])}), "
             f"{s['offers_made']} offers, {s['kills']} decoder "
             f"kills, {s['duration_s']:.0f} s ({s['cycles_done'] / max(s['duration_s'], 1e-9):.0f} cycles/s)",
             "offers ended: " + ", ".join(f"{k} {v}" for k, v in sorted(s["reasons"].items())),
             "outcomes (action/claim/offer): " + ", ".join(f"{k} {v}" for k, v in s["outcomes"].items()),
             "failed claims (an abort racing them) that landed blocks, each old or new: "
             + (", ".join(f"{k} {v}" for k, v in s["failed_claims_that_landed"].items()) or "none"),
             "offers made at the kills (held by the decoder / its claim in flight / never sent): "
             + ", ".join(f"{k} {v}" for k, v in s["kill_offers"].items())
             + f"; kill -> held offer seen released: median {fmt_ms(s['held_release_ms']['median'])}, max "
             f"{fmt_ms(s['held_release_ms']['max'])} ms (lease {cfg['lease_ms']} ms)",
             f"decoder aborts {s['decoder_aborts']}, told to the prefill: {s['handoff_events']}",
             "prefill stats at the end: " + ", ".join(f"{k} {v}" for k, v in s["stats"].items())]
    if s["growth"] is not None:
        w, e, g = s["warm"], s["end"], s["growth"]
        lines.append(f"prefill after warm-up (cycle {s['warm_at_cycle']}) -> end: RSS {w['rss'] / 2**20:.1f} -> "
                     f"{e['rss'] / 2**20:.1f} MiB ({g['rss'] / 2**20:+.1f}; bound +{cfg['max_rss_mib']}), fds "
                     f"{w['fds']} -> {e['fds']} ({g['fds']:+d}; bound +{cfg['max_fds']}), threads {w['threads']} -> "
                     f"{e['threads']} ({g['threads']:+d}; bound +{cfg['max_threads']})")
    lines.append("PASS" if not s["failures"] else "FAIL:\n  " + "\n  ".join(s["failures"]))
    return lines


def config(argv: list[str] | None = None) -> tuple[dict[str, Any], str | None]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=100_000)
    ap.add_argument("--kill-every", type=int, default=1000, help="cycles between two decoder kills")
    ap.add_argument("--warmup", type=int, default=None, help="first cycle of the warm-up sample (default: "
                    "half a kill period after the first kill)")
    ap.add_argument("--lease-ms", type=int, default=3000, help="every offer's lease")
    ap.add_argument("--transport", default="auto", help="the decoder's and prefill's data path: auto, cma, tcp, ucx")
    ap.add_argument("--kill-delay-ms", type=float, default=3.0, help="the kill comes 0 to this many ms (uniform) "
                    "after the asynchronous claim was sent")
    ap.add_argument("--seed", type=int, default=35)
    ap.add_argument("--max-rss-mib", type=float, default=16)
    ap.add_argument("--max-fds", type=int, default=2)
    ap.add_argument("--max-threads", type=int, default=2)
    ap.add_argument("--progress", type=int, default=10_000, help="print a line every that many cycles (0: never)")
    ap.add_argument("--out", default=None, help="a folder to save soak_handoff.{json,txt} in")
    a = ap.parse_args(argv)
    warmup = a.warmup if a.warmup is not None else min(a.kill_every + a.kill_every // 2, a.cycles - 1)
    return ({"cycles": a.cycles, "kill_every": a.kill_every, "warmup": warmup, "lease_ms": a.lease_ms,
             "transport": a.transport, "kill_delay_ms": a.kill_delay_ms, "seed": a.seed,
             "max_rss_mib": a.max_rss_mib, "max_fds": a.max_fds,
             "max_threads": a.max_threads, "progress": a.progress}, a.out)


def main(argv: list[str] | None = None) -> int:
    cfg, out = config(argv)
    s = soak(cfg)
    lines = report(s)
    print("\n".join(lines))
    if out:
        from bench_transfer import save

        save(out, "soak_handoff", s, "\n".join(lines))
    return 0 if not s["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
