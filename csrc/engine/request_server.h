// RequestServer: serves the requests a peer sends over a link's `in` channel (docs/architecture.md,
// "Data paths": the peer's serving thread), and holds the notifications peers send.
//
// Owns: the notification inbox (EngineLimits::max_notification*) and the count of expired pins. It
// holds no link: the link manager hands it each link to serve (serve, on that link's engine
// thread), and it reaches the link table only through the link manager (forget, retire,
// dialledBy); the registry, the path table and the pin epochs are the engine's (EngineState).
// Admission (admitHeader, admitAccess) is the only place that turns what a peer sent into work,
// with wire's bounded decoders; every check a peer can reach runs before anything is resolved,
// pinned or moved.
//
// Threading: one serving thread per link calls serve (or the fuzzer calls serveStream on its own
// stream); any application thread calls notify and takeNotifications. notify_mu_ is a leaf lock;
// EngineState::mu is taken only inside the link manager's calls. Transfers on one link's `out`
// channel are serialised by its out mutex (notify takes it).
// Errors: a non-OK Status from serving means the channel is unusable (the link is dropped); a
// refusal the link survives is answered on the wire as the peer's error. No exception escapes
// serveStream.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "core/status.h"
#include "engine/engine_state.h"
#include "engine/engine_types.h"
#include "engine/link_manager.h"
#include "transport/link.h"
#include "transport/stream.h"
#include "transport/wire.h"

namespace pdlink {

class RequestServer {
 public:
  RequestServer(EngineState& state, LinkManager& links);
  RequestServer(const RequestServer&) = delete;
  RequestServer& operator=(const RequestServer&) = delete;

  // What a link's serving keeps between requests (Engine::ServeState).
  struct ServeState {
    std::vector<std::shared_ptr<CacheEntry>> pinned;  // what a direct or IPC access of the peer uses
    std::vector<OfferTable::Guard> offer_pins;        // the offers such an access reads (engine/offers.h)
    std::vector<std::string> exported;                // IPC keys exported for it
    bool unlinked = false;                            // the peer unlinked
    PinEpochs::Word* pin_epoch = nullptr;             // this link's (pin_epochs), while it is served
    bool lane = false;                                // a lane: plain reads and writes only
    // EngineState::pins_held (set by serveStream): this link counts 1 there while it holds pins.
    std::atomic<int64_t>* pins_held = nullptr;
    bool pins_counted = false;
    // The bytes of the regions the access now pinned keeps registered (set with `pinned`), and what
    // of it EngineState::pinned_bytes counts (`pinned_bytes_total`, set by serveStream).
    uint64_t pinned_bytes = 0;
    std::atomic<int64_t>* pinned_bytes_total = nullptr;
    int64_t bytes_counted = 0;
    // Brings this link's counts in line with `pinned` and `exported`; true when the pin count changed.
    bool countPins() {
      const bool held = !pinned.empty() || !exported.empty();
      if (!held) pinned_bytes = 0;
      if (pinned_bytes_total && static_cast<int64_t>(pinned_bytes) != bytes_counted) {
        pinned_bytes_total->fetch_add(static_cast<int64_t>(pinned_bytes) - bytes_counted, std::memory_order_relaxed);
        bytes_counted = static_cast<int64_t>(pinned_bytes);
      }
      if (!pins_held || held == pins_counted) return false;
      pins_held->fetch_add(held ? 1 : -1, std::memory_order_seq_cst);
      pins_counted = held;
      return true;
    }
    ServeState() = default;
    ServeState(const ServeState&) = delete;
    ServeState& operator=(const ServeState&) = delete;
    ~ServeState() {
      if (pins_held && pins_counted) pins_held->fetch_sub(1, std::memory_order_seq_cst);
      if (pinned_bytes_total) pinned_bytes_total->fetch_sub(bytes_counted, std::memory_order_relaxed);
    }
  };
  // The link's serving thread: serves its `in` channel until it fails or the peer unlinks, then
  // breaks the link and leaves a tombstone (LinkManager::retire).
  void serve(const std::shared_ptr<Link>& link);
  // A lane's serving thread (Link::addLane): serves plain reads and writes (the stream path's, flags
  // 0) read from `lane` until it fails; any other frame, or the lane's end, breaks the whole link
  // (the requester's transfer on it failed, or the peer broke the protocol).
  void serveLane(const std::shared_ptr<Link>& link, Stream& lane);
  // Serves the requests read from `in` on `link` until `in` fails or a frame drops the link
  // (Engine::serveStream); no exception escapes.
  Status serveStream(const std::shared_ptr<Link>& link, Stream& in, ServeState* state);

  // Sends a kHandoff frame to the peer over this side's link and waits for its answer (as notify).
  Status sendHandoff(uint64_t cluster_id, const wire::HandoffBody& body, int64_t timeout_ms);

