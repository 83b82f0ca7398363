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
// Threading: every public method is thread-safe. Transfers on one link are serialised; transfers on
// different links run in parallel. Background threads: one listener thread (while listening), one
// handshake thread per connection being accepted, one serving thread per link. initialize() and
// finalize() must not race with other calls (as in llm_datadist).
// Lock order: mu_ before a Link's out mutex; the registry's own mutex is never held while calling
// out of the registry.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backends/backend.h"
#include "core/status.h"
#include "transport/link.h"
#include "engine/link_table.h"
#include "engine/mem_pool.h"
#include "transport/path.h"
#include "transport/path_table.h"
#include "engine/pin_epochs.h"
#include "engine/registry.h"
#include "transport/listener.h"
#include "transport/socket.h"

namespace pdlink {

namespace ucx {
class UcxHub;
}

// Values match llm_datadist.LLMRole.
enum class Role : uint8_t { kPrompt = 1, kDecoder = 2, kMix = 3 };

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
  // and from all the links of one source (an IP address, or a local uid: Engine::sourceOf).
  uint64_t max_notification_bytes_per_source = uint64_t{4} << 20;

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
  size_t live_links = 0;               // links with channels (dialled and accepted)
  size_t tombstones = 0;               // dead links still reported until unlinked (engine/link_table.h)
  size_t handshakes = 0;               // connections in a handshake now
  size_t threads = 0;                  // engine threads running (serving, handshakes)
  uint64_t handshakes_refused = 0;     // connections dropped for want of a handshake slot
  uint64_t handshakes_evicted = 0;     // silent connections dropped to make room for a newcomer
  uint64_t listener_backoffs = 0;      // times a listener paused for want of descriptors
  uint64_t pins_expired = 0;           // pins released before the peer's next frame
  size_t notifications = 0;            // notifications received and not yet taken
  uint64_t notifications_refused = 0;  // notifications refused because a queue bound was reached
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
};

