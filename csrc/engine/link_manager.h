// LinkManager: the engine's links to peer clusters (docs/architecture.md, "Links").
//
// Owns: the link table (engine/link_table.h) and the link log (Engine::linkedSince); the link
// attempts in flight and the nonces being dialled; the listeners (listen address, link()'s
// rendezvous endpoint, the same-host AF_UNIX socket) and the acceptor they share; the handshake
// slots (EngineLimits::max_handshakes, _per_source) and the incoming links waiting for their
// REVERSE channel. It dials (link; the dialler's half of the handshake is
// detail::helloExchange), accepts (handleIncoming: the acceptor's half, engine/handshake.cc),
// unlinks, probes links, chooses each new link's transport and paths, and has a new link's first
// device path set itself up (DataPath::connect). It does not serve a link: a link it installs is handed to the
// `serve` function given at construction (RequestServer::serve, on an engine thread).
//
// Threading: every public method is thread-safe unless it says "Locked" (then the caller holds
// EngineState::mu). Its tables are guarded by EngineState::mu (lock order: mu before a Link's out
// mutex; the out mutex of a brand-new link is taken under mu). Listeners are destroyed (joining
// their thread) only outside mu, since their accept callback takes it. Called by the Engine facade
// (any application thread), by RequestServer (serving threads: forget, retire, dialledBy) and
// Transfers (usableLink); its own threads: one per listener, one handshake
// thread per incoming connection (which goes on to serve the link it accepted).
// Errors: Status codes as the public API documents them (Engine::link, unlink, ping); a refused
// incoming connection gets its reason on the wire and is logged, never thrown.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "core/status.h"
#include "engine/engine_state.h"
#include "engine/engine_types.h"
#include "engine/link_table.h"
#include "transport/cma/cma.h"
#include "transport/link.h"
#include "transport/listener.h"
#include "transport/socket.h"

namespace pdlink {

class LinkManager {
 public:
  // Serves a link until its channels die (RequestServer::serve; `lane` non-null: that lane of the
  // link only, RequestServer::serveLane); called on an engine thread.
  using ServeFn = std::function<void(const std::shared_ptr<Link>&, Stream* lane)>;
  LinkManager(EngineState& state, ServeFn serve);
  LinkManager(const LinkManager&) = delete;
  LinkManager& operator=(const LinkManager&) = delete;

  // ---- initialize / finalize (the facade holds EngineState::mu where a name says Locked)
  void setOneWayLocked(bool one_way) { links_.setOneWay(one_way); }
  // Starts the listener of the configured listen address (kFailed when it cannot be bound).
  Status listenLocked(const std::string& ip, uint16_t port);
  // Starts the same-host AF_UNIX listener; without it (logged) links use tcp.
  void listenUnixLocked();
  bool listeningLocked() const { return listener_ != nullptr; }
  uint16_t listenPortLocked() const { return listener_ ? listener_->port() : 0; }
  // Every link, removed from the table (finalize).
  std::vector<std::shared_ptr<Link>> takeAllLocked() { return links_.removeAll(); }
  // Tells each peer (best effort, without waiting on a busy link) and breaks each link.
  static void closeAll(const std::vector<std::shared_ptr<Link>>& links);
  // Stops every listener (outside mu), then shuts down every connection mid-handshake and wakes
  // the handshakes waiting for a REVERSE channel.
  void stopListeners();
  void shutdownHandshakes();
  void clearPendingLocked() { pending_.clear(); }
  void addStatsLocked(EngineStats* s) const;
  uint64_t handshakesRefused() const { return handshakes_refused_.load(); }

