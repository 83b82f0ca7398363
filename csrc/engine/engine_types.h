// The engine's value types: its configuration and limits, link addresses, counters,
// notifications, transfer descriptions and prepared transfers. Shared by the facade (engine.h) and
// the classes behind it (engine_state.h, link_manager.h, request_server.h, transfers.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/cancel.h"
#include "engine/registry.h"
#include "engine/telemetry.h"
#include "transport/wire.h"

namespace pdlink {

// Values match llm_datadist.LLMRole.
enum class Role : uint8_t { kPrompt = 1, kDecoder = 2, kMix = 3 };

// Where an engine stands with its role (Engine::switchRole, docs/architecture.md, "Roles"):
//   kReady        serving and transferring under `role`, `epoch`;
//   kDraining     a switch is pending: new links, new transfers of this side and new reads,
//                 writes, describes and path connects of peers are refused (kRoleSwitching);
//                 what was admitted before runs to its end;
//   kSwitching    nothing in flight any more: the listener moves;
//   kRollingBack  the drain timed out (or the listener move failed with the old one in place):
//                 back to kReady with the old role and epoch;
//   kFailed       the listener move failed after the old listener was given up: role and epoch
//                 unchanged, no listener; transfers are admitted as in kReady, and the next
//                 switchRole (allowed from here) resolves it.
enum class Phase : uint8_t { kReady = 0, kDraining = 1, kSwitching = 2, kRollingBack = 3, kFailed = 4 };
const char* phaseName(Phase phase);  // "ready", "draining", ...

// How a switch goes (Engine::switchRole).
struct SwitchOptions {
  Role role = Role::kMix;
  std::string listen_ip;     // empty: stop listening (one-way links: keep the listener)
  uint16_t listen_port = 0;  // 0 with the listener's own ip: keep it
  // Refused with kStaleEpoch, nothing changed, unless it equals the engine's epoch.
  std::optional<uint64_t> expected_epoch;
  // How long the drain waits for the transfers in flight, served requests and pins; 0 or less:
  // EngineLimits::switch_drain_timeout_ms.
  int64_t drain_timeout_ms = 0;
  // llm_datadist's contract: kExistLink while any link exists (or is being made), nothing changed.
  bool require_no_links = false;
};

// A snapshot of an engine's role (Engine::roleState).
struct RoleState {
  Role role = Role::kMix;
  uint64_t epoch = 0;  // +1 per committed switch, from 0
  Phase phase = Phase::kReady;
  int64_t transfers_in_flight = 0;  // this side's own pulls, pushes, posts and describes running
  int64_t served_in_flight = 0;     // peers' reads, writes, describes and path connects being served
  int64_t pins = 0;                 // served links holding a direct, IPC or one-sided pin
  int64_t offers = 0;               // KV handoff offers not yet released (engine/offers.h)
};

// How a link moves bytes. kAuto: direct memory access (cross-memory attach) when both ends are on
// one host and the kernel permits it; else, with ucx_trusted_network and a UCX whose network
// transports include an RDMA one (UcxHub::autoBetweenHosts), the ucx path, falling back to TCP
// for a peer that serves no ucx; else TCP. kTcp / kCma force one (kCma fails the link when
// it is not possible). DEVICE memory of a backend with device transport moves by IPC between
// processes of one host (unless kTcp), else over the link's device channel (HCCL). kUcx: host
// memory as UCX Active Messages (transport/ucx/ucx_path.h; UCX loaded at run time, initialize fails
// without it), on every link except those with payload integrity (the stream, which seals it).
enum class Transport : uint8_t { kAuto = 0, kTcp = 1, kCma = 2, kUcx = 3 };

struct PoolConfig {
  uint64_t bytes = 0;  // 0 = no pool
  uint32_t page_shift = 16;
};

// What peers can make an engine spend, beyond the per-request bounds of core/limits.h. Each is an
// init option (pdlink.MaxLinks, ...; docs/security.md, "Limits"), with these defaults.
struct EngineLimits {
  // Live links (dialled and accepted); as many tombstones are kept. Default: HIXL's pool of 512,
  // or fewer where the process's descriptor limit (RLIMIT_NOFILE) cannot hold that many
  // (defaultMaxLinks).
  uint32_t max_links = defaultMaxLinks();
  // Of those, accepted from one source: an IP address, or, for AF_UNIX connections, a uid.
  uint32_t max_links_per_source = 64;
  uint32_t max_handshakes = 64;             // connections mid-handshake, from everyone
  uint32_t max_handshakes_per_source = 16;  // of those, from one source (as above)
  // How long an incoming connection may take to send its hello; past it, or when the handshake
  // slots are full and a newcomer arrives, the oldest connection still silent is dropped.
  int64_t hello_timeout_ms = 1000;
  // How long the serving side keeps the caches of a direct or IPC access pinned while the peer
  // sends nothing; 0: max(2 x sync_timeout_ms, 5 s). The peer's late copy then fails (pin epoch).
  int64_t pin_timeout_ms = 0;
  // How long an incoming connection may take over its handshake (hello to authentication) before
  // it is dropped and its slot and thread are freed.
  int64_t handshake_timeout_ms = 5000;
  // Notifications received and not yet taken (Engine::takeNotifications): at most this many from
  // one peer (hixl's 4096 per link), and at most this many bytes of names and messages from all of
  // them. A notification past either bound is refused with kLinkBusy; nothing is dropped.
  uint32_t max_notifications_per_link = 4096;
  uint64_t max_notification_bytes = uint64_t{16} << 20;
  uint64_t max_notification_bytes_per_link = uint64_t{1} << 20;  // of those, from one peer
  // and from all the links of one source (an IP address, or a local uid: LinkManager::sourceOf).
  uint64_t max_notification_bytes_per_source = uint64_t{4} << 20;

