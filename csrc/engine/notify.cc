// Notifications: small (name, message) byte strings a peer queues here over its link, taken by the
// application (RequestServer::notify, RequestServer::takeNotifications).
#include <utility>

#include "core/limits.h"
#include "core/log.h"
#include "engine/request_server.h"
#include "engine/engine_internal.h"

namespace pdlink {

using detail::linkDown;

Status RequestServer::notify(uint64_t cluster_id, const std::string& name, const std::string& message,
                             int64_t timeout_ms) {
  // Checked here too, so an oversized notification is the caller's error, not a protocol violation
  // that would cost the link.
  if (name.size() > limits::kMaxNotifyNameBytes || message.size() > limits::kMaxNotifyMessageBytes) {
    return Status(Code::kParamInvalid,
                  "a notification's name may have at most " + std::to_string(limits::kMaxNotifyNameBytes) +
                      " bytes and its message " + std::to_string(limits::kMaxNotifyMessageBytes) + " (got " +
                      std::to_string(name.size()) + " and " + std::to_string(message.size()) + ")");
  }
  if (timeout_ms <= 0) return Status(Code::kParamInvalid, "the notification timeout must be positive");
  auto link_r = links_.usableLink(cluster_id);
  if (!link_r.ok()) return link_r.status();
  std::shared_ptr<Link> link = link_r.value();
  const std::string body = wire::encode(wire::NotifyBody{name, message});
  std::lock_guard<std::mutex> out(link->outMutex());
  if (link->broken()) return linkDown(*link);
  wire::ResponseHeader rh;
  Status st = request(*link, wire::RequestHeader{wire::Op::kNotify, static_cast<uint32_t>(body.size()), 0}, body,
                      Deadline::afterMs(timeout_ms), "notifying", &rh);
  if (st.ok() && rh.payload_len != 0) {
    st = failTransfer(*link, Status(Code::kLinkFailed, "malformed answer to a notification"), "notifying");
  }
  return st;
}

std::vector<Notification> RequestServer::takeNotifications() {
  std::lock_guard<std::mutex> lock(notify_mu_);
  std::vector<Notification> out(std::make_move_iterator(inbox_.queue.begin()),
                                std::make_move_iterator(inbox_.queue.end()));
  inbox_.queue.clear();
  inbox_.per_peer.clear();
  inbox_.per_source.clear();
  inbox_.bytes = 0;
  return out;
}

void RequestServer::clearNotifications() {
  std::lock_guard<std::mutex> inbox(notify_mu_);  // unread notifications go with the links
  inbox_ = Inbox{};
}

void RequestServer::addStats(EngineStats* s) const {
  s->pins_expired = pins_expired_.load();
  std::lock_guard<std::mutex> lock(notify_mu_);
  s->notifications = inbox_.queue.size();
  s->notifications_refused = inbox_.refused;
}

Status RequestServer::serveNotify(const Link& link, Stream& s, const std::string& body, Deadline deadline) {
  wire::NotifyBody nb;
  Status st = wire::decode(reinterpret_cast<const uint8_t*>(body.data()), body.size(), &nb);
  if (!st.ok()) {
    PDLINK_LOG(kWarn, "dropping link to " << clusterName(link.peer()) << ": " << st.message());
    return st;
  }
  if (s_.config.one_way_links && link.initiator()) {  // as admitAccess: our own one-way link
    return sendResponse(s,
                        Status(Code::kNotYetLink,
                               "with one-way links only the side that linked notifies over a "
                               "link; connect on that side too"),
                        deadline);
  }
  const EngineLimits& lim = s_.config.limits;
  const uint64_t bytes = nb.name.size() + nb.message.size();
  Status queued;
  {
    std::lock_guard<std::mutex> lock(notify_mu_);
    Inbox::Share& mine = inbox_.per_peer[link.peer()];
    // A link this side dialled is its own source; an accepted one shares its source's budget.
    const std::string source = detail::shareSource(link);
    uint64_t& from_source = inbox_.per_source[source];
    if (mine.count >= lim.max_notifications_per_link) {
      queued = Status(Code::kLinkBusy, "it holds " + std::to_string(mine.count) +
                                           " unread notifications from this side (its limit per link); retry after "
                                           "it took them");
    } else if (mine.bytes + bytes > lim.max_notification_bytes_per_link) {
      queued = Status(Code::kLinkBusy, "its unread notifications from this side would pass its limit of " +
                                           std::to_string(lim.max_notification_bytes_per_link) +
                                           " bytes per link; retry after it took them");
    } else if (from_source + bytes > lim.max_notification_bytes_per_source) {
      queued = Status(Code::kLinkBusy, "its unread notifications from " + source + " would pass its limit of " +
                                           std::to_string(lim.max_notification_bytes_per_source) +
                                           " bytes per source; retry after it took them");
    } else if (inbox_.bytes + bytes > lim.max_notification_bytes) {
      queued =
          Status(Code::kLinkBusy, "its unread notifications would pass its limit of " +
                                      std::to_string(lim.max_notification_bytes) + " bytes; retry after it took them");
    } else {
      ++mine.count;
      mine.bytes += bytes;
      from_source += bytes;
      inbox_.bytes += bytes;
      inbox_.queue.push_back(Notification{link.peer(), std::move(nb.name), std::move(nb.message)});
    }
    if (!queued.ok()) {
      ++inbox_.refused;
      if (mine.count == 0) inbox_.per_peer.erase(link.peer());
      if (from_source == 0) inbox_.per_source.erase(source);
    }
  }
  return sendResponse(s, queued, deadline);
}

}  // namespace pdlink
