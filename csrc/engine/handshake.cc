// The handshake of a link's channels: transcripts, proofs, session keys and the dialler's half
// (declared in engine/handshake.h; the acceptor's half is in linking.cc).
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>

#include "core/limits.h"
#include "core/log.h"
#include "core/seeded_bug.h"
#include "engine/engine_internal.h"

namespace pdlink::detail {

void randomBytes(uint8_t* out, size_t n) {
  while (n > 0) {
    ssize_t got = ::getrandom(out, n, 0);
    if (got <= 0) continue;  // EINTR; getrandom does not fail otherwise once the pool is ready
    out += got;
    n -= static_cast<size_t>(got);
  }
}

wire::Nonce makeNonce() {
  wire::Nonce n;
  randomBytes(n.data(), n.size());
  return n;
}

void Transcript::add(const void* data, size_t len) { bytes_.append(static_cast<const char*>(data), len); }

void Transcript::addHello(const std::string& hello_frame, uint64_t server_id, const uint8_t* server_challenge) {
  bytes_ += hello_frame;
  add(server_id);
  add(server_challenge, wire::kChallengeBytes);
}

void Transcript::addClientAuth(const wire::ClientAuth& a) {
  add(a.hint.boot_id, sizeof(a.hint.boot_id));
  add(a.hint.pid_ns);
  add(a.gen_addr);
}

void Transcript::addVerdict(bool unix_channel, const wire::AuthResult& r) {
  add(static_cast<uint8_t>(unix_channel));
  add(r.status);
  add(r.flags);
  add(r.gen_addr);
  add(static_cast<uint16_t>(r.redirect.size()));
  bytes_ += r.redirect;
}

namespace {

Result<Digest> labelled(const std::string& key, const char* label, char role, const Transcript& t) {
  std::string m = label;
  m.push_back(role);
  m += t.bytes();
  return crypto::hmacSha256(key, m.data(), m.size());
}

}  // namespace

// HMAC-SHA256(secret, "pdlink-proof-v3" || role || transcript). The transcript binds the proof to
// this channel's fresh challenges, both ids, the nonce and the flags, so a proof cannot be replayed
// on another link or channel, nor the dialler's hint or address rewritten under it.
Result<Digest> handshakeProof(const std::string& secret, char role, const Transcript& t) {
  if (secret.empty()) return Digest{};
  return labelled(secret, "pdlink-proof-v3", role, t);
}

Result<Session> deriveSession(const std::string& secret, const Transcript& t) {
  Session out;
  if (secret.empty()) return out;
  auto k = labelled(secret, "pdlink-session-v3", '-', t);
  if (!k.ok()) return k.status();
  auto key = crypto::Key::create(std::string(reinterpret_cast<const char*>(k.value().data()), k.value().size()));
  if (!key.ok()) return key.status();
  out.key = std::move(key.value());
  auto tag = out.key->start();
  if (!tag.ok()) return tag.status();
  static constexpr char kLabel[] = "pdlink-auth-result";
  tag.value().update(kLabel, sizeof(kLabel) - 1);
  Digest d = tag.value().finish();
  std::memcpy(out.verdict_tag, d.data(), sizeof(out.verdict_tag));
  return out;
}

Status sessionFailed(const Status& why) {
  return Status(why.code() == Code::kFeatureNotEnabled ? Code::kFeatureNotEnabled : Code::kLinkFailed,
                "cannot authenticate the link: " + why.message());
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

// Client half of one channel's handshake (transport/wire.h): Hello out, HelloAck in (checking the
// endpoint's cluster id against *peer_id, or learning it when that is kAnyCluster), the acceptor's
// proof checked, ClientAuth out, AuthResult in (its tag checked under the session key). What
// ClientAuth carries beyond the proof (`mine`) goes out only once the acceptor has proven the secret.
Status helloExchange(Socket& s, wire::Hello hello, const std::string& secret, const wire::ClientAuth& mine,
                     uint64_t* peer_id, wire::AuthResult* result, Session* session, Deadline deadline) {
  randomBytes(hello.challenge, sizeof(hello.challenge));
  const std::string hello_frame = wire::encode(hello);
  PDLINK_RETURN_IF_ERROR(s.sendAll(hello_frame.data(), hello_frame.size(), deadline));
  uint8_t buf[wire::kHelloAckFixedBytes];
  PDLINK_RETURN_IF_ERROR(s.recvAll(buf, sizeof(buf), deadline));
  wire::HelloAck ack;
  uint32_t msg_len = 0;
  PDLINK_RETURN_IF_ERROR(wire::decodeFixed(buf, sizeof(buf), &ack, &msg_len));
  std::string msg;
  PDLINK_RETURN_IF_ERROR(s.readBounded(msg_len, wire::kMaxMessageBytes, deadline, &msg, "hello-ack text"));
  if (ack.status != 0) return Status(Code::kLinkFailed, "peer refused the link: " + msg);
  if (ack.version != wire::kProtocolVersion) return versionMismatch(ack.version);
  if (*peer_id == wire::kAnyCluster) {
    *peer_id = ack.cluster_id;
  } else if (ack.cluster_id != *peer_id) {
    return Status(Code::kLinkFailed,
                  "the endpoint is " + clusterName(ack.cluster_id) + ", not " + clusterName(*peer_id));
  }
  Transcript t;
  t.addHello(hello_frame, ack.cluster_id, ack.challenge);
  auto expected = handshakeProof(secret, 'S', t);
  if (!expected.ok()) return sessionFailed(expected.status());
  if (!constantTimeEqual(ack.proof, expected.value().data(), expected.value().size())) {
    static constexpr uint8_t kNoProof[wire::kProofBytes] = {0};
    if (secret.empty()) {
      return Status(Code::kLinkFailed,
                    "the peer requires a link secret and this engine has none: set the same "
                    "pdlink.LinkSecret (or PDLINK_LINK_SECRET) on both sides");
    }
    if (std::memcmp(ack.proof, kNoProof, sizeof(kNoProof)) == 0) {
      return Status(Code::kLinkFailed,
                    "the peer has no link secret and this engine has one: set the same "
                    "pdlink.LinkSecret (or PDLINK_LINK_SECRET) on both sides");
    }
    return Status(Code::kLinkFailed,
                  "the peer's link secret differs from this engine's (it could not prove it "
                  "knows this one, or the handshake was altered on the way): set the same "
                  "pdlink.LinkSecret on both sides");
  }
  wire::ClientAuth auth = mine;
  t.addClientAuth(auth);
  auto proof = handshakeProof(secret, 'C', t);
  if (!proof.ok()) return sessionFailed(proof.status());
  std::memcpy(auth.proof, proof.value().data(), sizeof(auth.proof));
  const std::string frame = wire::encode(auth);
  PDLINK_RETURN_IF_ERROR(s.sendAll(frame.data(), frame.size(), deadline));
  uint8_t rbuf[wire::kAuthResultFixedBytes];
  PDLINK_RETURN_IF_ERROR(s.recvAll(rbuf, sizeof(rbuf), deadline));
  uint16_t redirect_len = 0;
  PDLINK_RETURN_IF_ERROR(wire::decodeFixed(rbuf, sizeof(rbuf), result, &msg_len, &redirect_len));
  PDLINK_RETURN_IF_ERROR(s.readBounded(msg_len, wire::kMaxMessageBytes, deadline, &result->message, "auth text"));
  PDLINK_RETURN_IF_ERROR(
      s.readBounded(redirect_len, limits::kUnixNameBytes, deadline, &result->redirect, "redirect name"));
  if (result->status != 0) return Status(Code::kLinkFailed, "peer refused the link: " + result->message);
  // The verdict, its redirect and its address count only when they come from the prover, unaltered.
  t.addVerdict(s.isUnix(), *result);
  auto derived = deriveSession(secret, t);
  if (!derived.ok()) return sessionFailed(derived.status());
  if (!constantTimeEqual(result->tag, derived.value().verdict_tag, sizeof(result->tag))) {
    return Status(Code::kLinkFailed, "the peer's auth-result failed its authentication (altered on the way)");
  }
  // A redirect answers only a FORWARD TCP channel that offered to take one; addresses come only on
  // AF_UNIX channels; payload integrity only on an authenticated link that the dialler offered it
  // to, or whose acceptor wants it.
  const bool may_redirect =
      !s.isUnix() && hello.channel == wire::Channel::kForward && (hello.flags & wire::kHelloSameHost);
  if ((!result->redirect.empty() && !may_redirect) || (result->gen_addr != 0 && !s.isUnix()) ||
      ((result->flags & wire::kAuthPayloadIntegrity) && secret.empty())) {
    return Status(Code::kLinkFailed,
                  "malformed auth-result frame from peer (a redirect, an address or a flag it may not send)");
  }
  if ((hello.flags & wire::kHelloPayloadIntegrity) && !(result->flags & wire::kAuthPayloadIntegrity)) {
    return Status(Code::kLinkFailed, "the peer did not agree to the payload integrity this engine asked for");
  }
  derived.value().integrity = result->flags & wire::kAuthPayloadIntegrity;
  *session = std::move(derived.value());
  return Status::OK();
}

Status versionMismatch(uint16_t peer_version) {
  return Status(Code::kLinkFailed, "protocol version mismatch: the peer speaks pdlink protocol " +
                                       std::to_string(peer_version) + ", this engine " +
                                       std::to_string(wire::kProtocolVersion) +
                                       ": run the same pdlink release on both sides");
}

}  // namespace pdlink::detail
