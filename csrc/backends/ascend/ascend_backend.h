// The Ascend backend (see ascend_backend.cc for how it binds device contexts). Created through
// openBackend("ascend", device) (backends/open_backend.cc), one per device per process.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

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
  // IPC (aclrtIpcMem*; kFeatureNotEnabled when the runtime lacks them). Exports disable pid
  // validation, as torch_npu does: the key travels only over the link's (authenticated, when
  // configured) control connection and is closed once the transfer is done.
  Result<std::string> exportMemory(uint64_t addr, uint64_t length) override;
  void closeExport(const std::string& key) override;
  Result<uint64_t> importMemory(const std::string& key) override;
  void closeImport(const std::string& key) override;
  // aclrtMemcpyAsync (DEVICE_TO_DEVICE) on a pooled stream, then a bounded synchronise.
  Status copyDevice(const std::vector<DeviceCopy>& copies, Deadline deadline) override;

 private:
  AscendBackend(const AscendApi* api, int32_t device, aclrtContext ctx) : api_(api), device_(device), ctx_(ctx) {}
  Status synchronize(aclrtStream stream, Deadline deadline) const;
  const AscendApi* api_;
  const int32_t device_;
  const aclrtContext ctx_;  // the device's default context (aclrtSetDevice), bound per call
  std::mutex streams_mu_;
  std::vector<aclrtStream> idle_streams_;  // for copyDevice, guarded by streams_mu_
};

}  // namespace pdlink::ascend
