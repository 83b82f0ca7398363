// The registration table of the data paths (transport/path_table.h).
#include "transport/path_table.h"

#include <algorithm>

#include "transport/cma/cma_path.h"
#include "transport/device/hccl_path.h"
#include "transport/device/ipc_path.h"
#include "transport/tcp/stream_path.h"
#include "transport/ucx/ucx_path.h"

namespace pdlink {

namespace {
PathEntry (*test_path)() = nullptr;  // registerTestPath
}  // namespace

void registerTestPath(PathEntry (*make)()) { test_path = make; }

void registerPaths(std::vector<PathEntry>& table, Backend& backend, const BackendOffer& offer) {
  if (test_path) table.push_back(test_path());
  // host paths
  table.push_back(cmaEntry());
  table.push_back(ucxEntry());
  table.push_back(streamEntry(backend));
  // device paths
  table.push_back(ipcEntry(backend, offer));
  table.push_back(oneSidedEntry(offer));
  table.push_back(hcclEntry(offer));
}

PathTable::PathTable(Backend& backend, const BackendOffer& offer) { registerPaths(entries_, backend, offer); }

bool PathTable::names(uint8_t flags) const {
  for (const PathEntry& e : entries_) {
    if (e.caps.request_flags == flags) return true;
  }
  return false;
}

PathServer* PathTable::serverFor(uint8_t flags) const {
  for (const PathEntry& e : entries_) {
    if (e.caps.request_flags == flags) return e.server.get();
  }
  return nullptr;
}

void PathTable::setServer(uint8_t request_flags, std::unique_ptr<PathServer> server) {
  for (PathEntry& e : entries_) {
    if (e.caps.request_flags == request_flags) {
      e.server = std::move(server);
      return;
    }
  }
}

const PathEntry* PathTable::setupEntry(uint8_t path) const {
  for (const PathEntry& e : entries_) {
    if (e.caps.request_flags == path) return e.answer ? &e : nullptr;
  }
  return nullptr;
}

uint32_t PathTable::maxConnectBody() const {
  uint32_t most = 0;
  for (const PathEntry& e : entries_) {
    if (e.answer) most = std::max(most, e.max_connect_body);
  }
  return most;
}

ChosenPaths PathTable::choose(const LinkFacts& facts) const {
  ChosenPaths chosen;
  for (const PathEntry& e : entries_) {
    if (!e.applies(facts)) continue;
    if (e.caps.device_memory) {
      chosen.device.push_back(e.shared.get());
    } else if (!chosen.host) {
      chosen.host = e.make(facts);
    }
  }
  return chosen;
}

}  // namespace pdlink
