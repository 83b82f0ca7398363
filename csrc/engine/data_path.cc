// Serving a peer's requests and making this side's: admission, planning and the commit rule,
// once for every data path; the paths themselves move the bytes (transport/path.h, transport/*/).
#include "engine/engine.h"

#include <algorithm>
#include <cstring>

#include "core/limits.h"
#include "core/log.h"
#include "core/seeded_bug.h"
#include "engine/engine_internal.h"
#include "transport/path.h"
#include "transport/frames.h"
#include "transport/tcp/stream_path.h"
#include "transport/ucx/ucx_path.h"

namespace pdlink {

using namespace detail;  // NOLINT: this file is part of the engine

// ---------------------------------------------------------------- serving

void Engine::serve(const std::shared_ptr<Link>& link) {
  ServeState state;
  state.pin_epoch = pin_epochs_.take();
  Status st = serveStream(link, link->in(), &state);
  pin_epochs_.give(state.pin_epoch);  // moves first: a copy still running on our pins fails its check
  for (const std::string& key : state.exported) backend_->closeExport(key);
  if (!state.unlinked) {
    std::string why =
        st.message().find("closed by peer") != std::string::npos ? "peer closed the connection" : st.message();
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
  // Flags no path of this engine's table names are malformed, as wire::decode finds every other
  // combination no path names (kFlagTestPath is named only where a test build registered its path).
  if (!paths_.names(h.flags)) return wire::malformed("request");
  // Only reads and writes take flags or a payload (and a describe for direct reads kFlagDirect);
  // which flags depends on what this link and this engine negotiated (admitAccess). A frame
  // outside that is a protocol violation: the link is dropped.
  const bool access = h.op == wire::Op::kRead || h.op == wire::Op::kWrite;
  const bool direct_describe = h.op == wire::Op::kDescribe && h.flags == wire::kFlagDirect;
  if (!access && ((h.flags != 0 && !direct_describe) || h.payload_len != 0)) {
    return Status(Code::kLinkFailed, "flags or payload on a frame that takes none");
  }
  if ((h.op == wire::Op::kPing || h.op == wire::Op::kUnlink) && h.body_len != 0) {
    return Status(Code::kLinkFailed, "a body on a frame that takes none");
  }
  if (h.op == wire::Op::kConfirm && (h.body_len < sizeof(wire::Nonce) || h.body_len > sizeof(wire::Nonce) + 64)) {
    return Status(Code::kLinkFailed, "a link confirmation is one nonce and one endpoint");
  }
  if (h.op == wire::Op::kDeviceChannel && h.body_len > kMaxRendezvousBytes) {
    return Status(Code::kLinkFailed, "oversized device channel request");
  }
  if (h.op == wire::Op::kUcxConnect && h.body_len > wire::kMaxUcxHelloBytes) {
    return Status(Code::kLinkFailed, "oversized ucx connect request");
  }
  if (h.op == wire::Op::kNotify && h.body_len > wire::kMaxNotifyBodyBytes) {
    return Status(Code::kLinkFailed, "oversized notification");
  }
  if (h.op == wire::Op::kRead && h.payload_len != 0) return Status(Code::kLinkFailed, "a payload on a read");
  return Status::OK();
}

Status Engine::admitAccess(const Link& link, const wire::RequestHeader& h) const {
  if (config_.one_way_links && link.initiator()) {  // our own one-way link: the peer may not use it
    return Status(Code::kNotYetLink,
                  "with one-way links only the side that linked reads or writes over a "
                  "link; connect on that side too");
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
  if ((h.flags & wire::kFlagUcx) && !ucx_hub_) return Status(Code::kFeatureNotEnabled, "this engine has no ucx path");
  if ((h.flags & wire::kFlagUcx) && !ucx::isPathOf(ucx_hub_.get(), config_.transport == Transport::kUcx, link)) {
    return ucx::refused(link);
  }
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
      state->pin_epoch->fetch_add(1, std::memory_order_release);
      for (const std::string& key : state->exported) backend_->closeExport(key);
      state->exported.clear();
      state->pinned.clear();
      pins_expired_.fetch_add(1);
      PDLINK_LOG(kInfo, clusterName(link->peer())
                            << " sent nothing for " << pinTimeoutMs() << " ms after a direct access: its pin expired");
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
  if (h.op == wire::Op::kNotify) return serveNotify(*link, s, body, deadline);
  if (h.op == wire::Op::kConfirm) return serveConfirm(*link, s, body, deadline);
  if (h.op == wire::Op::kUcxConnect) {
    auto* ucx_server = static_cast<UcxServer*>(paths_.serverFor(wire::kFlagUcx));  // the ucx entry's
    return answerUcxConnect(ucx_server, config_.transport == Transport::kUcx, *link, s, body, deadline);
  }
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
    // A kRaw target without kFlagDirect asks for the table only (Engine::describeMemory: a peer that
    // can read every registered range learns nothing it could not probe); for direct reads the
    // same-host conditions apply.
    const bool direct = h.flags & wire::kFlagDirect || tb.target.kind != wire::TargetKind::kRaw;
    Status usable = !admitted.ok() ? admitted
                    : direct && !link->sameHost()
                        ? Status(Code::kFeatureNotEnabled, "direct reads need a same-host link")
                    : direct && device_transport_ ? Status(Code::kParamInvalid, "no direct reads here")
                                                  : Status::OK();
    if (usable.ok() && tb.target.kind == wire::TargetKind::kRaw) {
      Result<wire::RawTable> t = registry_.describeRaw();
      if (!t.ok()) return sendResponse(s, t.status(), deadline);
      return sendAnswer(s, wire::encode(t.value()), deadline);
    }
    Result<wire::CacheDescriptor> d =
        !usable.ok() ? Result<wire::CacheDescriptor>(usable)
        : tb.target.kind == wire::TargetKind::kBlocks
            ? registry_.describe(tb.target.model_id)
            : Result<wire::CacheDescriptor>(Status(Code::kParamInvalid, "describe needs a blocks or raw target"));
    if (!d.ok()) return sendResponse(s, d.status(), deadline);
    return sendAnswer(s, wire::encode(d.value()), deadline);
  }
  auto payload = tb.payloadBytes();
  const bool is_write = h.op == wire::Op::kWrite;
  const bool direct = h.flags & wire::kFlagDirect;
  const bool device = h.flags & wire::kFlagDevice;
  const bool in_stream = is_write && h.flags == 0;  // the stream path's: the payload follows in this stream
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
    PDLINK_LOG(kDebug, "rejected " << (is_write ? "write" : "read") << " from " << clusterName(link->peer()) << ": "
                                   << resolved.status().message());
    return refuse(resolved.status());
  }
  const Resolved& r = resolved.value();
  // Device memory is reachable only through the device channel, host memory only without it;
  // except that the stream path stages the DEVICE ranges of a descriptor list (kRaw), which may mix
  // both (hixl moves HOST and DEVICE memory in one batch, either way).
  const bool raw = tb.target.kind == wire::TargetKind::kRaw;
  std::vector<uint8_t> device_runs;  // per run of a kRaw request: in DEVICE memory
  bool all_device = false, any_device = false;
  if (device_transport_ && raw) {
    for (Placement p : r.run_placements) device_runs.push_back(p == Placement::kDevice);
    all_device = std::all_of(device_runs.begin(), device_runs.end(), [](uint8_t d) { return d != 0; });
    any_device = std::any_of(device_runs.begin(), device_runs.end(), [](uint8_t d) { return d != 0; });
  } else if (device_transport_) {
    all_device = any_device = r.keep.front()->layout.placement == Placement::kDevice;
  }
  if (device || !any_device) device_runs.clear();  // staged only on the stream path
  if (device && !all_device) {
    return refuse(raw ? Status(Code::kFeatureNotEnabled,
                               "some of the addressed ranges are host memory: the stream "
                               "path moves them")
                      : Status(Code::kParamInvalid,
                               "the addressed cache is in host memory; a device cache cannot be "
                               "moved to or from it over this link (use placement DEVICE on "
                               "both sides)"));
  }
  if (!device && any_device && (!raw || direct)) {
    return refuse(raw ? Status(Code::kFeatureNotEnabled,
                               "some of the addressed ranges are device memory: the stream "
                               "path moves them")
                      : Status(Code::kParamInvalid,
                               "the addressed cache is in device memory; the other side's cache "
                               "must be in device memory too (placement DEVICE, same backend)"));
  }
  ServeCall call{*link,           s,        h,     r.addrs,         r.tensors,       r.base, r.runs, device_runs,
                 payload.value(), deadline, false, state->exported, state->pin_epoch};
  // The flags name the path (wire::decode lets through only the path combinations): admitted above,
  // served by that path's entry, where this engine has its server.
  PathServer* server = paths_.serverFor(h.flags);
  if (!server) return refuse(Status(Code::kFeatureNotEnabled, "this engine does not serve that path"));
  Status served = server->serve(call);
  if (call.pin) state->pinned = r.keep;  // until the peer's next frame, or the pin bound
  return served;
}

void Engine::choosePaths(Link& link, bool direct) {
  LinkFacts f;
  f.same_host = link.sameHost();
  f.in_process = link.inProcess();
  f.unix_socket = link.outSocket().isUnix();
  if (direct) {
    f.direct = link.peerProcess();
    f.published_addr = link.peerPublishedAddr();
  }
  if (ucx::isPathOf(ucx_hub_.get(), config_.transport == Transport::kUcx, link)) f.ucx = ucx_hub_;
  f.auto_transport = config_.transport == Transport::kAuto;
  f.config_one_sided = config_.one_sided;
  f.offer = BackendOffer{device_transport_, ipc_, one_sided_};
  ChosenPaths chosen = paths_.choose(f);
  link.setPaths(std::move(chosen.host), std::move(chosen.device));
}

// ---------------------------------------------------------------- transfers

Result<std::shared_ptr<Link>> Engine::usableLink(uint64_t peer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!initialized_) return Status(Code::kFailed, "engine is not initialized");
  if (std::shared_ptr<Link> link = links_.forRequests(peer)) return link;
  if (auto why = links_.downReason(peer)) return linkDown(peer, *why);
  return Status(Code::kNotYetLink, "no link to " + clusterName(peer) + "; connect first");
}

