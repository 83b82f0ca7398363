// KV handoffs (engine/offers.h; docs/native_api.md, "Handoffs"): the Engine facade's calls, and the
// kHandoff frame's two halves (RequestServer::sendHandoff, RequestServer::serveHandoff).
#include <algorithm>

#include "core/log.h"
#include "engine/engine.h"
#include "engine/engine_internal.h"
#include "engine/request_server.h"

namespace pdlink {

using detail::linkDown;

// ---------------------------------------------------------------- the frame

Status RequestServer::sendHandoff(uint64_t cluster_id, const wire::HandoffBody& handoff, int64_t timeout_ms) {
  if (timeout_ms <= 0) return Status(Code::kParamInvalid, "the timeout must be positive");
  auto link_r = links_.usableLink(cluster_id);
  if (!link_r.ok()) return link_r.status();
  std::shared_ptr<Link> link = link_r.value();
  const std::string body = wire::encode(handoff);
  std::lock_guard<std::mutex> out(link->outMutex());
  if (link->broken()) return linkDown(*link);
  wire::ResponseHeader rh;
  Status st = request(*link, wire::RequestHeader{wire::Op::kHandoff, static_cast<uint32_t>(body.size()), 0}, body,
                      Deadline::afterMs(timeout_ms), "telling", &rh);
  if (st.ok() && rh.payload_len != 0) {
    st = failTransfer(*link, Status(Code::kLinkFailed, "malformed answer to a handoff frame"), "telling");
  }
  return st;
}

Status RequestServer::serveHandoff(const std::shared_ptr<Link>& link, Stream& s, const std::string& body,
                                   Deadline deadline) {
  wire::HandoffBody handoff;
  Status st = wire::decode(reinterpret_cast<const uint8_t*>(body.data()), body.size(), &handoff);
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropping link to " << clusterName(link->peer()) << ": " << st.message());
    return st;
  }
  if (handoff.kind == wire::HandoffBody::kAbort) {
    s_.offers.peerAborted(link, link->peer(), detail::shareSource(*link), handoff.request_id, handoff.reason);
  } else {
    s_.offers.hold(link, link->peer(), handoff.offers);
  }
  return sendResponse(s, Status::OK(), deadline);
}

// ---------------------------------------------------------------- the facade

Result<OfferTicket> Engine::offer(int64_t cache_id, std::vector<int64_t> blocks, std::string request_id,
                                  int64_t lease_ms) {
  if (!initialized()) return Status(Code::kFailed, Scope::kEngine, "the engine is not initialized");
  if (state_.switchPending()) return state_.switchingStatus();
  auto cache = state_.registry.get(cache_id);
  if (!cache.ok()) return cache.status();
  return state_.offers.offer(cache.value(), std::move(blocks), std::move(request_id), lease_ms);
}

Status Engine::claim(const ClaimSpec& c) {
  auto aborted = [&](const char* when) {
    return Status(Code::kOfferReleased, Scope::kCall,
                  "request " + c.request_id + " was aborted by " + clusterName(c.peer) + " " + when);
  };
  // An abort fails the claims over the link it arrived on, the one this claim pulls through: an
  // abort from another link under the same cluster id (a stranger claiming it) fails nothing here.
  // (No link: nothing can have arrived on it; the pull answers why.)
  auto link_r = link_manager_.usableLink(c.peer);
  const std::shared_ptr<Link> link = link_r.ok() ? link_r.value() : nullptr;
  if (state_.offers.abortedBy(link, c.request_id)) return aborted("before the claim");
  if (c.local_blocks.size() != c.remote_blocks.size()) {
    return Status(Code::kParamInvalid, "a claim lands as many blocks as the ticket offers (" +
                                           std::to_string(c.remote_blocks.size()) + "), got " +
                                           std::to_string(c.local_blocks.size()));
  }
  TransferSpec spec;
  spec.peer_cluster_id = c.peer;
  spec.target.kind = wire::TargetKind::kOffer;
  spec.target.model_id = c.key;
  spec.target.req_id = c.offer_id;
  spec.target.prefix_id = c.generation;
  spec.local_cache_id = c.local_cache_id;
  spec.mode = TransferSpec::Mode::kBlocksToBlocks;
  spec.local_blocks = c.local_blocks;
  spec.remote_blocks = c.remote_blocks;
  spec.timeout_ms = c.timeout_ms;
  spec.cancel = c.cancel;
  PDLINK_RETURN_IF_ERROR(transfers_.pull(spec));
  if (state_.offers.abortedBy(link, c.request_id)) return aborted("while the claim ran");
  return Status::OK();
}

Status Engine::abort(const std::string& request_id, std::optional<uint64_t> peer, const std::string& reason,
                     int64_t timeout_ms) {
  if (request_id.size() > limits::kMaxHandoffRequestIdBytes || reason.size() > limits::kMaxHandoffReasonBytes) {
    return Status(Code::kParamInvalid, "a request id and a reason have at most " +
                                           std::to_string(limits::kMaxHandoffRequestIdBytes) + " bytes each");
  }
  if (!wire::isUtf8(request_id.data(), request_id.size()) || !wire::isUtf8(reason.data(), reason.size())) {
    return Status(Code::kParamInvalid,
                  "a request id and a reason are UTF-8 text (a peer drops a link that sends other)");
  }
  state_.offers.releaseRequest(request_id, OfferReason::kAborted, nullptr);
  wire::HandoffBody body;
  body.kind = wire::HandoffBody::kAbort;
  body.request_id = request_id;
  body.reason = reason;
  if (peer) return server_.sendHandoff(*peer, body, timeout_ms);
  for (const LinkInfo& link : links()) {
    if (link.broken) continue;
    Status st = server_.sendHandoff(link.peer_cluster_id, body, timeout_ms);
    if (!st.ok())
      PDLINK_LOG(kInfo, "could not tell " << clusterName(link.peer_cluster_id) << " of an abort: " << st.message());
  }
  return Status::OK();
}

Status Engine::hold(uint64_t peer, const std::vector<std::pair<uint64_t, uint64_t>>& offers, int64_t timeout_ms) {
  if (offers.size() > limits::kMaxHoldOffers) {
    return Status(Code::kParamInvalid, "one hold names at most " + std::to_string(limits::kMaxHoldOffers) + " offers");
  }
  wire::HandoffBody body;
  body.kind = wire::HandoffBody::kHold;
  body.offers = offers;
  return server_.sendHandoff(peer, body, timeout_ms);
}

}  // namespace pdlink
