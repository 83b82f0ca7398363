// Links: dialling, accepting (the handshake with authentication and transport choice), unlinking.
#include "engine/engine.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <future>

#include "core/limits.h"
#include "core/log.h"
#include "engine/engine_internal.h"
#include "transport/cma/cma.h"

namespace pdlink {

using namespace detail;  // NOLINT: this file is part of the engine

Status detail::linkDown(uint64_t peer, const std::string& reason) {
  return Status(Code::kLinkFailed,
                "the link to " + clusterName(peer) + " is down (" + reason + "); disconnect, then connect again");
}

Status detail::linkDown(const Link& link) { return linkDown(link.peer(), link.brokenReason()); }

Status detail::linkError(const PeerAddress& peer, const Status& st) {
  Code code = st.code() == Code::kParamInvalid ? Code::kParamInvalid : Code::kLinkFailed;
  return Status(code, "cannot link to " + clusterName(peer.cluster_id) + " at " + peer.ip + ":" +
                          std::to_string(peer.port) + ": " + st.message());
}

struct Engine::Dialled {
  Socket fwd, rev;
  pid_t pid = 0;  // the acceptor, as SO_PEERCRED reports it (AF_UNIX channels only)
  uid_t uid = 0;
  uint64_t published_addr = 0;  // its Registry::Published words (AF_UNIX channels only)
  std::shared_ptr<cma::Grant> grant;
  Session fwd_session, rev_session;  // with a link secret: the channels' keys
  wire::Nonce nonce{};               // the forward channel's hello
  std::string endpoint;              // the forward channel's end here (Socket::localEndpoint)
  std::shared_ptr<void> in_flight;   // keeps `nonce` confirmable while the link is made (markDialling)
};

std::shared_ptr<void> Engine::markDialling(const wire::Nonce& nonce, uint64_t peer, const std::string& endpoint) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    dialling_[nonce] = {peer, endpoint};
  }
  return std::shared_ptr<void>(nullptr, [this, nonce](void*) {
    std::lock_guard<std::mutex> lock(mu_);
    dialling_.erase(nonce);
  });
}

// ---------------------------------------------------------------- links

std::vector<Status> Engine::link(const std::vector<PeerAddress>& peers, int64_t timeout_ms,
                                 std::vector<uint64_t>* peer_ids) {
  if (peers.size() > kMaxPeersPerCall) {
    return {Status(Code::kClusterNumExceedLimit, "at most 16 clusters per call, got " + std::to_string(peers.size()))};
  }
  if (!initialized()) return {Status(Code::kFailed, "engine is not initialized")};
  // Peers are linked in parallel: one slow or dead peer costs its own timeout, not everyone's.
  std::vector<uint64_t> ids(peers.size(), wire::kAnyCluster);
  std::vector<std::future<Status>> futures;
  for (size_t i = 0; i < peers.size(); ++i) {
    futures.push_back(std::async(
        std::launch::async, [this, &peers, &ids, i, timeout_ms] { return linkOne(peers[i], timeout_ms, &ids[i]); }));
  }
  std::vector<Status> out;
  for (auto& f : futures) out.push_back(f.get());
  if (peer_ids) *peer_ids = std::move(ids);
  return out;
}