namespace {

// Adds the range pair (local offset, remote offset, length) to a plan, merged into the last pair
// when it continues it on both sides (consecutive blocks move as one range).
void appendRun(TransferPlan& p, uint64_t local_offset, uint64_t remote_offset, uint64_t length) {
  if (!p.local_runs.empty() && p.local_runs.back().offset + p.local_runs.back().length == local_offset &&
      p.remote.runs.back().offset + p.remote.runs.back().length == remote_offset) {
    p.local_runs.back().length += length;
    p.remote.runs.back().length += length;
  } else {
    p.local_runs.push_back({local_offset, length});
    p.remote.runs.push_back({remote_offset, length});
  }
}

}  // namespace

Status Engine::planAbsolute(const TransferSpec& spec, Resolved* scratch, TransferPlan* out) {
  if (spec.mode != TransferSpec::Mode::kExplicit) {
    return Status(Code::kParamInvalid, "absolute local addresses need an explicit (descriptor list) transfer");
  }
  if (spec.local_runs.size() != spec.remote_runs.size() || spec.local_runs.empty()) {
    return Status(Code::kParamInvalid, "local and remote run lists must be non-empty and of equal length");
  }
  for (size_t i = 0; i < spec.local_runs.size(); ++i) {
    if (spec.local_runs[i].length != spec.remote_runs[i].length) {
      return Status(Code::kParamInvalid, "descriptor " + std::to_string(i) + ": local and remote lengths differ");
    }
  }
  // The same resolution a peer's raw request gets, against this engine's own registry (every cache,
  // remote accessible or not): each range inside registered memory, or nothing moves. The whole
  // list at once, which may be several requests' worth (execute splits it): no bound on its steps
  // but the list's own (the caller's), each range at most limits::kMaxRawSpan.
  Status resolved = registry_.resolveRaw(spec.local_runs, false, scratch, UINT64_MAX);
  if (!resolved.ok()) return Status(Code::kParamInvalid, "local " + resolved.message());
  TransferPlan& p = *out;
  // Runs in a device backend's DEVICE memory: all of them go over the device paths; some of them,
  // over the stream path, staged (transferPart).
  size_t on_device = 0;
  p.local_device_runs.clear();
  for (Placement placement : scratch->run_placements) {
    const bool device = device_transport_ && placement == Placement::kDevice;
    p.local_device_runs.push_back(device);
    on_device += device;
  }
  if (on_device == 0) p.local_device_runs.clear();
  // The caches stay registered through scratch->keep (the caller's), which p.local points at
  // without owning it.
  p.local = std::shared_ptr<const void>(std::shared_ptr<const void>(), &scratch->keep);
  p.local_absolute = true;
  p.local_addrs.assign(1, 0);  // runs are absolute: tensor 0 at address 0
  p.local_placement = on_device == spec.local_runs.size() ? Placement::kDevice : Placement::kHost;
  p.local_tensors.assign(1, 0);
  p.local_runs.assign(spec.local_runs.begin(), spec.local_runs.end());
  p.remote.target = spec.target;
  p.remote.block_size = 0;
  p.remote.tensors.assign(1, 0);
  p.remote.runs.assign(spec.remote_runs.begin(), spec.remote_runs.end());
  p.commit = true;
  auto payload = p.remote.payloadBytes();
  if (!payload.ok()) return payload.status();
  p.payload = payload.value();
  return Status::OK();
}

