// pdlink._core's Backend (backends/backend.h) and what this process's libraries provide: the
// Ascend and UCX loaders, libcrypto, the same-host ptrace grant. The loaders' reports never fail.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "backends/ascend/ascend_api.h"
#include "backends/backend.h"
#include "bindings/bindings.h"
#include "bindings/status_bridge.h"
#include "core/crypto.h"
#include "transport/cma/cma.h"
#include "transport/ucx/ucp_api.h"
#include "transport/ucx/ucx_worker.h"

namespace py = pybind11;

namespace pdlink::bindings {
namespace {

py::dict capabilitiesDict(const Capabilities& c) {
  py::dict d;
  d["device_memory"] = c.device_memory;
  d["host_memory"] = c.host_memory;
  d["device_transport"] = c.device_transport;
  py::dict f;
  for (auto& [name, on] : c.features) f[py::str(name)] = on;
  d["features"] = f;
  return d;
}

void bindBackendClass(py::module_& m) {
  // A process-wide backend (backends/backend.h): memory and local copies, used by pdlink.device.
  py::class_<Backend, std::shared_ptr<Backend>>(m, "Backend")
      .def_property_readonly("name", [](const Backend& b) { return std::string(b.name()); })
      .def_property_readonly("device_id", &Backend::deviceId)
      .def("capabilities", [](const Backend& b) { return capabilitiesDict(b.capabilities()); })
      .def(
          "allocate",
          [](Backend& b, Placement placement, size_t bytes) {
            return reinterpret_cast<uint64_t>(valueOrThrow(b.allocate(placement, bytes)));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "release",
          [](Backend& b, Placement placement, uint64_t addr, size_t bytes) {
            b.release(placement, reinterpret_cast<void*>(addr), bytes);
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "copy",
          [](Backend& b, uint64_t dst, Placement dst_placement, uint64_t src, Placement src_placement, size_t n) {
            throwIfError(b.copy(reinterpret_cast<void*>(dst), dst_placement, reinterpret_cast<const void*>(src),
                                src_placement, n));
          },
          py::call_guard<py::gil_scoped_release>());
  m.def(
      "open_backend",
      [](const std::string& name, int32_t device_id) { return valueOrThrow(openBackend(name, device_id)); },
      py::arg("name"), py::arg("device_id") = 0, py::call_guard<py::gil_scoped_release>());
}

void bindLoaders(py::module_& m) {
  // What the Ascend loader found, without failing: for pdlink.backend_info() and diagnostics.
  m.def("ascend_info", [] {
    Result<const ascend::AscendApi*> api = Status(Code::kFailed, "not loaded");
    {
      py::gil_scoped_release unlocked;  // dlopen may take a while on a real CANN install
      api = ascend::AscendApi::load();
    }
    py::dict d;
    d["loaded"] = api.ok();
    d["error"] = api.ok() ? std::string() : api.status().message();
    if (api.ok()) {
      d["library_dir"] = api.value()->library_dir;
      py::dict f;
      for (auto& [name, on] : api.value()->features) f[py::str(name)] = on;
      d["features"] = f;
      d["missing_optional"] = api.value()->missing_optional;
    }
    return d;
  });
  // UCX (transport/ucx/ucp_api.h): where to look for the libucx wheel's libucp, and what the
  // loader found, without failing.
  m.def("set_ucx_wheel_dir", &ucx::setWheelLibDir, py::arg("dir"));
  m.def("ucx_info", [] {
    Result<const ucx::UcpApi*> api = Status(Code::kFailed, "not loaded");
    {
      py::gil_scoped_release unlocked;  // dlopen
      api = ucx::load();
    }
    py::dict d;
    d["loaded"] = api.ok();
    d["error"] = api.ok() ? std::string() : api.status().message();
    d["library"] = api.ok() ? api.value()->library : std::string();
    d["version"] = api.ok() ? api.value()->version : std::string();
    return d;
  });
  m.def("ucx_network_probe", [] {
    // A network worker of its own (what an engine's would be, under this environment's UCX_*).
    Result<std::vector<std::string>> lanes = Status(Code::kFailed, "not probed");
    {
      py::gil_scoped_release unlocked;
      Result<std::unique_ptr<ucx::UcxWorker>> worker = ucx::UcxWorker::open(ucx::WorkerScope::kNetwork);
      lanes = worker.ok() ? worker.value()->lanesToSelf() : Result<std::vector<std::string>>(worker.status());
    }
    py::dict d;
    d["error"] = lanes.ok() ? std::string() : lanes.status().message();
    d["lanes"] = lanes.ok() ? lanes.value() : std::vector<std::string>{};
    d["auto_between_hosts"] = lanes.ok() && ucx::autoPicksUcx(lanes.value());
    return d;
  });
  m.def("_map_vendor_code", [](const std::string& lib, int rc) {
    return static_cast<uint32_t>(
        ascend::mapVendorCode(lib == "acl" ? ascend::Vendor::kAcl : ascend::Vendor::kHccl, rc));
  });
}

void bindSecurity(py::module_& m) {
  // Whether this process currently lets same-host peers read its memory (cma::Grant).
  m.def("ptrace_grant_active", &cma::Grant::active);
  // The links' MAC (libcrypto's, core/crypto.h), exposed so tests can check it against Python's.
  m.def("_hmac_sha256", [](const py::bytes& key, const py::bytes& msg) {
    std::string k = key, m = msg;
    Digest d = valueOrThrow(crypto::hmacSha256(k, m.data(), m.size()));
    return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
  });
  // Where libcrypto was loaded from; raises when it cannot be (a link secret then fails to init).
  m.def("crypto_library", [] {
    throwIfError(crypto::available());
    return crypto::libraryPath();
  });
}

}  // namespace

void bindBackend(py::module_& m) {
  bindBackendClass(m);
  bindLoaders(m);
  bindSecurity(m);
}

}  // namespace pdlink::bindings
