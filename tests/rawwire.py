"""A raw speaker of pdlink's wire protocol (v9), for hostile-peer and hostile-server tests: it says
exactly the bytes a test wants, well-formed or not. Layouts: csrc/transport/wire.h and
docs/architecture.md, "Wire protocol"."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import socket
import struct

VERSION = 10
# Wire v9 (csrc/transport/wire.h; its headers are v8's): a request header is 24 bytes, a reserved u16 at offset 6 (zero,
# anything else is malformed) and the u32 epoch tag at offset 8 (0: unfenced); a response header is
# 24 bytes, its last u32 the server's epoch tag. The tag is 1 + epoch % EPOCH_TAG_PERIOD.
REQUEST_FORMAT = "<IBBHIIQ"  # magic, op, flags, reserved, epoch_tag, body_len, payload_len
REQUEST_HEADER_BYTES = 24
RESPONSE_FORMAT = "<IIIQI"  # magic, status, message_len, payload_len, epoch_tag
RESPONSE_HEADER_BYTES = 24
EPOCH_TAG_PERIOD = 0xFFFFFFFF
HELLO_MAGIC, ACK_MAGIC, AUTH_MAGIC, REQUEST_MAGIC, RESPONSE_MAGIC = (
    0x4B4C4450, 0x414C4450, 0x524C4450, 0x514C4450, 0x534C4450)
HELLO_BYTES = 56
ACK_FIXED = 22 + 16 + 32
CLIENT_AUTH_BYTES = 32 + 16 + 8 + 8
AUTH_FIXED = 22 + 1 + 16
TAG_BYTES = 16
HELLO_SAME_HOST, HELLO_PAYLOAD_INTEGRITY = 1, 2
AUTH_PAYLOAD_INTEGRITY = 1

(OP_READ, OP_WRITE, OP_COMMIT, OP_UNLINK, OP_PING, OP_DESCRIBE, OP_RELEASE) = range(1, 8)
OP_NOTIFY, OP_CONFIRM, OP_PATH_CONNECT, OP_HANDOFF = 9, 11, 12, 13
# v4's device-channel and ucx-connect frames: unknown ops since v5 (a frame with either is dropped).
OLD_OP_DEVICE_CHANNEL, OLD_OP_UCX_CONNECT = 8, 10
FLAG_DIRECT, FLAG_DEVICE, FLAG_ONE_SIDED, FLAG_UCX = 1, 2, 4, 8
# A path-connect header names its path by the flags its requests carry (wire::kPathConnectHeaderBytes).
PATH_DEVICE_CHANNEL, PATH_UCX = FLAG_DEVICE, FLAG_UCX
FLAG_TEST_PATH = 16  # the path of a C++ test build only (csrc/tests/pipe_path.h)
MARK_SPLIT = 32  # wire v7's split mark, alone: on a read a chunk of a split pull, on a release its end
KIND_REQUEST_KEY, KIND_PREFIX_KEY, KIND_ID_INDEX, KIND_BLOCKS, KIND_RAW, KIND_OFFER = range(1, 7)
ANY = 2**64 - 1
ROWS_MARK = 0x80000000  # the top bit of a TransferBody's run count: rows follow (wire v10)
LINK_FAILED = 0x5010B009


def hello(version: int = VERSION, channel: int = 0, cluster: int = 9, expected: int = 1, nonce: int = 1234,
          challenge: bytes | None = None, flags: int = 0) -> bytes:
    """A Hello; ``nonce`` is the 128-bit nonce as a number (little-endian on the wire)."""
    challenge = challenge if challenge is not None else os.urandom(16)
    return (struct.pack("<IHBBQQ", HELLO_MAGIC, version, channel, flags, cluster, expected) +
            nonce.to_bytes(16, "little") + challenge)


def parse_hello(frame: bytes) -> tuple[int, int, int, int, int, int]:
    """(version, channel, flags, cluster, expected, nonce) of a Hello frame."""
    _magic, version, channel, flags, cluster, expected = struct.unpack("<IHBBQQ", frame[:24])
    return version, channel, flags, cluster, expected, int.from_bytes(frame[24:40], "little")


def direct_answer(epoch: int, epoch_addr: int, pieces: list[tuple[int, int]]) -> bytes:
    """The payload of a direct-access answer: the pin epoch, the address of its word, then
    (address, length) per piece."""
    return struct.pack("<QQ", epoch, epoch_addr) + b"".join(struct.pack("<QQ", a, n) for a, n in pieces)


def recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


@dataclasses.dataclass
class Ack:
    status: int
    cluster: int
    message: str
    challenge: bytes
    proof: bytes
    version: int


def ack(status: int = 0, cluster: int = 1, challenge: bytes = bytes(16), proof: bytes = bytes(32), message: bytes = b"",
        version: int = VERSION) -> bytes:
    return (struct.pack("<IHIQI", ACK_MAGIC, version, status, cluster, len(message)) + challenge + proof
            + message)


def read_ack(s: socket.socket) -> Ack:
    s.settimeout(5)
    head = recv_exact(s, ACK_FIXED)
    _magic, version, status, cluster, mlen = struct.unpack("<IHIQI", head[:22])
    return Ack(status, cluster, recv_exact(s, mlen).decode(), head[22:38], head[38:70], version)


def client_auth(proof: bytes, boot_id: bytes = bytes(16), pid_ns: int = 0, gen_addr: int = 0) -> bytes:
    return proof + boot_id + struct.pack("<QQ", pid_ns, gen_addr)


@dataclasses.dataclass
class AuthResult:
    status: int
    message: str
    redirect: str
    gen_addr: int
    flags: int = 0
    tag: bytes = bytes(TAG_BYTES)


def auth_result(status: int = 0, message: bytes = b"", redirect: bytes = b"", gen_addr: int = 0, flags: int = 0,
                tag: bytes = bytes(TAG_BYTES)) -> bytes:
    return (struct.pack("<IIIHQB", AUTH_MAGIC, status, len(message), len(redirect), gen_addr, flags) + tag + message
            + redirect)


def read_auth(s: socket.socket) -> AuthResult:
    fixed = recv_exact(s, AUTH_FIXED)
    magic, status, mlen, rlen, gen, flags = struct.unpack("<IIIHQB", fixed[:23])
    assert magic == AUTH_MAGIC
    return AuthResult(status, recv_exact(s, mlen).decode(), recv_exact(s, rlen).decode(), gen, flags, fixed[23:])


def _mac(key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hashlib.sha256).digest()


def transcript_hello(hello_frame: bytes, server: int, server_challenge: bytes) -> bytes:
    """The start of a channel's transcript (engine_internal.h Transcript): the Hello as sent, the
    acceptor's cluster id and challenge."""
    return hello_frame + struct.pack("<Q", server) + server_challenge


