// The one rule for whether an address range lies in registered memory, shared by every place that
// checks it: the registry resolving a peer's raw read or write (engine/registry.cc), the cma path
// checking a request against the peer's table before reading directly (transport/cma), and
// MemoryMap.covers in Python (bound as _core.covers).
//
// A range [offset, offset + length) is covered when it lies inside one registered range, or across
// registered ranges that follow each other exactly (hixl counts contiguous registrations as one),
// at most limits::kMaxRawSpan of them. Each step takes, among the limits::kRawCandidates ranges
// that start closest at or below the current address, the one that reaches farthest: O(log n) per
// step with a sorted index, so what a request costs is bounded by the steps it names.
// Header-only and stateless; callers hold whatever lock their index needs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/limits.h"

namespace pdlink::spans {

enum class Walk {
  kCovered,
  kInvalid,       // an empty range, or one whose end overflows
  kNotCovered,    // some byte lies outside registered memory, or the range crosses more than kMaxRawSpan
  kTooManySteps,  // the request's steps (counted in *steps, across its ranges) passed max_steps
  kRefused,       // visit() refused a registered range the walk reached
};

// Walks [offset, offset + length). reach(at) returns the end of the registered range that covers
// `at` and reaches farthest (among the kRawCandidates that start closest at or below it), or `at`
// when none covers it; visit() is called once per step after it is counted, for the range the last
// reach() found, and returns false to refuse it.
template <class Reach, class Visit>
Walk walk(uint64_t offset, uint64_t length, uint64_t max_steps, uint64_t* steps, Reach&& reach, Visit&& visit) {
  uint64_t end = 0;
  if (length == 0 || __builtin_add_overflow(offset, length, &end)) return Walk::kInvalid;
  uint64_t at = offset;
  for (size_t step = 0; at < end && step < limits::kMaxRawSpan; ++step) {
    const uint64_t next = reach(at);
    if (next <= at) break;
    if (++*steps > max_steps) return Walk::kTooManySteps;
    if (!visit()) return Walk::kRefused;
    at = next;
  }
  return at < end ? Walk::kNotCovered : Walk::kCovered;
}

// reach() over ranges (anything with .offset and .length) sorted by offset.
template <class Range>
uint64_t reachIn(const std::vector<Range>& sorted, uint64_t at) {
  uint64_t reach = at;
  auto it = std::upper_bound(sorted.begin(), sorted.end(), at, [](uint64_t a, const Range& r) { return a < r.offset; });
  for (size_t k = 0; k < limits::kRawCandidates && it != sorted.begin(); ++k) {
    --it;
    reach = std::max(reach, it->offset + it->length);
  }
  return reach;
}

// Whether every run lies in `sorted` by the rule above, with at most max_steps steps for all of
// them together.
template <class Range, class Run>
bool covers(const std::vector<Range>& sorted, const std::vector<Run>& runs, uint64_t max_steps) {
  uint64_t steps = 0;
  for (const Run& run : runs) {
    Walk w = walk(
        run.offset, run.length, max_steps, &steps, [&](uint64_t at) { return reachIn(sorted, at); },
        [] { return true; });
    if (w != Walk::kCovered) return false;
  }
  return true;
}

}  // namespace pdlink::spans
