// Helpers shared by the engine's source files (declared in engine_internal.h).
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <random>

#include "core/limits.h"
#include "core/log.h"
#include "core/seeded_bug.h"
#include "engine/engine_internal.h"

namespace pdlink::detail {

uint64_t makeNonce() {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t seed = [] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd();
  }();
  return seed ^ (++counter * 0x9E3779B97F4A7C15ull);
}

std::string clusterName(uint64_t id) { return "cluster " + std::to_string(id); }

void randomBytes(uint8_t* out, size_t n) {
  while (n > 0) {
    ssize_t got = ::getrandom(out, n, 0);
    if (got <= 0) continue;  // EINTR; getrandom does not fail otherwise once the pool is ready
    out += got;
    n -= static_cast<size_t>(got);
  }
}

// The proof of one side of a channel: HMAC-SHA256(secret, label || role || both challenges ||
// both cluster ids || nonce || channel). Binding the ids, nonce and channel stops a proof from
// being replayed on another link or channel. Without a secret it is all zeros.
Digest linkProof(const std::string& secret, char role, const uint8_t* client_challenge,
                 const uint8_t* server_challenge, uint64_t client_id, uint64_t server_id, uint64_t nonce,
                 uint8_t channel) {
  Digest out{};
  if (secret.empty()) return out;
  std::string m = "pdlink-link-v2";
  m.push_back(role);
  m.append(reinterpret_cast<const char*>(client_challenge), wire::kChallengeBytes);
  m.append(reinterpret_cast<const char*>(server_challenge), wire::kChallengeBytes);
  m.append(reinterpret_cast<const char*>(&client_id), 8);
  m.append(reinterpret_cast<const char*>(&server_id), 8);
  m.append(reinterpret_cast<const char*>(&nonce), 8);
  m.push_back(static_cast<char>(channel));
  return hmacSha256(secret, m.data(), m.size());
}

wire::HostHint localHint() {
  wire::HostHint id;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char text[64] = {0};
    if (std::fgets(text, sizeof(text), f)) {
      // "xxxxxxxx-xxxx-..." -> 16 bytes
      int k = 0;
      for (int i = 0; text[i] && k < 32; ++i) {
        char c = text[i];
        int v = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
        if (v < 0) continue;
        id.boot_id[k / 2] = static_cast<uint8_t>(id.boot_id[k / 2] | (k % 2 == 0 ? v << 4 : v));
        ++k;
      }
    }
    std::fclose(f);
  }
  struct stat st{};
  if (::stat("/proc/self/ns/pid", &st) == 0) id.pid_ns = static_cast<uint64_t>(st.st_ino);
  return id;
}

Status linkDown(uint64_t peer, const std::string& reason) {
  return Status(Code::kLinkFailed, "the link to " + clusterName(peer) + " is down (" + reason +
                                       "); call unlink_clusters, then link_clusters again");
}

Status linkDown(const Link& link) { return linkDown(link.peer(), link.brokenReason()); }

IpcSpan ipcSpan(const std::vector<wire::Run>& runs) {
  uint64_t lo = UINT64_MAX, hi = 0;
  for (const wire::Run& run : runs) {
    lo = std::min(lo, run.offset);
    hi = std::max(hi, run.offset + run.length);  // runs were checked: no overflow
  }
  return runs.empty() ? IpcSpan{0, 0} : IpcSpan{lo, hi - lo};
}

Status checkIpcAnswer(const wire::IpcAnswer& answer, const std::vector<wire::Run>& remote_runs) {
  if constexpr (seeded::bug(seeded::kOffset)) return Status::OK();  // fuzz demonstration only
  const IpcSpan span = ipcSpan(remote_runs);
  for (uint64_t stated : answer.spans) {
    if (stated != span.length) return Status(Code::kLinkFailed, "peer exported an IPC span of the wrong size");
  }
  return Status::OK();
}

