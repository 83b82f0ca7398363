// pdlink._core, bound by the types it exposes: one bindX function per file, each called once by
// PYBIND11_MODULE (module.cc), in the order below (a class is bound before a default argument or a
// return value of its type is needed).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/engine.h"

namespace pdlink::bindings {

// bind_status.cc: the Status -> exception translator and _register_errors (status_bridge.h),
// Scope (core/status.h) and LinkResult.
void bindStatus(pybind11::module_& m);
// bind_types.cc: the module's constants (PROTOCOL_VERSION, LIMITS, ...), the engine's enums and
// plain structs (Role, EngineConfig, Target, TransferSpec, ...), what it reports of itself
// (LinkInfo, EngineStats, PoolInfo) and its cache handles (CacheHandle).
void bindConstants(pybind11::module_& m);
void bindTypes(pybind11::module_& m);
// bind_backend.cc: Backend, open_backend, and what this process's libraries provide (the Ascend
// and UCX loaders, libcrypto, the ptrace grant).
void bindBackend(pybind11::module_& m);
// bind_transfer.cc: PreparedTransfer, BatchTransfer and covers (descriptor checks).
void bindTransfers(pybind11::module_& m);
// bind_engine.cc: Engine.
void bindEngine(pybind11::module_& m);

// One peer's outcome of Engine.link or Engine.unlink (pdlink.LinkResult): the Status and the
// peer's cluster id (learned from the handshake for link; the id asked for with unlink; ANY_CLUSTER
// when never learned). Read-only in Python: status (LLMStatusCode), message, scope, peer_cluster_id,
// ok; check() raises the status's exception (the translator's) when it failed.
struct LinkResult {
  Status status;
  uint64_t peer_cluster_id;
};

// A cache the engine registered or allocated (Engine.register_cache, allocate_cache): its id and
// one address per tensor. Unpacks as (cache_id, addresses).
struct CacheHandle {
  int64_t cache_id;
  std::vector<uint64_t> addresses;
};

// A prepared transfer bound to the engine that posts it (the Python object keeps the engine alive).
struct BoundPrepared {
  Engine* engine;
  std::shared_ptr<PreparedTransfer> prepared;
  // local[i] <-> remote[i], block indices as int64 arrays or lists of ints.
  // `cancel` (null: none): the post's token (core/cancel.h).
  void post(pybind11::handle local, pybind11::handle remote, bool is_push, const CancelToken* cancel = nullptr);
};

// Descriptor lists to one peer (pdlink.Engine.batch): its request spec built once, each call one
// all-or-nothing request of lengths[i] bytes between local[i] (this engine's registered memory)
// and remote[i] (the peer's).
struct BoundBatch {
  Engine* engine;
  TransferSpec spec;  // a kRaw target, local_absolute, kExplicit
  void move(pybind11::handle local, pybind11::handle remote, pybind11::handle lengths, bool is_push, int64_t timeout_ms,
            const CancelToken* cancel = nullptr) const;
};

}  // namespace pdlink::bindings
