// pdlink._core.Engine (engine/engine.h): every call that may block releases the GIL, and a failed
// Status raises through the translator (status_bridge.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backends/backend.h"
#include "bindings/bindings.h"
#include "core/limits.h"
#include "bindings/status_bridge.h"
#include "engine/engine.h"
#include "transport/wire.h"

namespace py = pybind11;

namespace pdlink::bindings {
namespace {

// One LinkResult per status, peer ids[i] for the i-th (ANY_CLUSTER past the end: the one status of
// a call that failed as a whole, kClusterNumExceedLimit or an engine not initialized).
std::vector<LinkResult> toResults(std::vector<Status> st, const std::vector<uint64_t>& ids) {
  std::vector<LinkResult> out;
  out.reserve(st.size());
  for (size_t i = 0; i < st.size(); ++i) {
    out.push_back(LinkResult{std::move(st[i]), st.size() == ids.size() ? ids[i] : wire::kAnyCluster});
  }
  return out;
}

std::vector<RequestKey> makeKeys(const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& keys) {
  std::vector<RequestKey> out;
  for (auto& [req, prefix, model] : keys) out.push_back(RequestKey{req, prefix, model});
  return out;
}

CacheHandle handle(const std::shared_ptr<CacheEntry>& e) { return {e->id, e->addrs}; }

// Engine's lifetime: the constructors, initialize, finalize, what the engine is and spent.
void defLifetime(py::class_<Engine>& cls) {
  cls.def(py::init([](std::shared_ptr<Backend> backend) { return std::make_unique<Engine>(std::move(backend)); }),
          py::arg("backend"))
      .def(py::init(
               [](const std::string& name) { return std::make_unique<Engine>(valueOrThrow(openBackend(name, 0))); }),
           py::arg("backend") = "cpu")
      .def(
          "initialize",
          [](Engine& e, const EngineConfig& c) {
            const EngineLimits& l = c.limits;
            if (l.max_links == 0 || l.max_links_per_source == 0 || l.max_handshakes == 0 ||
                l.max_handshakes_per_source == 0 || l.hello_timeout_ms <= 0 || l.pin_timeout_ms < 0 ||
                l.handshake_timeout_ms <= 0 || l.max_notifications_per_link == 0 || l.max_notification_bytes == 0 ||
                l.max_notification_bytes_per_link == 0 || l.max_notification_bytes_per_source == 0 ||
                l.switch_drain_timeout_ms <= 0 || l.max_offers == 0 || l.max_lease_ms <= 0 || l.offer_lease_ms <= 0 ||
                l.offer_lease_ms > l.max_lease_ms || l.max_handoff_events == 0) {
              throw py::value_error("limits must be positive (pin_timeout_ms: 0 for the default)");
            }
            if (l.max_metric_peers > limits::kMaxMetricPeers) {
              throw py::value_error("max_metric_peers must lie in [0, " + std::to_string(limits::kMaxMetricPeers) +
                                    "]");
            }
            if (l.tcp_streams == 0 || l.tcp_streams > limits::kMaxTcpStreams || l.max_tcp_lanes == 0 ||
                l.tcp_chunk_bytes < limits::kMinTcpChunkBytes || l.tcp_chunk_bytes > limits::kMaxTcpChunkBytes) {
              throw py::value_error("tcp_streams must lie in [1, " + std::to_string(limits::kMaxTcpStreams) +
                                    "], max_tcp_lanes be positive, tcp_chunk_bytes lie in [" +
                                    std::to_string(limits::kMinTcpChunkBytes) + ", " +
                                    std::to_string(limits::kMaxTcpChunkBytes) + "]");
            }
            throwIfError(e.initialize(c));
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
      .def("stats", &Engine::stats, py::call_guard<py::gil_scoped_release>())
      .def("pools", &Engine::pools);
}

// Engine's links: roles, dialling, pings, notifications, listeners.
void defLinks(py::class_<Engine>& cls) {
  cls.def(
         "switch_role", [](Engine& e, const SwitchOptions& o) { throwIfError(e.switchRole(o)); }, py::arg("options"),
         py::call_guard<py::gil_scoped_release>())  // blocks through the drain: without the GIL
      .def("role_state", &Engine::roleState)
      .def(
          "link",
          [](Engine& e, const std::vector<std::tuple<std::optional<uint64_t>, std::string, uint16_t>>& peers,
             int64_t timeout_ms) {
            std::vector<PeerAddress> addrs;
            for (auto& [id, ip, port] : peers) addrs.push_back(PeerAddress{id.value_or(wire::kAnyCluster), ip, port});
            std::vector<uint64_t> ids;
            std::vector<Status> st = e.link(addrs, timeout_ms, &ids);
            return toResults(std::move(st), ids);
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "ping",
          [](Engine& e, uint64_t cluster_id, int64_t timeout_ms) { throwIfError(e.ping(cluster_id, timeout_ms)); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "notify",
          [](Engine& e, uint64_t cluster_id, const std::string& name, const std::string& message, int64_t timeout_ms) {
            throwIfError(e.notify(cluster_id, name, message, timeout_ms));
          },
          py::arg("cluster_id"), py::arg("name"), py::arg("message"), py::arg("timeout_ms"),
          py::call_guard<py::gil_scoped_release>())
      .def("take_notifications", &Engine::takeNotifications)
      .def(
          "start_comm_listener",
          [](Engine& e, const std::string& ip, uint16_t port) { return valueOrThrow(e.startCommListener(ip, port)); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "unlink",
          [](Engine& e, const std::vector<uint64_t>& ids, int64_t timeout_ms, bool force) {
            return toResults(e.unlink(ids, timeout_ms, force), ids);
          },
          py::call_guard<py::gil_scoped_release>())
      .def("linked_since",
           [](const Engine& e, uint64_t after) {
             std::vector<uint64_t> peers;
             uint64_t latest = e.linkedSince(after, &peers);
             return std::make_pair(latest, peers);
           })
      .def("links", &Engine::links);
}

// Engine's caches: registration, pool allocation, keys.
void defCaches(py::class_<Engine>& cls) {
  cls.def(
         "register_cache",
         [](Engine& e, const CacheLayout& layout, const std::vector<uint64_t>& addrs,
            const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& keys, std::optional<uint64_t> blocks_model,
            bool remote_accessible) {
           auto r = e.registerCache(layout, addrs, makeKeys(keys), blocks_model, remote_accessible);
           return handle(valueOrThrow(std::move(r)));
         },
         py::arg("layout"), py::arg("addrs"), py::arg("keys"), py::arg("blocks_model"), py::arg("remote_accessible"),
         py::call_guard<py::gil_scoped_release>())
      .def(
          "allocate_cache",
          [](Engine& e, const CacheLayout& layout, const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& keys,
             std::optional<uint64_t> blocks_model) {
            return handle(valueOrThrow(e.allocateCache(layout, makeKeys(keys), blocks_model)));
          },
          py::arg("layout"), py::arg("keys"), py::arg("blocks_model"), py::call_guard<py::gil_scoped_release>())
      .def(
          "deallocate_cache", [](Engine& e, int64_t id, bool blocks) { throwIfError(e.deallocateCache(id, blocks)); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "unregister_cache", [](Engine& e, int64_t id) { throwIfError(e.unregisterCache(id)); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "remove_cache_key",
          [](Engine& e, uint64_t req, uint64_t prefix, uint64_t model) {
            e.removeCacheKey(RequestKey{req, prefix, model});
          },
          py::call_guard<py::gil_scoped_release>());
}

// Engine's transfers: pulls, pushes, prepared transfers, descriptor lists, local copies.
void defTransfers(py::class_<Engine>& cls) {
  cls.def(
         "pull", [](Engine& e, const TransferSpec& spec) { throwIfError(e.pull(spec)); }, py::arg("spec"),
         py::call_guard<py::gil_scoped_release>())
      .def(
          "push", [](Engine& e, const TransferSpec& spec) { throwIfError(e.push(spec)); }, py::arg("spec"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "prepare",
          [](Engine& e, const TransferSpec& spec, uint64_t block_size, uint64_t remote_base, uint64_t remote_bytes,
             const BlockMapping& mapping) {
            Result<std::shared_ptr<PreparedTransfer>> r = Status(Code::kFailed, "");
            {
              py::gil_scoped_release unlocked;
              r = e.prepare(spec, block_size, remote_base, remote_bytes, mapping);
            }
            return BoundPrepared{&e, valueOrThrow(std::move(r))};
          },
          py::arg("spec"), py::arg("block_size") = 0, py::arg("remote_base") = 0, py::arg("remote_bytes") = 0,
          py::arg("mapping") = BlockMapping{}, py::keep_alive<0, 1>())
      .def(
          "describe_memory",
          [](Engine& e, uint64_t cluster_id, int64_t timeout_ms) {
            Result<wire::RawTable> r = Status(Code::kFailed, "");
            {
              py::gil_scoped_release unlocked;
              r = e.describeMemory(cluster_id, timeout_ms);
            }
            wire::RawTable t = valueOrThrow(std::move(r));
            std::vector<std::pair<uint64_t, uint64_t>> ranges;
            ranges.reserve(t.ranges.size());
            for (const wire::Run& run : t.ranges) ranges.emplace_back(run.offset, run.length);
            return py::make_tuple(t.generation, ranges);
          },
          py::arg("cluster_id"), py::arg("timeout_ms"))
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
             Placement src_placement, const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& runs) {
            std::vector<Engine::CopyRun> rs;
            for (auto& [d, s, n] : runs) rs.push_back({d, s, n});
            throwIfError(e.copyLocal(dst, dst_placement, src, src_placement, rs));
          },
          py::call_guard<py::gil_scoped_release>());
}

// Engine's KV handoffs (engine/offers.h): offers, claims, aborts, holds, their events. Records are
// plain tuples; pdlink.Engine wraps them.
void defHandoffs(py::class_<Engine>& cls) {
  cls.def(
         "offer",
         [](Engine& e, int64_t cache_id, std::vector<int64_t> blocks, const std::string& request_id, int64_t lease_ms) {
           OfferTicket t = valueOrThrow(e.offer(cache_id, std::move(blocks), request_id, lease_ms));
           return std::make_tuple(t.id, t.generation, t.lease_ms);
         },
         py::arg("cache_id"), py::arg("blocks"), py::arg("request_id"), py::arg("lease_ms"),
         py::call_guard<py::gil_scoped_release>())
      .def("release_offer", &Engine::releaseOffer, py::arg("offer_id"), py::call_guard<py::gil_scoped_release>())
      .def(
          "claim",
          [](Engine& e, uint64_t peer, uint64_t key, uint64_t offer_id, uint64_t generation,
             const std::string& request_id, int64_t local_cache_id, std::vector<int64_t> local_blocks,
             std::vector<int64_t> remote_blocks, int64_t timeout_ms, const CancelToken* cancel) {
            Engine::ClaimSpec c;
            c.peer = peer;
            c.key = key;
            c.offer_id = offer_id;
            c.generation = generation;
            c.request_id = request_id;
            c.local_cache_id = local_cache_id;
            c.local_blocks = std::move(local_blocks);
            c.remote_blocks = std::move(remote_blocks);
            c.timeout_ms = timeout_ms;
            c.cancel = cancel;
            throwIfError(e.claim(c));
          },
          py::arg("peer"), py::arg("key"), py::arg("offer_id"), py::arg("generation"), py::arg("request_id"),
          py::arg("local_cache_id"), py::arg("local_blocks"), py::arg("remote_blocks"), py::arg("timeout_ms"),
          py::arg("cancel") = nullptr, py::call_guard<py::gil_scoped_release>())
      .def(
          "abort",
          [](Engine& e, const std::string& request_id, std::optional<uint64_t> peer, const std::string& reason,
             int64_t timeout_ms) { throwIfError(e.abort(request_id, peer, reason, timeout_ms)); },
          py::arg("request_id"), py::arg("peer"), py::arg("reason"), py::arg("timeout_ms"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "hold",
          [](Engine& e, uint64_t peer, const std::vector<std::pair<uint64_t, uint64_t>>& offers, int64_t timeout_ms) {
            throwIfError(e.hold(peer, offers, timeout_ms));
          },
          py::arg("peer"), py::arg("offers"), py::arg("timeout_ms"), py::call_guard<py::gil_scoped_release>())
      // Both build the Python list from the records already taken, each string decoded with
      // replacement (utf8Text), so no record can make the call raise and lose the queue it emptied.
      .def("take_released",
           [](Engine& e) {
             const std::vector<ReleasedOffer> taken = e.takeReleased();
             py::list out;
             for (const ReleasedOffer& r : taken) {
               // peer: None for an offer never bound (a peer may link as any id, 0 included)
               const py::object peer = r.bound ? py::object(py::int_(r.peer)) : py::object(py::none());
               out.append(py::make_tuple(r.offer_id, messageText(r.request_id), offerReasonName(r.reason), peer));
             }
             return out;
           })
      .def("take_handoff_events",
           [](Engine& e) {
             const std::vector<PeerHandoffEvent> taken = e.takeHandoffEvents();
             py::list out;
             for (const PeerHandoffEvent& ev : taken) {
               out.append(
                   py::make_tuple(messageText(ev.kind), ev.peer, messageText(ev.request_id), messageText(ev.reason)));
             }
             return out;
           })
      .def(
          "take_finalized_offers",
          [](Engine& e, int64_t timeout_ms) {
            std::vector<std::pair<uint64_t, std::string>> out;
            for (const auto& [id, reason] : e.takeFinalizedOffers(timeout_ms)) {
              out.emplace_back(id, offerReasonName(reason));
            }
            return out;
          },
          py::arg("timeout_ms"), py::call_guard<py::gil_scoped_release>())
      .def("wake_handoffs", &Engine::wakeHandoffs);
}

}  // namespace

void bindEngine(py::module_& m) {
  py::class_<Engine> cls(m, "Engine");
  defLifetime(cls);
  defLinks(cls);
  defCaches(cls);
  defTransfers(cls);
  defHandoffs(cls);
}

}  // namespace pdlink::bindings
