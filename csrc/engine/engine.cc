#include "engine/engine.h"

#include <algorithm>
#include <atomic>
#include <future>
#include <random>

#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "core/log.h"
#include "core/sha256.h"
#include "transport/cma.h"
#include "transport/wire.h"

namespace pdlink {
namespace {

constexpr size_t kMaxPeersPerCall = 16;
constexpr size_t kMaxHandshakes = 64;  // connections mid-handshake; more are dropped (flood guard)
constexpr size_t kIovBatch = 1024;

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

wire::HostIdentity localIdentity() {
  wire::HostIdentity id;
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
  id.pid = static_cast<uint32_t>(::getpid());
  return id;
}

Status linkDown(const Link& link) {
  return Status(Code::kLinkFailed, "the link to " + clusterName(link.peer()) + " is down (" + link.brokenReason() +
                                       "); call unlink_clusters, then link_clusters again");
}

bool usesKeyCommit(wire::TargetKind kind) {
  return kind == wire::TargetKind::kRequestKey || kind == wire::TargetKind::kIdIndex;
}

// Sends a response header plus its message text.
Status sendResponse(Socket& s, const Status& st, Deadline deadline) {
  std::string msg = st.message().substr(0, wire::kMaxMessageBytes);
  wire::ResponseHeader h{static_cast<uint32_t>(st.code()), static_cast<uint32_t>(msg.size()), 0};
  std::string frame = wire::encode(h) + msg;
  return s.sendAll(frame.data(), frame.size(), deadline);
}

// Reads a response header, and its message text when the status is an error.
Status readResponse(Socket& s, Deadline deadline, wire::ResponseHeader* h, Status* remote) {
  uint8_t buf[wire::kResponseHeaderBytes];
  PDLINK_RETURN_IF_ERROR(s.recvAll(buf, sizeof(buf), deadline));
  PDLINK_RETURN_IF_ERROR(wire::decode(buf, sizeof(buf), h));
  std::string msg(h->message_len, '\0');
  if (h->message_len > 0) PDLINK_RETURN_IF_ERROR(s.recvAll(msg.data(), msg.size(), deadline));
  *remote = h->status == 0 ? Status::OK() : Status(static_cast<Code>(h->status), msg);
  return Status::OK();
}

// Moves the payload of one transfer between a socket and memory, tensor-major, batching iovecs
// so that thousands of small blocks cost a few syscalls, not one each.
Status movePayload(Socket& s, bool sending, const std::vector<uint64_t>& addrs, const std::vector<uint32_t>& tensors,
                   uint64_t base, const std::vector<wire::Run>& runs, Deadline deadline, std::vector<iovec> iov = {}) {
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

// Client half of a channel handshake: hello out, ack in (checking the peer's identity against
// *peer_id, or learning it when that is kAnyCluster), then the challenge-response.
Status helloExchange(Socket& s, wire::Hello hello, const std::string& secret, uint64_t* peer_id,
                     wire::HostIdentity* peer_identity, Deadline deadline) {
  randomBytes(hello.challenge, sizeof(hello.challenge));
  std::string frame = wire::encode(hello);
  PDLINK_RETURN_IF_ERROR(s.sendAll(frame.data(), frame.size(), deadline));
  uint8_t buf[wire::kHelloAckFixedBytes];
  PDLINK_RETURN_IF_ERROR(s.recvAll(buf, sizeof(buf), deadline));
  wire::HelloAck ack;
  uint32_t msg_len = 0;
  PDLINK_RETURN_IF_ERROR(wire::decodeFixed(buf, sizeof(buf), &ack, &msg_len));
  std::string msg(msg_len, '\0');
  if (msg_len > 0) PDLINK_RETURN_IF_ERROR(s.recvAll(msg.data(), msg.size(), deadline));
  if (ack.status != 0) return Status(Code::kLinkFailed, "peer refused the link: " + msg);
  *peer_identity = ack.identity;
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
  Digest mine = linkProof(secret, 'C', hello.challenge, ack.challenge, hello.cluster_id, ack.cluster_id,
                          hello.nonce, channel);
  PDLINK_RETURN_IF_ERROR(s.sendAll(mine.data(), mine.size(), deadline));
  uint8_t rbuf[wire::kAuthResultFixedBytes];
  PDLINK_RETURN_IF_ERROR(s.recvAll(rbuf, sizeof(rbuf), deadline));
  wire::AuthResult result;
  PDLINK_RETURN_IF_ERROR(wire::decodeFixed(rbuf, sizeof(rbuf), &result, &msg_len));
  msg.assign(msg_len, '\0');
  if (msg_len > 0) PDLINK_RETURN_IF_ERROR(s.recvAll(msg.data(), msg.size(), deadline));
  if (result.status != 0) return Status(Code::kLinkFailed, "peer refused the link: " + msg);
  return Status::OK();
}

}  // namespace

struct Engine::Plan {
  std::shared_ptr<CacheEntry> local;
  std::vector<uint32_t> local_tensors;
  std::vector<wire::Run> local_runs;
  wire::TransferBody remote;  // target, block size, remote tensors and runs
  uint64_t payload = 0;
};

Engine::Engine(std::shared_ptr<Backend> backend) : backend_(std::move(backend)) {}

Engine::~Engine() { finalize(); }

bool Engine::initialized() const {
  std::lock_guard<std::mutex> lock(mu_);
  return initialized_;
}

Role Engine::role() const {
  std::lock_guard<std::mutex> lock(mu_);
  return role_;
}

uint16_t Engine::listenPort() const {
  std::lock_guard<std::mutex> lock(mu_);
  return listener_ ? listener_->port() : 0;
}

Status Engine::initialize(const EngineConfig& config) {
  std::lock_guard<std::mutex> lock(mu_);
  if (initialized_) return Status::OK();
  if (config.sync_timeout_ms <= 0) return Status(Code::kParamInvalid, "sync timeout must be > 0 ms");
  config_ = config;
  if (config.device_pool.bytes > 0) {
    auto pool = MemPool::create(backend_, Placement::kDevice, config.device_pool.bytes, config.device_pool.page_shift);
    if (!pool.ok()) return pool.status();
    device_pool_ = pool.value();
  }
  if (config.host_pool.bytes > 0) {
    auto pool = MemPool::create(backend_, Placement::kHost, config.host_pool.bytes, config.host_pool.page_shift);
    if (!pool.ok()) {
      device_pool_.reset();
      return pool.status();
    }
    host_pool_ = pool.value();
  }
  if (!config.listen_ip.empty()) {
    auto l = startListener(config.listen_ip, config.listen_port);
    if (!l.ok()) {
      device_pool_.reset();
      host_pool_.reset();
      return l.status();
    }
    listener_ = std::move(l.value());
  }
  identity_ = localIdentity();
  if (config.transport != Transport::kTcp) {
    identity_.transports |= wire::kTransportCma;
    cma::allowPeers();
  }
  identity_.gen_addr = reinterpret_cast<uint64_t>(registry_.generation());
  role_ = config.role;
  stopping_ = false;
  initialized_ = true;
  PDLINK_LOG(kInfo, "engine " << config.cluster_id << " initialised on backend " << backend_->name()
                              << (listener_ ? ", listening on port " + std::to_string(listener_->port()) : ""));
  return Status::OK();
}

void Engine::finalize() {
  std::vector<std::shared_ptr<Link>> links;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!initialized_) return;
    stopping_ = true;
    for (auto& [id, link] : links_) links.push_back(link);
    links_.clear();
  }
  stopListeners();
  for (auto& link : links) {
    if (!link->broken()) {
      std::unique_lock<std::mutex> out(link->outMutex(), std::try_to_lock);
      if (out.owns_lock()) {  // tell the peer, best effort, without waiting on a busy link
        wire::RequestHeader h{wire::Op::kUnlink, 0, 0};
        std::string frame = wire::encode(h);
        (void)link->out().sendAll(frame.data(), frame.size(), Deadline::afterMs(200));
      }
    }
    link->breakLink("engine finalized");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Socket* s : handshaking_) s->shutdown();
  }
  pending_cv_.notify_all();
  {
    std::lock_guard<std::mutex> lock(threads_mu_);
    for (auto& w : workers_) w.thread.join();
    workers_.clear();
  }
  std::lock_guard<std::mutex> lock(mu_);
  pending_.clear();
  registry_.clear();
  device_pool_.reset();
  host_pool_.reset();
  initialized_ = false;
  stopping_ = false;
}

