// The data path: serving a peer's requests, and pulls and pushes over TCP or direct memory access.
#include "engine/engine.h"

#include <algorithm>
#include <cstring>

#include "core/limits.h"
#include "core/log.h"
#include "core/seeded_bug.h"
#include "engine/engine_internal.h"
#include "transport/cma.h"

namespace pdlink {

using namespace detail;  // NOLINT: this file is part of the engine

// ---------------------------------------------------------------- serving

void Engine::serve(const std::shared_ptr<Link>& link) {
  ServeState state;
  Status st = serveStream(link, link->in(), &state);
  for (const std::string& key : state.exported) backend_->closeExport(key);
  if (!state.unlinked) {
    std::string why = st.message().find("closed by peer") != std::string::npos ? "peer closed the connection"
                                                                                : st.message();
    if (!link->broken()) PDLINK_LOG(kInfo, "link to " << clusterName(link->peer()) << " is down: " << why);
    link->breakLink(why);
  }
  // The link's channels are dead: leave a tombstone in its place, so its sockets close as soon as
  // no transfer holds the link any more, and this thread ends.
  std::lock_guard<std::mutex> lock(mu_);
  links_.retire(link, config_.limits.max_links);
}

Status Engine::serveStream(const std::shared_ptr<Link>& link, Stream& in, ServeState* state) {
  Status st;
  while (st.ok() && !state->unlinked) {
    // Nothing a peer sends may take the process down: whatever escapes a frame drops this link.
    try {
      st = serveOne(link, in, state);
    } catch (const std::exception& e) {
      st = Status(Code::kFailed, std::string("serving a request failed: ") + e.what());
      PDLINK_LOG(kWarn, "dropping link to " << clusterName(link->peer()) << ": " << st.message());
    }
  }
  return st;
}

Status Engine::admitHeader(const Link& link, const wire::RequestHeader& h) const {
  // Only reads and writes take flags or a payload; which flags depends on what this link and this
  // engine negotiated. A frame outside that is a protocol violation: the link is dropped.
  const bool access = h.op == wire::Op::kRead || h.op == wire::Op::kWrite;
  if (!access && (h.flags != 0 || h.payload_len != 0)) {
    return Status(Code::kLinkFailed, "flags or payload on a frame that takes none");
  }
  if ((h.op == wire::Op::kPing || h.op == wire::Op::kUnlink) && h.body_len != 0) {
    return Status(Code::kLinkFailed, "a body on a frame that takes none");
  }
  if (h.op == wire::Op::kDeviceChannel && h.body_len > kMaxRendezvousBytes) {
    return Status(Code::kLinkFailed, "oversized device channel request");
  }
  if (h.op == wire::Op::kRead && h.payload_len != 0) return Status(Code::kLinkFailed, "a payload on a read");
  return Status::OK();
}

Status Engine::admitAccess(const Link& link, const wire::RequestHeader& h) const {
  if (config_.one_way_links && link.initiator()) {  // our own one-way link: the peer may not use it
    return Status(Code::kNotYetLink, "with one-way links (transfer backend hixl) only the side that linked reads "
                                     "or writes over a link; call link_clusters on that side too");
  }
  const bool direct = h.flags & wire::kFlagDirect, device = h.flags & wire::kFlagDevice;
  const bool one_sided = h.flags & wire::kFlagOneSided;
  // Absolute addresses go only to a peer the kernel proved to be on this host (cma and IPC), or
  // into memory a device channel prepared (one-sided); the bytes of a device cache only over a
  // device channel.
  if (direct && !device && !link.sameHost() && !seeded::bug(seeded::kFlag)) {
    return Status(Code::kFeatureNotEnabled, "direct memory access needs a same-host link");
  }
  if (device && direct && !(ipc_ && link.sameHost())) {
    return Status(Code::kFeatureNotEnabled, "IPC needs a same-host link and a runtime that shares device memory");
  }
  if (one_sided && !one_sided_) return Status(Code::kFeatureNotEnabled, "no one-sided access on this runtime");
  return Status::OK();
}

Status Engine::serveOne(const std::shared_ptr<Link>& link, Stream& s, ServeState* state) {
  if (state->pinned.empty() && state->exported.empty()) {
    PDLINK_RETURN_IF_ERROR(s.waitReadable(Deadline::never()));
  } else {
    // A direct or IPC access keeps its caches pinned until the peer's next frame, but not longer
    // than the pin bound: a peer that goes silent after asking cannot keep freed memory alive.
    // The pin epoch moves first, so a copy still running fails its check (engine/registry.h).
    Status ready = s.waitReadable(Deadline::afterMs(pinTimeoutMs()));
    if (ready.code() == Code::kTimeout) {
      registry_.bumpPinEpoch();
      for (const std::string& key : state->exported) backend_->closeExport(key);
      state->exported.clear();
      state->pinned.clear();
      pins_expired_.fetch_add(1);
      PDLINK_LOG(kInfo, clusterName(link->peer()) << " sent nothing for " << pinTimeoutMs()
                                                  << " ms after a direct access: its pin expired");
      return Status::OK();
    }
    PDLINK_RETURN_IF_ERROR(ready);
  }
  // A peer that stalls mid-frame only ties up this link's thread, and only until this deadline.
  Deadline deadline = Deadline::afterMs(std::max<int64_t>(2 * config_.sync_timeout_ms, 5000));
  uint8_t hbuf[wire::kRequestHeaderBytes];
  PDLINK_RETURN_IF_ERROR(s.recvAll(hbuf, sizeof(hbuf), deadline));
  wire::RequestHeader h;
  Status st = wire::decode(hbuf, sizeof(hbuf), &h);
  if (st.ok()) st = admitHeader(*link, h);
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropping link to " << clusterName(link->peer()) << ": " << st.message());
    return st;
  }
  std::string body;
  PDLINK_RETURN_IF_ERROR(s.readBounded(h.body_len, wire::kMaxBodyBytes, deadline, &body, "request body"));
  // On an authenticated link, nothing of a frame is acted on before its tag checked out.
  PDLINK_RETURN_IF_ERROR(s.checkFrame(deadline));
  // The requester sends its next frame only after its direct or IPC copy finished: unpin.
  for (const std::string& key : state->exported) backend_->closeExport(key);
  state->exported.clear();
  state->pinned.clear();

