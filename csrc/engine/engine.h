// Engine: one LLM-DataDist instance. It owns the role, the optional listener, the links to peer
// clusters, the cache registry and the memory pools, and moves cache bytes over its links.
//
// Contract (mirrors llm_datadist CacheManager mode, llm_datadist_api.md §6, §8 and §10):
//  * Links are symmetric once established and keyed by the peer's real cluster id.
//  * Transfers are one-sided from the caller's view: the peer's serving thread answers them from
//    its registry; no code of the peer's application runs.
//  * Every transfer is bounded by the sync timeout and every link attempt by its timeout; a dead,
//    refusing or silent peer gives kTimeout, kLinkFailed or kNotYetLink, never a hang.
//  * A failed pull changes nothing on either side: the source key is released only after the
//    puller has received every byte (a separate commit frame).
//
// A thin facade over three parts that share one EngineState (engine/engine_state.h: the backend,
// the configuration, the registry and pools, the path table, the engine mutex, the threads):
//  * LinkManager (engine/link_manager.h): listeners, handshakes, dialling, unlinking, the link table;
//  * RequestServer (engine/request_server.h): serving each link's requests, admission, notifications;
//  * Transfers (engine/transfers.h): planning, splitting and posting this side's requests.
// The facade itself keeps initialize/finalize (their order), the registry calls and local copies.
//
// Threading: every public method is thread-safe. Transfers on one link are serialised; transfers on
// different links run in parallel. Background threads: one listener thread (while listening), one
// handshake thread per connection being accepted, one serving thread per link. initialize() and
// finalize() must not race with other calls (as in llm_datadist).
// Lock order: EngineState::mu before a Link's out mutex; the registry's own mutex is never held
// while calling out of the registry.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "core/status.h"
#include "engine/engine_state.h"
#include "engine/engine_types.h"
#include "engine/link_manager.h"
#include "engine/registry.h"
#include "engine/request_server.h"
#include "engine/transfers.h"
#include "transport/link.h"
#include "transport/stream.h"

namespace pdlink {

class Engine {
 public:
  explicit Engine(std::shared_ptr<Backend> backend);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Creates the pools and starts the listener. kParamInvalid for a bad config, kFailed when the
  // listen address cannot be bound.
  Status initialize(const EngineConfig& config);
  // Unlinks every peer (notifying it when reachable), stops all threads, frees pools. Idempotent.
  void finalize();
  bool initialized() const;

  uint64_t clusterId() const { return state_.config.cluster_id; }
  Role role() const;
  // The bound listen port, 0 when not listening.
  uint16_t listenPort() const;
  const char* backendName() const { return state_.backend->name(); }
  const std::shared_ptr<Backend>& backend() const { return state_.backend; }

  // Switches the role (docs/architecture.md, "Roles"). Refused with nothing changed: kStaleEpoch
  // when options.expected_epoch is not the epoch; kRoleSwitching while another switch is pending;
  // kExistLink with require_no_links while a link exists (llm_datadist's contract). Otherwise the
  // phase goes to kDraining (new links, this side's new transfers and peers' new reads, writes,
  // describes and path connects are refused with kRoleSwitching; pings, commits, releases,
  // unlinks, notifications and confirmations are still served) and the call blocks until nothing
  // is in flight (RoleState's three counts), at most the drain timeout: past it the switch rolls
  // back (role and epoch unchanged, phase kReady) and kTimeout says what was still in flight. Then
  // kSwitching: with a listen address, start listening there, or move the listener if it differs
  // from the current one; with an empty ip stop listening. A listener that cannot be bound while
  // the old one is still held rolls back (its error); once the old one was given up (a move to the
  // same port on another address) the phase stays kFailed, role and epoch unchanged, until the
  // next switchRole. Then it commits: the role, epoch + 1, phase kReady. The same role is a switch
  // too (epoch + 1). Links survive it; a prepared transfer made against the old epoch is refused
  // with kStaleEpoch by the peer's serving side (wire v7's epoch tag). With one-way links only the
  // label changes (and the epoch, after the same checks); a new listen address is kFeatureNotEnabled.
  Status switchRole(const SwitchOptions& options);
  RoleState roleState() const { return state_.roleState(); }

