#include "engine/registry.h"

#include <cerrno>
#include <shared_mutex>
#include <system_error>

#include "core/spans.h"

namespace pdlink {

RegistryMutex::RegistryMutex() {
  pthread_rwlockattr_t attr;
  pthread_rwlockattr_init(&attr);
#ifdef __GLIBC__
  pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
#endif
  if (pthread_rwlock_init(&rw_, &attr) != 0)
    throw std::system_error(errno, std::generic_category(), "pthread_rwlock_init");
  pthread_rwlockattr_destroy(&attr);
}

RegistryMutex::~RegistryMutex() { pthread_rwlock_destroy(&rw_); }

// pthread_rwlock_*lock fail only on misuse (deadlock detected, too many readers), as
// std::shared_mutex's do: thrown the same way.
void RegistryMutex::lock() {
  if (int rc = pthread_rwlock_wrlock(&rw_)) throw std::system_error(rc, std::generic_category(), "registry lock");
}
void RegistryMutex::unlock() { pthread_rwlock_unlock(&rw_); }
void RegistryMutex::lock_shared() {
  if (int rc = pthread_rwlock_rdlock(&rw_)) throw std::system_error(rc, std::generic_category(), "registry lock");
}
void RegistryMutex::unlock_shared() { pthread_rwlock_unlock(&rw_); }

namespace {

Status tooManySteps(uint64_t max_steps) {
  return Status(Code::kParamInvalid,
                "the address ranges of this request run across more than " + std::to_string(max_steps) +
                    " registrations in all (max_request_span_steps); split it into several requests");
}

}  // namespace

CacheEntry::~CacheEntry() {
  if (owned && pool) {
    for (uint64_t a : addrs) pool->release(a);
  }
}

Result<std::shared_ptr<CacheEntry>> Registry::add(CacheEntry entry, const std::vector<RequestKey>& keys) {
  std::unique_lock<RegistryMutex> lock(mu_);
  if (keys.size() > entry.layout.num_slots) {
    return Status(Code::kParamInvalid, "cache_keys has " + std::to_string(keys.size()) +
                                           " keys but the cache has only " + std::to_string(entry.layout.num_slots) +
                                           " batch slots");
  }
  // Check every key before binding any, so a rejected call changes nothing.
  std::set<std::pair<uint64_t, uint64_t>> seen_req, seen_prefix;
  for (const RequestKey& k : keys) {
    if (k.hasReq()) {
      auto ix = std::make_pair(k.req_id, k.model_id);
      if (req_index_.count(ix) || !seen_req.insert(ix).second) {
        return Status(Code::kParamInvalid, "request key (req_id=" + std::to_string(k.req_id) + ", model_id=" +
                                               std::to_string(k.model_id) + ") is already bound to a cache");
      }
    }
    if (k.hasPrefix()) {
      auto ix = std::make_pair(k.prefix_id, k.model_id);
      if (prefix_index_.count(ix) || !seen_prefix.insert(ix).second) {
        return Status(Code::kParamInvalid, "prefix key (prefix_id=" + std::to_string(k.prefix_id) + ", model_id=" +
                                               std::to_string(k.model_id) + ") is already bound to a cache");
      }
    }
  }
  if (entry.blocks_model && blocks_index_.count(*entry.blocks_model)) {
    return Status(Code::kParamInvalid,
                  "a blocks cache is already registered under model_id " + std::to_string(*entry.blocks_model));
  }
  entry.id = next_id_++;
  auto sp = std::make_shared<CacheEntry>(std::move(entry));
  caches_[sp->id] = sp;
  for (uint64_t a : sp->addrs) raw_index_.emplace(a, RawTensor{a + sp->layout.tensor_size, sp.get()});
  if (sp->owned) id_refs_.insert(sp->id);
  if (sp->blocks_model) blocks_index_[*sp->blocks_model] = sp->id;
  for (uint64_t slot = 0; slot < keys.size(); ++slot) {
    const RequestKey& k = keys[slot];
    if (!k.hasReq() && !k.hasPrefix()) continue;  // padding key: consumes the slot only
    bindings_[sp->id][slot] = Binding{k, {}};
    if (k.hasReq()) req_index_[{k.req_id, k.model_id}] = {sp->id, slot};
    if (k.hasPrefix()) prefix_index_[{k.prefix_id, k.model_id}] = {sp->id, slot};
  }
  return sp;
}

Result<std::shared_ptr<CacheEntry>> Registry::get(int64_t id) const {
  std::shared_lock<RegistryMutex> lock(mu_);
  auto it = caches_.find(id);
  if (it == caches_.end()) {
    return Status(Code::kParamInvalid, "no cache with id " + std::to_string(id) + " is registered here");
  }
  return it->second;
}

Status Registry::deallocate(int64_t id, bool expect_blocks) {
  std::unique_lock<RegistryMutex> lock(mu_);
  auto it = caches_.find(id);
  if (it == caches_.end() || !it->second->owned || !id_refs_.count(id)) return Status::OK();
  if (it->second->layout.is_blocks != expect_blocks) {
    return Status(Code::kParamInvalid, std::string("cache ") + std::to_string(id) + " is " +
                                           (expect_blocks ? "not a blocks cache; use deallocate_cache"
                                                          : "a blocks cache; use deallocate_blocks_cache"));
  }
  bumpLocked();
  id_refs_.erase(id);
  if (it->second->blocks_model) blocks_index_.erase(*it->second->blocks_model);
  maybeFreeLocked(id);
  return Status::OK();
}

Result<std::shared_ptr<CacheEntry>> Registry::unregister(int64_t id) {
  std::unique_lock<RegistryMutex> lock(mu_);
  auto it = caches_.find(id);
  if (it == caches_.end()) {
    return Status(Code::kParamInvalid, "no registered cache with id " + std::to_string(id));
  }
  if (it->second->owned) {
    return Status(Code::kParamInvalid,
                  "cache " + std::to_string(id) + " was allocated from a memory pool; use deallocate_cache");
  }
  bumpLocked();
  if (it->second->blocks_model) blocks_index_.erase(*it->second->blocks_model);
  auto b = bindings_.find(id);
  if (b != bindings_.end()) {
    std::vector<uint64_t> slots;
    for (auto& [slot, binding] : b->second) slots.push_back(slot);
    for (uint64_t slot : slots) unbindLocked(id, slot);
  }
  std::shared_ptr<CacheEntry> entry = it->second;
  eraseLocked(it);
  return entry;
}

void Registry::removeKey(const RequestKey& key) {
  std::unique_lock<RegistryMutex> lock(mu_);
  std::pair<int64_t, uint64_t> where{0, 0};
  auto r = key.hasReq() ? req_index_.find({key.req_id, key.model_id}) : req_index_.end();
  if (r != req_index_.end()) {
    where = r->second;
  } else {
    auto p = key.hasPrefix() ? prefix_index_.find({key.prefix_id, key.model_id}) : prefix_index_.end();
    if (p == prefix_index_.end()) return;
    where = p->second;
  }
  unbindLocked(where.first, where.second);
  maybeFreeLocked(where.first);
}

void Registry::unbindLocked(int64_t id, uint64_t slot) {
  bumpLocked();
  auto b = bindings_.find(id);
  if (b == bindings_.end()) return;
  auto s = b->second.find(slot);
  if (s == b->second.end()) return;
  const RequestKey& k = s->second.key;
  if (k.hasReq()) req_index_.erase({k.req_id, k.model_id});
  if (k.hasPrefix()) prefix_index_.erase({k.prefix_id, k.model_id});
  b->second.erase(s);
  if (b->second.empty()) bindings_.erase(b);
}

void Registry::maybeFreeLocked(int64_t id) {
  auto it = caches_.find(id);
  if (it == caches_.end() || !it->second->owned) return;
  if (id_refs_.count(id) || bindings_.count(id)) return;
  // The memory returns to the pool when the last in-flight transfer drops its reference.
  bumpLocked();
  eraseLocked(it);
}

void Registry::eraseLocked(std::map<int64_t, std::shared_ptr<CacheEntry>>::iterator it) {
  const CacheEntry& e = *it->second;
  for (uint64_t a : e.addrs) {
    auto [first, last] = raw_index_.equal_range(a);
    for (auto r = first; r != last; ++r) {
      if (r->second.entry == &e) {
        raw_index_.erase(r);
        break;
      }
    }
  }
  caches_.erase(it);
}

Result<Resolved> Registry::resolve(const wire::TransferBody& body, bool for_write) const {
  const wire::Target& t = body.target;
  if (t.kind == wire::TargetKind::kRaw) {
    if (body.tensors.size() != 1) return Status(Code::kParamInvalid, "a raw-address transfer moves one tensor");
    Resolved r;
    PDLINK_RETURN_IF_ERROR(body.rows.empty() ? resolveRaw(body.runs, for_write, &r)
                                             : resolveRawRows(body, for_write, &r));
    r.addrs = {0};
    r.tensors = {0};
    r.runs = body.runs;
    return r;
  }
  std::shared_ptr<CacheEntry> entry;
  uint64_t slot = 0;
  bool slotted = true;
  auto notFound = [&]() { return Status(Code::kKvCacheNotExist, "no cache is published here under " + t.describe()); };
  {  // the indexes, under the lock; the checks below read only the entry, which does not change
    std::shared_lock<RegistryMutex> lock(mu_);
    switch (t.kind) {
      case wire::TargetKind::kRequestKey:
      case wire::TargetKind::kPrefixKey: {
        const KeyIndex& ix = t.kind == wire::TargetKind::kRequestKey ? req_index_ : prefix_index_;
        uint64_t id_field = t.kind == wire::TargetKind::kRequestKey ? t.req_id : t.prefix_id;
        auto it = ix.find({id_field, t.model_id});
        if (it == ix.end()) return notFound();
        entry = caches_.at(it->second.first);
        slot = it->second.second;
        break;
      }
      case wire::TargetKind::kIdIndex: {
        auto it = caches_.find(t.cache_id);
        if (it == caches_.end() || t.batch_index >= it->second->layout.num_slots) return notFound();
        entry = it->second;
        slot = t.batch_index;
        break;
      }
      case wire::TargetKind::kBlocks: {
        auto it = blocks_index_.find(t.model_id);
        if (it == blocks_index_.end()) return notFound();
        entry = caches_.at(it->second);
        slotted = false;
        break;
      }
      case wire::TargetKind::kRaw:
        break;                        // handled above
      case wire::TargetKind::kOffer:  // the offer table's (engine/offers.h), never the registry's
        return Status(Code::kParamInvalid, "an offer is resolved by the offer table");
    }
  }
  const CacheLayout& L = entry->layout;
  if (for_write && !entry->remote_accessible) {
    return Status(Code::kParamInvalid, "cache " + std::to_string(entry->id) +
                                           " is not remote accessible; register it with remote_accessible=True");
  }
  if (body.block_size != 0 && body.block_size != L.stride()) {
    return Status(Code::kParamInvalid, "block size mismatch: requester uses " + std::to_string(body.block_size) +
                                           " bytes per block, " + t.describe() + " has " + std::to_string(L.stride()));
  }
  const uint64_t limit = slotted ? L.stride() : L.tensor_size;
  for (uint32_t tensor : body.tensors) {
    if (tensor >= L.num_tensors) {
      return Status(Code::kParamInvalid, "tensor index " + std::to_string(tensor) + " out of range: " + t.describe() +
                                             " has " + std::to_string(L.num_tensors) + " tensors");
    }
  }
  auto outside = [&](uint64_t offset, uint64_t length) {
    return Status(Code::kParamInvalid, "access [" + std::to_string(offset) + ", +" + std::to_string(length) +
                                           ") is outside " + t.describe() + " (" + std::to_string(limit) + " bytes)");
  };
  // A row at once: its runs lie in [offset, end()), which decode checked does not wrap.
  for (const wire::Row& row : body.rows) {
    if (row.length == 0 || row.end() > limit) return outside(row.offset, row.end() - row.offset);
  }
  if (body.rows.empty()) {
    for (const wire::Run& run : body.runs) {
      uint64_t end = 0;
      if (run.length == 0 || __builtin_add_overflow(run.offset, run.length, &end) || end > limit) {
        return outside(run.offset, run.length);
      }
    }
  }
  Resolved r;
  r.addrs = entry->addrs;
  r.keep.push_back(std::move(entry));
  r.tensors = body.tensors;
  r.runs = body.runs;
  r.base = slotted ? slot * L.stride() : 0;
  return r;
}

Status Registry::resolveRawRows(const wire::TransferBody& body, bool for_write, Resolved* out) const {
  // Each row's span as one range; where a span is not registered memory by the rule of
  // core/spans.h (a row whose runs lie in tensors with unregistered gaps between them), the runs
  // one by one, as a body of pairs is checked.
  std::vector<wire::Run> spans;
  spans.reserve(body.rows.size());
  for (const wire::Row& row : body.rows) {
    if (row.length == 0) return resolveRaw(body.runs, for_write, out);  // refused there, as an empty run
    spans.push_back(wire::Run{row.offset, row.end() - row.offset});
  }
  if (!resolveRaw(spans, for_write, out).ok()) return resolveRaw(body.runs, for_write, out);
  std::vector<Placement> by_row;
  by_row.swap(out->run_placements);
  out->run_placements.reserve(body.runs.size());
  for (size_t i = 0; i < body.rows.size(); ++i)
    out->run_placements.insert(out->run_placements.end(), body.rows[i].count, by_row[i]);
  return Status::OK();
}

Status Registry::resolveRaw(const std::vector<wire::Run>& runs, bool for_write, Resolved* out,
                            uint64_t max_steps) const {
  Resolved& r = *out;
  r.keep.clear();
  r.run_placements.clear();
  if (runs.size() > max_steps) return tooManySteps(max_steps);  // every range takes a step at least
  std::set<const CacheEntry*> kept;                             // used only once a request touched kKeepScan caches
  uint64_t steps = 0;
  size_t i = 0;
  while (i < runs.size()) {
    // One batch: let go between batches, so a writer waits for one batch at most (header).
    std::shared_lock<RegistryMutex> lock(mu_);
    const uint64_t batch_end = steps + kResolveBatchSteps;
    for (; i < runs.size() && steps < batch_end; ++i) {
      PDLINK_RETURN_IF_ERROR(resolveRawRunLocked(runs[i], for_write, max_steps, &steps, &r, &kept));
    }
  }
  return Status::OK();
}

Status Registry::resolveRawRunLocked(const wire::Run& run, bool for_write, uint64_t max_steps, uint64_t* steps,
                                     Resolved* out, std::set<const CacheEntry*>* kept) const {
  Resolved& r = *out;
  // The range must lie in registered memory by the rule of core/spans.h; each tensor a step
  // reaches is checked and referenced.
  const RawTensor* best = nullptr;  // what the last reach() found
  const CacheEntry* first = nullptr;
  Status refused;
  auto reach = [&](uint64_t at) {
    best = nullptr;
    auto it = raw_index_.upper_bound(at);
    for (size_t k = 0; k < limits::kRawCandidates && it != raw_index_.begin(); ++k) {
      --it;
      if (it->second.end > at && (best == nullptr || it->second.end > best->end)) best = &it->second;
    }
    return best == nullptr ? at : best->end;
  };
  auto visit = [&] {
    const CacheEntry& found = *best->entry;
    if (for_write && !found.remote_accessible) {
      refused = Status(Code::kParamInvalid, "cache " + std::to_string(found.id) + " is not remote accessible");
      return false;
    }
    // Host and device memory move by different means (a device backend's DEVICE memory only through
    // its copies and channels): one range is one of them.
    if (first == nullptr) {
      first = &found;
    } else if (found.layout.placement != first->layout.placement) {
      refused = Status(Code::kParamInvalid, "address range [" + std::to_string(run.offset) + ", +" +
                                                std::to_string(run.length) + ") spans HOST and DEVICE memory");
      return false;
    }
    // One reference per distinct cache: the last one added, a scan of the first few, then a set.
    bool have = !r.keep.empty() && r.keep.back().get() == &found;
    if (!have && r.keep.size() < kKeepScan) {
      for (const auto& e : r.keep) have = have || e.get() == &found;
    } else if (!have) {
      if (kept->empty()) {
        for (const auto& e : r.keep) kept->insert(e.get());
      }
      have = !kept->insert(&found).second;
    }
    if (!have) r.keep.push_back(caches_.at(found.id));
    return true;
  };
  switch (spans::walk(run.offset, run.length, max_steps, steps, reach, visit)) {
    case spans::Walk::kCovered:
      r.run_placements.push_back(first->layout.placement);
      return Status::OK();
    case spans::Walk::kInvalid:
      return Status(Code::kParamInvalid, "invalid address range");
    case spans::Walk::kTooManySteps:
      return tooManySteps(max_steps);
    case spans::Walk::kRefused:
      return refused;
    case spans::Walk::kNotCovered:
      break;
  }
  return Status(Code::kParamInvalid, "address range [" + std::to_string(run.offset) + ", +" +
                                         std::to_string(run.length) + ") is not inside registered memory");
}

void Registry::commitRead(const wire::Target& t, const std::vector<uint32_t>& tensors) {
  std::unique_lock<RegistryMutex> lock(mu_);
  std::pair<int64_t, uint64_t> where;
  if (t.kind == wire::TargetKind::kRequestKey) {
    auto it = req_index_.find({t.req_id, t.model_id});
    if (it == req_index_.end()) return;
    where = it->second;
  } else if (t.kind == wire::TargetKind::kIdIndex) {
    where = {t.cache_id, t.batch_index};
  } else {
    return;  // prefix keys and blocks caches are never consumed by reads
  }
  auto c = caches_.find(where.first);
  if (c == caches_.end() || !c->second->owned) return;
  auto b = bindings_.find(where.first);
  if (b == bindings_.end()) return;
  auto s = b->second.find(where.second);
  if (s == b->second.end() || !s->second.key.hasReq()) return;
  for (uint32_t tensor : tensors) {
    if (tensor < c->second->layout.num_tensors) s->second.read_tensors.insert(tensor);
  }
  if (s->second.read_tensors.size() >= c->second->layout.num_tensors) {
    unbindLocked(where.first, where.second);
    maybeFreeLocked(where.first);
  }
}

std::vector<std::pair<uint64_t, uint64_t>> Registry::registeredDeviceTensors() const {
  std::shared_lock<RegistryMutex> lock(mu_);
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (const auto& [id, e] : caches_) {
    if (e->owned || e->layout.placement != Placement::kDevice) continue;
    for (uint64_t a : e->addrs) out.emplace_back(a, e->layout.tensor_size);
  }
  return out;
}

size_t Registry::size() const {
  std::shared_lock<RegistryMutex> lock(mu_);
  return caches_.size();
}

Result<wire::CacheDescriptor> Registry::describe(uint64_t model_id) const {
  std::shared_lock<RegistryMutex> lock(mu_);
  auto it = blocks_index_.find(model_id);
  if (it == blocks_index_.end()) {
    return Status(Code::kKvCacheNotExist,
                  "no blocks cache is published here under model_id " + std::to_string(model_id));
  }
  const CacheEntry& e = *caches_.at(it->second);
  wire::CacheDescriptor d;
  d.generation = published_.generation.load(std::memory_order_acquire);
  d.tensor_size = e.layout.tensor_size;
  d.stride = e.layout.stride();
  d.addrs = e.addrs;
  return d;
}

Result<wire::RawTable> Registry::describeRaw() const {
  std::shared_lock<RegistryMutex> lock(mu_);
  if (raw_index_.size() > limits::kMaxRequestTensors) {
    return Status(Code::kParamInvalid, "too many registered tensors to describe");
  }
  wire::RawTable t;
  t.generation = published_.generation.load(std::memory_order_acquire);
  t.ranges.reserve(raw_index_.size());
  for (const auto& [start, tensor] : raw_index_) t.ranges.push_back({start, tensor.end - start});
  return t;
}

void Registry::clear() {
  std::unique_lock<RegistryMutex> lock(mu_);
  bumpLocked();
  caches_.clear();
  raw_index_.clear();
  id_refs_.clear();
  bindings_.clear();
  req_index_.clear();
  prefix_index_.clear();
  blocks_index_.clear();
}

}  // namespace pdlink
