"""What cancel costs and what it buys (issue #34): async transfers of ``pdlink.Engine`` carry a
cancel token, and with one a transfer over 8 MiB (``limits::kCancelSliceBytes``) is posted as
requests of at most 8 MiB each, so that ``Pending.cancel()`` waits for at most the request in
flight (docs/architecture.md, "Cancel points"). Synchronous ``Engine.read`` has no token and is not
sliced. This measures both sides of that trade.

Two processes on one host per data path (cma, tcp, and ucx over its tcp transport where UCX loads):
a target that listens and registers one region (256 MiB), and an initiator linked to it with a
destination of the same size (1 MiB blocks).

  * slices : one descriptor of 64 MiB and of 256 MiB read with ``Engine.read`` (sync, one request;
             on tcp split over the link's streams) and with ``Engine.read_async(...).wait()``
             (async, 8 MiB requests), --reps times each, the two modes alternating (which one goes
             first alternates too); reported: median and p90-time GB/s of each and async / sync
             of the medians per size: what the slicing costs (1.0: nothing);
  * cancel : a 256 MiB ``read_async`` is started and, at a fraction of the median async 256 MiB
             time measured above (0.25, 0.5, 0.75 in turn: a bench may place a cancel by the
             clock; nothing reports progress without slowing the transfer), ``cancel()`` is
             called; timed: from ``cancel()`` to ``wait()`` returning (raising TransferCancelled,
             or returning when the transfer had already finished), p50 / p90 / p99 over the cancels
             that won (CANCELLED; a DONE one waited only for what was left), with how many ended
             CANCELLED and DONE, how many waited at most one 8 MiB request, and the MiB that had
             landed (whole 1 MiB blocks of new bytes: a won cancel may still find every byte
             landed, its last request already sent). For context: the time
             one 8 MiB request takes at the async rate, the most a cancel should wait, and the
             time the transfer would have run on had nothing stopped it.

Verified: every completed transfer byte for byte against the source (the destination zeroed
before each), and after every cancelled one each 1 MiB block of the destination holds all its old
(zero) or all its new bytes. Any mismatch fails the run.

    python bench/bench_cancel.py                  # 9 reps per size and mode, 30 cancels per path
    python bench/bench_cancel.py --smoke          # 16 MiB, 2 reps, 3 cancels: seconds; what CI runs
    python bench/bench_cancel.py --paths tcp --reps 5
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

from bench_transfer import MIB, nonzero_content, path_unavailable, percentile, save, set_transport

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET_ID, INITIATOR_ID = 21, 22
SLICE = 8 * MIB  # limits::kCancelSliceBytes
CANCEL_AT = (0.25, 0.5, 0.75)  # fractions of the median async transfer time, in turn


# ---------------------------------------------------------------- the target (serving) process


def target_main(conn: Any, path: str, nbytes: int) -> None:
    import pdlink

    set_transport(path if path.startswith("ucx") else "auto")  # auto accepts tcp and cma
    engine = pdlink.Engine(pdlink.EngineOptions(cluster_id=TARGET_ID, listen="127.0.0.1:0", timeout_ms=60000))
    source = nonzero_content(nbytes)
    region = engine.register(source, block_size=MIB)
    conn.send((engine.listen_port, region.address))
    conn.recv()  # "stop"
    engine.close()
    conn.send("stopped")


# ---------------------------------------------------------------- the initiator process


def initiator_main(conn: Any, path: str, port: int, src: int, cfg: dict[str, Any]) -> None:
    try:
        conn.send(("ok", run_initiator(path, port, src, cfg)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        conn.send(("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def blocks_state(dest: np.ndarray, expect: np.ndarray) -> tuple[int, int, int]:
    """(new, old, mixed) 1 MiB blocks of ``dest``: all the source's bytes, all zero, or neither."""
    d, e = dest.reshape(-1, MIB), expect.reshape(-1, MIB)
    new = np.all(d == e, axis=1)
    old = ~new & ~d.any(axis=1)
    return int(new.sum()), int(old.sum()), int((~new & ~old).sum())