Result<TransferPlan> Engine::plan(const TransferSpec& spec, bool is_push) {
  auto local = registry_.get(spec.local_cache_id);
  if (!local.ok()) return local.status();
  TransferPlan p;
  p.local = local.value();
  p.local_addrs = local.value()->addrs;
  p.local_placement = local.value()->layout.placement;
  const CacheLayout& L = local.value()->layout;
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
      if (l.length == 0 || l.length != spec.remote_runs[i].length || __builtin_add_overflow(l.offset, l.length, &end) ||
          end > L.tensor_size) {
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
      return Status(Code::kParamInvalid,
                    "size " + std::to_string(len) + " exceeds the local slot size " + std::to_string(stride));
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
      appendRun(p, static_cast<uint64_t>(lb) * stride, static_cast<uint64_t>(rb) * stride, stride);
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

std::vector<TransferPlan> Engine::split(const TransferPlan& p) {
  // Each request names at most limits::kMaxRequestPieces (tensor, run) pieces, the bound every
  // server applies; a larger transfer becomes several requests of consecutive runs. Only the last
  // one commits a pulled request key.
  const uint64_t runs_per_request = std::max<uint64_t>(1, limits::kMaxRequestPieces / p.remote.tensors.size());
  std::vector<TransferPlan> out;
  for (size_t first = 0; first < p.remote.runs.size(); first += runs_per_request) {
    const size_t last = std::min<size_t>(p.remote.runs.size(), first + runs_per_request);
    TransferPlan c;
    c.local = p.local;
    c.local_absolute = p.local_absolute;
    c.local_addrs = p.local_addrs;
    c.local_placement = p.local_placement;
    c.local_tensors = p.local_tensors;
    c.local_runs.assign(p.local_runs.begin() + first, p.local_runs.begin() + last);
    if (!p.local_device_runs.empty()) {
      c.local_device_runs.assign(p.local_device_runs.begin() + first, p.local_device_runs.begin() + last);
    }
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

Result<wire::RawTable> Engine::describeMemory(uint64_t cluster_id, int64_t timeout_ms) {
  if (timeout_ms <= 0) return Status(Code::kParamInvalid, "the timeout must be positive");
  auto link_r = usableLink(cluster_id);
  if (!link_r.ok()) return link_r.status();
  Link& link = *link_r.value();
  wire::TransferBody tb;
  tb.target.kind = wire::TargetKind::kRaw;
  const std::string body = wire::encode(tb);
  const char* what = "describing the memory of";
  const Deadline deadline = Deadline::afterMs(timeout_ms);
  std::lock_guard<std::mutex> out(link.outMutex());
  if (link.broken()) return linkDown(link);
  wire::ResponseHeader rh;
  PDLINK_RETURN_IF_ERROR(request(link, wire::RequestHeader{wire::Op::kDescribe, static_cast<uint32_t>(body.size()), 0},
                                 body, deadline, what, &rh));
  std::string payload;
  Status st = readAnswer(link.out(), rh.payload_len, wire::kMaxRawTableBytes, deadline, &payload, "memory table");
  wire::RawTable table;
  if (st.ok()) st = wire::decode(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(), &table);
  if (!st.ok()) return failTransfer(link, st, what);
  return table;
}

Status Engine::pull(const TransferSpec& spec) { return transfer(spec, false); }
Status Engine::push(const TransferSpec& spec) { return transfer(spec, true); }

Status Engine::transfer(const TransferSpec& spec, bool is_push) {
  auto link_r = usableLink(spec.peer_cluster_id);
  if (!link_r.ok()) return link_r.status();
  const int64_t timeout_ms = spec.timeout_ms > 0 ? spec.timeout_ms : config_.sync_timeout_ms;
  if (spec.local_absolute) {
    // Descriptor lists are the small, frequent transfers of transfer-engine callers: as post() does,
    // each thread reuses one plan and one resolution, whose vectors keep their capacity (no path
    // keeps a reference to either), and lets go of the local caches when the transfer is over.
    thread_local TransferPlan p;
    thread_local Resolved scratch;
    struct Release {
      TransferPlan& plan;
      Resolved& resolved;
      ~Release() {
        plan.local.reset();
        resolved.keep.clear();
      }
    } release{p, scratch};
    PDLINK_RETURN_IF_ERROR(planAbsolute(spec, &scratch, &p));
    return execute(link_r.value(), p, is_push, timeout_ms);
  }
  auto p_r = plan(spec, is_push);
  if (!p_r.ok()) return p_r.status();
  return execute(link_r.value(), p_r.value(), is_push, timeout_ms);
}

Result<std::shared_ptr<PreparedTransfer>> Engine::prepare(const TransferSpec& spec, uint64_t block_size,
                                                          uint64_t remote_base, uint64_t remote_bytes) {
  const bool raw = spec.target.kind == wire::TargetKind::kRaw;
  if (!raw && spec.target.kind != wire::TargetKind::kBlocks) {
    return Status(Code::kParamInvalid, "a prepared transfer addresses a blocks cache by key, or registered memory");
  }
  // The generation is read before the cache is looked up: a change in between makes the first
  // post check again.
  const uint64_t generation = registry_.published()->generation.load(std::memory_order_acquire);
  auto local = registry_.get(spec.local_cache_id);
  if (!local.ok()) return local.status();
  const CacheLayout& L = local.value()->layout;
  if (block_size == 0) block_size = L.stride();
  if (block_size == 0 || L.tensor_size % block_size != 0) {
    return Status(Code::kParamInvalid, "block size " + std::to_string(block_size) +
                                           " does not divide the local tensors (" + std::to_string(L.tensor_size) +
                                           " bytes)");
  }
  auto p = std::make_shared<PreparedTransfer>();
  p->peer_cluster_id = spec.peer_cluster_id;
  p->target = spec.target;
  p->local_cache_id = spec.local_cache_id;
  p->block_size = block_size;
  p->local_blocks = L.tensor_size / block_size;
  if (spec.local_tensors.size() != spec.remote_tensors.size()) {
    return Status(Code::kParamInvalid, "local and remote tensor lists differ in length");
  }
  for (uint32_t t : spec.local_tensors) {
    if (t >= L.num_tensors)
      return Status(Code::kParamInvalid, "local tensor index " + std::to_string(t) + " out of range");
  }
  p->local_tensors = spec.local_tensors;
  p->remote_tensors = spec.remote_tensors;
  const size_t tensors = p->local_tensors.empty() ? L.num_tensors : p->local_tensors.size();
  if (tensors == 0 || tensors > limits::kMaxRequestTensors) {
    return Status(Code::kParamInvalid,
                  "a prepared transfer moves 1 to " + std::to_string(limits::kMaxRequestTensors) + " tensors");
  }
  if (raw) {
    uint64_t end = 0;
    if (tensors != 1) return Status(Code::kParamInvalid, "a transfer to registered memory moves one tensor");
    if (remote_bytes < block_size || __builtin_add_overflow(remote_base, remote_bytes, &end)) {
      return Status(Code::kParamInvalid, "the remote memory is empty, smaller than a block, or wraps");
    }
    p->remote_base = remote_base;
    p->remote_blocks = remote_bytes / block_size;
  }
  p->local = local.value();
  p->generation.store(generation, std::memory_order_release);
  return p;
}

Status Engine::post(PreparedTransfer& prep, const int64_t* local, const int64_t* remote, size_t n, bool is_push) {
  if (n == 0) return Status(Code::kParamInvalid, "the block list is empty");
  auto link_r = usableLink(prep.peer_cluster_id);
  if (!link_r.ok()) return link_r.status();
  // This side: the same cache, unless the registry changed since it was last checked.
  std::shared_ptr<CacheEntry> entry = prep.local.lock();
  const uint64_t now = registry_.published()->generation.load(std::memory_order_acquire);
  if (entry && now != prep.generation.load(std::memory_order_acquire)) {
    auto current = registry_.get(prep.local_cache_id);
    if (!current.ok() || current.value() != entry)
      entry.reset();
    else
      prep.generation.store(now, std::memory_order_release);  // re-prepared: still registered
  }
  if (!entry) {
    return Status(Code::kParamInvalid, "the prepared transfer's local cache " + std::to_string(prep.local_cache_id) +
                                           " is no longer registered; prepare it again");
  }
  // Posts are the small, frequent transfers: each thread reuses one plan, whose vectors keep their
  // capacity, so a post of a few blocks allocates nothing (no path keeps a reference to the plan).
  thread_local TransferPlan p;
  struct Release {  // the plan must not keep the local cache registered past this post
    TransferPlan& plan;
    ~Release() { plan.local.reset(); }
  } release{p};
  p.local_addrs.assign(entry->addrs.begin(), entry->addrs.end());
  p.local_placement = entry->layout.placement;
  p.local = std::move(entry);
  p.local_runs.clear();
  p.local_device_runs.clear();
  p.remote.runs.clear();
  p.commit = true;
  if (prep.local_tensors.empty()) {
    p.local_tensors.clear();
    for (uint32_t t = 0; t < p.local_addrs.size(); ++t) p.local_tensors.push_back(t);
    p.remote.tensors.assign(p.local_tensors.begin(), p.local_tensors.end());
  } else {
    p.local_tensors.assign(prep.local_tensors.begin(), prep.local_tensors.end());
    p.remote.tensors.assign(prep.remote_tensors.begin(), prep.remote_tensors.end());
  }
  p.remote.target = prep.target;
  const bool raw = prep.target.kind == wire::TargetKind::kRaw;
  const uint64_t bs = prep.block_size;
  p.remote.block_size = raw ? 0 : bs;
  const uint64_t max_remote = raw ? prep.remote_blocks : UINT64_MAX / bs;
  for (size_t i = 0; i < n; ++i) {
    const int64_t lb = local[i], rb = remote[i];
    if (lb < 0 || static_cast<uint64_t>(lb) >= prep.local_blocks) {
      return Status(Code::kParamInvalid, "block index " + std::to_string(lb) + " out of range: local cache has " +
                                             std::to_string(prep.local_blocks) + " blocks");
    }
    if (rb < 0 || static_cast<uint64_t>(rb) >= max_remote) {
      return Status(Code::kParamInvalid, "remote block index " + std::to_string(rb) + " out of range");
    }
    appendRun(p, static_cast<uint64_t>(lb) * bs, (raw ? prep.remote_base : 0) + static_cast<uint64_t>(rb) * bs, bs);
  }
  auto payload = p.remote.payloadBytes();
  if (!payload.ok()) return payload.status();
  p.payload = payload.value();
  return execute(link_r.value(), p, is_push, config_.sync_timeout_ms);
}

Status Engine::execute(const std::shared_ptr<Link>& link, TransferPlan& p, bool is_push, int64_t timeout_ms) {
  const char* what = is_push ? "push to" : "pull from";

  std::lock_guard<std::mutex> out(link->outMutex());
  if (link->broken()) {  // broke while we waited for the channel
    return linkDown(*link);
  }
  Deadline deadline = Deadline::afterMs(timeout_ms);
  if (p.remote.pieces() <= limits::kMaxRequestPieces) return transferPart(link, p, is_push, deadline, what);
  for (TransferPlan& part : split(p)) PDLINK_RETURN_IF_ERROR(transferPart(link, part, is_push, deadline, what));
  return Status::OK();
}

Status Engine::transferPart(const std::shared_ptr<Link>& link, TransferPlan& p, bool is_push, Deadline deadline,
                            const char* what) {
  // A descriptor list (local_absolute) of a device backend whose ranges here, or at the peer, mix
  // HOST and DEVICE memory goes over the stream path, each side staging its DEVICE ranges: its
  // DEVICE ranges here are marked in the plan, the peer's show in its refusal of the other paths
  // (kFeatureNotEnabled, nothing moved).
  const bool staged = device_transport_ && p.local_absolute && p.remote.target.kind == wire::TargetKind::kRaw;
  auto fallBack = [&](const Status& st) {
    if (!staged || st.code() != Code::kFeatureNotEnabled || link->broken()) return st;
    return staged_path_->transfer(*link, p, is_push, deadline, what);
  };
  if (!(device_transport_ && p.local_placement == Placement::kDevice)) {
    if (!p.local_device_runs.empty()) return staged_path_->transfer(*link, p, is_push, deadline, what);
    return fallBack(link->hostPath().transfer(*link, p, is_push, deadline, what));
  }
  // DEVICE memory: the link's device paths in order; one that cannot take this transfer (and moved
  // nothing) leaves it to the next.
  Status last(Code::kFeatureNotEnabled, "no data path for device memory on this link");
  const std::vector<DataPath*> paths = link->devicePaths();  // a path may drop itself meanwhile
  for (DataPath* path : paths) {
    if (path->caps().device_channel) {
      // A peer without device channels (a CPU backend) turns the channel down and moves nothing: a
      // descriptor list then goes staged over the stream (fallBack), anything else fails with it.
      Status channel = ensureDeviceChannel(link, deadline, what);
      if (channel.code() == Code::kFeatureNotEnabled && !link->broken()) {
        last = channel;
        continue;
      }
      PDLINK_RETURN_IF_ERROR(channel);
    }
    if (!path->usable(*link)) continue;
    last = path->transfer(*link, p, is_push, deadline, what);
    if (last.code() != Code::kFeatureNotEnabled || link->broken()) return last;
  }
  return fallBack(last);
}

// ---------------------------------------------------------------- device channels

Status Engine::serveDeviceChannel(const std::shared_ptr<Link>& link, Stream& s, const std::string& rendezvous,
                                  Deadline deadline) {
  if (!device_transport_) {
    return sendResponse(s,
                        Status(Code::kFeatureNotEnabled,
                               std::string("the peer's backend (") + backend_->name() + ") has no device channels"),
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
  Status st = request(*link, wire::RequestHeader{wire::Op::kDeviceChannel, static_cast<uint32_t>(body.size()), 0}, body,
                      deadline, what, &rh);
  if (!st.ok()) return st;  // refused (no device channels there): the link itself is fine
  std::string answer;
  const uint8_t offered = offer ? wire::kChannelOneSided : 0;
  if (rh.payload_len != 1 || !readAnswer(link->out(), 1, 1, deadline, &answer, "device channel answer").ok() ||
      (static_cast<uint8_t>(answer[0]) & ~offered) != 0) {
    return failTransfer(*link, Status(Code::kLinkFailed, "malformed device channel answer"), what);
  }
  const uint8_t agreed = static_cast<uint8_t>(answer[0]);
  auto channel = backend_->joinChannel(rv, true);
  if (channel.ok() && (agreed & wire::kChannelOneSided)) {
    st = channel.value()->prepare(preparedRegions(), std::max(1, deadline.remainingMsForPoll() / 1000));
    if (!st.ok()) channel = st;
  }
  if (!channel.ok()) return failTransfer(*link, channel.status(), what);  // the peer's half is in an unknown state
  link->setOutDevice(std::move(channel.value()));
  return Status::OK();
}

std::vector<Segment> Engine::preparedRegions() const {
  std::vector<Segment> out;
  if (device_pool_) out.push_back({device_pool_->base(), device_pool_->capacity()});
  for (auto& [addr, bytes] : registry_.registeredDeviceTensors()) out.push_back({addr, bytes});
  return out;
}

}  // namespace pdlink
