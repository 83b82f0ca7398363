// Deadline: an absolute point in time on the monotonic clock, so a timeout given once bounds a
// whole multi-step operation (connect + handshake, request + response) rather than each step.
#pragma once

#include <chrono>
#include <cstdint>

namespace pdlink {

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  static Deadline after(std::chrono::milliseconds ms) { return Deadline(Clock::now() + ms); }
  static Deadline afterMs(int64_t ms) { return after(std::chrono::milliseconds(ms)); }
  static Deadline never() { return Deadline(Clock::time_point::max()); }

  bool isNever() const { return at_ == Clock::time_point::max(); }
  bool expired() const { return !isNever() && Clock::now() >= at_; }
  // Milliseconds left, clamped to [0, INT32_MAX]; -1 for never (the poll(2) convention).
  int remainingMsForPoll() const;
  // The earlier of the two.
  static Deadline earliest(Deadline a, Deadline b) { return a.at_ < b.at_ ? a : b; }

 private:
  explicit Deadline(Clock::time_point at) : at_(at) {}
  Clock::time_point at_;
};

inline int Deadline::remainingMsForPoll() const {
  if (isNever()) return -1;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at_ - Clock::now()).count();
  if (left <= 0) return 0;
  if (left > INT32_MAX) return INT32_MAX;
  return static_cast<int>(left) + 1;  // round up so we never wake just before the deadline
}

}  // namespace pdlink