// ---------------------------------------------------------------- threads

void Engine::spawn(std::function<void()> fn) {
  // Join the threads that finished, so that an engine that only accepts links (and never calls
  // link/unlink, which reap too) does not keep their stacks: measured 17 KiB per link before.
  reapThreads();
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::lock_guard<std::mutex> lock(threads_mu_);
  workers_.push_back(Worker{std::thread([fn = std::move(fn), done] {
                              fn();
                              done->store(true);
                            }),
                            done});
}

void Engine::reapThreads() {
  std::lock_guard<std::mutex> lock(threads_mu_);
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (it->done->load()) {
      it->thread.join();
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
}

// ---------------------------------------------------------------- listener and roles

Result<std::unique_ptr<Listener>> Engine::startListener(const std::string& ip, uint16_t port) {
  return Listener::start(ip, port, [this](Socket s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      if (handshaking_.size() >= kMaxHandshakes) {
        PDLINK_LOG(kWarn, "dropping connection from " << s.peer() << ": too many handshakes in progress");
        return;
      }
    }
    auto holder = std::make_shared<Socket>(std::move(s));
    spawn([this, holder] { handleIncoming(std::move(*holder)); });
  });
}

void Engine::stopListeners() {
  std::unique_ptr<Listener> a, b;
  {
    std::lock_guard<std::mutex> lock(mu_);
    a = std::move(listener_);
    b = std::move(comm_listener_);
  }
  // Destroyed outside mu_: the accept callback takes it.
}

Status Engine::switchRole(Role role, const std::string& listen_ip, uint16_t listen_port) {
  std::unique_ptr<Listener> old, fresh;
  bool keep = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!initialized_) return Status(Code::kFailed, "engine is not initialized");
    if (!links_.empty() || !linking_.empty()) {
      std::string ids;
      for (auto& [id, l] : links_) ids += (ids.empty() ? "" : ", ") + std::to_string(id);
      return Status(Code::kExistLink, "cannot switch role while links exist (peer clusters: " + ids +
                                          "); call unlink_clusters first");
    }
    keep = !listen_ip.empty() && listener_ && listen_ip == listener_->ip() &&
           (listen_port == listener_->port() || listen_port == 0);
    // The new address is bound before the old one is given up, so a failed switch changes
    // nothing; only a move to the same port on another address must release the old one first.
    if (!keep && !listen_ip.empty() && listener_ && listen_port == listener_->port()) old = std::move(listener_);
  }
  old.reset();  // joins the accept thread, outside mu_
  if (!keep && !listen_ip.empty()) {
    auto l = startListener(listen_ip, listen_port);
    if (!l.ok()) return l.status();
    fresh = std::move(l.value());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!keep) {
      old = std::move(listener_);
      listener_ = std::move(fresh);
    }
    role_ = role;
    PDLINK_LOG(kInfo, "engine " << config_.cluster_id << " switched to role " << static_cast<int>(role)
                                << (listener_ ? ", listening on port " + std::to_string(listener_->port())
                                              : ", not listening"));
  }
  return Status::OK();
}

// ---------------------------------------------------------------- links

std::vector<Status> Engine::link(const std::vector<PeerAddress>& peers, int64_t timeout_ms,
                                 std::vector<uint64_t>* peer_ids) {
  reapThreads();
  if (peers.size() > kMaxPeersPerCall) {
    return {Status(Code::kClusterNumExceedLimit, "at most 16 clusters per call, got " + std::to_string(peers.size()))};
  }
  if (!initialized()) return {Status(Code::kFailed, "engine is not initialized")};
  // Peers are linked in parallel: one slow or dead peer costs its own timeout, not everyone's.
  std::vector<uint64_t> ids(peers.size(), wire::kAnyCluster);
  std::vector<std::future<Status>> futures;
  for (size_t i = 0; i < peers.size(); ++i) {
    futures.push_back(std::async(std::launch::async, [this, &peers, &ids, i, timeout_ms] {
      return linkOne(peers[i], timeout_ms, &ids[i]);
    }));
  }
  std::vector<Status> out;
  for (auto& f : futures) out.push_back(f.get());
  if (peer_ids) *peer_ids = std::move(ids);
  return out;
}

