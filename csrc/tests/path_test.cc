// The data-path conformance suite and unit tests of the path interface (transport/path.h), in one
// process over loopback: what every data path must do, run on every path of the registration table
// (transport/path_table.h), the test build's own path (pipe_path.h, registered below) included.
//
// Usage: path_test [--transport NAME|all] [--require ucx|device]... [--ascend-lib DIR]
//   --transport   one path of the table (pipe, cma, ucx, tcp, ipc, hccl-one-sided, hccl); default all.
//   --require     a path group that must run: `ucx` (CI's ucx job) fails when libucp does not load,
//                 `device` (CI's sanitizer runs) fails when the fake Ascend libraries are not given
//                 or do not load; without it such a path prints "path NAME: skipped: <why>".
//   --ascend-lib  the fake Ascend libraries' directory (tests/fake_ascend: `python3
//                 tests/fake_ascend/build.py` prints it); sets PDLINK_ASCEND_LIB_DIR, which the
//                 core loads them from. Either gives the device paths their runtime.
// Where each path runs:
//   - pipe, tcp: always; cma where the kernel lets this process read itself (process_vm_readv),
//     else skipped;
//   - ucx: where libucp loads (PDLINK_UCX_LIB_DIR, the loader path: transport/ucx/ucp_api.h), on
//     engines with Transport::kUcx and ucx_trusted_network (both engines are this process); UCX_TLS
//     must name a network transport (or be unset): an engine refuses kUcx otherwise;
//   - ipc, hccl-one-sided, hccl: on the Ascend backend over the FAKE libraries only (they must
//     export fake_acl_peek/poke and fake_ascend_calls; real CANN is never used here), P on device
//     0 and D on device 1 (FAKE_ASCEND_DEVICE_COUNT must leave 2), their caches in DEVICE memory,
//     read and written through the fakes' peek/poke, not the backend under test. ipc: a link under
//     Transport::kAuto (same host); hccl-one-sided: Transport::kTcp with one_sided on both engines;
//     hccl: Transport::kTcp. The fakes' call counters prove the path: each pull and push calls the
//     path's own vendor function (aclrtIpcMemImportByKey; HcclBatchGet / HcclBatchPut;
//     HcclBatchSendRecv) and none of the other paths'. HCCL_EXEC_TIMEOUT and HCCL_CONNECT_TIMEOUT
//     default to 10 s and 20 s here (the fakes' 120 s unless the environment sets them).
// Conformance, per path: two linked engines, P (cluster 1, listening) and D (cluster 2), their
// caches guarded (64 bytes of a fixed pattern before and after every tensor), every cache
// registered before the link (one-sided access reaches only memory registered before it):
//   - the link reports its host path's name (LinkInfo::transport: the path itself, or for a device
//     path the host path its link runs beside) and its device paths in the order tried;
//   - a pull of reversed, non-adjacent blocks, and a push back into another cache: the whole
//     destination is the old bytes with exactly those blocks replaced, every guard intact, the
//     source unchanged;
//   - a pull that names a block outside the peer's cache, a missing tensor, an unknown model, and
//     a push into a cache that is not remote accessible: refused with the exact code, nothing of
//     either side changed, and the link still moves exact bytes afterwards;
//   - a transfer of more pieces than one request may name (limits::kMaxRequestPieces) is split and
//     exact;
//   - device paths: a fault of the path's vendor call (fake_ascend_inject, once) fails the pull with
//     its exact code (ipc: the requester's import refused, kParamInvalid, the link kept; HCCL:
//     kLinkFailed, the link broken), the faulted call counted as made, nothing of either side
//     changed; the link, relinked where the fault broke it, then moves exact bytes again;
// and the interface's unit cases: every path's PathCaps, the table's lookup (exact flags, nothing
// for flags no path names or a path this engine does not serve) and its choice of a link's paths,
// and the IPC span / answer / copy helpers.
// Exit status 0 when every check passed, 1 otherwise (the failures are printed).
#include <dlfcn.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "core/limits.h"
#include "engine/engine.h"
#include "transport/path.h"
#include "transport/path_table.h"
#include "transport/cma/cma.h"
#include "transport/cma/cma_path.h"
#include "transport/device/device_channel.h"
#include "transport/device/hccl_path.h"
#include "transport/device/ipc_path.h"
#include "transport/tcp/stream_path.h"
#include "transport/ucx/ucp_api.h"
#include "transport/ucx/ucx_path.h"
#include "pipe_path.h"
#include "test_engines.h"

using namespace pdlink;
using testing::check;
using testing::checkCode;
using testing::failures;

