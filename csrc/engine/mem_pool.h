// MemPool: a fixed-size region from a backend, carved into page-aligned allocations.
//
// Backs allocate_cache / allocate_blocks_cache (`llm.MemPoolConfig` for DEVICE, `llm.HostMemPoolConfig`
// for HOST). First-fit over an address-ordered free list, with neighbours merged on release, so a
// pool that is emptied is one free range again.
// Ownership: the pool owns its region and returns it to the backend on destruction; allocations
// must be released before that (CacheEntry holds a shared_ptr to its pool to guarantee it).
// Threading: all methods are thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "backends/backend.h"
#include "core/status.h"

namespace pdlink {

class MemPool {
 public:
  static Result<std::shared_ptr<MemPool>> create(std::shared_ptr<Backend> backend, Placement placement, uint64_t bytes,
                                                 uint32_t page_shift);
  ~MemPool();

  // kOutOfMemory (with the sizes in the message) when no free range is large enough.
  Result<uint64_t> allocate(uint64_t bytes);
  void release(uint64_t addr);

  uint64_t capacity() const { return size_; }
  uint64_t base() const { return base_; }
  uint64_t used() const;

 private:
  MemPool() = default;
  std::shared_ptr<Backend> backend_;
  Placement placement_ = Placement::kHost;
  uint64_t base_ = 0;
  uint64_t size_ = 0;
  uint64_t page_ = 0;
  mutable std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;   // offset -> length, guarded by mu_
  std::map<uint64_t, uint64_t> taken_;  // offset -> length, guarded by mu_
};

}  // namespace pdlink
