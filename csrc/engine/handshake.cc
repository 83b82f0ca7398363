// The handshake of a link's channels: transcripts, proofs, session keys and the dialler's half
// (declared in engine/handshake.h), and the acceptor's half (LinkManager::handleIncoming and its
// steps, engine/link_manager.h).
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>

#include "core/limits.h"
#include "core/log.h"
#include "core/seeded_bug.h"
#include "engine/engine_internal.h"
#include "engine/link_manager.h"
#include "transport/cma/cma.h"
#include "transport/cma/cma_path.h"

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

// ---------------------------------------------------------------- the acceptor's half

namespace pdlink {

using namespace detail;  // NOLINT: this file is part of the engine

// One incoming connection's handshake: what handleIncoming's steps read, decide and answer.
struct LinkManager::Incoming {
  Incoming(Socket& s, HandshakeSlot* sl, Deadline d) : sock(s), slot(sl), tracked(&s), deadline(d) {}
  Socket& sock;  // handleIncoming's; moved out when the link is made
  HandshakeSlot* slot;
  Socket* tracked;  // the socket in handshaking_ (the parked forward channel, once parked)
  const Deadline deadline;
  const std::string from = sock.peer();
  const bool local = sock.isUnix();
  bool acked = false;  // once our HelloAck is out, a refusal is sent as an AuthResult
  uint8_t buf[wire::kHelloBytes];
  wire::Hello hello;
  wire::ClientAuth client;
  Transcript transcript;
  wire::AuthResult ok;  // the verdict
  Session session;
  pid_t pid = 0;
  uid_t uid = 0;
  std::shared_ptr<void> grant;  // cma's (cmaGrant)
};

void LinkManager::handleIncoming(Socket sock, HandshakeSlot* slot) {
  {
    std::lock_guard<std::mutex> lock(s_.mu);
    if (s_.stopping) {
      hearLocked(slot);
      return;
    }
    handshaking_.insert(&sock);
  }
  // However this ends, the connection stops being evictable before its descriptor closes.
  struct Heard {
    LinkManager* e;
    HandshakeSlot* slot;
    ~Heard() {
      std::lock_guard<std::mutex> lock(e->s_.mu);
      e->hearLocked(slot);
    }
  } heard_at_exit{this, slot};
  Incoming in(sock, slot, Deadline::afterMs(s_.config.limits.handshake_timeout_ms));
  if (!readHello(in) || !authenticate(in) || !admitChannel(in)) return;
  if (!sealVerdict(in)) return refuse(in, "cannot authenticate the link: libcrypto failed");
  const std::string ok_frame = wire::encode(in.ok);
  if (in.hello.channel == wire::Channel::kForward) return acceptForward(in, ok_frame);
  if (in.hello.channel == wire::Channel::kLane) return acceptLane(in, ok_frame);
  acceptReverse(in, ok_frame);
}

void LinkManager::untrack(Incoming& in) {
  std::lock_guard<std::mutex> lock(s_.mu);
  handshaking_.erase(in.tracked);
}

void LinkManager::heard(Incoming& in) {
  std::lock_guard<std::mutex> lock(s_.mu);
  hearLocked(in.slot);
}

void LinkManager::refuse(Incoming& in, const std::string& why) {
  PDLINK_LOG(kWarn, "refused link from " << in.from << ": " << why);
  std::string frame;
  if (in.acked) {
    wire::AuthResult r;
    r.status = static_cast<uint32_t>(Code::kLinkFailed);
    r.message = why;
    frame = wire::encode(r);
  } else {
    wire::HelloAck ack;
    ack.status = static_cast<uint32_t>(Code::kLinkFailed);
    ack.cluster_id = s_.config.cluster_id;
    ack.message = why;
    frame = wire::encode(ack);
  }
  (void)in.tracked->sendAll(frame.data(), frame.size(), Deadline::afterMs(200));
  untrack(in);
}

bool LinkManager::readHello(Incoming& in) {
  // A dialler sends its hello at once: a connection that stays silent is dropped long before the
  // handshake timeout (or sooner, evicted by a newcomer when the slots are full).
  const Deadline hello_deadline = Deadline::earliest(in.deadline, Deadline::afterMs(s_.config.limits.hello_timeout_ms));
  Status st = in.sock.recvAll(in.buf, wire::kHelloPrefixBytes, hello_deadline);
  if (st.ok()) st = wire::decodePrefix(in.buf, wire::kHelloPrefixBytes, &in.hello);
  if (!st.ok()) {
    heard(in);
    PDLINK_LOG(kWarn, "dropped connection from " << in.from << ": " << st.message());
    untrack(in);
    return false;
  }
  if (in.hello.version != wire::kProtocolVersion) {
    heard(in);
    refuse(in, "protocol version mismatch: this engine speaks pdlink protocol " +
                   std::to_string(wire::kProtocolVersion) + ", the dialler " + std::to_string(in.hello.version) +
                   ": run the same pdlink release on both sides");
    return false;
  }
  constexpr size_t kRest = wire::kHelloBytes - wire::kHelloPrefixBytes;
  st = in.sock.recvAll(in.buf + wire::kHelloPrefixBytes, kRest, hello_deadline);
  heard(in);
  if (st.ok()) st = wire::decodeRest(in.buf + wire::kHelloPrefixBytes, kRest, &in.hello);
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropped connection from " << in.from << ": " << st.message());
    untrack(in);
    return false;
  }
  if (in.hello.expected_peer != s_.config.cluster_id && in.hello.expected_peer != wire::kAnyCluster) {
    refuse(in,
           "this endpoint is " + clusterName(s_.config.cluster_id) + ", not " + clusterName(in.hello.expected_peer));
    return false;
  }
  if (in.hello.cluster_id == s_.config.cluster_id) {
    refuse(in, "peer uses this engine's own cluster id " + std::to_string(in.hello.cluster_id));
    return false;
  }
  return true;
}