Status Engine::linkOne(const PeerAddress& peer, int64_t timeout_ms, uint64_t* linked_id) {
  const bool known = peer.cluster_id != wire::kAnyCluster;
  std::shared_ptr<Link> claimed;  // an accepted link that claims to come from `peer`
  const std::string where = peer.ip + ":" + std::to_string(peer.port);
  // Guards against a second link attempt to the same peer, by id when known, else by address.
  const uint64_t guard_key = known ? peer.cluster_id : std::hash<std::string>{}(where) | (uint64_t{1} << 63);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (known && peer.cluster_id == config_.cluster_id) {
      return Status(Code::kParamInvalid,
                    "cannot link to this engine's own cluster id " + std::to_string(peer.cluster_id));
    }
    // A link entity of this side (a dead one too, until unlinked) for this peer: llm_datadist
    // answers LLM_ALREADY_LINK. (So a peer that linked to us first makes our own link attempt
    // ALREADY_LINK: its link is symmetric. One-way links count only our own.) An accepted link
    // alone is only a claim, though: the engine at the dialled address must confirm it is the
    // other end of it (below).
    for (const LinkInfo& l : links_.ownInfos()) {
      if ((known && l.peer_cluster_id == peer.cluster_id) || (!known && l.peer_address == where)) {
        if (known && !l.initiator && !l.broken) {
          claimed = links_.slot(peer.cluster_id, false);
          if (claimed) continue;
        }
        if (linked_id) *linked_id = l.peer_cluster_id;
        return Status(Code::kAlreadyLink, clusterName(l.peer_cluster_id) + " is already linked");
      }
    }
    if (links_.live() + linking_.size() >= config_.limits.max_links) {
      return Status(Code::kLinkFailed, "this engine already has " + std::to_string(links_.live()) +
                                           " links, the most it may have (pdlink.MaxLinks); unlink one first");
    }
    if (!linking_.insert(guard_key).second) {
      return Status(Code::kProcessingLink,
                    "a link to " + (known ? clusterName(peer.cluster_id) : where) + " is in progress");
    }
  }
  struct Unmark {
    Engine* e;
    uint64_t key;
    ~Unmark() {
      std::lock_guard<std::mutex> lock(e->mu_);
      e->linking_.erase(key);
    }
  } unmark{this, guard_key};

  Deadline deadline = Deadline::afterMs(timeout_ms);
  uint64_t peer_id = peer.cluster_id;
  const bool offer = config_.transport != Transport::kTcp;
  std::string redirect;
  auto dialled = dialTcp(peer, offer, &peer_id, deadline, &redirect);
  if (!dialled.ok()) return linkError(peer, dialled.status());
  if (!redirect.empty()) {
    // The acceptor is on this host (by the hints) and offers its AF_UNIX socket, where the kernel
    // tells each side who the other is. Out of reach (another network namespace): TCP after all.
    bool reached = false;
    auto local = dialUnix(redirect, &peer_id, deadline, &reached);
    if (local.ok()) {
      dialled = std::move(local);
    } else if (reached || config_.transport == Transport::kCma) {
      return linkError(peer, local.status());
    } else {
      PDLINK_LOG(kInfo, "same-host channels to " << clusterName(peer_id) << " unavailable (" << local.status().message()
                                                 << "); using tcp");
      peer_id = peer.cluster_id;
      dialled = dialTcp(peer, false, &peer_id, deadline, &redirect);
      if (!dialled.ok()) return linkError(peer, dialled.status());
    }
  }
  if (peer_id == config_.cluster_id) {
    return linkError(peer, Status(Code::kParamInvalid, "the peer uses this engine's own cluster id"));
  }
  Dialled& d = dialled.value();
  std::shared_ptr<const cma::Process> process;
  Status st = chooseTransport(d.fwd, d.pid, d.uid, d.published_addr, &process);
  if (!st.ok()) return linkError(peer, st);  // the peer sees the channels close
  auto link = std::make_shared<Link>(peer_id, std::move(d.fwd), std::move(d.rev), true);
  if (d.fwd_session.key) {
    link->authenticate(std::move(d.fwd_session.key), std::move(d.rev_session.key), d.fwd_session.integrity);
  }
  const bool direct = process != nullptr;
  link->setPeerProcess(d.pid, d.published_addr, std::move(d.grant), std::move(process));
  link->setPeerAddress(where);
  link->setOrigin("", d.nonce, d.endpoint);
  choosePaths(*link, direct);
  if (claimed) {
    // The engine we dialled says whether it made the accepted link. Yes: that link is the one
    // llm_datadist reports (ALREADY_LINK), and the new one is closed again, leaving nothing on
    // either side. No: the accepted link is an impostor's, or stale; it is dropped and the
    // dialled one used.
    Status confirmed = confirmDialled(*link, *claimed, deadline);
    if (confirmed.ok()) {
      dropUnused(*link, deadline);
      if (linked_id) *linked_id = peer_id;
      return Status(Code::kAlreadyLink, clusterName(peer_id) + " is already linked");
    }
    if (link->broken()) return linkError(peer, confirmed);
    PDLINK_LOG(kWarn, "dropping the link that claimed to come from "
                          << clusterName(peer_id) << " (" << claimed->peerAddress() << "): " << confirmed.message());
    {
      std::lock_guard<std::mutex> lock(mu_);
      links_.forget(claimed);
    }
    claimed->breakLink("claimed to come from " + clusterName(peer_id) + ", which did not dial it");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || !initialized_) return Status(Code::kLinkFailed, "engine is finalizing");
    installLink(link);
  }
  spawn([this, link] { serve(link); });
  bool channel = false;
  std::unique_lock<std::mutex> out(link->outMutex());
  // Set up this direction's device channel now rather than on the first pull when the link's first
  // device path needs one: HCCL's communicator setup takes seconds on real hardware. (A same-host
  // link uses IPC, and sets a channel up only if the peer turns IPC down.) A peer without device
  // channels (a CPU backend) still links; its device transfers are refused then.
  const bool wants_channel = !link->devicePaths().empty() && link->devicePaths().front()->caps().device_channel;
  if (wants_channel) {
    st = ensureDeviceChannel(link, deadline, "link to");
    channel = link->outDevice() != nullptr;
  }
  out.unlock();
  if (wants_channel) {
    if (!st.ok() && st.code() != Code::kFeatureNotEnabled) {
      (void)unlinkOne(peer_id, 1000, true);
      return linkError(peer, st);
    }
    if (!st.ok()) PDLINK_LOG(kInfo, st.message());
  }
  if (linked_id) *linked_id = peer_id;
  PDLINK_LOG(kInfo, "linked to " << clusterName(peer_id) << " at " << peer.ip << ":" << peer.port << " over "
                                 << link->transport() << (channel ? " and a device channel" : ""));
  return Status::OK();
}

