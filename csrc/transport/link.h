// Link: the engine's connection to one peer cluster (llm_datadist's "link entity").
//
// A link is symmetric once established: either side may pull from or push to the other. It holds
// two channels (transport/wire.h): `out`, on which this side sends requests and reads responses
// (callers serialise on out_mu), and `in`, which one serving thread owned by the engine reads.
// With a link secret each channel is an AuthStream over its socket (transport/auth_stream.h):
// every frame is sealed and checked under the channel's session key.
//
// A link breaks when a transfer on it times out or fails mid-stream (the byte stream can no longer
// be trusted) or when the peer closes its end. A broken link stays in the engine's table, so that
// switch_role still reports LLM_EXIST_LINK, until it is unlinked or the peer re-links.
// Threading: state_ and error_ are guarded by state_mu_; the sockets are shut down (never closed)
// by breakLink(), so a thread blocked on them wakes with an error and no fd is reused under it.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backends/backend.h"
#include "core/deadline.h"
#include "core/status.h"
#include "transport/auth_stream.h"
#include "transport/socket.h"
#include "transport/wire.h"

namespace pdlink {

class DataPath;  // transport/path.h

// What a path keeps on one link (the device paths: their channels; ucx: its endpoint back to the
// peer), defined in the path's folder. Dropped with the link.
class PathLinkState {
 public:
  virtual ~PathLinkState() = default;
};

// A path's key to its state on every link: the path's folder defines one (a static PathSlot) per
// kind of state it keeps; paths that share a state (the two HCCL paths, one device channel) share
// the slot. The link knows none of them.
struct PathSlot {
  const char* name;
};

// What `Engine::links()` reports of one link (or of a dead link's tombstone, engine/link_table.h).
struct LinkInfo {
  uint64_t peer_cluster_id = 0;
  std::string peer_address;
  bool initiator = false;  // this side dialled
  bool broken = false;
  std::string broken_reason;
  std::string transport;
  bool authenticated = false;             // every frame is sealed under a session key (a link secret)
  bool payload_integrity = false;         // and so is every payload
  std::vector<std::string> device_paths;  // the paths of this side's DEVICE-memory requests, in the order tried
  std::vector<std::string> lanes;         // what the host path moves bytes over (ucx: "tcp/lo", ...)
  bool confirmed = false;                 // accepted, and the engine at the peer's address said it made it
};

// Where this side's transfer now holding a link's out mutex is (Link::stage): what a failure is
// counted against (engine/telemetry.h). kAdmission: nothing sent yet; kRequest: sending the
// request; kServed: waiting for the peer's answer (a refusal is the peer's); kPayload: moving the
// bytes; kCommit: confirming a completed access to the peer.
enum class TransferStage : uint8_t { kAdmission, kRequest, kServed, kPayload, kCommit };
constexpr int kTransferStages = 5;
const char* stageName(TransferStage stage);

// Why a link went down (Link::breakLink), as telemetry counts it (engine/telemetry.h).
enum class LinkDown : uint8_t { kFailed, kUnlinked, kPeerUnlinked, kReplaced, kFinalized };
constexpr int kLinkDownReasons = 5;
const char* downName(LinkDown why);

// One extra TCP stream of a link (a LANE channel, transport/wire.h): its socket, and with a link
// secret its sealed stream under the lane's own session key. `token` is held for as long as the
// lane exists (the engine counts its lanes with it: EngineLimits::max_tcp_lanes).
struct Lane {
  Socket sock;
  std::unique_ptr<AuthStream> auth;
  std::shared_ptr<void> token;
  Stream& stream() { return auth ? static_cast<Stream&>(*auth) : sock; }
};

class Link {
 public:
  Link(uint64_t peer_cluster_id, Socket out, Socket in, bool initiator);
  ~Link();
  // Both ends wait for the next frame spinning this long before they sleep (transport/socket.h):
  // a requester for its reply, the serving thread for the next request of a busy peer.
  static constexpr int kSpinUs = 50;

