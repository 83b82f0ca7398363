// OfferTable (engine/offers.h): the prefill side's KV handoffs.
#include "engine/offers.h"

#include <algorithm>
#include <random>

#include "core/limits.h"
#include "transport/link.h"
#include "transport/wire.h"

namespace pdlink {

namespace {

uint64_t randomSalt() {
  std::random_device rd;  // the OS CSPRNG on Linux
  return (uint64_t{rd()} << 32) ^ rd() ^ (uint64_t{rd()} << 16);
}

// splitmix64's finaliser: a bijection, so distinct ids give distinct generations under one salt.
uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}

Status released(const std::string& why) { return Status(Code::kOfferReleased, Scope::kCall, why); }

}  // namespace

const char* offerReasonName(OfferReason reason) {
  switch (reason) {
    case OfferReason::kNone:
      return "";
    case OfferReason::kClaimed:
      return "claimed";
    case OfferReason::kExpired:
      return "expired";
    case OfferReason::kAborted:
      return "aborted";
    case OfferReason::kPeerAborted:
      return "peer_aborted";
    case OfferReason::kLinkDown:
      return "link_down";
    case OfferReason::kReleased:
      return "released";
  }
  return "";
}

OfferTable::OfferTable(std::function<void()> on_change) : on_change_(std::move(on_change)), salt_(randomSalt()) {}

OfferTable::~OfferTable() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  lease_cv_.notify_all();
  if (lease_thread_.joinable()) lease_thread_.join();
}

void OfferTable::configure(const OfferLimits& limits) {
  std::lock_guard<std::mutex> lock(mu_);
  limits_ = limits;
}

uint64_t OfferTable::generationOf(uint64_t id) const { return mix(mix(id) ^ salt_); }

bool OfferTable::sameLink(const std::weak_ptr<Link>& bound, const std::shared_ptr<Link>& link) {
  // Owner identity: a weak_ptr keeps its control block, so a later link never compares equal.
  return !bound.owner_before(link) && !link.owner_before(bound);
}

void OfferTable::changed() {
  if (on_change_) on_change_();
}

Result<OfferTicket> OfferTable::offer(std::shared_ptr<CacheEntry> cache, std::vector<int64_t> blocks,
                                      std::string request_id, int64_t lease_ms) {
  if (!cache || !cache->layout.is_blocks || !cache->blocks_model) {
    return Status(Code::kParamInvalid, "an offer is read through a region registered with a key (register(key=...))");
  }
  if (request_id.size() > limits::kMaxHandoffRequestIdBytes) {
    return Status(Code::kParamInvalid,
                  "a request id has at most " + std::to_string(limits::kMaxHandoffRequestIdBytes) + " bytes");
  }
  if (!wire::isUtf8(request_id.data(), request_id.size())) {
    return Status(Code::kParamInvalid, "a request id is UTF-8 text (it reaches a peer's application as text)");
  }
  if (blocks.empty()) return Status(Code::kParamInvalid, "an offer needs at least one block");
  const uint64_t slots = cache->layout.num_slots;
  std::vector<uint64_t> sorted;
  sorted.reserve(blocks.size());
  for (int64_t b : blocks) {
    if (b < 0 || static_cast<uint64_t>(b) >= slots) {
      return Status(Code::kParamInvalid, "block index " + std::to_string(b) + " out of range: the region has " +
                                             std::to_string(slots) + " blocks");
    }
    sorted.push_back(static_cast<uint64_t>(b));
  }
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  std::unique_lock<std::mutex> lock(mu_);
  if (lease_ms <= 0) lease_ms = limits_.default_lease_ms;
  if (lease_ms > limits_.max_lease_ms) {
    return Status(Code::kParamInvalid, "lease_ms " + std::to_string(lease_ms) + " is past max_lease_ms (" +
                                           std::to_string(limits_.max_lease_ms) + ")");
  }
  if (offers_.size() + finalized_.size() >= limits_.max_offers) {
    return Status(Code::kOutOfMemory, Scope::kEngine,
                  "this engine holds max_offers (" + std::to_string(limits_.max_offers) +
                      ") offers: wait for claims or releases (Limits.max_offers)");
  }
  const uint64_t id = next_id_++;
  Offer o;
  o.generation = generationOf(id);
  o.request_id = std::move(request_id);
  o.stride = cache->layout.stride();
  o.bytes = sorted.size() * o.stride * cache->layout.num_tensors;
  o.cache = std::move(cache);
  o.blocks = std::move(sorted);
  o.lease_ms = lease_ms;
  o.deadline = Clock::now() + std::chrono::milliseconds(lease_ms);
  leases_.emplace(o.deadline, id);
  stats_.live += 1;
  stats_.bytes += o.bytes;
  OfferTicket t{id, o.generation, lease_ms};
  offers_.emplace(id, std::move(o));
  if (!lease_thread_.joinable()) lease_thread_ = std::thread([this] { leaseLoop(); });
  lock.unlock();
  lease_cv_.notify_all();
  return t;
}