namespace {

// Both channels of a link agree on payload integrity (the acceptor decides it once per link).
Status sameIntegrity(const Session& fwd, const Session& rev) {
  if (fwd.integrity != rev.integrity) {
    return Status(Code::kLinkFailed, "the peer agreed to payload integrity on one channel only");
  }
  return Status::OK();
}

}  // namespace

Result<Engine::Dialled> Engine::dialTcp(const PeerAddress& peer, bool offer_same_host, uint64_t* peer_id,
                                        Deadline deadline, std::string* redirect) {
  redirect->clear();
  wire::Hello hello;
  hello.cluster_id = config_.cluster_id;
  hello.expected_peer = peer.cluster_id;
  hello.nonce = makeNonce();
  const uint8_t integrity = config_.payload_integrity ? wire::kHelloPayloadIntegrity : 0;
  hello.flags = (offer_same_host ? wire::kHelloSameHost : 0) | integrity;
  wire::ClientAuth mine;
  if (offer_same_host) mine.hint = hint_;  // what the acceptor needs to decide on a redirect
  Dialled d;
  auto fwd = Socket::connect(peer.ip, peer.port, deadline);
  if (!fwd.ok()) return fwd.status();
  wire::AuthResult result;
  PDLINK_RETURN_IF_ERROR(
      helloExchange(fwd.value(), hello, config_.link_secret, mine, peer_id, &result, &d.fwd_session, deadline));
  if (!result.redirect.empty()) {
    *redirect = result.redirect;
    return d;  // the acceptor closes this connection; the link is made on the AF_UNIX socket
  }
  d.nonce = hello.nonce;
  d.endpoint = fwd.value().localEndpoint();
  d.in_flight = markDialling(hello.nonce, *peer_id, d.endpoint);
  auto rev = Socket::connect(peer.ip, peer.port, deadline);
  if (!rev.ok()) return rev.status();
  hello.channel = wire::Channel::kReverse;
  hello.flags = integrity;
  PDLINK_RETURN_IF_ERROR(helloExchange(rev.value(), hello, config_.link_secret, wire::ClientAuth{}, peer_id, &result,
                                       &d.rev_session, deadline));
  PDLINK_RETURN_IF_ERROR(sameIntegrity(d.fwd_session, d.rev_session));
  d.fwd = std::move(fwd.value());
  d.rev = std::move(rev.value());
  return d;
}

Result<Engine::Dialled> Engine::dialUnix(const std::string& name, uint64_t* peer_id, Deadline deadline, bool* reached) {
  *reached = false;
  Dialled d;
  auto fwd = Socket::connectUnix(name, deadline);
  if (!fwd.ok()) return fwd.status();
  *reached = true;
  auto cred = fwd.value().peerCredentials();
  if (!cred.ok()) return cred.status();
  d.pid = cred.value().pid;
  d.uid = cred.value().uid;
  wire::Hello hello;
  hello.cluster_id = config_.cluster_id;
  hello.expected_peer = *peer_id;
  hello.nonce = makeNonce();
  hello.flags = config_.payload_integrity ? wire::kHelloPayloadIntegrity : 0;
  wire::ClientAuth mine;
  mine.hint = hint_;
  mine.gen_addr = reinterpret_cast<uint64_t>(registry_.published());
  wire::AuthResult result;
  PDLINK_RETURN_IF_ERROR(
      helloExchange(fwd.value(), hello, config_.link_secret, mine, peer_id, &result, &d.fwd_session, deadline));
  d.published_addr = result.gen_addr;
  d.nonce = hello.nonce;
  d.endpoint = fwd.value().localEndpoint();
  d.in_flight = markDialling(hello.nonce, *peer_id, d.endpoint);
  // The acceptor (it has proven the secret by now) probes this process before it completes the
  // link: let it read us from now on (released with `d` if the link does not come up). Not for a
  // peer inside this process.
  if (d.pid != 0 && d.pid != ::getpid()) d.grant = cma::Grant::acquire();
  auto rev = Socket::connectUnix(name, deadline);
  if (!rev.ok()) return rev.status();
  auto cred2 = rev.value().peerCredentials();
  if (!cred2.ok() || cred2.value().pid != d.pid) {
    return Status(Code::kLinkFailed, "the two same-host channels reached different processes");
  }
  hello.channel = wire::Channel::kReverse;
  PDLINK_RETURN_IF_ERROR(
      helloExchange(rev.value(), hello, config_.link_secret, mine, peer_id, &result, &d.rev_session, deadline));
  if (result.gen_addr != d.published_addr) {
    return Status(Code::kLinkFailed, "the two same-host channels disagree about the peer");
  }
  PDLINK_RETURN_IF_ERROR(sameIntegrity(d.fwd_session, d.rev_session));
  d.fwd = std::move(fwd.value());
  d.rev = std::move(rev.value());
  return d;
}