namespace {

constexpr uint64_t kP = 1, kD = 2;
constexpr uint32_t kTensors = 2;
constexpr uint64_t kBlocks = 16, kBlockBytes = 256;
constexpr uint64_t kGuard = 64;
constexpr int64_t kTimeoutMs = 20000;  // generous: sanitizers slow everything down

uint8_t guardByte(uint64_t i) { return static_cast<uint8_t>(0xA5 ^ (i * 29)); }

// The fake Ascend libraries' test hooks (tests/fake_ascend/fake_control.h), found in the
// libascendcl.so the core loaded: byte access to DEVICE memory that bypasses the backend under
// test, the vendor call counters, and fault injection.
struct Fakes {
  int (*peek)(const void*, void*, size_t) = nullptr;
  int (*poke)(void*, const void*, size_t) = nullptr;
  long (*calls)(const char*) = nullptr;
  int (*inject)(const char*, int, int, int) = nullptr;
};

// DEVICE memory of one backend, one allocation per tensor, released with the last Guarded that
// holds it.
struct DeviceTensors {
  std::shared_ptr<Backend> backend;
  const Fakes* fakes = nullptr;
  std::vector<void*> ptrs;
  uint64_t each = 0;
  ~DeviceTensors() {
    for (void* p : ptrs) backend->release(Placement::kDevice, p, each);
  }
};

// Where a Guarded's tensors live: host memory (no backend), or DEVICE memory of `backend`.
struct Place {
  std::shared_ptr<Backend> backend;
  const Fakes* fakes = nullptr;
};

// Tensors of `bytes` each, with guard bytes before and after, filled with a seed's pattern. Host
// tensors are `mem` itself; device tensors are mirrored in `mem`: refresh() reads them into it, and
// snap() gives a host copy of what they hold now (a snapshot: no memory of its own).
struct Guarded {
  std::vector<std::vector<uint8_t>> mem;
  uint64_t bytes;
  std::shared_ptr<DeviceTensors> dev;  // null: host memory
  Guarded(uint64_t b, uint64_t seed, const Place& place = {}) : bytes(b) {
    for (uint32_t t = 0; t < kTensors; ++t) {
      std::vector<uint8_t> m(bytes + 2 * kGuard);
      for (uint64_t i = 0; i < kGuard; ++i) m[i] = m[kGuard + bytes + i] = guardByte(i);
      for (uint64_t i = 0; i < bytes; ++i) m[kGuard + i] = static_cast<uint8_t>((seed * 131 + t * 31 + i * 7) % 251);
      mem.push_back(std::move(m));
    }
    if (!place.backend) return;
    dev = std::make_shared<DeviceTensors>();
    dev->backend = place.backend;
    dev->fakes = place.fakes;
    dev->each = bytes + 2 * kGuard;
    for (uint32_t t = 0; t < kTensors; ++t) {
      auto r = place.backend->allocate(Placement::kDevice, dev->each);
      if (!r.ok() || place.fakes->poke(r.value(), mem[t].data(), dev->each) != 0) {
        std::fprintf(stderr, "FAIL: device memory of %llu bytes: %s\n", static_cast<unsigned long long>(dev->each),
                     r.ok() ? "fake_acl_poke failed" : r.status().toString().c_str());
        std::exit(1);
      }
      dev->ptrs.push_back(r.value());
    }
  }
  std::vector<uint64_t> addrs() const {
    std::vector<uint64_t> a;
    for (uint32_t t = 0; t < kTensors; ++t) {
      a.push_back(
          reinterpret_cast<uint64_t>(dev ? static_cast<uint8_t*>(dev->ptrs[t]) + kGuard : mem[t].data() + kGuard));
    }
    return a;
  }
  void refresh() {
    if (!dev) return;
    for (uint32_t t = 0; t < kTensors; ++t) {
      if (dev->fakes->peek(dev->ptrs[t], mem[t].data(), mem[t].size()) != 0) {
        testing::check(false, "fake_acl_peek of a device tensor");
      }
    }
  }
  Guarded snap() {
    refresh();
    Guarded copy = *this;
    copy.dev = nullptr;
    return copy;
  }
  uint8_t* block(uint32_t t, uint64_t b) { return mem[t].data() + kGuard + b * kBlockBytes; }
};

// `dst` (read now) equals `before` with blocks dst_blocks[i] replaced by src's src_blocks[i],
// guards and everything else unchanged.
void checkMoved(Guarded& dst, const Guarded& before, Guarded& src, const std::vector<int64_t>& src_blocks,
                const std::vector<int64_t>& dst_blocks, const std::string& what) {
  dst.refresh();
  src.refresh();
  Guarded expected = before;
  for (uint32_t t = 0; t < kTensors; ++t) {
    for (size_t i = 0; i < src_blocks.size(); ++i) {
      std::memcpy(expected.block(t, dst_blocks[i]), src.mem[t].data() + kGuard + src_blocks[i] * kBlockBytes,
                  kBlockBytes);
    }
    for (uint64_t i = 0; i < dst.mem[t].size(); ++i) {
      if (dst.mem[t][i] != expected.mem[t][i]) {
        const bool guard = i < kGuard || i >= kGuard + dst.bytes;
        check(false, what + ": tensor " + std::to_string(t) + (guard ? " guard byte " : " byte ") + std::to_string(i) +
                         " differs");
        break;
      }
    }
  }
}

// `a`, read now, holds exactly the bytes of the snapshot `b`.
bool same(Guarded& a, const Guarded& b) {
  a.refresh();
  return a.mem == b.mem;
}

CacheLayout blocksLayout(uint64_t blocks = kBlocks, uint64_t block_bytes = kBlockBytes) {
  CacheLayout L;
  L.num_tensors = kTensors;
  L.tensor_size = blocks * block_bytes;
  L.num_slots = blocks;
  L.is_blocks = true;
  return L;
}

// How one path is run: its engines' configuration and memory, and how to tell it moved the bytes.
struct PathRun {
  std::string name;                       // the path (PathCaps::name)
  std::string link_name;                  // what LinkInfo::transport reports for the link
  std::vector<std::string> device_paths;  // and LinkInfo::device_paths
  Transport transport = Transport::kAuto;
  bool one_sided = false;
  bool ucx_trusted = false;
  // The tcp path over several streams: EngineLimits::tcp_streams and tcp_chunk_bytes of both engines
  // (0: the defaults), and what the dialler's link then reports as its lanes after the split pull.
  uint32_t tcp_streams = 0;
  uint64_t tcp_chunk_bytes = 0;
  std::vector<std::string> lanes_after_split;
  // Device paths: each engine's backend (P on device 0, D on device 1) and the fakes' hooks; null
  // for host paths (CPU backends, host memory).
  std::shared_ptr<Backend> p_backend, d_backend;
  const Fakes* fakes = nullptr;
  // Device paths: the vendor call a pull and a push of this path make (and no other device path
  // makes), and the error code a fault of it returns.
  const char* pull_call = nullptr;
  const char* push_call = nullptr;
  int fault_rc = 0;
  Code fault_code = Code::kSuccess;  // what the pull that meets the fault returns
  bool fault_breaks = false;         // and whether it breaks the link (a device channel's failure does)
};

std::unique_ptr<Engine> makeEngine(uint64_t id, bool listen, const PathRun& run) {
  EngineConfig c;
  c.cluster_id = id;
  if (listen) c.listen_ip = "127.0.0.1";
  c.sync_timeout_ms = kTimeoutMs;
  c.transport = run.transport;
  c.one_sided = run.one_sided;
  c.ucx_trusted_network = run.ucx_trusted;
  if (run.tcp_streams) c.limits.tcp_streams = run.tcp_streams;
  if (run.tcp_chunk_bytes) c.limits.tcp_chunk_bytes = run.tcp_chunk_bytes;
  std::shared_ptr<Backend> backend = id == kP ? run.p_backend : run.d_backend;
  if (!backend) return testing::startEngine(c);
  auto e = std::make_unique<Engine>(backend);
  Status st = e->initialize(c);
  if (!st.ok()) {
    check(false, run.name + ": initialize engine " + std::to_string(id) + ": " + st.toString());
    return nullptr;
  }
  return e;
}

int64_t reg(Engine& e, const Guarded& g, const CacheLayout& L, std::optional<uint64_t> model, bool remote) {
  return testing::registerOrExit(e, L, g.addrs(), {}, model, remote);
}

// A pull or push of remote_blocks[i] of P's blocks cache `model` <-> local_blocks[i].
TransferSpec blocksSpec(int64_t local, uint64_t model, std::vector<int64_t> remote_blocks,
                        std::vector<int64_t> local_blocks) {
  return testing::blocksSpec(kP, model, local, std::move(local_blocks), std::move(remote_blocks));
}

// The device paths' own vendor calls: a transfer over one path makes its own and none of the others.
const char* const kPathCalls[] = {"aclrtIpcMemImportByKey", "HcclBatchGet", "HcclBatchPut", "HcclBatchSendRecv"};

struct CallCounts {
  std::vector<long> n;
};

CallCounts countCalls(const PathRun& run) {
  CallCounts c;
  if (run.fakes) {
    for (const char* fn : kPathCalls) c.n.push_back(run.fakes->calls(fn));
  }
  return c;
}

// Since `before`: `own` was called (a device path) and no other path's call was.
void checkPathCalls(const PathRun& run, const CallCounts& before, const char* own, const std::string& what) {
  if (!run.fakes) return;
  const CallCounts now = countCalls(run);
  for (size_t i = 0; i < now.n.size(); ++i) {
    const bool mine = std::string(kPathCalls[i]) == own;
    const long delta = now.n[i] - before.n[i];
    check(mine ? delta > 0 : delta == 0, run.name + ": " + what + " made " + std::to_string(delta) + " call(s) of " +
                                             kPathCalls[i] + (mine ? " (its own path's: expected some)" : ""));
  }
}

// Links D to P; false (a failure counted) when it cannot.
bool linkTo(Engine& d, Engine& p, const PathRun& run) {
  auto linked = d.link({PeerAddress{kP, "127.0.0.1", p.listenPort()}}, kTimeoutMs);
  if (linked.size() != 1 || !linked[0].ok()) {
    check(false, run.name + ": link: " + (linked.empty() ? "no status" : linked[0].toString()));
    return false;
  }
  return true;
}

// ---------------------------------------------------------------- conformance, one path

void conformance(const PathRun& run) {
  const std::string& name = run.name;
  std::fprintf(stderr, "path %s\n", name.c_str());
  auto p = makeEngine(kP, true, run), d = makeEngine(kD, false, run);
  if (!p || !d) return;
  const Place p_place{run.p_backend, run.fakes}, d_place{run.d_backend, run.fakes};
  Guarded p_kv(kBlocks * kBlockBytes, 1, p_place), p_sink(kBlocks * kBlockBytes, 3, p_place),
      p_ro(kBlocks * kBlockBytes, 4, p_place);
  Guarded d_kv(kBlocks * kBlockBytes, 2, d_place);
  reg(*p, p_kv, blocksLayout(), 10, true);
  reg(*p, p_sink, blocksLayout(), 11, true);
  reg(*p, p_ro, blocksLayout(), 12, false);  // not remote accessible: no writes
  const int64_t d_id = reg(*d, d_kv, blocksLayout(), std::nullopt, true);
  // for the split case below; registered before the link, as one-sided access needs
  const uint64_t many = limits::kMaxRequestPieces / kTensors + 100, small = 8;
  Guarded p_many(many * small, 5, p_place), d_many(many * small, 6, d_place);
  reg(*p, p_many, blocksLayout(many, small), 13, true);
  const int64_t dm = reg(*d, d_many, blocksLayout(many, small), std::nullopt, true);
  if (!linkTo(*d, *p, run)) return;
  auto links = d->links();
  check(links.size() == 1 && links[0].transport == run.link_name,
        name + ": the link reports " + (links.empty() ? "nothing" : links[0].transport) + ", not " + run.link_name);
  check(links.size() == 1 && links[0].device_paths == run.device_paths, name + ": the link's device paths");

  // a pull of reversed, non-adjacent blocks (nothing coalesces)
  const std::vector<int64_t> src{0, 2, 5, 9, 15}, dst{14, 11, 7, 3, 1};
  Guarded d_before = d_kv.snap(), p_before = p_kv.snap();
  CallCounts calls = countCalls(run);
  checkCode(d->pull(blocksSpec(d_id, 10, src, dst)), Code::kSuccess, name + ": pull");
  checkPathCalls(run, calls, run.pull_call, "a pull");
  checkMoved(d_kv, d_before, p_kv, src, dst, name + ": pulled destination");
  check(same(p_kv, p_before), name + ": the pull's source changed");

  // a push back into another cache of the peer
  Guarded sink_before = p_sink.snap();
  d_before = d_kv.snap();
  calls = countCalls(run);
  checkCode(d->push(blocksSpec(d_id, 11, dst, src)), Code::kSuccess, name + ": push");
  checkPathCalls(run, calls, run.push_call, "a push");
  checkMoved(p_sink, sink_before, d_kv, src, dst, name + ": pushed destination");
  check(same(d_kv, d_before), name + ": the push's source changed");

  // refusals: exact codes, nothing changed on either side, the link still usable
  struct Refused {
    const char* what;
    TransferSpec spec;
    bool push;
    Code code;
  };
  TransferSpec missing_tensor = blocksSpec(d_id, 10, {1}, {1});
  missing_tensor.local_tensors = {0};
  missing_tensor.remote_tensors = {7};
  const std::vector<Refused> refused{
      {"a block outside the peer's cache", blocksSpec(d_id, 10, {int64_t(kBlocks)}, {0}), false, Code::kParamInvalid},
      {"a missing tensor", missing_tensor, false, Code::kParamInvalid},
      {"an unknown model", blocksSpec(d_id, 99, {0}, {0}), false, Code::kKvCacheNotExist},
      {"a push into a cache that is not remote accessible", blocksSpec(d_id, 12, {0}, {0}), true, Code::kParamInvalid},
  };
  for (const Refused& r : refused) {
    Guarded d0 = d_kv.snap(), p0 = p_kv.snap(), s0 = p_sink.snap(), r0 = p_ro.snap();
    Status st = r.push ? d->push(r.spec) : d->pull(r.spec);
    checkCode(st, r.code, name + ": " + r.what);
    check(same(d_kv, d0) && same(p_kv, p0) && same(p_sink, s0) && same(p_ro, r0),
          name + ": " + r.what + " changed memory");
  }
  d_before = d_kv.snap();
  checkCode(d->pull(blocksSpec(d_id, 10, {4}, {4})), Code::kSuccess, name + ": pull after refusals");
  checkMoved(d_kv, d_before, p_kv, {4}, {4}, name + ": pull after refusals");

  // more pieces than one request may name: split, exact
  std::vector<int64_t> every_other_src, every_other_dst;  // alternate blocks: no run coalesces
  for (uint64_t b = 0; b + 1 < many; b += 2) {
    every_other_src.push_back(static_cast<int64_t>(b));
    every_other_dst.push_back(static_cast<int64_t>(b + 1));
  }
  Guarded dm_before = d_many.snap();
  checkCode(d->pull(blocksSpec(dm, 13, every_other_src, every_other_dst)), Code::kSuccess, name + ": a split pull");
  d_many.refresh();
  p_many.refresh();
  bool exact = true;
  for (uint32_t t = 0; t < kTensors && exact; ++t) {
    for (size_t i = 0; i < every_other_src.size() && exact; ++i) {
      exact = std::memcmp(d_many.mem[t].data() + kGuard + every_other_dst[i] * small,
                          p_many.mem[t].data() + kGuard + every_other_src[i] * small, small) == 0 &&
              std::memcmp(d_many.mem[t].data() + kGuard + every_other_src[i] * small,
                          dm_before.mem[t].data() + kGuard + every_other_src[i] * small, small) == 0;
    }
    exact = exact && std::memcmp(d_many.mem[t].data(), dm_before.mem[t].data(), kGuard) == 0 &&
            std::memcmp(d_many.mem[t].data() + kGuard + many * small, dm_before.mem[t].data() + kGuard + many * small,
                        kGuard) == 0;
  }
  check(exact, name + ": a split pull moved the wrong bytes");
  if (!run.lanes_after_split.empty()) {
    links = d->links();
    check(links.size() == 1 && links[0].lanes == run.lanes_after_split,
          name + ": the link's lanes after the split pull: " +
              (links.empty() ? "none" : std::to_string(links[0].lanes.size())));
    // and a push over the streams too: D's odd blocks (the pulled bytes) into P's odd blocks
    Guarded pm_before = p_many.snap();
    checkCode(d->push(blocksSpec(dm, 13, every_other_dst, every_other_dst)), Code::kSuccess, name + ": a split push");
    p_many.refresh();
    d_many.refresh();
    bool pushed = true;
    for (uint32_t t = 0; t < kTensors && pushed; ++t) {
      for (size_t i = 0; i < every_other_src.size() && pushed; ++i) {
        pushed = std::memcmp(p_many.mem[t].data() + kGuard + every_other_dst[i] * small,
                             d_many.mem[t].data() + kGuard + every_other_dst[i] * small, small) == 0 &&
                 std::memcmp(p_many.mem[t].data() + kGuard + every_other_src[i] * small,
                             pm_before.mem[t].data() + kGuard + every_other_src[i] * small, small) == 0;
      }
      pushed = pushed && std::memcmp(p_many.mem[t].data(), pm_before.mem[t].data(), kGuard) == 0 &&
               std::memcmp(p_many.mem[t].data() + kGuard + many * small,
                           pm_before.mem[t].data() + kGuard + many * small, kGuard) == 0;
    }
    check(pushed, name + ": a split push moved the wrong bytes");
  }

  // device paths: a fault of the path's own vendor call fails the pull and changes nothing; the
  // link (relinked when the fault broke it) then moves exact bytes again
  if (run.fakes) {
    d_before = d_kv.snap();
    p_before = p_kv.snap();
    const long faults_before = run.fakes->calls(run.pull_call);
    run.fakes->inject(run.pull_call, run.fault_rc, 0, 1);  // the next call fails, once
    Status st = d->pull(blocksSpec(d_id, 10, {6}, {6}));
    const long faults = run.fakes->calls(run.pull_call) - faults_before;
    run.fakes->inject(nullptr, 0, 0, 0);
    check(faults > 0, name + ": the injected fault of " + run.pull_call + " was never reached");
    checkCode(st, run.fault_code, name + ": a pull whose " + run.pull_call + " failed");
    check(same(d_kv, d_before) && same(p_kv, p_before), name + ": a failed pull changed memory");
    links = d->links();
    check(links.size() == 1 && links[0].broken == run.fault_breaks,
          name + (run.fault_breaks ? ": the fault left the link usable" : ": the fault broke the link"));
    if (run.fault_breaks) {
      auto unlinked = d->unlink({kP}, kTimeoutMs, true);
      check(unlinked.size() == 1 && unlinked[0].ok(), name + ": unlink after the fault");
      if (!linkTo(*d, *p, run)) return;
    }
    d_before = d_kv.snap();
    checkCode(d->pull(blocksSpec(d_id, 10, {6}, {6})), Code::kSuccess, name + ": a pull after the fault");
    checkMoved(d_kv, d_before, p_kv, {6}, {6}, name + ": a pull after the fault");
  }
  d->finalize();
  p->finalize();
}

// ---------------------------------------------------------------- unit cases of the interface

void capsCases() {
  struct Want {
    const char* name;
    const PathCaps& caps;
    uint8_t flags;
    bool cross_host, one_sided, device_memory, device_channel;
  };
  StreamPath tcp(false), unix_stream(true);
  CmaPath cma(nullptr, 0);  // capabilities only: no copies
  auto backend = makeCpuBackend();
  IpcPath ipc(*backend);
  HcclPath hccl;
  OneSidedPath one_sided;
  testing::PipePath pipe;
  const Want wants[] = {
      {"pipe", pipe.caps(), wire::kFlagTestPath, false, false, false, false},
      {"ucx", UcxPath::ucxCaps(), wire::kFlagUcx, true, false, false, false},
      {"tcp", tcp.caps(), 0, true, false, false, false},
      {"unix", unix_stream.caps(), 0, false, false, false, false},
      {"cma", cma.caps(), wire::kFlagDirect, false, true, false, false},
      {"ipc", ipc.caps(), wire::kFlagDevice | wire::kFlagDirect, false, true, true, false},
      {"hccl-one-sided", one_sided.caps(), wire::kFlagDevice | wire::kFlagOneSided, true, true, true, true},
      {"hccl", hccl.caps(), wire::kFlagDevice, true, false, true, true},
  };
  for (const Want& w : wants) {
    const PathCaps& c = w.caps;
    check(std::string(c.name) == w.name && c.request_flags == w.flags && c.cross_host == w.cross_host &&
              c.one_sided == w.one_sided && c.device_memory == w.device_memory && c.device_channel == w.device_channel,
          std::string("caps of ") + w.name);
    check((c.request_flags & wire::kFlagDevice) == (c.device_memory ? wire::kFlagDevice : 0),
          std::string(w.name) + ": device memory and kFlagDevice go together");
  }
}

std::vector<std::string> names(const std::vector<DataPath*>& paths) {
  std::vector<std::string> out;
  for (const DataPath* p : paths) out.push_back(p->caps().name);
  return out;
}

void tableCases(Backend& backend) {
  const PathTable cpu(backend, BackendOffer{}), device(backend, BackendOffer{true, true, true});
  const std::vector<std::string> order{"pipe", "cma", "ucx", "tcp", "ipc", "hccl-one-sided", "hccl"};
  check(cpu.entries().size() == order.size(), "the table has every registered path");
  for (size_t i = 0; i < cpu.entries().size() && i < order.size(); ++i) {
    const PathEntry& e = cpu.entries()[i];
    check(e.caps.name == order[i], "table entry " + std::to_string(i) + " is " + order[i] + ", not " + e.caps.name);
    check(cpu.names(e.caps.request_flags), std::string(e.caps.name) + ": its flags are named");
    check(cpu.serverFor(e.caps.request_flags) == e.server.get(), std::string(e.caps.name) + ": its flags find it");
    for (size_t j = 0; j < i; ++j) {
      check(cpu.entries()[j].caps.request_flags != e.caps.request_flags,
            std::string(e.caps.name) + ": flags of its own");
    }
    check((e.shared != nullptr) == e.caps.device_memory && (e.make != nullptr) == !e.caps.device_memory,
          std::string(e.caps.name) + ": a host path makes one per link, a device path is shared");
  }
  // Served on a CPU backend: the host paths but ucx (its server comes with an initialised engine's
  // UCX workers); on a device backend also every device path.
  for (const PathEntry& e : cpu.entries()) {
    const bool served = !e.caps.device_memory && e.caps.request_flags != wire::kFlagUcx;
    check((e.server != nullptr) == served, std::string(e.caps.name) + ": served on a CPU backend");
  }
  for (const PathEntry& e : device.entries()) {
    check((e.server != nullptr) == (e.caps.request_flags != wire::kFlagUcx),
          std::string(e.caps.name) + ": served on a device backend");
  }
  // Flags no path names: none, so no server (admitHeader drops the link).
  for (uint8_t flags : {uint8_t{wire::kFlagOneSided}, uint8_t{wire::kFlagDirect | wire::kFlagUcx},
                        uint8_t{wire::kFlagTestPath | wire::kFlagDirect}, uint8_t{0x80}}) {
    check(!device.names(flags) && device.serverFor(flags) == nullptr,
          "flags " + std::to_string(flags) + " name no path");
  }
  // kPathConnect headers name paths by their request flags, on every backend (a CPU backend's device
  // answer is its refusal): the device channel is the HCCL entry's (the one-sided entry shares it),
  // ucx connect ucx's, each with its own bound; every other id, an entry's without a setup frame or
  // none, names no setup (the link is dropped). The bound before the header is read is the largest.
  for (const PathTable* t : {&cpu, &device}) {
    const PathEntry* channel = t->setupEntry(device::kChannelPath);
    const PathEntry* ucx_connect = t->setupEntry(wire::kFlagUcx);
    check(channel && std::string(channel->caps.name) == "hccl" && channel->max_connect_body == 8192,
          "the device channel's setup is the HCCL entry's");
    check(ucx_connect && std::string(ucx_connect->caps.name) == "ucx" &&
              ucx_connect->max_connect_body == wire::kMaxUcxHelloBytes,
          "the ucx connect is the ucx entry's");
    check(t->maxConnectBody() == 8192, "the largest setup bound is the device channel's");
    for (int path = 0; path <= 255; ++path) {
      if (path == device::kChannelPath || path == wire::kFlagUcx) continue;
      check(t->setupEntry(static_cast<uint8_t>(path)) == nullptr,
            "path " + std::to_string(path) + " has no setup frame");
    }
  }
  // What a link gets: the first applicable host path, then every applicable device path in order.
  LinkFacts f;
  ChosenPaths c = cpu.choose(f);
  check(c.host && std::string(c.host->caps().name) == "tcp" && c.device.empty(), "a link between hosts: tcp only");
  f.same_host = f.unix_socket = true;
  c = cpu.choose(f);
  check(c.host && std::string(c.host->caps().name) == "unix", "a same-host link without direct access: unix");
  f.in_process = true;
  c = cpu.choose(f);
  check(c.host && std::string(c.host->caps().name) == "unix", "an in-process link under a forced transport: unix");
  f.auto_transport = true;
  c = cpu.choose(f);
  check(c.host && std::string(c.host->caps().name) == "pipe", "an in-process link under auto: the pipe path");
  f.offer = BackendOffer{true, true, true};
  f.config_one_sided = true;
  check(names(device.choose(f).device) == std::vector<std::string>{"ipc", "hccl-one-sided", "hccl"},
        "device paths on a same-host link: ipc, one-sided, two-sided");
  f.same_host = f.in_process = false;
  check(names(device.choose(f).device) == std::vector<std::string>{"hccl-one-sided", "hccl"},
        "device paths between hosts: one-sided, two-sided");
  f.config_one_sided = false;
  check(names(device.choose(f).device) == std::vector<std::string>{"hccl"},
        "device paths without one-sided in the configuration: two-sided");
  f.offer = BackendOffer{true, false, false};
  f.config_one_sided = f.same_host = true;
  check(names(device.choose(f).device) == std::vector<std::string>{"hccl"},
        "device paths where the runtime has neither IPC nor one-sided: two-sided");
}

void ipcCases() {
  const std::vector<wire::Run> runs{{4096, 512}, {0, 256}, {8192, 128}};
  const IpcSpan span = ipcSpan(runs);
  check(span.lo == 0 && span.length == 8320, "ipcSpan covers the first offset to the last end");
  check(ipcSpan({}).length == 0, "ipcSpan of no runs is empty");
  wire::IpcAnswer right, wrong;
  right.spans = {8320, 8320};
  wrong.spans = {8320, 8321};
  checkCode(checkIpcAnswer(right, runs), Code::kSuccess, "checkIpcAnswer of the right spans");
  checkCode(checkIpcAnswer(wrong, runs), Code::kLinkFailed, "checkIpcAnswer of a span one byte too long");
  const std::vector<wire::Run> local{{0, 512}, {512, 256}, {768, 128}};
  const auto copies = ipcCopies({1000000}, local, {5000000}, runs, false);
  check(copies.size() == 3 && copies[0].dst == 1000000 && copies[0].src == 5000000 + 4096 && copies[0].length == 512 &&
            copies[1].dst == 1000512 && copies[1].src == 5000000 && copies[2].src == 5000000 + 8192,
        "ipcCopies of a pull place every run inside the mapped span, from this side's own offsets");
  const auto pushes = ipcCopies({1000000}, local, {5000000}, runs, true);
  check(pushes.size() == 3 && pushes[0].src == 1000000 && pushes[0].dst == 5000000 + 4096,
        "ipcCopies of a push go the other way");
}

bool cmaPermitted() {
  uint64_t word = 42;
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) return false;
  auto process = cma::Process::open(fds[0], getpid(), getuid());
  ::close(fds[0]);
  ::close(fds[1]);
  if (!process.ok()) return false;
  auto r = process.value()->readWord(reinterpret_cast<uint64_t>(&word));
  return r.ok() && r.value() == 42;
}

