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

std::vector<std::string> Link::lanes() const {
  std::vector<std::string> out = host_path_ ? host_path_->lanes() : std::vector<std::string>{};
  std::lock_guard<std::mutex> lock(state_mu_);
  // A tcp link with lanes: how many streams this side requests on, and how many of the peer's it serves.
  if (!out_lanes_.empty()) out.push_back("tcp x" + std::to_string(1 + out_lanes_.size()));
  if (!in_lanes_.empty()) out.push_back("served x" + std::to_string(1 + in_lanes_.size()));
  return out;
}

Lane* Link::addLane(bool out, Socket sock, std::shared_ptr<const crypto::Key> key, bool payload_integrity,
                    std::shared_ptr<void> token, size_t max) {
  auto lane = std::make_unique<Lane>();
  lane->sock = std::move(sock);
  lane->sock.setReceiveSpin(kSpinUs);
  if (key) lane->auth = std::make_unique<AuthStream>(lane->sock, std::move(key), out, payload_integrity);
  lane->token = std::move(token);
  std::lock_guard<std::mutex> lock(state_mu_);
  auto& lanes = out ? out_lanes_ : in_lanes_;
  if (broken_ || lanes.size() >= max) {
    lane->sock.shutdown();
    return nullptr;
  }
  lanes.push_back(std::move(lane));
  return lanes.back().get();
}

std::vector<Stream*> Link::outLanes() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  std::vector<Stream*> out;
  for (const auto& l : out_lanes_) out.push_back(&l->stream());
  return out;
}

size_t Link::laneCount(bool out) const {
  std::lock_guard<std::mutex> lock(state_mu_);
  return out ? out_lanes_.size() : in_lanes_.size();
}

void Link::openLanesOnce(Deadline deadline) {
  if (lanes_tried_ || !lane_opener_) return;
  lanes_tried_ = true;
  lane_opener_(*this, deadline);
}

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

void Link::breakLink(const std::string& reason, LinkDown why) {
  const uint8_t ending = ending_.load(std::memory_order_relaxed);
  if (why == LinkDown::kFailed && ending != 0) why = static_cast<LinkDown>(ending - 1);
  std::shared_ptr<void> held;
  DownHook hook;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (broken_) return;
    broken_ = true;
    broken_reason_ = reason;
    broken_why_ = why;
    held = std::move(held_);  // a broken link copies nothing more: its peer needs no access to us
    hook = std::move(down_hook_);
  }
  out_.shutdown();
  in_.shutdown();
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    for (const auto& l : out_lanes_) l->sock.shutdown();
    for (const auto& l : in_lanes_) l->sock.shutdown();
  }
  if (hook) hook(why);
}

void Link::setDownHook(DownHook hook) {
  LinkDown why;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (!broken_) {
      down_hook_ = std::move(hook);
      return;
    }
    why = broken_why_;
  }
  hook(why);  // it broke before it was installed: its end is reported at once
}

const char* stageName(TransferStage stage) {
  static constexpr const char* kNames[kTransferStages] = {"admission", "request", "served", "payload", "commit"};
  return kNames[static_cast<int>(stage)];
}

const char* downName(LinkDown why) {
  static constexpr const char* kNames[kLinkDownReasons] = {"failed", "unlinked", "peer_unlinked", "replaced",
                                                           "finalized"};
  return kNames[static_cast<int>(why)];
}

}  // namespace pdlink
