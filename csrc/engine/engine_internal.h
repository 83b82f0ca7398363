// Internal helpers shared by the engine's source files (engine.cc, links.cc, data_path.cc).
// Not part of the engine's interface; nothing outside csrc/engine includes this.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "core/sha256.h"
#include "core/status.h"
#include "engine/engine.h"
#include "engine/link.h"
#include "transport/socket.h"
#include "transport/wire.h"

namespace pdlink::detail {

constexpr size_t kMaxPeersPerCall = 16;
constexpr size_t kMaxHandshakes = 64;  // connections mid-handshake; more are dropped (flood guard)
constexpr size_t kIovBatch = 1024;     // iovecs per sendmsg/recvmsg

std::string clusterName(uint64_t id);
// A random 64-bit value pairing the two channels of one link attempt.
uint64_t makeNonce();
void randomBytes(uint8_t* out, size_t n);
// The proof of one side of a channel handshake (see links.cc); all zeros without a secret.
Digest linkProof(const std::string& secret, char role, const uint8_t* client_challenge,
                 const uint8_t* server_challenge, uint64_t client_id, uint64_t server_id, uint64_t nonce,
                 uint8_t channel);
wire::HostIdentity localIdentity();
// kLinkFailed naming the broken link's reason and what to do about it.
Status linkDown(const Link& link);
// Whether a completed pull through this target must release a request key on the peer.
bool usesKeyCommit(wire::TargetKind kind);
// A response header plus its message text.
Status sendResponse(Socket& s, const Status& st, Deadline deadline);
// Reads a response header, and its message text when the status is an error.
Status readResponse(Socket& s, Deadline deadline, wire::ResponseHeader* h, Status* remote);
// Moves the payload of one transfer between a socket and memory, tensor-major, batching iovecs.
Status movePayload(Socket& s, bool sending, const std::vector<uint64_t>& addrs, const std::vector<uint32_t>& tensors,
                   uint64_t base, const std::vector<wire::Run>& runs, Deadline deadline, std::vector<iovec> iov = {});
Status linkError(const PeerAddress& peer, const Status& st);
// Client half of a channel handshake (links.cc).
Status helloExchange(Socket& s, wire::Hello hello, const std::string& secret, uint64_t* peer_id,
                     wire::HostIdentity* peer_identity, Deadline deadline);

}  // namespace pdlink::detail

namespace pdlink {

// Byte runs for both sides of one transfer (data_path.cc).
struct Engine::Plan {
  std::shared_ptr<CacheEntry> local;
  std::vector<uint32_t> local_tensors;
  std::vector<wire::Run> local_runs;
  wire::TransferBody remote;  // target, block size, remote tensors and runs
  uint64_t payload = 0;
};

}  // namespace pdlink