def transcript_client(boot_id: bytes = bytes(16), pid_ns: int = 0, gen_addr: int = 0) -> bytes:
    """What ClientAuth adds to the transcript besides its proof."""
    return boot_id + struct.pack("<QQ", pid_ns, gen_addr)


def transcript_verdict(unix: bool, status: int = 0, flags: int = 0, gen_addr: int = 0, redirect: bytes = b"") -> bytes:
    """What the verdict adds: the channel kind, then the AuthResult's fields."""
    return struct.pack("<BIBQH", int(unix), status, flags, gen_addr, len(redirect)) + redirect


def proof(secret: bytes, role: bytes, transcript: bytes) -> bytes:
    """A handshake proof (engine_helpers.cc handshakeProof); 32 zero bytes without a secret."""
    return _mac(secret, b"pdlink-proof-v3" + role + transcript) if secret else bytes(32)


def session_key(secret: bytes, transcript: bytes) -> bytes:
    """A channel's session key (engine_helpers.cc deriveSession), over the whole transcript."""
    return _mac(secret, b"pdlink-session-v3-" + transcript)


def verdict_tag(key: bytes) -> bytes:
    return _mac(key, b"pdlink-auth-result")[:TAG_BYTES]


class Sealer:
    """One side of an authenticated channel (transport/auth_stream.h): tags the frames it sends and
    checks the ones it receives, counting both."""

    def __init__(self, key: bytes, requester: bool):
        self.key = key
        self.send_dir, self.recv_dir = (b"Q", b"A") if requester else (b"A", b"Q")
        self.sent = self.received = 0

    def tag(self, direction: bytes, seq: int, frame: bytes) -> bytes:
        return _mac(self.key, direction + struct.pack("<Q", seq) + frame)[:TAG_BYTES]

    def seal(self, frame: bytes) -> bytes:
        """The frame followed by its tag."""
        out = frame + self.tag(self.send_dir, self.sent, frame)
        self.sent += 1
        return out

    def check(self, frame: bytes, tag: bytes) -> bool:
        ok = hmac.compare_digest(tag, self.tag(self.recv_dir, self.received, frame))
        self.received += 1
        return ok


