// The data-path conformance suite and unit tests of the path interface (transport/path.h), in one
// process over loopback: what every host path must do, run on each host path of the registration
// table (transport/path_table.h), the test build's own path (pipe_path.h, registered below) included.
//
// Usage: path_test [--transport NAME|all]   (a host path's name: pipe, cma, tcp; default all; cma is
//        skipped, with a message, where the kernel does not let this process read itself with
//        process_vm_readv)
// Paths the suite cannot link here are checked without a peer (their caps, their table lookup and
// when they apply): ucx needs the UCX library and a trusted network (ucx_test runs it), the device
// paths (ipc, hccl-one-sided, hccl) a device backend (docs/ascend.md).
// Conformance, per path: two linked CPU engines, P (cluster 1, listening) and D (cluster 2), their
// caches in guarded buffers (64 bytes of a fixed pattern before and after every tensor):
//   - the link reports the path's name (LinkInfo::transport);
//   - a pull of reversed, non-adjacent blocks, and a push back into another cache: the whole
//     destination is the old bytes with exactly those blocks replaced, every guard intact, the
//     source unchanged;
//   - a pull that names a block outside the peer's cache, a missing tensor, an unknown model, and
//     a push into a cache that is not remote accessible: refused with the exact code, nothing of
//     either side changed, and the link still moves exact bytes afterwards;
//   - a transfer of more pieces than one request may name (limits::kMaxRequestPieces) is split and
//     exact;
// and the interface's unit cases: every path's PathCaps, the table's lookup (exact flags, nothing
// for flags no path names or a path this engine does not serve) and its choice of a link's paths,
// and the IPC span / answer / copy helpers.
// Exit status 0 when every check passed, 1 otherwise (the failures are printed).
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
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

// Tensors of `bytes` each, with guard bytes before and after, filled with a seed's pattern.
struct Guarded {
  std::vector<std::vector<uint8_t>> mem;
  uint64_t bytes;
  Guarded(uint64_t b, uint64_t seed) : bytes(b) {
    for (uint32_t t = 0; t < kTensors; ++t) {
      std::vector<uint8_t> m(bytes + 2 * kGuard);
      for (uint64_t i = 0; i < kGuard; ++i) m[i] = m[kGuard + bytes + i] = guardByte(i);
      for (uint64_t i = 0; i < bytes; ++i) m[kGuard + i] = static_cast<uint8_t>((seed * 131 + t * 31 + i * 7) % 251);
      mem.push_back(std::move(m));
    }
  }
  std::vector<uint64_t> addrs() const {
    std::vector<uint64_t> a;
    for (const auto& m : mem) a.push_back(reinterpret_cast<uint64_t>(m.data() + kGuard));
    return a;
  }
  uint8_t* block(uint32_t t, uint64_t b) { return mem[t].data() + kGuard + b * kBlockBytes; }
};

