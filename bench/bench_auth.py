"""What authenticated sessions cost: the same work on plain, sealed and payload-integrity links.

Two processes on one host (a prompt that registers a blocks cache and listens, a decoder that links
and moves it), once per mode and transport:

  * plain     : no link secret;
  * sealed    : pdlink.LinkSecret set: every frame carries an HMAC-SHA256 tag (the payload's length
                is covered, its bytes are not);
  * integrity : pdlink.PayloadIntegrity too: payloads are sealed in 256 KiB chunks, each checked
                before it lands.

Every mode is measured in several rounds, interleaved in a rotating order (this machine's speed
drifts between runs more than a seal costs); reported is the median over the rounds.

Measured: a one-block 4 KiB pull (p50/p99 latency: the cost per frame), 64 MiB pulled and
pushed in 256 KiB blocks (GB/s: the cost per GB), link_clusters (ms: the handshake). Beside them, in
the same run: HMAC-SHA256 throughput of this machine's libcrypto through Python's hmac module (the
ceiling a sealed payload can reach on one core; the plain runs are the other ceiling). Every
transfer is verified byte for byte once. Reported: medians, and each mode's ratio to plain.

    python bench/bench_auth.py              # a minute or two on 2 cores
    python bench/bench_auth.py --smoke      # seconds; what CI runs
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from bench_transfer import DECODER_ID, KIB, MIB, PROMPT_ID, options, pattern, percentile, save, summary, timed

HERE = os.path.dirname(os.path.abspath(__file__))
SECRET = "bench-secret"
MODES = {"plain": {}, "sealed": {"PDLINK_LINK_SECRET": SECRET},
         "integrity": {"PDLINK_LINK_SECRET": SECRET, "PDLINK_PAYLOAD_INTEGRITY": "1"}}


def _env(mode: str, transport: str) -> None:
    for k in ("PDLINK_LINK_SECRET", "PDLINK_PAYLOAD_INTEGRITY"):
        os.environ.pop(k, None)
    os.environ.update(MODES[mode])
    os.environ["PDLINK_TRANSPORT"] = transport


def _register(cm: Any, cfg: dict[str, Any], me: int, fill: bool) -> dict[str, Any]:
    from llm_datadist import BlocksCacheKey, CacheDesc, DataType

    out = {}
    for name, model, tensors, block, blocks in (("bulk", 0, 2, cfg["block"], cfg["total"] // (2 * cfg["block"])),
                                                ("one", 1, 1, 4 * KIB, 16)):
        shape = (blocks, block)
        arrays = [pattern(shape, seed=model * 100 + t) if fill else np.zeros(shape, np.uint8) for t in range(tensors)]
        cache = cm.register_blocks_cache(CacheDesc(tensors, list(shape), DataType.DT_UINT8),
                                         [a.ctypes.data for a in arrays], BlocksCacheKey(me, model))
        out[name] = (cache, arrays, model)
    return out


def target_main(conn: Any, mode: str, cfg: dict[str, Any]) -> None:
    _env(mode, "auto")
    from llm_datadist import LLMDataDist, LLMRole

    dd = LLMDataDist(LLMRole.PROMPT, PROMPT_ID)
    dd.init(options("127.0.0.1:0"))
    caches = _register(dd.cache_manager, cfg, PROMPT_ID, fill=True)
    conn.send(dd.listen_port)
    conn.recv()  # stop
    del caches
    dd.finalize()


def initiator_main(conn: Any, mode: str, transport: str, port: int, cfg: dict[str, Any]) -> None:
    try:
        conn.send(("ok", run(mode, transport, port, cfg)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run(mode: str, transport: str, port: int, cfg: dict[str, Any]) -> dict[str, Any]:
    _env(mode, transport)
    from llm_datadist import BlocksCacheKey, LLMClusterInfo, LLMDataDist, LLMRole, LLMStatusCode

    dd = LLMDataDist(LLMRole.DECODER, DECODER_ID)
    dd.init(options())
    cm = dd.cache_manager
    caches = _register(cm, cfg, DECODER_ID, fill=False)
    peer = LLMClusterInfo()
    peer.remote_cluster_id = PROMPT_ID
    peer.append_local_ip_info("127.0.0.1", 0)
    peer.append_remote_ip_info("127.0.0.1", port)
    link_ms = []
    for _ in range(cfg["link_n"]):
        t0 = time.perf_counter()
        ret, _ = dd.link_clusters([peer], 5000)
        link_ms.append((time.perf_counter() - t0) * 1e3)
        assert ret == LLMStatusCode.LLM_SUCCESS, ret
        assert dd.unlink_clusters([peer], 5000)[0] == LLMStatusCode.LLM_SUCCESS
    ret, _ = dd.link_clusters([peer], 5000)
    assert ret == LLMStatusCode.LLM_SUCCESS, ret
    (link,) = dd.links()
    want = (mode != "plain", mode == "integrity")
    assert (link["transport"], link["authenticated"], link["payload_integrity"]) == (transport, *want), link
    res: dict[str, Any] = {"link_ms": summary(link_ms)}

    bulk, bulk_arrays, bulk_model = caches["bulk"]
    n = bulk_arrays[0].shape[0]
    src, dst = list(range(n)), list(range(n - 1, -1, -1))
    key = BlocksCacheKey(PROMPT_ID, bulk_model)
    t = timed(lambda: cm.pull_blocks(key, bulk, src, dst), cfg["reps"])
    for i, arr in enumerate(bulk_arrays):
        if not np.array_equal(arr[dst], pattern(arr.shape, seed=bulk_model * 100 + i)[src]):
            raise AssertionError(f"{mode}/{transport}: pulled bytes differ")
    nbytes = sum(a.nbytes for a in bulk_arrays)
    res["pull"] = summary([nbytes / x / 1e9 for x in t])
    t = timed(lambda: cm.push_blocks(key, bulk, dst, src), cfg["reps"])  # back where they came from
    res["push"] = summary([nbytes / x / 1e9 for x in t])
    one, _arrays, one_model = caches["one"]
    one_key = BlocksCacheKey(PROMPT_ID, one_model)
    cm.pull_blocks(one_key, one, [3], [3])
    lat = []
    for _ in range(cfg["lat_n"]):
        t0 = time.perf_counter()
        cm.pull_blocks(one_key, one, [3], [3])
        lat.append((time.perf_counter() - t0) * 1e6)
    res["pull_4k_us"] = {"p50": percentile(lat, 50), "p99": percentile(lat, 99), "n": len(lat)}
    dd.finalize()
    return res


def hmac_ceiling(nbytes: int, reps: int) -> dict[str, float]:
    """HMAC-SHA256 of `nbytes` with this machine's libcrypto (Python's hmac uses OpenSSL)."""
    data = pattern((nbytes,), 3).tobytes()
    t = timed(lambda: hmac.new(b"k" * 32, data, hashlib.sha256).digest(), reps)
    return summary([nbytes / x / 1e9 for x in t])


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per transport and mode, the median over the rounds of each measurement's median (p50)."""
    out: dict[str, Any] = {}
    for transport, modes in rounds[0].items():
        for mode in modes:
            rs = [r[transport][mode] for r in rounds]
            out.setdefault(transport, {})[mode] = {
                key: {field: statistics.median(r[key][field] for r in rs) for field in ("median", "p50")
                      if field in rs[0][key]} for key in ("pull", "push", "pull_4k_us", "link_ms")}
    return out


