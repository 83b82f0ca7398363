// Telemetry (engine/telemetry.h): lock-free counters per peer, path and op, and their snapshot.
#include "engine/telemetry.h"

#include <cstring>

namespace pdlink {

namespace {

constexpr const char* kOpNames[kOps] = {"pull", "push"};

const char* pathName(int i) { return i < static_cast<int>(kPathNames.size()) ? kPathNames[i] : "other"; }

// kLatencyBounds in nanoseconds, for the hot path's comparisons.
struct BoundsNs {
  std::array<uint64_t, kLatencyBounds.size()> ns{};
  BoundsNs() {
    for (size_t i = 0; i < kLatencyBounds.size(); ++i) ns[i] = static_cast<uint64_t>(kLatencyBounds[i] * 1e9 + 0.5);
  }
};
const BoundsNs kBoundsNs;

}  // namespace

struct Histogram {
  std::array<std::atomic<uint64_t>, kLatencyBuckets> buckets{};
  std::atomic<uint64_t> sum_ns{0};
  std::atomic<uint64_t> count{0};

  void observe(uint64_t ns) {
    size_t i = 0;
    while (i < kBoundsNs.ns.size() && ns > kBoundsNs.ns[i]) ++i;  // le: a value on a bound is in its bucket
    buckets[i].fetch_add(1, std::memory_order_relaxed);
    sum_ns.fetch_add(ns, std::memory_order_relaxed);
    count.fetch_add(1, std::memory_order_relaxed);
  }
  HistogramCounts read() const {
    HistogramCounts h;
    h.buckets.reserve(kLatencyBuckets);
    for (const auto& b : buckets) h.buckets.push_back(b.load(std::memory_order_relaxed));
    h.sum = static_cast<double>(sum_ns.load(std::memory_order_relaxed)) / 1e9;
    h.count = count.load(std::memory_order_relaxed);
    return h;
  }
};

struct Telemetry::Series {
  std::atomic<uint64_t> transfers{0}, bytes{0}, descriptors{0};
  Histogram queue, wire, total;
};

struct Telemetry::Peer {
  explicit Peer(uint64_t id, bool other) : id(id), other(other) {}
  const uint64_t id;
  const bool other;  // the peers past the cap
  std::array<std::array<std::atomic<Series*>, kOps>, kPaths> series{};
  std::array<std::atomic<uint64_t>, 2> events{};  // up, reconnect
  std::array<std::atomic<uint64_t>, kLinkDownReasons> down{};
  std::atomic<bool> linked_before{false};
  std::string label() const { return other ? "other" : std::to_string(id); }
  ~Peer() {
    for (auto& row : series)
      for (auto& s : row) delete s.load();
  }
};

Telemetry::Telemetry(uint64_t max_peers) : max_peers_(max_peers) {
  size_t n = 16;
  while (n < 2 * max_peers_) n *= 2;
  slots_ = std::vector<std::atomic<Peer*>>(n);
  peers_.push_back(std::make_unique<Peer>(0, true));
  other_ = peers_.back().get();
}

Telemetry::~Telemetry() = default;

Telemetry::Peer* Telemetry::find(uint64_t peer_id, size_t* start) const {
  const size_t mask = slots_.size() - 1;
  *start = static_cast<size_t>((peer_id * 0x9E3779B97F4A7C15ull) >> 20) & mask;
  for (size_t i = 0; i <= mask; ++i) {  // the table is at most half full: a free slot ends the probe
    Peer* p = slots_[(*start + i) & mask].load(std::memory_order_acquire);
    if (p == nullptr) break;
    if (p->id == peer_id) return p;
  }
  return nullptr;
}

Telemetry::Peer& Telemetry::peer(uint64_t peer_id) {
  size_t start = 0;
  Peer* p = find(peer_id, &start);
  return p != nullptr ? *p : *other_;
}

Telemetry::Peer& Telemetry::admit(uint64_t peer_id) {
  size_t start = 0;
  if (Peer* p = find(peer_id, &start)) return *p;
  std::lock_guard<std::mutex> lock(mu_);
  const size_t mask = slots_.size() - 1;
  for (size_t i = 0; i <= mask; ++i) {
    std::atomic<Peer*>& slot = slots_[(start + i) & mask];
    Peer* p = slot.load(std::memory_order_acquire);
    if (p != nullptr && p->id == peer_id) return *p;  // admitted meanwhile
    if (p != nullptr) continue;
    if (peers_.size() - 1 >= max_peers_) return *other_;
    peers_.push_back(std::make_unique<Peer>(peer_id, false));
    slot.store(peers_.back().get(), std::memory_order_release);
    return *peers_.back();
  }
  return *other_;
}

int Telemetry::pathIndex(const char* path) {
  for (size_t i = 0; i < kPathNames.size(); ++i) {
    if (std::strcmp(path, kPathNames[i]) == 0) return static_cast<int>(i);
  }
  return kPaths - 1;
}

Telemetry::Series& Telemetry::series(Peer& peer, const char* path, bool is_push) {
  std::atomic<Series*>& slot = peer.series[pathIndex(path)][is_push ? 1 : 0];
  Series* s = slot.load(std::memory_order_acquire);
  if (s != nullptr) return *s;
  auto made = std::make_unique<Series>();
  Series* expected = nullptr;
  if (slot.compare_exchange_strong(expected, made.get(), std::memory_order_acq_rel)) return *made.release();
  return *expected;  // another thread made it first
}

void Telemetry::transferDone(Peer& peer, const char* path, bool is_push, uint64_t bytes, uint64_t descriptors,
                             uint64_t queue_ns, uint64_t wire_ns, uint64_t total_ns) {
  Series& s = series(peer, path, is_push);
  s.transfers.fetch_add(1, std::memory_order_relaxed);
  s.bytes.fetch_add(bytes, std::memory_order_relaxed);
  s.descriptors.fetch_add(descriptors, std::memory_order_relaxed);
  s.queue.observe(queue_ns);
  s.wire.observe(wire_ns);
  s.total.observe(total_ns);
}

void Telemetry::transferFailed(Peer& peer, const char* path, bool is_push, Code code, TransferStage stage) {
  std::lock_guard<std::mutex> lock(mu_);
  ++failures_[{&peer, pathIndex(path), is_push ? 1 : 0, static_cast<uint32_t>(code), static_cast<int>(stage)}];
}

void Telemetry::linkUp(uint64_t peer_id) {
  Peer& p = admit(peer_id);
  p.events[0].fetch_add(1, std::memory_order_relaxed);
  // The "other" peer stands for many: a reconnect is counted only for a peer of its own.
  if (p.linked_before.exchange(true, std::memory_order_relaxed) && !p.other) {
    p.events[1].fetch_add(1, std::memory_order_relaxed);
  }
}

void Telemetry::linkDown(uint64_t peer_id, LinkDown why) {
  peer(peer_id).down[static_cast<int>(why)].fetch_add(1, std::memory_order_relaxed);
}

TelemetrySnapshot Telemetry::snapshot() const {
  TelemetrySnapshot out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& peer : peers_) {
    const std::string label = peer->label();
    for (int path = 0; path < kPaths; ++path) {
      for (int op = 0; op < kOps; ++op) {
        const Series* s = peer->series[path][op].load(std::memory_order_acquire);
        if (s == nullptr) continue;
        TransferSeries t;
        t.peer = label;
        t.path = pathName(path);
        t.op = kOpNames[op];
        t.transfers = s->transfers.load(std::memory_order_relaxed);
        t.bytes = s->bytes.load(std::memory_order_relaxed);
        t.descriptors = s->descriptors.load(std::memory_order_relaxed);
        t.queue = s->queue.read();
        t.wire = s->wire.read();
        t.total = s->total.read();
        out.transfers.push_back(std::move(t));
      }
    }
    static constexpr const char* kEvents[2] = {"up", "reconnect"};
    for (int e = 0; e < 2; ++e) {
      const uint64_t n = peer->events[e].load(std::memory_order_relaxed);
      if (n != 0) out.link_events.push_back({label, kEvents[e], "", n});
    }
    for (int why = 0; why < kLinkDownReasons; ++why) {
      const uint64_t n = peer->down[why].load(std::memory_order_relaxed);
      if (n != 0) out.link_events.push_back({label, "down", downName(static_cast<LinkDown>(why)), n});
    }
  }
  for (const auto& [key, count] : failures_) {
    const auto& [peer, path, op, code, stage] = key;
    out.failures.push_back({peer->label(), pathName(path), kOpNames[op], codeName(static_cast<Code>(code)),
                            stageName(static_cast<TransferStage>(stage)), count});
  }
  return out;
}

}  // namespace pdlink