  // The process at the other end of this link's AF_UNIX channels, as the kernel reported it
  // (SO_PEERCRED on both channels; transport/socket.h), and where its registry publishes the words a
  // direct reader checks (Registry::Published). Set before the link is shared, then constant.
  // pid 0: no same-host proof (TCP channels, or a peer whose pid this namespace cannot see). Only a
  // proven link may use a same-host path, and addresses a peer sends are applied to that pid only.
  void setPeerProcess(pid_t pid, uint64_t published_addr) {
    peer_process_.pid = pid;
    peer_process_.published_addr = published_addr;
  }
  // The kernel proved the peer runs on this host (see setPeerProcess).
  bool sameHost() const { return peer_process_.pid != 0; }
  bool inProcess() const;  // the peer is another engine of this process

  uint64_t peerPublishedAddr() const { return peer_process_.published_addr; }
  // Something a path keeps alive for as long as the link is not broken (cma: the grant that keeps
  // this process readable by same-host peers, cma::Grant); set before the link is shared, dropped by
  // breakLink. Null: nothing.
  void holdUntilBroken(std::shared_ptr<void> held) { held_ = std::move(held); }

  // The data paths of this side's requests (transport/path.h), chosen when the link is made (before
  // it is shared, by the engine's path table): the one for host memory, and, on a device backend,
  // the ones for DEVICE memory in the order they are tried. Owned by the link (host path) or by the engine (device
  // paths), which outlives it.
  void setPaths(std::unique_ptr<DataPath> host, std::vector<DataPath*> device);
  DataPath& hostPath() { return *host_path_; }                                 // requires outMutex()
  const std::vector<DataPath*>& devicePaths() const { return device_paths_; }  // requires outMutex()
  // A device path the peer turned down for good (one whose peer's runtime lacks what it needs).
  void dropDevicePath(const DataPath* path);  // requires outMutex()
  // The names of devicePaths(), for links(): readable without outMutex() (a transfer may hold it).
  std::vector<std::string> devicePathNames() const;
  // What links() reports: the host path's name (PathCaps::name), and its lanes (DataPath::lanes).
  const char* transport() const;
  std::vector<std::string> lanes() const;

  // What the paths keep for this link (PathLinkState), one per slot and side: `out` for this side's
  // requests (requires outMutex()), `in` for the peer's (set and used only by the serving thread).
  // Null until the path sets it; a path drops its state (set null) when it can no longer be trusted.
  PathLinkState* outState(const PathSlot& slot) const { return find(out_states_, slot); }  // requires outMutex()
  void setOutState(const PathSlot& slot, std::unique_ptr<PathLinkState> state) {           // requires outMutex()
    put(out_states_, slot, std::move(state));
  }
  PathLinkState* inState(const PathSlot& slot) const { return find(in_states_, slot); }
  void setInState(const PathSlot& slot, std::unique_ptr<PathLinkState> state) {
    put(in_states_, slot, std::move(state));
  }

  // The epoch fence of this side's requests (wire v7, a u32 since v8): `send`, the tag the reads, writes and
  // describes of the transfer now holding outMutex() carry (0: unfenced); `seen`, the tag of the
  // peer's last answer to them (0: none yet). Set and reset by that transfer; its lanes' pumps read
  // `send` and write `seen` while it runs.
  struct EpochTags {
    std::atomic<uint32_t> send{0};
    std::atomic<uint32_t> seen{0};
  };
  EpochTags& epochTags() { return epoch_tags_; }
  // The stage of this side's transfer now holding outMutex() (TransferStage), set by it and by the
  // path helpers it calls (transport/path.h); its lanes' pumps may set it too.
  void setStage(TransferStage stage) { stage_.store(static_cast<uint8_t>(stage), std::memory_order_relaxed); }
  TransferStage stage() const { return static_cast<TransferStage>(stage_.load(std::memory_order_relaxed)); }
  // The serving side's split pull of the peer (wire::kMarkSplit; engine/request_server.h), one word
  // so that its three moves are each one atomic step: none -> open (its first chunk: openSplit), open
  // -> ended (a role switch's drain-timeout rollback, LinkManager::switchRole: endSplit), open or
  // ended -> none (its end frame, or the link's serving threads ending: closeSplit). An open pull is
  // counted in the engine's served_in_flight; an ended one is not (its count was given back when it
  // was ended, so it cannot hold a later switch) and its later chunks are refused until it closes.
  // openSplit returns the word as it found it (kNone: this chunk opened the pull, and must add that
  // count; kOpen: a continuation; kEnded: a chunk of an ended pull, refused), read in the same atomic
  // step, so an end frame on another stream of the link cannot slip in between; endSplit/closeSplit
  // return true when the caller must give back that count. Called by the link's serving threads
  // (channel and lanes) and the switch.
  enum class Split : uint8_t { kNone = 0, kOpen = 1, kEnded = 2 };
  Split openSplit() {
    uint8_t expected = static_cast<uint8_t>(Split::kNone);
    split_.compare_exchange_strong(expected, static_cast<uint8_t>(Split::kOpen), std::memory_order_seq_cst);
    return static_cast<Split>(expected);
  }
  bool endSplit() {
    uint8_t expected = static_cast<uint8_t>(Split::kOpen);
    return split_.compare_exchange_strong(expected, static_cast<uint8_t>(Split::kEnded), std::memory_order_seq_cst);
  }
  bool closeSplit() {
    return split_.exchange(static_cast<uint8_t>(Split::kNone), std::memory_order_seq_cst) ==
           static_cast<uint8_t>(Split::kOpen);
  }

