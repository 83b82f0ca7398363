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
  std::shared_ptr<cma::Grant> grant;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (broken_) return;
    broken_ = true;
    broken_reason_ = reason;
    grant = std::move(grant_);  // a broken link copies nothing more: its peer needs no access to us
  }
  out_.shutdown();
  in_.shutdown();
}

}  // namespace pdlink