  // ---- the public API's link calls (Engine)
  uint16_t listenPort() const;
  Status switchRole(const SwitchOptions& options);  // Engine::switchRole
  std::vector<Status> link(const std::vector<PeerAddress>& peers, int64_t timeout_ms, std::vector<uint64_t>* peer_ids);
  std::vector<Status> unlink(const std::vector<uint64_t>& cluster_ids, int64_t timeout_ms, bool force);
  std::vector<LinkInfo> links() const;
  uint64_t linkedSince(uint64_t after, std::vector<uint64_t>* peers) const;
  Status ping(uint64_t cluster_id, int64_t timeout_ms);
  Result<uint16_t> startCommListener(const std::string& ip, uint16_t port);

  // ---- for the request server and transfers
  // The link this side's requests to `peer` take (LinkTable::forRequests); kFailed before
  // initialize, kLinkFailed naming why a held link is down, else kNotYetLink.
  Result<std::shared_ptr<Link>> usableLink(uint64_t peer);
  // The peer unlinked `link` (its kUnlink frame): forgotten, no tombstone.
  void forget(const std::shared_ptr<Link>& link);
  // `link`'s serving ended: a tombstone takes its place (LinkTable::retire).
  void retire(const std::shared_ptr<Link>& link);
  // Whether this engine dialled (or is dialling) `link`'s peer with `nonce` from `endpoint` (the
  // answer to the peer's kConfirm).
  bool dialledBy(const Link& link, const wire::Nonce& nonce, const std::string& endpoint) const;

 private:
  // A handshake slot held by an incoming connection's thread; release() gives it back (once).
  // Fields other than `manager` and `source` are guarded by EngineState::mu.
  struct HandshakeSlot {
    LinkManager* manager = nullptr;
    std::string source;
    uint64_t arrival = 0;  // order of arrival (Slots::silent)
    int silent = -1;       // the connection's descriptor, while it has not sent its hello
    bool evicted = false;  // made room for a newcomer: its thread is on its way out
    void release();
    ~HandshakeSlot() { release(); }
  };
  // One incoming connection's handshake (handleIncoming's steps, engine/handshake.cc).
  struct Incoming;
  // The two channels of a link this side dials, and what the handshake proved about the peer.
  struct Dialled;

  Result<std::unique_ptr<Listener>> startListener(const std::string& ip, uint16_t port);
  // The AF_UNIX listener same-host diallers are redirected to, under a random abstract name
  // (started by initialize unless the transport is forced to tcp; without it links use TCP).
  Result<std::unique_ptr<Listener>> startUnixListener(std::string* name);
  // What every listener does with an accepted connection: a handshake thread, within the caps.
  Listener::AcceptFn acceptor();
  // Where a connection comes from, for the per-source shares (docs/security.md, "Limits").
  static std::string sourceOf(const Socket& s);
  // The slot's connection sent its hello (or is gone): it can no longer be evicted.
  void hearLocked(HandshakeSlot* slot);
  // Drops the oldest silent connection (of the newcomer's source, or of anyone); false if none.
  bool evictSilentLocked(const std::string& newcomer, bool same_source);
  static constexpr size_t kEvictingPerSlot = 4;

