// The cma path (transport/cma/cma_path.h).
#include "transport/cma/cma_path.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "core/limits.h"
#include "core/log.h"
#include "core/spans.h"
#include "transport/cma/cma.h"
#include "transport/frames.h"

namespace pdlink {

namespace {
// Whether every run lies in the table's memory as the server would find it (Registry::resolve:
// the rule of core/spans.h with the server's bound on a request's steps). A request the server
// would refuse is not read directly either: it goes the checked way, which reports the server's
// own error.
bool inRawTable(const wire::RawTable& table, const std::vector<wire::Run>& runs) {
  return spans::covers(table.ranges, runs, limits::kMaxRequestSpanSteps);
}
}  // namespace

CmaPath::CmaPath(std::shared_ptr<const cma::Process> process, uint64_t published_addr)
    : process_(std::move(process)), published_addr_(published_addr) {
  caps_.name = "cma";
  caps_.request_flags = wire::kFlagDirect;
  caps_.one_sided = true;
}

const std::string& CmaPath::encodedBody(const TransferPlan& p, std::string& body) {
  if (body.empty()) body = wire::encode(p.remote);
  return body;
}

Status CmaPath::transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) {
  // Reused per thread (cleared here, kept in capacity): a small read allocates nothing.
  thread_local std::vector<iovec> local, lv, rv;
  local.clear();
  for (uint32_t t : p.local_tensors) {
    for (const wire::Run& r : p.local_runs) {
      local.push_back({reinterpret_cast<void*>(p.local_addrs[t] + r.offset), static_cast<size_t>(r.length)});
    }
  }
  const wire::Target& target = p.remote.target;
  std::string body;  // encoded only when a frame carries it; the cached-read path sends none

  // Fast paths, reads of a blocks cache or of registered memory by address: with the peer's layout
  // (or table) cached, one process_vm_readv and no round trip. The peer's registry generation is
  // read after the data, in the same ordered copy: it only grows, and is bumped before any of the
  // peer's cache memory is released or any index changes, so reading the describe's own generation
  // there proves nothing changed from the describe until after the data was read; otherwise the
  // read is redone the checked way. Any run the cached layout does not hold goes the checked way
  // too, which reports the peer's own error.
  if (!is_push && target.kind == wire::TargetKind::kBlocks) {
    std::optional<Status> done = readCachedBlocks(link, p, local, lv, rv, body, deadline, what);
    if (done) return *done;
  }
  if (!is_push && target.kind == wire::TargetKind::kRaw && p.remote.tensors.size() == 1) {
    std::optional<Status> done = readCachedRaw(link, p, local, lv, rv, body, deadline, what);
    if (done) return *done;
  }
  return checkedAccess(link, p, is_push, local, body, deadline, what);
}

std::optional<Status> CmaPath::readCachedBlocks(Link& link, const TransferPlan& p, const std::vector<iovec>& local,
                                                std::vector<iovec>& lv, std::vector<iovec>& rv, std::string& body,
                                                Deadline deadline, const char* what) {
  const wire::Target& target = p.remote.target;
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto it = descriptors_.find(target.model_id);
    if (it == descriptors_.end()) {
      std::string payload;
      Status st = describe(link, encodedBody(p, body), 0, wire::kMaxDescriptorBytes, deadline, what, &payload);
      if (!st.ok() && link.broken()) return st;
      if (!st.ok()) break;
      wire::CacheDescriptor desc;
      st = wire::decode(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(), &desc);
      if (!st.ok()) return failTransfer(link, st, what);
      it = descriptors_.emplace(target.model_id, std::move(desc)).first;
    }
    const wire::CacheDescriptor& c = it->second;
    bool fits = p.remote.block_size == 0 || p.remote.block_size == c.stride;
    for (uint32_t t : p.remote.tensors) fits = fits && t < c.addrs.size();
    for (const wire::Run& r : p.remote.runs) {
      uint64_t end = 0;
      fits = fits && r.length > 0 && !__builtin_add_overflow(r.offset, r.length, &end) && end <= c.tensor_size;
    }
    if (!fits) break;
    lv.clear();
    rv.clear();
    size_t k = 0;
    for (uint32_t t : p.remote.tensors) {
      for (const wire::Run& r : p.remote.runs) {
        lv.push_back(local[k++]);
        rv.push_back({reinterpret_cast<void*>(c.addrs[t] + r.offset), static_cast<size_t>(r.length)});
      }
    }
    Result<bool> same = readChecked(link, lv, rv, c.generation);
    if (!same.ok() && same.status().code() == Code::kLinkFailed) return failTransfer(link, same.status(), what);
    if (!same.ok()) {  // the role fence refused it
      return Status(same.status().code(),
                    std::string(what) + " " + clusterName(link.peer()) + ": " + same.status().message());
    }
    if (same.value()) return Status::OK();
    descriptors_.erase(it);  // stale or unmapped: the peer's caches changed
  }
  return std::nullopt;
}