Status Engine::linkOne(const PeerAddress& peer, int64_t timeout_ms, uint64_t* linked_id) {
  const bool known = peer.cluster_id != wire::kAnyCluster;
  const std::string where = peer.ip + ":" + std::to_string(peer.port);
  // Guards against a second link attempt to the same peer, by id when known, else by address.
  const uint64_t guard_key = known ? peer.cluster_id : std::hash<std::string>{}(where) | (uint64_t{1} << 63);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (known && peer.cluster_id == config_.cluster_id) {
      return Status(Code::kParamInvalid, "cannot link to this engine's own cluster id " + std::to_string(peer.cluster_id));
    }
    for (auto& [id, l] : links_) {
      if ((known && id == peer.cluster_id) || (!known && l->peerAddress() == where)) {
        if (linked_id) *linked_id = id;
        return Status(Code::kAlreadyLink, clusterName(id) + " is already linked");
      }
    }
    if (!linking_.insert(guard_key).second) {
      return Status(Code::kProcessingLink, "a link to " + (known ? clusterName(peer.cluster_id) : where) +
                                               " is in progress");
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
  wire::Hello hello;
  hello.cluster_id = config_.cluster_id;
  hello.expected_peer = peer.cluster_id;
  hello.nonce = makeNonce();
  hello.identity = identity_;
  uint64_t peer_id = peer.cluster_id;
  wire::HostIdentity peer_identity;
  auto fwd = Socket::connect(peer.ip, peer.port, deadline);
  if (!fwd.ok()) return linkError(peer, fwd.status());
  Status st = helloExchange(fwd.value(), hello, config_.link_secret, &peer_id, &peer_identity, deadline);
  if (!st.ok()) return linkError(peer, st);
  if (peer_id == config_.cluster_id) {
    return linkError(peer, Status(Code::kParamInvalid, "the peer uses this engine's own cluster id"));
  }
  auto rev = Socket::connect(peer.ip, peer.port, deadline);
  if (!rev.ok()) return linkError(peer, rev.status());
  hello.channel = wire::Channel::kReverse;
  st = helloExchange(rev.value(), hello, config_.link_secret, &peer_id, &peer_identity, deadline);
  if (!st.ok()) return linkError(peer, st);

  bool direct = false;
  st = chooseTransport(peer_identity, &direct);
  if (!st.ok()) return linkError(peer, st);  // the peer sees the channels close
  auto link = std::make_shared<Link>(peer_id, std::move(fwd.value()), std::move(rev.value()), true);
  if (direct) link->enableDirect(static_cast<pid_t>(peer_identity.pid), peer_identity.gen_addr);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || !initialized_) return Status(Code::kLinkFailed, "engine is finalizing");
    installLink(link);
  }
  spawn([this, link] { serve(link); });
  if (linked_id) *linked_id = peer_id;
  PDLINK_LOG(kInfo, "linked to " << clusterName(peer_id) << " at " << where << " over " << link->transport());
  return Status::OK();
}

Status Engine::chooseTransport(const wire::HostIdentity& peer, bool* direct) const {
  *direct = false;
  if (config_.transport == Transport::kTcp) return Status::OK();
  const bool possible = identity_.sameHost(peer) && (peer.transports & wire::kTransportCma) &&
                        (identity_.transports & wire::kTransportCma);
  if (possible) {
    auto word = cma::readWord(static_cast<pid_t>(peer.pid), peer.gen_addr);
    if (word.ok()) {
      *direct = true;
      return Status::OK();
    }
    if (config_.transport == Transport::kCma) return word.status();
    PDLINK_LOG(kInfo, "same-host peer pid " << peer.pid << ": " << word.status().message() << "; using tcp");
    return Status::OK();
  }
  if (config_.transport == Transport::kCma) {
    return Status(Code::kLinkFailed, "transport 'cma' was forced but the peer is not on this host or refuses it");
  }
  return Status::OK();
}

void Engine::installLink(const std::shared_ptr<Link>& link) {
  auto it = links_.find(link->peer());
  if (it != links_.end()) {
    // The peer re-linked without unlinking (it restarted, or force-unlinked its end): the old
    // entity is stale, as in llm_datadist's force re-link.
    PDLINK_LOG(kInfo, "replacing stale link to " << clusterName(link->peer()));
    it->second->breakLink("replaced by a new link from the peer");
  }
  links_[link->peer()] = link;
}