Status Engine::chooseTransport(const Socket& channel, pid_t peer_pid, uid_t peer_uid, uint64_t published_addr,
                               std::shared_ptr<const cma::Process>* process) const {
  process->reset();
  if (config_.transport == Transport::kTcp || config_.transport == Transport::kUcx) return Status::OK();
  if (peer_pid == 0) {
    if (config_.transport == Transport::kCma) {
      return Status(Code::kLinkFailed, "transport 'cma' was forced but the peer is not on this host or refuses it");
    }
    return Status::OK();
  }
  // A proven same-host peer: copy directly if its process can be held for the life of the link
  // (cma::Process) and this process may read it (Yama, same user). The probe reads the peer's
  // published words, in the process the kernel named, never a claimed one.
  auto opened = cma::Process::open(channel.fd(), peer_pid, peer_uid);
  Result<uint64_t> word = opened.ok() ? opened.value()->readWord(published_addr) : Result<uint64_t>(opened.status());
  if (word.ok()) {
    PDLINK_LOG(kDebug, "same-host peer pid " << peer_pid << ": direct copies by " << opened.value()->modeName());
    *process = std::move(opened.value());
    return Status::OK();
  }
  if (config_.transport == Transport::kCma) return word.status();
  PDLINK_LOG(kInfo, "same-host peer pid " << peer_pid << ": " << word.status().message() << "; streaming");
  return Status::OK();
}

void Engine::installLink(const std::shared_ptr<Link>& link) {
  link_log_.emplace_back(++link_seq_, link->peer());
  if (link_log_.size() > limits::kLinkLogEntries) link_log_.pop_front();
  if (std::shared_ptr<Link> old = links_.install(link)) {
    // The peer re-linked without unlinking (it restarted, or force-unlinked its end), and its old
    // link was dead, or the newcomer proved the secret (handleIncoming): the old entity is stale,
    // as in llm_datadist's force re-link.
    PDLINK_LOG(kInfo, "replacing stale link to " << clusterName(link->peer()));
    old->breakLink("replaced by a new link from the peer");
  }
}

Status Engine::confirmDialled(Link& link, const Link& claimed, Deadline deadline) {
  std::lock_guard<std::mutex> out(link.outMutex());
  const std::string body =
      std::string(reinterpret_cast<const char*>(claimed.nonce().data()), claimed.nonce().size()) + claimed.endpoint();
  wire::ResponseHeader rh;
  Status st = request(link, wire::RequestHeader{wire::Op::kConfirm, static_cast<uint32_t>(body.size()), 0}, body,
                      deadline, "confirming a link with", &rh);
  if (st.ok() && rh.payload_len != 0) {
    st = failTransfer(link, Status(Code::kLinkFailed, "malformed answer to a link confirmation"), "confirming with");
  }
  return st;
}

void Engine::dropUnused(Link& link, Deadline deadline) {
  {
    std::lock_guard<std::mutex> out(link.outMutex());
    wire::ResponseHeader rh;
    (void)request(link, wire::RequestHeader{wire::Op::kUnlink, 0, 0}, "", deadline, "closing a spare link to", &rh);
  }
  link.breakLink("not needed: the peer's own link to this engine serves");
}

Status Engine::serveConfirm(const Link& link, Stream& s, const std::string& body, Deadline deadline) {
  // Ours if this engine dialled the asker with that nonce from that very end (the nonce alone is
  // not enough: every engine this one dials learns it, and may claim this one's id elsewhere).
  wire::Nonce nonce;
  std::memcpy(nonce.data(), body.data(), nonce.size());  // admitHeader checked the size
  const std::string endpoint = body.substr(nonce.size());
  bool ours = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<Link> own = links_.slot(link.peer(), true);
    auto it = dialling_.find(nonce);
    ours = (own && !own->broken() && own->nonce() == nonce && own->endpoint() == endpoint) ||
           (it != dialling_.end() && it->second.peer == link.peer() && it->second.endpoint == endpoint);
  }
  if (ours) return sendResponse(s, Status::OK(), deadline);
  return sendResponse(
      s, Status(Code::kNotYetLink, "this engine did not dial that link to " + clusterName(config_.cluster_id)),
      deadline);
}