  uint64_t peer() const { return peer_; }
  bool initiator() const { return initiator_; }
  // The address this side dialled ("ip:port", also for a link redirected to an AF_UNIX socket), or
  // where an accepted link came from.
  const std::string& peerAddress() const { return peer_address_.empty() ? out_.peer() : peer_address_; }
  void setPeerAddress(std::string address) { peer_address_ = std::move(address); }  // before the link is shared
  // Who made the link, for a confirmation (Engine::confirmDialled): its forward hello's nonce, and
  // the forward channel's dialling end ("ip:port" as the acceptor saw it, or "unix:pid N"). An
  // accepted link also keeps its source (LinkManager::sourceOf), for the per-source share. Set before
  // the link is shared.
  void setOrigin(std::string source, const wire::Nonce& nonce, std::string endpoint) {
    source_ = std::move(source);
    nonce_ = nonce;
    endpoint_ = std::move(endpoint);
  }
  const std::string& source() const { return source_; }
  // An accepted link whose peer this engine confirmed (LinkManager::settleClaim: the engine at the
  // address its cluster id was dialled at answered that it made this very link): its identity is then
  // as proven as a dialled link's, for as long as this Link object lives (a replacement is a new one).
  // Any thread; never unset.
  void markConfirmed() { confirmed_.store(true, std::memory_order_release); }
  bool confirmed() const { return confirmed_.load(std::memory_order_acquire); }
  const wire::Nonce& nonce() const { return nonce_; }
  const std::string& endpoint() const { return endpoint_; }

  // Authenticates both channels under their session keys (an authenticated link; before the link
  // is shared): from now on out()/in() seal and check every frame.
  void authenticate(std::shared_ptr<const crypto::Key> out_key, std::shared_ptr<const crypto::Key> in_key,
                    bool payload_integrity) {
    out_auth_ = std::make_unique<AuthStream>(out_, std::move(out_key), true, payload_integrity);
    in_auth_ = std::make_unique<AuthStream>(in_, std::move(in_key), false, payload_integrity);
  }
  bool authenticated() const { return out_auth_ != nullptr; }
  bool payloadIntegrity() const { return out_auth_ && out_auth_->payloadIntegrity(); }

  // The channels frames travel on: requests out, the peer's requests in.
  Stream& out() { return out_auth_ ? static_cast<Stream&>(*out_auth_) : out_; }
  Stream& in() { return in_auth_ ? static_cast<Stream&>(*in_auth_) : in_; }
  // The socket under out(), for what is not a frame (the acceptor's last handshake message).
  Socket& outSocket() { return out_; }
  std::mutex& outMutex() { return out_mu_; }