bool LinkManager::authenticate(Incoming& in) {
  // Challenge-response: prove we know the link secret, then check the dialler's proof. Nothing
  // about this engine's host or memory goes out, and nothing is reachable, before that check.
  const std::string& secret = s_.config.link_secret;
  wire::HelloAck ack;
  ack.cluster_id = s_.config.cluster_id;
  randomBytes(ack.challenge, sizeof(ack.challenge));
  in.transcript.addHello(std::string(reinterpret_cast<const char*>(in.buf), sizeof(in.buf)), ack.cluster_id,
                         ack.challenge);
  auto server_proof = handshakeProof(secret, 'S', in.transcript);
  if (!server_proof.ok()) {
    refuse(in, sessionFailed(server_proof.status()).message());
    return false;
  }
  std::memcpy(ack.proof, server_proof.value().data(), sizeof(ack.proof));
  std::string ack_frame = wire::encode(ack);
  Status st = in.sock.sendAll(ack_frame.data(), ack_frame.size(), in.deadline);
  in.acked = true;
  uint8_t auth_buf[wire::kClientAuthBytes];
  if (st.ok()) st = in.sock.recvAll(auth_buf, sizeof(auth_buf), in.deadline);
  if (st.ok()) st = wire::decode(auth_buf, sizeof(auth_buf), &in.client);
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropped connection from " << in.from << " during authentication: " << st.message());
    untrack(in);
    return false;
  }
  in.transcript.addClientAuth(in.client);
  auto expected = handshakeProof(secret, 'C', in.transcript);
  if (!expected.ok()) {
    refuse(in, sessionFailed(expected.status()).message());
    return false;
  }
  if (!constantTimeEqual(in.client.proof, expected.value().data(), expected.value().size())) {
    static constexpr uint8_t kNoProof[wire::kProofBytes] = {0};
    const bool none = std::memcmp(in.client.proof, kNoProof, sizeof(kNoProof)) == 0;
    refuse(in, std::string("authentication failed for ") + clusterName(in.hello.cluster_id) +
                   (secret.empty() ? ": this engine has no link secret but the peer sent a proof"
                    : none         ? ": the peer has no link secret"
                                   : ": the peer does not know this engine's link secret"));
    return false;
  }
  return true;
}

