// Internal helpers shared by the engine's source files (engine.cc, link_manager.cc, handshake.cc,
// request_server.cc, notify.cc, transfers.cc). Not part of the engine's interface; outside
// csrc/engine only the fuzz target includes it (it drives the engine's own serving loop and
// handshake).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "core/crypto.h"
#include "core/status.h"
#include "engine/engine.h"
#include "engine/handshake.h"
#include "transport/frames.h"
#include "transport/link.h"
#include "transport/path.h"
#include "transport/socket.h"
#include "transport/wire.h"

namespace pdlink::detail {

constexpr size_t kMaxPeersPerCall = 16;

// kLinkFailed naming the broken link's reason and what to do about it.
Status linkDown(const Link& link);
Status linkDown(uint64_t peer, const std::string& reason);
// A link another peer wants to take over is found dead only after pings sent with these waits
// for an answer go unanswered (LinkManager::stillAlive): a window of kProbeWindowMs.
constexpr int64_t kProbeWaitsMs[] = {500, 1000, 1500};
constexpr int64_t kProbeWindowMs = 500 + 1000 + 1500;
// kLinkFailed (kParamInvalid stays) for one peer of a connect to several, naming its address.
Status linkError(const PeerAddress& peer, const Status& st);
// The source whose share a link's peer-driven queues count against (unread notifications, queued
// handoff events): an accepted link's source (LinkManager::sourceOf: a local peer's uid, a remote
// one's IP address), so one process linking as many cluster ids gains nothing; a link this side
// dialled is its own source.
inline std::string shareSource(const Link& link) {
  return link.source().empty() ? "cluster " + std::to_string(link.peer()) : link.source();
}

}  // namespace pdlink::detail
