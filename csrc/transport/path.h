// The data-path interface: how the bytes of one transfer move between this process and a linked
// peer. The engine (csrc/engine) keeps roles, links, the registry, admission and the commit rule
// once for every path and decides which path a link uses; a path only moves bytes the engine has
// already checked (docs/architecture.md, "Data paths"). Nothing here knows the engine.
//
// A path has two halves:
//  - DataPath, the requesting side: one object per link and path, chosen when the link is made
//    (Link::hostPath, Link::devicePaths), called with the link's out mutex held;
//  - PathServer, the serving side: one object per engine and path, chosen by a request's flags,
//    called by the link's serving thread with a request the engine admitted and resolved.
// Each path sits in a folder of its own: transport/tcp (the stream), transport/cma (direct reads of
// a same-host peer's memory), transport/ucx, transport/device (HCCL two-sided and one-sided,
// same-host IPC); transport/path_table.h registers them.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "core/cancel.h"
#include "core/deadline.h"
#include "core/status.h"
#include "transport/link.h"
#include "transport/stream.h"
#include "transport/wire.h"

namespace pdlink {

// Byte runs for both sides of one request (Transfers::plan): the local cache's tensors and runs, and
// the body the peer resolves on its side.
struct TransferPlan {
  std::shared_ptr<const void> local;  // the local cache, kept registered until the transfer is over
  std::vector<uint64_t> local_addrs;  // its tensors' addresses
  bool local_absolute = false;        // a descriptor list: local_addrs is {0}, the runs are addresses
  Placement local_placement = Placement::kHost;
  std::vector<uint32_t> local_tensors;
  std::vector<wire::Run> local_runs;
  wire::TransferBody remote;  // target, block size, remote tensors and runs
  uint64_t payload = 0;
  // A local_absolute plan of a device backend (Transfers::planAbsolute) that touches DEVICE memory:
  // per local run, whether it lies in DEVICE memory, which the stream path moves through host
  // staging (moveStagedPayload). Empty otherwise.
  std::vector<uint8_t> local_device_runs;
  // The last request of the transfer: only it commits a pulled request key. A transfer of more
  // than limits::kMaxRequestPieces pieces is split into several requests (Transfers::transfer).
  bool commit = true;
  // The transfer's cancel token (core/cancel.h; null: not cancellable), owned by the caller for the
  // whole transfer. Checked between requests (Transfers::execute) and between the chunk requests of
  // a tcp transfer split over streams (StreamPath); a path never stops a request it has sent.
  const CancelToken* cancel = nullptr;
  // The engine's abort word and its value at the transfer's admission (core/cancel.h, CancelPoint):
  // a drain timeout moves it, and the transfer stops at its next cancel point. Null: none.
  const std::atomic<uint64_t>* abort = nullptr;
  uint64_t abort_admitted = 0;
  CancelPoint cancelPoint() const { return CancelPoint{cancel, abort, abort_admitted}; }
  // A prepared transfer's unit in bytes (a block, or a block view's piece: engine_types.h
  // BlockMapping): a split by size cuts runs at whole multiples of it (0: remote.block_size, or bytes).
  uint64_t block_unit = 0;
};

// What a path is, as typed fields (reported by links(), used to pick and to order paths).
struct PathCaps {
  const char* name = "";        // "tcp", "unix", "cma", "ipc", "hccl-one-sided", "hccl"
  uint8_t request_flags = 0;    // the wire::kFlag* bits its requests carry (what the server dispatches on)
  bool cross_host = false;      // reaches a peer on another host
  bool one_sided = false;       // the peer's threads do not copy the bytes (they only check and pin)
  bool device_memory = false;   // moves DEVICE memory of a device backend; else host memory
  bool device_channel = false;  // needs setting up on a link before its first transfer (DataPath::connect)
};

// What of the engine a path may use when it sets itself up on a link (DataPath::connect) or answers
// the peer's setup: the backend, what the runtime and the configuration allow. Made by the engine
// per call (EngineState::pathEnv).
struct PathEnv {
  Backend& backend;
  bool device_transport = false;  // the backend has device channels
  bool config_one_sided = false;  // the configuration enables one-sided access
  bool one_sided = false;         // the runtime has one-sided access
  bool forced_ucx = false;        // the engine's transport is forced to ucx (ucx::isPathOf)
  // The memory a device channel prepares for one-sided access (EngineState::preparedRegions).
  std::function<std::vector<Segment>()> prepared_regions;
};

// The requesting side of a path on one link.
class DataPath {
 public:
  virtual ~DataPath() = default;
  virtual const PathCaps& caps() const = 0;
  // What the path moves bytes over beneath its name, where it has a choice (the ucx path: UCX's
  // "transport/device" lanes once connected); empty for the rest. Thread-safe.
  virtual std::vector<std::string> lanes() const { return {}; }
  // Sets up what the path needs on `link` before it takes transfers there (the HCCL paths: the
  // link's device channel for this side's requests), once; a no-op once done and for a path that
  // needs nothing. Requires the link's out mutex. kFeatureNotEnabled with the link not broken: the
  // peer turned it down (the link itself is fine); other failures have broken the link.
  virtual Status connect(Link& link, const PathEnv& env, Deadline deadline, const char* what) { return Status::OK(); }
  // Whether this path may take transfers on `link` now (requires the link's out mutex).
  virtual bool usable(const Link& link) const { return true; }
  // Moves the bytes of `p` (pull: the peer's into local memory; push: the other way), by
  // `deadline`; requires the link's out mutex. kFeatureNotEnabled with the link not broken: this
  // path cannot take this transfer and nothing moved; the engine tries the link's next path. Any
  // other failure is the transfer's result; one that leaves the stream untrustworthy has broken the
  // link (failTransfer).
  virtual Status transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) = 0;
};

