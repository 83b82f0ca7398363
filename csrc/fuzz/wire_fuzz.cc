// libFuzzer target: the wire-protocol decoders (transport/wire.h) and what the serving side does
// with a decoded transfer (Registry::resolve, commitRead, describe), fed arbitrary bytes.
//
// Input: one selector byte (fuzz_fixture.h, Mode), then the bytes for that decoder. Checked beyond
// "no crash, no sanitizer report":
//  * a decoder that accepts its input accepted only values within the documented bounds, and
//    re-encoding them gives the same bytes (no field skipped or misread);
//  * an access that Registry::resolve accepts lies inside one tensor of a cache that the registry
//    still holds and that the result keeps alive; a write only inside a remote-accessible cache;
//    the payload size is what payloadBytes() says; every byte of the range can be touched;
//  * a rejected access is kKvCacheNotExist or kParamInvalid, never anything else;
//  * a describe() answer names live tensors of a blocks cache.
// A violation prints what was wrong and aborts, so libFuzzer keeps the input.
//
// Build: cmake -DPDLINK_BUILD_FUZZ=ON with clang (see .ci/fuzz.sh).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "fuzz/fuzz_fixture.h"

namespace pdlink::fuzz {
namespace {

#define FUZZ_CHECK(cond)                                                                   \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "wire_fuzz: invariant violated: %s (%s:%d)\n", #cond, __FILE__, \
                   __LINE__);                                                              \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)

bool prefixIs(const std::string& encoded, const uint8_t* p, size_t n) {
  return encoded.size() >= n && std::memcmp(encoded.data(), p, n) == 0;
}

void fuzzHello(const uint8_t* p, size_t n) {
  wire::Hello h;
  if (!wire::decodePrefix(p, n, &h).ok()) return;
  FUZZ_CHECK(n >= wire::kHelloPrefixBytes);
  FUZZ_CHECK(static_cast<uint8_t>(h.channel) <= 1);
  FUZZ_CHECK(prefixIs(wire::encode(h), p, wire::kHelloPrefixBytes));
  if (!wire::decodeRest(p + wire::kHelloPrefixBytes, n - wire::kHelloPrefixBytes, &h).ok()) {
    FUZZ_CHECK(n < wire::kHelloBytes);  // the rest is opaque bytes: only a short one is refused
    return;
  }
  std::string e = wire::encode(h);
  FUZZ_CHECK(e.size() == wire::kHelloBytes && prefixIs(e, p, wire::kHelloBytes));
  (void)h.identity.sameHost(h.identity);
}

void fuzzIdentity(const uint8_t* p, size_t n) {
  wire::Hello h;
  if (!wire::decodeIdentity(p, n, &h.identity).ok()) {
    FUZZ_CHECK(n < wire::kIdentityBytes);
    return;
  }
  std::string e = wire::encode(h);
  FUZZ_CHECK(e.size() >= wire::kHelloPrefixBytes + wire::kIdentityBytes);
  FUZZ_CHECK(std::memcmp(e.data() + wire::kHelloPrefixBytes, p, wire::kIdentityBytes) == 0);
}

void fuzzHelloAck(const uint8_t* p, size_t n) {
  wire::HelloAck a;
  uint32_t len = 0;
  if (!wire::decodeFixed(p, n, &a, &len).ok()) return;
  FUZZ_CHECK(n >= wire::kHelloAckFixedBytes && len <= wire::kMaxMessageBytes);
  a.message.assign(len, '\0');
  std::string e = wire::encode(a);
  FUZZ_CHECK(e.size() == wire::kHelloAckFixedBytes + len && prefixIs(e, p, wire::kHelloAckFixedBytes));
}

void fuzzAuthResult(const uint8_t* p, size_t n) {
  wire::AuthResult a;
  uint32_t len = 0;
  if (!wire::decodeFixed(p, n, &a, &len).ok()) return;
  FUZZ_CHECK(n >= wire::kAuthResultFixedBytes && len <= wire::kMaxMessageBytes && isKnownCode(a.status));
  a.message.assign(len, '\0');
  std::string e = wire::encode(a);
  FUZZ_CHECK(e.size() == wire::kAuthResultFixedBytes + len && prefixIs(e, p, wire::kAuthResultFixedBytes));
}

void fuzzRequest(const uint8_t* p, size_t n) {
  wire::RequestHeader h;
  if (!wire::decode(p, n, &h).ok()) return;
  const uint8_t op = static_cast<uint8_t>(h.op);
  FUZZ_CHECK(n >= wire::kRequestHeaderBytes);
  FUZZ_CHECK(op >= 1 && op <= wire::kMaxOp && !(h.flags & ~wire::kKnownFlags) &&
             (!(h.flags & wire::kFlagOneSided) || h.flags == (wire::kFlagDevice | wire::kFlagOneSided)) &&
             h.body_len <= wire::kMaxBodyBytes);
  uint8_t canonical[wire::kRequestHeaderBytes];
  std::memcpy(canonical, p, sizeof(canonical));
  canonical[6] = canonical[7] = 0;  // padding: ignored on decode, zero on encode
  std::string e = wire::encode(h);
  FUZZ_CHECK(e.size() == wire::kRequestHeaderBytes && prefixIs(e, canonical, sizeof(canonical)));
}

