#include "engine/mem_pool.h"

namespace pdlink {

Result<std::shared_ptr<MemPool>> MemPool::create(std::shared_ptr<Backend> backend, Placement placement, uint64_t bytes,
                                                 uint32_t page_shift) {
  if (bytes == 0) return Status(Code::kParamInvalid, "memory pool size must be > 0");
  if (page_shift < 10 || page_shift >= 31) {
    return Status(Code::kParamInvalid, "page_shift must be in [10, 31), got " + std::to_string(page_shift));
  }
  auto region = backend->allocate(placement, bytes);
  if (!region.ok()) return region.status();
  std::shared_ptr<MemPool> pool(new MemPool());
  pool->backend_ = std::move(backend);
  pool->placement_ = placement;
  pool->base_ = reinterpret_cast<uint64_t>(region.value());
  pool->size_ = bytes;
  pool->page_ = uint64_t{1} << page_shift;
  pool->free_[0] = bytes;
  return pool;
}

MemPool::~MemPool() { backend_->release(placement_, reinterpret_cast<void*>(base_), size_); }

Result<uint64_t> MemPool::allocate(uint64_t bytes) {
  if (bytes > size_) {  // also keeps the rounding below from wrapping around
    return Status(Code::kOutOfMemory, "memory pool exhausted: need " + std::to_string(bytes) + " bytes, the pool has " +
                                          std::to_string(size_));
  }
  uint64_t need = (bytes + page_ - 1) / page_ * page_;
  if (need == 0) need = page_;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    uint64_t off = it->first;
    uint64_t left = it->second - need;
    free_.erase(it);
    if (left > 0) free_[off + need] = left;
    taken_[off] = need;
    return base_ + off;
  }
  uint64_t in_use = 0;
  for (auto& [o, l] : taken_) in_use += l;
  return Status(Code::kOutOfMemory, "memory pool exhausted: need " + std::to_string(need) + " bytes, " +
                                        std::to_string(size_ - in_use) + " of " + std::to_string(size_) +
                                        " free (possibly fragmented)");
}

void MemPool::release(uint64_t addr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = taken_.find(addr - base_);
  if (it == taken_.end()) return;
  uint64_t off = it->first, len = it->second;
  taken_.erase(it);
  auto next = free_.lower_bound(off);
  if (next != free_.end() && off + len == next->first) {  // merge with the following range
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {  // merge with the preceding range
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += len;
      return;
    }
  }
  free_[off] = len;
}

uint64_t MemPool::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t n = 0;
  for (auto& [o, l] : taken_) n += l;
  return n;
}

}  // namespace pdlink
