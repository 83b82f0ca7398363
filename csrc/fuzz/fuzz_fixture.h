// The fuzz target's world: the input layout (a selector byte, then the bytes for one mode) and a
// small set of caches in real memory, in a bare Registry (Fixture) or in a real Engine
// (EngineFixture), shared by the fuzz target (wire_fuzz.cc) and the seed generator (make_seeds.cc)
// so that seeds address caches that exist.
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
// Registered tensors are heap buffers of exactly their size (AddressSanitizer guards their edges),
// filled with kTensorFill; pool tensors come from a pool. `regions` lists every tensor ever added,
// with its cache id.
#pragma once

#include <sys/mman.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "backends/backend.h"
#include "engine/engine.h"
#include "engine/mem_pool.h"
#include "engine/registry.h"
#include "transport/wire.h"

namespace pdlink::fuzz {

// First input byte (mod kModeCount) selects what the rest is.
enum Mode : uint8_t {
  kModeHello = 0,         // Hello prefix, then (if long enough) the challenge
  kModeClientAuth = 1,    // ClientAuth
  kModeHelloAck = 2,      // HelloAck fixed part
  kModeAuthResult = 3,    // AuthResult fixed part
  kModeRequest = 4,       // RequestHeader
  kModeResponse = 5,      // ResponseHeader
  kModeBody = 6,          // TransferBody, then Registry::resolve / commitRead / describe
  kModeDescriptor = 7,    // CacheDescriptor (a requester reads it)
  kModeServe = 8,         // the real serving loop (Engine::serveStream) over a sequence of steps
  kModeDirectAnswer = 9,  // u16 expected pieces, then a DirectAnswer (a requester reads it)
  kModeAddresses = 10,    // u16 expected count, then an address list (a requester reads it)
  kModeIpcAnswer = 11,    // u8 tensors, u8 runs, runs (2 x u16), then an IpcAnswer: the requester's check
  kModeNotify = 12,       // NotifyBody (the serving side reads it)
  kModeRawTable = 13,     // RawTable (a kDescribe answer of a kRaw target)
  kModeUcxAddress = 14,   // u8 UCX release selector, then a UCX worker address (ucx::checkWorkerAddress)
  kModeCount = 15,
};

// kModeServe: the first byte's bit 0 says whether the link is same-host (proven); then steps, each
// starting with a StepKind byte. Consecutive frames form one stream handed to serveStream; a
// registry step between them runs between two such streams (the serving state, pins included,
// carries over).
enum StepKind : uint8_t {
  kStepFrame = 0,       // RequestHeader (24 B) + body_len bytes of body (+ an in-stream write's payload)
  kStepDeallocate = 1,  // u8 cache id, u8 expect_blocks
  kStepUnregister = 2,  // u8 cache id
  kStepRemoveKey = 3,   // u8 req_id, u8 prefix_id, u8 model_id (0xFF: "none" for the ids)
  kStepCount = 4,
};

// The bytes every registered test tensor is filled with: no 8-byte window of them looks like an
// address, so an address in the serving loop's output can only be one it disclosed.
constexpr uint8_t kTensorFill = 0x11;

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

inline RequestKey fixtureKey(uint64_t req, uint64_t prefix, uint64_t model) {
  RequestKey k;
  k.req_id = req;
  k.prefix_id = prefix;
  k.model_id = model;
  return k;
}

// The five caches above, in registration order.
struct CacheSpec {
  uint32_t tensors;
  uint64_t bytes;
  uint64_t slots;
  bool blocks;
  std::vector<RequestKey> keys;
  std::optional<uint64_t> model;
  bool remote_accessible;
  bool owned;  // pool-allocated
  bool raw;    // cache E: its tensor at kRawTensorAddr
  CacheLayout layout() const {
    CacheLayout L;
    L.num_tensors = tensors;
    L.tensor_size = bytes;
    L.num_slots = slots;
    L.is_blocks = blocks;
    return L;
  }
};

inline std::vector<CacheSpec> cacheSpecs() {
  const RequestKey none;
  return {
      {2,
       256,
       4,
       false,
       {fixtureKey(1, kInvalidId, 0), fixtureKey(kInvalidId, 2, 0), none, fixtureKey(3, 4, 1)},
       std::nullopt,
       true,
       false,
       false},
      {3, 256, 8, true, {}, 0, false, false, false},
      {2, 200, 2, false, {fixtureKey(5, kInvalidId, 0), fixtureKey(6, 6, 2)}, std::nullopt, true, true, false},
      {1, 256, 4, true, {}, 7, true, true, false},
      {1, kRawTensorBytes, 3, false, {}, std::nullopt, true, false, true},
  };
}

[[noreturn]] inline void fixtureFailed(const char* what) {
  std::fprintf(stderr, "fuzz fixture: cannot set up %s\n", what);
  std::abort();
}

// Registered tensors: heap buffers of exactly their size, filled with kTensorFill (cache E's sits
// at its fixed address).
class TensorBuffers {
 public:
  std::vector<uint64_t> make(const CacheSpec& c) {
    std::vector<uint64_t> addrs;
    for (uint32_t t = 0; t < c.tensors; ++t) {
      uint8_t* p = c.raw ? rawTensor() : nullptr;
      if (!p) {
        buffers_.emplace_back(new uint8_t[c.bytes]);
        p = buffers_.back().get();
      }
      std::memset(p, kTensorFill, c.bytes);
      addrs.push_back(reinterpret_cast<uint64_t>(p));
    }
    return addrs;
  }

