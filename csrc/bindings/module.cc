// pdlink._core: registration of the native engine for the Python layer (python/pdlink).
// The module mirrors the C++ engine and makes no policy decisions; argument validation that
// llm_datadist performs in Python stays in Python. Every call that may block releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <iterator>
#include <optional>
#include <type_traits>

#include "backends/ascend/ascend_api.h"
#include "backends/backend.h"
#include "core/crypto.h"
#include "bindings/status_bridge.h"
#include "engine/engine.h"
#include "core/limits.h"
#include "core/spans.h"
#include "transport/cma/cma.h"
#include "transport/ucx/ucp_api.h"
#include "transport/ucx/ucx_worker.h"
#include "transport/wire.h"

namespace py = pybind11;
using namespace pdlink;
using bindings::throwIfError;
using bindings::valueOrThrow;

namespace {

using StatusList = std::vector<std::pair<uint32_t, std::string>>;

StatusList toList(const std::vector<Status>& in) {
  StatusList out;
  for (const Status& s : in) out.emplace_back(static_cast<uint32_t>(s.code()), s.message());
  return out;
}

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

std::vector<RequestKey> makeKeys(const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& keys) {
  std::vector<RequestKey> out;
  for (auto& [req, prefix, model] : keys) out.push_back(RequestKey{req, prefix, model});
  return out;
}

std::pair<int64_t, std::vector<uint64_t>> handle(const std::shared_ptr<CacheEntry>& e) { return {e->id, e->addrs}; }

using RunPairs = std::vector<std::pair<uint64_t, uint64_t>>;

RunPairs runPairs(const std::vector<wire::Run>& runs) {
  RunPairs out;
  out.reserve(runs.size());
  for (const wire::Run& r : runs) out.emplace_back(r.offset, r.length);
  return out;
}

std::vector<wire::Run> wireRuns(const RunPairs& pairs) {
  std::vector<wire::Run> out;
  out.reserve(pairs.size());
  for (auto& [offset, length] : pairs) out.push_back({offset, length});
  return out;
}

// An int64 index array from numpy (or anything numpy converts), read without one Python object per
// element; pybind11 converts other dtypes and non-contiguous arrays into a temporary copy.
using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

size_t length1d(const py::array& a, const char* name) {
  if (a.ndim() != 1) throw py::value_error(std::string(name) + " must be one-dimensional");
  return static_cast<size_t>(a.shape(0));
}

// Integers as T (int64_t: block indices; uint64_t: addresses and lengths): a Python list is read
// directly (the common short list, without a numpy conversion) and must hold ints only (not bools:
// TypeError, as for an int outside T), anything else goes through a numpy array of T.
template <typename T>
class Ints {
 public:
  using Array = py::array_t<T, py::array::c_style | py::array::forcecast>;
  Ints(py::handle obj, const char* name) {
    if (PyList_CheckExact(obj.ptr())) {
      const size_t n = static_cast<size_t>(PyList_GET_SIZE(obj.ptr()));
      T* out = inline_;
      if (n > kInline) {
        list_.resize(n);
        out = list_.data();
      }
      for (size_t i = 0; i < n; ++i) {
        PyObject* item = PyList_GET_ITEM(obj.ptr(), static_cast<Py_ssize_t>(i));
        if (!PyLong_CheckExact(item) || !read(item, &out[i])) {
          throw py::type_error(std::string(name) + " must be a list of ints within " +
                               (std::is_signed_v<T> ? "int64" : "uint64"));
        }
      }
      data_ = out;
      size_ = n;
    } else {
      // Already T and C-contiguous: borrowed, no conversion call; anything else converted once.
      Array a = Array::check_(obj) ? py::reinterpret_borrow<Array>(obj) : Array::ensure(obj);
      if (!a) throw py::error_already_set();
      size_ = length1d(a, name);
      data_ = a.data();
      keep_ = std::move(a);
    }
  }
  const T* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  static bool read(PyObject* item, T* out) {
    if constexpr (std::is_signed_v<T>) {
      int overflow = 0;
      *out = PyLong_AsLongLongAndOverflow(item, &overflow);
      return overflow == 0;
    } else {
      *out = PyLong_AsUnsignedLongLong(item);
      if (*out == static_cast<T>(-1) && PyErr_Occurred()) {
        PyErr_Clear();  // negative, or past 2**64
        return false;
      }
      return true;
    }
  }
  // A short list is read into inline_ (no allocation), a longer one into list_.
  static constexpr size_t kInline = 8;
  T inline_[kInline];
  std::vector<T> list_;
  // The array data_ points into. Not an Array member: a default-constructed array_t allocates an
  // empty numpy array, which cost more than the rest of a small post.
  py::object keep_;
  const T* data_ = nullptr;
  size_t size_ = 0;
};
using Indices = Ints<int64_t>;

// A prepared transfer bound to the engine that posts it (the Python object keeps the engine alive).
struct BoundPrepared {
  Engine* engine;
  std::shared_ptr<PreparedTransfer> prepared;
  void post(py::handle local, py::handle remote, bool is_push, const char* op) {
    const Indices l(local, "local blocks"), r(remote, "remote blocks");
    if (l.size() != r.size()) throw py::value_error("local and remote block arrays differ in length");
    Status st;
    {
      py::gil_scoped_release unlocked;
      st = engine->post(*prepared, l.data(), r.data(), l.size(), is_push);
    }
    throwIfError(st, op);
  }
};

// Descriptor lists to one peer (pdlink.Engine.batch): its request spec built once, each call one
// all-or-nothing request of lengths[i] bytes between local[i] (this engine's registered memory)
// and remote[i] (the peer's).
struct BoundBatch {
  Engine* engine;
  TransferSpec spec;  // a kRaw target, local_absolute, kExplicit
  void move(py::handle local, py::handle remote, py::handle lengths, bool is_push, int64_t timeout_ms,
            const char* op) const {
    const Ints<uint64_t> lo(local, "local addresses"), ro(remote, "remote addresses"), len(lengths, "lengths");
    const size_t n = lo.size();
    if (ro.size() != n || len.size() != n) throw py::value_error("descriptor arrays differ in length");
    if (timeout_ms < 0 || timeout_ms >= (int64_t{1} << 31)) {
      throw py::value_error("timeout_ms must be 0 (the engine's timeout) or a positive int32");
    }
    // Reused per thread (its vectors keep their capacity): a short list allocates nothing.
    thread_local TransferSpec s;
    s = spec;
    if (timeout_ms > 0) s.timeout_ms = timeout_ms;
    s.local_runs.resize(n);
    s.remote_runs.resize(n);
    for (size_t i = 0; i < n; ++i) {
      s.local_runs[i] = {lo.data()[i], len.data()[i]};
      s.remote_runs[i] = {ro.data()[i], len.data()[i]};
    }
    Status st;
    {
      py::gil_scoped_release unlocked;
      st = is_push ? engine->push(s) : engine->pull(s);
    }
    throwIfError(st, op);
  }
};

// The enums and plain structs of the engine's interface (engine/engine.h, transport/wire.h),
// bound once: Python reads their values from here and never re-types them.
void bindTypes(py::module_& m) {
  py::enum_<Role>(m, "Role").value("PROMPT", Role::kPrompt).value("DECODER", Role::kDecoder).value("MIX", Role::kMix);
  py::enum_<Placement>(m, "Placement").value("HOST", Placement::kHost).value("DEVICE", Placement::kDevice);
  py::enum_<Transport>(m, "Transport")
      .value("AUTO", Transport::kAuto)
      .value("TCP", Transport::kTcp)
      .value("CMA", Transport::kCma)
      .value("UCX", Transport::kUcx);
  py::enum_<wire::TargetKind>(m, "TargetKind")
      .value("REQUEST_KEY", wire::TargetKind::kRequestKey)
      .value("PREFIX_KEY", wire::TargetKind::kPrefixKey)
      .value("ID_INDEX", wire::TargetKind::kIdIndex)
      .value("BLOCKS", wire::TargetKind::kBlocks)
      .value("RAW", wire::TargetKind::kRaw);
  py::enum_<TransferSpec::Mode>(m, "TransferMode")
      .value("SLOT_TO_SLOT", TransferSpec::Mode::kSlotToSlot)
      .value("BLOCKS_TO_BLOCKS", TransferSpec::Mode::kBlocksToBlocks)
      .value("SLOT_TO_BLOCKS", TransferSpec::Mode::kSlotToBlocks)
      .value("EXPLICIT", TransferSpec::Mode::kExplicit);

  // What peers may make an engine spend (engine/engine.h EngineLimits); the defaults come from C++.
  py::class_<EngineLimits>(m, "EngineLimits")
      .def(py::init<>())
      .def_readwrite("max_links", &EngineLimits::max_links)
      .def_readwrite("max_links_per_source", &EngineLimits::max_links_per_source)
      .def_readwrite("max_handshakes", &EngineLimits::max_handshakes)
      .def_readwrite("max_handshakes_per_source", &EngineLimits::max_handshakes_per_source)
      .def_readwrite("hello_timeout_ms", &EngineLimits::hello_timeout_ms)
      .def_readwrite("pin_timeout_ms", &EngineLimits::pin_timeout_ms)
      .def_readwrite("handshake_timeout_ms", &EngineLimits::handshake_timeout_ms)
      .def_readwrite("max_notifications_per_link", &EngineLimits::max_notifications_per_link)
      .def_readwrite("max_notification_bytes", &EngineLimits::max_notification_bytes)
      .def_readwrite("max_notification_bytes_per_link", &EngineLimits::max_notification_bytes_per_link)
      .def_readwrite("max_notification_bytes_per_source", &EngineLimits::max_notification_bytes_per_source)
      .def("__repr__", [](const EngineLimits& l) {
        return "EngineLimits(max_links=" + std::to_string(l.max_links) +
               ", max_links_per_source=" + std::to_string(l.max_links_per_source) +
               ", max_handshakes=" + std::to_string(l.max_handshakes) +
               ", max_handshakes_per_source=" + std::to_string(l.max_handshakes_per_source) +
               ", hello_timeout_ms=" + std::to_string(l.hello_timeout_ms) +
               ", pin_timeout_ms=" + std::to_string(l.pin_timeout_ms) +
               ", handshake_timeout_ms=" + std::to_string(l.handshake_timeout_ms) +
               ", max_notifications_per_link=" + std::to_string(l.max_notifications_per_link) +
               ", max_notification_bytes=" + std::to_string(l.max_notification_bytes) +
               ", max_notification_bytes_per_link=" + std::to_string(l.max_notification_bytes_per_link) +
               ", max_notification_bytes_per_source=" + std::to_string(l.max_notification_bytes_per_source) + ")";
      });
  // Received notifications (Engine::takeNotifications): name and message are the bytes sent.
  py::class_<Notification>(m, "Notification")
      .def_readonly("peer", &Notification::peer)
      .def_property_readonly("name", [](const Notification& n) { return py::bytes(n.name); })
      .def_property_readonly("message", [](const Notification& n) { return py::bytes(n.message); });
  py::class_<PoolConfig>(m, "PoolConfig")
      .def(py::init([](uint64_t bytes, uint32_t page_shift) { return PoolConfig{bytes, page_shift}; }),
           py::arg("bytes") = 0, py::arg("page_shift") = PoolConfig{}.page_shift)
      .def_readwrite("bytes", &PoolConfig::bytes)
      .def_readwrite("page_shift", &PoolConfig::page_shift);
  py::class_<EngineConfig>(m, "EngineConfig")
      .def(py::init<>())
      .def_readwrite("cluster_id", &EngineConfig::cluster_id)
      .def_readwrite("role", &EngineConfig::role)
      .def_readwrite("listen_ip", &EngineConfig::listen_ip)
      .def_readwrite("listen_port", &EngineConfig::listen_port)
      .def_readwrite("sync_timeout_ms", &EngineConfig::sync_timeout_ms)
      .def_readwrite("device_pool", &EngineConfig::device_pool)
      .def_readwrite("host_pool", &EngineConfig::host_pool)
      .def_readwrite("transport", &EngineConfig::transport)
      .def_readwrite("link_secret", &EngineConfig::link_secret)
      .def_readwrite("payload_integrity", &EngineConfig::payload_integrity)
      .def_readwrite("hccl_one_sided", &EngineConfig::one_sided)
      .def_readwrite("one_way_links", &EngineConfig::one_way_links)
      .def_readwrite("ucx_trusted_network", &EngineConfig::ucx_trusted_network)
      .def_readwrite("limits", &EngineConfig::limits);
  py::class_<CacheLayout>(m, "CacheLayout")
      .def(py::init(
               [](uint32_t num_tensors, uint64_t tensor_size, uint64_t num_slots, bool is_blocks, Placement placement) {
                 return CacheLayout{num_tensors, tensor_size, num_slots, is_blocks, placement};
               }),
           py::arg("num_tensors"), py::arg("tensor_size"), py::arg("num_slots"), py::arg("is_blocks"),
           py::arg("placement"))
      .def_readwrite("num_tensors", &CacheLayout::num_tensors)
      .def_readwrite("tensor_size", &CacheLayout::tensor_size)
      .def_readwrite("num_slots", &CacheLayout::num_slots)
      .def_readwrite("is_blocks", &CacheLayout::is_blocks)
      .def_readwrite("placement", &CacheLayout::placement);
  py::class_<wire::Target>(m, "Target")
      .def(py::init([](wire::TargetKind kind, uint64_t model_id, uint64_t req_id, uint64_t prefix_id, int64_t cache_id,
                       uint64_t batch_index) {
             return wire::Target{kind, model_id, req_id, prefix_id, cache_id, batch_index};
           }),
           py::kw_only(), py::arg("kind") = wire::TargetKind::kBlocks, py::arg("model_id") = 0, py::arg("req_id") = 0,
           py::arg("prefix_id") = 0, py::arg("cache_id") = 0, py::arg("batch_index") = 0)
      .def_readwrite("kind", &wire::Target::kind)
      .def_readwrite("model_id", &wire::Target::model_id)
      .def_readwrite("req_id", &wire::Target::req_id)
      .def_readwrite("prefix_id", &wire::Target::prefix_id)
      .def_readwrite("cache_id", &wire::Target::cache_id)
      .def_readwrite("batch_index", &wire::Target::batch_index)
      .def("__repr__", [](const wire::Target& t) { return "Target(" + t.describe() + ")"; });
  // One pull or push (engine/engine.h TransferSpec): runs are (offset, length) pairs.
  py::class_<TransferSpec>(m, "TransferSpec")
      .def(py::init([](uint64_t peer_cluster_id, const wire::Target& target, int64_t local_cache_id,
                       TransferSpec::Mode mode, uint64_t local_slot, int64_t size, std::vector<int64_t> local_blocks,
                       std::vector<int64_t> remote_blocks, std::vector<uint32_t> local_tensors,
                       std::vector<uint32_t> remote_tensors, const RunPairs& local_runs, const RunPairs& remote_runs,
                       bool local_absolute, int64_t timeout_ms) {
             TransferSpec s;
             s.peer_cluster_id = peer_cluster_id;
             s.target = target;
             s.local_cache_id = local_cache_id;
             s.mode = mode;
             s.local_slot = local_slot;
             s.size = size;
             s.local_blocks = std::move(local_blocks);
             s.remote_blocks = std::move(remote_blocks);
             s.local_tensors = std::move(local_tensors);
             s.remote_tensors = std::move(remote_tensors);
             s.local_runs = wireRuns(local_runs);
             s.remote_runs = wireRuns(remote_runs);
             s.local_absolute = local_absolute;
             s.timeout_ms = timeout_ms;
             return s;
           }),
           // one call builds a whole spec: a pull_blocks pays for one conversion, not one per field
           py::kw_only(), py::arg("peer_cluster_id") = 0, py::arg("target") = wire::Target{},
           py::arg("local_cache_id") = 0, py::arg("mode") = TransferSpec::Mode::kSlotToSlot, py::arg("local_slot") = 0,
           py::arg("size") = -1, py::arg("local_blocks") = std::vector<int64_t>{},
           py::arg("remote_blocks") = std::vector<int64_t>{}, py::arg("local_tensors") = std::vector<uint32_t>{},
           py::arg("remote_tensors") = std::vector<uint32_t>{}, py::arg("local_runs") = RunPairs{},
           py::arg("remote_runs") = RunPairs{}, py::arg("local_absolute") = false, py::arg("timeout_ms") = 0)
      .def_readwrite("peer_cluster_id", &TransferSpec::peer_cluster_id)
      .def_readwrite("target", &TransferSpec::target)
      .def_readwrite("local_cache_id", &TransferSpec::local_cache_id)
      .def_readwrite("local_absolute", &TransferSpec::local_absolute)
      .def_readwrite("timeout_ms", &TransferSpec::timeout_ms)
      .def_readwrite("mode", &TransferSpec::mode)
      .def_readwrite("local_slot", &TransferSpec::local_slot)
      .def_readwrite("size", &TransferSpec::size)
      .def_readwrite("local_blocks", &TransferSpec::local_blocks)
      .def_readwrite("remote_blocks", &TransferSpec::remote_blocks)
      .def_readwrite("local_tensors", &TransferSpec::local_tensors)
      .def_readwrite("remote_tensors", &TransferSpec::remote_tensors)
      .def_property(
          "local_runs", [](const TransferSpec& s) { return runPairs(s.local_runs); },
          [](TransferSpec& s, const RunPairs& r) { s.local_runs = wireRuns(r); })
      .def_property(
          "remote_runs", [](const TransferSpec& s) { return runPairs(s.remote_runs); },
          [](TransferSpec& s, const RunPairs& r) { s.remote_runs = wireRuns(r); });
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "pdlink native engine (C++ core; CPU and Ascend backends; TCP, same-host and HCCL transports)";
  bindings::registerStatusTranslator();
  m.attr("PROTOCOL_VERSION") = wire::kProtocolVersion;
  m.attr("ANY_CLUSTER") = wire::kAnyCluster;
  {
    py::tuple backends(std::size(kBackendNames));
    for (size_t i = 0; i < std::size(kBackendNames); ++i) backends[i] = kBackendNames[i];
    m.attr("BACKENDS") = backends;  // the names open_backend takes
  }
  m.attr("INVALID_ID") = kInvalidId;                     // an unset req_id / prefix_id / registration key
  m.attr("LATEST_LINK_MARK") = Engine::kLatestLinkMark;  // linked_since(it): no peer, only the latest mark
  // The bounds on what one peer may make an engine spend (core/limits.h), bound once.
  {
    py::dict limits;
    limits["max_request_tensors"] = limits::kMaxRequestTensors;
    limits["max_request_pieces"] = limits::kMaxRequestPieces;
    limits["max_request_span_steps"] = limits::kMaxRequestSpanSteps;
    limits["max_raw_span"] = limits::kMaxRawSpan;
    limits["max_body_bytes"] = limits::kMaxBodyBytes;
    limits["max_message_bytes"] = limits::kMaxMessageBytes;
    limits["read_chunk_bytes"] = limits::kReadChunkBytes;
    limits["payload_chunk_bytes"] = limits::kPayloadChunkBytes;
    limits["link_log_entries"] = limits::kLinkLogEntries;
    limits["max_notify_name_bytes"] = limits::kMaxNotifyNameBytes;
    limits["max_notify_message_bytes"] = limits::kMaxNotifyMessageBytes;
    m.attr("LIMITS") = limits;
  }
  bindTypes(m);
  // Whether this process currently lets same-host peers read its memory (cma::Grant).
  m.def("ptrace_grant_active", &cma::Grant::active);
  // MemoryMap.covers: core/spans.h's rule, each range on its own (no request bound on the steps).
  m.def(
      "covers",
      [](std::vector<std::pair<uint64_t, uint64_t>> ranges, const std::vector<uint64_t>& addresses,
         const std::vector<uint64_t>& lengths) {
        if (addresses.size() != lengths.size()) throw py::value_error("addresses and lengths differ in length");
        std::vector<wire::Run> sorted, runs;
        for (const auto& [offset, length] : ranges) sorted.push_back({offset, length});
        std::sort(sorted.begin(), sorted.end(),
                  [](const wire::Run& a, const wire::Run& b) { return a.offset < b.offset; });
        for (size_t i = 0; i < addresses.size(); ++i) runs.push_back({addresses[i], lengths[i]});
        return spans::covers(sorted, runs, UINT64_MAX);
      },
      py::arg("ranges"), py::arg("addresses"), py::arg("lengths"));
  // The links' MAC (libcrypto's, core/crypto.h), exposed so tests can check it against Python's.
  m.def("_hmac_sha256", [](const py::bytes& key, const py::bytes& msg) {
    std::string k = key, m = msg;
    Digest d = valueOrThrow(crypto::hmacSha256(k, m.data(), m.size()), "hmac_sha256");
    return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
  });
  // Where libcrypto was loaded from; raises when it cannot be (a link secret then fails to init).
  m.def("crypto_library", [] {
    throwIfError(crypto::available(), "crypto_library");
    return crypto::libraryPath();
  });

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
      Result<std::unique_ptr<ucx::UcxWorker>> worker = ucx::UcxWorker::open(ucx::Scope::kNetwork);
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

  // A process-wide backend (backends/backend.h): memory and local copies, used by pdlink.device.
  py::class_<Backend, std::shared_ptr<Backend>>(m, "Backend")
      .def_property_readonly("name", [](const Backend& b) { return std::string(b.name()); })
      .def_property_readonly("device_id", &Backend::deviceId)
      .def("capabilities", [](const Backend& b) { return capabilitiesDict(b.capabilities()); })
      .def(
          "allocate",
          [](Backend& b, Placement placement, size_t bytes) {
            return reinterpret_cast<uint64_t>(valueOrThrow(b.allocate(placement, bytes), "allocate"));
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
                                src_placement, n),
                         "copy");
          },
          py::call_guard<py::gil_scoped_release>());
  m.def(
      "open_backend",
      [](const std::string& name, int32_t device_id) { return valueOrThrow(openBackend(name, device_id), "init"); },
      py::arg("name"), py::arg("device_id") = 0, py::call_guard<py::gil_scoped_release>());

  // A prepared transfer (engine/engine.h PreparedTransfer), posted with int64 block-index arrays.
  py::class_<BoundPrepared>(m, "PreparedTransfer")
      .def("post", &BoundPrepared::post, py::arg("local"), py::arg("remote"), py::arg("push"), py::arg("op"))
      .def(
          "read", [](BoundPrepared& b, py::handle l, py::handle r) { b.post(l, r, false, "read"); }, py::arg("local"),
          py::arg("remote"))
      .def(
          "write", [](BoundPrepared& b, py::handle l, py::handle r) { b.post(l, r, true, "write"); }, py::arg("local"),
          py::arg("remote"))
      .def_property_readonly("block_size", [](const BoundPrepared& b) { return b.prepared->block_size; })
      .def_property_readonly("local_blocks", [](const BoundPrepared& b) { return b.prepared->local_blocks; })
      .def_property_readonly("remote_blocks", [](const BoundPrepared& b) { return b.prepared->remote_blocks; })
      .def_property_readonly("peer_cluster_id", [](const BoundPrepared& b) { return b.prepared->peer_cluster_id; });

  py::class_<BoundBatch>(m, "BatchTransfer")
      .def(
          "read",
          [](const BoundBatch& b, py::handle l, py::handle r, py::handle n, int64_t timeout_ms) {
            b.move(l, r, n, false, timeout_ms, "read");
          },
          py::arg("local_addresses"), py::arg("remote_addresses"), py::arg("lengths"), py::arg("timeout_ms") = 0)
      .def(
          "write",
          [](const BoundBatch& b, py::handle l, py::handle r, py::handle n, int64_t timeout_ms) {
            b.move(l, r, n, true, timeout_ms, "write");
          },
          py::arg("local_addresses"), py::arg("remote_addresses"), py::arg("lengths"), py::arg("timeout_ms") = 0)
      .def_property_readonly("peer_cluster_id", [](const BoundBatch& b) { return b.spec.peer_cluster_id; });

  py::class_<Engine>(m, "Engine")
      .def(py::init([](std::shared_ptr<Backend> backend) { return std::make_unique<Engine>(std::move(backend)); }),
           py::arg("backend"))
      .def(py::init([](const std::string& name) {
             return std::make_unique<Engine>(valueOrThrow(openBackend(name, 0), "init"));
           }),
           py::arg("backend") = "cpu")
      .def(
          "initialize",
          [](Engine& e, const EngineConfig& c) {
            const EngineLimits& l = c.limits;
            if (l.max_links == 0 || l.max_links_per_source == 0 || l.max_handshakes == 0 ||
                l.max_handshakes_per_source == 0 || l.hello_timeout_ms <= 0 || l.pin_timeout_ms < 0 ||
                l.handshake_timeout_ms <= 0 || l.max_notifications_per_link == 0 || l.max_notification_bytes == 0 ||
                l.max_notification_bytes_per_link == 0 || l.max_notification_bytes_per_source == 0) {
              throw py::value_error("limits must be positive (pin_timeout_ms: 0 for the default)");
            }
            throwIfError(e.initialize(c), "init");
          },
          py::arg("config"), py::call_guard<py::gil_scoped_release>())
      .def("finalize", &Engine::finalize, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("initialized", &Engine::initialized)
      .def_property_readonly("cluster_id", &Engine::clusterId)
      .def_property_readonly("role", &Engine::role)
      .def_property_readonly("listen_port", &Engine::listenPort)
      .def_property_readonly("backend", [](const Engine& e) { return std::string(e.backendName()); })
      .def_property_readonly("backend_handle", [](const Engine& e) { return e.backend(); })
      .def_property_readonly("cache_count", &Engine::cacheCount)
      .def("stats",
           [](const Engine& e) {
             EngineStats s = e.stats();
             py::dict d;
             d["live_links"] = s.live_links;
             d["tombstones"] = s.tombstones;
             d["handshakes"] = s.handshakes;
             d["threads"] = s.threads;
             d["handshakes_refused"] = s.handshakes_refused;
             d["handshakes_evicted"] = s.handshakes_evicted;
             d["listener_backoffs"] = s.listener_backoffs;
             d["pins_expired"] = s.pins_expired;
             d["notifications"] = s.notifications;
             d["notifications_refused"] = s.notifications_refused;
             return d;
           })
      .def("pools",
           [](const Engine& e) {
             py::list out;
             for (const Engine::PoolInfo& p : e.pools()) {
               py::dict d;
               d["placement"] = p.placement;
               d["base"] = p.base;
               d["capacity"] = p.capacity;
               d["used"] = p.used;
               out.append(d);
             }
             return out;
           })
      .def(
          "switch_role",
          [](Engine& e, Role role, const std::string& ip, uint16_t port) {
            throwIfError(e.switchRole(role, ip, port), "switch_role");
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "link",
          [](Engine& e, const std::vector<std::tuple<std::optional<uint64_t>, std::string, uint16_t>>& peers,
             int64_t timeout_ms) {
            std::vector<PeerAddress> addrs;
            for (auto& [id, ip, port] : peers) addrs.push_back(PeerAddress{id.value_or(wire::kAnyCluster), ip, port});
            std::vector<uint64_t> ids;
            std::vector<Status> st = e.link(addrs, timeout_ms, &ids);
            std::vector<std::tuple<uint32_t, std::string, uint64_t>> out;
            for (size_t i = 0; i < st.size(); ++i) {
              out.emplace_back(static_cast<uint32_t>(st[i].code()), st[i].message(),
                               i < ids.size() ? ids[i] : wire::kAnyCluster);
            }
            return out;
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "ping",
          [](Engine& e, uint64_t cluster_id, int64_t timeout_ms, const std::string& op) {
            throwIfError(e.ping(cluster_id, timeout_ms), op.c_str());
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "notify",
          [](Engine& e, uint64_t cluster_id, const std::string& name, const std::string& message, int64_t timeout_ms,
             const std::string& op) { throwIfError(e.notify(cluster_id, name, message, timeout_ms), op.c_str()); },
          py::arg("cluster_id"), py::arg("name"), py::arg("message"), py::arg("timeout_ms"), py::arg("op"),
          py::call_guard<py::gil_scoped_release>())
      .def("take_notifications", &Engine::takeNotifications)
      .def(
          "start_comm_listener",
          [](Engine& e, const std::string& ip, uint16_t port) {
            return valueOrThrow(e.startCommListener(ip, port), "link");
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "unlink",
          [](Engine& e, const std::vector<uint64_t>& ids, int64_t timeout_ms, bool force) {
            return toList(e.unlink(ids, timeout_ms, force));
          },
          py::call_guard<py::gil_scoped_release>())
      .def("linked_since",
           [](const Engine& e, uint64_t after) {
             std::vector<uint64_t> peers;
             uint64_t latest = e.linkedSince(after, &peers);
             return std::make_pair(latest, peers);
           })
      .def("links",
           [](const Engine& e) {
             py::list out;
             for (const LinkInfo& l : e.links()) {
               py::dict d;
               d["peer_cluster_id"] = l.peer_cluster_id;
               d["peer_address"] = l.peer_address;
               d["initiator"] = l.initiator;
               d["broken"] = l.broken;
               d["broken_reason"] = l.broken_reason;
               d["transport"] = l.transport;
               d["authenticated"] = l.authenticated;
               d["payload_integrity"] = l.payload_integrity;
               d["device_paths"] = l.device_paths;
               d["lanes"] = l.lanes;
               out.append(d);
             }
             return out;
           })
      .def(
          "register_cache",
          [](Engine& e, const CacheLayout& layout, const std::vector<uint64_t>& addrs,
             const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& keys, std::optional<uint64_t> blocks_model,
             bool remote_accessible, const std::string& op) {
            auto r = e.registerCache(layout, addrs, makeKeys(keys), blocks_model, remote_accessible);
            return handle(valueOrThrow(std::move(r), op.c_str()));
          },
          py::arg("layout"), py::arg("addrs"), py::arg("keys"), py::arg("blocks_model"), py::arg("remote_accessible"),
          py::arg("op") = "register_cache", py::call_guard<py::gil_scoped_release>())
      .def(
          "allocate_cache",
          [](Engine& e, const CacheLayout& layout, const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& keys,
             std::optional<uint64_t> blocks_model, const std::string& op) {
            return handle(valueOrThrow(e.allocateCache(layout, makeKeys(keys), blocks_model), op.c_str()));
          },
          py::arg("layout"), py::arg("keys"), py::arg("blocks_model"), py::arg("op") = "allocate_cache",
          py::call_guard<py::gil_scoped_release>())
      .def(
          "deallocate_cache",
          [](Engine& e, int64_t id, bool blocks, const std::string& op) {
            throwIfError(e.deallocateCache(id, blocks), op.c_str());
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "unregister_cache", [](Engine& e, int64_t id) { throwIfError(e.unregisterCache(id), "unregister_cache"); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "remove_cache_key",
          [](Engine& e, uint64_t req, uint64_t prefix, uint64_t model) {
            e.removeCacheKey(RequestKey{req, prefix, model});
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "pull",
          [](Engine& e, const TransferSpec& spec, const std::string& op) { throwIfError(e.pull(spec), op.c_str()); },
          py::arg("spec"), py::arg("op") = "pull", py::call_guard<py::gil_scoped_release>())
      .def(
          "push",
          [](Engine& e, const TransferSpec& spec, const std::string& op) { throwIfError(e.push(spec), op.c_str()); },
          py::arg("spec"), py::arg("op") = "push", py::call_guard<py::gil_scoped_release>())
      .def(
          "prepare",
          [](Engine& e, const TransferSpec& spec, uint64_t block_size, uint64_t remote_base, uint64_t remote_bytes,
             const std::string& op) {
            Result<std::shared_ptr<PreparedTransfer>> r = Status(Code::kFailed, "");
            {
              py::gil_scoped_release unlocked;
              r = e.prepare(spec, block_size, remote_base, remote_bytes);
            }
            return BoundPrepared{&e, valueOrThrow(std::move(r), op.c_str())};
          },
          py::arg("spec"), py::arg("block_size") = 0, py::arg("remote_base") = 0, py::arg("remote_bytes") = 0,
          py::arg("op") = "prepare", py::keep_alive<0, 1>())
      .def(
          "describe_memory",
          [](Engine& e, uint64_t cluster_id, int64_t timeout_ms, const std::string& op) {
            Result<wire::RawTable> r = Status(Code::kFailed, "");
            {
              py::gil_scoped_release unlocked;
              r = e.describeMemory(cluster_id, timeout_ms);
            }
            wire::RawTable t = valueOrThrow(std::move(r), op.c_str());
            std::vector<std::pair<uint64_t, uint64_t>> ranges;
            ranges.reserve(t.ranges.size());
            for (const wire::Run& run : t.ranges) ranges.emplace_back(run.offset, run.length);
            return py::make_tuple(t.generation, ranges);
          },
          py::arg("cluster_id"), py::arg("timeout_ms"), py::arg("op") = "describe_memory")
      .def(
          "batch",
          [](Engine& e, uint64_t peer) {
            BoundBatch b{&e, {}};
            b.spec.peer_cluster_id = peer;
            b.spec.target.kind = wire::TargetKind::kRaw;
            b.spec.mode = TransferSpec::Mode::kExplicit;
            b.spec.local_absolute = true;
            return b;
          },
          py::arg("peer"), py::keep_alive<0, 1>())
      .def(
          "copy_local",
          [](Engine& e, const std::vector<uint64_t>& dst, Placement dst_placement, const std::vector<uint64_t>& src,
             Placement src_placement, const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& runs,
             const std::string& op) {
            std::vector<Engine::CopyRun> rs;
            for (auto& [d, s, n] : runs) rs.push_back({d, s, n});
            throwIfError(e.copyLocal(dst, dst_placement, src, src_placement, rs), op.c_str());
          },
          py::call_guard<py::gil_scoped_release>());
}
