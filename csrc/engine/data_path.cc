// The data path: serving a peer's requests, and pulls and pushes over TCP or direct memory access.
#include "engine/engine.h"

#include <algorithm>
#include <cstring>

#include "core/log.h"
#include "engine/engine_internal.h"
#include "transport/cma.h"

namespace pdlink {

using namespace detail;  // NOLINT: this file is part of the engine

// ---------------------------------------------------------------- serving

void Engine::serve(const std::shared_ptr<Link>& link) {
  bool unlinked = false;
  Status st;
  std::vector<std::shared_ptr<CacheEntry>> pinned;  // caches a peer is copying directly
  std::vector<std::string> exported;                 // IPC keys a peer is copying through
  while (st.ok() && !unlinked) st = serveOne(link, &unlinked, &pinned, &exported);
  for (const std::string& key : exported) backend_->closeExport(key);
  if (!unlinked) {
    std::string why = st.message().find("closed by peer") != std::string::npos ? "peer closed the connection"
                                                                                : st.message();
    if (!link->broken()) PDLINK_LOG(kInfo, "link to " << clusterName(link->peer()) << " is down: " << why);
    link->breakLink(why);
  }
}

Status Engine::serveOne(const std::shared_ptr<Link>& link, bool* unlinked,
                        std::vector<std::shared_ptr<CacheEntry>>* pinned, std::vector<std::string>* exported) {
  Socket& s = link->in();
  PDLINK_RETURN_IF_ERROR(s.waitReadable(Deadline::never()));
  // A peer that stalls mid-frame only ties up this link's thread, and only until this deadline.
  Deadline deadline = Deadline::afterMs(std::max<int64_t>(2 * config_.sync_timeout_ms, 5000));
  uint8_t hbuf[wire::kRequestHeaderBytes];
  PDLINK_RETURN_IF_ERROR(s.recvAll(hbuf, sizeof(hbuf), deadline));
  wire::RequestHeader h;
  Status st = wire::decode(hbuf, sizeof(hbuf), &h);
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropping link to " << clusterName(link->peer()) << ": " << st.message());
    return st;
  }
  std::vector<uint8_t> body(h.body_len);
  if (h.body_len > 0) PDLINK_RETURN_IF_ERROR(s.recvAll(body.data(), body.size(), deadline));
  // The requester sends its next frame only after its direct or IPC copy finished: unpin.
  for (const std::string& key : *exported) backend_->closeExport(key);
  exported->clear();
  pinned->clear();

