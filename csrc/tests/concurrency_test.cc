// Concurrency and leak test of the engine, in one process, over loopback: engines linked to each
// other while several threads pull, push, link, unlink and change registrations at once. Every
// transfer checks its bytes and its status, so this is a functional test on its own; its purpose
// is to run under ThreadSanitizer (races, lock-order inversions) and under AddressSanitizer with
// LeakSanitizer (memory errors, leaks), which .ci/sanitizers.sh does.
//
// Usage: concurrency_test MODE [--transport auto|tcp|cma] [--secret S] [--integrity 0|1] [--seconds S]
//        [--cycles N]
//   stress  engines P (cluster 1, listening) and D (cluster 2) linked; for S seconds (default 10):
//           - 3 threads on D pull random block pairs from P's blocks cache, checking the bytes;
//           - 1 thread on D pushes blocks into P's sink cache and pulls them back, checking them;
//           - 1 thread on P allocates pool caches under fresh request keys (dropping the id at
//             once), 1 thread on D pulls each by its key, which releases it: the memory goes back
//             to the pool after the transfer, never during it;
//           - 1 thread on P registers and unregisters a prefix-keyed cache over and over while 1
//             thread on D pulls by that key (LLM_SUCCESS or LLM_KV_CACHE_NOT_EXIST only);
//           - 1 thread runs a third engine E (cluster 3) that links to P, pulls, pings, notifies
//             and unlinks (force and non-force in turn), while D re-links (LLM_ALREADY_LINK) and
//             lists links, and 1 thread on P takes the notifications as they come.
//           At the end P holds no keyed cache, it took every notification E sent, and every count
//           adds up.
//   cycles  N times (default 100): a fresh engine links to P, pulls, unlinks (force and non-force
//           in turn) and is finalized and destroyed. Afterwards P's open descriptors, threads,
//           links and caches are back at their starting values; LeakSanitizer checks memory at exit.
// Exit status 0 when every check passed, 1 otherwise (the failures are printed).
#include <dirent.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backends/backend.h"
#include "engine/engine.h"
#include "test_engines.h"

using namespace pdlink;