  if (h.op == wire::Op::kPing) return sendResponse(s, Status::OK(), deadline);
  if (h.op == wire::Op::kDeviceChannel) return serveDeviceChannel(link, s, body, deadline);
  if (h.op == wire::Op::kUnlink) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      links_.forget(link);
    }
    (void)sendResponse(s, Status::OK(), deadline);
    link->breakLink("unlinked by the peer");
    state->unlinked = true;
    PDLINK_LOG(kInfo, clusterName(link->peer()) << " unlinked");
    return Status::OK();
  }

  wire::TransferBody tb;
  st = wire::decode(reinterpret_cast<const uint8_t*>(body.data()), body.size(), &tb);
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropping link to " << clusterName(link->peer()) << ": " << st.message());
    return st;
  }
  if (h.op == wire::Op::kCommit) {
    // A commit releases keys the peer read; over our own one-way link it read nothing.
    if (!admitAccess(*link, h).ok()) return Status::OK();
    registry_.commitRead(tb.target, tb.tensors);
    return Status::OK();
  }
  if (h.op == wire::Op::kRelease) return Status::OK();
  if (h.op == wire::Op::kDescribe) {
    // With device memory in play the checked round trip decides (it knows each cache's placement).
    const Status admitted = admitAccess(*link, h);
    Result<wire::CacheDescriptor> d =
        !admitted.ok() ? Result<wire::CacheDescriptor>(admitted)
        : !link->sameHost() ? Status(Code::kFeatureNotEnabled, "direct reads need a same-host link")
        : device_transport_ ? Status(Code::kParamInvalid, "no direct reads here")
        : tb.target.kind == wire::TargetKind::kBlocks
            ? registry_.describe(tb.target.model_id)
            : Result<wire::CacheDescriptor>(Status(Code::kParamInvalid, "describe needs a blocks target"));
    if (!d.ok()) return sendResponse(s, d.status(), deadline);
    return sendAnswer(s, wire::encode(d.value()), deadline);
  }
  auto payload = tb.payloadBytes();
  const bool is_write = h.op == wire::Op::kWrite;
  const bool direct = h.flags & wire::kFlagDirect;
  const bool device = h.flags & wire::kFlagDevice;
  const bool in_stream = is_write && !direct && !device;  // the payload follows in this stream
  if (!payload.ok() || h.payload_len != (in_stream ? payload.value() : 0)) {
    // The stream cannot be resynchronised without a trustworthy length.
    PDLINK_LOG(kWarn, "dropping link to " << clusterName(link->peer()) << ": inconsistent payload length");
    return Status(Code::kLinkFailed, "inconsistent payload length");
  }
  auto refuse = [&](const Status& why) -> Status {
    if (in_stream) PDLINK_RETURN_IF_ERROR(discardPayload(s, h.payload_len, deadline));
    return sendResponse(s, why, deadline);
  };
  if (Status admitted = admitAccess(*link, h); !admitted.ok()) {
    PDLINK_LOG(kDebug, "refused a request from " << clusterName(link->peer()) << ": " << admitted.message());
    return refuse(admitted);
  }
  auto resolved = registry_.resolve(tb, is_write);
  if (!resolved.ok()) {
    PDLINK_LOG(kDebug, "rejected " << (is_write ? "write" : "read") << " from " << clusterName(link->peer())
                                   << ": " << resolved.status().message());
    return refuse(resolved.status());
  }
  const Resolved& r = resolved.value();
  // Device memory is reachable only through the device channel; host memory only without it.
  const bool on_device = device_transport_ && std::any_of(r.keep.begin(), r.keep.end(), [](const auto& e) {
                           return e->layout.placement == Placement::kDevice;
                         });
  if (device != on_device) {
    return refuse(Status(Code::kParamInvalid,
                         on_device ? "the addressed cache is in device memory; the other side's cache must be "
                                     "in device memory too (placement DEVICE, same backend)"
                                   : "the addressed cache is in host memory; a device cache cannot be moved to "
                                     "or from it over this link (use placement DEVICE on both sides)"));
  }
  if (device && direct) {  // same-host IPC: export the checked regions, keep them until the next frame
    state->pinned = r.keep;
    return serveIpc(s, r, deadline, &state->exported);
  }
  if (device && (h.flags & wire::kFlagOneSided)) {  // addresses in prepared memory, kept until the next frame
    DeviceChannel* channel = link->inDevice();
    std::string list;
    list.reserve(r.tensors.size() * r.runs.size() * 8);  // bounded: limits::kMaxRequestPieces
    for (uint32_t t : r.tensors) {
      for (const wire::Run& run : r.runs) {
        uint64_t addr = r.addrs[t] + r.base + run.offset;
        if (!channel || !channel->prepared(addr, run.length)) {
          return sendResponse(s, Status(Code::kFeatureNotEnabled, "not in the memory prepared for one-sided access"),
                              deadline);
        }
        list.append(reinterpret_cast<const char*>(&addr), 8);
      }
    }
    state->pinned = r.keep;
    return sendAnswer(s, list, deadline);
  }
  if (device) {
    DeviceChannel* channel = link->inDevice();
    if (!channel) return sendResponse(s, Status(Code::kFailed, "no device channel on this link"), deadline);
    std::vector<Segment> segments;
    segments.reserve(r.tensors.size() * r.runs.size());
    for (uint32_t t : r.tensors) {
      for (const wire::Run& run : r.runs) segments.push_back({r.addrs[t] + r.base + run.offset, run.length});
    }
    PDLINK_RETURN_IF_ERROR(sendResponse(s, Status::OK(), deadline));
    Status moved = is_write ? channel->recv(segments, deadline) : channel->send(segments, deadline);
    if (!moved.ok()) {  // the channel (and so the link) can no longer be trusted
      link->setInDevice(nullptr);
      return moved;
    }
    return is_write ? sendResponse(s, Status::OK(), deadline) : Status::OK();
  }
  if (direct) {
    // Checked like any access; answer where the bytes are and keep them alive until the next frame
    // (the pin epoch lets the requester detect a pin that lapsed meanwhile).
    wire::DirectAnswer answer;
    answer.pin_epoch = registry_.pinEpoch();
    answer.addrs.reserve(r.tensors.size() * r.runs.size());  // bounded: limits::kMaxRequestPieces
    answer.lengths.reserve(r.tensors.size() * r.runs.size());
    for (uint32_t t : r.tensors) {
      for (const wire::Run& run : r.runs) {
        answer.addrs.push_back(r.addrs[t] + r.base + run.offset);
        answer.lengths.push_back(run.length);
      }
    }
    state->pinned = r.keep;
    return sendAnswer(s, wire::encode(answer), deadline);
  }
  if (is_write) {
    PDLINK_RETURN_IF_ERROR(movePayload(s, false, r.addrs, r.tensors, r.base, r.runs, deadline));
    return sendResponse(s, Status::OK(), deadline);
  }
  std::string head = wire::encode(wire::ResponseHeader{0, 0, payload.value()});
  return movePayload(s, true, r.addrs, r.tensors, r.base, r.runs, deadline, {{head.data(), head.size()}});
}