  // The link's lanes (transport/tcp/stream_path.h): extra TCP streams this side requests on (out,
  // dialled by the initiator) or serves (in, accepted by the acceptor). Added at most `max` per
  // direction and never removed until the link goes; a lane added to a broken link is shut down at
  // once. addLane returns the lane (valid for the link's lifetime), or null when the link is
  // broken or already has `max` lanes that way (the lane is then dropped).
  Lane* addLane(bool out, Socket sock, std::shared_ptr<const crypto::Key> key, bool payload_integrity,
                std::shared_ptr<void> token, size_t max);
  std::vector<Stream*> outLanes() const;
  size_t laneCount(bool out) const;
  // What opens this side's out lanes, once per link, on the first large transfer (set by the
  // engine before the link is shared, on links it dialled over TCP; null: none). Called with the
  // out mutex held; bounded by `deadline`; adds the lanes it could open.
  using LaneOpener = std::function<void(Link&, Deadline)>;
  void setLaneOpener(LaneOpener opener) { lane_opener_ = std::move(opener); }
  // Runs the opener the first time it is called on this link (requires outMutex()).
  void openLanesOnce(Deadline deadline);
  // The streams this side's tcp requests use (the out channel and its lanes) and the chunk size, as
  // the engine configured them (EngineLimits::tcp_streams, tcp_chunk_bytes); set before the link is shared.
  void setStreamPlan(uint32_t streams, uint64_t chunk_bytes) {
    streams_ = streams;
    chunk_bytes_ = chunk_bytes;
  }
  uint32_t streams() const { return streams_; }
  uint64_t chunkBytes() const { return chunk_bytes_; }
  // The round trip last measured on this link (a lane's handshake, microseconds; 0: none yet).
  void setRoundTripUs(uint64_t us) { rtt_us_.store(us, std::memory_order_relaxed); }
  uint64_t roundTripUs() const { return rtt_us_.load(std::memory_order_relaxed); }

  bool broken() const;
  std::string brokenReason() const;
  // Marks the link unusable and wakes both channels. Idempotent; the first reason is kept, and the
  // first call (only) runs the down hook with `why`, on the calling thread, no lock held.
  void breakLink(const std::string& reason, LinkDown why = LinkDown::kFailed);
  // What breakLink reports the link's end to (the engine's telemetry); set once the link is
  // installed (LinkManager::installLink); on a link already broken it runs at once.
  using DownHook = std::function<void(LinkDown)>;
  void setDownHook(DownHook hook);
  // This side is ending the link (`why`: unlinking, finalizing) and may see its channels close
  // before it breaks the link itself: a break for a failure from now on reports `why` instead.
  void ending(LinkDown why) { ending_.store(static_cast<uint8_t>(why) + 1, std::memory_order_relaxed); }

 private:
  const uint64_t peer_;
  const bool initiator_;
  std::atomic<bool> confirmed_{false};
  Socket out_;
  Socket in_;
  std::unique_ptr<AuthStream> out_auth_, in_auth_;  // set before the link is shared, then constant
  std::mutex out_mu_;                               // held for a whole request/response exchange on out_
  struct PeerProcess {
    pid_t pid = 0;
    uint64_t published_addr = 0;
  };
  using States = std::vector<std::pair<const PathSlot*, std::unique_ptr<PathLinkState>>>;
  static PathLinkState* find(const States& states, const PathSlot& slot);
  static void put(States& states, const PathSlot& slot, std::unique_ptr<PathLinkState> state);
  PeerProcess peer_process_;             // set before the link is shared, then constant
  std::unique_ptr<DataPath> host_path_;  // set before the link is shared
  std::vector<DataPath*> device_paths_;  // guarded by out_mu_
  std::shared_ptr<void> held_;           // set before the link is shared; dropped by breakLink under state_mu_
  std::string peer_address_;
  std::string source_;
  wire::Nonce nonce_{};
  std::string endpoint_;
  States out_states_;                                        // guarded by out_mu_
  std::vector<std::unique_ptr<Lane>> out_lanes_, in_lanes_;  // guarded by state_mu_, only ever grow
  LaneOpener lane_opener_;                                   // set before the link is shared
  bool lanes_tried_ = false;                                 // guarded by out_mu_
  uint32_t streams_ = 1;
  uint64_t chunk_bytes_ = uint64_t{1} << 20;
  std::atomic<uint64_t> rtt_us_{0};
  std::atomic<uint8_t> stage_{0};
  std::atomic<uint8_t> ending_{0};           // 0, or 1 + the LinkDown this side is ending the link with
  DownHook down_hook_;                       // guarded by state_mu_
  LinkDown broken_why_ = LinkDown::kFailed;  // guarded by state_mu_
  EpochTags epoch_tags_;
  std::atomic<uint8_t> split_{0};  // a Split
  States in_states_;               // serving thread only
  mutable std::mutex state_mu_;
  bool broken_ = false;                         // guarded by state_mu_
  std::string broken_reason_;                   // guarded by state_mu_
  std::vector<std::string> device_path_names_;  // guarded by state_mu_; follows device_paths_
};

}  // namespace pdlink
