"""Mooncake Transfer Engine on the benchmark's work: TCP transport, P2P handshake, two processes.

The target registers a buffer; the initiator reads and writes it in blocks with the batch API
(every block a separate entry, reversed order as in pdlink's run; one call per repetition, or calls
of at most MAX_BATCH entries: 0.3.13's TCP transport rejects a larger batch, logging "TCP lane
queue-full rejection", and the call fails), then times one 4 KiB synchronous read per iteration.
Bytes are verified once each way.
Usage: python mooncake_peer.py total_MiB block_KiB reps lat_n  -> one JSON line
"""
import multiprocessing as mp
import sys
import time

import numpy as np
from _common import emit

TOTAL, BLOCK = int(sys.argv[1]) << 20, int(sys.argv[2]) << 10
REPS, LAT_N = int(sys.argv[3]), int(sys.argv[4])
N = TOTAL // BLOCK
MAX_BATCH = 1024


def engine():
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake initialize failed")
    return te


def target(to_init, from_init):
    te = engine()
    buf = np.random.default_rng(1).integers(0, 256, TOTAL, dtype=np.uint8)
    assert te.register_memory(buf.ctypes.data, TOTAL) == 0
    to_init.send((f"127.0.0.1:{te.get_rpc_port()}", buf.ctypes.data, buf.tobytes()))
    from_init.recv()  # written: send what arrived back for verification
    to_init.send(buf.tobytes())
    from_init.recv()


def main():
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=target, args=(b, b), daemon=True)
    p.start()
    peer, raddr, original = a.recv()
    te = engine()
    local = np.zeros(TOTAL, dtype=np.uint8)
    assert te.register_memory(local.ctypes.data, TOTAL) == 0
    laddrs = [local.ctypes.data + i * BLOCK for i in range(N)]
    raddrs = [raddr + (N - 1 - i) * BLOCK for i in range(N)]
    lens = [BLOCK] * N
    gbps = {}
    for op, batch in (("read", te.batch_transfer_sync_read), ("write", te.batch_transfer_sync_write)):
        def fn(peer, laddrs, raddrs, lens, batch=batch):
            for i in range(0, len(lens), MAX_BATCH):
                ret = batch(peer, laddrs[i:i + MAX_BATCH], raddrs[i:i + MAX_BATCH], lens[i:i + MAX_BATCH])
                if ret != 0:
                    return ret
            return 0

        assert fn(peer, laddrs, raddrs, lens) == 0  # warm-up, connection setup
        if op == "read":  # verify: local block i == remote block N-1-i
            ref = np.frombuffer(original, dtype=np.uint8).reshape(N, BLOCK)[::-1].reshape(-1)
            assert np.array_equal(local, ref), "mooncake read: bytes differ"
        times = []
        for _ in range(REPS):
            t0 = time.perf_counter()
            assert fn(peer, laddrs, raddrs, lens) == 0
            times.append(time.perf_counter() - t0)
        gbps[op] = [TOTAL / t / 1e9 for t in times]
    a.send("check")
    arrived = np.frombuffer(a.recv(), dtype=np.uint8).reshape(N, BLOCK)
    assert np.array_equal(arrived[::-1].reshape(-1), local), "mooncake write: bytes differ"
    lat = []
    for _ in range(LAT_N):
        t0 = time.perf_counter()
        assert te.transfer_sync_read(peer, local.ctypes.data, raddr, 4096) == 0
        lat.append((time.perf_counter() - t0) * 1e6)
    a.send("stop")
    emit(gbps["read"], gbps["write"], lat, {"peer": "mooncake", "transport": "tcp", "block": BLOCK})


if __name__ == "__main__":
    main()
