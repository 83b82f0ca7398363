"""NIXL (UCX backend, DRAM) on bench/bench_tp.py's work: a target agent holds 2 x total bytes of
blocks; the initiator reads the second half of every block (a head slice) into a dense buffer,
with NIXL's strided descriptors (Nx5 arrays: address, len, device, stride, count; NIXL >= 1.5)
prepared once and posted by index arrays, and, for comparison, the same bytes as whole blocks of
half the size. Verified once each. UCX_TLS selects UCX's transports; NIXL_MOD names the module.
Usage: python nixl_strided_peer.py total_MiB block_KiB reps lat_n  -> one JSON line
"""
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np
from _common import summary
from nixl_peer import agent, wait  # its argv is this one's (total_MiB block_KiB reps lat_n)

TOTAL, BLOCK = int(sys.argv[1]) << 20, int(sys.argv[2]) << 10
REPS = int(sys.argv[3])
N = 2 * TOTAL // BLOCK  # remote blocks; half of each is read
HALF = BLOCK // 2


def target(conn):
    ag = agent("target")
    buf = np.random.default_rng(1).integers(0, 256, 2 * TOTAL, dtype=np.uint8)
    ag.register_memory([(buf.ctypes.data, buf.size, 0, "")], "DRAM")
    conn.send((ag.get_agent_metadata(), buf.tobytes(), buf.ctypes.data))
    ag.add_remote_agent(conn.recv())
    conn.recv()


def timed(ag, h, check):
    wait(ag, h)
    check()
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        wait(ag, h)
        times.append(time.perf_counter() - t0)
    return [TOTAL / t / 1e9 for t in times]


def main():
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=target, args=(b,), daemon=True)
    p.start()
    meta, original, raddr = a.recv()
    source = np.frombuffer(original, dtype=np.uint8).reshape(N, BLOCK)
    ag = agent("initiator")
    local = np.zeros(TOTAL, dtype=np.uint8)
    ag.register_memory([(local.ctypes.data, TOTAL, 0, "")], "DRAM")
    remote = ag.add_remote_agent(meta)
    a.send(ag.get_agent_metadata())
    # the head slice: N pieces of HALF bytes, one per remote block (at HALF into it), dense here
    lh = ag.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[local.ctypes.data, HALF, 0, HALF, N]], np.uint64), "DRAM")
    rh = ag.prep_xfer_dlist(remote, np.array([[raddr + HALF, HALF, 0, BLOCK, N]], np.uint64), "DRAM")
    idx = np.arange(N, dtype=np.int32)
    h = ag.make_prepped_xfer("READ", lh, idx, rh, idx)

    def sliced_ok():
        assert np.array_equal(local.reshape(N, HALF), source[:, HALF:]), "nixl strided read: bytes differ"

    sliced = timed(ag, h, sliced_ok)
    ag.release_xfer_handle(h)
    # the same bytes as whole blocks: the first TOTAL bytes of the source in blocks of HALF
    local[:] = 0
    lh2 = ag.prep_xfer_dlist("NIXL_INIT_AGENT", [(local.ctypes.data + i * HALF, HALF, 0) for i in range(N)], "DRAM")
    rh2 = ag.prep_xfer_dlist(remote, [(raddr + i * HALF, HALF, 0) for i in range(N)], "DRAM")
    h2 = ag.make_prepped_xfer("READ", lh2, idx, rh2, idx)

    def whole_ok():
        assert np.array_equal(local, source.reshape(-1)[:TOTAL]), "nixl whole-block read: bytes differ"

    whole = timed(ag, h2, whole_ok)
    a.send("stop")
    print(json.dumps({"peer": "nixl", "transport": os.environ.get("UCX_TLS", "default"), "block": BLOCK,
                      "sliced": summary(sliced), "whole": summary(whole)}), flush=True)


if __name__ == "__main__":
    main()
