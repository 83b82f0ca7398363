// Backend: where cache memory lives, how bytes are copied inside one process, and (for backends
// whose DEVICE memory the host cannot address) how DEVICE bytes move to a peer process.
//
// The engine (engine/engine.h) owns roles, links, the cache registry and the wire protocol; a
// backend provides memory of each placement, local copies and, optionally, device channels, so
// adding one touches no link or role code. Optional features are reported by capabilities().
//
// Backends are process-wide (openBackend() returns the same instance for the same name and device)
// because the vendor runtimes they wrap are: ACL is initialised once per process.
//
// Ownership: memory returned by allocate() belongs to the caller until passed to release(); a
// DeviceChannel belongs to its caller and is closed by its destructor.
// Threading: every method may be called from any thread concurrently; a backend binds its device
// context on the calling thread itself (vendor runtimes keep the current device per thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "core/status.h"

namespace pdlink {

// Values match llm_datadist.Placement.
enum class Placement : uint8_t { kHost = 0, kDevice = 1 };

struct Capabilities {
  bool device_memory = false;     // DEVICE placement is memory the host cannot address directly
  bool host_memory = true;        // HOST placement is supported
  bool device_transport = false;  // DEVICE bytes move between processes through DeviceChannel
  // Optional vendor features, by name (e.g. "ipc", "one_sided", "sync_timeout"): true when the
  // loaded runtime provides them. For reporting; the engine asks only for device_transport.
  std::map<std::string, bool> features;
};

// A byte range of this process's memory.
struct Segment {
  uint64_t addr = 0;
  uint64_t length = 0;
};

// One DEVICE copy: inside this process (copyDevice), or between this process and the peer of a
// DeviceChannel (get: dst local, src the peer's; put: dst the peer's, src local).
struct DeviceCopy {
  uint64_t dst = 0;
  uint64_t src = 0;
  uint64_t length = 0;
};

// A point-to-point channel to one peer process for DEVICE memory (an HCCL communicator of two
// ranks). One side sends what the other receives: both pass segment lists of the same lengths, in
// the same order. Calls on one channel must not overlap (the engine serialises them per link
// direction). A failed or timed-out call leaves the channel unusable: the caller destroys it.
class DeviceChannel {
 public:
  virtual ~DeviceChannel() = default;
  // Returns once every byte has left (send) or arrived (recv), or with kTimeout at the deadline.
  virtual Status send(const std::vector<Segment>& segments, Deadline deadline) = 0;
  virtual Status recv(const std::vector<Segment>& segments, Deadline deadline) = 0;

  // One-sided access (feature "one_sided"). Both sides call prepare() at the same time with the
  // DEVICE regions they let the peer reach (blocking, like a collective); afterwards get()/put()
  // read or write the peer's prepared memory without the peer taking part, and prepared() tells
  // whether a range of this side's memory is reachable that way.
  virtual bool canPrepare() const { return false; }
  virtual Status prepare(const std::vector<Segment>& regions, int32_t timeout_s) {
    (void)regions;
    (void)timeout_s;
    return Status(Code::kFeatureNotEnabled, "no one-sided access on this channel");
  }
  virtual bool prepared(uint64_t addr, uint64_t length) const {
    (void)addr;
    (void)length;
    return false;
  }
  virtual Status get(const std::vector<DeviceCopy>& copies, Deadline deadline) {
    (void)copies;
    (void)deadline;
    return Status(Code::kFeatureNotEnabled, "no one-sided access on this channel");
  }
  virtual Status put(const std::vector<DeviceCopy>& copies, Deadline deadline) {
    (void)copies;
    (void)deadline;
    return Status(Code::kFeatureNotEnabled, "no one-sided access on this channel");
  }
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual int32_t deviceId() const { return 0; }
  virtual Capabilities capabilities() const = 0;
  // Memory for a pool or cache; kOutOfMemory (host) or kDeviceOutOfMemory when none is left.
  virtual Result<void*> allocate(Placement placement, size_t bytes) = 0;
  virtual void release(Placement placement, void* ptr, size_t bytes) = 0;
  // Copies `n` bytes between two addresses of this process, each of the given placement.
  virtual Status copy(void* dst, Placement dst_placement, const void* src, Placement src_placement, size_t n) = 0;

  // Device channels (capability device_transport). The side that creates a rendezvous sends it to
  // the peer over the link's control connection; both then join, the creator as rank 0. join
  // blocks until both have joined (bounded by the vendor's connect timeout, not by `deadline`,
  // which real HCCL cannot honour: see docs/ascend.md).
  virtual Result<std::string> newRendezvous() {
    return Status(Code::kFeatureNotEnabled, std::string(name()) + " backend has no device channels");
  }
  virtual Result<std::unique_ptr<DeviceChannel>> joinChannel(const std::string& rendezvous, bool creator) {
    (void)rendezvous;
    (void)creator;
    return Status(Code::kFeatureNotEnabled, std::string(name()) + " backend has no device channels");
  }

  // Same-host sharing of DEVICE memory between processes (feature "ipc"). exportMemory gives a
  // key (at most 64 bytes) through which another process of this host can map [addr, +length)
  // until closeExport; importMemory maps a peer's key and returns this process's address of the
  // region's first byte, valid until closeImport. copyDevice runs DEVICE-to-DEVICE copies (imported
  // memory included) and returns when all have landed, or kTimeout at the deadline.
  virtual Result<std::string> exportMemory(uint64_t addr, uint64_t length) {
    (void)addr;
    (void)length;
    return Status(Code::kFeatureNotEnabled, std::string(name()) + " backend cannot share device memory");
  }
  virtual void closeExport(const std::string& key) { (void)key; }
  virtual Result<uint64_t> importMemory(const std::string& key) {
    (void)key;
    return Status(Code::kFeatureNotEnabled, std::string(name()) + " backend cannot share device memory");
  }
  virtual void closeImport(const std::string& key) { (void)key; }
  virtual Status copyDevice(const std::vector<DeviceCopy>& copies, Deadline deadline) {
    (void)copies;
    (void)deadline;
    return Status(Code::kFeatureNotEnabled, std::string(name()) + " backend has no device copies");
  }
};

// The CPU backend: both placements are ordinary host memory (backends/cpu/cpu_backend.cc).
std::shared_ptr<Backend> makeCpuBackend();

// The names openBackend takes (bound for Python as _core.BACKENDS).
inline constexpr const char* kBackendNames[] = {"auto", "cpu", "ascend"};

// The backend of that name for that device: "cpu", "ascend", or "auto" (Ascend when its libraries
// load and report a device, else CPU). kFeatureNotEnabled, naming the reason, when the named
// backend cannot be used here (backends/open_backend.cc).
Result<std::shared_ptr<Backend>> openBackend(const std::string& name, int32_t device_id);

}  // namespace pdlink