bool Engine::stillAlive(const std::shared_ptr<Link>& link) {
  if (link->broken()) return false;
  std::unique_lock<std::mutex> out(link->outMutex(), std::try_to_lock);
  if (!out.owns_lock()) return true;  // a transfer (or another probe) is running on it
  // Found dead only after a window of silence, not one missed answer: a ping, and another each
  // time the wait for any answer doubles (kProbeWaitsMs). An owner that pauses for less than the
  // window answers one of them, and keeps its link; the answers of every ping sent are read back.
  const std::string frame = wire::encode(wire::RequestHeader{wire::Op::kPing, 0, 0});
  size_t sent = 0;
  Status st;
  for (int64_t wait_ms : kProbeWaitsMs) {
    st = link->out().sendFrame(frame, Deadline::afterMs(wait_ms));
    if (!st.ok()) break;
    ++sent;
    st = link->out().waitReadable(Deadline::afterMs(wait_ms));
    if (st.code() != Code::kTimeout) break;
  }
  for (size_t i = 0; st.ok() && i < sent; ++i) {
    wire::ResponseHeader rh;
    Status remote;
    st = readResponse(link->out(), Deadline::afterMs(kProbeWaitsMs[0]), &rh, &remote);
  }
  if (!st.ok()) link->breakLink("found dead by probes over " + std::to_string(kProbeWindowMs) + " ms: " + st.message());
  return st.ok();
}

