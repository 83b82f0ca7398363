"""NIXL (UCX backend, DRAM) on the benchmark's work: two agents in two processes, metadata over a
pipe, prepared descriptor lists and block-index arrays (the PD-disaggregation pattern), READ and
WRITE of every block (reversed order), then one prepared 4 KiB READ per iteration. UCX_TLS in the
environment selects UCX's transports; NIXL_MOD names the module (nixl_cu12, nixl).
Usage: python nixl_peer.py total_MiB block_KiB reps lat_n  -> one JSON line
"""
import importlib
import multiprocessing as mp
import os
import sys
import time

import numpy as np
from _common import emit

TOTAL, BLOCK = int(sys.argv[1]) << 20, int(sys.argv[2]) << 10
REPS, LAT_N = int(sys.argv[3]), int(sys.argv[4])
N = TOTAL // BLOCK


def api():
    return importlib.import_module(os.environ.get("NIXL_MOD", "nixl") + "._api")


def agent(name):
    m = api()
    return m.nixl_agent(name, m.nixl_agent_config(backends=["UCX"]))


def target(conn):
    ag = agent("target")
    buf = np.random.default_rng(1).integers(0, 256, TOTAL, dtype=np.uint8)
    ag.register_memory([(buf.ctypes.data, TOTAL, 0, "")], "DRAM")
    conn.send((ag.get_agent_metadata(), buf.tobytes(), buf.ctypes.data))
    ag.add_remote_agent(conn.recv())
    descs = ag.get_xfer_descs([(buf.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(N)], "DRAM")
    conn.send(ag.get_serialized_descs(descs))
    conn.recv()  # written
    conn.send(buf.tobytes())
    conn.recv()


def wait(ag, h):
    st = ag.transfer(h)
    while st == "PROC":
        st = ag.check_xfer_state(h)
    if st != "DONE":
        raise RuntimeError(f"nixl transfer state {st}")


def main():
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=target, args=(b,), daemon=True)
    p.start()
    meta, original, raddr = a.recv()
    ag = agent("initiator")
    local = np.zeros(TOTAL, dtype=np.uint8)
    ag.register_memory([(local.ctypes.data, TOTAL, 0, "")], "DRAM")
    remote = ag.add_remote_agent(meta)
    a.send(ag.get_agent_metadata())
    rdescs = ag.deserialize_descs(a.recv())
    ldescs = ag.get_xfer_descs([(local.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(N)], "DRAM")
    lh = ag.prep_xfer_dlist("NIXL_INIT_AGENT", ldescs)
    rh = ag.prep_xfer_dlist(remote, rdescs)
    lidx = np.arange(N, dtype=np.int32)
    ridx = lidx[::-1].copy()
    gbps = {}
    for op in ("READ", "WRITE"):
        h = ag.make_prepped_xfer(op, lh, lidx, rh, ridx)
        wait(ag, h)  # warm-up
        if op == "READ":
            ref = np.frombuffer(original, dtype=np.uint8).reshape(N, BLOCK)[::-1].reshape(-1)
            assert np.array_equal(local, ref), "nixl read: bytes differ"
        times = []
        for _ in range(REPS):
            t0 = time.perf_counter()
            wait(ag, h)
            times.append(time.perf_counter() - t0)
        gbps[op.lower()] = [TOTAL / t / 1e9 for t in times]
        ag.release_xfer_handle(h)
    a.send("check")
    arrived = np.frombuffer(a.recv(), dtype=np.uint8).reshape(N, BLOCK)
    assert np.array_equal(arrived[::-1].reshape(-1), local), "nixl write: bytes differ"
    # one 4 KiB block, prepared once and posted repeatedly
    one = ag.initialize_xfer("READ", ag.get_xfer_descs([(local.ctypes.data, 4096, 0)], "DRAM"),
                             ag.get_xfer_descs([(raddr, 4096, 0)], "DRAM"), remote)
    wait(ag, one)
    lat = []
    for _ in range(LAT_N):
        t0 = time.perf_counter()
        wait(ag, one)
        lat.append((time.perf_counter() - t0) * 1e6)
    a.send("stop")
    emit(gbps["read"], gbps["write"], lat,
         {"peer": "nixl", "transport": os.environ.get("UCX_TLS", "default"), "block": BLOCK})


if __name__ == "__main__":
    main()
