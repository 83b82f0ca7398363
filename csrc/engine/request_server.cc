// RequestServer (engine/request_server.h): a link's serving loop, admission, and the requests
// that are not transfers (ping, unlink, confirm, path connects). Notifications are in notify.cc;
// the data paths' serving halves under transport/ (transport/path.h).
#include "engine/request_server.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "core/limits.h"
#include "core/log.h"
#include "core/seeded_bug.h"
#include "engine/engine_internal.h"
#include "transport/frames.h"
#include "transport/path.h"
#include "transport/ucx/ucx_path.h"

namespace pdlink {

using namespace detail;  // NOLINT: this file is part of the engine

RequestServer::RequestServer(EngineState& state, LinkManager& links) : s_(state), links_(links) {}

// ---------------------------------------------------------------- serving

void RequestServer::serve(const std::shared_ptr<Link>& link) {
  ServeState state;
  state.pin_epoch = s_.pin_epochs.take();
  Status st = serveStream(link, link->in(), &state);
  closeSplit(*link);                    // a split pull of the peer open on this link is over with it
  s_.pin_epochs.give(state.pin_epoch);  // moves first: a copy still running on our pins fails its check
  for (const std::string& key : state.exported) s_.backend->closeExport(key);
  state.offer_pins.clear();
  // The offers bound to this link are released (link_down) as soon as its serving ends: a killed
  // decoder's sockets are closed by its kernel, so this is at once (engine/offers.h).
  s_.offers.linkEnded(link);
  if (!state.unlinked) {
    std::string why =
        st.message().find("closed by peer") != std::string::npos ? "peer closed the connection" : st.message();
    if (!link->broken()) PDLINK_LOG(kInfo, "link to " << clusterName(link->peer()) << " is down: " << why);
    link->breakLink(why);
  }
  // The link's channels are dead: leave a tombstone in its place, so its sockets close as soon as
  // no transfer holds the link any more, and this thread ends.
  links_.retire(link);
}

void RequestServer::serveLane(const std::shared_ptr<Link>& link, Stream& lane) {
  ServeState state;
  state.lane = true;
  Status st = serveStream(link, lane, &state);
  closeSplit(*link);
  if (!link->broken()) {
    PDLINK_LOG(kInfo, "link to " << clusterName(link->peer()) << " is down: a lane ended: " << st.message());
  }
  link->breakLink("a lane of the link ended: " + st.message());
}

Status RequestServer::serveStream(const std::shared_ptr<Link>& link, Stream& in, ServeState* state) {
  in.setEpochWord(&s_.epoch_tag);  // every response carries this engine's epoch tag (wire v7)
  state->pins_held = &s_.pins_held;
  state->pinned_bytes_total = &s_.pinned_bytes;
  Status st;
  while (st.ok() && !state->unlinked) {
    // Nothing a peer sends may take the process down: whatever escapes a frame drops this link.
    try {
      st = serveOne(link, in, state);
    } catch (const std::exception& e) {
      st = Status(Code::kFailed, std::string("serving a request failed: ") + e.what());
      PDLINK_LOG(kWarn, "dropping link to " << clusterName(link->peer()) << ": " << st.message());
    }
    countPins(state);
  }
  return st;
}

void RequestServer::closeSplit(Link& link) {
  if (!link.closeSplit()) return;  // none open, or ended by a rollback (its count already given back)
  s_.served_in_flight.fetch_sub(1, std::memory_order_seq_cst);
  s_.drainNotify();
}

void RequestServer::countPins(ServeState* state) {
  if (state->countPins()) s_.drainNotify();
}

Status RequestServer::serveOne(const std::shared_ptr<Link>& link, Stream& s, ServeState* state) {
  bool expired = false;
  PDLINK_RETURN_IF_ERROR(awaitRequest(*link, s, state, &expired));
  if (expired) return Status::OK();
  // The requester sends its next frame only after its direct or IPC copy finished: unpin on the
  // frame's first byte, so that a peer stalling mid-frame holds no pin past PinTimeoutMs.
  for (const std::string& key : state->exported) s_.backend->closeExport(key);
  state->exported.clear();
  state->pinned.clear();
  state->offer_pins.clear();
  countPins(state);
  // A peer that stalls mid-frame only ties up this link's thread, and only until this deadline.
  Deadline deadline = Deadline::afterMs(std::max<int64_t>(2 * s_.config.sync_timeout_ms, 5000));
  wire::RequestHeader h;
  std::string body;
  const PathEntry* setup = nullptr;
  PDLINK_RETURN_IF_ERROR(readRequest(*link, s, deadline, &h, &body, &setup));
  if (state->lane && !((h.op == wire::Op::kRead || h.op == wire::Op::kWrite) && h.flags == 0)) {
    PDLINK_LOG(kWarn,
               "dropping link to " << clusterName(link->peer()) << ": a frame other than a read or write on a lane");
    return Status(Code::kLinkFailed, "a frame other than a plain read or write on a lane");
  }

  // Reads, writes, describes and path connects are counted while served (what a role switch
  // drains) and refused while a switch is pending; reads, writes and describes fenced by an epoch
  // tag are refused when it is not this engine's (wire v7). The link stays either way.
  // A chunk of a split pull (wire::kMarkSplit) opens the pull on this link unless it is open, counted
  // in served_in_flight until the pull's end frame (or the link's end): a drain waits for the whole
  // pull, and while it drains the open pull's chunks are admitted (continuations), any other request
  // refused. Opened first, then checked, as Admission counts: a drain that starts in between sees
  // the pull open, or the opening chunk sees the drain (refused, the pull closed again).
  const bool counted = h.op == wire::Op::kRead || h.op == wire::Op::kWrite || h.op == wire::Op::kDescribe ||
                       h.op == wire::Op::kPathConnect;
  std::optional<EngineState::Admission> admission;
  Status gate;
  if (counted) {
    bool opened = false, continuation = false, ended = false;
    if (h.split) {  // a plain read (wire::decode)
      const Link::Split found = link->openSplit();
      opened = found == Link::Split::kNone;
      ended = found == Link::Split::kEnded;
      if (opened) s_.served_in_flight.fetch_add(1, std::memory_order_seq_cst);
      continuation = !opened;
    }
    // A read of a KV handoff's offer (target kind kOffer, the body's first byte) is admitted while a
    // switch drains, as a continuation: live offers are what the drain waits for (their claims end
    // them), and the offer table refuses a read of any offer that is not live (engine/offers.h).
    const bool offer_read = h.op == wire::Op::kRead && !body.empty() &&
                            static_cast<uint8_t>(body[0]) == static_cast<uint8_t>(wire::TargetKind::kOffer);
    admission.emplace(s_, s_.served_in_flight, continuation || offer_read);
    const uint32_t ours = s_.epoch_tag.load(std::memory_order_acquire);
    if (!admission->admitted()) {
      if (opened) closeSplit(*link);
      gate = admission->status();
    } else if (ended) {
      // A split pull opened before a drain timeout (docs/architecture.md, "Roles"): its later chunks
      // are refused until its end frame closes it; the requester's pull fails with this code. It no
      // longer counts in served_in_flight (the rollback gave its count back), so it holds no later
      // switch.
      gate = Status(Code::kRoleSwitching, clusterName(s_.config.cluster_id) +
                                              " ended this split pull: a role switch there timed out its drain "
                                              "and rolled back; pull again");
    } else if (h.op != wire::Op::kPathConnect && h.epoch_tag != 0 && h.epoch_tag != ours) {
      gate = Status(Code::kStaleEpoch, "the request was prepared against role epoch tag " +
                                           std::to_string(h.epoch_tag) + ", but " + clusterName(s_.config.cluster_id) +
                                           " is at tag " + std::to_string(ours) + ": prepare it again");
    }
    // A refused request is not served: it stops counting before its refusal is sent, so a peer that
    // reads the refusal sees the drain's count without it.
    if (!gate.ok()) admission.reset();
  }
  if (h.op == wire::Op::kPathConnect && !gate.ok()) return sendResponse(s, gate, deadline);

  Status result;
  if (serveControl(link, s, h, body, setup, deadline, state, &result)) return result;

  wire::TransferBody tb;
  Status st = wire::decode(reinterpret_cast<const uint8_t*>(body.data()), body.size(), &tb);
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropping link to " << clusterName(link->peer()) << ": " << st.message());
    return st;
  }
  if (h.op == wire::Op::kCommit) {
    // A commit releases keys the peer read; over our own one-way link it read nothing.
    if (!admitAccess(*link, h).ok()) return Status::OK();
    // Through an offer: the claim is complete, the offer released (claimed) if from its bound link.
    if (tb.target.kind == wire::TargetKind::kOffer) {
      s_.offers.commit(tb.target, link);
      return Status::OK();
    }
    s_.registry.commitRead(tb.target, tb.tensors);
    return Status::OK();
  }
  if (h.op == wire::Op::kRelease && h.split) {  // the peer's split pull is over
    closeSplit(*link);
    return Status::OK();
  }
  if (h.op == wire::Op::kRelease) return Status::OK();
  if (h.op == wire::Op::kDescribe)
    return gate.ok() ? serveDescribe(*link, s, h, tb, deadline) : sendResponse(s, gate, deadline);
  return serveAccess(link, s, h, tb, deadline, state, gate);
}

