"""``pdlink demo``: a prefill and a decode process move a KV cache, switch roles, move it back.

What it shows, end to end, on one machine over loopback (on the CPU backend the KV is host memory
moved over TCP or same-host copies; with PDLINK_BACKEND=ascend it is NPU memory moved over HCCL):
  1. the prefill process (PROMPT, cluster 1) registers a paged KV cache filled with a known
     pattern and listens; the decode process (DECODER, cluster 2) links to it;
  2. decode pulls every block (in a shuffled block order), verifies every byte, and reports GB/s;
  3. both unlink and switch roles: the old decoder becomes PROMPT and listens, the old
     prefill becomes DECODER, links back and pulls a new pattern the other way, verified.

The two processes coordinate through a pipe, as real serving stacks do through ZMQ or HTTP;
all KV bytes travel through pdlink.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

PROMPT_ID, DECODER_ID = 1, 2


def _pattern(np: Any, shape: tuple, tensor: int, seed: int):
    n = 1
    for d in shape:
        n *= d
    mixed = (np.arange(n, dtype=np.uint32) * 2654435761 + tensor * 97 + seed * 7919) >> 7
    return mixed.astype(np.uint8).reshape(shape)


def _worker(name: str, role_first: int, conn: Any, args: dict[str, Any], results: Any) -> None:
    import numpy as np

    from llm_datadist import (
        BlocksCacheKey,
        CacheDesc,
        DataType,
        LLMClusterInfo,
        LLMConfig,
        LLMDataDist,
        LLMRole,
        LLMStatusCode,
    )
    from pdlink.device import DeviceMemory

    num_tensors, num_blocks, block_bytes = args["num_tensors"], args["num_blocks"], args["block_bytes"]
    shape = (num_blocks, block_bytes)
    me = PROMPT_ID if role_first == 1 else DECODER_ID
    other = DECODER_ID if me == PROMPT_ID else PROMPT_ID
    prompt_first = me == PROMPT_ID

    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.sync_kv_timeout = 20000
    if prompt_first:
        cfg.listen_ip_info = "127.0.0.1:0"
    dd = LLMDataDist(LLMRole.PROMPT if prompt_first else LLMRole.DECODER, me)
    dd.init(cfg.generate_options())
    cm = dd.cache_manager
    # The KV memory comes from the engine's backend: host memory on CPU, NPU memory on Ascend
    # (PDLINK_BACKEND), so the same demo runs on either; fill and check go through backend copies.
    backend = dd._engine.backend
    results.put(("backend", backend))
    kv = [DeviceMemory(num_blocks * block_bytes, backend=backend) for _ in range(num_tensors)]
    zeros = np.zeros(num_blocks * block_bytes, dtype=np.uint8)
    desc = CacheDesc(num_tensors, list(shape), DataType.DT_UINT8)
    cache = cm.register_blocks_cache(desc, [m.addr for m in kv], BlocksCacheKey(me, 0))

    def pull_and_verify(seed: int, peer_port: int) -> dict[str, Any]:
        info = LLMClusterInfo()
        info.remote_cluster_id = other
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", peer_port)
        t0 = time.perf_counter()
        ret, per = dd.link_clusters([info], 5000)
        link_ms = (time.perf_counter() - t0) * 1e3
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"{name}: link_clusters failed: {ret} {per}")
        rng = np.random.default_rng(seed)
        src_blocks = rng.permutation(num_blocks).tolist()
        dst_blocks = list(range(num_blocks))
        times = []
        for _ in range(args["repeat"]):
            for m in kv:
                m.write(zeros)
            t0 = time.perf_counter()
            cm.pull_blocks(BlocksCacheKey(other, 0), cache, src_blocks, dst_blocks)
            times.append(time.perf_counter() - t0)
        for t, m in enumerate(kv):  # every byte, in the shuffled order
            expected = _pattern(np, shape, t, seed)[src_blocks]
            if not np.array_equal(m.read().reshape(shape), expected):
                raise RuntimeError(f"{name}: verification failed for tensor {t}")
        t0 = time.perf_counter()
        ret, per = dd.unlink_clusters([info], 5000)
        unlink_ms = (time.perf_counter() - t0) * 1e3
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"{name}: unlink_clusters failed: {ret} {per}")
        total = num_tensors * num_blocks * block_bytes
        med = statistics.median(times)
        return {"who": name, "bytes": total, "median_s": med, "min_s": min(times), "max_s": max(times),
                "gbps": total / med / 1e9, "link_ms": link_ms, "unlink_ms": unlink_ms}

    def recv() -> Any:
        kind, value = conn.recv()
        if kind == "error":
            raise RuntimeError("the other demo process failed")
        return value

    def fill(seed: int) -> None:
        for t, m in enumerate(kv):
            m.write(_pattern(np, shape, t, seed))

    try:
        # Phase 1: prompt serves, decoder pulls.
        if prompt_first:
            fill(seed=1)
            conn.send(("port", dd.listen_port))
            recv()  # decoder finished pulling and unlinked
        else:
            port = recv()
            results.put(("pull", pull_and_verify(1, port)))
            conn.send(("done", None))
        # Phase 2: switch roles (no links remain), then the data flows the other way.
        t0 = time.perf_counter()
        if prompt_first:
            dd.switch_role(LLMRole.DECODER)
        else:
            dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})
        results.put(("switch", {"who": name, "ms": (time.perf_counter() - t0) * 1e3, "role": str(dd.role)}))
        if prompt_first:
            port = recv()
            results.put(("pull", pull_and_verify(2, port)))
            conn.send(("done", None))
        else:
            fill(seed=2)
            conn.send(("port", dd.listen_port))
            recv()
        cm.unregister_cache(cache.cache_id)
        dd.finalize()
        for m in kv:
            m.free()
        results.put(("ok", name))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        results.put(("error", f"{name}: {type(e).__name__}: {e}"))
        conn.send(("error", None))


def run(size_mib: int = 64, block_kib: int = 256, num_tensors: int = 8, repeat: int = 5, out: Any = None) -> int:
    """Run the demo; returns a process exit code (0 on success)."""
    out = out or sys.stdout
    block_bytes = block_kib * 1024
    total = size_mib * 1024 * 1024
    num_blocks = max(1, total // (num_tensors * block_bytes))
    args = {"num_tensors": num_tensors, "num_blocks": num_blocks, "block_bytes": block_bytes, "repeat": repeat}
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    results = ctx.Queue()
    print(f"pdlink demo: {num_tensors} tensors x {num_blocks} blocks x {block_kib} KiB = "
          f"{num_tensors * num_blocks * block_bytes / 2**20:.0f} MiB per pull, {repeat} repetitions, "
          "loopback", file=out)
    procs = [ctx.Process(target=_worker, args=("prefill", 1, a, args, results), name="pdlink-prefill"),
             ctx.Process(target=_worker, args=("decode", 2, b, args, results), name="pdlink-decode")]
    for p in procs:
        p.start()
    got: list[tuple] = []
    deadline = time.monotonic() + 300
    while sum(1 for k, _ in got if k in ("ok", "error")) < 2 and time.monotonic() < deadline:
        try:
            got.append(results.get(timeout=1.0))
        except Exception:  # noqa: BLE001 - queue.Empty: check the children are alive
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    errors = [v for k, v in got if k == "error"]
    shown = set()
    for kind, v in got:
        if kind == "pull":
            print(f"  {v['who']:>8} pulled {v['bytes'] / 2**20:.0f} MiB: median {v['gbps']:.2f} GB/s "
                  f"({v['median_s'] * 1e3:.1f} ms; min {v['min_s'] * 1e3:.1f}, max {v['max_s'] * 1e3:.1f}), "
                  f"verified byte for byte; link {v['link_ms']:.1f} ms, unlink {v['unlink_ms']:.1f} ms", file=out)
        elif kind == "backend" and v != "cpu" and v not in shown:  # both processes report it
            shown.add(v)
            print(f"  backend {v}: KV in device memory, moved over HCCL", file=out)
        elif kind == "switch":
            print(f"  {v['who']:>8} switched role to {v['role']} in {v['ms']:.2f} ms", file=out)
    oks = [v for k, v in got if k == "ok"]
    if errors or len(oks) != 2:
        for e in errors or ["a demo process did not finish"]:
            print(f"FAILED: {e}", file=out)
        return 1
    print("OK: KV moved prefill -> decode, roles switched, KV moved back; every byte verified.", file=out)
    return 0