bool LinkManager::admitChannel(Incoming& in) {
  // Same-host: a FORWARD TCP channel from a dialler that offers it and, by its hint, runs on this
  // host is redirected to the AF_UNIX socket (which proves it); otherwise the link stays on TCP.
  // Payload integrity when either side wants it (on an authenticated link only).
  if (!s_.config.link_secret.empty() &&
      (s_.config.payload_integrity || (in.hello.flags & wire::kHelloPayloadIntegrity))) {
    in.ok.flags = wire::kAuthPayloadIntegrity;
  }
  if (in.local && in.hello.channel == wire::Channel::kLane) {
    refuse(in, "lanes are TCP connections only");
    return false;
  }
  if (in.local) {
    if (s_.config.transport == Transport::kTcp) {
      refuse(in, "this engine uses tcp only");
      return false;
    }
    auto cred = in.sock.peerCredentials();
    if (!cred.ok()) {
      refuse(in, cred.status().message());
      return false;
    }
    in.pid = cred.value().pid;
    in.uid = cred.value().uid;
    in.ok.gen_addr = reinterpret_cast<uint64_t>(s_.registry.published());
    // The dialler probes this process before it completes the link.
    in.grant = cmaGrant(in.pid);
  } else if (in.hello.channel == wire::Channel::kForward) {
    std::string name;
    {
      std::lock_guard<std::mutex> lock(s_.mu);
      name = unix_name_;
    }
    if ((in.hello.flags & wire::kHelloSameHost) && s_.config.transport != Transport::kTcp && !name.empty() &&
        s_.hint.sameHost(in.client.hint)) {
      in.ok.redirect = name;
      if (!sealVerdict(in)) {
        refuse(in, "cannot authenticate the link: libcrypto failed");
        return false;
      }
      const std::string frame = wire::encode(in.ok);
      (void)in.sock.sendAll(frame.data(), frame.size(), in.deadline);
      untrack(in);
      return false;
    }
  }
  if (!in.local && s_.config.transport == Transport::kCma) {
    refuse(in, "transport 'cma' was forced here but the peer is not on this host or refuses it");
    return false;
  }
  if (in.hello.channel == wire::Channel::kForward) {
    size_t live = 0, waiting = 0, mine = 0;
    {
      std::lock_guard<std::mutex> lock(s_.mu);
      live = links_.live();
      waiting = pending_.size();
      mine = links_.acceptedFrom(in.slot->source);
      for (const auto& [nonce, p] : pending_) mine += p->source == in.slot->source ? 1 : 0;
    }
    if (s_.switchPending()) {  // a peer that keeps linking cannot hold a switch (Engine::switchRole)
      refuse(in, "this engine is switching its role; link again once it is ready");
      return false;
    }
    if (live + waiting >= s_.config.limits.max_links) {
      refuse(in, "this engine already has " + std::to_string(live) + " links, the most it may have");
      return false;
    }
    if (mine >= s_.config.limits.max_links_per_source) {
      refuse(in, "this engine already has " + std::to_string(mine) + " links from " + in.slot->source +
                     ", the most one source may have (pdlink.MaxLinksPerSource)");
      return false;
    }
  }
  return true;
}

bool LinkManager::sealVerdict(Incoming& in) {
  // The verdict carries a tag under the channel's session key, which covers the whole handshake.
  in.transcript.addVerdict(in.local, in.ok);
  auto derived = deriveSession(s_.config.link_secret, in.transcript);
  if (!derived.ok()) return false;
  in.session = std::move(derived.value());
  in.session.integrity = in.ok.flags & wire::kAuthPayloadIntegrity;
  std::memcpy(in.ok.tag, in.session.verdict_tag, sizeof(in.ok.tag));
  return true;
}