 private:
  std::vector<std::unique_ptr<uint8_t[]>> buffers_;
};

inline void noteRegions(const std::shared_ptr<CacheEntry>& e, std::vector<Region>* regions) {
  for (uint64_t a : e->addrs) regions->push_back({a, e->layout.tensor_size, e->id, e->remote_accessible});
}

// The caches in a bare Registry, for the decoder and access-check modes.
class Fixture {
  // Destroyed after the registry (members go in reverse order): owned tensors return to the pool
  // when their entries die, and registered tensors must outlive every entry that names them.
  TensorBuffers buffers_;
  std::shared_ptr<MemPool> pool_;

 public:
  Fixture() {
    auto pool = MemPool::create(makeCpuBackend(), Placement::kDevice, 16 << 10, 10);
    if (!pool.ok()) fixtureFailed("memory pool");
    pool_ = pool.value();
    for (const CacheSpec& c : cacheSpecs()) {
      CacheEntry e;
      e.layout = c.layout();
      e.remote_accessible = c.remote_accessible;
      e.blocks_model = c.model;
      if (c.owned) {
        e.owned = true;
        e.pool = pool_;
        for (uint32_t t = 0; t < c.tensors; ++t) {
          auto a = pool_->allocate(c.bytes);
          if (!a.ok()) fixtureFailed("a pool allocation");
          e.addrs.push_back(a.value());
        }
      } else {
        e.addrs = buffers_.make(c);
      }
      auto r = registry.add(std::move(e), c.keys);
      if (!r.ok()) fixtureFailed("a cache");
      noteRegions(r.value(), &regions);
    }
  }

  Registry registry;
  std::vector<Region> regions;
};

// The same caches in a real Engine (CPU backend, transport tcp, no listener), for the serving loop.
class EngineFixture {
  TensorBuffers buffers_;  // outlives the engine (declared first)

 public:
  EngineFixture() : engine(makeCpuBackend()) {
    EngineConfig config;
    config.cluster_id = 1;
    config.transport = Transport::kTcp;
    config.device_pool = {16 << 10, 10};
    if (!engine.initialize(config).ok()) fixtureFailed("the engine");
    for (const CacheSpec& c : cacheSpecs()) {
      auto r = c.owned ? engine.allocateCache(c.layout(), c.keys, c.model)
                       : engine.registerCache(c.layout(), buffers_.make(c), c.keys, c.model, c.remote_accessible);
      if (!r.ok()) fixtureFailed("a cache");
      noteRegions(r.value(), &regions);
    }
  }

  Engine engine;
  std::vector<Region> regions;
};

}  // namespace pdlink::fuzz