void Engine::handleIncoming(Socket sock) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    handshaking_.insert(&sock);
  }
  Socket* tracked = &sock;
  auto untrack = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    handshaking_.erase(tracked);
  };
  Deadline deadline = Deadline::afterMs(config_.handshake_timeout_ms);
  const std::string from = sock.peer();
  bool acked = false;  // once our HelloAck is out, a refusal is sent as an AuthResult
  auto refuse = [&](const std::string& why) {
    PDLINK_LOG(kWarn, "refused link from " << from << ": " << why);
    std::string frame;
    if (acked) {
      frame = wire::encode(wire::AuthResult{static_cast<uint32_t>(Code::kLinkFailed), why});
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
  Status st = sock.recvAll(buf, wire::kHelloPrefixBytes, deadline);
  if (st.ok()) st = wire::decodePrefix(buf, wire::kHelloPrefixBytes, &hello);
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropped connection from " << from << ": " << st.message());
    untrack();
    return;
  }
  if (hello.version != wire::kProtocolVersion) {
    return refuse("protocol version mismatch: peer speaks " + std::to_string(hello.version) + ", this engine " +
                  std::to_string(wire::kProtocolVersion));
  }
  st = sock.recvAll(buf + wire::kHelloPrefixBytes, wire::kHelloRestBytes, deadline);
  if (st.ok()) st = wire::decodeRest(buf + wire::kHelloPrefixBytes, wire::kHelloRestBytes, &hello);
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
  // about this engine's memory is reachable before the dialler's proof has been checked.
  wire::HelloAck ack;
  ack.cluster_id = config_.cluster_id;
  ack.identity = identity_;
  randomBytes(ack.challenge, sizeof(ack.challenge));
  const uint8_t channel = static_cast<uint8_t>(hello.channel);
  Digest server_proof = linkProof(config_.link_secret, 'S', hello.challenge, ack.challenge, hello.cluster_id, config_.cluster_id,
                                  hello.nonce, channel);
  std::memcpy(ack.proof, server_proof.data(), sizeof(ack.proof));
  std::string ack_frame = wire::encode(ack);
  st = sock.sendAll(ack_frame.data(), ack_frame.size(), deadline);
  acked = true;
  uint8_t client_proof[wire::kProofBytes];
  if (st.ok()) st = sock.recvAll(client_proof, sizeof(client_proof), deadline);
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropped connection from " << from << " during authentication: " << st.message());
    untrack();
    return;
  }
  Digest expected = linkProof(config_.link_secret, 'C', hello.challenge, ack.challenge, hello.cluster_id, config_.cluster_id,
                              hello.nonce, channel);
  if (!constantTimeEqual(client_proof, expected.data(), expected.size())) {
    return refuse(std::string("authentication failed for ") + clusterName(hello.cluster_id) +
                  (config_.link_secret.empty() ? ": this engine has no link secret but the peer sent a proof"
                                               : ": the peer does not know this engine's link secret"));
  }
  const std::string ok_frame = wire::encode(wire::AuthResult{0, ""});

  if (hello.channel == wire::Channel::kForward) {
    auto pending = std::make_shared<PendingLink>();
    pending->peer = hello.cluster_id;
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
        pending_cv_.wait_until(lock, std::chrono::steady_clock::now() +
                                         std::chrono::milliseconds(std::max(0, deadline.remainingMsForPoll())),
                               [&] { return pending->done || stopping_; });
      }
      pending_.erase(hello.nonce);
      if (pending->done) link = pending->link;
      if (!link) handshaking_.erase(tracked);
    }
    if (!link) {
      PDLINK_LOG(kWarn, "incomplete link attempt from " << from << " (cluster " << hello.cluster_id << ")");
      return;
    }
    PDLINK_LOG(kInfo, "accepted link from " << clusterName(hello.cluster_id) << " at " << from);
    serve(link);
    return;
  }

  // REVERSE channel: completes the link whose FORWARD channel is waiting under the same nonce.
  std::shared_ptr<Link> link;
  std::unique_lock<std::mutex> out_lock;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto deadline_tp = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(0, deadline.remainingMsForPoll()));
    // The FORWARD thread registers the nonce before it acks, so an unknown nonce is refused at
    // once; a known one may still be parking its socket, which takes microseconds.
    pending_cv_.wait_until(lock, deadline_tp, [&] {
      auto it = pending_.find(hello.nonce);
      return stopping_ || it == pending_.end() || it->second->forward;
    });
    auto it = pending_.find(hello.nonce);
    if (stopping_ || it == pending_.end() || !it->second->forward || it->second->peer != hello.cluster_id) {
      lock.unlock();
      return refuse("no matching forward channel for this link attempt");
    }
    auto pending = it->second;
    handshaking_.erase(pending->forward.get());
    handshaking_.erase(tracked);
    // A forced transport that cannot be had here is refused now, before the link is installed.
    bool direct = false;
    Status chosen = chooseTransport(hello.identity, &direct);
    if (!chosen.ok()) {
      lock.unlock();
      return refuse(chosen.message());
    }
    link = std::make_shared<Link>(hello.cluster_id, std::move(sock), std::move(*pending->forward), false);
    if (direct) link->enableDirect(static_cast<pid_t>(hello.identity.pid), hello.identity.gen_addr);
    // Nobody may send on the new link before our ack is out; the link is brand new, so taking its
    // mutex under mu_ cannot deadlock.
    out_lock = std::unique_lock<std::mutex>(link->outMutex());
    installLink(link);
    pending->link = link;
    pending->done = true;
  }
  pending_cv_.notify_all();
  if (!link->out().sendAll(ok_frame.data(), ok_frame.size(), deadline).ok()) {
    link->breakLink("peer went away during the handshake");
  }
}

std::vector<Status> Engine::unlink(const std::vector<uint64_t>& ids, int64_t timeout_ms, bool force) {
  reapThreads();
  if (ids.size() > kMaxPeersPerCall) {
    return {Status(Code::kClusterNumExceedLimit, "at most 16 clusters per call, got " + std::to_string(ids.size()))};
  }
  std::vector<Status> out;
  for (uint64_t id : ids) out.push_back(unlinkOne(id, timeout_ms, force));
  return out;
}

Status Engine::unlinkOne(uint64_t cluster_id, int64_t timeout_ms, bool force) {
  std::shared_ptr<Link> link;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(cluster_id);
    if (it == links_.end()) return Status(Code::kNotYetLink, "no link to " + clusterName(cluster_id));
    link = it->second;
    links_.erase(it);
  }
  Status result;
  if (!force && !link->broken()) {
    // Tell the peer so it drops its end too; a dead peer cannot be told.
    std::lock_guard<std::mutex> out(link->outMutex());
    Deadline deadline = Deadline::afterMs(timeout_ms);
    wire::RequestHeader h{wire::Op::kUnlink, 0, 0};
    std::string frame = wire::encode(h);
    Status st = link->out().sendAll(frame.data(), frame.size(), deadline);
    wire::ResponseHeader rh;
    Status remote;
    if (st.ok()) st = readResponse(link->out(), deadline, &rh, &remote);
    if (!st.ok()) {
      result = Status(Code::kNotifyPromptUnlinkFailed,
                      "unlinked locally, but " + clusterName(cluster_id) + " could not be told (" + st.message() +
                          "); call unlink_clusters on that side too");
    }
  }
  link->breakLink("unlinked by this side");
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
  Status st = link->out().sendAll(frame.data(), frame.size(), deadline);
  wire::ResponseHeader rh;
  Status remote;
  if (st.ok()) st = readResponse(link->out(), deadline, &rh, &remote);
  if (!st.ok()) return failTransfer(link, st, "link check with");
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
  std::vector<LinkInfo> out;
  for (auto& [id, l] : links_) {
    out.push_back(LinkInfo{id, l->peerAddress(), l->initiator(), l->broken(), l->brokenReason(), l->transport()});
  }
  return out;
}