void LinkManager::acceptForward(Incoming& in, const std::string& ok_frame) {
  auto pending = std::make_shared<PendingLink>();
  pending->peer = in.hello.cluster_id;
  pending->source = in.slot->source;
  pending->pid = in.pid;
  pending->published_addr = in.local ? in.client.gen_addr : 0;
  pending->grant = std::move(in.grant);
  pending->session_key = std::move(in.session.key);
  pending->integrity = in.session.integrity;
  std::shared_ptr<Link> link;
  {
    std::unique_lock<std::mutex> lock(s_.mu);
    if (s_.stopping || pending_.count(in.hello.nonce)) {
      lock.unlock();
      return refuse(in, "duplicate or late link attempt");
    }
    pending_[in.hello.nonce] = pending;
  }
  Status st = in.sock.sendAll(ok_frame.data(), ok_frame.size(), in.deadline);
  {
    std::unique_lock<std::mutex> lock(s_.mu);
    // The REVERSE handler takes `sock` out of this frame under mu, so wait for it here.
    pending->forward = std::make_unique<Socket>(std::move(in.sock));
    handshaking_.erase(in.tracked);
    in.tracked = pending->forward.get();
    handshaking_.insert(in.tracked);
    if (st.ok()) {
      pending_cv_.notify_all();
      pending_cv_.wait_until(
          lock,
          std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(0, in.deadline.remainingMsForPoll())),
          [&] { return pending->done || s_.stopping; });
    }
    if (auto it = pending_.find(in.hello.nonce); it != pending_.end() && it->second == pending) pending_.erase(it);
    if (pending->done) link = pending->link;
    if (!link) handshaking_.erase(in.tracked);
  }
  if (!link) {
    PDLINK_LOG(kWarn, "incomplete link attempt from " << in.from << " (cluster " << in.hello.cluster_id << ")");
    return;
  }
  PDLINK_LOG(kInfo, "accepted link from " << clusterName(in.hello.cluster_id) << " at " << in.from);
  in.slot->release();  // the handshake is over: this thread serves the link from now on
  serve_(link, nullptr);
}

void LinkManager::acceptReverse(Incoming& in, const std::string& ok_frame) {
  // REVERSE channel: completes the link whose FORWARD channel is waiting under the same nonce.
  // A peer may not take over the cluster id of another peer's healthy link: only one that proved
  // the secret (it is that cluster), or when a probe finds the old link dead (the peer restarted).
  std::shared_ptr<Link> rival;
  {
    std::lock_guard<std::mutex> lock(s_.mu);
    rival = links_.slot(in.hello.cluster_id, false);
  }
  // The probes take up to kProbeWindowMs of this handshake's time; without that much left, the
  // old link is given the benefit of the doubt.
  if (rival && s_.config.link_secret.empty() &&
      (in.deadline.remainingMsForPoll() < kProbeWindowMs + kProbeWaitsMs[0] || stillAlive(rival))) {
    return refuse(in, clusterName(in.hello.cluster_id) + " already has a healthy link from " + rival->peerAddress() +
                          "; it must unlink first");
  }
  std::shared_ptr<Link> link;
  std::unique_lock<std::mutex> out_lock;
  {
    std::unique_lock<std::mutex> lock(s_.mu);
    link = completeLinkLocked(in, lock, &out_lock);
    if (!link) return;  // refused
  }
  pending_cv_.notify_all();
  if (!link->outSocket().sendAll(ok_frame.data(), ok_frame.size(), in.deadline).ok()) {
    link->breakLink("peer went away during the handshake");
  }
}