  if (h.op == wire::Op::kPing) return sendResponse(s, Status::OK(), deadline);
  if (h.op == wire::Op::kDeviceChannel) return serveDeviceChannel(link, body, deadline);
  if (h.op == wire::Op::kUnlink) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = links_.find(link->peer());
      if (it != links_.end() && it->second == link) links_.erase(it);
    }
    (void)sendResponse(s, Status::OK(), deadline);
    link->breakLink("unlinked by the peer");
    *unlinked = true;
    PDLINK_LOG(kInfo, clusterName(link->peer()) << " unlinked");
    return Status::OK();
  }

  wire::TransferBody tb;
  st = wire::decode(body.data(), body.size(), &tb);
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropping link to " << clusterName(link->peer()) << ": " << st.message());
    return st;
  }
  if (h.op == wire::Op::kCommit) {
    registry_.commitRead(tb.target, tb.tensors);
    return Status::OK();
  }
  if (h.op == wire::Op::kRelease) return Status::OK();
  if (h.op == wire::Op::kDescribe) {
    // With device memory in play the checked round trip decides (it knows each cache's placement).
    auto d = device_transport_ ? Result<wire::CacheDescriptor>(Status(Code::kParamInvalid, "no direct reads here"))
             : tb.target.kind == wire::TargetKind::kBlocks
                 ? registry_.describe(tb.target.model_id)
                 : Result<wire::CacheDescriptor>(Status(Code::kParamInvalid, "describe needs a blocks target"));
    if (!d.ok()) return sendResponse(s, d.status(), deadline);
    std::string payload = wire::encode(d.value());
    std::string head = wire::encode(wire::ResponseHeader{0, 0, payload.size()}) + payload;
    return s.sendAll(head.data(), head.size(), deadline);
  }
  auto payload = tb.payloadBytes();
  bool is_write = h.op == wire::Op::kWrite;
  const bool direct = h.flags & wire::kFlagDirect;
  const bool device = h.flags & wire::kFlagDevice;
  const bool in_stream = is_write && !direct && !device;  // the payload follows in this stream
  if (!payload.ok() || h.payload_len != (in_stream ? payload.value() : 0)) {
    // The stream cannot be resynchronised without a trustworthy length.
    PDLINK_LOG(kWarn, "dropping link to " << clusterName(link->peer()) << ": inconsistent payload length");
    return Status(Code::kLinkFailed, "inconsistent payload length");
  }
  auto resolved = registry_.resolve(tb, is_write);
  if (!resolved.ok()) {
    PDLINK_LOG(kDebug, "rejected " << (is_write ? "write" : "read") << " from " << clusterName(link->peer())
                                   << ": " << resolved.status().message());
    if (in_stream) PDLINK_RETURN_IF_ERROR(s.discard(h.payload_len, deadline));
    return sendResponse(s, resolved.status(), deadline);
  }
  const Resolved& r = resolved.value();
  // Device memory is reachable only through the device channel; host memory only without it.
  const bool on_device = device_transport_ && std::any_of(r.keep.begin(), r.keep.end(), [](const auto& e) {
                           return e->layout.placement == Placement::kDevice;
                         });
  if (device != on_device) {
    if (in_stream) PDLINK_RETURN_IF_ERROR(s.discard(h.payload_len, deadline));
    return sendResponse(s,
                        Status(Code::kParamInvalid,
                               on_device ? "the addressed cache is in device memory; the other side's cache must be "
                                           "in device memory too (placement DEVICE, same backend)"
                                         : "the addressed cache is in host memory; a device cache cannot be moved to "
                                           "or from it over this link (use placement DEVICE on both sides)"),
                        deadline);
  }
  if (device && direct) {  // same-host IPC: export the checked regions, keep them until the next frame
    *pinned = r.keep;
    return serveIpc(s, r, deadline, exported);
  }
  if (device && (h.flags & wire::kFlagOneSided)) {  // addresses in prepared memory, kept until the next frame
    DeviceChannel* channel = link->inDevice();
    std::string list;
    list.reserve(r.tensors.size() * r.runs.size() * 8);
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
    *pinned = r.keep;
    std::string head = wire::encode(wire::ResponseHeader{0, 0, list.size()}) + list;
    return s.sendAll(head.data(), head.size(), deadline);
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
    // Checked like any access; answer where the bytes are and keep them alive until the next frame.
    std::string list;
    list.reserve(r.tensors.size() * r.runs.size() * 16);
    for (uint32_t t : r.tensors) {
      for (const wire::Run& run : r.runs) {
        uint64_t addr = r.addrs[t] + r.base + run.offset;
        list.append(reinterpret_cast<const char*>(&addr), 8);
        list.append(reinterpret_cast<const char*>(&run.length), 8);
      }
    }
    *pinned = r.keep;
    std::string head = wire::encode(wire::ResponseHeader{0, 0, list.size()}) + list;
    return s.sendAll(head.data(), head.size(), deadline);
  }
  if (is_write) {
    PDLINK_RETURN_IF_ERROR(movePayload(s, false, r.addrs, r.tensors, r.base, r.runs, deadline));
    return sendResponse(s, Status::OK(), deadline);
  }
  wire::ResponseHeader rh{0, 0, payload.value()};
  std::string head = wire::encode(rh);
  std::vector<iovec> iov{{head.data(), head.size()}};
  return movePayload(s, true, r.addrs, r.tensors, r.base, r.runs, deadline, std::move(iov));
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
  if (!link.out().sendv(iov, deadline).ok()) link.breakLink("could not confirm a completed transfer to the peer");
}