// ---------------------------------------------------------------- transfers

namespace {

// Tells the peer an access through `body` (the request's body) is over: kCommit after a pull that
// received every byte (the peer may then release the request key it read: never before, so a
// failed pull leaves the source intact and retryable), kRelease to unpin after a direct or IPC
// access. Not answered; a failure to send it breaks the link.
void finishAccess(Link& link, wire::Op op, const std::string& body, Deadline deadline) {
  std::string head = wire::encode(wire::RequestHeader{op, static_cast<uint32_t>(body.size()), 0});
  std::vector<iovec> iov{{head.data(), head.size()}, {const_cast<char*>(body.data()), body.size()}};
  if (!link.out().sendFrame(iov, deadline).ok()) link.breakLink("could not confirm a completed transfer to the peer");
}

// After a pull that received every byte: release the request key, once the last request of a
// split transfer is done (a key read in several requests must survive until then).
void commitPull(Link& link, wire::TargetKind kind, bool last, const std::string& body, Deadline deadline) {
  if (usesKeyCommit(kind) && last) finishAccess(link, wire::Op::kCommit, body, deadline);
}

}  // namespace

Result<std::shared_ptr<Link>> Engine::usableLink(uint64_t peer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!initialized_) return Status(Code::kFailed, "engine is not initialized");
  if (std::shared_ptr<Link> link = links_.forRequests(peer)) return link;
  if (auto why = links_.downReason(peer)) return linkDown(peer, *why);
  return Status(Code::kNotYetLink, "no link to " + clusterName(peer) + "; call link_clusters first");
}

Status Engine::failTransfer(const std::shared_ptr<Link>& link, const Status& st, const char* what) {
  link->breakLink(st.message());
  Code code = st.code() == Code::kTimeout ? Code::kTimeout : Code::kLinkFailed;
  return Status(code, std::string(what) + " " + clusterName(link->peer()) + " failed: " + st.message() +
                          "; the link is now unusable: call unlink_clusters, then link_clusters again");
}

Status Engine::awaitResponse(const std::shared_ptr<Link>& link, Deadline deadline, const char* what,
                             wire::ResponseHeader* rh) {
  Status remote;
  Status st = readResponse(link->out(), deadline, rh, &remote);
  if (!st.ok()) return failTransfer(link, st, what);
  if (!remote.ok()) {  // the peer refused this request; the link itself is fine
    return Status(remote.code(), std::string(what) + " " + clusterName(link->peer()) + ": " + remote.message());
  }
  return Status::OK();
}

Status Engine::request(const std::shared_ptr<Link>& link, const wire::RequestHeader& header, const std::string& body,
                       Deadline deadline, const char* what, wire::ResponseHeader* rh) {
  std::string head = wire::encode(header);
  std::vector<iovec> iov{{head.data(), head.size()}, {const_cast<char*>(body.data()), body.size()}};
  Status st = link->out().sendFrame(iov, deadline);
  if (!st.ok()) return failTransfer(link, st, what);
  return awaitResponse(link, deadline, what, rh);
}

Status Engine::requestAccess(const std::shared_ptr<Link>& link, const std::string& body, bool is_push, uint8_t flags,
                             Deadline deadline, const char* what, wire::ResponseHeader* rh) {
  wire::RequestHeader h{is_push ? wire::Op::kWrite : wire::Op::kRead, static_cast<uint32_t>(body.size()), 0, flags};
  return request(link, h, body, deadline, what, rh);
}

