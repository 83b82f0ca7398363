// OfferTable: the prefill side's KV handoffs (pdlink.Engine.offer / claim / abort / hold;
// docs/native_api.md, "Handoffs"; docs/architecture.md, "Handoffs").
//
// An offer retains blocks of one registered blocks cache (with a key) for one request id until a
// decoder has claimed them, or the offer is released otherwise; from its release on, the blocks may
// be reused, and nothing of the offer is ever served again.
//
// Contract:
//  * Identity: an offer id is a never-reused u64 sequence (from 1); its generation is the id mixed
//    with a random 64-bit salt drawn when the table is made, so a ticket from an earlier engine
//    incarnation, or a guessed id, does not match (a read naming it is refused as an unknown offer).
//  * States: live -> closing -> released. Any release (claimed, expired, aborted, peer_aborted,
//    link_down, released) marks the offer closing: from then every new read of it is refused
//    (kOfferReleased, nothing moved). It is finalised (removed, its release event queued, the
//    dispatcher told, the cache reference dropped) once `serving`, the reads of it being served, is 0.
//    So `released` (what the application reads) means: no byte of these blocks is read for this
//    offer any more; the first reason wins.
//  * The serving check (admitRead): a read names kOffer (model_id = the cache's key, req_id = the
//    id, prefix_id = the generation); it is admitted only while the offer is live, the generation
//    and key match, the link is its bound link (the first admitted read, or a hold, binds an unbound
//    offer to its link, by the Link's identity, not the cluster id), the tensors exist and every run
//    lies inside the offer's blocks (O(runs x log blocks): a run's first and last block, and that
//    the blocks between are all offered, by position in the sorted list). An admitted read holds a
//    Guard: one count of `serving`, until the guard goes (its response sent; on pinned paths, the
//    pin's end). A read admitted also extends the lease, as a hold does.
//  * Leases: each offer has a deadline (offer time + lease_ms, extended by each hold or admitted
//    read); one lazily started thread waits on a condition variable for the earliest deadline and
//    releases what passed it (reason expired). No thread per offer.
//  * Link death: linkEnded releases every offer bound to that link (link_down); the serving thread
//    calls it when the link's serving ends.
//  * Bounds (OfferLimits, from EngineLimits): max_offers offers live, closing, or finalised and not
//    yet taken by the dispatcher (offer() past it: kOutOfMemory, nothing retained); a lease at most
//    max_lease_ms; max_events entries in each event queue (released offers; what peers told): the
//    oldest is dropped and counted when one is full. What peers told has two shares of a quarter
//    each, so neither one peer (a cluster id, which a peer picks) nor the links of one source (where
//    they come from, as for notifications: LinkManager::sourceOf, a dialled link its own source;
//    detail::shareSource) can fill it: past its peer's share an event drops that peer's oldest, past
//    its source's share that source's oldest. As many (link, request id) aborts remembered for claims,
//    with the same two shares (a link for a peer): a stranger's flood forgets only its own.
// Threading: every method is thread-safe under one mutex (a leaf: nothing is called out of the table
// with it held but the `on_change` hook, which is called without it).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/status.h"
#include "engine/registry.h"
#include "transport/wire.h"

namespace pdlink {

class Link;

// Why an offer was released (HandoffEvent.reason in Python).
enum class OfferReason : uint8_t {
  kNone = 0,
  kClaimed = 1,      // its bound link committed it: the bound decoder said it is done
  kExpired = 2,      // its lease passed
  kAborted = 3,      // this engine's abort(request_id)
  kPeerAborted = 4,  // a peer's abort of its request id
  kLinkDown = 5,     // the link it was bound to ended
  kReleased = 6,     // the application released it (or the engine closed)
};
const char* offerReasonName(OfferReason reason);  // "claimed", ...; "" for kNone

struct OfferLimits {
  uint32_t max_offers = 65536;
  int64_t max_lease_ms = 3600000;
  int64_t default_lease_ms = 60000;
  uint32_t max_events = 4096;
};

struct OfferTicket {
  uint64_t id = 0;
  uint64_t generation = 0;
  int64_t lease_ms = 0;
};

// A released offer (Engine::takeReleased): `peer` is the cluster id of the link it was bound to (0:
// none).
struct ReleasedOffer {
  uint64_t offer_id = 0;
  std::string request_id;
  OfferReason reason = OfferReason::kNone;
  bool bound = false;  // it was bound to a link, of cluster `peer` (any id a peer linked as, 0 included)
  uint64_t peer = 0;
};

// What a peer told this engine (Engine::takeHandoffEvents): kind "aborted".
struct PeerHandoffEvent {
  std::string kind;
  uint64_t peer = 0;
  std::string request_id;
  std::string reason;
  std::string source;  // the share it counts against (detail::shareSource of its link)
};

struct OfferStats {
  uint64_t live = 0;      // offers not finalised (live or closing)
  uint64_t released = 0;  // finalised, every reason
  uint64_t expired = 0;
  uint64_t aborted = 0;  // aborted here or by a peer
  uint64_t bytes = 0;    // bytes the live offers retain (blocks x block bytes x tensors)
  uint64_t events_dropped = 0;
};

class OfferTable {
 public:
  // `on_change`: called (without the table's lock) after the count of live offers fell (a role
  // switch's drain waits for it).
  explicit OfferTable(std::function<void()> on_change);
  ~OfferTable();
  OfferTable(const OfferTable&) = delete;
  OfferTable& operator=(const OfferTable&) = delete;

