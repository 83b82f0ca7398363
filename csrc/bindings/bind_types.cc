// pdlink._core's constants, and the enums and plain structs of the engine's interface
// (engine/engine.h, transport/wire.h), bound once: Python reads their values from here and never
// re-types them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <iterator>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "backends/backend.h"
#include "bindings/bindings.h"
#include "bindings/record.h"
#include "core/environment.h"
#include "core/limits.h"
#include "engine/engine.h"
#include "transport/link.h"
#include "transport/wire.h"

namespace py = pybind11;

namespace pdlink::bindings {
namespace {

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

void bindEnums(py::module_& m) {
  py::enum_<Role>(m, "Role").value("PROMPT", Role::kPrompt).value("DECODER", Role::kDecoder).value("MIX", Role::kMix);
  // Where an engine stands with its role (engine/engine_types.h Phase).
  py::enum_<Phase>(m, "Phase")
      .value("READY", Phase::kReady)
      .value("DRAINING", Phase::kDraining)
      .value("SWITCHING", Phase::kSwitching)
      .value("ROLLING_BACK", Phase::kRollingBack)
      .value("FAILED", Phase::kFailed);
  // How a role switch goes (Engine::switchRole).
  py::class_<SwitchOptions>(m, "SwitchOptions")
      .def(py::init<>())
      .def_readwrite("role", &SwitchOptions::role)
      .def_readwrite("listen_ip", &SwitchOptions::listen_ip)
      .def_readwrite("listen_port", &SwitchOptions::listen_port)
      .def_readwrite("expected_epoch", &SwitchOptions::expected_epoch)
      .def_readwrite("drain_timeout_ms", &SwitchOptions::drain_timeout_ms)
      .def_readwrite("require_no_links", &SwitchOptions::require_no_links);
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
      .value("RAW", wire::TargetKind::kRaw)
      .value("OFFER", wire::TargetKind::kOffer);
  py::enum_<TransferSpec::Mode>(m, "TransferMode")
      .value("SLOT_TO_SLOT", TransferSpec::Mode::kSlotToSlot)
      .value("BLOCKS_TO_BLOCKS", TransferSpec::Mode::kBlocksToBlocks)
      .value("SLOT_TO_BLOCKS", TransferSpec::Mode::kSlotToBlocks)
      .value("EXPLICIT", TransferSpec::Mode::kExplicit);
}

void bindEngineLimits(py::module_& m) {
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
      .def_readwrite("tcp_streams", &EngineLimits::tcp_streams)
      .def_readwrite("max_tcp_lanes", &EngineLimits::max_tcp_lanes)
      .def_readwrite("tcp_chunk_bytes", &EngineLimits::tcp_chunk_bytes)
      .def_readwrite("switch_drain_timeout_ms", &EngineLimits::switch_drain_timeout_ms)
      .def_readwrite("max_offers", &EngineLimits::max_offers)
      .def_readwrite("max_lease_ms", &EngineLimits::max_lease_ms)
      .def_readwrite("offer_lease_ms", &EngineLimits::offer_lease_ms)
      .def_readwrite("max_handoff_events", &EngineLimits::max_handoff_events)
      .def_readwrite("max_metric_peers", &EngineLimits::max_metric_peers)
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
               ", max_notification_bytes_per_source=" + std::to_string(l.max_notification_bytes_per_source) +
               ", tcp_streams=" + std::to_string(l.tcp_streams) + ", max_tcp_lanes=" + std::to_string(l.max_tcp_lanes) +
               ", tcp_chunk_bytes=" + std::to_string(l.tcp_chunk_bytes) +
               ", switch_drain_timeout_ms=" + std::to_string(l.switch_drain_timeout_ms) +
               ", max_offers=" + std::to_string(l.max_offers) + ", max_lease_ms=" + std::to_string(l.max_lease_ms) +
               ", offer_lease_ms=" + std::to_string(l.offer_lease_ms) +
               ", max_handoff_events=" + std::to_string(l.max_handoff_events) +
               ", max_metric_peers=" + std::to_string(l.max_metric_peers) + ")";
      });
}

void bindEngineStructs(py::module_& m) {
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
}

void bindCacheTypes(py::module_& m) {
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
}

