// The pdlink wire protocol (version 1), spoken over each TCP channel of a link.
//
// A link is two TCP connections opened by the initiator to the acceptor's listener:
//   FORWARD: the initiator sends requests, the acceptor serves them;
//   REVERSE: the acceptor sends requests, the initiator serves them.
// So each side has one channel it requests on and one it serves on, and a transfer is one-sided:
// the serving side answers from a C++ thread without any Python involvement.
//
// Every connection starts with a Hello from the initiator and a HelloAck from the acceptor. After
// that, frames are a fixed RequestHeader (+ body + payload) answered by a ResponseHeader
// (+ message + payload). All integers are little-endian. Nothing read off the wire is trusted:
// decoders bound every length and count before using it, and the serving side checks every
// access against the caches it has registered (engine/registry.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace pdlink::wire {

constexpr uint32_t kHelloMagic = 0x4B4C4450;     // "PDLK"
constexpr uint32_t kAckMagic = 0x414C4450;       // "PDLA"
constexpr uint32_t kRequestMagic = 0x514C4450;   // "PDLQ"
constexpr uint32_t kResponseMagic = 0x534C4450;  // "PDLS"
constexpr uint16_t kProtocolVersion = 2;
constexpr uint64_t kAnyCluster = UINT64_MAX;  // Hello.expected_peer when the dialler does not know it

constexpr uint32_t kMaxBodyBytes = 64u << 20;   // request descriptors (block runs etc.)
constexpr uint32_t kMaxMessageBytes = 64u << 10;  // error text in responses and acks

enum class Channel : uint8_t { kForward = 0, kReverse = 1 };

// Who an endpoint is on its host: lets two ends of a link find out that they share one and can
// copy memory directly (cross-memory attach) instead of streaming it through a socket.
struct HostIdentity {
  uint8_t boot_id[16] = {0};  // /proc/sys/kernel/random/boot_id
  uint64_t pid_ns = 0;        // inode of /proc/self/ns/pid
  uint32_t pid = 0;
  uint32_t transports = 0;    // kTransportCma: this end accepts direct memory access
  uint64_t gen_addr = 0;      // address of the registry generation counter (see engine/registry.h)
  bool sameHost(const HostIdentity& o) const;
};
constexpr uint32_t kTransportCma = 1;
constexpr size_t kIdentityBytes = 40;

// Link authentication (challenge-response). Each side sends a fresh random challenge; each proves
// it knows the shared link secret with HMAC-SHA256 over both challenges and the link's identity
// (engine.cc linkProof). No secret ever crosses the wire. Without a secret a proof is all zeros,
// which a side that has a secret rejects.
constexpr size_t kChallengeBytes = 16;
constexpr size_t kProofBytes = 32;

struct Hello {
  uint16_t version = kProtocolVersion;
  Channel channel = Channel::kForward;
  uint8_t flags = 0;
  uint64_t cluster_id = 0;     // the sender's own cluster id
  uint64_t expected_peer = 0;  // the cluster id the sender believes it is dialling
  uint64_t nonce = 0;          // pairs the FORWARD and REVERSE channels of one link
  HostIdentity identity;
  uint8_t challenge[kChallengeBytes] = {0};
};
// The first 32 bytes keep one layout in every version (magic, version, ...), so a peer of another
// version is recognised and told so; version 2 appends the identity and the challenge.
constexpr size_t kHelloPrefixBytes = 32;
constexpr size_t kHelloRestBytes = kIdentityBytes + kChallengeBytes;
constexpr size_t kHelloBytes = kHelloPrefixBytes + kHelloRestBytes;
std::string encode(const Hello& h);
// Decodes the 32-byte prefix. Rejects a wrong magic (garbage) with kLinkFailed; a version mismatch
// is reported by the caller.
Status decodePrefix(const uint8_t* p, size_t n, Hello* out);
Status decodeIdentity(const uint8_t* p, size_t n, HostIdentity* out);
// Decodes the part after the prefix (identity and challenge).
Status decodeRest(const uint8_t* p, size_t n, Hello* out);

struct HelloAck {
  uint16_t version = kProtocolVersion;
  uint32_t status = 0;  // an LLMStatusCode value
  uint64_t cluster_id = 0;
  HostIdentity identity;
  uint8_t challenge[kChallengeBytes] = {0};
  uint8_t proof[kProofBytes] = {0};  // the acceptor's proof (see above)
  std::string message;
};
constexpr size_t kHelloAckFixedBytes = 22 + kIdentityBytes + kChallengeBytes + kProofBytes;
std::string encode(const HelloAck& a);
// Decodes the fixed part; `message_len` tells how many message bytes follow.
Status decodeFixed(const uint8_t* p, size_t n, HelloAck* out, uint32_t* message_len);

// After the HelloAck the dialler sends its proof (kProofBytes raw) and the acceptor answers with
// an AuthResult; only then is the channel part of a link.
constexpr uint32_t kAuthMagic = 0x524C4450;  // "PDLR"
constexpr size_t kAuthResultFixedBytes = 12;
struct AuthResult {
  uint32_t status = 0;
  std::string message;
};
std::string encode(const AuthResult& r);
Status decodeFixed(const uint8_t* p, size_t n, AuthResult* out, uint32_t* message_len);

