// LinkManager (engine/link_manager.h): listeners and handshake slots, dialling, unlinking, probes,
// each new link's transport and paths, device channels. The acceptor's half of the handshake is in
// engine/handshake.cc.
#include "engine/link_manager.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>

#include "core/limits.h"
#include "core/log.h"
#include "engine/engine_internal.h"
#include "transport/cma/cma.h"
#include "transport/cma/cma_path.h"
#include "transport/ucx/ucx_path.h"

namespace pdlink {

using namespace detail;  // NOLINT: this file is part of the engine

Status detail::linkDown(uint64_t peer, const std::string& reason) {
  return Status(Code::kLinkFailed,
                "the link to " + clusterName(peer) + " is down (" + reason + "); disconnect, then connect again");
}

Status detail::linkDown(const Link& link) { return linkDown(link.peer(), link.brokenReason()); }

Status detail::linkError(const PeerAddress& peer, const Status& st) {
  Code code = st.code() == Code::kParamInvalid ? Code::kParamInvalid : Code::kLinkFailed;
  // A peer dialled without a cluster id is named by its address only.
  const std::string who = peer.cluster_id == wire::kAnyCluster ? "the engine" : clusterName(peer.cluster_id);
  return Status(code,
                "cannot link to " + who + " at " + peer.ip + ":" + std::to_string(peer.port) + ": " + st.message());
}

LinkManager::LinkManager(EngineState& state, ServeFn serve) : s_(state), serve_(std::move(serve)) {}

// ---------------------------------------------------------------- initialize, finalize, stats

Status LinkManager::listenLocked(const std::string& ip, uint16_t port) {
  auto l = startListener(ip, port);
  if (!l.ok()) return l.status();
  listener_ = std::move(l.value());
  return Status::OK();
}

void LinkManager::listenUnixLocked() {
  std::string name;
  auto u = startUnixListener(&name);
  if (u.ok()) {
    unix_listener_ = std::move(u.value());
    unix_name_ = name;
  } else {
    PDLINK_LOG(kWarn, "no same-host socket (" << u.status().message() << "); links to this engine use tcp");
  }
}

void LinkManager::closeAll(const std::vector<std::shared_ptr<Link>>& links) {
  for (auto& link : links) {
    link->ending(LinkDown::kFinalized);
    if (!link->broken()) {
      std::unique_lock<std::mutex> out(link->outMutex(), std::try_to_lock);
      if (out.owns_lock()) {  // tell the peer, best effort, without waiting on a busy link
        wire::RequestHeader h{wire::Op::kUnlink, 0, 0};
        std::string frame = wire::encode(h);
        (void)link->out().sendFrame(frame, Deadline::afterMs(200));
      }
    }
    link->breakLink("engine finalized", LinkDown::kFinalized);
  }
}

void LinkManager::shutdownHandshakes() {
  {
    std::lock_guard<std::mutex> lock(s_.mu);
    for (Socket* s : handshaking_) s->shutdown();
  }
  pending_cv_.notify_all();
}

void LinkManager::addStatsLocked(EngineStats* s) const {
  s->live_links = links_.live();
  s->tombstones = links_.tombstones();
  s->handshakes = slots_.total;
  s->handshakes_evicted = slots_.evicted;
  for (const Listener* l : {listener_.get(), comm_listener_.get(), unix_listener_.get()}) {
    if (l) s->listener_backoffs += l->backoffs();
  }
  for (const LinkInfo& info : links_.infos()) {
    if (info.broken) continue;
    auto it = std::find_if(s->links_by_path.begin(), s->links_by_path.end(),
                           [&](const auto& e) { return e.first == info.transport; });
    if (it == s->links_by_path.end()) {
      s->links_by_path.emplace_back(info.transport, 1);
    } else {
      ++it->second;
    }
  }
}

uint16_t LinkManager::listenPort() const {
  std::lock_guard<std::mutex> lock(s_.mu);
  return listenPortLocked();
}

// ---------------------------------------------------------------- for serving and transfers

void LinkManager::forget(const std::shared_ptr<Link>& link) {
  std::lock_guard<std::mutex> lock(s_.mu);
  links_.forget(link);
}

void LinkManager::retire(const std::shared_ptr<Link>& link) {
  std::lock_guard<std::mutex> lock(s_.mu);
  links_.retire(link, s_.config.limits.max_links);
}

bool LinkManager::dialledBy(const Link& link, const wire::Nonce& nonce, const std::string& endpoint) const {
  std::lock_guard<std::mutex> lock(s_.mu);
  std::shared_ptr<Link> own = links_.slot(link.peer(), true);
  auto it = dialling_.find(nonce);
  return (own && !own->broken() && own->nonce() == nonce && own->endpoint() == endpoint) ||
         (it != dialling_.end() && it->second.peer == link.peer() && it->second.endpoint == endpoint);
}

struct LinkManager::Dialled {
  Socket fwd, rev;
  pid_t pid = 0;  // the acceptor, as SO_PEERCRED reports it (AF_UNIX channels only)
  uid_t uid = 0;
  uint64_t published_addr = 0;       // its Registry::Published words (AF_UNIX channels only)
  std::shared_ptr<void> grant;       // cma's (cmaGrant), for the link to hold until it breaks
  Session fwd_session, rev_session;  // with a link secret: the channels' keys
  wire::Nonce nonce{};               // the forward channel's hello
  std::string endpoint;              // the forward channel's end here (Socket::localEndpoint)
  std::shared_ptr<void> in_flight;   // keeps `nonce` confirmable while the link is made (markDialling)
};

std::shared_ptr<void> LinkManager::markDialling(const wire::Nonce& nonce, uint64_t peer, const std::string& endpoint) {
  {
    std::lock_guard<std::mutex> lock(s_.mu);
    dialling_[nonce] = {peer, endpoint};
  }
  return std::shared_ptr<void>(nullptr, [this, nonce](void*) {
    std::lock_guard<std::mutex> lock(s_.mu);
    dialling_.erase(nonce);
  });
}

// ---------------------------------------------------------------- listeners and roles

std::string LinkManager::sourceOf(const Socket& s) {
  // A local peer is its user: every process of one uid shares one share, whichever way it comes
  // (AF_UNIX, or TCP from a loopback address), so many processes or many loopback addresses gain
  // an attacker nothing. A remote peer is its IP address.
  if (s.isUnix()) {
    auto cred = s.peerCredentials();
    return cred.ok() ? "uid " + std::to_string(cred.value().uid) : s.peer();
  }
  auto uid = s.loopbackPeerUid();
  if (uid.ok()) return "uid " + std::to_string(uid.value());
  const std::string& p = s.peer();
  return p.substr(0, p.rfind(':'));
}

void LinkManager::HandshakeSlot::release() {
  if (!manager) return;
  std::lock_guard<std::mutex> lock(manager->s_.mu);
  manager->hearLocked(this);
  if (evicted) {
    --manager->slots_.evicting;  // its place was counted out when it was evicted
  } else {
    --manager->slots_.total;
    auto it = manager->slots_.per_source.find(source);
    if (it != manager->slots_.per_source.end() && --it->second == 0) manager->slots_.per_source.erase(it);
  }
  manager = nullptr;
}

void LinkManager::hearLocked(HandshakeSlot* slot) {
  if (slot->silent < 0) return;
  slots_.silent.erase(slot->arrival);
  slot->silent = -1;
}

bool LinkManager::evictSilentLocked(const std::string& newcomer, bool same_source) {
  // The oldest connection (of the newcomer's source, or of anyone) that has not sent its hello yet
  // makes room: its place is the newcomer's at once. Its thread wakes from its read and ends; until it has,
  // it counts as evicting, and at most kEvictingPerSlot x max_handshakes of those may be in flight.
  if (slots_.evicting >= kEvictingPerSlot * size_t{s_.config.limits.max_handshakes}) return false;
  for (auto it = slots_.silent.begin(); it != slots_.silent.end(); ++it) {
    HandshakeSlot* victim = it->second;
    if (same_source && victim->source != newcomer) continue;
    // Wakes its thread's read; the descriptor stays open (and so is never another's) until that
    // thread, which heard() first, closes it.
    (void)::shutdown(victim->silent, SHUT_RDWR);
    victim->silent = -1;
    victim->evicted = true;
    ++slots_.evicting;
    ++slots_.evicted;
    --slots_.total;
    auto share = slots_.per_source.find(victim->source);
    if (--share->second == 0 && victim->source != newcomer) slots_.per_source.erase(share);  // the caller holds its own
    slots_.silent.erase(it);
    return true;
  }
  return false;
}

Listener::AcceptFn LinkManager::acceptor() {
  return [this](Socket s) {
    // A handshake slot is taken here, on the listener's thread, before any thread is started: a
    // flood from one source runs out of its own slots, not everyone's.
    auto slot = std::make_shared<HandshakeSlot>();
    const std::string source = sourceOf(s);
    {
      std::lock_guard<std::mutex> lock(s_.mu);
      if (s_.stopping) return;
      const EngineLimits& lim = s_.config.limits;
      size_t& mine = slots_.per_source[source];
      // Full: a connection that speaks at once is not locked out by silent ones (evictSilentLocked).
      const bool room = (mine < lim.max_handshakes_per_source || evictSilentLocked(source, true)) &&
                        (slots_.total < lim.max_handshakes || evictSilentLocked(source, false));
      if (!room) {
        const size_t held = mine;  // read before the erase below frees it
        if (held == 0) slots_.per_source.erase(source);
        if (handshakes_refused_.fetch_add(1) % 1000 == 0) {  // one line per thousand, not one each
          PDLINK_LOG(kWarn, "dropping connection from " << s.peer() << ": too many handshakes in progress ("
                                                        << slots_.total << " in all, " << held << " from " << source
                                                        << ")");
        }
        return;
      }
      ++mine;
      ++slots_.total;
      slot->manager = this;
      slot->source = source;
      slot->arrival = ++slots_.arrivals;
      slot->silent = s.fd();  // evictable until its hello arrives (handleIncoming)
      slots_.silent[slot->arrival] = slot.get();
    }
    auto holder = std::make_shared<Socket>(std::move(s));
    try {
      s_.spawn([this, holder, slot] { handleIncoming(std::move(*holder), slot.get()); });
    } catch (const std::exception& e) {  // no thread to be had: drop this connection, keep listening
      PDLINK_LOG(kWarn, "dropping connection from " << holder->peer() << ": " << e.what());
      slot->release();
    }
  };
}

Result<std::unique_ptr<Listener>> LinkManager::startListener(const std::string& ip, uint16_t port) {
  return Listener::start(ip, port, acceptor());
}

Result<std::unique_ptr<Listener>> LinkManager::startUnixListener(std::string* name) {
  uint8_t rnd[16];
  randomBytes(rnd, sizeof(rnd));
  static const char* hex = "0123456789abcdef";
  *name = "pdlink-";
  for (uint8_t b : rnd) {
    name->push_back(hex[b >> 4]);
    name->push_back(hex[b & 15]);
  }
  return Listener::startUnix(*name, acceptor());
}

void LinkManager::stopListeners() {
  std::unique_ptr<Listener> a, b, c;
  {
    std::lock_guard<std::mutex> lock(s_.mu);
    a = std::move(listener_);
    b = std::move(comm_listener_);
    c = std::move(unix_listener_);
    unix_name_.clear();
  }
  // Destroyed outside s_.mu: the accept callback takes it.
}

Status LinkManager::switchRole(const SwitchOptions& o) {
  const auto sameListener = [&] {
    return listener_ && o.listen_ip == listener_->ip() && (o.listen_port == listener_->port() || o.listen_port == 0);
  };
  const auto commitLocked = [&] {
    s_.role = o.role;
    ++s_.epoch;
    s_.epoch_tag.store(EngineState::tagOf(s_.epoch));
    s_.phase.store(Phase::kReady);
    s_.registry.publishRole(s_.epoch, false);
  };
  Role old_role;
  {
    std::lock_guard<std::mutex> lock(s_.mu);
    if (!s_.initialized) return Status(Code::kFailed, Scope::kEngine, "engine is not initialized");
    if (s_.switchPending()) {
      return Status(Code::kRoleSwitching, "a role switch is already pending (phase " +
                                              std::string(phaseName(s_.phase.load())) + "); wait until it is over");
    }
    if (o.expected_epoch && *o.expected_epoch != s_.epoch) {
      return Status(Code::kStaleEpoch, "expected role epoch " + std::to_string(*o.expected_epoch) +
                                           ", but the engine is at epoch " + std::to_string(s_.epoch) +
                                           "; nothing changed");
    }
    if (s_.config.one_way_links) {
      // As llm_datadist's hixl backend: the role is a label; links and listener stay as they are.
      if (!o.listen_ip.empty() && !sameListener()) {
        return Status(Code::kFeatureNotEnabled,
                      "with one-way links switch_role cannot change the listen "
                      "address; close the engine and open a new one");
      }
      commitLocked();
      return Status::OK();
    }
    if (o.require_no_links && (!links_.empty() || !linking_.empty())) {
      std::string ids;
      for (uint64_t id : links_.peers()) ids += (ids.empty() ? "" : ", ") + std::to_string(id);
      return Status(Code::kExistLink,
                    "cannot switch role while links exist (peer clusters: " + ids + "); disconnect them first");
    }
    old_role = s_.role;
    s_.phase.store(Phase::kDraining);         // from here nothing new is admitted (EngineState::Admission)
    s_.registry.publishRole(s_.epoch, true);  // and no cached same-host read of a prepared transfer
  }
  // A same-host requester's cached layout (cma) is checked against the generation around each
  // copy: it asks this side again, which refuses while the switch is pending.
  s_.registry.bumpGeneration();
  const int64_t drain_ms = o.drain_timeout_ms > 0 ? o.drain_timeout_ms : s_.config.limits.switch_drain_timeout_ms;
  if (!s_.drain(drain_ms)) {
    // Rollback (docs/architecture.md, "Roles"): every transfer of this side still in flight is
    // cancelled at its next cancel point and every split pull a peer opened here has its next chunk
    // refused and no longer counted (Link::endSplit: so an ended pull holds no later switch); the
    // cancelled transfers get at most min(1 s, drain) more to end. Pins are left to their bound
    // (pinTimeoutMs): nothing they keep registered changes in a rollback. The counts named are those
    // the drain gave up on.
    const int64_t served = s_.served_in_flight.load(), pins = s_.pins_held.load();
    {
      std::lock_guard<std::mutex> lock(s_.mu);
      s_.phase.store(Phase::kRollingBack);  // no split pull opens from here (Admission)
      for (uint64_t peer : links_.peers()) {
        for (bool dialled : {true, false}) {
          std::shared_ptr<Link> l = links_.slot(peer, dialled);
          if (l && l->endSplit()) s_.served_in_flight.fetch_sub(1, std::memory_order_seq_cst);
        }
      }
    }
    const int64_t cancelled = s_.transfers_in_flight.load();
    s_.abort_generation.fetch_add(1, std::memory_order_seq_cst);
    const int64_t grace_ms = std::min<int64_t>(1000, drain_ms);
    s_.drain(grace_ms, true);
    const int64_t ending = s_.transfers_in_flight.load();
    {
      std::lock_guard<std::mutex> lock(s_.mu);
      s_.phase.store(Phase::kReady);
      s_.registry.publishRole(s_.epoch, false);  // nothing was changed: the old role and epoch stand
    }
    PDLINK_LOG(kInfo, "engine " << s_.config.cluster_id << ": role switch rolled back after " << drain_ms
                                << " ms of drain; " << cancelled << " transfers cancelled, " << ending
                                << " still ending");
    return Status(Code::kTimeout, Scope::kCall,
                  "the role switch did not drain within " + std::to_string(drain_ms) + " ms (" +
                      std::to_string(cancelled) + " transfers, " + std::to_string(served) + " served requests, " +
                      std::to_string(pins) + " pins in flight); it rolled back to role " +
                      std::to_string(static_cast<int>(old_role)) + ", epoch unchanged: " + std::to_string(cancelled) +
                      " transfers cancelled (" + std::to_string(ending) + " still ending after " +
                      std::to_string(grace_ms) + " ms), the peers' open split pulls ended, pins left to their " +
                      std::to_string(s_.pinTimeoutMs()) + " ms bound");
  }
  std::unique_ptr<Listener> old, fresh;
  bool keep = false, gave_up_old = false;
  {
    std::lock_guard<std::mutex> lock(s_.mu);
    s_.phase.store(Phase::kSwitching);
    keep = !o.listen_ip.empty() && sameListener();
    // The new address is bound before the old one is given up, so a failed switch changes
    // nothing; only a move to the same port on another address must release the old one first.
    if (!keep && !o.listen_ip.empty() && listener_ && o.listen_port == listener_->port()) {
      old = std::move(listener_);
      gave_up_old = true;
    }
  }
  old.reset();  // joins the accept thread, outside s_.mu
  if (!keep && !o.listen_ip.empty()) {
    auto l = startListener(o.listen_ip, o.listen_port);
    if (!l.ok()) {
      std::lock_guard<std::mutex> lock(s_.mu);
      if (gave_up_old) {
        // The old listener is gone and the new one could not be had: the engine is in neither role.
        s_.phase.store(Phase::kFailed);
        s_.registry.publishRole(s_.epoch, false);  // as admission: kFailed is not a pending switch
        return Status(l.status().code(), l.status().message() +
                                             "; the old listener was given up: the switch failed (phase failed, "
                                             "role and epoch unchanged); switch again to resolve it");
      }
      s_.phase.store(Phase::kRollingBack);
      s_.phase.store(Phase::kReady);
      s_.registry.publishRole(s_.epoch, false);
      return Status(l.status().code(), l.status().message() + "; the switch rolled back (role and epoch unchanged)");
    }
    fresh = std::move(l.value());
  }
  {
    std::lock_guard<std::mutex> lock(s_.mu);
    if (!keep) {
      old = std::move(listener_);
      listener_ = std::move(fresh);
    }
    commitLocked();
    PDLINK_LOG(
        kInfo,
        "engine " << s_.config.cluster_id << " switched to role " << static_cast<int>(o.role) << ", epoch " << s_.epoch
                  << (listener_ ? ", listening on port " + std::to_string(listener_->port()) : ", not listening"));
  }
  s_.registry.bumpGeneration();
  return Status::OK();
}

// ---------------------------------------------------------------- links

std::vector<Status> LinkManager::link(const std::vector<PeerAddress>& peers, int64_t timeout_ms,
                                      std::vector<uint64_t>* peer_ids) {
  if (peers.size() > kMaxPeersPerCall) {
    return {Status(Code::kClusterNumExceedLimit, "at most 16 clusters per call, got " + std::to_string(peers.size()))};
  }
  if (!s_.isInitialized()) return {Status(Code::kFailed, Scope::kEngine, "engine is not initialized")};
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

Status LinkManager::linkOne(const PeerAddress& peer, int64_t timeout_ms, uint64_t* linked_id) {
  const bool known = peer.cluster_id != wire::kAnyCluster;
  std::shared_ptr<Link> claimed;  // an accepted link that claims to come from `peer`
  const std::string where = peer.ip + ":" + std::to_string(peer.port);
  // Guards against a second link attempt to the same peer, by id when known, else by address.
  const uint64_t guard_key = known ? peer.cluster_id : std::hash<std::string>{}(where) | (uint64_t{1} << 63);
  PDLINK_RETURN_IF_ERROR(admitLinkAttempt(peer, guard_key, &claimed, linked_id));
  struct Unmark {
    LinkManager* e;
    uint64_t key;
    ~Unmark() {
      std::lock_guard<std::mutex> lock(e->s_.mu);
      e->linking_.erase(key);
    }
  } unmark{this, guard_key};

  Deadline deadline = Deadline::afterMs(timeout_ms);
  uint64_t peer_id = peer.cluster_id;
  auto dialled = dialChannels(peer, &peer_id, deadline);  // kept until the end: its nonce stays confirmable
  if (!dialled.ok()) return dialled.status();
  if (peer_id == s_.config.cluster_id) {
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
  link->setPeerProcess(d.pid, d.published_addr);
  link->holdUntilBroken(std::move(d.grant));
  link->setPeerAddress(where);
  link->setOrigin("", d.nonce, d.endpoint);
  choosePaths(*link, std::move(process));
  link->setStreamPlan(s_.config.limits.tcp_streams, s_.config.limits.tcp_chunk_bytes);
  // A link dialled over TCP whose transfers take the stream path may add lanes (its first large
  // transfer opens them: StreamPath::transfer). Same-host links never do.
  if (!link->sameHost() && !link->outSocket().isUnix() && std::string(link->transport()) == "tcp" &&
      s_.config.limits.tcp_streams > 1) {
    link->setLaneOpener([this](Link& l, Deadline dl) { openLanes(l, dl); });
  }
  if (claimed) PDLINK_RETURN_IF_ERROR(settleClaim(peer, peer_id, link, claimed, deadline, linked_id));
  return finishLink(peer, peer_id, link, deadline, linked_id);
}

Status LinkManager::admitLinkAttempt(const PeerAddress& peer, uint64_t guard_key, std::shared_ptr<Link>* claimed,
                                     uint64_t* linked_id) {
  const bool known = peer.cluster_id != wire::kAnyCluster;
  const std::string where = peer.ip + ":" + std::to_string(peer.port);
  std::lock_guard<std::mutex> lock(s_.mu);
  if (s_.switchPending()) return s_.switchingStatus();  // a peer cannot hold a switch by linking
  if (known && peer.cluster_id == s_.config.cluster_id) {
    return Status(Code::kParamInvalid,
                  "cannot link to this engine's own cluster id " + std::to_string(peer.cluster_id));
  }
  // A link entity of this side (a dead one too, until unlinked) for this peer: llm_datadist
  // answers LLM_ALREADY_LINK. (So a peer that linked to us first makes our own link attempt
  // ALREADY_LINK: its link is symmetric. One-way links count only our own.) An accepted link
  // alone is only a claim, though: the engine at the dialled address must confirm it is the
  // other end of it (settleClaim), once: a confirmed link answers ALREADY_LINK at once.
  for (const LinkInfo& l : links_.ownInfos()) {
    if ((known && l.peer_cluster_id == peer.cluster_id) || (!known && l.peer_address == where)) {
      if (known && !l.initiator && !l.broken && !l.confirmed) {
        *claimed = links_.slot(peer.cluster_id, false);
        if (*claimed) continue;
      }
      if (linked_id) *linked_id = l.peer_cluster_id;
      return Status(Code::kAlreadyLink, clusterName(l.peer_cluster_id) + " is already linked");
    }
  }
  if (links_.live() + linking_.size() >= s_.config.limits.max_links) {
    return Status(Code::kLinkFailed, Scope::kEngine,  // out of links: any new link fails alike
                  "this engine already has " + std::to_string(links_.live()) +
                      " links, the most it may have (pdlink.MaxLinks); unlink one first");
  }
  if (!linking_.insert(guard_key).second) {
    return Status(Code::kProcessingLink,
                  "a link to " + (known ? clusterName(peer.cluster_id) : where) + " is in progress");
  }
  return Status::OK();
}

Result<LinkManager::Dialled> LinkManager::dialChannels(const PeerAddress& peer, uint64_t* peer_id, Deadline deadline) {
  const bool offer = s_.config.transport != Transport::kTcp;
  std::string redirect;
  auto dialled = dialTcp(peer, offer, peer_id, deadline, &redirect);
  if (!dialled.ok()) return linkError(peer, dialled.status());
  if (!redirect.empty()) {
    // The acceptor is on this host (by the hints) and offers its AF_UNIX socket, where the kernel
    // tells each side who the other is. Out of reach (another network namespace): TCP after all.
    bool reached = false;
    auto local = dialUnix(redirect, peer_id, deadline, &reached);
    if (local.ok()) {
      dialled = std::move(local);
    } else if (reached || s_.config.transport == Transport::kCma) {
      return linkError(peer, local.status());
    } else {
      PDLINK_LOG(kInfo, "same-host channels to " << clusterName(*peer_id) << " unavailable ("
                                                 << local.status().message() << "); using tcp");
      *peer_id = peer.cluster_id;
      dialled = dialTcp(peer, false, peer_id, deadline, &redirect);
      if (!dialled.ok()) return linkError(peer, dialled.status());
    }
  }
  return dialled;
}

Status LinkManager::settleClaim(const PeerAddress& peer, uint64_t peer_id, const std::shared_ptr<Link>& link,
                                const std::shared_ptr<Link>& claimed, Deadline deadline, uint64_t* linked_id) {
  // The engine we dialled says whether it made the accepted link. Yes: that link is the one
  // llm_datadist reports (ALREADY_LINK), and the new one is closed again, leaving nothing on
  // either side. No: the accepted link is an impostor's, or stale; it is dropped and the
  // dialled one used.
  Status confirmed = confirmDialled(*link, *claimed, deadline);
  if (confirmed.ok()) {
    claimed->markConfirmed();  // later attempts (a link call, a claim) need not dial again
    dropUnused(*link, deadline);
    if (linked_id) *linked_id = peer_id;
    return Status(Code::kAlreadyLink, clusterName(peer_id) + " is already linked");
  }
  if (link->broken()) return linkError(peer, confirmed);
  PDLINK_LOG(kWarn, "dropping the link that claimed to come from "
                        << clusterName(peer_id) << " (" << claimed->peerAddress() << "): " << confirmed.message());
  {
    std::lock_guard<std::mutex> lock(s_.mu);
    links_.forget(claimed);
  }
  claimed->breakLink("claimed to come from " + clusterName(peer_id) + ", which did not dial it");
  return Status::OK();
}

Status LinkManager::finishLink(const PeerAddress& peer, uint64_t peer_id, const std::shared_ptr<Link>& link,
                               Deadline deadline, uint64_t* linked_id) {
  {
    std::lock_guard<std::mutex> lock(s_.mu);
    if (s_.stopping || !s_.initialized) return Status(Code::kLinkFailed, "engine is finalizing");
    installLink(link);
  }
  s_.spawn([this, link] { serve_(link, nullptr); });
  bool channel = false;
  Status st;
  std::unique_lock<std::mutex> out(link->outMutex());
  // Set up this direction's device channel now rather than on the first pull when the link's first
  // device path needs one: HCCL's communicator setup takes seconds on real hardware. (A same-host
  // link uses IPC, and sets a channel up only if the peer turns IPC down.) A peer without device
  // channels (a CPU backend) still links; its device transfers are refused then.
  const bool wants_channel = !link->devicePaths().empty() && link->devicePaths().front()->caps().device_channel;
  if (wants_channel) {
    DataPath& first = *link->devicePaths().front();
    st = first.connect(*link, s_.pathEnv(), deadline, "link to");
    channel = first.usable(*link);
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

Result<LinkManager::Dialled> LinkManager::dialTcp(const PeerAddress& peer, bool offer_same_host, uint64_t* peer_id,
                                                  Deadline deadline, std::string* redirect) {
  redirect->clear();
  wire::Hello hello;
  hello.cluster_id = s_.config.cluster_id;
  hello.expected_peer = peer.cluster_id;
  hello.nonce = makeNonce();
  const uint8_t integrity = s_.config.payload_integrity ? wire::kHelloPayloadIntegrity : 0;
  hello.flags = (offer_same_host ? wire::kHelloSameHost : 0) | integrity;
  wire::ClientAuth mine;
  if (offer_same_host) mine.hint = s_.hint;  // what the acceptor needs to decide on a redirect
  Dialled d;
  auto fwd = Socket::connect(peer.ip, peer.port, deadline);
  if (!fwd.ok()) return fwd.status();
  wire::AuthResult result;
  PDLINK_RETURN_IF_ERROR(
      helloExchange(fwd.value(), hello, s_.config.link_secret, mine, peer_id, &result, &d.fwd_session, deadline));
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
  PDLINK_RETURN_IF_ERROR(helloExchange(rev.value(), hello, s_.config.link_secret, wire::ClientAuth{}, peer_id, &result,
                                       &d.rev_session, deadline));
  PDLINK_RETURN_IF_ERROR(sameIntegrity(d.fwd_session, d.rev_session));
  d.fwd = std::move(fwd.value());
  d.rev = std::move(rev.value());
  return d;
}

Result<LinkManager::Dialled> LinkManager::dialUnix(const std::string& name, uint64_t* peer_id, Deadline deadline,
                                                   bool* reached) {
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
  hello.cluster_id = s_.config.cluster_id;
  hello.expected_peer = *peer_id;
  hello.nonce = makeNonce();
  hello.flags = s_.config.payload_integrity ? wire::kHelloPayloadIntegrity : 0;
  wire::ClientAuth mine;
  mine.hint = s_.hint;
  mine.gen_addr = reinterpret_cast<uint64_t>(s_.registry.published());
  wire::AuthResult result;
  PDLINK_RETURN_IF_ERROR(
      helloExchange(fwd.value(), hello, s_.config.link_secret, mine, peer_id, &result, &d.fwd_session, deadline));
  d.published_addr = result.gen_addr;
  d.nonce = hello.nonce;
  d.endpoint = fwd.value().localEndpoint();
  d.in_flight = markDialling(hello.nonce, *peer_id, d.endpoint);
  // The acceptor (it has proven the secret by now) probes this process before it completes the
  // link: let it read us from now on (released with `d` if the link does not come up). Not for a
  // peer inside this process.
  d.grant = cmaGrant(d.pid);
  auto rev = Socket::connectUnix(name, deadline);
  if (!rev.ok()) return rev.status();
  auto cred2 = rev.value().peerCredentials();
  if (!cred2.ok() || cred2.value().pid != d.pid) {
    return Status(Code::kLinkFailed, "the two same-host channels reached different processes");
  }
  hello.channel = wire::Channel::kReverse;
  PDLINK_RETURN_IF_ERROR(
      helloExchange(rev.value(), hello, s_.config.link_secret, mine, peer_id, &result, &d.rev_session, deadline));
  if (result.gen_addr != d.published_addr) {
    return Status(Code::kLinkFailed, "the two same-host channels disagree about the peer");
  }
  PDLINK_RETURN_IF_ERROR(sameIntegrity(d.fwd_session, d.rev_session));
  d.fwd = std::move(fwd.value());
  d.rev = std::move(rev.value());
  return d;
}

Status LinkManager::chooseTransport(const Socket& channel, pid_t peer_pid, uid_t peer_uid, uint64_t published_addr,
                                    std::shared_ptr<const cma::Process>* process) const {
  const bool allowed = s_.config.transport != Transport::kTcp && s_.config.transport != Transport::kUcx;
  return cmaProbe(channel, peer_pid, peer_uid, published_addr, allowed, s_.config.transport == Transport::kCma,
                  process);
}

void LinkManager::installLink(const std::shared_ptr<Link>& link) {
  link_log_.emplace_back(++link_seq_, link->peer());
  if (s_.telemetry) {  // counted once installed: up now, down when it breaks (its hook)
    s_.telemetry->linkUp(link->peer());
    link->setDownHook([t = s_.telemetry, peer = link->peer()](LinkDown why) { t->linkDown(peer, why); });
  }
  if (link_log_.size() > limits::kLinkLogEntries) link_log_.pop_front();
  if (std::shared_ptr<Link> old = links_.install(link)) {
    // The peer re-linked without unlinking (it restarted, or force-unlinked its end), and its old
    // link was dead, or the newcomer proved the secret (handleIncoming): the old entity is stale,
    // as in llm_datadist's force re-link.
    PDLINK_LOG(kInfo, "replacing stale link to " << clusterName(link->peer()));
    old->breakLink("replaced by a new link from the peer", LinkDown::kReplaced);
  }
}

Status LinkManager::confirmDialled(Link& link, const Link& claimed, Deadline deadline) {
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

void LinkManager::dropUnused(Link& link, Deadline deadline) {
  {
    std::lock_guard<std::mutex> out(link.outMutex());
    wire::ResponseHeader rh;
    (void)request(link, wire::RequestHeader{wire::Op::kUnlink, 0, 0}, "", deadline, "closing a spare link to", &rh);
  }
  link.breakLink("not needed: the peer's own link to this engine serves", LinkDown::kReplaced);
}

bool LinkManager::stillAlive(const std::shared_ptr<Link>& link) {
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

std::vector<Status> LinkManager::unlink(const std::vector<uint64_t>& ids, int64_t timeout_ms, bool force) {
  if (ids.size() > kMaxPeersPerCall) {
    return {Status(Code::kClusterNumExceedLimit, "at most 16 clusters per call, got " + std::to_string(ids.size()))};
  }
  std::vector<Status> out;
  for (uint64_t id : ids) out.push_back(unlinkOne(id, timeout_ms, force));
  return out;
}

Status LinkManager::unlinkOne(uint64_t cluster_id, int64_t timeout_ms, bool force) {
  std::vector<std::shared_ptr<Link>> links;
  // One-way links: only our own goes, and the peer is not told (its end sees the channels close).
  if (s_.config.one_way_links) force = true;
  {
    std::lock_guard<std::mutex> lock(s_.mu);
    bool had = false;
    links = links_.remove(cluster_id, &had);
    if (!had && s_.config.one_way_links) return Status::OK();  // as the hixl backend: nothing to destroy
    if (!had) return Status(Code::kNotYetLink, "no link to " + clusterName(cluster_id));
  }
  Status result;
  Deadline deadline = Deadline::afterMs(timeout_ms);
  for (const auto& link : links) {
    link->ending(LinkDown::kUnlinked);
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
    link->breakLink("unlinked by this side", LinkDown::kUnlinked);
  }
  PDLINK_LOG(kInfo, "unlinked " << clusterName(cluster_id) << (force ? " (force)" : ""));
  return result;
}

Status LinkManager::ping(uint64_t cluster_id, int64_t timeout_ms) {
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
  if (!remote.ok()) {
    // An engine always answers a ping with success: any other answer is a peer out of protocol,
    // and its code (an engine code included) is not this engine's to report.
    return failTransfer(*link,
                        Status(Code::kLinkFailed, std::string("it answered ") + codeName(remote.code()) + " (" +
                                                      remote.message() + "), not success"),
                        "link check with");
  }
  return Status::OK();
}

Result<uint16_t> LinkManager::startCommListener(const std::string& ip, uint16_t port) {
  {
    std::lock_guard<std::mutex> lock(s_.mu);
    if (!s_.initialized) return Status(Code::kFailed, Scope::kEngine, "engine is not initialized");
    if (comm_listener_) {
      if (comm_listener_->ip() == ip && (port == 0 || comm_listener_->port() == port)) return comm_listener_->port();
      return Status(Code::kParamInvalid, "link() endpoint already bound to " + comm_listener_->ip() + ":" +
                                             std::to_string(comm_listener_->port()));
    }
  }
  auto l = startListener(ip, port);
  if (!l.ok()) return l.status();
  std::unique_ptr<Listener> extra;  // destroyed on return, outside s_.mu (its callback takes s_.mu)
  std::lock_guard<std::mutex> lock(s_.mu);
  if (comm_listener_) {
    extra = std::move(l.value());  // lost a race with a concurrent call: keep the first
  } else {
    comm_listener_ = std::move(l.value());
  }
  return comm_listener_->port();
}

std::vector<LinkInfo> LinkManager::links() const {
  std::lock_guard<std::mutex> lock(s_.mu);
  return links_.infos();
}

uint64_t LinkManager::linkedSince(uint64_t after, std::vector<uint64_t>* peers) const {
  std::lock_guard<std::mutex> lock(s_.mu);
  peers->clear();
  for (const auto& [seq, peer] : link_log_) {
    if (seq > after) peers->push_back(peer);
  }
  return link_seq_;
}

// ---------------------------------------------------------------- paths and device channels

void LinkManager::choosePaths(Link& link, std::shared_ptr<const cma::Process> direct) {
  LinkFacts f;
  f.same_host = link.sameHost();
  f.in_process = link.inProcess();
  f.unix_socket = link.outSocket().isUnix();
  if (direct) {
    f.direct = std::move(direct);
    f.published_addr = link.peerPublishedAddr();
  }
  if (ucx::isPathOf(s_.ucx_hub.get(), s_.config.transport == Transport::kUcx, link)) f.ucx = s_.ucx_hub;
  f.auto_transport = s_.config.transport == Transport::kAuto;
  f.config_one_sided = s_.config.one_sided;
  f.offer = BackendOffer{s_.device_transport, s_.ipc, s_.one_sided};
  ChosenPaths chosen = s_.paths.choose(f);
  link.setPaths(std::move(chosen.host), std::move(chosen.device));
}

Result<std::shared_ptr<Link>> LinkManager::usableLink(uint64_t peer) {
  std::lock_guard<std::mutex> lock(s_.mu);
  if (!s_.initialized) return Status(Code::kFailed, Scope::kEngine, "engine is not initialized");
  if (std::shared_ptr<Link> link = links_.forRequests(peer)) return link;
  if (auto why = links_.downReason(peer)) return linkDown(peer, *why);
  return Status(Code::kNotYetLink, "no link to " + clusterName(peer) + "; connect first");
}

}  // namespace pdlink

namespace pdlink {

std::shared_ptr<void> LinkManager::takeLaneToken() {
  auto count = lanes_;
  uint32_t n = count->load();
  do {
    if (n >= s_.config.limits.max_tcp_lanes) return nullptr;
  } while (!count->compare_exchange_weak(n, n + 1));
  // Non-null (a null shared_ptr<void> reads as "no token"): it points at the count it gives back to.
  return std::shared_ptr<void>(count.get(), [count](void*) { count->fetch_sub(1); });
}

void LinkManager::openLanes(Link& link, Deadline deadline) {
  const std::string& where = link.peerAddress();
  const size_t colon = where.rfind(':');
  if (colon == std::string::npos) return;
  const std::string ip = where.substr(0, colon);
  const auto port = static_cast<uint16_t>(std::strtoul(where.c_str() + colon + 1, nullptr, 10));
  const size_t want = s_.config.limits.tcp_streams - 1;
  std::vector<std::future<Status>> dials;
  for (size_t i = 0; i < want; ++i) {
    std::shared_ptr<void> token = takeLaneToken();
    if (!token) {
      PDLINK_LOG(kInfo, "no lane left for " << clusterName(link.peer()) << " (pdlink.MaxTcpLanes)");
      break;
    }
    dials.push_back(std::async(std::launch::async, [this, &link, ip, port, deadline, want, token]() -> Status {
      auto sock = Socket::connect(ip, port, deadline);
      if (!sock.ok()) return sock.status();
      wire::Hello hello;
      hello.channel = wire::Channel::kLane;
      hello.cluster_id = s_.config.cluster_id;
      hello.expected_peer = link.peer();
      hello.nonce = link.nonce();
      hello.flags = s_.config.payload_integrity ? wire::kHelloPayloadIntegrity : 0;
      uint64_t peer_id = link.peer();
      wire::AuthResult result;
      Session session;
      const auto start = std::chrono::steady_clock::now();
      PDLINK_RETURN_IF_ERROR(helloExchange(sock.value(), hello, s_.config.link_secret, wire::ClientAuth{}, &peer_id,
                                           &result, &session, deadline));
      // The hello exchange is two round trips (hello/ack, auth/result).
      const auto us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start);
      link.setRoundTripUs(static_cast<uint64_t>(us.count()) / 2);
      if (session.integrity != link.payloadIntegrity()) {
        return Status(Code::kLinkFailed, "the peer agreed to another payload integrity on a lane");
      }
      if (!link.addLane(true, std::move(sock.value()), std::move(session.key), session.integrity, token, want)) {
        return Status(Code::kLinkFailed, "the link broke");
      }
      return Status::OK();
    }));
  }
  for (auto& f : dials) {
    Status st = f.get();
    if (!st.ok())
      PDLINK_LOG(kInfo, "a lane to " << clusterName(link.peer()) << " could not be opened: " << st.message());
  }
  PDLINK_LOG(kDebug, "link to " << clusterName(link.peer()) << ": " << 1 + link.laneCount(true) << " tcp streams");
}

}  // namespace pdlink
