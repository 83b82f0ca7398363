#include "engine/link_table.h"

#include <algorithm>

namespace pdlink {

namespace {
LinkInfo infoOf(const Link& l) {
  return LinkInfo{l.peer(),      l.peerAddress(),   l.initiator(),        l.broken(),          l.brokenReason(),
                  l.transport(), l.authenticated(), l.payloadIntegrity(), l.devicePathNames(), l.lanes(),
                  l.confirmed()};
}
}  // namespace

size_t LinkTable::live() const {
  size_t n = 0;
  for (const auto& [peer, e] : entries_) n += (e.dialled ? 1 : 0) + (e.accepted ? 1 : 0);
  return n;
}

size_t LinkTable::acceptedFrom(const std::string& source) const {
  size_t n = 0;
  for (const auto& [peer, e] : entries_) n += e.accepted && e.accepted->source() == source ? 1 : 0;
  return n;
}

size_t LinkTable::tombstones() const {
  size_t n = 0;
  for (const auto& [peer, e] : entries_) n += e.tombstone ? 1 : 0;
  return n;
}

std::shared_ptr<Link> LinkTable::forRequests(uint64_t peer) const {
  auto it = entries_.find(peer);
  if (it == entries_.end()) return nullptr;
  for (const auto& l : {it->second.dialled, one_way_ ? nullptr : it->second.accepted}) {
    if (l && !l->broken()) return l;
  }
  return nullptr;
}

std::shared_ptr<Link> LinkTable::slot(uint64_t peer, bool dialled) const {
  auto it = entries_.find(peer);
  if (it == entries_.end()) return nullptr;
  return dialled ? it->second.dialled : it->second.accepted;
}

std::optional<std::string> LinkTable::downReason(uint64_t peer) const {
  auto it = entries_.find(peer);
  if (it == entries_.end()) return std::nullopt;
  if (one_way_ && !it->second.dialled && !it->second.tombstone) return std::nullopt;  // only the peer's link
  for (const auto& l : {it->second.dialled, one_way_ ? nullptr : it->second.accepted}) {
    if (l) return l->brokenReason();
  }
  return it->second.tombstone ? it->second.tombstone->info.broken_reason : std::string();
}

std::shared_ptr<Link> LinkTable::install(std::shared_ptr<Link> link) {
  Entry& e = entries_[link->peer()];
  std::shared_ptr<Link>& slot = link->initiator() ? e.dialled : e.accepted;
  std::shared_ptr<Link> old = std::move(slot);
  slot = std::move(link);
  e.tombstone.reset();
  return old;
}

void LinkTable::retire(const std::shared_ptr<Link>& link, size_t max_tombstones) {
  auto it = entries_.find(link->peer());
  if (it == entries_.end()) return;
  Entry& e = it->second;
  std::shared_ptr<Link>& slot = link->initiator() ? e.dialled : e.accepted;
  if (slot != link) return;              // replaced or unlinked meanwhile
  if (one_way_ && !link->initiator()) {  // the peer's link: nothing of it stays here
    forget(link);
    return;
  }
  e.tombstone = Tombstone{infoOf(*link), ++seq_};
  e.tombstone->info.broken = true;
  slot.reset();
  while (tombstones() > max_tombstones) {  // forget the oldest
    auto oldest = entries_.end();
    for (auto jt = entries_.begin(); jt != entries_.end(); ++jt) {
      if (jt->second.tombstone &&
          (oldest == entries_.end() || jt->second.tombstone->seq < oldest->second.tombstone->seq)) {
        oldest = jt;
      }
    }
    oldest->second.tombstone.reset();
    if (oldest->second.holdsNothing()) entries_.erase(oldest);
  }
}

void LinkTable::forget(const std::shared_ptr<Link>& link) {
  auto it = entries_.find(link->peer());
  if (it == entries_.end()) return;
  std::shared_ptr<Link>& slot = link->initiator() ? it->second.dialled : it->second.accepted;
  if (slot != link) return;
  slot.reset();
  if (it->second.holdsNothing()) entries_.erase(it);
}

std::vector<std::shared_ptr<Link>> LinkTable::remove(uint64_t peer, bool* had) {
  std::vector<std::shared_ptr<Link>> out;
  auto it = entries_.find(peer);
  *had = false;
  if (it == entries_.end()) return out;
  Entry& e = it->second;
  if (one_way_) {
    *had = e.dialled || e.tombstone;
    if (e.dialled) out.push_back(std::move(e.dialled));
    e.dialled.reset();
    e.tombstone.reset();
    if (e.holdsNothing()) entries_.erase(it);
    return out;
  }
  *had = true;
  for (auto& l : {e.dialled, e.accepted}) {
    if (l) out.push_back(l);
  }
  entries_.erase(it);
  return out;
}

std::vector<std::shared_ptr<Link>> LinkTable::removeAll() {
  std::vector<std::shared_ptr<Link>> out;
  for (auto& [peer, e] : entries_) {
    for (auto& l : {e.dialled, e.accepted}) {
      if (l) out.push_back(l);
    }
  }
  entries_.clear();
  return out;
}

std::vector<LinkInfo> LinkTable::infos() const {
  std::vector<LinkInfo> out;
  for (const auto& [peer, e] : entries_) {
    if (e.dialled) out.push_back(infoOf(*e.dialled));
    if (e.accepted) out.push_back(infoOf(*e.accepted));
    // A dead link still shows while nothing replaced it (one-way: while this side has no link of
    // its own; the peer's accepted one is not a replacement).
    if (e.tombstone && !e.dialled && (one_way_ || !e.accepted)) out.push_back(e.tombstone->info);
  }
  return out;
}

std::vector<LinkInfo> LinkTable::ownInfos() const {
  if (!one_way_) return infos();
  std::vector<LinkInfo> out;
  for (const auto& [peer, e] : entries_) {
    if (e.dialled) {
      out.push_back(infoOf(*e.dialled));
    } else if (e.tombstone) {  // one-way tombstones are of dialled links only
      out.push_back(e.tombstone->info);
    }
  }
  return out;
}

std::vector<uint64_t> LinkTable::peers() const {
  std::vector<uint64_t> out;
  for (const auto& [peer, e] : entries_) out.push_back(peer);
  return out;
}

}  // namespace pdlink