void Engine::handleIncoming(Socket sock, HandshakeSlot* slot) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      hearLocked(slot);
      return;
    }
    handshaking_.insert(&sock);
  }
  // However this ends, the connection stops being evictable before its descriptor closes.
  struct Heard {
    Engine* e;
    HandshakeSlot* slot;
    ~Heard() {
      std::lock_guard<std::mutex> lock(e->mu_);
      e->hearLocked(slot);
    }
  } heard_at_exit{this, slot};
  Socket* tracked = &sock;
  auto untrack = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    handshaking_.erase(tracked);
  };
  Deadline deadline = Deadline::afterMs(config_.limits.handshake_timeout_ms);
  const std::string from = sock.peer();
  const bool local = sock.isUnix();
  bool acked = false;  // once our HelloAck is out, a refusal is sent as an AuthResult
  auto refuse = [&](const std::string& why) {
    PDLINK_LOG(kWarn, "refused link from " << from << ": " << why);
    std::string frame;
    if (acked) {
      wire::AuthResult r;
      r.status = static_cast<uint32_t>(Code::kLinkFailed);
      r.message = why;
      frame = wire::encode(r);
    } else {
      wire::HelloAck ack;
      ack.status = static_cast<uint32_t>(Code::kLinkFailed);
      ack.cluster_id = config_.cluster_id;
      ack.message = why;
      frame = wire::encode(ack);
    }
    (void)tracked->sendAll(frame.data(), frame.size(), Deadline::afterMs(200));
    untrack();
  };

  uint8_t buf[wire::kHelloBytes];
  wire::Hello hello;
  // A dialler sends its hello at once: a connection that stays silent is dropped long before the
  // handshake timeout (or sooner, evicted by a newcomer when the slots are full).
  const Deadline hello_deadline = Deadline::earliest(deadline, Deadline::afterMs(config_.limits.hello_timeout_ms));
  auto heard = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    hearLocked(slot);
  };
  Status st = sock.recvAll(buf, wire::kHelloPrefixBytes, hello_deadline);
  if (st.ok()) st = wire::decodePrefix(buf, wire::kHelloPrefixBytes, &hello);
  if (!st.ok()) {
    heard();
    PDLINK_LOG(kWarn, "dropped connection from " << from << ": " << st.message());
    untrack();
    return;
  }
  if (hello.version != wire::kProtocolVersion) {
    heard();
    return refuse("protocol version mismatch: this engine speaks pdlink protocol " +
                  std::to_string(wire::kProtocolVersion) + ", the dialler " + std::to_string(hello.version) +
                  ": run the same pdlink release on both sides");
  }
  constexpr size_t kRest = wire::kHelloBytes - wire::kHelloPrefixBytes;
  st = sock.recvAll(buf + wire::kHelloPrefixBytes, kRest, hello_deadline);
  heard();
  if (st.ok()) st = wire::decodeRest(buf + wire::kHelloPrefixBytes, kRest, &hello);
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropped connection from " << from << ": " << st.message());
    untrack();
    return;
  }
  if (hello.expected_peer != config_.cluster_id && hello.expected_peer != wire::kAnyCluster) {
    return refuse("this endpoint is " + clusterName(config_.cluster_id) + ", not " + clusterName(hello.expected_peer));
  }
  if (hello.cluster_id == config_.cluster_id) {
    return refuse("peer uses this engine's own cluster id " + std::to_string(hello.cluster_id));
  }

  // Challenge-response: prove we know the link secret, then check the dialler's proof. Nothing
  // about this engine's host or memory goes out, and nothing is reachable, before that check.
  const std::string& secret = config_.link_secret;
  wire::HelloAck ack;
  ack.cluster_id = config_.cluster_id;
  randomBytes(ack.challenge, sizeof(ack.challenge));
  Transcript transcript;
  transcript.addHello(std::string(reinterpret_cast<const char*>(buf), sizeof(buf)), ack.cluster_id, ack.challenge);
  auto server_proof = handshakeProof(secret, 'S', transcript);
  if (!server_proof.ok()) return refuse(sessionFailed(server_proof.status()).message());
  std::memcpy(ack.proof, server_proof.value().data(), sizeof(ack.proof));
  std::string ack_frame = wire::encode(ack);
  st = sock.sendAll(ack_frame.data(), ack_frame.size(), deadline);
  acked = true;
  uint8_t auth_buf[wire::kClientAuthBytes];
  wire::ClientAuth client;
  if (st.ok()) st = sock.recvAll(auth_buf, sizeof(auth_buf), deadline);
  if (st.ok()) st = wire::decode(auth_buf, sizeof(auth_buf), &client);
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropped connection from " << from << " during authentication: " << st.message());
    untrack();
    return;
  }
  transcript.addClientAuth(client);
  auto expected = handshakeProof(secret, 'C', transcript);
  if (!expected.ok()) return refuse(sessionFailed(expected.status()).message());
  if (!constantTimeEqual(client.proof, expected.value().data(), expected.value().size())) {
    static constexpr uint8_t kNoProof[wire::kProofBytes] = {0};
    const bool none = std::memcmp(client.proof, kNoProof, sizeof(kNoProof)) == 0;
    return refuse(std::string("authentication failed for ") + clusterName(hello.cluster_id) +
                  (secret.empty() ? ": this engine has no link secret but the peer sent a proof"
                   : none         ? ": the peer has no link secret"
                                  : ": the peer does not know this engine's link secret"));
  }

  // Same-host: a FORWARD TCP channel from a dialler that offers it and, by its hint, runs on this
  // host is redirected to the AF_UNIX socket (which proves it); otherwise the link stays on TCP.
  wire::AuthResult ok;
  // Payload integrity when either side wants it (on an authenticated link only).
  if (!secret.empty() && (config_.payload_integrity || (hello.flags & wire::kHelloPayloadIntegrity))) {
    ok.flags = wire::kAuthPayloadIntegrity;
  }
  // The verdict carries a tag under the channel's session key, which covers the whole handshake.
  Session session;
  auto seal = [&]() -> bool {
    transcript.addVerdict(local, ok);
    auto derived = deriveSession(secret, transcript);
    if (!derived.ok()) return false;
    session = std::move(derived.value());
    session.integrity = ok.flags & wire::kAuthPayloadIntegrity;
    std::memcpy(ok.tag, session.verdict_tag, sizeof(ok.tag));
    return true;
  };
  pid_t pid = 0;
  uid_t uid = 0;
  std::shared_ptr<cma::Grant> grant;
  if (local) {
    if (config_.transport == Transport::kTcp) return refuse("this engine uses tcp only");
    auto cred = sock.peerCredentials();
    if (!cred.ok()) return refuse(cred.status().message());
    pid = cred.value().pid;
    uid = cred.value().uid;
    ok.gen_addr = reinterpret_cast<uint64_t>(registry_.published());
    // The dialler probes this process before it completes the link.
    if (pid != 0 && pid != ::getpid()) grant = cma::Grant::acquire();
  } else if (hello.channel == wire::Channel::kForward) {
    std::string name;
    {
      std::lock_guard<std::mutex> lock(mu_);
      name = unix_name_;
    }
    if ((hello.flags & wire::kHelloSameHost) && config_.transport != Transport::kTcp && !name.empty() &&
        hint_.sameHost(client.hint)) {
      ok.redirect = name;
      if (!seal()) return refuse("cannot authenticate the link: libcrypto failed");
      const std::string frame = wire::encode(ok);
      (void)sock.sendAll(frame.data(), frame.size(), deadline);
      untrack();
      return;
    }
  }
  if (!local && config_.transport == Transport::kCma) {
    return refuse("transport 'cma' was forced here but the peer is not on this host or refuses it");
  }
  if (hello.channel == wire::Channel::kForward) {
    size_t live = 0, waiting = 0, mine = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      live = links_.live();
      waiting = pending_.size();
      mine = links_.acceptedFrom(slot->source);
      for (const auto& [nonce, p] : pending_) mine += p->source == slot->source ? 1 : 0;
    }
    if (live + waiting >= config_.limits.max_links) {
      return refuse("this engine already has " + std::to_string(live) + " links, the most it may have");
    }
    if (mine >= config_.limits.max_links_per_source) {
      return refuse("this engine already has " + std::to_string(mine) + " links from " + slot->source +
                    ", the most one source may have (pdlink.MaxLinksPerSource)");
    }
  }
  if (!seal()) return refuse("cannot authenticate the link: libcrypto failed");
  const std::string ok_frame = wire::encode(ok);

  if (hello.channel == wire::Channel::kForward) {
    auto pending = std::make_shared<PendingLink>();
    pending->peer = hello.cluster_id;
    pending->source = slot->source;
    pending->pid = pid;
    pending->published_addr = local ? client.gen_addr : 0;
    pending->grant = std::move(grant);
    pending->session_key = std::move(session.key);
    pending->integrity = session.integrity;
    std::shared_ptr<Link> link;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stopping_ || pending_.count(hello.nonce)) {
        lock.unlock();
        return refuse("duplicate or late link attempt");
      }
      pending_[hello.nonce] = pending;
    }
    st = sock.sendAll(ok_frame.data(), ok_frame.size(), deadline);
    {
      std::unique_lock<std::mutex> lock(mu_);
      // The REVERSE handler takes `sock` out of this frame under mu_, so wait for it here.
      pending->forward = std::make_unique<Socket>(std::move(sock));
      handshaking_.erase(tracked);
      tracked = pending->forward.get();
      handshaking_.insert(tracked);
      if (st.ok()) {
        pending_cv_.notify_all();
        pending_cv_.wait_until(
            lock,
            std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(0, deadline.remainingMsForPoll())),
            [&] { return pending->done || stopping_; });
      }
      if (auto it = pending_.find(hello.nonce); it != pending_.end() && it->second == pending) pending_.erase(it);
      if (pending->done) link = pending->link;
      if (!link) handshaking_.erase(tracked);
    }
    if (!link) {
      PDLINK_LOG(kWarn, "incomplete link attempt from " << from << " (cluster " << hello.cluster_id << ")");
      return;
    }
    PDLINK_LOG(kInfo, "accepted link from " << clusterName(hello.cluster_id) << " at " << from);
    slot->release();  // the handshake is over: this thread serves the link from now on
    serve(link);
    return;
  }

  // REVERSE channel: completes the link whose FORWARD channel is waiting under the same nonce.
  // A peer may not take over the cluster id of another peer's healthy link: only one that proved
  // the secret (it is that cluster), or when a probe finds the old link dead (the peer restarted).
  std::shared_ptr<Link> rival;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rival = links_.slot(hello.cluster_id, false);
  }
  // The probes take up to kProbeWindowMs of this handshake's time; without that much left, the
  // old link is given the benefit of the doubt.
  if (rival && config_.link_secret.empty() &&
      (deadline.remainingMsForPoll() < kProbeWindowMs + kProbeWaitsMs[0] || stillAlive(rival))) {
    return refuse(clusterName(hello.cluster_id) + " already has a healthy link from " + rival->peerAddress() +
                  "; it must unlink first");
  }
  std::shared_ptr<Link> link;
  std::unique_lock<std::mutex> out_lock;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto deadline_tp =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(0, deadline.remainingMsForPoll()));
    // The FORWARD thread registers the nonce before it acks, so an unknown nonce is refused at
    // once; a known one may still be parking its socket, which takes microseconds.
    pending_cv_.wait_until(lock, deadline_tp, [&] {
      auto it = pending_.find(hello.nonce);
      return stopping_ || it == pending_.end() || it->second->forward;
    });
    auto it = pending_.find(hello.nonce);
    if (stopping_ || it == pending_.end() || !it->second->forward || it->second->peer != hello.cluster_id ||
        it->second->forward->isUnix() != local) {
      lock.unlock();
      return refuse("no matching forward channel for this link attempt");
    }
    auto pending = it->second;
    if (links_.live() >= config_.limits.max_links) {
      lock.unlock();
      return refuse("this engine already has the most links it may have");
    }
    if (local && (pending->pid != pid || pending->published_addr != client.gen_addr)) {
      lock.unlock();
      return refuse("the two same-host channels come from different processes");
    }
    if (pending->integrity != session.integrity) {
      lock.unlock();
      return refuse("the two channels disagree about payload integrity");
    }
    handshaking_.erase(pending->forward.get());
    handshaking_.erase(tracked);
    // A forced transport that cannot be had here is refused now, before the link is installed.
    std::shared_ptr<const cma::Process> process;
    Status chosen = local ? chooseTransport(sock, pid, uid, pending->published_addr, &process) : Status::OK();
    if (!chosen.ok()) {
      lock.unlock();
      return refuse(chosen.message());
    }
    std::string endpoint = pending->forward->peer();  // the dialler's end of its forward channel
    link = std::make_shared<Link>(hello.cluster_id, std::move(sock), std::move(*pending->forward), false);
    link->setOrigin(pending->source, hello.nonce, std::move(endpoint));
    if (session.key) link->authenticate(std::move(session.key), pending->session_key, session.integrity);
    const bool direct = process != nullptr;
    link->setPeerProcess(pid, pending->published_addr, pending->grant, std::move(process));
    choosePaths(*link, direct);
    // Nobody may send on the new link before our ack is out; the link is brand new, so taking its
    // mutex under mu_ cannot deadlock.
    out_lock = std::unique_lock<std::mutex>(link->outMutex());
    installLink(link);
    // No longer waiting: counted as a live link from now on, not twice against pdlink.MaxLinks.
    pending_.erase(it);
    pending->link = link;
    pending->done = true;
  }
  pending_cv_.notify_all();
  if (!link->outSocket().sendAll(ok_frame.data(), ok_frame.size(), deadline).ok()) {
    link->breakLink("peer went away during the handshake");
  }
}

