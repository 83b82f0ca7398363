"""pdlink transfer benchmark: pdlink beside the hardware ceilings and the peers, in one run.

Two processes on one host (a target that registers KV caches and listens, an initiator that links
and moves them), for each pdlink transport (direct memory access "cma" and loopback "tcp"):

  * pull_blocks / push_blocks of 64 MiB in 256 KiB blocks;
  * the same bytes in 4 KiB blocks (per-block overhead, us/block);
  * one 4 KiB block pull (a one-tensor cache): p50 / p99 latency;
  * link_clusters, unlink_clusters and switch_role latency;
  * GB/s against block size (4 KiB .. 4 MiB) for the plot;
  * scale: registering a cache is O(tensors); pulls of 1k / 10k / 100k block pairs.

In the same run: the ceilings, numpy memcpy of the same bytes, and loopback TCP in C with the CPU
seconds both sides spend per GB beside pdlink's own: the same pull in bench/tcp_ceiling.c (blocking,
and busy-polling as pdlink's sockets do) and iperf3's steady stream, each over one stream (what a
pdlink tcp link uses; pdlink's tcp figures are held to the best of these) and over two. Then, when
installed, the peers on the same work
(Mooncake Transfer Engine over TCP, NIXL/UCX with default transports and with UCX_TLS=tcp). A
peer that is not installed is skipped with a message; point PDLINK_BENCH_MOONCAKE_PYTHON /
PDLINK_BENCH_NIXL_PYTHON at an interpreter that has it.

Block orders are reversed (source block i -> destination block n-1-i), so no two blocks coalesce
and every block costs what a paged KV cache costs. Every transfer kind is verified byte for byte
once. Reported: median of the repetitions, with min and max.

    python bench/bench_transfer.py                 # full run (a few minutes on 2 cores)
    python bench/bench_transfer.py --smoke         # tiny sizes, seconds; what CI runs
    python bench/bench_transfer.py --transports tcp@1,tcp@4 --no-peers   # tcp with 1 and 4 streams

A transport "tcp@N" is tcp with N streams per link (PDLINK_TCP_STREAMS=N on both sides: the link's
channel and N - 1 lanes for transfers of at least two chunks, docs/architecture.md); plain "tcp"
takes the engines' default (pdlink.TcpStreams, 4).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT_ID, DECODER_ID = 1, 2
KIB, MIB = 1024, 1024 * 1024
SCALE_BLOCK = 64  # bytes: the scale test measures per-block cost, not bandwidth


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def save(out: str, stem: str, results: dict[str, Any], text: str) -> None:
    """Writes ``results`` as ``out/stem.json`` and the printed report ``text`` as ``out/stem.txt``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out, stem + ".txt"), "w") as f:
        f.write(text + "\n")


def nonzero_content(nbytes: int) -> np.ndarray:
    """A source of ``nbytes`` with no zero byte, so a zeroed (old) byte is never mistaken for a new one."""
    return (np.arange(nbytes, dtype=np.uint64) * 31 % 251 + 1).astype(np.uint8)