// ---------------------------------------------------------------- serving

void Engine::serve(const std::shared_ptr<Link>& link) {
  bool unlinked = false;
  Status st;
  std::vector<std::shared_ptr<CacheEntry>> pinned;  // caches a peer is copying directly
  while (st.ok() && !unlinked) st = serveOne(link, &unlinked, &pinned);
  if (!unlinked) {
    std::string why = st.message().find("closed by peer") != std::string::npos ? "peer closed the connection"
                                                                                : st.message();
    if (!link->broken()) PDLINK_LOG(kInfo, "link to " << clusterName(link->peer()) << " is down: " << why);
    link->breakLink(why);
  }
}

Status Engine::serveOne(const std::shared_ptr<Link>& link, bool* unlinked,
                        std::vector<std::shared_ptr<CacheEntry>>* pinned) {
  Socket& s = link->in();
  PDLINK_RETURN_IF_ERROR(s.waitReadable(Deadline::never()));
  // A peer that stalls mid-frame only ties up this link's thread, and only until this deadline.
  Deadline deadline = Deadline::afterMs(std::max<int64_t>(2 * config_.sync_timeout_ms, 5000));
  uint8_t hbuf[wire::kRequestHeaderBytes];
  PDLINK_RETURN_IF_ERROR(s.recvAll(hbuf, sizeof(hbuf), deadline));
  wire::RequestHeader h;
  Status st = wire::decode(hbuf, sizeof(hbuf), &h);
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropping link to " << clusterName(link->peer()) << ": " << st.message());
    return st;
  }
  std::vector<uint8_t> body(h.body_len);
  if (h.body_len > 0) PDLINK_RETURN_IF_ERROR(s.recvAll(body.data(), body.size(), deadline));
  // The requester sends its next frame only after its direct copy finished: unpin.
  pinned->clear();

  if (h.op == wire::Op::kPing) return sendResponse(s, Status::OK(), deadline);
  if (h.op == wire::Op::kUnlink) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = links_.find(link->peer());
      if (it != links_.end() && it->second == link) links_.erase(it);
    }
    (void)sendResponse(s, Status::OK(), deadline);
    link->breakLink("unlinked by the peer");
    *unlinked = true;
    PDLINK_LOG(kInfo, clusterName(link->peer()) << " unlinked");
    return Status::OK();
  }

  wire::TransferBody tb;
  st = wire::decode(body.data(), body.size(), &tb);
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropping link to " << clusterName(link->peer()) << ": " << st.message());
    return st;
  }
  if (h.op == wire::Op::kCommit) {
    registry_.commitRead(tb.target, tb.tensors);
    return Status::OK();
  }
  if (h.op == wire::Op::kRelease) return Status::OK();
  if (h.op == wire::Op::kDescribe) {
    auto d = tb.target.kind == wire::TargetKind::kBlocks
                 ? registry_.describe(tb.target.model_id)
                 : Result<wire::CacheDescriptor>(Status(Code::kParamInvalid, "describe needs a blocks target"));
    if (!d.ok()) return sendResponse(s, d.status(), deadline);
    std::string payload = wire::encode(d.value());
    std::string head = wire::encode(wire::ResponseHeader{0, 0, payload.size()}) + payload;
    return s.sendAll(head.data(), head.size(), deadline);
  }
  auto payload = tb.payloadBytes();
  bool is_write = h.op == wire::Op::kWrite;
  const bool direct = h.flags & wire::kFlagDirect;
  if (!payload.ok() || h.payload_len != (is_write && !direct ? payload.value() : 0)) {
    // The stream cannot be resynchronised without a trustworthy length.
    PDLINK_LOG(kWarn, "dropping link to " << clusterName(link->peer()) << ": inconsistent payload length");
    return Status(Code::kLinkFailed, "inconsistent payload length");
  }
  auto resolved = registry_.resolve(tb, is_write);
  if (!resolved.ok()) {
    PDLINK_LOG(kDebug, "rejected " << (is_write ? "write" : "read") << " from " << clusterName(link->peer())
                                   << ": " << resolved.status().message());
    if (is_write && !direct) PDLINK_RETURN_IF_ERROR(s.discard(h.payload_len, deadline));
    return sendResponse(s, resolved.status(), deadline);
  }
  const Resolved& r = resolved.value();
  if (direct) {
    // Checked like any access; answer where the bytes are and keep them alive until the next frame.
    std::string list;
    list.reserve(r.tensors.size() * r.runs.size() * 16);
    for (uint32_t t : r.tensors) {
      for (const wire::Run& run : r.runs) {
        uint64_t addr = r.addrs[t] + r.base + run.offset;
        list.append(reinterpret_cast<const char*>(&addr), 8);
        list.append(reinterpret_cast<const char*>(&run.length), 8);
      }
    }
    *pinned = r.keep;
    std::string head = wire::encode(wire::ResponseHeader{0, 0, list.size()}) + list;
    return s.sendAll(head.data(), head.size(), deadline);
  }
  if (is_write) {
    PDLINK_RETURN_IF_ERROR(movePayload(s, false, r.addrs, r.tensors, r.base, r.runs, deadline));
    return sendResponse(s, Status::OK(), deadline);
  }
  wire::ResponseHeader rh{0, 0, payload.value()};
  std::string head = wire::encode(rh);
  std::vector<iovec> iov{{head.data(), head.size()}};
  return movePayload(s, true, r.addrs, r.tensors, r.base, r.runs, deadline, std::move(iov));
}

// ---------------------------------------------------------------- transfers

Result<std::shared_ptr<Link>> Engine::usableLink(uint64_t peer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!initialized_) return Status(Code::kFailed, "engine is not initialized");
  auto it = links_.find(peer);
  if (it == links_.end()) {
    return Status(Code::kNotYetLink, "no link to " + clusterName(peer) + "; call link_clusters first");
  }
  if (it->second->broken()) {
    return linkDown(*it->second);
  }
  return it->second;
}