  // Notifications (Engine::notify, Engine::takeNotifications).
  Status notify(uint64_t cluster_id, const std::string& name, const std::string& message, int64_t timeout_ms);
  std::vector<Notification> takeNotifications();
  // Drops every unread notification (finalize).
  void clearNotifications();
  // notifications, notifications_refused, pins_expired.
  void addStats(EngineStats* s) const;

 private:
  // Serving one request read from `s`; a non-OK result means the channel is unusable. Its steps:
  Status serveOne(const std::shared_ptr<Link>& link, Stream& s, ServeState* state);
  // Waits for the peer's next frame; with pins held, at most the pin bound: past it the pins are
  // released (*expired, OK) and serveOne ends without reading.
  Status awaitRequest(const Link& link, Stream& s, ServeState* state, bool* expired);
  // Reads and admits one request: its header (admitHeader), its body (bounded), the frame's tag. A
  // kPathConnect's header is read first and admitted (admitSetup: *setup, the entry it names), then
  // only the rest, the path's setup body, goes to *body. Non-OK: the link is dropped.
  Status readRequest(const Link& link, Stream& s, Deadline deadline, wire::RequestHeader* h, std::string* body,
                     const PathEntry** setup);
  // The requests without a transfer body (ping, notify, confirm, path connect (answered by `setup`),
  // unlink): true when `h` is one, with its result in *result.
  bool serveControl(const std::shared_ptr<Link>& link, Stream& s, const wire::RequestHeader& h, const std::string& body,
                    const PathEntry* setup, Deadline deadline, ServeState* state, Status* result);
  Status serveDescribe(const Link& link, Stream& s, const wire::RequestHeader& h, const wire::TransferBody& tb,
                       Deadline deadline);
  // A read or write: admitted, resolved in the registry (exactly the checked ranges), placement
  // checked, then served by the path its flags name.
  // `gate`: the refusal decided before (a pending role switch, a stale epoch tag), answered once the
  // frame's payload is consumed; OK to serve.
  Status serveAccess(const std::shared_ptr<Link>& link, Stream& s, const wire::RequestHeader& h,
                     const wire::TransferBody& tb, Deadline deadline, ServeState* state, const Status& gate);
  // Closes the peer's split pull open on `link` (wire::kMarkSplit), if one is: its count in
  // served_in_flight is given back and a drain woken.
  void closeSplit(Link& link);
  // Updates state's pin count (ServeState::countPins), waking a drain when it changed.
  void countPins(ServeState* state);
  // Device memory is reachable only through the device channel, host memory only without it
  // (except staged kRaw runs on the stream path, marked in *device_runs): the refusal, or OK.
  Status checkPlacement(const wire::RequestHeader& h, const wire::TransferBody& tb, const Resolved& r,
                        std::vector<uint8_t>* device_runs) const;
  // Admission (with wire's bounded decoders, the only place that turns what a peer sent into
  // work). admitHeader: whether a frame of this kind and size may be read at all on this link
  // (non-OK: a protocol violation, the link is dropped). admitAccess: whether a read or write may
  // use the path its flags ask for on this link (non-OK: refused, the link stays).
  Status admitHeader(const Link& link, const wire::RequestHeader& h) const;
  // admitSetup: whether a kPathConnect whose header names `path` may have a setup body of
  // `setup_len` bytes read: the path has an entry with a setup frame (*setup) and the body is within
  // its bound (non-OK: the link is dropped, nothing of the body read).
  Status admitSetup(uint8_t path, uint32_t setup_len, const PathEntry** setup) const;
  Status admitAccess(const Link& link, const wire::RequestHeader& h) const;
  // A kNotify frame: queued within the limits and acknowledged (a refusal keeps the link); a
  // malformed body drops the link.
  Status serveNotify(const Link& link, Stream& s, const std::string& body, Deadline deadline);
  // A kHandoff frame (engine/offers.h): an abort or a hold from the peer, acted on and acknowledged;
  // a malformed body drops the link.
  Status serveHandoff(const std::shared_ptr<Link>& link, Stream& s, const std::string& body, Deadline deadline);
  // Answers kConfirm: whether this engine dialled (or is dialling) the asker with that nonce.
  Status serveConfirm(const Link& link, Stream& s, const std::string& body, Deadline deadline);

  EngineState& s_;
  LinkManager& links_;
  std::atomic<uint64_t> pins_expired_{0};

  // Notifications received and not yet taken, with what the limits count. notify_mu_ is a leaf.
  struct Inbox {
    std::deque<Notification> queue;
    struct Share {
      size_t count = 0;    // unread notifications from one peer
      uint64_t bytes = 0;  // of their names and messages
    };
    std::map<uint64_t, Share> per_peer;
    std::map<std::string, uint64_t> per_source;  // bytes from the links of one source
    uint64_t bytes = 0;                          // of all of them
    uint64_t refused = 0;
  };
  mutable std::mutex notify_mu_;
  Inbox inbox_;  // guarded by notify_mu_
};

}  // namespace pdlink
