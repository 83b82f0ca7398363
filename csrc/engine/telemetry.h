// Telemetry: what an engine's transfers and links did, counted per peer, data path and op
// (docs/metrics.md). Read as a snapshot (Engine::stats, EngineStats::transfers and the rest);
// exported by pdlink.metrics.
//
// What is counted, on the side that initiates a transfer (pull, push, prepared post, descriptor
// list): a completed transfer adds 1, its payload bytes and its descriptors (the (tensor, range)
// pieces its caller named, before consecutive ones merge), and its latencies: queue (entry to the
// moment its first request goes onto the link: admission, planning, waiting for the link's out
// mutex), wire (from there to completion) and total (entry to completion). A failed or refused
// transfer adds 1 to its failures by status code and stage (link.h TransferStage), nothing else.
// Links: each installed link adds an `up` (a `reconnect` too when the peer had one before), each
// end a `down` with its reason (link.h LinkDown).
//
// Cardinality: the first `max_peers` peers (EngineLimits::max_metric_peers) a link was installed
// with get series of their own for the engine's life; later ones, and ids no link was ever
// installed with (a transfer to a peer never linked), are all counted under one "other" peer.
// Paths are the fixed set of PathCaps names (kPathNames), ops pull and push.
//
// Threading: counting is lock-free (relaxed atomics; a peer's first sight takes the table's mutex
// once); snapshot() takes that mutex (to walk the peers) and reads the atomics, so a snapshot
// taken while transfers run may be a few counts apart between families, never torn within a count.
// Memory: at most max_peers + 1 peers, each with at most kPaths x kOps series made on first use.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "core/status.h"
#include "transport/link.h"

namespace pdlink {

// The histograms' bucket upper bounds, in seconds (the last bucket, +Inf, is implicit).
constexpr std::array<double, 21> kLatencyBounds{1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
                                                0.05, 0.1,    0.25, 0.5,  1.0,    2.5,  5.0,  10.0,   30.0, 60.0};
constexpr int kLatencyBuckets = static_cast<int>(kLatencyBounds.size()) + 1;
constexpr std::array<const char*, 8> kPathNames{"tcp", "unix", "cma", "ucx", "ipc", "hccl-one-sided", "hccl", "none"};
constexpr int kPaths = static_cast<int>(kPathNames.size()) + 1;  // the last: "other" (a path not listed)
constexpr int kOps = 2;                                          // pull, push
constexpr uint64_t kDefaultMaxMetricPeers = 64;

// ---------------------------------------------------------------- snapshots (plain values)

struct HistogramCounts {
  std::vector<uint64_t> buckets;  // per bucket of kLatencyBounds and +Inf, not cumulative
  double sum = 0;                 // seconds
  uint64_t count = 0;
};

// One (peer, path, op): its completed transfers.
struct TransferSeries {
  std::string peer;  // the cluster id in decimal, or "other"
  std::string path;
  std::string op;
  uint64_t transfers = 0;
  uint64_t bytes = 0;
  uint64_t descriptors = 0;
  HistogramCounts queue, wire, total;
};

// Failed transfers of one (peer, path, op, code, stage).
struct FailureSeries {
  std::string peer, path, op;
  std::string code;  // the LLMStatusCode name (codeName)
  std::string stage;
  uint64_t count = 0;
};

// Link events of one (peer, event, reason): event "up", "reconnect" (reason "") or "down".
struct LinkEventSeries {
  std::string peer, event, reason;
  uint64_t count = 0;
};

// What telemetry adds to EngineStats.
struct TelemetrySnapshot {
  std::vector<TransferSeries> transfers;
  std::vector<FailureSeries> failures;
  std::vector<LinkEventSeries> link_events;
};

// ---------------------------------------------------------------- counting

class Telemetry {
 public:
  explicit Telemetry(uint64_t max_peers = kDefaultMaxMetricPeers);
  ~Telemetry();
  Telemetry(const Telemetry&) = delete;
  Telemetry& operator=(const Telemetry&) = delete;

  struct Peer;
  // The counters of `peer_id`: its own once a link to it was installed (linkUp) within the cap,
  // else the "other" peer's. Valid for the Telemetry's life. Lock-free.
  Peer& peer(uint64_t peer_id);

  // One transfer's outcome (see the file comment); `path` a PathCaps name ("none": no link).
  void transferDone(Peer& peer, const char* path, bool is_push, uint64_t bytes, uint64_t descriptors, uint64_t queue_ns,
                    uint64_t wire_ns, uint64_t total_ns);
  void transferFailed(Peer& peer, const char* path, bool is_push, Code code, TransferStage stage);
  // A link to `peer_id` was installed / went down.
  void linkUp(uint64_t peer_id);
  void linkDown(uint64_t peer_id, LinkDown why);

  TelemetrySnapshot snapshot() const;

 private:
  struct Series;
  static int pathIndex(const char* path);
  // peer(), giving `peer_id` counters of its own when it has none and the cap allows.
  Peer& admit(uint64_t peer_id);
  Peer* find(uint64_t peer_id, size_t* start) const;
  Series& series(Peer& peer, const char* path, bool is_push);

  const uint64_t max_peers_;
  // Lookup without a lock: open addressing over `slots_` (a power of two, at least twice
  // max_peers); a slot once set never changes. Owned by `peers_`.
  std::vector<std::atomic<Peer*>> slots_;
  mutable std::mutex mu_;                     // guards peers_ (appends) and failures_
  std::vector<std::unique_ptr<Peer>> peers_;  // in order of first sight; the "other" peer first
  Peer* other_ = nullptr;
  // Failures are rare: a map under mu_, bounded by peers x paths x ops x codes x stages.
  std::map<std::tuple<const Peer*, int, int, uint32_t, int>, uint64_t> failures_;
};

}  // namespace pdlink
