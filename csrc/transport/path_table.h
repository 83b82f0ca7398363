// The registration table of the data paths (transport/path.h): one ordered entry per path, saying
// what the path is, serving its requests, and, for a new link, whether it applies and what its
// requesting side is. The engine keeps one table (EngineState::paths) and asks it two things: which
// server a request's flags name (serverFor), and which paths a new link uses (choose). Each path's
// folder makes its own entry (e.g. cmaEntry, transport/cma/cma_path.h); registerPaths lists them,
// one line each, in the order they are tried.
//
// Threading: the table is filled before the engine serves or links anything; afterwards only
// setServer changes it, from Engine::initialize and finalize, while no link is served.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backends/backend.h"
#include "transport/cma/cma.h"
#include "transport/path.h"

namespace pdlink {

namespace ucx {
class UcxHub;  // transport/ucx/ucx_path.h
}  // namespace ucx

// What this engine's backend offers, read once from its capabilities.
struct BackendOffer {
  bool device_transport = false;  // device channels
  bool ipc = false;               // same-host DEVICE transfers by IPC (implies device_transport)
  bool one_sided = false;         // HCCL one-sided access (implies device_transport)
};

// What the handshake proved about one link, and what this engine offers on it: all a path looks
// at to say whether it applies to the link and to make the link's requesting side.
struct LinkFacts {
  bool same_host = false;    // the kernel proved the peer runs on this host (Link::sameHost)
  bool in_process = false;   // and it is this process (Link::inProcess)
  bool unix_socket = false;  // the link's channels are AF_UNIX connections
  // Direct access proven (the probe read of the peer's published words succeeded): the peer's
  // process and where its registry publishes. Null: no direct access on this link.
  std::shared_ptr<const cma::Process> direct;
  uint64_t published_addr = 0;
  // ucx is this link's host path (ucx::isPathOf: forced, or auto between hosts): the engine's UCX
  // workers. Null: not ucx.
  std::shared_ptr<ucx::UcxHub> ucx;
  bool auto_transport = false;    // the engine's transport is auto (not forced)
  bool config_one_sided = false;  // the engine's configuration enables one-sided access
  BackendOffer offer;
};

// One path of the table.
struct PathEntry {
  PathCaps caps;  // what the path is; caps.request_flags are the flags of the requests it serves
  // Serves the requests whose path bits equal caps.request_flags; null where this engine or its
  // backend cannot serve the path (its requests are then never dispatched).
  std::unique_ptr<PathServer> server;
  // Whether the path applies to a link with these facts.
  bool (*applies)(const LinkFacts&) = nullptr;
  // A host path (not caps.device_memory): the link's own requesting side, owned by the link.
  std::unique_ptr<DataPath> (*make)(const LinkFacts&) = nullptr;
  // A device path: the one requesting side every link shares (links hold it by pointer, and a
  // path that drops itself from a link is recognised by it: Link::dropDevicePath).
  std::unique_ptr<DataPath> shared;
  // How the peer sets this path up on a link (its DataPath::connect), where the path needs that: a
  // wire::Op::kPathConnect frame whose header names this entry by caps.request_flags, and whose
  // setup body (the rest) is at most max_connect_body bytes (a larger one drops the link:
  // "oversized <connect_what> request"; nothing of it is read). `answer` serves it on the link's
  // serving thread with the setup body read and its frame checked, whether or not this engine has
  // the path's server: where the path cannot be set up here it answers a refusal. A refusal is
  // answered and the link kept; non-OK drops the link. An entry without `answer` has no setup
  // frame: a kPathConnect naming it drops the link, as one naming no entry does. Paths that share
  // one setup (the two HCCL paths, one device channel) name it on one entry. Adding a path with a
  // setup frame takes no new op: its entry sets these three.
  uint32_t max_connect_body = 0;
  const char* connect_what = "";
  Status (*answer)(const PathEntry& self, Link& link, Stream& s, const std::string& body, const PathEnv& env,
                   Deadline deadline) = nullptr;
};

// What a new link uses: its host path, and its device paths in the order they are tried.
struct ChosenPaths {
  std::unique_ptr<DataPath> host;
  std::vector<DataPath*> device;
};

class PathTable {
 public:
  // Every path of registerPaths, in its order.
  PathTable(Backend& backend, const BackendOffer& offer);
  // Whether an entry's request_flags equal `flags` (served here or not).
  bool names(uint8_t flags) const;
  // The server of the entry whose request_flags equal `flags` exactly; null when there is none or
  // it has no server (the caller refuses the request). `flags` come from the peer: nothing else
  // decides which server runs.
  PathServer* serverFor(uint8_t flags) const;
  // Replaces the server of the entry with these request_flags (one that exists only while the
  // engine is initialised: ucx). Not while links are served.
  void setServer(uint8_t request_flags, std::unique_ptr<PathServer> server);
  // The first applicable host entry's path, then every applicable device entry's, in table order.
  // Some host entry applies to every link (the stream).
  ChosenPaths choose(const LinkFacts& facts) const;
  // The entry a kPathConnect header names (`path`: its caps.request_flags) when it has a setup frame
  // (an answer); null otherwise (the caller drops the link). `path` comes from the peer.
  const PathEntry* setupEntry(uint8_t path) const;
  // The largest max_connect_body of the entries with a setup frame: no kPathConnect body is longer
  // than this plus its header.
  uint32_t maxConnectBody() const;
  const std::vector<PathEntry>& entries() const { return entries_; }

 private:
  std::vector<PathEntry> entries_;
};

// The registration list: each path's entry, one line each, in the order they are tried (host paths:
// the first applicable one; device paths: every applicable one, in order).
void registerPaths(std::vector<PathEntry>& table, Backend& backend, const BackendOffer& offer);
// Registers the path of a test build (its request_flags: wire::kFlagTestPath), tried first by every
// PathTable made afterwards; the one line a test program adds (csrc/tests/path_test.cc). Not
// thread-safe: call before any engine exists. Without it no engine names kFlagTestPath.
void registerTestPath(PathEntry (*make)());

}  // namespace pdlink
