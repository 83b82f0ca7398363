// A link's device channels (Backend::DeviceChannel; on Ascend, an HCCL communicator), which the
// HCCL paths (transport/device/hccl_path.h) move DEVICE memory over. One per direction, like the
// link's sockets: `out` carries the bytes of this side's requests (this side created it, rank 0),
// `in` those of the peer's requests. Each is a state the link keeps for the device paths
// (Link::outState / inState under kChannelSlot), created on first use and dropped on failure.
//
// Setting one up: the requester sends a wire::Op::kPathConnect frame naming kChannelPath whose
// setup body is a backend rendezvous and one byte of options (wire::kChannelOneSided); the server
// answers with the options it agreed to, then both join (and with one-sided access agreed both
// prepare).
#pragma once

#include <string>

#include "core/deadline.h"
#include "core/status.h"
#include "transport/link.h"
#include "transport/path.h"
#include "transport/wire.h"

namespace pdlink::device {

// The path a device channel's kPathConnect header names: the HCCL entry's request_flags (its entry
// answers the setup; the one-sided entry shares the channel).
constexpr uint8_t kChannelPath = wire::kFlagDevice;
// Setup bodies of device channels (after the kPathConnect header): an HCCL root info (4108 bytes)
// and one byte of options.
constexpr uint32_t kMaxRendezvousBytes = 8192;

// The channel of this side's requests (requires the out mutex) and dropping it (after a failure:
// the channel can no longer be trusted).
DeviceChannel* outChannel(const Link& link);
void dropOutChannel(Link& link);
// The channel of the peer's requests (the serving thread only) and dropping it.
DeviceChannel* inChannel(const Link& link);
void dropInChannel(Link& link);

// The channel of this side's requests on `link`, created on first use (requires the out mutex): a
// rendezvous the peer accepts, then both join. The peer's refusal (no device channels there) comes
// back as its status, the link intact; a malformed answer or a failed join breaks the link.
Status ensureOutChannel(Link& link, const PathEnv& env, Deadline deadline, const char* what);
// Answers a device channel's kPathConnect (`body`: its setup body, the rendezvous and the options
// byte, bounded by the request server) on `link`'s serving thread. Refusals are answered, the link
// kept; non-OK: the link is dropped.
Status answerChannel(Link& link, Stream& s, const std::string& body, const PathEnv& env, Deadline deadline);

}  // namespace pdlink::device
