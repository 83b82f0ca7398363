// Transfers: this side's pulls, pushes, prepared posts and memory descriptions (docs/architecture.md,
// "Data paths": the requesting side).
//
// Owns: the staged stream path (descriptor lists mixing HOST and DEVICE memory). It plans a
// transfer against this side's registry (local indices and ranges checked here; the peer checks its
// own side), splits it into requests within limits::kMaxRequestPieces, and posts each on the link's
// path for the local memory (its host path, or its device paths in order). It reaches links only
// through the link manager (usableLink), and the registry through
// EngineState.
//
// Threading: every public method is thread-safe and may block on a link: a transfer holds its
// link's out mutex for all its requests (transfers on one link are serialised, on different links
// run in parallel); it takes EngineState::mu only inside LinkManager::usableLink, never while
// holding the out mutex. Called from application threads (the Engine facade).
// Errors: kParamInvalid for a bad description (nothing sent), kNotYetLink / kLinkFailed for the
// link, kTimeout past the deadline, otherwise the peer's refusal; a failed transfer that broke the
// channel breaks the link (failTransfer).
// Telemetry: every pull, push and post is counted (EngineState::telemetry, engine/telemetry.h) when
// it returns: done with its bytes, descriptors and latencies, or failed with its code and stage.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/deadline.h"
#include "core/status.h"
#include "engine/engine_state.h"
#include "engine/engine_types.h"
#include "engine/link_manager.h"
#include "transport/link.h"
#include "transport/path.h"

namespace pdlink {

class Transfers {
 public:
  Transfers(EngineState& state, LinkManager& links);
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;

  // As Engine::pull, push, prepare, post and describeMemory (engine.h).
  Status pull(const TransferSpec& spec);
  Status push(const TransferSpec& spec);
  Result<std::shared_ptr<PreparedTransfer>> prepare(const TransferSpec& spec, uint64_t block_size, uint64_t remote_base,
                                                    uint64_t remote_bytes, const BlockMapping& mapping = {});
  Status post(PreparedTransfer& p, const int64_t* local, const int64_t* remote, size_t n, bool is_push,
              const CancelToken* cancel = nullptr);
  Result<wire::RawTable> describeMemory(uint64_t cluster_id, int64_t timeout_ms);

 private:
  // What one transfer tells telemetry (counted): filled in as it goes.
  struct Outcome {
    const char* path = "none";  // the path that took it (the link's host path until one did)
    uint64_t bytes = 0;         // its payload
    uint64_t descriptors = 0;   // the (tensor, range) pieces its caller named
    // When its first request went onto the link (unset: it never got there; then its failure is
    // counted at the admission stage, else at the link's stage).
    std::chrono::steady_clock::time_point wire_start{};
    TransferStage stage = TransferStage::kAdmission;  // where it failed
  };
  // Runs `move` (a transfer reporting into its Outcome) and counts its result for `peer`.
  template <class Move>
  Status counted(uint64_t peer, bool is_push, Move move);
  Result<TransferPlan> plan(const TransferSpec& spec, bool is_push);
  // The plan of a local_absolute spec, into *out (its vectors' capacity reused); the local caches
  // are held in scratch->keep, which out->local points at without owning: the caller keeps both
  // until the transfer is over.
  Status planAbsolute(const TransferSpec& spec, Resolved* scratch, TransferPlan* out);
  // `p` as requests of at most limits::kMaxRequestPieces pieces and `max_bytes` payload bytes each
  // (runs cut at whole blocks of a blocks target); only the last commits.
  static std::vector<TransferPlan> split(const TransferPlan& p, uint64_t max_bytes);
  Status transfer(const TransferSpec& spec, bool is_push, Outcome* outcome);
  // Moves a planned transfer over `link` (split into requests within the per-request bounds).
  // `epoch_tag`: what this transfer's reads, writes and describes carry (wire v8's u32; 0: unfenced);
  // *seen_tag (when given): the epoch tag of the peer's last answer to them (0: none).
  Status execute(const std::shared_ptr<Link>& link, TransferPlan& p, bool is_push, int64_t timeout_ms, Outcome* outcome,
                 uint32_t epoch_tag = 0, uint32_t* seen_tag = nullptr);
  Status postUncounted(PreparedTransfer& p, const int64_t* local, const int64_t* remote, size_t n, bool is_push,
                       const CancelToken* cancel, Outcome* outcome);
  // One request of a transfer (requires the out mutex), on the link's path for the local cache's
  // memory: its host path, or its device paths in order (transport/path.h).
  Status transferPart(const std::shared_ptr<Link>& link, TransferPlan& p, bool is_push, Deadline deadline,
                      const char* what, Outcome* outcome);

  EngineState& s_;
  LinkManager& links_;
  // The stream path that stages DEVICE memory: descriptor lists mixing HOST and DEVICE memory, on
  // either side, on any link (transferPart).
  std::unique_ptr<DataPath> staged_path_;
};

}  // namespace pdlink
