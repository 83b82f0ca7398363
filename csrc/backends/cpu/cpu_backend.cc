// CPU backend: DEVICE and HOST placements are both anonymous host mappings.
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "backends/backend.h"

namespace pdlink {
namespace {

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }
  Capabilities capabilities() const override { return Capabilities{}; }

  Result<void*> allocate(Placement, size_t bytes) override {
    // mmap rather than malloc: pools are large, page-aligned, and returned to the OS on release.
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return Status(Code::kOutOfMemory, "cannot map " + std::to_string(bytes) + " bytes: " + std::strerror(errno));
    }
    return p;
  }

  void release(Placement, void* ptr, size_t bytes) override { ::munmap(ptr, bytes); }

  Status copy(void* dst, Placement, const void* src, Placement, size_t n) override {
    std::memmove(dst, src, n);
    return Status::OK();
  }
};

}  // namespace

std::shared_ptr<Backend> makeCpuBackend() { return std::make_shared<CpuBackend>(); }

}  // namespace pdlink