std::vector<DeviceCopy> ipcCopies(const std::vector<uint64_t>& local_bases, const std::vector<wire::Run>& local_runs,
                                  const std::vector<uint64_t>& remote_bases, const std::vector<wire::Run>& remote_runs,
                                  bool is_push) {
  const IpcSpan span = ipcSpan(remote_runs);
  std::vector<DeviceCopy> copies;
  copies.reserve(local_bases.size() * local_runs.size());
  for (size_t i = 0; i < local_bases.size(); ++i) {
    for (size_t j = 0; j < local_runs.size(); ++j) {
      const uint64_t local = local_bases[i] + local_runs[j].offset;
      const uint64_t remote = remote_bases[i] + (remote_runs[j].offset - span.lo);
      copies.push_back(is_push ? DeviceCopy{remote, local, local_runs[j].length}
                               : DeviceCopy{local, remote, local_runs[j].length});
    }
  }
  return copies;
}

bool usesKeyCommit(wire::TargetKind kind) {
  return kind == wire::TargetKind::kRequestKey || kind == wire::TargetKind::kIdIndex;
}

// Sends a response header plus its message text.
Status sendResponse(Stream& s, const Status& st, Deadline deadline) {
  std::string msg = st.message().substr(0, wire::kMaxMessageBytes);
  wire::ResponseHeader h{static_cast<uint32_t>(st.code()), static_cast<uint32_t>(msg.size()), 0};
  std::string frame = wire::encode(h) + msg;
  return s.sendAll(frame.data(), frame.size(), deadline);
}

// Reads a response header, and its message text when the status is an error.
Status readResponse(Stream& s, Deadline deadline, wire::ResponseHeader* h, Status* remote) {
  uint8_t buf[wire::kResponseHeaderBytes];
  PDLINK_RETURN_IF_ERROR(s.recvAll(buf, sizeof(buf), deadline));
  PDLINK_RETURN_IF_ERROR(wire::decode(buf, sizeof(buf), h));
  if (h->status == 0 && h->message_len != 0) return Status(Code::kLinkFailed, "malformed response (text on success)");
  std::string msg;
  PDLINK_RETURN_IF_ERROR(s.readBounded(h->message_len, wire::kMaxMessageBytes, deadline, &msg, "response text"));
  if (h->status != 0 && h->payload_len != 0) return Status(Code::kLinkFailed, "malformed response (payload on error)");
  *remote = h->status == 0 ? Status::OK() : Status(static_cast<Code>(h->status), msg);
  return Status::OK();
}

// Moves the payload of one transfer between a stream and memory, tensor-major, batching iovecs
// so that thousands of small blocks cost a few syscalls, not one each.
Status movePayload(Stream& s, bool sending, const std::vector<uint64_t>& addrs, const std::vector<uint32_t>& tensors,
                   uint64_t base, const std::vector<wire::Run>& runs, Deadline deadline, std::vector<iovec> iov) {
  for (uint32_t t : tensors) {
    for (const wire::Run& r : runs) {
      iov.push_back({reinterpret_cast<void*>(addrs[t] + base + r.offset), static_cast<size_t>(r.length)});
      if (iov.size() >= kIovBatch) {
        PDLINK_RETURN_IF_ERROR(sending ? s.sendv(iov, deadline) : s.recvv(iov, deadline));
        iov.clear();
      }
    }
  }
  if (!iov.empty()) PDLINK_RETURN_IF_ERROR(sending ? s.sendv(iov, deadline) : s.recvv(iov, deadline));
  return Status::OK();
}

Status linkError(const PeerAddress& peer, const Status& st) {
  Code code = st.code() == Code::kParamInvalid ? Code::kParamInvalid : Code::kLinkFailed;
  return Status(code, "cannot link to " + clusterName(peer.cluster_id) + " at " + peer.ip + ":" +
                          std::to_string(peer.port) + ": " + st.message());
}