namespace {

constexpr uint64_t kP = 1, kD = 2, kE = 3;
constexpr uint64_t kBlocks = 16, kBlockBytes = 512;  // blocks caches: 16 blocks of 512 B per tensor
constexpr uint32_t kTensors = 2;
constexpr uint64_t kSlotBytes = 4096;  // keyed (contiguous) caches: 1 slot per tensor
constexpr uint64_t kPrefixId = 77;
constexpr int64_t kTimeoutMs = 20000;  // generous: sanitizers slow everything down

std::atomic<int> failures{0};
std::mutex print_mu;

void fail(const std::string& what) {
  std::lock_guard<std::mutex> lock(print_mu);
  std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  ++failures;
}

bool expectOk(const Status& st, const std::string& what) {
  if (st.ok()) return true;
  fail(what + ": " + st.toString());
  return false;
}

uint8_t pattern(uint64_t seed, uint32_t tensor, uint64_t offset) {
  return static_cast<uint8_t>((seed * 131 + tensor * 31 + offset * 7 + (offset >> 8)) % 251);
}

// Memory owned by the test, registered with an engine.
struct Buffers {
  std::vector<std::unique_ptr<uint8_t[]>> tensors;
  uint64_t bytes = 0;
  Buffers(uint32_t n, uint64_t size) : bytes(size) {
    for (uint32_t t = 0; t < n; ++t) tensors.emplace_back(new uint8_t[size]());
  }
  std::vector<uint64_t> addrs() const {
    std::vector<uint64_t> a;
    for (auto& t : tensors) a.push_back(reinterpret_cast<uint64_t>(t.get()));
    return a;
  }
  void fill(uint64_t seed) {
    for (uint32_t t = 0; t < tensors.size(); ++t) {
      for (uint64_t i = 0; i < bytes; ++i) tensors[t][i] = pattern(seed, t, i);
    }
  }
};

CacheLayout layout(uint64_t bytes, uint64_t slots, bool blocks) {
  CacheLayout L;
  L.num_tensors = kTensors;
  L.tensor_size = bytes;
  L.num_slots = slots;
  L.is_blocks = blocks;
  return L;
}

Transport transport = Transport::kAuto;
std::string secret;              // --secret: authenticated links (every frame sealed)
bool payload_integrity = false;  // --integrity 1: payloads sealed too

std::unique_ptr<Engine> makeEngine(uint64_t id, bool listen, uint64_t pool_bytes = 0) {
  EngineConfig c;
  c.cluster_id = id;
  if (listen) c.listen_ip = "127.0.0.1";
  c.sync_timeout_ms = kTimeoutMs;
  c.device_pool.bytes = pool_bytes;
  c.device_pool.page_shift = 12;
  c.transport = transport;
  c.link_secret = secret;
  c.payload_integrity = payload_integrity;
  return testing::startEngine(c);
}

int64_t registerOrDie(Engine& e, const CacheLayout& L, const Buffers& b, std::vector<RequestKey> keys,
                      std::optional<uint64_t> model, bool remote) {
  return testing::registerOrExit(e, L, b.addrs(), keys, model, remote);
}

Status linkTo(Engine& e, uint64_t peer, uint16_t port) {
  auto st = e.link({PeerAddress{peer, "127.0.0.1", port}}, kTimeoutMs);
  return st.empty() ? Status(Code::kFailed, "no status") : st[0];
}

using testing::blocksSpec;

TransferSpec keySpec(uint64_t peer, wire::TargetKind kind, uint64_t id, int64_t local) {
  TransferSpec s;
  s.peer_cluster_id = peer;
  s.target.kind = kind;
  (kind == wire::TargetKind::kRequestKey ? s.target.req_id : s.target.prefix_id) = id;
  s.local_cache_id = local;
  s.mode = TransferSpec::Mode::kSlotToSlot;
  return s;
}

// Block `lb` of `local` must equal block `rb` of a blocks cache filled with `seed`.
bool checkBlock(const Buffers& local, uint64_t lb, uint64_t seed, uint64_t rb, const std::string& what) {
  for (uint32_t t = 0; t < local.tensors.size(); ++t) {
    for (uint64_t i = 0; i < kBlockBytes; ++i) {
      if (local.tensors[t][lb * kBlockBytes + i] != pattern(seed, t, rb * kBlockBytes + i)) {
        fail(what + ": byte mismatch in tensor " + std::to_string(t) + ", block " + std::to_string(lb));
        return false;
      }
    }
  }
  return true;
}

bool checkSlot(const Buffers& local, uint64_t seed, uint64_t offset, const std::string& what) {
  for (uint32_t t = 0; t < local.tensors.size(); ++t) {
    for (uint64_t i = 0; i < kSlotBytes; ++i) {
      if (local.tensors[t][i] != pattern(seed, t, offset + i)) {
        fail(what + ": byte mismatch in tensor " + std::to_string(t) + " at " + std::to_string(i));
        return false;
      }
    }
  }
  return true;
}

int countEntries(const char* dir) {
  int n = 0;
  if (DIR* d = ::opendir(dir)) {
    while (struct dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
  }
  return n;
}

// ------------------------------------------------------------------------------------------ stress

int stress(int seconds) {
  auto P = makeEngine(kP, true, 4 << 20);
  auto D = makeEngine(kD, false);
  const uint16_t port = P->listenPort();
  if (!expectOk(linkTo(*D, kP, port), "link D -> P")) return 1;

  Buffers source(kTensors, kBlocks * kBlockBytes);  // P: published blocks, read only
  source.fill(1);
  registerOrDie(*P, layout(source.bytes, kBlocks, true), source, {}, 0, false);
  Buffers sink(kTensors, kBlocks * kBlockBytes);  // P: written by D's pusher
  registerOrDie(*P, layout(sink.bytes, kBlocks, true), sink, {}, 1, true);
  Buffers churned(kTensors, 2 * kSlotBytes);  // P: registered and unregistered over and over
  churned.fill(3);
  const size_t p_baseline = P->cacheCount();

  std::atomic<bool> stop{false};
  std::atomic<uint64_t> pulls{0}, pushes{0}, keyed{0}, prefixed{0}, prefix_absent{0}, relinks{0};
  std::atomic<uint64_t> notified{0}, taken{0};
  std::vector<std::thread> threads;

  for (int w = 0; w < 3; ++w) {  // pullers
    threads.emplace_back([&, w] {
      Buffers local(kTensors, kBlocks * kBlockBytes);
      int64_t id = registerOrDie(*D, layout(local.bytes, kBlocks, true), local, {}, std::nullopt, false);
      std::mt19937_64 rng(w);
      while (!stop) {
        std::vector<int64_t> lb, rb;
        const int n = 1 + rng() % 4;
        for (int i = 0; i < n; ++i) {
          lb.push_back(static_cast<int64_t>((w * 5 + i) % kBlocks));  // distinct local blocks
          rb.push_back(static_cast<int64_t>(rng() % kBlocks));
        }
        if (!expectOk(D->pull(blocksSpec(kP, 0, id, lb, rb)), "pull blocks")) return;
        for (int i = 0; i < n; ++i) {
          if (!checkBlock(local, lb[i], 1, rb[i], "pull blocks")) return;
        }
        ++pulls;
      }
    });
  }

  // Two threads post one prepared transfer (its generation re-checked as P's churn below changes
  // P's registry, and D's as the other threads register), each into its own local blocks.
  std::shared_ptr<PreparedTransfer> prepared;
  Buffers prepared_local(kTensors, kBlocks * kBlockBytes);
  {
    int64_t id =
        registerOrDie(*D, layout(prepared_local.bytes, kBlocks, true), prepared_local, {}, std::nullopt, false);
    auto r = D->prepare(blocksSpec(kP, 0, id, {}, {}), 0, 0, 0);
    if (!expectOk(r.status(), "prepare")) return 1;
    prepared = r.value();
  }
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937_64 rng(100 + w);
      while (!stop) {
        const int64_t lb[2] = {w * 8 + static_cast<int64_t>(rng() % 4), w * 8 + 4 + static_cast<int64_t>(rng() % 4)};
        const int64_t rb[2] = {static_cast<int64_t>(rng() % kBlocks), static_cast<int64_t>(rng() % kBlocks)};
        if (!expectOk(D->post(*prepared, lb, rb, 2, false), "post prepared")) return;
        if (!checkBlock(prepared_local, lb[0], 1, rb[0], "post prepared") ||
            !checkBlock(prepared_local, lb[1], 1, rb[1], "post prepared")) {
          return;
        }
        ++pulls;
      }
    });
  }

  threads.emplace_back([&] {  // pusher: push blocks, pull them back
    Buffers out(kTensors, kBlocks * kBlockBytes), back(kTensors, kBlocks * kBlockBytes);
    int64_t out_id = registerOrDie(*D, layout(out.bytes, kBlocks, true), out, {}, std::nullopt, false);
    int64_t back_id = registerOrDie(*D, layout(back.bytes, kBlocks, true), back, {}, std::nullopt, false);
    for (uint64_t round = 10; !stop; ++round) {
      out.fill(round);
      const int64_t b = static_cast<int64_t>(round % kBlocks);
      if (!expectOk(D->push(blocksSpec(kP, 1, out_id, {b, (b + 1) % 16}, {b, (b + 1) % 16})), "push")) return;
      if (!expectOk(D->pull(blocksSpec(kP, 1, back_id, {0, 1}, {b, (b + 1) % 16})), "pull pushed")) return;
      if (!checkBlock(back, 0, round, b, "push then pull") ||
          !checkBlock(back, 1, round, (b + 1) % 16, "push then pull")) {
        return;
      }
      ++pushes;
    }
  });

  std::mutex q_mu;
  std::condition_variable q_cv;
  std::deque<uint64_t> published;  // request ids whose caches P filled
  threads.emplace_back([&] {       // P: publish pool caches under fresh request keys
    for (uint64_t req = 1000; !stop; ++req) {
      {
        std::unique_lock<std::mutex> lock(q_mu);
        q_cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return published.size() < 4; });
        if (published.size() >= 4) continue;
      }
      RequestKey key;
      key.req_id = req;
      int64_t id = 0;
      {
        auto c = P->allocateCache(layout(kSlotBytes, 1, false), {key}, std::nullopt);
        if (!c.ok()) {
          fail("allocate keyed cache: " + c.status().toString());
          return;
        }
        for (uint32_t t = 0; t < kTensors; ++t) {
          uint8_t* mem = reinterpret_cast<uint8_t*>(c.value()->addrs[t]);
          for (uint64_t i = 0; i < kSlotBytes; ++i) mem[i] = pattern(req, t, i);
        }
        id = c.value()->id;
      }  // our reference to the entry is gone; the id reference goes next, the key keeps the memory
      expectOk(P->deallocateCache(id, false), "deallocate keyed cache");
      std::lock_guard<std::mutex> lock(q_mu);
      published.push_back(req);
      q_cv.notify_all();
    }
  });
  threads.emplace_back([&] {  // D: pull each published key (releasing it)
    Buffers local(kTensors, kSlotBytes);
    int64_t id = registerOrDie(*D, layout(kSlotBytes, 1, false), local, {}, std::nullopt, false);
    while (!stop) {
      uint64_t req = 0;
      {
        std::unique_lock<std::mutex> lock(q_mu);
        if (!q_cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return !published.empty(); })) continue;
        req = published.front();
        published.pop_front();
        q_cv.notify_all();
      }
      if (!expectOk(D->pull(keySpec(kP, wire::TargetKind::kRequestKey, req, id)), "pull by request key")) return;
      if (!checkSlot(local, req, 0, "pull by request key")) return;
      ++keyed;
    }
  });

  threads.emplace_back([&] {  // P: register / unregister a prefix-keyed cache
    RequestKey pad, key;
    key.prefix_id = kPrefixId;
    while (!stop) {
      int64_t id = registerOrDie(*P, layout(churned.bytes, 2, false), churned, {pad, key}, std::nullopt, false);
      std::this_thread::sleep_for(std::chrono::microseconds(500));
      expectOk(P->unregisterCache(id), "unregister");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  threads.emplace_back([&] {  // D: pull by that prefix key
    Buffers local(kTensors, kSlotBytes);
    int64_t id = registerOrDie(*D, layout(kSlotBytes, 1, false), local, {}, std::nullopt, false);
    while (!stop) {
      Status st = D->pull(keySpec(kP, wire::TargetKind::kPrefixKey, kPrefixId, id));
      if (st.code() == Code::kKvCacheNotExist) {
        ++prefix_absent;
        continue;
      }
      if (!expectOk(st, "pull by prefix key") || !checkSlot(local, 3, kSlotBytes, "pull by prefix key")) return;
      ++prefixed;
    }
  });

  threads.emplace_back([&] {  // E links, pulls, pings, unlinks; D re-links and lists links
    auto E = makeEngine(kE, false);
    Buffers local(kTensors, kBlocks * kBlockBytes);
    int64_t id = registerOrDie(*E, layout(local.bytes, kBlocks, true), local, {}, std::nullopt, false);
    for (int i = 0; !stop; ++i) {
      if (!expectOk(linkTo(*E, kP, port), "link E -> P")) return;
      if (!expectOk(E->pull(blocksSpec(kP, 0, id, {3, 4}, {7, 8})), "E pulls") ||
          !checkBlock(local, 3, 1, 7, "E pulls") || !checkBlock(local, 4, 1, 8, "E pulls")) {
        return;
      }
      if (!expectOk(E->ping(kP, kTimeoutMs), "E pings P")) return;
      if (!expectOk(E->notify(kP, "e", std::to_string(i), kTimeoutMs), "E notifies P")) return;
      ++notified;
      Status again = linkTo(*D, kP, port);
      if (again.code() != Code::kAlreadyLink) fail("D re-links: expected LLM_ALREADY_LINK, got " + again.toString());
      if (D->links().size() != 1) fail("D lists " + std::to_string(D->links().size()) + " links, expected 1");
      auto un = E->unlink({kP}, kTimeoutMs, i % 2 == 1);
      if (un.size() != 1 || !expectOk(un[0], "E unlinks")) return;
      ++relinks;
    }
  });

  threads.emplace_back([&] {  // P's application takes notifications while E sends them
    while (!stop) {
      for (const Notification& n : P->takeNotifications()) {
        if (n.peer != kE || n.name != "e") fail("P took a notification from " + std::to_string(n.peer));
        ++taken;
      }
      std::this_thread::yield();
    }
  });

  std::this_thread::sleep_for(std::chrono::seconds(seconds));
  stop = true;
  q_cv.notify_all();
  for (auto& t : threads) t.join();

  taken += P->takeNotifications().size();
  if (taken != notified) {
    fail("P took " + std::to_string(taken.load()) + " notifications, E sent " + std::to_string(notified.load()));
  }
  // Keys published but not pulled yet: take them, so that P ends with no keyed cache.
  Buffers local(kTensors, kSlotBytes);
  int64_t id = registerOrDie(*D, layout(kSlotBytes, 1, false), local, {}, std::nullopt, false);
  for (uint64_t req : published) {
    if (expectOk(D->pull(keySpec(kP, wire::TargetKind::kRequestKey, req, id)), "drain request key")) {
      checkSlot(local, req, 0, "drain request key");
    }
  }
  // The peer releases a key when the puller's commit frame arrives, just after the pull returns.
  for (int i = 0; i < 500 && P->cacheCount() != p_baseline; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (P->cacheCount() != p_baseline) {
    fail("P holds " + std::to_string(P->cacheCount()) + " caches after the run, expected " +
         std::to_string(p_baseline) + " (a keyed cache was not released)");
  }
  if (pulls == 0 || pushes == 0 || keyed == 0 || relinks == 0 || notified == 0 || prefixed + prefix_absent == 0) {
    fail("some thread made no progress");
  }
  std::printf(
      "stress: %llu block pulls, %llu push+pull rounds, %llu keyed pulls, %llu prefix pulls (%llu absent), "
      "%llu link cycles\n",
      static_cast<unsigned long long>(pulls.load()), static_cast<unsigned long long>(pushes.load()),
      static_cast<unsigned long long>(keyed.load()), static_cast<unsigned long long>(prefixed.load()),
      static_cast<unsigned long long>(prefix_absent.load()), static_cast<unsigned long long>(relinks.load()));
  D->finalize();
  P->finalize();
  return failures == 0 ? 0 : 1;
}

// ------------------------------------------------------------------------------------------ cycles

int cycles(int n) {
  auto P = makeEngine(kP, true, 1 << 20);
  Buffers source(kTensors, kBlocks * kBlockBytes);
  source.fill(1);
  registerOrDie(*P, layout(source.bytes, kBlocks, true), source, {}, 0, false);
  const uint16_t port = P->listenPort();
  const size_t caches = P->cacheCount();

  auto settle = [&](int fds, int threads) {  // serving threads and sockets go away asynchronously
    for (int i = 0; i < 200; ++i) {
      if (countEntries("/proc/self/fd") <= fds && countEntries("/proc/self/task") <= threads) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  };
  const int fds0 = countEntries("/proc/self/fd"), threads0 = countEntries("/proc/self/task");

  for (int i = 0; i < n && failures == 0; ++i) {
    auto E = makeEngine(kE, false, 1 << 20);
    Buffers local(kTensors, kBlocks * kBlockBytes);
    int64_t id = registerOrDie(*E, layout(local.bytes, kBlocks, true), local, {}, std::nullopt, false);
    if (!expectOk(linkTo(*E, kP, port), "cycle link")) break;
    if (expectOk(E->pull(blocksSpec(kP, 0, id, {0, 1, 5}, {2, 3, 9})), "cycle pull")) {
      checkBlock(local, 5, 1, 9, "cycle pull");
    }
    // An allocation the engine must free on finalize.
    if (!E->allocateCache(layout(kSlotBytes, 1, false), {}, std::nullopt).ok()) fail("cycle allocate");
    auto un = E->unlink({kP}, kTimeoutMs, i % 2 == 1);
    if (un.size() != 1) {
      fail("cycle unlink: expected one status");
    } else {
      expectOk(un[0], "cycle unlink");
    }
    E->finalize();
    E.reset();
  }
  // A force unlink leaves P a stale entry until the peer relinks; drop it as serving code would.
  for (const LinkInfo& l : P->links()) P->unlink({l.peer_cluster_id}, kTimeoutMs, true);
  if (!settle(fds0, threads0)) {
    fail("after " + std::to_string(n) + " cycles: " + std::to_string(countEntries("/proc/self/fd")) +
         " open descriptors (started with " + std::to_string(fds0) + "), " +
         std::to_string(countEntries("/proc/self/task")) + " threads (started with " + std::to_string(threads0) + ")");
  }
  if (!P->links().empty()) fail("P still lists links");
  if (P->cacheCount() != caches) fail("P's cache count changed");
  std::printf("cycles: %d link/pull/unlink cycles, descriptors %d -> %d, threads %d -> %d\n", n, fds0,
              countEntries("/proc/self/fd"), threads0, countEntries("/proc/self/task"));
  P->finalize();
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: %s stress|cycles [--transport auto|tcp|cma] [--secret S] [--integrity 0|1] [--seconds S] "
                 "[--cycles N]\n",
                 argv[0]);
    return 2;
  }
  std::string mode = argv[1];
  int seconds = 10, n = 100;
  for (int i = 2; i + 1 < argc; i += 2) {
    std::string opt = argv[i], val = argv[i + 1];
    if (opt == "--transport") {
      transport = val == "tcp" ? Transport::kTcp : val == "cma" ? Transport::kCma : Transport::kAuto;
    } else if (opt == "--secret") {
      secret = val;
    } else if (opt == "--integrity") {
      payload_integrity = val == "1";
    } else if (opt == "--seconds") {
      seconds = std::atoi(val.c_str());
    } else if (opt == "--cycles") {
      n = std::atoi(val.c_str());
    } else {
      std::fprintf(stderr, "unknown option %s\n", opt.c_str());
      return 2;
    }
  }
  int rc = mode == "stress" ? stress(seconds) : mode == "cycles" ? cycles(n) : 2;
  std::printf("%s: %s\n", mode.c_str(), rc == 0 ? "OK" : "FAILED");
  return rc;
}
