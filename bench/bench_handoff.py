"""What a KV handoff costs (issue #35): offer + claim + release, until the prefill sees the release,
against a bare prepared pull of the same blocks on the same link.

Per data path (cma, tcp, and ucx over its tcp transport where UCX loads), two processes, as in
serving: a prefill that listens and registers a region of 64 blocks with a key, and a decoder
linked to it over loopback, with a destination of 64 blocks of the same size. (One process holding
both engines would time the prefill's handoff thread, woken by each release, against the decoder's
claim for the same interpreter lock.) For each block size (4 KiB and 256 KiB) and blocks per
request (1 and 16; the blocks every other one of the region, as a paged cache's are):

  * bare    : ``PreparedTransfer.read(local, remote)`` in the decoder (``Engine.prepare`` once, by
              the region's key);
  * handoff : its three parts, each timed where it runs: ``prefill.offer(region, blocks, ...)`` in
              the prefill; ``decoder.claim(offer.ticket, ...)`` in the decoder; and from the
              claim's return until the prefill's ``on_release`` callback ran (``Offer.released``:
              the claim's commit arrived and the handoff thread reported it; 0 when it ran before
              the claim returned). ``time.perf_counter`` is the system's monotonic clock, the same
              in both processes; the ticket travels between them over a pipe, outside the timing.

``--iters`` of each (default 300), the two alternating (which one goes first alternates too),
after a warm-up of 10 each; the destination is zeroed before each and checked byte for byte
after it (outside the timed window; a mismatch fails the run). Reported per cell: the median and
p90 of each, handoff / bare of the medians, and the handoff's parts at their medians.

    python bench/bench_handoff.py              # writes bench/results/handoff.{json,txt}
    python bench/bench_handoff.py --smoke      # 5 iterations per cell: seconds (CI)
    python bench/bench_handoff.py --paths tcp --iters 100
    python bench/bench_handoff.py --prefill-dials   # the prefill dials the decoder: handoff_prefill_dials.*

With ``--prefill-dials`` the decoder listens and the prefill links to it, so the decoder's link is
an accepted one: without a link secret its cluster id is only a claim, and the first claim dials
the ticket's address once to confirm it (docs/security.md, "Identities"). That first claim's time
is reported apart; every later one pulls over the confirmed link.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from bench_transfer import HERE, path_unavailable, percentile, save, set_transport

PREFILL_ID, DECODER_ID = 51, 52
BLOCKS = 64
KEY = 3
SIZES = (4096, 256 * 1024)
COUNTS = (1, 16)
WARMUP = 10


def source_bytes(size: int) -> np.ndarray:
    """What the prefill's region of ``size``-byte blocks holds (the decoder checks against it)."""
    return (np.arange(BLOCKS * size, dtype=np.uint64) * 31 % 251 + 1).astype(np.uint8)


def prefill_main(conn: Any, path: str) -> None:
    """The prefill process: answers the decoder's requests on ``conn`` until ``close``."""
    import pdlink

    set_transport(path)
    engine = pdlink.Engine(pdlink.EngineOptions(cluster_id=PREFILL_ID, listen="127.0.0.1:0", timeout_ms=60000))
    seen: dict[int, float] = {}
    offers: dict[int, Any] = {}
    region = None
    try:
        conn.send(engine.listen_port)
        while True:
            op, *args = conn.recv()
            if op == "register":
                if region is not None:
                    engine.deregister(region)
                region = engine.register(source_bytes(args[0]), block_size=args[0], key=KEY)
                conn.send(region.remote())
            elif op == "offer":
                blocks, request_id = args
                t0 = time.perf_counter()
                offer = engine.offer(region, blocks, request_id=request_id,
                                     on_release=lambda o: seen.__setitem__(o.ticket.offer_id, time.perf_counter()))
                t = time.perf_counter() - t0
                offers[offer.ticket.offer_id] = offer
                conn.send((offer.ticket, t))
            elif op == "seen":
                offer = offers.pop(args[0])
                if not offer.wait(60):
                    raise AssertionError("an offer was not released within 60 s")
                while offer.ticket.offer_id not in seen:  # the callback runs right after wait() returns
                    time.sleep(0)
                conn.send((seen.pop(offer.ticket.offer_id), offer.reason))
            elif op == "dial":
                engine.connect(f"127.0.0.1:{args[0]}", cluster_id=DECODER_ID)
                conn.send(None)
            elif op == "live":
                conn.send(engine.stats().offers_live)
            else:
                conn.send(None)
                return
    finally:
        engine.close()


