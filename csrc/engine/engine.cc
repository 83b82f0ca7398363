// Engine lifecycle, threads, listeners and roles, and the cache registry calls.
// Links and their handshake are in linking.cc and handshake.cc, serving and transfers in data_path.cc
// (the data paths themselves under transport/, transport/path.h).
#include "engine/engine.h"

#include <sys/resource.h>
#include <sys/socket.h>

#include "core/log.h"
#include "engine/engine_internal.h"
#include "transport/cma/cma.h"
#include "transport/tcp/stream_path.h"
#include "transport/ucx/ucx_path.h"

namespace pdlink {

using namespace detail;  // NOLINT: this file is part of the engine

namespace {
bool hasFeature(const Capabilities& c, const char* name) {
  auto it = c.features.find(name);
  return it != c.features.end() && it->second;
}
}  // namespace

Engine::Engine(std::shared_ptr<Backend> backend) : Engine(backend, backend->capabilities()) {}

Engine::Engine(std::shared_ptr<Backend> backend, const Capabilities& caps)
    : backend_(std::move(backend)),
      device_transport_(caps.device_transport),
      ipc_(caps.device_transport && hasFeature(caps, "ipc")),
      one_sided_(caps.device_transport && hasFeature(caps, "one_sided")),
      paths_(*backend_, BackendOffer{device_transport_, ipc_, one_sided_}),
      staged_path_(std::make_unique<StreamPath>(false, backend_.get())) {}

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
  if (config.payload_integrity && config.link_secret.empty()) {
    return Status(Code::kParamInvalid, "payload integrity needs a link secret (pdlink.LinkSecret)");
  }
  if (!config.link_secret.empty()) PDLINK_RETURN_IF_ERROR(crypto::available());  // names what is missing
  if (config.transport == Transport::kUcx && !config.ucx_trusted_network) {
    return Status(Code::kFeatureNotEnabled,
                  "transport ucx trusts every process that can reach this one: UCX aborts the process on a "
                  "malformed connection message and its workers accept connections from anyone (docs/ucx.md, "
                  "'Trust'). Where only trusted hosts reach this one, set ucx_trusted_network "
                  "(PDLINK_UCX_TRUSTED_NETWORK=1, pdlink.UcxTrustedNetwork=1)");
  }
  std::shared_ptr<ucx::UcxHub> hub;  // first: nothing else to undo when UCX cannot be had
  const bool auto_ucx = config.transport == Transport::kAuto && config.ucx_trusted_network;
  if (config.transport == Transport::kUcx || auto_ucx) {
    auto opened = ucx::UcxHub::open(auto_ucx);
    if (opened.ok()) {
      hub = opened.value();
    } else if (auto_ucx) {  // auto may pick ucx between hosts (choosePaths); without UCX, the stream
      PDLINK_LOG(kInfo, "no ucx path (" << opened.status().message() << "); links between hosts use tcp");
    } else {
      return opened.status();
    }
  }
  config_ = config;
  links_.setOneWay(config.one_way_links);
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
  hint_ = localHint();
  if (config.transport != Transport::kTcp) {
    std::string name;
    auto u = startUnixListener(&name);
    if (u.ok()) {
      unix_listener_ = std::move(u.value());
      unix_name_ = name;
    } else {
      PDLINK_LOG(kWarn, "no same-host socket (" << u.status().message() << "); links to this engine use tcp");
    }
  }
  if (hub) {
    ucx_hub_ = std::move(hub);
    paths_.setServer(wire::kFlagUcx, std::make_unique<UcxServer>(ucx_hub_));
  }
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
    links = links_.removeAll();
  }
  stopListeners();
  for (auto& link : links) {
    if (!link->broken()) {
      std::unique_lock<std::mutex> out(link->outMutex(), std::try_to_lock);
      if (out.owns_lock()) {  // tell the peer, best effort, without waiting on a busy link
        wire::RequestHeader h{wire::Op::kUnlink, 0, 0};
        std::string frame = wire::encode(h);
        (void)link->out().sendFrame(frame, Deadline::afterMs(200));
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
    std::unique_lock<std::mutex> lock(threads_->mu);
    threads_->cv.wait(lock, [&] { return threads_->running == 0; });
  }
  std::lock_guard<std::mutex> lock(mu_);
  pending_.clear();
  registry_.clear();
  {
    std::lock_guard<std::mutex> inbox(notify_mu_);  // unread notifications go with the links
    inbox_ = Inbox{};
  }
  device_pool_.reset();
  host_pool_.reset();
  paths_.setServer(wire::kFlagUcx, nullptr);
  ucx_hub_.reset();  // the workers go with the last link that still holds them
  initialized_ = false;
  stopping_ = false;
}

// ---------------------------------------------------------------- threads

void Engine::spawn(std::function<void()> fn) {
  // Detached: a thread that ends frees its stack at once, with nobody to join it. `threads_`
  // counts the running ones so that finalize can wait for them; a thread's last act is the
  // decrement, and the counter it then touches it co-owns, so the engine may go right after.
  std::shared_ptr<Threads> t = threads_;
  {
    std::lock_guard<std::mutex> lock(t->mu);
    ++t->running;
  }
  try {
    std::thread([t, fn = std::move(fn)]() mutable {
      fn();
      fn = nullptr;  // what it captured (a link, a socket) goes before the count does
      std::lock_guard<std::mutex> lock(t->mu);
      if (--t->running == 0) t->cv.notify_all();
    }).detach();
  } catch (...) {
    std::lock_guard<std::mutex> lock(t->mu);
    if (--t->running == 0) t->cv.notify_all();
    throw;
  }
}

EngineStats Engine::stats() const {
  EngineStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.live_links = links_.live();
    s.tombstones = links_.tombstones();
    s.handshakes = slots_.total;
    s.handshakes_evicted = slots_.evicted;
    for (const Listener* l : {listener_.get(), comm_listener_.get(), unix_listener_.get()}) {
      if (l) s.listener_backoffs += l->backoffs();
    }
  }
  s.handshakes_refused = handshakes_refused_.load();
  s.pins_expired = pins_expired_.load();
  {
    std::lock_guard<std::mutex> lock(notify_mu_);
    s.notifications = inbox_.queue.size();
    s.notifications_refused = inbox_.refused;
  }
  {
    std::lock_guard<std::mutex> lock(threads_->mu);
    s.threads = threads_->running;
  }
  return s;
}