  // One status per peer, in order. At most 16 peers per call (kClusterNumExceedLimit). When
  // `peer_ids` is given it receives each linked peer's cluster id (learned when not given).
  std::vector<Status> link(const std::vector<PeerAddress>& peers, int64_t timeout_ms,
                           std::vector<uint64_t>* peer_ids = nullptr);
  std::vector<Status> unlink(const std::vector<uint64_t>& cluster_ids, int64_t timeout_ms, bool force);
  std::vector<LinkInfo> links() const;
  // Every link this engine installed (dialled or accepted) is numbered, from 1. Returns the number
  // of the latest (0: none yet) and, in `peers`, the cluster ids of those numbered after `after`,
  // oldest first: a poll sees a link that came and went meanwhile (link()'s sticky OK status).
  // Only the latest limits::kLinkLogEntries are kept; older ones are left out. Thread-safe.
  // `after` = kLatestLinkMark lists no peer: only the latest number.
  static constexpr uint64_t kLatestLinkMark = UINT64_MAX;
  uint64_t linkedSince(uint64_t after, std::vector<uint64_t>* peers) const;
  // One round trip on the link (check_link_status). kNotYetLink / kLinkFailed / kTimeout.
  Status ping(uint64_t cluster_id, int64_t timeout_ms);
  // Sends a notification (a name and a message, both bytes, at most limits::kMaxNotifyNameBytes and
  // kMaxNotifyMessageBytes, else kParamInvalid) over this side's link to the peer and waits for its
  // acknowledgement, within timeout_ms: OK once the peer queued it. kLinkBusy when the peer holds
  // as many unread notifications as its limits allow (EngineLimits): retry after it took them.
  // Otherwise as ping (kNotYetLink, kLinkFailed, kTimeout). It travels on the link's request
  // channel behind every transfer this side already completed on that link, so a notification sent
  // after a write returned arrives after the written bytes are in place.
  // The peer's registered memory as address ranges, sorted, with its registry generation: what
  // its raw-address (kRaw) checks accept (wire::RawTable; a range may also run across ranges that
  // follow each other exactly). A snapshot: a later release or re-index on the peer changes the
  // generation (a registration adds ranges and keeps it). Blocking (the link's out mutex, one round trip by
  // `timeout_ms`); kParamInvalid when the peer has more than limits::kMaxRequestTensors tensors registered.
  Result<wire::RawTable> describeMemory(uint64_t cluster_id, int64_t timeout_ms);
  Status notify(uint64_t cluster_id, const std::string& name, const std::string& message, int64_t timeout_ms);
  // Takes every notification received and not yet taken, in arrival order (per peer, the order it
  // sent them), leaving none. Thread-safe; never blocks on a link.
  std::vector<Notification> takeNotifications();
  // A second listener, the rendezvous endpoint of two-sided link() calls; idempotent for the same
  // address. Returns the bound port.
  Result<uint16_t> startCommListener(const std::string& ip, uint16_t port);

  // Registers user memory (addrs: one address per tensor). kParamInvalid on bad layout or keys.
  Result<std::shared_ptr<CacheEntry>> registerCache(const CacheLayout& layout, const std::vector<uint64_t>& addrs,
                                                    const std::vector<RequestKey>& keys,
                                                    std::optional<uint64_t> blocks_model, bool remote_accessible);
  // Allocates from the pool of the layout's placement. kFeatureNotEnabled without a pool,
  // kOutOfMemory when it is full (nothing stays allocated then).
  Result<std::shared_ptr<CacheEntry>> allocateCache(const CacheLayout& layout, const std::vector<RequestKey>& keys,
                                                    std::optional<uint64_t> blocks_model);
  Status deallocateCache(int64_t cache_id, bool expect_blocks);
  // Withdraws registered memory: no request resolves to it from now on, its live offers are
  // released (kReleased), and the call returns once nothing uses the memory any more (transfers
  // being served or made over it end within their deadlines, a peer's pin at its next frame or
  // after the pin timeout), so the caller may then free it. Blocks meanwhile (the binding releases
  // the GIL). kTimeout if something still uses it after twice the longest of those bounds: the
  // memory must then stay allocated. kParamInvalid for unknown or pool-allocated ids.
  Status unregisterCache(int64_t cache_id);
  void removeCacheKey(const RequestKey& key);
  size_t cacheCount() const { return state_.registry.size(); }
  EngineStats stats() const;
  // The memory pools created by initialize() (none before it or after finalize()): where each lies
  // and how much of it is allocated. For tests that check a whole pool around a transfer; like
  // allocateCache, not to be called concurrently with initialize/finalize.
  struct PoolInfo {
    Placement placement;
    uint64_t base, capacity, used;
  };
  std::vector<PoolInfo> pools() const;

  Status pull(const TransferSpec& spec);
  Status push(const TransferSpec& spec);