def host_hint() -> tuple[bytes, int]:
    """(boot id, pid namespace inode) of this process: what a same-host dialler's hint says."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = bytes.fromhex(f.read().strip().replace("-", ""))
    return boot, os.stat("/proc/self/ns/pid").st_ino


def connect_unix(name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + name)
    return s


@dataclasses.dataclass
class Handshake:
    sock: socket.socket
    stage: str  # "ack" when the HelloAck refused, "proof" when the acceptor's proof failed, else "auth"
    status: int
    message: str
    result: AuthResult | None = None
    ack: Ack | None = None
    key: bytes = b""  # the session key (with a secret, once the verdict's tag checked out)


def handshake(port: int | None = None, channel: int = 0, cluster: int = 9, expected: int = 1, nonce: int = 1234,
              secret: bytes = b"", send_proof: bytes | None = None, flags: int = 0,
              hint: tuple[bytes, int] | None = None, gen_addr: int = 0, unix: str | None = None,
              source: str = "127.0.0.1") -> Handshake:
    """Connect (TCP to 127.0.0.1:port from `source`, or to the AF_UNIX abstract name `unix`) and run
    one channel's handshake."""
    if unix is not None:
        s = connect_unix(unix)
    else:
        assert port is not None
        s = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
    frame = hello(channel=channel, cluster=cluster, expected=expected, nonce=nonce, flags=flags)
    s.sendall(frame)
    a = read_ack(s)
    if a.status != 0:
        return Handshake(s, "ack", a.status, a.message, ack=a)
    transcript = transcript_hello(frame, a.cluster, a.challenge)
    if secret and a.proof != proof(secret, b"S", transcript):
        return Handshake(s, "proof", LINK_FAILED, "the acceptor's proof does not match", ack=a)
    boot, pid_ns = hint if hint is not None else (bytes(16), 0)
    transcript += transcript_client(boot, pid_ns, gen_addr)
    mine = send_proof if send_proof is not None else proof(secret, b"C", transcript)
    s.sendall(client_auth(mine, boot, pid_ns, gen_addr))
    r = read_auth(s)
    key = b""
    if secret and r.status == 0:
        key = session_key(secret, transcript + transcript_verdict(unix is not None, r.status, r.flags, r.gen_addr,
                                                                  r.redirect.encode()))
        assert r.tag == verdict_tag(key), "the verdict's tag does not match"
    return Handshake(s, "auth", r.status, r.message, r, a, key)


def epoch_tag_of(epoch: int) -> int:
    """The epoch tag of role epoch ``epoch`` (wire::epochTagOf): never 0, which is "unfenced"."""
    return 1 + epoch % EPOCH_TAG_PERIOD


def request_header(op: int, body_len: int, payload_len: int = 0, flags: int = 0, epoch_tag: int = 0,
                   reserved: int = 0) -> bytes:
    """A request header announcing ``body_len`` body bytes; ``reserved``: the u16 at offset 6."""
    return struct.pack(REQUEST_FORMAT, REQUEST_MAGIC, op, flags, reserved, epoch_tag, body_len, payload_len)


def request(op: int, body: bytes, payload_len: int = 0, flags: int = 0, epoch_tag: int = 0,
            reserved: int = 0) -> bytes:
    return request_header(op, len(body), payload_len, flags, epoch_tag, reserved) + body


def path_connect(path: int, setup: bytes, flags: int = 0, payload_len: int = 0, body_len: int | None = None) -> bytes:
    """A kPathConnect frame: its header (the path's id, one byte), then the path's setup body;
    ``body_len`` overrides the announced length (header included)."""
    body = bytes([path]) + setup
    blen = len(body) if body_len is None else body_len
    return request_header(OP_PATH_CONNECT, blen, payload_len, flags) + body


def body_header(kind: int = KIND_BLOCKS, model: int = 0, req: int = ANY, prefix: int = ANY, cache_id: int = 0,
                batch: int = 0, block_size: int = 0) -> bytes:
    return struct.pack("<BQQQqQQ", kind, model, req, prefix, cache_id, batch, block_size)


def blocks_body(model: int = 0, tensors=(0,), runs=((0, 64),), block_size: int = 0, kind: int = KIND_BLOCKS,
                req: int = ANY) -> bytes:
    b = body_header(kind=kind, model=model, block_size=block_size, req=req)
    b += struct.pack("<I", len(tensors)) + b"".join(struct.pack("<I", t) for t in tensors)
    b += struct.pack("<I", len(runs)) + b"".join(struct.pack("<QQ", o, n) for o, n in runs)
    return b


def counted_body(tensor_count: int, run_count: int, tensor_bytes: bytes = b"", run_bytes: bytes = b"",
                 model: int = 0) -> bytes:
    """A body whose counts say one thing and whose bytes may say another (for bounds tests)."""
    return (body_header(model=model) + struct.pack("<I", tensor_count) + tensor_bytes + struct.pack("<I", run_count)
            + run_bytes)