def measure_path(conn: Any, path: str, iters: int, prefill_dials: bool) -> None:
    try:
        conn.send(("ok", run_path(path, iters, prefill_dials)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        conn.send(("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_path(path: str, iters: int, prefill_dials: bool) -> dict[str, Any]:
    """The decoder process: starts the prefill's, links to it (or has it link here), runs every cell."""
    import pdlink

    set_transport(path)
    ctx = mp.get_context("spawn")
    prefill, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_main, args=(child, path), daemon=True)
    proc.start()
    decoder = pdlink.Engine(pdlink.EngineOptions(cluster_id=DECODER_ID, timeout_ms=60000,
                                                 listen="127.0.0.1:0" if prefill_dials else None))
    cells: dict[str, Any] = {}
    try:
        port = prefill.recv()
        if prefill_dials:
            prefill.send(("dial", decoder.listen_port))
            prefill.recv()
        else:
            decoder.connect(f"127.0.0.1:{port}", cluster_id=PREFILL_ID)
        transport = decoder.links()[0].transport
        for size in SIZES:
            prefill.send(("register", size))
            remote = prefill.recv()
            dest = np.zeros(BLOCKS * size, np.uint8)
            dst_region = decoder.register(dest, block_size=size)
            prepared = decoder.prepare(PREFILL_ID, dst_region, remote)
            for count in COUNTS:
                cells[f"{size}x{count}"] = run_cell(path, prefill, decoder, prepared, dst_region,
                                                    (source_bytes(size), dest), size, count, iters)
            decoder.deregister(dst_region)
    finally:
        decoder.close()
        prefill.send(("close",))
        prefill.recv()
        proc.join(60)
    return {"transport": transport, "cells": cells}


def run_cell(path: str, prefill: Any, decoder: Any, prepared: Any, dst_region: Any,
             arrays: tuple[np.ndarray, np.ndarray], size: int, count: int, iters: int) -> dict[str, Any]:
    """One cell: ``count`` blocks of ``size`` bytes (every other one of the region), bare and handoff
    alternating, every destination checked."""
    source, dest = arrays
    remote = list(range(0, 2 * count, 2))  # every other block
    local = list(range(1, 2 * count, 2))
    expect = source.reshape(BLOCKS, size)[remote]
    parts: dict[str, list[float]] = {"offer": [], "claim": [], "seen": []}
    n = [0]

    def bare() -> float:
        t0 = time.perf_counter()
        prepared.read(local, remote)
        return time.perf_counter() - t0

    def handoff() -> float:
        prefill.send(("offer", remote, f"r{n[0]}"))
        ticket, offer_s = prefill.recv()
        t1 = time.perf_counter()
        decoder.claim(ticket, dst_region, local)
        t2 = time.perf_counter()
        prefill.send(("seen", ticket.offer_id))
        seen_at, reason = prefill.recv()
        if reason != "claimed":
            raise AssertionError(f"{path}: offer ended {reason}")
        n[0] += 1
        claim_s, seen_s = t2 - t1, max(0.0, seen_at - t2)
        parts["offer"].append(offer_s)
        parts["claim"].append(claim_s)
        parts["seen"].append(seen_s)
        return offer_s + claim_s + seen_s

    modes = {"bare": bare, "handoff": handoff}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(WARMUP + iters):
        order = list(modes) if i % 2 == 0 else list(modes)[::-1]
        for mode in order:
            dest[:] = 0
            t = modes[mode]()
            got = dest.reshape(BLOCKS, size)
            if not np.array_equal(got[local], expect) or np.count_nonzero(got) != count * size:
                raise AssertionError(f"{path}: {mode} of {count} x {size} B: the destination differs")
            if i >= WARMUP:
                times[mode].append(t)
    first_claim = parts["claim"][0]
    for k in parts:
        del parts[k][:WARMUP]
    prefill.send(("live",))
    if prefill.recv():
        raise AssertionError(f"{path}: offers left live")
    return {"size": size, "count": count, "times": times, "parts": parts, "first_claim": first_claim}


def measure(path: str, iters: int, prefill_dials: bool) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    # not a daemon: it starts the prefill's process
    proc = ctx.Process(target=measure_path, args=(child, path, iters, prefill_dials), daemon=False)
    proc.start()
    try:
        status, value = conn.recv()
        if status != "ok":
            raise RuntimeError(f"{path}: {value}")
        return dict(value)
    finally:
        proc.join(60)


def us(x: float) -> str:
    v = x * 1e6
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def summarize(r: dict[str, Any]) -> None:
    for cell in r["cells"].values():
        st = {}
        for mode, ts in cell["times"].items():
            st[mode] = {"p50": statistics.median(ts), "p90": percentile(ts, 90), "n": len(ts)}
        st["ratio"] = st["handoff"]["p50"] / st["bare"]["p50"]
        st["parts"] = {k: statistics.median(v) for k, v in cell["parts"].items()}
        cell["stats"] = st


def report(results: dict[str, Any]) -> list[str]:
    cfg = results["config"]
    who = "the prefill dialled the decoder" if cfg["prefill_dials"] else "the decoder dialled the prefill"
    lines = [f"handoff: offer + claim + release seen by the prefill vs a bare prepared pull of the same blocks, "
             f"{cfg['iters']} of each per cell, alternating ({who}); median [p90] in us",
             "| path | block | blocks | bare | handoff | handoff / bare | handoff - bare "
             "| offer / claim / release seen |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for path, r in results["paths"].items():
        if "skipped" in r:
            lines.append(f"| {path} | skipped: {r['skipped']} | | | | | | |")
            continue
        for cell in r["cells"].values():
            st = cell["stats"]
            b, h, p = st["bare"], st["handoff"], st["parts"]
            size = f"{cell['size'] // 1024} KiB"
            lines.append(f"| {path} ({r['transport']}) | {size} | {cell['count']} | {us(b['p50'])} [{us(b['p90'])}] | "
                         f"{us(h['p50'])} [{us(h['p90'])}] | {st['ratio']:.2f} | {us(h['p50'] - b['p50'])} | "
                         f"{us(p['offer'])} / {us(p['claim'])} / {us(p['seen'])} |")
    for path, r in results["paths"].items():
        if "skipped" not in r:
            first = next(iter(r["cells"].values()))["first_claim"]
            confirming = ", confirming the link" if cfg["prefill_dials"] else ""
            lines.append(f"{path}: the run's first claim (1 block of 4 KiB{confirming}): {us(first)} us")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="5 iterations per cell: checks that everything runs")
    ap.add_argument("--iters", type=int, default=300, help="timed iterations of each mode per cell")
    ap.add_argument("--paths", default="cma,tcp,ucx", help="comma-separated: cma, tcp, ucx (ucx over UCX_TLS=tcp)")
    ap.add_argument("--prefill-dials", action="store_true",
                    help="the prefill links to the decoder (its first claim confirms the link)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    iters = 5 if args.smoke else args.iters
    results: dict[str, Any] = {"config": {"iters": iters, "sizes": SIZES, "counts": COUNTS, "blocks": BLOCKS,
                                          "prefill_dials": args.prefill_dials}, "paths": {}}
    for path in args.paths.split(","):
        why = path_unavailable(path)
        if why is not None:
            print(f"{path}: skipped: {why}")
            results["paths"][path] = {"skipped": why}
            continue
        r = measure("ucx:tcp" if path == "ucx" else path, iters, args.prefill_dials)
        summarize(r)
        results["paths"][path] = r
        print(f"{path}: handoff / bare " + ", ".join(f"{k} {c['stats']['ratio']:.2f}" for k, c in r["cells"].items()),
              flush=True)
    lines = report(results)
    print("\n".join(lines))
    save(args.out, "handoff_prefill_dials" if args.prefill_dials else "handoff", results, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