Status Engine::failTransfer(const std::shared_ptr<Link>& link, const Status& st, const char* what) {
  link->breakLink(st.message());
  Code code = st.code() == Code::kTimeout ? Code::kTimeout : Code::kLinkFailed;
  return Status(code, std::string(what) + " " + clusterName(link->peer()) + " failed: " + st.message() +
                          "; the link is now unusable: call unlink_clusters, then link_clusters again");
}

Result<Engine::Plan> Engine::plan(const TransferSpec& spec, bool is_push) {
  auto local = registry_.get(spec.local_cache_id);
  if (!local.ok()) return local.status();
  Plan p;
  p.local = local.value();
  const CacheLayout& L = p.local->layout;
  const uint64_t stride = L.stride();
  if (stride == 0) return Status(Code::kParamInvalid, "local cache has zero-sized slots");
  // Tensor mapping.
  if (spec.local_tensors.empty()) {
    for (uint32_t t = 0; t < L.num_tensors; ++t) p.local_tensors.push_back(t);
    p.remote.tensors = p.local_tensors;
  } else {
    if (spec.local_tensors.size() != spec.remote_tensors.size()) {
      return Status(Code::kParamInvalid, "source and destination layer ranges cover different tensor counts");
    }
    for (uint32_t t : spec.local_tensors) {
      if (t >= L.num_tensors) {
        return Status(Code::kParamInvalid, "tensor index " + std::to_string(t) + " out of range: local cache has " +
                                               std::to_string(L.num_tensors) + " tensors");
      }
    }
    p.local_tensors = spec.local_tensors;
    p.remote.tensors = spec.remote_tensors;
  }
  p.remote.target = spec.target;
  using Mode = TransferSpec::Mode;
  if (spec.mode == Mode::kExplicit) {
    if (spec.local_runs.size() != spec.remote_runs.size() || spec.local_runs.empty()) {
      return Status(Code::kParamInvalid, "local and remote run lists must be non-empty and of equal length");
    }
    for (size_t i = 0; i < spec.local_runs.size(); ++i) {
      const wire::Run& l = spec.local_runs[i];
      uint64_t end = 0;
      if (l.length == 0 || l.length != spec.remote_runs[i].length ||
          __builtin_add_overflow(l.offset, l.length, &end) || end > L.tensor_size) {
        return Status(Code::kParamInvalid, "local range [" + std::to_string(l.offset) + ", +" +
                                               std::to_string(l.length) + ") is outside the local tensors (" +
                                               std::to_string(L.tensor_size) + " bytes) or mismatches the remote one");
      }
    }
    p.local_runs = spec.local_runs;
    p.remote.runs = spec.remote_runs;
  } else if (spec.mode == Mode::kSlotToSlot) {
    if (L.is_blocks) return Status(Code::kParamInvalid, "this transfer needs a non-blocks local cache");
    if (spec.local_slot >= L.num_slots) {
      return Status(Code::kParamInvalid, "batch_index " + std::to_string(spec.local_slot) +
                                             " out of range: local batch size is " + std::to_string(L.num_slots));
    }
    uint64_t len = spec.size > 0 ? static_cast<uint64_t>(spec.size) : stride;
    if (len > stride) {
      return Status(Code::kParamInvalid, "size " + std::to_string(len) + " exceeds the local slot size " +
                                             std::to_string(stride));
    }
    p.local_runs.push_back({spec.local_slot * stride, len});
    p.remote.runs.push_back({0, len});
  } else {
    if (!L.is_blocks) return Status(Code::kParamInvalid, "this transfer needs a blocks cache on the local side");
    const bool pairs = spec.mode == Mode::kBlocksToBlocks;
    if (spec.local_blocks.empty()) return Status(Code::kParamInvalid, "the block list is empty");
    if (pairs && spec.local_blocks.size() != spec.remote_blocks.size()) {
      return Status(Code::kParamInvalid, "src_blocks and dst_blocks differ in length (" +
                                             std::to_string(spec.remote_blocks.size()) + " vs " +
                                             std::to_string(spec.local_blocks.size()) + ")");
    }
    if (is_push && !pairs) return Status(Code::kParamInvalid, "pushing a blocks cache into a slot is not supported");
    p.remote.block_size = pairs ? stride : 0;
    const uint64_t max_remote = UINT64_MAX / stride;
    for (size_t i = 0; i < spec.local_blocks.size(); ++i) {
      int64_t lb = spec.local_blocks[i];
      int64_t rb = pairs ? spec.remote_blocks[i] : static_cast<int64_t>(i);
      if (lb < 0 || static_cast<uint64_t>(lb) >= L.num_slots) {
        return Status(Code::kParamInvalid, "block index " + std::to_string(lb) + " out of range: local cache has " +
                                               std::to_string(L.num_slots) + " blocks");
      }
      if (rb < 0 || static_cast<uint64_t>(rb) >= max_remote) {
        return Status(Code::kParamInvalid, "remote block index " + std::to_string(rb) + " out of range");
      }
      uint64_t loff = static_cast<uint64_t>(lb) * stride, roff = static_cast<uint64_t>(rb) * stride;
      // Coalesce runs that are consecutive on both sides into one range.
      if (!p.local_runs.empty() && p.local_runs.back().offset + p.local_runs.back().length == loff &&
          p.remote.runs.back().offset + p.remote.runs.back().length == roff) {
        p.local_runs.back().length += stride;
        p.remote.runs.back().length += stride;
      } else {
        p.local_runs.push_back({loff, stride});
        p.remote.runs.push_back({roff, stride});
      }
    }
  }
  auto payload = p.remote.payloadBytes();
  if (!payload.ok()) return payload.status();
  p.payload = payload.value();
  return p;
}

Status Engine::pull(const TransferSpec& spec) { return transfer(spec, false); }
Status Engine::push(const TransferSpec& spec) { return transfer(spec, true); }

