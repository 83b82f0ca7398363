"""Small network probes to run inside emulated hosts (``Host.run`` / ``Host.spawn`` of
pdlink.testing.hosts): a UDP echo and a prober that measures round trips, a paced numbered sender
and a receiver that reports what arrived (loss, order). Standard library only; every call is bounded
by its own arguments (a count and a time)."""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any


def udp_echo(ip: str, port: int, seconds: float) -> int:
    """Echo UDP datagrams on ip:port for ``seconds``; returns how many."""
    n = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((ip, port))
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            try:
                data, peer = s.recvfrom(65536)
            except TimeoutError:
                break
            s.sendto(data, peer)
            n += 1
    return n


def udp_probe(
    ip: str, port: int, count: int, size: int = 64, wait_s: float = 1.0, gap_s: float = 0.0
) -> dict[str, Any]:
    """Send ``count`` numbered datagrams to an echo at ip:port one at a time (each waits up to
    ``wait_s`` for its echo). Returns the round trips in microseconds of those answered and how many
    were lost."""
    rtts: list[float] = []
    lost = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, port))
        pad = b"\0" * max(0, size - 12)
        for seq in range(count):
            sent = time.perf_counter()
            s.send(struct.pack("!Id", seq, sent) + pad)
            deadline = sent + wait_s
            while True:
                left = deadline - time.perf_counter()
                if left <= 0:
                    lost += 1
                    break
                s.settimeout(left)
                try:
                    data = s.recv(65536)
                except (TimeoutError, ConnectionRefusedError):
                    continue
                got, _ = struct.unpack("!Id", data[:12])
                if got == seq:
                    rtts.append((time.perf_counter() - sent) * 1e6)
                    break
            if gap_s:
                time.sleep(gap_s)
    return {"rtts_us": rtts, "lost": lost}


def udp_receive(ip: str, port: int, count: int, seconds: float) -> list[int]:
    """Receive numbered datagrams on ip:port until ``count`` arrived or ``seconds`` passed with
    none; returns the sequence numbers in arrival order."""
    seqs: list[int] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        s.bind((ip, port))
        s.settimeout(seconds)
        while len(seqs) < count:
            try:
                data = s.recv(65536)
            except TimeoutError:
                break
            seqs.append(struct.unpack("!I", data[:4])[0])
    return seqs


def udp_send(ip: str, port: int, count: int, size: int = 200, per_ms: int = 20) -> int:
    """Send ``count`` numbered datagrams to ip:port, ``per_ms`` a millisecond (paced, so no socket
    buffer on the way overflows: what is lost is the wire's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, port))
        pad = b"\0" * max(0, size - 4)
        start = time.perf_counter()
        for seq in range(count):
            s.send(struct.pack("!I", seq) + pad)
            if seq % per_ms == per_ms - 1:
                ahead = start + (seq + 1) / per_ms / 1000 - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)
    return count


SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's value (the socket module lacks it before 3.13)


def _icmp_checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def icmp_probe(ip: str, count: int, size: int = 56, wait_s: float = 1.0, gap_s: float = 0.0) -> dict[str, Any]:
    """Ping ``ip`` ``count`` times, one echo request at a time (each waits up to ``wait_s`` for its
    reply; needs CAP_NET_RAW). The kernel of the other host answers, so no process there has to be
    scheduled, and the reply's arrival is the kernel's receive timestamp (SO_TIMESTAMPNS), so this
    process's own wake-up is not counted either: the round trips measure the wire and the two
    kernels. Returns the round trips in microseconds of those answered and how many were lost."""
    ident = os.getpid() & 0xFFFF
    rtts: list[float] = []
    lost = 0
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as s:
        s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        pad = b"\xa5" * max(0, size - 8)
        for seq in range(count):
            seq16 = seq & 0xFFFF
            header = struct.pack("!BBHHH", 8, 0, 0, ident, seq16)
            packet = struct.pack("!BBHHH", 8, 0, _icmp_checksum(header + pad), ident, seq16) + pad
            sent = time.time_ns()
            s.sendto(packet, (ip, 0))
            deadline = time.monotonic() + wait_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    lost += 1
                    break
                s.settimeout(left)
                try:
                    data, ancillary, _, _ = s.recvmsg(65536, 1024)
                except TimeoutError:
                    continue
                ihl = (data[0] & 0xF) * 4
                kind, _, _, rid, rseq = struct.unpack("!BBHHH", data[ihl : ihl + 8])
                if kind != 0 or rid != ident or rseq != seq16:
                    continue
                arrived = time.time_ns()
                for level, typ, payload in ancillary:
                    if level == socket.SOL_SOCKET and typ == SO_TIMESTAMPNS:
                        sec, nsec = struct.unpack("qq", payload[:16])
                        arrived = sec * 1_000_000_000 + nsec
                rtts.append((arrived - sent) / 1000)
                break
            if gap_s:
                time.sleep(gap_s)
    return {"rtts_us": rtts, "lost": lost}