Status RequestServer::awaitRequest(const Link& link, Stream& s, ServeState* state, bool* expired) {
  if (state->pinned.empty() && state->exported.empty()) return s.waitReadable(Deadline::never());
  // A direct or IPC access keeps its caches pinned until the peer's next frame, but not longer
  // than the pin bound: a peer that goes silent after asking cannot keep freed memory alive.
  // The pin epoch moves first, so a copy still running fails its check (engine/registry.h).
  Status ready = s.waitReadable(Deadline::afterMs(s_.pinTimeoutMs()));
  if (ready.code() == Code::kTimeout) {
    state->pin_epoch->fetch_add(1, std::memory_order_release);
    for (const std::string& key : state->exported) s_.backend->closeExport(key);
    state->exported.clear();
    state->pinned.clear();
    state->offer_pins.clear();
    countPins(state);
    pins_expired_.fetch_add(1);
    PDLINK_LOG(kInfo, clusterName(link.peer())
                          << " sent nothing for " << s_.pinTimeoutMs() << " ms after a direct access: its pin expired");
    *expired = true;
    return Status::OK();
  }
  return ready;
}

Status RequestServer::readRequest(const Link& link, Stream& s, Deadline deadline, wire::RequestHeader* h,
                                  std::string* body, const PathEntry** setup) {
  *setup = nullptr;
  uint8_t hbuf[wire::kRequestHeaderBytes];
  PDLINK_RETURN_IF_ERROR(s.recvAll(hbuf, sizeof(hbuf), deadline));
  Status st = wire::decode(hbuf, sizeof(hbuf), h);
  if (st.ok()) st = admitHeader(link, *h);
  uint32_t body_len = h->body_len;
  if (st.ok() && h->op == wire::Op::kPathConnect) {
    // The header naming the path comes first (admitHeader checked it is there): the rest is bounded
    // by that path's entry before any of it is read.
    uint8_t path = 0;
    static_assert(wire::kPathConnectHeaderBytes == sizeof(path), "the header is the path's id");
    PDLINK_RETURN_IF_ERROR(s.recvAll(&path, sizeof(path), deadline));
    body_len -= wire::kPathConnectHeaderBytes;
    st = admitSetup(path, body_len, setup);
  }
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropping link to " << clusterName(link.peer()) << ": " << st.message());
    return st;
  }
  PDLINK_RETURN_IF_ERROR(s.readBounded(body_len, wire::kMaxBodyBytes, deadline, body, "request body"));
  // On an authenticated link, nothing of a frame is acted on before its tag checked out.
  return s.checkFrame(deadline);
}

