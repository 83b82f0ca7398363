// The Ascend backend (see ascend_backend.cc for how it binds device contexts). Created through
// openBackend("ascend", device) (backends/registry.cc), one per device per process.
#pragma once

#include <memory>
#include <string>

#include "backends/ascend/ascend_api.h"
#include "backends/backend.h"

namespace pdlink::ascend {

class AscendBackend final : public Backend {
 public:
  // Initialises ACL unless the application already has (then uses it as is), checks the device
  // and records its default context. kFeatureNotEnabled without devices, kParamInvalid for a bad id.
  static Result<std::shared_ptr<AscendBackend>> create(const AscendApi* api, int32_t device_id);

  const char* name() const override { return "ascend"; }
  int32_t deviceId() const override { return device_; }
  Capabilities capabilities() const override;
  Result<void*> allocate(Placement placement, size_t bytes) override;
  void release(Placement placement, void* ptr, size_t bytes) override;
  Status copy(void* dst, Placement dst_placement, const void* src, Placement src_placement, size_t n) override;
  // The rendezvous is an HcclRootInfo; the creator is rank 0 of the two-rank communicator.
  Result<std::string> newRendezvous() override;
  Result<std::unique_ptr<DeviceChannel>> joinChannel(const std::string& rendezvous, bool creator) override;

 private:
  AscendBackend(const AscendApi* api, int32_t device, aclrtContext ctx) : api_(api), device_(device), ctx_(ctx) {}
  const AscendApi* api_;
  const int32_t device_;
  const aclrtContext ctx_;  // the device's default context (aclrtSetDevice), bound per call
};

}  // namespace pdlink::ascend