def path_unavailable(path: str) -> str | None:
    """Why data path ``path`` (cma, tcp, ucx) cannot run here, or None when it can: cma needs
    process_vm_readv permitted, ucx needs pdlink's UCX loader to find UCX."""
    if path == "cma":
        from pdlink._sysinfo import direct_access_permitted

        return None if direct_access_permitted() else "direct memory access (process_vm_readv) is not permitted here"
    if path == "ucx":
        from pdlink.native import core

        info = dict(core().ucx_info())
        return None if info.get("loaded") else str(info.get("error"))
    return None


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def pattern(shape: tuple, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


# ---------------------------------------------------------------- the caches both sides register


def cache_plan(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """(model_id, tensors, blocks, block bytes) of every cache the run uses."""
    total = cfg["total"]
    plan = [
        {"name": "bulk", "model": 0, "tensors": 2, "block": cfg["block"], "purpose": "pull/push"},
        {"name": "small", "model": 1, "tensors": 2, "block": 4 * KIB, "purpose": "4 KiB blocks"},
        {"name": "push", "model": 2, "tensors": 2, "block": cfg["block"], "purpose": "push target"},
        {"name": "one", "model": 4, "tensors": 1, "block": 4 * KIB, "purpose": "latency", "total": 64 * KIB},
    ]
    for i, bs in enumerate(cfg["sweep"]):
        plan.append({"name": f"sweep{bs}", "model": 10 + i, "tensors": 2, "block": bs, "purpose": "sweep",
                     "total": cfg["sweep_total"]})
    for c in plan:
        c["blocks"] = max(1, c.get("total", total) // (c["tensors"] * c["block"]))
    # many tiny blocks for the scale test: pulls of up to max(scale_blocks) random block pairs
    plan.append({"name": "scale", "model": 3, "tensors": 2, "block": SCALE_BLOCK, "purpose": "scale",
                 "blocks": max(cfg["scale_blocks"])})
    return plan


def register(cm: Any, plan: list[dict[str, Any]], me: int, fill: bool) -> dict[str, Any]:
    from llm_datadist import BlocksCacheKey, CacheDesc, DataType

    out = {}
    for c in plan:
        shape = (c["blocks"], c["block"])
        arrays = [pattern(shape, seed=c["model"] * 100 + t) if fill else np.zeros(shape, np.uint8)
                  for t in range(c["tensors"])]
        cache = cm.register_blocks_cache(CacheDesc(c["tensors"], list(shape), DataType.DT_UINT8),
                                         [a.ctypes.data for a in arrays], BlocksCacheKey(me, c["model"]))
        out[c["name"]] = (cache, arrays)
    return out


def options(listen: str | None = None):
    from llm_datadist import LLMConfig

    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.sync_kv_timeout = 120000
    if listen:
        cfg.listen_ip_info = listen
    return cfg.generate_options()


# ---------------------------------------------------------------- target process


def set_transport(transport: str) -> None:
    """This process's pdlink transport: "cma", "tcp", "auto", or "ucx" / "ucx:TLS" (the ucx path,
    with UCX_TLS=TLS when given; loopback only, so the network is trusted)."""
    transport, _, streams = transport.partition("@")
    if streams:
        os.environ["PDLINK_TCP_STREAMS"] = streams
    name, _, tls = transport.partition(":")
    os.environ["PDLINK_TRANSPORT"] = name
    if name == "ucx":
        os.environ["PDLINK_UCX_TRUSTED_NETWORK"] = "1"
        if tls:
            os.environ["UCX_TLS"] = tls


def target_main(conn: Any, cfg: dict[str, Any], transport: str = "auto") -> None:
    from llm_datadist import LLMDataDist, LLMRole

    set_transport(transport)  # auto accepts tcp and cma; the ucx path needs a ucx engine at both ends
    dd = LLMDataDist(LLMRole.PROMPT, PROMPT_ID)
    dd.init(options("127.0.0.1:0"))
    _served = register(dd.cache_manager, cache_plan(cfg), PROMPT_ID, fill=True)  # alive while registered
    conn.send({"port": dd.listen_port, "pid": os.getpid()})
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            dd.finalize()
            conn.send("ok")
            return


# ---------------------------------------------------------------- initiator process


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU time of a process (every thread), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(fn, reps: int) -> list[float]:
    fn()  # warm-up (first-touch faults, descriptor fetch)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def initiator_main(conn: Any, transport: str, cfg: dict[str, Any], info: dict[str, Any]) -> None:
    try:
        conn.send(("ok", run_initiator(transport, cfg, info)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_initiator(transport: str, cfg: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    set_transport(transport)
    from llm_datadist import BlocksCacheKey, LLMClusterInfo, LLMDataDist, LLMRole, LLMStatusCode

    reps = cfg["reps"]
    plan = cache_plan(cfg)
    by_name = {c["name"]: c for c in plan}
    dd = LLMDataDist(LLMRole.DECODER, DECODER_ID)
    dd.init(options())
    cm = dd.cache_manager
    caches = register(cm, plan, DECODER_ID, fill=False)
    peer = LLMClusterInfo()
    peer.remote_cluster_id = PROMPT_ID
    peer.append_local_ip_info("127.0.0.1", 0)
    peer.append_remote_ip_info("127.0.0.1", info["port"])
    ret, _ = dd.link_clusters([peer], 5000)
    assert ret == LLMStatusCode.LLM_SUCCESS, ret
    got = {link["transport"] for link in dd.links()}
    assert got == {transport.partition("@")[0].partition(":")[0]}, f"asked for {transport}, linked over {got}"
    res: dict[str, Any] = {"transport": transport}

    def reversed_blocks(name: str):
        n = by_name[name]["blocks"]
        return list(range(n)), list(range(n - 1, -1, -1))

    def verify(name: str, src_blocks: list[int], dst_blocks: list[int], seed_base: int) -> None:
        c = by_name[name]
        for t, arr in enumerate(caches[name][1]):
            expected = pattern((c["blocks"], c["block"]), seed=seed_base + t)[src_blocks]
            if not np.array_equal(arr[dst_blocks], expected):
                raise AssertionError(f"{transport}: bytes differ in {name} tensor {t}")

    def pull(name: str, src: list[int], dst: list[int]):
        cache = caches[name][0]
        key = BlocksCacheKey(PROMPT_ID, by_name[name]["model"])
        return lambda: cm.pull_blocks(key, cache, src, dst)

    # 64 MiB in 256 KiB blocks, and in 4 KiB blocks
    for name in ("bulk", "small"):
        src, dst = reversed_blocks(name)
        cpu0 = cpu_seconds() + cpu_seconds(info["pid"])
        t = timed(pull(name, src, dst), reps)
        cpu = cpu_seconds() + cpu_seconds(info["pid"]) - cpu0  # both processes, warm-up included
        verify(name, src, dst, by_name[name]["model"] * 100)
        c = by_name[name]
        nbytes = c["tensors"] * c["blocks"] * c["block"]
        res[f"pull_{name}"] = {**summary([nbytes / x / 1e9 for x in t]), "bytes": nbytes,
                               "us_per_block": statistics.median(t) / (c["tensors"] * c["blocks"]) * 1e6,
                               "block": c["block"], "cpu_s_per_gb": cpu / (nbytes * (reps + 1) / 1e9)}
    # push the pulled bulk cache into the target's push cache, then read it back to verify
    src, dst = reversed_blocks("bulk")
    bulk_cache = caches["bulk"][0]
    push_key = BlocksCacheKey(PROMPT_ID, by_name["push"]["model"])
    t = timed(lambda: cm.push_blocks(push_key, bulk_cache, src, dst), reps)
    c = by_name["bulk"]
    nbytes = c["tensors"] * c["blocks"] * c["block"]
    res["push_bulk"] = {**summary([nbytes / x / 1e9 for x in t]), "bytes": nbytes, "block": c["block"]}
    check = caches["push"]
    cm.pull_blocks(push_key, check[0], dst, src)  # back into the same order as bulk
    for a, b in zip(check[1], caches["bulk"][1]):
        if not np.array_equal(a, b):
            raise AssertionError(f"{transport}: pushed bytes differ")
    # one 4 KiB block (one tensor): latency
    one = pull("one", [3], [3])
    one()
    lat = []
    for _ in range(cfg["lat_n"]):
        t0 = time.perf_counter()
        one()
        lat.append((time.perf_counter() - t0) * 1e6)
    res["lat_4k_us"] = {"p50": percentile(lat, 50), "p99": percentile(lat, 99), "n": len(lat)}
    # sweep over block sizes (pull)
    res["sweep"] = {}
    for bs in cfg["sweep"]:
        name = f"sweep{bs}"
        src, dst = reversed_blocks(name)
        t = timed(pull(name, src, dst), max(3, reps // 2))
        c = by_name[name]
        res["sweep"][bs] = statistics.median([c["tensors"] * c["blocks"] * bs / x / 1e9 for x in t])
    first = f"sweep{cfg['sweep'][0]}"
    verify(first, *reversed_blocks(first), by_name[first]["model"] * 100)
    # link / unlink / switch_role latency
    ret, _ = dd.unlink_clusters([peer], 5000)
    assert ret == LLMStatusCode.LLM_SUCCESS, ret
    link_t, unlink_t = [], []
    for _ in range(cfg["link_n"]):
        t0 = time.perf_counter()
        ret, _ = dd.link_clusters([peer], 5000)
        link_t.append((time.perf_counter() - t0) * 1e3)
        assert ret == LLMStatusCode.LLM_SUCCESS, ret
        t0 = time.perf_counter()
        ret, _ = dd.unlink_clusters([peer], 5000)
        unlink_t.append((time.perf_counter() - t0) * 1e3)
        assert ret == LLMStatusCode.LLM_SUCCESS, ret
    switch_t = []
    for _ in range(cfg["link_n"]):
        t0 = time.perf_counter()
        dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})
        dd.switch_role(LLMRole.DECODER)
        switch_t.append((time.perf_counter() - t0) * 1e3 / 2)
    res["link_ms"], res["unlink_ms"], res["switch_role_ms"] = summary(link_t), summary(unlink_t), summary(switch_t)
    if transport == cfg["transports"][0]:
        ret, _ = dd.link_clusters([peer], 5000)
        assert ret == LLMStatusCode.LLM_SUCCESS, ret
        res["scale"] = scale_test(cm, caches, by_name, cfg)
    # the memory ceiling, from this process (same CPUs, same bytes)
    if transport == cfg["transports"][0]:
        res["memcpy"] = memcpy_ceiling(by_name["bulk"]["tensors"] * by_name["bulk"]["blocks"] * cfg["block"], reps)
    dd.finalize()
    return res


def scale_test(cm: Any, caches: dict[str, Any], plan: dict[str, dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """Registration costs O(tensors), not O(blocks); a pull stays linear in its block pairs."""
    from llm_datadist import BlocksCacheKey, CacheDesc, DataType

    out: dict[str, Any] = {"register_ms": {}, "pull_ms": {}, "block_bytes": SCALE_BLOCK}
    for n in cfg["scale_blocks"]:
        arrays = [np.zeros((n, SCALE_BLOCK), np.uint8) for _ in range(2)]
        t0 = time.perf_counter()
        c = cm.register_blocks_cache(CacheDesc(2, [n, SCALE_BLOCK], DataType.DT_UINT8), [a.ctypes.data for a in arrays])
        out["register_ms"][n] = (time.perf_counter() - t0) * 1e3
        cm.unregister_cache(c.cache_id)
    cache = caches["scale"][0]
    n_max = plan["scale"]["blocks"]
    key = BlocksCacheKey(PROMPT_ID, plan["scale"]["model"])
    rng = np.random.default_rng(0)
    for n in cfg["scale_blocks"]:
        src = rng.permutation(n_max)[:n].tolist()  # random on both sides: nothing coalesces
        dst = rng.permutation(n_max)[:n].tolist()
        cm.pull_blocks(key, cache, src[:8], dst[:8])
        t0 = time.perf_counter()
        cm.pull_blocks(key, cache, src, dst)
        out["pull_ms"][n] = (time.perf_counter() - t0) * 1e3
        for t, arr in enumerate(caches["scale"][1]):
            expected = pattern((n_max, SCALE_BLOCK), seed=plan["scale"]["model"] * 100 + t)
            if not np.array_equal(arr[dst], expected[src]):
                raise AssertionError("scale pull: bytes differ")
    return out


def tcp_ceilings(nbytes: int, reps: int, smoke: bool) -> list[dict[str, Any]]:
    """The C-level loopback TCP ceilings, each a GB/s summary with its CPU seconds per GB (both
    sides): bench/tcp_ceiling.c (the same pull in C, blocking and busy-polling, one stream and two)
    and iperf3 (a steady stream, one and two), each skipped with a message where its tool is
    missing."""
    out = []
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("  skipped bench/tcp_ceiling.c: no C compiler (set CC)")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            exe = os.path.join(tmp, "tcp_ceiling")
            subprocess.run([cc, "-O2", "-pthread", "-o", exe, os.path.join(HERE, "tcp_ceiling.c")], check=True)
            for mode in ("block", "spin"):
                for streams in (1, 2):
                    r = json.loads(subprocess.run([exe, str(nbytes), str(reps), str(streams), mode], check=True,
                                                  capture_output=True, text=True, timeout=600).stdout)
                    out.append({"tool": "C", "mode": mode, "streams": streams, **summary(r["gbps"]),
                                "cpu_s_per_gb": r["cpu_s_per_gb"]})
    exe = shutil.which("iperf3")
    if exe is None:
        print("  skipped iperf3: not installed (apt-get install iperf3)")
        return out
    for streams in (1, 2):
        out.append(iperf3(exe, streams, seconds=1 if smoke else 5))
    return out


def iperf3(exe: str, streams: int, seconds: int) -> dict[str, Any]:
    """One iperf3 run over loopback (`-P streams`): the GB/s of each 0.5 s interval after the first
    second (slow start), and the CPU seconds per GB of client and server."""
    with socket.socket() as probe:  # a free port (released just before the server takes it)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([exe, "-s", "-1", "-B", "127.0.0.1", "-p", str(port), "--forceflush"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        deadline = time.monotonic() + 30
        while "Server listening" not in server.stdout.readline():  # iperf3 says so once it listens
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the iperf3 server did not start")
        omit = 0 if seconds <= 1 else 1
        run = subprocess.run([exe, "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds + omit), "-O", str(omit),
                              "-i", "0.5", "-P", str(streams), "-J"], capture_output=True, text=True,
                             timeout=60 + seconds, check=True)
    finally:
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    r = json.loads(run.stdout)
    gbps = [iv["sum"]["bits_per_second"] / 8e9 for iv in r["intervals"] if not iv["sum"].get("omitted")]
    end = r["end"]
    cpu = end["cpu_utilization_percent"]
    moved_gb = end["sum_received"]["bytes"] / 1e9
    cpu_s = (cpu["host_total"] + cpu["remote_total"]) / 100 * end["sum_received"]["seconds"]
    return {"tool": "iperf3", "mode": "stream", "streams": streams, **summary(gbps), "cpu_s_per_gb": cpu_s / moved_gb}


def memcpy_ceiling(nbytes: int, reps: int) -> dict[str, float]:
    src = pattern((nbytes,), 1)
    dst = np.empty_like(src)
    t = timed(lambda: np.copyto(dst, src), reps)
    return summary([nbytes / x / 1e9 for x in t])


# ---------------------------------------------------------------- peers


def run_peer(name: str, script: str, env_var: str, module: str, extra_env: dict[str, str], cfg: dict[str, Any]
             ) -> dict[str, Any] | None:
    python = os.environ.get(env_var) or sys.executable
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"  skipped {name}: `import {module}` failed with {python} (set {env_var} to an interpreter that has it)")
        return None
    env = dict(os.environ, **extra_env)
    args = [python, os.path.join(HERE, "peers", script), str(cfg["total"] // MIB), str(cfg["block"] // KIB),
            str(cfg["reps"]), str(cfg["lat_n"])]
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired:
        print(f"  {name}: timed out")
        return None
    line = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if not line:
        print(f"  {name}: failed ({r.returncode}): {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        return None
    if r.returncode != 0:  # NIXL 1.5.1 crashes while tearing down, after its results are out
        print(f"  {name}: exited with {r.returncode} after reporting its results (results kept)")
    return json.loads(line[-1])


# ---------------------------------------------------------------- report


def fmt(s: dict[str, float], unit: str = "GB/s", digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} {unit} [{s['min']:.{digits}f}..{s['max']:.{digits}f}]"


def best_one_stream(ceilings: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The one-stream ceiling with the highest median: what a pdlink tcp link (one stream) is held to."""
    one = [c for c in ceilings if c["streams"] == 1]
    return max(one, key=lambda c: c["median"]) if one else None


def report(results: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = []
    runs = results["pdlink"]
    first = runs[cfg["transports"][0]]
    memcpy = first["memcpy"]
    total_mib = cfg["total"] / MIB
    lines.append(f"pdlink benchmark: {total_mib:.0f} MiB per transfer, {cfg['reps']} repetitions, median [min..max]")
    lines.append(f"  ceiling numpy memcpy ({total_mib:.0f} MiB)      : {fmt(memcpy)}")
    ceilings = results.get("tcp_ceilings") or []
    for c in ceilings:
        label = f"{c['tool']} {c['mode']}, {c['streams']} stream{'s' if c['streams'] > 1 else ''}"
        lines.append(f"  ceiling TCP {label:<26}: {fmt(c)}, {c['cpu_s_per_gb']:.3f} CPU s/GB")
    tcp_ceiling = best_one_stream(ceilings)
    for tr, r in runs.items():
        if tr == "cma":
            ceiling, cname = memcpy, "memcpy"
        elif tcp_ceiling is not None:
            ceiling, cname = tcp_ceiling, f"the best 1-stream TCP ceiling ({tcp_ceiling['tool']} {tcp_ceiling['mode']})"
        else:
            ceiling, cname = None, ""
        b = r["pull_bulk"]
        vs = f" = {b['median'] / ceiling['median']:.2f}x {cname}" if ceiling else ""
        lines.append(f"  pdlink {tr:<4} pull {cfg['block'] // KIB} KiB blocks : {fmt(b)}{vs}; "
                     f"{b['cpu_s_per_gb']:.3f} CPU s/GB")
        p = r["push_bulk"]
        vs = f" = {p['median'] / ceiling['median']:.2f}x {cname}" if ceiling else ""
        lines.append(f"  pdlink {tr:<4} push {cfg['block'] // KIB} KiB blocks : {fmt(p)}{vs}")
        s = r["pull_small"]
        lines.append(f"  pdlink {tr:<4} pull 4 KiB blocks   : {fmt(s)}, {s['us_per_block']:.3f} us/block")
        lat = r["lat_4k_us"]
        lines.append(f"  pdlink {tr:<4} one 4 KiB pull      : p50 {lat['p50']:.1f} us, p99 {lat['p99']:.1f} us "
                     f"(n={lat['n']})")
        lines.append(f"  pdlink {tr:<4} link / unlink       : {fmt(r['link_ms'], 'ms')} / {fmt(r['unlink_ms'], 'ms')}")
        lines.append(f"  pdlink {tr:<4} switch_role         : {fmt(r['switch_role_ms'], 'ms', 3)}")
        sweep = ", ".join(f"{bs // KIB}K {v:.2f}" for bs, v in r["sweep"].items())
        lines.append(f"  pdlink {tr:<4} pull GB/s by block  : {sweep}")
    scale = first.get("scale")
    if scale:
        reg = ", ".join(f"{n} blocks {ms:.3f} ms" for n, ms in scale["register_ms"].items())
        lines.append(f"  scale: register_blocks_cache      : {reg}")
        pulls = ", ".join(f"{n}: {ms:.1f} ms ({ms / n * 1e3:.2f} us/pair)" for n, ms in scale["pull_ms"].items())
        lines.append(f"  scale: pull n random block pairs ({scale['block_bytes']} B) : {pulls}")
    for name, r in results["peers"].items():
        if r is None:
            lines.append(f"  peer {name:<26}: not run")
            continue
        lines.append(f"  peer {name:<26}: read {fmt(r['read'])}, write {fmt(r['write'])}, "
                     f"4 KiB op p50 {r['lat_us']['p50']:.1f} us p99 {r['lat_us']['p99']:.1f} us")
    return lines


def plot(results: dict[str, Any], cfg: dict[str, Any], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install '.[bench]'); no plot written"
    fig, ax = plt.subplots(figsize=(8, 5))
    for tr, r in results["pdlink"].items():
        xs = sorted(r["sweep"])
        ax.plot([x / KIB for x in xs], [r["sweep"][x] for x in xs], marker="o", label=f"pdlink {tr} pull")
    first = results["pdlink"][cfg["transports"][0]]
    ax.axhline(first["memcpy"]["median"], color="gray", linestyle="--", label="numpy memcpy (ceiling)")
    tcp = best_one_stream(results.get("tcp_ceilings") or [])
    if tcp is not None:
        ax.axhline(tcp["median"], color="black", linestyle=":",
                   label=f"loopback TCP, 1 stream, {tcp['tool']} {tcp['mode']} (ceiling)")
    for name, r in results["peers"].items():
        if r is not None:
            ax.plot([cfg["block"] / KIB], [r["read"]["median"]], marker="s", linestyle="none", label=f"{name} read")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (KiB)")
    ax.set_ylabel("GB/s (median)")
    ax.set_title(f"KV block pull throughput, two processes on one host ({platform.node()})")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and counts: checks that everything runs")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="where results.json and the plot go")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--transports", default="cma,tcp",
                    help='comma-separated: cma, tcp, tcp@N (N streams per link), ucx (UCX_TLS as set), ucx:TLS '
                         '(e.g. "ucx:tcp")')
    args = ap.parse_args(argv)
    from pdlink._sysinfo import direct_access_permitted

    cfg = {
        "total": 64 * MIB, "block": 256 * KIB, "reps": args.reps, "lat_n": 2000, "link_n": 20,
        "sweep": [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB], "sweep_total": 16 * MIB,
        "scale_blocks": [1000, 10000, 100000], "transports": args.transports.split(","),
    }
    if "cma" in cfg["transports"] and not direct_access_permitted():
        print("direct memory access (process_vm_readv) is not permitted here: measuring tcp only")
        cfg["transports"] = [t for t in cfg["transports"] if t != "cma"] or ["tcp"]
    if args.smoke:
        cfg.update(total=2 * MIB, block=64 * KIB, reps=2, lat_n=20, link_n=2, sweep=[4 * KIB, 64 * KIB],
                   sweep_total=1 * MIB, scale_blocks=[100, 1000])
    ctx = mp.get_context("spawn")
    results: dict[str, Any] = {"config": {k: v for k, v in cfg.items()}, "pdlink": {}, "peers": {},
                               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                           "platform": platform.platform()}}
    for tr in cfg["transports"]:
        # a target per transport: the ucx path needs a ucx engine at both ends
        tconn, child = ctx.Pipe()
        # "auto" accepts tcp and cma; tcp@N's stream count goes to the target too (it bounds the lanes)
        streams = tr.partition("@")[2]
        accepts = tr if tr.startswith("ucx") else "auto" + (f"@{streams}" if streams else "")
        target = ctx.Process(target=target_main, args=(child, cfg, accepts), daemon=True)
        target.start()
        info = tconn.recv()
        try:
            iconn, ichild = ctx.Pipe()
            proc = ctx.Process(target=initiator_main, args=(ichild, tr, cfg, info))
            proc.start()
            status, value = iconn.recv()
            proc.join(60)
            if status != "ok":
                print(f"pdlink {tr}: FAILED\n{value}")
                return 1
            results["pdlink"][tr] = value
        finally:
            tconn.send("stop")
            tconn.recv()
            target.join(30)
    if any(t.startswith("tcp") for t in cfg["transports"]):
        results["tcp_ceilings"] = tcp_ceilings(cfg["total"], cfg["reps"], args.smoke)
    if not args.no_peers and not args.smoke:
        print("peers (same work, same machine, same run):")
        results["peers"]["Mooncake TE tcp"] = run_peer("Mooncake TE tcp", "mooncake_peer.py",
                                                       "PDLINK_BENCH_MOONCAKE_PYTHON", "mooncake.engine", {}, cfg)
        for label, tls in (("NIXL/UCX default", None), ("NIXL/UCX UCX_TLS=tcp", "tcp")):
            env = {"NIXL_MOD": os.environ.get("NIXL_MOD", "nixl_cu12")}
            if tls:
                env["UCX_TLS"] = tls
            results["peers"][label] = run_peer(label, "nixl_peer.py", "PDLINK_BENCH_NIXL_PYTHON",
                                               env["NIXL_MOD"] + "._api", env, cfg)
    lines = report(results, cfg)
    print("\n".join(lines))
    save(args.out, "results", results, "\n".join(lines))
    note = plot(results, cfg, os.path.join(args.out, "throughput.png"))
    print(note or f"plot: {os.path.join(args.out, 'throughput.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
