// A link's device channels (transport/device/device_channel.h).
#include "transport/device/device_channel.h"

#include <algorithm>

#include "core/log.h"
#include "transport/frames.h"

namespace pdlink::device {

namespace {

// The slot of both directions' channels on every link (one state per side).
const PathSlot kChannelSlot{"device channel"};

struct ChannelState : PathLinkState {
  explicit ChannelState(std::unique_ptr<DeviceChannel> c) : channel(std::move(c)) {}
  std::unique_ptr<DeviceChannel> channel;
};

DeviceChannel* channelOf(PathLinkState* state) {
  return state ? static_cast<ChannelState*>(state)->channel.get() : nullptr;
}

}  // namespace

DeviceChannel* outChannel(const Link& link) { return channelOf(link.outState(kChannelSlot)); }
void dropOutChannel(Link& link) { link.setOutState(kChannelSlot, nullptr); }
DeviceChannel* inChannel(const Link& link) { return channelOf(link.inState(kChannelSlot)); }
void dropInChannel(Link& link) { link.setInState(kChannelSlot, nullptr); }

Status ensureOutChannel(Link& link, const PathEnv& env, Deadline deadline, const char* what) {
  if (outChannel(link)) return Status::OK();
  auto rendezvous = env.backend.newRendezvous();
  if (!rendezvous.ok()) return rendezvous.status();
  const std::string& rv = rendezvous.value();
  // One-sided access is offered when this runtime has it; the peer agrees when its runtime has it
  // too (and its configuration allows it).
  const bool offer = env.config_one_sided && env.one_sided;
  std::string body = wire::pathConnectBody(kChannelPath, rv + static_cast<char>(offer ? wire::kChannelOneSided : 0));
  wire::ResponseHeader rh;
  Status st = request(link, wire::RequestHeader{wire::Op::kPathConnect, static_cast<uint32_t>(body.size()), 0}, body,
                      deadline, what, &rh);
  if (!st.ok()) return st;  // refused (no device channels there): the link itself is fine
  std::string answer;
  const uint8_t offered = offer ? wire::kChannelOneSided : 0;
  if (rh.payload_len != 1 || !readAnswer(link.out(), 1, 1, deadline, &answer, "device channel answer").ok() ||
      (static_cast<uint8_t>(answer[0]) & ~offered) != 0) {
    return failTransfer(link, Status(Code::kLinkFailed, "malformed device channel answer"), what);
  }
  const uint8_t agreed = static_cast<uint8_t>(answer[0]);
  auto channel = env.backend.joinChannel(rv, true);
  if (channel.ok() && (agreed & wire::kChannelOneSided)) {
    st = channel.value()->prepare(env.prepared_regions(), std::max(1, deadline.remainingMsForPoll() / 1000));
    if (!st.ok()) channel = st;
  }
  if (!channel.ok()) return failTransfer(link, channel.status(), what);  // the peer's half is in an unknown state
  link.setOutState(kChannelSlot, std::make_unique<ChannelState>(std::move(channel.value())));
  return Status::OK();
}

Status answerChannel(Link& link, Stream& s, const std::string& rendezvous, const PathEnv& env, Deadline deadline) {
  if (!env.device_transport) {
    return sendResponse(s,
                        Status(Code::kFeatureNotEnabled,
                               std::string("the peer's backend (") + env.backend.name() + ") has no device channels"),
                        deadline);
  }
  if (rendezvous.empty()) return sendResponse(s, Status(Code::kParamInvalid, "empty device channel request"), deadline);
  const uint8_t wanted = rendezvous.back();  // channel options (wire::kChannelOneSided)
  // Accept first, then join: the requester joins only after this answer, so a refusal never
  // leaves it waiting in the vendor's communicator setup. The answer says which options apply.
  const uint8_t agreed = wanted & (env.config_one_sided ? wire::kChannelOneSided : 0);
  PDLINK_RETURN_IF_ERROR(sendAnswer(s, std::string(1, static_cast<char>(agreed)), deadline));
  auto channel = env.backend.joinChannel(rendezvous.substr(0, rendezvous.size() - 1), false);
  if (channel.ok() && (agreed & wire::kChannelOneSided)) {
    Status st = channel.value()->prepare(env.prepared_regions(), std::max(1, deadline.remainingMsForPoll() / 1000));
    if (!st.ok()) channel = st;
  }
  if (!channel.ok()) {
    PDLINK_LOG(kWarn, "device channel from " << clusterName(link.peer()) << ": " << channel.status().message());
    return channel.status();
  }
  link.setInState(kChannelSlot, std::make_unique<ChannelState>(std::move(channel.value())));
  PDLINK_LOG(kDebug, "device channel from " << clusterName(link.peer()) << " ready");
  return Status::OK();
}

}  // namespace pdlink::device
