"""What telemetry costs a transfer: the same engine with a Prometheus collector registered and
scraped over HTTP 20 times a second, beside none, alternating in one run (docs/metrics.md).

Two processes per transport ("cma", "tcp"): a target that registers 64 MiB and listens, and an
initiator that reads it. The initiator alternates rounds of

  * 4 KiB prepared reads (``Engine.prepare`` + ``read``, one block each) for 1.5 s: every call timed;
  * 64 MiB prepared reads (256 blocks of 256 KiB in one call): GB/s;

with no collector, and with ``pdlink.metrics.EngineCollector(engine)`` in a registry served by
prometheus_client's HTTP server that a third process scrapes every 50 ms (each scrape takes one
``Engine.stats()`` and renders every family). The engine counts in C++ in both (it always does):
what differs is the scraping. Reported: the 4 KiB p50 of each mode over all its rounds, their
ratio, and the 64 MiB medians with min and max. The first read of each kind is verified byte for
byte.

    python bench/bench_telemetry.py              # about a minute on 2 cores
    python bench/bench_telemetry.py --smoke      # seconds
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import urllib.request
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_transfer import percentile, save, summary  # noqa: E402

KIB, MIB = 1024, 1024 * 1024
TOTAL = 64 * MIB
TARGET_ID, INITIATOR_ID = 1, 2
KEY_BIG, KEY_SMALL = 10, 11


def pattern(n: int) -> np.ndarray:
    return np.random.default_rng(1).integers(0, 256, size=n, dtype=np.uint8)


def target_main(conn: Any, transport: str) -> None:
    import pdlink

    data = pattern(TOTAL)
    engine = pdlink.Engine(pdlink.EngineOptions(cluster_id=TARGET_ID, listen="127.0.0.1:0", transport=transport))
    big = engine.register(data, block_size=256 * KIB, key=KEY_BIG)
    small = engine.register(address=big.address, length=TOTAL, block_size=4 * KIB, key=KEY_SMALL)
    conn.send({"port": engine.listen_port, "big": big.remote(), "small": small.remote()})
    conn.recv()
    engine.close()


def scraper_main(port: int, stop: Any, count: Any) -> None:
    """Scrapes http://127.0.0.1:port/metrics every 50 ms until `stop` is set (a Prometheus server's
    part, at 20 times its usual rate)."""
    url = f"http://127.0.0.1:{port}/metrics"
    next_at = time.monotonic()
    while not stop.is_set():
        with urllib.request.urlopen(url, timeout=5) as r:
            r.read()
        count.value += 1
        next_at += 0.05
        stop.wait(max(0.0, next_at - time.monotonic()))


def run_initiator(transport: str, info: dict[str, Any], rounds: int, seconds: float, reps: int) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry, start_http_server

    import pdlink
    from pdlink.metrics import EngineCollector

    expected = pattern(TOTAL)
    local = np.zeros(TOTAL, np.uint8)
    engine = pdlink.Engine(pdlink.EngineOptions(cluster_id=INITIATOR_ID, transport=transport))
    region_big = engine.register(local, block_size=256 * KIB)
    region_small = engine.register(address=region_big.address, length=TOTAL, block_size=4 * KIB)
    peer = engine.connect(f"127.0.0.1:{info['port']}")
    big = engine.prepare(peer, region_big, info["big"])
    small = engine.prepare(peer, region_small, info["small"])
    blocks = np.arange(TOTAL // (256 * KIB), dtype=np.int64)
    one, other = np.array([0], np.int64), np.array([7], np.int64)
    big.read(blocks, blocks)
    assert np.array_equal(local, expected), "the 64 MiB read differs from the source"
    local[:] = 0
    small.read(one, other)
    assert np.array_equal(local[:4 * KIB], expected[7 * 4 * KIB:8 * 4 * KIB]), "the 4 KiB read differs"
    assert not local[4 * KIB:].any(), "the 4 KiB read wrote outside its block"

    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(engine))
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    port = server.server_address[1]
    ctx = mp.get_context("spawn")
    lat: dict[str, list[float]] = {"none": [], "scraped": []}
    gb: dict[str, list[float]] = {"none": [], "scraped": []}
    scrapes = 0
    for r in range(rounds):
        for mode in (("none", "scraped") if r % 2 == 0 else ("scraped", "none")):
            stop, count, scraper = ctx.Event(), ctx.Value("i", 0), None
            if mode == "scraped":
                scraper = ctx.Process(target=scraper_main, args=(port, stop, count), daemon=True)
                scraper.start()
                while count.value == 0:  # scraping before the first timed call
                    time.sleep(0.01)
            for _ in range(100):  # warm
                small.read(one, other)
            end = time.perf_counter() + seconds  # long enough for 20 scrapes a second to land in it
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                small.read(one, other)
                lat[mode].append((time.perf_counter() - t0) * 1e6)
            for _ in range(reps):
                t0 = time.perf_counter()
                big.read(blocks, blocks)
                gb[mode].append(TOTAL / (time.perf_counter() - t0) / 1e9)
            if scraper is not None:
                stop.set()
                scraper.join(10)
                scrapes += count.value
    server.shutdown()
    stats = engine.stats()
    engine.close()
    p50 = {m: percentile(v, 50) for m, v in lat.items()}
    return {"transport": transport, "p50_us": p50, "p99_us": {m: percentile(v, 99) for m, v in lat.items()},
            "ratio_p50": p50["scraped"] / p50["none"], "gbps": {m: summary(v) for m, v in gb.items()},
            "gbps_ratio": statistics.median(gb["scraped"]) / statistics.median(gb["none"]),
            "calls": {m: len(v) for m, v in lat.items()}, "scrapes": scrapes,
            "transfers_counted": sum(t.transfers for t in stats.transfers)}


def initiator_main(conn: Any, *args: Any) -> None:
    try:
        conn.send(("ok", run_initiator(*args)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run(transport: str, rounds: int, seconds: float, reps: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    t_conn, t_child = ctx.Pipe()
    target = ctx.Process(target=target_main, args=(t_child, transport))
    target.start()
    info = t_conn.recv()
    i_conn, i_child = ctx.Pipe()
    initiator = ctx.Process(target=initiator_main, args=(i_child, transport, info, rounds, seconds, reps))
    initiator.start()
    status, result = i_conn.recv()
    initiator.join()
    t_conn.send("done")
    target.join()
    if status != "ok":
        raise RuntimeError(result)
    return dict(result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a few rounds: seconds")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    rounds, seconds, reps = (2, 0.25, 2) if args.smoke else (8, 1.5, 5)
    results, lines = [], []
    for transport in ("cma", "tcp"):
        r = run(transport, rounds, seconds, reps)
        results.append(r)
        g = r["gbps"]
        lines.append(f"{transport}: 4 KiB prepared read p50 {r['p50_us']['none']:.1f} us without a collector, "
                     f"{r['p50_us']['scraped']:.1f} us scraped at 20 Hz (x{r['ratio_p50']:.3f}); "
                     f"64 MiB {g['none']['median']:.2f} GB/s [{g['none']['min']:.2f}, {g['none']['max']:.2f}] vs "
                     f"{g['scraped']['median']:.2f} [{g['scraped']['min']:.2f}, {g['scraped']['max']:.2f}] "
                     f"(x{r['gbps_ratio']:.3f}); {r['scrapes']} scrapes, {r['transfers_counted']} transfers counted")
    text = "\n".join(lines)
    print(text)
    save(args.out, "bench_telemetry" + ("_smoke" if args.smoke else ""), {"runs": results}, text)


if __name__ == "__main__":
    main()