std::optional<Status> CmaPath::readCachedRaw(Link& link, const TransferPlan& p, const std::vector<iovec>& local,
                                             std::vector<iovec>& lv, std::vector<iovec>& rv, std::string& body,
                                             Deadline deadline, const char* what) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    const bool cached = raw_table_.has_value();
    if (!cached) {
      std::string payload;
      Status st =
          describe(link, encodedBody(p, body), wire::kFlagDirect, wire::kMaxRawTableBytes, deadline, what, &payload);
      if (!st.ok() && link.broken()) return st;
      if (!st.ok()) break;
      wire::RawTable table;
      st = wire::decode(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(), &table);
      if (!st.ok()) return failTransfer(link, st, what);
      raw_table_ = std::move(table);
    }
    bool fits = inRawTable(*raw_table_, p.remote.runs);
    if (!fits && cached) {  // registered since the table was fetched (adds keep the generation)?
      raw_table_.reset();
      continue;
    }
    if (!fits) break;
    lv.assign(local.begin(), local.end());
    rv.clear();
    for (const wire::Run& r : p.remote.runs) {
      rv.push_back({reinterpret_cast<void*>(r.offset), static_cast<size_t>(r.length)});
    }
    Result<bool> same = readChecked(link, lv, rv, raw_table_->generation);
    if (!same.ok() && same.status().code() == Code::kLinkFailed) return failTransfer(link, same.status(), what);
    if (!same.ok()) {  // the role fence refused it
      return Status(same.status().code(),
                    std::string(what) + " " + clusterName(link.peer()) + ": " + same.status().message());
    }
    if (same.value()) return Status::OK();
    raw_table_.reset();  // the peer's registrations changed
  }
  return std::nullopt;
}

Status CmaPath::checkedAccess(Link& link, TransferPlan& p, bool is_push, std::vector<iovec>& local, std::string& body,
                              Deadline deadline, const char* what) {
  // Checked round trip: the peer validates and pins the target and answers with its addresses.
  // The pin lasts until this side's next frame, or until it expires on the peer: the peer's pin
  // epoch, read again after the copy, tells. A lapsed pin fails the transfer (a read may have
  // seen memory that was freed meanwhile, a write may have landed in it).
  encodedBody(p, body);
  wire::ResponseHeader rh;
  Status st = requestAccess(link, body, is_push, wire::kFlagDirect, deadline, what, &rh);
  if (!st.ok()) return st;
  wire::DirectAnswer answer;
  st = readDirectAnswer(link, rh, local, deadline, &answer);
  if (!st.ok()) return failTransfer(link, st, what);
  std::vector<iovec> remote_iov(local.size());
  for (size_t i = 0; i < local.size(); ++i) {
    remote_iov[i] = {reinterpret_cast<void*>(answer.addrs[i]), local[i].iov_len};
  }
  Status copied = copyPinned(is_push, local, remote_iov, answer);
  // Unpin on the peer; for a completed read by request key this is also the release of the key.
  finishPinned(link, p, copied.ok(), is_push, body, deadline);
  if (!copied.ok()) {
    if (copied.code() == Code::kLinkFailed) return failTransfer(link, copied, what);
    return Status(copied.code(), std::string(what) + " " + clusterName(link.peer()) + ": " + copied.message());
  }
  return Status::OK();
}

