// A UCP context and worker (UcxWorker), endpoints to peers' workers (UcxEndpoint) and Active
// Messages between them: the pieces the ucx data path is built from (docs/ucx.md).
//
// Trust, and why there is no one-sided RMA here: a UCP context with UCP_FEATURE_RMA answers a
// peer's software-emulated put and get (the transport for tcp, and for any peer that chooses to
// emulate) by copying to or from whatever address the message names, whatever remote key, if
// any, it was given (UCX's ucp/rma/rma_sw.c; csrc/tests/ucx_test.cc shows a write landing outside
// every mapped range). Any process that reaches the worker's address could then read and write
// all of this process's memory. So a UcxWorker has UCP_FEATURE_AM only: a peer's bytes land only
// where this side's handler, after pdlink's own checks, receives them (ucx_test shows the same
// emulated put dropped by such a worker). Large messages move by UCX's rendezvous into the buffer
// the handler gives, with a hardware zero-copy get where the transport has one.
//
// Shared memory: a worker address is opaque bytes that tell UCX how to reach a peer, including
// through shared memory with a named process (posix, sysv, cma, xpmem). A worker of
// Scope::kNetwork is made with every shared-memory and loopback transport removed from its
// UCX_TLS, so whatever an address says it reaches peers over the network only. Scope::kAny (all
// of the user's UCX_TLS) is for peers the kernel proved to be on this host.
//
// Threading: a worker is created UCS_THREAD_MODE_MULTI; its calls may come from any thread. Message
// handlers run on whichever thread progresses the worker.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "core/status.h"
#include "transport/ucx/ucp_api.h"

namespace pdlink::ucx {

enum class Scope { kNetwork, kAny };

// The UCX_TLS value a worker of `scope` is made with, from the user's UCX_TLS (`user`, null when
// unset): kAny keeps it ("" for UCX's default); kNetwork removes shared memory and loopback ("sm"
// and its members posix, sysv, cma, knem, xpmem; "shm", "mm"; "self") from a list, or adds "sm"
// and "self" to a "^" exclusion, or is "^sm,self" when unset or "all". kFeatureNotEnabled when
// nothing is left.
Result<std::string> transportsFor(Scope scope, const char* user);

// A lane's transport family: its name up to the first '_' ("rc" of "rc_mlx5", "tcp" of "tcp").
std::string transportFamily(const std::string& lane);
// The transport families that make `auto` pick ucx for a link between hosts: those of `setting`
// (the value of PDLINK_UCX_AUTO_TRANSPORTS, a comma list: "" names none) or, when it is null
// (unset), UCX's RDMA families rc, dc, ud and srd.
std::vector<std::string> autoFamilies(const char* setting);
// Whether some lane ("transport/device", UcxEndpoint::lanes) is of one of `families`.
bool anyLaneOf(const std::vector<std::string>& lanes, const std::vector<std::string>& families);
// Whether `auto` picks ucx for links between hosts given the network worker's lanes: some lane is
// of autoFamilies(PDLINK_UCX_AUTO_TRANSPORTS as set now).
bool autoPicksUcx(const std::vector<std::string>& network_lanes);

class UcxWorker;

// One Active Message as it arrives, handed to the handler of its id (UcxWorker::setHandler), valid
// only during that call.
struct AmIncoming {
  const uint8_t* header = nullptr;  // the sender's header bytes
  size_t header_length = 0;
  size_t length = 0;                // the message's data bytes
  bool rendezvous = false;          // the data is still at the sender (UCX's rendezvous)
  // The data when it arrived with the header (not rendezvous): valid during the handler's call.
  const uint8_t* bytes() const { return rendezvous ? nullptr : static_cast<const uint8_t*>(data_); }
  // Takes the data into [buffer, +length): copied now when it arrived with the header, else
  // fetched by rendezvous. `done` is called once, on a progressing thread, with OK when every byte
  // is in place or with why not; at most one receive per message. A message the handler does not
  // receive is dropped, and its bytes land nowhere.
  void receiveInto(void* buffer, std::function<void(Status)> done);