  // The TCP streams this side's transfers use on a tcp link it dialled: the link's own channel and
  // tcp_streams - 1 lanes the dialler opens on its first large transfer (transport/tcp/stream_path.h;
  // 1: the channel only). Also the most lanes + 1 a peer's link may attach here. In [1,
  // limits::kMaxTcpStreams]. Default 4: enough that a lossy long path (where one TCP stream's rate
  // falls as 1/sqrt(loss)) gets about 4x one stream's share, few enough to cost 3 descriptors and,
  // at the acceptor, 3 serving threads per link.
  uint32_t tcp_streams = 4;
  // Lanes (extra TCP streams) of all links together, dialled and accepted: each a descriptor, and
  // an accepted one a thread. Past it a link keeps fewer streams (a refused lane is only logged).
  uint32_t max_tcp_lanes = 64;
  // The chunk a large tcp transfer is split into (one request each, spread over the streams); a
  // transfer of less than 2 chunks is one request on the link's channel, as with one stream. In
  // [limits::kMinTcpChunkBytes, limits::kMaxTcpChunkBytes].
  uint64_t tcp_chunk_bytes = uint64_t{1} << 20;
  // How long a role switch waits for the transfers in flight, the peers' requests being served and
  // the pins peers hold to end (Engine::switchRole) before it rolls back with kTimeout. A peer
  // cannot hold a switch longer: it can neither link nor start a request while the switch drains.
  int64_t switch_drain_timeout_ms = 30000;
  // KV handoffs (engine/offers.h, Engine::offer): offers held at once (live, or released and not
  // yet reported), the longest lease an offer may ask for, the lease of one that asks for none,
  // and the entries of each handoff event queue (released offers; aborts peers sent: one peer at
  // most a quarter of them), the oldest dropped when full.
  uint32_t max_offers = 65536;
  int64_t max_lease_ms = 3600000;
  int64_t offer_lease_ms = 60000;
  uint32_t max_handoff_events = 4096;
  // Telemetry (engine/telemetry.h): the peers that get series of their own; later ones are counted
  // under one "other" peer (a bound on the metrics' cardinality and memory).
  uint32_t max_metric_peers = 64;

