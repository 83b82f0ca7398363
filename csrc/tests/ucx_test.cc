// The UCX building blocks (transport/ucx/ucx_worker.h) against the real libucp, in one process.
//
// Usage: ucx_test            (UCX_TLS as the environment sets it; CI runs it with tcp and sm,tcp)
// Needs libucp (PDLINK_UCX_LIB_DIR, or the loader path). Without it the program prints why and
// exits 0, unless PDLINK_REQUIRE_UCX=1 (CI's ucx job), where that is a failure.
// Checks:
//   - transportsFor: what a network-only worker may use, for each form of UCX_TLS;
//   - two workers, A and B: B maps two guarded buffers (one remote-writable, one not) and packs
//     their keys; A connects to B's address and unpacks them; reads and writes of non-adjacent
//     runs move exactly those bytes (the whole destination checked: everything else, and the
//     guards, unchanged; the source unchanged), with B's worker progressed from a thread that
//     sleeps on its event fd, as a serving side does;
//   - with UCX_TLS=tcp or sm,tcp: a write through a key of memory mapped read-only lands (UCX does
//     not enforce a key's protection there: pdlink packs keys only for memory peers may write);
//   - B's worker destroyed: A's next read fails (kLinkFailed or kTimeout) by its deadline;
//   - with shared memory alone (UCX_TLS=sm): a network worker cannot be made, and an endpoint is
//     refused with a message naming the fix (UCX cannot report a dead peer over shared memory).
// Exit status 0 when every check passed, 1 otherwise (the failures are printed).
#include <poll.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "transport/ucx/ucx_worker.h"
#include "test_engines.h"

using namespace pdlink;
using namespace pdlink::ucx;
using testing::check;
using testing::checkCode;