bool RequestServer::serveControl(const std::shared_ptr<Link>& link, Stream& s, const wire::RequestHeader& h,
                                 const std::string& body, const PathEntry* setup, Deadline deadline, ServeState* state,
                                 Status* result) {
  if (h.op == wire::Op::kPing) {
    *result = sendResponse(s, Status::OK(), deadline);
  } else if (h.op == wire::Op::kNotify) {
    *result = serveNotify(*link, s, body, deadline);
  } else if (h.op == wire::Op::kConfirm) {
    *result = serveConfirm(*link, s, body, deadline);
  } else if (h.op == wire::Op::kHandoff) {
    *result = serveHandoff(link, s, body, deadline);
  } else if (h.op == wire::Op::kPathConnect) {
    // A path's setup frame: the path its header names (readRequest found it) answers for itself.
    *result = setup->answer(*setup, *link, s, body, s_.pathEnv(), deadline);
  } else if (h.op == wire::Op::kUnlink) {
    links_.forget(link);
    (void)sendResponse(s, Status::OK(), deadline);
    link->breakLink("unlinked by the peer", LinkDown::kPeerUnlinked);
    state->unlinked = true;
    PDLINK_LOG(kInfo, clusterName(link->peer()) << " unlinked");
    *result = Status::OK();
  } else {
    return false;
  }
  return true;
}