Result<Engine::Plan> Engine::plan(const TransferSpec& spec, bool is_push) {
  auto local = registry_.get(spec.local_cache_id);
  if (!local.ok()) return local.status();
  Plan p;
  p.local = local.value();
  const CacheLayout& L = p.local->layout;
  const uint64_t stride = L.stride();
  if (stride == 0) return Status(Code::kParamInvalid, "local cache has zero-sized slots");
  // Tensor mapping.
  if (spec.local_tensors.empty()) {
    for (uint32_t t = 0; t < L.num_tensors; ++t) p.local_tensors.push_back(t);
    p.remote.tensors = p.local_tensors;
  } else {
    if (spec.local_tensors.size() != spec.remote_tensors.size()) {
      return Status(Code::kParamInvalid, "source and destination layer ranges cover different tensor counts");
    }
    for (uint32_t t : spec.local_tensors) {
      if (t >= L.num_tensors) {
        return Status(Code::kParamInvalid, "tensor index " + std::to_string(t) + " out of range: local cache has " +
                                               std::to_string(L.num_tensors) + " tensors");
      }
    }
    p.local_tensors = spec.local_tensors;
    p.remote.tensors = spec.remote_tensors;
  }
  p.remote.target = spec.target;
  using Mode = TransferSpec::Mode;
  if (spec.mode == Mode::kExplicit) {
    if (spec.local_runs.size() != spec.remote_runs.size() || spec.local_runs.empty()) {
      return Status(Code::kParamInvalid, "local and remote run lists must be non-empty and of equal length");
    }
    for (size_t i = 0; i < spec.local_runs.size(); ++i) {
      const wire::Run& l = spec.local_runs[i];
      uint64_t end = 0;
      if (l.length == 0 || l.length != spec.remote_runs[i].length ||
          __builtin_add_overflow(l.offset, l.length, &end) || end > L.tensor_size) {
        return Status(Code::kParamInvalid, "local range [" + std::to_string(l.offset) + ", +" +
                                               std::to_string(l.length) + ") is outside the local tensors (" +
                                               std::to_string(L.tensor_size) + " bytes) or mismatches the remote one");
      }
    }
    p.local_runs = spec.local_runs;
    p.remote.runs = spec.remote_runs;
  } else if (spec.mode == Mode::kSlotToSlot) {
    if (L.is_blocks) return Status(Code::kParamInvalid, "this transfer needs a non-blocks local cache");
    if (spec.local_slot >= L.num_slots) {
      return Status(Code::kParamInvalid, "batch_index " + std::to_string(spec.local_slot) +
                                             " out of range: local batch size is " + std::to_string(L.num_slots));
    }
    uint64_t len = spec.size > 0 ? static_cast<uint64_t>(spec.size) : stride;
    if (len > stride) {
      return Status(Code::kParamInvalid, "size " + std::to_string(len) + " exceeds the local slot size " +
                                             std::to_string(stride));
    }
    p.local_runs.push_back({spec.local_slot * stride, len});
    p.remote.runs.push_back({0, len});
  } else {
    if (!L.is_blocks) return Status(Code::kParamInvalid, "this transfer needs a blocks cache on the local side");
    const bool pairs = spec.mode == Mode::kBlocksToBlocks;
    if (spec.local_blocks.empty()) return Status(Code::kParamInvalid, "the block list is empty");
    if (pairs && spec.local_blocks.size() != spec.remote_blocks.size()) {
      return Status(Code::kParamInvalid, "src_blocks and dst_blocks differ in length (" +
                                             std::to_string(spec.remote_blocks.size()) + " vs " +
                                             std::to_string(spec.local_blocks.size()) + ")");
    }
    if (is_push && !pairs) return Status(Code::kParamInvalid, "pushing a blocks cache into a slot is not supported");
    p.remote.block_size = pairs ? stride : 0;
    const uint64_t max_remote = UINT64_MAX / stride;
    for (size_t i = 0; i < spec.local_blocks.size(); ++i) {
      int64_t lb = spec.local_blocks[i];
      int64_t rb = pairs ? spec.remote_blocks[i] : static_cast<int64_t>(i);
      if (lb < 0 || static_cast<uint64_t>(lb) >= L.num_slots) {
        return Status(Code::kParamInvalid, "block index " + std::to_string(lb) + " out of range: local cache has " +
                                               std::to_string(L.num_slots) + " blocks");
      }
      if (rb < 0 || static_cast<uint64_t>(rb) >= max_remote) {
        return Status(Code::kParamInvalid, "remote block index " + std::to_string(rb) + " out of range");
      }
      uint64_t loff = static_cast<uint64_t>(lb) * stride, roff = static_cast<uint64_t>(rb) * stride;
      // Coalesce runs that are consecutive on both sides into one range.
      if (!p.local_runs.empty() && p.local_runs.back().offset + p.local_runs.back().length == loff &&
          p.remote.runs.back().offset + p.remote.runs.back().length == roff) {
        p.local_runs.back().length += stride;
        p.remote.runs.back().length += stride;
      } else {
        p.local_runs.push_back({loff, stride});
        p.remote.runs.push_back({roff, stride});
      }
    }
  }
  if (p.remote.tensors.size() > limits::kMaxRequestTensors) {
    return Status(Code::kParamInvalid, "a transfer moves at most " + std::to_string(limits::kMaxRequestTensors) +
                                           " tensors, got " + std::to_string(p.remote.tensors.size()));
  }
  auto payload = p.remote.payloadBytes();
  if (!payload.ok()) return payload.status();
  p.payload = payload.value();
  return p;
}

