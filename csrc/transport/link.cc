#include "transport/link.h"

#include <unistd.h>

#include <algorithm>

#include "transport/path.h"

namespace pdlink {

Link::Link(uint64_t peer_cluster_id, Socket out, Socket in, bool initiator)
    : peer_(peer_cluster_id), initiator_(initiator), out_(std::move(out)), in_(std::move(in)) {
  out_.setReceiveSpin(kSpinUs);
  in_.setReceiveSpin(kSpinUs);
}

Link::~Link() = default;

namespace {
std::vector<std::string> namesOf(const std::vector<DataPath*>& paths) {
  std::vector<std::string> names;
  for (const DataPath* p : paths) names.emplace_back(p->caps().name);
  return names;
}
}  // namespace

void Link::setPaths(std::unique_ptr<DataPath> host, std::vector<DataPath*> device) {
  host_path_ = std::move(host);
  device_paths_ = std::move(device);
  std::lock_guard<std::mutex> lock(state_mu_);
  device_path_names_ = namesOf(device_paths_);
}

void Link::dropDevicePath(const DataPath* path) {
  device_paths_.erase(std::remove(device_paths_.begin(), device_paths_.end(), path), device_paths_.end());
  std::lock_guard<std::mutex> lock(state_mu_);
  device_path_names_ = namesOf(device_paths_);
}

std::vector<std::string> Link::devicePathNames() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  return device_path_names_;
}

const char* Link::transport() const {
  if (host_path_) return host_path_->caps().name;
  return out_.isUnix() ? "unix" : "tcp";
}

std::vector<std::string> Link::lanes() const { return host_path_ ? host_path_->lanes() : std::vector<std::string>{}; }

PathLinkState* Link::find(const States& states, const PathSlot& slot) {
  for (const auto& [key, state] : states) {
    if (key == &slot) return state.get();
  }
  return nullptr;
}

void Link::put(States& states, const PathSlot& slot, std::unique_ptr<PathLinkState> state) {
  for (auto& [key, held] : states) {
    if (key == &slot) {
      held = std::move(state);
      return;
    }
  }
  if (state) states.emplace_back(&slot, std::move(state));
}

bool Link::inProcess() const { return peer_process_.pid != 0 && peer_process_.pid == ::getpid(); }

bool Link::broken() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  return broken_;
}

std::string Link::brokenReason() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  return broken_reason_;
}

void Link::breakLink(const std::string& reason) {
  std::shared_ptr<void> held;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (broken_) return;
    broken_ = true;
    broken_reason_ = reason;
    held = std::move(held_);  // a broken link copies nothing more: its peer needs no access to us
  }
  out_.shutdown();
  in_.shutdown();
}

}  // namespace pdlink