Status RequestServer::serveDescribe(const Link& link, Stream& s, const wire::RequestHeader& h,
                                    const wire::TransferBody& tb, Deadline deadline) {
  // With device memory in play the checked round trip decides (it knows each cache's placement).
  const Status admitted = admitAccess(link, h);
  // A kRaw target without kFlagDirect asks for the table only (Engine::describeMemory: a peer that
  // can read every registered range learns nothing it could not probe); for direct reads the
  // same-host conditions apply.
  const bool direct = h.flags & wire::kFlagDirect || tb.target.kind != wire::TargetKind::kRaw;
  Status usable = !admitted.ok()               ? admitted
                  : direct && !link.sameHost() ? Status(Code::kFeatureNotEnabled, "direct reads need a same-host link")
                  : direct && s_.device_transport ? Status(Code::kParamInvalid, "no direct reads here")
                                                  : Status::OK();
  if (usable.ok() && tb.target.kind == wire::TargetKind::kRaw) {
    Result<wire::RawTable> t = s_.registry.describeRaw();
    if (!t.ok()) return sendResponse(s, t.status(), deadline);
    return sendAnswer(s, wire::encode(t.value()), deadline);
  }
  Result<wire::CacheDescriptor> d =
      !usable.ok() ? Result<wire::CacheDescriptor>(usable)
      : tb.target.kind == wire::TargetKind::kBlocks
          ? s_.registry.describe(tb.target.model_id)
          : Result<wire::CacheDescriptor>(Status(Code::kParamInvalid, "describe needs a blocks or raw target"));
  if (!d.ok()) return sendResponse(s, d.status(), deadline);
  return sendAnswer(s, wire::encode(d.value()), deadline);
}

