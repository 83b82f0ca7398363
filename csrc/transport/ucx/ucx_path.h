// The ucx data path (docs/ucx.md): host memory moved as UCX Active Messages between two engines'
// UCX workers, every request checked on pdlink's own control link as on every path.
//
//  - UcxHub: one per engine with Transport::kUcx. It owns a network-only worker (for peers not
//    proven to be on this host) and an any-transport worker (for proven ones), one thread that
//    progresses both (sleeping on their event fds), and the expectations: for each link and
//    direction, the pieces the current request may land, under a random 64-bit token.
//  - UcxPath (requesting side, per link) and UcxServer (serving side, per engine), speaking
//    a wire::Op::kPathConnect naming it once per link and wire::kFlagUcx reads and writes (transport/wire.h).
//
// Every message is one chunk (at most the link's chunk size) of one checked piece, sent whole with its header
// (UCX's eager protocol; no rendezvous, so no transfer writes into a caller's memory after the call
// that expected it returned): {token, chunk}. The receiving side copies it into exactly that
// chunk's range, once, while the expectation is open; a message with another token, an unknown or
// repeated chunk, or the wrong length, is dropped.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/backend.h"
#include "transport/path.h"
#include "transport/path_table.h"
#include "transport/ucx/ucx_worker.h"

namespace pdlink {
namespace ucx {

// The size of a link's messages (the last of each piece may be shorter), chosen by the serving
// side from the lanes of its endpoint back (wire::UcxHello): 16 KiB where every lane is UCX's tcp,
// whose large eager messages are reassembled in a bounce buffer (docs/performance.md, "The ucx
// path": 16 KiB moved 1.5x the bytes of 256 KiB there); 256 KiB otherwise.
constexpr uint32_t kTcpChunkBytes = 16 * 1024;
constexpr uint32_t kChunkBytes = 256 * 1024;
uint32_t chunkBytesFor(const std::vector<std::string>& lanes);
// Bytes of one transfer's messages in flight at once, at most (and at least kMinSendWindow messages).
constexpr size_t kSendWindowBytes = 1 << 20;
constexpr size_t kMinSendWindow = 16;

// The pieces one request may land on this side, by chunk; filled by the progress thread.
// Where the chunks of one transfer land: its pieces and, per piece, the index of its first chunk
// (Chunks), so chunk i is found in O(log pieces) and the bookkeeping is bounded by the request's
// pieces plus one bit per chunk, never one entry per chunk.
struct Chunks {
  std::vector<Segment> pieces;
  std::vector<uint64_t> first;  // first[p]: the index of piece p's first chunk
  uint64_t chunk_bytes = 0;
  uint64_t count = 0;
  void cut(const std::vector<Segment>& ps, uint64_t bytes);
  // The range chunk `i` (< count) covers.
  Segment at(uint64_t i) const;
};

struct Expectation {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;         // guarded by mu
  Chunks chunks;             // guarded by mu
  std::vector<bool> landed;  // guarded by mu: one bit per chunk
  uint64_t remaining = 0;    // guarded by mu
};

class UcxHub {
 public:
  // Both workers and the progress thread; with `decide_auto` (an engine with Transport::kAuto),
  // also autoBetweenHosts. kFeatureNotEnabled when UCX cannot be loaded or UCX_TLS allows no
  // network transport (the message says which).
  static Result<std::shared_ptr<UcxHub>> open(bool decide_auto);
  ~UcxHub();
  UcxHub(const UcxHub&) = delete;
  UcxHub& operator=(const UcxHub&) = delete;

  // Whether `auto` picks ucx for links between hosts (autoPicksUcx on the network worker's lanes,
  // UcxWorker::lanesToSelf): decided by open(true), false after open(false). Constant after open.
  bool autoBetweenHosts() const { return auto_between_hosts_; }
  // The worker for a link: the any-transport one for a peer the kernel proved to be on this host.
  UcxWorker& worker(bool same_host) { return same_host ? *local_ : *network_; }
  // A new expectation under a fresh random token (returned), closed until open().
  std::shared_ptr<Expectation> expect(uint64_t* token);
  // Drops an expectation's token: its messages are dropped from now on.
  void forget(uint64_t token);
  // Opens `e` for the chunks of `pieces` (local ranges, in the order the sender walks them);
  // await() or close() after the transfer, whatever its outcome. One transfer at a time per
  // expectation: a link's transfers are serialised, and any that fails drops the link, so no
  // message of an earlier transfer is still on its way when the next one opens.
  static void open(Expectation& e, const std::vector<Segment>& pieces, uint64_t chunk_bytes);
  // Waits until every chunk landed (OK) or `deadline` (kTimeout), then closes `e`: no byte lands
  // after this returns. The progress thread lands the chunks (a second thread progressing the same
  // worker only contends for UCX's lock: measured slower on 2 cores).
  static Status await(Expectation& e, Deadline deadline, const char* what);
  static void close(Expectation& e);

