// Backend: where cache memory lives and how bytes are copied inside one process.
//
// The engine (engine/engine.h) owns roles, links, the cache registry and the wire protocol; a
// backend only provides memory of each placement and local copies, so adding one (Ascend, a fault
// injector) touches no link or role code. Optional features are reported by capabilities(), not
// by extra virtuals.
//
// Ownership: memory returned by allocate() belongs to the caller until passed to release().
// Threading: every method may be called from any thread concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"

namespace pdlink {

// Values match llm_datadist.Placement.
enum class Placement : uint8_t { kHost = 0, kDevice = 1 };

struct Capabilities {
  bool device_memory = false;  // DEVICE placement is distinct from host memory
  bool host_memory = true;     // HOST placement is supported
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual Capabilities capabilities() const = 0;
  // Memory for a pool or cache; kOutOfMemory when none is left.
  virtual Result<void*> allocate(Placement placement, size_t bytes) = 0;
  virtual void release(Placement placement, void* ptr, size_t bytes) = 0;
  // Copies `n` bytes between two addresses of this process (any placement).
  virtual Status copy(void* dst, const void* src, size_t n) = 0;
};

// The CPU backend: both placements are ordinary host memory (backends/cpu/cpu_backend.cc).
std::shared_ptr<Backend> makeCpuBackend();

}  // namespace pdlink