namespace {

constexpr size_t kGuard = 64;
constexpr size_t kBytes = 1 << 16;

// A buffer with kGuard pattern bytes on either side of kBytes of `seed`-derived data.
struct Guarded {
  std::vector<uint8_t> all;
  explicit Guarded(uint8_t seed) : all(kBytes + 2 * kGuard) {
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint8_t>(i * 31 + seed);
    for (size_t i = 0; i < kGuard; ++i) all[i] = all[all.size() - 1 - i] = 0xA5;
  }
  uint64_t data() { return reinterpret_cast<uint64_t>(all.data() + kGuard); }
};

// Every byte of `after` equals `before`, but the runs copied from `src` (offsets in data bytes).
void checkExact(const Guarded& before, const Guarded& after, const Guarded& src, const std::vector<RmaRun>& runs,
                uint64_t dst_base, uint64_t src_base, bool dst_is_local, const std::string& what) {
  std::vector<uint8_t> want = before.all;
  for (const RmaRun& r : runs) {
    uint64_t d = (dst_is_local ? r.local : r.remote) - dst_base;
    uint64_t s = (dst_is_local ? r.remote : r.local) - src_base;
    std::memcpy(want.data() + kGuard + d, src.all.data() + kGuard + s, r.length);
  }
  size_t wrong = 0;
  for (size_t i = 0; i < want.size(); ++i) wrong += want[i] != after.all[i];
  check(wrong == 0, what + ": " + std::to_string(wrong) + " bytes differ from the expected destination");
}

void testTransportsFor() {
  auto is = [](Result<std::string> r, const std::string& want, const std::string& what) {
    check(r.ok() && r.value() == want, what + ": got " + (r.ok() ? r.value() : r.status().message()));
  };
  is(transportsFor(Scope::kNetwork, nullptr), "^sm,self", "unset");
  is(transportsFor(Scope::kNetwork, "all"), "^sm,self", "all");
  is(transportsFor(Scope::kNetwork, "sm,tcp"), "tcp", "sm,tcp");
  is(transportsFor(Scope::kNetwork, "posix,cma,self,rc,tcp"), "rc,tcp", "members of sm");
  is(transportsFor(Scope::kNetwork, "^ud"), "^ud,sm,self", "an exclusion");
  is(transportsFor(Scope::kNetwork, "^sm"), "^sm,self", "an exclusion naming sm");
  is(transportsFor(Scope::kAny, "sm,tcp"), "sm,tcp", "any scope keeps it");
  checkCode(transportsFor(Scope::kNetwork, "sm,self").status(), Code::kFeatureNotEnabled, "only local transports");
}

// Progresses `w` whenever its event fd says so, until `stop`.
void serveLoop(UcxWorker* w, std::atomic<bool>* stop) {
  while (!stop->load()) {
    w->progress();
    if (!w->arm()) continue;  // events arrived meanwhile
    pollfd p{w->eventFd(), POLLIN, 0};
    ::poll(&p, 1, 50);
  }
}

void testMoves(Scope scope) {
  const std::string name = scope == Scope::kNetwork ? "network worker" : "any-transport worker";
  const char* tls = std::getenv("UCX_TLS");
  if (scope == Scope::kNetwork && !transportsFor(scope, tls).ok()) {
    checkCode(UcxWorker::open(scope).status(), Code::kFeatureNotEnabled, name + " with no network transport");
    return;
  }
  Result<std::unique_ptr<UcxWorker>> a = UcxWorker::open(scope);
  Result<std::unique_ptr<UcxWorker>> b = UcxWorker::open(scope);
  if (!a.ok() || !b.ok()) {
    check(false, name + ": open: " + (a.ok() ? b.status().message() : a.status().message()));
    return;
  }
  std::printf("  %s: UCX_TLS=%s, address %zu bytes\n", name.c_str(), a.value()->transports().c_str(),
              a.value()->address().size());
  Guarded source(1), sink(2), readonly(3), local(4);
  auto src_map = b.value()->map(source.data(), kBytes, false);
  auto sink_map = b.value()->map(sink.data(), kBytes, true);
  check(src_map.ok() && sink_map.ok(), name + ": map");
  if (!src_map.ok() || !sink_map.ok()) return;
  check(!src_map.value()->remoteWritable() && sink_map.value()->remoteWritable(), name + ": writability recorded");

  if (!transportsFor(Scope::kNetwork, tls).ok()) {
    // shared memory only: UCX cannot report a dead peer over it, and refuses the endpoint
    auto ep = a.value()->connect(b.value()->address());
    check(!ep.ok() && ep.status().message().find("tcp") != std::string::npos,
          name + ": an endpoint over shared memory alone is refused, naming the fix");
    return;
  }
  std::atomic<bool> stop{false};
  std::thread server(serveLoop, b.value().get(), &stop);
  {
    auto ep = a.value()->connect(b.value()->address());
    check(ep.ok(), name + ": connect");
    if (ep.ok()) {
      auto src_key = ep.value()->unpack(src_map.value()->packedKey());
      auto sink_key = ep.value()->unpack(sink_map.value()->packedKey());
      check(src_key.ok() && sink_key.ok(), name + ": unpack");
      if (src_key.ok() && sink_key.ok()) {
        // three non-adjacent runs, out of order, none aligned
        std::vector<RmaRun> reads = {{local.data() + 9000, source.data() + 100, 777},
                                     {local.data() + 5, source.data() + 40000, 4096},
                                     {local.data() + 30001, source.data() + 3, 12345}};
        Guarded local0 = local, source0 = source;
        Status st = ep.value()->rma(*src_key.value(), reads, false, Deadline::afterMs(5000));
        check(st.ok(), name + ": read: " + st.message());
        checkExact(local0, local, source0, reads, local.data(), source.data(), true, name + ": read destination");
        checkExact(source0, source, source0, {}, 0, 0, true, name + ": read source unchanged");

        std::vector<RmaRun> writes = {{local.data() + 100, sink.data() + 60000, 1000},
                                      {local.data() + 20000, sink.data() + 7, 8192}};
        Guarded sink0 = sink;
        local0 = local;
        st = ep.value()->rma(*sink_key.value(), writes, true, Deadline::afterMs(5000));
        check(st.ok(), name + ": write: " + st.message());
        checkExact(sink0, sink, local0, writes, sink.data(), local.data(), false, name + ": write destination");
        checkExact(local0, local, local0, {}, 0, 0, true, name + ": write source unchanged");
        // What pdlink's design rests on (docs/ucx.md, "Trust"): over tcp and shared memory UCX does
        // not enforce a key's protection, so a key packed for memory mapped read-only still lets
        // its holder write there. pdlink therefore packs keys only for memory peers may write.
        Guarded before_bad = source;
        std::vector<RmaRun> bad = {{local.data(), source.data(), 64}};
        st = ep.value()->rma(*src_key.value(), bad, true, Deadline::afterMs(3000));
        bool landed = st.ok() && before_bad.all != source.all;
        std::printf("  a write through a key of read-only memory: %s\n", landed ? "landed" : "refused");
        if (tls != nullptr && (std::string(tls) == "tcp" || std::string(tls) == "sm,tcp")) {
          check(landed, name + ": UCX now refuses a write through a read-only key over " + std::string(tls) +
                            ": docs/ucx.md's trust section can be relaxed");
        }
        src_key.value().reset();
        sink_key.value().reset();
      }
    }
  }
  stop = true;
  b.value()->signal();
  server.join();

  // The peer goes away: the next read fails by its deadline, with a link or timeout code.
  auto ep = a.value()->connect(b.value()->address());
  auto key = ep.ok() ? ep.value()->unpack(src_map.value()->packedKey()) : Status(Code::kFailed, "no endpoint");
  src_map.value().reset();
  sink_map.value().reset();
  b.value().reset();
  if (ep.ok() && key.ok()) {
    std::vector<RmaRun> one = {{local.data(), source.data(), 4096}};
    auto t0 = std::chrono::steady_clock::now();
    Status st = ep.value()->rma(*key.value(), one, false, Deadline::afterMs(2000));
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    check(st.code() == Code::kLinkFailed || st.code() == Code::kTimeout,
          name + ": a read from a destroyed worker: expected LINK_FAILED or TIMEOUT, got " + st.message());
    check(s < 10.0, name + ": a read from a destroyed worker returned after " + std::to_string(s) + " s");
    key.value().reset();
  }
}

}  // namespace

int main() {
  testTransportsFor();
  Result<const UcpApi*> api = load();
  if (!api.ok()) {
    const char* require = std::getenv("PDLINK_REQUIRE_UCX");
    if (require != nullptr && std::string(require) == "1") {
      check(false, "PDLINK_REQUIRE_UCX=1 and " + api.status().message());
    } else {
      std::printf("ucx_test: UCX checks not run: %s\n", api.status().message().c_str());
    }
  } else {
    std::printf("ucx_test: %s (UCX %s)\n", api.value()->library.c_str(), api.value()->version.c_str());
    testMoves(Scope::kNetwork);
    testMoves(Scope::kAny);
  }
  if (testing::failures) {
    std::printf("ucx_test: %d checks failed\n", testing::failures);
    return 1;
  }
  std::printf("ucx_test: all checks passed\n");
  return 0;
}
