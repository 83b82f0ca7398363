"""Mooncake Transfer Engine across two hosts: TCP transport, P2P handshake, one process per host.

The two-host form of mooncake_peer.py, for bench/bench_hosts.py: each role runs on its own host
(network namespace), started by the benchmark with that host's command prefix.

  target IP TOTAL_MiB SEED
      registers TOTAL_MiB of a seeded pattern, prints one JSON line
      {"segment": "IP:rpc_port", "address": A}, then waits for a line (or EOF) on stdin and exits.
  initiator IP SEGMENT ADDRESS TOTAL_MiB BLOCK_KiB SEED REPS BUDGET_S
      reads the target's buffer in BLOCK_KiB blocks with the batch API (every block a separate
      entry, reversed order as in pdlink's run; calls of at most MAX_BATCH entries, as in
      mooncake_peer.py), once to warm up, then verifies every byte once, then times up to REPS reads,
      stopping early once BUDGET_S seconds have passed (at least one timed read); prints one JSON
      line {"read": summary of GB/s, "gbps": [...], "verified": true, ...}.

stdlib + numpy only: it runs in Mooncake's own virtualenv.
"""
import json
import sys
import time

import numpy as np
from _common import summary

MAX_BATCH = 1024


def engine(ip):
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize(ip, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError(f"mooncake initialize({ip}) failed")
    return te


def target(ip, total_mib, seed):
    total = total_mib << 20
    te = engine(ip)
    buf = np.random.default_rng(seed).integers(0, 256, total, dtype=np.uint8)
    assert te.register_memory(buf.ctypes.data, total) == 0
    print(json.dumps({"segment": f"{ip}:{te.get_rpc_port()}", "address": buf.ctypes.data}), flush=True)
    sys.stdin.readline()  # "stop", or EOF when the benchmark goes away


def initiator(ip, segment, address, total_mib, block_kib, seed, reps, budget_s):
    total, block = total_mib << 20, block_kib << 10
    n = total // block
    te = engine(ip)
    local = np.zeros(total, dtype=np.uint8)
    assert te.register_memory(local.ctypes.data, total) == 0
    laddrs = [local.ctypes.data + i * block for i in range(n)]
    raddrs = [address + (n - 1 - i) * block for i in range(n)]
    lens = [block] * n

    def read():
        for i in range(0, n, MAX_BATCH):
            ret = te.batch_transfer_sync_read(segment, laddrs[i:i + MAX_BATCH], raddrs[i:i + MAX_BATCH],
                                              lens[i:i + MAX_BATCH])
            if ret != 0:
                raise RuntimeError(f"mooncake batch_transfer_sync_read returned {ret}")

    t0 = time.perf_counter()
    read()  # warm-up, connection setup
    warm_s = time.perf_counter() - t0
    original = np.random.default_rng(seed).integers(0, 256, total, dtype=np.uint8)
    expected = original.reshape(n, block)[::-1].reshape(-1)  # local block i == remote block n-1-i
    if not np.array_equal(local, expected):
        raise AssertionError("mooncake read across hosts: bytes differ")
    start, gbps = time.perf_counter(), []
    while len(gbps) < reps and (not gbps or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        read()
        gbps.append(total / (time.perf_counter() - t0) / 1e9)
    print(json.dumps({"read": summary(gbps), "gbps": gbps, "verified": True, "warmup_s": warm_s,
                      "peer": "mooncake", "transport": "tcp", "block": block}), flush=True)


def main(argv):
    if argv[0] == "target":
        target(argv[1], int(argv[2]), int(argv[3]))
    elif argv[0] == "initiator":
        initiator(argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5]), int(argv[6]), int(argv[7]),
                  float(argv[8]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