std::vector<Engine::Plan> Engine::split(const Plan& p) {
  // Each request names at most limits::kMaxRequestPieces (tensor, run) pieces, the bound every
  // server applies; a larger transfer becomes several requests of consecutive runs. Only the last
  // one commits a pulled request key.
  const uint64_t runs_per_request = std::max<uint64_t>(1, limits::kMaxRequestPieces / p.remote.tensors.size());
  std::vector<Plan> out;
  for (size_t first = 0; first < p.remote.runs.size(); first += runs_per_request) {
    const size_t last = std::min<size_t>(p.remote.runs.size(), first + runs_per_request);
    Plan c;
    c.local = p.local;
    c.local_tensors = p.local_tensors;
    c.local_runs.assign(p.local_runs.begin() + first, p.local_runs.begin() + last);
    c.remote.target = p.remote.target;
    c.remote.block_size = p.remote.block_size;
    c.remote.tensors = p.remote.tensors;
    c.remote.runs.assign(p.remote.runs.begin() + first, p.remote.runs.begin() + last);
    c.payload = c.remote.payloadBytes().value();  // a part of a sum that did not overflow
    c.commit = last == p.remote.runs.size();
    out.push_back(std::move(c));
  }
  return out;
}

Status Engine::pull(const TransferSpec& spec) { return transfer(spec, false); }
Status Engine::push(const TransferSpec& spec) { return transfer(spec, true); }

Status Engine::transfer(const TransferSpec& spec, bool is_push) {
  auto link_r = usableLink(spec.peer_cluster_id);
  if (!link_r.ok()) return link_r.status();
  auto p_r = plan(spec, is_push);
  if (!p_r.ok()) return p_r.status();
  std::shared_ptr<Link> link = link_r.value();
  const char* what = is_push ? "push to" : "pull from";

  std::lock_guard<std::mutex> out(link->outMutex());
  if (link->broken()) {  // broke while we waited for the channel
    return linkDown(*link);
  }
  Deadline deadline = Deadline::afterMs(config_.sync_timeout_ms);
  Plan& p = p_r.value();
  if (p.remote.pieces() <= limits::kMaxRequestPieces) return transferPart(link, p, is_push, deadline, what);
  for (Plan& part : split(p)) PDLINK_RETURN_IF_ERROR(transferPart(link, part, is_push, deadline, what));
  return Status::OK();
}

Status Engine::transferPart(const std::shared_ptr<Link>& link, Plan& p, bool is_push, Deadline deadline,
                            const char* what) {
  if (device_transport_ && p.local->layout.placement == Placement::kDevice) {
    return deviceTransfer(link, p, is_push, deadline, what);
  }
  if (link->direct()) return directTransfer(link, p, is_push, deadline, what);
  Stream& s = link->out();
  std::string body = wire::encode(p.remote);
  wire::ResponseHeader rh;
  Status st;
  if (is_push) {  // the payload follows the request in the same stream
    wire::RequestHeader h{wire::Op::kWrite, static_cast<uint32_t>(body.size()), p.payload};
    std::string head = wire::encode(h);
    std::vector<iovec> iov{{head.data(), head.size()}, {body.data(), body.size()}};
    st = movePayload(s, true, p.local->addrs, p.local_tensors, 0, p.local_runs, deadline, std::move(iov));
    if (!st.ok()) return failTransfer(link, st, what);
    return awaitResponse(link, deadline, what, &rh);
  }
  st = request(link, wire::RequestHeader{wire::Op::kRead, static_cast<uint32_t>(body.size()), 0}, body, deadline,
               what, &rh);
  if (!st.ok()) return st;
  if (rh.payload_len != p.payload) {
    return failTransfer(link, Status(Code::kLinkFailed, "peer sent " + std::to_string(rh.payload_len) +
                                                            " bytes, expected " + std::to_string(p.payload)),
                        what);
  }
  st = movePayload(s, false, p.local->addrs, p.local_tensors, 0, p.local_runs, deadline);
  if (!st.ok()) return failTransfer(link, st, what);
  commitPull(*link, p.remote.target.kind, p.commit, body, deadline);
  return Status::OK();
}