// A prepared block transfer (Engine::prepare, pdlink.Engine.prepare): this side's cache and the
// peer's memory described once, then posted many times with block-index arrays. Local block i is
// bytes [i * block_size, +block_size) of each local tensor; remote block j is the same range of the
// peer's blocks cache published under `target.model_id` (kBlocks, which the peer checks against its
// own block size), or [remote_base + j * block_size, +block_size) of the peer's registered memory
// (kRaw, one tensor).
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
  uint64_t remote_blocks = 0;  // kRaw: the blocks there (the bound on remote indices); kBlocks: 0
  int64_t local_cache_id = 0;
  uint64_t block_size = 0;
  uint64_t local_blocks = 0;                            // tensor_size / block_size of the local cache
  std::vector<uint32_t> local_tensors, remote_tensors;  // pairs; all local tensors i <-> i when empty
  std::weak_ptr<CacheEntry> local;
  std::atomic<uint64_t> generation{0};  // of this side's registry when `local` was last checked
};

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

  uint64_t clusterId() const { return config_.cluster_id; }
  Role role() const;
  // The bound listen port, 0 when not listening.
  uint16_t listenPort() const;
  const char* backendName() const { return backend_->name(); }
  const std::shared_ptr<Backend>& backend() const { return backend_; }

  // kExistLink while any link exists. With a listen address: start listening there, or move the
  // listener if it differs from the current one; with an empty ip: stop listening.
  Status switchRole(Role role, const std::string& listen_ip, uint16_t listen_port);

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
  Status unregisterCache(int64_t cache_id);
  void removeCacheKey(const RequestKey& key);
  size_t cacheCount() const { return registry_.size(); }
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
  // `remote_base`. kParamInvalid for a bad description; nothing is sent to the peer.
  Result<std::shared_ptr<PreparedTransfer>> prepare(const TransferSpec& spec, uint64_t block_size, uint64_t remote_base,
                                                    uint64_t remote_bytes);
  // Moves local block local[i] <-> remote block remote[i] for i < n (coalescing consecutive pairs),
  // a pull or a push, bounded by the sync timeout. Errors as pull/push; kParamInvalid for an index
  // out of range or a local cache that is no longer registered.
  Status post(PreparedTransfer& p, const int64_t* local, const int64_t* remote, size_t n, bool is_push);

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
  struct ServeState {
    std::vector<std::shared_ptr<CacheEntry>> pinned;  // what a direct or IPC access of the peer uses
    std::vector<std::string> exported;                // IPC keys exported for it
    bool unlinked = false;                            // the peer unlinked
    PinEpochs::Word* pin_epoch = nullptr;             // this link's (pin_epochs_), while it is served
  };
  Status serveStream(const std::shared_ptr<Link>& link, Stream& in, ServeState* state);

 private:
  Engine(std::shared_ptr<Backend> backend, const Capabilities& caps);
  Result<TransferPlan> plan(const TransferSpec& spec, bool is_push);
  // The plan of a local_absolute spec, into *out (its vectors' capacity reused); the local caches
  // are held in scratch->keep, which out->local points at without owning: the caller keeps both
  // until the transfer is over.
  Status planAbsolute(const TransferSpec& spec, Resolved* scratch, TransferPlan* out);
  static std::vector<TransferPlan> split(const TransferPlan& p);
  Status transfer(const TransferSpec& spec, bool is_push);
  // Moves a planned transfer over `link` (split into requests within the per-request bounds).
  Status execute(const std::shared_ptr<Link>& link, TransferPlan& p, bool is_push, int64_t timeout_ms);
  // One request of a transfer (requires the out mutex), on the link's path for the local cache's
  // memory: its host path, or its device paths in order (transport/path.h).
  Status transferPart(const std::shared_ptr<Link>& link, TransferPlan& p, bool is_push, Deadline deadline,
                      const char* what);
  Result<std::shared_ptr<Link>> usableLink(uint64_t peer);
  // The paths of this side's requests on a new link (before it is shared), as the path table picks
  // them from what the handshake proved (`direct`: chooseTransport allowed cma) and what this
  // engine offers (PathTable::choose).
  void choosePaths(Link& link, bool direct);

  Result<std::unique_ptr<Listener>> startListener(const std::string& ip, uint16_t port);
  // The AF_UNIX listener same-host diallers are redirected to, under a random abstract name
  // (started by initialize unless the transport is forced to tcp; without it links use TCP).
  Result<std::unique_ptr<Listener>> startUnixListener(std::string* name);
  // What every listener does with an accepted connection: a handshake thread, within the caps.
  Listener::AcceptFn acceptor();
  void stopListeners();
  // A handshake slot held by an incoming connection's thread; release() gives it back (once).
  // Fields other than `engine` and `source` are guarded by mu_.
  struct HandshakeSlot {
    Engine* engine = nullptr;
    std::string source;
    uint64_t arrival = 0;  // order of arrival (Slots::silent)
    int silent = -1;       // the connection's descriptor, while it has not sent its hello
    bool evicted = false;  // made room for a newcomer: its thread is on its way out
    void release();
    ~HandshakeSlot() { release(); }
  };
  // Where a connection comes from, for the per-source shares (docs/security.md, "Limits").
  static std::string sourceOf(const Socket& s);
  // The slot's connection sent its hello (or is gone): it can no longer be evicted.
  void hearLocked(HandshakeSlot* slot);
  // Drops the oldest silent connection (of the newcomer's source, or of anyone); false if none.
  bool evictSilentLocked(const std::string& newcomer, bool same_source);
  static constexpr size_t kEvictingPerSlot = 4;
  void handleIncoming(Socket sock, HandshakeSlot* slot);
  // The two channels of a link this side dials, and what the handshake proved about the peer.
  struct Dialled;
  Result<Dialled> dialTcp(const PeerAddress& peer, bool offer_same_host, uint64_t* peer_id, Deadline deadline,
                          std::string* redirect);
  // `reached`: the acceptor answered (a failure after that is the acceptor's refusal, not a sign
  // that its socket is out of reach).
  Result<Dialled> dialUnix(const std::string& name, uint64_t* peer_id, Deadline deadline, bool* reached);
  Status linkOne(const PeerAddress& peer, int64_t timeout_ms, uint64_t* linked_id);
  Status unlinkOne(uint64_t cluster_id, int64_t timeout_ms, bool force);
  void installLink(const std::shared_ptr<Link>& link);
  // Keeps `nonce` (a link this side is dialling to `peer`) confirmable (serveConfirm) until the
  // returned handle goes.
  std::shared_ptr<void> markDialling(const wire::Nonce& nonce, uint64_t peer, const std::string& endpoint);
  // Asks the peer over `link` (dialled, not yet installed) whether it dialled `claimed` (an
  // accepted link): its hello's nonce and the end it came from (Link::endpoint). OK if so; its
  // refusal if not; a transport failure breaks `link`.
  Status confirmDialled(Link& link, const Link& claimed, Deadline deadline);
  // Tells the peer to forget `link` (dialled, never installed) and breaks it.
  void dropUnused(Link& link, Deadline deadline);
  // Answers kConfirm: whether this engine dialled (or is dialling) the asker with that nonce.
  Status serveConfirm(const Link& link, Stream& s, const std::string& body, Deadline deadline);
  // Whether the peer still answers on `link` (pings over a window of kProbeWindowMs, or a transfer
  // running on it); breaks it when not.
  bool stillAlive(const std::shared_ptr<Link>& link);
  // Whether this side's requests copy the peer's memory directly: only for a peer the kernel
  // identified (pid != 0) on the AF_UNIX `channel`, held as a cma::Process, after a probe read of
  // its published words; `process` is then set. kLinkFailed when cma is forced and not possible.
  Status chooseTransport(const Socket& channel, pid_t peer_pid, uid_t peer_uid, uint64_t published_addr,
                         std::shared_ptr<const cma::Process>* process) const;
  void serve(const std::shared_ptr<Link>& link);
  // Serving one request read from `in`; a non-OK result means the channel is unusable.
  Status serveOne(const std::shared_ptr<Link>& link, Stream& in, ServeState* state);
  // Admission (with wire's bounded decoders, the only place that turns what a peer sent into
  // work). admitHeader: whether a frame of this kind and size may be read at all on this link
  // (non-OK: a protocol violation, the link is dropped). admitAccess: whether a read or write may
  // use the path its flags ask for on this link (non-OK: refused, the link stays).
  Status admitHeader(const Link& link, const wire::RequestHeader& h) const;
  int64_t pinTimeoutMs() const {
    const int64_t set = config_.limits.pin_timeout_ms;
    return set > 0 ? set : std::max<int64_t>(2 * config_.sync_timeout_ms, 5000);
  }
  Status admitAccess(const Link& link, const wire::RequestHeader& h) const;
  // The device channel of this side's requests on `link`, created on first use (requires the out
  // mutex): a rendezvous the peer accepts, then both join. The peer's refusal (no device channels
  // there) comes back as its status, the link intact.
  Status ensureDeviceChannel(const std::shared_ptr<Link>& link, Deadline deadline, const char* what);
  // The DEVICE memory a device channel prepares for one-sided access: the device pool and every
  // registered DEVICE cache's tensors.
  std::vector<Segment> preparedRegions() const;
  Status serveDeviceChannel(const std::shared_ptr<Link>& link, Stream& s, const std::string& rendezvous,
                            Deadline deadline);
  // A kNotify frame: queued within the limits and acknowledged (a refusal keeps the link); a
  // malformed body drops the link.
  Status serveNotify(const Link& link, Stream& s, const std::string& body, Deadline deadline);
  // Starts an engine thread (detached; finalize waits for every one). Throws std::system_error when
  // the system has no thread to give.
  void spawn(std::function<void()> fn);

  std::shared_ptr<Backend> backend_;
  // From backend_->capabilities(), read once: device channels; same-host DEVICE transfers by IPC;
  // a runtime with HCCL one-sided access.
  const bool device_transport_;
  const bool ipc_;
  const bool one_sided_;
  // The data paths (transport/path_table.h): the serving side of each, and the requesting side of
  // the device paths (a link's host path is its own object, Link::hostPath). The ucx entry's
  // server is set by initialize and dropped by finalize.
  PathTable paths_;
  PinEpochs pin_epochs_;  // one word per served link
  // Transport::kUcx, or kAuto with ucx_trusted_network where UCX loads: the engine's UCX workers
  // (shared with its links' paths, which may outlive finalize); set by initialize, dropped by
  // finalize.
  std::shared_ptr<ucx::UcxHub> ucx_hub_;
  // The stream path that stages DEVICE memory: descriptor lists mixing HOST and DEVICE memory, on
  // either side, on any link (transferPart).
  std::unique_ptr<DataPath> staged_path_;
  EngineConfig config_;
  wire::HostHint hint_;  // set by initialize()
  Registry registry_;
  std::shared_ptr<MemPool> device_pool_;
  std::shared_ptr<MemPool> host_pool_;

  mutable std::mutex mu_;
  bool initialized_ = false;    // guarded by mu_
  bool stopping_ = false;       // guarded by mu_
  Role role_ = Role::kMix;      // guarded by mu_
  LinkTable links_;             // guarded by mu_
  std::set<uint64_t> linking_;  // link attempts in flight, guarded by mu_
  struct Dialling {
    uint64_t peer;
    std::string endpoint;
  };
  std::map<wire::Nonce, Dialling> dialling_;            // links being dialled, by nonce; guarded by mu_
  std::deque<std::pair<uint64_t, uint64_t>> link_log_;  // (number, peer) of the latest links, guarded by mu_
  uint64_t link_seq_ = 0;                               // guarded by mu_

  // Listeners are destroyed (which joins their thread) only outside mu_.
  std::unique_ptr<Listener> listener_;       // from listen_ip_info / switch_role, guarded by mu_
  std::unique_ptr<Listener> comm_listener_;  // rendezvous endpoint of link(), guarded by mu_
  std::unique_ptr<Listener> unix_listener_;  // same-host redirect target, guarded by mu_
  std::string unix_name_;                    // its abstract name, guarded by mu_

  // Incoming links waiting for their REVERSE channel, keyed by the initiator's nonce.
  struct PendingLink {
    uint64_t peer = 0;
    std::string source;               // Engine::sourceOf the forward channel
    std::unique_ptr<Socket> forward;  // the channel this side will serve
    pid_t pid = 0;                    // SO_PEERCRED of an AF_UNIX forward channel
    uint64_t published_addr = 0;      // from the forward channel's ClientAuth (AF_UNIX only)
    std::shared_ptr<cma::Grant> grant;
    std::shared_ptr<const crypto::Key> session_key;  // the forward channel's (with a link secret)
    bool integrity = false;                          // payload integrity agreed on it
    std::shared_ptr<Link> link;                      // set by the REVERSE handler when the link is installed
    bool done = false;
  };
  std::map<wire::Nonce, std::shared_ptr<PendingLink>> pending_;  // guarded by mu_
  std::condition_variable pending_cv_;
  std::set<Socket*> handshaking_;  // sockets in a handshake; shut down by finalize, guarded by mu_
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
  Slots slots_;  // guarded by mu_
  std::atomic<uint64_t> handshakes_refused_{0};
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

  struct Threads {
    std::mutex mu;
    std::condition_variable cv;
    size_t running = 0;  // guarded by mu
  };
  std::shared_ptr<Threads> threads_ = std::make_shared<Threads>();  // engine threads still running
};

}  // namespace pdlink