// One read or write the engine admitted (RequestServer::admitAccess) and resolved in its registry, for the
// path its flags name: exactly the checked ranges, addrs[t] + base + run.offset for every t of
// `tensors` and every run. A path touches nothing else.
struct ServeCall {
  Link& link;
  Stream& stream;  // the link's in channel: the answer goes here
  const wire::RequestHeader& header;
  const std::vector<uint64_t>& addrs;
  const std::vector<uint32_t>& tensors;
  uint64_t base;
  const std::vector<wire::Run>& runs;
  // A kRaw request over the stream path: per run, whether it lies in this device backend's DEVICE
  // memory (the stream server moves those through host staging). Empty: all host memory.
  const std::vector<uint8_t>& device_runs;
  uint64_t payload;  // bytes the request moves
  Deadline deadline;
  // Out: the peer may use the ranges until its next frame (addresses handed out): the engine keeps
  // the caches pinned until then, or until the pin bound.
  bool pin = false;
  // Out: IPC exports made for the peer, closed at its next frame (or the pin bound).
  std::vector<std::string>& exported;
  // The serving link's pin epoch word (engine/pin_epochs.h): a direct answer names it.
  const std::atomic<uint64_t>* pin_epoch = nullptr;
};

// The serving side of a path, one per engine.
class PathServer {
 public:
  virtual ~PathServer() = default;
  // Answers `call`. Non-OK: the channel can no longer be trusted (the link is dropped); a refusal
  // the link survives is an OK return after sendResponse with the refusal.
  virtual Status serve(ServeCall& call) = 0;
};

// ---------------------------------------------------------------- helpers (path.cc)

// "cluster <id>", how messages and logs name a peer.
std::string clusterName(uint64_t id);
// Whether a completed pull through this target must release a request key on the peer.
bool usesKeyCommit(wire::TargetKind kind);

// Marks the link unusable after `st` broke its stream, and says so: kTimeout stays kTimeout, the
// rest becomes kLinkFailed, both naming what to do.
Status failTransfer(Link& link, const Status& st, const char* what);
// Reads the response to a request on the link's out channel: a transport failure poisons the link
// (failTransfer); a refusal by the peer comes back as the peer's status, the link intact (its
// scope the code's default, but kLink where that is kEngine: the peer's engine, not this one).
Status awaitResponse(Link& link, Deadline deadline, const char* what, wire::ResponseHeader* rh);
// The epoch tag a request of kind `op` carries on `link` now (Link::EpochTags: the transfer's, for
// reads, writes and describes; 0 otherwise). request() stamps it; a path that encodes its own
// headers calls it.
uint32_t fenceTag(Link& link, wire::Op op);
// Sends header + body on the out channel, then awaitResponse.
Status request(Link& link, const wire::RequestHeader& header, const std::string& body, Deadline deadline,
               const char* what, wire::ResponseHeader* rh);
// request() of a read (pull) or write (push) of `body` (an encoded TransferBody) with these flags.
Status requestAccess(Link& link, const std::string& body, bool is_push, uint8_t flags, Deadline deadline,
                     const char* what, wire::ResponseHeader* rh);
// Tells the peer an access through `body` is over: kCommit after a pull that received every byte
// (the peer may then release the request key it read: never before, so a failed pull leaves the
// source intact and retryable), kRelease to unpin after a direct or IPC access. Not answered; a
// failure to send it breaks the link.
void finishAccess(Link& link, wire::Op op, const std::string& body, Deadline deadline);
// Whether a pull that received every byte commits now: its target releases on commit, this is its
// last request, and its cancel token (where it has one) is settled as finished here, not cancelled
// (core/cancel.h: a cancelled outcome never hides a commit).
bool commitsNow(const TransferPlan& p);
// After a pull that received every byte: release the request key, once the last request of a
// split transfer is done (a key read in several requests must survive until then), unless a cancel
// came first (commitsNow).
void commitPull(Link& link, const TransferPlan& p, const std::string& body, Deadline deadline);
// After an access that used pinned memory (direct, IPC, one-sided): commit a completed pull by
// request key, else release the pin.
void finishPinned(Link& link, const TransferPlan& p, bool completed, bool is_push, const std::string& body,
                  Deadline deadline);
// The (tensor, run) pieces of one side, tensor-major: addrs[t] + base + run.offset.
std::vector<Segment> pieces(const std::vector<uint64_t>& addrs, const std::vector<uint32_t>& tensors, uint64_t base,
                            const std::vector<wire::Run>& runs);

}  // namespace pdlink
