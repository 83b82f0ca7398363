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
// WorkerScope::kNetwork is made with every shared-memory and loopback transport removed from its
// UCX_TLS, so whatever an address says it reaches peers over the network only. WorkerScope::kAny (all
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

enum class WorkerScope { kNetwork, kAny };

// The UCX_TLS value a worker of `scope` is made with, from the user's UCX_TLS (`user`, null when
// unset): kAny keeps it ("" for UCX's default); kNetwork removes shared memory and loopback ("sm"
// and its members posix, sysv, cma, knem, xpmem; "shm", "mm"; "self") from a list, or adds "sm"
// and "self" to a "^" exclusion, or is "^sm,self" when unset or "all". kFeatureNotEnabled when
// nothing is left.
Result<std::string> transportsFor(WorkerScope scope, const char* user);

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

// ------------------------------------------------------------------ worker addresses
//
// A worker address is what a peer sends in the ucx path's kPathConnect (and a server in its answer), and UCX
// trusts it: ucp_ep_create takes it without a length and ucp_address_unpack (ucp/wireup/address.c)
// walks it by the lengths and flags inside it, aborting on an unknown version and reading past the
// end of a short one; the transports then read their device and interface addresses by their own
// fixed layouts (a missing one is a null pointer to them). So no peer's bytes reach UCX unless
// checkWorkerAddress accepted them, and then only padded (kAddressPadBytes of zeros after them).
//
// The layout, as UCX 1.12 .. 1.22 read it for ucp_ep_create (non-unified mode; UcxWorker forces
// UNIFIED_MODE off, under which the layout would depend on this side's resources):
//   header     v1: one byte, version 0 in bits 0-3, flags in bits 4-7;
//              v2: version 1 | release << 4, then a flags byte (bits 4-7 unused);
//              flags: debug info 1, worker uuid 2, client id 4, AM only 8
//   uuid       8 bytes (v1: always, for ucp_ep_create; v2: with the uuid flag)
//   client id  8 bytes, with its flag
//   name       a length byte and that many bytes, with the debug-info flag
//   devices    until one has the last flag (a first byte 0xff would mean "no devices"):
//     md       byte: bit 7 "no transports", the md index below (v2: 0x7f means "the next byte")
//     dev len  byte: bit 7 last device, bit 6 paths byte follows, bit 5 system-device byte follows,
//              bits 0-4 the length (v2: 31 means "the next byte")
//     [paths] [sys dev]  one byte each, with their flags
//     device address     dev len bytes
//     transports, unless "no transports", until one has the last flag:
//       checksum  2 bytes: which transport (of its name)
//       attrs     v1: 16 bytes (three floats, prio and capability flags); v2: 8 bytes
//       iface len byte: bit 7 last transport, bit 6 endpoint addresses follow, bits 0-5 the
//                 length (v2: 63 means "the next byte")
//       interface address  iface len bytes
//   In v1 an empty last device's md index carries the sender's release (UCX >= 1.19 then clears
//   the md index bits older releases used as flags).
// Refused, beyond what UCX itself would misread: any byte past the last device or one missing;
// another version or an unknown flag; no devices, or none with a transport; more than 128 devices or transports
// (UCP_MAX_RESOURCES); an md index of 64 or more (UCP_MAX_MDS, a bit of UCX's md maps); a paths
// byte of 0; endpoint addresses (a worker address carries none: they belong to UCX's own wireup);
// v1 attributes that are not finite or a zero bandwidth; a v2 active-message transport whose
// segment is under 512 bytes (UCX aborts when its rendezvous keys do not fit one); and, for a
// transport this side's own worker has, a missing device or interface address where this side's
// own entries of that transport have one (what the transport would dereference). Transports this
// side does not have are kept as they are: UCX never matches them to a lane.
struct AddressEntry {
  uint16_t tl_name_csum = 0;  // which transport
  unsigned md_index = 0;      // as this UCX reads it
  size_t dev_addr_len = 0;
  size_t iface_addr_len = 0;
};
struct WorkerAddressLayout {
  unsigned version = 0;  // 0: UCX's address v1; 1: v2
  size_t devices = 0;    // including empty ones
  std::vector<AddressEntry> entries;
};
// The UCX releases (1.minor) whose worker-address layout is the one above; UcxWorker refuses others.
constexpr unsigned kAddressMinorFirst = 12;
constexpr unsigned kAddressMinorLast = 22;
// Zeros after a checked address: a transport that reads a fixed-size structure from a shorter
// device or interface address reads them rather than past the buffer.
constexpr size_t kAddressPadBytes = 256;
// The longest worker address accepted (wire::kMaxUcxHelloBytes bounds what a peer can send).
constexpr size_t kMaxWorkerAddressBytes = 4096;

// Parses `n` bytes as a worker address the way UCX 1.`minor` reads one for ucp_ep_create, with
// the refusals above (all but the comparison with this side's own transports). kParamInvalid,
// naming the byte offset and what is wrong, for anything else. Pure: no UCX needed.
Result<WorkerAddressLayout> parseWorkerAddress(const uint8_t* p, size_t n, unsigned minor);
// parseWorkerAddress, then each entry of a transport that `own` (this worker's own address, parsed)
// has must have a device address and an interface address where all of own's entries of that
// transport have them.
Status checkWorkerAddress(const uint8_t* p, size_t n, unsigned minor, const WorkerAddressLayout& own);

class UcxWorker;

// One Active Message as it arrives, handed to the handler of its id (UcxWorker::setHandler), valid
// only during that call.
struct AmIncoming {
  const uint8_t* header = nullptr;  // the sender's header bytes
  size_t header_length = 0;
  size_t length = 0;        // the message's data bytes
  bool rendezvous = false;  // the data is still at the sender (UCX's rendezvous)
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
  static Result<std::unique_ptr<UcxWorker>> open(WorkerScope scope);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  WorkerScope scope() const { return scope_; }
  const std::string& transports() const { return transports_; }
  // This worker's address as a peer needs it (network devices only for WorkerScope::kNetwork).
  const std::string& address() const { return address_; }
  // An endpoint to the worker at `peer_address` (bytes a peer sent, see the file comment): refused
  // with kParamInvalid, before UCX sees any of it, unless checkWorkerAddress accepts it against this
  // worker's own address.
  Result<std::unique_ptr<UcxEndpoint>> connect(const std::string& peer_address);
  // This worker's own address as parseWorkerAddress reads it (what connect checks peers against).
  const WorkerAddressLayout& ownLayout() const { return own_layout_; }
  // The loaded UCX's minor release (1.minor), which the address layout is read for.
  unsigned ucxMinor() const { return minor_; }
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
  UcxWorker(const UcpApi* api, WorkerScope scope) : api_(api), scope_(scope) {}
  static ucs_status_t onMessage(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                const AmRecvParam* param);
  // Progresses until `request` (a ucp_*_nbx result) completes or `deadline` passes; frees it.
  // kErrTimedOut leaves the request pending (the caller ends it by closing its endpoint).
  ucs_status_t wait(ucs_status_ptr_t request, Deadline deadline);
  const UcpApi* api_;
  WorkerScope scope_;
  std::string transports_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  WorkerAddressLayout own_layout_;
  unsigned minor_ = 0;
  int efd_ = -1;
  std::vector<std::unique_ptr<HandlerSlot>> handlers_;  // kept for the worker's life (UCX holds their address)
};

}  // namespace pdlink::ucx
