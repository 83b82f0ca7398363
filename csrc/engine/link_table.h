// LinkTable: an engine's links, per peer cluster id (llm_datadist's "link entities").
//
// For each peer the table holds the link this side dialled and the link it accepted, at most one
// of each, so two engines may link to each other at the same time (and a one-way transfer
// backend can keep one link per direction), plus, once its links died, a tombstone: what callers
// still see of a dead link (LLMDataDist.links(), switch_role's LLM_EXIST_LINK) until they unlink
// it. A tombstone holds no socket and no thread; a link whose channels died is turned into one by
// its serving thread as that thread ends (RequestServer::serve), so its descriptors close as soon as no
// transfer holds it any more. Tombstones are bounded: past the bound the oldest is forgotten.
//
// Symmetric use (CacheManager mode): a request takes the dialled link when it is usable, else the
// accepted one. A new accepted link never displaces the dialled one.
// One-way use (setOneWay): only the dialled link is this side's; an accepted link is the peer's,
// served here but never used for requests, and leaves no tombstone when it dies.
// Threading: not thread-safe; the engine uses it under its mutex only.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "transport/link.h"

namespace pdlink {

class LinkTable {
 public:
  void setOneWay(bool one_way) { one_way_ = one_way; }
  // Links that are not tombstones (broken ones included until their serving thread retires them).
  size_t live() const;
  // Live accepted links from one source (Link::source).
  size_t acceptedFrom(const std::string& source) const;
  size_t tombstones() const;
  bool empty() const { return entries_.empty(); }
  // Whether anything (a link or a tombstone) is held for `peer`.
  bool has(uint64_t peer) const { return entries_.count(peer) != 0; }

  // The link for this side's requests to `peer`: the dialled one if it is not broken, else the
  // accepted one if that is not; nullptr otherwise.
  std::shared_ptr<Link> forRequests(uint64_t peer) const;
  // The link in one slot (dialled or accepted), whatever its state.
  std::shared_ptr<Link> slot(uint64_t peer, bool dialled) const;
  // Why `peer` has no usable link though the table holds something for it (the reason its link
  // broke); nullopt when it holds nothing.
  std::optional<std::string> downReason(uint64_t peer) const;

  // Puts `link` in its slot (by link->initiator()) and drops the peer's tombstone. Returns what the
  // slot held before (the caller breaks it), or nullptr.
  std::shared_ptr<Link> install(std::shared_ptr<Link> link);
  // `link`'s channels died: if it still holds its slot, a tombstone takes its place (forgetting the
  // oldest tombstone past `max_tombstones`).
  void retire(const std::shared_ptr<Link>& link, size_t max_tombstones);
  // Forgets `link` if it still holds its slot (the peer unlinked it), leaving no tombstone.
  void forget(const std::shared_ptr<Link>& link);
  // Removes everything held for `peer` (one-way: only this side's own link and tombstone) and
  // returns its links (to notify and break). `had` tells whether anything was removed.
  std::vector<std::shared_ptr<Link>> remove(uint64_t peer, bool* had);
  std::vector<std::shared_ptr<Link>> removeAll();

  std::vector<LinkInfo> infos() const;
  // What this side holds as its own link entities (one-way: the dialled links and their
  // tombstones; symmetric: everything), for the already-linked check.
  std::vector<LinkInfo> ownInfos() const;
  std::vector<uint64_t> peers() const;

 private:
  struct Tombstone {
    LinkInfo info;
    uint64_t seq;
  };
  struct Entry {
    std::shared_ptr<Link> dialled, accepted;
    std::optional<Tombstone> tombstone;
    bool holdsNothing() const { return !dialled && !accepted && !tombstone; }
  };
  std::map<uint64_t, Entry> entries_;
  bool one_way_ = false;
  uint64_t seq_ = 0;
};

}  // namespace pdlink