Status Engine::transfer(const TransferSpec& spec, bool is_push) {
  auto link_r = usableLink(spec.peer_cluster_id);
  if (!link_r.ok()) return link_r.status();
  auto p_r = plan(spec, is_push);
  if (!p_r.ok()) return p_r.status();
  std::shared_ptr<Link> link = link_r.value();
  Plan& p = p_r.value();
  const char* what = is_push ? "push to" : "pull from";

  std::lock_guard<std::mutex> out(link->outMutex());
  if (link->broken()) {  // broke while we waited for the channel
    return linkDown(*link);
  }
  Deadline deadline = Deadline::afterMs(config_.sync_timeout_ms);
  if (link->direct()) return directTransfer(link, p, is_push, deadline, what);
  Socket& s = link->out();
  std::string body = wire::encode(p.remote);
  wire::RequestHeader h{is_push ? wire::Op::kWrite : wire::Op::kRead, static_cast<uint32_t>(body.size()),
                        is_push ? p.payload : 0};
  if (body.size() > wire::kMaxBodyBytes) {
    return Status(Code::kParamInvalid, "too many block runs in one transfer (" + std::to_string(p.remote.runs.size()) + ")");
  }
  std::string head = wire::encode(h);
  std::vector<iovec> iov{{head.data(), head.size()}, {body.data(), body.size()}};
  Status st;
  if (is_push) {
    st = movePayload(s, true, p.local->addrs, p.local_tensors, 0, p.local_runs, deadline, std::move(iov));
  } else {
    st = s.sendv(iov, deadline);
  }
  if (!st.ok()) return failTransfer(link, st, what);
  wire::ResponseHeader rh;
  Status remote;
  st = readResponse(s, deadline, &rh, &remote);
  if (!st.ok()) return failTransfer(link, st, what);
  if (!remote.ok()) {
    return Status(remote.code(), std::string(what) + " " + clusterName(link->peer()) + ": " + remote.message());
  }
  if (is_push) return Status::OK();
  if (rh.payload_len != p.payload) {
    return failTransfer(link, Status(Code::kLinkFailed, "peer sent " + std::to_string(rh.payload_len) +
                                                            " bytes, expected " + std::to_string(p.payload)),
                        what);
  }
  st = movePayload(s, false, p.local->addrs, p.local_tensors, 0, p.local_runs, deadline);
  if (!st.ok()) return failTransfer(link, st, what);
  if (usesKeyCommit(p.remote.target.kind)) {
    // Every byte arrived: now the peer may release the request key (never before, so a failed
    // pull leaves the source intact and retryable).
    wire::RequestHeader ch{wire::Op::kCommit, static_cast<uint32_t>(body.size()), 0};
    std::string chead = wire::encode(ch);
    std::vector<iovec> civ{{chead.data(), chead.size()}, {body.data(), body.size()}};
    if (!s.sendv(civ, deadline).ok()) link->breakLink("could not confirm a completed pull to the peer");
  }
  return Status::OK();
}

Status Engine::directTransfer(const std::shared_ptr<Link>& link, Plan& p, bool is_push, Deadline deadline,
                              const char* what) {
  Link::Direct& d = link->directState();
  Socket& s = link->out();
  std::vector<iovec> local;
  for (uint32_t t : p.local_tensors) {
    for (const wire::Run& r : p.local_runs) {
      local.push_back({reinterpret_cast<void*>(p.local->addrs[t] + r.offset), static_cast<size_t>(r.length)});
    }
  }
  const wire::Target& target = p.remote.target;
  std::string body;  // encoded only when a frame carries it; the cached-read path sends none
  auto encoded = [&]() -> const std::string& {
    if (body.empty()) body = wire::encode(p.remote);
    return body;
  };

  // Fast path, reads of a blocks cache: with the peer's layout cached, one process_vm_readv and no
  // round trip. The peer's registry generation is read before and after the data (in the same
  // ordered copy), so a layout that changed meanwhile is detected and the read redone the checked way.
  if (!is_push && target.kind == wire::TargetKind::kBlocks) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      auto it = d.descriptors.find(target.model_id);
      if (it == d.descriptors.end()) {
        const std::string& b = encoded();
        std::string head = wire::encode(wire::RequestHeader{wire::Op::kDescribe, static_cast<uint32_t>(b.size()), 0});
        std::vector<iovec> iov{{head.data(), head.size()}, {const_cast<char*>(b.data()), b.size()}};
        Status st = s.sendv(iov, deadline);
        wire::ResponseHeader rh;
        Status remote;
        if (st.ok()) st = readResponse(s, deadline, &rh, &remote);
        if (!st.ok()) return failTransfer(link, st, what);
        if (!remote.ok()) return Status(remote.code(), std::string(what) + " " + clusterName(link->peer()) + ": " + remote.message());
        if (rh.payload_len > wire::kMaxBodyBytes) return failTransfer(link, Status(Code::kLinkFailed, "oversized descriptor"), what);
        std::string payload(rh.payload_len, '\0');
        st = s.recvAll(payload.data(), payload.size(), deadline);
        wire::CacheDescriptor desc;
        if (st.ok()) st = wire::decode(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(), &desc);
        if (!st.ok()) return failTransfer(link, st, what);
        it = d.descriptors.emplace(target.model_id, std::move(desc)).first;
      }
      const wire::CacheDescriptor& c = it->second;
      bool fits = p.remote.block_size == 0 || p.remote.block_size == c.stride;
      for (uint32_t t : p.remote.tensors) fits = fits && t < c.addrs.size();
      for (const wire::Run& r : p.remote.runs) {
        uint64_t end = 0;
        fits = fits && r.length > 0 && !__builtin_add_overflow(r.offset, r.length, &end) && end <= c.tensor_size;
      }
      if (!fits) break;  // the checked way reports the peer's own error
      uint64_t g1 = 0, g2 = 0;
      std::vector<iovec> lv{{&g1, 8}}, rv{{reinterpret_cast<void*>(d.gen_addr), 8}};
      size_t k = 0;
      for (uint32_t t : p.remote.tensors) {
        for (const wire::Run& r : p.remote.runs) {
          lv.push_back(local[k++]);
          rv.push_back({reinterpret_cast<void*>(c.addrs[t] + r.offset), static_cast<size_t>(r.length)});
        }
      }
      lv.push_back({&g2, 8});
      rv.push_back({reinterpret_cast<void*>(d.gen_addr), 8});
      Status st = cma::copy(d.pid, false, lv, rv);
      if (st.ok() && g1 == c.generation && g2 == c.generation) return Status::OK();
      if (!st.ok() && st.code() == Code::kLinkFailed) return failTransfer(link, st, what);
      d.descriptors.erase(it);  // stale or unmapped: the peer's caches changed
    }
  }

  // Checked round trip: the peer validates and pins the target and answers with its addresses.
  encoded();
  std::string head = wire::encode(wire::RequestHeader{is_push ? wire::Op::kWrite : wire::Op::kRead,
                                                      static_cast<uint32_t>(body.size()), 0, wire::kFlagDirect});
  std::vector<iovec> iov{{head.data(), head.size()}, {body.data(), body.size()}};
  Status st = s.sendv(iov, deadline);
  wire::ResponseHeader rh;
  Status remote;
  if (st.ok()) st = readResponse(s, deadline, &rh, &remote);
  if (!st.ok()) return failTransfer(link, st, what);
  if (!remote.ok()) return Status(remote.code(), std::string(what) + " " + clusterName(link->peer()) + ": " + remote.message());
  if (rh.payload_len != local.size() * 16) {
    return failTransfer(link, Status(Code::kLinkFailed, "peer answered " + std::to_string(rh.payload_len / 16) +
                                                            " ranges, expected " + std::to_string(local.size())),
                        what);
  }
  std::vector<uint64_t> list(local.size() * 2);
  st = s.recvAll(list.data(), rh.payload_len, deadline);
  if (!st.ok()) return failTransfer(link, st, what);
  std::vector<iovec> remote_iov(local.size());
  for (size_t i = 0; i < local.size(); ++i) {
    if (list[2 * i + 1] != local[i].iov_len) {
      return failTransfer(link, Status(Code::kLinkFailed, "peer answered a range of the wrong length"), what);
    }
    remote_iov[i] = {reinterpret_cast<void*>(list[2 * i]), local[i].iov_len};
  }
  Status copied = cma::copy(d.pid, is_push, local, remote_iov);
  // Unpin on the peer; for a completed read by request key this is also the release of the key.
  bool commit = copied.ok() && !is_push && usesKeyCommit(target.kind);
  std::string done = wire::encode(wire::RequestHeader{commit ? wire::Op::kCommit : wire::Op::kRelease,
                                                      static_cast<uint32_t>(body.size()), 0});
  std::vector<iovec> div{{done.data(), done.size()}, {body.data(), body.size()}};
  if (!s.sendv(div, deadline).ok()) link->breakLink("could not confirm a direct copy to the peer");
  if (!copied.ok()) {
    if (copied.code() == Code::kLinkFailed) return failTransfer(link, copied, what);
    return Status(copied.code(), std::string(what) + " " + clusterName(link->peer()) + ": " + copied.message());
  }
  return Status::OK();
}

