// Pin epoch words: one per serving link, read directly by that link's same-host requester.
//
// A checked direct access (transport/cma/cma_path.h) is answered with the addresses of the ranges,
// pinned until the requester's next frame, and with the value and address of the serving link's pin
// epoch word. The word moves whenever that link's pins are released before the requester's next
// frame (the pin expired, or the link's serving ended), so a requester that reads it again after
// its copy knows its memory stayed pinned throughout. One word per link: one peer's expired pins
// never fail another peer's transfers.
//
// Ownership: the words live as long as the engine and never move (a requester may read a word after
// its link ended: it must find it there, moved on). A word given back is bumped, then handed to a
// later link; its value only grows, so an epoch answered on the old link never matches again.
// Bound: as many words as links served at once, at most. Threading: take/give from any thread; the
// words themselves are atomics.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

namespace pdlink {

class PinEpochs {
 public:
  using Word = std::atomic<uint64_t>;
  Word* take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      Word* w = free_.back();
      free_.pop_back();
      return w;
    }
    return &words_.emplace_back(1);  // a deque never moves its elements when it grows at the end
  }
  void give(Word* w) {
    w->fetch_add(1, std::memory_order_release);
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(w);
  }

 private:
  std::mutex mu_;
  std::deque<Word> words_;   // guarded by mu_ (the container; the words are atomics)
  std::vector<Word*> free_;  // guarded by mu_
};

}  // namespace pdlink
