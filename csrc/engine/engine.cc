// The Engine facade (engine/engine.h): lifecycle (initialize and finalize, which order the parts'
// steps), stats, the cache registry calls and local copies; everything else is handed to the link
// manager (link_manager.cc, handshake.cc), the request server (request_server.cc, notify.cc) or
// transfers (transfers.cc).
#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <tuple>
#include <thread>

#include <sys/resource.h>
#include <sys/socket.h>

#include "core/log.h"
#include "engine/engine_internal.h"
#include "transport/cma/cma.h"
#include "transport/tcp/stream_path.h"
#include "transport/ucx/ucx_path.h"

namespace pdlink {

using namespace detail;  // NOLINT: this file is part of the engine

Engine::Engine(std::shared_ptr<Backend> backend) : Engine(backend, backend->capabilities()) {}

Engine::Engine(std::shared_ptr<Backend> backend, const Capabilities& caps)
    : state_(std::move(backend), caps),
      link_manager_(state_,
                    [this](const std::shared_ptr<Link>& link, Stream* lane) {
                      if (lane) {
                        server_.serveLane(link, *lane);
                      } else {
                        server_.serve(link);
                      }
                    }),
      server_(state_, link_manager_),
      transfers_(state_, link_manager_) {}

Engine::~Engine() { finalize(); }

bool Engine::initialized() const { return state_.isInitialized(); }

Role Engine::role() const {
  std::lock_guard<std::mutex> lock(state_.mu);
  return state_.role;
}

uint16_t Engine::listenPort() const { return link_manager_.listenPort(); }

Status Engine::initialize(const EngineConfig& config) {
  std::lock_guard<std::mutex> lock(state_.mu);
  if (state_.initialized) return Status::OK();
  if (config.sync_timeout_ms <= 0) return Status(Code::kParamInvalid, "sync timeout must be > 0 ms");
  const EngineLimits& lim = config.limits;
  if (lim.tcp_streams == 0 || lim.tcp_streams > limits::kMaxTcpStreams || lim.max_tcp_lanes == 0 ||
      lim.tcp_chunk_bytes < limits::kMinTcpChunkBytes || lim.tcp_chunk_bytes > limits::kMaxTcpChunkBytes) {
    return Status(Code::kParamInvalid,
                  "tcp_streams must lie in [1, 16], max_tcp_lanes be positive and "
                  "tcp_chunk_bytes lie in [64 KiB, 64 MiB]");
  }
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
  if (lim.max_metric_peers > limits::kMaxMetricPeers) {
    return Status(Code::kParamInvalid, "max_metric_peers must be at most " + std::to_string(limits::kMaxMetricPeers));
  }
  state_.config = config;
  state_.telemetry = std::make_shared<Telemetry>(lim.max_metric_peers);
  state_.offers.configure(OfferLimits{config.limits.max_offers, config.limits.max_lease_ms,
                                      config.limits.offer_lease_ms, config.limits.max_handoff_events});
  link_manager_.setOneWayLocked(config.one_way_links);
  if (config.device_pool.bytes > 0) {
    auto pool =
        MemPool::create(state_.backend, Placement::kDevice, config.device_pool.bytes, config.device_pool.page_shift);
    if (!pool.ok()) return pool.status();
    state_.device_pool = pool.value();
  }
  if (config.host_pool.bytes > 0) {
    auto pool = MemPool::create(state_.backend, Placement::kHost, config.host_pool.bytes, config.host_pool.page_shift);
    if (!pool.ok()) {
      state_.device_pool.reset();
      return pool.status();
    }
    state_.host_pool = pool.value();
  }
  if (!config.listen_ip.empty()) {
    Status listening = link_manager_.listenLocked(config.listen_ip, config.listen_port);
    if (!listening.ok()) {
      state_.device_pool.reset();
      state_.host_pool.reset();
      return listening;
    }
  }
  state_.hint = localHint();
  if (config.transport != Transport::kTcp) link_manager_.listenUnixLocked();
  if (hub) {
    state_.ucx_hub = std::move(hub);
    state_.paths.setServer(wire::kFlagUcx, std::make_unique<UcxServer>(state_.ucx_hub));
  }
  state_.role = config.role;
  state_.epoch = 0;
  state_.epoch_tag.store(EngineState::tagOf(0));
  state_.phase.store(Phase::kReady);
  state_.registry.publishRole(0, false);
  state_.stopping = false;
  state_.initialized = true;
  PDLINK_LOG(kInfo, "engine " << config.cluster_id << " initialised on backend " << state_.backend->name()
                              << (link_manager_.listeningLocked()
                                      ? ", listening on port " + std::to_string(link_manager_.listenPortLocked())
                                      : ""));
  return Status::OK();
}

void Engine::finalize() {
  std::vector<std::shared_ptr<Link>> links;
  {
    std::lock_guard<std::mutex> lock(state_.mu);
    if (!state_.initialized) return;
    state_.stopping = true;
    links = link_manager_.takeAllLocked();
  }
  link_manager_.stopListeners();
  LinkManager::closeAll(links);
  link_manager_.shutdownHandshakes();
  state_.waitThreads();
  std::lock_guard<std::mutex> lock(state_.mu);
  link_manager_.clearPendingLocked();
  state_.offers.releaseAll(OfferReason::kReleased);  // nothing serves them any more
  state_.registry.clear();
  server_.clearNotifications();  // unread notifications go with the links
  state_.device_pool.reset();
  state_.host_pool.reset();
  state_.paths.setServer(wire::kFlagUcx, nullptr);
  state_.ucx_hub.reset();  // the workers go with the last link that still holds them
  state_.initialized = false;
  state_.stopping = false;
}

EngineStats Engine::stats() const {
  EngineStats s;
  {
    std::lock_guard<std::mutex> lock(state_.mu);
    link_manager_.addStatsLocked(&s);
  }
  s.handshakes_refused = link_manager_.handshakesRefused();
  server_.addStats(&s);
  s.threads = state_.threadsRunning();
  const OfferStats o = state_.offers.stats();
  s.offers_live = o.live;
  s.offers_released = o.released;
  s.offers_expired = o.expired;
  s.offers_aborted = o.aborted;
  s.offer_bytes = o.bytes;
  s.handoff_events_dropped = o.events_dropped;
  s.pinned_bytes = static_cast<uint64_t>(std::max<int64_t>(0, state_.pinned_bytes.load()));
  s.role_epoch = state_.roleState().epoch;
  s.taken_at = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  if (state_.telemetry) {
    TelemetrySnapshot t = state_.telemetry->snapshot();
    s.transfers = std::move(t.transfers);
    s.failures = std::move(t.failures);
    s.link_events = std::move(t.link_events);
  }
  return s;
}

namespace {

HistogramCounts minus(const HistogramCounts& a, const HistogramCounts& b) {
  HistogramCounts d = a;
  for (size_t i = 0; i < d.buckets.size() && i < b.buckets.size(); ++i) d.buckets[i] -= b.buckets[i];
  d.sum -= b.sum;
  d.count -= b.count;
  return d;
}

// Subtracts from each entry of `later` the entry of `earlier` with the same key (`key_of`), by
// `sub`; entries new since `earlier` stay whole.
template <class T, class Key, class Sub>
void subtractMatching(std::vector<T>& later, const std::vector<T>& earlier, Key key_of, Sub sub) {
  std::map<decltype(key_of(earlier.front())), const T*> index;
  for (const T& e : earlier) index.emplace(key_of(e), &e);
  for (T& l : later) {
    auto it = index.find(key_of(l));
    if (it != index.end()) sub(l, *it->second);
  }
}

}  // namespace

EngineStats EngineStats::since(const EngineStats& earlier) const {
  EngineStats d = *this;
  d.handshakes_refused -= earlier.handshakes_refused;
  d.handshakes_evicted -= earlier.handshakes_evicted;
  d.listener_backoffs -= earlier.listener_backoffs;
  d.pins_expired -= earlier.pins_expired;
  d.notifications_refused -= earlier.notifications_refused;
  d.offers_released -= earlier.offers_released;
  d.offers_expired -= earlier.offers_expired;
  d.offers_aborted -= earlier.offers_aborted;
  d.handoff_events_dropped -= earlier.handoff_events_dropped;
  subtractMatching(
      d.transfers, earlier.transfers, [](const TransferSeries& x) { return std::make_tuple(x.peer, x.path, x.op); },
      [](TransferSeries& t, const TransferSeries& e) {
        t.transfers -= e.transfers;
        t.bytes -= e.bytes;
        t.descriptors -= e.descriptors;
        t.queue = minus(t.queue, e.queue);
        t.wire = minus(t.wire, e.wire);
        t.total = minus(t.total, e.total);
      });
  subtractMatching(
      d.failures, earlier.failures,
      [](const FailureSeries& x) { return std::make_tuple(x.peer, x.path, x.op, x.code, x.stage); },
      [](FailureSeries& f, const FailureSeries& e) { f.count -= e.count; });
  subtractMatching(
      d.link_events, earlier.link_events,
      [](const LinkEventSeries& x) { return std::make_tuple(x.peer, x.event, x.reason); },
      [](LinkEventSeries& l, const LinkEventSeries& e) { l.count -= e.count; });
  return d;
}

// ---------------------------------------------------------------- limits

uint32_t EngineLimits::defaultMaxLinks() {
  rlimit fds{};
  if (::getrlimit(RLIMIT_NOFILE, &fds) != 0 || fds.rlim_cur == RLIM_INFINITY) return 512;
  if (fds.rlim_cur <= kReservedDescriptors + kDescriptorsPerLink) return 1;
  return static_cast<uint32_t>(std::min<rlim_t>(512, (fds.rlim_cur - kReservedDescriptors) / kDescriptorsPerLink));
}

// ---------------------------------------------------------------- links, serving, transfers

Status Engine::switchRole(const SwitchOptions& options) { return link_manager_.switchRole(options); }

std::vector<Status> Engine::link(const std::vector<PeerAddress>& peers, int64_t timeout_ms,
                                 std::vector<uint64_t>* peer_ids) {
  return link_manager_.link(peers, timeout_ms, peer_ids);
}

std::vector<Status> Engine::unlink(const std::vector<uint64_t>& ids, int64_t timeout_ms, bool force) {
  return link_manager_.unlink(ids, timeout_ms, force);
}

std::vector<LinkInfo> Engine::links() const { return link_manager_.links(); }

uint64_t Engine::linkedSince(uint64_t after, std::vector<uint64_t>* peers) const {
  return link_manager_.linkedSince(after, peers);
}

Status Engine::ping(uint64_t cluster_id, int64_t timeout_ms) { return link_manager_.ping(cluster_id, timeout_ms); }

Result<uint16_t> Engine::startCommListener(const std::string& ip, uint16_t port) {
  return link_manager_.startCommListener(ip, port);
}

Status Engine::serveStream(const std::shared_ptr<Link>& link, Stream& in, ServeState* state) {
  return server_.serveStream(link, in, state);
}

Status Engine::notify(uint64_t cluster_id, const std::string& name, const std::string& message, int64_t timeout_ms) {
  return server_.notify(cluster_id, name, message, timeout_ms);
}

std::vector<Notification> Engine::takeNotifications() { return server_.takeNotifications(); }

Result<wire::RawTable> Engine::describeMemory(uint64_t cluster_id, int64_t timeout_ms) {
  return transfers_.describeMemory(cluster_id, timeout_ms);
}

Status Engine::pull(const TransferSpec& spec) { return transfers_.pull(spec); }
Status Engine::push(const TransferSpec& spec) { return transfers_.push(spec); }

Result<std::shared_ptr<PreparedTransfer>> Engine::prepare(const TransferSpec& spec, uint64_t block_size,
                                                          uint64_t remote_base, uint64_t remote_bytes,
                                                          const BlockMapping& mapping) {
  return transfers_.prepare(spec, block_size, remote_base, remote_bytes, mapping);
}

Status Engine::post(PreparedTransfer& p, const int64_t* local, const int64_t* remote, size_t n, bool is_push,
                    const CancelToken* cancel) {
  return transfers_.post(p, local, remote, n, is_push, cancel);
}

// ---------------------------------------------------------------- registry

Result<std::shared_ptr<CacheEntry>> Engine::registerCache(const CacheLayout& layout, const std::vector<uint64_t>& addrs,
                                                          const std::vector<RequestKey>& keys,
                                                          std::optional<uint64_t> blocks_model,
                                                          bool remote_accessible) {
  if (!initialized()) return Status(Code::kFailed, Scope::kEngine, "engine is not initialized");
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
  return state_.registry.add(std::move(e), keys);
}

std::vector<Engine::PoolInfo> Engine::pools() const {
  std::vector<PoolInfo> out;
  for (const auto& pool : {state_.device_pool, state_.host_pool}) {
    if (pool)
      out.push_back({pool == state_.device_pool ? Placement::kDevice : Placement::kHost, pool->base(), pool->capacity(),
                     pool->used()});
  }
  return out;
}

Result<std::shared_ptr<CacheEntry>> Engine::allocateCache(const CacheLayout& layout,
                                                          const std::vector<RequestKey>& keys,
                                                          std::optional<uint64_t> blocks_model) {
  if (!initialized()) return Status(Code::kFailed, Scope::kEngine, "engine is not initialized");
  std::shared_ptr<MemPool> pool = layout.placement == Placement::kDevice ? state_.device_pool : state_.host_pool;
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
  return state_.registry.add(std::move(e), keys);
}

Status Engine::deallocateCache(int64_t id, bool expect_blocks) { return state_.registry.deallocate(id, expect_blocks); }
Status Engine::unregisterCache(int64_t id) {
  auto removed = state_.registry.unregister(id);
  if (!removed.ok()) return removed.status();
  std::shared_ptr<CacheEntry> entry = std::move(removed).value();
  // No request resolves to it any more; what already did holds the entry (a transfer being served
  // or made, a pin, an offer and its reads): the memory is the caller's again only once the last
  // of those is gone. Offers are given up; the rest ends within its own deadline, a pin at the
  // peer's next frame or after the pin timeout.
  const size_t offers = state_.offers.releaseCache(entry.get(), OfferReason::kReleased);
  const int64_t bound_ms =
      2 * std::max<int64_t>(state_.pinTimeoutMs(), std::max<int64_t>(2 * state_.config.sync_timeout_ms, 5000));
  const Deadline deadline = Deadline::afterMs(bound_ms);
  auto pause = std::chrono::microseconds(50);
  while (entry.use_count() > 1) {
    if (deadline.expired()) {
      return Status(Code::kTimeout, "cache " + std::to_string(id) +
                                        " was unregistered, but transfers still use its "
                                        "memory after " +
                                        std::to_string(bound_ms) + " ms: keep it allocated");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(2 * pause, std::chrono::milliseconds(5));
  }
  if (offers) PDLINK_LOG(kInfo, "cache " << id << " unregistered: " << offers << " offer(s) of it released");
  return Status::OK();
}
void Engine::removeCacheKey(const RequestKey& key) { state_.registry.removeKey(key); }

Status Engine::copyLocal(const std::vector<uint64_t>& dst_addrs, Placement dst_placement,
                         const std::vector<uint64_t>& src_addrs, Placement src_placement,
                         const std::vector<CopyRun>& runs) {
  if (dst_addrs.size() != src_addrs.size()) return Status(Code::kParamInvalid, "tensor counts differ");
  for (size_t t = 0; t < dst_addrs.size(); ++t) {
    for (const CopyRun& r : runs) {
      PDLINK_RETURN_IF_ERROR(state_.backend->copy(reinterpret_cast<void*>(dst_addrs[t] + r.dst_offset), dst_placement,
                                                  reinterpret_cast<const void*>(src_addrs[t] + r.src_offset),
                                                  src_placement, r.length));
    }
  }
  return Status::OK();
}

}  // namespace pdlink
