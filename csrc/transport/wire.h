// The pdlink wire protocol (version 9), spoken over each channel of a link.
//
// A link is two stream connections opened by the initiator to the acceptor:
//   FORWARD: the initiator sends requests, the acceptor serves them;
//   REVERSE: the acceptor sends requests, the initiator serves them;
// and, on a TCP link, up to limits' tcp_streams - 1 LANE channels the initiator may add later (since
// v6): each a further stream the initiator requests on and the acceptor serves, for the chunks of
// one large tcp transfer (transport/tcp/stream_path.h). A LANE's Hello carries the link's own nonce
// (the FORWARD channel's, known only to both ends), its handshake is a channel's full handshake (with
// a secret: its own proofs and session key over its own transcript), and the acceptor attaches it
// only to the established, unbroken TCP link it accepted from that cluster with that nonce; on it only
// plain reads and writes (flags 0) are served.
// So each side has one channel it requests on and one it serves on, and a transfer is one-sided:
// the serving side answers from a C++ thread without any Python involvement.
//
// Handshake, per channel (all integers little-endian):
//   dialler  -> Hello        version, channel, flags, both cluster ids, nonce, challenge
//   acceptor -> HelloAck     status, its cluster id, its challenge, its proof (or a refusal)
//   dialler  -> ClientAuth   its proof; host hint and generation address (same-host channels only)
//   acceptor -> AuthResult   status; a same-host redirect; its generation address (same-host only);
//                            with a secret, a tag under the session key
// With a link secret, every frame after the handshake carries a tag under a session key derived from
// it (both challenges, both cluster ids, the nonce, the channel, the host hint, both published
// addresses, the channel kind and the payload-integrity choice): transport/auth_stream.h.
// Nothing about an engine's host or memory travels before the other side has proven the link
// secret: the host hint goes out only after the acceptor's proof checked out, the acceptor's
// redirect and addresses only after the dialler's.
//
// Same-host links: a dialler that may use same-host paths says so in its Hello (kHelloSameHost)
// and sends its host hint; an acceptor on the same host (by that hint) answers the FORWARD channel
// with a redirect to its AF_UNIX abstract socket and closes it. The dialler then opens both
// channels there, with the same handshake. On an AF_UNIX channel the kernel reports the peer's pid
// (SO_PEERCRED), so nothing a peer claims decides whether memory is copied directly: only a link
// whose channels are AF_UNIX connections to a process this side can see may use cma or IPC.
//
// After the handshake, frames are a fixed RequestHeader (+ body + payload) answered by a
// ResponseHeader (+ message + payload). Nothing read off the wire is trusted: decoders bound every
// length and count (core/limits.h) before anything is allocated for it, the serving side admits a
// request only for the paths its link negotiated (RequestServer::admit) and checks every access against
// its registered caches (engine/registry.h), and the requester checks every answer against what it
// asked for.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/limits.h"
#include "core/status.h"

