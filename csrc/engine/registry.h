// Registry: the caches of one engine and the keys under which peers find them.
//
// A cache is `num_tensors` tensors of `tensor_size` bytes each, split along dimension 0 into
// `num_slots` equal slots: batch slots for a contiguous cache, blocks for a blocks cache. Ids count
// from 1 in call order across register and allocate (serving code relies on this).
//
// Indexes (llm_datadist llm_datadist_api.md §10.1):
//   (req_id, model_id)    -> (cache, slot)   request keys of contiguous caches
//   (prefix_id, model_id) -> (cache, slot)   prefix keys of contiguous caches
//   model_id              -> blocks cache    from register/allocate_blocks_cache with a key
// Lifetime of pool-allocated caches is reference counted: the memory returns to the pool once the
// id reference (dropped by deallocate) and every request key (dropped by a successful remote pull by
// that key, or by removeKey) are gone. Registered caches are user memory and are never freed here.
//
// Threading: all methods are thread-safe (one reader-writer lock: resolve, describe and lookups
// share it, changes take it alone). A resolve holds it for a time bounded by the request's pieces
// (core/limits.h) times log(tensors), never by the registry's size. Resolve() returns a shared_ptr
// that keeps the cache's memory alive while a transfer uses it, even if it is deallocated
// meanwhile.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <utility>
#include <vector>

#include "backends/backend.h"
#include "core/status.h"
#include "engine/mem_pool.h"
#include "transport/wire.h"

namespace pdlink {

constexpr uint64_t kInvalidId = UINT64_MAX;

struct CacheLayout {
  uint32_t num_tensors = 0;
  uint64_t tensor_size = 0;  // bytes per tensor
  uint64_t num_slots = 1;    // shape[0]
  bool is_blocks = false;
  Placement placement = Placement::kDevice;
  uint64_t stride() const { return num_slots == 0 ? 0 : tensor_size / num_slots; }
};

struct RequestKey {
  uint64_t req_id = kInvalidId;
  uint64_t prefix_id = kInvalidId;
  uint64_t model_id = 0;
  bool hasReq() const { return req_id != kInvalidId; }
  bool hasPrefix() const { return prefix_id != kInvalidId; }
};

struct CacheEntry {
  int64_t id = 0;
  CacheLayout layout;
  std::vector<uint64_t> addrs;  // one per tensor
  bool owned = false;           // allocated from a pool (true) or registered user memory
  bool remote_accessible = true;
  std::optional<uint64_t> blocks_model;
  std::shared_ptr<MemPool> pool;  // set when owned; outlives the entry's allocations

  // Move-only: an owned entry returns its tensors to the pool exactly once, on destruction.
  CacheEntry() = default;
  CacheEntry(CacheEntry&&) = default;
  CacheEntry& operator=(CacheEntry&&) = default;
  CacheEntry(const CacheEntry&) = delete;
  CacheEntry& operator=(const CacheEntry&) = delete;
  ~CacheEntry();
};

// What a peer's request addresses, checked: for each tensor t in `tensors` and run r in `runs`,
// the bytes [addrs[t] + base + r.offset, + r.length). `keep` holds the caches alive meanwhile.
struct Resolved {
  std::vector<std::shared_ptr<CacheEntry>> keep;
  std::vector<uint64_t> addrs;
  std::vector<uint32_t> tensors;
  std::vector<wire::Run> runs;
  uint64_t base = 0;
  // kRaw only: the placement of each run's memory (a raw run never spans both placements);
  // empty for every other target, whose runs share keep[0]'s placement.
  std::vector<Placement> run_placements;
};

class Registry {
 public:
  // Adds a cache. `keys` bind batch slots in order (padding keys consume a slot); a key already
  // bound, or repeated, is kParamInvalid and nothing is added.
  Result<std::shared_ptr<CacheEntry>> add(CacheEntry entry, const std::vector<RequestKey>& keys);
  // The cache with this id; kParamInvalid when there is none.
  Result<std::shared_ptr<CacheEntry>> get(int64_t id) const;
  // Drops the id reference of a pool-allocated cache; a no-op for unknown or registered caches.
  Status deallocate(int64_t id, bool expect_blocks);
  // Removes a registered cache and its keys. kParamInvalid for pool-allocated or unknown ids.
  Status unregister(int64_t id);
  // Unbinds the request and prefix keys of `key`; a no-op when absent.
  void removeKey(const RequestKey& key);

