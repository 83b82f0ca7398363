// Internal helpers shared by the engine's source files (engine.cc, links.cc, data_path.cc).
// Not part of the engine's interface; nothing outside csrc/engine includes this.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "core/crypto.h"
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
// The handshake transcript of one channel, as both sides see it (transport/wire.h): the Hello
// frame as sent, the acceptor's cluster id and challenge; then what ClientAuth says besides its
// proof; then the channel kind and the verdict. Proofs and the session key cover it.
class Transcript {
 public:
  void addHello(const std::string& hello_frame, uint64_t server_id, const uint8_t* server_challenge);
  void addClientAuth(const wire::ClientAuth& auth);
  void addVerdict(bool unix_channel, const wire::AuthResult& result);
  const std::string& bytes() const { return bytes_; }

 private:
  void add(const void* data, size_t len);
  template <class T>
  void add(T v) {
    add(&v, sizeof(v));
  }
  std::string bytes_;
};
// The proof of one side ('S' acceptor, after addHello; 'C' dialler, after addClientAuth); all zeros
// without a secret. Fails only when libcrypto is unusable.
Result<Digest> handshakeProof(const std::string& secret, char role, const Transcript& t);
// An authenticated channel's session (after addVerdict): its key (transport/auth_stream.h) and the
// AuthResult's tag under it. Without a secret: no key, zero tag.
struct Session {
  std::shared_ptr<const crypto::Key> key;
  uint8_t verdict_tag[16] = {0};
  bool integrity = false;  // payload integrity was agreed (AuthResult flags)
};
Result<Session> deriveSession(const std::string& secret, const Transcript& t);
// kLinkFailed (kFeatureNotEnabled when libcrypto is missing) for a handshake that could not be
// computed.
Status sessionFailed(const Status& why);
// kLinkFailed naming both protocol versions and what to do.
Status versionMismatch(uint16_t peer_version);
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
// A response header plus its message text, as one frame.
Status sendResponse(Stream& s, const Status& st, Deadline deadline);
// A successful response that carries an answer (a descriptor, addresses, IPC keys, options): the
// header, then the answer as a frame of its own.
Status sendAnswer(Stream& s, const std::string& answer, Deadline deadline);
// Reads a response header, and its message text (bounded) when the status is an error, and checks
// the frame. A malformed header (text on success, payload on an error) is kLinkFailed.
Status readResponse(Stream& s, Deadline deadline, wire::ResponseHeader* h, Status* remote);
// Reads the answer sendAnswer sent (`len` from its header, at most `max`) and checks its frame.
Status readAnswer(Stream& s, uint64_t len, uint64_t max, Deadline deadline, std::string* out, const char* what);
// Moves the payload of one transfer between a stream and memory, tensor-major, as a payload frame
// (Stream::payload: sealed or checked only with payload integrity). `frame` (sending only): the
// frame that precedes the payload (its header), sent in the same write when the stream has no tags.
Status movePayload(Stream& s, bool sending, const std::vector<uint64_t>& addrs, const std::vector<uint32_t>& tensors,
                   uint64_t base, const std::vector<wire::Run>& runs, Deadline deadline,
                   std::vector<iovec> frame = {});
// Reads and drops the payload of a refused write (checked like any payload frame).
Status discardPayload(Stream& s, uint64_t len, Deadline deadline);
Status linkError(const PeerAddress& peer, const Status& st);
// Client half of one channel's handshake (engine_helpers.cc).
Status helloExchange(Socket& s, wire::Hello hello, const std::string& secret, const wire::ClientAuth& mine,
                     uint64_t* peer_id, wire::AuthResult* result, Session* session, Deadline deadline);

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