  void configure(const OfferLimits& limits);

  // Retains `blocks` (indices of `cache`'s blocks; sorted and deduplicated here) for `request_id`
  // (at most limits::kMaxHandoffRequestIdBytes bytes). lease_ms <= 0: the default lease.
  // kParamInvalid: no blocks, a block out of range, a lease past max_lease_ms, a cache without a
  // key, a request id too long; kOutOfMemory: max_offers reached.
  Result<OfferTicket> offer(std::shared_ptr<CacheEntry> cache, std::vector<int64_t> blocks, std::string request_id,
                            int64_t lease_ms);

  // One read of an offer being served (a count of its `serving`); move-only.
  class Guard {
   public:
    Guard() = default;
    Guard(OfferTable* t, uint64_t id) : t_(t), id_(id) {}
    Guard(Guard&& o) noexcept : t_(o.t_), id_(o.id_) { o.t_ = nullptr; }
    Guard& operator=(Guard&& o) noexcept {
      if (this != &o) {
        reset();
        t_ = o.t_;
        id_ = o.id_;
        o.t_ = nullptr;
      }
      return *this;
    }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
    ~Guard() { reset(); }
    void reset();
    explicit operator bool() const { return t_ != nullptr; }

   private:
    OfferTable* t_ = nullptr;
    uint64_t id_ = 0;
  };

  // The serving check of a read of a kOffer target on `link` (contract above). OK: *guard holds the
  // read, *resolved what it addresses (the offer's cache, offsets from its tensors' starts).
  // kOfferReleased (the message says why), or kParamInvalid for a run or tensor out of the cache.
  Status admitRead(const wire::TransferBody& body, const std::shared_ptr<Link>& link, uint64_t peer, Guard* guard,
                   Resolved* resolved);
  // A kCommit through a kOffer target from `link`: releases the offer (claimed) when it is live, the
  // generation and key (model_id) match, as for a read, and `link` is its bound link; otherwise
  // nothing.
  void commit(const wire::Target& target, const std::shared_ptr<Link>& link);
  // The application gives the offer up (reason kReleased, or the one given). A no-op once released.
  void release(uint64_t id, OfferReason reason = OfferReason::kReleased);
  // Releases the live offers of `request_id`: all of them (from_link null: this engine's abort),
  // or those not bound to another link than `from_link` (a peer's abort). Returns how many.
  size_t releaseRequest(const std::string& request_id, OfferReason reason, const std::shared_ptr<Link>& from_link);
  // A hold from `link`: each (id, generation) that is live and unbound or bound to `link` is bound to
  // it and its lease extended by its lease_ms; the rest are ignored. Returns how many were held.
  size_t hold(const std::shared_ptr<Link>& link, uint64_t peer,
              const std::vector<std::pair<uint64_t, uint64_t>>& offers);
  // The link's serving ended: its offers are released (link_down).
  void linkEnded(const std::shared_ptr<Link>& link);
  // Releases every offer (finalize); their events are queued as any release's.
  void releaseAll(OfferReason reason);
  // Releases the live offers of `cache` (its region is being deregistered); returns how many.
  size_t releaseCache(const CacheEntry* cache, OfferReason reason);

  // A peer's abort of `request_id` arrived on `link` (from cluster `peer`, its links' share
  // `source`): its offers are released (peer_aborted, releaseRequest's rule), an event queued
  // (within the peer's and the source's shares), and the abort remembered for claims over `link`.
  void peerAborted(const std::shared_ptr<Link>& link, uint64_t peer, const std::string& source,
                   const std::string& request_id, const std::string& reason);
  // Whether an abort of `request_id` arrived on `link` (among the latest max_events ones): by the
  // link's identity, so an abort from another link under the same cluster id (a stranger claiming
  // it) fails no claim over `link`. False for a null link.
  bool abortedBy(const std::shared_ptr<Link>& link, const std::string& request_id) const;