void fuzzResponse(const uint8_t* p, size_t n) {
  wire::ResponseHeader h;
  if (!wire::decode(p, n, &h).ok()) return;
  FUZZ_CHECK(n >= wire::kResponseHeaderBytes);
  FUZZ_CHECK(h.message_len <= wire::kMaxMessageBytes && isKnownCode(h.status));
  std::string e = wire::encode(h);
  FUZZ_CHECK(e.size() == wire::kResponseHeaderBytes && prefixIs(e, p, wire::kResponseHeaderBytes));
}

void fuzzDescriptor(const uint8_t* p, size_t n) {
  wire::CacheDescriptor d;
  if (!wire::decode(p, n, &d).ok()) return;
  std::string e = wire::encode(d);
  FUZZ_CHECK(e.size() == n && prefixIs(e, p, n));  // the decoder takes exactly its bytes
}

// What the serving side may do with an accepted access: the checks listed at the top.
void checkResolved(const Fixture& fx, const wire::TransferBody& b, const Resolved& r, bool for_write) {
  std::set<int64_t> kept;
  for (const auto& e : r.keep) {
    FUZZ_CHECK(e != nullptr);
    kept.insert(e->id);
  }
  FUZZ_CHECK(r.runs.size() == b.runs.size());
  if (b.target.kind == wire::TargetKind::kRaw) {
    FUZZ_CHECK(b.tensors.size() == 1 && r.tensors.size() == 1);
  } else {
    FUZZ_CHECK(r.tensors == b.tensors);
  }
  uint64_t per_tensor = 0;
  for (const wire::Run& run : r.runs) per_tensor += run.length;  // each run lies in a tensor: no overflow
  for (uint32_t t : r.tensors) {
    FUZZ_CHECK(t < r.addrs.size());
    for (const wire::Run& run : r.runs) {
      uint64_t start = 0, end = 0;
      FUZZ_CHECK(run.length > 0);
      FUZZ_CHECK(!__builtin_add_overflow(r.addrs[t], r.base, &start) &&
                 !__builtin_add_overflow(start, run.offset, &start) &&
                 !__builtin_add_overflow(start, run.length, &end));
      const Region* in = nullptr;
      for (const Region& g : fx.regions) {
        if (start >= g.addr && end <= g.addr + g.size && kept.count(g.cache_id)) {
          in = &g;
          break;
        }
      }
      if (!in) {
        std::fprintf(stderr,
                     "wire_fuzz: resolved %s [%#llx, +%llu) of tensor %u (%s, base %llu, offset %llu) lies "
                     "outside every cache the result keeps\n",
                     for_write ? "write" : "read", static_cast<unsigned long long>(start),
                     static_cast<unsigned long long>(run.length), t, b.target.describe().c_str(),
                     static_cast<unsigned long long>(r.base), static_cast<unsigned long long>(run.offset));
        std::abort();
      }
      FUZZ_CHECK(fx.registry.get(in->cache_id).ok());  // not a cache that was removed
      if (for_write) FUZZ_CHECK(in->remote_accessible);
      // Touch both ends (AddressSanitizer guards the heap-allocated tensors' edges).
      volatile uint8_t* q = reinterpret_cast<volatile uint8_t*>(start);
      uint8_t first = q[0], last = q[run.length - 1];
      if (for_write) {
        q[0] = first;
        q[run.length - 1] = last;
      }
    }
  }
  auto total = b.payloadBytes();
  FUZZ_CHECK(total.ok() && total.value() == per_tensor * r.tensors.size());
}

void checkRejected(const Status& st) {
  FUZZ_CHECK(!st.ok());
  FUZZ_CHECK(st.code() == Code::kKvCacheNotExist || st.code() == Code::kParamInvalid);
}

void checkDescribe(const Fixture& fx, uint64_t model_id) {
  auto d = fx.registry.describe(model_id);
  if (!d.ok()) {
    FUZZ_CHECK(d.status().code() == Code::kKvCacheNotExist);
    return;
  }
  const wire::CacheDescriptor& desc = d.value();
  FUZZ_CHECK(!desc.addrs.empty() && desc.stride > 0 && desc.stride <= desc.tensor_size);
  for (uint64_t a : desc.addrs) {
    const Region* in = nullptr;
    for (const Region& g : fx.regions) {
      if (g.addr == a && g.size == desc.tensor_size) in = &g;
    }
    FUZZ_CHECK(in != nullptr && fx.registry.get(in->cache_id).ok());
  }
}