enum class Op : uint8_t {
  kRead = 1,    // serve bytes of a registered cache       -> Response + payload
  kWrite = 2,   // payload follows; store into a cache       -> Response
  kCommit = 3,  // a read by request key completed: release  (no response)
  kUnlink = 4,  // the peer tears the link down              -> Response
  kPing = 5,    // liveness check (check_link_status)          -> Response
  kDescribe = 6,  // a kBlocks target's layout for direct reads  -> Response + CacheDescriptor
  kRelease = 7,   // a direct (kFlagDirect) access finished     (no response)
  kDeviceChannel = 8,  // body: a backend rendezvous; both sides join a device channel -> Response
};
constexpr uint8_t kMaxOp = 8;

// kRead/kWrite with kFlagDirect: the server checks the access as usual but answers with the
// absolute addresses (AddressList) instead of moving bytes; the requester then copies them itself
// with process_vm_readv/writev, and the server keeps the caches alive until the next frame.
constexpr uint8_t kFlagDirect = 1;
// kRead/kWrite with kFlagDevice: checked as usual; the bytes then move over the link's device
// channel for this direction (Backend::DeviceChannel) instead of this stream. kRead: Response, then
// the server sends. kWrite: Response (accepted), the requester sends, then a second Response
// (stored). Set only for DEVICE-placement caches of a backend with device transport.
constexpr uint8_t kFlagDevice = 2;
// Both flags: same-host IPC. The server checks the access, exports each addressed tensor's span
// (Backend::exportMemory) and answers with one 64-byte key per tensor, then one u64 offset into
// that span per (tensor, run); the requester maps the keys and copies device to device itself,
// then sends kCommit/kRelease, at which the server closes the exports and unpins.
// kFlagDevice | kFlagOneSided: HCCL one-sided access. The server checks the access as usual and,
// when every addressed range lies in memory it prepared on the link's device channel, answers with
// one u64 absolute address per (tensor, run) and keeps the caches alive until the next frame; the
// requester reads or writes them with HcclBatchGet/Put, then sends kCommit/kRelease. Otherwise it
// refuses with kFeatureNotEnabled and the requester uses the two-sided transfer.
constexpr uint8_t kFlagOneSided = 4;
constexpr uint8_t kKnownFlags = kFlagDirect | kFlagDevice | kFlagOneSided;
// kDeviceChannel body: the rendezvous, then one byte of channel options; the response carries one
// byte, the options the server agreed to. Both then join; with kChannelOneSided agreed both prepare.
constexpr uint8_t kChannelOneSided = 1;
struct RequestHeader {
  Op op = Op::kRead;
  uint32_t body_len = 0;
  uint64_t payload_len = 0;
  uint8_t flags = 0;  // kFlagDirect or kFlagDevice
};
constexpr size_t kRequestHeaderBytes = 20;
std::string encode(const RequestHeader& h);
Status decode(const uint8_t* p, size_t n, RequestHeader* out);

struct ResponseHeader {
  uint32_t status = 0;
  uint32_t message_len = 0;
  uint64_t payload_len = 0;
};
constexpr size_t kResponseHeaderBytes = 20;
std::string encode(const ResponseHeader& h);
Status decode(const uint8_t* p, size_t n, ResponseHeader* out);

// How the serving side finds the cache a transfer addresses.
enum class TargetKind : uint8_t {
  kRequestKey = 1,  // (req_id, model_id) -> (cache, slot)
  kPrefixKey = 2,   // (prefix_id, model_id) -> (cache, slot)
  kIdIndex = 3,     // (cache_id, batch_index) -> (cache, slot)
  kBlocks = 4,      // model_id -> blocks cache; offsets are from the tensor start
  kRaw = 5,         // run offsets are absolute addresses inside any registered tensor (one tensor)
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

// The body of kRead, kWrite and kCommit. The same runs apply to every listed tensor; the payload is
// tensor-major: for each tensor in `tensors`, for each run, `length` bytes.
struct TransferBody {
  Target target;
  uint64_t block_size = 0;  // kBlocks: the requester's block size, must equal the server's stride
  std::vector<uint32_t> tensors;
  std::vector<Run> runs;
  // Total payload bytes, or an error if the descriptor would overflow 64 bits.
  Result<uint64_t> payloadBytes() const;
};
std::string encode(const TransferBody& b);
Status decode(const uint8_t* p, size_t n, TransferBody* out);

// kDescribe answer: everything a requester needs to read a blocks cache directly, valid while the
// server's registry generation stays `generation`.
struct CacheDescriptor {
  uint64_t generation = 0;
  uint64_t tensor_size = 0;
  uint64_t stride = 0;
  std::vector<uint64_t> addrs;
};
std::string encode(const CacheDescriptor& d);
Status decode(const uint8_t* p, size_t n, CacheDescriptor* out);

}  // namespace pdlink::wire
