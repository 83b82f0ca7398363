// A transfer's cancel token (docs/native_api.md, "Pending.cancel"; docs/architecture.md, "Cancel
// points"): one object per transfer, shared by the caller that may cancel it and the thread that
// runs it.
//
// Contract: the token goes from running to exactly one of cancelled (cancel() won) or finished
// (finish() won), once. cancel() never blocks: it is one atomic exchange, so it returns at once
// whatever the transfer is doing. The transfer checks requested() at its cancel points (between its
// requests, between the chunk requests of a tcp transfer split over streams) and stops issuing new
// requests there; the requests already in flight finish, so the link's byte stream stays whole.
// When the transfer returns, its caller calls finish(): false means a cancel came first, and the
// transfer's outcome is "cancelled" whatever the engine returned (the bytes of the requests that
// finished have landed; nothing else moved).
//
// The engine's abort word (EngineState::abort_generation, CancelPoint below): a role switch whose drain
// times out bumps it, and every transfer admitted before the bump stops at its next cancel point as
// if its token had been cancelled (its token, where it has one, is cancelled there).
//
// Thread-safe: every method may be called from any thread.
#pragma once

#include <atomic>
#include <string>

#include "core/status.h"

namespace pdlink {

class CancelToken {
 public:
  enum class State : int { kRunning = 0, kCancelled = 1, kFinished = 2 };

  // True when the transfer will end cancelled (this call or an earlier one came before finish());
  // false when it had already finished (its result stands).
  bool cancel() {
    int expected = static_cast<int>(State::kRunning);
    if (state_.compare_exchange_strong(expected, static_cast<int>(State::kCancelled), std::memory_order_acq_rel)) {
      return true;
    }
    return expected == static_cast<int>(State::kCancelled);
  }
  // Whether the transfer should stop issuing requests (a cancel point's check).
  bool requested() const { return state_.load(std::memory_order_acquire) == static_cast<int>(State::kCancelled); }
  // The transfer is over: true when it finished before any cancel (its result stands), false when
  // it was cancelled. Idempotent. The engine calls it too, right before a pull's commit (the frame
  // that releases the source on the peer: transport/path.h, commitPull): a cancel that came first
  // stops the commit (the source stays, the outcome is cancelled); one that comes later loses (the
  // pull is committed and its outcome is its result), so a cancelled outcome never hides a commit.
  bool finish() const {
    int expected = static_cast<int>(State::kRunning);
    if (state_.compare_exchange_strong(expected, static_cast<int>(State::kFinished), std::memory_order_acq_rel)) {
      return true;
    }
    return expected == static_cast<int>(State::kFinished);
  }
  State state() const { return static_cast<State>(state_.load(std::memory_order_acquire)); }

 private:
  friend struct CancelPoint;
  mutable std::atomic<int> state_{static_cast<int>(State::kRunning)};
};

// A transfer's cancel points: its token (null: none) and the engine's abort word with the value it
// read at admission (null: none). requested() is what each cancel point checks: the token was
// cancelled, or the abort word moved since admission (a drain timeout: docs/architecture.md,
// "Roles"); then the token, where there is one, is cancelled too, so that its caller sees the
// cancelled outcome exactly as after Pending.cancel(). Costs one acquire load of the abort word per
// cancel point, plus one of the token where there is one.
struct CancelPoint {
  const CancelToken* token = nullptr;
  const std::atomic<uint64_t>* abort = nullptr;
  uint64_t admitted = 0;

  bool requested() const {
    if (abort != nullptr && abort->load(std::memory_order_acquire) != admitted) {
      if (token != nullptr) {
        int expected = static_cast<int>(CancelToken::State::kRunning);
        token->state_.compare_exchange_strong(expected, static_cast<int>(CancelToken::State::kCancelled),
                                              std::memory_order_acq_rel);
      }
      return true;
    }
    return token != nullptr && token->requested();
  }
};

// What a transfer stopped at a cancel point returns (kFailed, scope kCall: nothing is wrong with the
// link; marked as Status::Cancelled, so the Python API reports the transfer as CANCELLED and a
// synchronous call raises pdlink.TransferCancelled: bindings/bind_status.cc).
inline Status cancelledStatus(const char* what) {
  return Status::Cancelled(std::string(what) + ": cancelled at a cancel point");
}

}  // namespace pdlink