// Resolve `b` as a read and as a write, describe a blocks target, commit it, and resolve again.
void exerciseBody(Fixture& fx, const wire::TransferBody& b) {
  for (bool for_write : {false, true}) {
    auto r = fx.registry.resolve(b, for_write);
    if (r.ok()) {
      checkResolved(fx, b, r.value(), for_write);
    } else {
      checkRejected(r.status());
    }
  }
  if (b.target.kind == wire::TargetKind::kBlocks) checkDescribe(fx, b.target.model_id);
  fx.registry.commitRead(b.target, b.tensors);
  auto again = fx.registry.resolve(b, false);
  if (again.ok()) {
    checkResolved(fx, b, again.value(), false);
  } else {
    checkRejected(again.status());
  }
}

void fuzzBody(const uint8_t* p, size_t n) {
  wire::TransferBody b;
  if (!wire::decode(p, n, &b).ok()) return;
  std::string e = wire::encode(b);
  FUZZ_CHECK(e.size() == n && prefixIs(e, p, n));
  const uint8_t kind = static_cast<uint8_t>(b.target.kind);
  FUZZ_CHECK(kind >= 1 && kind <= 5);
  Fixture fx;
  exerciseBody(fx, b);
}

// A sequence of request frames and local registry changes against one registry, each frame handled
// as Engine::serveOne handles it (a frame that would drop the link ends the sequence).
void fuzzStream(const uint8_t* p, size_t n) {
  Fixture fx;
  std::vector<std::shared_ptr<CacheEntry>> pinned;  // direct accesses stay pinned until the next frame
  size_t i = 0;
  auto id = [](uint8_t v) { return static_cast<int64_t>(v % 7); };  // 0 and 6 name no cache
  while (i < n) {
    const uint8_t step = p[i++] % kStepCount;
    if (step == kStepDeallocate) {
      if (n - i < 2) return;
      (void)fx.registry.deallocate(id(p[i]), p[i + 1] & 1);
      i += 2;
      continue;
    }
    if (step == kStepUnregister) {
      if (n - i < 1) return;
      (void)fx.registry.unregister(id(p[i]));
      i += 1;
      continue;
    }
    if (step == kStepRemoveKey) {
      if (n - i < 3) return;
      RequestKey k;
      k.req_id = p[i] == 0xFF ? kInvalidId : p[i];
      k.prefix_id = p[i + 1] == 0xFF ? kInvalidId : p[i + 1];
      k.model_id = p[i + 2];
      fx.registry.removeKey(k);
      i += 3;
      continue;
    }
    // kStepFrame
    if (n - i < wire::kRequestHeaderBytes) return;
    wire::RequestHeader h;
    if (!wire::decode(p + i, wire::kRequestHeaderBytes, &h).ok()) return;
    i += wire::kRequestHeaderBytes;
    if (n - i < h.body_len) return;
    const uint8_t* body = p + i;
    i += h.body_len;
    pinned.clear();
    if (h.op == wire::Op::kPing || h.op == wire::Op::kUnlink || h.op == wire::Op::kDeviceChannel) continue;
    wire::TransferBody b;
    if (!wire::decode(body, h.body_len, &b).ok()) return;
    if (h.op == wire::Op::kCommit) {
      fx.registry.commitRead(b.target, b.tensors);
      continue;
    }
    if (h.op == wire::Op::kRelease) continue;
    if (h.op == wire::Op::kDescribe) {
      if (b.target.kind == wire::TargetKind::kBlocks) checkDescribe(fx, b.target.model_id);
      continue;
    }
    const bool is_write = h.op == wire::Op::kWrite;
    const bool in_stream = is_write && h.flags == 0;  // kFlagDirect/kFlagDevice: bytes move elsewhere
    auto payload = b.payloadBytes();
    if (!payload.ok() || h.payload_len != (in_stream ? payload.value() : 0)) return;
    auto r = fx.registry.resolve(b, is_write);
    if (!r.ok()) {
      checkRejected(r.status());
      continue;
    }
    checkResolved(fx, b, r.value(), is_write);
    if (h.flags & wire::kFlagDirect) pinned = r.value().keep;
  }
}

}  // namespace
}  // namespace pdlink::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pdlink::fuzz;
  if (size == 0) return 0;
  const uint8_t* p = data + 1;
  const size_t n = size - 1;
  switch (data[0] % kModeCount) {
    case kModeHello: fuzzHello(p, n); break;
    case kModeIdentity: fuzzIdentity(p, n); break;
    case kModeHelloAck: fuzzHelloAck(p, n); break;
    case kModeAuthResult: fuzzAuthResult(p, n); break;
    case kModeRequest: fuzzRequest(p, n); break;
    case kModeResponse: fuzzResponse(p, n); break;
    case kModeBody: fuzzBody(p, n); break;
    case kModeDescriptor: fuzzDescriptor(p, n); break;
    case kModeStream: fuzzStream(p, n); break;
  }
  return 0;
}