Status RequestServer::serveAccess(const std::shared_ptr<Link>& link_ptr, Stream& s, const wire::RequestHeader& h,
                                  const wire::TransferBody& tb, Deadline deadline, ServeState* state,
                                  const Status& gate) {
  Link& link = *link_ptr;
  auto payload = tb.payloadBytes();
  const bool is_write = h.op == wire::Op::kWrite;
  const bool in_stream = is_write && h.flags == 0;  // the stream path's: the payload follows in this stream
  if (!payload.ok() || h.payload_len != (in_stream ? payload.value() : 0)) {
    // The stream cannot be resynchronised without a trustworthy length.
    PDLINK_LOG(kWarn, "dropping link to " << clusterName(link.peer()) << ": inconsistent payload length");
    return Status(Code::kLinkFailed, "inconsistent payload length");
  }
  auto refuse = [&](const Status& why) -> Status {
    if (in_stream) PDLINK_RETURN_IF_ERROR(discardPayload(s, h.payload_len, deadline));
    return sendResponse(s, why, deadline);
  };
  if (!gate.ok()) {
    PDLINK_LOG(kDebug, "refused a request from " << clusterName(link.peer()) << ": " << gate.message());
    return refuse(gate);
  }
  if (Status admitted = admitAccess(link, h); !admitted.ok()) {
    PDLINK_LOG(kDebug, "refused a request from " << clusterName(link.peer()) << ": " << admitted.message());
    return refuse(admitted);
  }
  // An offer's reads are checked by the offer table (engine/offers.h): live, its generation, its
  // bound link, every run inside its blocks; the guard counts this read in the offer's `serving`
  // until the response is sent, or, on a pinned access, until the pin ends.
  OfferTable::Guard offer_guard;
  Result<Resolved> resolved = Status(Code::kFailed, "");
  if (tb.target.kind == wire::TargetKind::kOffer) {
    Resolved r;
    Status admitted = is_write ? Status(Code::kParamInvalid, "an offer is read only: writes to it are refused")
                               : s_.offers.admitRead(tb, link_ptr, link.peer(), &offer_guard, &r);
    resolved = admitted.ok() ? Result<Resolved>(std::move(r)) : Result<Resolved>(admitted);
  } else {
    resolved = s_.registry.resolve(tb, is_write);
  }
  if (!resolved.ok()) {
    PDLINK_LOG(kDebug, "rejected " << (is_write ? "write" : "read") << " from " << clusterName(link.peer()) << ": "
                                   << resolved.status().message());
    return refuse(resolved.status());
  }
  const Resolved& r = resolved.value();
  std::vector<uint8_t> device_runs;  // per run of a kRaw request: in DEVICE memory
  if (Status placed = checkPlacement(h, tb, r, &device_runs); !placed.ok()) return refuse(placed);
  ServeCall call{link,
                 s,
                 h,
                 r.addrs,
                 r.tensors,
                 r.base,
                 r.runs,
                 device_runs,
                 payload.value(),
                 deadline,
                 false,
                 state->exported,
                 state->pin_epoch};
  // The flags name the path (wire::decode lets through only the path combinations): admitted above,
  // served by that path's entry, where this engine has its server.
  PathServer* server = s_.paths.serverFor(h.flags);
  if (!server) return refuse(Status(Code::kFeatureNotEnabled, "this engine does not serve that path"));
  Status served = server->serve(call);
  if (call.pin) {  // until the peer's next frame, or the pin bound
    state->pinned = r.keep;
    // What the pin holds: the regions it keeps registered, each once (never more than is registered,
    // however many runs or tensors the request repeats).
    state->pinned_bytes = 0;
    for (const auto& entry : r.keep) state->pinned_bytes += entry->layout.tensor_size * entry->layout.num_tensors;
    if (offer_guard) state->offer_pins.push_back(std::move(offer_guard));
  }
  return served;
}

Status RequestServer::checkPlacement(const wire::RequestHeader& h, const wire::TransferBody& tb, const Resolved& r,
                                     std::vector<uint8_t>* device_runs) const {
  const bool direct = h.flags & wire::kFlagDirect;
  const bool device = h.flags & wire::kFlagDevice;
  // Device memory is reachable only through the device channel, host memory only without it;
  // except that the stream path stages the DEVICE ranges of a descriptor list (kRaw), which may mix
  // both (hixl moves HOST and DEVICE memory in one batch, either way).
  const bool raw = tb.target.kind == wire::TargetKind::kRaw;
  bool all_device = false, any_device = false;
  if (s_.device_transport && raw) {
    for (Placement p : r.run_placements) device_runs->push_back(p == Placement::kDevice);
    all_device = std::all_of(device_runs->begin(), device_runs->end(), [](uint8_t d) { return d != 0; });
    any_device = std::any_of(device_runs->begin(), device_runs->end(), [](uint8_t d) { return d != 0; });
  } else if (s_.device_transport) {
    all_device = any_device = r.keep.front()->layout.placement == Placement::kDevice;
  }
  if (device || !any_device) device_runs->clear();  // staged only on the stream path
  if (device && !all_device) {
    return raw ? Status(Code::kFeatureNotEnabled,
                        "some of the addressed ranges are host memory: the stream "
                        "path moves them")
               : Status(Code::kParamInvalid,
                        "the addressed cache is in host memory; a device cache cannot be "
                        "moved to or from it over this link (use placement DEVICE on "
                        "both sides)");
  }
  if (!device && any_device && (!raw || direct)) {
    return raw ? Status(Code::kFeatureNotEnabled,
                        "some of the addressed ranges are device memory: the stream "
                        "path moves them")
               : Status(Code::kParamInvalid,
                        "the addressed cache is in device memory; the other side's cache "
                        "must be in device memory too (placement DEVICE, same backend)");
  }
  return Status::OK();
}

