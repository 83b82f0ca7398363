#include "engine/link.h"

#include <unistd.h>

namespace pdlink {

bool Link::inProcess() const { return direct_state_.pid != 0 && direct_state_.pid == ::getpid(); }

bool Link::broken() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  return broken_;
}

std::string Link::brokenReason() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  return broken_reason_;
}

void Link::breakLink(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (broken_) return;
    broken_ = true;
    broken_reason_ = reason;
  }
  out_.shutdown();
  in_.shutdown();
}

}  // namespace pdlink
