// EngineState: what the engine's parts share (engine.h's facade, LinkManager, RequestServer,
// Transfers): the backend and what it offers, the data path table, the configuration, the
// registry and pools, the one engine mutex and the flags it guards, and the engine's threads.
//
// Owned by the Engine facade, which creates it first and destroys it last; the three parts hold a
// reference to it and never own each other.
// Threading: `mu` is the engine's one mutex (lock order: `mu` before a Link's out mutex; the
// registry's and the notification inbox's own mutexes are leaves). It guards `initialized`,
// `stopping` and `role` here, and the link manager's tables (link_manager.h). `config`, `hint`,
// the pools and `ucx_hub` are written only by initialize and finalize, which do not race with other
// calls; everything else is immutable or has its own lock.
#pragma once

#include <algorithm>
#include <atomic>
#include <string>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "backends/backend.h"
#include "core/status.h"
#include "engine/engine_types.h"
#include "engine/mem_pool.h"
#include "engine/offers.h"
#include "engine/pin_epochs.h"
#include "engine/registry.h"
#include "transport/path.h"
#include "transport/path_table.h"

namespace pdlink {

namespace ucx {
class UcxHub;
}

struct EngineState {
  EngineState(std::shared_ptr<Backend> backend_in, const Capabilities& caps);

  std::shared_ptr<Backend> backend;
  // From backend->capabilities(), read once: device channels; same-host DEVICE transfers by IPC;
  // a runtime with HCCL one-sided access.
  const bool device_transport;
  const bool ipc;
  const bool one_sided;
  // The data paths (transport/path_table.h): the serving side of each, and the requesting side of
  // the device paths (a link's host path is its own object, Link::hostPath). The ucx entry's
  // server is set by initialize and dropped by finalize.
  PathTable paths;
  PinEpochs pin_epochs;  // one word per served link
  // Transport::kUcx, or kAuto with ucx_trusted_network where UCX loads: the engine's UCX workers
  // (shared with its links' paths, which may outlive finalize); set by initialize, dropped by
  // finalize.
  std::shared_ptr<ucx::UcxHub> ucx_hub;
  EngineConfig config;
  wire::HostHint hint;  // set by initialize()
  Registry registry;
  std::shared_ptr<MemPool> device_pool;
  std::shared_ptr<MemPool> host_pool;

  mutable std::mutex mu;
  bool initialized = false;  // guarded by mu
  bool stopping = false;     // guarded by mu
  Role role = Role::kMix;    // guarded by mu
  uint64_t epoch = 0;        // guarded by mu: +1 per committed switch (Engine::switchRole)
  // Written under mu; read without it by the admission checks (Admission).
  std::atomic<Phase> phase{Phase::kReady};
  // What this engine's responses carry (the wire's epoch tag, a u32 since v8): wire::epochTagOf(epoch),
  // 1 + epoch % 0xFFFFFFFF, written under mu with `epoch`; the serving streams point at it
  // (Stream::setEpochWord).
  std::atomic<uint32_t> epoch_tag{1};
  static uint32_t tagOf(uint64_t epoch) { return wire::epochTagOf(epoch); }
  // What a drain waits for (RoleState): this side's transfers, the peers' requests being served,
  // and the served links that hold pins. Changed through Admission and ServeState only.
  std::atomic<int64_t> transfers_in_flight{0};
  std::atomic<int64_t> served_in_flight{0};
  std::atomic<int64_t> pins_held{0};
  // Bytes the served links hold pinned (ServeState::countPins): EngineStats::pinned_bytes.
  std::atomic<int64_t> pinned_bytes{0};
  // What this engine's transfers and links did (engine/telemetry.h), made by initialize (its cap on
  // peers is a limit); shared with the links' down hooks, which may outlive the engine.
  std::shared_ptr<Telemetry> telemetry;
  // The KV handoffs this engine offers (engine/offers.h): its live offers count in a drain too (a
  // handoff never outlives its role epoch).
  OfferTable offers{[this] { drainNotify(); }};
  // The abort word (core/cancel.h, CancelPoint): +1 when a switch's drain times out. A transfer of
  // this side reads it at admission (Admission::arm) and stops at its next cancel point once it
  // moved.
  std::atomic<uint64_t> abort_generation{0};
  // A switch is pending (phase draining, switching or rolling back): nothing new is admitted.
  bool switchPending() const {
    const Phase p = phase.load(std::memory_order_seq_cst);
    return p == Phase::kDraining || p == Phase::kSwitching || p == Phase::kRollingBack;
  }
  Status switchingStatus() const {
    return Status(Code::kRoleSwitching, Scope::kEngine,
                  std::string("cluster ") + std::to_string(config.cluster_id) + " is switching its role (phase " +
                      phaseName(phase.load()) + "); retry once it is ready");
  }
  // Wakes a drain (switchRole) after a count fell.
  void drainNotify() {
    const Phase p = phase.load(std::memory_order_seq_cst);
    if (p != Phase::kDraining && p != Phase::kRollingBack) return;
    std::lock_guard<std::mutex> lock(drain_mu);
    drain_cv.notify_all();
  }
  // Waits until nothing counted above is left (`transfers_only`: until transfers_in_flight is 0), at
  // most `timeout_ms`: true when drained.
  bool drain(int64_t timeout_ms, bool transfers_only = false);
  int64_t inFlight() const {
    return transfers_in_flight.load() + served_in_flight.load() + pins_held.load() + offers.liveCount();
  }

