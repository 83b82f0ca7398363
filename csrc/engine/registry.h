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
// Threading: all methods are thread-safe, under one reader-writer lock (RegistryMutex, below):
// resolve, describe and lookups share it, changes take it alone. What a peer's request may make a
// reader hold it for is bounded twice over, so that register(), deallocate() and every other
// change get in promptly however peers hammer the registry:
//   - per hold: a resolve takes the lock only for what needs the indexes, and for a raw-address
//     request (kRaw) in batches of at most kResolveBatchSteps index steps (plus one range's), letting
//     go between batches. Each range is resolved whole within one hold; what a batch resolved stays
//     valid after the lock is let go because the result holds a reference to every cache it touched
//     (a cache changes nothing of its layout once added; its memory stays while referenced);
//   - per request: every step counts against limits::kMaxRequestSpanSteps, and a request past it is
//     refused as soon as its count passes;
//   - writers first: a writer waiting for the lock is let in before readers that come after it (a
//     plain std::shared_mutex, glibc's default rwlock, lets new readers overtake a waiting writer
//     for as long as readers overlap: several links resolving back to back starved register() for
//     seconds), so a writer waits for the holds already under way, one batch each, and no more.
// A resolve's result holds one reference per distinct cache it touched, never one per range or
// step: its memory is bounded by the request's ranges (a placement each) and the registry's caches.
// Resolve() returns shared_ptrs that keep the caches' memory alive while a transfer uses it, even if
// they are deallocated meanwhile.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "backends/backend.h"
#include "core/limits.h"
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

// The registry's reader-writer lock: a pthread rwlock that prefers writers (glibc's
// PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP; elsewhere the platform's default kind). Usable with
// std::shared_lock and std::unique_lock. Not recursive: a thread holding it shared must not take it
// again (no Registry method does).
class RegistryMutex {
 public:
  RegistryMutex();
  ~RegistryMutex();
  RegistryMutex(const RegistryMutex&) = delete;
  RegistryMutex& operator=(const RegistryMutex&) = delete;
  void lock();
  void unlock();
  void lock_shared();
  void unlock_shared();

 private:
  pthread_rwlock_t rw_;
};

// What a peer's request addresses, checked: for each tensor t in `tensors` and run r in `runs`,
// the bytes [addrs[t] + base + r.offset, + r.length). `keep` holds the caches alive meanwhile.
struct Resolved {
  std::vector<std::shared_ptr<CacheEntry>> keep;  // each distinct cache once
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
  // Removes a registered cache and its keys: no later request resolves to it. Returns the entry,
  // which transfers already resolved may still hold (Resolved::keep, pins, offers): the memory stays
  // in use until its last reference goes (Engine::unregisterCache waits for that). kParamInvalid
  // for pool-allocated or unknown ids.
  Result<std::shared_ptr<CacheEntry>> unregister(int64_t id);
  // Unbinds the request and prefix keys of `key`; a no-op when absent.
  void removeKey(const RequestKey& key);

  // Serving side: find what a peer addresses and check its runs, tensors and (for writes)
  // remote accessibility. kKvCacheNotExist when the target is absent, kParamInvalid otherwise.
  // A body that came as rows (wire::TransferBody::rows) is checked a row at a time: the row's span
  // holds all its runs, so a row of any count costs one check (a kRaw span that is not registered
  // memory falls back to its runs one by one).
  // A kRaw run (an absolute address range; also how Engine checks local_absolute runs) must lie
  // inside one registered tensor or across up to limits::kMaxRawSpan tensors that follow each other
  // exactly, all of one placement; all the runs of one request together take at most
  // limits::kMaxRequestSpanSteps steps (one per tensor a run lies in), else kParamInvalid.
  Result<Resolved> resolve(const wire::TransferBody& body, bool for_write) const;
  // The check of resolve() for kRaw runs alone, into out->keep and out->run_placements (replaced,
  // their capacity reused; nothing else of *out is touched): how the engine checks its own
  // descriptor lists, once per transfer, without allocating. `max_steps` bounds the steps of all
  // the runs together (the engine's own lists, which it splits into requests afterwards, pass more).
  Status resolveRaw(const std::vector<wire::Run>& runs, bool for_write, Resolved* out,
                    uint64_t max_steps = limits::kMaxRequestSpanSteps) const;
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
  // Second word (offset 8): the engine's role, `epoch << 1 | pending` (pending: a role switch is
  // draining, switching or rolling back), written by the engine (publishRole) before the generation
  // is bumped at each phase change of a switch. A same-host requester's prepared transfer binds its
  // epoch from it and checks it before and after each copy through a cached layout, which the
  // server never sees (transport/cma/cma_path.h).
  struct Published {
    std::atomic<uint64_t> generation{1};
    std::atomic<uint64_t> role{0};
  };
  static constexpr uint64_t kPublishedRoleOffset = 8;
  static uint64_t roleWord(uint64_t epoch, bool pending) { return epoch << 1 | (pending ? 1 : 0); }
  const Published* published() const { return &published_; }
  void publishRole(uint64_t epoch, bool pending) {
    published_.role.store(roleWord(epoch, pending), std::memory_order_seq_cst);
  }
  // Moves the generation without changing anything (a role switch: Engine::switchRole), so that a
  // same-host peer's cached descriptors are checked again by asking this side.
  void bumpGeneration() { bumpLocked(); }

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

  // One run of a raw resolution, under the shared lock: its steps counted into *steps (at most
  // max_steps in all), each cache it touches added to out->keep once (`kept`: their entries, for
  // requests that touch many), its placement appended to out->run_placements.
  Status resolveRawRunLocked(const wire::Run& run, bool for_write, uint64_t max_steps, uint64_t* steps, Resolved* out,
                             std::set<const CacheEntry*>* kept) const;
  // resolve() of a kRaw body that came as rows (body.rows): each row's span [offset, end()) checked
  // as one range, which holds each of its runs; where that fails, body.runs one by one. Placements
  // are per run either way.
  Status resolveRawRows(const wire::TransferBody& body, bool for_write, Resolved* out) const;
  void eraseLocked(std::map<int64_t, std::shared_ptr<CacheEntry>>::iterator it);
  void unbindLocked(int64_t id, uint64_t slot);
  void maybeFreeLocked(int64_t id);

  void bumpLocked() { published_.generation.fetch_add(1, std::memory_order_release); }

  // A raw resolution lets go of the shared lock between batches of about this many steps (each
  // run whole in one hold, so a hold is at most this plus limits::kMaxRawSpan steps): a few
  // hundred microseconds, what a writer waits for at most behind one reader.
  static constexpr uint64_t kResolveBatchSteps = 4096;
  // A request that touches more distinct caches than this tracks them in a set (fewer: a scan).
  static constexpr size_t kKeepScan = 16;
  struct RawTensor {
    uint64_t end;
    const CacheEntry* entry;  // valid while indexed: an entry leaves raw_index_ before caches_
  };

  mutable RegistryMutex mu_;
  alignas(16) Published published_;
  int64_t next_id_ = 1;
  std::map<int64_t, std::shared_ptr<CacheEntry>> caches_;
  std::set<int64_t> id_refs_;                                // allocated caches not yet deallocated
  std::map<int64_t, std::map<uint64_t, Binding>> bindings_;  // cache id -> slot -> key
  KeyIndex req_index_;
  KeyIndex prefix_index_;
  std::map<uint64_t, int64_t> blocks_index_;
  std::multimap<uint64_t, RawTensor> raw_index_;  // tensor start -> end, cache (every cache's tensors)
};

}  // namespace pdlink