  // Descriptors one link may hold: its two channels, and on a same-host link the peer's pidfd and
  // memory descriptor (transport/cma/cma.h).
  static constexpr uint32_t kDescriptorsPerLink = 4;
  // Descriptors kept back from links: listeners, handshakes, the application's own.
  static constexpr uint32_t kReservedDescriptors = 128;
  // 512, or what the soft RLIMIT_NOFILE leaves for links after the reserve (at least 1).
  static uint32_t defaultMaxLinks();
};

struct EngineConfig {
  uint64_t cluster_id = 0;
  Role role = Role::kMix;
  std::string listen_ip;           // empty = do not listen (pure client)
  uint16_t listen_port = 0;        // 0 = pick a free port
  int64_t sync_timeout_ms = 1000;  // bounds each pull and push
  PoolConfig device_pool;
  PoolConfig host_pool;
  Transport transport = Transport::kAuto;
  // The operator states that every process that can reach this one over the network is trusted.
  // UCX assumes so (a malformed connection message aborts the process, and UCX's workers accept
  // connections from anyone: docs/ucx.md, "Trust"): initialize refuses kUcx without it
  // (kFeatureNotEnabled), and kAuto considers ucx only with it.
  bool ucx_trusted_network = false;
  // When non-empty, both ends of every link must prove they know it (challenge-response in the
  // handshake, transport/wire.h); a peer that cannot is refused before it can reach any memory, and
  // every frame after the handshake is sealed under a session key (transport/auth_stream.h). Needs
  // the system's libcrypto (core/crypto.h): initialize() fails with kFeatureNotEnabled without it.
  std::string link_secret;
  // With a link secret: the transfers' payloads (tensor bytes) are sealed too, not only the frames
  // around them. Either side asking for it is enough. Costs one HMAC-SHA256 pass over every byte
  // on each side (docs/security.md). Without a secret: kParamInvalid.
  bool payload_integrity = false;
  // DEVICE transfers over HCCL use its one-sided access (HcclBatchGet/Put) when both ends enable
  // it, both runtimes have it and the memory was registered before the link; otherwise two-sided
  // (HcclBatchSendRecv). Off by default: the one-sided API is not public HCCL and its struct
  // layouts changed between CANN releases (docs/ascend.md).
  bool one_sided = false;
  // One-way links (llm_datadist's "hixl" transfer backend): only the side that dialled a link
  // reads and writes over it; the acceptor serves it but cannot use it for its own requests
  // (kNotYetLink until it links too), and both sides may link to each other, each link on its own.
  // unlink drops only this side's own link, without telling the peer, and succeeds when there is
  // none; switch_role keeps the links and the listener (a new listen address: kFeatureNotEnabled).
  bool one_way_links = false;
  EngineLimits limits;
};

struct PeerAddress {
  uint64_t cluster_id = wire::kAnyCluster;  // kAnyCluster: learn it from the peer's handshake
  std::string ip;
  uint16_t port = 0;
};

// Counters of what peers made an engine spend (Engine::stats): for tests, logs and metrics.
struct EngineStats {
  size_t live_links = 0;                // links with channels (dialled and accepted)
  size_t tombstones = 0;                // dead links still reported until unlinked (engine/link_table.h)
  size_t handshakes = 0;                // connections in a handshake now
  size_t threads = 0;                   // engine threads running (serving, handshakes)
  uint64_t handshakes_refused = 0;      // connections dropped for want of a handshake slot
  uint64_t handshakes_evicted = 0;      // silent connections dropped to make room for a newcomer
  uint64_t listener_backoffs = 0;       // times a listener paused for want of descriptors
  uint64_t pins_expired = 0;            // pins released before the peer's next frame
  size_t notifications = 0;             // notifications received and not yet taken
  uint64_t notifications_refused = 0;   // notifications refused because a queue bound was reached
  uint64_t offers_live = 0;             // KV handoff offers not yet released (engine/offers.h)
  uint64_t offers_released = 0;         // offers released, every reason
  uint64_t offers_expired = 0;          // of those, by their lease
  uint64_t offers_aborted = 0;          // of those, by an abort of this engine or of a peer
  uint64_t offer_bytes = 0;             // bytes the live offers retain
  uint64_t handoff_events_dropped = 0;  // handoff events dropped from a full queue
  uint64_t pinned_bytes = 0;            // bytes of this engine's memory pinned for peers' direct accesses now
  uint64_t role_epoch = 0;              // the role epoch (RoleState::epoch)
  double taken_at = 0;                  // when this snapshot was taken: seconds on the monotonic clock
  // Telemetry (engine/telemetry.h): this side's transfers, failures and link events, and its live
  // links by host path.
  std::vector<TransferSeries> transfers;
  std::vector<FailureSeries> failures;
  std::vector<LinkEventSeries> link_events;
  std::vector<std::pair<std::string, uint64_t>> links_by_path;
  // What changed since `earlier` (a snapshot of the same engine): counts and histograms as
  // differences, series absent from `earlier` whole; the gauges (live_links, tombstones, handshakes,
  // threads, notifications, offers_live, offer_bytes, pinned_bytes, role_epoch, links_by_path) and
  // taken_at as in this one.
  EngineStats since(const EngineStats& earlier) const;
};

// A notification a peer sent (Engine::notify): its cluster id and the bytes it sent.
struct Notification {
  uint64_t peer = 0;
  std::string name;
  std::string message;
};

// A pull or push, described from the caller's side. The engine turns it into byte runs (coalescing
// consecutive blocks) and validates local indices; the peer validates its own side.
struct TransferSpec {
  enum class Mode : uint8_t {
    kSlotToSlot,      // one batch slot of a contiguous cache <-> a remote slot
    kBlocksToBlocks,  // local_blocks[i] <-> remote_blocks[i]
    kSlotToBlocks,    // remote slot as consecutive blocks -> local_blocks[i] (pull only)
    kExplicit,        // local_runs[i] <-> remote_runs[i], offsets from each tensor's start (remote:
                      // from the target's base, or absolute addresses for a kRaw target)
  };
  uint64_t peer_cluster_id = 0;
  wire::Target target;  // the remote cache (resolved by the peer)
  int64_t local_cache_id = 0;
  Mode mode = Mode::kSlotToSlot;
  uint64_t local_slot = 0;  // kSlotToSlot
  int64_t size = -1;        // kSlotToSlot: bytes per tensor, -1 = the local slot size
  std::vector<int64_t> local_blocks;
  std::vector<int64_t> remote_blocks;
  // Tensor mapping: local_tensors[i] <-> remote_tensors[i]. Empty = every local tensor i <-> i.
  std::vector<uint32_t> local_tensors;
  std::vector<uint32_t> remote_tensors;
  std::vector<wire::Run> local_runs;   // kExplicit
  std::vector<wire::Run> remote_runs;  // kExplicit
  // kExplicit only: local_runs are absolute addresses, each inside registered memory of this engine
  // (any cache; local_cache_id and the tensor mapping are ignored), each of one placement. The
  // whole list then goes to the peer as one request (up to limits::kMaxRequestPieces runs), so a
  // peer that refuses any run moves none of them. The list may mix HOST and DEVICE memory on
  // either side: with a device backend such a list moves over the stream path, its DEVICE ranges
  // staged through host memory; one all in DEVICE memory on both sides takes the device paths.
  bool local_absolute = false;
  // Bounds the whole transfer; 0 or less: the engine's EngineConfig::sync_timeout_ms.
  int64_t timeout_ms = 0;
  // The transfer's cancel token (core/cancel.h), the caller's for the whole call; null: none.
  const CancelToken* cancel = nullptr;
};

// How a prepared transfer maps blocks (issue #36; docs/native_api.md, "Block views and ratios"). The
// default maps every byte of local block i to remote block remote[i]. A view is the byte range
// [offset, offset + length) of every block of one side (a head slice of a head-major block; length
// 0: the whole block); a ratio r maps one local block to r remote blocks: the local view is cut in
// r equal pieces, piece j <-> the remote view of remote block remote[r * i + j] (prefill blocks of
// 16 tokens into decode blocks of 32, token-major). So remote_view length * r == local view length.
struct BlockMapping {
  uint64_t remote_block_size = 0;  // the peer's block size (0: the local one)
  uint64_t local_view_offset = 0;
  uint64_t local_view_length = 0;  // 0: the whole local block
  uint64_t remote_view_offset = 0;
  uint64_t remote_view_length = 0;  // 0: the local view's length / block_ratio
  uint32_t block_ratio = 1;
};

// A prepared block transfer (Engine::prepare, pdlink.Engine.prepare): this side's cache and the
// peer's memory described once, then posted many times with block-index arrays. Local block i is
// bytes [i * block_size, +block_size) of each local tensor; remote block j is the same range of the
// peer's blocks cache published under `target.model_id` (kBlocks, which the peer checks against its
// own block size), or [remote_base + j * block_size, +block_size) of the peer's registered memory
// (kRaw, one tensor); `mapping` narrows both to views, with the peer's own block size (BlockMapping).
//
// Not a pin: it holds the local cache only weakly, with the generation of this side's registry when
// it was last checked. A post after any registry change re-checks that the same cache is still
// registered ("re-prepares") and fails with kParamInvalid when it is not; the peer checks its side on
// every post (its registry, and the cma path's cached descriptor by the peer's generation), so a
// post after the peer deregistered fails with the peer's code and moves nothing.
// Threading: one PreparedTransfer may be posted from several threads (its fields are immutable but
// the generation, which is atomic); posts on one link are serialised like any transfer.
struct PreparedTransfer {
  uint64_t peer_cluster_id = 0;
  wire::Target target;         // kBlocks or kRaw
  uint64_t remote_base = 0;    // kRaw: the peer's address of remote block 0
  uint64_t remote_blocks = 0;  // kRaw: the remote blocks there (the bound on remote indices); kBlocks: 0
  int64_t local_cache_id = 0;
  uint64_t block_size = 0;                              // the local block size
  BlockMapping mapping;                                 // resolved: sizes and view lengths all set
  uint64_t local_blocks = 0;                            // tensor_size / block_size of the local cache
  std::vector<uint32_t> local_tensors, remote_tensors;  // pairs; all local tensors i <-> i when empty
  std::weak_ptr<CacheEntry> local;
  std::atomic<uint64_t> generation{0};  // of this side's registry when `local` was last checked
  // The epoch fence (wire v7, a u32 since v8): 0 until the first response of the peer to a post of it, then that
  // response's epoch tag, sent with every later post; a peer whose role epoch moved since refuses
  // those with kStaleEpoch (nothing moved): prepare again.
  std::atomic<uint32_t> epoch_tag{0};
};

}  // namespace pdlink