void OfferTable::Guard::reset() {
  if (!t_) return;
  OfferTable* t = t_;
  t_ = nullptr;
  bool finalised = false;
  {
    std::lock_guard<std::mutex> lock(t->mu_);
    auto it = t->offers_.find(id_);
    if (it != t->offers_.end() && --it->second.serving == 0 && it->second.state == State::kClosing) {
      t->finaliseLocked(it);
      finalised = true;
    }
  }
  if (finalised) {
    t->finalized_cv_.notify_all();
    t->changed();
  }
}

void OfferTable::extendLocked(uint64_t id, Offer& o) {
  leases_.erase({o.deadline, id});
  o.deadline = Clock::now() + std::chrono::milliseconds(o.lease_ms);
  leases_.emplace(o.deadline, id);
}

Status OfferTable::admitRead(const wire::TransferBody& body, const std::shared_ptr<Link>& link, uint64_t peer,
                             Guard* guard, Resolved* resolved) {
  const wire::Target& t = body.target;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = offers_.find(t.req_id);
  // An unknown id, a wrong generation or key: one answer, so a guess learns nothing.
  if (it == offers_.end() || it->second.generation != t.prefix_id || *it->second.cache->blocks_model != t.model_id) {
    return released("offer " + std::to_string(t.req_id) +
                    " is not live here (claimed, expired, aborted, released, its link down, or never offered)");
  }
  Offer& o = it->second;
  if (o.state != State::kLive) {
    return released("offer " + std::to_string(t.req_id) + " was released: " + offerReasonName(o.reason));
  }
  if (o.bound && !sameLink(o.link, link)) {
    return released("offer " + std::to_string(t.req_id) + " is bound to another link (another decoder holds it)");
  }
  const CacheLayout& L = o.cache->layout;
  if (body.block_size != 0 && body.block_size != o.stride) {
    return Status(Code::kParamInvalid, "block size mismatch: requester uses " + std::to_string(body.block_size) +
                                           " bytes per block, the offer's region has " + std::to_string(o.stride));
  }
  for (uint32_t tensor : body.tensors) {
    if (tensor >= L.num_tensors) {
      return Status(Code::kParamInvalid, "tensor index " + std::to_string(tensor) +
                                             " out of range: the offer's region has " + std::to_string(L.num_tensors) +
                                             " tensors");
    }
  }
  for (const wire::Run& run : body.runs) {
    uint64_t end = 0;
    if (run.length == 0 || __builtin_add_overflow(run.offset, run.length, &end) || end > L.tensor_size) {
      return Status(Code::kParamInvalid, "access [" + std::to_string(run.offset) + ", +" + std::to_string(run.length) +
                                             ") is outside the offer's region");
    }
    // Blocks first..last all offered: first's position p in the sorted list, and last at p + (last
    // - first) (the list is unique and sorted, so that holds exactly when every block between is).
    const uint64_t first = run.offset / o.stride, last = (end - 1) / o.stride;
    auto at = std::lower_bound(o.blocks.begin(), o.blocks.end(), first);
    const uint64_t pos = static_cast<uint64_t>(at - o.blocks.begin());
    if (at == o.blocks.end() || *at != first || last - first >= o.blocks.size() - pos ||
        o.blocks[pos + (last - first)] != last) {
      return released("access [" + std::to_string(run.offset) + ", +" + std::to_string(run.length) +
                      ") reaches blocks outside offer " + std::to_string(t.req_id));
    }
  }
  if (!o.bound) {
    o.bound = true;
    o.link = link;
    o.peer = peer;
  }
  extendLocked(it->first, o);
  ++o.serving;
  resolved->keep.assign(1, o.cache);
  resolved->addrs = o.cache->addrs;
  resolved->tensors = body.tensors;
  resolved->runs = body.runs;
  resolved->base = 0;
  resolved->run_placements.clear();
  *guard = Guard(this, it->first);
  return Status::OK();
}

bool OfferTable::closeLocked(std::unordered_map<uint64_t, Offer>::iterator it, OfferReason reason) {
  Offer& o = it->second;
  if (o.state != State::kLive) return false;
  o.state = State::kClosing;
  o.reason = reason;
  leases_.erase({o.deadline, it->first});
  if (o.serving > 0) return false;  // the last read's guard finalises it
  finaliseLocked(it);
  return true;
}