void bindBlockMapping(py::module_& m) {
  // A prepared transfer's block views and ratio (engine/engine_types.h BlockMapping).
  py::class_<BlockMapping>(m, "BlockMapping")
      .def(py::init([](uint64_t remote_block_size, uint64_t local_view_offset, uint64_t local_view_length,
                       uint64_t remote_view_offset, uint64_t remote_view_length, uint32_t block_ratio) {
             return BlockMapping{remote_block_size,  local_view_offset,  local_view_length,
                                 remote_view_offset, remote_view_length, block_ratio};
           }),
           py::kw_only(), py::arg("remote_block_size") = 0, py::arg("local_view_offset") = 0,
           py::arg("local_view_length") = 0, py::arg("remote_view_offset") = 0, py::arg("remote_view_length") = 0,
           py::arg("block_ratio") = 1)
      .def_readonly("remote_block_size", &BlockMapping::remote_block_size)
      .def_readonly("local_view_offset", &BlockMapping::local_view_offset)
      .def_readonly("local_view_length", &BlockMapping::local_view_length)
      .def_readonly("remote_view_offset", &BlockMapping::remote_view_offset)
      .def_readonly("remote_view_length", &BlockMapping::remote_view_length)
      .def_readonly("block_ratio", &BlockMapping::block_ratio)
      .def("__repr__", [](const BlockMapping& b) {
        return "BlockMapping(remote_block_size=" + std::to_string(b.remote_block_size) + ", local_view=(" +
               std::to_string(b.local_view_offset) + ", " + std::to_string(b.local_view_length) + "), remote_view=(" +
               std::to_string(b.remote_view_offset) + ", " + std::to_string(b.remote_view_length) +
               "), block_ratio=" + std::to_string(b.block_ratio) + ")";
      });
}