// `dst` now equals `before` with blocks dst_blocks[i] replaced by src's src_blocks[i], guards and
// everything else unchanged.
void checkMoved(const Guarded& dst, const Guarded& before, const Guarded& src, const std::vector<int64_t>& src_blocks,
                const std::vector<int64_t>& dst_blocks, const std::string& what) {
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

bool same(const Guarded& a, const Guarded& b) { return a.mem == b.mem; }

CacheLayout blocksLayout(uint64_t blocks = kBlocks, uint64_t block_bytes = kBlockBytes) {
  CacheLayout L;
  L.num_tensors = kTensors;
  L.tensor_size = blocks * block_bytes;
  L.num_slots = blocks;
  L.is_blocks = true;
  return L;
}

std::unique_ptr<Engine> makeEngine(uint64_t id, bool listen, Transport transport) {
  EngineConfig c;
  c.cluster_id = id;
  if (listen) c.listen_ip = "127.0.0.1";
  c.sync_timeout_ms = kTimeoutMs;
  c.transport = transport;
  return testing::startEngine(c);
}

int64_t reg(Engine& e, const Guarded& g, const CacheLayout& L, std::optional<uint64_t> model, bool remote) {
  return testing::registerOrExit(e, L, g.addrs(), {}, model, remote);
}

// A pull or push of remote_blocks[i] of P's blocks cache `model` <-> local_blocks[i].
TransferSpec blocksSpec(int64_t local, uint64_t model, std::vector<int64_t> remote_blocks,
                        std::vector<int64_t> local_blocks) {
  return testing::blocksSpec(kP, model, local, std::move(local_blocks), std::move(remote_blocks));
}

// ---------------------------------------------------------------- conformance, one host path

void conformance(Transport transport, const char* name) {
  std::fprintf(stderr, "path %s\n", name);
  auto p = makeEngine(kP, true, transport), d = makeEngine(kD, false, transport);
  Guarded p_kv(kBlocks * kBlockBytes, 1), p_sink(kBlocks * kBlockBytes, 3), p_ro(kBlocks * kBlockBytes, 4);
  Guarded d_kv(kBlocks * kBlockBytes, 2);
  reg(*p, p_kv, blocksLayout(), 10, true);
  reg(*p, p_sink, blocksLayout(), 11, true);
  reg(*p, p_ro, blocksLayout(), 12, false);  // host memory, not remote accessible: no writes
  const int64_t d_id = reg(*d, d_kv, blocksLayout(), std::nullopt, true);
  auto linked = d->link({PeerAddress{kP, "127.0.0.1", p->listenPort()}}, kTimeoutMs);
  if (linked.size() != 1 || !linked[0].ok()) {
    check(false, std::string(name) + ": link: " + (linked.empty() ? "no status" : linked[0].toString()));
    return;
  }
  auto links = d->links();
  check(links.size() == 1 && links[0].transport == name,
        std::string(name) + ": the link reports " + (links.empty() ? "nothing" : links[0].transport));

  // a pull of reversed, non-adjacent blocks (nothing coalesces)
  const std::vector<int64_t> src{0, 2, 5, 9, 15}, dst{14, 11, 7, 3, 1};
  Guarded d_before = d_kv, p_before = p_kv;
  checkCode(d->pull(blocksSpec(d_id, 10, src, dst)), Code::kSuccess, std::string(name) + ": pull");
  checkMoved(d_kv, d_before, p_kv, src, dst, std::string(name) + ": pulled destination");
  check(same(p_kv, p_before), std::string(name) + ": the pull's source changed");

  // a push back into another cache of the peer
  Guarded sink_before = p_sink;
  d_before = d_kv;
  checkCode(d->push(blocksSpec(d_id, 11, dst, src)), Code::kSuccess, std::string(name) + ": push");
  checkMoved(p_sink, sink_before, d_kv, src, dst, std::string(name) + ": pushed destination");
  check(same(d_kv, d_before), std::string(name) + ": the push's source changed");

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
    Guarded d0 = d_kv, p0 = p_kv, s0 = p_sink, r0 = p_ro;
    Status st = r.push ? d->push(r.spec) : d->pull(r.spec);
    checkCode(st, r.code, std::string(name) + ": " + r.what);
    check(same(d_kv, d0) && same(p_kv, p0) && same(p_sink, s0) && same(p_ro, r0),
          std::string(name) + ": " + r.what + " changed memory");
  }
  d_before = d_kv;
  checkCode(d->pull(blocksSpec(d_id, 10, {4}, {4})), Code::kSuccess, std::string(name) + ": pull after refusals");
  checkMoved(d_kv, d_before, p_kv, {4}, {4}, std::string(name) + ": pull after refusals");

  // more pieces than one request may name: split, exact
  const uint64_t many = limits::kMaxRequestPieces / kTensors + 100, small = 8;
  Guarded p_many(many * small, 5), d_many(many * small, 6);
  reg(*p, p_many, blocksLayout(many, small), 13, true);
  const int64_t dm = reg(*d, d_many, blocksLayout(many, small), std::nullopt, true);
  std::vector<int64_t> every_other_src, every_other_dst;  // alternate blocks: no run coalesces
  for (uint64_t b = 0; b + 1 < many; b += 2) {
    every_other_src.push_back(static_cast<int64_t>(b));
    every_other_dst.push_back(static_cast<int64_t>(b + 1));
  }
  Guarded dm_before = d_many;
  checkCode(d->pull(blocksSpec(dm, 13, every_other_src, every_other_dst)), Code::kSuccess,
            std::string(name) + ": a split pull");
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
  check(exact, std::string(name) + ": a split pull moved the wrong bytes");
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

}  // namespace

int main(int argc, char** argv) {
  registerTestPath(testing::pipeEntry);  // the test build's path, ahead of every built-in one
  std::string which = "all";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--transport") which = argv[i + 1];
  }
  auto backend = makeCpuBackend();
  capsCases();
  tableCases(*backend);
  ipcCases();
  // Every host path of the table, linked the way that makes an engine pick it.
  const PathTable table(*backend, BackendOffer{});
  for (const PathEntry& e : table.entries()) {
    const std::string name = e.caps.name;
    if (e.caps.device_memory || (which != "all" && which != name)) continue;
    if (name == "pipe") {
      conformance(Transport::kAuto, "pipe");  // an in-process link under auto
    } else if (name == "tcp") {
      conformance(Transport::kTcp, "tcp");
    } else if (name == "cma" && cmaPermitted()) {
      conformance(Transport::kCma, "cma");
    } else if (name == "cma") {
      std::fprintf(stderr, "path cma: skipped (process_vm_readv of this process is not permitted here)\n");
    } else if (name == "ucx") {
      std::fprintf(stderr, "path ucx: caps and lookup only (a link needs UCX and a trusted network: ucx_test)\n");
    } else {
      check(false, "path " + name + ": no way to link over it in this suite");
    }
  }
  std::fprintf(stderr, failures ? "path_test: %d failure(s)\n" : "path_test: every check passed\n", failures);
  return failures ? 1 : 0;
}