namespace pdlink::wire {

constexpr uint32_t kHelloMagic = 0x4B4C4450;     // "PDLK"
constexpr uint32_t kAckMagic = 0x414C4450;       // "PDLA"
constexpr uint32_t kRequestMagic = 0x514C4450;   // "PDLQ"
constexpr uint32_t kResponseMagic = 0x534C4450;  // "PDLS"
constexpr uint32_t kAuthMagic = 0x524C4450;      // "PDLR"
constexpr uint16_t kProtocolVersion = 10;
constexpr uint64_t kAnyCluster = UINT64_MAX;  // Hello.expected_peer when the dialler does not know it

constexpr uint32_t kMaxBodyBytes = limits::kMaxBodyBytes;
constexpr uint32_t kMaxMessageBytes = limits::kMaxMessageBytes;

enum class Channel : uint8_t { kForward = 0, kReverse = 1, kLane = 2 };

// Link authentication (challenge-response). Each side sends a fresh random challenge; each proves
// it knows the shared link secret with HMAC-SHA256 over both challenges and the link's identity
// (engine/handshake.cc, handshakeProof). No secret ever crosses the wire. Without a secret a proof is all
// zeros, which a side that has a secret rejects.
constexpr size_t kChallengeBytes = 16;
constexpr size_t kProofBytes = 32;

// Hello.flags: the dialler may take a same-host redirect (its transport is not forced to tcp);
// it wants payload integrity (authenticated links: engine/engine.h EngineConfig::payload_integrity).
constexpr uint8_t kHelloSameHost = 1;
constexpr uint8_t kHelloPayloadIntegrity = 2;

// 128 random bits (the OS CSPRNG): a link attempt's identity, which nobody can predict and so
// pre-register at an acceptor.
using Nonce = std::array<uint8_t, 16>;

struct Hello {
  uint16_t version = kProtocolVersion;
  Channel channel = Channel::kForward;
  uint8_t flags = 0;
  uint64_t cluster_id = 0;     // the sender's own cluster id
  uint64_t expected_peer = 0;  // the cluster id the sender believes it is dialling
  Nonce nonce{};               // pairs the FORWARD and REVERSE channels of one link (random)
  uint8_t challenge[kChallengeBytes] = {0};
};
// The first 32 bytes keep one layout in every version (magic, version, ...), so a peer of another
// version is recognised and told so; they hold the nonce's first 8 bytes, the rest holds its other 8
// and the challenge.
constexpr size_t kHelloPrefixBytes = 32;
constexpr size_t kHelloBytes = kHelloPrefixBytes + 8 + kChallengeBytes;
std::string encode(const Hello& h);
// Decodes the 32-byte prefix. Rejects a wrong magic (garbage) with kLinkFailed; a version mismatch
// is reported by the caller.
Status decodePrefix(const uint8_t* p, size_t n, Hello* out);
// Decodes the part after the prefix (the nonce's second half, the challenge).
Status decodeRest(const uint8_t* p, size_t n, Hello* out);

struct HelloAck {
  uint16_t version = kProtocolVersion;
  uint32_t status = 0;  // an LLMStatusCode value
  uint64_t cluster_id = 0;
  uint8_t challenge[kChallengeBytes] = {0};
  uint8_t proof[kProofBytes] = {0};  // the acceptor's proof (see above)
  std::string message;
};
constexpr size_t kHelloAckFixedBytes = 22 + kChallengeBytes + kProofBytes;
std::string encode(const HelloAck& a);
// Decodes the fixed part; `message_len` (bounded) tells how many message bytes follow.
Status decodeFixed(const uint8_t* p, size_t n, HelloAck* out, uint32_t* message_len);

// Where an endpoint runs: a hint, never a proof (same-host is proven by the kernel, see above).
struct HostHint {
  uint8_t boot_id[16] = {0};  // /proc/sys/kernel/random/boot_id
  uint64_t pid_ns = 0;        // inode of /proc/self/ns/pid
  bool sameHost(const HostHint& o) const;
};

// The dialler's answer to the HelloAck: its proof, then what a same-host link needs. On a TCP
// channel `hint` is sent only with kHelloSameHost and `gen_addr` is always 0.
struct ClientAuth {
  uint8_t proof[kProofBytes] = {0};
  HostHint hint;
  uint64_t gen_addr = 0;  // address of the dialler's published registry words (engine/registry.h)
};
constexpr size_t kClientAuthBytes = kProofBytes + 16 + 8 + 8;
std::string encode(const ClientAuth& a);
Status decode(const uint8_t* p, size_t n, ClientAuth* out);

// The acceptor's verdict. `redirect` (FORWARD TCP channels only): the AF_UNIX abstract name to
// reconnect to for a same-host link; the acceptor closes this connection. `gen_addr`: as in
// ClientAuth, non-zero only on AF_UNIX channels. `flags`: kAuthPayloadIntegrity when the acceptor
// wants payload integrity. `tag` (with a secret; zeros without): HMAC-SHA256 under the channel's
// session key over status, flags, gen_addr and redirect, truncated to 16 bytes, so the dialler
// knows the verdict, the redirect and the address come from the prover, unaltered.
constexpr uint8_t kAuthPayloadIntegrity = 1;
struct AuthResult {
  uint32_t status = 0;
  std::string message;
  std::string redirect;
  uint64_t gen_addr = 0;
  uint8_t flags = 0;
  uint8_t tag[16] = {0};
};
constexpr size_t kAuthResultFixedBytes = 22 + 1 + 16;
std::string encode(const AuthResult& r);
// Decodes the fixed part; the message (bounded) then the redirect name (bounded) follow.
Status decodeFixed(const uint8_t* p, size_t n, AuthResult* out, uint32_t* message_len, uint16_t* redirect_len);

enum class Op : uint8_t {
  kRead = 1,      // serve bytes of a registered cache       -> Response + payload
  kWrite = 2,     // payload follows; store into a cache       -> Response
  kCommit = 3,    // a read by request key completed: release  (no response)
  kUnlink = 4,    // the peer tears the link down              -> Response
  kPing = 5,      // liveness check (check_link_status)          -> Response
  kDescribe = 6,  // a kBlocks target's layout for direct reads (same-host) -> Response + CacheDescriptor
  kRelease = 7,   // a direct (kFlagDirect) access finished     (no response)
  // 8 and 10 were v4's kDeviceChannel and kUcxConnect: since v5 every path's setup is kPathConnect,
  // and a frame with either op is malformed, as is any op not listed here (isOp).
  kNotify = 9,        // body: a NotifyBody, queued for the application (Engine::notifications) -> Response
  kConfirm = 11,      // body: a Nonce and an endpoint (<= 64 bytes); "did you dial the link to me
                      // whose hello had it, from there?" -> Response
  kPathConnect = 12,  // body: a path-connect header naming a path, then that path's setup body
                      // (below) -> that path's answer
  kHandoff = 13,      // body: a HandoffBody (a KV handoff's abort or hold, engine/offers.h) -> Response
};
constexpr uint8_t kMaxOp = 13;
// Whether `op` is an op of this version (the decoder drops a frame with any other).
bool isOp(uint8_t op);

// kPathConnect: the peer sets one path up on this link (its DataPath::connect); the path answers for
// itself (transport/path_table.h, PathEntry::answer). Its body starts with a fixed header of
// kPathConnectHeaderBytes: `u8 path`, the PathCaps::request_flags of the path's table entry (the
// flags its requests carry, so one id names a path on the wire in every frame). The rest is that
// path's own setup body, at most its PathEntry::max_connect_body bytes: a device channel's
// rendezvous and options byte (path kFlagDevice: the HCCL entry, which the one-sided path shares),
// a UcxHello (path kFlagUcx). The serving side reads the header before the rest and drops the link
// when it names no path with a setup frame, or when the rest is past that path's bound
// (engine/request_server.h, readRequest); a path that cannot be set up on this engine refuses it,
// answered, the link kept.
constexpr uint32_t kPathConnectHeaderBytes = 1;
// The body of a kPathConnect frame: the header naming `path`, then `setup` (the path's own body).
std::string pathConnectBody(uint8_t path, const std::string& setup);

// kRead/kWrite with kFlagDirect (same-host links only): the server checks the access as usual but
// answers with a DirectAnswer (the absolute address of every piece, and its pin epoch) instead of
// moving bytes; the requester copies them itself with process_vm_readv/writev and the server keeps
// the caches alive until the next frame (or until the pin expires: the requester re-reads the pin
// epoch after its copy, see engine/registry.h).
constexpr uint8_t kFlagDirect = 1;
// kRead/kWrite with kFlagDevice: checked as usual; the bytes then move over the link's device
// channel for this direction (Backend::DeviceChannel) instead of this stream. kRead: Response, then
// the server sends. kWrite: Response (accepted), the requester sends, then a second Response
// (stored). Set only for DEVICE-placement caches of a backend with device transport.
constexpr uint8_t kFlagDevice = 2;
// Both flags: same-host IPC. The server checks the access, exports each addressed tensor's span
// [first run's offset, last run's end) (Backend::exportMemory) and answers with an IpcAnswer: one
// 64-byte key and the span's length per tensor. The requester checks each span against the one it
// computes from its own request, maps the keys and copies device to device itself (offsets inside
// a span are its own runs', never the server's), then sends kCommit/kRelease, at which the server
// closes the exports and unpins.
// kFlagDevice | kFlagOneSided: HCCL one-sided access. The server checks the access as usual and,
// when every addressed range lies in memory it prepared on the link's device channel, answers with
// one u64 absolute address per piece and keeps the caches alive until the next frame; the requester
// reads or writes them with HcclBatchGet/Put, then sends kCommit/kRelease. Otherwise it
// refuses with kFeatureNotEnabled and the requester uses the two-sided transfer.
constexpr uint8_t kFlagOneSided = 4;
// kRead/kWrite with kFlagUcx (alone; engines with the ucx path, host memory only): checked as
// usual; the bytes then move as UCX Active Messages between the endpoints the ucx path's
// kPathConnect set up (transport/ucx/ucx_path.h). kRead: the server sends the messages, then the
// Response. kWrite: Response (accepted), the requester sends the messages, then a second Response
// (stored).
constexpr uint8_t kFlagUcx = 8;
// kRead/kWrite with kFlagTestPath (alone): the path of a test build (csrc/tests/pipe_path.h). An
// engine whose path table has no such path drops a link that sends it as malformed, as decode drops
// every other combination no path names (RequestServer::admitHeader).
constexpr uint8_t kFlagTestPath = 16;
constexpr uint8_t kKnownFlags = kFlagDirect | kFlagDevice | kFlagOneSided | kFlagUcx | kFlagTestPath;
// The split mark (since v7, bit 32 of the flags byte; decoded into RequestHeader::split, never part
// of `flags`, so it names no path): on a plain read (flags 0), "one chunk of a pull split over the
// link's streams" (transport/tcp/stream_path.h); on a kRelease (flags 0, sent on the channel once
// every chunk was answered), "that split pull is over". The serving side keeps at most one split
// pull open per link, counted in flight from its first admitted chunk to that kRelease (or the
// link's end): while a role switch drains, a chunk of the open pull is admitted and any other
// request refused (engine/request_server.h). On any other frame the bit is malformed.
constexpr uint8_t kMarkSplit = 32;
// The ucx path's kPathConnect setup body and its answer (a UcxHello): the token the sender's
// expected messages carry, the size of
// the link's messages (chunk_bytes: 0 in the request, the server's choice in the answer, both
// directions use it; else a power of two in [kMinUcxChunkBytes, kMaxUcxChunkBytes]), then the
// sender's UCX worker address (opaque bytes, at most kMaxUcxAddressBytes).
constexpr uint32_t kMaxUcxAddressBytes = 4096;
constexpr uint32_t kMinUcxChunkBytes = 16 * 1024;
constexpr uint32_t kMaxUcxChunkBytes = 1024 * 1024;
constexpr uint32_t kMaxUcxHelloBytes = 12 + kMaxUcxAddressBytes;
struct UcxHello {
  uint64_t token = 0;
  uint32_t chunk_bytes = 0;
  std::string address;
};
std::string encode(const UcxHello& h);
Status decode(const uint8_t* p, size_t n, UcxHello* out);
// The device channel's kPathConnect setup body (path kFlagDevice): the rendezvous, then one byte of channel options;
// the response carries one byte, the options the server agreed to. Both then join; with kChannelOneSided agreed both
// prepare.
constexpr uint8_t kChannelOneSided = 1;
// The epoch fence (since v7; a u32 since v8): a request's `epoch_tag` is 0 (unfenced) or
// 1 + (epoch % 0xFFFFFFFF) of the serving engine's role epoch the requester prepared against (a
// prepared transfer binds it from the first answer it gets: PreparedTransfer::epoch_tag); a server
// whose own tag differs refuses a read, write or describe carrying it with kStaleEpoch (nothing moved;
// a write's payload is consumed, as with other refusals; the link stays). Other frames' tags are not
// checked. Every response carries the server's current tag. Any value is well-formed: a hostile tag
// gets a refusal, nothing else. A tag repeats only after 2^32 - 1 committed switches (v7's u16 tag
// after 65535: a transfer prepared at epoch e was accepted again at e + 65535).
constexpr uint32_t kEpochTagPeriod = 0xFFFFFFFF;
constexpr uint32_t epochTagOf(uint64_t epoch) { return static_cast<uint32_t>(1 + epoch % kEpochTagPeriod); }
// Layout (24 bytes since v8; 20 in v7 with a u16 tag at offset 6): magic u32, op u8, flags u8, u16 zero
// (a decoder refuses anything else as malformed), epoch_tag u32 (offset 8), body_len u32, payload_len u64.
struct RequestHeader {
  Op op = Op::kRead;
  uint32_t body_len = 0;  // at most kMaxBodyBytes
  uint64_t payload_len = 0;
  uint8_t flags = 0;       // a combination above; which ones a link accepts: RequestServer::admit
  uint32_t epoch_tag = 0;  // the epoch fence above; 0: unfenced
  bool split = false;      // kMarkSplit (encoded in the flags byte)
};
constexpr size_t kRequestHeaderBytes = 24;
std::string encode(const RequestHeader& h);
Status decode(const uint8_t* p, size_t n, RequestHeader* out);
// What every decoder answers for a frame it refuses: kLinkFailed, "malformed <what> frame from peer".
Status malformed(const char* what);

// Layout (24 bytes since v7, 20 before): magic u32, status u32, message_len u32, payload_len u64,
// epoch_tag u32 (offset 20; the server's current tag; 0 from a side that serves no engine; in v7 a
// u16 tag then a u16 zero).
struct ResponseHeader {
  uint32_t status = 0;
  uint32_t message_len = 0;
  uint64_t payload_len = 0;
  uint32_t epoch_tag = 0;
};
constexpr size_t kResponseHeaderBytes = 24;
std::string encode(const ResponseHeader& h);
Status decode(const uint8_t* p, size_t n, ResponseHeader* out);

// How the serving side finds the cache a transfer addresses.
enum class TargetKind : uint8_t {
  kRequestKey = 1,  // (req_id, model_id) -> (cache, slot)
  kPrefixKey = 2,   // (prefix_id, model_id) -> (cache, slot)
  kIdIndex = 3,     // (cache_id, batch_index) -> (cache, slot)
  kBlocks = 4,      // model_id -> blocks cache; offsets are from the tensor start
  kRaw = 5,         // run offsets are absolute addresses inside any registered tensor (one tensor)
  // A KV handoff's offer (engine/offers.h): model_id = the offered region's key, req_id = the offer
  // id, prefix_id = its generation; offsets are from the tensor start, as kBlocks'. Reads only (a
  // write is refused), each run inside the offer's blocks, from the offer's bound link; a kCommit
  // through it releases the offer (claimed). Never read through cma's cached layout.
  kOffer = 6,
};

struct Target {
  TargetKind kind = TargetKind::kBlocks;
  uint64_t model_id = 0;
  uint64_t req_id = 0;
  uint64_t prefix_id = 0;
  int64_t cache_id = 0;
  uint64_t batch_index = 0;
  std::string describe() const;
};

// One contiguous byte range, relative to the target's base (the slot for key targets, the tensor
// start for kBlocks).
struct Run {
  uint64_t offset;
  uint64_t length;
};

// `count` runs of `length` bytes, each `stride` bytes after the previous (stride 0: the same bytes
// again), the first at `offset`: how runs in arithmetic progression go on the wire (since v10).
struct Row {
  uint64_t offset;
  uint64_t length;
  uint64_t stride;
  uint64_t count;
  // One past the last byte of the last run, for count >= 1 (decode refuses a row of no run, and
  // one where this wraps).
  uint64_t end() const { return offset + stride * (count - 1) + length; }
};
// `runs` as rows: each maximal stretch of runs of one length whose offsets step by one stride
// (forward or 0) is one row. Exactly the runs again when expanded, in order.
std::vector<Row> rowsOf(const std::vector<Run>& runs);

// The body of kRead, kWrite and kCommit. The same runs apply to every listed tensor; the payload is
// tensor-major: for each tensor in `tensors`, for each run, `length` bytes.
//
// Layout: target kind u8, model_id, req_id, prefix_id u64, cache_id i64, batch_index u64,
// block_size u64, tensor count u32 and the u32 tensors, then a u32 whose top bit (kRowsMark, since
// v10) says how the runs follow: clear, that many (offset, length) u64 pairs; set, its other bits
// count rows (offset, length, stride, count) u64 each. encode() sends rows when they take fewer
// bytes (rowsOf). decode() expands rows into `runs`, after checking that each has a run and does
// not wrap and that every run of the body fits the piece limit, and keeps them in `rows` for the
// server's checks, which take a row's span [offset, end()) at once (engine/registry.h).
constexpr uint32_t kRowsMark = 0x80000000u;
struct TransferBody {
  Target target;
  uint64_t block_size = 0;  // kBlocks: the requester's block size, must equal the server's stride
  std::vector<uint32_t> tensors;
  std::vector<Run> runs;
  std::vector<Row> rows;  // set by decode when the body came as rows (runs holds their runs); never sent
  // Total payload bytes, or an error if the descriptor would overflow 64 bits.
  Result<uint64_t> payloadBytes() const;
  // tensors x runs: the byte ranges this body names (limits::kMaxRequestPieces at most).
  uint64_t pieces() const { return uint64_t{tensors.size()} * runs.size(); }
};
std::string encode(const TransferBody& b);
// Rejects more than limits::kMaxRequestTensors tensors or kMaxRequestPieces pieces before
// allocating for them.
Status decode(const uint8_t* p, size_t n, TransferBody* out);

// kDescribe answer (same-host links only): everything a requester needs to read a blocks cache
// directly, valid while the server's registry generation stays `generation`. At most
// limits::kMaxRequestTensors addresses.
struct CacheDescriptor {
  uint64_t generation = 0;
  uint64_t tensor_size = 0;
  uint64_t stride = 0;
  std::vector<uint64_t> addrs;
};
std::string encode(const CacheDescriptor& d);
Status decode(const uint8_t* p, size_t n, CacheDescriptor* out);
// The largest encoded CacheDescriptor: what a requester reads at most for one.
constexpr uint64_t kMaxDescriptorBytes = 28 + 8 * uint64_t{limits::kMaxRequestTensors};

// kDescribe answer for a kRaw target (same-host links only): every range of registered memory the
// server's peers may read, sorted by address (ranges may overlap: memory can be registered twice),
// valid while the server's registry generation stays `generation`. At most limits::kMaxRequestTensors
// ranges, each non-empty and not wrapping.
struct RawTable {
  uint64_t generation = 0;
  std::vector<Run> ranges;  // offset: the range's address
};
std::string encode(const RawTable& t);
Status decode(const uint8_t* p, size_t n, RawTable* out);
// The largest encoded RawTable: what a requester reads at most for one.
constexpr uint64_t kMaxRawTableBytes = 12 + 16 * uint64_t{limits::kMaxRequestTensors};

// Answers a requester decodes against what it asked: each decoder takes the count it expects and
// fails (kLinkFailed, "malformed ... answer") on any other size or any value out of bounds.
//
// kFlagDirect: the pin epoch and the address of the word that holds it (the serving link's,
// engine/pin_epochs.h), then (address, length) per piece, tensor-major.
struct DirectAnswer {
  uint64_t pin_epoch = 0;
  uint64_t epoch_addr = 0;
  std::vector<uint64_t> addrs;
  std::vector<uint64_t> lengths;
};
std::string encode(const DirectAnswer& a);
uint64_t directAnswerBytes(uint64_t pieces);
Status decode(const uint8_t* p, size_t n, uint64_t expected_pieces, DirectAnswer* out);
// kFlagDevice|kFlagOneSided: one address per piece, tensor-major.
Status decodeAddresses(const uint8_t* p, size_t n, uint64_t expected, std::vector<uint64_t>* out);
// kFlagDevice|kFlagDirect: per tensor a key (NUL-padded to limits::kIpcKeyBytes; at least one
// non-NUL byte) and the exported span's length.
struct IpcAnswer {
  std::vector<std::string> keys;
  std::vector<uint64_t> spans;
};
constexpr size_t kIpcEntryBytes = limits::kIpcKeyBytes + 8;
std::string encode(const IpcAnswer& a);
Status decode(const uint8_t* p, size_t n, uint64_t expected_tensors, IpcAnswer* out);

// kNotify body: u32 name length, the name, then the message (the rest of the body). The name is at
// most limits::kMaxNotifyNameBytes, the message limits::kMaxNotifyMessageBytes; both are bytes.
struct NotifyBody {
  std::string name;
  std::string message;
};
constexpr uint32_t kMaxNotifyBodyBytes = 4 + limits::kMaxNotifyNameBytes + limits::kMaxNotifyMessageBytes;
std::string encode(const NotifyBody& b);
// kLinkFailed for a short body or a field past its bound.
Status decode(const uint8_t* p, size_t n, NotifyBody* out);

// kHandoff body: u8 kind, then
//   kAbort: u16 length + request id (<= limits::kMaxHandoffRequestIdBytes), u16 length + reason
//           (<= limits::kMaxHandoffReasonBytes): "release your offers of that request id, and fail
//           my claims of it";
//   kHold:  u32 n (<= limits::kMaxHoldOffers), then n x (offer id u64, generation u64): "extend
//           these offers' leases and bind them to this link".
// Nothing else may follow. A decoder drops the link on anything else (kLinkFailed), and on a request
// id or reason that is not well-formed UTF-8 (isUtf8: they reach the application as text).
struct HandoffBody {
  enum Kind : uint8_t { kAbort = 1, kHold = 2 };
  Kind kind = kAbort;
  std::string request_id;
  std::string reason;
  std::vector<std::pair<uint64_t, uint64_t>> offers;  // kHold: (offer id, generation)
};
constexpr uint32_t kMaxHandoffBodyBytes = 5 + 16 * limits::kMaxHoldOffers;
std::string encode(const HandoffBody& b);
Status decode(const uint8_t* p, size_t n, HandoffBody* out);
// Whether [p, p + n) is well-formed UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing past
// U+10FFFF). NUL is a character like any other.
bool isUtf8(const char* p, size_t n);

}  // namespace pdlink::wire