void bindTransferSpec(py::module_& m) {
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

// What the engine reports of itself: its links (transport/link.h LinkInfo), what peers made it
// spend (EngineStats) and its pools (Engine::PoolInfo): read-only records, each field named once
// (record.h).
void bindEngineReports(py::module_& m) {
  bindRecord(m, "LinkInfo",
             std::make_tuple(field("peer_cluster_id", &LinkInfo::peer_cluster_id),
                             field("peer_address", &LinkInfo::peer_address), field("initiator", &LinkInfo::initiator),
                             field("broken", &LinkInfo::broken), field("broken_reason", &LinkInfo::broken_reason),
                             field("transport", &LinkInfo::transport), field("authenticated", &LinkInfo::authenticated),
                             field("payload_integrity", &LinkInfo::payload_integrity),
                             field("device_paths", &LinkInfo::device_paths), field("lanes", &LinkInfo::lanes),
                             field("confirmed", &LinkInfo::confirmed)));
  // Telemetry's series (engine/telemetry.h), bound before EngineStats, which holds them.
  bindRecord(m, "HistogramCounts",
             std::make_tuple(field("buckets", &HistogramCounts::buckets), field("sum", &HistogramCounts::sum),
                             field("count", &HistogramCounts::count)));
  bindRecord(m, "TransferSeries",
             std::make_tuple(field("peer", &TransferSeries::peer), field("path", &TransferSeries::path),
                             field("op", &TransferSeries::op), field("transfers", &TransferSeries::transfers),
                             field("bytes", &TransferSeries::bytes), field("descriptors", &TransferSeries::descriptors),
                             field("queue", &TransferSeries::queue), field("wire", &TransferSeries::wire),
                             field("total", &TransferSeries::total)));
  bindRecord(m, "FailureSeries",
             std::make_tuple(field("peer", &FailureSeries::peer), field("path", &FailureSeries::path),
                             field("op", &FailureSeries::op), field("code", &FailureSeries::code),
                             field("stage", &FailureSeries::stage), field("count", &FailureSeries::count)));
  bindRecord(m, "LinkEventSeries",
             std::make_tuple(field("peer", &LinkEventSeries::peer), field("event", &LinkEventSeries::event),
                             field("reason", &LinkEventSeries::reason), field("count", &LinkEventSeries::count)));
  m.attr("LATENCY_BOUNDS") = py::tuple(py::cast(std::vector<double>(kLatencyBounds.begin(), kLatencyBounds.end())));
  bindRecord(
      m, "EngineStats",
      std::make_tuple(
          field("live_links", &EngineStats::live_links), field("tombstones", &EngineStats::tombstones),
          field("handshakes", &EngineStats::handshakes), field("threads", &EngineStats::threads),
          field("handshakes_refused", &EngineStats::handshakes_refused),
          field("handshakes_evicted", &EngineStats::handshakes_evicted),
          field("listener_backoffs", &EngineStats::listener_backoffs),
          field("pins_expired", &EngineStats::pins_expired), field("notifications", &EngineStats::notifications),
          field("notifications_refused", &EngineStats::notifications_refused),
          field("offers_live", &EngineStats::offers_live), field("offers_released", &EngineStats::offers_released),
          field("offers_expired", &EngineStats::offers_expired), field("offers_aborted", &EngineStats::offers_aborted),
          field("offer_bytes", &EngineStats::offer_bytes),
          field("handoff_events_dropped", &EngineStats::handoff_events_dropped),
          field("pinned_bytes", &EngineStats::pinned_bytes), field("role_epoch", &EngineStats::role_epoch),
          field("taken_at", &EngineStats::taken_at), field("transfers", &EngineStats::transfers),
          field("failures", &EngineStats::failures), field("link_events", &EngineStats::link_events),
          field("links_by_path", &EngineStats::links_by_path)))
      .def("since", &EngineStats::since, py::arg("earlier"))
      .def("__sub__", &EngineStats::since);
  bindRecord(
      m, "RoleState",
      std::make_tuple(field("role", &RoleState::role), field("epoch", &RoleState::epoch),
                      field("phase", &RoleState::phase), field("transfers_in_flight", &RoleState::transfers_in_flight),
                      field("served_in_flight", &RoleState::served_in_flight), field("pins", &RoleState::pins),
                      field("offers", &RoleState::offers)));
  bindRecord(m, "PoolInfo",
             std::make_tuple(field("placement", &Engine::PoolInfo::placement), field("base", &Engine::PoolInfo::base),
                             field("capacity", &Engine::PoolInfo::capacity), field("used", &Engine::PoolInfo::used)));
  py::class_<CacheHandle>(m, "CacheHandle")
      .def_readonly("cache_id", &CacheHandle::cache_id)
      .def_property_readonly("addresses", [](const CacheHandle& h) { return py::tuple(py::cast(h.addresses)); })
      .def("__iter__", [](const CacheHandle& h) { return py::iter(py::make_tuple(h.cache_id, h.addresses)); })
      .def("__len__", [](const CacheHandle&) { return 2; })
      .def("__repr__", [](const CacheHandle& h) {
        return py::str("CacheHandle(cache_id={}, addresses={!r})").format(h.cache_id, py::tuple(py::cast(h.addresses)));
      });
}

}  // namespace

void bindConstants(py::module_& m) {
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
    limits["max_tcp_streams"] = limits::kMaxTcpStreams;
    limits["min_tcp_chunk_bytes"] = limits::kMinTcpChunkBytes;
    limits["max_tcp_chunk_bytes"] = limits::kMaxTcpChunkBytes;
    limits["max_tcp_depth"] = limits::kMaxTcpDepth;
    limits["max_notify_name_bytes"] = limits::kMaxNotifyNameBytes;
    limits["max_notify_message_bytes"] = limits::kMaxNotifyMessageBytes;
    limits["max_metric_peers"] = limits::kMaxMetricPeers;
    m.attr("LIMITS") = limits;
  }
  // The PDLINK_* variables the core reads itself (core/environment.h): (name, meaning, fallback or
  // None, whether an empty setting is a value of its own), for pdlink.environment to list.
  {
    py::tuple variables(std::size(environment::kVariables));
    for (size_t i = 0; i < std::size(environment::kVariables); ++i) {
      const environment::Variable& v = *environment::kVariables[i];
      variables[i] = py::make_tuple(v.name, v.meaning, v.fallback ? py::object(py::str(v.fallback)) : py::none(),
                                    v.empty_is_value);
    }
    m.attr("NATIVE_VARIABLES") = variables;
  }
}

void bindTypes(py::module_& m) {
  bindEnums(m);
  bindEngineLimits(m);
  bindEngineStructs(m);
  bindCacheTypes(m);
  bindBlockMapping(m);
  bindTransferSpec(m);
  bindEngineReports(m);
}

}  // namespace pdlink::bindings