  std::vector<ReleasedOffer> takeReleased();
  std::vector<PeerHandoffEvent> takePeerEvents();
  // The offers finalised since the last call, oldest first, as (id, reason): waits up to
  // `timeout_ms` for one (the dispatcher of pdlink.Engine's callbacks). wake() ends a wait at once.
  std::vector<std::pair<uint64_t, OfferReason>> takeFinalized(int64_t timeout_ms);
  void wake();
  OfferStats stats() const;
  int64_t liveCount() const;

 private:
  enum class State : uint8_t { kLive, kClosing };
  struct Offer {
    uint64_t generation = 0;
    std::string request_id;
    std::shared_ptr<CacheEntry> cache;
    std::vector<uint64_t> blocks;  // sorted, unique
    uint64_t stride = 0;
    uint64_t bytes = 0;
    int64_t lease_ms = 0;
    std::chrono::steady_clock::time_point deadline;
    std::weak_ptr<Link> link;  // the bound link (identity by its control block)
    bool bound = false;
    uint64_t peer = 0;
    State state = State::kLive;
    OfferReason reason = OfferReason::kNone;
    int64_t serving = 0;
  };
  using Clock = std::chrono::steady_clock;

  uint64_t generationOf(uint64_t id) const;
  static bool sameLink(const std::weak_ptr<Link>& bound, const std::shared_ptr<Link>& link);
  // Under mu_: marks `it` closing with `reason` (first reason wins) and finalises it when nothing
  // serves it. Returns true when a live offer was finalised (on_change is due).
  bool closeLocked(std::unordered_map<uint64_t, Offer>::iterator it, OfferReason reason);
  void finaliseLocked(std::unordered_map<uint64_t, Offer>::iterator it);
  // Closes every offer `pick` selects with `reason` (closeLocked, under mu_; then the waiters and
  // on_change, without it); returns how many it selected.
  template <typename Pred>
  size_t releaseWhere(Pred pick, OfferReason reason);
  void extendLocked(uint64_t id, Offer& o);
  void leaseLoop();
  void changed();

  std::function<void()> on_change_;
  const uint64_t salt_;
  mutable std::mutex mu_;
  std::condition_variable lease_cv_;      // the lease thread's (deadlines changed, stop)
  std::condition_variable finalized_cv_;  // takeFinalized's
  OfferLimits limits_;
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, Offer> offers_;               // live and closing
  std::set<std::pair<Clock::time_point, uint64_t>> leases_;  // deadlines of live offers
  std::deque<std::pair<uint64_t, OfferReason>> finalized_;   // for the dispatcher
  std::deque<ReleasedOffer> released_;
  std::deque<PeerHandoffEvent> peer_events_;
  std::map<uint64_t, size_t> peer_share_;       // events of one peer in peer_events_
  std::map<std::string, size_t> source_share_;  // events of one source in peer_events_
  // Remembered aborts, by the identity of the link they arrived on (owner order of its control
  // block, which an expired weak_ptr keeps, so a later link never matches), oldest first, with
  // each link's and each source's count in aborts_ (their shares).
  using AbortKey = std::pair<std::weak_ptr<Link>, std::string>;
  struct AbortLess {
    bool operator()(const AbortKey& a, const AbortKey& b) const {
      if (a.first.owner_before(b.first)) return true;
      if (b.first.owner_before(a.first)) return false;
      return a.second < b.second;
    }
  };
  struct LinkLess {
    bool operator()(const std::weak_ptr<Link>& a, const std::weak_ptr<Link>& b) const { return a.owner_before(b); }
  };
  struct RememberedAbort {
    AbortKey key;
    std::string source;
  };
  std::deque<RememberedAbort> aborts_;
  std::set<AbortKey, AbortLess> abort_set_;
  std::map<std::weak_ptr<Link>, size_t, LinkLess> abort_link_share_;
  std::map<std::string, size_t> abort_source_share_;
  // Under mu_: remembers `key` from `source` (not yet remembered), within the shares.
  void rememberAbortLocked(AbortKey key, const std::string& source);
  // Under mu_: drops the oldest event `pick` selects (the first, when none matches) and counts it.
  template <typename Pick>
  void dropEventLocked(Pick pick);
  OfferStats stats_;
  bool woken_ = false;
  bool stop_ = false;
  std::thread lease_thread_;  // started by the first offer
};

}  // namespace pdlink