Status CmaPath::readDirectAnswer(Link& link, const wire::ResponseHeader& rh, const std::vector<iovec>& local,
                                 Deadline deadline, wire::DirectAnswer* answer) {
  Stream& s = link.out();
  std::string payload;
  Status st;
  if (rh.payload_len != wire::directAnswerBytes(local.size())) {
    st = Status(Code::kLinkFailed, "peer answered a direct access of " + std::to_string(rh.payload_len) +
                                       " bytes, expected " + std::to_string(wire::directAnswerBytes(local.size())));
  } else {
    st = readAnswer(s, rh.payload_len, rh.payload_len, deadline, &payload, "direct-access answer");
    if (st.ok()) {
      st = wire::decode(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(), local.size(), answer);
    }
  }
  for (size_t i = 0; st.ok() && i < local.size(); ++i) {
    if (answer->lengths[i] != local[i].iov_len) {
      st = Status(Code::kLinkFailed, "peer answered a range of the wrong length");
    }
  }
  return st;
}

Status CmaPath::copyPinned(bool is_push, std::vector<iovec>& local, std::vector<iovec>& remote_iov,
                           const wire::DirectAnswer& answer) {
  // The addresses are the peer's, applied to the peer's process (proven by the kernel): at worst
  // they make this side copy the peer's own memory. So is the pin epoch word's, the serving link's.
  const uint64_t pin_epoch_word = answer.epoch_addr;
  uint64_t epoch_after = 0;
  Status copied;
  if (is_push) {
    copied = process_->copy(true, local, remote_iov);
    if (copied.ok()) {
      auto epoch = process_->readWord(pin_epoch_word);
      copied = epoch.status();
      if (epoch.ok()) epoch_after = epoch.value();
    }
  } else {  // the epoch word is read after the data (in the same ordered read where one thread copies)
    auto epoch = process_->readThenWord(local, remote_iov, pin_epoch_word);
    copied = epoch.status();
    if (epoch.ok()) epoch_after = epoch.value();
  }
  if (copied.ok() && epoch_after != answer.pin_epoch) {
    copied = Status(Code::kFailed, "the peer released its pin before the copy finished (pin expired); retry");
  }
  return copied;
}

Status CmaPath::describe(Link& link, const std::string& body, uint8_t flags, uint64_t max_bytes, Deadline deadline,
                         const char* what, std::string* payload) {
  wire::ResponseHeader rh;
  Status st = request(link, wire::RequestHeader{wire::Op::kDescribe, static_cast<uint32_t>(body.size()), 0, flags},
                      body, deadline, what, &rh);
  if (!st.ok()) return st;
  st = readAnswer(link.out(), rh.payload_len, max_bytes, deadline, payload, "describe answer");
  return st.ok() ? st : failTransfer(link, st, what);
}

namespace {
// A failed role fence: its refusal, or a lost link; an unreadable word (not kLinkFailed) sends the read
// the checked way, as an unreadable generation does.
Result<bool> fenceFailed(const Status& st) {
  const Code c = st.code();
  if (c == Code::kRoleSwitching || c == Code::kStaleEpoch || c == Code::kLinkFailed) return st;
  return false;
}
}  // namespace

Status CmaPath::roleFence(Link& link, bool after) {
  Result<uint64_t> word = process_->readWord(published_addr_ + kRoleWordOffset);
  if (!word.ok()) return word.status();
  const uint64_t epoch = word.value() >> 1;
  const uint32_t tag = wire::epochTagOf(epoch), fence = link.epochTags().send.load(std::memory_order_relaxed);
  const char* when = after ? " (after the copy: only the destination changed)" : "";
  if (word.value() & 1) {
    return Status(Code::kRoleSwitching, std::string("the peer is switching its role; retry once it is ready") + when);
  }
  if (fence != 0 && fence != tag) {
    return Status(Code::kStaleEpoch, "the transfer was prepared against role epoch tag " + std::to_string(fence) +
                                         ", but the peer is at tag " + std::to_string(tag) + ": prepare it again" +
                                         when);
  }
  if (after) link.epochTags().seen.store(tag, std::memory_order_relaxed);
  return Status::OK();
}