 private:
  UcxHub() = default;
  void onMessage(AmIncoming& in);
  void progressLoop();

  std::unique_ptr<UcxWorker> network_, local_;
  bool auto_between_hosts_ = false;
  std::mutex mu_;
  std::map<uint64_t, std::weak_ptr<Expectation>> expectations_;  // guarded by mu_
  int wake_fd_ = -1;
  bool stop_ = false;  // guarded by mu_
  std::thread progress_;
};

// The most chunks one transfer may be cut into: 2^26 (1 TiB in 16 KiB messages), so the landed
// bits of one expectation stay within 8 MiB whatever a peer asks. A peer's request past it is
// refused (UcxServer::serve).
constexpr uint64_t kMaxChunksPerTransfer = uint64_t{1} << 26;

// Whether ucx is `link`'s host path as an engine with these workers (null: none) picks it:
// `forced` (Transport::kUcx), or auto between hosts over an RDMA-capable UCX, and never with payload
// integrity (nor on a cma link: a link cma serves is a same-host one, which auto never puts on ucx,
// and forcing ucx never picks cma). The serving side takes ucx frames only where this holds, so a
// peer cannot make UCX parse its bytes on a link the engine keeps on tcp or cma.
bool isPathOf(const UcxHub* hub, bool forced, const Link& link);
// Why ucx is not `link`'s path (kFeatureNotEnabled), for a peer that asked for it anyway.
Status refused(const Link& link);

}  // namespace ucx

// The requesting side on one link. With a `fallback` (the path `auto` would have used: the engine
// picked ucx on its own), a peer that refuses ucx (it serves no ucx path) turns this link over to
// the fallback for good, which then moves this and every later transfer; without one (transport
// forced to ucx) that refusal is the transfer's result.
class UcxPath : public DataPath {
 public:
  UcxPath(std::shared_ptr<ucx::UcxHub> hub, bool same_host, std::unique_ptr<DataPath> fallback = nullptr);
  // What the path is while the peer takes ucx (caps() is the fallback's once it declined).
  static const PathCaps& ucxCaps() { return kCaps; }
  ~UcxPath() override;
  const PathCaps& caps() const override;
  std::vector<std::string> lanes() const override;
  Status transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) override;

 private:
  // Its kPathConnect, once per link: the endpoint to the peer's worker, the peer's token for our pushes.
  Status connect(Link& link, Deadline deadline, const char* what);

  static const PathCaps kCaps;
  std::shared_ptr<ucx::UcxHub> hub_;  // before ep_: destroyed after it
  const bool same_host_;
  std::unique_ptr<DataPath> fallback_;
  std::atomic<bool> declined_{false};     // the peer refused ucx: fallback_ moves everything
  std::unique_ptr<ucx::UcxEndpoint> ep_;  // out mutex
  uint64_t pull_token_ = 0;               // what the peer stamps the bytes of our reads with
  std::shared_ptr<ucx::Expectation> pulls_;
  uint64_t push_token_ = 0;   // the peer's token for the bytes of our writes
  uint32_t chunk_bytes_ = 0;  // the link's message size, the server's choice (set with ep_)
  mutable std::mutex lanes_mu_;
  std::vector<std::string> lanes_;  // guarded by lanes_mu_: ep_'s, once connected
};

// The serving side, one per engine.
class UcxServer : public PathServer {
 public:
  explicit UcxServer(std::shared_ptr<ucx::UcxHub> hub) : hub_(std::move(hub)) {}
  const ucx::UcxHub* hub() const { return hub_.get(); }
  Status serve(ServeCall& call) override;
  // Answers the ucx kPathConnect (`body`: its setup body, the requester's UcxHello) on `link`'s serving thread.
  Status connect(Link& link, Stream& s, const std::string& body, Deadline deadline);

 private:
  std::shared_ptr<ucx::UcxHub> hub_;
};

// Answers the ucx path's kPathConnect on `link`'s serving thread (`forced`: as for ucx::isPathOf). Where
// this engine has no ucx path (`server` null) or ucx is not the link's path, refused as admitAccess
// refuses what the engine does not serve on a link: answered, the link kept (a requester that
// picked ucx on its own falls back to its stream), nothing of the address read. Else
// UcxServer::connect. Non-OK: the link is dropped.
Status answerUcxConnect(UcxServer* server, bool forced, Link& link, Stream& s, const std::string& body,
                        Deadline deadline);

// ucx's table entry: applies where ucx is the link's host path (LinkFacts::ucx), keeping the stream
// behind under auto for a peer without ucx. Its server exists only while the engine has UCX
// workers: Engine::initialize sets it (PathTable::setServer), finalize drops it.
PathEntry ucxEntry();

}  // namespace pdlink