Status Engine::directTransfer(const std::shared_ptr<Link>& link, Plan& p, bool is_push, Deadline deadline,
                              const char* what) {
  Link::Direct& d = link->directState();
  Stream& s = link->out();
  std::vector<iovec> local;
  for (uint32_t t : p.local_tensors) {
    for (const wire::Run& r : p.local_runs) {
      local.push_back({reinterpret_cast<void*>(p.local->addrs[t] + r.offset), static_cast<size_t>(r.length)});
    }
  }
  const wire::Target& target = p.remote.target;
  std::string body;  // encoded only when a frame carries it; the cached-read path sends none
  auto encoded = [&]() -> const std::string& {
    if (body.empty()) body = wire::encode(p.remote);
    return body;
  };
  // The peer's published words (Registry::Published): generation, then pin epoch.
  void* const generation_word = reinterpret_cast<void*>(d.published_addr);
  void* const pin_epoch_word = reinterpret_cast<void*>(d.published_addr + 8);

  // Fast path, reads of a blocks cache: with the peer's layout cached, one process_vm_readv and no
  // round trip. The peer's registry generation is read before and after the data (in the same
  // ordered copy), so a layout that changed meanwhile is detected and the read redone the checked way.
  if (!is_push && target.kind == wire::TargetKind::kBlocks) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      auto it = d.descriptors.find(target.model_id);
      if (it == d.descriptors.end()) {
        const std::string& b = encoded();
        wire::ResponseHeader rh;
        Status st = request(link, wire::RequestHeader{wire::Op::kDescribe, static_cast<uint32_t>(b.size()), 0}, b,
                            deadline, what, &rh);
        if (!st.ok() && link->broken()) return st;
        if (!st.ok()) break;  // refused: the checked round trip below gives the peer's own answer
        std::string payload;
        st = readAnswer(s, rh.payload_len, wire::kMaxDescriptorBytes, deadline, &payload, "cache descriptor");
        wire::CacheDescriptor desc;
        if (st.ok()) st = wire::decode(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(), &desc);
        if (!st.ok()) return failTransfer(link, st, what);
        it = d.descriptors.emplace(target.model_id, std::move(desc)).first;
      }
      const wire::CacheDescriptor& c = it->second;
      bool fits = p.remote.block_size == 0 || p.remote.block_size == c.stride;
      for (uint32_t t : p.remote.tensors) fits = fits && t < c.addrs.size();
      for (const wire::Run& r : p.remote.runs) {
        uint64_t end = 0;
        fits = fits && r.length > 0 && !__builtin_add_overflow(r.offset, r.length, &end) && end <= c.tensor_size;
      }
      if (!fits) break;  // the checked way reports the peer's own error
      uint64_t g1 = 0, g2 = 0;
      std::vector<iovec> lv{{&g1, 8}}, rv{{generation_word, 8}};
      size_t k = 0;
      for (uint32_t t : p.remote.tensors) {
        for (const wire::Run& r : p.remote.runs) {
          lv.push_back(local[k++]);
          rv.push_back({reinterpret_cast<void*>(c.addrs[t] + r.offset), static_cast<size_t>(r.length)});
        }
      }
      lv.push_back({&g2, 8});
      rv.push_back({generation_word, 8});
      Status st = cma::copy(d.pid, false, lv, rv);
      if (st.ok() && g1 == c.generation && g2 == c.generation) return Status::OK();
      if (!st.ok() && st.code() == Code::kLinkFailed) return failTransfer(link, st, what);
      d.descriptors.erase(it);  // stale or unmapped: the peer's caches changed
    }
  }

  // Checked round trip: the peer validates and pins the target and answers with its addresses.
  // The pin lasts until this side's next frame, or until it expires on the peer: the peer's pin
  // epoch, read again after the copy, tells. A lapsed pin fails the transfer (a read may have
  // seen memory that was freed meanwhile, a write may have landed in it).
  encoded();
  wire::ResponseHeader rh;
  Status st = request(link, wire::RequestHeader{is_push ? wire::Op::kWrite : wire::Op::kRead,
                                                static_cast<uint32_t>(body.size()), 0, wire::kFlagDirect},
                      body, deadline, what, &rh);
  if (!st.ok()) return st;
  std::string payload;
  wire::DirectAnswer answer;
  if (rh.payload_len != wire::directAnswerBytes(local.size())) {
    st = Status(Code::kLinkFailed, "peer answered a direct access of " + std::to_string(rh.payload_len) +
                                       " bytes, expected " + std::to_string(wire::directAnswerBytes(local.size())));
  } else {
    st = readAnswer(s, rh.payload_len, rh.payload_len, deadline, &payload, "direct-access answer");
    if (st.ok()) {
      st = wire::decode(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(), local.size(), &answer);
    }
  }
  for (size_t i = 0; st.ok() && i < local.size(); ++i) {
    if (answer.lengths[i] != local[i].iov_len) {
      st = Status(Code::kLinkFailed, "peer answered a range of the wrong length");
    }
  }
  if (!st.ok()) return failTransfer(link, st, what);
  std::vector<iovec> remote_iov(local.size());
  for (size_t i = 0; i < local.size(); ++i) {
    remote_iov[i] = {reinterpret_cast<void*>(answer.addrs[i]), local[i].iov_len};
  }
  // The addresses are the peer's, applied to the peer's pid (proven by the kernel): at worst they
  // make this side copy the peer's own memory.
  uint64_t epoch_after = 0;
  Status copied;
  if (is_push) {
    copied = cma::copy(d.pid, true, local, remote_iov);
    if (copied.ok()) {
      auto epoch = cma::readWord(d.pid, reinterpret_cast<uint64_t>(pin_epoch_word));
      copied = epoch.status();
      if (epoch.ok()) epoch_after = epoch.value();
    }
  } else {  // the epoch word rides in the same ordered read, after the data
    local.push_back({&epoch_after, 8});
    remote_iov.push_back({pin_epoch_word, 8});
    copied = cma::copy(d.pid, false, local, remote_iov);
  }
  if (copied.ok() && epoch_after != answer.pin_epoch) {
    copied = Status(Code::kFailed, "the peer released its pin before the copy finished (pin expired); retry");
  }
  // Unpin on the peer; for a completed read by request key this is also the release of the key.
  bool commit = copied.ok() && !is_push && usesKeyCommit(target.kind) && p.commit;
  finishAccess(*link, commit ? wire::Op::kCommit : wire::Op::kRelease, body, deadline);
  if (!copied.ok()) {
    if (copied.code() == Code::kLinkFailed) return failTransfer(link, copied, what);
    return Status(copied.code(), std::string(what) + " " + clusterName(link->peer()) + ": " + copied.message());
  }
  return Status::OK();
}

// ---------------------------------------------------------------- device channels

