"""Attacker-side sweep of a request's flag byte (tests/hostile/test_flag_sweep.py): for each op and
each of the 256 flag values, a fresh raw link (tests/peers/hostile.py's handshake, sealed frames
when a secret is given: tests/rawwire.py's Sealer) sends one frame, and what came back is recorded:
"closed", or (status, payload bytes, payload). Run in the attacker's process so the sweep costs one
call.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct

import rawwire
from peers.hostile import ATTACKER_IP, _words

NO_ANSWER = {rawwire.OP_COMMIT, rawwire.OP_RELEASE}


def raw_link(port: int, cluster: int, secret: bytes, unix: str | None):
    """Both channels of a raw link as cluster ``cluster`` (proving ``secret`` when given, over the AF_UNIX
    name ``unix`` when given): (forward socket, reverse socket, the forward channel's Sealer or None)."""
    nonce = int.from_bytes(os.urandom(16), "little")
    gen = ctypes.addressof(_words) if unix is not None else 0
    fwd = rawwire.handshake(port, cluster=cluster, expected=rawwire.ANY, nonce=nonce, secret=secret, unix=unix,
                            source=ATTACKER_IP, gen_addr=gen)
    assert fwd.status == 0, fwd.message
    rev = rawwire.handshake(port, channel=1, cluster=cluster, expected=rawwire.ANY, nonce=nonce, secret=secret,
                            unix=unix, source=ATTACKER_IP, gen_addr=gen)
    assert rev.status == 0, rev.message
    fwd.sock.settimeout(10)
    sealer = rawwire.Sealer(fwd.key, requester=True) if secret else None
    return fwd.sock, rev.sock, sealer


def _response(s: socket.socket, sealer) -> tuple[int, int, bytes]:
    head = rawwire.recv_exact(s, rawwire.RESPONSE_HEADER_BYTES)
    status, mlen, plen, _tag = rawwire.response_header(head)
    message = rawwire.recv_exact(s, mlen)
    if sealer is not None:
        tag = rawwire.recv_exact(s, rawwire.TAG_BYTES)
        assert sealer.check(head + message, tag), "a response whose tag does not check out"
    payload = rawwire.recv_exact(s, min(plen, 1 << 20)) if sealer is None else b""
    return status, plen, payload


def sweep(port: int, frames: dict[int, bytes], secret: bytes = b"", unix: str | None = None,
          first_cluster: int = 1000) -> dict[tuple[int, int], object]:
    """``frames``: op -> a frame of that op (its flag byte is overwritten, and its payload length
    zeroed unless the flags are 0). Returns (op, flags) -> "closed" | (status, payload_len, payload)."""
    out: dict[tuple[int, int], object] = {}
    cluster = first_cluster
    for op, frame in sorted(frames.items()):
        for flags in range(256):
            fwd, rev, sealer = raw_link(port, cluster, secret, unix)
            cluster += 1
            f = bytearray(frame)
            f[5] = flags
            if flags != 0:  # only the stream's write carries its payload in the stream
                head = list(struct.unpack_from(rawwire.REQUEST_FORMAT, f))
                blen, head[-1] = head[-2], 0  # body_len kept, payload_len zeroed
                struct.pack_into(rawwire.REQUEST_FORMAT, f, 0, *head)
                f = f[:rawwire.REQUEST_HEADER_BYTES + blen]
            data = bytes(f)
            if sealer is not None:
                end = rawwire.REQUEST_HEADER_BYTES + struct.unpack_from(rawwire.REQUEST_FORMAT, data)[-2]
                frame_bytes, rest = data[:end], data[end:]
                data = sealer.seal(frame_bytes) + rest
            try:
                fwd.sendall(data)
                if op in NO_ANSWER:
                    ping = rawwire.request(rawwire.OP_PING, b"")
                    fwd.sendall(sealer.seal(ping) if sealer is not None else ping)
                out[(op, flags)] = _response(fwd, sealer)
            except (ConnectionError, OSError):
                out[(op, flags)] = "closed"
            fwd.close()
            rev.close()
    return out