  // Serving side: find what a peer addresses and check its runs, tensors and (for writes)
  // remote accessibility. kKvCacheNotExist when the target is absent, kParamInvalid otherwise.
  // A kRaw run (an absolute address range; also how Engine checks local_absolute runs) must lie
  // inside one registered tensor or across up to kMaxRawSpan tensors that follow each other exactly,
  // all of one placement.
  Result<Resolved> resolve(const wire::TransferBody& body, bool for_write) const;
  // The check of resolve() for kRaw runs alone, into out->keep and out->run_placements (replaced,
  // their capacity reused; nothing else of *out is touched): how the engine checks its own
  // descriptor lists, once per transfer, without allocating.
  Status resolveRaw(const std::vector<wire::Run>& runs, bool for_write, Resolved* out) const;
  // Serving side: a peer finished reading `tensors` through `target`; releases the request key of a
  // pool-allocated cache once every tensor has been read.
  void commitRead(const wire::Target& target, const std::vector<uint32_t>& tensors);

  // Serving side of direct (same-host) reads: the layout of the blocks cache published under
  // model_id. kKvCacheNotExist when there is none.
  Result<wire::CacheDescriptor> describe(uint64_t model_id) const;
  // Every registered tensor as an address range (the kRaw answer of kDescribe), with the current
  // generation; kParamInvalid beyond limits::kMaxRequestTensors tensors (the checked path serves).
  Result<wire::RawTable> describeRaw() const;
  // The word a same-host peer reads directly (transport/cma/cma.h), published at one fixed address
  // for the Registry's lifetime (sent in the handshake of same-host links only): the generation,
  // bumped before any cache memory is released or any index changes, so a peer that read it before
  // and after a direct copy through a cached descriptor knows the descriptor was still valid.
  // (Whether a checked direct access stayed pinned is each link's own word: engine/pin_epochs.h.)
  struct Published {
    std::atomic<uint64_t> generation{1};
  };
  const Published* published() const { return &published_; }

  // Every tensor of a registered (not pool-allocated) DEVICE cache, as (address, bytes): the
  // memory a device channel prepares for one-sided access besides the device pool.
  std::vector<std::pair<uint64_t, uint64_t>> registeredDeviceTensors() const;

  size_t size() const;
  void clear();

 private:
  struct Binding {
    RequestKey key;
    std::set<uint32_t> read_tensors;
  };
  using KeyIndex = std::map<std::pair<uint64_t, uint64_t>, std::pair<int64_t, uint64_t>>;

  Status resolveRawLocked(const std::vector<wire::Run>& runs, bool for_write, Resolved* out) const;
  void eraseLocked(std::map<int64_t, std::shared_ptr<CacheEntry>>::iterator it);
  void unbindLocked(int64_t id, uint64_t slot);
  void maybeFreeLocked(int64_t id);

  void bumpLocked() { published_.generation.fetch_add(1, std::memory_order_release); }

  // For a raw-address access, of overlapping registrations the ones that start closest below the
  // address are considered, this many.
  static constexpr size_t kRawCandidates = 16;
  static constexpr size_t kMaxRawSpan = 64;  // registered tensors one raw range may run across
  struct RawTensor {
    uint64_t end;
    int64_t cache_id;
  };

  mutable std::shared_mutex mu_;
  alignas(16) Published published_;
  int64_t next_id_ = 1;
  std::map<int64_t, std::shared_ptr<CacheEntry>> caches_;
  std::set<int64_t> id_refs_;                               // allocated caches not yet deallocated
  std::map<int64_t, std::map<uint64_t, Binding>> bindings_;  // cache id -> slot -> key
  KeyIndex req_index_;
  KeyIndex prefix_index_;
  std::map<uint64_t, int64_t> blocks_index_;
  std::multimap<uint64_t, RawTensor> raw_index_;  // tensor start -> end, cache (every cache's tensors)
};

}  // namespace pdlink
