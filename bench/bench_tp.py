"""Head-sliced pulls (prefill TP != decode TP): pdlink's strided rows beside a whole-block pull of
the same bytes and beside NIXL's strided descriptors on the same work, in one run, same host.

A target process registers 2 x TOTAL bytes as blocks of BLOCK bytes. For each pdlink transport
the initiator reads, into a dense buffer of TOTAL bytes:

  * sliced, rows : the second half of every block (a head slice of an HND block), as one strided
    row per side (``Engine.read`` with (N, 4) rows: remote ``(base + BLOCK/2, BLOCK/2, BLOCK, N)``);
  * sliced, list : the same pieces as an (N, 2) descriptor list (what the rows expand to);
  * whole        : the same number of bytes as whole blocks of BLOCK/2 (an (N, 2) list), the
    reference the issue holds the slice to (>= 0.8x);
  * sliced, prepared : the head slice as a prepared transfer with a block view (``Engine.prepare``
    with ``remote_view=(BLOCK/2, BLOCK/2)``, posted by index arrays), beside
  * whole, prepared  : the whole-block prepared transfer of the same bytes (blocks of BLOCK/2).

NIXL (UCX backend, default transports; bench/peers/nixl_strided_peer.py) runs the sliced read with
its Nx5 strided descriptors and the whole-block read, when PDLINK_BENCH_NIXL_PYTHON (or this
interpreter) has it (NIXL >= 1.5). Each kind is verified byte for byte once. Reported: medians
with min and max, and the ratios.

    python bench/bench_tp.py              # about a minute on 2 cores
    python bench/bench_tp.py --smoke      # seconds; what CI runs
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_small import fmt, gbps, host_transports, pattern, report_to, run_pair  # noqa: E402
from bench_transfer import run_peer, save, summary  # noqa: E402

KIB, MIB = 1024, 1024 * 1024
TARGET_ID, INITIATOR_ID = 1, 2


def target_main(conn: Any, total: int) -> None:
    import pdlink

    data = pattern(2 * total, 1)
    engine = pdlink.Engine(pdlink.EngineOptions(cluster_id=TARGET_ID, listen="127.0.0.1:0", transport="auto"))
    region = engine.register(data)
    conn.send({"port": engine.listen_port, "address": region.address})
    conn.recv()
    engine.close()


def initiator_main(conn: Any, transport: str, total: int, block: int, reps: int, info: dict[str, Any]) -> None:
    report_to(conn, run_initiator, transport, total, block, reps, info)


def run_initiator(transport: str, total: int, block: int, reps: int, info: dict[str, Any]) -> dict[str, Any]:
    import pdlink

    half, n = block // 2, 2 * total // block
    source = pattern(2 * total, 1).reshape(n, block)
    local = np.zeros(total, np.uint8)
    res: dict[str, Any] = {"transport": transport}
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=INITIATOR_ID, transport=transport)) as engine:
        peer = engine.connect(f"127.0.0.1:{info['port']}")
        got = {link.transport for link in engine.links()}
        assert got == {transport}, f"asked for {transport}, linked over {got}"
        region = engine.register(local, block_size=half)
        base, raddr = local.ctypes.data, info["address"]
        rows_local = np.array([[base, half, half, n]], np.uint64)
        rows_remote = np.array([[raddr + half, half, block, n]], np.uint64)
        k = np.arange(n, dtype=np.uint64)
        list_local = np.stack([base + k * half, np.full(n, half, np.uint64)], axis=1)
        list_remote = np.stack([raddr + half + k * block, np.full(n, half, np.uint64)], axis=1)
        whole_remote = np.stack([raddr + k * half, np.full(n, half, np.uint64)], axis=1)
        sliced = source[:, half:].reshape(-1)
        idx = np.arange(n, dtype=np.int64)
        sliced_view = engine.prepare(peer, region, pdlink.RemoteRegion(length=2 * total, block_size=block,
                                                                       address=raddr), remote_view=(half, half))
        whole_blocks = engine.prepare(peer, region, pdlink.RemoteRegion(length=total, block_size=half, address=raddr))
        runs: list[tuple[str, Any, Any]] = [
            ("sliced_rows", lambda: engine.read(peer, rows_local, rows_remote), sliced),
            ("sliced_list", lambda: engine.read(peer, list_local, list_remote), sliced),
            ("whole", lambda: engine.read(peer, list_local, whole_remote), source.reshape(-1)[:total]),
            ("sliced_prepared", lambda: sliced_view.read(idx, idx), sliced),
            ("whole_prepared", lambda: whole_blocks.read(idx, idx), source.reshape(-1)[:total])]
        for kind, move, want in runs:
            local[:] = 0
            move()
            if not np.array_equal(local, want):
                raise AssertionError(f"{transport}: {kind}: bytes differ")
            res[kind] = summary(gbps(move, total, reps))
    return res


def report(results: dict[str, Any]) -> str:
    lines = [f"pdlink head-sliced pull benchmark ({results['config']})"]
    nixl = results["peers"].get("NIXL/UCX default")
    for r in results["pdlink"]:
        tr = r["transport"]
        for kind, whole in (("sliced_rows", "whole"), ("sliced_list", "whole"), ("whole", None),
                            ("sliced_prepared", "whole_prepared"), ("whole_prepared", None)):
            line = f"  pdlink {tr:<4} {kind:<15}: {fmt(r[kind])}"
            if whole:
                line += f"  ({r[kind]['median'] / r[whole]['median']:.2f}x {whole})"
            if nixl and kind.startswith("sliced_") and kind != "sliced_list":
                line += f"  ({r[kind]['median'] / nixl['sliced']['median']:.2f}x NIXL's strided read)"
            lines.append(line)
    if nixl:
        lines.append(f"  NIXL/UCX strided sliced  : {fmt(nixl['sliced'])}  "
                     f"({nixl['sliced']['median'] / nixl['whole']['median']:.2f}x its whole-block read)")
        lines.append(f"  NIXL/UCX whole           : {fmt(nixl['whole'])}")
    else:
        lines.append("  NIXL: not run (see above)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and counts: checks that everything runs")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--block-kib", type=int, default=128, help="prefill block size (half of it is read)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="where tp.json goes")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--transports", default="cma,tcp")
    args = ap.parse_args()
    transports = host_transports(args.transports)
    total = 1 * MIB if args.smoke else 64 * MIB
    reps = 2 if args.smoke else args.reps
    block = args.block_kib * KIB
    results: dict[str, Any] = {"config": f"{total // MIB} MiB read, half of each {block // KIB} KiB block, "
                                         f"{reps} reps, no secret", "peers": {}}
    results["pdlink"] = run_pair("pdlink", target_main, (total,), initiator_main, transports,
                                 lambda tr, info: (tr, total, block, reps, info))
    if not args.no_peers:
        mod = os.environ.get("NIXL_MOD", "nixl_cu12")
        nixl = run_peer("NIXL/UCX strided", "nixl_strided_peer.py", "PDLINK_BENCH_NIXL_PYTHON", mod + "._api",
                        {"NIXL_MOD": mod}, {"total": total, "block": block, "reps": reps, "lat_n": 0})
        if nixl:
            results["peers"]["NIXL/UCX default"] = nixl
    text = report(results)
    print(text)
    save(args.out, "tp", results, text)


if __name__ == "__main__":
    main()