void OfferTable::finaliseLocked(std::unordered_map<uint64_t, Offer>::iterator it) {
  Offer& o = it->second;
  stats_.live -= 1;
  stats_.bytes -= o.bytes;
  stats_.released += 1;
  if (o.reason == OfferReason::kExpired) stats_.expired += 1;
  if (o.reason == OfferReason::kAborted || o.reason == OfferReason::kPeerAborted) stats_.aborted += 1;
  if (released_.size() >= limits_.max_events) {
    released_.pop_front();
    stats_.events_dropped += 1;
  }
  released_.push_back(ReleasedOffer{it->first, o.request_id, o.reason, o.bound, o.bound ? o.peer : 0});
  finalized_.emplace_back(it->first, o.reason);
  offers_.erase(it);  // drops the cache reference
}

void OfferTable::commit(const wire::Target& target, const std::shared_ptr<Link>& link) {
  bool finalised = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = offers_.find(target.req_id);
    if (it == offers_.end() || it->second.generation != target.prefix_id ||
        *it->second.cache->blocks_model != target.model_id || !it->second.bound || !sameLink(it->second.link, link)) {
      return;
    }
    finalised = closeLocked(it, OfferReason::kClaimed);
  }
  if (finalised) {
    finalized_cv_.notify_all();
    changed();
  }
}

void OfferTable::release(uint64_t id, OfferReason reason) {
  bool finalised = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = offers_.find(id);
    if (it != offers_.end()) finalised = closeLocked(it, reason);
  }
  if (finalised) {
    finalized_cv_.notify_all();
    changed();
  }
}

size_t OfferTable::releaseRequest(const std::string& request_id, OfferReason reason,
                                  const std::shared_ptr<Link>& from_link) {
  return releaseWhere(
      [&](const Offer& o) {
        return o.state == State::kLive && o.request_id == request_id &&
               !(from_link && o.bound && !sameLink(o.link, from_link));
      },
      reason);
}

size_t OfferTable::hold(const std::shared_ptr<Link>& link, uint64_t peer,
                        const std::vector<std::pair<uint64_t, uint64_t>>& offers) {
  size_t held = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, generation] : offers) {
      auto it = offers_.find(id);
      if (it == offers_.end() || it->second.generation != generation || it->second.state != State::kLive) continue;
      Offer& o = it->second;
      if (o.bound && !sameLink(o.link, link)) continue;
      if (!o.bound) {
        o.bound = true;
        o.link = link;
        o.peer = peer;
      }
      extendLocked(id, o);
      ++held;
    }
  }
  lease_cv_.notify_all();
  return held;
}

void OfferTable::linkEnded(const std::shared_ptr<Link>& link) {
  bool finalised = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<uint64_t> ids;
    for (auto& [id, o] : offers_) {
      if (o.state == State::kLive && o.bound && sameLink(o.link, link)) ids.push_back(id);
    }
    for (uint64_t id : ids) finalised = closeLocked(offers_.find(id), OfferReason::kLinkDown) || finalised;
  }
  if (finalised) {
    finalized_cv_.notify_all();
    changed();
  }
}

void OfferTable::releaseAll(OfferReason reason) {
  releaseWhere([](const Offer&) { return true; }, reason);
}

size_t OfferTable::releaseCache(const CacheEntry* cache, OfferReason reason) {
  return releaseWhere([&](const Offer& o) { return o.state == State::kLive && o.cache.get() == cache; }, reason);
}

template <typename Pred>
size_t OfferTable::releaseWhere(Pred pick, OfferReason reason) {
  size_t n = 0;
  bool finalised = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<uint64_t> ids;
    for (auto& [id, o] : offers_) {
      if (pick(o)) ids.push_back(id);
    }
    for (uint64_t id : ids) {
      finalised = closeLocked(offers_.find(id), reason) || finalised;
      ++n;
    }
  }
  if (finalised) {
    finalized_cv_.notify_all();
    changed();
  }
  return n;
}

template <typename Pick>
void OfferTable::dropEventLocked(Pick pick) {
  auto e = std::find_if(peer_events_.begin(), peer_events_.end(), pick);
  if (e == peer_events_.end()) e = peer_events_.begin();
  if (--peer_share_[e->peer] == 0) peer_share_.erase(e->peer);
  if (--source_share_[e->source] == 0) source_share_.erase(e->source);
  peer_events_.erase(e);
  stats_.events_dropped += 1;
}