std::vector<Status> Engine::unlink(const std::vector<uint64_t>& ids, int64_t timeout_ms, bool force) {
  if (ids.size() > kMaxPeersPerCall) {
    return {Status(Code::kClusterNumExceedLimit, "at most 16 clusters per call, got " + std::to_string(ids.size()))};
  }
  std::vector<Status> out;
  for (uint64_t id : ids) out.push_back(unlinkOne(id, timeout_ms, force));
  return out;
}

Status Engine::unlinkOne(uint64_t cluster_id, int64_t timeout_ms, bool force) {
  std::vector<std::shared_ptr<Link>> links;
  // One-way links: only our own goes, and the peer is not told (its end sees the channels close).
  if (config_.one_way_links) force = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool had = false;
    links = links_.remove(cluster_id, &had);
    if (!had && config_.one_way_links) return Status::OK();  // as the hixl backend: nothing to destroy
    if (!had) return Status(Code::kNotYetLink, "no link to " + clusterName(cluster_id));
  }
  Status result;
  Deadline deadline = Deadline::afterMs(timeout_ms);
  for (const auto& link : links) {
    if (!force && !link->broken()) {
      // Tell the peer so it drops its end too; a dead peer cannot be told.
      std::lock_guard<std::mutex> out(link->outMutex());
      wire::RequestHeader h{wire::Op::kUnlink, 0, 0};
      std::string frame = wire::encode(h);
      Status st = link->out().sendFrame(frame, deadline);
      wire::ResponseHeader rh;
      Status remote;
      if (st.ok()) st = readResponse(link->out(), deadline, &rh, &remote);
      if (!st.ok()) {
        result = Status(Code::kNotifyPromptUnlinkFailed, "unlinked locally, but " + clusterName(cluster_id) +
                                                             " could not be told (" + st.message() +
                                                             "); disconnect on that side too");
      }
    }
    link->breakLink("unlinked by this side");
  }
  PDLINK_LOG(kInfo, "unlinked " << clusterName(cluster_id) << (force ? " (force)" : ""));
  return result;
}