// ---------------------------------------------------------------- admission

Status RequestServer::admitHeader(const Link& link, const wire::RequestHeader& h) const {
  // Flags no path of this engine's table names are malformed, as wire::decode finds every other
  // combination no path names (kFlagTestPath is named only where a test build registered its path).
  if (!s_.paths.names(h.flags)) return wire::malformed("request");
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
  if (h.op == wire::Op::kPathConnect && h.body_len < wire::kPathConnectHeaderBytes) {
    return Status(Code::kLinkFailed, "a path connect without its header");
  }
  // Past every path's bound (admitSetup checks the named path's once the header is read).
  if (h.op == wire::Op::kPathConnect && h.body_len > wire::kPathConnectHeaderBytes + s_.paths.maxConnectBody()) {
    return Status(Code::kLinkFailed, "oversized path connect request");
  }
  if (h.op == wire::Op::kNotify && h.body_len > wire::kMaxNotifyBodyBytes) {
    return Status(Code::kLinkFailed, "oversized notification");
  }
  if (h.op == wire::Op::kHandoff && (h.body_len == 0 || h.body_len > wire::kMaxHandoffBodyBytes)) {
    return Status(Code::kLinkFailed, "a handoff frame without a body, or oversized");
  }
  if (h.op == wire::Op::kRead && h.payload_len != 0) return Status(Code::kLinkFailed, "a payload on a read");
  return Status::OK();
}

Status RequestServer::admitSetup(uint8_t path, uint32_t setup_len, const PathEntry** setup) const {
  const PathEntry* entry = s_.paths.setupEntry(path);
  if (!entry)
    return Status(Code::kLinkFailed,
                  "a path connect naming path " + std::to_string(path) + ", which has no setup frame");
  if (setup_len > entry->max_connect_body) {
    return Status(Code::kLinkFailed, std::string("oversized ") + entry->connect_what + " request");
  }
  *setup = entry;
  return Status::OK();
}

Status RequestServer::admitAccess(const Link& link, const wire::RequestHeader& h) const {
  if (s_.config.one_way_links && link.initiator()) {  // our own one-way link: the peer may not use it
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
  if (device && direct && !(s_.ipc && link.sameHost())) {
    return Status(Code::kFeatureNotEnabled, "IPC needs a same-host link and a runtime that shares device memory");
  }
  if (one_sided && !s_.one_sided) return Status(Code::kFeatureNotEnabled, "no one-sided access on this runtime");
  if ((h.flags & wire::kFlagUcx) && !s_.ucx_hub) return Status(Code::kFeatureNotEnabled, "this engine has no ucx path");
  if ((h.flags & wire::kFlagUcx) && !ucx::isPathOf(s_.ucx_hub.get(), s_.config.transport == Transport::kUcx, link)) {
    return ucx::refused(link);
  }
  return Status::OK();
}

// ---------------------------------------------------------------- requests that are not transfers

Status RequestServer::serveConfirm(const Link& link, Stream& s, const std::string& body, Deadline deadline) {
  // Ours if this engine dialled the asker with that nonce from that very end (the nonce alone is
  // not enough: every engine this one dials learns it, and may claim this one's id elsewhere).
  wire::Nonce nonce;
  std::memcpy(nonce.data(), body.data(), nonce.size());  // admitHeader checked the size
  const std::string endpoint = body.substr(nonce.size());
  const bool ours = links_.dialledBy(link, nonce, endpoint);
  if (ours) return sendResponse(s, Status::OK(), deadline);
  return sendResponse(
      s, Status(Code::kNotYetLink, "this engine did not dial that link to " + clusterName(s_.config.cluster_id)),
      deadline);
}

}  // namespace pdlink