void LinkManager::acceptLane(Incoming& in, const std::string& ok_frame) {
  // Only the established TCP link this cluster dialled with this very nonce (which only both ends
  // know), from the same source, takes the lane; within its share and the engine's.
  const size_t per_link = s_.config.limits.tcp_streams - 1;
  std::shared_ptr<Link> link;
  Lane* lane = nullptr;
  std::string why;
  {
    // Checked and attached under mu, so two lanes racing cannot both take the last place.
    std::lock_guard<std::mutex> lock(s_.mu);
    std::shared_ptr<void> token;
    link = s_.stopping ? nullptr : links_.slot(in.hello.cluster_id, false);
    if (!link || link->initiator() || link->nonce() != in.hello.nonce || link->broken()) {
      why = "no link of " + clusterName(in.hello.cluster_id) + " for this lane";
    } else if (link->sameHost() || link->outSocket().isUnix() || link->source() != in.slot->source) {
      why = "a lane must come from where its tcp link came from";
    } else if (link->payloadIntegrity() != in.session.integrity) {
      why = "the lane disagrees with its link about payload integrity";
    } else if (link->laneCount(false) >= per_link) {
      why = "the link already has " + std::to_string(per_link) + " lanes, the most it may have (pdlink.TcpStreams)";
    } else if (!(token = takeLaneToken())) {
      why = "this engine already has the most lanes it may have (pdlink.MaxTcpLanes)";
    } else {
      handshaking_.erase(in.tracked);
      lane = link->addLane(false, std::move(in.sock), std::move(in.session.key), in.session.integrity, token, per_link);
      if (!lane) return;  // the link broke meanwhile: the lane is shut down
    }
  }
  if (!why.empty()) return refuse(in, why);
  if (!lane->sock.sendAll(ok_frame.data(), ok_frame.size(), in.deadline).ok()) return;
  PDLINK_LOG(kDebug, "accepted a lane of " << clusterName(in.hello.cluster_id) << " from " << in.from);
  in.slot->release();  // the handshake is over: this thread serves the lane from now on
  serve_(link, &lane->stream());
}

std::shared_ptr<Link> LinkManager::completeLinkLocked(Incoming& in, std::unique_lock<std::mutex>& lock,
                                                      std::unique_lock<std::mutex>* out_lock) {
  auto deadline_tp =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(0, in.deadline.remainingMsForPoll()));
  // The FORWARD thread registers the nonce before it acks, so an unknown nonce is refused at
  // once; a known one may still be parking its socket, which takes microseconds.
  pending_cv_.wait_until(lock, deadline_tp, [&] {
    auto it = pending_.find(in.hello.nonce);
    return s_.stopping || it == pending_.end() || it->second->forward;
  });
  auto it = pending_.find(in.hello.nonce);
  if (s_.stopping || it == pending_.end() || !it->second->forward || it->second->peer != in.hello.cluster_id ||
      it->second->forward->isUnix() != in.local) {
    lock.unlock();
    refuse(in, "no matching forward channel for this link attempt");
    return nullptr;
  }
  auto pending = it->second;
  if (links_.live() >= s_.config.limits.max_links) {
    lock.unlock();
    refuse(in, "this engine already has the most links it may have");
    return nullptr;
  }
  if (in.local && (pending->pid != in.pid || pending->published_addr != in.client.gen_addr)) {
    lock.unlock();
    refuse(in, "the two same-host channels come from different processes");
    return nullptr;
  }
  if (pending->integrity != in.session.integrity) {
    lock.unlock();
    refuse(in, "the two channels disagree about payload integrity");
    return nullptr;
  }
  handshaking_.erase(pending->forward.get());
  handshaking_.erase(in.tracked);
  // A forced transport that cannot be had here is refused now, before the link is installed.
  std::shared_ptr<const cma::Process> process;
  Status chosen = in.local ? chooseTransport(in.sock, in.pid, in.uid, pending->published_addr, &process) : Status::OK();
  if (!chosen.ok()) {
    lock.unlock();
    refuse(in, chosen.message());
    return nullptr;
  }
  std::string endpoint = pending->forward->peer();  // the dialler's end of its forward channel
  auto link = std::make_shared<Link>(in.hello.cluster_id, std::move(in.sock), std::move(*pending->forward), false);
  link->setOrigin(pending->source, in.hello.nonce, std::move(endpoint));
  if (in.session.key) link->authenticate(std::move(in.session.key), pending->session_key, in.session.integrity);
  link->setPeerProcess(in.pid, pending->published_addr);
  link->holdUntilBroken(pending->grant);
  choosePaths(*link, std::move(process));
  // Nobody may send on the new link before our ack is out; the link is brand new, so taking its
  // mutex under mu cannot deadlock.
  *out_lock = std::unique_lock<std::mutex>(link->outMutex());
  installLink(link);
  // No longer waiting: counted as a live link from now on, not twice against pdlink.MaxLinks.
  pending_.erase(it);
  pending->link = link;
  pending->done = true;
  return link;
}

}  // namespace pdlink