void OfferTable::peerAborted(const std::shared_ptr<Link>& link, uint64_t peer, const std::string& source,
                             const std::string& request_id, const std::string& reason) {
  releaseRequest(request_id, OfferReason::kPeerAborted, link);
  std::lock_guard<std::mutex> lock(mu_);
  const size_t max = std::max<size_t>(1, limits_.max_events);
  const size_t share = std::max<size_t>(1, max / 4);
  auto peer_it = peer_share_.find(peer);
  auto source_it = source_share_.find(source);
  if (peer_it != peer_share_.end() && peer_it->second >= share) {
    // This peer's share is full: its oldest event goes (another peer's are untouched).
    dropEventLocked([&](const PeerHandoffEvent& e) { return e.peer == peer; });
  } else if (source_it != source_share_.end() && source_it->second >= share) {
    // Its source's share is full (one process may link as many cluster ids): that source's oldest.
    dropEventLocked([&](const PeerHandoffEvent& e) { return e.source == source; });
  } else if (peer_events_.size() >= max) {
    dropEventLocked([](const PeerHandoffEvent&) { return true; });
  }
  peer_events_.push_back(PeerHandoffEvent{"aborted", peer, request_id, reason, source});
  peer_share_[peer] += 1;
  source_share_[source] += 1;
  AbortKey key{link, request_id};
  if (link && abort_set_.count(key) == 0) rememberAbortLocked(std::move(key), source);
}

void OfferTable::rememberAbortLocked(AbortKey key, const std::string& source) {
  const size_t max = std::max<size_t>(1, limits_.max_events);
  const size_t share = std::max<size_t>(1, max / 4);
  // What goes to make room, as for the events: past the link's share its oldest, past its source's
  // share that source's oldest, past the bound the oldest of all; never another link's because of
  // one link's flood.
  auto forget = [&](auto pick) {
    auto a = std::find_if(aborts_.begin(), aborts_.end(), pick);
    if (a == aborts_.end()) a = aborts_.begin();
    auto l = abort_link_share_.find(a->key.first);
    if (l != abort_link_share_.end() && --l->second == 0) abort_link_share_.erase(l);
    if (--abort_source_share_[a->source] == 0) abort_source_share_.erase(a->source);
    abort_set_.erase(a->key);
    aborts_.erase(a);
  };
  const std::weak_ptr<Link>& link = key.first;
  auto link_it = abort_link_share_.find(link);
  auto source_it = abort_source_share_.find(source);
  if (link_it != abort_link_share_.end() && link_it->second >= share) {
    forget([&](const RememberedAbort& a) { return !LinkLess()(a.key.first, link) && !LinkLess()(link, a.key.first); });
  } else if (source_it != abort_source_share_.end() && source_it->second >= share) {
    forget([&](const RememberedAbort& a) { return a.source == source; });
  } else if (aborts_.size() >= max) {
    forget([](const RememberedAbort&) { return true; });
  }
  abort_link_share_[link] += 1;
  abort_source_share_[source] += 1;
  abort_set_.insert(key);
  aborts_.push_back(RememberedAbort{std::move(key), source});
}

bool OfferTable::abortedBy(const std::shared_ptr<Link>& link, const std::string& request_id) const {
  if (!link) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return abort_set_.count(AbortKey{link, request_id}) != 0;
}

std::vector<ReleasedOffer> OfferTable::takeReleased() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ReleasedOffer> out(std::make_move_iterator(released_.begin()), std::make_move_iterator(released_.end()));
  released_.clear();
  return out;
}

std::vector<PeerHandoffEvent> OfferTable::takePeerEvents() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PeerHandoffEvent> out(std::make_move_iterator(peer_events_.begin()),
                                    std::make_move_iterator(peer_events_.end()));
  peer_events_.clear();
  peer_share_.clear();
  source_share_.clear();
  return out;
}

std::vector<std::pair<uint64_t, OfferReason>> OfferTable::takeFinalized(int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  finalized_cv_.wait_for(lock, std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0)),
                         [this] { return !finalized_.empty() || woken_; });
  woken_ = false;
  std::vector<std::pair<uint64_t, OfferReason>> out(finalized_.begin(), finalized_.end());
  finalized_.clear();
  return out;
}

void OfferTable::wake() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    woken_ = true;
  }
  finalized_cv_.notify_all();
}

OfferStats OfferTable::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

int64_t OfferTable::liveCount() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(offers_.size());
}

void OfferTable::leaseLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (leases_.empty()) {
      lease_cv_.wait(lock);
      continue;
    }
    const auto [deadline, id] = *leases_.begin();
    if (Clock::now() < deadline) {
      lease_cv_.wait_until(lock, deadline);
      continue;
    }
    auto it = offers_.find(id);
    bool finalised = false;
    if (it == offers_.end()) {
      leases_.erase(leases_.begin());
    } else {
      finalised = closeLocked(it, OfferReason::kExpired);
    }
    if (finalised) {
      lock.unlock();
      finalized_cv_.notify_all();
      changed();
      lock.lock();
    }
  }
}

}  // namespace pdlink
