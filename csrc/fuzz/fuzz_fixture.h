// The fuzz target's world: the input layout (a selector byte, then the bytes for one decoder) and
// a small Registry of caches in real memory, shared by the fuzz target (wire_fuzz.cc) and the
// seed generator (make_seeds.cc) so that seeds address caches that exist.
//
// Caches, in registration order (ids 1..5):
//   1 A  registered contiguous, 2 tensors x 256 B, 4 slots (stride 64); keys: slot 0 req (1, m0),
//        slot 1 prefix (2, m0), slot 2 padding, slot 3 req (3, m1) + prefix (4, m1); remote accessible
//   2 B  registered blocks (model 0), 3 tensors x 256 B, 8 blocks of 32 B; NOT remote accessible
//   3 C  pool-allocated contiguous, 2 tensors x 200 B, 2 slots (stride 100); keys: slot 0 req (5, m0),
//        slot 1 req (6, m2) + prefix (6, m2)
//   4 D  pool-allocated blocks (model 7), 1 tensor x 256 B, 4 blocks of 64 B
//   5 E  registered contiguous, 1 tensor x 100 B, 3 slots (stride 33), no keys; its tensor sits at a
//        fixed address (kRawTensorAddr, below) so that seeds can name it in raw-address transfers
// Registered tensors are heap buffers of exactly their size (AddressSanitizer guards their edges);
// pool tensors come from a MemPool. `regions` lists every tensor ever added, with its cache id.
#pragma once

#include <sys/mman.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <vector>

#include "backends/backend.h"
#include "engine/mem_pool.h"
#include "engine/registry.h"
#include "transport/wire.h"

namespace pdlink::fuzz {

// First input byte (mod kModeCount) selects what the rest is.
enum Mode : uint8_t {
  kModeHello = 0,       // Hello prefix, then (if long enough) the rest: identity + challenge
  kModeIdentity = 1,    // HostIdentity alone
  kModeHelloAck = 2,    // HelloAck fixed part
  kModeAuthResult = 3,  // AuthResult fixed part
  kModeRequest = 4,     // RequestHeader
  kModeResponse = 5,    // ResponseHeader
  kModeBody = 6,        // TransferBody, then Registry::resolve / commitRead / describe
  kModeDescriptor = 7,  // CacheDescriptor
  kModeStream = 8,      // a sequence of steps against one registry (see StepKind)
  kModeCount = 9,
};

// kModeStream: each step starts with a StepKind byte.
enum StepKind : uint8_t {
  kStepFrame = 0,       // RequestHeader (20 B) + body_len bytes of body, served as serveOne does
  kStepDeallocate = 1,  // u8 cache id, u8 expect_blocks
  kStepUnregister = 2,  // u8 cache id
  kStepRemoveKey = 3,   // u8 req_id, u8 prefix_id, u8 model_id (0xFF: "none" for the ids)
  kStepCount = 4,
};

// A fixed, otherwise unused address for cache E's tensor, so that seeds can name it in raw-address
// transfers (inside the application range of x86-64's AddressSanitizer layout). Where it cannot be
// mapped (a smaller address space), the tensor is an ordinary buffer and only the raw seed misses.
constexpr uint64_t kRawMapAddr = 0x200000000000ull;
constexpr uint64_t kRawTensorAddr = kRawMapAddr + 0x100;
constexpr uint64_t kRawTensorBytes = 100;

struct Region {
  uint64_t addr;
  uint64_t size;
  int64_t cache_id;
  bool remote_accessible;
};

inline uint8_t* rawTensor() {
  static uint8_t* p = [] {
    void* m = ::mmap(reinterpret_cast<void*>(kRawMapAddr), 4096, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (m == reinterpret_cast<void*>(kRawMapAddr)) return static_cast<uint8_t*>(m) + (kRawTensorAddr - kRawMapAddr);
    if (m != MAP_FAILED) ::munmap(m, 4096);  // kernels before 4.17 treat the address as a hint
    return new uint8_t[kRawTensorBytes]();
  }();
  return p;
}

class Fixture {
  // Destroyed after the registry (members go in reverse order): owned tensors return to the pool
  // when their entries die, and registered tensors must outlive every entry that names them.
  std::vector<std::unique_ptr<uint8_t[]>> buffers_;
  std::shared_ptr<MemPool> pool_;

 public:
  Fixture() {
    auto pool = MemPool::create(makeCpuBackend(), Placement::kDevice, 16 << 10, 10);
    if (!pool.ok()) fail("memory pool");
    pool_ = pool.value();

    RequestKey none;
    addRegistered({2, 256, 4, false}, {key(1, kInvalidId, 0), key(kInvalidId, 2, 0), none, key(3, 4, 1)},
                  std::nullopt, true);
    addRegistered({3, 256, 8, true}, {}, 0, false);
    addOwned({2, 200, 2, false}, {key(5, kInvalidId, 0), key(6, 6, 2)}, std::nullopt);
    addOwned({1, 256, 4, true}, {}, 7);
    addRegistered({1, kRawTensorBytes, 3, false}, {}, std::nullopt, true, rawTensor());
  }

  Registry registry;
  std::vector<Region> regions;

 private:
  static RequestKey key(uint64_t req, uint64_t prefix, uint64_t model) {
    RequestKey k;
    k.req_id = req;
    k.prefix_id = prefix;
    k.model_id = model;
    return k;
  }
  [[noreturn]] static void fail(const char* what) {
    std::fprintf(stderr, "fuzz fixture: cannot set up %s\n", what);
    std::abort();
  }
  static CacheLayout layout(uint32_t tensors, uint64_t bytes, uint64_t slots, bool blocks) {
    CacheLayout L;
    L.num_tensors = tensors;
    L.tensor_size = bytes;
    L.num_slots = slots;
    L.is_blocks = blocks;
    return L;
  }
  struct Shape {
    uint32_t tensors;
    uint64_t bytes;
    uint64_t slots;
    bool blocks;
  };

  void add(CacheEntry e, const std::vector<RequestKey>& keys) {
    bool remote = e.remote_accessible;
    auto r = registry.add(std::move(e), keys);
    if (!r.ok()) fail("a cache");
    for (uint64_t a : r.value()->addrs) regions.push_back({a, r.value()->layout.tensor_size, r.value()->id, remote});
  }

  void addRegistered(Shape s, const std::vector<RequestKey>& keys, std::optional<uint64_t> blocks_model,
                     bool remote, uint8_t* fixed = nullptr) {
    CacheEntry e;
    e.layout = layout(s.tensors, s.bytes, s.slots, s.blocks);
    for (uint32_t t = 0; t < s.tensors; ++t) {
      uint8_t* p = fixed;
      if (!p) {
        buffers_.emplace_back(new uint8_t[s.bytes]());
        p = buffers_.back().get();
      }
      e.addrs.push_back(reinterpret_cast<uint64_t>(p));
    }
    e.remote_accessible = remote;
    e.blocks_model = blocks_model;
    add(std::move(e), keys);
  }

  void addOwned(Shape s, const std::vector<RequestKey>& keys, std::optional<uint64_t> blocks_model) {
    CacheEntry e;
    e.layout = layout(s.tensors, s.bytes, s.slots, s.blocks);
    e.owned = true;
    e.pool = pool_;
    e.blocks_model = blocks_model;
    for (uint32_t t = 0; t < s.tensors; ++t) {
      auto a = pool_->allocate(s.bytes);
      if (!a.ok()) fail("a pool allocation");
      e.addrs.push_back(a.value());
    }
    add(std::move(e), keys);
  }
};

}  // namespace pdlink::fuzz