def run_initiator(path: str, port: int, src: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import pdlink

    set_transport(path)
    nbytes = cfg["nbytes"]
    expect = nonzero_content(nbytes)
    dest = np.zeros(nbytes, np.uint8)
    engine = pdlink.Engine(pdlink.EngineOptions(cluster_id=INITIATOR_ID, timeout_ms=60000))
    try:
        region = engine.register(dest, block_size=MIB)
        engine.connect(f"127.0.0.1:{port}", cluster_id=TARGET_ID)
        transport = engine.links()[0].transport

        def sync(size: int) -> None:
            engine.read(TARGET_ID, [(region.address, size)], [(src, size)])

        def async_(size: int) -> None:
            engine.read_async(TARGET_ID, [(region.address, size)], [(src, size)]).wait(120)

        modes = {"sync": sync, "async": async_}
        verified = 0
        slices: dict[str, dict[str, list[float]]] = {}
        for size in cfg["sizes"]:
            for fn in modes.values():  # warm up: pages touched, link and lanes up
                fn(size)
            times: dict[str, list[float]] = {m: [] for m in modes}
            for rep in range(cfg["reps"]):
                order = list(modes) if rep % 2 == 0 else list(modes)[::-1]
                for mode in order:
                    dest[:size] = 0
                    t0 = time.perf_counter()
                    modes[mode](size)
                    times[mode].append(time.perf_counter() - t0)
                    if not np.array_equal(dest[:size], expect[:size]):
                        raise AssertionError(f"{path}: {mode} read of {size // MIB} MiB: bytes differ")
                    verified += 1
            slices[str(size)] = times

        # cancel latency: a whole-region read_async, cancelled at a fraction of its median time
        full = float(statistics.median(slices[str(nbytes)]["async"])) if str(nbytes) in slices else None
        if full is None:
            raise AssertionError("the cancel runs need the async time of the whole region (a size == nbytes)")
        cancels: list[dict[str, Any]] = []
        for i in range(cfg["cancels"]):
            at = CANCEL_AT[i % len(CANCEL_AT)] * full
            dest[:] = 0
            t_start = time.perf_counter()
            pending = engine.read_async(TARGET_ID, [(region.address, nbytes)], [(src, nbytes)])
            left = t_start + at - time.perf_counter()
            if left > 0:
                time.sleep(left)
            done_before = pending.done()
            t0 = time.perf_counter()
            won = pending.cancel()
            try:
                pending.wait(120)
            except pdlink.TransferCancelled:
                pass
            t1 = time.perf_counter()
            status = pending.status()
            if status not in ("CANCELLED", "DONE") or won != (status == "CANCELLED"):
                raise AssertionError(f"{path}: cancel {i}: cancel() returned {won}, status {status}")
            new, old, mixed = blocks_state(dest, expect)
            if status == "DONE" and new != nbytes // MIB:
                raise AssertionError(f"{path}: cancel {i}: the transfer ended DONE but {old + mixed} MiB differ")
            if mixed:
                raise AssertionError(f"{path}: cancel {i}: {mixed} blocks of 1 MiB are neither old nor new")
            cancels.append({"at_ms": at * 1e3, "cancel_ms": (t1 - t0) * 1e3, "since_start_ms": (t1 - t_start) * 1e3,
                            "status": status, "done_before_cancel": done_before, "new_mib": new})
        # the link is still usable after the cancels: one more read, verified
        dest[:] = 0
        sync(nbytes)
        if not np.array_equal(dest, expect):
            raise AssertionError(f"{path}: the read after the cancels: bytes differ")
        verified += 1
        return {"transport": transport, "nbytes": nbytes, "slices": slices, "cancels": cancels, "async_full_s": full,
                "verified_exact": verified}
    finally:
        engine.close()


# ---------------------------------------------------------------- orchestration


def measure(path: str, cfg: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    tconn, tchild = ctx.Pipe()
    target = ctx.Process(target=target_main, args=(tchild, path, cfg["nbytes"]), daemon=True)
    target.start()
    port, src = tconn.recv()
    iconn, ichild = ctx.Pipe()
    initiator = ctx.Process(target=initiator_main, args=(ichild, path, port, src, cfg), daemon=True)
    initiator.start()
    try:
        status, value = iconn.recv()
        if status != "ok":
            raise RuntimeError(f"{path}: initiator: {value}")
        return dict(value)
    finally:
        tconn.send("stop")
        tconn.recv()
        target.join(30)
        initiator.join(30)


def summarize(r: dict[str, Any]) -> None:
    """Adds the statistics to one path's raw result."""
    for size, times in r["slices"].items():
        st: dict[str, Any] = {}
        for mode, ts in times.items():
            gbps = [int(size) / t / 1e9 for t in ts]
            st[mode] = {"p50_gbps": int(size) / statistics.median(ts) / 1e9,
                        "p90_gbps": int(size) / percentile(ts, 90) / 1e9, "min_gbps": min(gbps),
                        "max_gbps": max(gbps), "n": len(ts)}
        st["async_over_sync"] = st["async"]["p50_gbps"] / st["sync"]["p50_gbps"]
        r.setdefault("slice_stats", {})[size] = st
    c = r["cancels"]
    rate = r["nbytes"] / r["async_full_s"]  # bytes/s of the async whole-region read
    slice_ms = SLICE / rate * 1e3
    # the latency of the cancels that won; one that lost (DONE) only waited for what was left
    won = [x["cancel_ms"] for x in c if x["status"] == "CANCELLED"]
    lat = won or [float("nan")]
    r["cancel_stats"] = {
        "p50_ms": percentile(lat, 50), "p90_ms": percentile(lat, 90), "p99_ms": percentile(lat, 99),
        "max_ms": max(lat), "n": len(won), "within_slice": sum(x <= slice_ms for x in lat),
        "cancelled": sum(x["status"] == "CANCELLED" for x in c), "done": sum(x["status"] == "DONE" for x in c),
        "new_mib_median": statistics.median(x["new_mib"] for x in c), "slice_ms": slice_ms,
        "run_on_ms_median": statistics.median(r["async_full_s"] * 1e3 - x["at_ms"] for x in c),
    }


def fmt(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def report(results: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = [f"slices: one descriptor read, sync Engine.read (one request) vs read_async().wait() (8 MiB "
             f"requests), {cfg['reps']} reps each, alternating; GB/s at the median time [at the p90 time]",
             "| path | size | sync GB/s | async GB/s | async / sync | spread sync / async (min..max GB/s) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for path, r in results["paths"].items():
        if "skipped" in r:
            lines.append(f"| {path} | skipped: {r['skipped']} | | | | |")
            continue
        for size, st in r["slice_stats"].items():
            s, a = st["sync"], st["async"]
            lines.append(f"| {path} ({r['transport']}) | {int(size) // MIB} MiB | {s['p50_gbps']:.2f} "
                         f"[{s['p90_gbps']:.2f}] | {a['p50_gbps']:.2f} [{a['p90_gbps']:.2f}] | "
                         f"{st['async_over_sync']:.2f} | {s['min_gbps']:.2f}..{s['max_gbps']:.2f} / "
                         f"{a['min_gbps']:.2f}..{a['max_gbps']:.2f} |")
    mib = cfg["nbytes"] // MIB
    lines += ["",
              f"cancel: a {mib} MiB read_async cancelled at {', '.join(str(f) for f in CANCEL_AT)} of its median "
              f"time in turn, {cfg['cancels']} per path; ms from cancel() to wait() returning, over the cancels "
              f"that won (CANCELLED)",
              "| path | p50 ms | p90 ms | p99 ms | max ms | within one request | CANCELLED / DONE | MiB landed "
              "(median) | one 8 MiB request at the async rate, ms | would have run on (median), ms |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for path, r in results["paths"].items():
        if "skipped" in r:
            lines.append(f"| {path} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        c = r["cancel_stats"]
        lines.append(f"| {path} ({r['transport']}) | {fmt(c['p50_ms'])} | {fmt(c['p90_ms'])} | {fmt(c['p99_ms'])} | "
                     f"{fmt(c['max_ms'])} | {c['within_slice']} / {c['n']} | {c['cancelled']} / {c['done']} | "
                     f"{c['new_mib_median']:.0f} | {fmt(c['slice_ms'])} | "
                     f"{fmt(c['run_on_ms_median'])} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and counts: checks that everything runs")
    ap.add_argument("--reps", type=int, default=9, help="timed reads per size and mode")
    ap.add_argument("--cancels", type=int, default=30, help="cancelled reads per path")
    ap.add_argument("--paths", default="cma,tcp,ucx", help="comma-separated: cma, tcp, ucx (ucx over UCX_TLS=tcp)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    cfg: dict[str, Any] = {"nbytes": 256 * MIB, "sizes": [64 * MIB, 256 * MIB], "reps": args.reps,
                           "cancels": args.cancels}
    if args.smoke:
        cfg.update(nbytes=16 * MIB, sizes=[4 * MIB, 16 * MIB], reps=2, cancels=3)
    results: dict[str, Any] = {"config": cfg, "paths": {}}
    for path in args.paths.split(","):
        why = path_unavailable(path)
        if why is not None:
            print(f"{path}: skipped: {why}")
            results["paths"][path] = {"skipped": why}
            continue
        r = measure("ucx:tcp" if path == "ucx" else path, cfg)
        summarize(r)
        results["paths"][path] = r
        print(f"{path}: async/sync "
              + ", ".join(f"{int(s) // MIB} MiB {st['async_over_sync']:.2f}" for s, st in r["slice_stats"].items())
              + f"; cancel p50 {fmt(r['cancel_stats']['p50_ms'])} ms", flush=True)
    lines = report(results, cfg)
    print("\n".join(lines))
    save(args.out, "cancel", results, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
