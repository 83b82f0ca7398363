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
constexpr size_t kIovBatch = 1024;     // iovecs per sendmsg/recvmsg

std::string clusterName(uint64_t id);
// A random 64-bit value pairing the two channels of one link attempt.
uint64_t makeNonce();
void randomBytes(uint8_t* out, size_t n);
// The proof of one side of a channel handshake (see links.cc); all zeros without a secret.
Digest linkProof(const std::string& secret, char role, const uint8_t* client_challenge,
                 const uint8_t* server_challenge, uint64_t client_id, uint64_t server_id, uint64_t nonce,
                 uint8_t channel);
// Where this process runs (a hint for same-host redirects, never a proof).
wire::HostHint localHint();
// kLinkFailed naming the broken link's reason and what to do about it.
Status linkDown(const Link& link);
Status linkDown(uint64_t peer, const std::string& reason);
// How long a probe of a link that a newcomer wants to take over may wait for the peer's answer.
constexpr int64_t kProbeTimeoutMs = 500;
// The byte range of a tensor an IPC access exports: from the first run's offset to the last
// run's end (both sides compute it from the same runs).
struct IpcSpan {
  uint64_t lo = 0, length = 0;
};
IpcSpan ipcSpan(const std::vector<wire::Run>& runs);
// The requester's check of an IPC answer: every span the server states is exactly the one this side
// computes from its own request (remote_runs). kLinkFailed otherwise.
Status checkIpcAnswer(const wire::IpcAnswer& answer, const std::vector<wire::Run>& remote_runs);
// The copies of an IPC transfer, once checkIpcAnswer passed and the keys were mapped at
// `remote_bases`: run j of tensor i lies at remote_bases[i] + (remote run j's offset - span start),
// inside the mapped span by construction. Offsets come from this side's own runs only.
std::vector<DeviceCopy> ipcCopies(const std::vector<uint64_t>& local_bases, const std::vector<wire::Run>& local_runs,
                                  const std::vector<uint64_t>& remote_bases, const std::vector<wire::Run>& remote_runs,
                                  bool is_push);
// Bodies of kDeviceChannel requests: an HCCL root info (4108 bytes) and one byte of options.
constexpr uint32_t kMaxRendezvousBytes = 8192;
// Whether a completed pull through this target must release a request key on the peer.
bool usesKeyCommit(wire::TargetKind kind);
// A response header plus its message text.
Status sendResponse(Stream& s, const Status& st, Deadline deadline);
// Reads a response header, and its message text (bounded) when the status is an error. A
// malformed header (text on success, payload on an error) is kLinkFailed.
Status readResponse(Stream& s, Deadline deadline, wire::ResponseHeader* h, Status* remote);
// Moves the payload of one transfer between a stream and memory, tensor-major, batching iovecs.
Status movePayload(Stream& s, bool sending, const std::vector<uint64_t>& addrs, const std::vector<uint32_t>& tensors,
                   uint64_t base, const std::vector<wire::Run>& runs, Deadline deadline, std::vector<iovec> iov = {});
Status linkError(const PeerAddress& peer, const Status& st);
// Client half of one channel's handshake (engine_helpers.cc).
Status helloExchange(Socket& s, wire::Hello hello, const std::string& secret, const wire::ClientAuth& mine,
                     uint64_t* peer_id, wire::AuthResult* result, Deadline deadline);

}  // namespace pdlink::detail

namespace pdlink {

// Byte runs for both sides of one transfer (data_path.cc).
struct Engine::Plan {
  std::shared_ptr<CacheEntry> local;
  std::vector<uint32_t> local_tensors;
  std::vector<wire::Run> local_runs;
  wire::TransferBody remote;  // target, block size, remote tensors and runs
  uint64_t payload = 0;
  // The last request of the transfer: only it commits a pulled request key. A transfer of more
  // than limits::kMaxRequestPieces pieces is split into several requests (Engine::transfer).
  bool commit = true;
};

}  // namespace pdlink