Result<bool> CmaPath::readChecked(Link& link, std::vector<iovec>& local, std::vector<iovec>& remote,
                                  uint64_t generation) {
  // The role fence first: a refused read copies nothing.
  if (Status fenced = roleFence(link, false); !fenced.ok()) return fenceFailed(fenced);
  // A stale cached layout must not land a byte: the caller then fails (or redoes) the read, and a
  // refused read moves nothing. Small reads land in a per-thread bounce buffer first and reach the
  // destination only once the generation read after them matches; larger ones read the generation
  // before the data too, so only a deregistration racing the copy itself can land bytes of a read
  // that then fails (docs/native_api.md, "Memory"). Either way the generation is read strictly
  // after the data (cma::readThenWord), so an OK read held registered bytes throughout.
  size_t total = 0;
  for (const iovec& v : local) total += v.iov_len;
  const bool bounce = total <= kBounceBytes;
  if (!bounce) {
    Result<uint64_t> before = process_->readWord(published_addr_);
    if (!before.ok()) return before.status().code() == Code::kLinkFailed ? Result<bool>(before.status()) : false;
    if (before.value() != generation) return false;
  }
  thread_local std::vector<uint8_t> buffer;
  thread_local std::vector<iovec> staged;
  if (bounce) {
    if (buffer.size() < total) buffer.resize(kBounceBytes);
    staged.clear();
    size_t at = 0;
    for (const iovec& v : local) {
      staged.push_back({buffer.data() + at, v.iov_len});
      at += v.iov_len;
    }
  }
  Result<uint64_t> g = process_->readThenWord(bounce ? staged : local, remote, published_addr_);
  if (!g.ok() && g.status().code() == Code::kLinkFailed) return g.status();
  if (!g.ok() || g.value() != generation) return false;  // an unmapped range (EFAULT) counts as changed
  // And after the data and the generation: a switch that began meanwhile fails the read (a bounced
  // one before any byte of it lands).
  if (Status fenced = roleFence(link, true); !fenced.ok()) return fenceFailed(fenced);
  if (bounce) {
    size_t at = 0;
    for (const iovec& v : local) {
      std::memcpy(v.iov_base, buffer.data() + at, v.iov_len);
      at += v.iov_len;
    }
  }
  return true;
}

Status CmaServer::serve(ServeCall& call) {
  // Checked like any access; answer where the bytes are and keep them alive until the next frame
  // (the pin epoch lets the requester detect a pin that lapsed meanwhile).
  wire::DirectAnswer answer;
  answer.pin_epoch = call.pin_epoch->load(std::memory_order_acquire);
  answer.epoch_addr = reinterpret_cast<uint64_t>(call.pin_epoch);
  for (const Segment& piece : pieces(call.addrs, call.tensors, call.base, call.runs)) {  // bounded: kMaxRequestPieces
    answer.addrs.push_back(piece.addr);
    answer.lengths.push_back(piece.length);
  }
  call.pin = true;
  return sendAnswer(call.stream, wire::encode(answer), call.deadline);
}

PathEntry cmaEntry() {
  PathEntry e;
  e.caps = CmaPath(nullptr, 0).caps();
  e.server = std::make_unique<CmaServer>();
  e.applies = [](const LinkFacts& f) { return f.direct != nullptr; };
  e.make = [](const LinkFacts& f) -> std::unique_ptr<DataPath> {
    return std::make_unique<CmaPath>(f.direct, f.published_addr);
  };
  return e;
}

std::shared_ptr<void> cmaGrant(pid_t peer_pid) {
  if (peer_pid == 0 || peer_pid == ::getpid()) return nullptr;
  return cma::Grant::acquire();
}

Status cmaProbe(const Socket& channel, pid_t peer_pid, uid_t peer_uid, uint64_t published_addr, bool allowed,
                bool forced, std::shared_ptr<const cma::Process>* process) {
  process->reset();
  if (!allowed) return Status::OK();
  if (peer_pid == 0) {
    if (forced) {
      return Status(Code::kLinkFailed, "transport 'cma' was forced but the peer is not on this host or refuses it");
    }
    return Status::OK();
  }
  // A proven same-host peer: copy directly if its process can be held for the life of the link
  // (cma::Process) and this process may read it (Yama, same user). The probe reads the peer's
  // published words, in the process the kernel named, never a claimed one.
  auto opened = cma::Process::open(channel.fd(), peer_pid, peer_uid);
  Result<uint64_t> word = opened.ok() ? opened.value()->readWord(published_addr) : Result<uint64_t>(opened.status());
  if (word.ok()) {
    PDLINK_LOG(kDebug, "same-host peer pid " << peer_pid << ": direct copies by " << opened.value()->modeName());
    *process = std::move(opened.value());
    return Status::OK();
  }
  if (forced) return word.status();
  PDLINK_LOG(kInfo, "same-host peer pid " << peer_pid << ": " << word.status().message() << "; streaming");
  return Status::OK();
}

}  // namespace pdlink
