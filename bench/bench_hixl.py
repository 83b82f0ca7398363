"""pdlink's ``hixl`` beside NIXL's prepared transfers and Mooncake's batch API, in one run, same
host, no secret.

Two processes (a hixl server that registers 64 MiB, a client that registers 64 MiB of its own and
connects), for each pdlink transport ("cma": direct memory access, "tcp": loopback):

  * one 4 KiB READ by ``transfer_sync`` (a one-descriptor list): p50 / p99;
  * 64 MiB as 256 KiB and as 4 KiB descriptors in one ``transfer_sync`` READ, remote blocks in
    reversed order so nothing coalesces; GB/s and the cost per descriptor. The descriptor list is
    built once (``TransferOpDesc`` objects, as callers keep them) and timed separately;
  * the ceiling: numpy copying the same 4 KiB blocks (reversed) in this process.

The peers, each in its own process pair, when their interpreters have them: NIXL (UCX backend,
default transports: its prepared 4 KiB READ and both descriptor sizes, bench/peers/nixl_peer.py)
and Mooncake Transfer Engine (TCP, P2P handshake: its batch read of both sizes and one 4 KiB
synchronous read, bench/peers/mooncake_peer.py). Every kind of transfer is verified byte for
byte once. Reported: medians, with min and max.

    python bench/bench_hixl.py            # about a minute on 2 cores
    python bench/bench_hixl.py --smoke    # seconds; what CI runs (tests/programs/test_bench_smoke.py)

PDLINK_BENCH_NIXL_PYTHON / PDLINK_BENCH_MOONCAKE_PYTHON: interpreters that have the peers.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_small import gbps, host_transports, latency, memcpy_ceiling, pattern, run_nixl, run_pair  # noqa: E402
from bench_transfer import fmt, run_peer, save, summary  # noqa: E402

KIB, MIB = 1024, 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_main(conn: Any, total: int) -> None:
    import hixl

    engine = hixl.Hixl()
    for _ in range(20):  # a free port can be taken between the probe and the listen
        name = f"127.0.0.1:{free_port()}"
        if engine.initialize(name, {}) == hixl.SUCCESS:
            break
    else:
        raise RuntimeError("no listen port")
    data = pattern(total, 1)
    ret, handle = engine.register_mem(hixl.MemDesc(data.ctypes.data, total), hixl.MEM_HOST)
    assert ret == hixl.SUCCESS, ret
    conn.send((name, data.ctypes.data))
    conn.recv()
    engine.deregister_mem(handle)
    engine.finalize()


def client_main(conn: Any, transport: str, total: int, reps: int, lat_n: int, server: str, raddr: int) -> None:
    try:
        conn.send(("ok", run_client(transport, total, reps, lat_n, server, raddr)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_client(transport: str, total: int, reps: int, lat_n: int, server: str, raddr: int) -> dict[str, Any]:
    os.environ["PDLINK_TRANSPORT"] = transport
    import hixl

    expected = pattern(total, 1)
    local = np.zeros(total, np.uint8)
    engine = hixl.Hixl()
    assert engine.initialize("127.0.0.1", {}) == hixl.SUCCESS
    ret, handle = engine.register_mem(hixl.MemDesc(local.ctypes.data, total), hixl.MEM_HOST)
    assert ret == hixl.SUCCESS, ret
    assert engine.connect(server, 5000) == hixl.SUCCESS
    res: dict[str, Any] = {"transport": transport}
    for label, bs in (("256K", 256 * KIB), ("4K", 4 * KIB)):
        n = total // bs
        t0 = time.perf_counter()
        descs = [hixl.TransferOpDesc(local.ctypes.data + i * bs, raddr + (n - 1 - i) * bs, bs) for i in range(n)]
        build_us = (time.perf_counter() - t0) * 1e6
        local[:] = 0

        def read(descs: list[Any] = descs) -> None:
            assert engine.transfer_sync(server, hixl.READ, descs, 30000) == hixl.SUCCESS

        t = gbps(read, total, reps)
        if not np.array_equal(local.reshape(n, bs)[::-1].reshape(-1), expected):
            raise AssertionError(f"{transport}: {label} descriptors: bytes differ")
        res[f"read_{label}"] = {**summary(t), "us_per_desc": total / statistics.median(t) / 1e9 / n * 1e6,
                                "build_list_us": build_us}
    one = [hixl.TransferOpDesc(local.ctypes.data, raddr + 5 * 4 * KIB, 4 * KIB)]

    def read_one() -> None:
        assert engine.transfer_sync(server, hixl.READ, one, 1000) == hixl.SUCCESS

    res["lat_4k_us"] = latency(read_one, lat_n)
    if not np.array_equal(local[:4 * KIB], expected[5 * 4 * KIB:6 * 4 * KIB]):
        raise AssertionError(f"{transport}: one 4 KiB read: bytes differ")
    assert engine.disconnect(server, 5000) == hixl.SUCCESS
    engine.deregister_mem(handle)
    engine.finalize()
    return res


def run_mooncake(total: int, reps: int, lat_n: int) -> dict[str, Any] | None:
    """Mooncake's batch read at 256 KiB and 4 KiB blocks (with its one 4 KiB sync read)."""
    out = None
    for block in (256 * KIB, 4 * KIB):
        cfg = {"total": total, "block": block, "reps": reps, "lat_n": lat_n}
        r = run_peer(f"Mooncake TE tcp {block // KIB} KiB", "mooncake_peer.py", "PDLINK_BENCH_MOONCAKE_PYTHON",
                     "mooncake.engine", {}, cfg)
        if r is None:
            return out
        if out is None:
            out = r
        out[f"read_{block // KIB}K"] = r["read"]
    return out


