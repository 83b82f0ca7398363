// What every data path's requesting side shares (declared in transport/path.h).
#include "transport/path.h"

#include "transport/frames.h"

namespace pdlink {

std::string clusterName(uint64_t id) { return "cluster " + std::to_string(id); }

bool usesKeyCommit(wire::TargetKind kind) {
  // kOffer: the commit releases the offer (claimed), on every path, after every byte landed.
  return kind == wire::TargetKind::kRequestKey || kind == wire::TargetKind::kIdIndex ||
         kind == wire::TargetKind::kOffer;
}

Status failTransfer(Link& link, const Status& st, const char* what) {
  link.breakLink(st.message());
  Code code = st.code() == Code::kTimeout ? Code::kTimeout : Code::kLinkFailed;
  return Status(code, std::string(what) + " " + clusterName(link.peer()) + " failed: " + st.message() +
                          "; the link is now unusable: disconnect, then connect again");
}

Status awaitResponse(Link& link, Deadline deadline, const char* what, wire::ResponseHeader* rh) {
  link.setStage(TransferStage::kServed);
  Status remote;
  Status st = readResponse(link.out(), deadline, rh, &remote);
  if (!st.ok()) return failTransfer(link, st, what);
  link.epochTags().seen.store(rh->epoch_tag, std::memory_order_relaxed);
  if (remote.ok()) link.setStage(TransferStage::kPayload);  // what follows an answer is the payload's
  if (!remote.ok()) {                                       // the peer refused this request; the link itself is fine
    // A refusal for the peer's own engine (out of memory, finalised) concerns that peer, not this engine.
    Scope scope = remote.scope() == Scope::kEngine ? Scope::kLink : remote.scope();
    return Status(remote.code(), scope, std::string(what) + " " + clusterName(link.peer()) + ": " + remote.message());
  }
  return Status::OK();
}

uint32_t fenceTag(Link& link, wire::Op op) {
  const bool fenced = op == wire::Op::kRead || op == wire::Op::kWrite || op == wire::Op::kDescribe;
  return fenced ? link.epochTags().send.load(std::memory_order_relaxed) : 0;
}

Status request(Link& link, const wire::RequestHeader& header, const std::string& body, Deadline deadline,
               const char* what, wire::ResponseHeader* rh) {
  wire::RequestHeader h = header;
  h.epoch_tag = fenceTag(link, h.op);
  std::string head = wire::encode(h);
  std::vector<iovec> iov{{head.data(), head.size()}, {const_cast<char*>(body.data()), body.size()}};
  link.setStage(TransferStage::kRequest);
  Status st = link.out().sendFrame(iov, deadline);
  if (!st.ok()) return failTransfer(link, st, what);
  return awaitResponse(link, deadline, what, rh);
}

Status requestAccess(Link& link, const std::string& body, bool is_push, uint8_t flags, Deadline deadline,
                     const char* what, wire::ResponseHeader* rh) {
  wire::RequestHeader h{is_push ? wire::Op::kWrite : wire::Op::kRead, static_cast<uint32_t>(body.size()), 0, flags};
  return request(link, h, body, deadline, what, rh);
}

void finishAccess(Link& link, wire::Op op, const std::string& body, Deadline deadline) {
  std::string head = wire::encode(wire::RequestHeader{op, static_cast<uint32_t>(body.size()), 0});
  std::vector<iovec> iov{{head.data(), head.size()}, {const_cast<char*>(body.data()), body.size()}};
  if (!link.out().sendFrame(iov, deadline).ok()) link.breakLink("could not confirm a completed transfer to the peer");
}

bool commitsNow(const TransferPlan& p) {
  // The transfer's outcome is settled here: a cancel that came first keeps the source (no commit).
  return usesKeyCommit(p.remote.target.kind) && p.commit && (p.cancel == nullptr || p.cancel->finish());
}

void commitPull(Link& link, const TransferPlan& p, const std::string& body, Deadline deadline) {
  link.setStage(TransferStage::kCommit);
  if (commitsNow(p)) finishAccess(link, wire::Op::kCommit, body, deadline);
}

void finishPinned(Link& link, const TransferPlan& p, bool completed, bool is_push, const std::string& body,
                  Deadline deadline) {
  if (completed) link.setStage(TransferStage::kCommit);  // a failed copy stays the payload's
  const bool commit = completed && !is_push && commitsNow(p);
  finishAccess(link, commit ? wire::Op::kCommit : wire::Op::kRelease, body, deadline);
}

std::vector<Segment> pieces(const std::vector<uint64_t>& addrs, const std::vector<uint32_t>& tensors, uint64_t base,
                            const std::vector<wire::Run>& runs) {
  std::vector<Segment> out;
  out.reserve(tensors.size() * runs.size());  // bounded by the caller: limits::kMaxRequestPieces
  for (uint32_t t : tensors) {
    for (const wire::Run& r : runs) out.push_back({addrs[t] + base + r.offset, r.length});
  }
  return out;
}

}  // namespace pdlink
