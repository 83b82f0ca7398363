// What the engine's parts share (engine/engine_state.h): capabilities, threads.
#include "engine/engine_state.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace pdlink {

namespace {
bool hasFeature(const Capabilities& c, const char* name) {
  auto it = c.features.find(name);
  return it != c.features.end() && it->second;
}
}  // namespace

EngineState::EngineState(std::shared_ptr<Backend> backend_in, const Capabilities& caps)
    : backend(std::move(backend_in)),
      device_transport(caps.device_transport),
      ipc(caps.device_transport && hasFeature(caps, "ipc")),
      one_sided(caps.device_transport && hasFeature(caps, "one_sided")),
      paths(*backend, BackendOffer{device_transport, ipc, one_sided}) {}

bool EngineState::isInitialized() const {
  std::lock_guard<std::mutex> lock(mu);
  return initialized;
}

const char* phaseName(Phase phase) {
  switch (phase) {
    case Phase::kReady:
      return "ready";
    case Phase::kDraining:
      return "draining";
    case Phase::kSwitching:
      return "switching";
    case Phase::kRollingBack:
      return "rolling_back";
    case Phase::kFailed:
      return "failed";
  }
  return "failed";
}

RoleState EngineState::roleState() const {
  RoleState r;
  {
    std::lock_guard<std::mutex> lock(mu);
    r.role = role;
    r.epoch = epoch;
    r.phase = phase.load();
  }
  r.transfers_in_flight = transfers_in_flight.load();
  r.served_in_flight = served_in_flight.load();
  r.pins = pins_held.load();
  r.offers = offers.liveCount();
  return r;
}

bool EngineState::drain(int64_t timeout_ms, bool transfers_only) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0));
  std::unique_lock<std::mutex> lock(drain_mu);
  while ((transfers_only ? transfers_in_flight.load() : inFlight()) != 0) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= until) return false;
    // Woken by drainNotify; the bounded wait is only a backstop.
    drain_cv.wait_for(lock, std::min<std::chrono::steady_clock::duration>(until - now, std::chrono::milliseconds(50)));
  }
  return true;
}

std::vector<Segment> EngineState::preparedRegions() const {
  std::vector<Segment> out;
  if (device_pool) out.push_back({device_pool->base(), device_pool->capacity()});
  for (auto& [addr, bytes] : registry.registeredDeviceTensors()) out.push_back({addr, bytes});
  return out;
}

void EngineState::spawn(std::function<void()> fn) {
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

void EngineState::waitThreads() {
  std::unique_lock<std::mutex> lock(threads_->mu);
  threads_->cv.wait(lock, [&] { return threads_->running == 0; });
}

size_t EngineState::threadsRunning() const {
  std::lock_guard<std::mutex> lock(threads_->mu);
  return threads_->running;
}

}  // namespace pdlink