  // One transfer of this side, or one request of a peer being served, counted in `counter` while
  // it lives. Counted first, then checked: a drain that starts in between sees it counted, or it
  // sees the drain and is refused (status() kRoleSwitching; the count is given back at once).
  class Admission {
   public:
    // `continuation`: a later request of a transfer admitted before the switch (a chunk of a split
    // pull open on its link): counted and admitted even while a switch is pending.
    Admission(EngineState& s, std::atomic<int64_t>& counter, bool continuation = false) : s_(s), counter_(&counter) {
      counter_->fetch_add(1, std::memory_order_seq_cst);
      if (!continuation && s_.switchPending()) release();
      // Read after the check: an admitted transfer saw no drain begun, so it reads the word before
      // any timeout of that drain moves it.
      generation_ = s_.abort_generation.load(std::memory_order_seq_cst);
    }
    // Points the plan's cancel points at the abort word as it was at admission.
    template <class Plan>
    void arm(Plan* p) const {
      p->abort = &s_.abort_generation;
      p->abort_admitted = generation_;
    }
    ~Admission() { release(); }
    Admission(const Admission&) = delete;
    Admission& operator=(const Admission&) = delete;
    bool admitted() const { return counter_ != nullptr; }
    Status status() const { return admitted() ? Status::OK() : s_.switchingStatus(); }

   private:
    void release() {
      if (!counter_) return;
      counter_->fetch_sub(1, std::memory_order_seq_cst);
      counter_ = nullptr;
      s_.drainNotify();
    }
    EngineState& s_;
    std::atomic<int64_t>* counter_;
    uint64_t generation_ = 0;
  };

  // Takes mu.
  bool isInitialized() const;
  RoleState roleState() const;
  // How long a direct or IPC access of a peer stays pinned while it sends nothing
  // (EngineLimits::pin_timeout_ms).
  int64_t pinTimeoutMs() const {
    const int64_t set = config.limits.pin_timeout_ms;
    return set > 0 ? set : std::max<int64_t>(2 * config.sync_timeout_ms, 5000);
  }
  // The DEVICE memory a device channel prepares for one-sided access: the device pool and every
  // registered DEVICE cache's tensors.
  std::vector<Segment> preparedRegions() const;
  // What a path's connect and answer hooks see of this engine (transport/path.h).
  PathEnv pathEnv() const {
    return PathEnv{
        *backend, device_transport, config.one_sided, one_sided, config.transport == Transport::kUcx, [this] {
          return preparedRegions();
        }};
  }

  // Starts an engine thread (detached; waitThreads waits for every one). Throws std::system_error
  // when the system has no thread to give.
  void spawn(std::function<void()> fn);
  // Blocks until every thread spawn started has ended.
  void waitThreads();
  size_t threadsRunning() const;

 private:
  struct Threads {
    std::mutex mu;
    std::condition_variable cv;
    size_t running = 0;  // guarded by mu
  };
  std::shared_ptr<Threads> threads_ = std::make_shared<Threads>();  // engine threads still running

 public:
  std::mutex drain_mu;  // a leaf: only drain_cv's
  std::condition_variable drain_cv;
};

}  // namespace pdlink
