"""A raw client of pdlink's wire protocol (v2), for hostile-peer tests: it says exactly the bytes a
test wants, well-formed or not. Layouts: docs/architecture.md, "Wire protocol"."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

HELLO_MAGIC, ACK_MAGIC, AUTH_MAGIC, REQUEST_MAGIC = 0x4B4C4450, 0x414C4450, 0x524C4450, 0x514C4450
ACK_FIXED = 22 + 40 + 16 + 32


def hello(version=2, channel=0, cluster=9, expected=1, nonce=1234, challenge=None):
    """A Hello; the identity is zeros ("not on your host")."""
    challenge = challenge if challenge is not None else os.urandom(16)
    return struct.pack("<IHBBQQQ", HELLO_MAGIC, version, channel, 0, cluster, expected, nonce) + bytes(40) + challenge


def recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def read_ack(s: socket.socket):
    """(status, cluster id, message, challenge, proof) of a HelloAck."""
    s.settimeout(5)
    head = recv_exact(s, ACK_FIXED)
    _magic, _version, status, cluster, mlen = struct.unpack("<IHIQI", head[:22])
    challenge, proof = head[62:78], head[78:110]
    return status, cluster, recv_exact(s, mlen).decode(), challenge, proof


def read_auth(s: socket.socket):
    """(status, message) of an AuthResult."""
    magic, status, mlen = struct.unpack("<III", recv_exact(s, 12))
    assert magic == AUTH_MAGIC
    return status, recv_exact(s, mlen).decode()


def proof(secret: bytes, role: bytes, client_challenge: bytes, server_challenge: bytes, client: int, server: int,
          nonce: int, channel: int) -> bytes:
    """The handshake proof (engine.cc linkProof); 32 zero bytes without a secret."""
    if not secret:
        return bytes(32)
    msg = (b"pdlink-link-v2" + role + client_challenge + server_challenge + struct.pack("<QQQ", client, server, nonce)
           + bytes([channel]))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def handshake(port: int, channel=0, cluster=9, expected=1, nonce=1234, secret=b"", send_proof=None):
    """Connect and run one channel's handshake. Returns (socket, stage, status, message): stage is
    "ack" when the HelloAck refused, else "auth" with the AuthResult's status."""
    s = socket.create_connection(("127.0.0.1", port))
    challenge = os.urandom(16)
    s.sendall(hello(channel=channel, cluster=cluster, expected=expected, nonce=nonce, challenge=challenge))
    status, server, msg, server_challenge, _server_proof = read_ack(s)
    if status != 0:
        return s, "ack", status, msg
    mine = send_proof if send_proof is not None else proof(secret, b"C", challenge, server_challenge, cluster, server,
                                                           nonce, channel)
    s.sendall(mine)
    status, msg = read_auth(s)
    return s, "auth", status, msg


def request(op: int, body: bytes, payload_len: int = 0, flags: int = 0) -> bytes:
    return struct.pack("<IBBHIQ", REQUEST_MAGIC, op, flags, 0, len(body), payload_len) + body


def blocks_body(model=0, tensors=(0,), runs=((0, 64),), block_size=0, kind=4) -> bytes:
    b = struct.pack("<BQQQqQQ", kind, model, 2**64 - 1, 2**64 - 1, 0, 0, block_size)
    b += struct.pack("<I", len(tensors)) + b"".join(struct.pack("<I", t) for t in tensors)
    b += struct.pack("<I", len(runs)) + b"".join(struct.pack("<QQ", o, n) for o, n in runs)
    return b


def read_response(s: socket.socket):
    """(status, message, payload) of a Response."""
    _magic, status, mlen, plen = struct.unpack("<IIIQ", recv_exact(s, 20))
    return status, recv_exact(s, mlen).decode(), recv_exact(s, plen)
