// The device-channel paths, two-sided and one-sided (transport/device/hccl_path.h).
#include "transport/device/hccl_path.h"

#include "transport/device/device_channel.h"
#include "transport/frames.h"

namespace pdlink {

namespace {

std::vector<Segment> localPieces(const TransferPlan& p) {
  return pieces(p.local_addrs, p.local_tensors, 0, p.local_runs);
}

}  // namespace

HcclPath::HcclPath() {
  caps_.name = "hccl";
  caps_.request_flags = wire::kFlagDevice;
  caps_.cross_host = true;
  caps_.device_memory = true;
  caps_.device_channel = true;
}

Status HcclPath::connect(Link& link, const PathEnv& env, Deadline deadline, const char* what) {
  return device::ensureOutChannel(link, env, deadline, what);
}

bool HcclPath::usable(const Link& link) const { return device::outChannel(link) != nullptr; }

Status HcclPath::transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) {
  const std::string body = wire::encode(p.remote);
  wire::ResponseHeader rh;
  Status st = requestAccess(link, body, is_push, wire::kFlagDevice, deadline, what, &rh);
  if (!st.ok()) return st;  // the peer refused the access, or the link failed
  if (rh.payload_len != 0) return failTransfer(link, Status(Code::kLinkFailed, "unexpected payload"), what);
  DeviceChannel* channel = device::outChannel(link);
  const std::vector<Segment> segments = localPieces(p);
  st = is_push ? channel->send(segments, deadline) : channel->recv(segments, deadline);
  if (!st.ok()) {
    device::dropOutChannel(link);
    return failTransfer(link, st, what);
  }
  if (is_push) return awaitResponse(link, deadline, what, &rh);  // stored on the peer
  commitPull(link, p, body, deadline);
  return Status::OK();
}

Status HcclServer::serve(ServeCall& call) {
  DeviceChannel* channel = device::inChannel(call.link);
  if (!channel) {
    return sendResponse(call.stream, Status(Code::kFailed, "no device channel on this link"), call.deadline);
  }
  const std::vector<Segment> segments = pieces(call.addrs, call.tensors, call.base, call.runs);
  PDLINK_RETURN_IF_ERROR(sendResponse(call.stream, Status::OK(), call.deadline));
  const bool is_write = call.header.op == wire::Op::kWrite;
  Status moved = is_write ? channel->recv(segments, call.deadline) : channel->send(segments, call.deadline);
  if (!moved.ok()) {  // the channel (and so the link) can no longer be trusted
    device::dropInChannel(call.link);
    return moved;
  }
  return is_write ? sendResponse(call.stream, Status::OK(), call.deadline) : Status::OK();
}

OneSidedPath::OneSidedPath() {
  caps_.name = "hccl-one-sided";
  caps_.request_flags = wire::kFlagDevice | wire::kFlagOneSided;
  caps_.cross_host = true;
  caps_.one_sided = true;
  caps_.device_memory = true;
  caps_.device_channel = true;
}

Status OneSidedPath::connect(Link& link, const PathEnv& env, Deadline deadline, const char* what) {
  return device::ensureOutChannel(link, env, deadline, what);
}

bool OneSidedPath::usable(const Link& link) const {
  return device::outChannel(link) && device::outChannel(link)->canPrepare();
}

Status OneSidedPath::transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) {
  DeviceChannel* channel = device::outChannel(link);
  const std::vector<Segment> local = localPieces(p);
  for (const Segment& seg : local) {
    if (!channel->prepared(seg.addr, seg.length)) {
      return Status(Code::kFeatureNotEnabled, "local memory not prepared for one-sided access");
    }
  }
  const std::string body = wire::encode(p.remote);
  wire::ResponseHeader rh;
  Status st = requestAccess(link, body, is_push, wire::kFlagDevice | wire::kFlagOneSided, deadline, what, &rh);
  if (!st.ok()) return st;  // refused (kFeatureNotEnabled: not prepared there), or the link failed
  std::vector<uint64_t> remote;
  std::string payload;
  if (rh.payload_len != local.size() * 8) {
    st = Status(Code::kLinkFailed, "peer answered " + std::to_string(rh.payload_len / 8) + " addresses, expected " +
                                       std::to_string(local.size()));
  } else {
    st = readAnswer(link.out(), rh.payload_len, rh.payload_len, deadline, &payload, "address list");
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
    device::dropOutChannel(link);
    return failTransfer(link, moved, what);  // unpins on the peer too: its serving thread sees the link go
  }
  // Unpin on the peer; for a completed read by request key this is also the release of the key.
  finishPinned(link, p, true, is_push, body, deadline);
  return Status::OK();
}

Status OneSidedServer::serve(ServeCall& call) {
  // The addresses of exactly the checked ranges, each inside memory this side's channel prepared;
  // kept pinned until the peer's next frame.
  DeviceChannel* channel = device::inChannel(call.link);
  std::string list;
  for (const Segment& piece : pieces(call.addrs, call.tensors, call.base, call.runs)) {  // bounded: kMaxRequestPieces
    if (!channel || !channel->prepared(piece.addr, piece.length)) {
      return sendResponse(call.stream,
                          Status(Code::kFeatureNotEnabled, "not in the memory prepared for one-sided access"),
                          call.deadline);
    }
    list.append(reinterpret_cast<const char*>(&piece.addr), 8);
  }
  call.pin = true;
  return sendAnswer(call.stream, list, call.deadline);
}

PathEntry hcclEntry(const BackendOffer& offer) {
  PathEntry e;
  e.shared = std::make_unique<HcclPath>();
  e.caps = e.shared->caps();
  if (offer.device_transport) e.server = std::make_unique<HcclServer>();
  e.applies = [](const LinkFacts& f) { return f.offer.device_transport; };
  // The link's device channel, which the one-sided entry shares: a kPathConnect naming this entry
  // (device::kChannelPath), answered where this backend has none too (the refusal).
  e.max_connect_body = device::kMaxRendezvousBytes;
  e.connect_what = "device channel";
  e.answer = [](const PathEntry&, Link& link, Stream& s, const std::string& body, const PathEnv& env,
                Deadline deadline) { return device::answerChannel(link, s, body, env, deadline); };
  return e;
}

PathEntry oneSidedEntry(const BackendOffer& offer) {
  PathEntry e;
  e.shared = std::make_unique<OneSidedPath>();
  e.caps = e.shared->caps();
  if (offer.one_sided) e.server = std::make_unique<OneSidedServer>();
  e.applies = [](const LinkFacts& f) { return f.config_one_sided && f.offer.one_sided; };
  return e;
}

}  // namespace pdlink