void commitPull(Link& link, wire::TargetKind kind, const std::string& body, Deadline deadline) {
  if (usesKeyCommit(kind)) finishAccess(link, wire::Op::kCommit, body, deadline);
}

// An IPC key on the wire: NUL-padded to a fixed size (ACL's keys are 65-byte C strings).
constexpr size_t kIpcKeyBytes = 64;

}  // namespace

Result<std::shared_ptr<Link>> Engine::usableLink(uint64_t peer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!initialized_) return Status(Code::kFailed, "engine is not initialized");
  auto it = links_.find(peer);
  if (it == links_.end()) {
    return Status(Code::kNotYetLink, "no link to " + clusterName(peer) + "; call link_clusters first");
  }
  if (it->second->broken()) {
    return linkDown(*it->second);
  }
  return it->second;
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
  Status st = link->out().sendv(iov, deadline);
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
  auto payload = p.remote.payloadBytes();
  if (!payload.ok()) return payload.status();
  p.payload = payload.value();
  // The request must fit one frame (wire::kMaxBodyBytes): about 4 million block runs.
  const uint64_t body_bytes = 64 + 4 * uint64_t{p.remote.tensors.size()} + 16 * uint64_t{p.remote.runs.size()};
  if (body_bytes > wire::kMaxBodyBytes) {
    return Status(Code::kParamInvalid, "too many block runs in one transfer (" + std::to_string(p.remote.runs.size()) +
                                           "); split it into several calls");
  }
  return p;
}

Status Engine::pull(const TransferSpec& spec) { return transfer(spec, false); }
Status Engine::push(const TransferSpec& spec) { return transfer(spec, true); }

Status Engine::transfer(const TransferSpec& spec, bool is_push) {
  auto link_r = usableLink(spec.peer_cluster_id);
  if (!link_r.ok()) return link_r.status();
  auto p_r = plan(spec, is_push);
  if (!p_r.ok()) return p_r.status();
  std::shared_ptr<Link> link = link_r.value();
  Plan& p = p_r.value();
  const char* what = is_push ? "push to" : "pull from";

  std::lock_guard<std::mutex> out(link->outMutex());
  if (link->broken()) {  // broke while we waited for the channel
    return linkDown(*link);
  }
  Deadline deadline = Deadline::afterMs(config_.sync_timeout_ms);
  if (device_transport_ && p.local->layout.placement == Placement::kDevice) {
    return deviceTransfer(link, p, is_push, deadline, what);
  }
  if (link->direct()) return directTransfer(link, p, is_push, deadline, what);
  Socket& s = link->out();
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
  commitPull(*link, p.remote.target.kind, body, deadline);
  return Status::OK();
}

