"""How long a role switch takes, idle and under load (issue #34): ``pdlink.Engine.switch_role`` of
a prefill engine, PROMPT -> DECODER -> PROMPT ..., with each switch's ``expected_epoch``, while its
decoder peer pulls from it.

Two processes on one host per data path (cma, tcp, and ucx over its tcp transport where UCX loads):
a prefill engine that listens and publishes one 64 MiB region, and 8 decoder engines in one
process, each linked to it (transfers on one link run one at a time) with a 64 MiB destination.

  * idle   : --switches switches (100) with nothing in flight;
  * loaded : each decoder engine pulls the whole 64 MiB region into its destination on a thread
             of its own, again and again (a pull refused with LLM_ROLE_SWITCHING while the prefill
             drains is tried again after 1 ms); before each switch the prefill waits (at most
             IN_FLIGHT_WAIT_S) until it serves 8 requests, so a switch starts with up to 8 x 64 MiB
             in flight and its drain waits for what it counts of them (on tcp each split pull
             admitted before the drain until its last chunk: docs/architecture.md, "Roles").

Timed: the ``switch_role`` call in the prefill's process, which returns once the switch committed
(the drain included). Reported: p50 and p99 over the switches, per data path, how many requests
the prefill served when each loaded switch began (median), and how many pulls completed and were
refused meanwhile. On cma a descriptor read is a
kernel copy the prefill never sees (the cached-layout path), so it counts none and drains none.
Verified byte for byte: one pull before the load, and one into each of the 8 destinations after it
(a pull under the switches ends exact or refused with LLM_ROLE_SWITCHING; any other error fails
the run).

    python bench/bench_switch.py                 # 100 switches per path and mode (a few minutes on 2 cores)
    python bench/bench_switch.py --smoke         # 8 x 1 MiB, 6 switches: seconds; what CI runs
    python bench/bench_switch.py --paths tcp --switches 20
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

from bench_transfer import MIB, nonzero_content, path_unavailable, percentile, save, set_transport

HERE = os.path.dirname(os.path.abspath(__file__))
PREFILL_ID, DECODER_ID = 11, 12
KEY = 7
PULLERS = 8
IN_FLIGHT_WAIT_S = 0.5
REFUSED_BACKOFF_S = 0.001  # a puller refused with LLM_ROLE_SWITCHING tries again after this
FIELD = "vLLM / SGLang / MindIE (issue #34): 0.3-1.6 s idle, up to 4.3 s under load"


# ---------------------------------------------------------------- the prefill (switching) process


def prefill_main(conn: Any, path: str, cfg: dict[str, Any]) -> None:
    import pdlink

    set_transport(path if path.startswith("ucx") else "auto")  # auto accepts tcp and cma
    engine = pdlink.Engine(pdlink.EngineOptions(cluster_id=PREFILL_ID, role="PROMPT", listen="127.0.0.1:0",
                                                timeout_ms=60000))
    source = nonzero_content(cfg["nbytes"])
    region = engine.register(source, block_size=cfg["nbytes"], key=KEY)
    conn.send((engine.listen_port, region.address))
    listen = f"127.0.0.1:{engine.listen_port}"
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            engine.close()
            conn.send("stopped")
            return
        _, switches, loaded = cmd
        times, in_flight = [], []
        try:
            for _ in range(switches):
                state = engine.role_state()
                if loaded:
                    deadline = time.monotonic() + IN_FLIGHT_WAIT_S
                    while state.served_in_flight < PULLERS and time.monotonic() < deadline:
                        time.sleep(0.001)
                        state = engine.role_state()
                    in_flight.append(state.served_in_flight)
                role = "DECODER" if state.role == "PROMPT" else "PROMPT"
                t0 = time.perf_counter()
                engine.switch_role(role, listen, expected_epoch=state.epoch, drain_timeout_ms=60000)
                times.append((time.perf_counter() - t0) * 1e3)
            final = engine.role_state()
            conn.send(("ok", {"ms": times, "in_flight": in_flight, "epoch": final.epoch, "phase": final.phase,
                              "pins": final.pins}))
        except Exception as e:  # noqa: BLE001 - reported by the parent
            conn.send(("failed", f"{type(e).__name__}: {e}"))


# ---------------------------------------------------------------- the decoder (pulling) process


def decoder_main(conn: Any, path: str, port: int, src: int, cfg: dict[str, Any]) -> None:
    """PULLERS decoder engines in this process (a link each: transfers on one link run one at a time),
    each with a destination of its own, pulling on a thread of its own."""
    import pdlink

    set_transport(path)
    nbytes = cfg["nbytes"]
    expect = nonzero_content(nbytes)
    try:
        engines = [pdlink.Engine(pdlink.EngineOptions(cluster_id=DECODER_ID + i, role="DECODER", timeout_ms=60000))
                   for i in range(PULLERS)]
        dests = [np.zeros(nbytes, np.uint8) for _ in range(PULLERS)]
        regions = [e.register(d, block_size=nbytes) for e, d in zip(engines, dests)]
        for e in engines:
            e.connect(f"127.0.0.1:{port}", cluster_id=PREFILL_ID)
        transport = engines[0].links()[0].transport
        engines[0].read(PREFILL_ID, [(regions[0].address, nbytes)], [(src, nbytes)])
        if not np.array_equal(dests[0], expect):
            raise AssertionError(f"{path}: the verified pull differs")
        conn.send(("ok", transport))
    except Exception as e:  # noqa: BLE001 - reported by the parent
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    stop = threading.Event()
    done = [0] * PULLERS
    refused = [0] * PULLERS
    errors: list[str] = []

    def pull(i: int) -> None:
        while not stop.is_set():
            try:
                engines[i].read(PREFILL_ID, [(regions[i].address, nbytes)], [(src, nbytes)])
                done[i] += 1
            except pdlink.LLMException as e:
                if e.status_code != pdlink.LLMStatusCode.LLM_ROLE_SWITCHING:
                    errors.append(f"puller {i}: {e!r}")
                    return
                refused[i] += 1
                time.sleep(REFUSED_BACKOFF_S)  # as a client would: the prefill is draining

    assert conn.recv() == "load"
    threads = [threading.Thread(target=pull, args=(i,), daemon=True) for i in range(PULLERS)]
    for t in threads:
        t.start()
    conn.send("loading")
    assert conn.recv() == "stop"
    stop.set()
    for t in threads:
        t.join(120)
    exact = True
    for i in range(PULLERS):  # one more pull into every destination, each verified
        dests[i][:] = 0
        engines[i].read(PREFILL_ID, [(regions[i].address, nbytes)], [(src, nbytes)])
        exact = exact and bool(np.array_equal(dests[i], expect))
    for engine in engines:
        engine.close()
    conn.send({"pulls": sum(done), "refused": sum(refused), "errors": errors, "exact_after": exact,
               "stuck": sum(t.is_alive() for t in threads)})


# ---------------------------------------------------------------- orchestration


def measure(path: str, cfg: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    pconn, pchild = ctx.Pipe()
    prefill = ctx.Process(target=prefill_main, args=(pchild, path, cfg), daemon=True)
    prefill.start()
    port, src = pconn.recv()
    dconn, dchild = ctx.Pipe()
    decoder = ctx.Process(target=decoder_main, args=(dchild, path, port, src, cfg), daemon=True)
    decoder.start()
    try:
        status, transport = dconn.recv()
        if status != "ok":
            raise RuntimeError(f"decoder: {transport}")
        out: dict[str, Any] = {"transport": transport}
        pconn.send(("switch", cfg["switches"], False))
        status, idle = pconn.recv()
        if status != "ok":
            raise RuntimeError(f"idle switches: {idle}")
        dconn.send("load")
        assert dconn.recv() == "loading"
        pconn.send(("switch", cfg["switches"], True))
        status, loaded = pconn.recv()
        dconn.send("stop")
        pulls = dconn.recv()
        if status != "ok":
            raise RuntimeError(f"loaded switches: {loaded}")
        if pulls["errors"] or pulls["stuck"] or not pulls["exact_after"]:
            raise RuntimeError(f"the pulls under the switches: {pulls}")
        out.update(idle=idle, loaded=loaded, pulls=pulls)
        return out
    finally:
        pconn.send(("stop",))
        pconn.recv()
        prefill.join(30)
        decoder.join(30)


def stats(ms: list[float]) -> dict[str, float]:
    return {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "max": max(ms), "n": len(ms)}


def ms(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.1f}"


def report(results: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    mib = cfg["nbytes"] // MIB
    lines = [f"role switches, {cfg['switches']} per mode; loaded: {PULLERS} pulls of {mib} MiB running "
             f"(switch_role's own time in the switching process, ms)",
             f"| path | idle p50 | idle p99 | loaded p50 | loaded p99 | loaded max | served in flight at the "
             f"switch (median) | pulls of {mib} MiB done / refused during the loaded run |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for path, r in results["paths"].items():
        if "skipped" in r:
            lines.append(f"| {path} | skipped: {r['skipped']} | | | | | | |")
            continue
        idle, loaded = r["idle"]["stats"], r["loaded"]["stats"]
        lines.append(f"| {path} ({r['transport']}) | {ms(idle['p50'])} | {ms(idle['p99'])} | {ms(loaded['p50'])} | "
                     f"{ms(loaded['p99'])} | {ms(loaded['max'])} | "
                     f"{statistics.median(r['loaded']['in_flight']):.0f} | "
                     f"{r['pulls']['pulls']} / {r['pulls']['refused']} |")
    lines.append(f"for context, the field's published switch times: {FIELD}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and counts: checks that everything runs")
    ap.add_argument("--switches", type=int, default=100)
    ap.add_argument("--paths", default="cma,tcp,ucx", help="comma-separated: cma, tcp, ucx (ucx over UCX_TLS=tcp)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    cfg = {"nbytes": 64 * MIB, "switches": args.switches}
    if args.smoke:
        cfg.update(nbytes=1 * MIB, switches=6)
    results: dict[str, Any] = {"config": cfg, "paths": {}}
    for path in args.paths.split(","):
        why = path_unavailable(path)
        if why is not None:
            print(f"{path}: skipped: {why}")
            results["paths"][path] = {"skipped": why}
            continue
        r = measure("ucx:tcp" if path == "ucx" else path, cfg)
        for mode in ("idle", "loaded"):
            r[mode]["stats"] = stats(r[mode]["ms"])
        results["paths"][path] = r
        print(f"{path}: idle p50 {ms(r['idle']['stats']['p50'])} ms, loaded p50 {ms(r['loaded']['stats']['p50'])} ms",
              flush=True)
    lines = report(results, cfg)
    print("\n".join(lines))
    save(args.out, "switch", results, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