// ---------------------------------------------------------------- listener and roles

uint32_t EngineLimits::defaultMaxLinks() {
  rlimit fds{};
  if (::getrlimit(RLIMIT_NOFILE, &fds) != 0 || fds.rlim_cur == RLIM_INFINITY) return 512;
  if (fds.rlim_cur <= kReservedDescriptors + kDescriptorsPerLink) return 1;
  return static_cast<uint32_t>(std::min<rlim_t>(512, (fds.rlim_cur - kReservedDescriptors) / kDescriptorsPerLink));
}

std::string Engine::sourceOf(const Socket& s) {
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

void Engine::HandshakeSlot::release() {
  if (!engine) return;
  std::lock_guard<std::mutex> lock(engine->mu_);
  engine->hearLocked(this);
  if (evicted) {
    --engine->slots_.evicting;  // its place was counted out when it was evicted
  } else {
    --engine->slots_.total;
    auto it = engine->slots_.per_source.find(source);
    if (it != engine->slots_.per_source.end() && --it->second == 0) engine->slots_.per_source.erase(it);
  }
  engine = nullptr;
}

void Engine::hearLocked(HandshakeSlot* slot) {
  if (slot->silent < 0) return;
  slots_.silent.erase(slot->arrival);
  slot->silent = -1;
}

bool Engine::evictSilentLocked(const std::string& newcomer, bool same_source) {
  // The oldest connection (of the newcomer's source, or of anyone) that has not sent its hello yet
  // makes room: its place is the newcomer's at once. Its thread wakes from its read and ends; until it has,
  // it counts as evicting, and at most kEvictingPerSlot x max_handshakes of those may be in flight.
  if (slots_.evicting >= kEvictingPerSlot * size_t{config_.limits.max_handshakes}) return false;
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

Listener::AcceptFn Engine::acceptor() {
  return [this](Socket s) {
    // A handshake slot is taken here, on the listener's thread, before any thread is started: a
    // flood from one source runs out of its own slots, not everyone's.
    auto slot = std::make_shared<HandshakeSlot>();
    const std::string source = sourceOf(s);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      const EngineLimits& lim = config_.limits;
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
      slot->engine = this;
      slot->source = source;
      slot->arrival = ++slots_.arrivals;
      slot->silent = s.fd();  // evictable until its hello arrives (handleIncoming)
      slots_.silent[slot->arrival] = slot.get();
    }
    auto holder = std::make_shared<Socket>(std::move(s));
    try {
      spawn([this, holder, slot] { handleIncoming(std::move(*holder), slot.get()); });
    } catch (const std::exception& e) {  // no thread to be had: drop this connection, keep listening
      PDLINK_LOG(kWarn, "dropping connection from " << holder->peer() << ": " << e.what());
      slot->release();
    }
  };
}

Result<std::unique_ptr<Listener>> Engine::startListener(const std::string& ip, uint16_t port) {
  return Listener::start(ip, port, acceptor());
}

Result<std::unique_ptr<Listener>> Engine::startUnixListener(std::string* name) {
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

void Engine::stopListeners() {
  std::unique_ptr<Listener> a, b, c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    a = std::move(listener_);
    b = std::move(comm_listener_);
    c = std::move(unix_listener_);
    unix_name_.clear();
  }
  // Destroyed outside mu_: the accept callback takes it.
}

Status Engine::switchRole(Role role, const std::string& listen_ip, uint16_t listen_port) {
  std::unique_ptr<Listener> old, fresh;
  bool keep = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!initialized_) return Status(Code::kFailed, "engine is not initialized");
    if (config_.one_way_links) {
      // As llm_datadist's hixl backend: the role is a label; links and listener stay as they are.
      const bool same = listen_ip.empty() || (listener_ && listen_ip == listener_->ip() &&
                                              (listen_port == listener_->port() || listen_port == 0));
      if (!same) {
        return Status(Code::kFeatureNotEnabled,
                      "with one-way links switch_role cannot change the listen "
                      "address; close the engine and open a new one");
      }
      role_ = role;
      return Status::OK();
    }
    if (!links_.empty() || !linking_.empty()) {
      std::string ids;
      for (uint64_t id : links_.peers()) ids += (ids.empty() ? "" : ", ") + std::to_string(id);
      return Status(Code::kExistLink,
                    "cannot switch role while links exist (peer clusters: " + ids + "); disconnect them first");
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

// ---------------------------------------------------------------- registry

Result<std::shared_ptr<CacheEntry>> Engine::registerCache(const CacheLayout& layout, const std::vector<uint64_t>& addrs,
                                                          const std::vector<RequestKey>& keys,
                                                          std::optional<uint64_t> blocks_model,
                                                          bool remote_accessible) {
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

std::vector<Engine::PoolInfo> Engine::pools() const {
  std::vector<PoolInfo> out;
  for (const auto& pool : {device_pool_, host_pool_}) {
    if (pool)
      out.push_back(
          {pool == device_pool_ ? Placement::kDevice : Placement::kHost, pool->base(), pool->capacity(), pool->used()});
  }
  return out;
}

Result<std::shared_ptr<CacheEntry>> Engine::allocateCache(const CacheLayout& layout,
                                                          const std::vector<RequestKey>& keys,
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

Status Engine::copyLocal(const std::vector<uint64_t>& dst_addrs, Placement dst_placement,
                         const std::vector<uint64_t>& src_addrs, Placement src_placement,
                         const std::vector<CopyRun>& runs) {
  if (dst_addrs.size() != src_addrs.size()) return Status(Code::kParamInvalid, "tensor counts differ");
  for (size_t t = 0; t < dst_addrs.size(); ++t) {
    for (const CopyRun& r : runs) {
      PDLINK_RETURN_IF_ERROR(backend_->copy(reinterpret_cast<void*>(dst_addrs[t] + r.dst_offset), dst_placement,
                                            reinterpret_cast<const void*>(src_addrs[t] + r.src_offset), src_placement,
                                            r.length));
    }
  }
  return Status::OK();
}

}  // namespace pdlink