  // The acceptor's half of the handshake (engine/handshake.cc), in steps; a step that returns
  // false has ended the connection (dropped it, or refused it with the reason).
  void handleIncoming(Socket sock, HandshakeSlot* slot);
  // Sends the refusal (a HelloAck, or an AuthResult once our HelloAck is out) and forgets the socket.
  void refuse(Incoming& in, const std::string& why);
  void untrack(Incoming& in);  // the socket is no longer in a handshake (handshaking_)
  void heard(Incoming& in);    // hearLocked, under mu
  bool readHello(Incoming& in);
  bool authenticate(Incoming& in);
  // Same host (AF_UNIX: the peer's credentials and our published words) or a redirect of a FORWARD
  // TCP channel; then the forced-transport and link-count checks of a FORWARD channel.
  bool admitChannel(Incoming& in);
  // Tags the verdict (Incoming::ok) under the channel's session key; false when libcrypto failed.
  bool sealVerdict(Incoming& in);
  // FORWARD: parks the channel until its REVERSE channel completes the link, then serves it.
  void acceptForward(Incoming& in, const std::string& ok_frame);
  // REVERSE: completes and installs the link whose FORWARD channel waits under the same nonce.
  void acceptReverse(Incoming& in, const std::string& ok_frame);
  // LANE: attaches the channel to the accepted TCP link from that cluster with that nonce, within
  // the bounds (EngineLimits::tcp_streams per link, max_tcp_lanes in all), then serves it.
  void acceptLane(Incoming& in, const std::string& ok_frame);
  // The dialler's half: opens up to tcp_streams - 1 lanes of `link` (one this side dialled over TCP),
  // in parallel, by `deadline`; a lane that cannot be had is logged, the link keeps the rest.
  void openLanes(Link& link, Deadline deadline);
  // One of the engine's max_tcp_lanes lanes, held by the lane (null: none left).
  std::shared_ptr<void> takeLaneToken();
  // Under mu: the checks of acceptReverse against the waiting FORWARD channel, then the link made
  // and installed with its out mutex held (*out_lock); nullptr when refused (already answered).
  std::shared_ptr<Link> completeLinkLocked(Incoming& in, std::unique_lock<std::mutex>& lock,
                                           std::unique_lock<std::mutex>* out_lock);

  Result<Dialled> dialTcp(const PeerAddress& peer, bool offer_same_host, uint64_t* peer_id, Deadline deadline,
                          std::string* redirect);
  // `reached`: the acceptor answered (a failure after that is the acceptor's refusal, not a sign
  // that its socket is out of reach).
  Result<Dialled> dialUnix(const std::string& name, uint64_t* peer_id, Deadline deadline, bool* reached);
  // linkOne's steps: the admission of a link attempt (kAlreadyLink, the link cap, one attempt per
  // peer; *claimed: an accepted link that claims to come from `peer`), the two channels (TCP, or
  // AF_UNIX after a redirect), and what is done once the link is installed.
  Status linkOne(const PeerAddress& peer, int64_t timeout_ms, uint64_t* linked_id);
  Status admitLinkAttempt(const PeerAddress& peer, uint64_t guard_key, std::shared_ptr<Link>* claimed,
                          uint64_t* linked_id);
  Result<Dialled> dialChannels(const PeerAddress& peer, uint64_t* peer_id, Deadline deadline);
  // A claimed accepted link: kAlreadyLink when the peer confirms it (the new link dropped), OK when
  // the claim was false (the claimed link dropped), else the failure.
  Status settleClaim(const PeerAddress& peer, uint64_t peer_id, const std::shared_ptr<Link>& link,
                     const std::shared_ptr<Link>& claimed, Deadline deadline, uint64_t* linked_id);
  Status finishLink(const PeerAddress& peer, uint64_t peer_id, const std::shared_ptr<Link>& link, Deadline deadline,
                    uint64_t* linked_id);
  Status unlinkOne(uint64_t cluster_id, int64_t timeout_ms, bool force);
  // Requires mu.
  void installLink(const std::shared_ptr<Link>& link);
  // Keeps `nonce` (a link this side is dialling to `peer`) confirmable (dialledBy) until the
  // returned handle goes.
  std::shared_ptr<void> markDialling(const wire::Nonce& nonce, uint64_t peer, const std::string& endpoint);
  // Asks the peer over `link` (dialled, not yet installed) whether it dialled `claimed` (an
  // accepted link): its hello's nonce and the end it came from (Link::endpoint). OK if so; its
  // refusal if not; a transport failure breaks `link`.
  Status confirmDialled(Link& link, const Link& claimed, Deadline deadline);
  // Tells the peer to forget `link` (dialled, never installed) and breaks it.
  void dropUnused(Link& link, Deadline deadline);
  // Whether the peer still answers on `link` (pings over a window of kProbeWindowMs, or a transfer
  // running on it); breaks it when not.
  bool stillAlive(const std::shared_ptr<Link>& link);
  // Whether this side's requests copy the peer's memory directly: the cma path's probe (cmaProbe,
  // transport/cma/cma_path.h) as this engine's transport allows it; `process` is then set.
  // kLinkFailed when cma is forced and not possible.
  Status chooseTransport(const Socket& channel, pid_t peer_pid, uid_t peer_uid, uint64_t published_addr,
                         std::shared_ptr<const cma::Process>* process) const;
  // The paths of this side's requests on a new link (before it is shared), as the path table picks
  // them from what the handshake proved (`direct`: the peer's process where chooseTransport allowed
  // cma, else null) and what this engine offers (PathTable::choose).
  void choosePaths(Link& link, std::shared_ptr<const cma::Process> direct);