 private:
  friend class UcxWorker;
  UcxWorker* worker_ = nullptr;
  void* data_ = nullptr;
  bool taken_ = false;
};

// An endpoint to a peer's worker. On a network worker it asks UCX to report the peer's death
// (UCP_ERR_HANDLING_MODE_PEER: a dead peer fails its requests); on the any-transport worker, whose
// peers are on this host, it does not (UCX's shared-memory transports cannot tell, and an endpoint
// that asks gets none of them): a send there may complete into a dead peer's queue. Closed by
// force when destroyed. Must not outlive its worker.
class UcxEndpoint {
 public:
  ~UcxEndpoint();
  UcxEndpoint(const UcxEndpoint&) = delete;
  UcxEndpoint& operator=(const UcxEndpoint&) = delete;
  // Sends Active Message `id` (`header`, then `length` bytes at `data`) and returns once UCX is
  // done with both buffers (the peer took the data, or, for a small message, UCX copied it): OK;
  // kTimeout at `deadline` (the endpoint is then closed by force: make a new one); kLinkFailed
  // when the peer failed.
  Status send(unsigned id, const void* header, size_t header_length, const void* data, size_t length,
              Deadline deadline);
  // One message of sendAll.
  struct Message {
    const void* header;
    size_t header_length;
    const void* data;
    size_t length;
  };
  // Sends every message as Active Message `id`, each whole with its header (UCX's eager protocol:
  // the receiver's handler gets the bytes, never a rendezvous), at most `window` in flight, and
  // returns once UCX is done with every buffer; failures as send's.
  Status sendAll(unsigned id, const std::vector<Message>& messages, size_t window, Deadline deadline);
  // Whether UCX reported the peer failed (the endpoint is then unusable).
  bool failed() const;
  // The transports UCX chose for this endpoint, as "transport/device" ("tcp/lo", "cma/memory",
  // "rc_mlx5/mlx5_0:1"), each once, in UCX's lane order. Read once at connect; empty where the
  // library cannot say (no ucp_ep_query, or one that does not report transports).
  const std::vector<std::string>& lanes() const { return lanes_; }

 private:
  friend class UcxWorker;
  explicit UcxEndpoint(UcxWorker* worker) : worker_(worker) {}
  static void onError(void* arg, ucp_ep_h ep, ucs_status_t status);
  void closeForce();
  UcxWorker* worker_;
  ucp_ep_h ep_ = nullptr;
  std::vector<std::string> lanes_;
  int error_ = 0;  // the peer failure UCX reported (atomic access)
};

class UcxWorker {
 public:
  // Handles one message (see AmIncoming); runs on a progressing thread, must not block.
  using Handler = std::function<void(AmIncoming&)>;

  // A context (UCP_FEATURE_AM | UCP_FEATURE_WAKEUP) and worker whose transports `scope` allows.
  // kFeatureNotEnabled when UCX is not loadable or allows nothing; kFailed when UCX fails.
  static Result<std::unique_ptr<UcxWorker>> open(Scope scope);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  Scope scope() const { return scope_; }
  const std::string& transports() const { return transports_; }
  // This worker's address as a peer needs it (network devices only for Scope::kNetwork).
  const std::string& address() const { return address_; }
  // An endpoint to the worker at `peer_address` (bytes a peer sent: opaque, see the file comment).
  Result<std::unique_ptr<UcxEndpoint>> connect(const std::string& peer_address);
  // The lanes UCX chooses for an endpoint of this worker to itself: what it would use toward a
  // peer with the same devices (the network worker: no shared memory, so the NICs' transports).
  Result<std::vector<std::string>> lanesToSelf();
  // Routes messages of `id` to `handler` (replacing any before; before any peer sends them). A
  // message of an id without a handler is dropped by UCX.
  Status setHandler(unsigned id, Handler handler);
  // Progresses the worker until none of its work is ready now: what a serving side's thread calls
  // after the event fd woke it.
  void progress();
  // The worker's event fd (readable when progress is due; arm() before sleeping on it).
  int eventFd() const { return efd_; }
  // Arms the event fd; false when events are pending (progress again before sleeping).
  bool arm();
  // Wakes a thread sleeping on the event fd.
  void signal();

 private:
  friend class UcxEndpoint;
  friend struct AmIncoming;
  struct HandlerSlot {
    UcxWorker* worker;
    Handler handler;
  };
  UcxWorker(const UcpApi* api, Scope scope) : api_(api), scope_(scope) {}
  static ucs_status_t onMessage(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                const AmRecvParam* param);
  // Progresses until `request` (a ucp_*_nbx result) completes or `deadline` passes; frees it.
  // kErrTimedOut leaves the request pending (the caller ends it by closing its endpoint).
  ucs_status_t wait(ucs_status_ptr_t request, Deadline deadline);
  const UcpApi* api_;
  Scope scope_;
  std::string transports_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  int efd_ = -1;
  std::vector<std::unique_ptr<HandlerSlot>> handlers_;  // kept for the worker's life (UCX holds their address)
};

}  // namespace pdlink::ucx
