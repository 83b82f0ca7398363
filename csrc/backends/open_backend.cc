// openBackend: the process-wide backend instances, and what "auto" picks.
#include <map>
#include <mutex>

#include "backends/ascend/ascend_backend.h"
#include "backends/backend.h"
#include "core/log.h"

namespace pdlink {

Result<std::shared_ptr<Backend>> openBackend(const std::string& name, int32_t device_id) {
  static std::mutex mu;
  static auto* ascend = new std::map<int32_t, std::shared_ptr<Backend>>();  // never destroyed: see backend.h
  if (name == "cpu") {
    static auto* cpu = new std::shared_ptr<Backend>(makeCpuBackend());
    return *cpu;
  }
  if (name != "ascend" && name != "auto") {
    std::string names;
    for (const char* n : kBackendNames) names += std::string(names.empty() ? "" : ", ") + n;
    return Status(Code::kParamInvalid, "unknown backend '" + name + "' (available: " + names + ")");
  }
  auto api = ascend::AscendApi::load();
  Result<std::shared_ptr<Backend>> r = api.status();
  if (api.ok()) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = ascend->find(device_id);
    if (it != ascend->end()) return it->second;
    auto b = ascend::AscendBackend::create(api.value(), device_id);
    if (b.ok()) {
      (*ascend)[device_id] = b.value();
      return std::shared_ptr<Backend>(b.value());
    }
    r = b.status();
  }
  // "auto" falls back only when Ascend is absent, not when it is present and the device id is bad.
  if (name == "ascend" || (api.ok() && r.status().code() == Code::kParamInvalid)) return r;
  PDLINK_LOG(kDebug, "backend auto: using cpu (" << r.status().message() << ")");
  return openBackend("cpu", device_id);
}

}  // namespace pdlink
