// A UCP context and worker (UcxWorker), endpoints to peers' workers (UcxEndpoint), registered
// memory (UcxMemory) and one-sided reads and writes by a deadline: the pieces the ucx data path is
// built from. Nothing here checks what a peer may reach: callers hand in ranges the engine checked,
// and remote keys only for memory a checked request resolved to.
//
// Trust: a worker address is opaque bytes that tell UCX how to reach a peer, including through
// shared memory with a named process (posix, sysv, cma, xpmem). A hostile address can point those
// lanes at any local process, this one included, so a worker of Scope::kNetwork is made with every
// shared-memory and loopback transport removed from its UCX_TLS: whatever an address says, it
// reaches peers over the network only. Scope::kAny (all of the user's UCX_TLS) is for peers the
// kernel proved to be on this host.
//
// Threading: a worker is created UCS_THREAD_MODE_MULTI; its calls may come from any thread.
#pragma once

#include <cstdint>
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
// and its members posix, sysv, cma, knem, xpmem; "shm"; "self") from a list, or adds them to a
// "^" exclusion, or is "^sm,self" when unset or "all". kFeatureNotEnabled when nothing is left.
Result<std::string> transportsFor(Scope scope, const char* user);

class UcxWorker;

// Memory mapped for remote access (ucp_mem_map); unmapped when destroyed, which revokes every
// remote key packed from it. Must not outlive its worker.
class UcxMemory {
 public:
  ~UcxMemory();
  UcxMemory(const UcxMemory&) = delete;
  UcxMemory& operator=(const UcxMemory&) = delete;
  uint64_t address() const { return address_; }
  uint64_t length() const { return length_; }
  bool remoteWritable() const { return writable_; }
  // The packed remote key a peer unpacks to reach this memory.
  const std::string& packedKey() const { return packed_; }

 private:
  friend class UcxWorker;
  UcxMemory(const UcpApi* api, ucp_context_h context, ucp_mem_h memh, uint64_t address, uint64_t length,
            bool writable, std::string packed)
      : api_(api), context_(context), memh_(memh), address_(address), length_(length), writable_(writable),
        packed_(std::move(packed)) {}
  const UcpApi* api_;
  ucp_context_h context_;
  ucp_mem_h memh_;
  uint64_t address_, length_;
  bool writable_;
  std::string packed_;
};

// A remote key unpacked on one endpoint; destroyed with it (before the endpoint).
class UcxRemoteKey {
 public:
  ~UcxRemoteKey();
  UcxRemoteKey(const UcxRemoteKey&) = delete;
  UcxRemoteKey& operator=(const UcxRemoteKey&) = delete;
  ucp_rkey_h handle() const { return rkey_; }

 private:
  friend class UcxEndpoint;
  UcxRemoteKey(const UcpApi* api, ucp_rkey_h rkey) : api_(api), rkey_(rkey) {}
  const UcpApi* api_;
  ucp_rkey_h rkey_;
};

// One local <-> remote byte run of a read or write.
struct RmaRun {
  uint64_t local;
  uint64_t remote;
  uint64_t length;
};

// An endpoint to a peer's worker, UCP_ERR_HANDLING_MODE_PEER (a dead peer fails its requests).
// Closed by force when destroyed. Must not outlive its worker.
class UcxEndpoint {
 public:
  ~UcxEndpoint();
  UcxEndpoint(const UcxEndpoint&) = delete;
  UcxEndpoint& operator=(const UcxEndpoint&) = delete;
  // Unpacks a remote key the peer packed (UcxMemory::packedKey). kLinkFailed for bytes UCX refuses.
  Result<std::unique_ptr<UcxRemoteKey>> unpack(const std::string& packed);
  // Reads (`write` false: remote -> local) or writes every run through `key`, and returns once all
  // of them completed at both ends (a write is flushed), or fails: kTimeout at `deadline` (the
  // endpoint is then closed by force: make a new one), kLinkFailed when the peer failed, with
  // the runs in an unknown state. `local` ranges must stay valid until it returns.
  Status rma(const UcxRemoteKey& key, const std::vector<RmaRun>& runs, bool write, Deadline deadline);
  // Whether UCX reported the peer failed (the endpoint is then unusable).
  bool failed() const;

 private:
  friend class UcxWorker;
  UcxEndpoint(UcxWorker* worker, ucp_ep_h ep) : worker_(worker), ep_(ep) {}
  static void onError(void* arg, ucp_ep_h ep, ucs_status_t status);
  void closeForce();
  UcxWorker* worker_;
  ucp_ep_h ep_;
  int error_ = 0;  // the peer failure UCX reported (atomic access)
};

class UcxWorker {
 public:
  // A context (UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP) and worker whose transports `scope` allows.
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
  // Maps [address, +length) for remote reads, and writes when `remote_writable`.
  Result<std::unique_ptr<UcxMemory>> map(uint64_t address, uint64_t length, bool remote_writable);
  // Progresses the worker until none of its work is left that is ready now; what the serving
  // side's progress thread calls after the event fd woke it.
  void progress();
  // The worker's event fd (readable when progress is due; arm() before sleeping on it).
  int eventFd() const { return efd_; }
  // Arms the event fd; false when events are pending (progress again before sleeping).
  bool arm();
  // Wakes a thread sleeping on the event fd.
  void signal();

 private:
  friend class UcxEndpoint;
  UcxWorker(const UcpApi* api, Scope scope) : api_(api), scope_(scope) {}
  // Progresses until `request` (a ucp_*_nbx result) completes or `deadline` passes; frees it.
  ucs_status_t wait(ucs_status_ptr_t request, Deadline deadline);
  const UcpApi* api_;
  Scope scope_;
  std::string transports_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  int efd_ = -1;
};

}  // namespace pdlink::ucx