  EngineState& s_;
  const ServeFn serve_;

  LinkTable links_;             // guarded by s_.mu
  std::set<uint64_t> linking_;  // link attempts in flight, guarded by s_.mu
  struct Dialling {
    uint64_t peer;
    std::string endpoint;
  };
  std::map<wire::Nonce, Dialling> dialling_;            // links being dialled, by nonce; guarded by s_.mu
  std::deque<std::pair<uint64_t, uint64_t>> link_log_;  // (number, peer) of the latest links, guarded by s_.mu
  uint64_t link_seq_ = 0;                               // guarded by s_.mu

  // Listeners are destroyed (which joins their thread) only outside s_.mu.
  std::unique_ptr<Listener> listener_;       // from listen_ip_info / switch_role, guarded by s_.mu
  std::unique_ptr<Listener> comm_listener_;  // rendezvous endpoint of link(), guarded by s_.mu
  std::unique_ptr<Listener> unix_listener_;  // same-host redirect target, guarded by s_.mu
  std::string unix_name_;                    // its abstract name, guarded by s_.mu

  // Incoming links waiting for their REVERSE channel, keyed by the initiator's nonce.
  struct PendingLink {
    uint64_t peer = 0;
    std::string source;                              // sourceOf the forward channel
    std::unique_ptr<Socket> forward;                 // the channel this side will serve
    pid_t pid = 0;                                   // SO_PEERCRED of an AF_UNIX forward channel
    uint64_t published_addr = 0;                     // from the forward channel's ClientAuth (AF_UNIX only)
    std::shared_ptr<void> grant;                     // cma's (cmaGrant), for the link to hold until it breaks
    std::shared_ptr<const crypto::Key> session_key;  // the forward channel's (with a link secret)
    bool integrity = false;                          // payload integrity agreed on it
    std::shared_ptr<Link> link;                      // set by the REVERSE handler when the link is installed
    bool done = false;
  };
  std::map<wire::Nonce, std::shared_ptr<PendingLink>> pending_;  // guarded by s_.mu
  std::condition_variable pending_cv_;
  std::set<Socket*> handshaking_;  // sockets in a handshake; shut down by finalize, guarded by s_.mu
  // Handshake slots (EngineLimits::max_handshakes, _per_source): taken by the listener, released
  // when the handshake ends.
  struct Slots {
    size_t total = 0;
    size_t evicting = 0;   // evicted, their threads not yet ended (not in total)
    uint64_t evicted = 0;  // ever
    std::map<std::string, size_t> per_source;
    uint64_t arrivals = 0;
    std::map<uint64_t, HandshakeSlot*> silent;  // by arrival: connections that have not said hello
  };
  Slots slots_;  // guarded by s_.mu
  std::atomic<uint64_t> handshakes_refused_{0};
  // Lanes of all links (dialled and accepted), each counted while it exists (takeLaneToken);
  // shared with the tokens, which a link may keep past this manager.
  std::shared_ptr<std::atomic<uint32_t>> lanes_ = std::make_shared<std::atomic<uint32_t>>(0);
};

}  // namespace pdlink
