"""Small transfers: pdlink's native API beside NIXL's prepared transfers and the memcpy ceiling, in
one run, same host, no secret.

Two processes (a target that registers 64 MiB and listens, an initiator that connects and moves
it), for each pdlink transport ("cma": direct memory access, "tcp": loopback):

  * one 4 KiB READ through a prepared transfer (``Engine.prepare`` + ``read``): p50 / p99;
  * the same through ``llm_datadist``'s ``pull_blocks`` (a one-block call, its per-call cost);
  * descriptor throughput: 64 MiB as 256 KiB and as 4 KiB descriptors, block order reversed so
    nothing coalesces, posted as one prepared index array and as one descriptor list
    (``Engine.read``); with the per-descriptor cost of the 4 KiB case;
  * the ceilings: numpy copying the same 4 KiB blocks (reversed) in this process, per descriptor;
    and one 4 KiB process_vm_readv in C (bench/cma_ceiling.c), what the same-host path cannot beat;
  * ``import pdlink``: median wall time of a fresh interpreter, beside ``import numpy``.

NIXL (UCX backend, default transports) runs the same: the prepared 4 KiB READ and both
descriptor sizes (bench/peers/nixl_peer.py), when PDLINK_BENCH_NIXL_PYTHON (or this interpreter)
has it. Every kind of transfer is verified byte for byte once. Reported: medians, with min and max.

    python bench/bench_small.py              # a minute or two on 2 cores
    python bench/bench_small.py --smoke      # seconds; what CI runs
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_transfer import percentile, run_peer, save, summary  # noqa: E402

KIB, MIB = 1024, 1024 * 1024
TARGET_ID, INITIATOR_ID = 1, 2
KEY_256K, KEY_4K = 10, 11


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def target_main(conn: Any, total: int) -> None:
    import pdlink
    from llm_datadist import BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole

    os.environ["PDLINK_TRANSPORT"] = "auto"
    data = pattern(total, 1)
    engine = pdlink.Engine(pdlink.EngineOptions(cluster_id=TARGET_ID, listen="127.0.0.1:0"))
    # the same memory twice: in 256 KiB and in 4 KiB blocks, each published under its key
    big = engine.register(data, block_size=256 * KIB, key=KEY_256K)
    small = engine.register(address=big.address, length=total, block_size=4 * KIB, key=KEY_4K)
    # and llm_datadist beside it (its own engine): one 4 KiB one-tensor blocks cache
    dd = LLMDataDist(LLMRole.PROMPT, 3)
    cfg = LLMConfig()
    cfg.enable_cache_manager = True
    cfg.listen_ip_info = "127.0.0.1:0"
    dd.init(cfg.generate_options())
    one = pattern(16 * 4 * KIB, 2).reshape(16, 4 * KIB)
    dd.cache_manager.register_blocks_cache(CacheDesc(1, [16, 4 * KIB], DataType.DT_UINT8), [one.ctypes.data],
                                           BlocksCacheKey(3, 0))
    conn.send({"port": engine.listen_port, "dd_port": dd.listen_port, "big": big.remote(), "small": small.remote()})
    conn.recv()
    dd.finalize()
    engine.close()


def latency(fn, n: int) -> dict[str, float]:
    for _ in range(max(10, n // 10)):
        fn()
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        lat.append((time.perf_counter() - t0) * 1e6)
    return {"p50": percentile(lat, 50), "p99": percentile(lat, 99), "n": n}


def gbps(fn, nbytes: int, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return out


def report_to(conn: Any, run: Callable[..., Any], *args: Any) -> None:
    """Sends ("ok", run(*args)), or ("error", the traceback): what ``run_pair`` reads."""
    try:
        conn.send(("ok", run(*args)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def initiator_main(conn: Any, transport: str, total: int, reps: int, lat_n: int, info: dict[str, Any]) -> None:
    report_to(conn, run_initiator, transport, total, reps, lat_n, info)


def run_initiator(transport: str, total: int, reps: int, lat_n: int, info: dict[str, Any]) -> dict[str, Any]:
    import pdlink
    from llm_datadist import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole

    expected = pattern(total, 1)
    local = np.zeros(total, np.uint8)
    res: dict[str, Any] = {"transport": transport}
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=INITIATOR_ID, transport=transport)) as engine:
        peer = engine.connect(f"127.0.0.1:{info['port']}")
        got = {link.transport for link in engine.links()}
        assert got == {transport}, f"asked for {transport}, linked over {got}"
        for label, bs, remote in (("256K", 256 * KIB, info["big"]), ("4K", 4 * KIB, info["small"])):
            region = engine.register(local, block_size=bs)
            n = total // bs
            src = np.arange(n, dtype=np.int64)
            dst = src[::-1].copy()
            prepared = engine.prepare(peer, region, remote)
            local[:] = 0
            t = gbps(lambda: prepared.read(dst, src), total, reps)  # noqa: B023 - used at once
            if not np.array_equal(local.reshape(n, bs)[::-1].reshape(-1), expected):
                raise AssertionError(f"{transport}: prepared {label} read: bytes differ")
            res[f"prepared_{label}"] = {**summary(t), "us_per_desc": total / statistics.median(t) / 1e9 / n * 1e6}
            ldesc = np.stack([local.ctypes.data + dst * bs, np.full(n, bs)], axis=1).astype(np.uint64)
            rdesc = np.stack([remote.address + src * bs, np.full(n, bs)], axis=1).astype(np.uint64)
            local[:] = 0
            t = gbps(lambda: engine.read(peer, ldesc, rdesc), total, reps)  # noqa: B023
            if not np.array_equal(local.reshape(n, bs)[::-1].reshape(-1), expected):
                raise AssertionError(f"{transport}: descriptor {label} read: bytes differ")
            res[f"descs_{label}"] = {**summary(t), "us_per_desc": total / statistics.median(t) / 1e9 / n * 1e6}
            if label == "4K":
                one_l, one_r = np.array([0], np.int64), np.array([5], np.int64)
                res["prepared_lat_4k_us"] = latency(lambda: prepared.read(one_l, one_r), lat_n)  # noqa: B023
                if not np.array_equal(local[:bs], expected[5 * bs:6 * bs]):
                    raise AssertionError(f"{transport}: one 4 KiB prepared read: bytes differ")
            engine.deregister(region)
    # llm_datadist's pull_blocks: one 4 KiB block per call
    os.environ["PDLINK_TRANSPORT"] = transport
    dd = LLMDataDist(LLMRole.DECODER, 4)
    cfg = LLMConfig()
    cfg.enable_cache_manager = True
    dd.init(cfg.generate_options())
    mine = np.zeros((16, 4 * KIB), np.uint8)
    cache = dd.cache_manager.register_blocks_cache(CacheDesc(1, [16, 4 * KIB], DataType.DT_UINT8), [mine.ctypes.data])
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 3
    cluster.append_local_ip_info("127.0.0.1", 0)
    cluster.append_remote_ip_info("127.0.0.1", info["dd_port"])
    dd.link_clusters([cluster], 5000)
    key = BlocksCacheKey(3, 0)
    cm = dd.cache_manager
    res["pull_blocks_lat_4k_us"] = latency(lambda: cm.pull_blocks(key, cache, [3], [3]), lat_n)
    if not np.array_equal(mine[3], pattern(16 * 4 * KIB, 2).reshape(16, 4 * KIB)[3]):
        raise AssertionError(f"{transport}: pull_blocks: bytes differ")
    dd.finalize()
    return res


def memcpy_ceiling(total: int, reps: int) -> dict[str, Any]:
    """numpy copying the 4 KiB blocks in reversed order (what a 4 KiB descriptor moves), and the
    whole buffer at once: GB/s and us per 4 KiB block."""
    n = total // (4 * KIB)
    src, dst = pattern(total, 3).reshape(n, 4 * KIB), np.zeros((n, 4 * KIB), np.uint8)
    order = np.arange(n)[::-1].copy()

    def blocks() -> None:
        np.take(src, order, axis=0, out=dst)

    t = gbps(blocks, total, reps)
    whole = gbps(lambda: np.copyto(dst, src), total, reps)
    return {"blocks_4K": {**summary(t), "us_per_desc": total / statistics.median(t) / 1e9 / n * 1e6},
            "whole": summary(whole)}


def cma_ceiling(calls: int) -> dict[str, float] | None:
    """bench/cma_ceiling.c: the kernel's cost of one 4 KiB process_vm_readv, alone and with the
    generation word pdlink's cma path reads in the same call (p50, us); None without a compiler."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("  skipped bench/cma_ceiling.c: no C compiler (set CC)")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "cma_ceiling")
        subprocess.run([cc, "-O2", "-o", exe, os.path.join(HERE, "cma_ceiling.c")], check=True)
        r = subprocess.run([exe, str(4 * KIB), str(calls)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        print(f"  bench/cma_ceiling.c failed: {r.stderr.strip()}")
        return None
    out: dict[str, float] = json.loads(r.stdout)
    return out


def import_time(module: str, n: int) -> dict[str, float]:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
        xs.append((time.perf_counter() - t0) * 1e3)
    return summary(xs)


def fmt(s: dict[str, float], unit: str = "GB/s", digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} {unit} [{s['min']:.{digits}f}..{s['max']:.{digits}f}]"


def report(results: dict[str, Any]) -> str:
    lines = [f"pdlink small-transfer benchmark ({results['config']})"]
    ceil = results["memcpy"]
    lines.append(f"  ceiling memcpy 4 KiB blocks    : {fmt(ceil['blocks_4K'])}, "
                 f"{ceil['blocks_4K']['us_per_desc']:.3f} us/desc; whole buffer {fmt(ceil['whole'])}")
    cma = results.get("cma_ceiling")
    if cma:
        lines.append(f"  ceiling one 4 KiB process_vm_readv: p50 {cma['block_us']:.2f} us; with the generation word "
                     f"{cma['block_and_word_us']:.2f} us (bench/cma_ceiling.c)")
    nixl = results["peers"].get("NIXL/UCX default")
    for r in results["pdlink"]:
        tr = r["transport"]
        p, d = r["prepared_lat_4k_us"], r["pull_blocks_lat_4k_us"]
        line = f"  pdlink {tr:<4} prepared 4 KiB READ : p50 {p['p50']:.1f} us, p99 {p['p99']:.1f} us"
        if cma and tr == "cma":
            line += f"  ({p['p50'] / cma['block_and_word_us']:.2f}x the kernel's)"
        if nixl:
            line += f"  ({p['p50'] / nixl['lat_us']['p50']:.2f}x NIXL's p50)"
        lines.append(line)
        lines.append(f"  pdlink {tr:<4} pull_blocks 4 KiB   : p50 {d['p50']:.1f} us, p99 {d['p99']:.1f} us (one call)")
        for label in ("256K", "4K"):
            for kind in ("prepared", "descs"):
                s = r[f"{kind}_{label}"]
                line = (f"  pdlink {tr:<4} {kind:<8} {label:>4} x   : {fmt(s)}, {s['us_per_desc']:.3f} us/desc")
                if label == "4K":
                    line += f", {s['us_per_desc'] / ceil['blocks_4K']['us_per_desc']:.1f}x memcpy's"
                if nixl and f"read_{label}" in nixl:
                    line += f", {s['median'] / nixl[f'read_{label}']['median']:.2f}x NIXL's GB/s"
                lines.append(line)
    if nixl:
        lines.append(f"  NIXL/UCX prepared 4 KiB READ    : p50 {nixl['lat_us']['p50']:.1f} us, "
                     f"p99 {nixl['lat_us']['p99']:.1f} us")
        for label in ("256K", "4K"):
            if f"read_{label}" in nixl:
                s = nixl[f"read_{label}"]
                lines.append(f"  NIXL/UCX prepared {label:>4} x       : {fmt(s)}")
    else:
        lines.append("  NIXL: not run (see above)")
    imp = results["import"]
    lines.append(f"  import pdlink (fresh process)   : {fmt(imp['pdlink'], 'ms', 1)}; "
                 f"import numpy {fmt(imp['numpy'], 'ms', 1)}")
    return "\n".join(lines)


def run_nixl(total: int, reps: int, lat_n: int) -> dict[str, Any] | None:
    """NIXL's run at 256 KiB blocks (with its 4 KiB latency) and at 4 KiB blocks."""
    env = {"NIXL_MOD": os.environ.get("NIXL_MOD", "nixl_cu12")}
    out = None
    for block in (256 * KIB, 4 * KIB):
        cfg = {"total": total, "block": block, "reps": reps, "lat_n": lat_n}
        r = run_peer(f"NIXL/UCX {block // KIB} KiB", "nixl_peer.py", "PDLINK_BENCH_NIXL_PYTHON",
                     env["NIXL_MOD"] + "._api", env, cfg)
        if r is None:
            return out
        if out is None:
            out = r
        out[f"read_{block // KIB}K"] = r["read"]
    return out


def host_transports(spec: str) -> list[str]:
    """The transports of ``--transports`` that can run here (cma needs process_vm_readv)."""
    from pdlink._sysinfo import direct_access_permitted

    transports = spec.split(",")
    if "cma" in transports and not direct_access_permitted():
        print("direct memory access (process_vm_readv) is not permitted here: measuring tcp only")
        transports.remove("cma")
    return transports


def run_pair(label: str, target: Callable[..., None], target_args: tuple[Any, ...], initiator: Callable[..., None],
             transports: list[str], initiator_args: Callable[[str, Any], tuple[Any, ...]]) -> list[Any]:
    """Runs ``target(conn, *target_args)`` in a process, then for each transport
    ``initiator(conn, *initiator_args(transport, what_the_target_sent))`` in another, one after the
    other; each initiator sends ("ok", result) or ("error", text). Their results, in order."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=target, args=(child, *target_args), daemon=True)
    server.start()
    info = parent.recv()
    out = []
    try:
        for tr in transports:
            a, b = ctx.Pipe()
            p = ctx.Process(target=initiator, args=(b, *initiator_args(tr, info)), daemon=True)
            p.start()
            status, value = a.recv()
            p.join(60)
            if status != "ok":
                raise SystemExit(f"{label} {tr} run failed:\n{value}")
            out.append(value)
    finally:
        parent.send("stop")
        server.join(30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and counts: checks that everything runs")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="where small.json goes")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--transports", default="cma,tcp")
    args = ap.parse_args()
    transports = host_transports(args.transports)
    total = 1 * MIB if args.smoke else 64 * MIB
    reps = 2 if args.smoke else args.reps
    lat_n = 200 if args.smoke else 5000
    results: dict[str, Any] = {"config": f"{total // MIB} MiB, {reps} reps, {lat_n} latency samples, no secret",
                               "peers": {}}
    results["pdlink"] = run_pair("pdlink", target_main, (total,), initiator_main, transports,
                                 lambda tr, info: (tr, total, reps, lat_n, info))
    results["memcpy"] = memcpy_ceiling(total, reps)
    if "cma" in transports:
        results["cma_ceiling"] = cma_ceiling(lat_n * 4)
    if not args.no_peers:
        nixl = run_nixl(total, reps, lat_n)
        if nixl:
            results["peers"]["NIXL/UCX default"] = nixl
    n = 3 if args.smoke else 11
    results["import"] = {"pdlink": import_time("pdlink", n), "numpy": import_time("numpy", n)}
    text = report(results)
    print(text)
    save(args.out, "small", results, text)


if __name__ == "__main__":
    main()