// The fake Ascend libraries, loaded by the Ascend backend from PDLINK_ASCEND_LIB_DIR: their hooks,
// and the backends of devices 0 and 1; or why the device paths cannot run here.
struct DeviceSetup {
  Fakes fakes;
  std::shared_ptr<Backend> p_backend, d_backend;
  std::string why_not;  // empty: ready
};

DeviceSetup openFakes() {
  DeviceSetup s;
  const char* dir = std::getenv("PDLINK_ASCEND_LIB_DIR");
  if (!dir || !*dir) {
    s.why_not =
        "no fake Ascend libraries (--ascend-lib DIR or PDLINK_ASCEND_LIB_DIR; `python3 "
        "tests/fake_ascend/build.py` builds them and prints DIR)";
    return s;
  }
  // The fakes' own checks of a transfer that fails: seconds, not HCCL's default two minutes.
  setenv("HCCL_EXEC_TIMEOUT", "10", 0);
  setenv("HCCL_CONNECT_TIMEOUT", "20", 0);
  // Loaded first by this program, RTLD_LOCAL: the backend's own dlopen of the same file then finds
  // this one, whose hooks are the ones every engine's calls go through.
  const std::string acl = std::string(dir) + "/libascendcl.so";
  void* handle = ::dlopen(acl.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    s.why_not = std::string("cannot load ") + acl + ": " + ::dlerror();
    return s;
  }
  s.fakes.peek = reinterpret_cast<int (*)(const void*, void*, size_t)>(::dlsym(handle, "fake_acl_peek"));
  s.fakes.poke = reinterpret_cast<int (*)(void*, const void*, size_t)>(::dlsym(handle, "fake_acl_poke"));
  s.fakes.calls = reinterpret_cast<long (*)(const char*)>(::dlsym(handle, "fake_ascend_calls"));
  s.fakes.inject = reinterpret_cast<int (*)(const char*, int, int, int)>(::dlsym(handle, "fake_ascend_inject"));
  if (!s.fakes.peek || !s.fakes.poke || !s.fakes.calls || !s.fakes.inject) {
    s.why_not = acl + " is not the fake library (no fake_acl_peek/poke, fake_ascend_calls, fake_ascend_inject)";
    return s;
  }
  auto p = openBackend("ascend", 0), d = openBackend("ascend", 1);
  if (!p.ok() || !d.ok()) {
    s.why_not = "the Ascend backend on devices 0 and 1: " + (p.ok() ? d : p).status().toString();
    return s;
  }
  s.p_backend = p.value();
  s.d_backend = d.value();
  const Capabilities caps = s.p_backend->capabilities();
  for (const char* feature : {"ipc", "one_sided"}) {
    auto it = caps.features.find(feature);
    if (it == caps.features.end() || !it->second) {
      s.why_not = std::string("the fake runtime lacks ") + feature + " (not the \"full\" variant)";
      return s;
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  registerTestPath(testing::pipeEntry);  // the test build's path, ahead of every built-in one
  std::string which = "all";
  bool require_ucx = false, require_device = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--transport" && has_value) {
      which = argv[++i];
    } else if (arg == "--require" && has_value && std::string(argv[i + 1]) == "ucx") {
      require_ucx = true;
      ++i;
    } else if (arg == "--require" && has_value && std::string(argv[i + 1]) == "device") {
      require_device = true;
      ++i;
    } else if (arg == "--ascend-lib" && has_value) {
      setenv("PDLINK_ASCEND_LIB_DIR", argv[++i], 1);
    } else {
      std::fprintf(stderr, "usage: path_test [--transport NAME|all] [--require ucx|device]... [--ascend-lib DIR]\n");
      return 2;
    }
  }
  auto backend = makeCpuBackend();
  capsCases();
  tableCases(*backend);
  ipcCases();
  // Paths that cannot run here: a skip, or a failure where the run requires them.
  auto skipped = [](const std::string& name, bool required, const std::string& why) {
    if (required) {
      check(false, "path " + name + ": required but cannot run: " + why);
    } else {
      std::fprintf(stderr, "path %s: skipped: %s\n", name.c_str(), why.c_str());
    }
  };
  std::optional<DeviceSetup> device;  // opened when a device path is first asked for
  // Every path of the table, linked the way that makes an engine pick it.
  const PathTable table(*backend, BackendOffer{true, true, true});
  size_t ran = 0;
  for (const PathEntry& e : table.entries()) {
    const std::string name = e.caps.name;
    if (which != "all" && which != name) continue;
    ++ran;
    PathRun run;
    run.name = run.link_name = name;
    if (name == "pipe") {
      conformance(run);  // an in-process link under auto
    } else if (name == "tcp") {
      run.transport = Transport::kTcp;
      run.tcp_streams = 1;  // one stream: every transfer one request on the link's channel
      conformance(run);
      // four streams, in chunks of the smallest size: the split pull and push go over the lanes
      std::fprintf(stderr, "path tcp: 4 streams\n");
      run.tcp_streams = 4;
      run.tcp_chunk_bytes = limits::kMinTcpChunkBytes;
      run.lanes_after_split = {"tcp x4"};
      conformance(run);
    } else if (name == "cma" && cmaPermitted()) {
      run.transport = Transport::kCma;
      conformance(run);
    } else if (name == "cma") {
      skipped(name, false, "process_vm_readv of this process is not permitted here");
    } else if (name == "ucx") {
      auto api = ucx::load();
      if (!api.ok()) {
        skipped(name, require_ucx, api.status().message());
        continue;
      }
      run.transport = Transport::kUcx;
      run.ucx_trusted = true;  // both ends are this process
      conformance(run);
    } else if (e.caps.device_memory) {
      if (!device) device = openFakes();
      if (!device->why_not.empty()) {
        skipped(name, require_device, device->why_not);
        continue;
      }
      run.p_backend = device->p_backend;
      run.d_backend = device->d_backend;
      run.fakes = &device->fakes;
      if (name == "ipc") {
        run.link_name = "pipe";  // an in-process link under auto: the pipe path beside it
        run.device_paths = {"ipc", "hccl"};
        run.pull_call = run.push_call = "aclrtIpcMemImportByKey";
        run.fault_rc = 100000;  // ACL_ERROR_INVALID_PARAM: the requester's own call, refused
        run.fault_code = Code::kParamInvalid;
      } else if (name == "hccl-one-sided") {
        run.transport = Transport::kTcp;
        run.link_name = "tcp";
        run.one_sided = true;
        run.device_paths = {"hccl-one-sided", "hccl"};
        run.pull_call = "HcclBatchGet";
        run.push_call = "HcclBatchPut";
        run.fault_rc = 21;  // HCCL_E_REMOTE
        run.fault_code = Code::kLinkFailed;
        run.fault_breaks = true;
      } else if (name == "hccl") {
        run.transport = Transport::kTcp;
        run.link_name = "tcp";
        run.device_paths = {"hccl"};
        run.pull_call = run.push_call = "HcclBatchSendRecv";
        run.fault_rc = 21;  // the first of the two sides' calls fails; the other sees its peer's failure
        run.fault_code = Code::kLinkFailed;
        run.fault_breaks = true;
      } else {
        check(false, "path " + name + ": no way to link over this device path in this suite");
        continue;
      }
      conformance(run);
    } else {
      check(false, "path " + name + ": no way to link over it in this suite");
    }
  }
  check(ran > 0, "--transport " + which + " names no path of the table");
  std::fprintf(stderr, failures ? "path_test: %d failure(s)\n" : "path_test: every check passed\n", failures);
  return failures ? 1 : 0;
}