Status Engine::ping(uint64_t cluster_id, int64_t timeout_ms) {
  auto link_r = usableLink(cluster_id);
  if (!link_r.ok()) return link_r.status();
  std::shared_ptr<Link> link = link_r.value();
  std::lock_guard<std::mutex> out(link->outMutex());
  if (link->broken()) return linkDown(*link);
  Deadline deadline = Deadline::afterMs(timeout_ms);
  std::string frame = wire::encode(wire::RequestHeader{wire::Op::kPing, 0, 0});
  Status st = link->out().sendFrame(frame, deadline);
  wire::ResponseHeader rh;
  Status remote;
  if (st.ok()) st = readResponse(link->out(), deadline, &rh, &remote);
  if (!st.ok()) return failTransfer(*link, st, "link check with");
  return remote;
}

Result<uint16_t> Engine::startCommListener(const std::string& ip, uint16_t port) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!initialized_) return Status(Code::kFailed, "engine is not initialized");
    if (comm_listener_) {
      if (comm_listener_->ip() == ip && (port == 0 || comm_listener_->port() == port)) return comm_listener_->port();
      return Status(Code::kParamInvalid, "link() endpoint already bound to " + comm_listener_->ip() + ":" +
                                             std::to_string(comm_listener_->port()));
    }
  }
  auto l = startListener(ip, port);
  if (!l.ok()) return l.status();
  std::unique_ptr<Listener> extra;  // destroyed on return, outside mu_ (its callback takes mu_)
  std::lock_guard<std::mutex> lock(mu_);
  if (comm_listener_) {
    extra = std::move(l.value());  // lost a race with a concurrent call: keep the first
  } else {
    comm_listener_ = std::move(l.value());
  }
  return comm_listener_->port();
}

std::vector<LinkInfo> Engine::links() const {
  std::lock_guard<std::mutex> lock(mu_);
  return links_.infos();
}

uint64_t Engine::linkedSince(uint64_t after, std::vector<uint64_t>* peers) const {
  std::lock_guard<std::mutex> lock(mu_);
  peers->clear();
  for (const auto& [seq, peer] : link_log_) {
    if (seq > after) peers->push_back(peer);
  }
  return link_seq_;
}

}  // namespace pdlink
