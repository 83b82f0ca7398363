// What the native test programs (concurrency_test, path_test, unit_test) share: checks that count
// failures, engines that start or end the program, registrations that cannot fail quietly, and
// transfer specs of blocks caches. Single-threaded checks: concurrency_test keeps its own counter.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "engine/engine.h"

namespace pdlink::testing {

inline int failures = 0;  // the checks that failed; a program exits 1 when any did

// Counts and prints a failed check.
inline void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    ++failures;
  }
}

// `st` has exactly the code `want`.
inline void checkCode(const Status& st, Code want, const std::string& what) {
  check(st.code() == want,
        what + ": expected code " + std::to_string(static_cast<int>(want)) + ", got " + st.toString());
}

// A CPU engine initialised with `config`; exits the program (status 1) when it cannot start.
inline std::unique_ptr<Engine> startEngine(const EngineConfig& config) {
  auto e = std::make_unique<Engine>(makeCpuBackend());
  Status st = e->initialize(config);
  if (!st.ok()) {
    std::fprintf(stderr, "FAIL: initialize engine %llu: %s\n", static_cast<unsigned long long>(config.cluster_id),
                 st.toString().c_str());
    std::exit(1);
  }
  return e;
}

// Registers test memory (one address per tensor); exits the program when the engine refuses it.
inline int64_t registerOrExit(Engine& e, const CacheLayout& layout, const std::vector<uint64_t>& addrs,
                              const std::vector<RequestKey>& keys, std::optional<uint64_t> model, bool remote) {
  auto r = e.registerCache(layout, addrs, keys, model, remote);
  if (!r.ok()) {
    std::fprintf(stderr, "FAIL: register: %s\n", r.status().toString().c_str());
    std::exit(1);
  }
  return r.value()->id;
}

// local_blocks[i] of local cache `local` <-> remote_blocks[i] of the peer's blocks cache `model`.
inline TransferSpec blocksSpec(uint64_t peer, uint64_t model, int64_t local, std::vector<int64_t> local_blocks,
                               std::vector<int64_t> remote_blocks) {
  TransferSpec s;
  s.peer_cluster_id = peer;
  s.target.kind = wire::TargetKind::kBlocks;
  s.target.model_id = model;
  s.local_cache_id = local;
  s.mode = TransferSpec::Mode::kBlocksToBlocks;
  s.local_blocks = std::move(local_blocks);
  s.remote_blocks = std::move(remote_blocks);
  return s;
}

}  // namespace pdlink::testing