Status Engine::directTransfer(const std::shared_ptr<Link>& link, Plan& p, bool is_push, Deadline deadline,
                              const char* what) {
  Link::Direct& d = link->directState();
  Socket& s = link->out();
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
        if (rh.payload_len > wire::kMaxBodyBytes) return failTransfer(link, Status(Code::kLinkFailed, "oversized descriptor"), what);
        std::string payload(rh.payload_len, '\0');
        st = s.recvAll(payload.data(), payload.size(), deadline);
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
      std::vector<iovec> lv{{&g1, 8}}, rv{{reinterpret_cast<void*>(d.gen_addr), 8}};
      size_t k = 0;
      for (uint32_t t : p.remote.tensors) {
        for (const wire::Run& r : p.remote.runs) {
          lv.push_back(local[k++]);
          rv.push_back({reinterpret_cast<void*>(c.addrs[t] + r.offset), static_cast<size_t>(r.length)});
        }
      }
      lv.push_back({&g2, 8});
      rv.push_back({reinterpret_cast<void*>(d.gen_addr), 8});
      Status st = cma::copy(d.pid, false, lv, rv);
      if (st.ok() && g1 == c.generation && g2 == c.generation) return Status::OK();
      if (!st.ok() && st.code() == Code::kLinkFailed) return failTransfer(link, st, what);
      d.descriptors.erase(it);  // stale or unmapped: the peer's caches changed
    }
  }

  // Checked round trip: the peer validates and pins the target and answers with its addresses.
  encoded();
  wire::ResponseHeader rh;
  Status st = request(link, wire::RequestHeader{is_push ? wire::Op::kWrite : wire::Op::kRead,
                                                static_cast<uint32_t>(body.size()), 0, wire::kFlagDirect},
                      body, deadline, what, &rh);
  if (!st.ok()) return st;
  if (rh.payload_len != local.size() * 16) {
    return failTransfer(link, Status(Code::kLinkFailed, "peer answered " + std::to_string(rh.payload_len / 16) +
                                                            " ranges, expected " + std::to_string(local.size())),
                        what);
  }
  std::vector<uint64_t> list(local.size() * 2);
  st = s.recvAll(list.data(), rh.payload_len, deadline);
  if (!st.ok()) return failTransfer(link, st, what);
  std::vector<iovec> remote_iov(local.size());
  for (size_t i = 0; i < local.size(); ++i) {
    if (list[2 * i + 1] != local[i].iov_len) {
      return failTransfer(link, Status(Code::kLinkFailed, "peer answered a range of the wrong length"), what);
    }
    remote_iov[i] = {reinterpret_cast<void*>(list[2 * i]), local[i].iov_len};
  }
  Status copied = cma::copy(d.pid, is_push, local, remote_iov);
  // Unpin on the peer; for a completed read by request key this is also the release of the key.
  bool commit = copied.ok() && !is_push && usesKeyCommit(target.kind);
  finishAccess(*link, commit ? wire::Op::kCommit : wire::Op::kRelease, body, deadline);
  if (!copied.ok()) {
    if (copied.code() == Code::kLinkFailed) return failTransfer(link, copied, what);
    return Status(copied.code(), std::string(what) + " " + clusterName(link->peer()) + ": " + copied.message());
  }
  return Status::OK();
}

// ---------------------------------------------------------------- device channels

Status Engine::serveDeviceChannel(const std::shared_ptr<Link>& link, const std::vector<uint8_t>& rendezvous,
                                  Deadline deadline) {
  Socket& s = link->in();
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
  std::string head = wire::encode(wire::ResponseHeader{0, 0, 1});
  head.push_back(static_cast<char>(agreed));
  PDLINK_RETURN_IF_ERROR(s.sendAll(head.data(), head.size(), deadline));
  auto channel = backend_->joinChannel(std::string(rendezvous.begin(), rendezvous.end() - 1), false);
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
  uint8_t agreed = 0;
  if (rh.payload_len != 1 || !link->out().recvAll(&agreed, 1, deadline).ok()) {
    return failTransfer(link, Status(Code::kLinkFailed, "malformed device channel answer"), what);
  }
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
  commitPull(*link, p.remote.target.kind, body, deadline);
  return Status::OK();
}

// ---------------------------------------------------------------- same-host IPC