def report(results: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = [f"pdlink authenticated sessions: {cfg['total'] // MIB} MiB in {cfg['block'] // KIB} KiB blocks, "
             f"{cfg['reps']} repetitions x {cfg['rounds']} interleaved rounds, medians (ratio to plain)",
             f"  ceiling HMAC-SHA256, one core (libcrypto)  : {results['hmac']['median']:.2f} GB/s"]
    for transport, modes in results["runs"].items():
        base = modes["plain"]
        for mode, r in modes.items():
            def ratio(key: str, field: str = "median", r: dict = r, base: dict = base) -> str:
                return f"{r[key][field] / base[key][field]:.2f}x"

            lines.append(
                f"  {transport:<3} {mode:<9} pull {r['pull']['median']:.2f} GB/s ({ratio('pull')}), "
                f"push {r['push']['median']:.2f} GB/s ({ratio('push')}), "
                f"4 KiB pull p50 {r['pull_4k_us']['p50']:.1f} us ({ratio('pull_4k_us', 'p50')}), "
                f"link {r['link_ms']['median']:.2f} ms")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and counts: checks that everything runs")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3, help="every mode measured this many times, interleaved")
    ap.add_argument("--transports", default="tcp,cma")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    from pdlink._sysinfo import direct_access_permitted

    cfg = {"total": 64 * MIB, "block": 256 * KIB, "reps": args.reps, "lat_n": 2000, "link_n": 10}
    if args.smoke:
        cfg.update(total=2 * MIB, block=64 * KIB, reps=2, lat_n=20, link_n=2)
        args.rounds = 1
    transports = [t for t in args.transports.split(",") if t != "cma" or direct_access_permitted()]
    ctx = mp.get_context("spawn")
    results: dict[str, Any] = {"config": {**cfg, "rounds": args.rounds}, "rounds": [],
                               "hmac": hmac_ceiling(cfg["total"], cfg["reps"])}
    order = list(MODES)
    for round_ in range(args.rounds):  # modes interleaved, in a rotating order: drift hits all alike
        runs: dict[str, dict[str, Any]] = {}
        for mode in order[round_ % len(order):] + order[:round_ % len(order)]:
            tconn, child = ctx.Pipe()
            target = ctx.Process(target=target_main, args=(child, mode, cfg), daemon=True)
            target.start()
            port = tconn.recv()
            try:
                for transport in transports:
                    iconn, ichild = ctx.Pipe()
                    proc = ctx.Process(target=initiator_main, args=(ichild, mode, transport, port, cfg))
                    proc.start()
                    status, value = iconn.recv()
                    proc.join(60)
                    if status != "ok":
                        print(f"{mode}/{transport}: FAILED\n{value}")
                        return 1
                    runs.setdefault(transport, {})[mode] = value
            finally:
                tconn.send("stop")
                target.join(30)
        results["rounds"].append(runs)
    results["runs"] = combine(results["rounds"])
    lines = report(results, results["config"])
    print("\n".join(lines))
    save(args.out, "auth", results, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