def report(results: dict[str, Any]) -> str:
    lines = [f"pdlink hixl benchmark ({results['config']})"]
    ceil = results["memcpy"]["blocks_4K"]
    lines.append(f"  ceiling memcpy 4 KiB blocks       : {fmt(ceil)}, {ceil['us_per_desc']:.3f} us/desc")
    nixl, mc = results["peers"].get("NIXL/UCX default"), results["peers"].get("Mooncake TE tcp")
    for r in results["hixl"]:
        tr = r["transport"]
        p = r["lat_4k_us"]
        line = f"  hixl {tr:<4} transfer_sync 4 KiB READ: p50 {p['p50']:.1f} us, p99 {p['p99']:.1f} us"
        if nixl:
            line += f"  ({p['p50'] / nixl['lat_us']['p50']:.2f}x NIXL's p50)"
        if mc:
            line += f"  ({p['p50'] / mc['lat_us']['p50']:.2f}x Mooncake's)"
        lines.append(line)
        for label in ("256K", "4K"):
            s = r[f"read_{label}"]
            line = f"  hixl {tr:<4} {label:>4} descriptors      : {fmt(s)}, {s['us_per_desc']:.3f} us/desc"
            if label == "4K":
                line += f", {s['us_per_desc'] / ceil['us_per_desc']:.1f}x memcpy's"
            for name, peer in (("NIXL", nixl), ("Mooncake", mc)):
                if peer and f"read_{label}" in peer:
                    line += f", {s['median'] / peer[f'read_{label}']['median']:.2f}x {name}'s GB/s"
            line += f" (list built once: {s['build_list_us'] / 1e3:.1f} ms)"
            lines.append(line)
    for name, peer, what in (("NIXL/UCX", nixl, "prepared"), ("Mooncake tcp", mc, "batch")):
        if not peer:
            lines.append(f"  {name}: not run (see above)")
            continue
        lat = peer["lat_us"]
        lines.append(f"  {name} 4 KiB READ{'':<14}: p50 {lat['p50']:.1f} us, p99 {lat['p99']:.1f} us")
        for label in ("256K", "4K"):
            if f"read_{label}" in peer:
                lines.append(f"  {name} {what} {label:>4} x{'':<8}: {fmt(peer[f'read_{label}'])}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and counts: checks that everything runs")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="where hixl.json goes")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--transports", default="cma,tcp")
    args = ap.parse_args()
    transports = host_transports(args.transports)
    total = 1 * MIB if args.smoke else 64 * MIB
    reps = 2 if args.smoke else args.reps
    lat_n = 200 if args.smoke else 5000
    results: dict[str, Any] = {"config": f"{total // MIB} MiB, {reps} reps, {lat_n} latency samples, no secret",
                               "peers": {}}
    results["hixl"] = run_pair("hixl", server_main, (total,), client_main, transports,
                               lambda tr, info: (tr, total, reps, lat_n, *info))
    results["memcpy"] = memcpy_ceiling(total, reps)
    if not args.no_peers:
        nixl = run_nixl(total, reps, lat_n)
        if nixl:
            results["peers"]["NIXL/UCX default"] = nixl
        mc = run_mooncake(total, reps, lat_n)
        if mc:
            results["peers"]["Mooncake TE tcp"] = mc
    text = report(results)
    print(text)
    save(args.out, "hixl", results, text)


if __name__ == "__main__":
    main()