def offer_body(model: int, offer_id: int, generation: int, runs=((0, 64),), tensors=(0,), block_size: int = 0) -> bytes:
    """A TransferBody naming a KV handoff's offer (kOffer: model = the region's key, req = the offer
    id, prefix = its generation)."""
    b = body_header(kind=KIND_OFFER, model=model, req=offer_id, prefix=generation, block_size=block_size)
    b += struct.pack("<I", len(tensors)) + b"".join(struct.pack("<I", t) for t in tensors)
    b += struct.pack("<I", len(runs)) + b"".join(struct.pack("<QQ", o, n) for o, n in runs)
    return b


def abort_body(request_id: bytes, reason: bytes = b"") -> bytes:
    """A kHandoff abort: kind 1, u16 length + request id, u16 length + reason."""
    return struct.pack("<BH", 1, len(request_id)) + request_id + struct.pack("<H", len(reason)) + reason


def hold_body(offers: list[tuple[int, int]], count: int | None = None) -> bytes:
    """A kHandoff hold: kind 2, u32 count (``count`` overrides it), then (offer id, generation) pairs."""
    n = len(offers) if count is None else count
    return struct.pack("<BI", 2, n) + b"".join(struct.pack("<QQ", i, g) for i, g in offers)


def notify_body(name: bytes, message: bytes) -> bytes:
    """A kNotify body: u32 name length, the name, the message."""
    return struct.pack("<I", len(name)) + name + message


def response(status: int = 0, message: bytes = b"", payload: bytes = b"", payload_len: int | None = None,
             epoch_tag: int = 0) -> bytes:
    plen = len(payload) if payload_len is None else payload_len
    return struct.pack(RESPONSE_FORMAT, RESPONSE_MAGIC, status, len(message), plen, epoch_tag) + message + payload


def response_header(head: bytes) -> tuple[int, int, int, int]:
    """(status, message_len, payload_len, epoch_tag) of a response header's RESPONSE_HEADER_BYTES."""
    _magic, status, mlen, plen, tag = struct.unpack(RESPONSE_FORMAT, head)
    return status, mlen, plen, tag


def read_response(s: socket.socket) -> tuple[int, str, bytes]:
    """(status, message, payload) of a Response."""
    status, mlen, plen, _tag = response_header(recv_exact(s, RESPONSE_HEADER_BYTES))
    return status, recv_exact(s, mlen).decode(), recv_exact(s, plen)


def read_request(s: socket.socket) -> tuple[int, int, bytes, int]:
    """(op, flags, body, payload_len) of a Request (the payload is left in the socket)."""
    magic, op, flags, _reserved, _tag, blen, plen = struct.unpack(REQUEST_FORMAT, recv_exact(s, REQUEST_HEADER_BYTES))
    assert magic == REQUEST_MAGIC, hex(magic)
    return op, flags, recv_exact(s, blen), plen


def parse_body(body: bytes) -> tuple[int, list[int], list[tuple[int, int]]]:
    """(target kind, tensors, runs) of a TransferBody."""
    kind = body[0]
    pos = struct.calcsize("<BQQQqQQ")
    (nt,) = struct.unpack_from("<I", body, pos)
    pos += 4
    tensors = list(struct.unpack_from(f"<{nt}I", body, pos))
    pos += 4 * nt
    (nr,) = struct.unpack_from("<I", body, pos)
    pos += 4
    if nr & ROWS_MARK:  # rows (offset, length, stride, count): their runs
        flat = struct.unpack_from(f"<{4 * (nr & ~ROWS_MARK)}Q", body, pos)
        return kind, tensors, [(o + k * stride, n) for o, n, stride, count in zip(*[iter(flat)] * 4)
                               for k in range(count)]
    flat = struct.unpack_from(f"<{2 * nr}Q", body, pos)
    return kind, tensors, list(zip(flat[::2], flat[1::2]))


def rows_body(rows, model: int = 0, tensors=(0,), block_size: int = 0, kind: int = KIND_BLOCKS, req: int = ANY,
              count: int | None = None) -> bytes:
    """A TransferBody whose runs go as rows ``(offset, length, stride, count)`` (``count``
    overrides the row count the body states)."""
    b = body_header(kind=kind, model=model, block_size=block_size, req=req)
    b += struct.pack("<I", len(tensors)) + b"".join(struct.pack("<I", t) for t in tensors)
    b += struct.pack("<I", (len(rows) if count is None else count) | ROWS_MARK)
    return b + b"".join(struct.pack("<QQQQ", *row) for row in rows)
