// Deliberate bugs, to show that the fuzzer finds each kind (docs/reliability.md, "Fuzzing").
//
// Compiled in only by the fuzz build's seeded targets (wire_fuzz_reserve, wire_fuzz_flag,
// wire_fuzz_offset: CMakeLists.txt compiles the sources that include this header once per target
// with PDLINK_SEEDED_BUG set; .ci/fuzz.sh runs them); every other build has PDLINK_SEEDED_BUG 0, and
// `bug()` is then a constant false the compiler removes. Never enable one outside a fuzz build.
#pragma once

#ifndef PDLINK_SEEDED_BUG
#define PDLINK_SEEDED_BUG 0
#endif

namespace pdlink::seeded {

enum Kind : int {
  kNone = 0,
  kReserve = 1,  // a decoder reserves for a peer's count before checking it
  kFlag = 2,     // admission accepts the direct flag on a link that is not same-host
  kOffset = 3,   // the requester uses an IPC answer whose spans it did not check
};

constexpr bool bug(Kind k) { return PDLINK_SEEDED_BUG == k; }

}  // namespace pdlink::seeded