// Client half of one channel's handshake (transport/wire.h): Hello out, HelloAck in (checking the
// endpoint's cluster id against *peer_id, or learning it when that is kAnyCluster), the acceptor's
// proof checked, ClientAuth out, AuthResult in. What ClientAuth carries beyond the proof (`mine`)
// goes out only once the acceptor has proven the secret.
Status helloExchange(Socket& s, wire::Hello hello, const std::string& secret, const wire::ClientAuth& mine,
                     uint64_t* peer_id, wire::AuthResult* result, Deadline deadline) {
  randomBytes(hello.challenge, sizeof(hello.challenge));
  std::string frame = wire::encode(hello);
  PDLINK_RETURN_IF_ERROR(s.sendAll(frame.data(), frame.size(), deadline));
  uint8_t buf[wire::kHelloAckFixedBytes];
  PDLINK_RETURN_IF_ERROR(s.recvAll(buf, sizeof(buf), deadline));
  wire::HelloAck ack;
  uint32_t msg_len = 0;
  PDLINK_RETURN_IF_ERROR(wire::decodeFixed(buf, sizeof(buf), &ack, &msg_len));
  std::string msg;
  PDLINK_RETURN_IF_ERROR(s.readBounded(msg_len, wire::kMaxMessageBytes, deadline, &msg, "hello-ack text"));
  if (ack.status != 0) return Status(Code::kLinkFailed, "peer refused the link: " + msg);
  if (ack.version != wire::kProtocolVersion) {
    return Status(Code::kLinkFailed, "protocol version mismatch: the peer speaks " + std::to_string(ack.version) +
                                         ", this engine " + std::to_string(wire::kProtocolVersion));
  }
  if (*peer_id == wire::kAnyCluster) {
    *peer_id = ack.cluster_id;
  } else if (ack.cluster_id != *peer_id) {
    return Status(Code::kLinkFailed, "the endpoint is " + clusterName(ack.cluster_id) + ", not " +
                                         clusterName(*peer_id));
  }
  const uint8_t channel = static_cast<uint8_t>(hello.channel);
  Digest expected = linkProof(secret, 'S', hello.challenge, ack.challenge, hello.cluster_id, ack.cluster_id,
                              hello.nonce, channel);
  if (!constantTimeEqual(ack.proof, expected.data(), expected.size())) {
    return Status(Code::kLinkFailed,
                  secret.empty() ? "the peer requires a link secret (set pdlink.LinkSecret or PDLINK_LINK_SECRET)"
                                 : "the peer could not prove it knows the link secret");
  }
  wire::ClientAuth auth = mine;
  Digest proof = linkProof(secret, 'C', hello.challenge, ack.challenge, hello.cluster_id, ack.cluster_id,
                           hello.nonce, channel);
  std::memcpy(auth.proof, proof.data(), sizeof(auth.proof));
  frame = wire::encode(auth);
  PDLINK_RETURN_IF_ERROR(s.sendAll(frame.data(), frame.size(), deadline));
  uint8_t rbuf[wire::kAuthResultFixedBytes];
  PDLINK_RETURN_IF_ERROR(s.recvAll(rbuf, sizeof(rbuf), deadline));
  uint16_t redirect_len = 0;
  PDLINK_RETURN_IF_ERROR(wire::decodeFixed(rbuf, sizeof(rbuf), result, &msg_len, &redirect_len));
  PDLINK_RETURN_IF_ERROR(s.readBounded(msg_len, wire::kMaxMessageBytes, deadline, &result->message, "auth text"));
  PDLINK_RETURN_IF_ERROR(s.readBounded(redirect_len, limits::kUnixNameBytes, deadline, &result->redirect,
                                       "redirect name"));
  if (result->status != 0) return Status(Code::kLinkFailed, "peer refused the link: " + result->message);
  // A redirect answers only a FORWARD TCP channel that offered to take one; addresses come only on
  // AF_UNIX channels.
  const bool may_redirect = !s.isUnix() && hello.channel == wire::Channel::kForward &&
                            (hello.flags & wire::kHelloSameHost);
  if ((!result->redirect.empty() && !may_redirect) || (result->gen_addr != 0 && !s.isUnix())) {
    return Status(Code::kLinkFailed,
                  "malformed auth-result frame from peer (a redirect or an address it may not send)");
  }
  return Status::OK();
}

}  // namespace pdlink::detail