Status Engine::serveDeviceChannel(const std::shared_ptr<Link>& link, Stream& s, const std::string& rendezvous,
                                  Deadline deadline) {
  if (!device_transport_) {
    return sendResponse(s, Status(Code::kFeatureNotEnabled, std::string("the peer's backend (") + backend_->name() +
                                                                ") has no device channels"),
                        deadline);
  }
  if (rendezvous.empty()) return sendResponse(s, Status(Code::kParamInvalid, "empty device channel request"), deadline);
  const uint8_t wanted = rendezvous.back();  // channel options (wire::kChannelOneSided)
  // Accept first, then join: the requester joins only after this answer, so a refusal never
  // leaves it waiting in the vendor's communicator setup. The answer says which options apply.
  const uint8_t agreed = wanted & (config_.one_sided ? wire::kChannelOneSided : 0);
  PDLINK_RETURN_IF_ERROR(sendAnswer(s, std::string(1, static_cast<char>(agreed)), deadline));
  auto channel = backend_->joinChannel(rendezvous.substr(0, rendezvous.size() - 1), false);
  if (channel.ok() && (agreed & wire::kChannelOneSided)) {
    Status st = channel.value()->prepare(preparedRegions(), std::max(1, deadline.remainingMsForPoll() / 1000));
    if (!st.ok()) channel = st;
  }
  if (!channel.ok()) {
    PDLINK_LOG(kWarn, "device channel from " << clusterName(link->peer()) << ": " << channel.status().message());
    return channel.status();
  }
  link->setInDevice(std::move(channel.value()));
  PDLINK_LOG(kDebug, "device channel from " << clusterName(link->peer()) << " ready");
  return Status::OK();
}

Status Engine::ensureDeviceChannel(const std::shared_ptr<Link>& link, Deadline deadline, const char* what) {
  if (link->outDevice()) return Status::OK();
  auto rendezvous = backend_->newRendezvous();
  if (!rendezvous.ok()) return rendezvous.status();
  const std::string& rv = rendezvous.value();
  // One-sided access is offered when this runtime has it; the peer agrees when its runtime has it
  // too (and its configuration allows it).
  const bool offer = config_.one_sided && one_sided_;
  std::string body = rv + static_cast<char>(offer ? wire::kChannelOneSided : 0);
  wire::ResponseHeader rh;
  Status st = request(link, wire::RequestHeader{wire::Op::kDeviceChannel, static_cast<uint32_t>(body.size()), 0},
                      body, deadline, what, &rh);
  if (!st.ok()) return st;  // refused (no device channels there): the link itself is fine
  std::string answer;
  const uint8_t offered = offer ? wire::kChannelOneSided : 0;
  if (rh.payload_len != 1 || !readAnswer(link->out(), 1, 1, deadline, &answer, "device channel answer").ok() ||
      (static_cast<uint8_t>(answer[0]) & ~offered) != 0) {
    return failTransfer(link, Status(Code::kLinkFailed, "malformed device channel answer"), what);
  }
  const uint8_t agreed = static_cast<uint8_t>(answer[0]);
  auto channel = backend_->joinChannel(rv, true);
  if (channel.ok() && (agreed & wire::kChannelOneSided)) {
    st = channel.value()->prepare(preparedRegions(), std::max(1, deadline.remainingMsForPoll() / 1000));
    if (!st.ok()) channel = st;
  }
  if (!channel.ok()) return failTransfer(link, channel.status(), what);  // the peer's half is in an unknown state
  link->setOutDevice(std::move(channel.value()));
  return Status::OK();
}

Status Engine::deviceTransfer(const std::shared_ptr<Link>& link, Plan& p, bool is_push, Deadline deadline,
                              const char* what) {
  const std::string body = wire::encode(p.remote);
  if (ipc_ && link->ipcPossible()) {
    Status st = ipcTransfer(link, p, body, is_push, deadline, what);
    if (st.code() != Code::kFeatureNotEnabled || link->broken()) return st;
    PDLINK_LOG(kInfo, "IPC with " << clusterName(link->peer()) << " unavailable (" << st.message() << "); using HCCL");
    link->refuseIpc();
  }
  PDLINK_RETURN_IF_ERROR(ensureDeviceChannel(link, deadline, what));
  std::vector<Segment> segments;
  segments.reserve(p.local_tensors.size() * p.local_runs.size());
  for (uint32_t t : p.local_tensors) {
    for (const wire::Run& r : p.local_runs) segments.push_back({p.local->addrs[t] + r.offset, r.length});
  }
  if (link->outDevice()->canPrepare()) {
    Status st = oneSidedTransfer(link, p, body, segments, is_push, deadline, what);
    if (st.code() != Code::kFeatureNotEnabled || link->broken()) return st;
    // Memory registered after the link (not prepared on one side or the other): two-sided.
  }
  wire::ResponseHeader rh;
  Status st = requestAccess(link, body, is_push, wire::kFlagDevice, deadline, what, &rh);
  if (!st.ok()) return st;  // the peer refused the access, or the link failed
  if (rh.payload_len != 0) return failTransfer(link, Status(Code::kLinkFailed, "unexpected payload"), what);
  DeviceChannel* channel = link->outDevice();
  st = is_push ? channel->send(segments, deadline) : channel->recv(segments, deadline);
  if (!st.ok()) {
    link->setOutDevice(nullptr);
    return failTransfer(link, st, what);
  }
  if (is_push) return awaitResponse(link, deadline, what, &rh);  // stored on the peer
  commitPull(*link, p.remote.target.kind, p.commit, body, deadline);
  return Status::OK();
}

// ---------------------------------------------------------------- same-host IPC

Status Engine::serveIpc(Stream& s, const Resolved& r, Deadline deadline, std::vector<std::string>* exported) {
  if (!ipc_) {
    return sendResponse(s, Status(Code::kFeatureNotEnabled, "the peer's runtime cannot share device memory (IPC)"),
                        deadline);
  }
  // One export per tensor, spanning its runs [lo, hi): the requester checks the span against its
  // own request and places its runs inside it itself.
  const IpcSpan span = ipcSpan(r.runs);
  wire::IpcAnswer answer;
  for (uint32_t t : r.tensors) {
    auto key = backend_->exportMemory(r.addrs[t] + r.base + span.lo, span.length);
    if (key.ok() && (key.value().empty() || key.value().size() > limits::kIpcKeyBytes ||
                     key.value().find('\0') != std::string::npos)) {
      key = Status(Code::kFailed, "IPC key of an unexpected form");
    }
    if (!key.ok()) return sendResponse(s, key.status(), deadline);  // exported so far: closed at the next frame
    exported->push_back(key.value());
    answer.keys.push_back(key.value());
    answer.spans.push_back(span.length);
  }
  return sendAnswer(s, wire::encode(answer), deadline);
}