Status Engine::serveIpc(Socket& s, const Resolved& r, Deadline deadline, std::vector<std::string>* exported) {
  if (!ipc_) {
    return sendResponse(s, Status(Code::kFeatureNotEnabled, "the peer's runtime cannot share device memory (IPC)"),
                        deadline);
  }
  // One export per tensor, spanning its runs; the requester gets each run's offset in it.
  uint64_t lo = UINT64_MAX, hi = 0;
  for (const wire::Run& run : r.runs) {
    lo = std::min(lo, run.offset);
    hi = std::max(hi, run.offset + run.length);
  }
  std::string payload;
  payload.reserve(r.tensors.size() * (kIpcKeyBytes + 8 * r.runs.size()));
  for (uint32_t t : r.tensors) {
    auto key = backend_->exportMemory(r.addrs[t] + r.base + lo, hi - lo);
    if (key.ok() && key.value().size() > kIpcKeyBytes) key = Status(Code::kFailed, "IPC key longer than 64 bytes");
    if (!key.ok()) return sendResponse(s, key.status(), deadline);  // exported so far: closed at the next frame
    exported->push_back(key.value());
    std::string padded = key.value();
    padded.resize(kIpcKeyBytes, '\0');
    payload += padded;
  }
  for (size_t i = 0; i < r.tensors.size(); ++i) {
    for (const wire::Run& run : r.runs) {
      uint64_t off = run.offset - lo;
      payload.append(reinterpret_cast<const char*>(&off), 8);
    }
  }
  std::string head = wire::encode(wire::ResponseHeader{0, 0, payload.size()}) + payload;
  return s.sendAll(head.data(), head.size(), deadline);
}

Status Engine::ipcTransfer(const std::shared_ptr<Link>& link, Plan& p, const std::string& body, bool is_push,
                           Deadline deadline, const char* what) {
  wire::ResponseHeader rh;
  Status st = requestAccess(link, body, is_push, wire::kFlagDevice | wire::kFlagDirect, deadline, what, &rh);
  if (!st.ok()) return st;  // refused (kFeatureNotEnabled: no IPC there), or the link failed
  const size_t nt = p.remote.tensors.size(), nr = p.remote.runs.size();
  if (rh.payload_len != nt * (kIpcKeyBytes + 8 * nr)) {
    return failTransfer(link, Status(Code::kLinkFailed, "peer answered an IPC description of the wrong size"), what);
  }
  std::string payload(rh.payload_len, '\0');
  st = link->out().recvAll(payload.data(), payload.size(), deadline);
  if (!st.ok()) return failTransfer(link, st, what);

  std::vector<std::string> imported;
  std::vector<DeviceCopy> copies;
  copies.reserve(nt * nr);
  Status copied;
  for (size_t i = 0; i < nt && copied.ok(); ++i) {
    std::string key(payload.data() + i * kIpcKeyBytes, kIpcKeyBytes);
    key.resize(key.find('\0') == std::string::npos ? kIpcKeyBytes : key.find('\0'));
    auto base = backend_->importMemory(key);
    if (!base.ok()) {
      copied = base.status();
      break;
    }
    imported.push_back(key);
    const char* offs = payload.data() + nt * kIpcKeyBytes + i * nr * 8;
    const uint64_t local_base = p.local->addrs[p.local_tensors[i]];
    for (size_t j = 0; j < nr; ++j) {
      uint64_t off;
      std::memcpy(&off, offs + j * 8, 8);
      uint64_t local = local_base + p.local_runs[j].offset, remote = base.value() + off;
      copies.push_back(is_push ? DeviceCopy{remote, local, p.local_runs[j].length}
                               : DeviceCopy{local, remote, p.local_runs[j].length});
    }
  }
  if (copied.ok()) copied = backend_->copyDevice(copies, deadline);
  for (const std::string& key : imported) backend_->closeImport(key);
  // Unpin on the peer (and close its exports); for a completed read by request key this is also
  // the release of the key.
  const bool commit = copied.ok() && !is_push && usesKeyCommit(p.remote.target.kind);
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
  if (rh.payload_len != local.size() * 8) {
    return failTransfer(link, Status(Code::kLinkFailed, "peer answered " + std::to_string(rh.payload_len / 8) +
                                                            " addresses, expected " + std::to_string(local.size())),
                        what);
  }
  std::vector<uint64_t> remote(local.size());
  st = link->out().recvAll(remote.data(), rh.payload_len, deadline);
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
  const bool commit = !is_push && usesKeyCommit(p.remote.target.kind);
  finishAccess(*link, commit ? wire::Op::kCommit : wire::Op::kRelease, body, deadline);
  return Status::OK();
}

}  // namespace pdlink