// ---------------------------------------------------------------- registry

Result<std::shared_ptr<CacheEntry>> Engine::registerCache(const CacheLayout& layout, const std::vector<uint64_t>& addrs,
                                                          const std::vector<RequestKey>& keys,
                                                          std::optional<uint64_t> blocks_model, bool remote_accessible) {
  if (!initialized()) return Status(Code::kFailed, "engine is not initialized");
  if (addrs.size() != layout.num_tensors || addrs.empty()) {
    return Status(Code::kParamInvalid, "expected " + std::to_string(layout.num_tensors) + " tensor addresses, got " +
                                           std::to_string(addrs.size()));
  }
  for (uint64_t a : addrs) {
    if (a == 0) return Status(Code::kParamInvalid, "tensor address 0 is invalid");
  }
  if (layout.num_slots == 0) return Status(Code::kParamInvalid, "shape[0] must be > 0");
  CacheEntry e;
  e.layout = layout;
  e.addrs = addrs;
  e.owned = false;
  e.remote_accessible = remote_accessible;
  e.blocks_model = blocks_model;
  return registry_.add(std::move(e), keys);
}

Result<std::shared_ptr<CacheEntry>> Engine::allocateCache(const CacheLayout& layout, const std::vector<RequestKey>& keys,
                                                          std::optional<uint64_t> blocks_model) {
  if (!initialized()) return Status(Code::kFailed, "engine is not initialized");
  std::shared_ptr<MemPool> pool = layout.placement == Placement::kDevice ? device_pool_ : host_pool_;
  if (!pool) {
    return Status(Code::kFeatureNotEnabled, std::string("no ") +
                                                (layout.placement == Placement::kDevice ? "device" : "host") +
                                                " memory pool is configured");
  }
  if (layout.num_tensors == 0 || layout.num_slots == 0) {
    return Status(Code::kParamInvalid, "num_tensors and shape[0] must be > 0");
  }
  CacheEntry e;
  e.layout = layout;
  e.owned = true;
  e.pool = pool;
  e.blocks_model = blocks_model;
  for (uint32_t t = 0; t < layout.num_tensors; ++t) {
    auto a = pool->allocate(layout.tensor_size);
    if (!a.ok()) return a.status();  // ~CacheEntry returns what was taken so far
    e.addrs.push_back(a.value());
  }
  return registry_.add(std::move(e), keys);
}

Status Engine::deallocateCache(int64_t id, bool expect_blocks) { return registry_.deallocate(id, expect_blocks); }
Status Engine::unregisterCache(int64_t id) { return registry_.unregister(id); }
void Engine::removeCacheKey(const RequestKey& key) { registry_.removeKey(key); }

Status Engine::copyLocal(const std::vector<uint64_t>& dst_addrs, const std::vector<uint64_t>& src_addrs,
                         const std::vector<CopyRun>& runs) {
  if (dst_addrs.size() != src_addrs.size()) return Status(Code::kParamInvalid, "tensor counts differ");
  for (size_t t = 0; t < dst_addrs.size(); ++t) {
    for (const CopyRun& r : runs) {
      PDLINK_RETURN_IF_ERROR(backend_->copy(reinterpret_cast<void*>(dst_addrs[t] + r.dst_offset),
                                            reinterpret_cast<const void*>(src_addrs[t] + r.src_offset), r.length));
    }
  }
  return Status::OK();
}

}  // namespace pdlink