Status Engine::ipcTransfer(const std::shared_ptr<Link>& link, Plan& p, const std::string& body, bool is_push,
                           Deadline deadline, const char* what) {
  wire::ResponseHeader rh;
  Status st = requestAccess(link, body, is_push, wire::kFlagDevice | wire::kFlagDirect, deadline, what, &rh);
  if (!st.ok()) return st;  // refused (kFeatureNotEnabled: no IPC there), or the link failed
  const size_t nt = p.remote.tensors.size();
  std::string payload;
  wire::IpcAnswer answer;
  if (rh.payload_len != nt * wire::kIpcEntryBytes) {
    st = Status(Code::kLinkFailed, "peer answered an IPC description of the wrong size");
  } else {
    st = readAnswer(link->out(), rh.payload_len, rh.payload_len, deadline, &payload, "IPC answer");
    if (st.ok()) st = wire::decode(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(), nt, &answer);
  }
  if (st.ok()) st = checkIpcAnswer(answer, p.remote.runs);
  if (!st.ok()) return failTransfer(link, st, what);

  std::vector<std::string> imported;
  std::vector<uint64_t> local_bases, remote_bases;
  Status copied;
  for (size_t i = 0; i < nt; ++i) {
    auto base = backend_->importMemory(answer.keys[i]);
    if (!base.ok()) {
      copied = base.status();
      break;
    }
    imported.push_back(answer.keys[i]);
    remote_bases.push_back(base.value());
    local_bases.push_back(p.local->addrs[p.local_tensors[i]]);
  }
  std::vector<DeviceCopy> copies;
  if (copied.ok()) copies = ipcCopies(local_bases, p.local_runs, remote_bases, p.remote.runs, is_push);
  if (copied.ok()) copied = backend_->copyDevice(copies, deadline);
  for (const std::string& key : imported) backend_->closeImport(key);
  // Unpin on the peer (and close its exports); for a completed read by request key this is also
  // the release of the key.
  const bool commit = copied.ok() && !is_push && usesKeyCommit(p.remote.target.kind) && p.commit;
  finishAccess(*link, commit ? wire::Op::kCommit : wire::Op::kRelease, body, deadline);
  if (!copied.ok()) {
    if (copied.code() == Code::kTimeout) return failTransfer(link, copied, what);
    return Status(copied.code() == Code::kFeatureNotEnabled ? Code::kFailed : copied.code(),
                  std::string(what) + " " + clusterName(link->peer()) + " over IPC: " + copied.message());
  }
  return Status::OK();
}

// ---------------------------------------------------------------- one-sided HCCL

std::vector<Segment> Engine::preparedRegions() const {
  std::vector<Segment> out;
  if (device_pool_) out.push_back({device_pool_->base(), device_pool_->capacity()});
  for (auto& [addr, bytes] : registry_.registeredDeviceTensors()) out.push_back({addr, bytes});
  return out;
}

Status Engine::oneSidedTransfer(const std::shared_ptr<Link>& link, Plan& p, const std::string& body,
                                const std::vector<Segment>& local, bool is_push, Deadline deadline, const char* what) {
  DeviceChannel* channel = link->outDevice();
  for (const Segment& seg : local) {
    if (!channel->prepared(seg.addr, seg.length)) {
      return Status(Code::kFeatureNotEnabled, "local memory not prepared for one-sided access");
    }
  }
  wire::ResponseHeader rh;
  Status st = requestAccess(link, body, is_push, wire::kFlagDevice | wire::kFlagOneSided, deadline, what, &rh);
  if (!st.ok()) return st;  // refused (kFeatureNotEnabled: not prepared there), or the link failed
  std::vector<uint64_t> remote;
  std::string payload;
  if (rh.payload_len != local.size() * 8) {
    st = Status(Code::kLinkFailed, "peer answered " + std::to_string(rh.payload_len / 8) + " addresses, expected " +
                                       std::to_string(local.size()));
  } else {
    st = readAnswer(link->out(), rh.payload_len, rh.payload_len, deadline, &payload, "address list");
    if (st.ok()) {
      st = wire::decodeAddresses(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(), local.size(),
                                 &remote);
    }
  }
  if (!st.ok()) return failTransfer(link, st, what);
  std::vector<DeviceCopy> copies(local.size());
  for (size_t i = 0; i < local.size(); ++i) {
    copies[i] = is_push ? DeviceCopy{remote[i], local[i].addr, local[i].length}
                        : DeviceCopy{local[i].addr, remote[i], local[i].length};
  }
  Status moved = is_push ? channel->put(copies, deadline) : channel->get(copies, deadline);
  if (!moved.ok()) {
    link->setOutDevice(nullptr);
    return failTransfer(link, moved, what);  // unpins on the peer too: its serving thread sees the link go
  }
  // Unpin on the peer; for a completed read by request key this is also the release of the key.
  const bool commit = !is_push && usesKeyCommit(p.remote.target.kind) && p.commit;
  finishAccess(*link, commit ? wire::Op::kCommit : wire::Op::kRelease, body, deadline);
  return Status::OK();
}

}  // namespace pdlink