  // Describes a prepared transfer (see PreparedTransfer): `spec` names the peer, the target (kBlocks
  // or kRaw), the local cache and the tensor pairs; `block_size` divides the local tensors (0: the
  // local cache's own block size, its stride); for kRaw, `remote_bytes` is the registered length at
  // `remote_base`; `mapping` its block views and ratio (engine_types.h BlockMapping). kParamInvalid
  // for a bad description; nothing is sent to the peer.
  Result<std::shared_ptr<PreparedTransfer>> prepare(const TransferSpec& spec, uint64_t block_size, uint64_t remote_base,
                                                    uint64_t remote_bytes, const BlockMapping& mapping = {});
  // Moves local block local[i] <-> remote block remote[i] for i < n (coalescing consecutive pairs;
  // with a block ratio r, `remote` has r * n entries: the mapping's rule),
  // a pull or a push, bounded by the sync timeout. Errors as pull/push; kParamInvalid for an index
  // out of range or a local cache that is no longer registered.
  // `cancel` (null: none): the post's cancel token (core/cancel.h), the caller's until it returns.
  Status post(PreparedTransfer& p, const int64_t* local, const int64_t* remote, size_t n, bool is_push,
              const CancelToken* cancel = nullptr);

  // KV handoffs (engine/offers.h; docs/native_api.md, "Handoffs").
  // Retains `blocks` of the registered blocks cache `cache_id` (registered with a key) for
  // `request_id`: kRoleSwitching while a switch is pending, else OfferTable::offer's errors.
  Result<OfferTicket> offer(int64_t cache_id, std::vector<int64_t> blocks, std::string request_id, int64_t lease_ms);
  // The application gives an offer up (reason "released"); a no-op once released.
  void releaseOffer(uint64_t offer_id) { state_.offers.release(offer_id); }
  // A claim: pulls the offer's `remote_blocks` of the peer's region `key` into `local_blocks` of the
  // local blocks cache (same count, same block size and tensors, as a pull checks), through the
  // kOffer target, and, once every byte landed, releases the offer on the peer by the pull's kCommit.
  // kOfferReleased when the peer refuses the offer, or an abort of `request_id` from that peer
  // arrived before the claim returned; else a pull's errors.
  struct ClaimSpec {
    uint64_t peer = 0;
    uint64_t key = 0;
    uint64_t offer_id = 0;
    uint64_t generation = 0;
    std::string request_id;
    int64_t local_cache_id = 0;
    std::vector<int64_t> local_blocks, remote_blocks;
    int64_t timeout_ms = 0;
    const CancelToken* cancel = nullptr;
  };
  Status claim(const ClaimSpec& spec);
  // Releases this engine's offers of `request_id` (reason "aborted") and tells `peer` (or, with no
  // peer, every linked peer: failures to reach one are skipped) with a kHandoff abort. With `peer`,
  // that peer's answer is the result.
  Status abort(const std::string& request_id, std::optional<uint64_t> peer, const std::string& reason,
               int64_t timeout_ms);
  // Tells `peer` to extend the leases of these offers (id, generation) and bind them to this link.
  Status hold(uint64_t peer, const std::vector<std::pair<uint64_t, uint64_t>>& offers, int64_t timeout_ms);
  std::vector<ReleasedOffer> takeReleased() { return state_.offers.takeReleased(); }
  std::vector<PeerHandoffEvent> takeHandoffEvents() { return state_.offers.takePeerEvents(); }
  // The offers finalised since the last call (waits up to timeout_ms for one); wakeHandoffs ends a
  // wait at once. For one dispatcher (pdlink.Engine's callbacks).
  std::vector<std::pair<uint64_t, OfferReason>> takeFinalizedOffers(int64_t timeout_ms) {
    return state_.offers.takeFinalized(timeout_ms);
  }
  void wakeHandoffs() { state_.offers.wake(); }

  // Local copy: for each tensor pair (dst_addrs[t], src_addrs[t]) and each (dst_off, src_off, len).
  struct CopyRun {
    uint64_t dst_offset, src_offset, length;
  };
  // Each side's memory is of the given placement (the backend picks the copy kind from them).
  Status copyLocal(const std::vector<uint64_t>& dst_addrs, Placement dst_placement,
                   const std::vector<uint64_t>& src_addrs, Placement src_placement, const std::vector<CopyRun>& runs);

  // Serves the requests read from `in` on `link` until `in` fails or a frame drops the link,
  // exactly as the link's serving thread does (it calls this on the link's in channel); no
  // exception escapes. Public so that the fuzzer drives the real serving loop over an in-memory
  // stream (csrc/fuzz). `state` must outlive the call; its pins are released when it is destroyed.
  using ServeState = RequestServer::ServeState;
  Status serveStream(const std::shared_ptr<Link>& link, Stream& in, ServeState* state);

 private:
  Engine(std::shared_ptr<Backend> backend, const Capabilities& caps);

  EngineState state_;         // first in, last out: the parts below hold references to it
  LinkManager link_manager_;  // serves each link it installs through server_
  RequestServer server_;      // reaches links through link_manager_
  Transfers transfers_;       // reaches links through link_manager_
};

}  // namespace pdlink
